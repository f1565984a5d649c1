"""A real GPU's profiler trace through compare and calibrate --from: GPT-2 (batch 8, seq 1024, bf16,
dropout on), one eager training step on a lent H100 80GB HBM3 under torch.profiler (CPU + CUDA,
shapes recorded; torch 2.11, transformers 5.17): tests/fixtures/h100_gpt2_b8_s1024_bf16_trace.json.gz,
copied from bench/data/lent-gpus/h100/trace-0.json.gz (bench/gpu_steps.py wrote it)."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from fxworkload.cost import devices
from fxworkload.errors import UserError
from fxworkload.measure.compare import load_document, load_measured, row_ops
from fxworkload.measure.kernels import fitted_from_trace, median_abs_pct, op_from_json, trace_samples, with_model
from fxworkload.workload.table import op_estimate_ns

from ..test_cli import in_process

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "h100_gpt2_b8_s1024_bf16_trace.json.gz"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@pytest.fixture(scope="module")
def estimated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt2-h100") / "est"
    result = in_process("extract", "gpt2", "--batch", 8, "--seq", 1024, "--dtype", "bf16", "--device", "h100-sxm",
                        "--out", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def measured(estimated) -> dict:
    return load_measured(TRACE, load_document(estimated, "workload.json"), "torch-profiler")


def test_compare_ties_the_real_traces_kernel_time_to_graph_nodes(estimated, tmp_path):
    """Oracle: the trace's own JSON, read here with gzip and json: the sum of its kernel, memcpy and
    memset durations is the step's GPU time; compare's total equals it, and ties at least 99 % of it
    (the rest: transformers' packed-sequence check, which the capture answers at trace time)."""
    events = json.loads(gzip.decompress(TRACE.read_bytes()))["traceEvents"]
    kernel_us = sum(e["dur"] for e in events if e.get("cat") in GPU_CATEGORIES)
    result = in_process("compare", estimated, TRACE, "--out", tmp_path / "cmp")
    assert result.returncode == 0, result.stderr
    comparison = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert comparison["trace"]["total_ns"] == pytest.approx(kernel_us * 1e3)
    assert comparison["attributed_fraction"] >= 0.99


def test_workload_ops_read_back_cost_what_extract_costed(measured):
    """Each op of the trace's pairing, rebuilt from workload.json, costs on h100-sxm what extract
    wrote for it (the same model, the same fields)."""
    device = devices.load("h100-sxm")
    rows = trace_samples(measured)
    assert len(rows) > 500
    for sample in rows:
        written = next(op for row in measured["rows"] for op in row_ops(row) if op.get(
            "measured_ns") == sample.measured_ns and op["op"] == sample.ops[0].op)
        assert op_estimate_ns(sample.ops[0], device) == pytest.approx(written["estimated_ns"], rel=1e-9)


@pytest.mark.parametrize("field, value", [("input_dtypes", ["load"]), ("gemm_mkn", [1, -2, 3]),
                                          ("flops", 1.5), ("attention", {"backend": "os.system"}),
                                          ("input_shapes", [None]), ("input_shapes", [[2, "x"]]),
                                          ("output_dtypes", [["float32"]]), ("gemm_leading", "abc")])
def test_a_workload_op_not_as_extract_writes_it_is_refused_naming_the_field(measured, field, value):
    op = next(op for row in measured["rows"] for op in row_ops(row) if op and op.get("gemm_mkn"))
    with pytest.raises(UserError, match=f"row 7: op field '({field}|shapes or dtypes)'"):
        op_from_json({**op, field: value}, 7)


def test_a_fit_to_a_trace_recovers_the_gpu_model_that_made_its_times(measured):
    """Oracle: a known model. Every tied op's time is set to what h100-sxm's model with its tensor
    GEMMs 25 % slower and memory 20 % slower says; the fit from h100-sxm's own parameters must find
    times within 3 % (median) of those, where it starts 25 % off on GEMMs."""
    base = devices.load("h100-sxm")
    model = base.gpu_model()
    truth = with_model(base, replace(model, gemm_tensor_efficiency=model.gemm_tensor_efficiency / 1.25,
                                     memory_efficiency=model.memory_efficiency / 1.2))
    synthetic = json.loads(json.dumps(measured))
    for row in synthetic["rows"]:
        for op in row_ops(row):
            if op and op.get("measured_ns"):
                op["measured_ns"] = op_estimate_ns(op_from_json(op, 0), truth)
    fitted, report = fitted_from_trace(synthetic, base, "synthetic", "synthetic.json")
    assert report["before_pct"]["gemm"] > 15
    assert all(error < 3 for error in median_abs_pct(trace_samples(synthetic), fitted).values())


def test_calibrate_from_a_gpu_trace_refits_the_gpu_model(estimated, tmp_path, monkeypatch):
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    result = in_process("calibrate", "--from", TRACE, "--estimated", estimated, "--name", "my-h100-trace")
    assert result.returncode == 0, result.stderr
    assert "gemm" in result.stdout and "held out" in result.stdout
    profile = devices.load("my-h100-trace")
    assert profile.sm_count == 132 and profile.gpu_model() != devices.load("h100-sxm").gpu_model()


def test_a_gpu_trace_against_a_cpu_estimate_needs_like(measured, tmp_path, monkeypatch):
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    cpu_estimate = tmp_path / "cpu"
    in_process("extract", "gpt2", "--batch", 8, "--seq", 1024, "--dtype", "bf16", "--device", "a100-80gb",
               "--out", cpu_estimate)
    document = json.loads((cpu_estimate / "workload.json").read_text())
    document["settings"]["device"] = "cpu-like"
    (cpu_estimate / "workload.json").write_text(json.dumps(document))
    result = in_process("calibrate", "--from", TRACE, "--estimated", cpu_estimate, "--name", "x")
    assert result.returncode == 2 and "give --like PROFILE" in result.stderr and result.stderr.count("\n") == 1
