"""ZeRO-3 / FSDP on two streams (cluster/zero3.py), against timelines computed by hand."""

from __future__ import annotations

import pytest

from fxworkload.cluster.zero3 import NCCL_CHANNELS, Group, compute_share_lost, simulate_pass
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract


def test_a_gather_longer_than_the_layer_before_it_is_exposed():
    """Two layers, compute 10 and 10, gathers 4 and 15 (no compute slowdown). By hand:
    gather 1 runs 0-4 (exposed: 4); layer 1 computes 4-14 while gather 2 runs 4-19; layer 2 waits
    until 19 (exposed: 5) and ends at 29."""
    timeline = simulate_pass([Group(10, 4), Group(10, 15)], share_lost=0.0)
    assert timeline.duration_ns == 29 and timeline.exposed_gather_ns == 4 + 5 and timeline.trailing_ns == 0


def test_a_gather_shorter_than_the_layer_before_it_hides():
    """Gathers 4 and 6 behind compute 10 and 10: only the first gather shows, the step is 4 + 10 + 10."""
    timeline = simulate_pass([Group(10, 4), Group(10, 6)], share_lost=0.0)
    assert timeline.duration_ns == 24 and timeline.exposed_gather_ns == 4


def test_backward_reduce_scatters_queue_behind_the_prefetched_gather():
    """Backward of two layers (reversed order already): compute 10, 10; gathers 4, 6; reduce-scatters
    3, 3. By hand: gather A 0-4; A computes 4-14, gather B (prefetched at 4) runs 4-10; A's
    reduce-scatter, issued at 14, runs 14-17; B computes 14-24 (its gather was done at 10); B's
    reduce-scatter runs 24-27: 3 ns still running when the compute ends."""
    timeline = simulate_pass([Group(10, 4, 3), Group(10, 6, 3)], share_lost=0.0)
    assert timeline.duration_ns == 24 and timeline.exposed_gather_ns == 4 and timeline.trailing_ns == 3


def test_compute_beside_a_collective_loses_ncclss_share_of_the_sms():
    """H100 SXM: 132 SMs, 16 of them NCCL's: compute overlapped by a collective runs at 116/132. Layer 1
    (compute 100) runs beside gather 2 (50 ns): it loses 50 x 16/132 ns."""
    share = compute_share_lost(132)
    assert share == pytest.approx(NCCL_CHANNELS / 132)
    timeline = simulate_pass([Group(100, 0), Group(100, 50)], share_lost=share)
    assert timeline.slowdown_ns == pytest.approx(50 * 16 / 132)
    assert timeline.duration_ns == pytest.approx(200 + 50 * 16 / 132)


def test_the_cluster_step_runs_each_pass_on_the_two_streams(tiny_dirs):
    """ZeRO 3 on 8 data-parallel ranks: every pass starts with an exposed gather, so the step is
    longer than without sharding and the summary reports the exposed gathers; keeping the gathered
    parameters (FSDP2's reshard_after_forward=False) removes the backward's gathers."""
    run = dict(batch=1, seq=16, dtype="bf16", device="h100-sxm")
    plain = extract(str(tiny_dirs["llama4"]), parallel=Parallel(dp=8, zero=1), **run).cluster
    sharded = extract(str(tiny_dirs["llama4"]), parallel=Parallel(dp=8, zero=3), **run).cluster
    kept = extract(str(tiny_dirs["llama4"]), parallel=Parallel(dp=8, zero=3, reshard_after_forward=False), **run).cluster
    assert sharded.exposed_ns["zero3_gather"] > 0 and plain.exposed_ns["zero3_gather"] == 0
    assert sharded.pipeline_ns > plain.pipeline_ns
    assert kept.exposed_ns["zero3_gather"] < sharded.exposed_ns["zero3_gather"]
    assert kept.pipeline_ns < sharded.pipeline_ns


