"""What a kernel allocates for itself while it runs: scratch taken from the caching allocator inside an op
and given back before it returns, so the graph never shows it, yet ``max_memory_allocated`` counts it and the
holes it leaves decide what ``max_memory_reserved`` reaches (workload/memory.py replays it).

A registry of small per-op rules, as ``torch/utils/flop_counter.py`` keeps FLOP rules. Each gives the
requests, in bytes and in the order the kernel makes them, for one node run as its own kernel on the GPU the
trace dispatched for (``GpuTarget``; none on a CPU trace, whose ops do not use the CUDA allocator):

- **TensorIterator reductions** (``sum``, ``mean``, ``amax``…; ``gpu_reduce_kernel`` in
  aten/src/ATen/native/cuda/Reduce.cuh): where ``setReduceConfig`` splits each output's inputs over several
  blocks (``ctas_per_output`` > 1: few outputs, many inputs each, as a bias or norm-weight gradient summed
  over every token), the blocks' partial results go through a global buffer of
  ``sizeof(arg_t) x outputs x ctas_per_output`` bytes (x ``block.x x output_vec_size`` where the block's
  threads do not reduce together) and ``sizeof(int) x grid.x`` semaphores. The lent H100's allocator record
  of GPT-2 (batch 8, seq 1024) shows these exactly: 132.75, 132 and 48 MiB for its 2,304-, 3,072- and
  768-wide bias gradients, with 72-, 96- and 24-byte semaphores (tests/workload/test_scratch.py).
- **FlashAttention-2's backward** (``mha_bwd`` in aten/src/ATen/native/transformers/cuda/flash_attn/
  flash_api.cpp): ``softmax_d`` (fp32, batch x heads x seq_q rounded to 128) and ``dq_accum`` (fp32, batch x
  seq_q rounded to 128 x heads x head dim rounded to 32), and with grouped-query attention ``dk_expanded`` and
  ``dv_expanded`` (batch x seq_k x query heads x head dim, in the inputs' dtype), summed into dk and dv.
- **cuDNN's SDPA backward** (``run_cudnn_SDP_bprop`` in aten/src/ATen/native/cudnn/MHA.cpp allocates the
  graph's workspace): from cuDNN 9 the frontend's ``SDPABackwardNode`` keeps the dQ accumulator (fp32, batch x
  heads x seq_q x head dim) and the softmax row sums (fp32, batch x heads x seq_q) there. Measured: 24.375 MiB
  for GPT-2's shape, 256 bytes over these two (not modelled: under one 512-byte block).

Not modelled: the memory-efficient kernel's workspace, cuBLAS workspaces (one per handle, kept for the
process), embedding backward's sort buffers (data-dependent), ROCm's reductions (warps of 64, other limits),
and inductor's own split-reduction buffers (a compiled stack's reductions are its kernels, not these).
"""

from __future__ import annotations

import math

import torch

from ..capture.attention import GpuTarget

aten = torch.ops.aten

REDUCE_MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double only)
WARP_SIZE = 32  # at::cuda::warp_size() on NVIDIA GPUs
MIN_VALUES_PER_THREAD = 16  # setReduceConfig, CUDA (ROCm: 128)
MAX_VALUES_PER_THREAD = 256
INPUT_VEC_SIZE = 4  # gpu_reduce_kernel's default vt0 (= input_vec_size): the vectorize-along-input case
OUTPUT_VEC_SIZE = 4  # get_output_vec_size's start, halved until the shape and strides divide
INT_BYTES = 4  # the semaphores: one int per block column (grid.x)
FLASH_SEQ_ROUNDING = 128  # flash_api.cpp: seqlen_q_rounded = round_multiple(seqlen_q, 128)
FLASH_HEAD_DIM_ROUNDING = 32  # head_size_rounded = round_multiple(head_size, 32) up to 192, else 256
FP32_BYTES = 4


