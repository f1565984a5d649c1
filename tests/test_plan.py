"""fxworkload plan: the layouts it considers, its ranking against the cluster step, Ray, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxworkload.cost.system import System
from fxworkload.limits import cores
from fxworkload.parallel.execution import Execution
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract
from fxworkload.plan import Run, Shape, candidate_layouts, evaluate_shape, plan

from .conftest import tiny_config
from .test_cli import fxworkload, in_process

BF16_16, H100 = Execution(seq=16, dtype="bf16"), System("h100-sxm")  # evaluate_shape's run and system

@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama4")
    tiny_config("llama", num_hidden_layers=4).save_pretrained(folder)
    return str(folder)


# what tells one plan row's layout from another's on one device
LAYOUT_FIELDS = ("tp", "pp", "dp", "zero", "recompute", "micro_batch", "vpp", "reshard_after_forward",
                 "accumulate_unsharded")


def test_every_layout_divides_the_gpus_and_the_batch(four_layers):
    from fxworkload.plan import _facts

    facts = _facts(four_layers, "bf16")
    groups, dropped = candidate_layouts(Run(four_layers, gpus=8, global_batch=16), facts, 8)
    layouts = [p for group in groups.values() for p in group]
    assert layouts and all(p.world == 8 for p in layouts)
    for shape, group in groups.items():
        for p in group:
            assert shape.micro_batch * p.micro_batches * p.dp == 16
            assert facts.heads % p.tp == 0 and facts.layers % (p.pp * p.vpp) == 0 and p.sp == (p.tp > 1)
    # tiny Llama: 4 heads, 2 kv heads -> tp 1 or 2; 4 layers -> pp 1, 2, 4
    assert {p.tp for p in layouts} == {1, 2} and {p.pp for p in layouts} == {1, 2, 4}
    assert dropped["tp does not divide the heads or exceeds a node"] > 0


@pytest.mark.parametrize("cp", [1, 2])
def test_a_shapes_rows_are_the_cluster_step_of_each_layout(four_layers, cp):
    """Each row against its own extract (nothing shared): what the search computes once for many layouts
    (passes, buckets, schedules, one step for ZeRO 1 and 2) gives each layout's own figures."""
    layouts = [Parallel(tp=2, sp=True, pp=2, dp=2, cp=cp, micro_batches=4, zero=z) for z in (0, 1, 2, 3)]
    rows = evaluate_shape(four_layers, Shape(2, 1, 1, cp), layouts, BF16_16, H100)
    for row, p in zip(rows, layouts):
        result = extract(four_layers, batch=1, seq=16, dtype="bf16", device="h100-sxm", parallel=p)
        assert row["step_ms"] == pytest.approx(result.cluster.step_ns / 1e6)
        assert row["mfu"] == pytest.approx(result.cluster.mfu)
        assert row["peak_bytes"] == max(
            extract(four_layers, batch=1, seq=16, dtype="bf16", device="h100-sxm",
                    parallel=Parallel(**{**vars(p), "stage": s})).memory.total_peak_bytes for s in (0, 1))


def test_fsdp2_options_are_the_ones_fsdp2_accepts():
    """By hand, from FSDP2's rules (torch/distributed/fsdp/_fully_shard/_fsdp_init.py _get_post_forward_mesh_info:
    an int reshard_after_forward divides the shard mesh, and DTensor parameters refuse it): ZeRO 3 on 16 ranks, tp 1,
    4 micro-batches, 8-GPU domains tries freed, kept and 8-rank shards, each with and without summed gradients; tp 2,
    a group no wider than a domain, or one micro-batch drop what each rules out; ZeRO 0-2 has none of them."""
    from fxworkload.plan import fsdp2_options

    assert fsdp2_options(3, 16, 1, 1, 4, 8) == [(True, False), (True, True), (False, False), (False, True),
                                                (8, False), (8, True)]
    assert fsdp2_options(3, 16, 2, 1, 4, 8) == [(True, False), (True, True), (False, False), (False, True)]
    assert fsdp2_options(3, 16, 1, 2, 1, 8) == [(True, False), (False, False)]
    assert fsdp2_options(3, 8, 1, 1, 1, 8) == [(True, False), (False, False)]
    assert fsdp2_options(3, 12, 1, 1, 1, 8) == [(True, False), (False, False)]  # 8 does not divide 12
    assert all(fsdp2_options(zero, 16, 1, 1, 4, 8) == [(True, False)] for zero in (0, 1, 2))


