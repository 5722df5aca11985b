"""The layout of the flat, range-sharded fp32 buffers a checkpoint was written with, as JSON-able models.

A checkpoint stores each flat buffer as N equal shards (one file per rank). The layout says which parameter sits
at which element offset of which buffer, how much padding follows, and how many shards there are, so that the
buffers can be rebuilt and re-sliced for any other world size or stage. This mirrors the idea of DeepSpeed's
"universal checkpoint" (per-parameter fragments with their offsets), kept in one small JSON document instead of a
separate conversion step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

FORMAT_VERSION = 1


class LayoutMismatchError(ValueError):
    """A checkpoint's layout cannot be mapped onto the running job's layout; the message names both."""


class ParamSlot(BaseModel):
    """One parameter inside a flat buffer.

    Attributes:
        name: the parameter's fully qualified name in ``module.state_dict()``.
        shape: its full (unsharded) shape.
        dtype: the model-side dtype of the parameter (e.g. ``"bfloat16"``); the flat buffer itself is fp32.
        offset: first element of the parameter in its bucket (elements, not bytes).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    offset: int = Field(ge=0)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class BucketLayout(BaseModel):
    """A contiguous run of whole parameters, padded to a multiple of the world size and cut into equal chunks.

    Attributes:
        params: the parameters, by increasing ``offset`` (relative to the bucket), not overlapping.
        numel: elements used by parameters.
        padded_numel: elements including padding; a multiple of the group's ``world_size``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    params: tuple[ParamSlot, ...]
    numel: int = Field(ge=0)
    padded_numel: int = Field(ge=0)


class FlatGroupLayout(BaseModel):
    """One flat fp32 buffer made of buckets, sharded by element ranges that ignore parameter boundaries.

    Bucket ``b`` is split into ``world_size`` chunks of ``b.padded_numel // world_size`` elements; a rank's shard
    is the concatenation of its chunk of every bucket, in bucket order (one bucket = a plain range-sharded buffer,
    as in Megatron's distributed optimizer; several = zero_core's bucketed flat groups).

    Attributes:
        key: a name unique within the checkpoint, without ``/`` (e.g. ``"group0"``); file keys are built from it.
        optim_group: index of the optimizer param group whose hyper-parameters apply to this buffer; None for a
            buffer of frozen parameters (no optimizer state; stored in the parameters' dtype).
        buckets: the buckets in flat order.
        world_size: number of shards (1 for a buffer every rank holds whole, e.g. at stage 0); shard ``r`` is
            written by rank ``r``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: str
    optim_group: int | None = Field(default=None, ge=0)
    buckets: tuple[BucketLayout, ...]
    world_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> FlatGroupLayout:
        if not self.key or "/" in self.key:
            raise ValueError(f"flat group key {self.key!r} must be non-empty and contain no '/'")
        for i, b in enumerate(self.buckets):
            where = f"flat group {self.key!r} bucket {i}"
            if b.padded_numel % self.world_size:
                raise ValueError(
                    f"{where}: padded_numel {b.padded_numel} is not a multiple of world_size {self.world_size}"
                )
            if b.padded_numel < b.numel:
                raise ValueError(f"{where}: padded_numel {b.padded_numel} < numel {b.numel}")
            end = 0
            for p in b.params:
                if p.offset < end:
                    raise ValueError(f"{where}: parameter {p.name!r} at offset {p.offset} overlaps")
                end = p.offset + p.numel
            if end > b.numel:
                raise ValueError(f"{where}: parameters end at {end} > numel {b.numel}")
        return self

    @classmethod
    def single(cls, key: str, optim_group: int | None, params, numel: int, padded_numel: int, world_size: int):
        """A one-bucket group (a plain range-sharded buffer)."""
        bucket = BucketLayout(params=params, numel=numel, padded_numel=padded_numel)
        return cls(key=key, optim_group=optim_group, buckets=(bucket,), world_size=world_size)

    @property
    def params(self) -> list[ParamSlot]:
        return [p for b in self.buckets for p in b.params]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements per shard (the sum of one chunk of every bucket)."""
        return sum(b.padded_numel for b in self.buckets) // self.world_size

    def chunks(self) -> list[tuple[BucketLayout, int, int]]:
        """``(bucket, chunk size, offset of the bucket's chunk within a shard)`` per bucket."""
        out, offset = [], 0
        for b in self.buckets:
            chunk = b.padded_numel // self.world_size
            out.append((b, chunk, offset))
            offset += chunk
        return out


class CheckpointLayout(BaseModel):
    """Every flat buffer of a job, plus the stage and world size it ran with."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format_version: int = FORMAT_VERSION
    stage: int = Field(ge=0, le=3)
    world_size: int = Field(ge=1)
    groups: tuple[FlatGroupLayout, ...]

    @model_validator(mode="after")
    def _unique(self) -> CheckpointLayout:
        keys, names = set(), set()
        for g in self.groups:
            if g.key in keys:
                raise ValueError(f"flat group key {g.key!r} appears twice")
            keys.add(g.key)
            for p in g.params:
                if p.name in names:
                    raise ValueError(f"parameter {p.name!r} appears in more than one flat group")
                names.add(p.name)
        return self

    def describe(self) -> str:
        """One line for error messages: stage, world size, groups and their sizes."""
        parts = [
            f"{g.key}({'frozen' if g.optim_group is None else f'optim group {g.optim_group}'}, "
            f"{len(g.params)} params, {g.numel} elements, {g.world_size} shards)"
            for g in self.groups
        ]
        return (
            f"stage {self.stage}, world size {self.world_size}, {len(self.groups)} flat groups: "
            + ", ".join(parts[:6])
            + (" ..." if len(parts) > 6 else "")
        )

    def param_index(self) -> dict[str, tuple[FlatGroupLayout, ParamSlot]]:
        """Parameter name -> (its flat group, its slot)."""
        return {p.name: (g, p) for g in self.groups for p in g.params}

    def locate(self) -> dict[str, tuple[FlatGroupLayout, ParamSlot, int, int]]:
        """Parameter name -> (flat group, slot, chunk size of its bucket, its bucket's chunk offset in a shard)."""
        return {p.name: (g, p, c, o) for g in self.groups for b, c, o in g.chunks() for p in b.params}


def check_compatible(saved: CheckpointLayout, current: CheckpointLayout) -> None:
    """Raise :class:`LayoutMismatchError` unless ``saved`` can be resharded onto ``current``.

    Any world size and any stage map onto each other, as long as both hold the same trainable parameters with the
    same shapes in the same optimizer param groups (resharding goes through per-parameter tensors by name); a
    parameter saved in a frozen buffer may be in an optimizer group now (it starts with no optimizer state).

    Raises:
        LayoutMismatchError: naming both layouts and the first differences (missing/unexpected names, shapes,
            optimizer param group indices).
    """
    a, b = saved.param_index(), current.param_index()
    problems = []
    missing = sorted(set(b) - set(a))
    unexpected = sorted(set(a) - set(b))
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing[:8]}")
    if unexpected:
        problems.append(f"parameters in the checkpoint but not in the model: {unexpected[:8]}")
    for name in sorted(set(a) & set(b)):
        (ga, pa), (gb, pb) = a[name], b[name]
        if pa.shape != pb.shape:
            problems.append(f"{name}: shape {list(pa.shape)} in the checkpoint, {list(pb.shape)} in the model")
        # a parameter frozen outside the optimizer when saved may be in an optimizer group now (zero_core since
        # the seam keeps frozen parameters of optimizer groups in their group, HV-03): master from its stored
        # values, no optimizer state
        if ga.optim_group != gb.optim_group and ga.optim_group is not None:
            problems.append(
                f"{name}: optimizer param group {ga.optim_group} in the checkpoint, {gb.optim_group} in the model"
            )
        if len(problems) > 8:
            break
    if problems:
        raise LayoutMismatchError(
            "checkpoint layout cannot be loaded into this job:\n  saved:   "
            + saved.describe()
            + "\n  current: "
            + current.describe()
            + "\n  "
            + "\n  ".join(problems)
        )
