"""The scratch kernels take from the caching allocator, against the lent H100's own allocator record
(tests/fixtures/h100_gpt2_alloc_trace.json.gz: GPT-2, batch 8, seq 1024, bf16, torch 2.11) and hand
computations from the sources each rule follows (Reduce.cuh's setReduceConfig, flash_api.cpp's mha_bwd,
CublasHandlePool.cpp)."""

import pytest
import torch

from fxworkload.capture.attention import GpuTarget
from fxworkload.capture.trace import FORWARD, capture_training_step
from fxworkload.cost.flops import register_transformers_ops
from fxworkload.workload.scratch import handle_workspaces, reduce_buffer_bytes, scratch_bytes

from ..conftest import tiny_config

H100 = dict(sm_count=132, threads_per_sm=2048)
MIB = 1 << 20


def _scratch_requests(trace: dict) -> list[tuple[int, int]]:
    """(buffer, semaphores) pairs of the second step: two requests, then both freed, the second first (the
    pattern of gpu_reduce_kernel's two DataPtrs going out of scope, in reverse, after the launch)."""
    begin, end = trace["step_starts"][1], trace["step_starts"][2]
    events = [e for e in trace["events"][begin:end] if e[0] in ("alloc", "free_completed")]
    pairs = []
    for i in range(len(events) - 3):
        (a, first, first_bytes), (b, second, second_bytes), (c, freed_first, _), (d, freed_second, _) = \
            events[i:i + 4]
        if (a, b, c, d) == ("alloc", "alloc", "free_completed", "free_completed") and \
                (freed_first, freed_second) == (second, first):
            pairs.append((first_bytes, second_bytes))
    return pairs


@pytest.mark.parametrize("width", [2304, 3072, 768])
def test_a_bias_gradients_reduction_buffer_is_the_one_the_h100_allocated(width, alloc_trace):
    """GPT-2's bias gradients sum 8,192 rows of each linear's outputs (c_attn 2,304, c_fc 3,072, the two
    c_proj 768): Reduce.cuh splits each output over ctas_per_output blocks and stages their partials; the
    allocator's record holds exactly these requests, once per layer (twice for the 768-wide ones)."""
    expected = reduce_buffer_bytes((8192, width), (width, 1), {0}, 4, **H100)
    pairs = _scratch_requests(alloc_trace)
    assert pairs.count(expected) == (24 if width == 768 else 12)


def test_reduction_buffers_worked_by_hand_from_set_reduce_config():
    # c_fc's bias gradient: 3,072 outputs in vectors of 4, 32 lanes each, 4 warps splitting 8,192 rows; grid.x
    # = 768 / 32 = 24 blocks; target grid = 132 SMs x 2,048 / 128 threads = 2,112; ctas_per_output =
    # max(min(ceil(2112 / 24), ceil(2048 / 16)), ceil(2048 / 256)) = 88; buffer 4 x 3,072 x 88 x 32 x 4
    assert reduce_buffer_bytes((8192, 3072), (3072, 1), {0}, 4, **H100) == (4 * 3072 * 88 * 32 * 4, 4 * 24)
    # a norm weight's gradient over batch 2 x seq 8,192 rows: the two reduced dims coalesce into 16,384
    assert reduce_buffer_bytes((2, 8192, 4096), (8192 * 4096, 4096, 1), {0, 1}, 4, **H100) == (
        4 * 4096 * 66 * 32 * 4, 4 * 32)
    # a mean over each row of 4,096 (RMSNorm's variance): the block's lanes reduce a row together, 128 values
    # a thread, under the 256 that would split it across warps: no global buffer
    assert reduce_buffer_bytes((16384, 4096), (4096, 1), {1}, 4, **H100) == ()
    # a whole-tensor amax in bf16 (Float8's tensor-wise scale): 512 threads, 131,072 values each; ctas =
    # max(min(132 x 4, 8192), 512) = 528 partials of 2 bytes, the block reduces its lanes (no x block.x)
    assert reduce_buffer_bytes((1 << 26,), (1,), {0}, 2, **H100) == (2 * 528, 4)
    # fewer SMs, more blocks of partials per output: an A100 (108 SMs) for c_fc: ceil(1728 / 24) = 72
    assert reduce_buffer_bytes((8192, 3072), (3072, 1), {0}, 4, sm_count=108, threads_per_sm=2048)[0] == (
        4 * 3072 * 72 * 32 * 4)


