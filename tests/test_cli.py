"""The command line: outputs, determinism, checkpoints, and one clear line for every bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from .conftest import tiny_config


def fxworkload(*args, cwd=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "fxworkload", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env)


def in_process(*args, cwd=None) -> subprocess.CompletedProcess:
    """The CLI's main() in this process, as fxworkload() runs it in a new one (exit code, stdout, stderr),
    without the 2 s of importing torch again: for the many checks of what bad input prints."""
    from fxworkload.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["fxworkload", *map(str, args)], code, out.getvalue(), err.getvalue())


def test_extract_writes_both_tables_and_a_summary(tiny_dirs, tmp_path):
    run = fxworkload("extract", tiny_dirs["gpt2"], "--batch", 2, "--seq", 16, "--out", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", "nodes.tsv", "workload.json",
                                                                    "workload.tsv"]
    header = (tmp_path / "out" / "workload.tsv").read_text().splitlines()[0].split("\t")
    assert header == ["name", "forward_compute_time", "forward_comm_type", "forward_comm_size",
                      "backward_compute_time", "backward_comm_type", "backward_comm_size",
                      "weight_grad_compute_time", "weight_grad_comm_type", "weight_grad_comm_size", "process_time"]
    document = json.loads((tmp_path / "out" / "workload.json").read_text())
    assert document["settings"]["batch"] == 2 and document["settings"]["seq"] == 16
    assert document["unruled_ops"] == []
    assert "trainable parameters" in run.stdout and "costliest" in run.stdout


def test_same_command_twice_writes_identical_files(tiny_dirs, tmp_path):
    """The second run captures again (--no-cache), so this is not the cache replaying the first."""
    layout = ["--tp", 2, "--dp", 2, "--pp", 2, "--micro-batches", 2, "--format", "tables,simai,chrome-trace",
              "--device", "h100-sxm"]
    for out, cache in (("a", []), ("b", ["--no-cache"])):
        run = fxworkload("extract", tiny_dirs["llama"], "--seq", 16, *layout, *cache, "--out", tmp_path / out)
        assert run.returncode == 0, run.stderr
    for name in ("workload.tsv", "workload.json", "workload.simai.txt", "workload.trace.json", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_checkpoint_folder_extracts_the_same_table_as_its_config(tiny_dirs, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(tmp_path / "ckpt")
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "ckpt").iterdir())
    from_ckpt = fxworkload("extract", tmp_path / "ckpt", "--seq", 16, "--out", tmp_path / "a")
    from_config = fxworkload("extract", tmp_path / "ckpt" / "config.json", "--seq", 16, "--out", tmp_path / "b")
    assert from_ckpt.returncode == 0 and from_config.returncode == 0, from_ckpt.stderr + from_config.stderr
    assert (tmp_path / "a" / "workload.tsv").read_bytes() == (tmp_path / "b" / "workload.tsv").read_bytes()


def test_a_data_dependent_branch_is_named_not_a_traceback(tmp_path):
    """XLM checks a tensor's maximum in a Python branch: tracing stops there, and the CLI says so."""
    from transformers import CONFIG_MAPPING
    CONFIG_MAPPING["xlm"](n_layers=2, emb_dim=64, n_heads=4, vocab_size=96, max_position_embeddings=64,
                          is_decoder=True).save_pretrained(tmp_path / "xlm")
    run = fxworkload("extract", tmp_path / "xlm", "--seq", 8, "--out", tmp_path / "out")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "cannot trace a training step of this model: data-dependent control flow" in run.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_config_without_a_position_limit_takes_any_seq():
    from transformers import CONFIG_MAPPING

    from fxworkload.capture.models import max_positions
    assert max_positions(CONFIG_MAPPING["xlnet"]()) is None  # XLNet's max_position_embeddings is -1
    assert max_positions(tiny_config("gpt2")) == 64


def test_models_lists_every_built_in_with_its_parameter_count():
    run = fxworkload("models", "--parameters")
    assert run.returncode == 0
    assert "llama-3-70b" in run.stdout and "70,553,706,496" in run.stdout


def test_models_without_parameter_counts_reads_the_configs_alone():
    run = fxworkload("models")
    assert run.returncode == 0
    gpt2 = next(line.split() for line in run.stdout.splitlines() if line.startswith("gpt2 "))
    assert gpt2 == ["gpt2", "gpt2", "causal-lm", "12", "768", "12"]  # models/gpt2/config.json: n_layer, n_embd, n_head


