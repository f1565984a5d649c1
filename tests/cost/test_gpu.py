"""The GPU kernel-time model: its mechanics by hand, its kernel-family rule and its fit against
kernels measured on an H100 (tests/fixtures, from shared/gpu-kernels)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from fxworkload.cost.devices import load, read
from fxworkload.cost.gpu import GpuFacts, GpuModel, alignment_bytes, causal_fraction, gemm_ns, two_stream_ns
from fxworkload.errors import UserError
from fxworkload.measure import kernels

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LEADING = {"NT": lambda m, k, n: (k, k, n), "NN": lambda m, k, n: (k, n, n), "TN": lambda m, k, n: (m, n, n)}


def _gemm_rows():
    with open(FIXTURES / "h100_gemm_kernels.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_hopper_kernels_run_exactly_when_every_leading_dimension_is_16_byte_aligned():
    """Oracle: which cuBLAS kernel ran for each of 1,015 16-bit GEMMs measured on an H100."""
    rows = [r for r in _gemm_rows() if r["dtype"] != "fp32"]
    predicted = [alignment_bytes(LEADING[r["layout"]](int(r["m"]), int(r["k"]), int(r["n"])), 2) >= 16 for r in rows]
    assert len(rows) == 1015 and predicted == [r["hopper_kernel"] == "1" for r in rows]


def test_the_traced_gemm_reads_its_leading_dimensions_from_the_operands_strides():
    from fxworkload.measure.kernels import gemm_samples

    rows = [{"dtype": "bf16", "m": "64", "k": "96", "n": "200", "layout": layout, "us": "1", "_line": 2}
            for layout in ("NT", "NN", "TN")]
    leading = [s.ops[0].gemm_leading for s in gemm_samples(rows)]
    assert leading == [(96, 96, 200), (96, 200, 200), (64, 200, 200)]


FACTS = GpuFacts(sm_count=132, tensor_flops_per_s={"bf16": 1e15, "fp16": 1e15, "fp32": 6.7e13},
                 memory_bytes_per_s=3e12)
BARE = GpuModel(gemm_kernel_ns=0.0, gemm_min_ns=0.0, gemm_tile_edge=0.0, gemm_tensor_efficiency=1.0)


def test_one_tile_row_more_than_the_sms_hold_costs_most_of_a_wave():
    """132 tiles of 128x256 fill one wave exactly (time by hand: one tile's FLOPs at one SM's rate).
    128 more rows need a second wave of those tiles (2x); with no small-tile penalty (edge 0) the
    cheapest tiling is then 64x64: 26 x 44 = 1,144 tiles in 9 waves of 1/8 the work, 9/8 the time."""
    one_wave = gemm_ns(128 * 12, 8192, 256 * 11, 1, "bf16", (8192, 2816, 2816), FACTS, BARE)
    more = gemm_ns(128 * 13, 8192, 256 * 11, 1, "bf16", (8192, 2816, 2816), FACTS, BARE)
    assert one_wave == pytest.approx(2 * 128 * 256 * 8192 / (1e15 / 132) * 1e9)
    assert more == pytest.approx(9 / 8 * one_wave)


def test_an_odd_leading_dimension_takes_the_fallback_rate():
    aligned = gemm_ns(8192, 768, 50304, 1, "bf16", (768, 768, 50304), FACTS, GpuModel())
    odd = gemm_ns(8192, 768, 50257, 1, "bf16", (768, 768, 50257), FACTS, GpuModel())
    model = GpuModel()
    assert odd / aligned == pytest.approx(model.gemm_tensor_efficiency / model.gemm_align1_efficiency, rel=0.1)


def test_causal_kernels_visit_the_blocks_on_and_below_the_diagonal():
    assert causal_fraction(128, 128) == 1.0 and causal_fraction(4096, 4096) == pytest.approx(33 / 64)


def test_flash_attentions_causal_grid_ends_when_its_last_slot_does():
    """By hand: one sequence of 512 (four 128-query blocks against eight 64-key blocks) on one SM that holds
    two CTAs. Causal, the blocks run 2, 4, 6 and 8 key blocks: slot A runs 2 then 6 (ends at 8), slot B 4 then
    8 (ends at 12); unmasked, two waves of 8 end at 16. With the SMs of an H100 every block has a slot of its
    own, and the causal grid ends with its longest block, the diagonal's, as late as the unmasked one."""
    from fxworkload.cost.gpu import flash_causal_grid_ratio

    assert flash_causal_grid_ratio(1, 512, 512, sm_count=1) == 12 / 16
    assert flash_causal_grid_ratio(1, 512, 512, sm_count=132) == 1.0
    # a query shorter than its keys (bottom-right aligned): one 128-query block sees every key
    assert flash_causal_grid_ratio(1, 128, 512, sm_count=132) == 1.0


