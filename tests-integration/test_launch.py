"""`zero run` beyond one node: hostfile and filters, the torchrun command per node, bad input, and real launches
where "nodes" are separate torchrun agents on 127.0.0.1 (local launcher): 2 nodes x R ranks must equal 1 node x
2R ranks bitwise (fp32), a SIGKILLed rank under --max-restarts 1 must cost only a replay from the last checkpoint,
and without restarts the launcher must name the dead rank, its signal and its last log line."""

import json
import os
import pathlib
import shlex
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from zero.cli import main
from zero.commands import hostfile as hf
from zero.commands.node_runner import GRACE_S, KILL_AFTER_S
from zero.commands.pin_cores import cores_for_rank, parse_core_list

SCRIPT = str(pathlib.Path(__file__).with_name("elastic_train.py"))
STEPS, EVERY = 6, 2
RUN_TIMEOUT_S = 400  # a launch takes ~10 s on a quiet 2-core machine, ~40 s with seven other test runs beside it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hostfile(tmp_path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


# --- hostfile, filters, dry run ------------------------------------------------------------------------------------
def test_hostfile_comments_blank_lines_and_order():
    text = "# cluster\n\nworker-1 slots=8\n  worker-0   slots=2  \n# end\n"
    assert list(hf.parse_hostfile(text).items()) == [("worker-1", 8), ("worker-0", 2)]


