"""The host's share of a step (workload/table.py's dispatch times, the summary's verdict), by hand."""

from __future__ import annotations

import re

import pytest

from fxworkload.cost.gpu import two_stream_ns
from fxworkload.formats.tables import HOST_BOUND_SHARE
from fxworkload.pipeline import extract

from ..conftest import tiny_config


def test_an_ops_host_time_is_its_dispatch_and_an_allocation_per_extra_output(tmp_path):
    """native_layer_norm returns three tensors (output, mean, rstd): dispatch + 2 allocations; add one."""
    tiny_config("gpt2").save_pretrained(tmp_path)
    result = extract(str(tmp_path), batch=1, seq=16, device="h100-sxm")
    model = result.device.gpu_model()
    ops = {op.op: op for op in result.workload.ops("forward")}
    assert ops["aten.native_layer_norm.default"].dispatch_ns == pytest.approx(
        model.host_dispatch_ns + 2 * model.host_output_ns)
    assert ops["aten.add.Tensor"].dispatch_ns == pytest.approx(model.host_dispatch_ns)


def _verdict(result) -> tuple[str, float]:
    """The summary's verdict, and the GPU's idle share computed by hand from every op in eager order."""
    ordered = result.workload.execution_order()
    step = two_stream_ns([(op.dispatch_ns, op.estimated_ns) for op in ordered])
    idle = 1 - sum(op.estimated_ns for op in ordered) / step
    line = next(line for line in result.summary().splitlines() if line.startswith(("HOST-BOUND", "GPU-bound")))
    return line, idle


def test_the_summary_says_a_small_gpt2_step_on_an_h100_is_host_bound():
    """GPT-2 small at batch 1 (seq 1,024, bf16) on the H100 profile: ~620 ops of ~15 us against ~10 ms
    of kernels; the verdict agrees with the two-stream step computed here."""
    line, idle = _verdict(extract("gpt2", batch=1, dtype="bf16", device="h100-sxm"))
    assert idle > HOST_BOUND_SHARE and line.startswith("HOST-BOUND")
    assert f"{100 * idle:.0f}%" in line


def test_the_summary_says_a_large_llama_step_is_gpu_bound(tmp_path):
    """A Llama of 8B's widths at seq 4,096: seconds of GEMMs, the host far ahead."""
    tiny_config("llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                num_hidden_layers=2, vocab_size=128256, max_position_embeddings=4096).save_pretrained(tmp_path)
    line, idle = _verdict(extract(str(tmp_path), batch=1, seq=4096, dtype="bf16", device="h100-sxm"))
    assert idle < HOST_BOUND_SHARE and re.match(r"GPU-bound: the host keeps ahead", line)


def test_the_step_interval_moves_each_kernel_family_by_its_held_out_error(tmp_path):
    """A GPU-bound step: with GEMMs bounded by x0.5-x2 and the other families exact, the step's
    interval is the step less half / plus all of the GEMM kernels' time (a hand sum over the ops)."""
    from dataclasses import replace

    from fxworkload.workload.table import kernel_family

    tiny_config("llama", hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
                num_hidden_layers=2, vocab_size=32000, max_position_embeddings=4096).save_pretrained(tmp_path)
    workload = extract(str(tmp_path), batch=1, seq=4096, dtype="bf16", device="h100-sxm").workload
    assert workload.error_intervals  # the shipped fit carries them
    totals = workload.totals
    assert totals["step_low_ns"] <= totals["step_estimated_ns"] <= totals["step_high_ns"]
    chosen = replace(workload, error_intervals={"gemm": (0.5, 2.0), "sdpa": (1.0, 1.0), "vector": (1.0, 1.0)})
    gemm_ns = sum(op.estimated_ns for op in workload.execution_order() if kernel_family(op) == "gemm")
    step = chosen.totals["step_estimated_ns"]
    assert chosen.totals["step_high_ns"] == pytest.approx(step + gemm_ns, rel=1e-3)
    # faster GEMMs can leave the GPU waiting on the host here and there: no lower than the hand figure
    assert step - gemm_ns / 2 <= chosen.totals["step_low_ns"] <= (step - gemm_ns / 2) * 1.01
