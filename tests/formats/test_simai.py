"""SimAI workload files and Chrome traces: written by the CLI, read back, checked against the rank's units."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from fxworkload import read_simai
from fxworkload.capture.trace import FORWARD, INPUT_GRAD, PHASES, WEIGHT_GRAD
from fxworkload.cluster.network import comm_ns
from fxworkload.formats.chrome_trace import CLUSTER_PID
from fxworkload.cli import main
from fxworkload.cost.devices import load
from fxworkload.errors import UserError
from fxworkload.cost.gpu import memory_ns
from fxworkload.pipeline import extract
from fxworkload.parallel.layout import Parallel
from fxworkload.formats.simai import COMM_TYPES, from_rank, text

SEED = Path(__file__).resolve().parents[1] / "fixtures" / "simai_405b_tp8_pp16.txt"
PARALLEL_ARGS = ["--tp", "2", "--pp", "2", "--dp", "4", "--ep", "2", "--sp", "--micro-batches", "3", "--zero", "1"]


def _run(tmp_path, *args):
    out = tmp_path / "out"
    code = main(["extract", *args, "--out", str(out)])
    return code, out



def _pass_ns(unit, phase: str) -> float:
    """A unit's pass as the cluster step takes it: its kernels, or its ops' host dispatch where that is longer."""
    ops = unit.ops(phase)
    return max(sum(op.estimated_ns for op in ops), sum(op.dispatch_ns for op in ops))

def test_simai_file_round_trips_and_matches_the_rank(tiny_dirs, tmp_path, capsys):
    code, out = _run(tmp_path, str(tiny_dirs["mixtral"]), "--batch", "2", "--seq", "16", "--format", "simai",
                     "--stage", "1", *PARALLEL_ARGS)
    assert code == 0 and sorted(p.name for p in out.iterdir()) == ["manifest.json", "workload.simai.txt"]
    document = read_simai(out / "workload.simai.txt")
    lines = (out / "workload.simai.txt").read_text().splitlines()
    assert lines[0] == ("HYBRID_TRANSFORMER_FWD_IN_BCKWD model_parallel_NPU_group: 2 ep: 2 pp: 2 vpp: 1 ga: 3 "
                        f"all_gpus: 16 checkpoints: 0 checkpoint_initiates: 0 pp_comm: {2 * 16 * 64 * 4 // 2}")
    assert int(lines[1]) == len(document.rows) == len(lines) - 2
    assert all(len(line.split("\t")) == 12 and "." not in line for line in lines[2:])
    for row in document.rows:
        for kind in (row.forward_comm, row.input_grad_comm, row.weight_grad_comm):
            assert kind.removesuffix("_DP_EP").removesuffix("_EP") in COMM_TYPES and "ASYNC" not in kind
    result = extract(str(tiny_dirs["mixtral"]), batch=2, seq=16, parallel=Parallel(
        tp=2, pp=2, dp=4, ep=2, sp=True, micro_batches=3, zero=1, stage=1))
    assert document == from_rank(result.rank, result.device, result.cluster_or_none())
    units = [u for u in result.rank.units if u.block != "dp"]
    # SimAI runs the rows once (Workload.cc): the rank's units are written once per micro-batch
    assert [r.name for r in document.rows if r.forward_ns] == 3 * [u.name for u in units if round(_pass_ns(u, FORWARD))]
    # a row's forward: its pass, and torch's copies around its tensor-parallel collectives (2 sequences a
    # micro-batch on dim 1: each gather's result and each scatter's input, read and written)
    copies = [c for u in units for c in u.comms[FORWARD] if c.group == "tp" and c.type in ("ALLGATHER", "REDUCESCATTER")]
    assert copies and all(c.copy_bytes == 2 * c.bytes for c in copies if c.what.startswith(("block", "row-parallel")))
    copies_ns = {id(u): sum(memory_ns(c.copy_bytes, result.device.gpu_facts(), result.device.gpu_model())
                            for c in u.comms[FORWARD] if c.group == "tp" and c.copy_bytes) for u in units}
    assert sum(r.forward_ns for r in document.rows) == 3 * sum(round(_pass_ns(u, FORWARD) + copies_ns[id(u)])
                                                               for u in units)
    sizes = sorted(r.forward_comm_bytes for r in document.rows if r.forward_comm == "ALLTOALL_EP")
    assert sizes == [2 * 16 // 2 * 2 * 64 * 4] * 2 * 3  # one MoE layer on stage 1: dispatch and combine, 3 times
    assert {r.weight_grad_comm for r in document.rows} >= {"REDUCESCATTER", "ALLGATHER", "REDUCESCATTER_DP_EP"}


def test_reads_a_simai_file_of_another_generator():
    """A SimAI workload file of another generator: a 405B-class model, TP 8, PP 16, old header."""
    document = read_simai(SEED)
    assert document.policy == "HYBRID_TRANSFORMER_FWD_IN_BCKWD"
    assert document.header["model_parallel_NPU_group"] == 8 and document.header["pp"] == 16
    assert document.header["all_gpus"] == 1024 and "vpp" not in document.header
    assert len(document.rows) == 557
    assert document.rows[0].weight_grad_comm == "ALLGATHER" and document.rows[0].weight_grad_comm_bytes == 6401032192
    raw = [line.split("\t") for line in SEED.read_text().splitlines()[2:]]
    assert [r.name for r in document.rows] == [fields[0] for fields in raw]
    assert [r.input_grad_ns for r in document.rows] == [int(fields[5]) for fields in raw]


def test_read_simai_names_a_malformed_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("HYBRID_TRANSFORMER_FWD_IN_BCKWD ep: 1\n1\nembedding\t-1\t1.5\tNONE\t0\t0\tNONE\t0\t0\tNONE\t0\t100\n")
    with pytest.raises(UserError, match=r"bad.txt:3: '1.5' is not an integer"):
        read_simai(path)
    path.write_text("HYBRID_TRANSFORMER_FWD_IN_BCKWD ep: 1\n1\nembedding -1 1 NONE 0 0 NONE 0 0 BROADCAST 0 100\n")
    with pytest.raises(UserError, match=r"bad.txt:3: unknown comm type 'BROADCAST'"):
        read_simai(path)


def test_read_simai_takes_any_whitespace_as_the_simulator_does(tmp_path):
    path = tmp_path / "spaces.txt"
    path.write_text("HYBRID_TRANSFORMER_FWD_IN_BCKWD ep: 1\n1\nembedding  -1 7   NONE 0 8 NONE 0 9 ALLREDUCE 10 100\n")
    (row,) = read_simai(path).rows
    assert (row.forward_ns, row.input_grad_ns, row.weight_grad_ns, row.weight_grad_comm_bytes) == (7, 8, 9, 10)


def test_simai_runs_every_micro_batch_of_the_step_and_each_gradient_bucket_once(tiny_dirs):
    """SimAI 1.6 runs the rows as written, once (Workload.cc, iterate_hybrid_parallel_Transformer_fwd_in_bckwd),
    so its total compute is the sum of the rows: it must be the step's, three micro-batches of it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    result = extract(str(tiny_dirs["gpt2"]), batch=2, seq=16, parallel=Parallel(dp=2, micro_batches=3))
    rows = from_rank(result.rank).rows
    simai_compute = sum(r.forward_ns + r.input_grad_ns + r.weight_grad_ns for r in rows)
    # one micro-batch: each unit's pass, its kernels or its ops' host dispatch where longer (this tiny model is
    # host-bound), by hand from the per-node table's ops
    table = sum(_pass_ns(u, phase) for u in result.rank.units for phase in PHASES)
    assert table >= sum(result.totals[f"{phase}_estimated_ns"] for phase in PHASES)
    assert simai_compute == pytest.approx(3 * table, abs=len(rows))  # integer ns per row
    assert [r.name for r in rows].count("embedding_layer") == 3
    reduced = [r for r in rows if r.weight_grad_comm != "NONE"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dirs["gpt2"]))
    parameters = sum(p.numel() for p in model.parameters())  # torch's count: the tied head once
    assert {r.weight_grad_comm for r in reduced} == {"ALLREDUCE"}
    assert sum(r.weight_grad_comm_bytes for r in reduced) == parameters * 4  # fp32 gradients, each bucket once


