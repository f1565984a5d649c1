"""compare on torch.profiler traces: real CPU traces of eager training steps of tiny models, tied to
the extracted workload's rows; the trace's own totals, read from its JSON here, are the oracle."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxworkload.errors import UserError
from fxworkload.measure.compare import compare, comparison_json, detect_format, load_measured, overall
from fxworkload.measure.profiler_trace import BACKWARD_ROOT, measured_document
from fxworkload.pipeline import extract

from ..conftest import tiny_config
from ..test_cli import fxworkload
from .cuda_events import NO_KERNEL, kernel, launch, with_structural_times, write

BATCH, SEQ = 2, 16


def profile_steps(model_type: str, path, steps: int = 1) -> None:
    """What a user does: an eager training step under torch.profiler, exported as Chrome JSON."""
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # warm-up, outside the trace
    if steps == 1:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        prof.export_chrome_trace(str(path))
        return
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)  # ProfilerStep#N annotations
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(1 + steps):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            prof.step()


@pytest.fixture(scope="module")
def traced(tiny_dirs, tmp_path_factory):
    """model_type -> (workload.json document, trace path, its folder)."""
    out = {}
    for model_type in ("gpt2", "llama", "mixtral"):
        folder = tmp_path_factory.mktemp(f"trace-{model_type}")
        profile_steps(model_type, folder / "trace.json")
        result = extract(str(tiny_dirs[model_type]), batch=BATCH, seq=SEQ, trace_on="cpu", device="cpu")
        result.write(folder / "estimated", ["tables"])
        out[model_type] = (json.loads((folder / "estimated" / "workload.json").read_text()), folder / "trace.json", folder)
    return out


def top_level_ops(trace_path) -> list[dict]:
    """The trace's own top-level CPU ops (no op of the same thread encloses them), read from its JSON."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
                 key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    top, open_until = [], {}
    for op in ops:
        if op["ts"] >= open_until.get(op["tid"], float("-inf")):
            top.append(op)
            open_until[op["tid"]] = op["ts"] + op["dur"]
    return top


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mixtral"])
def test_at_least_95_percent_of_op_time_is_tied_to_graph_nodes(traced, model_type, tmp_path):
    estimated, recorded, _ = traced[model_type]
    trace_path = tmp_path / "structural.json"  # op time as the ops nest, not as the loaded machine timed them
    with_structural_times(recorded, trace_path)
    measured = measured_document(trace_path, estimated)
    top = top_level_ops(trace_path)
    backward_ns = 1e3 * sum(op["dur"] for op in top if op["name"].startswith(BACKWARD_ROOT))
    first_backward = min(op["ts"] for op in top if op["name"].startswith(BACKWARD_ROOT))
    forward_ns = 1e3 * sum(op["dur"] for op in top if op["ts"] < first_backward)
    trace = measured["trace"]
    assert trace["total_ns"] == pytest.approx(forward_ns + backward_ns, rel=1e-6)
    assert trace["attributed_ns"] + sum(trace["unattributed_ns"].values()) == pytest.approx(trace["total_ns"], rel=1e-9)
    rows = measured["rows"]
    forward_tied = sum(r["forward_measured_ns"] for r in rows)
    backward_tied = sum(r["input_grad_measured_ns"] + r["weight_grad_measured_ns"] for r in rows)
    assert forward_tied + backward_tied == pytest.approx(trace["attributed_ns"], rel=1e-9)
    print(f"{model_type}: forward {forward_tied / forward_ns:.3f}, backward {backward_tied / backward_ns:.3f}, "
          f"step {trace['attributed_fraction']:.3f} tied")
    # transformers' check for packed sequences (below) is eager work the graph has no node for, left out of the bar
    packed_check_ns = sum(ns for name, ns in trace["unattributed_ns"].items()
                          if name in ("aten::diff", "aten::cumsum", "aten::all", "aten::eq", "aten::ne"))
    assert trace["attributed_ns"] >= 0.95 * (trace["total_ns"] - packed_check_ns), trace["unattributed_ns"]
    assert backward_tied >= 0.95 * backward_ns and backward_tied <= backward_ns * (1 + 1e-9)
    # The forward's rest is eager transformers' check for packed sequences (diff, cumsum, all), which the
    # capture answers at trace time: real time the graph has no node for, reported by name.
    assert forward_tied >= 0.85 * forward_ns and forward_tied <= forward_ns * (1 + 1e-9)
    assert {"aten::diff", "aten::cumsum"} <= set(trace["unattributed_ns"])


