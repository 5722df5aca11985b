"""The forward's order of units at stage 3: recorded on one pass, followed (and checked) on the next ones.

One record answers three questions the stage-3 store asks: which units to prefetch next (the order of first uses,
forward ahead, backward in reverse), whether this pass still follows the record (a pass that departs drops
prefetching and records again; its gathers are agreed with the peers one by one), and how far away a unit's next
use is (DeepSpeed's ``stage3_max_reuse_distance``, measured over the full sequence, repeats included: a tied or
re-run module uses its unit twice).
"""

from __future__ import annotations

from zero_core.layout import Bucket

__all__ = ["ForwardRecord"]


class ForwardRecord:
    """The unit order of one forward pass and this pass's position in it.

    ``order`` is the recorded order of first uses (None until a pass has been recorded); ``sequence`` every use
    in order, repeats included, with per position ``next_use`` (the position of the same unit's next use, -1 for
    none) and ``numel_before`` (elements gathered in the sequence before that position). ``steady`` is True once a
    whole step followed the record.
    """

    def __init__(self) -> None:
        self.order: list[Bucket] | None = None
        self.position: dict[Bucket, int] = {}  # unit -> its index in ``order``
        self.cursor = 0  # the next expected index in ``order`` this pass
        self.follows = True  # this pass has followed ``order`` so far (or nothing is recorded)
        self.recording: list[Bucket] = []  # the order being recorded on this pass
        self.sequence: list[Bucket] | None = None
        self.next_use: list[int] = []
        self.numel_before: list[int] = []
        self.pass_sequence: list[Bucket] = []  # this pass's uses so far
        self.seq_cursor = 0
        self.last_pos: dict[Bucket, int] = {}  # unit -> its latest position in ``sequence`` on a steady pass
        self.steady = False

    def follow(self, b: Bucket) -> None:
        """Forward is about to use unit ``b``: advance along the record, or note the departure (prefetching
        stops, the order is recorded again from here, and ``steady`` falls so the next gathers are agreed)."""
        self._follow_sequence(b)
        if self.order is None or not self.follows:
            if b not in self.recording:
                self.recording.append(b)
            return
        if self.order and self.order[0] is b:  # a new pass (e.g. after an eval forward)
            self.cursor = 1
        elif self.cursor < len(self.order) and self.order[self.cursor] is b:
            self.cursor += 1
        elif b not in self.order[: self.cursor]:
            self.follows = False
            self.recording = list(self.order[: self.cursor]) + [b]
            self.steady = False

    def _follow_sequence(self, b: Bucket) -> None:
        self.pass_sequence.append(b)
        seq = self.sequence
        if not self.steady or seq is None:
            return
        if self.seq_cursor < len(seq) and seq[self.seq_cursor] is b:
            self.seq_cursor += 1
        elif seq[0] is b:  # a new pass (e.g. after a forward without backward)
            self.seq_cursor, self.pass_sequence = 1, [b]
        else:
            self.steady = False
            self.last_pos.clear()
            return
        self.last_pos[b] = self.seq_cursor - 1

    def ahead(self) -> list[Bucket]:
        """The units recorded after this pass's position (what a forward prefetches); empty while recording."""
        if self.order is None or not self.follows:
            return []
        return self.order[self.cursor :]

    def before(self, b: Bucket) -> list[Bucket]:
        """The units recorded before ``b``, nearest first (what a backward at ``b`` prefetches); empty when ``b`` is
        not in the record or this pass departed from it."""
        if not self.order or not self.follows or b not in self.position:
            return []
        return self.order[: self.position[b]][::-1]

    def after(self, b: Bucket, forward: bool) -> list[Bucket]:
        """The units that come after ``b`` in the recorded order: later ones in forward, earlier ones (nearest
        first) in backward; empty when ``b`` is not recorded."""
        pos = self.position.get(b) if self.order else None
        if pos is None:
            return []
        return self.order[pos + 1 :] if forward else self.order[:pos][::-1]

    def reuse_distance(self, b: Bucket, into_backward: bool) -> int | None:
        """Elements gathered between this use of ``b`` and its next one, or None when unknown or never: within
        this forward from the sequence; otherwise (``into_backward``: autograd records, so backward uses it next,
        in reverse order) twice the elements gathered after it in the forward."""
        pos = self.last_pos.get(b)
        if not self.steady or pos is None:
            return None
        nxt = self.next_use[pos]
        if nxt >= 0:
            return self.numel_before[nxt] - self.numel_before[pos + 1]
        if into_backward:
            return 2 * (self.numel_before[-1] - self.numel_before[pos + 1])
        return None

    def end_forward(self) -> None:
        """Forward is over: a first (or departed) pass becomes the record; a pass that was not steady becomes the
        sequence the reuse distances are measured on."""
        if not self.steady:
            self._set_sequence(self.pass_sequence)
        self.pass_sequence, self.seq_cursor = [], 0
        self.last_pos.clear()
        if self.order is None or not self.follows:
            self.order, self.follows = self.recording, True
            self.recording = []
            self.position = {b: i for i, b in enumerate(self.order)}

    def _set_sequence(self, seq: list[Bucket]) -> None:
        self.sequence = seq
        self.numel_before = [0]
        for b in seq:
            self.numel_before.append(self.numel_before[-1] + b.padded_numel)
        self.next_use, later = [-1] * len(seq), {}
        for i in range(len(seq) - 1, -1, -1):
            self.next_use[i] = later.get(seq[i], -1)
            later[seq[i]] = i

    def end_pass(self) -> None:
        """Backward (or a forward-only pass) is over: the next forward starts at the top; the pass was steady when
        both the sequence and the order are recorded and it followed them."""
        self.cursor = 0
        self.steady = self.sequence is not None and self.order is not None and self.follows

    def forget(self) -> None:
        """Drop the record (``empty_partition_cache``, close): the next forward records again."""
        self.__init__()
