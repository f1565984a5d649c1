"""Capture one training step (forward, loss, backward) of a meta-device model as an aten-level fx graph.

The step is traced by ``make_fx`` over fake CPU tensors: no tensor memory is allocated, and every op
dispatches as it would in an eager CPU step (so SDPA lowers to the fused CPU flash kernel, as eager
does). Backward is the real autograd graph, executed by the autograd engine under the tracer.

Each node of the returned graph is labelled with
- its phase: forward, input-grad (on the path that carries gradients back to earlier ops) or
  weight-grad (only feeds parameter gradients);
- for a backward node, the forward node whose autograd node (``grad_fn``) produced it;
- for a forward node, the module path it ran in (``transformer.h.0.attn.c_attn``).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
from dataclasses import dataclass, replace

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import UserError
from ..progress import set_stage, stage
from .attention import GpuTarget, dispatch_for, eager_attention_tagged
from .flex import flex_capture

FORWARD = "forward"
INPUT_GRAD = "input_grad"
WEIGHT_GRAD = "weight_grad"
PHASES = (FORWARD, INPUT_GRAD, WEIGHT_GRAD)

# Keys of node.meta["custom"], which the fx tracer copies from the current meta onto every new node.
_PHASE_KEY = "fxworkload_phase"
_GRAD_FN_KEY = "fxworkload_grad_fn_seq_nr"


@dataclass
class Capture:
    graph_module: torch.fx.GraphModule  # callable as (parameters + buffers, input_ids) -> (loss, grads)
    graph: torch.fx.Graph
    phase: dict[torch.fx.Node, str]  # every call_function node
    owner: dict[torch.fx.Node, torch.fx.Node]  # backward node -> forward node it differentiates
    module: dict[torch.fx.Node, str]  # forward node -> innermost module path ("" = the root)
    parameter_nodes: dict[str, torch.fx.Node]  # parameter name -> its placeholder
    gpu: GpuTarget | None = None  # the GPU whose dispatch the trace followed; None: the CPU's


def capture_training_step(model: torch.nn.Module, batch: int, seq: int, device: str = "cpu",
                          gpu: GpuTarget | None = None) -> Capture:
    """Trace forward with the model's own loss (labels = input ids) and backward to every parameter.

    ``device`` is where the fake tensors live, so where ops dispatch: the graph runs on that device.
    ``gpu``: trace on fake CPU tensors but dispatch attention as this GPU would (see attention.py).
    """
    parameters = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    names = list(parameters) + list(buffers)
    with FakeTensorMode():
        values = [_fake_like(t, device, requires_grad=name in parameters)
                  for name, t in list(parameters.items()) + list(buffers.items())]
        input_ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    n_params = len(parameters)

    def training_step(values, input_ids):
        state = dict(zip(names, values))
        out = torch.func.functional_call(model, state, (input_ids,), {"labels": input_ids})
        loss = out.loss
        set_stage(f"{progress_head}: backward")
        _set_custom({_PHASE_KEY: "backward"})
        _label_grad_fns(loss.grad_fn)
        grads = torch.autograd.grad(loss, values[:n_params], allow_unused=True)
        _set_custom({})
        return loss, grads

    progress_head = stage()
    with fx_traceback.preserve_node_meta(), _module_stack_recorder(model), _trace_friendly(model), \
            dispatch_for(gpu), eager_attention_tagged(model), flex_capture(), _layer_progress(model, progress_head):
        try:
            gm = make_fx(training_step, tracing_mode="fake")(values, input_ids)
        except Exception as exc:  # any failure inside the model's own code
            raise UserError(f"cannot trace a training step of this model: {_blocker(exc)}") from None
    gm.graph.eliminate_dead_code()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    parameter_nodes = dict(zip(list(parameters), placeholders[:n_params]))
    return replace(_label(gm, parameter_nodes), gpu=gpu)


@contextlib.contextmanager
def _layer_progress(model: torch.nn.Module, head: str):
    """While the step is traced, the run's stage says which decoder layer the forward has reached (the
    heartbeat's line every 10 s names it: a long capture shows where it is)."""
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    layers = list(max(stacks, key=len)) if stacks else []
    index = {id(layer): i for i, layer in enumerate(layers)}

    def reached(module, args):  # as _module_stack_recorder: the global hook, which every module call runs
        if id(module) in index:
            set_stage(f"{head}: forward, layer {index[id(module)] + 1} of {len(layers)}")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(reached)
    try:
        yield
    finally:
        handle.remove()
        set_stage(head)


def _fake_like(t: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=device, requires_grad=requires_grad)


def _set_custom(custom: dict) -> None:
    fx_traceback.get_current_meta()["custom"] = custom


def _label_grad_fns(root) -> None:
    """Hook every autograd node so that the ops it runs are tagged with its sequence number.

    Ops the engine runs between autograd nodes (gradient accumulation of a tensor used twice) are
    tagged with the phase only; they are attributed to the next autograd node, the one that
    consumes the accumulated gradient.
    """
    seen, todo = set(), [root]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        seq_nr = fn._sequence_nr()
        fn.register_prehook(_enter_grad_fn(seq_nr))
        fn.register_hook(_leave_grad_fn)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)