def test_an_op_and_its_backward_carry_the_time_the_trace_gives_them(traced):
    """By hand: GPT-2's first Linear (c_attn, an addmm) and the AddmmBackward0 with its sequence number."""
    estimated, trace_path, _ = traced["gpt2"]
    measured = {r["name"]: r for r in measured_document(trace_path, estimated)["rows"]}
    top = top_level_ops(trace_path)
    addmm = next(op for op in top if op["name"] == "aten::addmm")
    backward = next(op for op in top if op["name"] == BACKWARD_ROOT + "AddmmBackward0"
                    and op["args"]["Sequence number"] == addmm["args"]["Sequence number"])
    after = top[top.index(backward) + 1:]
    accumulated = after[:next(i for i, op in enumerate(after) if not op["name"].endswith("AccumulateGrad"))]
    assert len(accumulated) == 2  # c_attn's weight and bias gradients, stored into .grad
    row = measured["transformer_h_0_attn_c_attn"]
    assert row["forward"]["op"] == "aten.addmm.default"
    assert row["forward"]["measured_ns"] == pytest.approx(1e3 * addmm["dur"], rel=1e-9)
    assert row["input_grad_measured_ns"] + row["weight_grad_measured_ns"] == pytest.approx(
        1e3 * (backward["dur"] + sum(op["dur"] for op in accumulated)), rel=1e-9)
    assert {op["op"] for op in row["weight_grad"]} >= {"aten.mm.default", "aten.sum.dim_IntList"}


def test_gzipped_trace_reads_the_same(traced, tmp_path):
    estimated, trace_path, _ = traced["llama"]
    zipped = tmp_path / "trace.json.gz"
    zipped.write_bytes(gzip.compress(trace_path.read_bytes()))
    assert detect_format(zipped) == "torch-profiler"
    plain, packed = (measured_document(p, estimated) for p in (trace_path, zipped))
    assert plain["rows"] == packed["rows"]