def test_the_step_waits_for_the_slower_of_host_and_gpu():
    assert two_stream_ns([(10, 1), (10, 1)]) == 21  # host-bound: each kernel waits for its launch
    assert two_stream_ns([(1, 10), (1, 10)]) == 21  # GPU-bound: the first launch, then back to back
    assert two_stream_ns([(5, 0), (1, 10)]) == 16  # an op with no kernel costs host time only


def test_the_shipped_fit_holds_on_the_measured_gemms():
    """Oracle: 1,267 GEMM times measured on an H100 (the model's free parameters were fitted on
    them; bench/kernels.py reports the held-out half). Aligned 16-bit GEMMs: median error <= 10%."""
    device = load("h100-sxm")
    rows = [dict(r, _line=i) for i, r in enumerate(_gemm_rows(), start=2) if r["dtype"] != "fp32"
            and r["hopper_kernel"] == "1"]
    samples = kernels.gemm_samples(rows[::4])
    errors = [abs(e) for e in kernels.relative_errors(samples, device)]
    assert statistics.median(errors) <= 0.10


def _vector_kernel_ns(op: str, dtype: str, rows: int, cols: int, device) -> float:
    from fxworkload.workload.table import op_estimate_ns

    sample = kernels.vector_samples([{"op": op, "dtype": dtype, "rows": str(rows), "cols": str(cols), "us": "1",
                                      "_line": 1}], kernels.target_of(device))[0]
    return sum(op_estimate_ns(o, device) for o in sample.ops)


def test_a_gpu_that_differs_only_in_bandwidth_does_not_speed_up_what_its_sms_bound():
    """An H100 with an H200's 1.43x bandwidth and nothing else changed. By hand: a large vectorized add
    is bound by DRAM, so it runs 1.43x faster less its fixed cost; a bf16 -> fp32 cast runs the unrolled
    casting kernel, bound by the bytes its 132 SMs keep in flight over the memory latency (Little's law),
    so it runs no faster."""
    from dataclasses import replace

    h100 = load("h100-sxm")
    wider = replace(h100, memory_bytes_per_s=h100.memory_bytes_per_s * 4.8 / 3.35)
    model = h100.gpu_model()
    assert h100.sm_count * model.memory_cast_bytes_per_s_per_sm < h100.memory_bytes_per_s * model.memory_efficiency
    add = [_vector_kernel_ns("add", "bf16", 32768, 8192, d) for d in (h100, wider)]
    fixed = model.vector_kernel_ns
    assert (add[0] - fixed) / (add[1] - fixed) == pytest.approx(4.8 / 3.35, rel=1e-6)
    cast = [_vector_kernel_ns("to_fp32", "bf16", 32768, 8192, d) for d in (h100, wider)]
    assert cast[0] == pytest.approx(cast[1], rel=1e-9)


def test_a_kernel_csv_with_a_missing_column_or_a_bad_number_is_named(tmp_path):
    (tmp_path / "gemm.csv").write_text("dtype,m,k,n,us\nbf16,1,2,3,4\n")
    with pytest.raises(UserError, match=r"gemm.csv: missing column 'layout'"):
        kernels.read_rows(tmp_path / "gemm.csv")
    (tmp_path / "gemm.csv").write_text("dtype,m,k,n,layout,us\nbf16,1,2,3,NT,fast\n")
    with pytest.raises(UserError, match=r"gemm.csv:2: column 'us' is 'fast', not a time in µs"):
        kernels.read_rows(tmp_path / "gemm.csv")