def test_devices_lists_the_profiles():
    run = fxworkload("devices")
    assert run.returncode == 0
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "gb200", "h20", "mi300x", "mi325x", "cpu"):
        assert name in run.stdout
    mi300x = next(line for line in run.stdout.splitlines() if line.startswith("mi300x "))
    assert "2615" in mi300x and "assumed" in mi300x  # the data sheet's dense FP8 peak; its fit is an H100's
    h100 = next(line for line in run.stdout.splitlines() if line.startswith("h100-sxm "))
    assert " 79.2 " in h100  # GiB: the 81,079 MiB CUDA reported on the lent H100 (not the datasheet's "80 GB")


def test_devices_name_lists_each_figure_with_its_kind_and_source():
    run = fxworkload("devices", "h100-sxm")
    assert run.returncode == 0
    fit = next(line for line in run.stdout.splitlines() if line.startswith("gpu_model_fit"))
    assert "fitted" in fit and "H100" in fit
    bad = fxworkload("devices", "no-such-gpu")
    assert bad.returncode != 0 and "unknown device" in bad.stderr and "Traceback" not in bad.stderr
    assert "did you mean" not in bad.stderr  # nothing near it


def test_a_device_named_as_people_say_it_is_met_with_the_profiles_it_may_mean():
    """'--device H100' (the datasheet's spelling) names the three H100 profiles in one line on stderr."""
    bad = fxworkload("devices", "H100")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
    meant = bad.stderr.split("did you mean ", 1)[1].split("?", 1)[0]  # measured profiles may join them
    assert {"h100-nvl", "h100-pcie", "h100-sxm"} <= set(meant.replace(" or ", ", ").split(", "))


def _bad_inputs(tmp_path, tiny_dirs):
    empty = tmp_path / "empty"
    empty.mkdir()
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "config.json").write_text('{"model_type": "gpt2", ')
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "config.json").write_text('{"model_type": "resnet"}')
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    gpt2 = tiny_dirs["gpt2"]
    return {
        "unknown model": (["no-such-model"], "gpt2-medium"),
        "folder without config.json": ([empty], "no config.json"),
        "malformed config.json": ([malformed], "malformed JSON"),
        "unsupported architecture": ([vision], "unsupported architecture"),
        "batch 0": ([gpt2, "--batch", 0], "--batch"),
        "negative seq": ([gpt2, "--seq", -4], "--seq"),
        "seq past the model's positions": ([gpt2, "--seq", 4096], "max_position_embeddings"),
        "unknown device": ([gpt2, "--device", "tpu-v9"], "unknown device"),
        "unknown dtype": ([gpt2, "--dtype", "fp8"], "unknown --dtype"),
        "unwritable out": ([gpt2, "--seq", 8, "--out", blocker / "sub"], "cannot write"),
        "non-integer batch": ([gpt2, "--batch", "two"], "invalid int"),
        "over-long out": ([gpt2, "--seq", 8, "--out", tmp_path / ("o" * 300)], "longer than the 255 bytes"),
        "empty out": ([gpt2, "--seq", 8, "--out", ""], "--out is empty"),
        "negative top": ([gpt2, "--seq", 8, "--top", -1], "--top must be 0 or more, got -1"),
        "seq 1": ([gpt2, "--seq", 1], "needs --seq 2 or more"),
        "a stage shorter than its chunks": ([gpt2, "--seq", 8, "--pp", 2, "--pp-layers", "1,1", "--vpp", 2,
                                             "--micro-batches", 2], "need at least 2 layers on every stage"),
    }


@pytest.mark.parametrize("case", ["unknown model", "folder without config.json", "malformed config.json",
                                  "unsupported architecture", "batch 0", "negative seq",
                                  "seq past the model's positions", "unknown device", "unknown dtype",
                                  "unwritable out", "non-integer batch", "over-long out", "empty out",
                                  "negative top", "seq 1", "a stage shorter than its chunks"])
def test_bad_input_gives_one_line_exit_2_and_no_files(case, tmp_path, tiny_dirs):
    args, expected = _bad_inputs(tmp_path, tiny_dirs)[case]
    out = tmp_path / "never"
    if "--out" not in args:
        args = [*args, "--out", out]
    run = in_process("extract", *args, cwd=tmp_path)
    assert run.returncode == 2
    progress = ("building", "capturing", "captured", "its layers", "costing", "read the captured")
    lines = [line for line in run.stderr.splitlines() if not line.startswith(progress)]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("fxworkload: error:") and expected in lines[0]
    assert "Traceback" not in run.stderr
    assert not out.exists() and not (tmp_path / "outputs").exists()


