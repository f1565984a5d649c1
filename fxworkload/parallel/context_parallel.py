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

A ring runs the core as cp kernels, one per step, and merges each step's output into the running one by
its log-sum-exp, in fp32 (``merge_bytes``); the backward accumulates the query, key and value gradients in
fp32 over the steps. What that moves beside the kernels, on the slowest rank (the last, whose steps all
take whole outputs), as the implementations do it:
- torch's context parallelism (``torch/distributed/tensor/experimental/_attention.py``: ``_SDPAMerger``,
  ``_templated_ring_attention_backward``; every rotate method runs the steps), under the PyTorch stacks:
  eager, each step's merge is five kernels (the block's output to fp32; ``out - block_out``; times the
  sigmoid of the log-sum-exp difference; subtracted from ``out``), keys and values concatenated afresh each
  step, the gradients accumulated in fp32 (``+=``, ``_partial_update``'s chunk and ``cat``) and
  concatenated for the next rank each step; under ``--stack compiled`` the ring is traced into the block's
  graph and inductor fuses each step's merge into one kernel (fp32 output read and written, the block's
  16-bit output read), and each step's gradient update into one, at ``generated_kernel_slowdown``;
- Transformer Engine's p2p ring (``--stack fused``, ``cp_comm p2p``): the same fused corrections, its own
  kernels; its all-gather (and Llama 3's) runs one kernel per local chunk over the gathered keys: nothing
  to merge.
"""

from __future__ import annotations

from dataclasses import replace

from ..cost.devices import DeviceProfile
from ..cost.gpu import memory_ns
from ..workload.stacks import STACKS
from ..workload.table import NodeRow, OpCost, Workload
from .layout import Parallel

# Bytes per element of the rank's attention output (E: batch x heads x queries x head_dim) and of its keys
# (K: batch x key heads x keys x head_dim, as the core's op takes them), for the first step, each later step
# and the closing conversion, and the kernels each runs (module docstring; bf16 or fp16 operands, fp32 sums).
MERGE_BYTES = {
    "eager": {False: (((6, 8), 2), ((38, 8), 5), ((6, 0), 1)),     # forward
              True: (((14, 44), 6), ((10, 50), 6), ((6, 12), 2))},  # backward
    "fused": {False: (((6, 0), 1), ((10, 0), 1), ((6, 0), 1)),
              True: (((6, 12), 2), ((10, 20), 2), ((6, 12), 2))},
}


def is_core(op: OpCost) -> bool:
    """The attention core (SDPA's kernels, or eager attention's tagged ops): what reads the other ranks' keys."""
    return bool(op.sdpa_backend)


def merging(stack: str, cp_comm: str) -> str | None:
    """How a ring's per-step outputs are merged under ``stack`` (MERGE_BYTES' keys; None: no merge)."""
    how = STACKS[stack].ring_merges
    if how == "fused-p2p":
        return "fused" if cp_comm == "p2p" else None
    return how


def merge_bytes(attention: dict, cp: int, how: str) -> tuple[int, int]:
    """(bytes, kernels) the slowest rank's merges move beside one core op's cp steps (module docstring)."""
    out = attention["batch"] * attention["heads"] * attention["q_len"] * attention["head_dim"]
    keys = attention["batch"] * attention["kv_heads"] * attention["kv_len"] * attention["head_dim"]
    first, later, last = MERGE_BYTES[how][attention["backward"]]
    total = sum(e * out + k * keys for (e, k), _ in (first, last)) + (cp - 1) * (later[0][0] * out + later[0][1] * keys)
    return total, first[1] + last[1] + (cp - 1) * later[1]


def with_context_parallel(workload: Workload, parallel: Parallel, device: DeviceProfile | None = None) -> Workload:
    """The captured step (seq / cp tokens) with its attention core doing the work of the rank's queries
    against the whole sequence's keys: cp times the captured core's FLOPs, bytes and time; and, where its
    ring merges per-step outputs (``merging``), that merge's bytes and time on ``device``'s memory."""
    cp = parallel.cp
    if cp == 1:
        return workload
    scaled: dict[int, OpCost] = {}
    how = merging(workload.stack, parallel.cp_comm) if device is not None and device.gpu_model_fit else None
    slowdown = device.gpu_model().generated_kernel_slowdown if how and STACKS[workload.stack].generates_kernels else 1.0

    def widened(op: OpCost) -> OpCost:
        if not is_core(op):
            return op
        if id(op) not in scaled:
            extra_bytes, extra_ns = 0, 0.0
            if how and op.attention:
                extra_bytes, kernels = merge_bytes(op.attention, cp, how)
                extra_ns = memory_ns(extra_bytes, device.gpu_facts(), device.gpu_model(), kernels) * slowdown
            scaled[id(op)] = replace(op, flops=op.flops * cp, bytes=op.bytes * cp + extra_bytes,
                                     estimated_ns=op.estimated_ns * cp + extra_ns)
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

