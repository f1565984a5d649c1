"""The bounds on every count a user gives, in one place, checked before any work starts.

Each is far beyond any real run (the largest trainings so far use about 10^5 GPUs, 10^3
micro-batches, global batches of a few thousand sequences and contexts of about 10^6 tokens): a
figure past one is a typo, and would make a sweep hang or an output of absurd size.
"""

from __future__ import annotations

import os

from .errors import UserError

MAX_WORLD = 1 << 20  # GPUs
MAX_MICRO_BATCHES = 1 << 14  # per step and pipeline
MAX_GLOBAL_BATCH = 1 << 22  # sequences per step
MAX_BATCH = 1 << 16  # sequences per micro-batch
MAX_SEQ = 1 << 24  # tokens per sequence
MAX_TOKENS = 1 << 26  # tokens per micro-batch
MAX_LAYERS = 4096  # decoder layers of a model
MAX_VOCAB_MULTIPLE = 1 << 16
MAX_BUCKET_MB = 1 << 20


STEP_DTYPES = ("fp32", "bf16", "fp16")  # dtypes.DTYPES's names, here without torch


def check_settings(batch: int, seq: int | None, dtype: str, grad_dtype: str | None = None) -> None:
    """A step's batch, sequence and dtypes, before any work starts."""
    for name, value, limit in (("batch", batch, MAX_BATCH), ("seq", seq, MAX_SEQ)):
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be a positive integer, got {value}")
        if value is not None and value > limit:
            raise UserError(f"--{name} {value:,} exceeds {limit:,}, more than any real training step; check it")
    if seq is not None and batch * seq > MAX_TOKENS:
        raise UserError(f"--batch x --seq = {batch * seq:,} tokens per micro-batch exceeds {MAX_TOKENS:,}; "
                        "use a smaller --batch (and more --micro-batches)")
    for name, value in (("dtype", dtype), ("grad-dtype", grad_dtype)):
        if value is not None and value not in STEP_DTYPES:
            raise UserError(f"unknown --{name} '{value}': use one of {', '.join(STEP_DTYPES)}")


def check_count(option: str, value, limit: int, hint: str = "check it") -> None:
    """A positive integer no larger than ``limit``; else one line naming the option, the value and the limit."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{option} must be a positive integer, got {value}")
    if value > limit:
        raise UserError(f"{option} {value:,} exceeds {limit:,}, more than any real run; {hint}")


def cores() -> int:
    """The CPUs this process may run on: its affinity mask where the OS keeps one (taskset, a container's
    cpuset), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS and Windows keep no affinity mask
        return os.cpu_count() or 1


def check_workers(workers: int | None) -> None:
    """A local worker is a process that loads torch and evaluates shapes on a core: at least one, and no more
    than the cores (more would only take memory, up to 4.3 GB a worker: docs/limits.md; a count such as 10**6 would start
    processes until the machine ran out of it, with a stop signal held until the pool was whole)."""
    if workers is None:
        return
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    most = cores()
    if workers > most:
        raise UserError(f"--workers {workers} is more than the {most} cores this process may use: each worker "
                        f"is a process that evaluates on a core of its own; use at most {most} (the default, one "
                        "per core)")


SUM_OF_OPS_TOLERANCE = 0.25  # the ops' medians and the eager step disagree by more: the timings are not to be trusted


def sum_of_ops_warning(totals: dict) -> str | None:
    """On a CPU (no profiler timer) each op's median is a wall time of its own: their sum should be near the
    eager step's; far off, something else ran beside the timing, or the clock timer's per-op cost dominates."""
    ops, eager = totals["step_measured_ns"], totals["eager_step_ns"]
    if "kernel_check" in totals or not eager or abs(ops / eager - 1) <= SUM_OF_OPS_TOLERANCE:
        return None
    return (f"WARNING: the ops' medians add up to {ops / 1e6:.1f} ms but the eager step took {eager / 1e6:.1f} ms "
            f"({ops / eager - 1:+.0%}): the op timings are not to be trusted (other work on the machine, or ops "
            "too small for the clock); profile again on a quiet machine, or with more --repeat")