def test_a_cached_extract_never_imports_transformers(tiny_dirs, tmp_path):
    """The warm path reads config.json as JSON and the model's facts from the graph cache."""
    code = ("import sys; from fxworkload.cli import main; "
            f"rc = main(['extract', {str(tiny_dirs['llama'])!r}, '--seq', '8', '--out', {str(tmp_path / 'o')!r}]); "
            "print(rc, 'transformers' in sys.modules)")
    env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert first.stdout.split()[-2:] == ["0", "True"]  # captured: transformers built the model
    assert again.stdout.split()[-2:] == ["0", "False"]


def test_a_closed_pipe_and_a_full_disk_are_not_tracebacks():
    """Issue 16.2: `fxworkload devices | head -n1` and `fxworkload models > /dev/full`."""
    reader = subprocess.Popen([sys.executable, "-m", "fxworkload", "devices"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    reader.stdout.close()  # before the command has started writing (its table fits in a pipe's buffer)
    assert reader.wait() == 141 and b"Traceback" not in reader.stderr.read()
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "-m", "fxworkload", "models"], stdout=full, stderr=subprocess.PIPE,
                             text=True)
    assert run.returncode == 1 and run.stderr.strip() == ("fxworkload: error: No space left on device "
                                                          "(writing standard output)")