def test_simai_bubble_is_megatrons_with_the_rows_repeated(tiny_dirs):
    """Layer.cc: pre_bubble_time sums every row not named embedding_layer (compute and blocking
    collectives) and scales it by (PP_size - 1) / (GA * vpp). With the rows written once per
    micro-batch that is (pp - 1) / vpp micro-batch passes of the device, Megatron's interleaved
    bubble; the chunks' rows follow the schedule's forward order (schedules.py: a device runs
    micro-batches through its chunks in groups of pp, chunk (k mod pp·vpp) // pp)."""
    from fxworkload.workload.layers import layer_of

    p = Parallel(pp=2, vpp=2, micro_batches=4)
    result = extract(str(tiny_dirs["llama4"]), batch=1, seq=16, parallel=p)
    document = from_rank(result.rank)
    assert (document.header["vpp"], document.header["ga"], document.header["pp"]) == (2, 4, 2)
    layers = [int(r.name.split("_")[0].removeprefix("layer")) for r in document.rows if r.name.endswith("_attention")]
    assert layers == [0, 0, 2, 2, 0, 0, 2, 2]  # device 0 holds virtual stages 0 and 2: layers 0 and 2
    rows = [r for r in document.rows if r.name != "embedding_layer"]
    bubble = sum(r.forward_ns + r.input_grad_ns + r.weight_grad_ns for r in rows) * (2 - 1) / (4 * 2)
    stack = result.facts.stack
    assert {u.layer for u in result.rank.units if u.layer is not None} == {0, 2}
    per_micro_batch = sum(_pass_ns(u, phase) for u in result.rank.units if u.layer in (0, 2) for phase in PHASES)
    assert sum(op.estimated_ns for row in result.workload.node_rows if layer_of(row.module, stack) in (0, 2)
               for phase in PHASES for op in row.ops(phase)) <= per_micro_batch
    assert bubble == pytest.approx((2 - 1) / 2 * per_micro_batch, abs=len(rows))