def test_a_gpu_profile_missing_a_datasheet_field_is_named(tmp_path):
    from fxworkload.cost.devices import DATA_DIR

    document = json.loads((DATA_DIR / "h100-sxm.json").read_text())
    del document["sm_count"]
    document["arch"] = "sm90"
    (tmp_path / "broken.json").write_text(json.dumps(document))
    with pytest.raises(UserError, match="missing the datasheet field 'sm_count'"):
        read(tmp_path / "broken.json")


def test_every_shipped_gpu_profile_names_a_source_for_each_fact():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h200"):
        profile = load(name)
        assert profile.sm_count and profile.arch and profile.memory_capacity_bytes
        for fact in ("arch", "sm_count", "l2_bytes", "memory_capacity_bytes", "sdpa_priority", "gpu_model_fit"):
            assert profile.sources.get(fact), (name, fact)


def test_an_explicit_mask_visits_every_block_at_a_fitted_extra_cost():
    """By hand: with a mask the kernel skips no causal block and its main loop costs (1 + mask cost)
    times the unmasked non-causal one; the mask's shape (causal, sliding window) does not enter."""
    from fxworkload.cost.gpu import attention_ns

    model = GpuModel(attention_kernel_ns=0.0, attention_forward_memory_passes=0.0, attention_mask_forward_cost=0.5)
    shape = dict(batch=1, heads=8, q_len=4096, kv_len=4096, head_dim=128, dropout=0.0, facts=FACTS, model=model)
    flops = 4 * 8 * 4096 * 4096 * 128
    full = attention_ns(flops, "cudnn", False, "bf16", is_causal=False, has_mask=False, **shape)
    masked = attention_ns(flops, "cudnn", False, "bf16", is_causal=True, has_mask=True, **shape)
    causal = attention_ns(flops, "cudnn", False, "bf16", is_causal=True, has_mask=False, **shape)
    assert masked == pytest.approx(1.5 * full) and causal == pytest.approx(full * 33 / 64)


@pytest.mark.parametrize("arch, forward, backward", [("sm90", 1.25, 1.03), ("sm80", 0.90, 0.85)])
def test_flex_attention_runs_its_visited_tiles_at_flashs_speed_times_the_published_ratio(arch, forward, backward):
    """Oracle: FlexAttention's authors' averages (GTC 2025, arXiv 2412.05496): on H100s forward ~25 % faster than
    FlashAttention-2 and backward ~3 % faster; on A100s 90 % and 85 % of it. A kernel visiting a quarter of the
    tiles takes a quarter of the dense one's time."""
    from dataclasses import replace

    from fxworkload.cost.gpu import attention_ns

    model = GpuModel(attention_kernel_ns=0.0, attention_forward_memory_passes=0.0,
                     attention_backward_memory_passes=0.0)
    facts = replace(FACTS, arch=arch)
    shape = dict(batch=1, heads=8, q_len=4096, kv_len=4096, head_dim=128, dropout=0.0, facts=facts, model=model,
                 is_causal=False, has_mask=False)
    flops = 4 * 8 * 4096 * 4096 * 128
    for backward_pass, ratio in ((False, forward), (True, backward)):
        flash = attention_ns(flops, "flash", backward_pass, "bf16", **shape)
        dense = attention_ns(flops, "flex", backward_pass, "bf16", **shape)
        quarter = attention_ns(flops, "flex", backward_pass, "bf16", visited_share=0.25, **shape)
        assert dense == pytest.approx(flash / ratio)
        assert quarter == pytest.approx(dense / 4)