def test_a_shapes_fsdp2_rows_are_each_layouts_own_extract(four_layers):
    """The search's FSDP2 variants (kept parameters, 2-rank post-forward shards, gradients summed unsharded), each
    row against its own extract with that Parallel: nothing the search shares between the variants leaks."""
    layouts = [Parallel(dp=4, pp=2, micro_batches=4, zero=3, reshard_after_forward=reshard, accumulate_unsharded=summed)
               for reshard in (True, False, 2) for summed in (False, True)]
    rows = evaluate_shape(four_layers, Shape(1, 1, 1), layouts, BF16_16, H100)
    steps = {row["step_ms"] for row in rows}
    assert len(steps) > 1  # the variants do differ
    for row, p in zip(rows, layouts):
        assert (row["reshard_after_forward"], row["accumulate_unsharded"]) == (p.reshard_after_forward,
                                                                               p.accumulate_unsharded)
        result = extract(four_layers, batch=1, seq=16, dtype="bf16", device="h100-sxm", parallel=p)
        assert row["step_ms"] == pytest.approx(result.cluster.step_ns / 1e6)
        assert row["peak_bytes"] == max(
            extract(four_layers, batch=1, seq=16, dtype="bf16", device="h100-sxm",
                    parallel=Parallel(**{**vars(p), "stage": s})).memory.total_peak_bytes for s in (0, 1))


def test_devices_holding_alike_layers_share_their_figures(tmp_path):
    """Eight Llama layers on four stages: the fast path's first and last layers differ from the six middle
    ones, so devices 1 and 2 (layers 2-3 and 4-5) are alike and the search (alike=True) times device 2
    with device 1's units; every row still equals its own extract, where each device has its own."""
    from fxworkload.cluster.step import _alike_devices

    tiny_config("llama", num_hidden_layers=8).save_pretrained(tmp_path)
    model = str(tmp_path)
    layouts = [Parallel(tp=2, sp=True, pp=4, dp=1, micro_batches=8, zero=zero, vpp=vpp)
               for zero in (0, 3) for vpp in (1, 2)]
    rows = evaluate_shape(model, Shape(2, 1, 1), layouts, BF16_16, H100)
    base = extract(model, batch=1, seq=16, dtype="bf16", device="h100-sxm", rank_view=False,
                   parallel=Parallel(tp=2, sp=True))
    assert _alike_devices(base.facts, base.workload, base.workload, layouts[0]) == [0, 1, 1, 3]
    for row, p in zip(rows, layouts):
        result = extract(model, batch=1, seq=16, dtype="bf16", device="h100-sxm", parallel=p)
        assert row["step_ms"] == pytest.approx(result.cluster.step_ns / 1e6, rel=1e-12)
        assert row["bubble"] == pytest.approx(result.cluster.bubble_fraction, rel=1e-12)


def test_a_layout_that_does_not_fit_is_not_timed():
    """Llama 3 70B on 64 H100s (80 GB): ZeRO 0 keeps every weight's 2 + 2 + 12 bytes (over 1 TB) on each
    GPU, ZeRO 3 a 64th (17.6 GB). A plan (time_unfit=False) leaves the first's step figures empty and gives
    the second the same row as timing every layout does."""
    from fxworkload.plan import STEP_FIGURES

    layouts = [Parallel(dp=64, micro_batches=1, zero=zero) for zero in (0, 3)]
    timed = evaluate_shape("llama-3-70b", Shape(1, 1, 1), layouts, BF16_16, H100)
    untimed = evaluate_shape("llama-3-70b", Shape(1, 1, 1), layouts, BF16_16, H100, time_unfit=False)
    assert [row["fits"] for row in timed] == [False, True]
    assert timed[0]["peak_bytes"] > 70e9 * 16 and timed[0]["step_ms"] > 0
    assert untimed[0] == timed[0] | dict.fromkeys(STEP_FIGURES) and untimed[1] == timed[1]


def test_plan_ranks_by_step_time_and_keeps_what_fits(four_layers):
    result = plan(four_layers, gpus=4, global_batch=8, seq=16, workers=1)
    ranked = result["ranked"]
    assert ranked and all(r["fits"] for r in ranked)
    times = [r["step_ms"] for r in ranked]  # ascending; within a microsecond, memory decides (rank_key)
    assert all(later >= earlier - 1e-3 for earlier, later in zip(times, times[1:]))
    assert all(a["peak_bytes"] <= b["peak_bytes"] for a, b in zip(ranked, ranked[1:])
               if round(a["step_ms"], 3) == round(b["step_ms"], 3))
    assert result["evaluated"] == len(ranked) + result["dropped"]["does not fit in memory"]
    best = ranked[0]
    for row in ranked:  # each row's 90 % interval brackets its step; marked where it reaches the best's
        assert row["step_low_ms"] <= row["step_ms"] <= row["step_high_ms"]
        assert row["overlaps_best"] == (row["step_low_ms"] <= best["step_high_ms"])


