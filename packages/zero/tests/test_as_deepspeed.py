"""Opt-in ``import deepspeed`` served by zero: refusal next to a real DeepSpeed, forcing, metadata, ``zero run``."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import zero
from zero.compat import alias


@pytest.fixture
def fake_real_deepspeed(tmp_path, monkeypatch):
    """A package named ``deepspeed`` on sys.path: a real DeepSpeed is then importable."""
    pkg = tmp_path / "site" / "deepspeed"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.19.8"\nREAL = True\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield pkg
    alias.uninstall_as_deepspeed()


def test_refuses_when_a_real_deepspeed_is_importable(fake_real_deepspeed):
    path_before, hooks_before = list(sys.path), list(sys.meta_path)
    with pytest.raises(alias.DeepSpeedPresentError) as err:
        zero.install_as_deepspeed()
    assert str(fake_real_deepspeed) in str(err.value) and "force=True" in str(err.value)
    assert sys.path == path_before and sys.meta_path == hooks_before and "deepspeed" not in sys.modules


def test_force_serves_zero_over_the_real_one(fake_real_deepspeed):
    folder = zero.install_as_deepspeed(force=True)
    import deepspeed
    import deepspeed.comm
    import deepspeed.runtime.zero.stage3 as stage3

    assert not hasattr(deepspeed, "REAL")
    assert deepspeed.__version__ == alias.VERSION_SEEN == f"0.19.8+zero.{zero.__version__}"
    assert (
        deepspeed.comm is zero.comm
        and deepspeed.zero.Init is zero.zero.Init
        and deepspeed.initialize is zero.initialize
    )
    assert stage3 is sys.modules["zero.as_deepspeed.runtime.zero.stage3"]
    assert zero.comm.__spec__.name == "zero.as_deepspeed.comm"
    assert importlib.metadata.version("deepspeed") == alias.VERSION_SEEN
    assert "not DeepSpeed" in importlib.metadata.metadata("deepspeed")["Summary"]
    assert Path(folder).is_dir() and not str(folder).startswith(sys.prefix)  # nothing installed into the env
    with pytest.raises(ModuleNotFoundError):
        import deepspeed.no_such_module  # noqa: F401
    alias.uninstall_as_deepspeed()
    assert "deepspeed" not in sys.modules and folder not in sys.path


def test_transformers_and_accelerate_see_deepspeed_only_when_opted_in(tmp_path):
    """A fresh interpreter: before, nothing; after install_as_deepspeed, both libraries' checks pass honestly."""
    script = textwrap.dedent("""
        import importlib.util, sys
        before = importlib.util.find_spec("deepspeed") is not None
        import zero
        zero.install_as_deepspeed()
        from transformers.integrations.deepspeed import is_deepspeed_available
        from accelerate.utils import compare_versions, is_deepspeed_available as acc_available
        print(before, is_deepspeed_available(), acc_available(), compare_versions("deepspeed", ">=", "0.9.3"))
    """)
    env = {k: v for k, v in os.environ.items() if k not in (alias.ENV_DIR,)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-4:] == ["False", "True", "True", "True"]


@pytest.mark.parametrize(
    "options",
    [
        ["--as-deepspeed", "--standalone", "--nproc-per-node", "1"],
        ["--standalone", "--nproc-per-node", "1", "--as-deepspeed"],  # among the options, as the README writes it
        ["--num_gpus", "1", "--as-deepspeed", "--standalone"],  # after DeepSpeed's launcher flag
    ],
)
def test_zero_run_as_deepspeed_refuses_next_to_a_real_deepspeed(fake_real_deepspeed, tmp_path, capfd, options):
    """Refused before anything is launched (``zero run`` in this process; capfd would also catch a launched
    script's output), wherever the flag sits among the launcher options; forcing is covered in-process above, and
    the launch itself by test_hf_integration.py (every job there runs through `zero run --as-deepspeed`)."""
    from zero.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('LAUNCHED')\n")
    code = main(["run", *options, str(script)])
    out, err = capfd.readouterr()
    assert code == 2 and "a real DeepSpeed is importable" in err, err[-3000:]
    assert str(fake_real_deepspeed) in err and "--as-deepspeed-force" in err
    assert "LAUNCHED" not in out