@pytest.mark.parametrize("profile", ["h100-sxm", "a100-80gb"])
def test_the_memory_efficient_kernel_on_16_bit_inputs_runs_no_faster_than_flashattention_2(profile):
    """Oracle: FlashAttention-2's paper (Dao 2023) measured it faster than xformers' CUTLASS kernel, which is
    PyTorch's memory-efficient backend, both on sm80's mma.sync instructions; and an sm80 CUTLASS GEMM on the H100
    reaches 0.28 of its BF16 peak in the measured data, so no such attention kernel reaches the 0.66 that the
    efficient kernel's fp32 rows were fitted at. On bf16 the efficient kernel takes at least flash's time; on fp32
    (the FP32 units, where the fit was made) its time does not depend on flash's efficiencies."""
    from dataclasses import replace

    from fxworkload.cost.gpu import attention_ns

    device = load(profile)
    facts, model = device.gpu_facts(), device.gpu_model()
    shape = dict(batch=4, heads=16, q_len=4096, kv_len=4096, head_dim=128, dropout=0.0, facts=facts,
                 is_causal=False, has_mask=False)  # no mask: the same grid for both (flash's causal tail is its own)
    flops = 4 * 4 * 16 * 4096 * 4096 * 128
    for backward in (False, True):
        efficient = attention_ns(flops, "efficient", backward, "bf16", model=model, **shape)
        flash = attention_ns(flops, "flash", backward, "bf16", model=model, **shape)
        assert efficient >= flash * (1 - 1e-9)
        slower_flash = replace(model, flash_forward_efficiency=0.1, flash_backward_efficiency=0.1)
        fp32 = [attention_ns(flops, "efficient", backward, "fp32", model=m, **shape) for m in (model, slower_flash)]
        assert fp32[0] == fp32[1]
        assert attention_ns(flops, "efficient", backward, "bf16", model=slower_flash, **shape) > efficient


def test_dropouts_random_numbers_are_drawn_for_the_blocks_a_causal_kernel_visits_only():
    """By hand: dropout adds its fitted fraction of the kernel and its operations per score element, and a
    causal kernel draws them for the blocks on and below the diagonal only (33 of 64 at 4,096 in 128-wide
    blocks), in 8 x 32 CTAs over 132 SMs (two waves where 1.94 are busy)."""
    from fxworkload.cost.gpu import attention_ns

    model = GpuModel(attention_kernel_ns=0.0, attention_forward_memory_passes=0.0, cudnn_forward_dropout_cost=0.25,
                     attention_forward_dropout_flops=40.0)
    shape = dict(batch=1, heads=8, q_len=4096, kv_len=4096, head_dim=128, facts=FACTS, model=model)
    flops = 4 * 8 * 4096 * 4096 * 128
    plain = attention_ns(flops, "cudnn", False, "bf16", is_causal=True, has_mask=False, dropout=0.0, **shape)
    dropped = attention_ns(flops, "cudnn", False, "bf16", is_causal=True, has_mask=False, dropout=0.1, **shape)
    waves = 2 / (8 * 32 / 132)
    random_numbers_s = waves * 8 * 4096 * 4096 * 33 / 64 * 40.0 / 6.7e13
    assert dropped == pytest.approx(1.25 * plain + 1e9 * random_numbers_s)


def test_cuda_softmax_backward_is_a_multiply_kernel_then_the_backward_kernel():
    """By hand, from SoftMax.cu (softmax_backward_cuda_out: ``tmp = grad * output``, then the backward
    kernel over tmp and output): two kernel launches and two passes over the op's three tensors,
    where a plain softmax forward is one kernel and one pass."""
    import torch

    from fxworkload.capture.trace import FORWARD
    from fxworkload.cost.optime import gpu_op_ns
    from fxworkload.measure.kernels import _traced_ops

    device = load("h100-sxm")
    model, facts = device.gpu_model(), device.gpu_facts()
    bandwidth = facts.memory_bytes_per_s * model.memory_efficiency
    x = torch.randn(64, 1024, requires_grad=True)
    backward, = [op for op in _traced_ops(lambda x: torch.autograd.grad(torch.softmax(x, -1).sum(), x), [x])
                 if op.op == "aten._softmax_backward_data.default"]
    tensor_bytes = 64 * 1024 * 4
    assert backward.bytes == 3 * tensor_bytes and backward.phase == FORWARD
    assert gpu_op_ns(backward, device, "fp32") == pytest.approx(2 * model.vector_kernel_ns
                                                                + 1e9 * 6 * tensor_bytes / bandwidth)
    forward, = [op for op in _traced_ops(lambda x: torch.softmax(x, -1), [x]) if op.op == "aten._softmax.default"]
    assert gpu_op_ns(forward, device, "fp32") == pytest.approx(model.vector_kernel_ns + 1e9 * 2 * tensor_bytes / bandwidth)