def test_several_profiler_steps_give_each_op_its_median(tmp_path, traced):
    estimated, _, _ = traced["gpt2"]
    profile_steps("gpt2", tmp_path / "three.json", steps=3)
    measured = measured_document(tmp_path / "three.json", estimated)
    assert measured["trace"]["steps"] == 3
    ops = [op for op in top_level_ops(tmp_path / "three.json") if op["name"] == "aten::addmm"]
    first_of_each_step = sorted(1e3 * op["dur"] for op in ops[::len(ops) // 3])
    row = next(r for r in measured["rows"] if r["name"] == "transformer_h_0_attn_c_attn")
    assert row["forward"]["measured_ns"] == pytest.approx(first_of_each_step[1], rel=1e-9)


def test_compare_writes_comparison_json_with_the_attributed_fraction(traced, tmp_path):
    estimated, recorded, folder = traced["mixtral"]
    trace_path = tmp_path / "structural.json"  # op time as the ops nest, not as the loaded machine timed them
    with_structural_times(recorded, trace_path)
    run = fxworkload("compare", str(folder / "estimated"), str(trace_path), "--out", str(tmp_path / "cmp"))
    assert run.returncode == 0, run.stderr
    document = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    # what is not tied is eager MoE routing's data-dependent index work the traced graph has no node for
    # (aten::diff, cumsum, all, ...): 2.6 % of the structural op time
    assert document["attributed_fraction"] >= 0.85
    assert {"aten::diff", "aten::cumsum"} & set(document["trace"]["unattributed_ns"])
    assert "tied to graph nodes" in run.stdout
    expected = compare(estimated, load_measured(trace_path, estimated))
    assert document == json.loads(comparison_json(expected))
    step = next(p for p in document["phases"] if p["span"] == "step")
    assert step["measured_ns"] == pytest.approx(sum(n[f"{ph}_measured_ns"] for n in measured_rows(trace_path, estimated)
                                                    for ph in ("forward", "input_grad", "weight_grad")))


def measured_rows(trace_path, estimated):
    return measured_document(trace_path, estimated)["rows"]


@pytest.mark.parametrize("content, says", [
    (b"", "not complete JSON"),
    (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1', "not complete JSON"),
    (b'{"schemaVersion": 1, "traceEvents": []}', "no profiler ops"),
    (gzip.compress(b'{"traceEvents": [', mtime=0)[:-6], "a truncated gzip file"),  # no timestamp: one test id in every xdist worker
])
def test_a_broken_trace_is_one_line(traced, tmp_path, content, says):
    _, _, folder = traced["gpt2"]
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    run = fxworkload("compare", str(folder / "estimated"), str(bad), "--measured-format", "torch-profiler",
                                "--out", str(tmp_path / "never"))
    assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "never").exists()


def test_a_foreign_file_is_named_as_such(traced, tmp_path):
    _, _, folder = traced["gpt2"]
    foreign = tmp_path / "notes.json"
    foreign.write_text("hello, this is not a trace\n")
    run = fxworkload("compare", str(folder / "estimated"), str(foreign))
    assert run.returncode == 2 and "neither measured.json, a profiler trace nor a Megatron timing log" in run.stderr


def test_a_trace_of_another_model_is_refused(traced, tmp_path):
    _, _, folder = traced["gpt2"]
    _, llama_trace, _ = traced["llama"]
    run = fxworkload("compare", str(folder / "estimated"), str(llama_trace), "--out", str(tmp_path / "x"))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert "another step" in run.stderr or "no training step of this model" in run.stderr
    assert not (tmp_path / "x").exists()


def test_a_trace_of_other_shapes_is_refused(traced, tiny_dirs, tmp_path):
    _, trace_path, _ = traced["gpt2"]
    other = extract(str(tiny_dirs["gpt2"]), batch=1, seq=SEQ, trace_on="cpu", device="cpu")
    other.write(tmp_path / "b1", ["tables"])
    with pytest.raises(UserError, match="another step"):
        load_measured(trace_path, json.loads((tmp_path / "b1" / "workload.json").read_text()))


def test_profiler_trace_without_hta_says_how_to_install(traced, tmp_path, monkeypatch):
    estimated, trace_path, _ = traced["gpt2"]
    import builtins

    real_import = builtins.__import__

    def no_hta(name, *args, **kwargs):
        if name.startswith("hta"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hta)
    with pytest.raises(UserError, match=r"fxworkload\[traces\]"):
        measured_document(trace_path, estimated)


def test_calibrate_from_a_trace_fits_a_profile_that_reproduces_its_step(traced, tmp_path, tiny_dirs):
    """Fitted to the Llama trace, the profile gives back that step's GEMM time (the rate is pooled
    net of the overhead, so Σ overhead + FLOPs / rate is Σ measured) and its overhead is the median
    of the small ops, by hand. How it predicts other models is bench/trace_calibration.py's job."""
    import statistics

    from fxworkload.cost import devices
    from fxworkload.measure.compare import kind_summary

    estimated, trace_path, folder = traced["llama"]
    run = fxworkload("calibrate", "--from", trace_path, "--estimated", folder / "estimated", "--name", "fit-llama")
    assert run.returncode == 0, run.stderr
    profile = json.loads(devices.measured_path("fit-llama").read_text())
    measured = measured_document(trace_path, estimated)
    small = [op["measured_ns"] for row in measured["rows"] for ph in ("forward", "input_grad", "weight_grad")
             for op in ([row[ph]] if ph == "forward" else row[ph])
             if op and op["kind"] not in ("view", "matmul") and 0 < op["bytes"] <= 64 << 10 and op["measured_ns"] > 0]
    assert profile["kernel_launch_ns"] == pytest.approx(statistics.median(small))
    assert profile["matmul_flops_per_s"]["fp32"] > 0 and profile["vector_flops_per_s_by_op"]
    refit = extract(str(tiny_dirs["llama"]), batch=BATCH, seq=SEQ, trace_on="cpu", device="fit-llama")
    refit.write(tmp_path / "llama-fit", ["tables"])
    document = json.loads((tmp_path / "llama-fit" / "workload.json").read_text())
    matmul = next(k for k in kind_summary(compare(document, measured)) if k["kind"] == "matmul")
    print(f"GEMM time of the fitted step: estimated {matmul['estimated_ns'] / 1e6:.3f} ms, "
          f"measured {matmul['measured_ns'] / 1e6:.3f} ms")
    # By hand: each GEMM is overhead + FLOPs / rate, the rate pooled over the GEMMs' time net of the overhead
    # (a GEMM shorter than the overhead counts a tenth of its time, calibrate's floor), so the GEMMs together
    # take n x overhead + the sum of their net times: the trace's GEMM time wherever no floor applies.
    gemms = [op["measured_ns"] for row in measured["rows"] for ph in ("forward", "input_grad", "weight_grad")
             for op in ([row[ph]] if ph == "forward" else row[ph])
             if op and op["kind"] == "matmul" and op["measured_ns"] > 0]
    launch = profile["kernel_launch_ns"]
    by_hand = len(gemms) * launch + sum(max(m - launch, 0.1 * m) for m in gemms)
    assert matmul["estimated_ns"] == pytest.approx(by_hand, rel=0.02)


def test_calibrate_from_needs_its_workload_and_a_name(traced):
    _, trace_path, folder = traced["gpt2"]
    run = fxworkload("calibrate", "--from", trace_path, "--name", "x1")
    assert run.returncode == 2 and "--from TRACE and --estimated WORKLOAD go together" in run.stderr
    run = fxworkload("calibrate", "--from", trace_path, "--estimated", folder / "estimated")
    assert run.returncode == 2 and "--from needs --name" in run.stderr


def with_kernels(trace_path, out_path) -> dict:
    """A CUDA-style trace made from a CPU one: every leaf op that computes launches one kernel through
    cudaLaunchKernel (linked by correlation id, as Kineto writes them); one kernel has no launching
    op, and a record_param_comms op launches an nccl kernel. Returns what was built."""
    document = json.loads(trace_path.read_text())
    ops = [e for e in document["traceEvents"] if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    ops.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    leaves = [op for i, op in enumerate(ops)
              if not (i + 1 < len(ops) and ops[i + 1]["tid"] == op["tid"] and ops[i + 1]["ts"] < op["ts"] + op["dur"])]
    added, kernel_ns = [], {}
    pid, tid = ops[0]["pid"], ops[0]["tid"]
    for correlation, op in enumerate((op for op in leaves if op["name"] not in NO_KERNEL and op["dur"] > 0), start=1):
        duration_us = 1.0 + correlation % 7
        added += launch(op, op["ts"] + op["dur"] / 4, op["dur"] / 2, f"void kernel_{op['name']}", duration_us, correlation)
        kernel_ns[id(op)] = 1e3 * duration_us
    end = max(op["ts"] + op["dur"] for op in ops)
    comm = {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": tid, "ts": end + 10, "dur": 20,
            "args": {}}
    added += [comm, *launch(comm, end + 15, 5, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40.0, 900001, end + 16),
              kernel("void orphan_kernel", end + 60, 3.0, 900002)]
    write(document, added, out_path)
    return {"leaves": leaves, "kernel_ns": kernel_ns, "ops": ops}


def test_a_cuda_trace_ties_kernels_to_nodes_through_their_launches(traced, tmp_path):
    estimated, trace_path, _ = traced["gpt2"]
    built = with_kernels(trace_path, tmp_path / "cuda.json")
    measured = measured_document(tmp_path / "cuda.json", estimated)
    trace = measured["trace"]
    assert trace["unit"] == "kernel" and "H100" in measured["settings"]["device"]
    compute_ns = sum(built["kernel_ns"].values())
    assert trace["total_ns"] == pytest.approx(compute_ns + 40e3 + 3e3)
    assert trace["communication_ns"] == pytest.approx(40e3)
    spans = {s["span"]: s for s in overall(compare(estimated, measured))}
    assert spans["communication"]["measured_ns"] == pytest.approx(40e3) and spans["communication"]["error"] is None
    assert trace["unattributed_ns"]["(kernels no op launched)"] == pytest.approx(3e3)
    # Kernels are tied as the ops that launched them are: what is left over is what the CPU trace left.
    on_cpu = measured_document(trace_path, estimated)["trace"]["unattributed_ns"]
    assert set(trace["unattributed_ns"]) - {"(kernels no op launched)"} <= set(on_cpu)
    assert trace["attributed_ns"] >= 0.85 * compute_ns
    addmm = next(op for op in top_level_ops(trace_path) if op["name"] == "aten::addmm")
    under = sum(ns for op in built["leaves"] for key, ns in built["kernel_ns"].items() if key == id(op)
                and op["tid"] == addmm["tid"] and addmm["ts"] <= op["ts"] < addmm["ts"] + addmm["dur"])
    row = next(r for r in measured["rows"] if r["name"] == "transformer_h_0_attn_c_attn")
    assert under > 0 and row["forward"]["measured_ns"] == pytest.approx(under)


def _steps_without_markers(path, steps: int, optimizer: bool = False) -> None:
    config = tiny_config("gpt2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    adam = torch.optim.AdamW(model.parameters())
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            if optimizer:
                adam.step()
                adam.zero_grad(set_to_none=True)
    prof.export_chrome_trace(str(path))


def test_compare_explains_a_trace_it_cannot_read_as_meant(traced, tiny_dirs, tmp_path):
    """Issue 28 §3: three iterations without ProfilerStep markers are flagged, the optimizer's ops are
    reported as its step, and a CPU trace against a GPU-traced estimate names the command that fixes it."""
    _steps_without_markers(tmp_path / "three.json", steps=3, optimizer=True)
    _, _, folder = traced["gpt2"]
    run = fxworkload("compare", folder / "estimated", tmp_path / "three.json", "--out", tmp_path / "c3")
    assert run.returncode == 0, run.stderr
    report = (tmp_path / "c3" / "comparison.txt").read_text()
    assert "holds 3 training steps but no ProfilerStep markers" in report
    assert "optimizer step (AdamW.step)" in report
    gpu_traced = tmp_path / "gpu-est"
    assert fxworkload("extract", tiny_dirs["gpt2"], "--batch", BATCH, "--seq", SEQ, "--device", "h100-sxm",
                      "--out", gpu_traced).returncode == 0
    run = fxworkload("compare", gpu_traced, folder / "trace.json", "--out", tmp_path / "cg")
    assert run.returncode == 0, run.stderr
    report = (tmp_path / "cg" / "comparison.txt").read_text()
    assert "the trace ran on the CPU but the estimate's graph follows CUDA's dispatch" in report
    assert f"--batch {BATCH} --seq {SEQ} --dtype fp32 --trace-on cpu --device cpu" in report
    single = (folder / "estimated" / "workload.json")
    run = fxworkload("compare", single, folder / "trace.json", "--out", tmp_path / "c1")
    report = (tmp_path / "c1" / "comparison.txt").read_text()
    assert "WARNING" not in report  # one step, traced as it ran: nothing to explain


def test_a_users_own_loop_is_set_against_the_estimate_with_every_untied_op_named(tiny_dirs, tmp_path):
    """The issue's loop as HF users write it: a checkpoint loaded with from_pretrained (eval mode, so no dropout
    runs), AdamW, zero_grad, use_cache at its default, schedule(wait=1, warmup=1, active=3), prof.step(). compare
    says the loop ran without dropout and names --no-dropout; extracted so, the trace's own op time (its JSON,
    the oracle, timed by how its ops nest) is tied to graph nodes or to the optimizer the estimate prices for at
    least 95 %, and every op
    tied to no node is listed with its reason (the KV cache's cat among them)."""
    from transformers import AutoModelForCausalLM as Auto

    checkpoint = tmp_path / "checkpoint"
    torch.manual_seed(0)
    Auto.from_config(tiny_config("gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)).save_pretrained(checkpoint)
    model = Auto.from_pretrained(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    recorded = tmp_path / "trace.json"
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(recorded))) as prof:
        for _ in range(5):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    trace = tmp_path / "structural.json"  # op time as the ops nest, not as the loaded machine timed them
    with_structural_times(recorded, trace)
    reports = {}
    for dropout in (True, False):
        estimated = tmp_path / f"estimated-{dropout}"
        extract(str(checkpoint), batch=BATCH, seq=SEQ, trace_on="cpu", device="cpu", dropout=dropout).write(
            estimated, ["tables"])
        run = fxworkload("compare", estimated, trace, "--out", tmp_path / f"compared-{dropout}")
        assert run.returncode == 0, run.stderr
        reports[dropout] = (run.stdout, json.loads((tmp_path / f"compared-{dropout}" / "comparison.json").read_text()))
    assert "extract with --no-dropout" in reports[True][0] and "--no-dropout" not in reports[False][0]
    report, document = reports[False]
    own_ns = sum(op["dur"] for op in top_level_ops(trace)) * 1e3 / 3  # the trace's top-level CPU ops, per step
    trace_totals = document["trace"]
    assert trace_totals["total_ns"] == pytest.approx(own_ns, rel=0.02)
    optimizer_ns = sum(ns for name, ns in trace_totals["unattributed_ns"].items() if name.startswith("optimizer"))
    assert optimizer_ns > 0 and "optimizer step: measured" in report
    assert (trace_totals["attributed_ns"] + optimizer_ns) / own_ns >= 0.95
    untied = [line for line in report.splitlines() if line.startswith("  untied ")]
    assert len(untied) == len(trace_totals["unattributed_ns"]) and all(": " in line for line in untied)
    assert any("aten::cat" in line and "use_cache" in line for line in untied)
    # lm_head's weight-gradient GEMM, which autograd runs before the input's, is paired with the trace's GEMM of its shapes
    assert any(op["row"] == "lm_head" and op["phase"] == "weight_grad" and op["op"] == "aten.mm.default"
               for op in document["ops"])
    own = document["own_loop"]
    assert own["set_against_fraction"] >= 0.95 and len(own["untied"]) == len(untied)
    assert reports[True][1]["own_loop"]["dropout_off_in_measured"] and not own["dropout_off_in_measured"]
