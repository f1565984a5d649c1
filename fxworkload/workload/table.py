"""From a captured training step to the per-node workload: costs, backward split, gradient rows."""

from __future__ import annotations

import functools

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from ..capture.attention import BACKEND_KEY, OP_BACKEND
from ..capture.flex import FLEX_BLOCKS_KEY
from ..capture.trace import FORWARD, INPUT_GRAD, PHASES, WEIGHT_GRAD, Capture
from ..cost import flops as flop_rules
from ..cost.devices import DeviceProfile
from ..cost.gpu import two_stream_ns
from ..cost.optime import attention_facts, gpu_op_ns
from ..cost.roofline import estimate_ns
from ..cost.traffic import bytes_moved, is_alias
from ..dtypes import DTYPE_NAMES
from .fusion import Regions, made_from, regions, traffic_bytes
from .memory import SavePolicy, activation_memory
from .partition import partitioner_saved
from .stacks import STACKS


@dataclass(frozen=True)
class OpCost:
    fx_name: str  # the node's name in its captured graph (internal: not written, it numbers ops globally)
    op: str  # aten overload, e.g. aten.addmm.default
    kind: str  # matmul, attention, elementwise, norm, reduction, data_movement, view, other
    phase: str  # forward, input_grad, weight_grad
    input_shapes: list
    input_dtypes: list
    output_shapes: list
    output_dtypes: list
    flops: int
    bytes: int
    estimated_ns: float
    has_flop_rule: bool
    gemm_mkn: tuple[int, int, int] | None = None  # m, k, n of a plain or batched GEMM, for the roofline
    gemm_leading: tuple[int, int, int] | None = None  # leading dimensions (elements) of A, B and C
    gemm_batch: int = 1  # matrices in a batched GEMM
    grouped_gemm: tuple[int, int, int, int] | None = None  # m, k, n of one group, and the groups (MoE experts)
    attention: dict | None = None  # a fused attention kernel: backend, shapes, is_causal, has_mask, dropout
    sdpa_backend: str | None = None  # the SDPA implementation this op belongs to (cudnn, flash, efficient, math...)
    dispatch_ns: float = 0.0  # host (CPU) time to issue it in an eager step; 0 where not modelled
    fused_ops: int = 0  # a fused kernel's op (--stack fused/compiled): the aten ops the kernel runs; 0: not one
    fused: bool = False  # runs inside another op's fused kernel, whose flops, bytes and time hold it
    gemm_dtype: str = ""  # a GEMM run in another dtype than its tensors' (--fp8: "fp8"); "" = theirs
    gemm_padded: bool = False  # --stack compiled: padded to aligned shapes where inductor's pad_mm would
    graphed: bool = False  # --cuda-graphs: replayed from a CUDA graph, no host dispatch of its own (cuda_graphs.py)
    generated: bool = False  # --stack compiled: a fused kernel inductor generates (cost/gpu.py generated_kernel_slowdown)


