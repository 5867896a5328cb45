"""Errors in what the user gave (a path, a config key, an option's value), as opposed to bugs.

The message of a `UserError` names what to change. The `fastgrpo` command prints it as one line on stderr and
exits with status 2; `--debug` shows its traceback too. Every other exception keeps its traceback. `UserError` is
a `ValueError` (and `MissingPathError` also a `FileNotFoundError`), so code catching those still catches them.
"""


class UserError(ValueError):
    """Bad input; the message says what to change."""


class MissingPathError(UserError, FileNotFoundError):
    """A file, directory or package that the input names does not exist."""
