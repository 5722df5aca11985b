"""The `zero` command line (run, report, train, consolidate, plot)."""

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zero` command. Subcommands land with the engine issue; until then this fails loudly."""
    argv = sys.argv[1:] if argv is None else argv
    print(f"zero: subcommand {argv[:1]} is not built yet (see the engine issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
