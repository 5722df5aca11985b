"""`zero train --eval-every N` refuses a negative N before anything starts (the run itself: test_cli_train.py)."""


def test_eval_every_negative_is_a_usage_error(tmp_path, capsys):
    from zero.cli import main

    code = main(["train", "--runs-dir", str(tmp_path / "runs"), "--eval-every", "-1"])
    assert code == 2 and "--eval-every must be >= 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