def test_plan_cli_writes_its_table(four_layers, tmp_path):
    run = fxworkload("plan", four_layers, "--gpus", 4, "--global-batch", 8, "--seq", 16, "--workers", 1,
                     "--out", tmp_path / "plan", "--top", 3)
    assert run.returncode == 0, run.stderr
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert document["ranked"][0]["step_ms"] <= min(r["step_ms"] for r in document["ranked"]) + 1e-3  # ties: rank_key
    assert "step_ms" in run.stdout and (tmp_path / "plan" / "plan.txt").read_text() in run.stdout


def _start_ray(ray) -> None:
    """A local Ray cluster, given the time a busy machine needs: Ray's own startup deadline is a fixed 30 s
    (ray/_private/node.py, raylet_start_wait_time_s), so it is tried again while a budget that grows with
    the machine's load lasts; a skip says why only when Ray could not start in all that time."""
    budget_s = 120 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    started, tries = time.monotonic(), 0
    while True:
        tries += 1
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            return
        except Exception as exc:  # Ray raises a bare Exception when its raylet misses the deadline
            ray.shutdown()
            if time.monotonic() - started > budget_s or tries >= 6:
                pytest.skip(f"Ray could not start a local cluster here in {tries} tries over "
                            f"{time.monotonic() - started:.0f} s (load {os.getloadavg()[0]:.1f}): {exc}")


def test_plan_on_a_local_ray_cluster(four_layers):
    import ray  # the 'ray' extra; make test installs it
    _start_ray(ray)
    try:
        local = plan(four_layers, gpus=2, global_batch=4, seq=16, workers=1)
        spread = plan(four_layers, gpus=2, global_batch=4, seq=16, ray="auto")
    finally:
        ray.shutdown()
    assert spread["ranked"] == local["ranked"]


