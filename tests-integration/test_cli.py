"""The `zero` CLI: bad input to `zero train` fails in one line before any rank starts and writes nothing;
`zero run` hands the script its own arguments untouched; `zero report` lists the environment and every package;
`zero train`'s first line says what will run (stage, ranks, steps, time limit, resume)."""

import json
import pathlib
import re
import subprocess
import sys

from zero.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fails(argv: list[str], capsys, runs: pathlib.Path, expect: str) -> None:
    rc = main(argv + ["--runs-dir", str(runs)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0 and err.startswith("zero: error:"), err
    assert expect in err, err
    assert not runs.exists() or not any(runs.iterdir()), "nothing may be written on bad input"


def test_train_missing_data_path(tmp_path, capsys):
    _fails(["train", "--data", str(tmp_path / "nope.txt")], capsys, tmp_path / "runs", "does not exist")


def test_train_empty_data(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _fails(["train", "--data", str(tmp_path / "empty")], capsys, tmp_path / "runs", "holds no text files")
    (tmp_path / "empty.txt").write_text("")
    _fails(["train", "--data", str(tmp_path / "empty.txt")], capsys, tmp_path / "runs", "holds no text")


def test_train_unreadable_file(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "secret.txt"
    bad.write_text("x" * 100)
    real = pathlib.Path.read_bytes

    def deny(self):  # running as root ignores chmod, so refuse the read the way the OS would
        if self == bad:
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", deny)
    _fails(["train", "--data", str(bad)], capsys, tmp_path / "runs", "cannot read data file")


def test_train_jsonl_without_text_field(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"body": "hello"}) + "\n")
    _fails(["train", "--data", str(data)], capsys, tmp_path / "runs", "no text field 'text'")


def test_train_config_typo(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 2}}))
    _fails(["train", "--config", str(cfg)], capsys, tmp_path / "runs", "did you mean 'zero_optimization'")


def test_train_batch_triple_does_not_multiply(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
                               "gradient_accumulation_steps": 2}))  # fmt: skip
    _fails(["train", "--config", str(cfg)], capsys, tmp_path / "runs", "world size 2")


def test_train_nproc_zero(tmp_path, capsys):
    _fails(["train", "--nproc-per-node", "0"], capsys, tmp_path / "runs", "--nproc-per-node")


def test_run_nproc_zero_and_no_script(capsys):
    assert main(["run", "--nproc-per-node", "0", "x.py"]) == 2
    assert main(["run", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node must be a positive integer" in err and "no script given" in err


def test_run_passes_script_arguments_untouched(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text(
        "import json, os, sys\n"
        "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(json.dumps(sys.argv[2:]))\n"
    )
    # --d, --nproc and --node_rank are prefixes/names of torchrun options: they must reach the script as written.
    args = ["--d", "1", "--nproc", "5", "--node_rank", "x", "--", "-m"]
    out = subprocess.run([sys.executable, "-m", "zero.cli", "run", "--nproc-per-node", "2", str(script), str(tmp_path),
                          *args], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in ("0", "1"):
        assert json.loads((tmp_path / rank).read_text()) == args


def test_report_lists_versions_and_packages(capsys):
    assert main(["report"]) == 0
    text = capsys.readouterr().out
    import torch

    assert torch.__version__ in text
    import importlib.metadata as md

    packages = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
    for pkg in packages:  # every package of the repository, with the version installed
        assert re.search(rf"^  {re.escape(pkg)} +{re.escape(md.version(pkg))}$", text, re.M), (pkg, text)
    assert "cpu_adam" in text


def test_train_banner_says_what_will_run(tmp_path):
    from zero.commands.train import banner

    settings = {"config": {"zero_optimization": {"stage": 3}}, "model_size": "20m", "steps": 120, "resume": False,
                "time_limit_s": 210.0, "data": "stdlib"}  # fmt: skip
    fresh = banner(settings, 2, tmp_path)
    assert "ZeRO stage 3" in fresh and "2 ranks" in fresh and "120 steps" in fresh and "210 s" in fresh, fresh
    assert "resum" not in fresh
    resumed = banner({**settings, "resume": True}, 2, tmp_path)
    assert f"resuming from the checkpoint in {tmp_path / 'checkpoint'}" in resumed, resumed
