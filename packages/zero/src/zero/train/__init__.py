"""The main job: pretrain a transformers Llama model on byte-level text with ZeRO (``zero train``)."""