@pytest.mark.parametrize("args, message", [
    (["calibrate", "--on", "gpu"], "unknown --on 'gpu': use cpu or cuda"),
    (["calibrate", "--name", "../x"], "--name '../x' is not a device profile name"),
    (["extract", "gpt2", "--device", "/tmp/x"], "--device '/tmp/x' is not a device profile name"),
    (["extract", "gpt2", "--device", "h100-sxm", "--sdpa-backends", "flash,cuda"], "--sdpa-backends 'flash,cuda'"),
    (["plan", "gpt2", "--gpus", "8", "--global-batch", "8", "--seq", "128", "--sdpa-backends", "fa3"],
     "--sdpa-backends 'fa3'"),
    (["profile", "gpt2", "--on", "cuda"], "CPU-only build" if torch.version.cuda is None else "no CUDA device"),
])
def test_messages_name_the_option_typed(args, message, tmp_path):
    run = fxworkload(*args, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


def _save_profile(name_or_path, **changes):
    from dataclasses import replace

    from fxworkload.cost import devices

    profile = replace(devices.load("h100-sxm"), **changes)
    path = name_or_path if not isinstance(name_or_path, str) else devices.measured_path(name_or_path)
    return devices.save(profile, path)


def test_devices_shows_a_measured_cpu_once_with_its_figures(tmp_path, monkeypatch):
    """Issue 17.9: the cpu row was listed with dashes even after calibration."""
    from fxworkload.cost import devices

    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    _save_profile(devices.cache_dir() / "devices" / "cpu-torch9.9-threads3.json", name="cpu",
                  description="a measured CPU", matmul_flops_per_s={"fp32": 1.5e11, "bf16": 2.5e10, "fp16": 1e9})
    rows = [line.split() for line in fxworkload("devices").stdout.splitlines() if line.startswith("cpu ")]
    assert len(rows) == 1 and rows[0][:7] == ["cpu", "a", "measured", "CPU", "[cpu-torch9.9-threads3]", "0.15",
                                              "0.025"]


def test_calibration_rates_keep_their_digits():
    from fxworkload.measure.calibrate import rate_text

    assert (rate_text(2.5e10), rate_text(9.894e14), rate_text(3.2e7)) == ("25 GFLOP/s", "989 TFLOP/s", "32 MFLOP/s")


def test_a_chrome_trace_needs_no_interconnect_without_collectives(tiny_dirs, tmp_path):
    """Issue 17.8: a calibrated GPU profile has no interconnect figures; one GPU has no collectives."""
    _save_profile("my-gpu", name="my-gpu", intra_node_bytes_per_s=0.0, inter_node_bytes_per_s=0.0)
    run = fxworkload("extract", tiny_dirs["llama"], "--seq", 16, "--device", "my-gpu", "--format", "chrome-trace",
                     "--out", tmp_path / "o")
    assert run.returncode == 0, run.stderr
    events = json.loads((tmp_path / "o" / "workload.trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "compute" for e in events) and not any(e.get("cat") == "comm" for e in events)


def test_a_simai_file_without_dp_says_how_to_get_the_gradient_all_reduce(tiny_dirs, tmp_path):
    run = fxworkload("extract", tiny_dirs["llama"], "--seq", 16, "--format", "simai", "--out", tmp_path / "o")
    assert run.returncode == 0 and "note: --dp 1: the SimAI file has no gradient all-reduce; pass --dp N" in run.stdout


def test_the_summary_says_what_each_figure_covers(tiny_dirs, tmp_path):
    """Issue 17.5: with tp, pp, dp and micro-batches the summary showed one shard's figures unlabelled."""
    run = fxworkload("extract", tiny_dirs["llama"], "--seq", 16, "--tp", 2, "--pp", 2, "--dp", 4,
                     "--micro-batches", 3, "--out", tmp_path / "o")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("trainable parameters (one tp 2 / ep 1 shard, all layers)") for line in lines)
    assert any("16 (1 x 16); per step 192 (3 micro-batches x dp 4)" in line for line in lines)
    assert any(line.startswith("fwd+bwd (one micro-batch, one tp 2 / ep 1 shard, all layers") for line in lines)
    # a tiny step is host-bound: its time is the kernels beside the host's dispatch, and the label says so
    assert any("kernels beside the host's dispatch of each op, so more than their sum" in line for line in lines)
    assert any(line.startswith("compute ms per step on this rank (3 micro-batches;") for line in lines)


@pytest.mark.parametrize("changes, field", [
    ({"matmul_flops_per_s": {"fp32": 0.0, "bf16": 1e15, "fp16": 1e15}}, "matmul_flops_per_s.fp32 = 0.0"),
    ({"kernel_launch_ns": -5.0}, "kernel_launch_ns = -5.0 must be a finite number, 0 or more"),
    ({"memory_bytes_per_s": float("nan")}, "memory_bytes_per_s = nan is not a positive finite number"),
    ({"compute_efficiency": 1.5}, "compute_efficiency = 1.5 must be a fraction in (0, 1]"),
])
def test_a_device_profile_with_an_impossible_figure_is_refused_by_name(changes, field, tiny_dirs, tmp_path):
    """Issue 16.5: a zero rate crashed, a negative launch time gave a negative step, NaN spread everywhere;
    one corrupt measured profile made `devices` fail."""
    name = f"bad-{abs(hash(field)) % 10 ** 6}"
    _save_profile(name, name=name, **changes)
    run = fxworkload("extract", tiny_dirs["llama"], "--seq", 16, "--device", name, "--out", tmp_path / "o")
    assert run.returncode == 2 and field in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert not (tmp_path / "o").exists()
    listing = fxworkload("devices")
    assert listing.returncode == 0 and "h100-sxm" in listing.stdout and f"{name} " in listing.stdout


@pytest.mark.parametrize("text, message", [
    ('{"model_type": ["gpt2"]}', "'model_type' must be a string, got list"),
    ('{"model_type": "gpt2", "architectures": "GPT2LMHeadModel"}', "'architectures' must be a list of class names"),
    ('{"model_type": "gpt2", "n_layer": -1}', "num_hidden_layers = -1 is not a model size"),
    ('{"model_type": "gpt2", "n_positions": 0}', "max_position_embeddings = 0 is not a model size"),
    ('{"model_type": "gpt2", "n_layer": 100000000}', "num_hidden_layers = 100000000 is not a model size"),
    ('{"a": ' * 50000 + "1" + "}" * 50000, "JSON nested too deeply"),
])
def test_a_config_of_the_wrong_types_or_sizes_is_one_line(text, message, tmp_path):
    """Issue 16.4: these crashed (TypeError, RecursionError), extracted nothing, traced at 1024 or hung."""
    (tmp_path / "config.json").write_text(text)
    run = in_process("extract", tmp_path / "config.json", "--out", tmp_path / "o")
    assert run.returncode == 2 and message in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_devices_lists_the_topology_with_its_values_and_sources():
    """The h100-sxm profile's topology block as the profile resolves it: NVLink SHARP on, eight 50 GB/s NICs
    (DGX H100 datasheet: eight 400 Gb/s ConnectX-7 ports), each with its source."""
    run = fxworkload("devices", "h100-sxm")
    assert run.returncode == 0, run.stderr
    lines = {line.split()[0]: line.split()[1] for line in run.stdout.splitlines() if line.startswith("topology.")}
    assert lines["topology.nvlink_sharp"] == "True" and lines["topology.nics_per_node"] == "8"
    assert float(lines["topology.nic_bytes_per_s"]) == 50e9
