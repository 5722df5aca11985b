"""The launcher's message when a rank dies: which rank, how (exit code or signal), and the last line it logged.

torchrun's agent knows the first failed rank (its "Root Cause" summary, or ``ChildFailedError.failures``); the
rank's own output is in torchrun's ``--log-dir`` (``<log_dir>/<run id>_*/attempt_<n>/<local_rank>/std{err,out}.log``
when ``--tee``/``--redirects`` is on), which is how the last line is found after a SIGKILL left no traceback.
"""

from __future__ import annotations

import pathlib
import re
import signal
import socket
from dataclasses import dataclass

_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_HOST = re.compile(r"^\s*host\s*:\s*(\S+)")


@dataclass(frozen=True)
class RankFailure:
    """The first rank that failed. ``exitcode`` < 0 means killed by signal ``-exitcode`` (Python's convention)."""

    rank: int
    local_rank: int
    exitcode: int
    host: str = "?"
    node: int | None = None
    last_line: str | None = None
    log_path: str | None = None

    @property
    def how(self) -> str:
        """``'signal SIGKILL (9)'`` or ``'exit code 1'``."""
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = "signal"
            return f"signal {name} ({-self.exitcode})"
        return f"exit code {self.exitcode}"

    def message(self) -> str:
        """One paragraph for the user: dead rank, how it died, the last line of its log (or where the log is)."""
        where = f"node {self.node}, " if self.node is not None else ""
        text = f"rank {self.rank} ({where}host {self.host}, local rank {self.local_rank}) died with {self.how}"
        if self.last_line is not None:
            text += f"; last line of its log: {self.last_line!r}"
        elif self.log_path:
            text += f"; its log: {self.log_path}"
        return text


def last_log_line(log_dir: str | pathlib.Path | None, local_rank: int) -> tuple[str | None, str | None]:
    """``(last non-empty line, path)`` of ``local_rank``'s newest torchrun log under ``log_dir`` (stderr first,
    then stdout); ``(None, None)`` when there is none (no ``--log-dir``, or the log is on another host)."""
    if log_dir is None:
        return None, None
    root = pathlib.Path(log_dir)
    attempts = sorted(root.glob(f"*/attempt_*/{local_rank}"), key=lambda p: p.stat().st_mtime)
    for folder in attempts[-1:]:  # the newest attempt
        for name in ("stderr.log", "stdout.log"):
            path = folder / name
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.is_file() else []
            if lines:
                return lines[-1].strip(), str(path)
    return None, str(root)


def from_child_failed(err, log_dir=None, node: int | None = None) -> RankFailure:
    """The root cause of torch's ``ChildFailedError`` (raised by ``torch.distributed.run.run``)."""
    rank, failure = err.get_first_failure()
    line, path = last_log_line(log_dir, failure.local_rank)
    host = getattr(failure, "hostname", None) or socket.gethostname()  # the agent ran in this process
    return RankFailure(rank, failure.local_rank, failure.exitcode, host, node, line, path)


def from_agent_output(lines: list[str], log_dir=None, node: int | None = None) -> RankFailure | None:
    """Parse the "Root Cause" block a torchrun agent printed on stderr; None when it printed none (the agent
    itself failed, e.g. the rendezvous never completed)."""
    try:
        start = max(i for i, ln in enumerate(lines) if "Root Cause" in ln)
    except ValueError:
        return None
    rank = local = code = None
    host = "?"
    for ln in lines[start:]:
        if m := _RANK.match(ln):
            rank, local = int(m.group(1)), int(m.group(2))
        elif m := _EXIT.match(ln):
            code = int(m.group(1))
        elif m := _HOST.match(ln):
            host = m.group(1)
    if rank is None or code is None:
        return None
    line, path = last_log_line(log_dir, local)
    return RankFailure(rank, local, code, host, node, line, path)


def torchrun_log_dir(torchrun_args: list[str]) -> str | None:
    """torchrun's ``--log-dir`` when ``--tee``/``--redirects`` also write the ranks' output there, else None."""
    value, writes = None, False
    for i, tok in enumerate(torchrun_args):
        key, eq, rest = tok.partition("=")
        if key in ("--log-dir", "--log_dir"):
            value = rest if eq else (torchrun_args[i + 1] if i + 1 < len(torchrun_args) else None)
        writes |= key in ("--tee", "-t", "--redirects", "-r")
    return value if writes else None