def test_a_grouped_gemm_is_one_kernel_over_the_tiles_of_its_groups():
    """By hand: (T, K)·(G, K, N) is G GEMMs of T/G rows; the weight gradient (K, T)·(T, N) → (G, K, N)
    contracts T/G tokens per group. Oracle for the rate: torch._grouped_mm measured on an H100 by
    pytorch/ao#2490 (bf16, 8,192 tokens over 16 experts, K 5,120, N 8,192: 1.31 ms)."""
    import torch

    from fxworkload.cost.flops import grouped_gemm_shape
    from fxworkload.cost.optime import gpu_op_ns
    from fxworkload.measure.kernels import _traced_ops

    grouped = torch.ops.aten._grouped_mm.default
    offsets = torch.empty(16, dtype=torch.int32)
    tokens, weights = torch.empty(8192, 5120, dtype=torch.bfloat16), torch.empty(16, 5120, 8192, dtype=torch.bfloat16)
    assert grouped_gemm_shape(grouped, (tokens, weights, offsets)) == (512, 5120, 8192, 16)
    assert grouped_gemm_shape(grouped, (tokens.t(), torch.empty(8192, 8192), offsets)) == (5120, 512, 8192, 16)
    assert grouped_gemm_shape(torch.ops.aten.mm.default, (tokens, tokens.t())) is None

    op, = _traced_ops(lambda x, w, offs: torch._grouped_mm(x, w, offs=offs),
                      [tokens, weights, torch.arange(512, 8193, 512, dtype=torch.int32)])
    assert op.grouped_gemm == (512, 5120, 8192, 16) and op.flops == 2 * 8192 * 5120 * 8192
    device = load("h100-sxm")
    assert gpu_op_ns(op, device, "bf16") == pytest.approx(1.31e6, rel=0.10)
    model = device.gpu_model()
    wave_ns = gemm_ns(512, 5120, 8192, 16, "bf16", (8, 8, 8), device.gpu_facts(), model, grouped=True)
    as_cube = gemm_ns(8192, 5120, 8192, 1, "bf16", (8, 8, 8), device.gpu_facts(), model)
    assert gpu_op_ns(op, device, "bf16") == wave_ns and wave_ns > 1.2 * as_cube  # slower than cuBLAS's one GEMM


def _softmax_rows():
    with open(FIXTURES / "h100_softmax_kernels.csv", newline="") as f:
        return [dict(r, _line=i) for i, r in enumerate(csv.DictReader(f), start=2)]


def test_softmax_runs_the_kernel_pytorch_chooses_for_its_row_length():
    """Oracle: the kernel that ran for each of 30 softmaxes measured on an H100 (rows of 768, 4,096
    and 50,304, bf16 and fp32): the warp kernel, the register kernel, or the block kernel that reads
    the row once per reduction."""
    from fxworkload.cost.gpu import softmax_kernel

    names = {"warp": "softmax_warp_forward", "registers": "cunn_SoftMaxForwardReg", "block": "cunn_SoftMaxForward<"}
    rows = _softmax_rows()
    assert len(rows) == 30
    for row in rows:
        chosen = softmax_kernel(int(row["cols"]), 2 if row["dtype"] == "bf16" else 4, backward=False)
        assert names[chosen] in row["kernels"], row


def test_a_long_softmax_rereads_its_rows_unless_the_rows_in_flight_fit_in_l2():
    """By hand: rows of 50,304 run in blocks of 512 threads (SoftMax_getBlockSize: min(50,304 / 4, 1,024) / 2
    for fp32, min(50,304 / 8, 1,024) / 2 for bf16), 4 to an SM of 2,048 threads, so 132 x 4 = 528 rows are in
    flight: 106 MB of fp32, over twice the H100's 50 MB of L2 (every re-read from memory: the forward's
    two, the backward's one); 53.1 MB of bf16, just over it (2 - 2 x 50 / 53.1 = 2.6 % of the re-reads
    miss). Oracle: the largest fp32 row of the measured softmaxes, 750 us, within 10%."""
    from fxworkload.cost.gpu import softmax_rereads

    device = load("h100-sxm")
    facts = device.gpu_facts()
    assert softmax_rereads(50304, 4, False, facts) == 2 and softmax_rereads(50304, 4, True, facts) == 1
    assert softmax_rereads(50304, 2, False, facts) == pytest.approx(2 * (2 - 2 * 52428800 / (528 * 50304 * 2)))
    assert softmax_rereads(4096, 4, False, facts) == 0  # the registers kernel: one read
    assert softmax_rereads(50304, 2, False, GpuFacts(132, {}, 3e12)) == 2  # no L2 known: from memory
    largest = [r for r in _softmax_rows() if r["dtype"] == "fp32" and r["cols"] == "50304" and r["rows"] == "2668"]
    sample, = kernels.vector_samples(largest, kernels.target_of(device))
    error, = kernels.relative_errors([sample], device)
    assert abs(error) <= 0.10


