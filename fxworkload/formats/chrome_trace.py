"""One rank's estimated training step as a Chrome / Perfetto trace (JSON, times in microseconds).

The rank's timeline lays its units inside its stage's passes as the cluster step times them (each pass
from its start under the 1F1B or interleaved schedule): forward in order, backward in reverse (input
gradient, then weight gradient); a tensor- or expert-parallel collective blocks compute until it ends,
CP's ring runs beside its unit's compute, and so do --tp-comm-overlap's collectives, the pass waiting after its
compute for what they outlast what they overlap by (cluster/step.py). Its data-parallel spans, optimizer and ZeRO gathers are the
step's own, so every span ends by the step. Collective times are NCCL's tuner on the device's topology (cluster/network.py). The cluster's
timeline (one process per stage) follows the rank's in the same file.
"""

from __future__ import annotations

import json

from ..capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from ..cluster.network import check_device, comm_ns
from ..cluster.step import blocking_tp_copies_ns, exposed_by_ns
from ..cost.devices import DeviceProfile
from ..parallel.layout import Parallel
from ..parallel.rank import RankWorkload
from ..parallel.units import Unit

COMPUTE, MODEL_PARALLEL_COMM, DATA_PARALLEL_COMM, HOST_COPIES = 0, 1, 2, 3
THREADS = {COMPUTE: "compute", MODEL_PARALLEL_COMM: "tp/ep collectives", DATA_PARALLEL_COMM: "dp collectives"}
HOST_COPIES_THREAD = "activation copies to and from the host (one offload stream)"
WAITING_BESIDE = "waiting for the collectives beside its compute"  # CP's ring, --tp-comm-overlap's
SEQUENCE_DIM_COPIES = "copies around its tensor-parallel collectives (sequence on dim 1)"


def trace_json(rank: RankWorkload, device: DeviceProfile, cluster, stack: str = "eager") -> str:
    check_device(device, rank.parallel)
    timeline = _Timeline(rank.parallel, device)
    _rank_in_the_cluster(timeline, cluster, rank.parallel.stage)
    threads = THREADS | ({HOST_COPIES: HOST_COPIES_THREAD} if cluster.activation_copies else {})
    meta = [{"name": "thread_name", "ph": "M", "pid": rank.parallel.stage, "tid": tid, "args": {"name": name}}
            for tid, name in threads.items()]
    meta.append({"name": "process_name", "ph": "M", "pid": rank.parallel.stage, "tid": 0,
                 "args": {"name": f"pipeline stage {rank.parallel.stage}, tensor-parallel rank 0"}})
    events = meta + timeline.events
    other = {"step_ns": round(timeline.end_ns()), "parallel": rank.parallel.as_dict(), "device": device.name,
             "stack": stack, "cluster_step_ns": round(cluster.step_ns)}
    events += cluster_events(cluster)
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}, indent=1) + "\n"


def _rank_in_the_cluster(timeline: "_Timeline", cluster, stage: int) -> None:
    """The rank's units inside its stage's passes as the cluster step times them (each pass from its start
    under the pipeline schedule), its gradient buckets and ZeRO's spans where the step runs them, and the
    optimizer: every span ends by the step's end (the rank's device's ``end_ns``)."""
    chunks = cluster.device_chunks[stage]
    for kind, chunk, micro_batch, start, _ in cluster.device_passes[stage]:
        timeline.now_ns = start
        order = chunks[chunk] if kind == "F" else list(reversed(chunks[chunk]))
        waits = cluster.copy_waits(order, kind == "F")
        for unit in order:
            if id(unit) in waits:  # --activation-offload-layers: the layer waits for an activation copy first
                timeline.span("waiting for activation copies", "offload", COMPUTE, timeline.now_ns, waits[id(unit)],
                              micro_batch=micro_batch)
                timeline.now_ns += waits[id(unit)]
            if kind == "F":
                timeline.compute(unit, FORWARD, micro_batch)
            else:
                timeline.compute(unit, INPUT_GRAD, micro_batch)
                timeline.compute(unit, WEIGHT_GRAD, micro_batch)
        if kind == "F":
            for name, at, end in copy_spans(cluster, start):
                timeline.span(name, "offload", HOST_COPIES, at, end - at, micro_batch=micro_batch)
    for device, name, start, end, nbytes in cluster.data_parallel_spans:
        if device == stage:
            timeline.span(name, "comm", DATA_PARALLEL_COMM, start, end - start, bytes=nbytes)
    summary = cluster.devices[stage]
    start = max(summary.pipeline_end_ns, summary.data_parallel_end_ns)
    if summary.optimizer_ns > 0:
        timeline.span("optimizer step (Adam)", "compute", COMPUTE, start, summary.optimizer_ns)
    if summary.zero_gather_ns > 0:
        timeline.span(_gather_name(cluster.parallel), "comm", DATA_PARALLEL_COMM, start + summary.optimizer_ns,
                      summary.zero_gather_ns)
    timeline.now_ns = summary.end_ns


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
                                     (DATA_PARALLEL_COMM, "dp collectives"),
                                     *([(HOST_COPIES, HOST_COPIES_THREAD)] if cluster.activation_copies else []))]
    for x in cluster.passes:
        name = f"{'forward' if x.kind == 'F' else 'backward'} mb{x.micro_batch}" + (
            f" chunk{x.chunk}" if cluster.parallel.vpp > 1 else "")
        events.append(_cluster_span(name, "pass", x.device, COMPUTE, x.start_ns, x.end_ns, micro_batch=x.micro_batch))
        if x.kind == "F":
            events += [_cluster_span(copy, "offload", x.device, HOST_COPIES, at, end, micro_batch=x.micro_batch)
                       for copy, at, end in copy_spans(cluster, x.start_ns)]
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
            events.append(_cluster_span(_gather_name(cluster.parallel), "comm", d.device, DATA_PARALLEL_COMM,
                                        start + d.optimizer_ns, d.end_ns))
    return events


