"""profile, compare and calibrate: measured runs checked against eager autograd and by hand."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxworkload.cost import devices
from fxworkload.measure.compare import compare, kind_summary, overall
from fxworkload.errors import UserError
from fxworkload.pipeline import extract
from fxworkload.parallel.layout import Parallel
from fxworkload.formats.tables import json_text, measured_json_text, tsv_text
from fxworkload.measure.profile import profile, verify

from ..conftest import tiny_config
from ..test_cli import fxworkload, in_process


@pytest.fixture(scope="module")
def measured_gpt2(tiny_dirs):
    return profile(str(tiny_dirs["gpt2"]), batch=2, seq=16, on="cpu", repeat=2, warmup=1)


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert", "mixtral"])
def test_node_by_node_step_equals_eager_autograd(tiny_dirs, model_type):
    result = profile(str(tiny_dirs[model_type]), batch=1, seq=8, on="cpu", repeat=1, warmup=0)
    check = result.verification
    assert check["equal"] and check["graph_loss"] == pytest.approx(check["eager_loss"], rel=1e-5)
    assert check["max_gradient_relative_difference"] <= 1e-4
    kernel_ops = [op for op in result.workload.ops() if op.kind != "view"]
    assert all(result.timings[op.fx_name].median_ns > 0 for op in kernel_ops)


def test_verification_names_a_gradient_that_differs(tiny_dirs):
    """Feed the graph one perturbed weight: the check must notice and name it."""
    result = profile(str(tiny_dirs["gpt2"]), batch=1, seq=8, on="cpu", repeat=1, warmup=0)
    from fxworkload.capture import models
    from fxworkload.capture.trace import capture_training_step

    spec = models.resolve(str(tiny_dirs["gpt2"]))
    module = models.build_real_model(spec, torch.float32, torch.device("cpu"))
    capture = capture_training_step(module, 1, 8)
    names = [name for name, _ in module.named_parameters()]
    values = [p.detach().clone() for p in module.parameters()]
    target = names.index("transformer.h.1.mlp.c_fc.weight")
    values[target] += 0.5
    with pytest.raises(UserError, match="the node-by-node step does not reproduce eager"):
        verify(module, capture.graph_module, values, torch.zeros(1, 8, dtype=torch.long), names, "fp32")
    assert result.verification["equal"]


def test_measured_table_lines_up_with_the_estimated_one(tiny_dirs, measured_gpt2):
    estimated = extract(str(tiny_dirs["gpt2"]), batch=2, seq=16, trace_on="cpu")
    e_lines = tsv_text(estimated.workload, "bytes").splitlines()
    m_lines = tsv_text(measured_gpt2.workload, "bytes", measured_gpt2.op_ns).splitlines()
    assert [line.split("\t")[0] for line in e_lines] == [line.split("\t")[0] for line in m_lines]
    assert all(len(line.split("\t")) == 11 for line in m_lines)
    # every row's measured times are the sums of its ops' medians, summed again to the phase totals
    document = json.loads(measured_json_text(measured_gpt2))
    for phase in ("forward", "input_grad", "weight_grad"):
        ops = [op for row in document["rows"] if row["type"] == "node"
               for op in ([row[phase]] if phase == "forward" else row[phase])]
        assert sum(op["measured_ns"] for op in ops) == pytest.approx(document["totals"][f"{phase}_measured_ns"])
        assert all(op["measured_min_ns"] <= op["measured_ns"] <= op["measured_max_ns"] for op in ops)


def test_checkpoint_weights_are_the_ones_measured(tmp_path):
    config = tiny_config("gpt2")
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    result = profile(str(tmp_path), batch=1, seq=8, on="cpu", repeat=1, warmup=0)
    assert result.settings["weights"] == "its checkpoint weights"
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    assert result.verification["eager_loss"] == pytest.approx(reference(ids, labels=ids).loss.item(), rel=1e-6)


def _documents(tiny_dirs, measured, **extract_args):
    estimated = extract(str(tiny_dirs["gpt2"]), **{"batch": 2, "seq": 16, "trace_on": "cpu", **extract_args})
    return (json.loads(json_text(estimated.workload, estimated.settings, {})),
            json.loads(measured_json_text(measured)))


def test_compare_sums_and_errors_by_hand(tiny_dirs, measured_gpt2):
    estimated, measured = _documents(tiny_dirs, measured_gpt2)
    comparison = compare(estimated, measured)
    for span in overall(comparison):
        phases = {"forward": ["forward"], "backward": ["input_grad", "weight_grad"],
                  "input_grad": ["input_grad"], "weight_grad": ["weight_grad"],
                  "step": ["forward", "input_grad", "weight_grad"]}[span["span"]]
        e = sum(estimated["totals"][f"{p}_estimated_ns"] for p in phases)
        m = sum(measured["totals"][f"{p}_measured_ns"] for p in phases)
        assert span["estimated_ns"] == pytest.approx(e) and span["measured_ns"] == pytest.approx(m)
        assert span["error"] == pytest.approx((e - m) / m)
    matmuls = [(e_op["estimated_ns"], m_op["measured_ns"])
               for e_row, m_row in zip(estimated["rows"], measured["rows"]) if e_row["type"] == "node"
               for e_op, m_op in zip([e_row["forward"], *e_row["input_grad"], *e_row["weight_grad"]],
                                     [m_row["forward"], *m_row["input_grad"], *m_row["weight_grad"]])
               if e_op["kind"] == "matmul"]
    summary = {k["kind"]: k for k in kind_summary(comparison)}
    assert summary["matmul"]["count"] == len(matmuls)
    errors = sorted(abs(e - m) / m for e, m in matmuls)
    middle = len(errors) // 2
    median = errors[middle] if len(errors) % 2 else (errors[middle - 1] + errors[middle]) / 2
    assert summary["matmul"]["median_abs_error"] == pytest.approx(median)


def test_compare_rejects_another_model_or_other_settings(tiny_dirs, measured_gpt2):
    estimated, measured = _documents(tiny_dirs, measured_gpt2, seq=8)
    with pytest.raises(UserError, match=r"different steps \(--seq 8 estimated vs 16 measured\)"):
        compare(estimated, measured)
    estimated["settings"]["seq"] = 16  # settings that lie: the shapes still tell
    with pytest.raises(UserError, match=r"row 1 'transformer_view' does not match: its forward aten.view.default reads shapes "
                                        r"\[\[2, 8\]\] estimated but \[\[2, 16\]\] measured"):
        compare(estimated, measured)
    other = extract(str(tiny_dirs["llama"]), batch=2, seq=16, trace_on="cpu")
    with pytest.raises(UserError, match=r"different steps \(MODEL llama estimated vs gpt2 measured\)"):
        compare(json.loads(json_text(other.workload, other.settings, {})), measured)
    tp2 = extract(str(tiny_dirs["gpt2"]), batch=2, seq=16, trace_on="cpu", parallel=Parallel(tp=2, vocab_multiple=8))
    with pytest.raises(UserError, match=r"different steps \(--tp 2 estimated vs 1 measured, "
                                        r"--vocab-multiple 8 estimated vs 1 measured\)"):
        compare(json.loads(json_text(tp2.workload, tp2.settings, {})), measured)


def test_profile_and_compare_commands(tiny_dirs, tmp_path):
    out, measured = tmp_path / "out", tmp_path / "measured"
    assert fxworkload("extract", tiny_dirs["gpt2"], "--seq", 16, "--trace-on", "cpu", "--out", out).returncode == 0
    run = fxworkload("profile", tiny_dirs["gpt2"], "--seq", 16, "--on", "cpu", "--repeat", 1, "--out", measured)
    assert run.returncode == 0, run.stderr
    assert "eager step" in run.stdout
    run = fxworkload("compare", out / "workload.tsv", measured, "--plot", tmp_path / "plot.png", "--out", tmp_path / "cmp")
    assert run.returncode == 0, run.stderr
    assert "median_abs_error" in run.stdout and "time-weighted error" in run.stdout
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_profile_and_compare_input_is_one_line(tiny_dirs, tmp_path):
    config = tiny_config("gpt2")
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**saved, "n_positions": 32}))
    (tmp_path / "junk.json").write_text("{not json")
    cases = [
        (("profile", tmp_path / "ckpt", "--seq", 8, "--on", "cpu", "--out", tmp_path / "o1"),
         "tensor 'transformer.wpe.weight' has shape [64, 64] in the checkpoint but [32, 64] in its config"),
        (("profile", tiny_dirs["gpt2"], "--repeat", 0, "--out", tmp_path / "o2"), "--repeat must be at least 1"),
        (("profile", tiny_dirs["gpt2"], "--on", "tpu", "--out", tmp_path / "o3"), "unknown --on 'tpu'"),
        (("compare", tmp_path / "missing", tmp_path / "junk.json"), "no such file"),
        (("compare", tmp_path / "junk.json", tmp_path / "junk.json"), "not complete JSON"),
    ]
    if not torch.cuda.is_available():
        cases.append((("calibrate", "--on", "cuda", "--name", "x"),
                      "is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA device"))
    for args, message in cases:
        run = in_process(*args)
        assert run.returncode == 2, (args, run.stderr)
        assert message in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3"))


def test_calibrated_profile_is_where_the_cost_model_reads_it(monkeypatch, tiny_dirs):
    """A (shortened) calibration saved as 'cpu' is the profile extract --device cpu costs with."""
    from fxworkload.measure import calibrate
    from fxworkload.cost.roofline import estimate_ns

    monkeypatch.setattr(calibrate, "GEMM_DIMS", (64, 256))
    monkeypatch.setattr(calibrate, "VECTOR_ELEMENTS", 1 << 14)
    measured = calibrate.measure("cpu", "cpu")
    devices.save(measured, devices.measured_path("cpu"))
    assert devices.load("cpu") == measured
    assert len(measured.matmul_flops_per_s_by_shape["fp32"]) == 8 and measured.kernel_launch_ns > 0
    result = extract(str(tiny_dirs["gpt2"]), seq=16, device="cpu")
    head = next(r for r in result.workload.node_rows if r.name == "lm_head")
    m, k, n = 16, 64, 96  # tokens x hidden x vocab of the tiny GPT-2
    assert head.forward.estimated_ns == pytest.approx(estimate_ns(
        head.forward.flops, head.forward.bytes, torch.float32, measured, uses_matmul_units=True, gemm=(m, k, n)))
    assert head.forward.flops == 2 * m * k * n


def _mangled(document: dict, how: str) -> dict:
    row = next(r for r in document["rows"] if r.get("type") == "node")
    if how == "non-object row":
        document["rows"].insert(0, 7)
    elif how == "missing key":
        del row["forward"]["kind"]
    elif how == "wrong type":
        row["input_grad"] = "none"
    elif how in ("nan", "inf", "negative"):
        row["forward"]["estimated_ns"] = {"nan": float("nan"), "inf": float("inf"), "negative": -1.0}[how]
    return document


@pytest.mark.parametrize("how, message", [
    ("non-object row", "row 1 is not an object"),
    ("missing key", "a forward op lacks its op, kind or input_shapes"),
    ("wrong type", "'input_grad' is not a list of ops"),
    ("nan", "NaN is not a JSON number: the file holds a non-finite value"),
    ("inf", "Infinity is not a JSON number: the file holds a non-finite value"),
    ("negative", "estimated_ns = -1.0 is not a time in ns"),
])
def test_compare_refuses_a_malformed_table_by_row_and_field(how, message, tiny_dirs, tmp_path):
    """Issue 16.6: these crashed with tracebacks, or printed +nan%."""
    result = extract(str(tiny_dirs["gpt2"]), seq=16, trace_on="cpu")
    document = _mangled(json.loads(json_text(result.workload, result.settings, {})), how)
    (tmp_path / "workload.json").write_text(json.dumps(document))
    run = fxworkload("compare", tmp_path / "workload.json", tmp_path / "workload.json")
    assert run.returncode == 2 and message in run.stderr and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_damaged_weights_are_one_line(damage, tmp_path):
    """Issue 16.7: a garbage, empty or truncated model.safetensors raised SafetensorError."""
    AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"garbage": b"\x00not safetensors" * 10, "empty": b"", "truncated": data[: len(data) // 2]}[damage])
    run = fxworkload("profile", tmp_path / "ckpt", "--seq", 8, "--on", "cpu", "--out", tmp_path / "o")
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "cannot load its weights" in run.stderr and "damaged or truncated" in run.stderr
    assert not (tmp_path / "o").exists()


def test_a_model_too_large_for_memory_is_refused_before_allocating(tiny_dirs, monkeypatch):
    from fxworkload.measure import profile as profile_module

    monkeypatch.setattr(profile_module, "_available_bytes", lambda device: 1000)
    with pytest.raises(UserError, match=r"has [\d,]+ parameters: profiling it needs at least .* but cpu has 0.0 GiB free"):
        profile(str(tiny_dirs["gpt2"]), seq=8, on="cpu", repeat=1)


def test_seq_1_is_refused_for_a_causal_lm_not_verified_with_a_nan_loss(tiny_dirs):
    """Issue 16.7: --seq 1 leaves no next token to predict: the loss was NaN and reported verified."""
    with pytest.raises(UserError, match="needs --seq 2 or more"):
        profile(str(tiny_dirs["gpt2"]), seq=1, on="cpu", repeat=1)


def test_a_measured_step_peak_is_set_beside_the_estimate(tiny_dirs, measured_gpt2):
    """A CPU profile measures no peak (null); a GPU's measured.json carries max_memory_allocated,
    which compare reports against the estimate (here a GPU figure written by hand: 2 MiB)."""
    from fxworkload.measure.compare import report_text

    estimated, measured = _documents(tiny_dirs, measured_gpt2)
    assert measured["totals"]["step_peak_bytes"] is None
    assert "step peak memory" not in report_text(compare(estimated, measured))
    measured["totals"]["step_peak_bytes"] = 2 * 2 ** 20
    ours = estimated["totals"]["step_peak_bytes"]
    line = next(x for x in report_text(compare(estimated, measured)).splitlines() if x.startswith("step peak memory"))
    assert line == (f"step peak memory: estimated {ours / 2 ** 20:.1f} MiB, measured 2.0 MiB (max_memory_allocated), "
                    f"{100 * (ours - 2 * 2 ** 20) / (2 * 2 ** 20):+.1f}%")


def test_compare_gives_a_verdict_when_the_measurement_failed_its_own_check(tiny_dirs, measured_gpt2):
    """Issue 40: on a busy machine compare printed step +301 % with no caveat. When measured.json's ops add up to
    far more than its eager step (profile's own check, formats/tables.sum_of_ops_warning), the report opens its
    notes with a verdict that the errors are that noise, and comparison.json carries the reason."""
    from fxworkload.measure.compare import comparison_json, report_text

    estimated, measured = _documents(tiny_dirs, measured_gpt2)
    measured["totals"]["eager_step_ns"] = measured["totals"]["step_measured_ns"]  # the ops add up to the step
    quiet = compare(estimated, measured)
    measured["totals"]["eager_step_ns"] = measured["totals"]["step_measured_ns"] / 4  # ops 4x the step: +300 %
    busy = compare(estimated, measured)
    assert quiet.measured_warning is None and "VERDICT" not in report_text(quiet)
    assert "+300%" in busy.measured_warning
    text = report_text(busy)
    assert "VERDICT: not a comparison" in text and text.index("VERDICT") < text.index("time-weighted error")
    assert json.loads(comparison_json(busy))["measured_warning"] == busy.measured_warning


def test_a_profiler_timed_run_without_its_trace_reader_stops_before_any_work(monkeypatch):
    """On a GPU (or --timer profiler) the per-node times are read back from the trace with
    HolisticTraceAnalysis; without it installed, profile says so first, not after loading,
    capturing and running the model (the first GPU run met this at the very end)."""
    import importlib.util

    from fxworkload.capture import models

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hta" else real_find_spec(name, *a))
    monkeypatch.setattr(models, "resolve", lambda *a: pytest.fail("the model was read before the check"))
    with pytest.raises(UserError, match="needs HolisticTraceAnalysis"):
        profile("gpt2", batch=1, seq=8, on="cpu", timer="profiler")