def test_alias_folder_is_removed_when_its_process_exits(tmp_path):
    """Each run used to leave its alias folder in the temp directory (hundreds after a day of launches): the folder
    must exist while the process and the ranks it launches run, and be gone once the process has exited."""
    env = {k: v for k, v in os.environ.items() if k != alias.ENV_DIR}
    installed = subprocess.run(
        [sys.executable, "-c", "import os, zero; d = zero.install_as_deepspeed(); print(d, os.path.isdir(d))"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    folder, existed = installed.stdout.split()[-2:]
    assert existed == "True" and not Path(folder).exists()

    script = tmp_path / "rank.py"
    script.write_text("import os\nd = os.environ['ZERO_AS_DEEPSPEED_DIR']\nprint('RANK_SEES', d, os.path.isdir(d))\n")
    launched = subprocess.run(
        [sys.executable, "-m", "zero.cli", "run", "--as-deepspeed", "--standalone", "--nproc-per-node", "1",
         str(script)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    line = next(ln for ln in launched.stdout.splitlines() if ln.startswith("RANK_SEES"))
    _, folder, existed = line.split()
    assert existed == "True" and not Path(folder).exists()


def _python(code: str, *path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, path), os.environ.get("PYTHONPATH", "")]))
    env.pop(alias.ENV_DIR, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_a_plain_import_zero_leaves_a_real_deepspeed_its_own_imports(tmp_path):
    # a real DeepSpeed's __init__ imports its own modules, among them names zero refuses (deepspeed.ops.adagrad):
    # after `import zero` (no alias asked for) they must load from DeepSpeed, in either import order
    pkg = tmp_path / "site" / "deepspeed"
    (pkg / "ops" / "adagrad").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.19.8"\nfrom deepspeed.ops.adagrad import CPU\n')
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "adagrad" / "__init__.py").write_text('CPU = "real adagrad"\n')
    check = "import deepspeed; assert deepspeed.CPU == 'real adagrad', deepspeed.CPU; print(deepspeed.__file__)"
    for code in ("import zero; " + check, check + "; import zero"):
        out = _python(code, tmp_path / "site")
        assert out.returncode == 0 and out.stdout.strip() == str(pkg / "__init__.py"), out.stderr[-2000:]


def test_zero_own_alias_folder_on_the_path_is_not_a_real_deepspeed(tmp_path, monkeypatch):
    # the README's Accelerate recipe puts `python -m zero.compat`'s folder on PYTHONPATH; a script that also calls
    # install_as_deepspeed() must run (it refused, naming zero's own shim as "a real DeepSpeed")
    folder = alias.write_alias_dir(tmp_path / "alias")
    code = (
        "import zero; from zero.compat import alias; alias.install_as_deepspeed(); import deepspeed;"
        "import deepspeed.comm; assert deepspeed.__version__ == alias.VERSION_SEEN; print('served')"
    )
    out = _python(code, Path(folder))
    assert out.returncode == 0 and out.stdout.strip() == "served", out.stderr[-2000:]
    monkeypatch.syspath_prepend(folder)
    assert alias.real_deepspeed_origin() is None  # nothing else named deepspeed on this test's path
    real = tmp_path / "site" / "deepspeed"  # a real one after zero's folder is still found
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "site")])
    assert alias.real_deepspeed_origin() == str(real / "__init__.py")


def test_as_deepspeed_after_the_script_is_the_scripts_own_argument():
    from zero.commands.launcher_args import split_argv
    from zero.compat.alias import CLI_FLAGS, split_cli_flags

    head, tail = split_argv(["--nproc-per-node", "2", "--as-deepspeed", "train.py", "--as-deepspeed"], tuple(CLI_FLAGS))
    assert head == ["--nproc-per-node", "2", "--as-deepspeed", "train.py"] and tail == ["--as-deepspeed"]
    assert split_cli_flags(head, anywhere=True) == (["--nproc-per-node", "2", "train.py"], False)
    assert split_cli_flags(["--as-deepspeed-force", "--as-deepspeed", "x.py", "--as-deepspeed"]) == (
        ["x.py", "--as-deepspeed"], True)  # fmt: skip