def _enter_grad_fn(seq_nr: int):
    def prehook(grad_outputs):
        _set_custom({_PHASE_KEY: "backward", _GRAD_FN_KEY: seq_nr})
    return prehook


def _leave_grad_fn(grad_inputs, grad_outputs):
    _set_custom({_PHASE_KEY: "backward"})


@contextlib.contextmanager
def _module_stack_recorder(model: torch.nn.Module):
    """Keep fx's ``nn_module_stack`` meta in step with the module calls of ``model``."""
    path_of = {id(m): name for name, m in model.named_modules()}
    stack: list[tuple[str, str]] = []

    def publish():
        fx_traceback.get_current_meta()["nn_module_stack"] = collections.OrderedDict(
            (path, (path, type_name)) for path, type_name in stack)

    def pre(module, args):
        if id(module) in path_of:
            stack.append((path_of[id(module)], type(module).__qualname__))
            publish()

    def post(module, args, output):
        if id(module) in path_of and stack:
            stack.pop()
            publish()

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
               torch.nn.modules.module.register_module_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        fx_traceback.get_current_meta().pop("nn_module_stack", None)


@contextlib.contextmanager
def _trace_friendly(model: torch.nn.Module):
    """Route MoE experts through a traceable grouped GEMM; read the batch as eager does (unpacked).

    transformers' default experts kernel, ``torch._grouped_mm``, has a meta function that accepts
    only bf16; for other dtypes transformers' own fallback op (same shapes, registered fake and
    backward) is used instead, as transformers itself does under torch.compile.
    """
    dtype = next(model.parameters()).dtype
    with _unpacked_sequences():
        try:
            from transformers.integrations import moe
        except ImportError:  # no MoE support in this transformers
            yield
            return
        original = moe._can_use_grouped_mm
        if dtype != torch.bfloat16:
            moe._can_use_grouped_mm = lambda *args: False
        try:
            with _llama4_routed():
                yield
        finally:
            moe._can_use_grouped_mm = original


@contextlib.contextmanager
def _llama4_routed():
    """Llama 4's text MoE as training runs it: each token through its top-k experts only.

    transformers' eager Llama4TextMoe sends every token through every expert (``hidden_states.repeat``
    over the experts, the router's sigmoid scores zero for the unchosen ones): 16 experts at top-1 cost
    16x the routed FLOPs. Training stacks (torchtitan's Llama 4, Megatron-Core's grouped GEMM) sort the
    routed (token, expert) pairs by expert and run one grouped GEMM per projection. Same arithmetic as
    transformers' (the input scaled by the sigmoid of its top-k logits, the shared expert added), on the
    routed tokens, through transformers' own grouped GEMM (integrations/moe.py), inside the experts module.
    """
    try:
        from transformers.integrations.moe import _grouped_linear
        from transformers.models.llama4 import modeling_llama4 as llama4
    except ImportError:
        yield
        return

    def experts_forward(self, routed, offsets):
        gate, up = _grouped_linear(routed, self.gate_up_proj, offsets, is_transposed=True).chunk(2, dim=-1)
        return _grouped_linear(up * self.act_fn(gate), self.down_proj, offsets, is_transposed=True)

    def moe_forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = torch.nn.functional.linear(hidden_states, self.router.weight)
        top_value, top_index = torch.topk(router_logits, self.top_k, dim=1)
        scores = torch.sigmoid(top_value.float()).to(hidden_states.dtype).reshape(-1)
        expert_ids, order = torch.sort(top_index.reshape(-1))
        tokens = order // self.top_k
        routed = hidden_states[tokens] * scores[order].unsqueeze(-1)
        counted = expert_ids.float() if hidden_states.device.type in ("cpu", "meta", "mps") else expert_ids.int()
        per_expert = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        out = self.shared_expert(hidden_states)
        out.index_add_(0, tokens, self.experts(routed, offsets).to(out.dtype))
        return out, router_logits

    saved = llama4.Llama4TextMoe.forward, llama4.Llama4TextExperts.forward
    llama4.Llama4TextMoe.forward, llama4.Llama4TextExperts.forward = moe_forward, experts_forward
    try:
        yield
    finally:
        llama4.Llama4TextMoe.forward, llama4.Llama4TextExperts.forward = saved


@contextlib.contextmanager
def _unpacked_sequences():
    """The traced batch holds one whole sequence per row. Eager transformers sees that from the
    position ids and passes SDPA no mask (``is_causal=True``); under tracing it cannot read them
    and builds an explicit mask, which would move the GPU off the flash and cuDNN kernels. Answer
    as eager does."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def grad_fn_of(node: torch.fx.Node) -> int | None:
    """The sequence number of the autograd node whose backward ran this op; None for forward ops and the
    engine's own (gradient accumulation between nodes)."""
    return node.meta.get("custom", {}).get(_GRAD_FN_KEY)