def test_text_is_what_the_reader_reads(tiny_dirs, tmp_path):
    result = extract(str(tiny_dirs["gpt2"]), batch=1, seq=16, parallel=Parallel(tp=2, dp=2, vocab_multiple=8))
    document = from_rank(result.rank)
    assert text(document).count("\n") == len(document.rows) + 2
    (tmp_path / "w.txt").write_text(text(document))
    assert read_simai(tmp_path / "w.txt") == document


def test_chrome_trace_lays_out_every_unit_and_collective(tiny_dirs, tmp_path):
    code, out = _run(tmp_path, str(tiny_dirs["llama"]), "--batch", "2", "--seq", "16", "--format", "chrome-trace",
                     "--device", "h100-sxm", "--tp", "2", "--dp", "2", "--micro-batches", "2")
    assert code == 0
    trace = json.loads((out / "workload.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] < CLUSTER_PID]  # the rank's own
    result = extract(str(tiny_dirs["llama"]), batch=2, seq=16, device="h100-sxm",
                     parallel=Parallel(tp=2, dp=2, micro_batches=2))
    units = [u for u in result.rank.units if u.block != "dp"]
    compute_us = sum(e["dur"] for e in spans if e["cat"] == "compute" and e["name"] != "optimizer step (Adam)")
    assert compute_us == pytest.approx(2 * sum(_pass_ns(u, p) for u in units for p in PHASES) / 1e3, abs=1e-3 * len(spans))
    tp_spans = [e for e in spans if e["cat"] == "comm" and e["tid"] == 1]
    assert len(tp_spans) == 2 * sum(len(u.comms[FORWARD]) + len(u.comms[INPUT_GRAD]) for u in units)
    dp = [c for u in result.rank.units for c in u.comms[WEIGHT_GRAD]]
    assert len([e for e in spans if e["tid"] == 2]) == len(dp)
    device = load("h100-sxm")
    # NCCL's tuner on 2 ranks of a node (tuning.cc): the fastest of ring LL (6.6 + 2 x 0.6 us, Hopper's llMaxBw
    # 141 GB/s), LL128 (14 + 2 x 1.9 us, 0.92 x 370 GB/s), Simple (8.4 + 2 x 3.4 us, 370 GB/s) and NVLS (25 us)
    b = dp[0].bytes
    by_hand = min(7_800 + b / 141e9 * 1e9, 17_800 + b / (0.92 * 370e9) * 1e9, 15_200 + b / 370e9 * 1e9,
                  25_000 + b / (370e9 * 0.85 * 2 / 3) * 1e9)
    assert comm_ns(dp[0], result.rank.parallel, device) == pytest.approx(by_hand)
    dp_spans = sorted(e["dur"] for e in spans if e["tid"] == 2)
    assert dp_spans[0] * 1e3 == pytest.approx(min(comm_ns(c, result.rank.parallel, device) for c in dp), abs=1)
    passes = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] >= CLUSTER_PID and e["cat"] == "pass"]
    assert len(passes) == 2 * 2  # one stage: forward and backward of 2 micro-batches
    assert trace["otherData"]["cluster_step_ns"] == round(result.cluster.step_ns)
    ends = [e["ts"] + e["dur"] for e in spans]
    assert trace["otherData"]["step_ns"] == pytest.approx(max(ends) * 1e3, abs=1)
    timeline = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] in (0, 1))
    assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in itertools.pairwise(timeline))


