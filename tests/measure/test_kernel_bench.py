"""calibrate --on cuda's two halves without a GPU: the kernel benchmarks write the shared data's CSV
format (run here on the CPU), and the fit recovers the GPU model from measured H100 kernel times."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fxworkload.cost import devices
from fxworkload.errors import UserError
from fxworkload.measure import kernel_bench, kernels

from ..test_cli import fxworkload

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_the_benchmarks_write_what_the_fit_reads(tmp_path):
    gemm = [("bf16", 8, 16, 24, "NT"), ("fp32", 8, 16, 24, "TN"), ("bf16", 7, 16, 24, "NN")]
    sdpa = [("fp32", 1, 2, 1, 16, 8, True, 0.0, "bool_causal"), ("bf16", 1, 2, 2, 16, 8, True, 0.1, "none"),
            ("fp32", 1, 3, 2, 16, 8, True, 0.0, "none")]  # 3 heads over 2 kv heads: no kernel takes it
    vector = [(op, "bf16", 4, 32) for op in kernels.VECTOR_OPS]
    files = kernel_bench.measure(torch.device("cpu"), gemm, sdpa, vector)
    folder = kernel_bench.write(tmp_path / "k", files)
    for name, header in (("gemm.csv", kernel_bench.GEMM_HEADER), ("sdpa.csv", kernel_bench.SDPA_HEADER),
                         ("vector.csv", kernel_bench.VECTOR_HEADER)):
        with open(folder / name, newline="") as f:
            assert tuple(csv.DictReader(f).fieldnames) == header
    rows = kernels.read_rows(folder / "sdpa.csv")
    assert rows[2]["fwd_kernels"].startswith("error:") and all(float(r["fwd_us"]) > 0 for r in rows[:2])
    assert rows[0]["mask"] == "bool_causal" and rows[1]["dropout"] == "0.1"
    measured = kernels.samples(folder, kernels.target_of(devices.load("h100-sxm")))
    families = [s.family for s in measured]
    assert families.count("gemm") == 3 and families.count("sdpa") == 4 and families.count("vector") == len(vector)
    gemm_rows = kernels.read_rows(folder / "gemm.csv")
    assert [(r["dtype"], int(r["m"]), int(r["k"]), int(r["n"]), r["layout"]) for r in gemm_rows] == gemm
    assert all(float(r["us"]) > 0 for r in gemm_rows)
    first = gemm_rows[0]
    assert float(first["tflops"]) == pytest.approx(2 * 8 * 16 * 24 / float(first["us"]) / 1e6, rel=0.01)


def test_the_default_cases_cover_every_class_the_model_is_judged_on():
    gemm, sdpa = kernel_bench.gemm_shapes(), kernel_bench.sdpa_configs()
    assert {layout for *_, layout in gemm} == {"NT", "NN", "TN"} and {d for d, *_ in gemm} == {"bf16", "fp32"}
    assert any(n % 8 for *_, n, _ in gemm) and any(n % 64 == 0 and n > 32000 for *_, n, _ in gemm)
    assert {mask for *_, mask in sdpa} == {"none", "bool_causal", "sliding4096"}
    assert {c[7] for c in sdpa} == {0.0, 0.1} and any(c[2] != c[3] for c in sdpa)
    assert {op for op, *_ in kernel_bench.vector_cases()} == set(kernels.VECTOR_OPS)


def _gemm_folder(tmp_path) -> Path:
    """Every 5th 16-bit GEMM measured on an H100 (tests/fixtures), and no SDPA or vector rows."""
    folder = tmp_path / "h100"
    folder.mkdir()
    with open(FIXTURES / "h100_gemm_kernels.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["dtype"] != "fp32"][::5]
    (folder / "gemm.csv").write_text(kernel_bench.csv_text(("dtype", "m", "k", "n", "layout", "us"),
                                                           [{k: r[k] for k in ("dtype", "m", "k", "n", "layout", "us")}
                                                            for r in rows]))
    (folder / "sdpa.csv").write_text(",".join(kernel_bench.SDPA_HEADER) + "\n")
    (folder / "vector.csv").write_text(",".join(kernel_bench.VECTOR_HEADER) + "\n")
    return folder


def test_the_fit_recovers_the_gemm_model_from_measured_kernels(tmp_path):
    """Oracle: the measured H100 GEMM times. Start from parameters knocked far off: the fit must
    bring the error back down, on the rows it saw and on those it did not."""
    h100 = devices.load("h100-sxm")
    model = h100.gpu_model()
    wrong = replace(model, gemm_tensor_efficiency=model.gemm_tensor_efficiency * 0.5,
                    gemm_align1_efficiency=model.gemm_align1_efficiency * 2.0, gemm_kernel_ns=model.gemm_kernel_ns * 3)
    base = kernels.with_model(h100, wrong)
    profile, report = kernels.fitted_profile(_gemm_folder(tmp_path), base, "my-h100", "an H100")
    assert report["rows"]["gemm"] > 150 and report["before_pct"]["gemm"] > 30
    assert report["after_pct"]["gemm"] <= 10 and report["held_out_pct"]["gemm"] <= 12
    assert profile.sm_count == h100.sm_count and profile.matmul_flops_per_s == h100.matmul_flops_per_s
    assert "fitted by 'fxworkload calibrate'" in profile.sources["gpu_model_parameters"]


def test_calibrate_kernels_saves_a_profile_extract_can_use(tmp_path, tiny_dirs):
    folder = _gemm_folder(tmp_path)
    run = fxworkload("calibrate", "--kernels", folder, "--name", "fitted-h100")
    assert run.returncode == 2 and "--kernels needs --like" in run.stderr
    run = fxworkload("calibrate", "--kernels", folder, "--like", "h100-sxm", "--name", "fitted-h100")
    assert run.returncode == 0, run.stderr
    assert "gemm" in run.stdout and "held out" in run.stdout and "--device fitted-h100" in run.stdout
    saved = devices.read(devices.measured_path("fitted-h100"))
    assert saved.sm_count == 132 and saved.gpu_model_parameters and not saved.gpu_model_fit
    run = fxworkload("extract", str(tiny_dirs["gpt2"]), "--seq", "8", "--device", "fitted-h100",
                     "--out", tmp_path / "x")
    assert run.returncode == 0, run.stderr


def test_calibrate_with_a_missing_kernel_file_or_column_is_one_line(tmp_path):
    folder = _gemm_folder(tmp_path)
    (folder / "vector.csv").unlink()
    run = fxworkload("calibrate", "--kernels", folder, "--like", "h100-sxm", "--name", "x2")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "no vector.csv" in run.stderr
    (folder / "vector.csv").write_text("op,dtype,rows,us\n")
    run = fxworkload("calibrate", "--kernels", folder, "--like", "h100-sxm", "--name", "x2")
    assert run.returncode == 2 and "missing column 'cols'" in run.stderr
    run = fxworkload("calibrate", "--kernels", folder, "--like", "cpu", "--name", "x2")
    assert run.returncode == 2 and run.stderr.count("\n") == 1


def test_a_gpu_name_finds_its_datasheet_profile():
    assert devices.matching_gpu("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert devices.matching_gpu("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert devices.matching_gpu("NVIDIA H200") == "h200"
    assert devices.matching_gpu("NVIDIA H100 PCIe") == "h100-pcie"
    assert devices.matching_gpu("NVIDIA H100 NVL") == "h100-nvl"
    assert devices.matching_gpu("NVIDIA L40S") == "l40s" and devices.matching_gpu("NVIDIA L4") == "l4"
    # the names torch reports on the GPUs of NeuSight's data (its CSVs' Device column), each to its own profile
    assert devices.matching_gpu("Tesla T4") == "t4" and devices.matching_gpu("Tesla P4") == "p4"
    assert devices.matching_gpu("Tesla V100-PCIE-32GB") == "v100-pcie"
    assert devices.matching_gpu("NVIDIA A100 80GB PCIe") == "a100-pcie-80gb"
    assert devices.matching_gpu("NVIDIA A100-PCIE-40GB") == "a100-pcie-40gb"
    assert devices.matching_gpu("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert devices.matching_gpu("AMD Instinct MI210") == "mi210"
    assert devices.matching_gpu("NVIDIA B200") == "b200" and devices.matching_gpu("NVIDIA GB200") == "gb200"
    assert devices.matching_gpu("NVIDIA RTX A6000") is None


def test_calibrate_on_cuda_without_a_gpu_is_one_line():
    with pytest.raises(UserError):
        from fxworkload.measure.timing import device_for
        device_for("cuda")
    run = fxworkload("calibrate", "--on", "cuda", "--name", "my-h100")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--on cuda" in run.stderr


def _folder_of(path: Path, rows: list[dict], add_us: float) -> Path:
    path.mkdir(parents=True)
    columns = ("dtype", "m", "k", "n", "layout")
    (path / "gemm.csv").write_text(kernel_bench.csv_text(
        (*columns, "us"), [{**{k: r[k] for k in columns}, "us": f"{float(r['us']) + add_us:.3f}"} for r in rows]))
    (path / "sdpa.csv").write_text(",".join(kernel_bench.SDPA_HEADER) + "\n")
    (path / "vector.csv").write_text(",".join(kernel_bench.VECTOR_HEADER) + "\n")
    return path


def test_rows_timed_one_call_alone_are_fitted_without_charging_their_launch_gap_to_every_kernel(tmp_path):
    """Oracle: the H100's measured 16-bit GEMMs of 60 us or more (kernel-bound, tests/fixtures), and the same
    rows with a 30 us launch gap added, as a call timed alone between two events would hold it. Fitted as
    isolated calls, the gap comes back (30 +- 3 us), the fixed costs per kernel stay the H100 fit's, and the
    profile predicts the kernels without the gap as well as the H100 fit does (within 8 %); fitted as
    back-to-back calls, the gap is soaked into each GEMM's fixed cost, which a step would pay per kernel."""
    with open(FIXTURES / "h100_gemm_kernels.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["dtype"] != "fp32" and float(r["us"]) >= 60][::4]
    h100 = devices.load("h100-sxm")
    in_step = kernels.samples(_folder_of(tmp_path / "in-step", rows, 0.0), kernels.target_of(h100))
    alone = _folder_of(tmp_path / "alone", rows, 30.0)
    isolated, report = kernels.fitted_profile(alone, h100, "alone", "an H100", timing="isolated")
    assert report["launch_gap_ns"] == pytest.approx(30e3, abs=3e3)
    assert isolated.gpu_model().gemm_kernel_ns == h100.gpu_model().gemm_kernel_ns
    assert kernels.median_abs_pct(in_step, isolated)["gemm"] <= 8
    soaked, _ = kernels.fitted_profile(alone, h100, "soaked", "an H100")
    assert soaked.gpu_model().gemm_kernel_ns > 2 * h100.gpu_model().gemm_kernel_ns
    assert kernels.median_abs_pct(in_step, soaked)["gemm"] > kernels.median_abs_pct(in_step, isolated)["gemm"]
    with pytest.raises(UserError, match="unknown --timing"):
        kernels.fitted_profile(alone, h100, "x", "x", timing="sometimes")


def test_timing_without_kernels_is_one_line(tmp_path):
    run = fxworkload("calibrate", "--timing", "isolated", "--name", "x")
    assert run.returncode == 2 and "give --kernels DIR with it" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