def reduce_buffer_bytes(shape: tuple[int, ...], strides: tuple[int, ...], reduced: set[int], acc_itemsize: int,
                        sm_count: int, threads_per_sm: int) -> tuple[int, ...]:
    """(global buffer, semaphores) bytes ``gpu_reduce_kernel`` allocates to reduce ``reduced`` dims of a tensor of
    ``shape`` and ``strides`` (elements), or () where ``setReduceConfig`` keeps every output in one block."""
    dims = [(size, stride, d in reduced) for d, (size, stride) in enumerate(zip(shape, strides)) if size != 1]
    outputs = math.prod(size for size, _, is_reduced in dims if not is_reduced)
    inputs = math.prod(size for size, _, is_reduced in dims if is_reduced)
    if outputs * inputs == 0 or inputs == 1:
        return ()
    # TensorIterator's order: reduced dims first (reorder_dimensions), each group by ascending stride, then
    # neighbours that are contiguous in the input coalesced
    reduce_dims = _coalesced(sorted(((size, stride) for size, stride, r in dims if r), key=lambda d: d[1]))
    kept_dims = _coalesced(sorted(((size, stride) for size, stride, r in dims if not r), key=lambda d: d[1]))
    on_fastest = not kept_dims or reduce_dims[0][1] < kept_dims[0][1]
    output_vec = 1
    if on_fastest:
        dim0, dim1, fastest_stride = inputs, outputs, reduce_dims[0][1]
        if fastest_stride == 1 and dim0 >= 128 and len(reduce_dims) == 1:  # vectorize along input
            dim0 //= INPUT_VEC_SIZE
    else:
        dim0, dim1, fastest_stride = outputs, inputs, kept_dims[0][1]
        if fastest_stride == 1:
            output_vec = _output_vec_size(kept_dims[0][0], [stride for _, stride in reduce_dims + kept_dims[1:]])
            dim0 //= output_vec
    max_threads = REDUCE_MAX_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    step_input, step_output = 1, 1
    if on_fastest:
        step_input *= block_width  # input_mult[BLOCK_X]: the block's lanes reduce together
    else:
        step_output *= block_width
    values_per_thread = -(-inputs // step_input)
    if values_per_thread < min(block_height * 16, MAX_VALUES_PER_THREAD):
        return ()  # each warp takes outputs of its own: no global reduction
    step_input *= block_height  # input_mult[BLOCK_Y]: split across warps
    values_per_thread = -(-inputs // step_input)
    target_grid = sm_count * (threads_per_sm // (block_width * block_height))
    grid_x = -(-(outputs // output_vec) // step_output)
    if values_per_thread < MAX_VALUES_PER_THREAD or grid_x > target_grid:
        return ()
    ctas_per_output = max(min(-(-target_grid // grid_x), -(-values_per_thread // MIN_VALUES_PER_THREAD)),
                          -(-values_per_thread // MAX_VALUES_PER_THREAD))
    if ctas_per_output <= 1:
        return ()
    buffer = acc_itemsize * outputs * ctas_per_output
    if not on_fastest:  # should_block_x_reduce() is false: each of block.x's lanes keeps its own partials
        buffer *= block_width * output_vec
    return buffer, INT_BYTES * grid_x


def _coalesced(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """TensorIterator's coalesce_dimensions over one group: a dim whose stride is its neighbour's extent merges."""
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, stride))
    return merged


def _output_vec_size(first_output_extent: int, strides: list[int]) -> int:
    """get_output_vec_size: 4, halved until the first output dim's extent and the input's other strides divide
    (the base address taken as aligned, as the allocator's 512-byte blocks are)."""
    vec = OUTPUT_VEC_SIZE
    for n in [first_output_extent] + strides:
        while n % vec:
            vec //= 2
    return vec


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _tensor(value) -> torch.Tensor | None:
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else None


def _reduction(node: torch.fx.Node, gpu: GpuTarget, accumulates: bool, dim_index: int | None) -> tuple[int, ...]:
    x = _tensor(node.args[0])
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        return ()
    dims = None if dim_index is None else (
        node.args[dim_index] if len(node.args) > dim_index else node.kwargs.get("dim"))
    dims = range(x.dim()) if dims is None or dims == [] else dims
    if isinstance(dims, int):
        dims = [dims]
    reduced = {d % max(x.dim(), 1) for d in dims}
    acc = 8 if x.dtype == torch.float64 else 4 if accumulates else x.element_size()
    return reduce_buffer_bytes(tuple(x.shape), tuple(x.stride()), reduced, acc, gpu.sm_count, gpu.threads_per_sm)


def _flash_backward(node: torch.fx.Node, gpu: GpuTarget) -> tuple[int, ...]:
    q, k = _tensor(node.args[1]), _tensor(node.args[2])
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    seq_rounded = -(-seq_q // FLASH_SEQ_ROUNDING) * FLASH_SEQ_ROUNDING
    dim_rounded = -(-head_dim // FLASH_HEAD_DIM_ROUNDING) * FLASH_HEAD_DIM_ROUNDING if head_dim <= 192 else 256
    requests = [batch * heads * seq_rounded * FP32_BYTES, batch * seq_rounded * heads * dim_rounded * FP32_BYTES]
    if kv_heads != heads:  # dk_expanded, dv_expanded
        requests += [batch * seq_k * heads * head_dim * q.element_size()] * 2
    return tuple(requests)


def _cudnn_backward(node: torch.fx.Node, gpu: GpuTarget) -> tuple[int, ...]:
    batch, heads, seq_q, head_dim = _tensor(node.args[1]).shape
    return (batch * heads * seq_q * (head_dim + 1) * FP32_BYTES,)  # dQ accumulator and softmax sums, one workspace


# reduction -> (accumulates in fp32, the index of its dims argument; None: over every dim)
REDUCTIONS = {aten.sum.dim_IntList: (True, 1), aten.sum.default: (True, None), aten.mean.dim: (True, 1),
              aten.mean.default: (True, None), aten.linalg_vector_norm.default: (True, 2),
              aten.amax.default: (False, 1), aten.amin.default: (False, 1)}
KERNELS = {aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
           aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward}


def scratch_bytes(node: torch.fx.Node, gpu: GpuTarget | None, fused: bool = False) -> tuple[int, ...]:
    """The requests ``node``'s kernel makes of the caching allocator while it runs, in order; ``fused``: the stack
    fuses reductions into kernels of its own (inductor), so only the library kernels it calls keep theirs."""
    if gpu is None or not gpu.sm_count or node.op != "call_function":
        return ()
    if node.target in KERNELS:
        return KERNELS[node.target](node, gpu)
    if node.target in REDUCTIONS and not fused:
        return _reduction(node, gpu, *REDUCTIONS[node.target])
    return ()


# cuBLAS keeps one workspace per (handle, stream) for the process (CublasHandlePool.cpp,
# ``cublas_handle_stream_to_workspace``; ``parseChosenWorkspaceSize``: ":4096:8", 32 MiB, on sm90 and later,
# ":4096:2:16:8" before); handles are per thread (``DeviceThreadHandlePool``), so the forward's thread and
# autograd's device thread, which runs the backward, take one each at their first GEMM. cuBLASLt's GEMMs with a
# bias epilogue (addmm) take a second one of 1 MiB (the lent H100, torch 2.11: 32 MiB at the first forward and
# the first backward GEMM, 1 MiB after the first forward addmm; never freed).
GEMMS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                   aten._scaled_mm.default})
LT_GEMMS = frozenset({aten.addmm.default})
CUBLAS_WORKSPACE_BYTES = {True: 4096 * 8 * 1024, False: 4096 * 1024 * 2 + 16 * 1024 * 8}  # sm90 and later?
CUBLASLT_WORKSPACE_BYTES = 1 << 20


def handle_workspaces(nodes: list[torch.fx.Node], in_backward, gpu: GpuTarget | None) -> list[tuple]:
    """(node, bytes) of each workspace a thread's cuBLAS handles allocate at their first use and keep;
    ``in_backward(node)``: whether autograd's thread runs it."""
    if gpu is None or not gpu.sm_count:
        return []
    taken, found = set(), []
    for node in nodes:
        if node.op != "call_function" or node.target not in GEMMS:
            continue
        thread = in_backward(node)
        for kind, nbytes, applies in (("cublas", CUBLAS_WORKSPACE_BYTES[gpu.arch[0] >= 9], True),
                                      ("cublaslt", CUBLASLT_WORKSPACE_BYTES, node.target in LT_GEMMS)):
            if applies and (thread, kind) not in taken:
                taken.add((thread, kind))
                found.append((node, nbytes))
    return found
