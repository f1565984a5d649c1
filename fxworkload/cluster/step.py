"""One training step of the whole cluster: every pipeline stage's passes, the schedule, and what the
collectives add to it.

- A pass (one micro-batch's forward or backward of one model chunk) is its units' compute plus the
  tensor- and expert-parallel collectives Megatron-LM runs inside it, which block compute (the
  collective times: network.py).
- The passes are scheduled as Megatron-LM's 1F1B or interleaved 1F1B (schedule.py), with the
  point-to-point transfer of an activation between devices.
- Data-parallel gradient buckets are reduced on their own stream as DDP does: a bucket starts
  once the last micro-batch's backward has produced its gradients (and the previous bucket is
  done); what runs past the device's last backward is exposed. ZeRO 1/2 gather the updated
  parameters after the optimizer; ZeRO 3 gathers them for every pass, on a stream beside it.
- The optimizer (Adam) is a memory-bound pass over the rank's parameters and its states.

Figures: step time (the slowest device), pipeline bubble, exposed communication per kind, model
FLOPs utilisation (MFU: the model's FLOPs, 6·N·tokens-like, read off the graph) and hardware
FLOPs utilisation (HFU: with the recomputed forward), tokens per second per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from ..cost.devices import DeviceProfile
from ..cost.gpu import memory_ns
from ..dtypes import DTYPES
from ..memo import Memo
from ..parallel.collectives import (ALLGATHER, EVERY, NONE, REDUCESCATTER, backward_gathers, data_parallel_units,
                                    fsdp_comms, fsdp_units, micro_batch_kinds, micro_batch_scatters, post_forward_copies,
                                    zero_rows)
from ..parallel.execution import Execution
from ..parallel.facts import ModelFacts
from ..parallel.layout import Parallel, virtual_stage_layers
from ..parallel.memory import ADAM_BYTES_PER_PARAMETER, fp8_weight_elements
from ..parallel.rank import MODEL_PARALLEL_FIELDS, model_chunks, model_parallel_chunks, split_once
from ..parallel.units import Comm, Unit, is_expert
from ..workload.table import Workload
from .activation_offload import OffloadedPass, copy_ns, offloaded_pass
from .network import comm_ns, p2p_ns
from .offload import offloaded_step_ns
from .schedule import BACKWARD, Pass, timelines
from .stragglers import slowest_step_ns
from .zero3 import Group, compute_share_lost, fsdp2_host_wait_ns, simulate_pass

# Adam touches per parameter: the fp32 master copy and both moments, read and written (2 x 12 bytes
# in mixed precision, 2 x 8 in fp32), the gradient read and the parameter written in its own dtype.
OPTIMIZER_PASSES = 2


@dataclass
class DeviceSummary:
    device: int
    compute_ns: float  # its passes' compute, every micro-batch
    blocking_comm_ns: dict[str, float]  # tp / ep collectives inside its passes
    pipeline_end_ns: float
    data_parallel_end_ns: float
    optimizer_ns: float
    zero_gather_ns: float  # ZeRO 1/2: the updated parameters' gathers after the optimizer
    end_ns: float
    zero3_gather_ns: tuple[float, float] = (0.0, 0.0)  # ZeRO 3: one forward and one backward pass's gathers
    zero3_exposed_gather_ns: float = 0.0  # ZeRO 3: compute waiting for parameters, every pass of the step
    zero3_copy_ns: float = 0.0  # ZeRO 3: FSDP2's copy kernels on the compute stream, every pass of the step
    bucket_slowdown_ns: float = 0.0  # backward compute lost to the SMs overlapped gradient buckets' NCCL kernels held
    offload_wait_ns: float = 0.0  # --activation-offload-layers: compute waiting on the copies, every micro-batch
    host_wait_ns: float = 0.0  # the GPU waiting on the host: its dispatch of eager ops, FSDP2's hooks (in compute_ns), every micro-batch


@dataclass
class ClusterStep:
    parallel: Parallel
    micro_batch: int
    seq: int
    step_ns: float
    pipeline_ns: float  # the slowest device's last pass
    bubble_fraction: float  # idle share of the pipeline on the busiest device
    exposed_ns: dict[str, float]  # per kind, on the device that ends the step
    model_flops: float  # per step, the whole cluster
    hardware_flops: float  # with recomputation
    peak_flops_per_s: float
    devices: list[DeviceSummary]
    device_passes: list[list[tuple]] = field(repr=False)  # per device: (kind, chunk, micro-batch, start, end)
    data_parallel_spans: list[tuple[int, str, float, float, int]] = field(repr=False)  # device, name, start, end, bytes
    device_units: list[list[Unit]] = field(repr=False, default_factory=list)  # per device, dp rows included
    device_chunks: list[list[list[Unit]]] = field(repr=False, default_factory=list)  # per device, its model chunks
    boundary_bytes: int = 0  # one activation sent between pipeline stages
    # --overlap-param-gather: per device, its first chunk's units grouped by the bucket whose parameter all-gathers
    # they wait for in the first forward (param_gather_groups)
    param_gathers: list = field(repr=False, default_factory=list)
    profile: DeviceProfile | None = field(repr=False, default=None)
    # the micro-batch's 90 % interval over its estimate (kernel families' held-out errors; the step as
    # captured, before recomputation), applied to the whole step: the collectives are taken as they are
    # estimated; (1, 1) where the profile has none
    interval_ratio: tuple[float, float] = (1.0, 1.0)
    # --activation-offload-layers: one micro-batch's timeline of the copies (activation_offload.py), its decoder
    # layers in order (the timeline's indices)
    activation_copies: OffloadedPass | None = field(repr=False, default=None)
    offload_layer_ids: tuple[int, ...] = field(repr=False, default=())

    def activation_wait_ns(self, layer: int | None, forward: bool) -> float:
        """What a decoder layer's forward or backward waits on the activations' copies, per micro-batch."""
        if self.activation_copies is None or layer not in self.offload_layer_ids:
            return 0.0
        waits = self.activation_copies.forward_waits_ns if forward else self.activation_copies.backward_waits_ns
        return waits[self.offload_layer_ids.index(layer)]

    def copy_waits(self, units: list[Unit], forward: bool) -> dict[int, float]:
        """id(unit) -> what it waits on activation copies before it runs, ``units`` in the pass's order: the
        first unit of each decoder layer carries the layer's wait (activation_offload.py)."""
        waits, seen = {}, set()
        for unit in units:
            if unit.layer is not None and unit.layer not in seen:
                seen.add(unit.layer)
                wait = self.activation_wait_ns(unit.layer, forward)
                if wait > 0:
                    waits[id(unit)] = wait
        return waits

    @property
    def step_interval_ns(self) -> tuple[float, float] | None:
        if self.interval_ratio == (1.0, 1.0):
            return None
        return self.step_ns * self.interval_ratio[0], self.step_ns * self.interval_ratio[1]

    @property
    def passes(self) -> list[Pass]:
        return [Pass(d, *entry) for d, timeline in enumerate(self.device_passes) for entry in timeline]

    @property
    def world(self) -> int:
        return self.parallel.world

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq * self.parallel.micro_batches * self.parallel.replicas

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_ns * 1e-9 * self.world * self.peak_flops_per_s)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.step_ns * 1e-9 * self.world * self.peak_flops_per_s)

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / (self.step_ns * 1e-9 * self.world) / 1e12

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / (self.step_ns * 1e-9) / self.world

    @property
    def gpu_speed_spread(self) -> float:
        return self.profile.network().gpu_speed_spread if self.profile is not None else 0.0

    @property
    def slowest_gpu_step_ns(self) -> float:
        """The step at the pace of the slowest GPU of the job (cluster/stragglers.py); the step where all are alike."""
        return slowest_step_ns(self.step_ns, self.exposed_ns, self.world, self.gpu_speed_spread)

    def as_dict(self) -> dict:
        return {"step_ns": self.step_ns, "pipeline_ns": self.pipeline_ns, "bubble_fraction": self.bubble_fraction,
                "exposed_ns": self.exposed_ns, "model_flops": self.model_flops, "hardware_flops": self.hardware_flops,
                "mfu": self.mfu, "hfu": self.hfu, "tflops_per_gpu": self.tflops_per_gpu,
                "tokens_per_step": self.tokens, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "peak_flops_per_s": self.peak_flops_per_s,
                "step_interval_ns": list(self.step_interval_ns) if self.step_interval_ns else None,
                "gpu_speed_spread": self.gpu_speed_spread, "slowest_gpu_step_ns": self.slowest_gpu_step_ns,
                "devices": [vars(d) for d in self.devices]}


