"""The one exception type the CLI turns into a single line on stderr and exit status 2."""


class UserError(Exception):
    """Bad input: the message names what is wrong and what to do about it."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the run stops the same way
    (workers ended, temporary folders removed) and exits 143, as a process killed by SIGTERM reports."""


def raise_terminated(signum, frame):
    raise Terminated
