"""Subcommands of the ``zero`` CLI (registered in zero.cli.COMMANDS)."""
