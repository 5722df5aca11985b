"""One family for bad input: the errors zero raises for a config key, a command-line flag or a data file the user
gave (``ConfigError`` and its ``NotSupportedError``, the CLI's ``UsageError``, ``zero train``'s ``DataError``) all
derive from :class:`InputError`, so a caller catches one class and reports one line."""


class InputError(Exception):
    """Bad input, raised before any work starts; the message names the key, flag or file, the value given and what
    is expected."""
