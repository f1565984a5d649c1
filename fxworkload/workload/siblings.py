"""Sibling linears: the linear layers of a decoder layer that read one tensor (q, k and v; gate and up), and
Megatron-Core's merge of each such group into one GEMM.

Found by two walks over the table's rows (a HuggingFace model's separate projections):
- linears of one input size with only views between them read the same input (q, then k, then v: each
  projection's reshape and transpose are views);
- linears whose input's producer (the nearest row before the linear, in its layer, that made a tensor of the
  input's size and is not a view) is one row, with as many output features each (gate and up, whose
  activation runs between them). q's output can have its input's size (q's width equal to the hidden size),
  which is why q/k/v need the first walk.

Megatron-Core builds each group as one linear: attention's ``linear_qkv`` with ``query_projection_size +
2 * kv_projection_size`` output features (megatron/core/transformer/attention.py, ``SelfAttention``), the MLP's
``linear_fc1`` with ``ffn_hidden_size * 2`` where ``gated_linear_unit`` (megatron/core/transformer/mlp.py). So
under ``--stack fused`` a group's forward is one GEMM of m x k by k x (n_1 + ... + n_j), its input gradient one
of m x (n_1 + ... + n_j) by that by k, its weight gradient one of (n_1 + ... + n_j) x m by m x k: timed as such
(a narrow k or v of grouped-query attention no longer runs a wave of its own), the time shared among the rows by
their FLOPs, which stay each row's. What else a row's op cost (FP8's casts) stays with it. Not modelled: the
adds that sum the separate input gradients (one GEMM writes the sum), which the fused stack folds into the
norm's backward kernel.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..cost.devices import DeviceProfile
from ..cost.optime import gpu_op_ns
from .layers import layer_of
from .stacks import STACKS
from .table import NodeRow, OpCost, Workload, kernel_dtype

# where a linear's output features stand in the (m, k, n) of each of its GEMMs as captured: forward
# input @ weight.t() (m, k, n); input gradient grad @ weight (m, n, k); weight gradient grad.t() @ input (n, m, k)
FEATURES_AT = {"forward": 2, "input_grad": 1, "weight_grad": 0}


def linear_in_layer(row: NodeRow, stack: str | None) -> bool:
    op = row.forward
    return (op.gemm_mkn is not None and not op.sdpa_backend and op.kind == "matmul"
            and layer_of(row.module, stack) is not None)


def makers_of_input_size(rows: list, linear: NodeRow, elements: int, stack: str | None, before: int | None = None):
    """Walking back from the linear (at ``before``, else after the last row) within its layer: the index of each
    row that made a tensor of the linear's input size (its input's producer among them, the nearest that is not
    a view)."""
    layer = layer_of(linear.module, stack)
    for i in range(len(rows) - 1 if before is None else before - 1, -1, -1):
        row = rows[i]
        if not isinstance(row, NodeRow):
            continue
        if layer_of(row.module, stack) != layer:
            return
        if any(math.prod(shape) == elements for shape in row.forward.output_shapes):
            yield i


def input_producer(rows: list, linear: NodeRow, elements: int, stack: str | None, before: int | None = None) -> int | None:
    """The index in ``rows`` of the linear's input's producer (gate's and up's are the same norm); None if none."""
    return next((i for i in makers_of_input_size(rows, linear, elements, stack, before)
                 if rows[i].forward.kind != "view"), None)


def input_elements(row: NodeRow) -> int:
    m, k, _ = row.forward.gemm_mkn
    return m * k * row.forward.gemm_batch


def sibling_groups(rows: list, stack: str | None) -> list[list[int]]:
    """The indices in ``rows`` of each group of two or more linears that read one tensor (module docstring)."""
    groups: list[list[int]] = []
    by_producer: dict[tuple[int, int], list[int]] = {}
    previous = None  # (input elements, group) of the last linear while only views follow it
    for i, row in enumerate(rows):
        if not (isinstance(row, NodeRow) and linear_in_layer(row, stack)):
            if isinstance(row, NodeRow) and row.forward.kind != "view":
                previous = None
            continue
        elements = input_elements(row)
        if previous is not None and previous[0] == elements:
            group = previous[1]
        else:
            producer = input_producer(rows, row, elements, stack, before=i)
            # one producer, as many output features: gate and up (a router beside them, other widths, apart)
            key = (producer, row.forward.gemm_mkn[2])
            group = by_producer.get(key) if producer is not None else None
            if group is None:
                group = []
                groups.append(group)
                if producer is not None:
                    by_producer[key] = group
        group.append(i)
        previous = (elements, group)
    return [group for group in groups if len(group) > 1]


def with_merged_siblings(workload: Workload, device: DeviceProfile, layer_stack: str | None) -> Workload:
    """Under a stack that builds sibling linears as one (Megatron-Core's), each group's GEMMs timed as one
    (module docstring); the table as it was elsewhere, and on a profile without the GPU model. ``layer_stack``:
    the path of the model's decoder layers."""
    if not (STACKS[workload.stack].merges_sibling_linears and device.sm_count):
        return workload
    rows = list(workload.rows)
    for group in sibling_groups(rows, layer_stack):
        members = [rows[i] for i in group]
        if any(r.forward.gemm_batch != 1 for r in members):
            continue
        phases = {"forward": [[r.forward] for r in members],
                  "input_grad": [[op for op in r.input_grad if op.gemm_mkn] for r in members],
                  "weight_grad": [[op for op in r.weight_grad if op.gemm_mkn] for r in members]}
        retimed = {}  # id of a member's GEMM op -> the op with its share of the one GEMM
        for phase, lists in phases.items():
            if all(len(ops) == 1 for ops in lists):
                ops = [ops[0] for ops in lists]
                retimed.update({id(op): new for op, new in zip(ops, _merged_ops(ops, members, phase, device))
                                if new is not None})
        for i, row in zip(group, members):
            rows[i] = row.with_ops(retimed.get(id(row.forward), row.forward),
                                   [retimed.get(id(op), op) for op in row.input_grad],
                                   [retimed.get(id(op), op) for op in row.weight_grad])
    return replace(workload, rows=rows)


def _merged_ops(ops: list[OpCost], members: list[NodeRow], phase: str, device: DeviceProfile) -> list:
    """Each member's op of ``phase`` with the one GEMM's time in place of its own, shared by FLOPs; Nones where
    the GEMMs are not the linears' as captured (FEATURES_AT)."""
    at = FEATURES_AT[phase]
    features = [r.forward.gemm_mkn[2] for r in members]
    shapes = [op.gemm_mkn for op in ops]
    rest = {tuple(d for j, d in enumerate(shape) if j != at) for shape in shapes}
    if len(rest) != 1 or any(shape[at] != n for shape, n in zip(shapes, features)) or not ops[0].gemm_leading:
        return [None] * len(ops)
    width = sum(features)
    first = ops[0]
    one = replace(first, gemm_mkn=tuple(width if j == at else d for j, d in enumerate(first.gemm_mkn)),
                  gemm_leading=tuple(width if ld == features[0] else ld for ld in first.gemm_leading),
                  flops=sum(op.flops for op in ops))
    dtype = kernel_dtype(first)
    one_ns = gpu_op_ns(one, device, dtype)
    total_flops = sum(op.flops for op in ops) or 1
    return [replace(op, estimated_ns=op.estimated_ns - gpu_op_ns(op, device, dtype) + one_ns * op.flops / total_flops)
            for op in ops]
