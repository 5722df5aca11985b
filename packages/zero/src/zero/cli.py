"""The ``zero`` command: a registry of subcommands, each a module with ``add_arguments(parser)`` and ``run(args)``.

To add a subcommand (e.g. ``zero plot``), add one entry to ``COMMANDS``; modules are imported only when used, so
``zero report`` never pays for importing transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from zero.commands.errors import UsageError  # noqa: F401 - importable from zero.cli, as before
from zero.errors import InputError

# name -> (module with add_arguments/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("zero.commands.run", "launch a training script on N ranks through torchrun"),
    "report": ("zero.commands.report", "versions of torch, CUDA and every zero package; ops built or buildable"),
    "train": ("zero.commands.train", "pretrain a Llama model on real text (the main job)"),
    "consolidate": ("zero.commands.consolidate", "merge a sharded checkpoint into one fp32 safetensors file"),
    "plot": ("zero.commands.plot", "draw a run log's step-time breakdown and loss curve to PNG"),
    "autotune": ("zero.commands.autotune", "find the fastest stage, micro-batch and buckets that fit"),
}


def _parser(name: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero", description="zero: ZeRO training, DeepSpeed-compatible.",
                                     allow_abbrev=False)  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(cmd, help=help_text, description=help_text, allow_abbrev=False)
        if cmd == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zero``. Returns the exit code (0 success, 2 usage/input error, else the command's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # the script's own arguments must not pass through any argparse
        from zero.commands import run as run_cmd

        return _guard(lambda: run_cmd.main(argv[1:]))
    name = argv[0] if argv and argv[0] in COMMANDS else None
    args = _parser(name).parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return _guard(lambda: module.run(args))


def _guard(fn) -> int:
    try:
        return int(fn() or 0)
    except InputError as e:  # a config key, a flag or a data file: one line
        print(f"zero: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python -m zero.cli`: use the importable module, so its InputError is the one raised
    from zero.cli import main as _main

    sys.exit(_main())