def cluster_step(facts: ModelFacts, workload: Workload, model_workload: Workload, execution: Execution,
                 device: DeviceProfile, alike: bool = False) -> ClusterStep:
    """The step of every rank of ``execution``'s layout on ``device`` (its network and memory tiers).
    ``workload``: one micro-batch's step as it runs (recomputation applied); ``model_workload``: as
    captured, for the model's FLOPs. ``alike``: devices whose chunks hold layers of the same kinds in the
    same order share one device's units (_alike_devices; a layout search's figures: the step's units then
    name that device's layers)."""
    p = replace(execution.parallel, stage=0)
    micro_batch, seq, dtype, grad_dtype = execution.batch, execution.seq_per_rank, execution.dtype, execution.gradients
    standing_for = _alike_devices(facts, workload, model_workload, p) if alike else range(p.pp)
    forward, backward, comm, flops, layouts, unit_backward = [], [], [], [], [], []
    for d in range(p.pp):
        chunks, forward_ns, backward_ns, blocking, device_flops, backward_by_unit = _device_passes(
            facts, workload, model_workload, p, standing_for[d], micro_batch, seq, dtype, device)
        unit_backward.append(backward_by_unit)
        forward.append(list(forward_ns))
        backward.append(list(backward_ns))
        comm.append(blocking)
        flops.append(device_flops)
        layouts.append((chunks, _with_data_parallel(chunks, p, grad_dtype, dtype, workload.fp8_modules)))
    zero3 = [_Zero3Device() for _ in range(p.pp)]
    if p.zero == 3:  # gathers and reduce-scatters per FSDP unit on a stream beside the compute (zero3.py)
        for d in range(p.pp):
            zero3[d] = _zero3_device(layouts[d][0], workload, p, device, dtype, grad_dtype)
            forward[d], backward[d] = list(zero3[d].forward_ns), list(zero3[d].backward_ns)
    offloaded = None  # --activation-offload-layers (pp 1, one chunk): the copies' timeline beside each micro-batch
    if p.activation_offload_layers:
        offload_layers, offloaded = activation_offload_pass(layouts[0][0][0], p, device)
        forward[0][0] += offloaded.forward_wait_ns
        backward[0][0] += offloaded.backward_wait_ns
    boundary = micro_batch * seq * facts.hidden * DTYPES[dtype].itemsize // (p.tp if p.sp else 1)
    transfer = p2p_ns(boundary, p, device)
    passes = timelines(p.pp, p.vpp, p.micro_batches, forward, backward, transfer)
    devices, spans = [], []
    slowed = [0.0] * p.pp  # compute lost to the SMs the overlapped buckets' NCCL kernels held
    for d in range(p.pp):
        mine = passes[d]
        pipeline_end = mine[-1][4]
        if p.zero == 3:  # the buckets' reduce-scatters ran per unit in each backward; the last one spills over
            dp_end = pipeline_end + zero3[d].trailing_ns
            dp_spans = [("ZeRO 3 last reduce-scatter", pipeline_end, dp_end, 0)] if zero3[d].trailing_ns else []
        else:
            dp_end, dp_spans = _data_parallel(layouts[d], mine, p, device, unit_backward[d])
            slowed[d] = _bucket_slowdown(dp_spans, mine, compute_share_lost(device.sm_count))
            pipeline_end += slowed[d]
            dp_end = max(dp_end, pipeline_end)
        spans += [(d, *span) for span in dp_spans]
        optimizer, gather = _after_the_passes(layouts[d], workload, p, dtype, grad_dtype, device)
        compute = p.micro_batches * (sum(forward[d]) + sum(backward[d]))  # every micro-batch through each chunk
        end = max(pipeline_end, dp_end) + optimizer + gather
        devices.append(DeviceSummary(device=d, compute_ns=compute, blocking_comm_ns=comm[d],
                                     pipeline_end_ns=pipeline_end, data_parallel_end_ns=dp_end,
                                     optimizer_ns=optimizer, zero_gather_ns=gather, end_ns=end,
                                     zero3_gather_ns=zero3[d].gather_ns, zero3_exposed_gather_ns=zero3[d].exposed_ns,
                                     zero3_copy_ns=zero3[d].copies_ns, bucket_slowdown_ns=slowed[d],
                                     offload_wait_ns=p.micro_batches * (offloaded.forward_wait_ns +
                                                                        offloaded.backward_wait_ns) if offloaded else 0.0,
                                     host_wait_ns=zero3[d].host_ns
                                     + p.micro_batches * _units_host_wait_ns(layouts[d][0])))
    slowest = max(devices, key=lambda x: x.end_ns)
    busiest = max(devices, key=lambda x: x.compute_ns)
    pipeline_ns = max(x.pipeline_end_ns for x in devices)
    busy_ns = busiest.compute_ns + busiest.bucket_slowdown_ns  # slowed compute is busy, not a bubble
    micro = p.micro_batches
    exposed = {"tp": slowest.blocking_comm_ns["tp"] * micro, "cp": slowest.blocking_comm_ns["cp"] * micro,
               "ep": slowest.blocking_comm_ns["ep"] * micro,
               "pp_bubble": max(0.0, pipeline_ns - busy_ns),  # no pipeline: 0, not a rounding error below it
               "dp": max(slowest.data_parallel_end_ns - slowest.pipeline_end_ns, 0.0),
               "zero_gather": slowest.zero_gather_ns, "zero3_gather": slowest.zero3_exposed_gather_ns,
               "zero3_copies": slowest.zero3_copy_ns,
               "dp_bucket_slowdown": slowest.bucket_slowdown_ns,
               "activation_offload": slowest.offload_wait_ns,
               "host": slowest.host_wait_ns,  # inside the compute: the GPU idle while the host issues ops
               "optimizer": slowest.optimizer_ns}
    ranks_per_stage = p.tp * p.replicas
    model_flops = sum(f[0] for f in flops) * micro * ranks_per_stage
    hardware_flops = sum(f[1] for f in flops) * micro * ranks_per_stage
    return ClusterStep(parallel=p, micro_batch=micro_batch, seq=seq, step_ns=slowest.end_ns, pipeline_ns=pipeline_ns,
                       bubble_fraction=max(0.0, 1 - busy_ns / pipeline_ns) if pipeline_ns else 0.0,
                       exposed_ns=exposed, model_flops=model_flops, hardware_flops=hardware_flops,
                       peak_flops_per_s=device.matmul_flops_per_s[dtype], devices=devices, device_passes=passes,
                       data_parallel_spans=spans, device_units=[layout[1] for layout in layouts],
                       device_chunks=[layout[0] for layout in layouts], boundary_bytes=boundary, profile=device,
                       param_gathers=[param_gather_groups(*layout, p, dtype, grad_dtype) for layout in layouts]
                       if p.overlap_param_gather and p.zero in (1, 2) else [],
                       interval_ratio=_interval_ratio(model_workload), activation_copies=offloaded,
                       offload_layer_ids=tuple(offload_layers) if offloaded else ())


