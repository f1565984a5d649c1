"""Stragglers (cluster/stragglers.py): the step at the pace of the slowest of the job's GPUs."""

from __future__ import annotations

import json
import math
import random

import pytest

from fxworkload.cluster.stragglers import expected_max_standard_normal, slowest_step_ns

from ..test_cli import fxworkload


@pytest.mark.parametrize("n, expected", [
    (2, 1 / math.sqrt(math.pi)),  # closed forms: E[max of 2] = 1/sqrt(pi), of 3 = 3 / (2 sqrt(pi))
    (3, 3 / (2 * math.sqrt(math.pi))),
    (5, 1.16296), (10, 1.53875), (100, 2.50759),  # Tippett (1925), Biometrika 17: expected largest of n normals
])
def test_the_expected_slowest_of_n_is_the_published_order_statistic(n, expected):
    assert expected_max_standard_normal(n) == pytest.approx(expected, abs=2e-5)
    assert expected_max_standard_normal(1) == 0.0


def test_the_slowest_gpu_sets_the_step_as_a_hand_built_timeline_of_64_ranks_says():
    """Oracle: 64 ranks, each computing 10 ms x (1 + 0.05 z), z a standard normal fixed per GPU, then a 2 ms
    gradient all-reduce all of them join: the step is the slowest rank's compute plus the all-reduce.
    Averaged over 4,000 seeded draws of the cluster, it matches the formula within 0.2 %."""
    draws = random.Random(0)
    trials = [max(10e6 * (1 + 0.05 * draws.gauss(0, 1)) for _ in range(64)) + 2e6 for _ in range(4000)]
    simulated = sum(trials) / len(trials)
    assert slowest_step_ns(12e6, {"dp": 2e6}, 64, 0.05) == pytest.approx(simulated, rel=2e-3)
    assert slowest_step_ns(12e6, {"dp": 2e6}, 64, 0.0) == 12e6  # alike GPUs: the mean rank's step


def test_extract_reports_the_slowest_gpus_step_beside_the_mean_ranks(tiny_dirs, tmp_path):
    run = fxworkload("extract", tiny_dirs["gpt2"], "--seq", 16, "--dp", 8, "--device", "h100-sxm",
                     "--topology", "gpu-spread=0.04", "--out", tmp_path / "o")
    assert run.returncode == 0, run.stderr
    assert "slowest of the 8 GPUs (GPU speeds spread 4 %)" in run.stdout
    cluster = json.loads((tmp_path / "o" / "workload.json").read_text())["cluster"]
    exposed = sum(cluster["exposed_ns"].get(k, 0.0) for k in ("tp", "cp", "ep", "dp", "zero_gather", "zero3_gather"))
    by_hand = cluster["step_ns"] + (cluster["step_ns"] - exposed) * 0.04 * 1.42360
    assert cluster["slowest_gpu_step_ns"] == pytest.approx(by_hand, rel=1e-4)
    bad = fxworkload("extract", tiny_dirs["gpt2"], "--seq", 16, "--dp", 8, "--device", "h100-sxm",
                     "--topology", "gpu-spread=0.7", "--out", tmp_path / "bad")
    assert bad.returncode == 2 and "gpu_speed_spread" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