def test_fsdp2s_copies_move_what_its_source_says():
    """By hand from torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, for a unit of E parameters in
    bf16 reduced in fp32 over 4 ranks: after its gather of 2E bytes, split_with_sizes_copy reads and writes
    them (4E); before its reduce-scatter, chunk_cat reads E bf16 gradients and writes E fp32 (6E bytes, a
    casting kernel). Each is one memory-bound kernel of those bytes on the compute stream."""
    from fxworkload.cluster.step import copy_kernels_ns
    from fxworkload.cost.devices import load
    from fxworkload.cost.gpu import memory_ns
    from fxworkload.parallel.collectives import fsdp_comms
    from fxworkload.parallel.units import Unit
    from fxworkload.workload.table import GradRow

    elements = 3 << 26
    unit = Unit(name="layer0", block="layer", layer=0,
                grads=[GradRow("w", "model.layers.0.mlp", ["weight"], elements, 4 * elements)])
    (gather,), (scatter,) = fsdp_comms([unit], Parallel(dp=4, zero=3), 2, 4)
    assert (gather.copy_bytes, gather.copy_casts) == (4 * elements, False)
    assert (scatter.copy_bytes, scatter.copy_casts) == (6 * elements, True)
    device = load("h100-sxm")
    facts, model = device.gpu_facts(), device.gpu_model()
    assert copy_kernels_ns([gather, scatter], device) == pytest.approx(
        memory_ns(4 * elements, facts, model) + memory_ns(6 * elements, facts, model, casts=True))
    assert copy_kernels_ns([gather], None) == 0.0


def test_a_units_copies_run_on_the_compute_stream_after_its_gather():
    """One unit, gather 5, compute 10, copies 3: the compute stream waits 5, then runs 13."""
    timeline = simulate_pass([Group(compute_ns=10.0, gather_ns=5.0, copy_ns=3.0)], 0.0)
    assert timeline.duration_ns == 18.0 and timeline.exposed_gather_ns == 5.0 and timeline.copy_ns == 3.0


def test_the_step_counts_fsdp2s_copies_in_every_pass_of_zero3_only(tiny_dirs):
    """ZeRO 3 reports its copies; ZeRO 1 has none; keeping the gathered parameters drops the backward's
    copy-outs (fewer copies), and an fp32 reduce dtype makes the copy-in move 6 bytes an element, not 4."""
    run = dict(batch=1, seq=16, dtype="bf16", device="h100-sxm")
    steps = {name: extract(str(tiny_dirs["llama4"]), parallel=Parallel(dp=8, **kw), **run, **extra).cluster
             for name, kw, extra in (("zero1", {"zero": 1}, {}), ("zero3", {"zero": 3}, {}),
                                     ("kept", {"zero": 3, "reshard_after_forward": False}, {}),
                                     ("fp32", {"zero": 3}, {"grad_dtype": "fp32"}))}
    copies = {name: step.exposed_ns.get("zero3_copies", 0.0) for name, step in steps.items()}
    assert copies["zero1"] == 0 and copies["zero3"] > 0
    assert copies["kept"] < copies["zero3"] < copies["fp32"]