@dataclass
class NodeRow:
    """One forward node, with the backward ops autograd ran for it."""
    name: str
    module: str
    forward: OpCost
    input_grad: list[OpCost] = field(default_factory=list)
    weight_grad: list[OpCost] = field(default_factory=list)
    saved_bytes: int = 0  # of the storages this node creates, those backward reads (held forward to backward)
    selective_saved_bytes: int = 0  # the same when its layer's attention core is recomputed (--recompute selective)

    def with_ops(self, forward: OpCost, input_grad: list[OpCost], weight_grad: list[OpCost],
                 saved_bytes: int | None = None, selective_saved_bytes: int | None = None) -> NodeRow:
        """This row with other ops (and saved bytes): ``dataclasses.replace`` without its per-call field
        walk, which the table transforms of a layout search pay a million times."""
        return NodeRow(self.name, self.module, forward, input_grad, weight_grad,
                       self.saved_bytes if saved_bytes is None else saved_bytes,
                       self.selective_saved_bytes if selective_saved_bytes is None else selective_saved_bytes)

    def renamed(self, name: str, module: str) -> NodeRow:
        """This row under another name and module (the fast path's layer copies), as ``with_ops`` does."""
        return NodeRow(name, module, self.forward, self.input_grad, self.weight_grad, self.saved_bytes,
                       self.selective_saved_bytes)

    def ops(self, phase: str) -> list[OpCost]:
        """This row's ops of one phase: its forward op, or the backward ops autograd ran for it."""
        if phase == FORWARD:
            return [self.forward]
        return self.input_grad if phase == INPUT_GRAD else self.weight_grad

    @property
    def backward_ns(self) -> float:
        return sum(op.estimated_ns for op in self.input_grad)

    @property
    def weight_grad_ns(self) -> float:
        return sum(op.estimated_ns for op in self.weight_grad)

    @property
    def total_ns(self) -> float:
        return self.forward.estimated_ns + self.backward_ns + self.weight_grad_ns


@dataclass
class GradRow:
    """The asynchronous all-reduce of one module's parameter gradients."""
    name: str
    module: str
    parameters: list[str]
    elements: int
    bytes: int


