"""The one exception type the CLI turns into a single line on stderr and exit status 2."""


class UserError(Exception):
    """Bad input: the message names what is wrong and what to do about it."""
