"""Progress for long work: a bar on a terminal (tqdm, where a command draws one), and where stderr is
a file or a pipe a line at least every ``EVERY_S`` seconds, so that a log shows the run is alive."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from typing import Callable


def _every_s() -> float:
    """$FXWORKLOAD_PROGRESS_EVERY_S where it is a positive number of seconds, else 10."""
    try:
        value = float(os.environ.get("FXWORKLOAD_PROGRESS_EVERY_S", "10"))
    except ValueError:
        return 10.0
    return value if value > 0 and math.isfinite(value) else 10.0


EVERY_S = _every_s()
_STAGE = ["starting"]  # what the run said it is doing last: what a heartbeat names


def say(text: str) -> None:
    set_stage(text)
    _line(text)


def _line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def set_stage(text: str) -> None:
    """What the run is doing now, for the heartbeat, without a line of its own."""
    _STAGE[0] = text.rstrip(". ")


def stage() -> str:
    return _STAGE[0]


def on_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


@contextlib.contextmanager
def heartbeat(what: str | Callable[[], str], every_s: float | None = None, out: Callable[[str], None] = _line):
    """While the block runs, ``out`` a line every ``every_s`` seconds (default EVERY_S): ``what`` (or what
    it returns) and the seconds so far."""
    every_s = EVERY_S if every_s is None else every_s
    stop = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            out(f"{what() if callable(what) else what} ({time.monotonic() - started:.0f} s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
