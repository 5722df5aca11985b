"""DeepSpeed's hostfile and resource filters: which hosts take part in a launch, and which slots on each.

A hostfile has one host per line, ``<hostname> slots=<count>`` (``worker-1 slots=8``); ``#`` starts a comment
line; blank lines are skipped. A *slot* is one rank on that host (a GPU; on CPU, one process).
``--include`` / ``--exclude`` take ``NODE_SPEC[@NODE_SPEC...]`` with ``NODE_SPEC = host[:slot[,slot...]]``
(``worker-0@worker-1:0,2``: every slot of worker-0, slots 0 and 2 of worker-1). ``--num_nodes`` keeps the first N
hosts, ``--num_gpus`` the first N slots of each. Semantics mirror DeepSpeed 0.19.8's ``deepspeed/launcher/runner.py``
(``_parse_hostfile``, ``parse_resource_filter``, ``apply_num_nodes_and_gpus``), except that ``--num_nodes`` larger
than the hostfile is an error here rather than a silent truncation.
"""

from __future__ import annotations

import os
import pathlib
import re

from zero.commands.errors import UsageError

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


class HostfileError(UsageError):
    """A hostfile or resource filter that cannot describe a launch (names the file, line and what was expected)."""


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """``{host: slots}`` in file order from hostfile ``text``.

    Raises: HostfileError naming ``source``, the line number and the line, for a line that is not
    ``host slots=N`` with N >= 1, a host listed twice, or a file with no host.
    """
    pool: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None or int(match.group(2)) < 1:
            raise HostfileError(f"hostfile {source} line {number}: {line!r} is not '<hostname> slots=<N>' "
                                "with N >= 1 (e.g. 'worker-1 slots=8')")  # fmt: skip
        host = match.group(1)
        if host in pool:
            raise HostfileError(f"hostfile {source} line {number}: host {host!r} is listed twice")
        pool[host] = int(match.group(2))
    if not pool:
        raise HostfileError(f"hostfile {source} lists no host (want lines like 'worker-1 slots=8')")
    return pool


def read_hostfile(path: str | os.PathLike) -> dict[str, int]:
    """:func:`parse_hostfile` of the file at ``path``. Raises HostfileError when it cannot be read."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as e:
        raise HostfileError(f"--hostfile {str(path)!r} cannot be read: {e.strerror or e}") from None
    return parse_hostfile(text, str(path))


def _parse_spec(spec: str, flag: str) -> dict[str, list[int]]:
    """``host[:slot,...]@...`` -> ``{host: sorted slots}`` (empty list: the whole host)."""
    out: dict[str, list[int]] = {}
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        if not host:
            raise HostfileError(f"{flag} {spec!r}: empty host name (want host[:slot,slot]@host2)")
        try:
            numbers = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise HostfileError(f"{flag} {spec!r}: slots of {host!r} must be integers, got {slots!r}") from None
        out[host] = sorted(set(out.get(host, []) + numbers))
    return out


def filter_resources(pool: dict[str, int], include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """Apply ``--include`` or ``--exclude`` to ``pool``; returns ``{host: [slot, ...]}`` in hostfile order,
    hosts left with no slot dropped.

    Raises: HostfileError when both are given, or a host / slot is not in the hostfile.
    """
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive")
    active = {host: list(range(n)) for host, n in pool.items()}
    spec, flag = (include, "--include") if include else (exclude, "--exclude")
    if not spec:
        return active
    chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in active.items()}
    for host, slots in _parse_spec(spec, flag).items():
        if host not in active:
            raise HostfileError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(active)})")
        for slot in slots:
            if slot not in active[host]:
                raise HostfileError(f"{flag}: host {host!r} has no slot {slot} (slots 0..{pool[host] - 1})")
        if include:
            chosen[host] = slots or active[host]
        else:
            chosen[host] = [s for s in chosen[host] if slots and s not in slots]
    return {h: chosen[h] for h in active if chosen.get(h)}


def limit_resources(active: dict[str, list[int]], num_nodes: int, num_gpus: int) -> dict[str, list[int]]:
    """Keep the first ``num_nodes`` hosts and slots ``0..num_gpus-1`` of each (-1: no limit).

    Raises: HostfileError when ``num_nodes`` exceeds the hosts available, or either is 0 / below -1.
    """
    for flag, value in (("--num_nodes", num_nodes), ("--num_gpus", num_gpus)):
        if value == 0 or value < -1:
            raise HostfileError(f"{flag} must be a positive integer, got {value}")
    if num_nodes > len(active):
        raise HostfileError(f"--num_nodes {num_nodes} is larger than the {len(active)} host(s) available "
                            f"({', '.join(active)})")  # fmt: skip
    hosts = list(active)[:num_nodes] if num_nodes > 0 else list(active)
    return {h: (list(range(num_gpus)) if num_gpus > 0 else active[h]) for h in hosts}


def find_env_file(search: tuple[str | os.PathLike, ...] = ("~", ".")) -> list[pathlib.Path]:
    """Environment files to export to every node, as DeepSpeed: ``.zero_env`` or ``.deepspeed_env`` (or the name
    in ``$DS_ENV_FILE``) in the home folder, then the current folder (later files override earlier ones)."""
    names = (".zero_env", os.environ.get("DS_ENV_FILE", ".deepspeed_env"))
    found = []
    for folder in search:
        for name in names:
            path = pathlib.Path(folder).expanduser() / name
            if path.is_file():
                found.append(path)
    return found


def read_env_file(path: pathlib.Path) -> dict[str, str]:
    """``KEY=value`` lines (blank and ``#`` lines skipped). Raises HostfileError naming the line without '='."""
    env = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise HostfileError(f"environment file {path} line {number}: {line!r} is not KEY=value")
        env[key.strip()] = value.strip()
    return env
