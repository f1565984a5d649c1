"""Which scaled_dot_product_attention kernel a GPU runs, and a trace hook that records it.

PyTorch picks the kernel at run time (``select_sdp_backend`` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): it walks a priority order and takes the
first backend whose constraints all hold. The constraints ported here are the ones that depend on
what a trace knows (dtype, shapes, mask, dropout, causality, GQA, the GPU's architecture); the
nested-tensor, determinism and run-time-disabled checks do not apply to a training step.

During a capture for a GPU target, ``GpuDispatch`` replaces each
``F.scaled_dot_product_attention`` call by the aten op of the chosen kernel (its meta and backward
formulas trace on fake CPU tensors, so no GPU is needed), converting a boolean mask to an additive
bias first as ``scaled_dot_product_attention`` does, and tags the ops with the backend name.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
import torch.fx.traceback as fx_traceback
from torch.overrides import TorchFunctionMode

from .sdpa_backends import CUDNN, EFFICIENT, FLASH, MATH, SDPA_BACKENDS

aten = torch.ops.aten

CPU_FLASH = "cpu_flash"
EAGER = "eager"  # transformers' own eager attention (matmul, softmax, dropout, matmul), outside SDPA
BACKEND_KEY = "fxworkload_sdpa_backend"  # key of node.meta["custom"]

# Backend of each fused aten op (forward and backward) as it appears in a graph.
OP_BACKEND = {"_scaled_dot_product_cudnn_attention": CUDNN, "_scaled_dot_product_cudnn_attention_backward": CUDNN,
              "_scaled_dot_product_flash_attention": FLASH, "_scaled_dot_product_flash_attention_backward": FLASH,
              "_scaled_dot_product_efficient_attention": EFFICIENT,
              "_scaled_dot_product_efficient_attention_backward": EFFICIENT,
              "_scaled_dot_product_flash_attention_for_cpu": CPU_FLASH,
              "_scaled_dot_product_flash_attention_for_cpu_backward": CPU_FLASH}


@dataclass(frozen=True)
class GpuTarget:
    """What the selection depends on: the compute capability and the priority order. PyTorch
    builds with cuDNN > 9.15 (the CUDA 13 wheels of 2.10 and later) put cuDNN first on sm90 and
    sm100 (``check_prefer_cudnn_attention``); otherwise flash, memory-efficient, math."""
    arch: tuple[int, int]  # (major, minor): (8, 0) A100, (9, 0) H100 / H200
    priority: tuple[str, ...] = (FLASH, EFFICIENT, MATH)
    cudnn_head_dim_256: bool = True  # cuDNN > 9.22 with a frontend that supports d = 256 (sm90/sm10x)
    # Releases after 2.11 take cuDNN only for dropout in steps of 1/16 (check_cudnn_dropout); 2.11, whose
    # kernels the shipped model is fitted on, ran cuDNN with dropout 0.1.
    cudnn_dropout_sixteenths: bool = False
    # The launch grid kernels size their scratch by (workload/scratch.py: Reduce.cuh's global buffer): the SMs
    # and resident threads per SM; 0 where not known (no scratch is then counted)
    sm_count: int = 0
    threads_per_sm: int = 0


@dataclass(frozen=True)
class SdpaCall:
    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    has_mask: bool
    dropout: float
    is_causal: bool
    enable_gqa: bool = False
    requires_grad: bool = True


def enabled(target: GpuTarget, backends: tuple[str, ...]) -> GpuTarget:
    """The target inside ``torch.nn.attention.sdpa_kernel(backends)``: only those backends enabled, tried in
    the build's own order (``set_priority=False``, the default); a backend the build's order leaves out comes
    where its default order puts it, after the rest."""
    order = tuple(target.priority) + tuple(b for b in SDPA_BACKENDS if b not in target.priority)
    return replace(target, priority=tuple(b for b in order if b in backends))


def choose(call: SdpaCall, target: GpuTarget) -> str:
    """The backend PyTorch's CUDA dispatch takes for this call, or "error" where none enabled can run it."""
    if call.heads != call.kv_heads and (not call.enable_gqa or call.heads % call.kv_heads):
        # one key/value head broadcasts over the query heads (Falcon's multi-query attention): only
        # the math path broadcasts (the fused kernels' check_batch_size_and_num_heads_dense fails)
        return MATH if call.kv_heads == 1 and MATH in target.priority else "error"
    for backend in target.priority:
        if backend == MATH or RULES[backend](call, target):
            return backend
    return "error"  # select_sdp_backend's "No available kernel": math, which runs anything, is disabled


