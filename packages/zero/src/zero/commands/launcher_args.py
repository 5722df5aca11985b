"""The launcher side of a ``zero run`` command line: torchrun's parser and where the script starts. Shared by
``zero run``, ``zero autotune`` and the per-node runner, so none of them imports another for it."""

from __future__ import annotations

from zero.commands.errors import UsageError
from zero.commands.launch_plan import DEEPSPEED_FLAGS, flag_name


def launcher_parser():
    """torchrun's own argument parser, named ``zero run`` (its options are what ``zero run`` passes through)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "zero run"
    parser.allow_abbrev = False
    return parser


def split_argv(argv: list[str], passthrough: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """``(launcher options + script, script arguments)``: the script is the first token that is neither an
    option nor an option's value. ``-m module`` / ``--no-python cmd`` are handled as torchrun does; ``passthrough``
    names flags without a value that are zero's own (``--as-deepspeed``), stepped over among the options.

    Raises UsageError: an unknown option before the script, or no script."""
    actions = launcher_parser()._option_string_actions
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i] + argv[i + 1 : i + 2], argv[i + 2 :]
        if not tok.startswith("-") or tok == "-":
            return argv[: i + 1], argv[i + 1 :]
        name = tok.split("=", 1)[0]
        action = actions.get(name)
        if tok in passthrough:
            i += 1
        elif action is not None:
            i += 1 if ("=" in tok or action.nargs == 0) else 2
        elif flag_name(tok) in DEEPSPEED_FLAGS:
            i += 1 if ("=" in tok or not DEEPSPEED_FLAGS[flag_name(tok)][1]) else 2
        else:
            raise UsageError(f"zero run: unknown launcher option {tok!r} before the script (options go first)")
    raise UsageError("zero run: no script given (usage: zero run [--nproc-per-node N] script.py [args])")
