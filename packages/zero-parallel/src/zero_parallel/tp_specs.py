"""Which layers AutoTP splits, and how: layer specs, the built-in presets, and transformers' tensor-parallel plans.

Mirrors DeepSpeed 0.19.8's configurable AutoTP (``tensor_parallel.partition_config``): a :class:`LayerSpec` matches
parameter names (``re.match`` of any of its patterns against e.g. ``"model.layers.0.self_attn.q_proj.weight"``) and
says column (split the output features, dim 0 of a ``Linear`` weight), row (split the input features, dim 1) or
skip (keep whole). The first matching spec wins. :func:`resolve_specs` picks the source in DeepSpeed's order:
the config's ``partition_config`` and ``preset_model``, else the model's Hugging Face plan
(``config.base_model_tp_plan`` and the class's ``_tp_plan``), else the built-in ``"llama"`` rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class PartitionType(str, Enum):
    """How a layer is split over the tensor-parallel group."""

    COLUMN = "column"  # output features split; the input's gradient is all-reduced in backward
    ROW = "row"  # input features split; the output is all-reduced in forward
    SKIP = "skip"  # kept whole on every rank


@dataclass(frozen=True)
class LayerSpec:
    """One rule of a partition config (DeepSpeed's ``TPLayerSpec``).

    Attributes:
        patterns: regular expressions, each ``re.match``-ed against a parameter name ending in ``.weight``.
        partition_type: column, row or skip.
        partition_dim: the weight dim that is split; None: 0 for column, 1 for row (a ``Linear`` weight is
            ``[out, in]``). Only the default is supported for a ``Linear`` (anything else changes what the layer
            computes), so another value is refused when the layer is split.
        shape: sub-parameters packed along the split dim, DeepSpeed's form: ``(n, -1)`` for ``n`` equal parts
            (a fused ``gate_up_proj``) or ``((a, b, c), -1)`` for parts of sizes a, b, c (fused QKV under GQA);
            each part is split on its own and the rank's pieces concatenated. None: one part.
        gather_output: column only: all-gather the output so every rank holds all features (an untied LM head).
        grad_allreduce: skip only: the parameter stays whole but each rank computes part of its gradient, so the
            gradient is summed over the group (transformers' ``replicated_with_grad_allreduce``).
        model_types: apply only to models whose ``config.model_type`` is one of these (None: any).
    """

    patterns: tuple[str, ...]
    partition_type: PartitionType = PartitionType.COLUMN
    partition_dim: int | None = None
    shape: tuple | None = None
    gather_output: bool = False
    grad_allreduce: bool = False
    model_types: tuple[str, ...] | None = None

    def __post_init__(self):
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"layer_specs pattern {p!r} is not a regular expression: {e}") from None
        if self.gather_output and self.partition_type is not PartitionType.COLUMN:
            raise ValueError(f"layer_specs {list(self.patterns)}: gather_output needs partition_type 'column'")
        if self.grad_allreduce and self.partition_type is not PartitionType.SKIP:
            raise ValueError(f"layer_specs {list(self.patterns)}: grad_allreduce needs partition_type 'skip'")

    @property
    def dim(self) -> int:
        """The split dim of the weight: ``partition_dim``, else 0 for column and 1 for row."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type is PartitionType.COLUMN else 1

    def sub_param_sizes(self, total: int) -> tuple[int, ...]:
        """Sizes of the packed sub-parameters along the split dim of a weight whose split dim is ``total`` long.

        Raises:
            ValueError: ``shape`` does not divide ``total`` (naming the patterns and both sizes)."""
        if self.shape is None:
            return (total,)
        part = self.shape[0] if self.dim >= len(self.shape) else self.shape[self.dim]
        sizes = tuple(part) if isinstance(part, tuple) else None
        if sizes is None:
            if part == -1:
                return (total,)
            if total % part:
                raise ValueError(f"layer_specs {list(self.patterns)}: shape {self.shape} splits dim {self.dim} "
                                 f"into {part} equal parts, but the weight's dim has {total} elements")  # fmt: skip
            sizes = (total // part,) * part
        if sum(sizes) != total:
            raise ValueError(f"layer_specs {list(self.patterns)}: sub-parameter sizes {sizes} sum to {sum(sizes)}, "
                             f"but the weight's dim {self.dim} has {total} elements")  # fmt: skip
        return sizes

    def matches(self, name: str, model_type: str | None) -> bool:
        """Whether this spec applies to parameter ``name`` of a model of ``model_type``."""
        if self.model_types is not None and (model_type or "").lower() not in {m.lower() for m in self.model_types}:
            return False
        return any(re.match(p, name) for p in self.patterns)


@dataclass(frozen=True)
class PartitionConfig:
    """A whole partition config (DeepSpeed's ``AutoTPConfig``): the specs, first match wins.

    ``use_default_specs``: with a preset, the config's specs come first and the preset's after (DeepSpeed's
    ``merge_autotp_configs``); False: the config's specs alone. ``strict_mode``: every ``Linear`` outside the LM
    head must match a spec. ``lm_head_patterns``: module-name suffixes of the LM head (kept whole unless a spec
    names it)."""

    layer_specs: tuple[LayerSpec, ...] = ()
    use_default_specs: bool = True
    strict_mode: bool = False
    lm_head_patterns: tuple[str, ...] = ("lm_head", "embed_out")
    source: str = "partition_config"  # for messages: where the specs came from

    def find(self, name: str, model_type: str | None) -> LayerSpec | None:
        """The first spec matching parameter ``name``, or None."""
        return next((s for s in self.layer_specs if s.matches(name, model_type)), None)


def _two_d(row: str, column: str) -> tuple[LayerSpec, ...]:
    return (LayerSpec((row,), PartitionType.ROW), LayerSpec((column,), PartitionType.COLUMN))


_LLAMA = (
    *_two_d(r".*\.self_attn\.o_proj\.weight$", r".*\.self_attn\.[qkv]_proj\.weight$"),
    *_two_d(r".*\.mlp\.down_proj\.weight$", r".*\.mlp\.(up|gate)_proj\.weight$"),
)
PRESETS: dict[str, tuple[LayerSpec, ...]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "mixtral": (
        *_two_d(r".*\.self_attn\.o_proj\.weight$", r".*\.self_attn\.[qkv]_proj\.weight$"),
        *_two_d(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$",
                r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
        LayerSpec((r".*\.block_sparse_moe\.gate\.weight$",), PartitionType.SKIP),
    ),
    "phi3": (
        LayerSpec((r".*\.self_attn\.o_proj\.weight$",), PartitionType.ROW),
        LayerSpec((r".*\.self_attn\.qkv_proj\.weight$",), PartitionType.COLUMN, 0, (3, -1)),
        LayerSpec((r".*\.mlp\.down_proj\.weight$",), PartitionType.ROW),
        LayerSpec((r".*\.mlp\.gate_up_proj\.weight$",), PartitionType.COLUMN, 0, (2, -1)),
    ),
}  # fmt: skip
"""Built-in presets by ``preset_model`` name (DeepSpeed's ``AutoTPPresets`` whose layers are plain ``Linear``s)."""

HF_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce",
             "embedding_rowwise")  # fmt: skip
"""transformers' plan styles AutoTP reads (any other style rejects the whole plan, as DeepSpeed does)."""


def preset(name: str) -> tuple[LayerSpec, ...]:
    """The specs of preset ``name``. Raises ValueError listing the presets for an unknown name."""
    if name.lower() not in PRESETS:
        raise ValueError(f"preset_model {name!r} is not a built-in preset; choose one of {sorted(PRESETS)} or give "
                         "partition_config.layer_specs")  # fmt: skip
    return PRESETS[name.lower()]


def hf_plan(model) -> dict[str, str]:
    """transformers' tensor-parallel plan of ``model``: ``config.base_model_tp_plan`` (patterns relative to the
    base model), then the class's ``_tp_plan`` (e.g. ``{"lm_head": "colwise_gather_output"}``), then an
    instance's ``_tp_plan``; a ``model.``-prefixed duplicate of an earlier pattern is dropped. Empty when none."""
    cfg = getattr(model, "config", None)  # a transformers model, or any module (then no plan)
    plans = (getattr(cfg, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
             vars(model).get("_tp_plan"))  # fmt: skip
    merged: dict[str, str] = {}
    for plan in plans:
        for pattern, style in (plan or {}).items():
            if pattern.startswith("model.") and pattern[len("model.") :] in merged:
                continue
            merged[pattern] = style
    return merged


def specs_from_hf_plan(plan: dict[str, str]) -> tuple[LayerSpec, ...]:
    """transformers' plan as layer specs: ``*`` -> ``.*``, anchored on ``.weight``; colwise -> column,
    colwise_rep / colwise_gather_output -> column with gathered output, rowwise -> row, embedding_rowwise -> skip
    (the embedding stays whole: no vocabulary-parallel embedding), replicated_with_grad_allreduce -> skip with
    the gradient summed.

    Raises:
        ValueError: a style outside :data:`HF_STYLES` (the whole plan is refused: half a column/row pair would
            compute something else)."""
    unknown = sorted({s for s in plan.values() if s.lower() not in HF_STYLES})
    if unknown:
        raise ValueError(f"the model's transformers tp_plan has style(s) {unknown} that AutoTP does not read; give "
                         "tensor_parallel.partition_config for this model")  # fmt: skip
    specs = []
    for pattern, style in plan.items():
        regex = ".*" + pattern.replace(".", r"\.").replace("*", ".*")
        regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
        s = style.lower()
        if s.startswith("colwise"):
            specs.append(LayerSpec((regex,), PartitionType.COLUMN, gather_output=s != "colwise"))
        elif s == "rowwise":
            specs.append(LayerSpec((regex,), PartitionType.ROW))
        else:
            specs.append(LayerSpec((regex,), PartitionType.SKIP, grad_allreduce=s == "replicated_with_grad_allreduce"))
    return tuple(specs)


def resolve_specs(model, partition: PartitionConfig | None, preset_model: str | None) -> PartitionConfig:
    """The partition config AutoTP applies to ``model``, in DeepSpeed 0.19.8's order of precedence.

    1. ``preset_model`` and/or ``partition`` (the config's ``partition_config``): with both and
       ``partition.use_default_specs``, the config's specs first, then the preset's; otherwise the config alone
       (or the preset alone).
    2. The model's transformers plan (:func:`hf_plan`), converted by :func:`specs_from_hf_plan`.
    3. The built-in ``"llama"`` preset (``*.self_attn.[qkv]_proj`` / ``*.mlp.(gate|up)_proj`` column,
       ``o_proj`` / ``down_proj`` row), which also fits Mistral, Qwen2 and most decoder-only models.

    Raises:
        ValueError: an unknown preset, or a transformers plan with a style AutoTP does not read.
    """
    base = preset(preset_model) if preset_model else None
    if partition is not None:
        specs = partition.layer_specs + (base or ()) if partition.use_default_specs else partition.layer_specs
        return PartitionConfig(specs, partition.use_default_specs, partition.strict_mode, partition.lm_head_patterns,
                               "partition_config" + (f" + preset {preset_model!r}" if base and
                                                     partition.use_default_specs else ""))  # fmt: skip
    if base is not None:
        return PartitionConfig(base, source=f"preset {preset_model!r}")
    plan = hf_plan(model)
    if plan:
        return PartitionConfig(specs_from_hf_plan(plan), source="the model's transformers tp_plan")
    return PartitionConfig(PRESETS["llama"], source="the built-in 'llama' rules")
