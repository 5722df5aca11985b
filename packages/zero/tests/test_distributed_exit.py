"""``zero.init_distributed`` destroys the group it created at interpreter exit.

Without it gloo's worker threads are torn down during finalization and the process can abort after the script
succeeded ("terminate called without an active exception", SIGABRT; seen in the autotuner's and HF trainer's child
jobs). The check: an atexit handler registered *before* init_distributed runs *after* ours (atexit is last in,
first out) and must find no process group, in one process and on 2 torchrun ranks.
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