@dataclass
class Workload:
    rows: list  # NodeRow and GradRow, in table order
    parameter_count: int
    gradient_bytes: int
    step_peak_bytes: int = 0  # highest activations + temporaries + gradients live in one micro-batch's step
    activation_peak_bytes: int = 0  # the same without the parameter gradients
    # what PyTorch's caching allocator holds beyond the step's allocated peak (segments it cannot reuse for
    # a later request), from its rules replayed over the step (workload/allocator.py); reserved = allocated + this
    reserved_slack_bytes: int = 0
    # per kernel family, the 90 % interval of measured / estimated on held-out kernels (the device's fit)
    error_intervals: dict = field(default_factory=dict)
    fp8_weight_elements: int = 0  # --fp8: the weights with FP8 copies (the decoder layers' linear layers)
    fp8_modules: frozenset = frozenset()  # --fp8: those linear layers' module paths
    # --fp8: the weights' FP8 copies are made once a step and kept (Transformer Engine); False: cast in every
    # forward and dropped (torchao's dynamic scaling)
    fp8_weights_kept: bool = True
    # --fp8: the sequence-parallel all-gathers into the FP8 linears move FP8 (fp8_tp_gathers); False: 16-bit,
    # torchao's row-wise recipe runs regular tensor parallelism and casts after the gather
    fp8_gathers_cast: bool = True
    stack: str = "eager"  # the execution stack the rows are costed as (workload/stacks.py)

    @classmethod
    def of_rows(cls, rows: list, grad_dtype: torch.dtype, step_peak_bytes: int = 0,
                activation_peak_bytes: int = 0, stack: str = "eager", reserved_slack_bytes: int = 0) -> Workload:
        """The table of these rows; its parameters are those its gradient rows hold."""
        elements = sum(r.elements for r in rows if isinstance(r, GradRow))
        return cls(rows=rows, parameter_count=elements, gradient_bytes=elements * grad_dtype.itemsize,
                   step_peak_bytes=step_peak_bytes, activation_peak_bytes=activation_peak_bytes, stack=stack,
                   reserved_slack_bytes=reserved_slack_bytes)

    @functools.cached_property
    def saved_bytes(self) -> int:
        """Activations one micro-batch holds from its forward until its backward (summed once: a
        table is never changed in place, only replaced)."""
        return sum(r.saved_bytes for r in self.node_rows)

    @property
    def fp8_tp_gathers(self) -> bool:
        """--fp8: the sequence-parallel all-gathers into the FP8 linears move FP8 (one byte an element), as both
        recipes run them: torchao's Float8 tensor parallelism (torchao/float8/float8_tensor_parallel.py) casts a
        block's input before its all-gather (PrepareFloat8ModuleInput) and a row-parallel output's gradient
        before the backward's (Float8RowwiseParallel: "fwd noop bwd cast"); Transformer Engine quantizes the
        norm's output before LayerNormLinear's all-gather and gathers grad_output with its quantizer
        (transformer_engine/pytorch/module/base.py, grad_output_preprocess). The reduce-scatters stay 16-bit.
        torchao's row-wise recipe gathers in 16 bits (torchtitan: 'float8 all-gather with TP is only supported for
        tensorwise')."""
        return bool(self.fp8_modules) and self.fp8_gathers_cast

    @property
    def node_rows(self) -> list[NodeRow]:
        return [r for r in self.rows if isinstance(r, NodeRow)]

    @property
    def grad_rows(self) -> list[GradRow]:
        return [r for r in self.rows if isinstance(r, GradRow)]

    def ops(self, phase: str | None = None) -> list[OpCost]:
        phases = PHASES if phase is None else (phase,)
        return [op for r in self.node_rows for p in phases for op in r.ops(p)]

    def execution_order(self) -> list[OpCost]:
        """Ops as an eager step runs them: forward in row order, then backward from the last row
        back (autograd's reverse order), each row's input-gradient ops before its weight-gradient ones."""
        rows = self.node_rows
        return [r.forward for r in rows] + [op for r in reversed(rows) for op in r.input_grad + r.weight_grad]

    @functools.cached_property
    def totals(self) -> dict:
        """Whole-step figures: flops, bytes and estimated ns per phase, kernel and dispatch sums, the step."""
        out = {}
        for phase in (FORWARD, INPUT_GRAD, WEIGHT_GRAD):
            ops = self.ops(phase)
            out[f"{phase}_flops"] = sum(op.flops for op in ops)
            out[f"{phase}_bytes"] = sum(op.bytes for op in ops)
            out[f"{phase}_estimated_ns"] = sum(op.estimated_ns for op in ops)
        ordered = self.execution_order()
        out["kernel_sum_ns"] = sum(out[f"{p}_estimated_ns"] for p in (FORWARD, INPUT_GRAD, WEIGHT_GRAD))
        out["dispatch_sum_ns"] = sum(op.dispatch_ns for op in ordered)
        out["step_estimated_ns"] = two_stream_ns([(op.dispatch_ns, op.estimated_ns) for op in ordered])
        if self.error_intervals:  # each family's kernels off together (a bias shared by a kind of kernel)
            for bound, name in ((0, "step_low_ns"), (1, "step_high_ns")):
                out[name] = two_stream_ns([(op.dispatch_ns, op.estimated_ns * self.error_intervals.get(
                    kernel_family(op), (1.0, 1.0))[bound]) for op in ordered])
        out["parameter_count"] = self.parameter_count  # trainable parameters (a count, not bytes)
        out["gradient_bytes"] = self.gradient_bytes
        out["saved_activation_bytes"] = self.saved_bytes
        out["step_peak_bytes"] = self.step_peak_bytes
        out["reserved_slack_bytes"] = self.reserved_slack_bytes
        out["activation_peak_bytes"] = self.activation_peak_bytes
        return out


def kernel_family(op: OpCost) -> str:
    """Which family of the GPU model (and of its measured kernels) an op's time comes from."""
    if op.attention is not None or op.kind == flop_rules.ATTENTION:
        return "sdpa"
    if op.kind == flop_rules.MATMUL:
        return "gemm"
    return "vector"


