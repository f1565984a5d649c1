"""Sequence parallelism (Korthikanti et al. 2022): the ops outside the tensor-parallel regions run
on seq / tp of the tokens.

Megatron-LM splits the sequence over the tensor-parallel group between a block's row-parallel
output (reduce-scattered) and the next block's column-parallel input (all-gathered): the layer
norms, dropouts and residual adds, and the final norm before the head. Each rank computes and
keeps 1/tp of them; the column-parallel GEMM's input is kept as that shard too (it is gathered
again in backward). The traced rank's graph holds them whole, so here each such row's FLOPs,
bytes, time above the per-op overhead and saved bytes are divided by tp, and the step's memory
peaks lose what those saves lost. A row is outside the region from the end of a row-parallel
module (or the start of a layer) until the next GEMM.
"""

from __future__ import annotations

from dataclasses import replace

from ..workload.layers import layer_of, within_any
from ..workload.table import NodeRow, OpCost, Workload
from .layout import Parallel


def with_sequence_parallel(workload: Workload, parallel: Parallel, stack: str | None, row_parallel: tuple[str, ...],
                           overhead_ns: float) -> Workload:
    if not parallel.sp or parallel.tp == 1:
        return workload
    tp = parallel.tp
    scaled: dict[int, OpCost] = {}

    def share(op: OpCost) -> OpCost:
        if id(op) not in scaled:
            rest = max(op.estimated_ns - overhead_ns, 0.0)
            scaled[id(op)] = replace(op, flops=op.flops // tp, bytes=op.bytes // tp,
                                     estimated_ns=op.estimated_ns - rest + rest / tp)
        return scaled[id(op)]

    rows, outside, previous = [], False, None
    for row in workload.rows:
        if not isinstance(row, NodeRow):
            rows.append(row)
            continue
        if previous is not None and _splits_after(previous, row, stack, row_parallel):
            outside = True
        if row.forward.kind == "matmul":
            outside = False
        if outside:
            row = row.with_ops(share(row.forward), [share(op) for op in row.input_grad],
                               [share(op) for op in row.weight_grad], saved_bytes=row.saved_bytes // tp,
                               selective_saved_bytes=row.selective_saved_bytes // tp)
        rows.append(row)
        previous = row
    # The step's peaks were read off the whole-sequence graph: they hold the same saves, less now.
    removed = workload.saved_bytes - sum(r.saved_bytes for r in rows if isinstance(r, NodeRow))
    return replace(workload, rows=rows, step_peak_bytes=max(workload.step_peak_bytes - removed, 0),
                   activation_peak_bytes=max(workload.activation_peak_bytes - removed, 0))


def _splits_after(previous: NodeRow, row: NodeRow, stack: str | None, row_parallel: tuple[str, ...]) -> bool:
    """Whether the sequence is split from ``row`` on: a new layer, the head after the last layer,
    or the first op past a row-parallel module."""
    before, here = layer_of(previous.module, stack), layer_of(row.module, stack)
    if before != here and (here is not None or before is not None):
        return True
    return within_any(previous.module, row_parallel) and not within_any(row.module, row_parallel)
