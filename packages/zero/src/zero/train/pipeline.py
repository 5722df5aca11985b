"""``zero train --pipeline-parallel N``: the main job's Llama cut into N pipeline stages by zero_parallel's
Hugging Face split (embedding, decoder layers, norm, head; ``decoder_layers``), trained with the pipeline engine's
``train_batch`` (1F1B), the ranks laid out as N stages x (ranks / N) data-parallel replicas.

Each data-parallel replica draws the windows a run without pipeline parallelism draws on the rank of the same
data-parallel index, so the loss and the updates equal that run's (the batch counts the replicas). A step's
whole ``train_batch`` is timed as its ``step`` phase (the stages' forwards and backwards interleave). Without a
``--config``, ZeRO stage 1 is used (ZeRO-3 does not compose with pipeline stages).
"""

from __future__ import annotations

import torch

from zero_parallel.pipe import PipelineModule, causal_lm_loss, decoder_layers

PIPELINE_STAGE = 1
"""The default config's ZeRO stage under ``--pipeline-parallel`` > 1."""


def check(pp: int, nproc: int, layers: int, stage: int | None) -> str | None:
    """Why ``--pipeline-parallel pp`` cannot run on ``nproc`` ranks for a model of ``layers`` decoder layers with
    ZeRO ``stage`` (None: it can)."""
    if pp < 1:
        return f"--pipeline-parallel must be >= 1, got {pp}"
    if pp == 1:
        return None
    if nproc % pp:
        return f"--pipeline-parallel {pp} must divide the ranks (--nproc-per-node {nproc})"
    if pp > layers + 3:
        return (f"--pipeline-parallel {pp} is more stages than the model's {layers + 3} layers (embedding, "
                f"{layers} decoder layers, norm, head)")  # fmt: skip
    if stage is not None and stage >= 3:
        return (f"--pipeline-parallel {pp} with zero_optimization.stage {stage} in --config: ZeRO-3 does not "
                "compose with pipeline stages; use stage 0, 1 or 2")  # fmt: skip
    return None


def split(model: torch.nn.Module, pp: int) -> PipelineModule:
    """This rank's stage of ``model`` (a transformers causal LM) over ``pp`` stages, cut by parameter counts."""
    return PipelineModule(decoder_layers(model), num_stages=pp, loss_fn=causal_lm_loss)


def train_step(engine, windows: list[torch.Tensor]) -> float:
    """One optimizer step on the ``windows`` micro-batches (``[micro, seq]`` int64 each, labels = inputs);
    returns the loss averaged over the micro-batches and replicas."""
    return float(engine.train_batch(iter([(x, x) for x in windows])))


@torch.no_grad()
def evaluate(engine, val: torch.Tensor, micro: int) -> float:
    """Mean next-token loss over the validation windows (``[n, seq]``): each data-parallel replica runs its share
    in micro-batches of ``micro`` windows (the same count on every replica; a remainder left out)."""
    dp, index = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_id()
    count = len(val) // (dp * micro)
    if count == 0:
        raise ValueError(f"evaluate: {len(val)} validation windows are fewer than the {dp} replicas x {micro} "
                         "windows per micro-batch; raise --val-windows")  # fmt: skip
    mine = val[index::dp]
    batches = [(mine[i * micro : (i + 1) * micro],) * 2 for i in range(count)]
    return float(engine.eval_batch(iter(batches), num_micro_batches=count))
