"""FLOPs of one aten op: a registry of small pure formulas, in the style of torch.utils.flop_counter.

Three sources, looked up in this order by overload packet:
1. ``torch.utils.flop_counter.flop_registry``: torch's own formulas (mm, addmm, bmm, convolution,
   the CUDA SDPA kernels...). Used as they are, never re-derived.
2. ``EXTRA_FORMULAS``: ops torch's registry does not count but that are GEMMs or attention: the CPU
   flash-SDPA kernels (wired to torch's ``sdpa_flop_count`` / ``sdpa_backward_flop_count``) and
   the grouped GEMMs of MoE experts.
3. ``PER_ELEMENT_RULES``: everything else (elementwise, norms, softmax, reductions, data movement),
   as FLOPs per element of the output or of the first input.

An op in none of them counts 0 FLOPs and is reported in ``unruled_ops`` of the JSON output.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from math import prod

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

aten = torch.ops.aten

MATMUL = "matmul"
ATTENTION = "attention"
ELEMENTWISE = "elementwise"
NORM = "norm"
REDUCTION = "reduction"
DATA_MOVEMENT = "data_movement"
VIEW = "view"
OTHER = "other"
KINDS = (MATMUL, ATTENTION, ELEMENTWISE, NORM, REDUCTION, DATA_MOVEMENT, VIEW, OTHER)


def _sdpa_cpu_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm_flop(mat_a, mat_b, *args, out_shape=None, **kwargs) -> int:
    """2·M·K·N summed over the groups: each output element is a K-long dot product.

    2D × 2D (the weight gradient, groups along the contracted token dimension): a is (K, T),
    b is (T, N), out is (G, K, N): the groups partition T, so 2·K·T·N in all.
    Otherwise the contraction is a's last dimension: 2·out.numel·K.
    """
    if len(mat_a) == 2 and len(mat_b) == 2:
        return 2 * mat_a[0] * mat_a[1] * mat_b[1]
    return 2 * prod(out_shape) * mat_a[-1]


def _triangular_solve_flop(a, b, *args, out_shape=None, **kwargs) -> int:
    """Solving A·X = B with A n×n triangular and B n×k: n²·k multiply-adds halved, so n²·k FLOPs per matrix."""
    n, k = a[-1], b[-1]
    return prod(out_shape[:-2]) * n * n * k


EXTRA_FORMULAS = {
    aten.linalg_solve_triangular: shape_wrapper(_triangular_solve_flop),
    aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_sdpa_cpu_flop),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_sdpa_cpu_backward_flop),
    aten._grouped_mm: shape_wrapper(_grouped_mm_flop),
}


def _fallback_grouped_mm_backward_flop(input, weight, offs, grad_output, *args, out_shape=None, **kwargs) -> int:
    """dX = dY·Wᵀ and dW = Xᵀ·dY per group: twice the forward's 2·T·K·N."""
    return 2 * 2 * input[0] * input[1] * weight[-1]


def register_transformers_ops() -> None:
    """transformers registers its fallback grouped GEMM (used for non-bf16 MoE) when imported."""
    ops = getattr(torch.ops, "transformers", None)
    formulas = {"grouped_mm_fallback": _grouped_mm_flop,
                "grouped_mm_fallback_backward": _fallback_grouped_mm_backward_flop}
    for name, formula in formulas.items():
        if ops is not None and hasattr(ops, name):  # older transformers releases lack the backward op
            EXTRA_FORMULAS[getattr(ops, name)] = shape_wrapper(formula)


@dataclass(frozen=True)
class Rule:
    kind: str
    flops_per_element: int
    basis: str = "output"  # "output": elements of the (first) output; "input": of the first tensor input


def _rules(kind: str, flops: int, names: str, basis: str = "output") -> dict[str, Rule]:
    return {name: Rule(kind, flops, basis) for name in names.split()}