@pytest.mark.parametrize("layout", [dict(dp=2, micro_batches=2), dict(tp=2, dp=2, zero=1, micro_batches=2),
                                    dict(pp=2, dp=2, zero=3, vpp=2, micro_batches=2),
                                    dict(pp=2, dp=2, zero=2, recompute="full", micro_batches=4)])
def test_the_cluster_timeline_adds_up_to_the_cluster_step(tiny_dirs, layout):
    """Every part of cluster_step_ns has a span: passes, gradient buckets, ZeRO's gathers (beside each
    pass for ZeRO 3, after the optimizer for 1 and 2) and the optimizer step."""
    result = extract(str(tiny_dirs["llama4"]), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**layout))
    trace = json.loads(result.files(["chrome-trace"])["workload.trace.json"])
    cluster = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] >= CLUSTER_PID]
    step_us = result.cluster.step_ns / 1e3
    assert max(e["ts"] + e["dur"] for e in cluster) == pytest.approx(step_us, abs=1e-3)
    slowest = max(result.cluster.devices, key=lambda d: d.end_ns)
    mine = [e for e in cluster if e["pid"] == CLUSTER_PID + slowest.device]
    names = {e["name"] for e in mine}
    assert "optimizer step (Adam)" in names
    assert ("ZeRO parameter gather" in names) == (layout.get("zero") in (1, 2))
    assert ("ZeRO 3 parameter gather" in names) == (layout.get("zero") == 3)
    optimizer = next(e for e in mine if e["name"] == "optimizer step (Adam)")
    assert optimizer["dur"] == pytest.approx(slowest.optimizer_ns / 1e3, abs=1e-3)
    # nothing of the step is left without a span: the compute stream is busy or waiting on a span's end
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["tid"] == 0)
    assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in itertools.pairwise(compute))


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads"),
    (["--tp", "4"], "--tp 4 does not divide the model's 2 key/value heads"),
    (["--ep", "2", "--dp", "2"], "--ep 2 needs a mixture-of-experts model"),
    (["--pp", "3"], "--pp 3 does not divide the model's 2 layers"),
    (["--pp", "2", "--pp-layers", "2,1"], "--pp-layers 2,1 must give 2 counts, each at least 1, summing to the model's 2"),
    (["--pp", "2", "--pp-layers", "2,0"], "--pp-layers 2,0 must give 2 counts (one per --pp stage), each at least 1"),
    (["--vocab-multiple", "0"], "--vocab-multiple must be a positive integer, got 0"),
    (["--bucket-mb", "nan"], "--bucket-mb must be 0 (one collective per parameter group) or a size up to"),
    (["--dp", "99999999999999999999"], "GPUs exceeds 1,048,576, more than any real run"),
    (["--micro-batches", "1000000", "--format", "chrome-trace"], "--micro-batches 1,000,000 exceeds 16,384"),
    (["--tp", "2", "--sp", "--seq", "15"], "--sp splits the sequence over --tp 2: --seq 15 does not divide by it"),
    (["--sp"], "--sp splits the sequence over the tensor-parallel group"),
    (["--pp", "2", "--stage", "2"], "--stage 2 is not a pipeline stage"),
    (["--zero", "4"], "--zero must be 0, 1, 2 or 3"),
    (["--dp", "0"], "--dp must be a positive integer"),
    (["--format", "simai,xml"], "unknown --format 'xml'"),
    (["--pp-layers", "a"], "--pp-layers must be comma-separated integers"),
    (["--format", "chrome-trace", "--device", "cpu", "--dp", "2"], "device 'cpu' has no interconnect figures"),
])
def test_bad_parallel_settings_are_one_line_and_write_nothing(tiny_dirs, tmp_path, capsys, args, message):
    code, out = _run(tmp_path, str(tiny_dirs["llama"]), "--seq", "16", *args)
    err = capsys.readouterr().err
    # one line, after at most the note that this CPU was measured (the cpu profile's first use) and, on a busy
    # machine, that the measurement is used for this run only
    assert code == 2 and message in err.splitlines()[-1] and "Traceback" not in err, err
    assert all(line.startswith(("measuring this CPU", "warning: this CPU's measurement is not to be trusted"))
               for line in err.splitlines()[:-1]), err
    assert not out.exists() or not any(out.iterdir())


