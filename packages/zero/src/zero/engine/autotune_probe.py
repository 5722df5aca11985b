"""The engine's side of ``zero autotune``: measure an experiment from inside the user's training script.

An experiment's config carries ``autotuning.metric_path`` (a timed run) or ``autotuning.model_info.profile`` with
``model_info_path`` (the one-step model profile). The engine then, as DeepSpeed's engine does for its autotuner:

* timed run: reads the engine's own timers (``wall_clock_breakdown``: forward + backward + step seconds of each
  optimizer step) for steps ``start_profile_step``..``end_profile_step``, writes ``{latency`` (the median step's
  seconds), ``throughput`` (samples per second), ``FLOPS_per_gpu, ...}`` as JSON on rank 0 and exits the process
  (``SystemExit(0)``) after the last profiled step;
* model profile: counts the bytes autograd saves for backward during the first training forward (activations,
  parameters excluded), then after that step writes ``{num_params, activation_bytes_per_sample, ...}`` and exits.

Memory figures are the maximum over ranks: ``model_state_bytes`` (zero_core's accounting) and ``peak_bytes``
(``torch.cuda.max_memory_allocated`` on CUDA, peak RSS from ``getrusage`` on CPU).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys

import torch
import torch.distributed as dist


class AutotuneProbe:
    """Created by the engine when the config asks for a measurement; ``after_boundary`` is called after each
    optimizer step (after the observer has closed the step's timers)."""

    def __init__(self, engine):
        at = engine.config.autotuning
        self.cfg = at
        self.profile_model = bool(at.model_info is not None and at.model_info.profile)
        self.latency_s: list[float] = []
        self.flops: int | None = None
        self.activation_bytes = 0
        self._samples = 0
        self._hooks = []
        self._ctx = None
        if self.profile_model:
            module = engine.module
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
            self._hooks.append(module.register_forward_pre_hook(self._enter_forward, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._leave_forward, always_call=True))

    @staticmethod
    def maybe(engine) -> AutotuneProbe | None:
        """A probe when ``autotuning.metric_path`` or ``autotuning.model_info.profile`` is set, else None."""
        at = engine.config.autotuning
        if at.metric_path or (at.model_info is not None and at.model_info.profile):
            return AutotuneProbe(engine)
        return None

    # --- activation bytes (model profile) -------------------------------------------------------------------------
    def _enter_forward(self, module, args, kwargs):
        if self._ctx is not None or not torch.is_grad_enabled() or self._samples:
            return
        seen: set[int] = set()

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen and key not in self._param_ptrs:
                seen.add(key)
                self.activation_bytes += storage.nbytes()
            return t

        self._samples = _batch_samples(args, kwargs)
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()

    def _leave_forward(self, module, args, kwargs_or_output, output=None):
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
            for h in self._hooks:
                h.remove()

    # --- the accumulation boundary ---------------------------------------------------------------------------------
    def after_boundary(self, engine) -> None:
        """Record step ``engine.global_steps``; after the last profiled step write the JSON and exit."""
        step = engine.global_steps
        if self.profile_model:
            self._finish(engine, self._model_info(engine), self.cfg.model_info_path or "autotuning_model_info.json")
        if step < self.cfg.start_profile_step:
            return
        obs = engine.observer
        seconds = obs.last_seconds if obs is not None else {}
        self.latency_s.append(sum(seconds.get(k, 0.0) for k in ("forward", "backward", "step")))
        if obs is not None and obs.last_profile is not None and self.flops is None:
            self.flops = int(obs.last_profile.total_flops)
        if step >= self.cfg.end_profile_step:
            self._finish(engine, self._metrics(engine), self.cfg.metric_path)

    def _metrics(self, engine) -> dict:
        # The median step, not DeepSpeed's mean: one step slowed by another process must not decide the ranking.
        latency = statistics.median(self.latency_s)
        out = {"latency": latency, "throughput": engine.train_batch_size() / latency if latency > 0 else 0.0,
               "steps": len(self.latency_s), "step_latencies": self.latency_s}  # fmt: skip
        if self.flops is not None:  # the profiled step's forward + backward FLOPs, this rank's micro-batches
            out["FLOPS_per_gpu"] = self.flops / latency if latency > 0 else 0.0
        return out

    def _model_info(self, engine) -> dict:
        from zero.engine.observe import full_numel_fn

        numel = full_numel_fn(engine.runtime)
        params = list(engine.module.parameters())
        return {"num_params": sum(numel(p) for p in params),
                "param_numels": [numel(p) for p in params],
                "activation_bytes": self.activation_bytes, "profiled_samples": self._samples,
                "activation_bytes_per_sample": self.activation_bytes / max(1, self._samples)}  # fmt: skip

    def _finish(self, engine, info: dict, path: str) -> None:
        state = engine.runtime.model_state_bytes()
        numbers = torch.tensor([float(state.get("total", 0)), float(_peak_bytes()), float(state.get("optimizer", 0))],
                               dtype=torch.float64)  # fmt: skip
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
        info.update(model_state_bytes=int(numbers[0]), peak_bytes=int(numbers[1]), optimizer_bytes=int(numbers[2]),
                    world_size=engine.world_size, micro_batch=engine.train_micro_batch_size_per_gpu(),
                    gradient_accumulation_steps=engine.gradient_accumulation_steps())  # fmt: skip
        if engine.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(info, f, indent=2)
            os.replace(tmp, path)
            print(f"zero autotune: wrote {path}", flush=True)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        sys.stdout.flush()
        raise SystemExit(0)


def _batch_samples(args, kwargs) -> int:
    """Samples in one forward: the first dimension of ``input_ids`` or of the first tensor argument."""
    t = kwargs.get("input_ids")
    if t is None:
        t = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() > 0 else 1


def _peak_bytes() -> int:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