@pytest.mark.parametrize(
    "line, expected",
    [("worker-0 slot=2", "line 2: 'worker-0 slot=2'"), ("worker-0", "line 2: 'worker-0'"),
     ("worker-0 slots=0", "N >= 1"), ("worker-1 slots=2", "listed twice")],
)  # fmt: skip
def test_bad_hostfile_line_is_one_clear_error(tmp_path, capsys, line, expected):
    path = _hostfile(tmp_path, f"worker-1 slots=4\n{line}\n")
    assert main(["run", "--hostfile", path, "--dry-run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero: error: hostfile") and expected in err and path in err and err.count("\n") == 1


def _dry_run(capsys, *argv) -> list[str]:
    assert main(["run", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def _node_args(line: str) -> dict:
    """A dry-run command line -> its environment and torchrun options as a dict, plus the script and its args."""
    toks = shlex.split(line)
    env = dict(t.split("=", 1) for t in toks[: toks.index(sys.executable)])
    rest = toks[toks.index("torch.distributed.run") + 1 :]
    opts, i = {}, 0
    while rest[i].startswith("-"):
        if rest[i] == "-m":  # the only flag without a value here
            opts["-m"], i = True, i + 1
            continue
        opts[rest[i]] = rest[i + 1]
        i += 2
    return {"env": env, "opts": opts, "script": rest[i:]}


def test_include_exclude_select_hosts_and_slots(tmp_path, capsys):
    path = _hostfile(tmp_path, "worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=2\n")
    out = _dry_run(capsys, "--hostfile", path, "--include", "worker-0:0,2@worker-2", "--master_port", "29555",
                   "--launcher", "ssh", "--dry-run", "--max-restarts", "2", "train.py", "--lr", "1e-3")  # fmt: skip
    assert out[0].startswith("# 2 node(s), world size 4, launcher ssh, rendezvous c10d at worker-0:29555")
    assert out[1] == "# node 0: host worker-0, slots 0,2 (2 ranks)"
    assert out[3] == "# node 1: host worker-2, slots 0,1 (2 ranks)"
    n0, n1 = _node_args(out[2]), _node_args(out[4])
    assert n0["env"]["CUDA_VISIBLE_DEVICES"] == "0,2" and n1["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    for n, is_host in ((n0, "1"), (n1, "0")):
        o = n["opts"]
        assert (o["--nnodes"], o["--nproc-per-node"], o["--rdzv-backend"], o["--rdzv-endpoint"]) == (
            "2", "2", "c10d", "worker-0:29555")  # fmt: skip
        assert o["--rdzv-conf"] == f"is_host={is_host}" and o["--max-restarts"] == "2"
        assert n["script"] == ["train.py", "--lr", "1e-3"]
    assert n0["opts"]["--rdzv-id"] == n1["opts"]["--rdzv-id"]

    out = _dry_run(capsys, "--hostfile", path, "--exclude", "worker-1@worker-0:3", "--launcher", "ssh",
                   "--dry-run", "train.py")  # fmt: skip
    nodes = [ln for ln in out if ln.startswith("# node")]
    assert nodes == ["# node 0: host worker-0, slots 0,1,2 (3 ranks)", "# node 1: host worker-2, slots 0,1 (2 ranks)"]

    out = _dry_run(capsys, "--hostfile", path, "--num_nodes", "2", "--num_gpus", "1", "--bind_cores_to_rank",
                   "--launcher", "pdsh", "--dry-run", "train.py")  # fmt: skip
    nodes = [ln for ln in out if ln.startswith("# node")]
    assert nodes == ["# node 0: host worker-0, slots 0 (1 ranks)", "# node 1: host worker-1, slots 0 (1 ranks)"]
    assert _node_args(out[2])["script"] == ["zero.commands.pin_cores", "train.py"]
    assert _node_args(out[2])["opts"]["-m"] is True


def test_filter_errors_name_the_host_or_slot(tmp_path, capsys):
    path = _hostfile(tmp_path, "worker-0 slots=2\n")
    for extra, expected in ((["--include", "worker-9"], "host 'worker-9' is not in the hostfile"),
                            (["--exclude", "worker-0:5"], "has no slot 5"),
                            (["--include", "worker-0", "--exclude", "worker-0"], "mutually exclusive")):  # fmt: skip
        assert main(["run", "--hostfile", path, *extra, "--dry-run", "x.py"]) == 2
        assert expected in capsys.readouterr().err


def test_num_nodes_larger_than_hostfile(tmp_path, capsys):
    path = _hostfile(tmp_path, "worker-0 slots=2\nworker-1 slots=2\n")
    assert main(["run", "--hostfile", path, "--num_nodes", "3", "--dry-run", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "--num_nodes 3 is larger than the 2 host(s) available (worker-0, worker-1)" in err


def test_unreachable_master_is_one_clear_error(tmp_path, capsys, monkeypatch):
    # Under srun, node 1 waits for node 0's rendezvous endpoint; nothing listens there.
    port = _free_port()
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "127.0.0.1,localhost")
    t0 = time.monotonic()
    assert main(["run", "--master_port", str(port), "--master_timeout", "1", "x.py"]) == 2
    err = capsys.readouterr().err
    assert f"master 127.0.0.1:{port} unreachable after" in err and "--master_addr" in err
    assert time.monotonic() - t0 < 30
    # The local launcher must host the endpoint itself: an address of another machine is refused up front.
    path = _hostfile(tmp_path, "a slots=1\nb slots=1\n")
    monkeypatch.delenv("SLURM_PROCID")
    assert main(["run", "--hostfile", path, "--launcher", "local", "--master_addr", "192.0.2.1", "x.py"]) == 2
    assert "'192.0.2.1' is not an address of this machine" in capsys.readouterr().err


def test_slurm_variables_plan_this_node(capsys, monkeypatch):
    for key, value in {"SLURM_PROCID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242",
                       "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS_PER_NODE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    out = _dry_run(capsys, "--num_gpus", "4", "--dry-run", "train.py")
    assert out[0].startswith("# 2 node(s), world size 8, launcher this-node, rendezvous c10d at gpu07:29500 (id 4242)")
    assert out[3] == "# node 1: host gpu08, slots 0,1,2,3 (4 ranks)"


def test_env_file_is_exported(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\n# comment\nFOO=a b\n")
    (tmp_path / ".zero_env").write_text("FOO=ours\n")
    out = _dry_run(capsys, "--num_gpus", "2", "--dry-run", "train.py")
    env = _node_args(out[2])["env"]
    assert env["NCCL_IB_DISABLE"] == "1" and env["FOO"] in ("ours", "a b")
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path)


def test_core_blocks():
    assert parse_core_list("0-3,8") == [0, 1, 2, 3, 8]
    assert cores_for_rank([0, 1, 2, 3, 8], 1, 2) == [2, 3]
    with pytest.raises(ValueError, match="2 core"):
        cores_for_rank([0, 1], 0, 3)
    with pytest.raises(ValueError, match="'3-1'"):
        parse_core_list("3-1")


def test_failure_from_torchrun_summary_and_log(tmp_path):
    from zero.commands import faults

    log = tmp_path / "node1" / "job7_abc" / "attempt_0" / "0"
    log.mkdir(parents=True)
    (log / "stderr.log").write_text("")
    (log / "stdout.log").write_text("step 1\nrank 3 saw step 2\n\n")
    summary = ["Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-30_15:39:20",
               "  host      : worker-1", "  rank      : 3 (local_rank: 0)", "  exitcode  : -9 (pid: 19963)",
               "  error_file: <N/A>", "  traceback : Signal 9 (SIGKILL) received by PID 19963"]  # fmt: skip
    failure = faults.from_agent_output(["noise", *summary], tmp_path / "node1", node=1)
    assert failure.message() == ("rank 3 (node 1, host worker-1, local rank 0) died with signal SIGKILL (9); last "
                                 "line of its log: 'rank 3 saw step 2'")  # fmt: skip
    assert faults.from_agent_output(["no summary here"]) is None
    assert faults.torchrun_log_dir(["--log-dir", "/x", "--tee", "3"]) == "/x"
    assert faults.torchrun_log_dir(["--log-dir=/x"]) is None  # no --tee/--redirects: nothing is written there


# --- real launches ------------------------------------------------------------------------------------------------
def _launch(out: pathlib.Path, launch_args: list[str], *script_args, env=None) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "zero.cli", "run", "--master_port", str(_free_port()), *launch_args, SCRIPT,
           str(out), str(STEPS), str(EVERY), *map(str, script_args)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)


def _fake_ssh(tmp_path) -> dict:
    """An environment whose ``ssh`` runs the remote command here (this machine has no sshd): what the ssh launcher
    sends (cd, exports, the torchrun command, quoting) is then executed for real. Records each host it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(
        "#!/bin/bash\n"
        "while [[ $1 == -* ]]; do case $1 in -o|-p) shift 2;; *) shift;; esac; done\n"
        f'echo "$1" >> {tmp_path / "ssh_hosts"}\n'
        'exec bash -c "$2"\n'
    )
    ssh.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _weights(out: pathlib.Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final.safetensors"))


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == torch.float32 and torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """Final weights of uninterrupted one-node runs, by world size (computed once per module)."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"one_node_{world}")
            res = _launch(out, ["--num_gpus", str(world)])
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            cache[world] = _weights(out)
        return cache[world]

    return get


@pytest.mark.parametrize("ranks_per_node, launcher", [(1, "ssh"), (2, "local")])
def test_two_nodes_equal_one_node(tmp_path, one_node, ranks_per_node, launcher):
    path = _hostfile(tmp_path, f"node-a slots={ranks_per_node}\nnode-b slots={ranks_per_node}\n")
    scratch = tmp_path / "tmp"  # where zero puts the ranks' logs when --log-dir is not given
    scratch.mkdir()
    env = _fake_ssh(tmp_path) if launcher == "ssh" else {**os.environ, "TMPDIR": str(scratch)}
    master = ["--master_addr", "127.0.0.1"] if launcher == "ssh" else []
    res = _launch(tmp_path / "out", ["--hostfile", path, "--launcher", launcher, *master], env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    if launcher == "local":  # a successful run on this machine leaves no log folder behind, as DeepSpeed's launcher
        assert not list(scratch.glob("zero-run-*")), list(scratch.iterdir())
    _assert_bitwise(_weights(tmp_path / "out"), one_node(2 * ranks_per_node))
    if launcher == "ssh":
        assert (tmp_path / "ssh_hosts").read_text().split() == ["node-a", "node-b"]
    teed = [ln for ln in res.stdout.splitlines() if ln.startswith("[default") and "done at step" in ln]
    assert teed, res.stdout[-2000:]  # the ranks' own output, --tee'd with torchrun's prefix


def _events(out: pathlib.Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "events.jsonl").read_text().splitlines()]


def test_sigkill_mid_run_resumes_and_matches_uninterrupted(tmp_path, one_node):
    path = _hostfile(tmp_path, "node-a slots=1\nnode-b slots=1\n")
    out = tmp_path / "out"
    res = _launch(out, ["--hostfile", path, "--launcher", "local", "--max-restarts", "1"], 1, 5)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    events = _events(out)
    kill = next(e for e in events if e["event"] == "kill")
    starts = [e for e in events if e["event"] == "start"]
    # killed in step 5; the last checkpoint was step 4, so the restarted run resumes there (one step lost)
    assert kill["step"] == 4 and [s["step"] for s in starts] == [0, 4], events
    assert pathlib.Path(starts[1]["resumed"]).parent.name == "global_step4"  # the model-states file, as DeepSpeed
    print(f"SIGKILL -> ranks resumed from step 4 after {starts[1]['time'] - kill['time']:.1f} s")
    _assert_bitwise(_weights(out), one_node(2))


def test_dead_rank_is_named_with_signal_and_last_log_line(tmp_path):
    path = _hostfile(tmp_path, "node-a slots=1\nnode-b slots=1\n")
    t0 = time.monotonic()
    res = _launch(tmp_path / "out", ["--hostfile", path, "--launcher", "local"], 1, 3)
    assert res.returncode == 1
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("zero run: rank"))
    assert line.startswith("zero run: rank 1 (node ") and "died with signal SIGKILL (9)" in line, line
    assert "last line of its log: 'rank 1 killing itself at step 3'" in line, line
    stopped_s = float(line.rsplit("stopped ", 1)[1].split(" s ")[0])
    assert stopped_s <= GRACE_S + KILL_AFTER_S + 0.5  # then every agent is down (SIGKILL at the latest)
    assert time.monotonic() - t0 < RUN_TIMEOUT_S
    assert not (tmp_path / "out" / "final.safetensors").exists()
