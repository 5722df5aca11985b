"""The layout a checkpoint was written with: the core's own ``FlatGroup`` layout, plus stage and world size.

A checkpoint stores each flat buffer as N equal shards (one file per rank). The layout says which parameter sits
at which element offset of which buffer, how much padding follows, and how many shards there are, so that the
buffers can be rebuilt and re-sliced for any other world size or stage. This mirrors the idea of DeepSpeed's
"universal checkpoint" (per-parameter fragments with their offsets), kept in one small JSON document instead of a
separate conversion step.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_core.layout import FlatGroup, LayoutError, ParamSlot

FORMAT_VERSION = 1


class LayoutMismatchError(ValueError):
    """A checkpoint's layout cannot be mapped onto the running job's layout; the message names both."""


@dataclass(frozen=True, eq=False)
class CheckpointLayout:
    """Every flat group of a job (``zero_core.layout.FlatGroup``, the one layout type), plus the stage and world
    size it ran with: the ``layout`` document of a checkpoint's model-state JSON (``to_dict`` / ``from_dict``)."""

    stage: int
    world_size: int
    groups: tuple[FlatGroup, ...]
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not 0 <= self.stage <= 3 or self.world_size < 1:
            raise LayoutError(f"checkpoint layout: stage {self.stage} (0-3) / world_size {self.world_size} (>= 1)")
        keys, names = set(), set()
        for g in self.groups:
            if g.key in keys:
                raise LayoutError(f"flat group key {g.key!r} appears twice")
            keys.add(g.key)
            for p in g.slots:
                if p.name in names:
                    raise LayoutError(f"parameter {p.name!r} appears in more than one flat group")
                names.add(p.name)

    def to_dict(self) -> dict:
        """The JSON form (format version 1)."""
        return {"format_version": self.format_version, "stage": self.stage, "world_size": self.world_size,
                "groups": [g.to_dict() for g in self.groups]}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> CheckpointLayout:
        """Read the JSON form. Raises :class:`zero_core.layout.LayoutError` naming what is malformed."""
        unknown = set(d) - {"format_version", "stage", "world_size", "groups"}
        if unknown:
            raise LayoutError(f"checkpoint layout: unknown fields {sorted(unknown)}")
        try:
            groups = tuple(FlatGroup.from_dict(g, i) for i, g in enumerate(d["groups"]))
            return cls(int(d["stage"]), int(d["world_size"]), groups, int(d.get("format_version", FORMAT_VERSION)))
        except (KeyError, TypeError) as e:
            raise LayoutError(f"checkpoint layout: malformed: {type(e).__name__}: {e}") from e

    def same_groups(self, other: CheckpointLayout) -> bool:
        """Every flat group laid out identically (no resharding needed)."""
        return len(self.groups) == len(other.groups) and all(
            a.same_layout(b) for a, b in zip(self.groups, other.groups)
        )

    def describe(self) -> str:
        """One line for error messages: stage, world size, groups and their sizes."""
        parts = [
            f"{g.key}({'frozen' if g.group_index is None else f'optim group {g.group_index}'}, "
            f"{len(g.slots)} params, {g.numel} elements, {g.partitions} shards)"
            for g in self.groups
        ]
        return (
            f"stage {self.stage}, world size {self.world_size}, {len(self.groups)} flat groups: "
            + ", ".join(parts[:6])
            + (" ..." if len(parts) > 6 else "")
        )

    def param_index(self) -> dict[str, tuple[FlatGroup, ParamSlot]]:
        """Parameter name -> (its flat group, its slot)."""
        return {p.name: (g, p) for g in self.groups for p in g.slots}

    def locate(self) -> dict[str, tuple[FlatGroup, ParamSlot, int, int]]:
        """Parameter name -> (flat group, slot, chunk size of its bucket, its bucket's chunk offset in a shard)."""
        return {p.name: (g, p, b.chunk, b.shard_offset) for g in self.groups for b in g.buckets for p in b.slots}


def check_compatible(saved: CheckpointLayout, current: CheckpointLayout, same_groups: bool = True) -> None:
    """Raise :class:`LayoutMismatchError` unless ``saved`` can be resharded onto ``current``.

    Any world size and any stage map onto each other, as long as both hold the same trainable parameters with the
    same shapes in the same optimizer param groups (resharding goes through per-parameter tensors by name); a
    parameter saved in a frozen buffer may be in an optimizer group now (it starts with no optimizer state).
    ``same_groups=False`` (a load without optimizer states) lets the param groups differ.

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
        if tuple(pa.shape) != tuple(pb.shape):
            problems.append(f"{name}: shape {list(pa.shape)} in the checkpoint, {list(pb.shape)} in the model")
        # a parameter frozen outside the optimizer when saved may be in an optimizer group now (zero_core since
        # the seam keeps frozen parameters of optimizer groups in their group): master from its stored
        # values, no optimizer state
        if same_groups and ga.group_index != gb.group_index and ga.group_index is not None:
            problems.append(
                f"{name}: optimizer param group {ga.group_index} in the checkpoint, {gb.group_index} in the model"
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
            + "\n  build the model and the optimizer's param groups as the saved run did (same parameter names, "
            "shapes and group of each), or load the weights alone (zero_to_fp32's state dict into the module) "
            "and start the optimizer afresh"
        )
