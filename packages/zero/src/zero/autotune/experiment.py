"""One experiment: the user's script, in a fresh torchrun job, with one candidate's config.

The experiment's directory holds ``ds_config.json`` (what ran), ``cmd.txt``, ``stdout.log``/``stderr.log`` and, when
it succeeded, ``metrics.json`` written by the engine (``zero.engine.autotune_probe``). The config reaches the
script by replacing the value of its config argument (``--deepspeed_config``, ``--deepspeed``, ``--config``,
``--zero_config``, or DeepSpeed's ``arg_mappings`` keys) with the experiment's path, as DeepSpeed's autotuner does.
A job that exits non-zero, writes no metrics or runs past ``timeout`` seconds (then its whole process group is
killed) is recorded as failed with the reason; the search goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--deepspeed", "--config", "--zero_config",
                "--zero-config")  # fmt: skip


@dataclass
class Outcome:
    """What one launch gave: ``status`` ("ok", "failed", "timeout"), ``metrics`` (the probe's JSON, or empty),
    ``reason`` (why it failed: last line of stderr, or the time limit) and ``seconds`` (wall clock)."""

    status: str
    metrics: dict = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0


def find_config_arg(script_args: list[str], extra_flags: tuple[str, ...] = ()) -> int | None:
    """Index of the config path's value in ``script_args`` (``--flag PATH`` or ``--flag=PATH``), or None."""
    flags = CONFIG_FLAGS + tuple(extra_flags)
    for i, tok in enumerate(script_args):
        if tok in flags and i + 1 < len(script_args):
            return i + 1
        if "=" in tok and tok.split("=", 1)[0] in flags:
            return i
    return None


def with_config(script_args: list[str], index: int, path: str) -> list[str]:
    """``script_args`` with the config value at ``index`` replaced by ``path``."""
    out = list(script_args)
    out[index] = f"{out[index].split('=', 1)[0]}={path}" if out[index].startswith("--") else path
    return out


def launch_command(script: str, script_args: list[str], nproc: int, module: bool = False) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N [-m] script args``; for one rank plain
    ``python [-m] script args`` (``zero.initialize`` then makes a one-rank group; it saves the launcher's start-up,
    seconds per experiment on a busy machine)."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return cmd + (["-m"] if module else []) + [script, *script_args]


def run_experiment(cmd: list[str], exp_dir: str, timeout: float, env: dict | None = None) -> Outcome:
    """Run ``cmd`` (writing ``metrics.json`` into ``exp_dir``) with a ``timeout`` in seconds; never raises for a
    failing job. The job runs in its own process group so that a hang is killed whole (ranks included)."""
    start = time.perf_counter()
    with open(os.path.join(exp_dir, "cmd.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    out_path, err_path = os.path.join(exp_dir, "stdout.log"), os.path.join(exp_dir, "stderr.log")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Outcome("timeout", reason=f"ran past the experiment time limit of {timeout:g} s",
                           seconds=time.perf_counter() - start)  # fmt: skip
    seconds = time.perf_counter() - start
    metrics_path = os.path.join(exp_dir, "metrics.json")
    if rc != 0:
        return Outcome("failed", reason=f"exit {rc}: {_last_line(err_path)}", seconds=seconds)
    if not os.path.exists(metrics_path):
        return Outcome("failed", reason="exited 0 without writing metrics (did the script run "
                       "end_profile_step optimizer steps through the engine?)", seconds=seconds)  # fmt: skip
    with open(metrics_path) as f:
        return Outcome("ok", json.load(f), seconds=seconds)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(path: str) -> str:
    """The most telling line of a failed job's stderr: the last ``...Error:`` line, else the last line."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return "no stderr"
    # The script's own exception, not torchrun's ChildFailedError summary that follows it.
    errors = [ln for ln in lines if ("Error" in ln.split(":", 1)[0] or "Exception" in ln.split(":", 1)[0]
                                     or ln.startswith("zero: error")) and "ChildFailedError" not in ln]  # fmt: skip
    return (errors or lines or ["no output"])[-1][:300]
