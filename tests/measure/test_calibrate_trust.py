"""Measurements that know when they are noise (issue 28 §1): calibrate's checks, profile's sum of ops."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxworkload.cost import devices
from fxworkload.errors import UserError
from fxworkload.formats.tables import sum_of_ops_warning
from fxworkload.measure import calibrate

from ..test_cli import in_process


def _profile(**changes):
    base = devices.read(calibrate.Path(__file__).resolve().parents[1] / "fixtures" / "cpu_profile.json")
    return replace(base, **changes)


def test_a_measured_profile_of_a_quiet_machine_passes_its_checks():
    assert calibrate.curve_problems(_profile()) == []


def test_a_bandwidth_curve_no_cache_makes_is_named():
    """The issue's run: 0.049 GB/s at 786 KB beside 321 GB/s at 196 KB."""
    curve = [[196608.0, 321e9], [786432.0, 0.049e9], [3145728.0, 160e9]]
    problems = calibrate.curve_problems(_profile(memory_bytes_per_s_by_bytes=curve))
    assert problems and "0.049 GB/s at 768 KiB" in problems[0]


def test_an_add_rate_the_bandwidth_cannot_explain_is_named():
    """The issue's run: add at 0.066 GFLOP/s. 1 FLOP per 12 bytes at the curve's bandwidth for 12 MiB."""
    profile = _profile()
    bandwidth = min(profile.memory_bytes_per_s_by_bytes, key=lambda p: abs(p[0] - 12 * calibrate.VECTOR_ELEMENTS))[1]
    slow = dict(profile.vector_flops_per_s_by_op, add=0.066e9)
    problems = calibrate.curve_problems(replace(profile, vector_flops_per_s_by_op=slow))
    assert problems and f"gives {bandwidth / 12 / 1e9:.3g}" in problems[-1]


def test_a_busy_machine_is_refused_with_its_reasons_and_nothing_saved(monkeypatch, tmp_path):
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "measure", lambda on, name, progress: _profile(name=name))
    # before (the machine its own), after (half the CPU, the GEMM 30 % slower): the measurement ran, then failed
    readings = iter([(1_000_000.0, 5_000.0, 1.0), (1_300_000.0, 5_100.0, 0.5)])
    monkeypatch.setattr(calibrate, "_reference", lambda clock: next(readings))
    run = in_process("calibrate")
    assert run.returncode == 1 and "not to be trusted, so no profile was saved" in run.stderr
    assert "got 50% of the CPU" in run.stderr and "(+30%)" in run.stderr and "--force" in run.stderr
    assert not devices.measured_path("cpu").exists()
    readings = iter([(1_000_000.0, 5_000.0, 0.5), (1_300_000.0, 5_100.0, 0.5)])  # shared from the start: --force
    run = in_process("calibrate", "--force")
    assert run.returncode == 0 and devices.measured_path("cpu").exists() and "warning (saved with --force)" in run.stderr


def test_a_fit_from_a_trace_outside_any_machines_overhead_is_refused():
    small = [{"kind": "pointwise", "op": "aten.add.Tensor", "bytes": 4096, "flops": 1024, "measured_ns": 7.9e6}] * 5
    gemm = {"kind": "matmul", "op": "aten.mm.default", "bytes": 1 << 20, "flops": 1 << 30, "measured_ns": 1e6,
            "input_dtypes": ["torch.float32"]}
    measured = {"settings": {"device": "CPU"}, "rows": [{"forward": op, "input_grad": [], "weight_grad": []}
                                                        for op in [*small, gemm]]}
    with pytest.raises(UserError, match=r"small ops take 7,900.0 us each, outside any machine's per-op overhead"):
        calibrate.fit_from_measured(measured, "x", "trace.json")


@pytest.mark.parametrize("ops_ms, eager_ms, warns", [(300, 100, True), (100, 300, True), (110, 100, False)])
def test_profile_warns_when_its_ops_and_the_eager_step_disagree(ops_ms, eager_ms, warns):
    totals = {"step_measured_ns": ops_ms * 1e6, "eager_step_ns": eager_ms * 1e6}
    assert (sum_of_ops_warning(totals) is not None) == warns
    assert sum_of_ops_warning({**totals, "kernel_check": {}}) is None  # a profiler's kernels: no such check


def test_calibrate_on_a_shared_cpu_refuses_before_measuring(monkeypatch):
    """Issue 40: calibrate worked 238 s on a busy machine before refusing. When the first reference GEMM (a
    second in) already got less than MIN_CPU_SHARE of the CPU, it refuses then, without the measurement."""
    monkeypatch.setattr(calibrate, "_reference", lambda clock: (1e6, 1e3, 0.4))
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("measured on a shared CPU"))
    run = in_process("calibrate")
    assert run.returncode != 0 and "got 40% of the CPU" in run.stderr and "before measuring" in run.stderr
    assert "--force" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    profile, problems = calibrate.measure_checked("cpu", "cpu", refuse_early=True)
    assert profile is None and problems
