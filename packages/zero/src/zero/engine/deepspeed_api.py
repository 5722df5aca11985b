"""Engine methods DeepSpeed scripts and integrations call (DeepSpeed 0.19.8 ``DeepSpeedEngine``), as a mixin.

Accelerate and transformers' Trainer call ``no_sync``, ``set_gradient_accumulation_boundary``,
``zero_gather_16bit_weights_on_model_save``/``_zero3_consolidated_16bit_state_dict`` (``save_model``),
``destroy`` and ``compile`` on the engine; user scripts read ``local_rank``, ``device`` and the config queries.
"""

from __future__ import annotations

import contextlib
import os

import torch

from zero.config import NotSupportedError
from zero.engine.compiled import compile_module


class DeepSpeedEngineMixin:
    """DeepSpeed engine methods over the Engine's ``runtime`` and ``config`` (see the module docstring)."""

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's LOCAL_RANK; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        """The device the model's parameters live on."""
        return self.runtime.device

    @property
    def is_compiled(self) -> bool:
        """True after :meth:`compile`."""
        return self._compiled

    # --- nn.Module views: DeepSpeed's engine is an nn.Module, and the Trainer and Accelerate call these on it
    def parameters(self, recurse: bool = True):
        """The module's parameters (at stage 3 they hold shards outside forward/backward)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The module's ``(name, parameter)`` pairs."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        """The module's buffers."""
        return self.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The module's ``(name, buffer)`` pairs."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def modules(self):
        """The module and its submodules."""
        return self.module.modules()

    def named_modules(self, *args, **kwargs):
        """The module's ``(name, submodule)`` pairs."""
        return self.module.named_modules(*args, **kwargs)

    def children(self):
        """The engine's one child, the module (DeepSpeed's engine registers it as a submodule)."""
        return iter([self.module])

    @property
    def _modules(self) -> dict:
        """``{"module": module}``: the submodule table of DeepSpeed's engine (Accelerate walks it)."""
        return {"module": self.module}

    # --- config queries ---------------------------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3)."""
        return int(self.config.zero_optimization.stage)

    def zero_optimization(self) -> bool:
        """True at stages 1-3."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """True at stages 2 and 3 (gradients are partitioned)."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """True at stage 3 (parameters are partitioned), as DeepSpeed's method of this name."""
        return self.zero_optimization_stage() >= 3

    def bfloat16_enabled(self) -> bool:
        """Parameters are stored/communicated in bf16."""
        return self.runtime.precision.param_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        """Parameters are stored/communicated in fp16."""
        return self.runtime.precision.param_dtype == torch.float16

    def gradient_clipping(self) -> float:
        """Max global gradient norm (0: off)."""
        return float(self.runtime.gradient_clipping)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (default False, as DeepSpeed): whether
        ``save_16bit_model`` gathers the full weights at stage 3. Accelerate's ``get_state_dict`` reads it and,
        when False, raises the ValueError on which HF Trainer's ``save_model`` saves a checkpoint instead."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's ``engine.empty_partition_cache()``: at stage 3 release every gathered parameter (kept for
        reuse, prefetched or in flight) and forget the prefetch state, so the next forward gathers and records
        again; a no-op at stages 0-2. Call it on every rank at the same point, between steps."""
        self.runtime.empty_partition_cache()

    # --- gradient accumulation ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no reduction) for the backward calls inside, at stages 0 and 1.

        The boundary is held False inside (so ``step()`` does not step there) and restored on exit; the next
        backward at a boundary reduces everything accumulated. Mirrors DeepSpeed, which refuses it when
        gradients are partitioned.

        Raises:
            AssertionError: at stages 2 and 3 (DeepSpeed's error type and refusal); nested in another ``no_sync``
                or ``coalesce_grad_reduction``. ``step()`` inside raises AssertionError too (DeepSpeed's).
        """
        if self.zero_optimization_partition_gradients():
            raise AssertionError(
                f"no_sync context manager is incompatible with gradient partitioning logic of "
                f"ZeRO stage {self.zero_optimization_stage()}"
            )
        if self.inside_no_sync_ctxt:
            raise AssertionError("no_sync context manager reentry is unsupported")
        previous = self._boundary_override
        self._boundary_override = False
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self._boundary_override = previous
            self.inside_no_sync_ctxt = False

    # --- saving -----------------------------------------------------------------------------------------------
    def _expert_parallel_parts(self):
        """The expert-parallel checkpoints object when experts are spread over ranks (``ep_size`` > 1), else None."""
        from zero.engine.expert_checkpoints import ExpertParallelCheckpoints

        parts = self.checkpoints
        return parts if isinstance(parts, ExpertParallelCheckpoints) and parts.ep_size > 1 else None

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The full state dict (every ``state_dict()`` key) in the parameter dtype on rank 0, ``{}`` elsewhere.
        Collective. Mirrors DeepSpeed's method of this name (Accelerate's ``get_state_dict`` calls it). With experts
        spread over ranks, every rank's experts under the names of the model at ``ep_size`` 1 (as
        ``save_16bit_model``)."""
        from zero_core.checkpoint import full_state_dict

        dtype = self.runtime.precision.param_dtype
        experts = self._expert_parallel_parts()
        state = full_state_dict(self.runtime, dtype) if experts is None else experts.dense_state(dtype)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The single-process state dict in the parameter dtype on global rank 0, ``{}`` elsewhere, for a model
        whose weights are split: at stage 3 :meth:`_zero3_consolidated_16bit_state_dict`; under AutoTP every split
        tensor all-gathered over its tensor-parallel group at full shape. Collective. Mirrors DeepSpeed's method of
        this name (Accelerate's ``get_state_dict`` calls it with ``tensor_parallel.autotp_size`` > 1). With experts
        spread over ranks (AutoEP, folded on AutoTP or not) the model at ``ep_size`` 1, as ``save_16bit_model``.

        Raises:
            ValueError: neither stage 3 nor tensor parallelism (DeepSpeed's error: nothing to consolidate).
        """
        from zero.engine.tensor_parallel import gather_full_state
        from zero_core.checkpoint import full_state_dict
        from zero_parallel import layout_of

        if self.zero_optimization_partition_weights() or self._expert_parallel_parts() is not None:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        split = layout_of(self.module)
        if split is None:
            raise ValueError("_consolidated_16bit_state_dict applies where weights are split (ZeRO stage 3 or "
                             "tensor_parallel.autotp_size > 1); use module.state_dict()")  # fmt: skip
        dtype = getattr(self.runtime.precision, "param_dtype", None)
        state = gather_full_state(full_state_dict(self.runtime, dtype, rank0_only=False), split)
        if torch.distributed.get_rank() != 0:
            return {}
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    # --- parallel ranks ---------------------------------------------------------------------------------------
    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size`` as configured (0 or 1: no tensor parallelism)."""
        return self.config.tensor_parallel.autotp_size

    def get_data_parallel_rank(self) -> int:
        """This rank's index among the ranks ZeRO partitions over (``deepspeed.utils.groups``' answer)."""
        from zero import parallel_groups as groups

        return groups.get_data_parallel_rank()

    def get_tensor_parallel_rank(self) -> int:
        """This rank's index in its tensor-parallel group; 0 without tensor parallelism."""
        from zero_parallel import layout_of

        split = layout_of(self.module)
        return 0 if split is None else split.rank

    def get_model_parallel_rank(self) -> int:
        """The tensor-parallel rank (zero has no other model parallelism)."""
        return self.get_tensor_parallel_rank()

    # --- life cycle -------------------------------------------------------------------------------------------
    def compile(
        self,
        backend: str = "inductor",
        compile_kwargs: dict | None = None,
        schedule=None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the model's forward, as DeepSpeed's ``engine.compile`` (``backend``: torch.compile's
        backend; ``compile_kwargs``: its other keyword arguments).

        Stages 0-2: the module is compiled in place (``nn.Module.compile``); their hooks sit outside its forward.
        Stage 3: the engine's forward calls ``torch.compile(module)``, which graph-breaks at each module that gathers
        (the store's hooks are ``torch.compiler.disable``d) and runs the first forward eagerly while the store checks
        released reads (see ``zero.engine.compiled.EagerWhileChecking``), as DeepSpeed's ZeRO-3 under compile.
        A forward the config already compiled (``compile.deepcompile``, its ``autosp``/``autotp`` passes,
        ``torch_compile.enabled``; DeepSpeed compiles DeepCompile's graphs in this call, zero in ``initialize()``)
        is kept, and a second call does nothing, as DeepSpeed's.

        Raises:
            NotSupportedError: ``schedule`` (DeepCompile's custom pass schedule) or ``compiled_autograd_enabled``.
        """
        if schedule is not None or compiled_autograd_enabled:
            raise NotSupportedError("engine.compile(schedule=..., compiled_autograd_enabled=True) is not supported")
        if self._compiled:
            return
        if self._forward is self.module:  # else the config compiled it at initialize()
            self._forward = compile_module(self.runtime, backend, compile_kwargs or {})
        self._compiled = True