def _sm_between(arch: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= arch <= high


def _half(call: SdpaCall) -> bool:
    return call.dtype in (torch.float16, torch.bfloat16)


def can_use_cudnn(call: SdpaCall, target: GpuTarget) -> bool:
    arch = target.arch
    if not (_half(call) and _sm_between(arch, (8, 0), (12, 1))):
        return False
    if target.cudnn_dropout_sixteenths and call.dropout * 16.0 != int(call.dropout * 16.0):
        return False
    if call.batch > 65535 or call.heads > 65535:
        return False
    sm90_or_sm10x = arch == (9, 0) or arch[0] == 10
    limit = 256 if sm90_or_sm10x and target.cudnn_head_dim_256 else 128
    if call.head_dim > limit or call.v_head_dim > limit or call.head_dim % 8 or call.v_head_dim % 8:
        return False
    if call.kv_len == 1 or (call.dropout > 0 and call.q_len == 1):
        return False
    if call.requires_grad and sm90_or_sm10x and limit == 256:  # backward only for these head dims
        supported = ((call.head_dim <= 128 and call.v_head_dim <= 128) or (call.head_dim, call.v_head_dim)
                     in ((192, 128), (256, 256)))
        if not supported:
            return False
    return True


def can_use_flash(call: SdpaCall, target: GpuTarget) -> bool:
    if call.has_mask or not _half(call) or not _sm_between(target.arch, (8, 0), (12, 1)):
        return False
    if call.head_dim != call.v_head_dim or call.head_dim > 256:
        return False
    if call.is_causal and call.q_len != call.kv_len:
        return False
    if call.requires_grad and ((8, 6) <= target.arch <= (8, 9) or (12, 0) <= target.arch <= (12, 1)):
        if not (call.head_dim <= 192 or (call.dropout == 0 and call.head_dim > 224)):
            return False
    return True


def can_use_efficient(call: SdpaCall, target: GpuTarget) -> bool:
    if not _sm_between(target.arch, (5, 0), (12, 1)) or call.heads != call.kv_heads:
        return False  # no GQA here (measured: fp32 GQA runs the math path on torch 2.11)
    if call.dtype not in (torch.float16, torch.bfloat16, torch.float32) or (
            call.dtype == torch.bfloat16 and target.arch < (8, 0)):
        return False
    alignment = 8 if _half(call) else 4  # minimum_gemm_alignment on sm80+: 16 bytes in elements
    return call.head_dim % alignment == 0 and call.v_head_dim % alignment == 0


RULES = {CUDNN: can_use_cudnn, FLASH: can_use_flash, EFFICIENT: can_use_efficient}


def call_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> SdpaCall:
    return SdpaCall(dtype=query.dtype, batch=int(query.shape[0]), heads=int(query.shape[-3]),
                    kv_heads=int(key.shape[-3]), q_len=int(query.shape[-2]), kv_len=int(key.shape[-2]),
                    head_dim=int(query.shape[-1]), v_head_dim=int(value.shape[-1]),
                    has_mask=attn_mask is not None, dropout=float(dropout_p), is_causal=bool(is_causal),
                    enable_gqa=bool(enable_gqa), requires_grad=query.requires_grad)


class GpuDispatch(TorchFunctionMode):
    """Inside a make_fx trace: every SDPA call becomes the aten op of the kernel ``target`` runs, and
    dropout the fused kernel CUDA runs."""

    def __init__(self, target: GpuTarget):
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if func is torch.nn.functional.dropout:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(input, p=0.5, training=True, inplace=False):
        """CUDA runs dropout as one fused native_dropout kernel (mask and scaled output); the CPU
        decomposes it into bernoulli_, div_ and mul."""
        if not training or p == 0:
            return input
        return aten.native_dropout(input, p, True)[0]

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        call = call_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        backend = choose(call, self.target)
        if backend == "error":
            raise ValueError(f"no enabled SDPA kernel ({', '.join(self.target.priority)}) takes this attention "
                             f"({call.heads} query heads, {call.kv_heads} key/value heads, head dim {call.head_dim}, "
                             f"{'a mask' if call.has_mask else 'no mask'}, {str(call.dtype).removeprefix('torch.')}): "
                             "enable another with --sdpa-backends")
        with _tagged(backend):
            if backend == MATH:
                if dropout_p > 0:
                    return cuda_math_attention(query, key, value, _additive(attn_mask, query.dtype), dropout_p,
                                               is_causal, scale, enable_gqa)
                return aten._scaled_dot_product_attention_math(
                    query, key, value, _additive(attn_mask, query.dtype), dropout_p, is_causal, None,
                    scale=scale, enable_gqa=enable_gqa)[0]
            if backend == CUDNN:
                return aten._scaled_dot_product_cudnn_attention(
                    query, key, value, _additive(attn_mask, query.dtype), True, dropout_p, is_causal, False,
                    scale=scale)[0]
            if backend == FLASH:
                return aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, _additive(attn_mask, query.dtype), True, dropout_p, is_causal,
                scale=scale)[0]


