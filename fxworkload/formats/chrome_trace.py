"""One rank's estimated training step as a Chrome / Perfetto trace (JSON, times in microseconds).

The timeline follows the SimAI policy the units describe, on one rank: for each micro-batch the
units run forward in order, then backward in reverse (input gradient, then weight gradient); a
tensor- or expert-parallel collective blocks compute until it ends. Data-parallel collectives run
on their own stream once the last micro-batch's backward reaches their row, one after another.
Collective times are NCCL's ring cost model (cluster/network.py), over NVLink when the group fits
in one node (Megatron-LM's rank order: tp innermost, then ep/dp) and over the network otherwise.
Pipeline waits are not in this rank's timeline; the cluster's (one process per stage, every
micro-batch's passes under the 1F1B or interleaved schedule) follows it in the same file.
"""

from __future__ import annotations

import json

from ..capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from ..cluster.network import check_device, comm_ns
from ..cost.devices import DeviceProfile
from ..parallel.layout import Parallel
from ..parallel.rank import RankWorkload
from ..parallel.units import Unit

COMPUTE, MODEL_PARALLEL_COMM, DATA_PARALLEL_COMM = 0, 1, 2
THREADS = {COMPUTE: "compute", MODEL_PARALLEL_COMM: "tp/ep collectives", DATA_PARALLEL_COMM: "dp collectives"}


def trace_json(rank: RankWorkload, device: DeviceProfile, cluster=None, stack: str = "eager") -> str:
    check_device(device, rank.parallel)
    timeline = _Timeline(rank.parallel, device)
    compute_units = [u for u in rank.units if u.block != "dp"]
    for micro_batch in range(rank.parallel.micro_batches):
        last = micro_batch == rank.parallel.micro_batches - 1
        for unit in compute_units:
            timeline.compute(unit, FORWARD, micro_batch)
        for unit in reversed(rank.units):
            if unit.block == "dp":
                if last:
                    timeline.data_parallel(unit)
                continue
            timeline.compute(unit, INPUT_GRAD, micro_batch)
            timeline.compute(unit, WEIGHT_GRAD, micro_batch)
    meta = [{"name": "thread_name", "ph": "M", "pid": rank.parallel.stage, "tid": tid, "args": {"name": name}}
            for tid, name in THREADS.items()]
    meta.append({"name": "process_name", "ph": "M", "pid": rank.parallel.stage, "tid": 0,
                 "args": {"name": f"pipeline stage {rank.parallel.stage}, tensor-parallel rank 0"}})
    events = meta + timeline.events
    other = {"step_ns": round(timeline.end_ns()), "parallel": rank.parallel.as_dict(), "device": device.name,
             "stack": stack}
    if cluster is not None:
        events += cluster_events(cluster)
        other["cluster_step_ns"] = round(cluster.step_ns)
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}, indent=1) + "\n"


CLUSTER_PID = 1000  # the cluster's timeline: one process per pipeline stage, after the rank's units


def cluster_events(cluster) -> list[dict]:
    """Every stage's passes under the pipeline schedule, its data-parallel buckets, ZeRO's gathers and the
    optimizer step (cluster/step.py): the last span ends at the cluster's step."""
    events = []
    for d in range(cluster.parallel.pp):
        pid = CLUSTER_PID + d
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"cluster: pipeline stage {d} (every micro-batch)"}})
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                   for tid, name in ((COMPUTE, "passes (compute and tp/ep collectives)"),
                                     (DATA_PARALLEL_COMM, "dp collectives"))]
    for x in cluster.passes:
        name = f"{'forward' if x.kind == 'F' else 'backward'} mb{x.micro_batch}" + (
            f" chunk{x.chunk}" if cluster.parallel.vpp > 1 else "")
        events.append(_cluster_span(name, "pass", x.device, COMPUTE, x.start_ns, x.end_ns, micro_batch=x.micro_batch))
        gather = cluster.devices[x.device].zero3_gather_ns[0 if x.kind == "F" else 1]
        if gather > 0:
            events.append(_cluster_span("ZeRO 3 parameter gather", "comm", x.device, DATA_PARALLEL_COMM, x.start_ns,
                                        x.start_ns + gather, micro_batch=x.micro_batch))
    for device, name, start, end, nbytes in cluster.data_parallel_spans:
        events.append(_cluster_span(name, "comm", device, DATA_PARALLEL_COMM, start, end, bytes=nbytes))
    for d in cluster.devices:  # the step's end: the optimizer after the last pass and bucket, then ZeRO 1/2's gathers
        if d.bucket_slowdown_ns > 0:
            events.append(_cluster_span("backward slowed by dp buckets (SMs held by NCCL)", "compute", d.device,
                                        COMPUTE, d.pipeline_end_ns - d.bucket_slowdown_ns, d.pipeline_end_ns))
        start = max(d.pipeline_end_ns, d.data_parallel_end_ns)
        if d.optimizer_ns > 0:
            events.append(_cluster_span("optimizer step (Adam)", "compute", d.device, COMPUTE, start,
                                        start + d.optimizer_ns))
        if d.zero_gather_ns > 0:
            events.append(_cluster_span("ZeRO parameter gather", "comm", d.device, DATA_PARALLEL_COMM,
                                        start + d.optimizer_ns, d.end_ns))
    return events


def _cluster_span(name: str, category: str, device: int, tid: int, start_ns: float, end_ns: float, **args) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": CLUSTER_PID + device, "tid": tid, "ts": _us(start_ns),
            "dur": round(_us(end_ns) - _us(start_ns), 3), "args": args}


class _Timeline:
    def __init__(self, parallel: Parallel, device: DeviceProfile):
        self.parallel, self.device = parallel, device
        self.now_ns = 0.0  # the compute stream's clock
        self.dp_free_ns = 0.0  # when the data-parallel stream is next free
        self.events: list[dict] = []

    def compute(self, unit: Unit, phase: str, micro_batch: int) -> None:
        duration = unit.ns(phase)
        if duration > 0:
            self._span(f"{unit.name} {phase}", "compute", COMPUTE, self.now_ns, duration, micro_batch=micro_batch)
            self.now_ns += duration
        if phase == WEIGHT_GRAD:
            return
        for comm in unit.comms[phase]:
            duration = comm_ns(comm, self.parallel, self.device)
            self._span(f"{comm.type} {comm.group}", "comm", MODEL_PARALLEL_COMM, self.now_ns, duration,
                       micro_batch=micro_batch, what=comm.what, bytes=comm.bytes)
            self.now_ns += duration

    def data_parallel(self, unit: Unit) -> None:
        for comm in unit.comms[WEIGHT_GRAD]:
            start = max(self.now_ns, self.dp_free_ns)
            duration = comm_ns(comm, self.parallel, self.device)
            self._span(f"{unit.name}", "comm", DATA_PARALLEL_COMM, start, duration, what=comm.what, bytes=comm.bytes)
            self.dp_free_ns = start + duration

    def end_ns(self) -> float:
        return max(self.now_ns, self.dp_free_ns)

    def _span(self, name: str, category: str, tid: int, start_ns: float, duration_ns: float, **args) -> None:
        self.events.append({"name": name, "cat": category, "ph": "X", "pid": self.parallel.stage, "tid": tid,
                            "ts": _us(start_ns), "dur": round(_us(start_ns + duration_ns) - _us(start_ns), 3),
                            "args": args})


def _us(ns: float) -> float:
    """Microseconds to the nanosecond; spans are cut from rounded end points so that they abut exactly."""
    return round(ns / 1e3, 3)