def build(capture: Capture, model: torch.nn.Module, device: DeviceProfile | None, grad_dtype: torch.dtype,
          stack: str = "eager", layers_path: str | None = None) -> Workload:
    """The table of one captured step as ``stack`` runs it (workload/stacks.py); with no device, every
    estimated time is 0 (rows and sizes only). ``layers_path``: the ModuleList of the decoder layers
    (ModelFacts.stack), which a stack compiling each block alone compiles."""
    costs = {node: cost_of(node, phase, device) for node, phase in capture.phase.items()}
    scope = compiled_scope(capture, layers_path) if STACKS[stack].scope == "layers" else None
    if STACKS[stack].pads_gemms:
        costs = {node: timed(replace(cost, gemm_padded=True), device)
                 if cost.gemm_leading is not None and (scope is None or node in scope) else cost
                 for node, cost in costs.items()}
    keep = None
    if STACKS[stack].fuses_pointwise:
        found = regions(capture, scope)
        keep = SavePolicy(found, partitioner_saved(capture) if STACKS[stack].keeps == "partitioner" else None,
                          scope=None if scope is None else frozenset(scope))
        costs = _fused_costs(costs, found, device, STACKS[stack].generates_kernels)
    forward_nodes = [n for n, phase in capture.phase.items() if phase == FORWARD]
    main_ops = _main_ops(forward_nodes, capture.module, costs, model)
    names = _row_names(forward_nodes, capture.module, main_ops)
    memory = activation_memory(capture, keep)
    core = [n for n in forward_nodes if costs[n].sdpa_backend]  # the attention core: what selective recomputes
    selective = activation_memory(capture, (keep or SavePolicy()).recomputing(core)) if core else memory
    rows = {n: NodeRow(name=names[n], module=capture.module[n], forward=costs[n],
                       saved_bytes=memory.saved_bytes.get(n, 0),
                       selective_saved_bytes=selective.saved_bytes.get(n, 0)) for n in forward_nodes}
    _dedupe_names(list(rows.values()))
    for node, owner in capture.owner.items():
        row = rows[owner]
        (row.weight_grad if capture.phase[node] == WEIGHT_GRAD else row.input_grad).append(costs[node])

    grad_rows = _grad_rows(model, capture, main_ops, rows, grad_dtype)
    table = []
    for node in forward_nodes:
        table.extend(grad_rows.pop(node, []))
        table.append(rows[node])
    for leftover in grad_rows.values():  # parameters no forward op of their module reads
        table.extend(leftover)
    return Workload.of_rows(table, grad_dtype, step_peak_bytes=memory.step_peak_bytes,
                            activation_peak_bytes=memory.activation_peak_bytes, stack=stack,
                            reserved_slack_bytes=memory.reserved_peak_bytes - memory.allocated_peak_bytes)


def compiled_scope(capture: Capture, layers_path: str | None) -> dict[torch.fx.Node, str]:
    """Each node of the decoder layers under ``layers_path``, forward and backward (a backward node is its
    forward owner's), with its layer's path: what a compiler that compiles each block alone sees, one graph
    a layer."""
    prefix = f"{layers_path}." if layers_path else None
    inside = {node: prefix + module[len(prefix):].split(".", 1)[0] for node, module in capture.module.items()
              if prefix and module.startswith(prefix)}
    return inside | {node: inside[owner] for node, owner in capture.owner.items() if owner in inside}


def _fused_costs(costs: dict, found: Regions, device: DeviceProfile | None, generated: bool = False) -> dict:
    """Each region's kernel on its lead op (its flops, the bytes the one kernel moves; ``generated``: a kernel
    the stack's compiler writes, not a library's); its other ops marked as run inside it."""
    costs = dict(costs)
    for region, members in found.members.items():
        lead = found.lead(region)
        kernels = [n for n in members if not is_alias(n.target)]
        costs[lead] = timed(replace(costs[lead], flops=sum(costs[n].flops for n in kernels), fused_ops=len(kernels),
                                    generated=generated,
                                    bytes=traffic_bytes(region, found, read_as=functools.partial(made_from, regions=found))),
                            device)
        for node in kernels:
            if node is not lead:
                costs[node] = replace(costs[node], flops=0, bytes=0, estimated_ns=0.0, dispatch_ns=0.0, fused=True)
    return costs


