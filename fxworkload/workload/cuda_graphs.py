"""CUDA graphs (``--cuda-graphs layers|step``): the ops a stack captures are replayed from a graph, so the host
issues one graph launch instead of each op.

- ``layers``: each decoder layer's forward and its backward are captured apart, the embeddings, the final
  norm, the head and the loss left eager: Megatron-Core's ``--enable-cuda-graph`` (Transformer Engine's
  ``make_graphed_callables`` per layer, ``--cuda-graph-scope`` its default) and
  ``torch.cuda.make_graphed_callables`` on the blocks.
- ``step``: the whole forward and backward as one graph (PyTorch's whole-network capture, Megatron-Core's
  full-iteration scope, ``torch.compile(mode="reduce-overhead")`` without graph breaks).

A replayed op has no host dispatch of its own; each replay costs the host ``host_graph_launch_ns`` (the
GPU model's, measured). Its kernel keeps its time, less the floor a cuBLAS call has back to back in eager
PyTorch (``gemm_min_ns``: the host's pace, which a graph does not wait on): the GPU still runs every kernel.
What the graph also saves on the GPU side (the launch gap between its kernels) is not modelled. Only that
floor is taken off an op's time as earlier passes left it, so what they added stays: FP8's GEMM dtype and
casts (workload/fp8.py), sequence parallelism's shares and context parallelism's widened cores.

Checked against the lent H100 (bench/lent_gpus.py --graphs): GPT-2's step eager and graphed both ways.
"""

from __future__ import annotations

from dataclasses import replace

from ..cost.devices import DeviceProfile
from ..cost.optime import gpu_op_ns
from .layers import layer_of
from .table import NodeRow, OpCost, Workload, kernel_dtype, op_dispatch_ns


def with_cuda_graphs(workload: Workload, device: DeviceProfile, scope: str, layer_stack: str | None) -> Workload:
    """The table with the ops ``scope`` captures replayed from graphs (re-timed on ``device``)."""
    if scope == "none" or not device.sm_count:
        return workload
    launch_ns = device.gpu_model().host_graph_launch_ns
    graphed: dict[int, object] = {}

    def replayed(op):
        if id(op) not in graphed:
            graphed[id(op)] = _replayed(op, device)
        return graphed[id(op)]

    rows = list(workload.rows)
    regions = _regions(rows, scope, layer_stack)
    captured = {i for region in regions for i in region}
    for i in captured:
        row = rows[i]
        rows[i] = row.with_ops(replayed(row.forward), [replayed(op) for op in row.input_grad],
                               [replayed(op) for op in row.weight_grad])
    for region in regions:  # one launch at the head of the forward's graph and, per layer, of the backward's
        first = rows[region[0]]
        rows[region[0]] = first.with_ops(replace(first.forward, dispatch_ns=launch_ns), first.input_grad,
                                         first.weight_grad)
        last = next((i for i in reversed(region) if rows[i].input_grad or rows[i].weight_grad), None)
        if scope == "layers" and last is not None:  # autograd runs the region's last row's backward first
            row = rows[last]
            ops = row.input_grad + row.weight_grad
            head = replace(ops[0], dispatch_ns=ops[0].dispatch_ns + launch_ns)
            split = len(row.input_grad)
            ops = [head] + ops[1:]
            rows[last] = row.with_ops(row.forward, ops[:split], ops[split:])
    return replace(workload, rows=rows)


def _replayed(op: OpCost, device: DeviceProfile) -> OpCost:
    """The op replayed from a graph: no dispatch of its own, and its kernel time less the eager floor a GEMM
    sat on (0 for every other op, and for a GEMM above the floor: a graph replays the same kernels)."""
    replayed = replace(op, graphed=True)
    dtype = kernel_dtype(op)
    floor_ns = gpu_op_ns(op, device, dtype) - gpu_op_ns(replayed, device, dtype)
    return replace(replayed, estimated_ns=op.estimated_ns - floor_ns, dispatch_ns=op_dispatch_ns(replayed, device))


def _regions(rows: list, scope: str, layer_stack: str | None) -> list[list[int]]:
    """The row indices of each captured graph, in row order."""
    node_rows = [i for i, row in enumerate(rows) if isinstance(row, NodeRow)]
    if scope == "step":
        return [node_rows] if node_rows else []
    by_layer: dict[int, list[int]] = {}
    for i in node_rows:
        layer = layer_of(rows[i].module, layer_stack)
        if layer is not None:
            by_layer.setdefault(layer, []).append(i)
    return [by_layer[layer] for layer in sorted(by_layer)]
