"""CommsLogger: per-collective counts, logical and on-the-wire bytes, latency, algbw and busbw.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``): ``algbw = S / t`` with ``S`` the logical size of the
operation (all-gather: output bytes; reduce-scatter: input bytes; all-reduce, broadcast, all-to-all: the tensor's
bytes) and ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather,
reduce-scatter and all-to-all, and ``1`` for broadcast.

The logger is off by default. Collectives check one module-level list (``_ACTIVE``) for emptiness; nothing else
runs on the hot path while no logger is active. A collective is recorded by the loggers that were active when it
was *issued*; an async one is recorded when it completes, even if those loggers have exited by then (so a post-step
all-gather waited in the next forward counts for the step that issued it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Loggers entered with ``with CommsLogger()``; collectives record into every active one (nesting is allowed).
_ACTIVE: list[CommsLogger] = []

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_uneven": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all_v": lambda n: (n - 1) / n,
}


def bus_factor(name: str, world: int) -> float:
    """nccl-tests' busbw/algbw factor for collective ``name`` on ``world`` ranks (1.0 for unknown names)."""
    if world <= 1:
        return 0.0
    return _BUS_FACTOR.get(name, lambda n: 1.0)(world)


@dataclass(frozen=True)
class CommRecord:
    """One completed collective as seen by this rank.

    Attributes:
        name: collective name (``all_gather_into_tensor``, ``qwz_all_gather``, ...).
        group_size: ranks in the process group.
        dtype: dtype of the communicated tensor, e.g. ``"torch.bfloat16"``.
        logical_bytes: nccl-tests' ``S`` for this operation, in bytes.
        wire_bytes: bytes this rank sends over the network for the algorithm actually used (see collectives.py).
        latency_s: seconds from issue to completion observed by ``wait`` (for async ops this includes any time
            the caller spent before calling ``wait``).
        async_op: whether the call was issued asynchronously.
        busbw_factor: nccl-tests' busbw/algbw factor for this collective and group size.
        algorithm: how the collective ran: "native" (the backend's call), one of zero_comm.algorithms'
            ("broadcast", "all_to_all", "shm") or "window" (copies from peers' shared-memory regions,
            ``zero_comm.window``: ``wire_bytes`` are the bytes read from peers); ``wire_bytes`` is that algorithm's.
        peer: for a point-to-point op (``send`` / ``recv``, :mod:`zero_comm.p2p`), the peer's global rank; None
            for collectives. A send's ``wire_bytes`` is the tensor's bytes, a recv's 0 (it sends nothing).
    """

    name: str
    group_size: int
    dtype: str
    logical_bytes: int
    wire_bytes: int
    latency_s: float
    async_op: bool
    busbw_factor: float
    algorithm: str = "native"
    peer: int | None = None

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth in bytes/s (``logical_bytes / latency_s``)."""
        return self.logical_bytes / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def busbw(self) -> float:
        """Bus bandwidth in bytes/s (``algbw * busbw_factor``, nccl-tests' definition)."""
        return self.algbw * self.busbw_factor


class CommsLogger:
    """Record every zero_comm collective this process issues while the logger is active.

    Usage::

        with CommsLogger() as log:
            all_reduce(t, group)
        log.count("all_reduce"), log.summary(), log.to_json()

    Mirrors the purpose of DeepSpeed's ``comms_logger`` (counts, sizes, latency, algbw/busbw per op), but as an
    explicit context object rather than a global configured through the engine.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommsLogger:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def record(self, rec: CommRecord) -> None:
        """Append one record (called by the collectives)."""
        self.records.append(rec)

    def count(self, name: str | None = None) -> int:
        """Number of recorded collectives, all of them or those named ``name``."""
        if name is None:
            return len(self.records)
        return sum(1 for r in self.records if r.name == name)

    def totals(self) -> dict[str, dict[str, float]]:
        """Per collective name: calls, logical_bytes, wire_bytes, total latency_s, algbw and busbw (bytes/s).

        algbw/busbw here are total bytes over total latency (a time-weighted mean over the calls).
        """
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            t = out.setdefault(r.name, dict(calls=0, logical_bytes=0, wire_bytes=0, latency_s=0.0, busbw_bytes=0.0))
            t["calls"] += 1
            t["logical_bytes"] += r.logical_bytes
            t["wire_bytes"] += r.wire_bytes
            t["latency_s"] += r.latency_s
            t["busbw_bytes"] += r.logical_bytes * r.busbw_factor
        for t in out.values():
            lat = t["latency_s"]
            t["algbw"] = t["logical_bytes"] / lat if lat > 0 else 0.0
            t["busbw"] = t.pop("busbw_bytes") / lat if lat > 0 else 0.0
        return out

    def peer_totals(self) -> dict[int, dict[str, int]]:
        """Per peer (global rank) of this rank's point-to-point ops: ``sends``, ``sent_bytes``, ``recvs``,
        ``received_bytes`` (bytes)."""
        out: dict[int, dict[str, int]] = {}
        for r in self.records:
            if r.peer is None:
                continue
            t = out.setdefault(r.peer, dict(sends=0, sent_bytes=0, recvs=0, received_bytes=0))
            if r.name == "send":
                t["sends"] += 1
                t["sent_bytes"] += r.logical_bytes
            else:
                t["recvs"] += 1
                t["received_bytes"] += r.logical_bytes
        return out

    def summary(self) -> str:
        """A markdown table, one row per collective name: calls, MB logical, MB on the wire, ms, algbw/busbw GB/s."""
        lines = [
            "| collective | calls | logical MB | wire MB (sent/rank) | total ms | mean ms | algbw GB/s | busbw GB/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, t in sorted(self.totals().items()):
            lines.append(
                f"| {name} | {t['calls']} | {t['logical_bytes'] / 1e6:.3f} | {t['wire_bytes'] / 1e6:.3f} "
                f"| {t['latency_s'] * 1e3:.3f} | {t['latency_s'] * 1e3 / t['calls']:.3f} "
                f"| {t['algbw'] / 1e9:.3f} | {t['busbw'] / 1e9:.3f} |"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        """A JSON-serialisable dict: ``{"records": [...], "totals": {...}}`` (bytes, seconds, bytes/s)."""
        recs = []
        for r in self.records:
            d = dataclasses.asdict(r)
            d["algbw"] = r.algbw
            d["busbw"] = r.busbw
            recs.append(d)
        return {"records": recs, "totals": self.totals()}