def recost(workload: Workload, device: DeviceProfile) -> Workload:
    """The same table with every op's time estimated on ``device``; shared ops are costed once."""
    costed: dict[int, OpCost] = {}

    def cost(op: OpCost) -> OpCost:
        if id(op) not in costed:
            costed[id(op)] = timed(op, device)
        return costed[id(op)]

    rows = [row if isinstance(row, GradRow) else row.with_ops(
        cost(row.forward), [cost(op) for op in row.input_grad], [cost(op) for op in row.weight_grad])
        for row in workload.rows]
    return replace(workload, rows=rows, error_intervals=device.error_intervals() if device.sm_count else {})


def timed(op: OpCost, device: DeviceProfile | None) -> OpCost:
    """The op with its kernel and host times on ``device``; as it is with no device."""
    if device is None:
        return op
    return replace(op, estimated_ns=op_estimate_ns(op, device), dispatch_ns=op_dispatch_ns(op, device))


def op_estimate_ns(op: OpCost, device: DeviceProfile) -> float:
    """Kernel time of one op: the GPU mechanics model where the profile has the GPU's facts,
    else the roofline with the profile's rates (CPUs, calibrated tables)."""
    if device.sm_count:
        return gpu_op_ns(op, device, kernel_dtype(op))
    dtype = _floating_dtype(op)
    return estimate_ns(op.flops, op.bytes, dtype, device, uses_matmul_units=op.kind in (flop_rules.MATMUL,
                       flop_rules.ATTENTION), op_name=flop_rules.base_name(op.op), gemm=op.gemm_mkn)


def kernel_dtype(op: OpCost) -> str:
    """The dtype an op's kernel computes in: a GEMM run in another dtype than its tensors' (``gemm_dtype``,
    FP8), else its first floating tensor's."""
    return op.gemm_dtype or DTYPE_NAMES.get(_floating_dtype(op), "fp32")


def _floating_dtype(op: OpCost):
    return next((getattr(torch, name) for name in op.input_dtypes + op.output_dtypes
                 if getattr(torch, name).is_floating_point), None)


def op_dispatch_ns(op: OpCost, device: DeviceProfile) -> float:
    """Host time of an op that launches a kernel, on a GPU profile; views and CPU profiles: 0."""
    if not device.sm_count or op.graphed or op.kind == flop_rules.VIEW or (op.flops == 0 and op.bytes == 0):
        return 0.0
    model = device.gpu_model()
    return model.host_dispatch_ns + model.host_output_ns * max(len(op.output_shapes) - 1, 0)


def cost_of(node: torch.fx.Node, phase: str, device: DeviceProfile | None) -> OpCost:
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    out = node.meta.get("val")
    alias = is_alias(node.target)
    flops = 0 if alias else flop_rules.node_flops(node.target, args, kwargs, out)
    nbytes = bytes_moved(node.target, args, kwargs, out)
    kind = flop_rules.op_kind(node.target, alias)
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    op = OpCost(
        fx_name=node.name, op=_op_string(node.target), kind=kind, phase=phase,
        input_shapes=[list(t.shape) for t in inputs], input_dtypes=[_dtype_name(t.dtype) for t in inputs],
        output_shapes=[list(t.shape) for t in outputs], output_dtypes=[_dtype_name(t.dtype) for t in outputs],
        flops=flops or 0, bytes=nbytes, estimated_ns=0.0, has_flop_rule=alias or flops is not None,
        gemm_mkn=flop_rules.gemm_shape(node.target, args), gemm_leading=flop_rules.gemm_leading_dims(node.target, args),
        gemm_batch=flop_rules.gemm_batch(node.target, args), grouped_gemm=flop_rules.grouped_gemm_shape(node.target, args),
        attention=attention_facts(node.target, args, kwargs, _flex_blocks(node)),
        sdpa_backend=node.meta.get("custom", {}).get(BACKEND_KEY) or OP_BACKEND.get(flop_rules.op_name(node.target)))
    return timed(op, device)


