"""Files other programs wrote, and the odd ways people hand them over: each example of issue 25 ends in
one clean line (naming the file, record and field) or a correct result, never an internal error."""

from __future__ import annotations

import csv
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxworkload import inputs
from fxworkload.pipeline import extract

from ..test_cli import fxworkload, in_process
from .test_profiler_trace import BATCH, SEQ, profile_steps

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def run(*argv) -> tuple[int, str]:
    """The CLI in process: exit code and stderr."""
    done = in_process(*argv)
    return done.returncode, done.stderr


def one_clean_line(code: int, err: str, says: str, expected_code: int = 2) -> None:
    """Progress lines may come first; then one error line, the last."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("fxworkload:")]
    assert code == expected_code and errors == lines[-1:] and says in lines[-1], err
    assert "internal error" not in err and "Traceback" not in err


@pytest.fixture(scope="module")
def trace(tiny_dirs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("foreign")
    profile_steps("gpt2", folder / "trace.json")
    extract(str(tiny_dirs["gpt2"]), batch=BATCH, seq=SEQ, trace_on="cpu", device="cpu").write(folder / "est")
    return folder


def _mangled_trace(trace: Path, tmp_path: Path, change) -> Path:
    document = json.loads((trace / "trace.json").read_text())
    ops = [e for e in document["traceEvents"] if e.get("cat") == "cpu_op"]
    change(ops[3])
    path = tmp_path / "mangled.json"
    path.write_text(json.dumps(document))  # json.dumps writes NaN and Infinity as Python's json does
    return path


@pytest.mark.parametrize("change, says", [
    (lambda op: op.__setitem__("dur", 1e300), "'dur' is 1e+300, not a time in µs"),
    (lambda op: op.__setitem__("dur", float("inf")), "Infinity is not a JSON number"),
    (lambda op: op.pop("name"), "'name' is None, not an op name"),
    (lambda op: op.__setitem__("name", None), "'name' is None, not an op name"),
    (lambda op: op.__setitem__("tid", "main thread"), "'tid' is 'main thread', not an integer id"),
    (lambda op: op["args"].__setitem__("Sequence number", float("nan")), "NaN is not a JSON number"),
    (lambda op: op["args"].__setitem__("Sequence number", 1.5), "args 'Sequence number' is 1.5, not an integer"),
    (lambda op: op.__setitem__("ts", "soon"), "'ts' is 'soon', not a time in µs"),
])
def test_a_trace_with_an_impossible_field_names_the_event_and_field(trace, tmp_path, change, says):
    path = _mangled_trace(trace, tmp_path, change)
    code, err = run("compare", trace / "est", path, "--out", tmp_path / "out")
    one_clean_line(code, err, says)
    assert "mangled.json: " in err and not (tmp_path / "out").exists()


def test_a_trace_nested_past_any_real_one_is_one_line(trace, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_clean_line(*run("compare", trace / "est", path), says="nested deeper than any real file")


def test_a_gzip_that_inflates_past_the_bound_stops_there(trace, tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "MAX_INPUT_BYTES", 1 << 20)  # the bound (1 GiB) made small, the mechanism the same
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b" " * (8 << 20)))  # 8 KiB that inflate to 8 MiB
    one_clean_line(*run("compare", trace / "est", path), says="inflates past")
    assert len(path.read_bytes()) < 64 << 10


def test_a_trace_read_from_a_pipe_is_read_once(trace, tmp_path):
    """`compare est <(zcat trace.json.gz)`: the format is sniffed and the trace parsed from one read."""
    with open(trace / "trace.json", "rb") as src, gzip.open(tmp_path / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    command = (f"{sys.executable} -m fxworkload compare {trace / 'est'} <(zcat {tmp_path / 'trace.json.gz'}) "
               f"--out {tmp_path / 'out'}")
    piped = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr
    direct = fxworkload("compare", trace / "est", tmp_path / "trace.json.gz", "--out", tmp_path / "direct")
    assert direct.returncode == 0, direct.stderr
    ours = (tmp_path / "out" / "comparison.txt").read_text().splitlines()
    theirs = (tmp_path / "direct" / "comparison.txt").read_text().splitlines()
    assert ours[1:] == theirs[1:] and len(ours) > 5  # the first line names the file read


def test_a_measured_file_whose_totals_is_a_list_is_named(tiny_dirs, tmp_path):
    est = tmp_path / "est"
    extract(str(tiny_dirs["gpt2"]), seq=16, trace_on="cpu").write(est)
    assert run("profile", tiny_dirs["gpt2"], "--seq", 16, "--on", "cpu", "--repeat", 1, "--warmup", 0,
               "--out", tmp_path / "measured")[0] == 0
    document = json.loads((tmp_path / "measured" / "measured.json").read_text())
    document["totals"] = [1, 2]
    (tmp_path / "m.json").write_text(json.dumps(document))
    one_clean_line(*run("compare", est, tmp_path / "m.json"), says="'totals' is not an object")


def test_a_megatron_log_with_an_endless_literal_is_one_line(trace, tmp_path):
    line = (FIXTURES / "megatron_dense_tp_rank0.txt").read_text().splitlines()[0]
    start = line.index("input__shape=[") + len("input__shape=")
    (tmp_path / "log.txt").write_text(line[:start] + "[" * 50_000 + "]" * 50_000 + line[line.index("]", start) + 1:])
    code, err = run("compare", trace / "est", tmp_path / "log.txt")
    one_clean_line(code, err, says="input__shape")


# The kernel CSVs of calibrate --kernels: one good folder, then one field broken at a time.
def kernel_rows() -> dict[str, list[list[str]]]:
    """A small kernel data folder as rows (header first), each file with enough rows to be fitted."""
    return {"gemm.csv": [["dtype", "m", "k", "n", "layout", "us"]]
            + [["bf16", str(256 * i), "1024", "1024", "NT", f"{10.0 * i}"] for i in (1, 2, 3, 4)],
            "sdpa.csv": [["dtype", "batch", "heads", "kv_heads", "seq", "head_dim", "causal", "dropout", "mask",
                          "fwd_us", "bwd_us", "fwd_kernels"]]
            + [["bf16", "1", "8", "8", str(128 * i), "64", "True", "0.0", "none", f"{20.0 * i}", f"{60.0 * i}", "k"]
               for i in (1, 2, 3, 4)],
            "vector.csv": [["op", "dtype", "rows", "cols", "us"]]
            + [["add", "bf16", str(1024 * i), "1024", f"{5.0 * i}"] for i in (1, 2, 3, 4)]}


def _kernel_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "kernels"
    folder.mkdir()
    for name, rows in kernel_rows().items():
        with open(folder / name, "w", newline="") as f:
            csv.writer(f).writerows(rows)
    return folder


def _break(folder: Path, name: str, column: str, value: str) -> None:
    with open(folder / name, newline="") as f:
        rows = list(csv.DictReader(f))
    rows[1][column] = value
    with open(folder / name, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


@pytest.mark.parametrize("name, column, value, says", [
    ("gemm.csv", "us", "0", "gemm.csv:3: column 'us' is '0', not a time in µs"),
    ("gemm.csv", "us", "-4", "column 'us' is '-4', not a time in µs"),
    ("gemm.csv", "m", "0", "column 'm' is '0', not a whole size"),
    ("gemm.csv", "m", "-256", "column 'm' is '-256', not a whole size"),
    ("gemm.csv", "k", "2.5", "column 'k' is '2.5', not a whole size"),
    ("gemm.csv", "dtype", "fp64", "column 'dtype' is 'fp64', not one of fp32, bf16, fp16"),
    ("gemm.csv", "layout", "TT", "column 'layout' is 'TT', not one of NN, NT, TN"),
    ("sdpa.csv", "head_dim", "0", "column 'head_dim' is '0', not a whole size"),
    ("sdpa.csv", "causal", "maybe", "column 'causal' is 'maybe', not one of True, False"),
    ("sdpa.csv", "dropout", "1.5", "not a dropout probability"),
    ("sdpa.csv", "kv_heads", "3", "8 heads do not share 3 key/value heads evenly"),
    ("vector.csv", "op", "fft", "column 'op' is 'fft', not an op of vector.csv"),
])
def test_a_kernel_csv_with_an_impossible_field_is_refused_not_fitted(tmp_path, name, column, value, says):
    folder = _kernel_folder(tmp_path)
    _break(folder, name, column, value)
    one_clean_line(*run("calibrate", "--kernels", folder, "--like", "h100-sxm", "--name", "fuzzed"), says=says)
    from fxworkload.cost import devices

    assert not devices.measured_path("fuzzed").exists()


def test_kernel_csvs_without_enough_rows_fit_nothing(tmp_path):
    folder = _kernel_folder(tmp_path)
    for name in ("gemm.csv", "sdpa.csv", "vector.csv"):  # headers only
        (folder / name).write_text((folder / name).read_text().splitlines()[0] + "\n")
    one_clean_line(*run("calibrate", "--kernels", folder, "--like", "h100-sxm", "--name", "x"),
                   says="hold no measured kernel time")
    (tmp_path / "one").mkdir()
    folder = _kernel_folder(tmp_path / "one")
    (folder / "gemm.csv").write_text("\n".join((folder / "gemm.csv").read_text().splitlines()[:2]) + "\n")
    one_clean_line(*run("calibrate", "--kernels", folder, "--like", "h100-sxm", "--name", "x"),
                   says="gemm.csv: 1 measured kernel time; a fit needs at least 4")


def test_a_kernel_csv_that_is_not_utf8_is_one_line(tmp_path):
    folder = _kernel_folder(tmp_path)
    (folder / "vector.csv").write_bytes((folder / "vector.csv").read_bytes() + b"add,bf16,1,1,\xff\xfe\n")
    one_clean_line(*run("calibrate", "--kernels", folder, "--like", "h100-sxm", "--name", "x"), says="not UTF-8 text")


def test_kernels_and_from_together_are_refused(tmp_path):
    one_clean_line(*run("calibrate", "--kernels", tmp_path, "--from", tmp_path / "t.json", "--estimated", tmp_path,
                        "--name", "x"), says="give one of them")


def test_a_router_sending_tokens_to_no_expert_is_refused(tmp_path):
    from .. conftest import tiny_config

    tiny_config("mixtral").save_pretrained(tmp_path / "moe")
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    config["num_experts_per_tok"] = 0
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    one_clean_line(*run("extract", tmp_path / "moe", "--seq", 16, "--out", tmp_path / "o"),
                   says="num_experts_per_tok = 0 is not a model size")


def test_an_empty_grad_dtype_is_not_the_default(tiny_dirs, tmp_path):
    one_clean_line(*run("extract", tiny_dirs["gpt2"], "--seq", 16, "--grad-dtype", "", "--out", tmp_path / "o"),
                   says="unknown --grad-dtype ''")


def test_a_5000_character_value_is_shown_by_its_ends(tiny_dirs, tmp_path):
    code, err = run("extract", tiny_dirs["gpt2"], "--seq", "9" * 5000, "--out", tmp_path / "o")
    one_clean_line(code, err, says="--seq")
    assert len(err) < 700


def test_running_out_of_memory_while_profiling_says_what_the_step_needs(tiny_dirs, tmp_path, monkeypatch):
    from fxworkload.capture import models

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(models, "build_real_model", no_memory)
    code, err = run("profile", tiny_dirs["gpt2"], "--seq", 16, "--on", "cpu", "--out", tmp_path / "o")
    one_clean_line(code, err, says="ran out of memory on cpu")
    assert "the step needs about" in err and "GiB: extract's estimate" in err and not (tmp_path / "o").exists()


def test_a_full_disk_under_the_output_folder_is_exit_1_as_documented(tiny_dirs, tmp_path, monkeypatch):
    import errno

    from fxworkload.formats import files

    def full(path, content):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(files, "_write", full)
    code, err = run("extract", tiny_dirs["gpt2"], "--seq", 16, "--out", tmp_path / "o")
    one_clean_line(code, err, says="No space left on device", expected_code=1)
    assert not (tmp_path / "o").exists() and [p.name for p in tmp_path.iterdir()] == []


def test_a_closed_stdout_is_one_line_before_any_work(tmp_path):
    run_ = subprocess.run(f"{sys.executable} -m fxworkload models >&-", shell=True, capture_output=True, text=True)
    assert run_.returncode == 1 and run_.stderr.strip() == (
        "fxworkload: error: standard output is closed; give the command somewhere to print (e.g. > log.txt)")
