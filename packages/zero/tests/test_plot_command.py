"""`zero plot RUN_LOG OUT.png` on records made by the main job's record writer, and its bad-input errors."""

import json

import matplotlib.image
import pytest

from zero.cli import main
from zero.train.worker import step_record


def _log(path, n=4):
    recs = [step_record(i, 5.0 - 0.5 * i, {"forward": 0.1 * i, "backward": 0.2, "step": 0.05}, lr=1e-3)
            for i in range(1, n + 1)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_zero_plot_writes_a_png_from_main_job_records(tmp_path, capsys):
    log = _log(tmp_path / "log.jsonl")
    assert main(["plot", str(log), str(tmp_path / "out.png"), "--dpi", "40"]) == 0
    assert matplotlib.image.imread(tmp_path / "out.png").shape == (260, 360, 4)  # 9 x 6.5 in at 40 dpi
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "out.png"]  # no temporary left


def test_step_record_rejects_a_bad_field_naming_it():
    with pytest.raises(ValueError, match=r"seconds\['step'\] must be a finite number >= 0"):
        step_record(3, 1.0, {"step": float("nan")})


@pytest.mark.parametrize(
    "log_text, out_name, needle",
    [
        (None, "o.png", "does not exist"),
        ('{"step": 1, "loss": 2.0}\n', "o.png", "missing ['seconds']"),
        ('{"step": 2, "loss": 1, "seconds": {}}\n{"step": 1, "loss": 1, "seconds": {}}\n', "o.png", "strictly"),
        ("not json\n", "o.png", "log.jsonl"),
        ('{"step": 1, "loss": 2.0, "seconds": {}}\n', "o.jpg", "must end in .png"),
        ('{"step": 1, "loss": 2.0, "seconds": {}}\n', "missing/o.png", "does not exist"),
    ],
)
def test_zero_plot_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, log_text, out_name, needle):
    log = tmp_path / "log.jsonl"
    if log_text is not None:
        log.write_text(log_text)
    assert main(["plot", str(log), str(tmp_path / out_name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero: error: ") and needle in err and err.count("\n") == 1
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*png"))
