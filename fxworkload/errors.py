"""The exceptions the CLI turns into one line on stderr and an exit status, and the signals that stop a run.

Three signals stop a run: Ctrl-C (SIGINT, exit 130), SIGTERM (143) and SIGHUP (129, a closed terminal
or an ssh session gone), each with the status a shell reports for a process the signal killed. Each is
raised in the main thread (KeyboardInterrupt, or Terminated), so that the run stops as an error does:
workers ended, temporary folders removed, nothing half written.

Except while a module is being imported: an exception raised inside an import leaves a half-initialised
module behind (a later import of a C extension then fails with "cannot load module more than once per
process"), and inside torch's C++ it can abort the process. A signal that arrives then is remembered,
and raised as soon as no import is running (a timer checks every ``RETRY_S``).
"""

import contextlib
import signal

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
RETRY_S = 0.02


class UserError(Exception):
    """Bad input: the message names what is wrong and what to do about it."""


class Refused(UserError):
    """The system refused what the run needed (a full disk, a permission): one line, exit status 1."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the run stops the same
    way (workers ended, temporary folders removed) and exits 128 + the signal, as a process it killed reports."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


_SIGNALLED: list[int] = []  # every stop signal this run received
_PENDING: list[int] = []  # a stop signal held until the import running when it came has finished
# "stopping": a stop was raised and is unwinding the run (its handlers and clean-ups must not be cut by a
# second one); "finished": the command is over, its output written (a signal now ends the process at once)
_STATE = {"stopping": False, "finished": False}


def exit_status(exc: BaseException) -> int:
    """128 + the signal that stopped the run."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def stop_message(exc: BaseException) -> str:
    if isinstance(exc, Terminated) and exc.signum == getattr(signal, "SIGHUP", None):
        return "fxworkload: hung up"
    return "fxworkload: terminated" if isinstance(exc, Terminated) else "fxworkload: interrupted"


def stop(signum: int) -> BaseException:
    """The exception that stops the run for ``signum``; from now on the run is stopping (see _STATE)."""
    _STATE["stopping"] = True
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def on_signal(signum, frame):
    """A stop signal stops the run (see the module), unless an import is running: then it waits for its end.
    Signals are also remembered, so that one swallowed by a library's bare ``except`` still stops the run
    before it writes anything (``check_signalled``)."""
    _SIGNALLED.append(signum)
    if _STATE["finished"]:
        _exit_now(signum)
    if _STATE["stopping"]:
        return  # the stop under way ends the run
    if _importing(frame):
        if not _PENDING:
            _PENDING.append(signum)
            signal.signal(signal.SIGALRM, _retry)
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    raise stop(signum)


def _retry(signum, frame):
    if _importing(frame):
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    if _PENDING and not _STATE["stopping"]:
        raise stop(_PENDING.pop())


def finish() -> None:
    """The command is over, its output written or refused: a stop signal from now on is ignored, and the
    process exits with the run's own status. Python's finalization (0.8 s after a run that imported torch)
    resets every Python-level handler to the default first (CPython's _PySignal_Fini), so a signal then
    would kill the process with no line; it leaves an ignored signal ignored. Blocking would not do: a
    signal goes to any thread that does not block it (tqdm's monitor, say)."""
    _STATE["finished"] = True
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):
            pass


def _exit_now(signum: int) -> None:
    import os
    import sys

    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(128 + signum)


def _importing(frame) -> bool:
    """Whether the main thread is inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def install() -> dict:
    """``on_signal`` for every stop signal; the handlers it replaced ({} outside the main thread, where
    signals are not delivered: an embedding program keeps its own)."""
    try:
        return {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    except ValueError:
        return {}


def restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def record_signal(signum, frame):
    """Remember the signal and let the work go on: where raising would cross C++ (torch's and
    transformers' imports, pybind11 aborts the process on a Python exception it cannot pass on),
    the caller checks afterwards (``check_signalled``)."""
    _SIGNALLED.append(signum)


def signalled() -> int | None:
    """The stop signal this run received (SIGTERM or SIGHUP before Ctrl-C), or None."""
    if not _SIGNALLED:
        return None
    return next((s for s in _SIGNALLED if s != signal.SIGINT), signal.SIGINT)


def check_signalled() -> None:
    if _SIGNALLED:
        if _PENDING:  # held for an import: this raise is its stop, so the timer that would raise it again goes
            _PENDING.clear()  # (left armed, it would fire at the interpreter's exit, its handler reset: SIGALRM)
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
        raise stop(next((s for s in _SIGNALLED if s != signal.SIGINT), signal.SIGINT))


def clear_signalled() -> None:
    """Forget the signals of an earlier run in this process (one held for an import still stops this one)."""
    _SIGNALLED.clear()
    _STATE["stopping"] = False


@contextlib.contextmanager
def signals_held():
    """Hold every stop signal until the block ends, then raise the first: a swap, a clean-up or a model
    build is never cut in half. Outside the main thread (signals are not delivered there) a plain block."""
    received: list[int] = []
    try:
        previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in STOP_SIGNALS}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        restore(previous)
        if received:
            _SIGNALLED.extend(received)
            raise stop(next((s for s in received if s != signal.SIGINT), signal.SIGINT))
