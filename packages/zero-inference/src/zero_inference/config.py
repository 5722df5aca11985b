"""DeepSpeed 0.19.8's inference config (``DeepSpeedInferenceConfig``), validated without pydantic.

Every key of DeepSpeed's model is accepted, under its name or its alias (``tp`` for ``tensor_parallel``,
``kernel_inject``, ``max_tokens``, ``injection_dict`` ...); an unknown key is refused, as DeepSpeed's
``extra="forbid"`` does, and so is a key given under both its name and its alias. Values ``"auto"`` are dropped
before validation (DeepSpeed's non-strict mode), except ``replace_method``. The deprecated top-level ``mp_size`` and
``mpu`` move into ``tensor_parallel`` (both the old and the new key: refused, as DeepSpeed asserts); ``ep_size`` and
the other deprecated MoE keys move into ``moe``.

What zero-inference does not implement is refused here, naming the key: ``enable_cuda_graph``, ``use_triton``,
quantization, expert parallelism (``moe.ep_size`` > 1), a ``zero`` section. Keys that in DeepSpeed only steer its
CUDA kernels or checkpoint conversion (``triangular_masking``, ``return_tuple``, ``min_out_tokens``,
``transposed_mode``, ``training_mp_size``, ``config``, ``replace_method``, ``injection_policy_tuple``) are
type-checked and kept, with no other effect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

_DTYPES = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    torch.int8: ("torch.int8", "int8"),
}


class InferenceConfigError(ValueError):
    """A key of the inference config is unknown, has the wrong type or value, or asks for what zero-inference
    does not implement; the message names the key."""


def parse_dtype(value) -> torch.dtype:
    """A ``torch.dtype`` from DeepSpeed's spellings (``torch.half``, ``"fp16"``, ``"bfloat16"``, ``"int8"`` ...).

    Raises:
        InferenceConfigError: an unknown string or another ``torch.dtype``; TypeError: neither (as DeepSpeed).
    """
    if isinstance(value, torch.dtype) and value in _DTYPES:
        return value
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(f"dtype {value!r}: expected a torch.dtype or a string such as 'fp16', not "
                        f"{type(value).__name__}")  # fmt: skip
    if isinstance(value, str):
        for dtype, names in _DTYPES.items():
            if value in names:
                return dtype
    choices = sorted(n for names in _DTYPES.values() for n in names)
    raise InferenceConfigError(f"dtype {value!r} is not a dtype DeepSpeed inference takes; use one of {choices}")


def _check(key: str, value, kind: type | tuple[type, ...], what: str):
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # True is an int too
        raise InferenceConfigError(f"{key} = {value!r}: expected {what}")
    return value


_TP_KEYS = ["enabled", "tp_size", "tp_grain_size", "mpu", "tp_group"]


def _take(data: dict, name: str, alias: str | None, where: str):
    """Pop ``name`` (or its ``alias``) from ``data``; refuses both at once."""
    if alias and alias in data and name in data:
        raise InferenceConfigError(f"{where}{name} is given twice, as {name!r} and as its alias {alias!r}")
    if name in data:
        return True, data.pop(name)
    if alias and alias in data:
        return True, data.pop(alias)
    return False, None


def _no_extra(data: dict, where: str, known: list[str]) -> None:
    if data:
        raise InferenceConfigError(f"unknown inference config key(s) {sorted(data)}{' in ' + where if where else ''}; "
                                   f"DeepSpeed's keys there are {sorted(known)}")  # fmt: skip


def _without_auto(data: dict, keep: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto") or k in keep}


@dataclass
class DeepSpeedTPConfig:
    """The ``tensor_parallel`` (alias ``tp``) section.

    Attributes:
        enabled: DeepSpeed's flag, kept (it splits by ``tp_size`` alone).
        tp_size: ranks one model is split over (int >= 1); 1: the whole model on every rank.
        tp_grain_size: DeepSpeed's granularity of MLP / LM-head shards (int >= 1); zero splits MLP features evenly
            over the ranks (the same shards whenever ``tp_size * tp_grain_size`` divides the MLP's width).
        mpu: an object with ``get_model_parallel_group()`` (:class:`zero_inference.tensor_parallel.ModelParallelUnit`);
            its group is the tensor-parallel group and sets ``tp_size``.
        tp_group: a process group to split over (its size must equal ``tp_size`` when that is given too).
    """

    enabled: bool = True
    tp_size: int = 1
    tp_grain_size: int = 64
    mpu: object = None
    tp_group: object = None
    fields_set: set[str] = field(default_factory=set)

    @classmethod
    def from_value(cls, value) -> DeepSpeedTPConfig:
        """From a dict (DeepSpeed's keys) or an instance. Raises InferenceConfigError naming a bad key."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InferenceConfigError(f"tensor_parallel = {value!r}: expected a dict of {_TP_KEYS}")
        data = _without_auto(value)
        out = cls()
        for key in _TP_KEYS:
            given, v = _take(data, key, None, "tensor_parallel.")
            if not given:
                continue
            out.fields_set.add(key)
            if key == "enabled":
                out.enabled = _check("tensor_parallel.enabled", v, bool, "a bool")
            elif key in ("tp_size", "tp_grain_size"):
                if _check(f"tensor_parallel.{key}", v, int, "an int >= 1") < 1:
                    raise InferenceConfigError(f"tensor_parallel.{key} = {v}: expected an int >= 1")
                setattr(out, key, v)
            else:
                setattr(out, key, v)
        _no_extra(data, "tensor_parallel", _TP_KEYS)
        return out


_MOE_KEYS = ["enabled", "ep_size", "moe_experts", "num_experts", "type", "ep_mp_group", "ep_group", "expert_group"]
_DEPRECATED_MOE = {"ep_size": "ep_size", "ep_group": "ep_group", "expert_group": "ep_group",
                   "ep_mp_group": "ep_mp_group", "expert_mp_group": "ep_mp_group", "moe_experts": "moe_experts",
                   "moe_type": "type"}  # fmt: skip
# (name, alias, type, what) of the keys stored as given (keep_module_on_host, replace_with_kernel_inject,
# checkpoint and base_dir are read by the engine; the others steer only DeepSpeed's CUDA kernels or conversion).
_PASSIVE = [
    ("triangular_masking", "tm", bool, "a bool"),
    ("return_tuple", None, bool, "a bool"),
    ("min_out_tokens", "min_tokens", int, "an int"),
    ("transposed_mode", None, bool, "a bool"),
    ("training_mp_size", None, int, "an int"),
    ("base_dir", None, str, "a str"),
    ("config", "args", (dict, type(None)), "a dict or None"),
    ("replace_method", None, str, "a str"),
    ("injection_policy_tuple", None, (tuple, type(None)), "a tuple or None"),
    ("keep_module_on_host", None, bool, "a bool"),
    ("replace_with_kernel_inject", "kernel_inject", bool, "a bool"),
    ("checkpoint", None, (str, os.PathLike, dict, type(None)), "a folder or JSON path, DeepSpeed's dict, or None"),
]
# (name, alias, the value that is allowed, why anything else is refused)
_REFUSED = [
    ("enable_cuda_graph", None, False, "CUDA graphs are not captured by zero-inference; leave it False"),
    ("use_triton", None, False, "zero-inference has no Triton kernels; leave it False"),
    ("triton_autotune", None, False, "zero-inference has no Triton kernels; leave it False"),
    ("set_empty_params", None, False, "zero-inference gives a meta model storage itself"),
    ("save_mp_checkpoint_path", None, None, "zero-inference does not save sharded checkpoints"),
]


class DeepSpeedInferenceConfig:
    """DeepSpeed's inference config: ``DeepSpeedInferenceConfig(**config_dict)``.

    Attributes (DeepSpeed's names and defaults):
        dtype: the ``torch.dtype`` the model is converted to (default ``torch.float16``, as DeepSpeed).
        tensor_parallel: :class:`DeepSpeedTPConfig`.
        injection_policy: None or ``{module class: names of its row-parallel Linears}`` (a tuple of name suffixes,
            or one string): the layers inside each module of that class are split, those ending in a given name by
            rows (their output all-reduced), the others by columns.
        keep_module_on_host: leave the model where it is instead of moving it to the device.
        max_out_tokens: the longest ``input_ids`` row ``generate`` takes (int > 0, default 1024).
        moe: the ``moe`` section as a dict (accepted only without expert parallelism).
        checkpoint: None, a folder (transformers' layout), a JSON file or DeepSpeed's description dict
            (:mod:`zero_inference.checkpoint`); base_dir: the folder the description's files are relative to.
        replace_with_kernel_inject: replace each Llama decoder layer by zero's fused block
            (:mod:`zero_inference.fused_block`); not with ``injection_policy``.
        enable_cuda_graph, use_triton ...: their DeepSpeed defaults (any
            other value is refused); the passive keys listed in the module docstring, as given.

    Raises:
        InferenceConfigError: an unknown key, a key given twice (name and alias, or a deprecated key with its new
            place), a wrong type or value, or a feature zero-inference does not implement, naming the key.
    """

    def __init__(self, **data):
        data = _without_auto(dict(data), keep=("replace_method",))
        self.dtype = torch.float16
        self.tensor_parallel = DeepSpeedTPConfig()
        self.injection_policy = None
        self.max_out_tokens = 1024
        self.moe: dict = {}
        self.quant: dict = {}
        self.zero: dict = {}
        self.checkpoint_config: dict = {}
        self.replace_with_kernel_inject = False
        self.checkpoint = None
        self.enable_cuda_graph = False
        self.use_triton = False
        self.triton_autotune = False
        self.set_empty_params = False
        self.save_mp_checkpoint_path = None
        self.triangular_masking = True
        self.return_tuple = True
        self.min_out_tokens = 1
        self.transposed_mode = False
        self.training_mp_size = 1
        self.base_dir = ""
        self.config = None
        self.replace_method = "auto"
        self.injection_policy_tuple = None
        self.keep_module_on_host = False
        known = [n for n, *_ in _PASSIVE + _REFUSED] + [a for _, a, *_ in _PASSIVE + _REFUSED if a]
        known += ["dtype", "tensor_parallel", "tp", "injection_policy", "injection_dict", "max_out_tokens",
                  "max_tokens", "moe", "quant", "zero", "checkpoint_config", "ckpt_config", "mp_size", "mpu",
                  *_DEPRECATED_MOE]  # fmt: skip
        given, value = _take(data, "dtype", None, "")
        if given:
            self.dtype = parse_dtype(value)
        given, value = _take(data, "tensor_parallel", "tp", "")
        if given:
            self.tensor_parallel = DeepSpeedTPConfig.from_value(value)
        self._move_deprecated_tp(data)
        given, value = _take(data, "injection_policy", "injection_dict", "")
        if given:
            self.injection_policy = _check("injection_policy", value, (dict, type(None)),
                                           "a dict {module class: row-parallel layer names} or None")  # fmt: skip
        given, value = _take(data, "max_out_tokens", "max_tokens", "")
        if given:
            if _check("max_out_tokens", value, int, "an int > 0") <= 0:
                raise InferenceConfigError(f"max_out_tokens = {value}: expected an int > 0")
            self.max_out_tokens = value
        self._moe(data)
        for name, alias, kind, what in _PASSIVE:
            given, value = _take(data, name, alias, "")
            if given:
                setattr(self, name, _check(name, value, kind, what))
        for name, alias, allowed, why in _REFUSED:
            given, value = _take(data, name, alias, "")
            if given and value != allowed:
                raise InferenceConfigError(f"{name} = {value!r} is not supported: {why}")
        for name, alias, why in (
            ("quant", None, "quantized inference is not implemented; leave quant out"),
            ("zero", None, "ZeRO-Inference is initialize() without an optimizer; leave it out"),
            ("checkpoint_config", "ckpt_config", "checkpoint loading is not implemented"),
        ):
            given, value = _take(data, name, alias, "")
            if given and value not in ({}, None) and not (isinstance(value, dict) and value.get("enabled") is False):
                raise InferenceConfigError(f"{name} = {value!r} is not supported: {why}")
        _no_extra(data, "", known)

    def _move_deprecated_tp(self, data: dict) -> None:
        """``mp_size`` -> ``tensor_parallel.tp_size``, ``mpu`` -> ``tensor_parallel.mpu`` (DeepSpeed's deprecated
        top-level keys); refused when the new key is set too."""
        for old, new in (("mp_size", "tp_size"), ("mpu", "mpu")):
            given, value = _take(data, old, None, "")
            if not given:
                continue
            if new in self.tensor_parallel.fields_set:
                raise InferenceConfigError(f"the deprecated {old} and its replacement tensor_parallel.{new} are both "
                                           f"given; keep tensor_parallel.{new} only")  # fmt: skip
            self.tensor_parallel = DeepSpeedTPConfig.from_value({**self._tp_dict(), new: value})

    def _tp_dict(self) -> dict:
        tp = self.tensor_parallel
        return {k: getattr(tp, k) for k in tp.fields_set}

    def _moe(self, data: dict) -> None:
        given, value = _take(data, "moe", None, "")
        moe: dict = {}
        if given and not isinstance(value, bool):
            moe = dict(_check("moe", value, dict, "a bool or a dict of DeepSpeed's moe keys"))
        for old, new in _DEPRECATED_MOE.items():
            found, v = _take(data, old, None, "")
            if found:
                if new in moe:
                    raise InferenceConfigError(f"the deprecated {old} and its replacement moe.{new} are both given")
                moe[new] = v
        _no_extra({k: v for k, v in moe.items() if k not in _MOE_KEYS}, "moe", _MOE_KEYS)
        ep = moe.get("ep_size", 1)
        if _check("moe.ep_size", ep, int, "an int >= 1") != 1 and moe.get("enabled", True) and value is not False:
            raise InferenceConfigError(
                f"moe.ep_size = {ep} is not supported: zero-inference has no expert "
                "parallelism yet; leave ep_size at 1 (experts are split like other layers)"
            )
        self.moe = moe