@dataclass(frozen=True)
class _Zero3Device:
    """One device's passes under ZeRO 3 (FSDP): each unit's gathers and reduce-scatters on a stream beside its
    compute (zero3.py), per chunk, and what they cost the step, every micro-batch."""
    forward_ns: tuple[float, ...] = ()  # per chunk: one forward pass
    backward_ns: tuple[float, ...] = ()  # per chunk: one backward, the step's mean
    gather_ns: tuple[float, float] = (0.0, 0.0)  # chunk 0's gathers: one forward, the last backward
    exposed_ns: float = 0.0  # the gathers' waits
    copies_ns: float = 0.0  # FSDP2's copy-in/copy-out kernels
    host_ns: float = 0.0  # the GPU waiting on FSDP2's hooks
    trailing_ns: float = 0.0  # the step's last reduce-scatter past its last backward


def _zero3_device(chunks: list[list[Unit]], workload: Workload, p: Parallel, device: DeviceProfile, dtype: str,
                  grad_dtype: str) -> _Zero3Device:
    itemsizes = DTYPES[dtype].itemsize, DTYPES[grad_dtype].itemsize, (
        workload.fp8_modules if p.fp8_param_gather else frozenset())
    share = compute_share_lost(device.sm_count)
    kinds = micro_batch_kinds(p)  # --accumulate-unsharded: the first, middle and last backwards differ
    groups_f = [_zero3_groups(c, FORWARD, p, device, *itemsizes) for c in chunks]
    groups_b = {kind: [_zero3_groups(c, INPUT_GRAD, p, device, *itemsizes, kind=kind) for c in chunks]
                for kind, _ in kinds}
    timelines_f = [simulate_pass(f, share) for f in groups_f]
    timelines_b = {kind: [simulate_pass(b, share) for b in groups] for kind, groups in groups_b.items()}
    last = kinds[-1][0]  # the step's last backward

    def every_micro_batch(figure) -> float:
        return p.micro_batches * sum(figure(t) for t in timelines_f) + sum(
            n * figure(t) for kind, n in kinds for t in timelines_b[kind])

    # the schedule takes one backward per chunk: their mean over the step's micro-batches (exact without a
    # pipeline, where the passes run one after another)
    return _Zero3Device(
        forward_ns=tuple(t.duration_ns for t in timelines_f),
        backward_ns=tuple(sum(n * timelines_b[kind][c].duration_ns for kind, n in kinds) / p.micro_batches
                          for c in range(len(chunks))),
        gather_ns=(sum(g.gather_ns for g in groups_f[0]), sum(g.gather_ns for g in groups_b[last][0])),
        exposed_ns=every_micro_batch(lambda t: t.exposed_gather_ns),
        copies_ns=every_micro_batch(lambda t: t.copy_ns),
        host_ns=every_micro_batch(lambda t: t.host_wait_ns),
        trailing_ns=timelines_b[last][0].trailing_ns)  # the step's last backward is chunk 0's