def test_experts_must_divide_by_ep(tiny_dirs, tmp_path, capsys):
    code, _ = _run(tmp_path, str(tiny_dirs["mixtral"]), "--seq", "16", "--ep", "8", "--dp", "8")
    assert code == 2 and "--ep 8 does not divide the model's 4 experts" in capsys.readouterr().err


def test_vocabulary_must_divide_by_tp(tiny_dirs, tmp_path, capsys):
    code, _ = _run(tmp_path, str(tiny_dirs["gpt2"]), "--seq", "16", "--tp", "4", "--dp", "1")
    assert code == 0  # 96 tokens split four ways
    code, _ = _run(tmp_path, "gpt2", "--seq", "16", "--tp", "2")
    assert code == 2 and "does not divide the model's 50257 vocabulary" in capsys.readouterr().err


def test_a_model_without_a_tp_plan_has_one_unit_per_layer_and_refuses_tp(tmp_path, capsys):
    from transformers import CONFIG_MAPPING

    folder = tmp_path / "neo"
    CONFIG_MAPPING["gpt_neo"](num_layers=2, hidden_size=64, num_heads=4, vocab_size=96, max_position_embeddings=64,
                              attention_types=[[["global", "local"], 1]]).save_pretrained(folder)
    code, out = _run(tmp_path, str(folder), "--seq", "16", "--format", "simai")
    assert code == 0
    assert [r.name for r in read_simai(out / "workload.simai.txt").rows] == ["embedding_layer", "layer0", "layer1",
                                                                             "head"]
    code, _ = _run(tmp_path, str(folder), "--seq", "16", "--tp", "2", "--format", "simai")
    err = capsys.readouterr().err
    assert code == 2 and "gpt_neo has no tensor-parallel plan" in err.splitlines()[-1] and "Traceback" not in err


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_zero3_simai_rows_carry_every_gather_and_reduce_scatter_per_micro_batch(tiny_dirs, tmp_path, keep_gathered):
    """ZeRO 3 as the cluster step runs it (cluster/zero3.py), in SimAI's weight-gradient column (its only column
    for the data-parallel group, Workload.cc): per micro-batch and FSDP unit (a decoder layer, the embedding,
    the head) one gradient reduce-scatter and a parameter all-gather for forward, and one for backward unless
    --keep-gathered. The oracle: the tiny Llama's parameter count (fp32) and the micro-batch count."""
    extra = ["--keep-gathered"] if keep_gathered else []
    code, out = _run(tmp_path, str(tiny_dirs["llama"]), "--seq", "16", "--format", "simai", "--dp", "2",
                     "--micro-batches", "3", "--zero", "3", *extra)
    assert code == 0
    rows = read_simai(out / "workload.simai.txt").rows
    model = _meta_model(tiny_dirs["llama"])
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters())
    units = 1 + model.config.num_hidden_layers + 1  # embedding, layers, head (norm and lm_head)
    scatters = [r for r in rows if r.weight_grad_comm == "REDUCESCATTER"]
    gathers = [r for r in rows if r.weight_grad_comm == "ALLGATHER"]
    assert len(scatters) == 3 * units and sum(r.weight_grad_comm_bytes for r in scatters) == 3 * parameter_bytes
    assert len(gathers) == 3 * units * (1 if keep_gathered else 2)
    assert sum(r.weight_grad_comm_bytes for r in gathers) == 3 * parameter_bytes * (1 if keep_gathered else 2)


