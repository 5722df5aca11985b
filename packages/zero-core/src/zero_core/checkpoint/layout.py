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
        offset: first element of the parameter in the flat buffer (elements, not bytes).
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


class FlatGroupLayout(BaseModel):
    """One flat fp32 buffer, sharded by element ranges that ignore parameter boundaries (Megatron-style).

    Attributes:
        key: a name unique within the checkpoint (e.g. ``"g0"`` or ``"unit3.g0"``); file keys are built from it.
        optim_group: index of the optimizer param group whose hyper-parameters apply to this buffer.
        params: the parameters, by increasing offset, not overlapping.
        numel: elements used by parameters (the buffer's unpadded size).
        padded_numel: elements including the padding that makes shards equal; a multiple of ``world_size``.
        world_size: number of shards; shard ``r`` covers ``[r * shard_numel, (r + 1) * shard_numel)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: str
    optim_group: int = Field(ge=0)
    params: tuple[ParamSlot, ...]
    numel: int = Field(ge=0)
    padded_numel: int = Field(ge=0)
    world_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> FlatGroupLayout:
        if not self.key or "/" in self.key:
            raise ValueError(f"flat group key {self.key!r} must be non-empty and contain no '/'")
        if self.padded_numel % self.world_size:
            raise ValueError(
                f"flat group {self.key!r}: padded_numel {self.padded_numel} is not a multiple of "
                f"world_size {self.world_size}"
            )
        if self.padded_numel < self.numel:
            raise ValueError(f"flat group {self.key!r}: padded_numel {self.padded_numel} < numel {self.numel}")
        end = 0
        for p in self.params:
            if p.offset < end:
                raise ValueError(f"flat group {self.key!r}: parameter {p.name!r} at offset {p.offset} overlaps")
            end = p.offset + p.numel
        if end > self.numel:
            raise ValueError(f"flat group {self.key!r}: parameters end at {end} > numel {self.numel}")
        return self

    @property
    def shard_numel(self) -> int:
        """Elements per shard (``padded_numel // world_size``)."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(start, end)`` element range of shard ``rank`` in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


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
        parts = [f"{g.key}(optim group {g.optim_group}, {len(g.params)} params, {g.numel} el)" for g in self.groups]
        return (
            f"stage {self.stage}, world size {self.world_size}, {len(self.groups)} flat groups: "
            + ", ".join(parts[:6])
            + (" ..." if len(parts) > 6 else "")
        )

    def param_index(self) -> dict[str, tuple[FlatGroupLayout, ParamSlot]]:
        """Parameter name -> (its flat group, its slot)."""
        return {p.name: (g, p) for g in self.groups for p in g.params}


def check_compatible(saved: CheckpointLayout, current: CheckpointLayout) -> None:
    """Raise :class:`LayoutMismatchError` unless ``saved`` can be resharded onto ``current``.

    Any world size and any stage map onto each other, as long as both hold the same trainable parameters with the
    same shapes in the same optimizer param groups (resharding goes through per-parameter tensors by name).

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
        if ga.optim_group != gb.optim_group:
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
