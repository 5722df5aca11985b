"""Raw-dict passes before validation: deprecated DeepSpeed keys, features zero lacks, and "auto" values."""

from __future__ import annotations

import copy
import typing
import warnings

from pydantic import BaseModel

from zero.config.errors import ConfigError, NotSupportedError
from zero.config.unsupported_why import why
from zero_core.config import ZeroConfig

# Top-level DeepSpeed keys of features zero does not implement. Present and enabled -> "not supported yet".
UNSUPPORTED_TOP = (
    "pipeline",
    "moe",
    "sparse_attention",
    "curriculum_learning",
    "data_efficiency",
    "amp",
    "compression_training",
    "elasticity",
    "nebula",
    "quantize_training",
    "eigenvalue",
    "progressive_layer_drop",
    "weight_quantization",
    "sparse_gradients",
    "dataloader_drop_last",
)
# Keys where "auto" is a placeholder a caller (an integration, or initialize() from the model) may fill.
AUTO_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.enabled",
        "bf16.enabled",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.zero_hpz_partition_size",  # initialize(): the launch's ranks per node (LOCAL_WORLD_SIZE)
    }
)


def _accepts_auto(annotation: object) -> bool:
    if typing.get_origin(annotation) is typing.Literal:
        return "auto" in typing.get_args(annotation)
    return any(_accepts_auto(a) for a in typing.get_args(annotation))


def _sections(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``ZenFlowConfig | None`` -> ``[ZenFlowConfig]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _sections(a)]


def _own_auto_keys(model: type[BaseModel], prefix: str):
    for name, f in model.model_fields.items():
        if _accepts_auto(f.annotation):
            yield f"{prefix}.{name}"
        for section in _sections(f.annotation):
            yield from _own_auto_keys(section, f"{prefix}.{name}")


# Keys whose schema has "auto" as a value of its own (zero-core resolves it: stage3_shared_shards at wrap time,
# the zenflow section's select_strategy / select_interval / update_interval as DeepSpeed's rules): not a
# placeholder, at any depth of zero_optimization.
VALUE_AUTO_KEYS = frozenset(_own_auto_keys(ZeroConfig, "zero_optimization"))


def _is_disabled(value: object) -> bool:
    if value in (None, False, 0, {}, []):
        return True
    return isinstance(value, dict) and value.get("enabled") is False


# ZeRO++ keys that DeepSpeed reads inside `zero_optimization`; at the top level they would silently do nothing.
ZERO_SECTION_KEYS = (
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_nontrainable_weights",
)


def reject_unsupported(cfg: dict) -> dict:
    """``cfg`` without disabled sections of features zero lacks; NotSupportedError naming an enabled one.

    Raises:
        NotSupportedError: an enabled section of a feature zero lacks (``pipeline``, ``moe``, ...).
        ConfigError: a ZeRO++ key at the top level (it belongs inside ``zero_optimization``).
    """
    for key in ZERO_SECTION_KEYS:
        if key in cfg:
            raise ConfigError(f"config key '{key}' belongs inside 'zero_optimization' (DeepSpeed reads it there); "
                              f"move it to 'zero_optimization.{key}'")  # fmt: skip
    for key in UNSUPPORTED_TOP:
        if key in cfg and not _is_disabled(cfg[key]):
            raise NotSupportedError(f"config key '{key}': not supported yet by zero{why(key)}")
    return {k: v for k, v in cfg.items() if k not in UNSUPPORTED_TOP}


def _rename(section: dict, old: str, new: str, where: str) -> None:
    if old in section:
        if new in section:
            raise ConfigError(f"config keys '{where}{old}' (deprecated) and '{where}{new}' are both set; keep '{new}'")
        warnings.warn(f"config key '{where}{old}' is deprecated; migrated to '{where}{new}'", stacklevel=4)
        section[new] = section.pop(old)


def migrate_deprecated(cfg: dict) -> dict:
    """A copy of ``cfg`` with deprecated DeepSpeed spellings moved to their current keys, each with a warning.

    Mirrors DeepSpeed's own migrations: ``bfloat16`` -> ``bf16``; ``zero_optimization: <bool|int>`` -> ``{stage}``;
    ``cpu_offload`` -> ``offload_optimizer: {device: cpu}``; ``cpu_offload_params`` -> ``offload_param``;
    ``cpu_offload_use_pin_memory`` -> ``pin_memory`` of both; ``stage3_gather_fp16_weights_on_model_save`` ->
    ``stage3_gather_16bit_weights_on_model_save``.
    """
    cfg = copy.deepcopy(cfg)
    _rename(cfg, "bfloat16", "bf16", "")
    zo = cfg.get("zero_optimization")
    if isinstance(zo, bool) or isinstance(zo, int):
        warnings.warn("config key 'zero_optimization' as a bool/int is deprecated; use {'stage': N}", stacklevel=3)
        cfg["zero_optimization"] = zo = {"stage": int(zo)}
    if not isinstance(zo, dict):
        return cfg
    w = "zero_optimization."
    _rename(zo, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", w)
    pin = zo.pop("cpu_offload_use_pin_memory", None)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
        if old in zo:
            if new in zo:
                raise ConfigError(f"config keys '{w}{old}' (deprecated) and '{w}{new}' are both set; keep '{new}'")
            warnings.warn(f"config key '{w}{old}' is deprecated; migrated to '{w}{new}'", stacklevel=3)
            if zo.pop(old):
                zo[new] = {"device": "cpu"} if pin is None else {"device": "cpu", "pin_memory": bool(pin)}
    return cfg


def _walk(node: object, path: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif node == "auto":
        yield path


def fill_auto(cfg: dict, values: dict[str, object] | None = None) -> dict:
    """A copy of ``cfg`` with each ``"auto"`` replaced by ``values[dotted_key]``.

    ``"auto"`` is a placeholder (as in Hugging Face's DeepSpeed integration) only for the keys in ``AUTO_KEYS``;
    anywhere else, or left unfilled, it is a ConfigError naming the key. Keys in ``VALUE_AUTO_KEYS`` keep their
    ``"auto"`` (the core's own setting, e.g. ``stage3_shared_shards``).
    """
    values = values or {}
    cfg = copy.deepcopy(cfg)
    for path in list(_walk(cfg, "")):
        if path in VALUE_AUTO_KEYS:
            continue
        if path not in AUTO_KEYS:
            raise ConfigError(f"config key '{path}': \"auto\" is not accepted here; give a value")
        if path not in values:
            raise ConfigError(f"config key '{path}' is \"auto\" but nothing filled it; give a value")
        *parents, leaf = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = values[path]
    return cfg
