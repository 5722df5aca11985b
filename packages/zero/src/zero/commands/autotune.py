"""``zero autotune [--nproc-per-node N] [--config PATH] [--run] SCRIPT [ARGS...]`` (and ``zero run --autotuning
tune|run ...``, DeepSpeed's spelling): tune the ``autotuning`` section's space, then optionally train with the best.

The script must take its config path as an argument (``--deepspeed_config``, ``--deepspeed``, ``--config``,
``--zero_config``): every experiment replaces that value with its own config. Without ``--config`` the path is
read from those arguments. Everything after SCRIPT goes to the script untouched.
Exit codes: 0 done (and, with ``--run``, the training's own code); 1 no experiment succeeded; 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import subprocess

from zero.commands.errors import UsageError


def add_arguments(parser) -> None:
    """Options of ``zero autotune`` (before the script)."""
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per experiment (default 1)")
    parser.add_argument("--config", default=None, help="the config (default: the script's config argument)")
    parser.add_argument("--run", action="store_true", help="after tuning, train with the best config")
    parser.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module (python -m)")
    parser.add_argument("script", help="the training script (it calls zero.initialize with the config)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def run(args) -> int:
    """Entry of ``zero autotune``; see the module docstring for the exit codes."""
    return tune(args.script, list(args.script_args), args.nproc_per_node, args.config, args.run, args.module)


def tune(script: str, script_args: list[str], nproc: int, config: str | None, then_run: bool,
         module: bool = False) -> int:  # fmt: skip
    """Run a session for ``script script_args`` on ``nproc`` ranks; with ``then_run`` train with the best config.

    Raises: UsageError when the config cannot be found among the script's arguments or nproc < 1."""
    from zero.autotune import AutotuneError, Autotuner, Job
    from zero.autotune.experiment import find_config_arg
    from zero.config import ConfigError

    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be a positive integer, got {nproc}")
    index = _config_index(script_args, config, find_config_arg)
    path = config or script_args[index].split("=", 1)[-1]
    try:
        with open(path) as f:
            user_config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read as JSON: {e}") from None
    if not isinstance(user_config, dict):
        raise ConfigError(f"config file {path!r} must hold a JSON object")
    mappings = (user_config.get("autotuning") or {}).get("arg_mappings")
    job = Job(script, script_args, index, nproc, module, mappings)
    try:
        tuner = Autotuner(job, user_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        best = tuner.tune()
    except AutotuneError as e:
        print(f"zero autotune: {e}", flush=True)
        return 1
    if best is None:
        return 1
    print(f"zero autotune: best config written to {tuner.best_config_path}", flush=True)
    if not then_run:
        return 0
    cmd = job.command(tuner.best_config_path, tuner.best_config)
    print(f"zero autotune: training with the best config: {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd)


def _config_index(script_args: list[str], config: str | None, find) -> int:
    index = find(script_args)
    if config is not None:
        exact = [i for i, a in enumerate(script_args) if a == config or a.endswith("=" + config)]
        index = exact[0] if exact else index
    if index is None:
        raise UsageError("zero autotune: the script takes no config argument; pass the config to the script as "
                         "--deepspeed_config PATH (or --deepspeed / --config / --zero_config) so that each "
                         "experiment can hand it its own config")  # fmt: skip
    return index


def from_run(argv: list[str]) -> int:
    """``zero run --autotuning tune|run [--nproc-per-node N] script args`` (``argv`` from ``--autotuning`` on):
    DeepSpeed's launcher spelling. Raises: UsageError for a mode other than tune/run."""
    from zero.commands.launcher_args import launcher_parser, split_argv

    if "=" in argv[0]:
        mode, argv = argv[0].split("=", 1)[1], argv[1:]
    else:
        mode, argv = (argv[1] if len(argv) > 1 else ""), argv[2:]
    if mode not in ("tune", "run"):
        raise UsageError(f"--autotuning must be 'tune' or 'run', got {mode!r}")
    launcher_argv, script_args = split_argv(argv)
    try:
        opts = launcher_parser().parse_args(launcher_argv)
    except SystemExit as e:
        raise UsageError(f"zero run: bad launcher options {launcher_argv[:-1]}") from e
    nproc = str(opts.nproc_per_node)
    if not nproc.isdigit():
        raise UsageError(f"zero run --autotuning needs --nproc-per-node as a number, got {nproc!r}")
    return tune(opts.training_script, script_args, int(nproc), None, mode == "run", bool(opts.module))