def test_zero3_simai_rows_reduce_scatter_once_when_gradients_accumulate_unsharded(tiny_dirs, tmp_path):
    """--accumulate-unsharded (FSDP2 without gradient sync until the last micro-batch): each FSDP unit
    reduce-scatters its gradients once a step, in the last micro-batch, the whole parameter count's bytes
    (the tiny Llama in fp32), where every micro-batch did before; the middle micro-batch's sums stand as rows
    without a collective (NONE), the first's not at all (one dtype: autograd's gradient is kept)."""
    code, out = _run(tmp_path, str(tiny_dirs["llama"]), "--seq", "16", "--format", "simai", "--dp", "2",
                     "--micro-batches", "3", "--zero", "3", "--accumulate-unsharded")
    assert code == 0
    rows = read_simai(out / "workload.simai.txt").rows
    model = _meta_model(tiny_dirs["llama"])
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters())
    units = 1 + model.config.num_hidden_layers + 1
    scatters = [r for r in rows if r.weight_grad_comm == "REDUCESCATTER"]
    assert len(scatters) == units and sum(r.weight_grad_comm_bytes for r in scatters) == parameter_bytes
    sums = [r for r in rows if "_reducescatter_" in r.name and r.weight_grad_comm == "NONE"]
    assert len(sums) == 2 * units and all(r.weight_grad_ns > 0 for r in sums)


