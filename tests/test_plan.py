"""fxworkload plan: the layouts it considers, its ranking against the cluster step, Ray, bad input."""

from __future__ import annotations

import json

import pytest

from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract
from fxworkload.plan import Shape, candidate_layouts, evaluate_shape, plan

from .conftest import tiny_config
from .test_cli import fxworkload


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama4")
    tiny_config("llama", num_hidden_layers=4).save_pretrained(folder)
    return str(folder)


def test_every_layout_divides_the_gpus_and_the_batch(four_layers):
    from fxworkload.plan import _facts

    facts = _facts(four_layers, "bf16")
    groups, dropped = candidate_layouts(8, 16, facts, 8)
    layouts = [p for group in groups.values() for p in group]
    assert layouts and all(p.world == 8 for p in layouts)
    for shape, group in groups.items():
        for p in group:
            assert shape.micro_batch * p.micro_batches * p.dp == 16
            assert facts.heads % p.tp == 0 and facts.layers % (p.pp * p.vpp) == 0 and p.sp == (p.tp > 1)
    # tiny Llama: 4 heads, 2 kv heads -> tp 1 or 2; 4 layers -> pp 1, 2, 4
    assert {p.tp for p in layouts} == {1, 2} and {p.pp for p in layouts} == {1, 2, 4}
    assert dropped["tp does not divide the heads or exceeds a node"] > 0


def test_a_shapes_rows_are_the_cluster_step_of_each_layout(four_layers):
    layouts = [Parallel(tp=2, sp=True, pp=2, dp=2, micro_batches=4, zero=z) for z in (0, 1)]
    rows = evaluate_shape(four_layers, Shape(2, 1, 1), layouts, 16, "bf16", "h100-sxm")
    for row, p in zip(rows, layouts):
        result = extract(four_layers, batch=1, seq=16, dtype="bf16", device="h100-sxm", parallel=p)
        assert row["step_ms"] == pytest.approx(result.cluster.step_ns / 1e6)
        assert row["mfu"] == pytest.approx(result.cluster.mfu)
        assert row["peak_bytes"] == max(
            extract(four_layers, batch=1, seq=16, dtype="bf16", device="h100-sxm",
                    parallel=Parallel(**{**vars(p), "stage": s})).memory.total_peak_bytes for s in (0, 1))


def test_plan_ranks_by_step_time_and_keeps_what_fits(four_layers):
    result = plan(four_layers, gpus=4, global_batch=8, seq=16, workers=1)
    ranked = result["ranked"]
    assert ranked and all(r["fits"] for r in ranked)
    assert [r["step_ms"] for r in ranked] == sorted(r["step_ms"] for r in ranked)
    assert result["evaluated"] == len(ranked) + result["dropped"]["does not fit in memory"]


def test_plan_cli_writes_its_table(four_layers, tmp_path):
    run = fxworkload("plan", four_layers, "--gpus", 4, "--global-batch", 8, "--seq", 16, "--workers", 1,
                     "--out", tmp_path / "plan", "--top", 3)
    assert run.returncode == 0, run.stderr
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert document["ranked"][0]["step_ms"] == min(r["step_ms"] for r in document["ranked"])
    assert "step_ms" in run.stdout and (tmp_path / "plan" / "plan.txt").read_text() in run.stdout


def test_plan_on_a_local_ray_cluster(four_layers):
    import ray  # the 'ray' extra; make test installs it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        local = plan(four_layers, gpus=2, global_batch=4, seq=16, workers=1)
        spread = plan(four_layers, gpus=2, global_batch=4, seq=16, ray="auto")
    finally:
        ray.shutdown()
    assert spread["ranked"] == local["ranked"]


@pytest.mark.parametrize("args, says", [
    (["--gpus", "7", "--global-batch", "8"], "no layout of 7 GPUs"),
    (["--gpus", "16", "--global-batch", "3"], "no layout of 16 GPUs"),
    (["--gpus", "0", "--global-batch", "8"], "must be positive"),
    (["--gpus", "4", "--global-batch", "8", "--ray", "127.0.0.1:1"], "cannot reach a Ray cluster"),
    (["--gpus", "4", "--global-batch", "8", "--device", "no-network"], "lacks interconnect or memory figures"),
])
def test_bad_plans_are_one_line(four_layers, tmp_path, args, says):
    from dataclasses import replace

    from fxworkload.cost import devices

    devices.save(replace(devices.load("h100-sxm"), name="no-network", inter_node_bytes_per_s=0.0),
                 devices.measured_path("no-network"))
    run = fxworkload("plan", four_layers, "--seq", 16, *args, "--out", tmp_path / "never")
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()
