"""The Python API as docs/commands.md shows it: its code block runs as written, and what it returns and
writes agrees with the CLI's files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import fxworkload
from fxworkload.cli import main

COMMANDS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "commands.md"


def _readme_snippet() -> str:
    section = COMMANDS_PAGE.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(_readme_snippet(), "docs/commands.md", "exec"), scope)
    printed = capsys.readouterr().out
    result, rank = scope["result"], scope["rank"]
    assert f"{result.totals['step_estimated_ns'] / 1e6:.1f} ms per step" in printed
    assert "trainable parameters (one tp 8 / ep 1 shard, all layers)" in printed
    out = tmp_path / "outputs" / "llama-3-70b-tp8-pp8"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "nodes.tsv", "workload.json",
                                                      "workload.simai.txt", "workload.tsv"]
    assert json.loads((out / "workload.json").read_text())["totals"] == rank.totals
    assert rank.settings["parallel"]["tp"] == 8 and rank.rank.layers == list(range(0, 10))


def test_api_files_are_the_clis_files(tiny_dirs, tmp_path, capsys):
    args = ["--seq", "16", "--tp", "2", "--dp", "2", "--format", "tables,simai"]
    assert main(["extract", str(tiny_dirs["llama"]), *args, "--out", str(tmp_path / "cli")]) == 0
    result = fxworkload.extract(str(tiny_dirs["llama"]), seq=16, parallel=fxworkload.Parallel(tp=2, dp=2))
    written = result.write(tmp_path / "api", formats=["tables", "simai"])
    assert [p.name for p in written] == ["workload.tsv", "nodes.tsv", "workload.json", "workload.simai.txt",
                                         "manifest.json"]
    for path in written:
        assert path.read_bytes() == (tmp_path / "cli" / path.name).read_bytes()


def test_an_execution_and_a_system_are_the_keywords_they_hold(tiny_dirs):
    """extract(model, Execution(...), System(...)) is the same run as the same fields given by keyword, a
    keyword replaces the object's field, and a keyword neither object has is refused as Python refuses one."""
    import pytest

    model = str(tiny_dirs["llama"])
    layout = fxworkload.Parallel(tp=2, dp=2, micro_batches=2)
    run = fxworkload.Execution(batch=2, seq=16, dtype="bf16", parallel=layout)
    by_object = fxworkload.extract(model, run, fxworkload.System("h100-sxm"))
    by_keyword = fxworkload.extract(model, batch=2, seq=16, dtype="bf16", parallel=layout, device="h100-sxm")
    replaced = fxworkload.extract(model, fxworkload.Execution(batch=1, seq=16, dtype="bf16", parallel=layout),
                                  fxworkload.System("a100-80gb"), batch=2, device="h100-sxm")
    for other in (by_keyword, replaced):
        assert other.settings == by_object.settings
        assert other.cluster.step_ns == by_object.cluster.step_ns
    assert by_object.execution.seq_per_rank == 16 and by_object.execution.grad_dtype == "bf16"
    with pytest.raises(TypeError, match="unexpected keyword arguments: devise"):
        fxworkload.extract(model, devise="h100-sxm")


def test_an_execution_refuses_what_a_run_cannot_be_before_any_work():
    import pytest

    from fxworkload.errors import UserError

    for execution, message in ((fxworkload.Execution(batch=0), "--batch must be a positive integer, got 0"),
                               (fxworkload.Execution(fp8_recipe="torchao"), "it needs --fp8"),
                               (fxworkload.Execution(stack="jax"), "unknown --stack 'jax'"),
                               (fxworkload.Execution(dtype="bf16", fp8=True, fp8_recipe="mx"), "unknown --fp8-recipe 'mx'")):
        with pytest.raises(UserError, match=re.escape(message)):
            execution.checked()
