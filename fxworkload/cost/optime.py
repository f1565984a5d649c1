"""Which kernel-time model an op takes on a GPU profile, from what its OpCost records.

GEMMs (with their leading dimensions) go to ``gpu.gemm_ns``, fused attention kernels to
``gpu.attention_ns``, grouped GEMMs (MoE experts, ``_grouped_mm``) to ``gpu.gemm_ns`` as one kernel over
their groups, ops that launch no kernel take 0, and everything else is memory-bound
(``gpu.memory_ns``). Other tensor-core ops (transformers' fallback grouped GEMM) take the GEMM model on
the cube of their size. A few ops run more than one kernel on CUDA (``CUDA_KERNELS``): each kernel
costs its launch, and each pass over the op's tensors its bytes.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .flops import ATTENTION, DATA_MOVEMENT, ELEMENTWISE, MATMUL, VIEW, base_name, is_flex_attention
from .gpu import attention_ns, gemm_ns, layer_norm_rereads, memory_ns, padded_gemm_ns, softmax_rereads

_FUSED_BACKENDS = {"cudnn", "flash", "efficient"}

# Ops that CUDA runs as several kernels: op name -> (kernels, passes over the bytes the op moves).
CUDA_KERNELS = {
    # SoftMax.cu, softmax_backward_cuda_out: ``tmp = grad * output`` (one elementwise kernel over the
    # three score-sized tensors), then the backward kernel reads tmp and output and writes grad_input.
    "_softmax_backward_data": (2, 2.0),
    # SoftMax.cpp: softmax, eq(-inf), all, a zero fill and where; its bytes already count every pass
    # (traffic.COMPOSITE_BYTES, the same on the CPU).
    "_safe_softmax": (5, 1.0),
}

# (log-)softmax ops over rows along the last dimension -> whether it is a backward
_SOFTMAX_OPS = {"_softmax": False, "_log_softmax": False, "_softmax_backward_data": True,
                "_log_softmax_backward_data": True}


def attention_facts(target, args, kwargs, blocks: tuple[int, int, int] | None = None) -> dict | None:
    """Backend, direction and shapes of a fused GPU attention op, read through its schema; None otherwise.
    ``blocks``: a flex attention op's (partial, full, all) tiles per head (capture/flex.py)."""
    if is_flex_attention(target):
        return _flex_facts(target, args, blocks)
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    backend = next((b for b in _FUSED_BACKENDS if name.startswith(f"_scaled_dot_product_{b}_attention")), None)
    if backend is None:
        return None
    schema = target._schema
    values = {arg.name: value for arg, value in zip(schema.arguments, args)}
    values.update(kwargs)
    query, key = values["query"], values["key"]
    mask = values.get("attn_bias", values.get("attn_mask"))
    return {"backend": backend, "backward": name.endswith("_backward"), "batch": int(query.shape[0]),
            "heads": int(query.shape[1]), "kv_heads": int(key.shape[1]), "q_len": int(query.shape[2]),
            "kv_len": int(key.shape[2]), "head_dim": int(query.shape[3]),
            "is_causal": bool(values.get("is_causal", False)), "has_mask": isinstance(mask, torch.Tensor),
            "dropout": float(values.get("dropout_p", 0.0)), "visited_share": 1.0}


def _flex_facts(target, args, blocks) -> dict:
    """flex_attention(query, key, value, ...) or flex_attention_backward(query, key, value, out, ...): the
    tiles it visits are the block mask's partial and full ones; with no count, all of them (dense)."""
    query, key = args[0], args[1]
    partial, full, tiles = blocks or (0, 1, 1)
    return {"backend": "flex", "backward": target.__name__.endswith("_backward"), "batch": int(query.shape[0]),
            "heads": int(query.shape[1]), "kv_heads": int(key.shape[1]), "q_len": int(query.shape[2]),
            "kv_len": int(key.shape[2]), "head_dim": int(query.shape[3]), "is_causal": False, "has_mask": False,
            "dropout": 0.0, "visited_share": (partial + full) / tiles if tiles else 1.0}