def test_unsharded_accumulation_moves_what_fsdp2s_source_says():
    """By hand from torch/distributed/fsdp/_fully_shard (_fsdp_param_group.py post_backward without reduce_grads;
    _fsdp_param.py to_accumulated_grad_if_needed, accumulate_unsharded_grad_if_needed), for a unit of E bf16
    parameters reduced in fp32: the first micro-batch casts its gradient to fp32 and keeps it (2E read, 4E
    written); a middle one adds its gradient to the kept one (4E and 2E read, 4E written); the last adds, then
    reduce-scatters the fp32 sum, its copy-in reading and writing fp32 (8E) before the same 4E-byte collective.
    With one dtype the first keeps the gradient as autograd left it: no kernel."""
    from fxworkload.parallel.collectives import (EVERY, FIRST, LAST, MIDDLE, NONE, REDUCESCATTER, fsdp_comms,
                                                 micro_batch_scatters)
    from fxworkload.parallel.units import Unit
    from fxworkload.workload.table import GradRow

    elements = 3 << 20
    unit = Unit(name="layer0", block="layer", layer=0,
                grads=[GradRow("w", "model.layers.0.mlp", ["weight"], elements, 4 * elements)])
    _, (mixed,) = fsdp_comms([unit], Parallel(dp=4, zero=3), 2, 4)
    _, (plain,) = fsdp_comms([unit], Parallel(dp=4, zero=3), 2, 2)

    def kernels(comms):
        return [(c.type, c.bytes, c.copy_bytes) for c in comms]

    assert kernels(micro_batch_scatters([mixed], EVERY)) == [(REDUCESCATTER, 4 * elements, 6 * elements)]
    assert kernels(micro_batch_scatters([mixed], FIRST)) == [(NONE, 0, 6 * elements)]
    assert kernels(micro_batch_scatters([mixed], MIDDLE)) == [(NONE, 0, 10 * elements)]
    assert kernels(micro_batch_scatters([mixed], LAST)) == [(NONE, 0, 10 * elements),
                                                            (REDUCESCATTER, 4 * elements, 8 * elements)]
    assert kernels(micro_batch_scatters([plain], FIRST)) == []
    assert kernels(micro_batch_scatters([plain], MIDDLE)) == [(NONE, 0, 6 * elements)]
    assert kernels(micro_batch_scatters([plain], LAST)) == [(NONE, 0, 6 * elements),
                                                            (REDUCESCATTER, 2 * elements, 4 * elements)]


def test_accumulating_unsharded_reduce_scatters_once_and_adds_its_kernels(tiny_dirs):
    """ZeRO 3 on 8 ranks, 3 micro-batches, bf16 parameters reduced in fp32, with and without
    --accumulate-unsharded. By hand over the step's FSDP units (E_u elements each): the copies grow by the
    middle micro-batch's add (10 E_u bytes) in place of its copy-in (6 E_u), and by the last one's add and fp32
    copy-in (10 E_u + 8 E_u) in place of its copy-in (6 E_u); the first one's cast moves what its copy-in moved.
    Only the last micro-batch reduce-scatters, so the gathers wait no longer than beside three reduce-scatters;
    the memory holds the rank's whole gradient in fp32 beside the rest."""
    from fxworkload.cost.devices import load
    from fxworkload.cost.gpu import memory_ns
    from fxworkload.parallel.collectives import fsdp_units

    run = dict(batch=1, seq=16, dtype="bf16", grad_dtype="fp32", device="h100-sxm")
    layouts = {name: Parallel(dp=8, zero=3, micro_batches=3, accumulate_unsharded=name == "summed")
               for name in ("each", "summed")}
    steps = {name: extract(str(tiny_dirs["llama4"]), parallel=p, **run) for name, p in layouts.items()}
    device = load("h100-sxm")
    facts, model = device.gpu_facts(), device.gpu_model()
    units = [u for u in steps["each"].cluster.device_units[0] if u.block != "dp"]
    added = 0.0
    for members in fsdp_units(units):
        e = sum(g.elements for u in members for g in u.grads)
        copy_in = memory_ns(6 * e, facts, model, casts=True)
        added += memory_ns(10 * e, facts, model, casts=True) - copy_in  # the middle micro-batch
        added += memory_ns(10 * e, facts, model, casts=True) + memory_ns(8 * e, facts, model) - copy_in  # the last
    copies = {name: step.cluster.exposed_ns["zero3_copies"] for name, step in steps.items()}
    assert copies["summed"] - copies["each"] == pytest.approx(added, rel=1e-9)
    assert steps["summed"].cluster.exposed_ns["zero3_gather"] <= steps["each"].cluster.exposed_ns["zero3_gather"]
    parameters = sum(g.elements for u in units for g in u.grads)
    memory = {name: step.memory for name, step in steps.items()}
    assert memory["each"].accumulated_gradients_bytes == 0
    assert memory["summed"].accumulated_gradients_bytes == 4 * parameters
    assert memory["summed"].total_peak_bytes - memory["each"].total_peak_bytes == 4 * parameters
    one = extract(str(tiny_dirs["llama4"]), parallel=Parallel(dp=8, zero=3, accumulate_unsharded=True), **run)
    assert one.memory.accumulated_gradients_bytes == 0  # one micro-batch: it reduce-scatters as ever


