"""``accelerate launch`` with a DeepSpeed config runs on zero: the launcher imports ``deepspeed.launcher.runner``
and the ranks ``import deepspeed``, both served by the alias folder that ``python -m zero.compat`` prints (put first
on PYTHONPATH). A plain ``Accelerator()`` script (see jobs/hf_accelerate_launch_job.py) at ZeRO-2 on 2 CPU ranks,
once with ``--use_deepspeed --deepspeed_config_file`` and once with ``--config_file`` holding a DeepSpeed section,
must equal Accelerate's own CPU DDP run of the same script (fp32: losses 1e-5 relative, final weights 1e-5).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero.compat import alias

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_launch import JOBS, LAUNCH_TIMEOUT, ZERO_RUN, launch_env  # noqa: E402

JOB = JOBS / "hf_accelerate_launch_job.py"
pytestmark = pytest.mark.timeout(1200)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
             "zero_optimization": {"stage": 2}}  # fmt: skip
ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds}
  deepspeed_multinode_launcher: standard
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
use_cpu: false
"""


def _run(cmd: list[str], env: dict, out: Path, mode: str) -> dict:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env)
    assert run.returncode == 0, f"{cmd}:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    return json.loads((out / f"{mode}.json").read_text())


def test_accelerate_launch_with_a_deepspeed_config_equals_its_ddp_run(tmp_path):
    folder = subprocess.run([sys.executable, "-m", "zero.compat"], capture_output=True, text=True, timeout=120,
                            env=launch_env(), check=True).stdout.strip()  # fmt: skip
    assert (Path(folder) / "deepspeed" / "__init__.py").is_file()
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(DS_CONFIG))
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_YAML.format(ds=ds))
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    runs = {}
    for name, flags in (
        ("flags", ["--use_deepspeed", "--num_processes", "2", "--deepspeed_config_file", str(ds)]),
        ("config_file", ["--config_file", str(tmp_path / "accelerate.yaml")]),
    ):
        out = tmp_path / name
        out.mkdir()
        runs[name] = _run(launch + flags + [str(JOB), str(out), "deepspeed"], launch_env(folder), out, "deepspeed")
    ddp = _run(ZERO_RUN + ["--standalone", "--nproc-per-node", "2", str(JOB), str(tmp_path), "ddp"], launch_env(),
               tmp_path, "ddp")  # fmt: skip
    assert (ddp["type"], ddp["processes"]) == ("DistributedType.MULTI_CPU", 2)
    for name, run in runs.items():
        assert (run["type"], run["processes"], run["engine"]) == (
            "DistributedType.DEEPSPEED", 2, "zero.engine.engine.Engine"), name  # fmt: skip
        assert run["losses"] == pytest.approx(ddp["losses"], rel=1e-5), name
        assert set(run["params"]) == set(ddp["params"]), name
        for key, values in ddp["params"].items():
            assert torch.allclose(torch.tensor(run["params"][key]), torch.tensor(values), rtol=1e-5, atol=1e-6), key


def test_alias_folder_command_refuses_a_real_deepspeed(tmp_path, monkeypatch, capsys):
    """``python -m zero.compat``'s main in this process (the test above runs the command itself), a real DeepSpeed
    first on sys.path."""
    site = tmp_path / "site" / "deepspeed"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert alias.main([]) == 1
    out, err = capsys.readouterr()
    assert "a real DeepSpeed is importable" in err and not out
    assert alias.main(["--force"]) == 0
    assert Path(capsys.readouterr().out.strip(), "deepspeed", "__init__.py").is_file()
