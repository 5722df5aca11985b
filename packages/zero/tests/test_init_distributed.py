"""``deepspeed.init_distributed`` with DeepSpeed's whole signature, on 2 real processes started without torchrun.

Scripts and test harnesses rendezvous through a shared file (``init_method="file://..."`` with ``rank`` and
``world_size``), a TCP address, ``distributed_port`` or an MPI launcher's variables. Each case starts two fresh
Python processes (no RANK/WORLD_SIZE/MASTER_* in their environment), checks the group each one got (rank, world
size, an all-reduce of rank + 1, the process group's timeout) and prints it as JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

import zero

SCRIPT = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch
    import torch.distributed as dist
    import zero as deepspeed

    kwargs = json.loads(sys.argv[1])
    if "timeout_s" in kwargs:
        kwargs["timeout"] = datetime.timedelta(seconds=kwargs.pop("timeout_s"))
    deepspeed.init_distributed(**kwargs)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    print("RESULT " + json.dumps({"rank": deepspeed.comm.get_rank(), "world": deepspeed.comm.get_world_size(),
                                   "sum": t.item(), "timeout_s": timeout.total_seconds(),
                                   "local_rank": deepspeed.comm.get_local_rank()}), flush=True)
    """
)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DEEPSPEED_TIMEOUT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, per_rank: list[tuple[dict, dict]]) -> list[dict]:
    """Start one process per ``(init_distributed kwargs, extra environment)``; return each one's RESULT."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("OMPI_", "PMI_"))}
    base["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), json.dumps(kw)],
            env={**base, **env},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for kw, env in per_rank
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out
            outs.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _check_pair(outs: list[dict], timeout_s: float) -> None:
    assert [o["rank"] for o in outs] == [0, 1]
    assert [o["world"] for o in outs] == [2, 2]
    assert [o["sum"] for o in outs] == [3.0, 3.0]  # (0 + 1) + (1 + 1): both ranks are in one group
    assert [o["timeout_s"] for o in outs] == [timeout_s, timeout_s]


def test_file_rendezvous_with_rank_and_world_size(tmp_path):
    shared = tmp_path / "rendezvous"
    kw = {"dist_backend": "gloo", "init_method": f"file://{shared}", "world_size": 2, "timeout_s": 97,
          "auto_mpi_discovery": False, "verbose": False, "config": {"comms_logger": {"enabled": False}}}  # fmt: skip
    _check_pair(_run(tmp_path, [({**kw, "rank": r}, {}) for r in range(2)]), 97.0)


def test_tcp_rendezvous_with_rank_and_world_size(tmp_path):
    kw = {"dist_backend": "gloo", "init_method": f"tcp://127.0.0.1:{_free_port()}", "world_size": 2, "timeout_s": 45}
    _check_pair(_run(tmp_path, [({**kw, "rank": r}, {}) for r in range(2)]), 45.0)


def test_distributed_port_and_default_timeout(tmp_path):
    """No init_method and no MASTER_PORT: the ranks meet on ``distributed_port``; DEEPSPEED_TIMEOUT (minutes) is
    the group's timeout, as DeepSpeed's default."""
    kw = {"dist_backend": "gloo", "distributed_port": _free_port(), "world_size": 2}
    _check_pair(_run(tmp_path, [({**kw, "rank": r}, {"DEEPSPEED_TIMEOUT": "3"}) for r in range(2)]), 180.0)


def test_default_timeout_is_deepspeeds_ten_minutes(tmp_path):
    (out,) = _run(tmp_path, [({"dist_backend": "gloo"}, {})])
    assert (out["rank"], out["world"], out["sum"], out["timeout_s"]) == (0, 1, 1.0, 600.0)


def test_mpi_launcher_environment(tmp_path):
    """An Open MPI launch (OMPI_COMM_WORLD_*) without torchrun's variables: found with auto_mpi_discovery."""
    port = str(_free_port())
    envs = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]  # fmt: skip
    outs = _run(tmp_path, [({"dist_backend": "gloo", "timeout_s": 60}, env) for env in envs])
    _check_pair(outs, 60.0)
    assert [o["local_rank"] for o in outs] == [0, 1]


def test_mpi_discovery_off_gives_one_rank(tmp_path):
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    (out,) = _run(tmp_path, [({"dist_backend": "gloo", "auto_mpi_discovery": False}, env)])
    assert (out["rank"], out["world"], out["sum"]) == (0, 1, 1.0)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"rank": 1}, ValueError, "give both rank"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank=2 is not below world_size=2"),
        ({"timeout": 30}, TypeError, "datetime.timedelta"),
        ({"config": {"comms_logger": {"enabled": "sometimes"}}}, zero.ConfigError, "comms_logger.enabled"),
        ({"config": 3}, TypeError, "expected a dict"),
    ],
)
def test_bad_arguments_named_before_any_rendezvous(kwargs, error, words, monkeypatch):
    world = _as_if_no_group(monkeypatch)
    with pytest.raises(error, match=words):
        zero.init_distributed(dist_backend="gloo", init_method="file:///nonexistent/never-used", **kwargs)
    assert dist.group.WORLD is world  # no rendezvous was started


def test_mpi_world_without_master_addr_is_named(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "4")
    world = _as_if_no_group(monkeypatch)
    with pytest.raises(ValueError, match="PMI_RANK/PMI_SIZE.*MASTER_ADDR"):
        zero.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=5))
    assert dist.group.WORLD is world


def _as_if_no_group(monkeypatch):
    """The script's view before its first init_distributed (another test of this process may have left a default
    group up, which would make init_distributed a no-op); returns the real default group (None or a group) so the
    test can check that no rendezvous replaced it."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    return dist.group.WORLD