def cuda_math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """``_scaled_dot_product_attention_math`` (attention.cpp) op for op, as it runs on CUDA tensors:
    there its ``at::dropout`` is one fused ``native_dropout`` kernel, where on the CPU tensors of a
    trace it decomposes into bernoulli_, div_ and mul."""
    scaling = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.shape[-1]))
    query = aten.mul.Scalar(query, scaling)
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
        minus_infinity = torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=query.device)
        attn_mask = torch.where(causal, zero, minus_infinity)
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    attn = torch.matmul(query, aten.mul.Scalar(key.transpose(-2, -1), scaling))
    if attn_mask is not None:
        attn = attn.add(attn_mask)
    attn = aten._safe_softmax(attn, -1)
    attn = aten.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, value)


def _additive(mask, dtype):
    """A boolean mask as the additive bias the kernels read (``convert_boolean_attn_mask``)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask.logical_not(), float("-inf"))


@contextlib.contextmanager
def tagged_meta(**custom):
    """The ops traced inside carry ``custom`` in node.meta["custom"] (with what was there already)."""
    meta = fx_traceback.get_current_meta()
    before = meta.get("custom")
    meta["custom"] = {**(before or {}), **custom}
    try:
        yield
    finally:  # the current meta fetched again: a higher-order op's trace (flex attention) may have replaced it
        fx_traceback.get_current_meta()["custom"] = before if before is not None else {}


def _tagged(backend: str):
    return tagged_meta(**{BACKEND_KEY: backend})


@contextlib.contextmanager
def eager_attention_tagged(model: torch.nn.Module):
    """Tag the ops of transformers' ``eager_attention_forward`` (attn_implementation "eager") as the
    attention core, as SDPA's ops are: what selective recomputation runs again."""
    import sys

    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    patched = [(module, module.eager_attention_forward) for module in modules
               if callable(getattr(module, "eager_attention_forward", None))]

    def tagging(function):
        def tagged(*args, **kwargs):
            with _tagged(EAGER):
                return function(*args, **kwargs)
        return tagged

    for module, function in patched:
        module.eager_attention_forward = tagging(function)
    try:
        yield
    finally:
        for module, function in patched:
            module.eager_attention_forward = function


@contextlib.contextmanager
def dispatch_for(target: GpuTarget | None):
    """The hook for a GPU target; nothing for the CPU (its own dispatch is the CPU's)."""
    if target is None:
        yield
        return
    with GpuDispatch(target):
        yield