def test_softmax_blocks_are_the_sizes_the_measured_kernels_launched():
    """NeuSight's measured softmaxes (sitar-lab/NeuSight@6945927, dataset/test/softmax.csv, torch 2.1, fp32)
    launched cunn_SoftMaxForward with blockDim.x 256 for rows of 1,280-2,048 and 512 for 2,560-16,384."""
    from fxworkload.cost.gpu import softmax_block_threads

    measured = {1280: 256, 1600: 256, 2048: 256, 2560: 512, 3072: 512, 4096: 512, 6400: 512, 10240: 512, 16384: 512}
    assert {row: softmax_block_threads(row, 4) for row in measured} == measured


def test_a_layer_norm_reads_its_rows_again_from_memory_as_far_as_they_overflow_l2():
    """By hand, fp32 rows of 1,600 (6,400 bytes) in 128-thread blocks: a V100 (80 SMs of 2,048 threads:
    1,280 rows, 8.2 MB in flight over its 6 MB of L2) misses 2 - 2 x 6 / 8.2 = 46 % of the second reads; an
    A100 (1,728 rows, 11 MB of 40 MB) none; a T4 (Turing: 1,024 threads an SM, 320 rows, 2 MB of 4 MB) none."""
    from fxworkload.cost.gpu import layer_norm_rereads

    v100, a100, t4 = (load(name).gpu_facts() for name in ("v100-pcie", "a100-pcie-40gb", "t4"))
    assert t4.threads_per_sm == 1024 and v100.threads_per_sm == 2048
    assert layer_norm_rereads(1600, 4, v100) == pytest.approx(2 - 2 * 6291456 / (80 * 16 * 6400))
    assert layer_norm_rereads(1600, 4, a100) == 0 and layer_norm_rereads(1600, 4, t4) == 0


# FlashAttention-2 on one H100 80GB SXM5, BF16, head dim 128, 16 heads, batch x seq = 16k tokens, as the
# FlashAttention-3 paper measured it (Shah et al., arXiv 2407.08608, Figures 5 and 6; its FLOPs: 4 seq^2 d h a
# sequence, halved with the causal mask, x 2.5 backward): (direction, causal, seq) -> TFLOP/s
FA2_ON_H100 = {("forward", False, 16384): 370, ("backward", False, 16384): 322, ("forward", True, 16384): 335,
               ("forward", True, 2048): 298}


@pytest.mark.parametrize("direction, causal, seq", list(FA2_ON_H100))
def test_sdpas_flash_kernel_on_an_h100_runs_at_flashattention_2s_published_speed(direction, causal, seq):
    """The shipped flash efficiencies are fitted on the paper's rows without the mask (bench/attention.py
    --fit): within 5 %. Its causal rows are held out, and hold within 5 % too since the forward's grid runs as
    launched (flash_causal_grid_ratio); when every causal block was taken to cost its mean, 16k was 13 % fast."""
    from fxworkload.capture.attention import GpuTarget
    from fxworkload.measure import kernels

    batch, heads, head_dim = 16384 // seq, 16, 128
    flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1) * (2.5 if direction == "backward" else 1)
    row = {"dtype": "bf16", "batch": batch, "heads": heads, "kv_heads": heads, "seq": seq, "head_dim": head_dim,
           "causal": str(causal), "dropout": "0.0", "mask": "none", "fwd_us": 1.0, "bwd_us": 1.0, "_line": 2}
    forward, backward = kernels.sdpa_samples([row], GpuTarget(arch=(9, 0), priority=("flash",)))
    sample = backward if direction == "backward" else forward
    assert all(op.sdpa_backend == "flash" for op in sample.ops if op.sdpa_backend)
    tflop_per_s = flops / kernels.estimate_ns(sample, load("h100-sxm")) / 1e3
    published = FA2_ON_H100[(direction, causal, seq)]
    assert abs(tflop_per_s / published - 1) < 0.05, tflop_per_s