# FLOPs per element for the ops torch's registry leaves out. A transcendental (exp, tanh, rsqrt)
# counts 1, like an add: these are op counts for a roofline, not instruction counts.
PER_ELEMENT_RULES: dict[str, Rule] = {
    **_rules(ELEMENTWISE, 1, "add add_ sub sub_ rsub mul mul_ div div_ neg reciprocal rsqrt sqrt pow exp "
             "log tanh sigmoid abs where maximum minimum clamp clamp_min clamp_max masked_fill "
             "masked_fill_ bernoulli_ native_dropout lt le gt ge eq ne logical_not bitwise_not "
             "bitwise_and bitwise_or cos sin erf triu tril fill_ lerp addcmul sign floor_divide remainder "
             "relu relu_ floor ceil round log1p expm1 sgn logical_and logical_and_ logical_or logical_or_ "
             "uniform_ normal_ exponential_ rand_like randn_like clamp_ erfinv"),
    # softplus log(1 + exp(x)) and log-sigmoid: exp, add, log; their backwards about as much
    **_rules(ELEMENTWISE, 3, "softplus softplus_backward log_sigmoid_forward log_sigmoid_backward"),
    **_rules(ELEMENTWISE, 2, "polar"),
    **_rules(ELEMENTWISE, 2, "tanh_backward sigmoid_backward threshold_backward native_dropout_backward"),
    # silu = x·sigmoid(x); gelu (erf or tanh form) about 8 ops per element
    **_rules(ELEMENTWISE, 4, "silu silu_"),
    **_rules(ELEMENTWISE, 6, "silu_backward"),
    **_rules(ELEMENTWISE, 8, "gelu gelu_"),
    **_rules(ELEMENTWISE, 12, "gelu_backward"),
    # softmax: max, subtract, exp, sum, divide; backward y·(g − Σ g·y): multiply, sum, subtract, multiply
    **_rules(ELEMENTWISE, 5, "_softmax _log_softmax _safe_softmax", basis="input"),
    **_rules(ELEMENTWISE, 4, "_softmax_backward_data _log_softmax_backward_data", basis="input"),
    # layer norm: mean, subtract, square, sum, scale by rstd, ·gamma, +beta; backward about twice that
    **_rules(NORM, 7, "native_layer_norm native_group_norm", basis="input"),
    **_rules(NORM, 14, "native_layer_norm_backward native_group_norm_backward", basis="input"),
    **_rules(NORM, 4, "_fused_rms_norm", basis="input"),
    **_rules(NORM, 8, "_fused_rms_norm_backward", basis="input"),
    **_rules(REDUCTION, 1, "sum mean amax max min argmax var_mean var std cumsum logsumexp "
             "nll_loss_forward nll_loss_backward histc topk sort", basis="input"),
    # embedding backward accumulates one add per element of the incoming gradient
    **_rules(REDUCTION, 1, "embedding_dense_backward scatter_add scatter_add_ index_add index_put index_put_",
             basis="input"),
    **_rules(REDUCTION, 2, "linalg_vector_norm", basis="input"),  # square and add per element
    **_rules(DATA_MOVEMENT, 0, "embedding index gather scatter clone copy copy_ _to_copy cat stack "
             "constant_pad_nd repeat repeat_interleave contiguous new_zeros zeros zeros_like ones "
             "ones_like full full_like arange scalar_tensor slice_scatter select_scatter "
             "index_select masked_select _unsafe_index lift_fresh_copy new_ones new_full slice_backward "
             "select_backward flip scatter_ eye"),
}


def is_flex_attention(target) -> bool:
    """flex_attention or flex_attention_backward: higher-order ops, each one kernel (capture/flex.py)."""
    return isinstance(target, torch._ops.HigherOrderOperator) and target.__name__.startswith("flex_attention")


def formula_for(target):
    packet = getattr(target, "overloadpacket", None)
    if packet is None:  # flex attention: torch's own rule (dense, as FlopCounterMode counts it)
        return flop_registry.get(target) if is_flex_attention(target) else None
    if packet in flop_registry:
        return flop_registry[packet]
    return EXTRA_FORMULAS.get(packet)


