"""Activation recomputation with Megatron-LM's meanings (``--recompute-granularity``).

- ``selective``: the attention core (the ops of a scaled-dot-product attention: a fused kernel, or
  the math path's matmuls, softmax and dropout, or transformers' eager attention) is run again in
  backward; what it saved is dropped and what it is re-made from (its inputs, Q, K and V) is kept:
  each row's ``selective_saved_bytes``, read off the graph with the core's ops not kept.
- ``full``: each recomputed layer keeps only its input (batch x seq x hidden, 1/tp of it with
  sequence parallelism); its whole forward runs again in backward. Under torch.compile (a stack whose
  saves are AOTAutograd's partitioner's) only what the layer's backward reads runs again: the
  checkpointed region's ops are tagged to be recomputed (torch/_higher_order_ops/wrap.py, a policy that
  always prefers recomputing), and the min-cut partitioner puts into the backward graph only the
  forward nodes the backward's own nodes need (torch/_functorch/partitioners.py, ``classify_nodes``'s
  ``required_bw_nodes``). A block's last GEMM (o_proj's or down_proj's row-parallel linear, whose output
  only the residual add reads) and what follows it are not run again: the forward up to the layer's last
  row whose output its backward reads (the row's ``saved_bytes``; the layer's final row, its output,
  is the next layer's kept input, not its own backward's).

- ``op``: torchtitan's op-level selective checkpointing of each layer (workload/stacks.py): torch's
  selective checkpoint keeps the layer's input and the output of every op its policy saves (GEMMs
  and attention kernels, but every second GEMM), whether backward reads it or not, and runs the
  layer's other ops again in backward.

``--recompute-layers N`` recomputes the first N layers of each pipeline stage (Megatron's
``--recompute-num-layers`` with the block method); by default every layer. A recomputed op is a
copy of its forward op at the head of the row's input-gradient ops, so its time shows in every
output: the tables' backward time, the SimAI file and the trace.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..capture.trace import INPUT_GRAD
from ..cost.flops import base_name
from ..workload.layers import layer_of
from ..workload.memory import allocated_bytes
from ..workload.stacks import STACKS, op_level_recomputed
from ..workload.table import NodeRow, OpCost, Workload
from .layout import Parallel, virtual_stage_layers


def recomputed_layers(parallel: Parallel, layers: int) -> set[int]:
    if parallel.recompute == "none":
        return set()
    count = parallel.recompute_layers  # per model chunk, as Megatron-LM's --recompute-num-layers with --vpp
    return {layer for chunk in virtual_stage_layers(parallel, layers) for layer in list(chunk)[:count]}


def with_recompute(workload: Workload, parallel: Parallel, stack: str | None, layers: int,
                   layer_input_bytes: int) -> tuple[Workload, int]:
    """The table as the recomputing step runs it: recomputed forward ops added to backward, and
    the saved bytes of what is recomputed dropped (a full layer keeps its input); and the bytes
    one layer's recomputation re-creates in backward (its dropped saves), a transient of the step."""
    chosen = recomputed_layers(parallel, layers)
    if not chosen:
        return workload, 0
    copies: dict[int, OpCost] = {}  # one copy per op object: layers that share ops share their copies

    def again(op: OpCost) -> OpCost:
        if id(op) not in copies:
            copies[id(op)] = replace(op, phase=INPUT_GRAD)
        return copies[id(op)]

    again_op = _op_level_rows(workload, stack) if parallel.recompute == "op" else set()
    reads_only = parallel.recompute == "full" and STACKS[workload.stack].keeps == "partitioner"
    read = _read_rows(workload, stack) if reads_only else set()
    rows, seen_layers, dropped = [], set(), {}
    for row in workload.rows:
        layer = layer_of(row.module, stack) if isinstance(row, NodeRow) else None
        if layer not in chosen:
            rows.append(row)
            continue
        recomputed = {"full": not reads_only or id(row) in read, "selective": row.forward.sdpa_backend is not None,
                      "op": id(row) in again_op}[parallel.recompute]
        if parallel.recompute == "selective":
            saved = row.selective_saved_bytes
        elif parallel.recompute == "op":
            saved = 0 if recomputed else _output_bytes(row.forward)
        else:
            saved = 0
        if parallel.recompute in ("full", "op") and layer not in seen_layers:
            saved += layer_input_bytes  # the layer's first row carries its kept input
            seen_layers.add(layer)
        dropped[layer] = dropped.get(layer, 0) + row.saved_bytes - saved
        again_first = [again(row.forward)] if recomputed else []
        rows.append(row.with_ops(row.forward, again_first + row.input_grad, row.weight_grad, saved_bytes=saved))
    return replace(workload, rows=rows), max(dropped.values(), default=0)


def is_recomputed(row: NodeRow) -> bool:
    """Whether the row's forward op runs again in backward (its copy heads the row's input-gradient ops)."""
    return bool(row.input_grad) and row.input_grad[0].fx_name == row.forward.fx_name


def _read_rows(workload: Workload, stack: str | None) -> set[int]:
    """The rows (by id) of each layer up to the last whose output the layer's own backward reads: what the
    partitioner recomputes of a checkpointed layer (module docstring). The layer's final row is its output,
    which the next layer keeps: it counts only for what it saves beyond that (a closing norm's statistics)."""
    by_layer: dict[int, list[NodeRow]] = {}
    for row in workload.node_rows:
        layer = layer_of(row.module, stack)
        if layer is not None:
            by_layer.setdefault(layer, []).append(row)
    read = set()
    for rows in by_layer.values():
        last = len(rows) - 1 if rows[-1].saved_bytes > _output_bytes(rows[-1].forward) else max(
            (i for i, row in enumerate(rows[:-1]) if row.saved_bytes), default=-1)
        read.update(id(row) for row in rows[:last + 1])
    return read


def _op_level_rows(workload: Workload, stack: str | None) -> set[int]:
    """The rows (by id) whose forward op-level checkpointing runs again, layer by layer."""
    by_layer: dict[int, list[NodeRow]] = {}
    for row in workload.node_rows:
        layer = layer_of(row.module, stack)
        if layer is not None:
            by_layer.setdefault(layer, []).append(row)
    return {id(row) for rows in by_layer.values()
            for row, again in zip(rows, op_level_recomputed([base_name(r.forward.op) for r in rows])) if again}


def _output_bytes(op: OpCost) -> int:
    """The bytes of an op's outputs as the allocator holds them."""
    return sum(allocated_bytes(math.prod(shape) * getattr(torch, dtype).itemsize)
               for shape, dtype in zip(op.output_shapes, op.output_dtypes))
