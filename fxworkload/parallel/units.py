"""Layer-level units of a per-node workload: the granularity of SimAI rows and of the trace timeline.

A unit is the embedding, one tensor-parallel block of a decoder layer (attention, MLP) or the
head (final norm, output projection, loss). A block runs from the end of the previous one to the
last op of its row-parallel projection, the point where Megatron-LM reduces its output. Without
a tensor-parallel plan a layer is one unit. The gradient rows of a unit's parameters travel with it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field

from ..capture.trace import FORWARD, PHASES
from ..workload.layers import layer_of
from ..workload.siblings import input_elements
from ..workload.table import GradRow, NodeRow, Workload
from .recompute import is_recomputed

EMBEDDING, ATTENTION, MLP, LAYER, HEAD = "embedding", "attention", "mlp", "layer", "head"
# What a block's overlapped tensor-parallel collective runs beside (Comm.beside): the column-parallel linears'
# GEMMs that read the gathered block input (q/k/v, gate/up), the row-parallel linear's GEMM that makes the
# reduce-scattered output (o, down), that linear's input-gradient GEMM, the column-parallel linears'
# weight-gradient GEMMs. In a backward pass READERS and PRODUCER are the recomputed forward's copies.
READERS, PRODUCER, DGRAD, WGRAD = "readers", "producer", "dgrad", "wgrad"


@dataclass(frozen=True)
class Comm:
    type: str  # ALLREDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL
    group: str  # tp, cp, ep, dp, dp_ep, or layout.POST_FORWARD
    bytes: int  # the collective's whole buffer, as SimAI and NCCL count it
    what: str  # why it happens, for timelines
    overlapped: bool = False  # runs beside the unit's attention core (CP's ring): only what outlasts it is exposed
    # the GEMMs an overlapped tensor-parallel collective is pipelined with (Unit.gemms_beside_ns): READERS, PRODUCER,
    # DGRAD or WGRAD; "" for one that is not tensor-parallel (CP's ring runs beside the attention core)
    beside: str = ""
    # the bytes a memory-bound kernel of its own moves on the compute stream with this collective: ZeRO 3 as
    # FSDP2 runs it (the gathered parameters' copy-out after a gather, the gradients' copy-in before a
    # reduce-scatter: cluster/zero3.py), AsyncTP's sum of a reduce-scatter's partials and its copies, torch's
    # copies around a collective on the sequence dim (collectives.py); and whether that copy converts dtypes
    copy_bytes: int = 0
    copy_casts: bool = False
    # reads the output of the unit's last GEMM (a row-parallel output's reduction, MoE's combine): a
    # recomputation that stops before that GEMM (torch.compile's partitioner: recompute.py) does not run it again
    follows_gemm: bool = False
    # DeepEP's dispatch or combine (Parallel.ep_comm): (one copy of the rank's tokens in bytes, experts, experts
    # per token), from which its sends once per (token, rank) and once per (token, node) follow
    # (collectives.expected_destinations, cluster/network.py's deepep_ns); ``bytes`` is its per-rank buffer
    deepep: tuple[int, int, int] | None = None


@dataclass
class Unit:
    name: str
    block: str  # EMBEDDING, ATTENTION, MLP, LAYER, HEAD, or "dp" for a data-parallel row
    layer: int | None = None
    rows: list[NodeRow] = field(default_factory=list)
    grads: list[GradRow] = field(default_factory=list)
    moe: bool = False
    comms: dict[str, list[Comm]] = field(default_factory=lambda: {phase: [] for phase in PHASES})
    costs: dict[str, tuple[float, int]] | None = None  # phase -> (ns, flops), summed once for a layout search
    core_ns: dict[str, float] | None = None  # phase -> its attention core's time (what CP's ring overlaps)
    host_wait_ns: dict[str, float] | None = None  # phase -> what the GPU waits on the host's dispatch (in costs)
    saved_bytes: int | None = None  # its rows' saved activations, summed once with ``costs``
    # (phase, beside) -> gemms_beside_ns, filled as asked; shared by a layout's copies of the unit (same rows)
    beside_ns: dict[tuple[str, str], float] = field(default_factory=dict)

    def saved(self) -> int:
        return self.saved_bytes if self.saved_bytes is not None else sum(row.saved_bytes for row in self.rows)

    def ops(self, phase: str) -> list:
        return [op for row in self.rows for op in row.ops(phase)]

    def ns(self, phase: str) -> float:
        """Its kernels' time in ``phase``."""
        return sum(op.estimated_ns for op in self.ops(phase))

    def pass_ns(self, phase: str) -> float:
        """The pass's time: its kernels, or the host's dispatch of its eager ops where that is longer (small
        shapes without CUDA graphs): the GPU waits on the host, as the micro-batch's two streams do."""
        ops = self.ops(phase)
        return max(sum(op.estimated_ns for op in ops), sum(op.dispatch_ns for op in ops))

    def host_wait(self, phase: str) -> float:
        """What the pass's GPU waits on the host (in ``pass_ns``)."""
        return self.pass_ns(phase) - self.ns(phase)

    def flops(self, phase: str) -> int:
        return sum(op.flops for op in self.ops(phase))

    def attention_core_ns(self, phase: str) -> float:
        return sum(op.estimated_ns for op in self.ops(phase) if op.sdpa_backend)

    def gemms_beside_ns(self, phase: str, beside: str) -> float:
        """The time of the GEMMs a collective of ``phase`` overlapped ``beside`` them is pipelined with."""
        key = (phase, beside)
        if key not in self.beside_ns:
            self.beside_ns[key] = sum(op.estimated_ns for op in gemms_beside(self.rows, phase, beside))
        return self.beside_ns[key]