def test_the_cublas_workspaces_are_the_ones_the_h100_kept(alloc_trace):
    """The record's requests of the first step never freed: 32 MiB at the first forward GEMM, 1 MiB after it
    (cuBLASLt's, for addmm's bias epilogue), 32 MiB at the first backward GEMM (autograd's thread, its own
    handle); a tiny GPT-2 traced for an sm90 GPU asks for the same, at the same GEMMs."""
    trace = alloc_trace
    begin, end = trace["step_starts"][0], trace["step_starts"][1]
    live = {}
    for index, (action, address, nbytes) in enumerate(trace["events"][:end]):
        if action == "alloc":
            live[address] = (index, nbytes)
        elif action == "free_completed":
            live.pop(address)
    kept = [nbytes for index, nbytes in sorted(live.values()) if index >= begin and nbytes >= MIB]
    assert kept[:3] == [32 * MIB, MIB, 32 * MIB]

    register_transformers_ops()
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    capture = capture_training_step(model, 2, 16, gpu=GpuTarget(arch=(9, 0), **H100))
    nodes = list(capture.graph.nodes)
    found = handle_workspaces(nodes, lambda n: capture.phase.get(n, FORWARD) != FORWARD, capture.gpu)
    assert [nbytes for _, nbytes in found] == [32 * MIB, MIB, 32 * MIB]
    gemms = [n for n in nodes if n.op == "call_function" and "mm" in str(n.target)]
    first_backward = next(n for n in gemms if capture.phase[n] != FORWARD)
    assert [node for node, _ in found] == [gemms[0], gemms[0], first_backward]
    # before sm90, ":4096:2:16:8": two 4 MiB and eight 16 KiB pieces
    older = handle_workspaces(nodes, lambda n: capture.phase.get(n, FORWARD) != FORWARD,
                              GpuTarget(arch=(8, 0), sm_count=108, threads_per_sm=2048))
    assert older[0][1] == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_flash_backward_takes_fp32_accumulators_and_expands_grouped_keys():
    """FlashAttention-2's mha_bwd for a GQA model (4 query heads, 2 key/value heads, head dim 16, seq 40):
    softmax_d b x h x 128 and dq_accum b x 128 x h x 32 floats (seq rounded to 128, head dim to 32), then
    dk_expanded and dv_expanded b x seq x h x d in bf16, summed into the 2 heads' dk and dv."""
    register_transformers_ops()
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16)
    capture = capture_training_step(model, 3, 40, gpu=GpuTarget(arch=(9, 0), priority=("flash",), **H100))
    backward = [n for n in capture.graph.nodes
                if n.target is torch.ops.aten._scaled_dot_product_flash_attention_backward.default]
    assert len(backward) == 2
    b, h, d = 3, 4, 16
    assert scratch_bytes(backward[0], capture.gpu) == (b * h * 128 * 4, b * 128 * h * 32 * 4,
                                                       b * 40 * h * d * 2, b * 40 * h * d * 2)
    assert scratch_bytes(backward[0], None) == ()  # a CPU trace: no CUDA allocator


def test_each_reduction_reads_its_dims_from_its_own_argument():
    """linalg_vector_norm's second argument is its order, its dims the third (native_functions.yaml); a whole-tensor
    sum takes every dim: over (8,192, 3,072) that is one output, 25 M inputs, a small buffer of 4-byte partials."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8192, 3072, dtype=torch.bfloat16, device="meta")
    gpu = GpuTarget(arch=(9, 0), **H100)
    norm = graph.call_function(torch.ops.aten.linalg_vector_norm.default, (x, 2, [0], True))
    column_sum = graph.call_function(torch.ops.aten.sum.dim_IntList, (x, [0], True))
    # c_fc's bias gradient, worked in the test above: 88 blocks of partials an output
    assert scratch_bytes(norm, gpu) == scratch_bytes(column_sum, gpu) == (4 * 3072 * 88 * 32 * 4, 4 * 24)
    whole = graph.call_function(torch.ops.aten.sum.default, (x,))
    # one output, 25,165,824 inputs: 512 lanes reduce together, 49,152 values each; ctas = max(min(132 x 2,048 /
    # 512, ceil(49152 / 16)), ceil(49152 / 256)) = 528 partials of 4 bytes, one semaphore
    assert scratch_bytes(whole, gpu) == (4 * 528, 4)
    assert scratch_bytes(column_sum, gpu, fused=True) == ()  # inductor's own reduction kernel
