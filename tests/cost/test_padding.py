"""torch.compile's GEMM padding (inductor's pad_mm pass) in the kernel-time model: the padded sizes
from inductor's own functions, the padded time against GEMMs measured on an H100, and the compiled
stack padding GPT-2's vocabulary GEMMs only."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch._inductor.fx_passes.pad_mm import get_alignment_size_dtype, get_padded_length

from fxworkload.cost.devices import load
from fxworkload.cost.gpu import gemm_ns, padded_gemm_ns, padded_sizes
from fxworkload.pipeline import extract

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H100 = load("h100-sxm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("m, k, n", [(8192, 768, 50257), (50257, 8192, 768), (123, 8859, 9586), (64, 64, 64)])
def test_padded_sizes_are_inductors(m, k, n, dtype):
    """Oracle: pad_mm's get_padded_length with get_alignment_size_dtype (fp8: 0, not padded)."""
    align = get_alignment_size_dtype(dtype)
    expected = tuple(size + get_padded_length(size, align) for size in (m, k, n))
    assert padded_sizes(m, k, n, dtype.itemsize) == expected


def _measured_us(m: int, k: int, n: int) -> float:
    with open(FIXTURES / "h100_gemm_kernels.csv", newline="") as f:
        return next(float(r["us"]) for r in csv.DictReader(f)
                    if (r["dtype"], r["layout"], int(r["m"]), int(r["k"]), int(r["n"])) == ("bf16", "NT", m, k, n))


def test_gpt2s_lm_head_padded_costs_the_aligned_gemm_measured_on_an_h100_and_its_weight_copy():
    """Measured on an H100 (shared/gpu-kernels): 2048 x 768 x 50,257 runs the align1 fallback in
    1,676 us, 2048 x 768 x 50,304 a Hopper kernel in 238 us. Padded to 50,264, the GEMM costs about
    the aligned one plus the copy of the 768 x 50,257 bf16 weight (77 MB read, 77 MB written: about
    60 us at H100's 2.7 TB/s reachable), far under the fallback, measured or estimated."""
    facts, model = H100.gpu_facts(), H100.gpu_model()
    unpadded_us = gemm_ns(2048, 768, 50257, 1, "bf16", (768, 768, 50257), facts, model) / 1e3
    padded_us = padded_gemm_ns(2048, 768, 50257, 1, "bf16", (768, 768, 50257), facts, model) / 1e3
    aligned_us, fallback_us = _measured_us(2048, 768, 50304), _measured_us(2048, 768, 50257)
    assert aligned_us < padded_us < aligned_us + 2 * 60 < fallback_us / 4
    assert padded_us < unpadded_us / 3


def test_aligned_and_memory_bound_gemms_are_not_padded():
    """An aligned GEMM has nothing to pad; a one-row GEMM's intensity, 4096·50257 / (4096 + 4096·50257
    + 50257) ≈ 1 FLOP per element, is far under half an H100's 989 TFLOP/s over 3.35 TB/s (148), so
    is_mm_compute_bound says no and it keeps the fallback."""
    facts, model = H100.gpu_facts(), H100.gpu_model()
    for m, k, n in ((8192, 768, 50304), (1, 4096, 50257)):
        leading = (k, k, n)
        assert padded_gemm_ns(m, k, n, 1, "bf16", leading, facts, model) == gemm_ns(m, k, n, 1, "bf16", leading,
                                                                                     facts, model)


def test_the_compiled_stack_pads_gpt2s_vocabulary_gemms_and_no_other():
    """GPT-2's only unaligned sizes are the vocabulary's 50,257: its lm_head GEMMs (forward, input and
    weight gradient, 2,048 tokens) run in under half their time under --stack compiled; every other
    GEMM costs what eager's does."""
    def gemms(stack):
        rows = extract("gpt2", batch=4, seq=512, dtype="bf16", device="h100-sxm", stack=stack).workload.node_rows
        return {(row.name, op.phase): op for row in rows for op in (row.forward, *row.input_grad, *row.weight_grad)
                if op.gemm_mkn is not None and not op.fused}
    eager, compiled = gemms("eager"), gemms("compiled")
    vocabulary = {key for key, op in eager.items() if 50257 in op.gemm_mkn}
    assert {name for name, _ in vocabulary} == {"lm_head"} and len(vocabulary) == 3
    for key, op in compiled.items():
        if key in vocabulary:
            assert op.estimated_ns < eager[key].estimated_ns / 2
        else:
            assert op.estimated_ns == eager[key].estimated_ns
