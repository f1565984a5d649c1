"""Context parallelism: the sequence split over cp ranks (Megatron-Core's ``--context-parallel-size``;
Llama 3's long-context stages).

Each rank holds seq / cp tokens, as two of the 2·cp chunks of the sequence (chunks r and 2cp-1-r),
so every rank does the same share of causal attention (Megatron-Core, ``get_batch_on_this_cp_rank``).
Everything but the attention core runs on the rank's tokens alone: the step is captured at seq / cp.
The attention core of the rank's queries reads the keys and values of the whole sequence: with the
balanced chunks its causal work is 1/cp of the whole sequence's, cp times the work of a causal
attention over the rank's own seq / cp tokens (what was captured). It runs as cp blocks of that
size (Transformer Engine's ring, one kernel per step) or one kernel over the gathered keys (Llama 3):
here the captured core's FLOPs, bytes and time are multiplied by cp.

Keys and values (kv_heads / tp heads of head_dim values, per token of the rank) are exchanged
(Comm bytes: the whole gathered buffer, cp x one rank's share, as NCCL counts an all-gather):
- ``p2p``, Megatron-Core and Transformer Engine (``AttnFuncWithCPAndKVP2P``): a ring of cp - 1
  point-to-point steps, each rank passing the block it holds to the next while it computes on it,
  the volume of a ring all-gather. Forward moves keys and values; backward moves them again and
  their gradients back the other way (a reduce-scatter's volume). The steps overlap the attention
  core: only what runs past the core's time is exposed.
- ``allgather``, Llama 3 (Dubey et al. 2024, section 3.3.2) as Transformer Engine implements it
  (``AttnFuncWithCPAndKVAllGather``): one all-gather of keys and values before the core; backward
  gathers them again and reduce-scatters their gradients; none overlaps. Only the rank's own keys
  and values are saved for backward (``ctx.save_for_backward(q, k, v, ...)``), so nothing is added to
  the captured step's saved bytes.

The exchange's collectives are attached with the other model-parallel ones (collectives.py).
"""

from __future__ import annotations

from dataclasses import replace

from ..workload.table import NodeRow, OpCost, Workload
from .layout import Parallel


def is_core(op: OpCost) -> bool:
    """The attention core (SDPA's kernels, or eager attention's tagged ops): what reads the other ranks' keys."""
    return bool(op.sdpa_backend)


def with_context_parallel(workload: Workload, parallel: Parallel) -> Workload:
    """The captured step (seq / cp tokens) with its attention core doing the work of the rank's queries
    against the whole sequence's keys: cp times the captured core's FLOPs, bytes and time."""
    cp = parallel.cp
    if cp == 1:
        return workload
    scaled: dict[int, OpCost] = {}

    def widened(op: OpCost) -> OpCost:
        if not is_core(op):
            return op
        if id(op) not in scaled:
            scaled[id(op)] = replace(op, flops=op.flops * cp, bytes=op.bytes * cp, estimated_ns=op.estimated_ns * cp)
        return scaled[id(op)]

    rows = [row.with_ops(widened(row.forward), [widened(op) for op in row.input_grad],
                         [widened(op) for op in row.weight_grad]) if _has_core(row) else row
            for row in workload.rows]
    return replace(workload, rows=rows)


def _has_core(row) -> bool:
    return isinstance(row, NodeRow) and any(is_core(op) for op in (row.forward, *row.input_grad, *row.weight_grad))


def kv_bytes(micro_batch: int, seq_per_rank: int, kv_heads: int, head_dim: int, tp: int, itemsize: int) -> int:
    """One rank's keys and values of one layer: 2 x tokens x its kv heads x head_dim values."""
    return 2 * micro_batch * seq_per_rank * max(kv_heads // tp, 1) * head_dim * itemsize