def _meta_model(folder):
    """The checkpoint's model as transformers builds it (on the meta device: only its parameters' shapes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


@pytest.mark.parametrize("layout", [dict(dp=2, zero=3, micro_batches=2),
                                    dict(dp=2, zero=3, reshard_after_forward=False, micro_batches=2),
                                    dict(pp=2, dp=2, vpp=2, zero=1, micro_batches=4), dict(cp=2, micro_batches=2)])
def test_every_chrome_trace_span_ends_by_the_cluster_step(tiny_dirs, layout):
    """Issue 36: a --keep-gathered trace's rank step (1,701.5 ms) outlasted its cluster step (1,690.2 ms). The
    rank's spans are now laid inside its stage's passes as the cluster step times them: none ends after the
    step, and the rank's step is its stage's end."""
    result = extract(str(tiny_dirs["llama4"]), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**layout))
    trace = json.loads(result.files(["chrome-trace"])["workload.trace.json"])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    step_us = trace["otherData"]["cluster_step_ns"] / 1e3
    assert max(e["ts"] + e["dur"] for e in spans) <= step_us + 1e-3
    assert trace["otherData"]["step_ns"] == round(result.cluster.devices[0].end_ns) <= trace["otherData"]["cluster_step_ns"]


def test_keep_gathered_changes_the_files_as_it_changes_the_step(tiny_dirs):
    """Issue 36: --keep-gathered changed the step but wrote files byte-identical to plain ZeRO 3. Without the
    backward's gathers the step is shorter and the SimAI file has fewer all-gathers."""
    plain, kept = (extract(str(tiny_dirs["llama4"]), batch=1, seq=16, device="h100-sxm",
                           parallel=Parallel(dp=2, zero=3, micro_batches=2, reshard_after_forward=reshard))
                   for reshard in (True, False))
    assert kept.cluster.step_ns < plain.cluster.step_ns
    count = lambda r: r.files(["simai"])["workload.simai.txt"].count("ALLGATHER")  # noqa: E731
    assert count(kept) * 2 == count(plain)


def test_overlapped_tp_collectives_are_folded_into_simai_compute(tiny_dirs):
    """SimAI would run a TP collective as a blocking one (Workload.cc): with --tp-comm-overlap a block row carries
    no TP collective, and its compute holds what the collectives expose (cluster.step.exposed_comms_ns)."""
    from fxworkload.cluster.step import exposed_comms_ns

    result = extract(str(tiny_dirs["llama"]), batch=2, seq=64, device="h100-sxm",
                     parallel=Parallel(tp=2, sp=True, tp_comm_overlap=True))
    rows = {r.name: r for r in from_rank(result.rank, result.device).rows}
    p = result.rank.parallel
    for unit in (u for u in result.rank.units if u.layer is not None):
        row = rows[unit.name]
        assert (row.forward_comm, row.input_grad_comm) == ("NONE", "NONE")
        exposed = exposed_comms_ns(unit, FORWARD, p, result.device)["tp"]
        assert row.forward_ns == round(_pass_ns(unit, FORWARD) + exposed)
    assert rows["head"].forward_comm != "NONE"  # the head's vocabulary-parallel collectives stay blocking


@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_simai_rows_carry_fsdp2s_copies_as_the_step_runs_them(tiny_dirs, reshard):
    """FSDP2's copy kernels (cluster/zero3.py) are compute the step spends: the SimAI file holds the same
    time, each in the pass that runs it: the ZeRO 3 rows' compute (the file repeats them for each micro-batch)
    sums to the cluster step's zero3_copy_ns; the forward gathers' copy-outs in the forward column, the
    backward's (none when the forward's parameters are kept) in the input-gradient column."""
    result = extract(str(tiny_dirs["llama4"]), batch=1, seq=16, dtype="bf16", grad_dtype="fp32", device="h100-sxm",
                     parallel=Parallel(dp=2, zero=3, micro_batches=2, reshard_after_forward=reshard))
    rows = [r for r in from_rank(result.rank, result.device).rows if "_param_allgather_" in r.name
            or "_reducescatter_" in r.name]
    copies_ns = sum(r.forward_ns + r.input_grad_ns + r.weight_grad_ns for r in rows)
    assert copies_ns == pytest.approx(result.cluster.devices[0].zero3_copy_ns, abs=len(rows))  # whole ns a row
    assert all(r.forward_ns > 0 for r in rows if r.name.endswith("_forward"))
    assert all(r.input_grad_ns > 0 for r in rows if r.name.endswith("_backward"))
    assert any(r.name.endswith("_backward") for r in rows) == reshard
    assert all(r.weight_grad_ns > 0 for r in rows if "_reducescatter_" in r.name)