def test_accumulate_unsharded_needs_zero3(tiny_dirs, capsys):
    from fxworkload.cli import main

    code = main(["extract", str(tiny_dirs["llama4"]), "--seq", "16", "--dp", "2", "--zero", "1",
                 "--accumulate-unsharded", "--out", "/nonexistent/never-written"])
    err = capsys.readouterr().err
    assert code == 2 and "--accumulate-unsharded" in err and "--zero 3" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_resharding_to_n_ranks_gathers_over_them_in_backward(tiny_dirs):
    """FSDP2's reshard_after_forward=8 on 16 data-parallel ranks (two DGX nodes): after each unit's forward the
    rank keeps its 1/8 of the gathered parameters (a clone of that slice: its bytes read and written), and the
    backward gathers over the 8 ranks of its node (torch's _get_post_forward_mesh_info views the shard mesh as
    (-1, 8)): by hand over the FSDP units, each backward gather is an 8-rank all-gather inside one NVLink domain
    of the unit's bytes, the forward's stay 16-rank gathers across two, and the rank holds 1/8 of its
    parameters beside its shard from forward to backward."""
    from fxworkload.cluster.network import collective_ns
    from fxworkload.cost.devices import load
    from fxworkload.cost.gpu import memory_ns
    from fxworkload.parallel.collectives import ALLGATHER, fsdp_units

    run = dict(batch=1, seq=16, dtype="bf16", device="h100-sxm")
    layouts = {"whole": Parallel(dp=16, zero=3, micro_batches=2),
               "node": Parallel(dp=16, zero=3, micro_batches=2, reshard_after_forward=8)}
    steps = {name: extract(str(tiny_dirs["llama4"]), parallel=p, **run) for name, p in layouts.items()}
    device = load("h100-sxm")
    facts, model = device.gpu_facts(), device.gpu_model()
    units = [u for u in steps["whole"].cluster.device_units[0] if u.block != "dp"]
    unit_bytes = [2 * sum(g.elements for u in members for g in u.grads) for members in fsdp_units(units)]
    forward_ns, backward_ns = steps["node"].cluster.devices[0].zero3_gather_ns
    assert forward_ns == pytest.approx(sum(collective_ns(ALLGATHER, b, 16, 2, device) for b in unit_bytes), rel=1e-9)
    assert backward_ns == pytest.approx(sum(collective_ns(ALLGATHER, b, 8, 1, device) for b in unit_bytes), rel=1e-9)
    assert backward_ns < steps["whole"].cluster.devices[0].zero3_gather_ns[1]
    kept = sum(memory_ns(2 * b // 8, facts, model) for b in unit_bytes)  # each unit's clone, every micro-batch
    copies = {name: step.cluster.exposed_ns["zero3_copies"] for name, step in steps.items()}
    assert copies["node"] - copies["whole"] == pytest.approx(2 * kept, rel=1e-9)
    assert steps["node"].memory.gathered_parameters_bytes == sum(unit_bytes) // 8
    assert steps["node"].memory.total_peak_bytes - steps["whole"].memory.total_peak_bytes == sum(unit_bytes) // 8


@pytest.mark.parametrize("argv, said", [
    (["--dp", "16", "--zero", "3", "--reshard-after-forward", "3"], "a divisor of the data-parallel group (16 ranks)"),
    (["--dp", "16", "--zero", "3", "--reshard-after-forward", "1"], "from 2 up"),
    (["--dp", "16", "--zero", "1", "--reshard-after-forward", "8"], "it needs --zero 3"),
    (["--dp", "8", "--tp", "2", "--zero", "3", "--reshard-after-forward", "4"], "not supported for DTensor parameters"),
    (["--dp", "16", "--zero", "3", "--keep-gathered", "--reshard-after-forward", "8"], "give one of the two"),
    (["--dp", "16", "--zero", "3", "--reshard-after-forward", "8", "--format", "simai"], "no group smaller"),
])
def test_reshard_after_forward_refuses_what_fsdp2_and_simai_cannot_run(tiny_dirs, tmp_path, capsys, argv, said):
    from fxworkload.cli import main

    out = tmp_path / "out"
    code = main(["extract", str(tiny_dirs["llama4"]), "--seq", "16", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


# What bench/fsdp2_host.py measured FSDP2's hooks to cost the host (fixed, per parameter tensor), microseconds
HOOKS_MEASURED_US = {"forward": (392.0, 13.5), "backward": (626.1, 14.2)}


def test_fsdp2s_hooks_are_the_figures_the_bench_measured():
    """A Llama decoder layer's 9 parameters: 392 + 9 x 13.5 = 513.5 us around its forward, 626.1 + 9 x 14.2 =
    753.9 us around its backward."""
    from fxworkload.cluster.zero3 import hooks_ns

    assert hooks_ns(False, 9) == pytest.approx(513.5e3)
    assert hooks_ns(True, 9) == pytest.approx(753.9e3)
    fixed, per_parameter = HOOKS_MEASURED_US["backward"]
    assert hooks_ns(True, 1) == pytest.approx((fixed + per_parameter) * 1e3)


def test_fsdp2s_hooks_cost_a_pass_only_where_the_host_is_the_slower():
    """A unit of 9 parameters whose forward runs 1 ms on the GPU and whose ops take the host 0.2 ms to issue: with
    its hooks (0.5135 ms) the host is done at 0.7135 ms, before the GPU: nothing waits. A 0.3 ms forward: the
    host's 0.7135 ms outlast it by 0.4135 ms, which the GPU waits."""
    from fxworkload.cluster.zero3 import fsdp2_host_wait_ns

    assert fsdp2_host_wait_ns(1e6, 0.2e6, False, 9) == 0.0
    assert fsdp2_host_wait_ns(0.3e6, 0.2e6, False, 9) == pytest.approx(0.4135e6)


def test_a_units_wait_on_the_host_runs_on_the_compute_stream():
    """One unit, gather 5, compute 10, copies 3, 4 waiting on the host: the compute stream waits 5, then runs
    17; the timeline reports the 4."""
    timeline = simulate_pass([Group(compute_ns=10.0, gather_ns=5.0, copy_ns=3.0, host_wait_ns=4.0)], 0.0)
    assert timeline.duration_ns == 22.0 and timeline.host_wait_ns == 4.0


def test_a_host_bound_zero3_step_waits_for_its_units_hooks(tiny_dirs):
    """The tiny 4-layer Llama at seq 16 on an H100: every forward op's issue outlasts its kernel, so each FSDP
    unit's forward is the host's and ZeRO 3 adds to the GPU's wait on the host all of its forward hooks; in
    backward a few kernels outlast their issue (the attention's, the loss's), and the hooks run beside those, so
    it adds at most the backward hooks. Per micro-batch (2) and unit: the embedding, each decoder layer and the
    head, with the parameters torch's model holds in each. ZeRO 1 runs no hook."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fxworkload.cluster.zero3 import hooks_ns

    run = dict(batch=1, seq=16, dtype="bf16", device="h100-sxm")
    parallel = dict(dp=8, micro_batches=2)
    zero1 = extract(str(tiny_dirs["llama4"]), parallel=Parallel(zero=1, **parallel), **run).cluster
    zero3 = extract(str(tiny_dirs["llama4"]), parallel=Parallel(zero=3, **parallel), **run).cluster
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dirs["llama4"]))
    units: dict[str, int] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        unit = ".".join(parts[:3]) if parts[1] == "layers" else ("embedding" if "embed" in name else "head")
        units[unit] = units.get(unit, 0) + 1
    assert len(units) == 6 and units["model.layers.0"] == 9
    forward = sum(hooks_ns(False, n) for n in units.values())
    backward = sum(hooks_ns(True, n) for n in units.values())
    added = zero3.exposed_ns["host"] - zero1.exposed_ns["host"]
    assert 2 * forward < added <= 2 * (forward + backward) + 1e-6
