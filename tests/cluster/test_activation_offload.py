"""Activations offloaded to host memory (cluster/activation_offload.py: Megatron-Core's layer-level CPU
offloading, Transformer Engine's schedule), against hand-built two-stream timelines."""

from __future__ import annotations

import csv
import json

import pytest

from fxworkload.cluster.activation_offload import offloaded_pass
from fxworkload.cluster.offload import HOST_LINK_EFFICIENCY
from fxworkload.cost import devices
from fxworkload.errors import UserError
from fxworkload.parallel.layout import Parallel, check_values

from ..test_cli import fxworkload


def test_copies_that_outlast_the_layers_beside_them_hold_the_compute_as_the_hand_built_timeline_does():
    """By hand: 4 layers, the first 2 offloaded; forward 10 and backward 20 a layer, a copy 30 each way,
    the head 5. Forward: layer 0 ends at 10, its copy runs 10-40; layer 1 ends at 20, its copy queues 40-70;
    layer 2 (= 4 - 2 + 0) waits for copy 0 (40) and ends at 50; layer 3 waits for copy 1 (70), ends at 80:
    40 waited. The head to 85. Backward: layer 3 to 105; layer 2 starts reload 1 (105-135) and ends at 125;
    layer 1 starts reload 0 (queued 135-165), waits for reload 1 (135), ends at 155; layer 0 waits for
    reload 0 (165), ends at 185: 185 - 85 - 80 = 20 waited."""
    run = offloaded_pass([10] * 4, [20] * 4, [30] * 4, 2, head_ns=5)
    assert (run.forward_wait_ns, run.backward_wait_ns) == (40, 20)
    assert run.forward_waits_ns == (0, 0, 20, 20) and run.backward_waits_ns == (10, 10, 0, 0)
    assert run.copies_ns == ((10, 40, 135, 165), (40, 70, 105, 135))


def test_copies_shorter_than_the_layers_beside_them_cost_nothing():
    """The same with copies of 15: copy 0 runs 10-25 and copy 1 25-40 under layers 1-3 (which end at 20, 35,
    50 after waiting for copy 0 at 25 and copy 1 at 40), forward waits 10; in backward reload 1 runs 75-90
    under layer 2 and reload 0 95-110 under layer 1: nothing waits."""
    run = offloaded_pass([10] * 4, [20] * 4, [15] * 4, 2, head_ns=5)
    assert (run.forward_wait_ns, run.backward_wait_ns) == (10, 0)


def test_offloading_all_but_the_last_layer_exposes_every_reload():
    """N = L - 1: layer i's reload starts at its own backward (L - 1 - N + i = i), so each copy back is
    waited for whole: 2 copies of 5."""
    run = offloaded_pass([10] * 3, [10] * 3, [5] * 3, 2)
    assert run.backward_wait_ns == 10


def test_megatron_cores_constraints_are_refused_in_one_line():
    with pytest.raises(UserError, match="needs --pp 1"):
        check_values(Parallel(pp=2, activation_offload_layers=1))
    with pytest.raises(UserError, match="needs --recompute none"):
        check_values(Parallel(recompute="full", activation_offload_layers=1))
    with pytest.raises(UserError, match="count of decoder layers"):
        check_values(Parallel(activation_offload_layers=-1))


def test_extract_moves_the_offloaded_layers_activations_to_the_host_and_waits_for_their_copies(tmp_path):
    """Llama 3 8B, one GPU, batch 1 x seq 4,096: the rank's activations fall by what its first 8 layers save
    (the saved bytes of layers 0-7's nodes, read off the per-node table), the host
    holds them, and the step grows by exactly the waits the summary reports."""
    runs = {}
    for layers in (0, 8):
        out = tmp_path / f"o{layers}"
        run = fxworkload("extract", "llama-3-8b", "--batch", 1, "--seq", 4096, "--dtype", "bf16", "--device",
                         "h100-sxm", "--activation-offload-layers", layers, "--out", out)
        assert run.returncode == 0, run.stderr
        runs[layers] = json.loads((out / "workload.json").read_text())
    kept, offloaded = runs[0], runs[8]
    moved = kept["memory"]["activations_bytes"] - offloaded["memory"]["activations_bytes"]
    assert moved == offloaded["memory"]["host_bytes"] > 0
    with open(tmp_path / "o0" / "nodes.tsv", newline="") as table:
        per_layer = [sum(int(r["saved_bytes"]) for r in rows if f"layers.{i}." in r["module"])
                     for rows in [list(csv.DictReader(table, delimiter="\t"))] for i in range(8)]
    assert moved == sum(per_layer) and min(per_layer) > 0
    waited = offloaded["cluster"]["exposed_ns"]["activation_offload"]
    assert waited > 0 and kept["cluster"]["exposed_ns"]["activation_offload"] == 0
    assert offloaded["cluster"]["step_ns"] - kept["cluster"]["step_ns"] == pytest.approx(waited, rel=1e-6)
    link = devices.load("h100-sxm").host_link_bytes_per_s * HOST_LINK_EFFICIENCY
    assert waited <= 2 * 1e9 * moved / link  # at most every copy, out and back, waited for whole