def linears(rows: list[NodeRow]) -> list[NodeRow]:
    """The rows of linear layers: one matrix's GEMM (not attention's batched ones, nor a fused attention)."""
    return [r for r in rows if r.forward.kind == "matmul" and r.forward.gemm_mkn is not None
            and r.forward.gemm_batch == 1 and not r.forward.sdpa_backend]


def gemms_beside(rows: list[NodeRow], phase: str, beside: str) -> list:
    """The GEMM ops of a block's rows that an overlapped collective of ``phase`` runs beside (READERS ...: the
    block's linears, the last its row-parallel one; the readers those reading the first one's input)."""
    layers = linears(rows)
    if not layers:
        return []
    producer = layers[-1]
    if beside == DGRAD:
        return [op for op in producer.input_grad if op.kind == "matmul"][-1:]
    readers = [r for r in layers[:-1] if input_elements(r) == input_elements(layers[0])]
    if beside == WGRAD:
        return [op for r in readers for op in r.weight_grad if op.kind == "matmul"]
    chosen = readers if beside == READERS else [producer]
    if phase == FORWARD:
        return [r.forward for r in chosen]
    return [r.input_grad[0] for r in chosen if is_recomputed(r)]  # a recomputed forward's copies



def split(workload: Workload, stack: str | None, row_parallel: list[str]) -> list[Unit]:
    """The units of the whole model, in forward order. ``stack`` is the decoder layers' ModuleList path."""
    closers: dict[int | None, list[str]] = defaultdict(list)  # each layer's row-parallel projections
    for path in row_parallel:
        closers[layer_of(path, stack)].append(path)
    units: list[Unit] = []
    made: dict[int, int] = defaultdict(int)  # units started per layer
    closer: str | None = None  # the row-parallel projection the last unit already holds
    pending: list[GradRow] = []
    for row in workload.rows:
        if isinstance(row, GradRow):
            pending.append(row)
            continue
        layer = layer_of(row.module, stack)
        unit = units[-1] if units else None
        if layer is None:
            block = EMBEDDING if not any(u.layer is not None for u in units) else HEAD
            if unit is None or unit.block != block:
                unit, closer = Unit(name=block, block=block), None
                units.append(unit)
        elif unit is None or unit.layer != layer or (closer is not None and not _within(row.module, closer)
                                                     and made[layer] < len(closers[layer])):
            unit, closer = Unit(name="", block=LAYER if not row_parallel else MLP, layer=layer), None
            units.append(unit)
            made[layer] += 1
        if layer is not None and closer is None:
            closer = next((path for path in closers[layer] if _within(row.module, path)), None)
            if closer is not None:
                unit.block = ATTENTION if any("attn" in p or "attention" in p for p in closer.split(".")) else MLP
        unit.rows.append(row)
        unit.grads.extend(pending)
        pending.clear()
        unit.moe = unit.moe or is_expert(row.module)
    if pending and units:
        units[-1].grads.extend(pending)
    for unit in units:
        if unit.layer is not None:
            unit.name = f"layer{unit.layer}" if unit.block == LAYER else f"layer{unit.layer}_{unit.block}"
    return units


@functools.lru_cache(maxsize=1 << 16)  # asked of the same few thousand paths for every layout of a search
def is_expert(module: str) -> bool:
    """Whether a module path lies in a mixture-of-experts layer's expert weights."""
    return "experts" in module.split(".")


def _within(module: str, path: str) -> bool:
    return module == path or module.startswith(path + ".")