@pytest.mark.parametrize("args, says", [
    (["--gpus", "7", "--global-batch", "8"], "no layout of 7 GPUs"),
    (["--gpus", "16", "--global-batch", "3"], "no layout of 16 GPUs"),
    (["--gpus", "0", "--global-batch", "8"], "--gpus must be a positive integer, got 0"),
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


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of a session: a dead worker waits as a zombie for init to reap it."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid and "\nState:\tZ" not in Path(f"/proc/{entry}/status").read_text():
                alive.append(int(entry))
        except OSError:
            pass
    return alive


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_stopping_plan_stops_its_workers_and_frees_the_callers_pipes(tmp_path, sig):
    """Whatever stops plan (SIGTERM, Ctrl-C and SIGHUP handled, SIGKILL not), no process of the run survives it
    and a `| tee` or `$(...)` reading its output sees the end at once."""
    env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
    workers = min(2, cores())  # a plan runs at most a worker a core
    run = subprocess.Popen([sys.executable, "-m", "fxworkload", "plan", "llama-3-8b", "--gpus", "64", "--global-batch",
                            "64", "--seq", "512", "--workers", str(workers), "--out", str(tmp_path / "plan")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(_session(run.pid)) < workers + 2 and time.monotonic() < deadline:  # the plan, workers, a tracker
            time.sleep(0.1)
        assert len(_session(run.pid)) >= workers + 2, "the plan's workers never started"
        time.sleep(1)  # the workers are capturing
        os.kill(run.pid, sig)
        out, err = run.communicate(timeout=30)  # both pipes closed: every writer is gone
        expected = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGHUP: 129, signal.SIGKILL: -signal.SIGKILL}[sig]
        assert run.returncode == expected, err
        if sig != signal.SIGKILL:
            assert err.decode().strip().splitlines()[-1] == {signal.SIGTERM: "fxworkload: terminated", signal.SIGINT:
                                                             "fxworkload: interrupted", signal.SIGHUP: "fxworkload: hung up"}[sig]
        assert b"Traceback" not in err and b"Warning" not in err, err
        # the workers notice their caller's death on their own (SIGKILL is not handled): a loaded machine can take
        # seconds to schedule them, so wait as long as their start may take; a survivor still fails the test
        deadline = time.monotonic() + 120
        while _session(run.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session(run.pid) == []
        assert not (tmp_path / "plan").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    finally:
        for pid in _session(run.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("args,message", [
    (["--gpus", str(2 ** 31)], "--gpus 2,147,483,648 exceeds 1,048,576"),
    (["--gpus", str(2 ** 63)], "--gpus 9,223,372,036,854,775,808 exceeds 1,048,576"),
    (["--gpus", "1" + "0" * 30], "exceeds 1,048,576, more than any real run"),
    (["--global-batch", str(10 ** 12)], "--global-batch 1,000,000,000,000 exceeds 4,194,304"),
    (["--global-batch", str(2 ** 63)], "--global-batch 9,223,372,036,854,775,808 exceeds 4,194,304"),
    (["--gpus", "0"], "--gpus must be a positive integer, got 0"),
])
def test_counts_past_any_real_run_are_refused_before_any_work(four_layers, tmp_path, args, message, monkeypatch):
    import fxworkload.capture.trace as capture
    import fxworkload.workload.layers as layers

    def no_capture(*args, **kwargs):
        raise AssertionError("the model was captured before the counts were checked")

    for module in (capture, layers):
        monkeypatch.setattr(module, "capture_training_step", no_capture)
    base = {"--gpus": "8", "--global-batch": "8"}
    base.update(dict(zip(args[::2], args[1::2])))
    run = in_process("plan", four_layers, "--seq", 16, *[x for kv in base.items() for x in kv], "--out", tmp_path / "x")
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_global_batch_needing_more_micro_batches_than_the_limit_drops_those_layouts(four_layers):
    from fxworkload.limits import MAX_MICRO_BATCHES
    from fxworkload.plan import _facts

    groups, dropped = candidate_layouts(Run(four_layers, gpus=2, global_batch=2 * MAX_MICRO_BATCHES * 2),
                                        _facts(four_layers, "bf16"), 8)
    layouts = [p for group in groups.values() for p in group]
    assert layouts and max(p.micro_batches for p in layouts) <= MAX_MICRO_BATCHES
    assert dropped[f"more than {MAX_MICRO_BATCHES:,} micro-batches"] > 0


def test_a_sequence_sp_cannot_split_drops_those_layouts_not_the_plan(four_layers, tmp_path):
    """Issue 28 §6: a sequence length tp does not divide made plan stop on an option the user never gave
    (--sp); the layouts with that tp are dropped, the others ranked."""
    result = plan(four_layers, gpus=2, global_batch=4, seq=15, device="h100-sxm", workers=1)
    assert result["ranked"] and {r["tp"] for r in result["ranked"]} == {1}
    assert result["dropped"]["sequence parallelism: tp does not divide the sequence"] > 0


def test_uneven_stages_are_the_llama3_papers():
    """Dubey et al. 2024, section 3.3.2: 126 layers on 16 stages, one layer fewer on the first and the last."""
    from fxworkload.plan import uneven_stages

    assert uneven_stages(126, 16) == (7, *[8] * 14, 7)
    assert uneven_stages(80, 8) is None  # divides: Megatron's even split
    for layers, pp in ((126, 8), (10, 4), (61, 64 // 2)):
        stages = uneven_stages(layers, pp)
        assert sum(stages) == layers and max(stages) - min(stages) == 1 and stages[0] == stages[-1] == min(stages)


def test_plan_searches_the_context_parallel_degrees(four_layers):
    result = plan(four_layers, gpus=4, global_batch=8, seq=16, workers=1, cp=(1, 2))
    degrees = {r["cp"] for r in result["ranked"]}
    assert degrees == {1, 2} and all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 4 for r in result["ranked"])


def test_a_plan_asked_again_is_read_back_whole(four_layers, tmp_path, monkeypatch):
    """The second run evaluates nothing (every shape's rows from the cache) and returns the same ranking."""
    import fxworkload.plan as planner

    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    first = plan(four_layers, gpus=4, global_batch=8, seq=16, workers=1)

    def never(*args, **kwargs):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(planner, "_evaluate_indexed", never)
    assert plan(four_layers, gpus=4, global_batch=8, seq=16, workers=1) == first


def test_why_the_best_wins_names_the_parts_that_differ():
    from fxworkload.plan import why_best

    parts = {"compute": 100.0, "tp": 10.0, "cp": 0.0, "ep": 0.0, "bubble": 20.0, "dp": 0.0, "zero gathers": 0.0,
             "optimizer": 5.0}
    best = {"device": "h100-sxm", "tp": 4, "cp": 1, "pp": 2, "vpp": 1, "ep": 1, "zero": 1, "recompute": "none",
            "micro_batch": 1, "step_ms": 135.0, "peak_bytes": 40 * 2 ** 30, "parts_ms": parts}
    other = best | {"pp": 4, "step_ms": 175.0, "parts_ms": parts | {"bubble": 55.0, "compute": 105.0}}
    lines = why_best([best, other])
    assert lines == ["pp 2 over 4: the best pp 4 layout is 40 ms slower (bubble +35 ms, compute +5 ms)"]
    # A runner-up that differs in two choices explains neither: one line per decision, never one layout twice.
    both = best | {"pp": 4, "tp": 2, "step_ms": 150.0}
    assert why_best([best, both, other]) == lines


def test_a_choice_fsdp2_options_exist_beside_only_is_set_against_the_fastest_differing_in_them_too():
    """By hand: the best is ZeRO 3 resharding to 8 ranks at tp 1, which FSDP2 allows only there; the fastest tp 2
    layout can only free its parameters after forward. Its tp line still comes, against that layout; the reshard
    line against the same tp 1 layout freeing them; a tp 2 layout differing in ZeRO too explains neither."""
    from fxworkload.plan import why_best

    parts = {"compute": 100.0, "tp": 0.0, "zero gathers": 10.0}
    best = {"device": "h100-sxm", "tp": 1, "cp": 1, "pp": 1, "vpp": 1, "ep": 1, "zero": 3, "recompute": "none",
            "micro_batch": 1, "reshard_after_forward": 8, "accumulate_unsharded": False, "step_ms": 110.0,
            "peak_bytes": 40 * 2 ** 30, "parts_ms": parts}
    freed = best | {"reshard_after_forward": True, "step_ms": 112.0, "parts_ms": parts | {"zero gathers": 12.0}}
    tp2 = freed | {"tp": 2, "step_ms": 130.0, "parts_ms": parts | {"tp": 20.0}}
    tp2_zero1 = tp2 | {"zero": 1, "step_ms": 120.0}
    lines = why_best([best, freed, tp2_zero1, tp2])
    assert lines == ["tp 1 over 2: the best tp 2 layout is 20 ms slower (tp +20 ms)",
                     "reshard_after_forward 8 over True: the best reshard_after_forward True layout is 2 ms slower "
                     "(zero gathers +2 ms)"]


def test_a_tie_goes_to_the_layout_holding_less_memory_then_to_the_simpler():
    """The issue's case: ZeRO 1 at 64.7 GiB and ZeRO 2 at 56.6 GiB with the same step: ZeRO 2 ranks first
    and its line says why; with memory equal too, ZeRO 1 (the simpler) does."""
    from fxworkload.plan import rank_key, why_best

    parts = {"compute": 100.0}
    zero1 = {"device": "h100-sxm", "tp": 2, "cp": 1, "pp": 1, "vpp": 1, "ep": 1, "dp": 4, "zero": 1,
             "recompute": "none", "micro_batch": 1, "step_ms": 100.0, "peak_bytes": int(64.7 * 2 ** 30),
             "parts_ms": parts}
    zero2 = zero1 | {"zero": 2, "peak_bytes": int(56.6 * 2 ** 30)}
    ranked = sorted([zero1, zero2], key=rank_key)
    assert ranked[0]["zero"] == 2
    assert why_best(ranked) == ["zero 2 over 1: as fast (within 0.5 ms); 8.1 GiB less memory"]
    same = zero2 | {"peak_bytes": zero1["peak_bytes"]}
    ranked = sorted([same, zero1], key=rank_key)
    assert ranked[0]["zero"] == 1 and why_best(ranked) == ["zero 1 over 2: as fast (within 0.5 ms); the simpler layout"]


def test_ray_auto_with_no_cluster_is_refused_even_when_every_shape_is_cached(four_layers, tmp_path, monkeypatch):
    """The issue's case: with the plan cache full, --ray auto and ray:// addresses no cluster answers exited 0."""
    import ray._private.services as services

    def none_found(address, temp_dir):  # Ray's own lookup finding no cluster (ray/_private/services.py)
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "get_ray_address_from_environment", none_found)
    args = ["plan", four_layers, "--gpus", 2, "--global-batch", 4, "--seq", 16, "--workers", 1]
    assert in_process(*args, "--out", tmp_path / "warm").returncode == 0
    for ray, says in (("auto", "--ray auto: no Ray cluster runs on this machine"),
                      ("ray://127.0.0.1:1", "--ray ray://127.0.0.1:1: cannot reach a Ray cluster"),
                      ("127.0.0.1:1", "cannot reach a Ray cluster"), ("no-port", "cannot reach a Ray cluster")):
        run = in_process(*args, "--ray", ray, "--out", tmp_path / "never")
        assert run.returncode == 2 and says in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


@pytest.mark.parametrize("device", ["h100-sxm\n", " h100-sxm", "h100-sxm,", "h100-sxm,,b200", "../h100-sxm"])
def test_device_names_are_exact(four_layers, tmp_path, device):
    run = in_process("plan", four_layers, "--gpus", 2, "--global-batch", 4, "--seq", 16, "--device", device,
                     "--out", tmp_path / "never")
    assert run.returncode == 2 and "is not a device profile name" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


def test_context_parallelism_cannot_stretch_a_sequence_past_the_models_positions(four_layers, tmp_path, monkeypatch):
    """The model has 64 positions (conftest); with --cp 4 a rank captures a quarter of the sequence, but the
    whole sequence must fit: refused on capture, on a cached capture of the rank's length, and in a plan."""
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    says = "--seq 128 exceeds"
    cp = ["--cp", 4, "--device", "h100-sxm"]
    run = in_process("extract", four_layers, "--seq", 128, *cp, "--out", tmp_path / "never")
    assert run.returncode == 2 and says in run.stderr and "max_position_embeddings (64)" in run.stderr, run.stderr
    assert in_process("extract", four_layers, "--seq", 32, "--device", "h100-sxm", "--out", tmp_path / "a").returncode == 0
    run = in_process("extract", four_layers, "--seq", 128, *cp, "--out", tmp_path / "never")  # its rank's 32 is cached
    assert run.returncode == 2 and says in run.stderr, run.stderr
    run = in_process("plan", four_layers, "--gpus", 4, "--global-batch", 4, "--seq", 128, "--cp", "1,4",
                     "--out", tmp_path / "never")
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert not (tmp_path / "never").exists()
    assert in_process("extract", four_layers, "--seq", 64, *cp, "--out", tmp_path / "b").returncode == 0


def test_plan_refuses_more_workers_than_cores_before_starting_one(four_layers, tmp_path, monkeypatch):
    """A worker count above the cores this process may use (the oracle: os.sched_getaffinity, else os.cpu_count)
    is one line and exit 2, with nothing written and no process started. `make fuzz` found the case: a count
    such as 2**69 started processes until the machine ran out of memory, with Ctrl-C held until the pool was
    whole. The cores themselves are allowed."""
    import multiprocessing

    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # the oracle
    for count in (allowed + 1, 2 ** 69):
        run = in_process("plan", four_layers, "--gpus", 4, "--global-batch", 8, "--seq", 16, "--workers", count,
                         "--out", tmp_path / "never")
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert f"--workers {count} is more than the {allowed} cores" in run.stderr, run.stderr
        assert multiprocessing.active_children() == [] and not (tmp_path / "never").exists()
    run = in_process("plan", four_layers, "--gpus", 2, "--global-batch", 4, "--seq", 16, "--workers", allowed,
                     "--out", tmp_path / "fine")
    assert run.returncode == 0, run.stderr


def test_a_plan_asked_again_never_imports_torch(four_layers, tmp_path):
    """Every shape's rows and the model's facts come from the cache, and what the plan says of them (its 'why'
    lines, the network's among them) needs no torch: the warm path's speed (bench/plan_speed.py) rests on it."""
    env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
    args = ["plan", four_layers, "--gpus", "16", "--global-batch", "16", "--seq", "16", "--workers", "1"]
    code = ("import sys; from fxworkload.cli import main; "
            f"code = main({args!r} + ['--out', sys.argv[1]]); print(code, 'torch' in sys.modules)")
    cold = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cold")], capture_output=True, text=True, env=env)
    warm = subprocess.run([sys.executable, "-c", code, str(tmp_path / "warm")], capture_output=True, text=True, env=env)
    assert cold.stdout.split()[-2:-1] == ["0"], cold.stderr
    assert warm.stdout.split()[-2:] == ["0", "False"], warm.stderr
    assert (tmp_path / "warm" / "plan.txt").read_bytes() == (tmp_path / "cold" / "plan.txt").read_bytes()
    assert "why: network:" in (tmp_path / "warm" / "plan.txt").read_text()


def test_plan_topology_slows_the_gradient_reduce_it_narrows(four_layers, tmp_path):
    """--topology with one 10 Gb/s NIC a node: every layout whose data-parallel group spans nodes (2 GPUs a
    node, 8 GPUs) pays more for its gradients than on the profile's own network; the layout table records the
    topology. An oracle by construction: the same layouts, only the network changed."""
    runs = {}
    for name, extra in (("own", ()), ("narrow", ("--topology", "gpus-per-node=2,nvlink-domain=2,nics-per-node=1,"
                                                               "nic-gbps=10"))):
        run = fxworkload("plan", four_layers, "--gpus", 8, "--global-batch", 16, "--seq", 16, "--workers", 1,
                         "--out", tmp_path / name, "--top", 0, *extra)
        assert run.returncode == 0, run.stderr
        runs[name] = json.loads((tmp_path / name / "plan.json").read_text())
    assert "topology" not in runs["own"] and runs["narrow"]["topology"].startswith("gpus-per-node=2")
    key = lambda r: tuple(r[k] for k in LAYOUT_FIELDS)  # noqa: E731
    own = {key(r): r for r in runs["own"]["ranked"]}
    spanning = [r for r in runs["narrow"]["ranked"] if r["dp"] > 1 and r["tp"] * r["dp"] > 2 and key(r) in own]
    assert spanning and all(r["step_ms"] > own[key(r)]["step_ms"] for r in spanning)


def test_plan_scales_fp8_as_its_recipe_says_and_asked_again_never_imports_torch(four_layers, tmp_path):
    """plan --fp8 --fp8-recipe te-current: every layout's casts read each tensor once more for its amax than delayed
    scaling's (Transformer Engine's quantizer.cpp, Float8CurrentScalingQuantizer::quantize_impl), so each layout
    replayed from CUDA graphs (its GPU, not the host's issue, sets the pace) costs more, the GEMMs the same (an oracle by construction: only the casts changed); a plan asked again reads
    its rows from the cache without torch, as without --fp8."""
    env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
    runs = {}
    for recipe in ("te", "te-current", "te-current"):
        args = ["plan", four_layers, "--gpus", "4", "--global-batch", "8", "--seq", "16", "--workers", "1", "--fp8",
                "--fp8-recipe", recipe, "--top", "0", "--cuda-graphs", "step"]  # no step bound by the host's issue
        code = ("import sys; from fxworkload.cli import main; "
                f"code = main({args!r} + ['--out', sys.argv[1]]); print(code, 'torch' in sys.modules)")
        run = subprocess.run([sys.executable, "-c", code, str(tmp_path / recipe)], capture_output=True, text=True,
                             env=env)
        assert run.stdout.split()[-2:-1] == ["0"], run.stderr
        runs[recipe] = json.loads((tmp_path / recipe / "plan.json").read_text())
    assert run.stdout.split()[-1] == "False"  # te-current the second time: from the cache
    assert runs["te"]["fp8_recipe"] == "te" and runs["te-current"]["fp8_recipe"] == "te-current"
    key = lambda r: tuple(r[k] for k in LAYOUT_FIELDS)  # noqa: E731
    delayed = {key(r): r for r in runs["te"]["ranked"]}
    # ZeRO 3 layouts left out: FSDP2's hooks on the host set this tiny model's pace there (cluster/zero3.py)
    current = [r for r in runs["te-current"]["ranked"] if key(r) in delayed and r["zero"] < 3]
    assert current and all(r["step_ms"] > delayed[key(r)]["step_ms"] for r in current)


@pytest.mark.parametrize("flags, says", [(("--fp8", "--fp8-recipe", "bogus"), "unknown --fp8-recipe 'bogus'"),
                                         (("--fp8-recipe", "torchao"), "it needs --fp8")])
def test_plan_refuses_a_bad_fp8_recipe_in_one_line(four_layers, tmp_path, flags, says):
    run = fxworkload("plan", four_layers, "--gpus", 2, "--global-batch", 2, "--seq", 16, *flags, "--out", tmp_path / "p")
    assert run.returncode != 0 and says in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "p").exists()


@pytest.mark.parametrize("value, says", [("nic-gbps=fast", "--topology: nic-gbps=fast is not a number"),
                                         ("speed=3", "--topology: 'speed=3' is not key=value")])
def test_plan_refuses_a_bad_topology_in_one_line(four_layers, tmp_path, value, says):
    run = fxworkload("plan", four_layers, "--gpus", 8, "--global-batch", 16, "--seq", 16, "--topology", value,
                     "--out", tmp_path / "p")
    assert run.returncode != 0 and says in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "p").exists()


@pytest.mark.parametrize("flag, key, applies", [
    ("--overlap-param-gather", "overlap_param_gather", lambda r: r["zero"] in (1, 2) and r["dp"] > 1),
    ("--tp-comm-overlap", "tp_comm_overlap", lambda r: r["tp"] > 1)])
def test_plan_overlap_options_hide_what_they_overlap(four_layers, tmp_path, flag, key, applies):
    """plan --overlap-param-gather (ZeRO 1/2 layouts) and --tp-comm-overlap (tp > 1): each layout they apply to
    costs no more than without (the same layout, its collectives moved beside compute), the others the same."""
    runs = {}
    for name, extra in (("plain", ()), ("overlapped", (flag,))):
        run = fxworkload("plan", four_layers, "--gpus", 8, "--global-batch", 16, "--seq", 16, "--workers", 1,
                         "--out", tmp_path / name, "--top", 0, *extra)
        assert run.returncode == 0, run.stderr
        runs[name] = json.loads((tmp_path / name / "plan.json").read_text())
    assert runs["overlapped"][key] is True and key not in runs["plain"]
    fields = lambda r: tuple(r[k] for k in LAYOUT_FIELDS)  # noqa: E731
    plain = {fields(r): r for r in runs["plain"]["ranked"]}
    pairs = [(r, plain[fields(r)]) for r in runs["overlapped"]["ranked"] if fields(r) in plain]
    assert any(applies(r) for r, _ in pairs)
    for overlapped, alone in pairs:
        if applies(overlapped):
            assert overlapped["step_ms"] <= alone["step_ms"] + 1e-9
        else:
            assert overlapped["step_ms"] == alone["step_ms"]


def test_the_pareto_front_keeps_the_layouts_no_other_beats_on_both_time_and_memory():
    """By hand: (memory GiB, step ms) = (10, 300), (20, 200), (25, 250), (30, 200), (40, 100): (25, 250) is beaten
    by (20, 200) on both, (30, 200) ties (20, 200)'s time with more memory; the front is the other three."""
    from fxworkload.formats.plan_plot import pareto_front

    rows = [{"peak_bytes": gib * 2 ** 30, "step_ms": ms} for gib, ms in ((40, 100), (25, 250), (10, 300), (30, 200),
                                                                          (20, 200))]
    assert [(r["peak_bytes"] // 2 ** 30, r["step_ms"]) for r in pareto_front(rows)] == [(10, 300), (20, 200), (40, 100)]


def test_plan_plot_writes_the_same_png_twice(four_layers, tmp_path):
    args = ["plan", four_layers, "--gpus", 2, "--global-batch", 4, "--seq", 16, "--workers", 1, "--plot"]
    for name in ("a", "b"):
        assert in_process(*args, "--out", tmp_path / name).returncode == 0
    png = (tmp_path / "a" / "plan.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png == (tmp_path / "b" / "plan.png").read_bytes()
    assert "plan.png" in (tmp_path / "a" / "manifest.json").read_text()


def test_a_plan_with_other_attention_kernels_is_evaluated_apart(four_layers, tmp_path, monkeypatch):
    """--sdpa-backends reaches every shape's evaluation, and a cached plan of the default kernels is not
    handed back for it: each shape gets cache entries of its own (one per shape and kernel choice)."""
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    default = plan(four_layers, gpus=2, global_batch=4, seq=16, device="h100-sxm", workers=1)
    entries = sorted((tmp_path / "cache" / "plans").glob("*.json"))
    flash = plan(four_layers, gpus=2, global_batch=4, seq=16, device="h100-sxm", workers=1,
                 sdpa_backends=("flash", "efficient"))
    assert "sdpa_backends" not in default and flash["sdpa_backends"] == ["flash", "efficient"]
    assert flash["ranked"] and len(flash["ranked"]) == len(default["ranked"])
    assert entries and len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 2 * len(entries)
    from fxworkload.formats.plan_text import plan_text

    assert "stack eager (attention: flash,efficient), cp 1:" in plan_text(flash)
    assert "(attention:" not in plan_text(default)