def test_offloading_as_many_layers_as_the_model_has_is_refused(tmp_path):
    run = fxworkload("extract", "llama-3-8b", "--batch", 1, "--seq", 128, "--device", "h100-sxm",
                     "--activation-offload-layers", 32, "--out", tmp_path / "o")
    assert run.returncode == 2 and "must be below the model's 32 layers" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def step_waits(out) -> tuple[list[float], list[float]]:
    """Per layer, one micro-batch's forward and backward waits, from the Chrome trace's rank view (mb 0)."""
    trace = json.loads((out / "workload.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0 and e["args"].get("micro_batch") == 0]
    forward_end = max(e["ts"] + e["dur"] for e in spans if e["name"].endswith(" forward"))
    waits = [e for e in spans if e["name"] == "waiting for activation copies"]
    return ([1e3 * e["dur"] for e in waits if e["ts"] < forward_end], [1e3 * e["dur"] for e in waits if e["ts"] >= forward_end])


def test_every_output_carries_the_waits_the_step_runs(tmp_path):
    """The Chrome trace lays each wait before its layer and each copy on the offload stream, its rank's step
    ending at the cluster's; the SimAI rows fold the waits into the waiting units' compute (forward and
    backward apart, every micro-batch's copy); the Chakra trace chains them as compute nodes of no FLOPs,
    read back with Chakra's own decoder."""
    from chakra.schema.protobuf.et_def_pb2 import COMP_NODE

    from fxworkload import read_simai

    from ..formats.test_chakra import read

    outs = {}
    for layers in (0, 8):
        out = outs[layers] = tmp_path / f"o{layers}"
        run = fxworkload("extract", "llama-3-8b", "--batch", 1, "--seq", 4096, "--dtype", "bf16", "--device",
                         "h100-sxm", "--micro-batches", 2, "--activation-offload-layers", layers, "--format",
                         "tables,simai,chrome-trace,chakra", "--out", out)
        assert run.returncode == 0, run.stderr
    step = json.loads((outs[8] / "workload.json").read_text())["cluster"]
    waited = step["exposed_ns"]["activation_offload"]  # both micro-batches
    trace = json.loads((outs[8] / "workload.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]
    waits = [e["dur"] for e in spans if e["name"] == "waiting for activation copies"]
    assert sum(waits) == pytest.approx(waited / 1e3, abs=1e-3 * len(waits))
    assert len([e for e in spans if e["cat"] == "offload" and e["tid"] == 3]) == 2 * 2 * 8  # out and back, 8 layers
    assert trace["otherData"]["step_ns"] == trace["otherData"]["cluster_step_ns"] == round(step["step_ns"])
    simai = {k: read_simai(outs[k] / "workload.simai.txt") for k in outs}
    forward_grown = sum(r.forward_ns for r in simai[8].rows) - sum(r.forward_ns for r in simai[0].rows)
    assert forward_grown == pytest.approx(2 * sum(step_waits(outs[8])[0]), abs=len(simai[8].rows))
    total = sum(r.forward_ns + r.input_grad_ns for r in simai[8].rows) - sum(
        r.forward_ns + r.input_grad_ns for r in simai[0].rows)
    assert total == pytest.approx(waited, abs=len(simai[8].rows))  # each row rounded to the nanosecond
    nodes = read(outs[8] / "workload.0.et")
    chained = [n for n in nodes if n.type == COMP_NODE and n.name.endswith("waits for activation copies")]
    assert sum(n.duration_micros for n in chained) == pytest.approx(waited / 1e3, rel=1e-3)
