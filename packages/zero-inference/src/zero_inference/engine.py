"""``InferenceEngine``: DeepSpeed 0.19.8's inference wrapper around a model, with AutoTP over a tensor-parallel group.

Built by :func:`zero_inference.init_inference`. In order, as DeepSpeed's constructor: the dtype is checked against
the device, the model converted to it, the tensor-parallel group found or made, the model split (AutoTP or the
``injection_policy``), the ``checkpoint``'s files loaded shard by shard (:mod:`zero_inference.checkpoint`), the
decoder layers replaced by fused blocks with ``replace_with_kernel_inject`` (:mod:`zero_inference.fused_block`), the
model moved to the device unless ``keep_module_on_host`` (a model still on the meta device is materialised there
with ``to_empty``), and the random state of the group's first rank given to every rank (sampled generation then
draws the same tokens everywhere).

``forward`` calls the model; ``generate`` checks its arguments as DeepSpeed does (``num_beams`` > 1 and an
``input_ids`` row longer than ``max_out_tokens`` are refused), then every rank of the tensor-parallel group agrees
that it is generating before the first step: a rank whose peers do not call ``generate`` within ``sync_timeout``
seconds raises :class:`PartialGenerateError` naming them, instead of hanging in the first all-reduce; an argument
error on one rank is raised on every rank. With ``replace_with_kernel_inject`` an unpadded greedy or sampled call
is decoded by zero's own loop (:mod:`zero_inference.decode`), any other by the model's ``generate``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from zero_comm import AgreementTimeout, agree, broadcast
from zero_inference.checkpoint import checkpoint_files, load_shards, materialize
from zero_inference.compiled import check_backend, decode_compile_config
from zero_inference.config import DeepSpeedInferenceConfig
from zero_inference.decode import DecodeLoop, own_loop_applies
from zero_inference.device import check_dtype, inference_device
from zero_inference.fused_block import inject_fused_blocks
from zero_inference.tensor_parallel import autotp_specs, check_heads, injection_specs, tensor_parallel_group
from zero_parallel import TensorParallelLayout, apply_autotp


class BeamSearchError(NotImplementedError):
    """``generate`` with ``num_beams`` > 1: refused as DeepSpeed's engine refuses it (a NotImplementedError)."""


@runtime_checkable
class GenerativeModel(Protocol):
    """A model with transformers' ``generate`` (what ``InferenceEngine.generate`` calls)."""

    def generate(self, *inputs, **kwargs):
        """Token ids ``[batch, prompt + new tokens]`` generated from the prompt."""


DEFAULT_SYNC_TIMEOUT = 120.0
"""Seconds ``generate`` waits for the other ranks of the tensor-parallel group to call it too."""


class PartialGenerateError(TimeoutError):
    """``generate`` was called on some ranks of the tensor-parallel group only: ``missing`` (group ranks) did not
    call it within the engine's ``sync_timeout``. Every rank of the group must call ``generate`` with the same
    inputs, since each decoding step all-reduces across them. The group is unusable afterwards."""

    def __init__(self, missing: list[int] | None, timeout: float):
        self.missing = missing
        who = f"ranks {missing} of the tensor-parallel group" if missing else "some ranks of the tensor-parallel group"
        super().__init__(
            f"InferenceEngine.generate: {who} did not call generate within {timeout:.1f} s; every rank "
            "of the group must call generate together (each decoding step all-reduces over them)"
        )


