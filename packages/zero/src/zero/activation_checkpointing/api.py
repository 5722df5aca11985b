"""Activation checkpointing with DeepSpeed's ``deepspeed.checkpointing`` interface (served there by the façade).

``configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None)`` and ``checkpoint(function, *args)``
as Megatron-DeepSpeed calls them; the config's `activation_checkpointing` section gives the same options
(``partition_activations``, ``contiguous_memory_optimization``, ``number_checkpoints``, ``cpu_checkpointing``,
``synchronize_checkpoint_boundary``, ``profile``), explicit arguments win.

With none of the storage options on, ``checkpoint`` is ``torch.utils.checkpoint`` (non-reentrant), which works with
ZeRO-3's gather hooks. With ``partition_activations``, ``cpu_checkpointing`` or ``contiguous_memory_optimization``
the segment's inputs are stored as :mod:`zero.activation_checkpointing.store` says and the segment runs through
:class:`CheckpointFunction` (recomputed in backward from the rebuilt inputs, with the RNG state restored so dropout
repeats, and under the forward's autocast state). Results equal plain recomputation bit for bit in fp32.
``synchronize`` synchronizes the accelerator at the start and end of each forward and recompute (a no-op on CPU);
``profile`` records the seconds of each forward and recompute (``timings()``).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.utils.checkpoint

from zero.activation_checkpointing.store import Settings, restore, store

settings = Settings()


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None,
              group=None) -> None:  # fmt: skip
    """Set the options (DeepSpeed's signature; ``group`` is zero's: the group to partition over without an mpu).

    Args:
        mpu_: an object with ``get_tensor_model_parallel_group()`` or ``get_model_parallel_group()`` (Megatron's
            mpu): activations are replicated over that group, so each rank can keep a slice.
        deepspeed_config: a config dict or JSON path; its `activation_checkpointing` section is read first.

    Raises:
        ConfigError: a bad `activation_checkpointing` key or value in ``deepspeed_config``.
        ValueError: contiguous checkpointing without partitioning or without ``num_checkpoints`` (as DeepSpeed).
    """
    global settings
    new = Settings(configured=True)
    if deepspeed_config is not None:
        from zero.config.model import ActivationCheckpointingSection, _read

        section = _read(deepspeed_config).get("activation_checkpointing", {})
        sec = _validated(ActivationCheckpointingSection, section)
        for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                    "number_checkpoints", "synchronize_checkpoint_boundary", "profile"):  # fmt: skip
            setattr(new, key, getattr(sec, key))
    explicit = {"partition_activations": partition_activations,
                "contiguous_memory_optimization": contiguous_checkpointing, "number_checkpoints": num_checkpoints,
                "cpu_checkpointing": checkpoint_in_cpu,
                "synchronize_checkpoint_boundary": synchronize, "profile": profile}  # fmt: skip
    for key, value in explicit.items():
        if value is not None:
            setattr(new, key, value)
    if new.contiguous_memory_optimization and not new.partition_activations:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs partition_activations true "
                         "(as DeepSpeed)")  # fmt: skip
    if new.contiguous_memory_optimization and not new.number_checkpoints:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints (the "
                         "checkpoints stored per forward: the buffer's slots)")  # fmt: skip
    if mpu_ is not None:
        get = getattr(mpu_, "get_tensor_model_parallel_group", None) or mpu_.get_model_parallel_group
        group = get()
    new.group = group
    settings = new


def _validated(model, section: dict):
    import pydantic

    from zero.config.errors import ConfigError, format_validation_error

    try:
        return model.model_validate(section)
    except pydantic.ValidationError as e:
        raise ConfigError(format_validation_error(e, model, "activation_checkpointing")) from None


def is_configured() -> bool:
    """True once :func:`configure` ran (DeepSpeed's query)."""
    return settings.configured


def reset() -> None:
    """Drop the contiguous buffers and the count of stored checkpoints (DeepSpeed: call after forwards without
    backward, e.g. evaluation)."""
    settings.buffers.clear()
    settings.live = settings.next_slot = 0


def timings() -> list[tuple[str, float]]:
    """``(phase, seconds)`` of every forward and recompute since configure, when ``profile`` is on."""
    return list(settings.timings)


def _sync(t: torch.Tensor | None) -> None:
    if settings.synchronize_checkpoint_boundary and t is not None and t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


class CheckpointFunction(torch.autograd.Function):
    """Forward without keeping activations; backward rebuilds the stored inputs, recomputes, back-propagates.

    ``args``: ``(settings, function, anchor, *inputs)``; ``anchor`` is an empty tensor that requires grad, so the
    recompute runs (and parameters get gradients) even when no input requires grad.
    """

    @staticmethod
    def forward(ctx, s: Settings, function, anchor, *inputs):
        ctx.s, ctx.function = s, function
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        # the recompute runs in backward, outside the caller's autocast: re-enter it there
        ctx.autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if s.contiguous_memory_optimization:
            if s.live == 0:
                s.next_slot = 0
            if s.next_slot >= s.number_checkpoints:
                raise ValueError(f"activation_checkpointing.number_checkpoints is {s.number_checkpoints} but this "
                                 "forward stores more checkpoints; raise it")  # fmt: skip
        slot = s.next_slot
        s.next_slot += 1
        s.live += 1
        ctx.kept = [
            store(s, i, x, slot) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for i, x in enumerate(inputs)
        ]
        with torch.no_grad():
            out = function(*inputs)
        return out

    @staticmethod
    def backward(ctx, *grads):
        s = ctx.s
        inputs = []
        for k in ctx.kept:
            if hasattr(k, "piece"):
                x = restore(s, k).requires_grad_(k.requires_grad)
            else:
                x = k.detach().requires_grad_(k.requires_grad) if isinstance(k, torch.Tensor) else k
            inputs.append(x)
        ctx.kept = None
        s.live -= 1
        start = time.perf_counter()
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if ctx.cuda_rng else []):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state_all(ctx.cuda_rng)
            with torch.enable_grad(), contextlib.ExitStack() as stack:
                for device, dtype in ctx.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
                out = ctx.function(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if s.profile:
            s.timings.append(("recompute", time.perf_counter() - start))
        grads_in = tuple(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs)
        return (None, None, None) + grads_in


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Mirrors ``deepspeed.checkpointing.checkpoint(function, *args)``; returns what ``function`` returns (a tensor
    or a tuple of tensors with the storage options). Keyword arguments go to ``function``.
    """
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    _sync(first)
    start = time.perf_counter()
    if settings.custom_storage:
        fn = function if not kwargs else (lambda *a: function(*a, **kwargs))
        anchor = torch.empty(0, requires_grad=True)
        out = CheckpointFunction.apply(settings, fn, anchor, *args)
    else:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    _sync(first)
    if settings.profile:
        settings.timings.append(("forward", time.perf_counter() - start))
    return out
