"""The error every ``zero`` subcommand raises for bad command-line input (``zero.cli`` prints it)."""

from zero.errors import InputError


class UsageError(InputError):
    """Bad command-line input, reported as one line on stderr with exit code 2 before any work starts."""