# Boost clocks from each board's datasheet (NVIDIA's product briefs; the H100's whitepaper), MHz
BOOST_MHZ = {"h100-sxm": 1980, "l4": 2040, "a100-pcie-80gb": 1410, "a100-pcie-40gb": 1410, "v100-pcie": 1380,
             "t4": 1590, "p100-pcie": 1303, "p4": 1063}


@pytest.mark.parametrize("name", sorted(BOOST_MHZ))
def test_the_issue_bound_fp32_sms_are_the_128_lane_single_issue_ones(name):
    """FP32 lanes per SM from the datasheet: the FP32 peak over 2 x SMs x boost clock. The issue share applies
    where a partition of 32 lanes issues one instruction a clock: 128 lanes an SM from Volta's scheduler on
    (GA10x, Ada, Hopper), not the 64-lane SMs (P100, V100, T4, A100) nor Pascal's dual-dispatch 128 (P4)."""
    profile = load(name)
    lanes = profile.matmul_flops_per_s["fp32"] / (2 * profile.sm_count * BOOST_MHZ[name] * 1e6)
    assert round(lanes / 64) * 64 in (64, 128) and abs(lanes / (round(lanes / 64) * 64) - 1) < 0.03
    single_issue = int(profile.arch.removeprefix("sm")) >= 70
    assert profile.gpu_facts().fp32_issue_bound == (round(lanes / 64) == 2 and single_issue)


def test_an_issue_bound_gpus_fp32_gemm_keeps_the_fitted_share_of_its_rate():
    facts = load("l4").gpu_facts()
    model = load("l4").gpu_model()
    assert facts.fp32_issue_bound and model.gemm_fp32_issue_share < 1
    big = (8192, 8192, 8192, 1, "fp32", (8192, 8192, 8192))
    unshared = gemm_ns(*big, facts, GpuModel(**{**model.__dict__, "gemm_fp32_issue_share": 1.0}))
    assert gemm_ns(*big, facts, model) == pytest.approx(unshared / model.gemm_fp32_issue_share, rel=0.01)


def test_an_fp32_tile_costs_its_k_plus_the_fitted_overhead_and_a_tensor_core_tile_its_k():
    """By hand: 4 SMs at 1 TFLOP/s each, no edge derating or fixed costs, DRAM never the limit. A 512 x 64 x 256
    fp32 GEMM runs four 128 x 256 tiles in one wave, 2 x 128 x 256 x (64 + 32) FLOPs each: 6,291.456 ns with
    32 elements of overhead, 4,194.304 without (64 / 96 of it); a bf16 GEMM's tiles take no such term."""
    facts = GpuFacts(4, {"fp32": 4e12, "bf16": 4e12}, 1e18)
    bare = GpuModel(gemm_fp32_efficiency=1.0, gemm_tensor_efficiency=1.0, gemm_tile_edge=0.0, gemm_kernel_ns=0.0,
                    gemm_min_ns=0.0)
    with_overhead = GpuModel(**{**bare.__dict__, "gemm_fp32_tile_overhead_k": 32.0})
    shape = (512, 64, 256, 1)
    assert gemm_ns(*shape, "fp32", (64, 256, 256), facts, with_overhead) == pytest.approx(6291.456, rel=1e-6)
    assert gemm_ns(*shape, "fp32", (64, 256, 256), facts, bare) == pytest.approx(4194.304, rel=1e-6)
    assert (gemm_ns(*shape, "bf16", (64, 256, 256), facts, with_overhead)
            == gemm_ns(*shape, "bf16", (64, 256, 256), facts, bare) == pytest.approx(4194.304, rel=1e-6))