def _units_host_wait_ns(chunks: list[list[Unit]]) -> float:
    """One micro-batch's wait on the host issuing the device's ops, every pass of every unit (rank.py)."""
    return sum((u.host_wait_ns or {}).get(ph, 0.0) for chunk in chunks for u in chunk
               for ph in (FORWARD, INPUT_GRAD, WEIGHT_GRAD))


def activation_offload_pass(chunk: list[Unit], p: Parallel, device: DeviceProfile) -> tuple[list[int], OffloadedPass]:
    """One micro-batch's waits on the first layers' activation copies (activation_offload.py), from the chunk's
    decoder layers' compute and blocking collectives and their saved bytes."""
    forward: dict[int, float] = {}
    backward: dict[int, float] = {}
    saved: dict[int, int] = {}
    head_ns = 0.0
    for u in chunk:
        f = u.costs[FORWARD][0] + _comms_ns(u, FORWARD, p, device)
        b = u.costs[INPUT_GRAD][0] + u.costs[WEIGHT_GRAD][0] + _comms_ns(u, INPUT_GRAD, p, device)
        if u.layer is None:
            head_ns += f + b if forward else 0.0  # after the layers: the head and loss; before them, the embedding
            continue
        forward[u.layer] = forward.get(u.layer, 0.0) + f
        backward[u.layer] = backward.get(u.layer, 0.0) + b
        saved[u.layer] = saved.get(u.layer, 0) + u.saved()
    layers = sorted(forward)
    return layers, offloaded_pass([forward[j] for j in layers], [backward[j] for j in layers],
                                  [copy_ns(saved[j], device) for j in layers], p.activation_offload_layers, head_ns)


def _alike_devices(facts: ModelFacts, workload: Workload, model_workload: Workload, p: Parallel) -> list[int]:
    """Per device, the first device whose chunks hold layers of the same kinds in the same order, neither
    holding the embedding or the head: its passes, gradient buckets, ZeRO-3 groups and optimizer step
    stand for this device's (the fast path's middle layers are all of one kind)."""
    kinds = tuple(zip(_layer_kinds(facts, workload), _layer_kinds(facts, model_workload)))
    ranges = virtual_stage_layers(p, facts.layers)
    first: dict[tuple, int] = {}
    out = []
    for d in range(p.pp):
        signature = (d == 0, d == p.pp - 1, tuple(tuple(kinds[layer] for layer in ranges[c * p.pp + d])
                                                   for c in range(p.vpp)))
        out.append(first.setdefault(signature, d))
    return out


_KINDS = Memo(256)


def _layer_kinds(facts: ModelFacts, workload: Workload) -> list[int]:
    """Per decoder layer, a number shared by the layers whose units cost, save, communicate and hold
    gradients alike (-1 for one without units)."""
    def make() -> list[int]:
        layers: dict[int, list] = {}
        for u in split_once(facts, workload):
            if u.layer is not None:
                layers.setdefault(u.layer, []).append((
                    u.block, u.moe, tuple(sorted(u.costs.items())), tuple(sorted(u.core_ns.items())), u.saved_bytes,
                    tuple((g.elements, g.bytes, is_expert(g.module), g.module in workload.fp8_modules)
                          for g in u.grads)))
        numbered: dict[tuple, int] = {}
        return [numbered.setdefault(tuple(layers[i]), len(numbered)) if i in layers else -1
                for i in range(facts.layers)]
    return _KINDS.get(id(workload), (workload,), make)


