"""`zero run --help` lists zero's own launcher options (DeepSpeed's flags) before torchrun's."""

import pytest

from zero.commands import run


@pytest.mark.smoke
def test_help_lists_zero_flags_then_torchrun_flags(capsys):
    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--hostfile", "--include", "--exclude", "--num_nodes", "--num_gpus", "--master_addr",
                 "--launcher", "--bind_cores_to_rank", "--master_timeout", "--dry-run", "--as-deepspeed"):  # fmt: skip
        assert flag in out, flag
    assert out.index("--hostfile") < out.index("--nproc-per-node")  # ours first, then torchrun's
