"""The ``fxworkload`` command's entry point: the stop signals are handled from its first line.

This module imports nothing but the standard library's ``signal`` and ``sys`` (through errors.py)
before it installs the handlers, so that Ctrl-C, SIGTERM or SIGHUP at any instant after the interpreter
hands over ends the run with one line and its exit status: while the CLI's modules import (the signal
waits for the import to finish, errors.py), while it runs, and after it returns (the interpreter's exit).
"""

import os
import sys

from . import errors

errors.install()


def main() -> int:
    try:
        from .cli import main as run
    except (KeyboardInterrupt, errors.Terminated) as exc:
        return _stopped(exc)
    try:
        status = run()
    except (KeyboardInterrupt, errors.Terminated) as exc:
        return _stopped(exc)
    _quiet_from_now_on()
    return status


def _stopped(exc: BaseException) -> int:
    print(errors.stop_message(exc), file=sys.stderr)
    return errors.exit_status(exc)


def _quiet_from_now_on() -> None:
    """The run is over and its files written: a stop signal while the interpreter exits ends it at once,
    with its status and no traceback."""
    import signal

    def leave(signum, frame):
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os._exit(128 + signum)

    for sig in errors.STOP_SIGNALS:
        try:
            signal.signal(sig, leave)
        except ValueError:
            return
