"""``python -m zero.commands.pin_cores [--core-list L] [--module] [--] script [args]``: pin this rank, then run the
script in this process (what ``zero run --bind_cores_to_rank`` puts between torchrun and the script).

Each of the ``LOCAL_WORLD_SIZE`` ranks on a node gets ``cores // LOCAL_WORLD_SIZE`` consecutive cores of the
allowed list (``--core-list`` as ``0-3,8``; default every core this process may use), local rank ``r`` the
``r``-th block, through ``os.sched_setaffinity``; ``OMP_NUM_THREADS`` is set to the block size.
Mirrors DeepSpeed's ``--bind_cores_to_rank`` (``deepspeed/utils/numa.py``, which uses ``numactl``) without
numactl. Torch is not imported here, so the thread pools start pinned.
"""

from __future__ import annotations

import os
import runpy
import sys


def parse_core_list(text: str) -> list[int]:
    """``'0-3,8'`` -> ``[0, 1, 2, 3, 8]``. Raises ValueError naming the bad part."""
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"--bind_core_list part {part!r} is not N or N-M (M >= N)")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(cores))


def cores_for_rank(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The ``local_rank``-th of ``local_world_size`` equal blocks of ``cores`` (left-over cores stay unused).

    Raises: ValueError when there are fewer cores than ranks.
    """
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        raise ValueError(f"--bind_cores_to_rank: {len(cores)} core(s) {cores} for {local_world_size} ranks on this "
                         "node; each rank needs at least one")  # fmt: skip
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def main(argv: list[str]) -> None:
    """Pin, then run ``argv``'s script (or ``--module``'s module) as ``__main__`` with its arguments."""
    core_list, module = None, False
    while argv and argv[0] in ("--core-list", "--module", "--"):
        if argv[0] == "--core-list":
            core_list, argv = argv[1], argv[2:]
        elif argv[0] == "--module":
            module, argv = True, argv[1:]
        else:
            argv = argv[1:]
            break
    if not argv:
        raise SystemExit("zero.commands.pin_cores: no script given")
    allowed = parse_core_list(core_list) if core_list else sorted(os.sched_getaffinity(0))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    mine = cores_for_rank(allowed, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # as DeepSpeed: one thread per pinned core
    os.environ["ZERO_BOUND_CORES"] = ",".join(map(str, mine))
    sys.argv = list(argv)
    if module:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