def op_name(target) -> str:
    """``addmm`` for aten.addmm.default; ``getitem`` for operator.getitem."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def base_name(op: str) -> str:
    """``addmm`` for the recorded op string aten.addmm.default, ``getitem`` for getitem."""
    parts = op.split(".")
    return parts[-2] if len(parts) >= 3 else op


def op_kind(target, is_alias: bool) -> str:
    if is_alias or target is operator.getitem:
        return VIEW
    packet = getattr(target, "overloadpacket", target)
    if "attention" in getattr(packet, "__name__", ""):
        return ATTENTION
    if formula_for(target) is not None:
        return MATMUL
    rule = PER_ELEMENT_RULES.get(op_name(target))
    return rule.kind if rule else OTHER


# op name -> positions of a GEMM's A and B operands
GEMM_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}


def _gemm_operands(target, args):
    operands = GEMM_OPERANDS.get(op_name(target))
    return None if operands is None else (args[operands[0]], args[operands[1]])


def gemm_shape(target, args) -> tuple[int, int, int] | None:
    """(m, k, n) of a plain or batched GEMM (per matrix of the batch); None for other ops."""
    operands = _gemm_operands(target, args)
    if operands is None:
        return None
    a, b = operands
    return int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])


def _leading(matrix) -> int:
    """The leading dimension cuBLAS sees: the stride of the non-unit-stride axis of the last two."""
    rows_stride, cols_stride = matrix.stride()[-2:]
    if cols_stride == 1:
        return int(rows_stride) if matrix.shape[-2] > 1 else int(matrix.shape[-1])
    if rows_stride == 1:
        return int(cols_stride) if matrix.shape[-1] > 1 else int(matrix.shape[-2])
    return int(max(rows_stride, cols_stride))


def gemm_leading_dims(target, args) -> tuple[int, int, int] | None:
    """Leading dimensions (in elements) of A, B and the output C of a GEMM, from the operands' strides:
    what decides whether cuBLAS can use its 16-byte-aligned kernels. None for other ops."""
    operands = _gemm_operands(target, args)
    if operands is None or not all(hasattr(t, "stride") for t in operands):
        return None
    a, b = operands
    return _leading(a), _leading(b), int(b.shape[-1])


def grouped_gemm_shape(target, args) -> tuple[int, int, int, int] | None:
    """(m, k, n, groups) of one group of a grouped GEMM (``_grouped_mm``, MoE experts); None for other ops.

    The tokens are taken as shared equally by the groups (the offsets are data, unknown when tracing):
    (T, K)·(G, K, N) is G GEMMs of T/G rows; the weight gradient (K, T)·(T, N) → (G, K, N) contracts
    T/G tokens per group; (G, M, K)·(G, K, N) is a plain batch.
    """
    if op_name(target) != "_grouped_mm":
        return None
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 3:
        groups = int(b.shape[0])
        return -(-int(a.shape[0]) // groups), int(a.shape[1]), int(b.shape[2]), groups
    if a.dim() == 2 and b.dim() == 2 and len(args) > 2 and isinstance(args[2], torch.Tensor):
        groups = int(args[2].shape[0])
        return int(a.shape[0]), -(-int(a.shape[1]) // groups), int(b.shape[1]), groups
    if a.dim() == 3 and b.dim() == 3:
        return int(a.shape[1]), int(a.shape[2]), int(b.shape[2]), int(a.shape[0])
    return None


def gemm_batch(target, args) -> int:
    operands = _gemm_operands(target, args)
    if operands is None or not hasattr(operands[0], "shape"):
        return 1
    return int(prod(operands[0].shape[:-2])) if operands[0].dim() > 2 else 1


def node_flops(target, args, kwargs, out) -> int | None:
    """FLOPs of one op given its argument values (tensors or shapes) and output; None if no rule."""
    formula = formula_for(target)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    if target is operator.getitem:
        return 0
    rule = PER_ELEMENT_RULES.get(op_name(target))
    if rule is None:
        return None
    tensor = _first_tensor(out) if rule.basis == "output" else _first_tensor((args, kwargs))
    return rule.flops_per_element * (tensor.numel() if tensor is not None else 0)


def _first_tensor(tree):
    leaves = torch.utils._pytree.tree_leaves(tree)
    return next((x for x in leaves if isinstance(x, torch.Tensor)), None)
