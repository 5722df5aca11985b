"""Checkpointed hidden states offloaded to host memory (``deepspeed.runtime.activation_checkpointing.
offload_activations``): transformers' tiny Llama with non-reentrant gradient checkpointing, one forward and backward
inside ``CheckpointHiddenStatesOffload``, gives the loss and every gradient of the run without offload exactly; on a
CPU-only machine every marked layer input already lives in host memory, so each is left where it is and counted as
skipped (DeepSpeed skips tensors that are not on an accelerator) instead of being copied to another host buffer;
the rest of the saved tensors are left alone; the marker on ``GradientCheckpointingLayer`` is removed on exit."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from zero.activation_checkpointing.offload import (
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)

LAYERS = 3


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _step(model, offload=None):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    if offload is None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    else:
        with offload:
            loss = model(input_ids=ids, labels=ids).loss
            assert len(offload._host) == 0  # the inputs already live on the CPU: nothing copied
            loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_checkpoint_inputs_already_on_the_cpu_are_skipped_and_gradients_are_unchanged():
    plain_call = GradientCheckpointingLayer.__call__
    want_loss, want = _step(_model())
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0, keep_last_count=1)
    loss, got = _step(_model(), offload)
    assert torch.equal(loss, want_loss)
    for name, g in got.items():
        assert torch.equal(g, want[name]), name
    s = offload.stats
    assert s.marked_tensors == s.skipped_marked_tensors == LAYERS
    assert s.offloaded_tensors == s.restored_tensors == 0
    assert s.kept_last_tensors == 0 and s.offloaded_bytes == s.restored_bytes == 0
    assert s.saved_tensors_seen > LAYERS  # other saved tensors (the norm, the head, the loss) went through untouched
    assert GradientCheckpointingLayer.__call__ is plain_call  # the marker is gone


def test_bad_arguments_and_reentry_are_refused():
    with pytest.raises(ValueError, match="keep_last_count must be >= 0, got -1"):
        CheckpointHiddenStatesOffload(keep_last_count=-1)
    offload = CheckpointHiddenStatesOffload()
    with offload, pytest.raises(RuntimeError, match="not re-entrant"):
        offload.__enter__()
