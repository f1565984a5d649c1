"""The exceptions the CLI turns into one line on stderr and an exit status, and the signals that stop a run."""

import signal


class UserError(Exception):
    """Bad input: the message names what is wrong and what to do about it."""


class Refused(UserError):
    """The system refused what the run needed (a full disk, a permission): one line, exit status 1."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the run stops the same way
    (workers ended, temporary folders removed) and exits 143, as a process killed by SIGTERM reports."""


_SIGNALLED: list[int] = []  # every SIGINT / SIGTERM this run received


def on_signal(signum, frame):
    """Ctrl-C and SIGTERM stop the run; they are also remembered, so that one swallowed by a library's
    bare ``except`` (while it imports, say) still stops the run before it writes anything."""
    _SIGNALLED.append(signum)
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def record_signal(signum, frame):
    """Remember the signal and let the work go on: where raising would cross C++ (torch's and
    transformers' imports, pybind11 aborts the process on a Python exception it cannot pass on),
    the caller checks afterwards (``check_signalled``)."""
    _SIGNALLED.append(signum)


def check_signalled() -> None:
    if _SIGNALLED:
        raise Terminated if signal.SIGTERM in _SIGNALLED else KeyboardInterrupt


def clear_signalled() -> None:
    _SIGNALLED.clear()