def test_a_bad_layout_is_the_only_line_when_the_step_comes_from_the_cache(tiny_dirs, tmp_path, capsys):
    """The first run captures the step and caches it; the second, with a layout the model cannot take, reads the
    cached step's facts and says only what is wrong (no "read the captured step from the cache" line first)."""
    code, _ = _run(tmp_path / "a", str(tiny_dirs["llama"]), "--seq", "16")
    assert code == 0
    capsys.readouterr()
    code, out = _run(tmp_path / "b", str(tiny_dirs["llama"]), "--seq", "16", "--pp", "3")
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == ["fxworkload: error: --pp 3 does not divide the model's 2 layers; choose "
                                              "a --pp that divides it or give --pp-layers"], err
    assert not out.exists() or not any(out.iterdir())


def test_zero3_simai_rows_carry_the_waits_on_fsdp2s_hooks_as_the_step_runs_them(tiny_dirs):
    """The tiny Llama at seq 16 is host-bound: ZeRO 3's step waits on FSDP2's hooks around each unit
    (cluster/zero3.py). The SimAI file holds that wait as compute too: its rows sum to the ZeRO 1 file's plus the
    step's extra wait on the host over its two micro-batches (the file lists its rows once per micro-batch), within a
    whole ns a row."""
    run = dict(batch=1, seq=16, dtype="bf16", grad_dtype="fp32", device="h100-sxm")
    zero1 = extract(str(tiny_dirs["llama4"]), parallel=Parallel(dp=2, zero=1, micro_batches=2), **run)
    zero3 = extract(str(tiny_dirs["llama4"]), parallel=Parallel(dp=2, zero=3, micro_batches=2), **run)

    def compute_ns(result, rows_of):
        return sum(r.forward_ns + r.input_grad_ns + r.weight_grad_ns for r in rows_of(result))

    model_rows = lambda result: [r for r in from_rank(result.rank, result.device).rows  # noqa: E731
                                 if "_param_allgather_" not in r.name and "_reducescatter_" not in r.name
                                 and "_allreduce" not in r.name and "_comm" not in r.name]
    waited = zero3.cluster.devices[0].host_wait_ns - zero1.cluster.devices[0].host_wait_ns
    assert waited > 0
    rows = model_rows(zero3)
    assert compute_ns(zero3, model_rows) == pytest.approx(compute_ns(zero1, model_rows) + waited, abs=len(rows))


OVERLAPPED_TP = dict(tp=2, sp=True, micro_batches=2, tp_comm_overlap=True)


@pytest.mark.parametrize("stack, layout", [("eager", OVERLAPPED_TP), ("compiled", OVERLAPPED_TP),
                                           ("eager", dict(cp=2, micro_batches=2)),
                                           ("compiled", dict(tp=2, sp=True, micro_batches=2))])
def test_chrome_trace_passes_wait_for_the_collectives_beside_their_compute(tiny_dirs, stack, layout):
    """--tp-comm-overlap (userbuffers under eager, AsyncTP under compiled) and CP's ring: the collectives run
    beside the unit's compute, and the pass waits, after its compute, for what they outlast what they overlap
    by (and AsyncTP's own kernels), as the cluster step counts it; plain sequence parallelism's copies around
    its collectives (the sequence on dim 1) run on the compute thread too: each pass's spans on the rank end
    where the cluster step's pass ends (2,048 sequences: collectives that outlast some of their GEMMs)."""
    result = extract(str(tiny_dirs["llama"]), batch=2048, seq=64, device="h100-sxm", stack=stack,
                     parallel=Parallel(**layout))
    trace = json.loads(result.files(["chrome-trace"])["workload.trace.json"])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["tid"] in (0, 1)]
    waits = [e for e in spans if e["name"] in ("waiting for the collectives beside its compute",
                                               "copies around its tensor-parallel collectives (sequence on dim 1)")]
    assert waits and all(e["dur"] > 0 for e in waits)
    for _, _, _, start_ns, end_ns in result.cluster.device_passes[0]:
        inside = [e for e in spans if start_ns / 1e3 - 1e-3 <= e["ts"] < end_ns / 1e3 - 1e-3]
        assert max(e["ts"] + e["dur"] for e in inside) == pytest.approx(end_ns / 1e3, abs=2e-3)