def gpu_op_ns(op, device, dtype: str) -> float:
    """Kernel time of an OpCost on a GPU profile (``device.sm_count`` set)."""
    if op.kind == VIEW or (op.flops == 0 and op.bytes == 0):
        return 0.0
    facts, model = device.gpu_facts(), device.gpu_model()
    if op.graphed:  # the floor of a cuBLAS call back to back in eager is the host's pace, not the kernel's
        model = replace(model, gemm_min_ns=0.0)
    if op.attention is not None:
        a = op.attention
        return attention_ns(op.flops, a["backend"], a["backward"], dtype, batch=a["batch"], heads=a["heads"],
                            q_len=a["q_len"], kv_len=a["kv_len"], head_dim=a["head_dim"], is_causal=a["is_causal"],
                            has_mask=a["has_mask"], dropout=a["dropout"], facts=facts, model=model, nbytes=op.bytes,
                            visited_share=a["visited_share"])
    if op.gemm_mkn is not None and op.gemm_leading is not None:
        m, k, n = op.gemm_mkn
        if op.gemm_padded:
            return padded_gemm_ns(m, k, n, op.gemm_batch, dtype, op.gemm_leading, facts, model)
        return gemm_ns(m, k, n, op.gemm_batch, dtype, op.gemm_leading, facts, model)
    if op.grouped_gemm is not None:
        m, k, n, groups = op.grouped_gemm
        return gemm_ns(m, k, n, groups, dtype, (8, 8, 8), facts, model, grouped=True)
    if op.kind in (MATMUL, ATTENTION) and op.flops:  # other tensor-core ops: a cube of their size
        side = max(int(round((op.flops / 2) ** (1 / 3))), 1)
        return gemm_ns(side, side, side, 1, dtype, (8, 8, 8), facts, model)
    if op.fused_ops:  # one kernel: each outside input read once, its outputs written once
        return memory_ns(op.bytes, facts, model) * (model.generated_kernel_slowdown if op.generated else 1.0)
    name = base_name(op.op)
    kernels, passes = CUDA_KERNELS.get(name, (1, 1.0))
    rereads = _softmax_reread_bytes(name, op, facts) + _layer_norm_reread_bytes(name, op, facts)
    return memory_ns(int(op.bytes * passes) + rereads, facts, model, kernels, casts=_casts(name, op))


def _casts(name: str, op) -> bool:
    """A TensorIterator op (elementwise or copy) whose floating tensor inputs (0-dim scalars aside) are
    not all of its output's dtype. Softmax kernels convert in their own loads (half_to_float)."""
    if op.kind not in (ELEMENTWISE, DATA_MOVEMENT) or not op.output_dtypes or name in _SOFTMAX_OPS \
            or name in CUDA_KERNELS:
        return False
    return any(dtype != op.output_dtypes[0] and getattr(torch, dtype).is_floating_point and shape
               for dtype, shape in zip(op.input_dtypes, op.input_shapes))


def _softmax_reread_bytes(name: str, op, facts) -> int:
    if name not in _SOFTMAX_OPS or not op.input_shapes or not op.input_shapes[0]:
        return 0
    shape = op.input_shapes[0]
    itemsize = getattr(torch, op.input_dtypes[0]).itemsize
    return int(softmax_rereads(shape[-1], itemsize, _SOFTMAX_OPS[name], facts) * math.prod(shape) * itemsize)


def _layer_norm_reread_bytes(name: str, op, facts) -> int:
    """The forward's second pass over its input where the rows in flight overflow L2 (gpu.layer_norm_rereads)."""
    if name != "native_layer_norm" or not op.input_shapes or not op.input_shapes[0]:
        return 0
    shape = op.input_shapes[0]
    itemsize = getattr(torch, op.input_dtypes[0]).itemsize
    return int(layer_norm_rereads(shape[-1], itemsize, facts) * math.prod(shape) * itemsize)