# A layout search evaluates many layouts that differ only in what leaves a device's passes unchanged
# (data-parallel degree, ZeRO stage, micro-batch count): their passes are computed once.
_PASSES = Memo(4096)


def _device_passes(facts, workload, model_workload, p: Parallel, d: int, micro_batch: int, seq: int, dtype: str,
                   device: DeviceProfile) -> tuple:
    """Device ``d``'s model chunks, one micro-batch's forward and backward pass per chunk, the blocking
    collectives' time per group and (model, hardware) FLOPs: what depends on the model-parallel layout only."""
    key = (id(workload), id(model_workload), id(device), d, micro_batch, seq, dtype,
           *(getattr(p, name) for name in MODEL_PARALLEL_FIELDS))
    return _PASSES.get(key, (workload, model_workload, device),
                       lambda: _device_passes_of(facts, workload, model_workload, p, d, micro_batch, seq, dtype, device))


def _device_passes_of(facts, workload, model_workload, p: Parallel, d: int, micro_batch: int, seq: int, dtype: str,
                      device: DeviceProfile) -> tuple:
    chunks = model_parallel_chunks(facts, workload, p, d, micro_batch, seq, dtype)
    captured_chunks = model_chunks(facts, split_once(facts, model_workload), p, d)
    forward_passes = [_pass(c, FORWARD, p, device) for c in chunks]
    backward_passes = [_pass(c, INPUT_GRAD, p, device) for c in chunks]
    backward_by_unit = {id(u): sum(u.costs[ph][0] for ph in (INPUT_GRAD, WEIGHT_GRAD)) + _comms_ns(u, INPUT_GRAD, p, device)
                        for c in chunks for u in c}
    return (chunks, tuple(ns for ns, _ in forward_passes), tuple(ns for ns, _ in backward_passes),
            _blocking_comm(forward_passes + backward_passes), (_flops(captured_chunks), _flops(chunks)),
            backward_by_unit)


_DP_UNITS = Memo(4096)
_AFTER = Memo(4096)


def _after_the_passes(layout: tuple, workload: Workload, p: Parallel, dtype: str, grad_dtype: str,
                      device: DeviceProfile) -> tuple[float, float]:
    """A device's optimizer step (with the FP8 weights' cast) and, under ZeRO 1/2, its updated parameters'
    gathers: once per device and data-parallel side in a layout search (its units are the memoised ones)."""
    chunks, with_dp = layout
    key = (id(chunks), id(with_dp), id(workload), id(device), p.zero, p.replicas, p.dp, p.ep, dtype, grad_dtype,
           p.overlap_param_gather, p.tp, p.cp, p.sp, p.cp_comm, p.optimizer_offload)

    def make() -> tuple[float, float]:
        optimizer = _optimizer_ns(chunks, p, dtype, grad_dtype, device) + _fp8_weight_cast_ns(chunks, workload, device)
        if p.zero not in (1, 2):
            return optimizer, 0.0
        if p.overlap_param_gather:
            return optimizer, overlapped_gather_ns(chunks, with_dp, p, device, dtype, grad_dtype)
        return optimizer, sum(comm_ns(c, p, device) for u in with_dp if u.block == "dp" for c in u.comms[WEIGHT_GRAD]
                              if c.type == ALLGATHER)
    return _AFTER.get(key, (chunks, with_dp, workload, device), make)


def param_gather_groups(chunks: list[list[Unit]], with_dp: list[Unit], p: Parallel, dtype: str,
                        grad_dtype: str) -> list[tuple[list[Unit], list[Comm]]]:
    """--overlap-param-gather: the first chunk's units in forward order, grouped by the gradient bucket whose
    parameters they first need (a bucket's row sits before the first unit that owns its parameters), each
    group with that bucket's parameter all-gathers (its reduce-scatter's elements at the parameters' dtype)."""
    first = {id(u) for u in chunks[0]}
    ratio = DTYPES[dtype].itemsize / DTYPES[grad_dtype].itemsize
    groups: list[tuple[list[Unit], list[Comm]]] = [([], [])]
    for unit in with_dp:
        if unit.block != "dp":
            if id(unit) not in first:
                break  # later chunks' buckets have the rest of the forward passes to arrive
            groups[-1][0].append(unit)
            continue
        gathers = [Comm(ALLGATHER, c.group, int(c.bytes * ratio), "updated parameters (bucket)")
                   for c in unit.comms[WEIGHT_GRAD] if c.type == REDUCESCATTER]
        if gathers and groups[-1][0]:
            groups.append(([], []))
        groups[-1][1].extend(gathers)
    return [g for g in groups if g[0] or g[1]]


