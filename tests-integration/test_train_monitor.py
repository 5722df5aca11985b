"""`zero train --monitor NAME`: a name that is not one of DeepSpeed's monitors is a one-line error before anything
starts (the events a run writes: test_cli_train.py)."""


def test_train_monitor_unknown_name_is_a_usage_error(tmp_path, capsys):
    from zero.cli import main

    argv = ["train", "--model-size", "tiny", "--runs-dir", str(tmp_path), "--name", "m", "--monitor", "tensorbord"]
    assert main(argv) == 2
    assert "--monitor: 'tensorbord' is not one of" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
