"""The ``fxworkload`` command's entry point: the stop signals are handled from its first line.

This module imports nothing but the standard library's ``signal`` and ``sys`` (through errors.py)
before it installs the handlers, so that Ctrl-C, SIGTERM or SIGHUP at any instant after the interpreter
hands over ends the run with one line and its exit status: while the CLI's modules import (the signal
waits for the import to finish, errors.py), while it runs, and after it returns (the interpreter's exit).
"""

import signal
import sys

from . import errors

_HELD: list[int] = []


def _hold(signum, frame):
    """Until main() runs (the console script's own lines come between), a stop signal is held, not raised:
    raising there would be a traceback in the script, outside any handler of ours."""
    _HELD.append(signum)


def _spawned_child() -> bool:
    """A multiprocessing worker runs the command's main module again (spawn), which imports this one: its
    signals are its pool's (SIGTERM from Pool.terminate must end it at once, not be held). multiprocessing
    marks a child it is preparing so (multiprocessing/spawn.py, _main: current_process()._inheriting = True,
    while it runs the main module with the parent's sys.argv); the command itself has not imported it."""
    process = sys.modules.get("multiprocessing.process")
    return process is not None and bool(getattr(process.current_process(), "_inheriting", False))


for _sig in () if _spawned_child() else errors.STOP_SIGNALS:
    try:
        signal.signal(_sig, _hold)
    except ValueError:  # imported outside the main thread: not the command's entry
        break


def main() -> int:
    try:
        errors.install()
        if _HELD:
            raise errors.stop(_HELD[0])
        from .cli import main as run

        # a signal during the import: held for it, or raised where Python ignores exceptions (a destructor run
        # meanwhile) and so swallowed; the CLI's start forgets earlier runs' signals, so it is raised here
        errors.check_signalled()
        status = run()
        errors.finish()  # the run is over, its files written: a signal from here on exits at once, quietly
    except (KeyboardInterrupt, errors.Terminated) as exc:  # a second signal waits: this one is stopping the run
        status = _stopped(exc)
        errors.finish()
    return status


def _stopped(exc: BaseException) -> int:
    print(errors.stop_message(exc), file=sys.stderr)
    return errors.exit_status(exc)