def overlapped_gather_ns(chunks, with_dp, p: Parallel, device: DeviceProfile, dtype: str, grad_dtype: str) -> float:
    """Megatron-Core's overlapped parameter gather (--overlap-param-gather; param_and_grad_buffer.py: the first
    bucket group's all-gather starts after the optimizer, each bucket group's forward pre-hook waits for its own
    and dispatches the next's): the first forward pass as ZeRO 3's stream runs it (zero3.py, prefetch of one), and
    what it adds to the step: compute waiting for parameters, and compute slowed by the SMs the gathers hold."""
    groups = [Group(compute_ns=sum(u.costs[FORWARD][0] + _comms_ns(u, FORWARD, p, device) for u in units),
                    gather_ns=sum(comm_ns(c, p, device) for c in gathers))
              for units, gathers in param_gather_groups(chunks, with_dp, p, dtype, grad_dtype)]
    timeline = simulate_pass(groups, compute_share_lost(device.sm_count))
    return timeline.exposed_gather_ns + timeline.slowdown_ns


def _with_data_parallel(chunks: list[list[Unit]], p: Parallel, grad_dtype: str, dtype: str,
                        fp8_modules: frozenset) -> list[Unit]:
    """The device's units with its data-parallel rows (data_parallel_units), once per chunks and data-parallel
    side (the chunks are the memoised ones of _device_passes); the list returned is not to be changed."""
    key = (id(chunks), p.replicas, p.dp, p.ep, zero_rows(p.zero), p.bucket_mb, p.fp8_param_gather, grad_dtype, dtype,
           p.reshard_after_forward)
    return _DP_UNITS.get(key, (chunks,), lambda: data_parallel_units(
        [u for chunk in chunks for u in chunk], p, DTYPES[grad_dtype].itemsize, DTYPES[dtype].itemsize, fp8_modules))


def _interval_ratio(workload: Workload) -> tuple[float, float]:
    totals = workload.totals
    if "step_low_ns" not in totals or not totals["step_estimated_ns"]:
        return 1.0, 1.0
    return totals["step_low_ns"] / totals["step_estimated_ns"], totals["step_high_ns"] / totals["step_estimated_ns"]


def _pass(units: list[Unit], phase: str, p: Parallel, device: DeviceProfile) -> tuple[float, dict[str, float]]:
    """A pass's time (its compute and the collectives it waits on) and those collectives' time per group."""
    phases = (FORWARD,) if phase == FORWARD else (INPUT_GRAD, WEIGHT_GRAD)
    compute = sum(u.costs[ph][0] for u in units for ph in phases)
    by_group: dict[str, float] = {}
    for u in units:
        for group, ns in exposed_comms_ns(u, phase, p, device).items():
            by_group[group] = by_group.get(group, 0.0) + ns
    return compute + sum(by_group.values()), by_group


def _comms_ns(unit: Unit, phase: str, p: Parallel, device: DeviceProfile) -> float:
    """The time a unit's pass waits on its collectives of ``phase``."""
    return sum(exposed_comms_ns(unit, phase, p, device).values())


def exposed_comms_ns(unit: Unit, phase: str, p: Parallel, device: DeviceProfile) -> dict[str, float]:
    """Per group, the time a unit's pass of ``phase`` waits on its collectives: the blocking ones whole;
    those overlapped with the unit's attention core (CP's ring: in backward its key/value steps and the
    key/value gradients' both run beside the one core, on the same links) what their sum outlasts it by;
    tensor-parallel ones overlapped with GEMMs (--tp-comm-overlap: Comm.beside, collectives._overlapped_tp)
    what they outlast the GEMMs they are pipelined with by, and at least one of the tp chunks they are
    pipelined in (the first chunk's transfer, or the last's, has no GEMM beside it). A tensor-parallel
    collective's own kernels on the compute stream (AsyncTP's sum of a reduce-scatter's partial products and its
    copies; torch's copies around a collective on the sequence dim: parallel/collectives.py) are waited for
    whole."""
    out: dict[str, float] = {}
    beside_core: dict[str, float] = {}
    beside_gemms: dict[str, float] = {}
    for c in unit.comms[phase]:
        ns = comm_ns(c, p, device)
        into = out if not c.overlapped else beside_gemms if c.beside else beside_core
        key = c.beside if c.overlapped and c.beside else c.group
        into[key] = into.get(key, 0.0) + ns
    for beside, ns in beside_gemms.items():
        out["tp"] = out.get("tp", 0.0) + max(ns / p.tp, ns - unit.gemms_beside_ns(phase, beside))
    if beside_core:
        phases = (FORWARD,) if phase == FORWARD else (INPUT_GRAD, WEIGHT_GRAD)
        core = sum(unit.core_ns[ph] for ph in phases)
        for group, ns in beside_core.items():
            out[group] = out.get(group, 0.0) + max(ns - core, 0.0)
    own_kernels = [c for c in unit.comms[phase] if c.group == "tp" and c.copy_bytes]  # (docstring)
    if own_kernels:
        out["tp"] = out.get("tp", 0.0) + copy_kernels_ns(own_kernels, device)
    return out


