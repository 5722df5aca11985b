"""Launching a job script (``jobs/``) on 2 gloo ranks with ``zero run`` from a test, and running a job's
single-process reference inside the test process.

The jobs take ``<out dir> <mode>[,<mode>...]`` and write ``<out>/<mode>.json``; several modes in one launch pay the
start-up (importing transformers, TRL) once. The launched ranks get one thread each, no Hub access and no CUDA, and
never inherit an alias folder of the test process (``zero run --as-deepspeed`` makes its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zero.compat import alias

JOBS = Path(__file__).resolve().parent / "jobs"
LAUNCH_TIMEOUT = 300  # seconds per mode; one launch takes about 20-70 s on a busy 2-core machine
ZERO_RUN = [sys.executable, "-c", "import sys; from zero.cli import main; sys.exit(main(sys.argv[1:]))", "run"]


def launch_env(pythonpath_first: str | None = None) -> dict[str, str]:
    """The environment of a launch: this one, one thread, offline, no CUDA, no inherited alias folder;
    ``pythonpath_first`` (an alias folder) put first on PYTHONPATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    env.pop(alias.ENV_DIR, None)
    if pythonpath_first is not None:
        env["PYTHONPATH"] = pythonpath_first + os.pathsep + env.get("PYTHONPATH", "")
    return env


def zero_run(job: str, out: Path, modes: str, as_deepspeed: bool = True, timeout: float = LAUNCH_TIMEOUT):
    """``zero run [--as-deepspeed] --standalone --nproc-per-node 2 jobs/<job> <out> <modes>``; the finished
    process (the caller checks its exit status: some tests expect a failure)."""
    cmd = ZERO_RUN + (["--as-deepspeed"] if as_deepspeed else [])
    cmd += ["--standalone", "--nproc-per-node", "2", str(JOBS / job), str(out), modes]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch_env())


def zero_run_modes(job: str, out: Path, modes: tuple[str, ...], as_deepspeed: bool = True) -> dict[str, dict]:
    """Launch ``job`` once running each of ``modes`` in turn; each mode's JSON result by mode.

    Raises:
        AssertionError: the launch failed (its output's tail in the message).
    """
    run = zero_run(job, out, ",".join(modes), as_deepspeed, timeout=LAUNCH_TIMEOUT * len(modes))
    assert run.returncode == 0, f"{job} {modes} failed:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    return {mode: json.loads((out / f"{mode}.json").read_text()) for mode in modes}


def plain_reference(job_module: str, out: Path, mode: str = "plain") -> dict:
    """``jobs/<job_module>.train(out, mode)`` in this process (one rank, no DeepSpeed); Accelerate's process-wide
    state is reset after so the next Trainer starts fresh."""
    from accelerate.state import AcceleratorState, PartialState

    sys.path.insert(0, str(JOBS))
    try:
        return __import__(job_module).train(str(out), mode)
    finally:
        sys.path.remove(str(JOBS))
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
