"""``zero run [torchrun options] script.py [script args]``: torchrun, with the script's arguments untouched.

torchrun's own parser matches option prefixes even after the script name (a script flag ``--d`` was taken as a
launcher flag, baselines.md). Here only the part before the script goes through torchrun's parser (with
abbreviations off); the script's arguments are handed to the launched processes as they are.
"""

from __future__ import annotations

import sys

from zero.cli import UsageError


def add_arguments(parser) -> None:  # `zero run` bypasses argparse (see zero.cli.main); kept for the registry
    """No-op: ``zero run`` parses its launcher options with torchrun's own parser."""


def _launcher_parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "zero run"
    parser.allow_abbrev = False
    return parser


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launcher options + script, script arguments)``: the script is the first token that is neither an
    option nor an option's value. ``-m module`` / ``--no-python cmd`` are handled as torchrun does."""
    actions = _launcher_parser()._option_string_actions
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i] + argv[i + 1 : i + 2], argv[i + 2 :]
        if not tok.startswith("-") or tok == "-":
            return argv[: i + 1], argv[i + 1 :]
        name = tok.split("=", 1)[0]
        action = actions.get(name)
        if action is None:
            raise UsageError(f"zero run: unknown launcher option {tok!r} before the script (options go first)")
        i += 1 if ("=" in tok or action.nargs == 0) else 2
    raise UsageError("zero run: no script given (usage: zero run [--nproc-per-node N] script.py [args])")


def validate_nproc(value: str) -> None:
    """torchrun accepts a positive integer or auto/cpu/gpu/xpu; anything else is a one-line error here."""
    if value in ("auto", "cpu", "gpu", "xpu"):
        return
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"--nproc-per-node must be a positive integer (or auto/cpu/gpu), got {value!r}")


def launch(launcher_argv: list[str], script_args: list[str]) -> None:
    """Run torchrun (``torch.distributed.run.run``) with ``launcher_argv`` and untouched ``script_args``.

    Raises: UsageError for bad launcher options; torch's ChildFailedError when a rank fails.
    """
    parser = _launcher_parser()
    try:
        args = parser.parse_args(launcher_argv)
    except SystemExit as e:
        raise UsageError(f"zero run: bad launcher options {launcher_argv[:-1]}") from e
    validate_nproc(str(args.nproc_per_node))
    args.training_script_args = list(script_args)
    from torch.distributed.run import run

    run(args)


def main(argv: list[str]) -> int:
    """``zero run`` entry: returns 0, or 1 when a rank failed (torchrun's summary is printed)."""
    if argv in ([], ["-h"], ["--help"]):
        _launcher_parser().print_help()
        return 0 if argv else 2
    if argv[0].split("=", 1)[0] == "--autotuning":  # DeepSpeed's `--autotuning tune|run` (zero autotune)
        from zero.commands.autotune import from_run

        return from_run(argv)
    launcher_argv, script_args = split_argv(argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch(launcher_argv, script_args)
    except ChildFailedError as e:
        print(f"zero run: {e}", file=sys.stderr)
        return 1
    return 0