class InferenceEngine(torch.nn.Module):
    """DeepSpeed's ``InferenceEngine``: the model, converted and split, behind ``forward`` and ``generate``.

    Attributes:
        module: the model (split in place: its ``Linear``s replaced by zero_parallel's column/row-parallel layers).
        mp_group: the tensor-parallel process group (None without tensor parallelism); mpu: the mpu given.
        layout: zero_parallel's :class:`~zero_parallel.TensorParallelLayout` of the split (None when not split).
        device: where the model runs (``cuda:<LOCAL_RANK>`` or the CPU).
        sync_timeout: seconds ``generate`` waits for the group's other ranks (:data:`DEFAULT_SYNC_TIMEOUT`).

    Raises (construction; every rank raises the same for the same model and config):
        ValueError: the dtype does not run on the device; ``tp_size`` does not divide the world size or the
            model's heads; a bad ``injection_policy`` name; a checkpoint path, file or key that does not fit;
            ``injection_policy`` with ``replace_with_kernel_inject``; ``replace_with_kernel_inject`` on a model
            without Llama decoder layers.
        TypeError: a bad ``injection_policy`` key.
    """

    def __init__(self, model: torch.nn.Module, config: DeepSpeedInferenceConfig):
        super().__init__()
        self.module = model
        self._config = config
        self.device = inference_device()
        self.sync_timeout = DEFAULT_SYNC_TIMEOUT
        self.mpu = config.tensor_parallel.mpu
        self.layout: TensorParallelLayout | None = None
        self._compiled_forward = None  # compile(): the compiled module forward calls
        self._decode_compile = None  # compile(): transformers' CompileConfig for generate's decode step
        self._decode_loop: DecodeLoop | None = None  # zero's own loop over the fused blocks (decode.py)
        check_dtype(config.dtype, self.device)
        tp = config.tensor_parallel
        if config.injection_policy and config.replace_with_kernel_inject:
            raise ValueError("injection_policy and replace_with_kernel_inject together: give one of them (as "
                             "DeepSpeed, which asserts the same)")  # fmt: skip
        partition = injection_specs(model, config.injection_policy) if config.injection_policy else None
        files = checkpoint_files(config.checkpoint, config.base_dir) if config.checkpoint is not None else None
        self.mp_group, size = tensor_parallel_group(tp.tp_size, tp.tp_group, self.mpu)
        tp.tp_size = size
        model.to(dtype=config.dtype)
        if size > 1:
            check_heads(model, size)
            self.layout = apply_autotp(model, self.mp_group, partition or autotp_specs(model))
        if files is not None:
            if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
                materialize(model, torch.device("cpu"))
            load_shards(model, files, self.layout)
        if config.replace_with_kernel_inject:
            inject_fused_blocks(model, self.mp_group)
            self._decode_loop = DecodeLoop(model)
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=self.device)
        elif not config.keep_module_on_host:
            model.to(self.device)
        if size > 1:
            self._share_rng_state()

    def _share_rng_state(self) -> None:
        """Every rank of the group takes its first rank's generator state on the device (sampling agrees)."""
        src = torch.distributed.get_global_rank(self.mp_group, 0)
        cuda = self.device.type == "cuda"
        state = (torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()).to(self.device)
        broadcast(state, src, self.mp_group)
        if cuda:
            torch.cuda.set_rng_state(state.cpu(), self.device)
        else:
            torch.set_rng_state(state.cpu())

    def forward(self, *inputs, **kwargs):
        """The model's forward on the same arguments (with tp > 1 every rank of the group must call it); after
        :meth:`compile` the compiled module's."""
        if self._compiled_forward is not None:
            return self._compiled_forward(*inputs, **kwargs)
        return self.module(*inputs, **kwargs)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None) -> None:
        """Compile ``forward`` and ``generate``'s one-token decode step (:mod:`zero_inference.compiled`); a second
        call does nothing, as DeepSpeed's ``InferenceEngine.compile``.

        Raises:
            zero_inference.compiled.CompileError: inductor on the CPU without a C++ compiler.
            TypeError: a ``compile_kwargs`` key torch.compile's decode-step config does not take.
        """
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        check_backend(backend, self.device)
        decode = decode_compile_config(backend, kwargs) if isinstance(self.module, GenerativeModel) else None
        self._compiled_forward = torch.compile(self.module, backend=backend, **kwargs)
        self._decode_compile = decode
        if self._decode_loop is not None:
            self._decode_loop = DecodeLoop(self.module, {"backend": backend, "dynamic": False, **kwargs})

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` was called (DeepSpeed's ``is_compiled``)."""
        return self._compiled_forward is not None

    def generate(self, *inputs, **kwargs):
        """The model's ``generate`` (transformers' arguments), after DeepSpeed's checks and the group agreement.

        Raises:
            BeamSearchError: a NotImplementedError: ``num_beams`` > 1 (argument or ``generation_config``), as DeepSpeed.
            RuntimeError: a row of a 2-D ``input_ids`` keyword is longer than ``max_out_tokens``.
            AttributeError: the model has no ``generate``.
            PartialGenerateError: the group's other ranks did not call ``generate`` in time.
            zero_comm.GroupOperationError: one of the errors above on another rank of the group (also an instance
                of its class).
        """
        error = None
        try:
            self._check_generate_args(kwargs)
        except (NotImplementedError, RuntimeError, AttributeError) as e:
            error = e
        if self.mp_group is not None:
            try:
                agree("InferenceEngine.generate", error, self.mp_group, timeout=self.sync_timeout)
            except AgreementTimeout as e:
                raise PartialGenerateError(e.missing, self.sync_timeout) from e
        elif error is not None:
            raise error
        if self._decode_loop is not None and own_loop_applies(self.module, inputs, kwargs):
            ids = kwargs.pop("input_ids") if "input_ids" in kwargs else inputs[0]
            kwargs.pop("attention_mask", None)
            return self._decode_loop.generate(ids, kwargs.pop("max_new_tokens"), kwargs)
        if self._config.replace_with_kernel_inject and not {"cache", "past_key_values", "cache_implementation",
                                                             "generation_config"} & kwargs.keys():  # fmt: skip
            kwargs["cache_implementation"] = "static"  # the fused blocks write into one preallocated cache
        if self._decode_compile is not None and "compile_config" not in kwargs:
            kwargs["compile_config"] = self._decode_compile
        return self.module.generate(*inputs, **kwargs)

    def _check_generate_args(self, kwargs: dict) -> None:
        if not isinstance(self.module, GenerativeModel):
            raise AttributeError(f"InferenceEngine.generate: the model ({type(self.module).__name__}) has no generate")
        num_beams = kwargs.get("num_beams", getattr(kwargs.get("generation_config"), "num_beams", 1))
        if num_beams is not None and num_beams > 1:
            raise BeamSearchError(f"InferenceEngine.generate: num_beams={num_beams}; beam search is not supported "
                                      "(as in DeepSpeed): use num_beams=1")  # fmt: skip
        ids = kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[-1] > self._config.max_out_tokens:
            raise RuntimeError(f"InferenceEngine.generate: input of {ids.shape[-1]} tokens exceeds max_out_tokens "
                               f"{self._config.max_out_tokens}; raise max_out_tokens (alias max_tokens) in the "
                               "inference config")  # fmt: skip