def _blocking_comm(passes: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Per micro-batch, the forward and backward passes of every chunk: the tensor-, context- and expert-parallel
    collectives (exposed time)."""
    out = {"tp": 0.0, "cp": 0.0, "ep": 0.0}
    for _, by_group in passes:
        for group, ns in by_group.items():
            out[group] = out.get(group, 0.0) + ns
    return out


def _flops(chunks: list[list[Unit]]) -> float:
    return sum(u.costs[ph][1] for units in chunks for u in units for ph in (FORWARD, INPUT_GRAD, WEIGHT_GRAD))


def _data_parallel(layout, mine: list[tuple], p: Parallel, device: DeviceProfile, backward_by_unit: dict):
    """Each bucket starts once the last backward of its chunk has passed the unit that completes it (or,
    without overlap, once the step's last backward has ended). ``backward_by_unit``: each unit's backward
    time with its blocking collectives."""
    chunks, with_dp = layout
    chunk_of = {id(u): c for c, units in enumerate(chunks) for u in units}
    done = {}  # each chunk's last backward's start: the passes are in time order, read from the end
    for kind, chunk, _, start, _ in reversed(mine):
        if kind == BACKWARD and chunk not in done:
            done[chunk] = start
            if len(done) == len(chunks):
                break
    free, ready, spans = 0.0, 0.0, []
    for unit in reversed(with_dp):
        if unit.block != "dp":
            c = chunk_of.get(id(unit), 0)
            done[c] += backward_by_unit[id(unit)]
            ready = done[c] if p.overlap_grad_reduce else mine[-1][4]
            continue
        for c in unit.comms[WEIGHT_GRAD]:
            if c.type == ALLGATHER:
                continue  # ZeRO's parameter gathers: after the optimizer, or beside each pass (ZeRO 3)
            start = max(ready, free)
            free = start + comm_ns(c, p, device)
            spans.append((unit.name, start, free, c.bytes))
    return max(free, mine[-1][4]), spans


def _bucket_slowdown(spans: list[tuple], mine: list[tuple], share_lost: float) -> float:
    """Compute lost while gradient buckets run beside backward passes: the SM share NCCL's kernels
    hold (zero3.py), over the time a bucket and a backward pass overlap (the stream model of ZeRO 3,
    applied to DDP's and ZeRO 1/2's buckets). Both lists are in time order and do not overlap
    among themselves: one sweep."""
    if not spans:
        return 0.0
    passes = []  # the backward passes that end after the first bucket starts, in time order
    for kind, _, _, start, end in reversed(mine):
        if end <= spans[0][1]:
            break
        if kind == BACKWARD:
            passes.append((start, end))
    passes.reverse()
    overlap, first = 0.0, 0
    for _, start, end, _ in spans:
        while first < len(passes) and passes[first][1] <= start:
            first += 1
        for b_start, b_end in passes[first:]:
            if b_start >= end:
                break
            overlap += min(end, b_end) - max(start, b_start)
    return share_lost * overlap


_ZERO3 = Memo(4096)


def _zero3_groups(units: list[Unit], phase: str, p: Parallel, device: DeviceProfile, param_itemsize: int,
                  grad_itemsize: int, fp8_modules: frozenset = frozenset(), kind: str = EVERY) -> list[Group]:
    """A chunk's FSDP units (decoder layers; the embedding and the head each one) in the order the pass
    runs them: compute with its blocking collectives, parameter gather, gradient reduce-scatter (the same
    chunk's groups computed once per group shape in a layout search); ``kind``: which of the step's backwards
    (collectives.micro_batch_kind)."""
    key = (id(units), phase, p.replicas, p.dp // p.ep, p.ep, p.tp, p.cp, p.cp_comm, p.sp, p.reshard_after_forward,
           p.post_forward_ranks, param_itemsize, grad_itemsize, fp8_modules, id(device), kind)
    return _ZERO3.get(key, (units, device), lambda: _zero3_groups_of(units, phase, p, device, param_itemsize,
                                                                     grad_itemsize, fp8_modules, kind))


def _zero3_groups_of(units: list[Unit], phase: str, p: Parallel, device: DeviceProfile, param_itemsize: int,
                     grad_itemsize: int, fp8_modules: frozenset, kind: str) -> list[Group]:
    groups = []
    for compute, host_wait, gathers, scatters in _zero3_units(units, phase, p, device, param_itemsize, grad_itemsize,
                                                              fp8_modules):
        kept = post_forward_copies(gathers, p) if phase == FORWARD else []  # reshard_after_forward=N
        gathers = gathers if phase == FORWARD else backward_gathers(gathers, p)
        gathered = phase == FORWARD or p.reshard_after_forward  # reshard_after_forward=False: the forward's stay
        gather = sum(comm_ns(c, p, device) for c in gathers) if gathered else 0.0
        scatters = [] if phase == FORWARD else micro_batch_scatters(scatters, kind)
        scatter = sum(comm_ns(c, p, device) for c in scatters if c.type != NONE)
        groups.append(Group(compute_ns=compute, gather_ns=gather, reduce_scatter_ns=scatter,
                            copy_ns=copy_kernels_ns((gathers if gathered else []) + scatters + kept, device),
                            host_wait_ns=host_wait))
    return groups if phase == FORWARD else groups[::-1]


_ZERO3_UNITS = Memo(4096)


def _zero3_units(units: list[Unit], phase: str, p: Parallel, device: DeviceProfile, param_itemsize: int,
                 grad_itemsize: int, fp8_modules: frozenset) -> list[tuple[float, float, list, list]]:
    """Per FSDP unit of a chunk (collectives.fsdp_units, the same units and collectives as the rank's ZeRO 3
    rows), its pass's compute with its blocking collectives, what it waits on the host running FSDP2's hooks
    (zero3.fsdp2_host_wait_ns; nothing without a host model, on a CPU profile), its parameter gathers and its
    gradient reduce-scatters: what FSDP2's options (reshard_after_forward, accumulate_unsharded) then change,
    computed once for all of them in a layout search."""
    key = (id(units), phase, p.replicas, p.dp // p.ep, p.ep, p.tp, p.cp, p.cp_comm, p.sp, param_itemsize,
           grad_itemsize, fp8_modules, id(device))

    def made() -> list[tuple[float, list, list]]:
        phases = (FORWARD,) if phase == FORWARD else (INPUT_GRAD, WEIGHT_GRAD)
        out = []
        for members in fsdp_units(units):
            compute = sum(u.costs[ph][0] for u in members for ph in phases) + sum(
                _comms_ns(u, phase, p, device) for u in members)
            out.append((compute, fsdp2_hooks_wait_ns(members, phase == FORWARD, device),
                        *fsdp_comms(members, p, param_itemsize, grad_itemsize, fp8_modules)))
        return out
    return _ZERO3_UNITS.get(key, (units, device), made)


def fsdp2_hooks_wait_ns(members: list[Unit], forward: bool, device: DeviceProfile | None) -> float:
    """What one FSDP unit's forward or backward waits on the host running FSDP2's hooks around it
    (zero3.fsdp2_host_wait_ns): its passes as the GPU runs them, its ops' issue, its parameter tensors. Nothing
    without a host model (no profile, or a CPU's) or without parameters. The cluster step, SimAI's rows and the
    Chakra traces each take it from here."""
    parameters = sum(len(u.grads) for u in members)
    if device is None or not device.sm_count or not parameters:
        return 0.0
    phases = (FORWARD,) if forward else (INPUT_GRAD, WEIGHT_GRAD)
    passes = sum(u.costs[ph][0] for u in members for ph in phases)
    issue = sum(op.dispatch_ns for u in members for ph in phases for op in u.ops(ph))
    return fsdp2_host_wait_ns(passes, issue, not forward, parameters)


def exposed_by_ns(unit: Unit, phase: str, comms: list, p: Parallel, device: DeviceProfile) -> float:
    """What the unit's pass of ``phase`` waits on these of its collectives alone, as exposed_comms_ns counts it
    (the formats fold or draw a part of a pass's collectives)."""
    if not comms:
        return 0.0
    return sum(exposed_comms_ns(replace(unit, comms={phase: comms}), phase, p, device).values())


def blocking_tp_copies_ns(unit: Unit, phase: str, device: DeviceProfile | None) -> float:
    """torch's copies around the unit's blocking tensor-parallel collectives of ``phase`` (a sequence on dim 1:
    parallel/collectives.py), kernels of their own on the compute stream."""
    copies = [c for c in unit.comms[phase] if c.group == "tp" and not c.overlapped and c.copy_bytes]
    return copy_kernels_ns(copies, device) if copies else 0.0


def copy_kernels_ns(comms: list, device: DeviceProfile | None) -> float:
    """The memory-bound kernels on the compute stream that go with ``comms`` (their ``copy_bytes``): FSDP2's
    copy-out and copy-in (zero3.py), AsyncTP's sum of a reduce-scatter's partial products (collectives.py);
    0 with no profile or one without the GPU model."""
    if device is None or not device.sm_count:
        return 0.0
    facts, model = device.gpu_facts(), device.gpu_model()
    return sum(memory_ns(c.copy_bytes, facts, model, casts=c.copy_casts) for c in comms if c.copy_bytes)


def _fp8_weight_cast_ns(chunks: list[list[Unit]], workload: Workload, device: DeviceProfile) -> float:
    """--fp8: the device's FP8 linear weights cast (with their transposes) once per step after the optimizer
    (Transformer Engine keeps them for every micro-batch of the next step): the same weights its memory
    holds FP8 copies of (parallel/memory.py). torchao's recipe casts them in every forward instead."""
    if not workload.fp8_modules or not workload.fp8_weights_kept:
        return 0.0
    from ..workload.fp8 import CAST_BYTES_PER_ELEMENT

    elements = fp8_weight_elements((u for units in chunks for u in units), workload.fp8_modules)
    return memory_ns(elements * CAST_BYTES_PER_ELEMENT, device.gpu_facts(), device.gpu_model(), casts=True)


def _optimizer_ns(chunks: list[list[Unit]], p: Parallel, dtype: str, grad_dtype: str, device: DeviceProfile) -> float:
    """The optimizer step of the rank's shard: with the distributed optimizer (ZeRO 1+) dense parameters are
    divided over the data-parallel group and expert ones over the expert-data-parallel group (dp / ep ranks),
    as their memory is (parallel/memory.py, model_state_bytes)."""
    grads = [g for units in chunks for u in units for g in u.grads]
    expert = sum(g.elements for g in grads if is_expert(g.module))
    parameters = sum(g.elements for g in grads)
    if p.zero >= 1:
        parameters = (parameters - expert) / p.replicas + expert / p.expert_replicas
    states = ADAM_BYTES_PER_PARAMETER["fp32" if dtype == "fp32" else "mixed"]
    per_parameter = OPTIMIZER_PASSES * states + DTYPES[grad_dtype].itemsize + DTYPES[dtype].itemsize
    on_gpu_ns = parameters * (1 - p.optimizer_offload) * per_parameter / (
        device.memory_bytes_per_s * device.memory_efficiency) * 1e9
    if not p.optimizer_offload:
        return on_gpu_ns
    # the offloaded share pipelines its copies and CPU steps over the parameters, beside the GPU's share
    stages = offloaded_step_ns(parameters * p.optimizer_offload, DTYPES[grad_dtype].itemsize, device)
    return max(on_gpu_ns, *stages.values())