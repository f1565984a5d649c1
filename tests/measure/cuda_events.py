"""Synthetic CUDA events for CPU profiler traces (no GPU here): kernels of known durations, each
launched through cudaLaunchKernel and linked to it by correlation id, as Kineto writes them."""

from __future__ import annotations

import json

# Ops that launch no kernel on CUDA (views, aliases, allocations): they get none here either.
NO_KERNEL = frozenset({"aten::view", "aten::as_strided", "aten::transpose", "aten::expand", "aten::unsqueeze",
                       "aten::t", "aten::reshape", "aten::_reshape_alias", "aten::detach", "detach", "aten::slice",
                       "aten::select", "aten::empty", "aten::empty_like", "aten::empty_strided",
                       "aten::resolve_conj", "aten::lift_fresh"})
GPU_PID, STREAM = 0, 7


def kernel(name: str, ts: float, duration_us: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": GPU_PID, "tid": STREAM, "ts": ts, "dur": duration_us,
            "args": {"correlation": correlation, "stream": STREAM, "device": 0}}


def launch(parent: dict, ts: float, launch_us: float, name: str, duration_us: float, correlation: int,
           kernel_ts: float | None = None) -> list[dict]:
    """A cudaLaunchKernel on ``parent``'s thread at ``ts`` and the kernel it launches."""
    runtime = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": parent["pid"],
               "tid": parent["tid"], "ts": ts, "dur": launch_us, "args": {"correlation": correlation}}
    return [runtime, kernel(name, ts if kernel_ts is None else kernel_ts, duration_us, correlation)]


def write(document: dict, added: list[dict], path) -> None:
    """The trace with the events added, on an H100 as the profiler names it."""
    document["traceEvents"] += added
    document["deviceProperties"] = [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}]
    path.write_text(json.dumps(document))


def with_structural_times(trace_path, out_path) -> None:
    """The trace with every timestamp replaced by its rank among all the trace's timestamps (in µs): order and
    nesting as recorded, an op lasting as many ranks as boundaries fall inside it. A share of op time read from
    it says what was tied, not how long a loaded machine took (CI's is shared: one preempted op swings a real
    trace's shares by several percent; bench/lent_gpus.py quotes real ones)."""
    document = json.loads(trace_path.read_text())
    events = [e for e in document["traceEvents"] if "ts" in e]
    bounds = sorted({float(e["ts"]) for e in events} | {float(e["ts"]) + float(e.get("dur", 0)) for e in events})
    rank = {t: i for i, t in enumerate(bounds)}
    for e in events:
        start, end = rank[float(e["ts"])], rank[float(e["ts"]) + float(e.get("dur", 0))]
        e["ts"] = start
        if "dur" in e:
            e["dur"] = end - start
    out_path.write_text(json.dumps(document))
