"""Wall-clock time of work on a device: ``perf_counter_ns`` on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import statistics
import time

import torch

from ..errors import UserError


class Clock:
    """Times callables on one device; CUDA work is timed on the stream with events."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def stop(self, started) -> "Lap":
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return Lap(started, event)
        return Lap(started, time.perf_counter_ns())

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median_ns(self, fn, repeat: int = 5, warmup: int = 1, calls: int | None = None) -> float:
        """Median time of one call. On a GPU each sample times ``calls`` (default 10) calls back to
        back, so that the stream stays busy: a kernel's own time, or the launch rate where launches
        are slower; on the CPU one call by default."""
        calls = calls or (10 if self.cuda else 1)
        for _ in range(warmup):
            fn()
        laps = []
        for _ in range(repeat):
            started = self.start()
            for _ in range(calls):
                fn()
            laps.append(self.stop(started))
        self.sync()
        return statistics.median(lap.ns for lap in laps) / calls


class Lap:
    """A start and an end mark; read ``ns`` only after the clock's ``sync``."""

    __slots__ = ("begin", "end")

    def __init__(self, begin, end):
        self.begin, self.end = begin, end

    @property
    def ns(self) -> float:
        if isinstance(self.begin, int):
            return float(self.end - self.begin)
        return self.begin.elapsed_time(self.end) * 1e6  # CUDA events give milliseconds


def device_for(on: str) -> torch.device:
    """The device ``--on`` names: cpu, cuda, or auto (cuda when torch sees one)."""
    if on == "auto":
        on = "cuda" if torch.cuda.is_available() else "cpu"
    if on == "cpu":
        return torch.device("cpu")
    if on == "cuda":
        if torch.version.cuda is None:
            raise UserError(f"--on cuda: the installed torch {torch.__version__} is a CPU-only build; install a "
                            "CUDA build of torch to run on a GPU, or use --on cpu")
        if not torch.cuda.is_available():
            raise UserError("--on cuda: torch sees no CUDA device on this machine; use --on cpu")
        return torch.device("cuda", torch.cuda.current_device())
    raise UserError(f"unknown --on '{on}': use auto, cpu or cuda")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"this machine's CPU ({torch.get_num_threads()} threads)"
