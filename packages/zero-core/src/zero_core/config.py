"""``ZeroConfig``: the ``zero_optimization`` section of a DeepSpeed JSON config, validated with pydantic.

Key names and defaults follow DeepSpeed's ``DeepSpeedZeroConfig`` (facts taken from its documentation) so users'
JSON files load unchanged. Unknown keys are rejected (``extra="forbid"``) with pydantic's message naming the key.

Bucket and prefetch sizes (counts of elements) must be positive integers. Policy for numbers written as floats
(JSON ``5e8``, integrations computing ``0.9 * hidden**2``): an integral float such as ``1.5e8`` is accepted and
converted to ``int``; a fractional value such as ``1.5`` is rejected, as are 0, negatives, booleans and strings
(DeepSpeed #8260 accepted 0 and later divided by it).
"""

from __future__ import annotations

import math
import warnings
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from zero_comm.quantize import DEFAULT_BLOCK
from zero_core.leaf import DEFAULT_LEAF_CLASSES
from zero_core.zenflow_config import ZenFlowConfig


def _count(value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number of elements (an integer), got {value!r} of type {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"must be an integral number of elements; fractional value {value!r} is rejected")
        value = int(value)
    if value < minimum:
        raise ValueError(f"must be >= {minimum}, got {value}")
    return value


PositiveCount = Annotated[int, BeforeValidator(lambda v: _count(v, minimum=1))]
"""An element count >= 1; integral floats accepted, fractional floats, bools and strings rejected."""
NonNegativeCount = Annotated[int, BeforeValidator(lambda v: _count(v, minimum=0))]
"""An element count >= 0 (same policy as ``PositiveCount``)."""


class OffloadConfig(BaseModel):
    """``offload_optimizer`` / ``offload_param``: where optimizer state or parameters live (zero_offload acts on it).

    zero_core only validates this section; the offload package implements it.
    """

    model_config = ConfigDict(extra="forbid")
    device: Literal["none", "cpu", "nvme"] = Field("none", description="Target: none (stay), cpu or nvme.")
    nvme_path: str | None = Field(None, description="Directory for NVMe swap files (device='nvme').")
    pin_memory: bool = Field(False, description="Use page-locked host buffers.")
    buffer_count: PositiveCount = Field(4, description="Number of swap buffers.")
    buffer_size: PositiveCount = Field(100_000_000, description="Elements per swap buffer (offload_param).")
    max_in_cpu: NonNegativeCount = Field(1_000_000_000, description="Elements kept in CPU memory (offload_param).")
    pipeline_read: bool = Field(False, description="Overlap NVMe reads with compute (offload_optimizer).")
    pipeline_write: bool = Field(False, description="Overlap NVMe writes with compute (offload_optimizer).")
    fast_init: bool = Field(False, description="Skip swapping at initialisation (offload_optimizer).")
    ratio: float = Field(1.0, ge=0.0, le=1.0, description="Fraction of optimizer work done on the CPU.")
    super_offload: bool = Field(
        False,
        description="SuperOffload: start each sub-group's host step during backward, "
        "validate (clip/overflow) at its end, undo exactly when needed (offload_optimizer).",
    )
    cpuadam_cores_perc: float = Field(0.8, gt=0.0, le=1.0, description="SuperOffload: share of the cores its "
                                      "optimizer worker uses (offload_optimizer).")  # fmt: skip

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs nvme_path: the folder for the swap files")
        return self


class OffloadParamConfig(OffloadConfig):
    """``offload_param`` (stage 3): DeepSpeed 0.19.8's defaults for this section differ from ``offload_optimizer``'s:
    ``pin_memory`` true, ``buffer_count`` 5 (``DeepSpeedZeroOffloadParamConfig``)."""

    pin_memory: bool = Field(True, description="Use page-locked host buffers (falls back with a warning).")
    buffer_count: PositiveCount = Field(5, description="Number of NVMe swap buffers for parameters.")


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class LeafModuleConfig(BaseModel):
    """``leaf_module`` (DeepSpeed 0.18+): modules made stage-3 leaves at initialisation (``zero_core.leaf``), named
    by class (``__name__`` or fully qualified), by ``named_modules()`` name, or by name suffix; one string counts as
    a list of one. Default classes: transformers' Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks."""

    model_config = ConfigDict(extra="forbid")
    classes: Annotated[list[str], BeforeValidator(_as_list)] = Field(
        default_factory=lambda: list(DEFAULT_LEAF_CLASSES), description="Leaf module classes."
    )
    names: Annotated[list[str], BeforeValidator(_as_list)] = Field(default_factory=list, description="Module names.")
    name_suffixes: Annotated[list[str], BeforeValidator(_as_list)] = Field(
        default_factory=list, description="Module name suffixes."
    )


class ZeroConfig(BaseModel):
    """The ``zero_optimization`` section (DeepSpeed key names; sizes count elements, not bytes).

    Used by :class:`zero_core.ZeroRuntime`: ``stage``, ``overlap_comm``, ``contiguous_gradients``,
    ``reduce_bucket_size``, ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``,
    ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``, ``stage3_module_granularity_threshold`` (leaves
    marked by ``zero_core.leaf.mark_by_granularity``) and zero's own ``stage3_unit_numel``,
    ``stage3_shared_shards`` (see ``zero_core.stage3``). Accepted with a
    ``UserWarning`` when set: ``allgather_bucket_size`` (DeepSpeed sizes its post-step all-gather buckets with it;
    here parameters are all-gathered per gradient bucket, so ``reduce_bucket_size`` sizes both).
    Accepted for compatibility and read by other packages: the offload sections, ``sub_group_size``,
    ``stage3_gather_16bit_weights_on_model_save``. ZeRO++ (stage 3 only; see ``zero_core.zeropp``):
    ``zero_quantized_weights``, ``zero_quantized_gradients``, ``zero_hpz_partition_size`` and zero's own
    ``zeropp_block_size``, ``zeropp_gradient_bits``, ``zeropp_quantizer``.
    Accepted with no effect (documented as such): ``save_muon_momentum_buffer_in_memory``, ``reduce_scatter``,
    ``allgather_partitions``, ``round_robin_gradients``, ``elastic_checkpoint``, ``load_from_fp32_weights``,
    ``ignore_unused_parameters`` (unused parameters never hang here; their gradient counts as zero).

    Raises:
        pydantic.ValidationError: unknown key, wrong type, or a size that is not a positive integer; the message
            names the field and the value given; a ZeRO++ key at a stage other than 3 ("requires stage 3");
            offload_optimizer at stage 0, offload_param below stage 3, device nvme without nvme_path; an odd
            allgather_bucket_size at stages 1-2 (DeepSpeed's).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    stage: Literal[0, 1, 2, 3] = Field(0, description="0: data parallel; 1: + optimizer state sharded; "
                                       "2: + gradients sharded; 3: + parameters sharded.")  # fmt: skip
    overlap_comm: bool | None = Field(None, description="Launch bucket collectives asynchronously during backward. "
                                      "None: DeepSpeed's default (True at stage 3, else False).")  # fmt: skip
    contiguous_gradients: bool = Field(True, description="Copy gradients into contiguous bucket buffers (always "
                                       "done here; kept for compatibility).")  # fmt: skip
    reduce_scatter: bool = Field(True, description="Accepted; reductions always use reduce-scatter at stage >= 1.")
    reduce_bucket_size: PositiveCount = Field(500_000_000, description="Elements per gradient bucket (stages 0-2); "
                                               "stage 3: units reduced together, at most (25 MiB cap).")  # fmt: skip
    allgather_bucket_size: PositiveCount = Field(500_000_000, description="Elements per parameter all-gather "
                                                 "bucket after the optimizer step (accepted; buckets are shared "
                                                 "with reduce_bucket_size).")  # fmt: skip
    allgather_partitions: bool = Field(True, description="Accepted; parameters are always all-gathered.")
    round_robin_gradients: bool = Field(False, description="Accepted, no effect.")
    elastic_checkpoint: bool = Field(False, description="Accepted, no effect (checkpoints always reshard).")
    load_from_fp32_weights: bool = Field(True, description="Accepted, no effect (masters are always fp32).")
    ignore_unused_parameters: bool = Field(True, description="Accepted; unused parameters never hang here.")
    sub_group_size: PositiveCount = Field(1_000_000_000, description="Elements per optimizer sub-group (offload).")
    stage3_prefetch_bucket_size: NonNegativeCount = Field(50_000_000, description="Stage 3: elements prefetched "
                                                          "ahead along the recorded module order; 0: no "
                                                          "prefetch (DeepSpeed's meaning).")  # fmt: skip
    stage3_module_granularity_threshold: NonNegativeCount = Field(0, description="Stage 3 (DeepSpeed 0.16+): "
        "modules whose parameter elements per layer are at most this become leaves (one unit each, "
        "zero_core.leaf.mark_by_granularity), outermost first; 0: off.")  # fmt: skip
    stage3_param_persistence_threshold: NonNegativeCount = Field(100_000, description="Stage 3: parameters with at "
                                                                 "most this many elements stay gathered.")  # fmt: skip
    stage3_unit_numel: NonNegativeCount = Field(0, description="Stage 3 (zero's own key, not DeepSpeed's): 0 "
                                                "gathers each module's own parameters as one unit (DeepSpeed); N > 0 "
                                                "makes each largest module subtree of at most N sharded elements one "
                                                "unit (FSDP2-style, e.g. one per decoder layer): fewer collectives."
                                                )  # fmt: skip
    stage3_shared_shards: Literal["auto"] | bool = Field(False, description="Stage 3 (zero's own key): keep each "
                                                         "rank's parameter shard in a shared-memory window the "
                                                         "group's ranks map, so a unit's gather is a copy from the "
                                                         "peers' shards instead of an all-gather (zero_comm.window). "
                                                         "Opt-in (default False: all-gathers, as DeepSpeed). "
                                                         "'auto': when every rank is on one host, on CPU over gloo, "
                                                         "without ZeRO++ weights or offloaded parameters; False: "
                                                         "always all-gather; True: as 'auto', warning when it cannot."
                                                         )  # fmt: skip
    stage3_max_live_parameters: PositiveCount = Field(1_000_000_000, description="Stage 3: most non-persistent "
                                                      "elements gathered at once (prefetch stops there; units kept "
                                                      "for reuse are released first).")  # fmt: skip
    stage3_max_reuse_distance: NonNegativeCount = Field(1_000_000_000, description="Stage 3: a unit whose next use "
                                                        "(in the recorded forward, or its backward) comes within this "
                                                        "many elements of other gathers stays gathered (not a "
                                                        "unit read from a stage3_shared_shards window: released "
                                                        "after every use).")  # fmt: skip
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, alias="stage3_gather_16bit_weights_on_model_save", description="Engine: gather weights on save."
    )
    save_muon_momentum_buffer_in_memory: bool = Field(False, description="Accepted (DeepSpeed: keep Muon's "
                                                      "momentum out of NVMe swapping): Muon's momentum always stays "
                                                      "in memory beside the master shard here.")  # fmt: skip
    offload_optimizer: OffloadConfig | None = Field(None, description="Optimizer state offload (zero_offload).")
    offload_param: OffloadParamConfig | None = Field(None, description="Parameter offload, stage 3 (zero_offload).")
    zenflow: ZenFlowConfig | None = Field(None, description="ZenFlow (DeepSpeed 0.18+): the important columns "
                                          "stepped on the device every step, the rest on the host every "
                                          "update_interval steps; needs offload_optimizer cpu, stage 1 or 2 "
                                          "(zero_offload).")  # fmt: skip
    zero_hpz_partition_size: PositiveCount = Field(
        1,
        description="ZeRO++ hpZ: ranks per node holding a secondary "
        "partition (1: off). Stage 3 only; must divide the world size.",
    )
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ: stage-3 unit all-gathers in blockwise "
                                         "int8. Stage 3 only.")  # fmt: skip
    zero_quantized_nontrainable_weights: bool = Field(False, description="ZeRO++: stage 3 holds each rank's shard "
                                                      "of the frozen parameters (in no optimizer param group) as "
                                                      "int8 blocks with fp32 scales, dequantized to the compute "
                                                      "dtype when a unit is gathered (zero_core.frozen_quant). "
                                                      "Ignored below stage 3, with a warning, as DeepSpeed ignores "
                                                      "it there.")  # fmt: skip
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ: stage-3 gradient reduce-scatter in "
                                           "blockwise int4/int8 through all-to-all. Stage 3 only.")  # fmt: skip
    zeropp_block_size: PositiveCount = Field(DEFAULT_BLOCK, description="qwZ/qgZ (zero's own key): elements per "
                                             "quantization block, one fp32 scale each (default: zero_comm's "
                                             "DEFAULT_BLOCK, 4096).")  # fmt: skip
    zeropp_gradient_bits: Literal[4, 8] = Field(4, description="qgZ (zero's own key): 4 (the paper) or 8 bits.")
    zeropp_quantizer: str = Field("torch", description="qwZ/qgZ (zero's own key): zero_comm quantizer registry "
                                  "name ('torch' is the reference).")  # fmt: skip
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig, description="Stage-3 leaf modules: "
                                          "each one unit, gathered on entry (zero_core.leaf).")  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        """DeepSpeed's deprecated spellings: ``stage3_gather_fp16_weights_on_model_save`` and ``cpu_offload``."""
        if isinstance(data, dict):
            data = dict(data)
            if "stage3_gather_fp16_weights_on_model_save" in data:
                data.setdefault(
                    "stage3_gather_16bit_weights_on_model_save", data.pop("stage3_gather_fp16_weights_on_model_save")
                )
            if "cpu_offload" in data:
                if data.pop("cpu_offload") is True:
                    data.setdefault("offload_optimizer", {"device": "cpu"})
        return data

    @model_validator(mode="after")
    def _zeropp_needs_stage3(self) -> ZeroConfig:
        """ZeRO++ keys act only at stage 3 (as in DeepSpeed); never accept them silently elsewhere."""
        on = {"zero_quantized_weights": self.zero_quantized_weights,
              "zero_quantized_gradients": self.zero_quantized_gradients,
              "zero_hpz_partition_size": self.zero_hpz_partition_size}  # fmt: skip
        active = [k for k, v in on.items() if (v > 1 if k == "zero_hpz_partition_size" else v)]
        if active and self.stage != 3:
            raise ValueError(f"{active[0]}={on[active[0]]!r} requires stage 3 (ZeRO++ qwZ/qgZ/hpZ shard parameters); "
                             f"got stage {self.stage}. Set stage 3 or remove {', '.join(active)}")  # fmt: skip
        knobs = {"zeropp_block_size", "zeropp_gradient_bits", "zeropp_quantizer"} & self.model_fields_set
        if self.zero_quantized_nontrainable_weights and self.stage == 3:  # int8 frozen weights use these two
            knobs -= {"zeropp_block_size", "zeropp_quantizer"}
        if knobs and not (self.zero_quantized_weights or self.zero_quantized_gradients):
            raise ValueError(f"{sorted(knobs)[0]} has an effect only with zero_quantized_weights or "
                             "zero_quantized_gradients set (block size and quantizer also with "
                             "zero_quantized_nontrainable_weights at stage 3); enable one or remove it")  # fmt: skip
        if self.zero_quantized_gradients and self.zeropp_gradient_bits == 4 and self.zeropp_block_size % 2:
            raise ValueError(f"zeropp_block_size={self.zeropp_block_size} must be even for zeropp_gradient_bits=4")
        return self

    @model_validator(mode="after")
    def _quantized_frozen(self) -> ZeroConfig:
        """``zero_quantized_nontrainable_weights``: DeepSpeed reads it only at stage 3 and ignores it elsewhere;
        here too, with a warning. At stage 3 it is refused with parameter offload or hpZ, whose stores hold
        shards their own way."""
        if not self.zero_quantized_nontrainable_weights:
            return self
        if self.stage != 3:
            warnings.warn(f"zero_quantized_nontrainable_weights has no effect at stage {self.stage}: frozen weights "
                          "are held as int8 only at stage 3 (DeepSpeed ignores it there too); set stage 3 or remove "
                          "it", UserWarning, stacklevel=2)  # fmt: skip
            return self
        prm = self.offload_param
        if prm is not None and prm.device != "none":
            raise ValueError(f"zero_quantized_nontrainable_weights with offload_param.device={prm.device!r} is not "
                             "supported: the offloaded parameter store keeps its shards in the storage dtype; use "
                             "one or the other")  # fmt: skip
        if self.zero_hpz_partition_size > 1:
            raise ValueError("zero_quantized_nontrainable_weights with zero_hpz_partition_size > 1 is not supported "
                             "(hpZ builds secondary shards from the stored shards in the storage dtype); use one or "
                             "the other")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _offload_stage(self) -> ZeroConfig:
        """Offload acts on sharded state: optimizer offload needs stage >= 1, parameter offload stage 3 (as in
        DeepSpeed); an unknown device is rejected by the field itself."""
        opt, prm = self.offload_optimizer, self.offload_param
        if opt is not None and opt.device != "none" and self.stage < 1:
            raise ValueError(f"offload_optimizer.device={opt.device!r} requires stage 1, 2 or 3 (it offloads the "
                             f"optimizer's shard); got stage {self.stage}")  # fmt: skip
        if prm is not None and prm.device != "none" and self.stage < 3:
            raise ValueError(f"offload_param.device={prm.device!r} requires stage 3 (only stage 3 shards "
                             f"parameters); got stage {self.stage}")  # fmt: skip
        if prm is not None and prm.device != "none" and self.zero_hpz_partition_size > 1:
            raise ValueError("offload_param with zero_hpz_partition_size > 1 is not supported (hpZ builds its "
                             "secondary shards from device-resident shards); use one or the other")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _zenflow_needs_cpu_offload(self) -> ZeroConfig:
        """ZenFlow splits ZeRO-Offload's host step: it needs ``offload_optimizer.device`` cpu (without SuperOffload
        or Twin-Flow's ``ratio``, which split the host step their own ways) at stage 1 or 2 (DeepSpeed: stages 1-2
        and 3; stage 3 is not implemented here)."""
        if self.zenflow is None:
            return self
        opt = self.offload_optimizer
        device = "none" if opt is None else opt.device
        if device != "cpu":
            raise ValueError(f"zenflow requires offload_optimizer.device 'cpu' (ZenFlow steps the unselected columns "
                             f"on the host); got offload_optimizer.device {device!r}. Set "
                             "offload_optimizer.device 'cpu' or remove zenflow")  # fmt: skip
        if self.stage not in (1, 2):
            raise ValueError(f"zenflow is implemented at stage 1 or 2; got stage {self.stage} (DeepSpeed's stage-3 "
                             "ZenFlow is not implemented in zero). Set stage 1 or 2 or remove zenflow")  # fmt: skip
        if opt.super_offload or opt.ratio < 1.0:
            key = "super_offload" if opt.super_offload else "ratio"
            raise ValueError(f"zenflow with offload_optimizer.{key}={getattr(opt, key)!r} is not supported (both "
                             f"split the host step); leave offload_optimizer.{key} at its default or remove zenflow"
                             )  # fmt: skip
        return self

    @model_validator(mode="after")
    def _allgather_bucket_unused(self) -> ZeroConfig:
        """``allgather_bucket_size`` has no effect here: say so rather than accept it silently. At stages 1-2 an odd
        size is refused, as DeepSpeed's ZeRO-1/2 optimizer refuses it (a multiple of its 4-byte alignment, 2)."""
        if self.stage in (1, 2) and self.allgather_bucket_size % 2:
            raise ValueError(f"allgather_bucket_size={self.allgather_bucket_size} must be a multiple of 2 at stages "
                             "1-2 (DeepSpeed aligns its all-gather buckets to 4 bytes of fp16)")  # fmt: skip
        if "allgather_bucket_size" in self.model_fields_set:
            warnings.warn(
                f"allgather_bucket_size={self.allgather_bucket_size} has no effect: parameters are all-gathered "
                "per gradient bucket after the step (stages 1-2, sized by reduce_bucket_size) and per unit at stage "
                "3 (stage3_prefetch_bucket_size bounds prefetch); remove it or set reduce_bucket_size",
                UserWarning,
                stacklevel=2,
            )
        return self

    @property
    def overlap(self) -> bool:
        """``overlap_comm`` with DeepSpeed's stage-dependent default applied."""
        return self.overlap_comm if self.overlap_comm is not None else self.stage == 3

    @property
    def offloads(self) -> bool:
        """``offload_optimizer`` or ``offload_param`` moves something off the device (cpu or nvme): memory comes
        first, so stage 3 keeps one unit per all-gather and per reduce-scatter (no batches: they hold up to 25 MiB
        more per collective in flight)."""
        return any(o is not None and o.device != "none" for o in (self.offload_optimizer, self.offload_param))