def copy_spans(cluster, forward_start_ns: float) -> list[tuple[str, float, float]]:
    """--activation-offload-layers: one micro-batch's copies out and back, from its forward's start."""
    if cluster.activation_copies is None:
        return []
    spans = []
    for layer, (out_start, out_end, back_start, back_end) in zip(cluster.offload_layer_ids,
                                                                 cluster.activation_copies.copies_ns):
        spans += [(f"layer {layer} activations to the host", forward_start_ns + out_start, forward_start_ns + out_end),
                  (f"layer {layer} activations back", forward_start_ns + back_start, forward_start_ns + back_end)]
    return spans


def _gather_name(p: Parallel) -> str:
    """ZeRO 1/2's parameter gathers after the optimizer, or (--overlap-param-gather) what of them the next
    forward waits for, laid at the step's end as the time the step owes them."""
    return "ZeRO parameter gather (exposed under the next forward)" if p.overlap_param_gather else \
        "ZeRO parameter gather"


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
        duration = unit.pass_ns(phase)
        start = self.now_ns
        if duration > 0:
            self._span(f"{unit.name} {phase}", "compute", COMPUTE, start, duration, micro_batch=micro_batch)
            self.now_ns += duration
        if phase == WEIGHT_GRAD:
            return
        beside = start  # CP's ring and --tp-comm-overlap's collectives run beside the unit's compute, from its start
        for comm in (c for c in unit.comms[phase] if c.overlapped):
            duration = comm_ns(comm, self.parallel, self.device)
            self._span(f"{comm.type} {comm.group}", "comm", MODEL_PARALLEL_COMM, beside, duration,
                       micro_batch=micro_batch, what=comm.what, bytes=comm.bytes)
            beside += duration
        waited = exposed_by_ns(unit, phase, [c for c in unit.comms[phase] if c.overlapped], self.parallel, self.device)
        if waited > 0:  # what they outlast the GEMMs (CP: the attention core) they overlap by; AsyncTP's own kernels
            self._span(WAITING_BESIDE, "comm", COMPUTE, self.now_ns, waited, micro_batch=micro_batch)
            self.now_ns += waited
        copies_ns = blocking_tp_copies_ns(unit, phase, self.device)
        if copies_ns > 0:  # torch's copies around its blocking collectives on the sequence dim
            self._span(SEQUENCE_DIM_COPIES, "compute", COMPUTE, self.now_ns, copies_ns, micro_batch=micro_batch)
            self.now_ns += copies_ns
        for comm in (c for c in unit.comms[phase] if not c.overlapped):
            duration = comm_ns(comm, self.parallel, self.device)
            self._span(f"{comm.type} {comm.group}", "comm", MODEL_PARALLEL_COMM, self.now_ns, duration,
                       micro_batch=micro_batch, what=comm.what, bytes=comm.bytes)
            self.now_ns += duration

    def span(self, name: str, category: str, tid: int, start_ns: float, duration_ns: float, **args) -> None:
        self._span(name, category, tid, start_ns, duration_ns, **args)
        if tid == DATA_PARALLEL_COMM:
            self.dp_free_ns = max(self.dp_free_ns, start_ns + duration_ns)

    def end_ns(self) -> float:
        return max(self.now_ns, self.dp_free_ns)

    def _span(self, name: str, category: str, tid: int, start_ns: float, duration_ns: float, **args) -> None:
        self.events.append({"name": name, "cat": category, "ph": "X", "pid": self.parallel.stage, "tid": tid,
                            "ts": _us(start_ns), "dur": round(_us(start_ns + duration_ns) - _us(start_ns), 3),
                            "args": args})


def _us(ns: float) -> float:
    """Microseconds to the nanosecond; spans are cut from rounded end points so that they abut exactly."""
    return round(ns / 1e3, 3)
