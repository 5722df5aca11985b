"""``zero.init_distributed`` destroys the group it created at interpreter exit.

Without it gloo's worker threads are torn down during finalization and the process can abort after the script
succeeded ("terminate called without an active exception", SIGABRT; seen in the autotuner's and HF trainer's child
jobs). The check: an atexit handler registered *before* init_distributed runs *after* ours (atexit is last in,
first out) and must find no process group, in one process and on 2 torchrun ranks. With a group created
elsewhere (Accelerate initialises before ``initialize`` calls ``init_distributed``), the group stays its
creator's and the reference cycles still holding groups are collected at exit, before finalization.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit
    import torch
    import torch.distributed as dist
    import zero

    atexit.register(lambda: print(f"initialized at exit: {dist.is_initialized()}", flush=True))
    zero.init_distributed(dist_backend="gloo")
    t = torch.ones(1000)
    dist.all_reduce(t, async_op=True).wait()
    print(f"sum {t[0].item():.0f}", flush=True)
    """
)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("ranks", [1, 2])
def test_group_destroyed_at_exit(tmp_path, ranks):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    if ranks == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--standalone", "--tee", "3", str(script)]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(f"sum {ranks}") == ranks, out
    assert out.count("initialized at exit: False") == ranks, out
    assert "initialized at exit: True" not in out, out


EXTERNAL = textwrap.dedent(
    """
    import atexit
    import weakref
    import torch.distributed as dist
    import zero

    # registered first, so it runs last (atexit is last in, first out): after zero's handler
    atexit.register(lambda: print(f"cycle alive at exit: {engine() is not None}", flush=True))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # as Accelerate, before zero
    zero.init_distributed(dist_backend="gloo")  # a no-op for the group, as initialize() calls it


    class Engine:  # holds a group in a reference cycle, as an engine can
        def __init__(self):
            self.group, self.me = dist.new_group([0]), self


    engine = weakref.ref(Engine())
    dist.destroy_process_group()  # the script leaves the group, as the Trainer jobs' teardown does
    print(f"cycle alive after the script: {engine() is not None}", flush=True)
    """
)


def test_cycles_holding_a_group_created_elsewhere_are_collected_at_exit(tmp_path):
    # zero leaves a group it did not create to its creator, but still collects, at exit and before finalization,
    # the reference cycles that hold groups: no gloo thread of theirs then needs the GIL during finalization
    script = tmp_path / "job.py"
    script.write_text(EXTERNAL)
    proc = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "cycle alive after the script: True" in out, out  # nothing had collected it yet
    assert "cycle alive at exit: False" in out, out