def _flex_blocks(node: torch.fx.Node) -> tuple[int, int, int] | None:
    """A flex attention node's (partial, full, all) tiles: the tag on the op that made its block mask's first
    table (capture/flex.py); None for other ops or an untagged mask."""
    if not flop_rules.is_flex_attention(node.target):
        return None
    block_mask = next((a for a in node.args if isinstance(a, tuple) and len(a) > 2), None)
    table = block_mask[2] if block_mask else None
    counts = table.meta.get("custom", {}).get(FLEX_BLOCKS_KEY) if isinstance(table, torch.fx.Node) else None
    return tuple(counts) if counts is not None else None


def _main_ops(forward_nodes, module_of, costs, model) -> dict[torch.fx.Node, str]:
    """The costliest forward op of each leaf or parameter-owning module: it is named after the module."""
    named = dict(model.named_modules())
    best: dict[str, torch.fx.Node] = {}
    for node in forward_nodes:
        path = module_of[node]
        module = named.get(path)
        if not path or module is None:
            continue
        if next(module.children(), None) is not None and next(module.parameters(recurse=False), None) is None:
            continue
        key = (costs[node].flops, costs[node].bytes)
        if path not in best or key > (costs[best[path]].flops, costs[best[path]].bytes):
            best[path] = node
    return {node: path for path, node in best.items() if costs[node].bytes > 0}


def _row_names(forward_nodes, module_of, main_ops) -> dict[torch.fx.Node, str]:
    """A module's main op is named after the module; its other ops after the module and the op,
    numbered within the module (``transformer_h_0_attn_view_2``), so names never depend on the
    ops of other layers."""
    seen: dict[str, int] = defaultdict(int)
    names = {}
    for node in forward_nodes:
        if node in main_ops:
            names[node] = main_ops[node].replace(".", "_")
            continue
        module = module_of[node]
        base = (module.replace(".", "_") + "_" if module else "") + flop_rules.op_name(node.target)
        names[node] = base if seen[base] == 0 else f"{base}_{seen[base]}"
        seen[base] += 1
    return names


def _dedupe_names(rows: list[NodeRow]) -> None:
    seen: set[str] = set()
    for row in rows:
        name, k = row.name, 1
        while name in seen:
            name, k = f"{row.name}_{k}", k + 1
        row.name = name
        seen.add(name)


def _grad_rows(model, capture: Capture, main_ops, rows, grad_dtype) -> dict[torch.fx.Node, list[GradRow]]:
    """One gradient row per module that owns trainable parameters, before the row of its main op.

    named_parameters() lists a tied weight once, under its first owner (GPT-2: transformer.wte),
    so every trainable parameter lands in exactly one row.
    """
    by_module: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            by_module.setdefault(name.rpartition(".")[0], []).append((name, param))
    main_of = {path: node for node, path in main_ops.items()}
    placed: dict[torch.fx.Node, list[GradRow]] = {}
    for path, params in by_module.items():
        anchor = main_of.get(path) or _first_reader(capture, [name for name, _ in params])
        elements = sum(p.numel() for _, p in params)
        base = rows[anchor].name if anchor is not None else path.replace(".", "_")
        placed.setdefault(anchor, []).append(GradRow(
            name=f"{base}_grad", module=path, parameters=[name for name, _ in params],
            elements=elements, bytes=elements * grad_dtype.itemsize))
    return placed


def _first_reader(capture: Capture, parameter_names: list[str]):
    """The first forward node that reads one of these parameters, for modules with no main op."""
    readers = [user for name in parameter_names if name in capture.parameter_nodes
               for user in capture.parameter_nodes[name].users if capture.phase.get(user) == FORWARD]
    order = {n: i for i, n in enumerate(capture.phase)}
    return min(readers, key=order.__getitem__, default=None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _op_string(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