def _label(gm: torch.fx.GraphModule, parameter_nodes: dict[str, torch.fx.Node]) -> Capture:
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    forward = [n for n in nodes if n.meta.get("custom", {}).get(_PHASE_KEY) != "backward"]
    backward = [n for n in nodes if n.meta.get("custom", {}).get(_PHASE_KEY) == "backward"]
    if not forward:
        raise UserError("the traced step has no forward ops; the model produced no loss")

    creator: dict[int, torch.fx.Node] = {}
    for node in forward:  # the first forward node with a sequence number is the op that created it
        creator.setdefault(node.meta.get("seq_nr", -1), node)
    last_forward = forward[-1]
    numbers = sorted(creator)

    def creator_of(seq_nr: int) -> torch.fx.Node:
        """An autograd node no forward op carries the number of (the in-place update of a view
        makes one) belongs to the next forward op, the in-place op that made it."""
        if seq_nr in creator:
            return creator[seq_nr]
        i = bisect.bisect_left(numbers, seq_nr)
        return creator[numbers[i]] if i < len(numbers) else last_forward

    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    pending: list[torch.fx.Node] = []
    for node in backward:
        seq_nr = node.meta["custom"].get(_GRAD_FN_KEY)
        if seq_nr is None:
            pending.append(node)
            continue
        owner[node] = creator_of(seq_nr)
        for waiting in pending:
            owner[waiting] = owner[node]
        pending.clear()
    for waiting in pending:
        owner[waiting] = last_forward
    for node, forward_user in _gradient_sums(graph, parameter_nodes, forward).items():
        owner[node] = forward_user

    phase = {n: FORWARD for n in forward}
    weight_grad = _weight_grad_nodes(backward, owner, _weight_like(graph, parameter_nodes))
    phase.update({n: WEIGHT_GRAD if n in weight_grad else INPUT_GRAD for n in backward})
    module = {n: _innermost_module(n) for n in forward}
    return Capture(graph_module=gm, graph=graph, phase=phase, owner=owner, module=module, parameter_nodes=parameter_nodes)


def _gradient_sums(graph: torch.fx.Graph, parameter_nodes: dict[str, torch.fx.Node],
                   forward: list[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """A parameter used twice (a head tied to the input embedding) gets its gradient as the sum of its
    two uses' gradients, added by autograd's engine outside any grad_fn: that add belongs to the
    parameter's first forward use (the embedding), not to whatever forward op came last."""
    output = next(n for n in graph.nodes if n.op == "output")
    flat = [a for a in torch.utils._pytree.tree_leaves(output.args[0]) if isinstance(a, torch.fx.Node)]
    grads = flat[1:1 + len(parameter_nodes)]  # the loss, then one gradient per parameter, in order
    position = {n: i for i, n in enumerate(forward)}
    out = {}
    for parameter, grad in zip(parameter_nodes.values(), grads):
        if grad.meta.get("custom", {}).get(_GRAD_FN_KEY) is not None or grad.op != "call_function":
            continue
        users = sorted((u for u in parameter.users if u in position), key=position.get)
        if users and grad.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor):
            out[grad] = users[0]
    return out


def _weight_like(graph: torch.fx.Graph, parameter_nodes: dict[str, torch.fx.Node]) -> set[torch.fx.Node]:
    """Parameters and forward ops computed from parameters alone (``t(W)``, ``W.to(bf16)``)."""
    weight_like = set(parameter_nodes.values())
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "call_function" and inputs and all(i in weight_like for i in inputs):
            weight_like.add(node)
    return weight_like


def _weight_grad_nodes(backward: list[torch.fx.Node], owner: dict, weight_like: set) -> set[torch.fx.Node]:
    """Backward ops whose results never reach another activation op's backward: dW, not dX.

    A "consumer" is an op that an activation op's autograd node runs on a gradient produced by
    another op's backward: the receiving end of the input-gradient chain. An op from which some
    consumer is reachable lies on that chain (input-grad: dX GEMMs, norm and attention backward);
    the others only feed parameter gradients (weight-grad: dW GEMMs, bias sums, the embedding
    backward, the adds that sum a tied weight's gradients).
    """
    def is_consumer(node):
        return (node.meta["custom"].get(_GRAD_FN_KEY) is not None and owner[node] not in weight_like
                and any(i in owner and owner[i] is not owner[node] for i in node.all_input_nodes))

    reaches_consumer: set[torch.fx.Node] = set()
    for node in reversed(backward):
        if any(u in reaches_consumer or (u in owner and is_consumer(u)) for u in node.users):
            reaches_consumer.add(node)
    return {n for n in backward if n not in reaches_consumer}


def _innermost_module(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack)) if stack else ""


def _blocker(exc: BaseException) -> str:
    """One line saying which construct stopped the trace."""
    text = " ".join(str(exc).split())
    if "data-dependent" in text or "_local_scalar_dense" in text:
        return "data-dependent control flow (a Python branch on tensor values) in the model code"
    if type(exc).__name__ == "DynamicOutputShapeException":
        return f"an op whose output shape depends on tensor values ({text}) in the model code"
    return f"{type(exc).__name__}: {text[:300]}"

