"""A run owns its output folder: it is replaced whole (all or none), with a manifest of what was written."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from fxworkload.cli import main
from fxworkload.errors import UserError
from fxworkload.formats.files import publish, remove_stale_temps


def _extract(tiny_dirs, out, *args):
    return main(["extract", str(tiny_dirs["gpt2"]), "--seq", "16", "--trace-on", "cpu", "--out", str(out), *args])


def test_a_second_run_leaves_no_file_of_the_first(tiny_dirs, tmp_path, capsys):
    """Issue 17.3: after tables,simai,chrome-trace at one --seq, a tables-only run at another --seq
    left the old SimAI file and trace beside the new tables."""
    out = tmp_path / "out"
    assert _extract(tiny_dirs, out, "--format", "tables,simai,chrome-trace") == 0
    assert _extract(tiny_dirs, out, "--seq", "8") == 0
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "nodes.tsv", "workload.json", "workload.tsv"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["seq"] == 8
    for name, entry in manifest["files"].items():
        data = (out / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_compare_refuses_a_file_copied_in_from_another_run(tiny_dirs, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _extract(tiny_dirs, a) == 0 and _extract(tiny_dirs, b, "--seq", "8") == 0
    shutil.copy(b / "workload.json", a / "workload.json")
    capsys.readouterr()
    assert main(["compare", str(a / "workload.json"), str(a / "workload.json")]) == 2
    assert "is not the file the run recorded" in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["notes.txt", "workload.json"])
def test_a_folder_holding_other_files_is_not_replaced(entry, tiny_dirs, tmp_path, capsys):
    """Issue 16.1: a folder named workload.json inside --out left a new workload.tsv beside it."""
    out = tmp_path / "mine"
    out.mkdir()
    if entry == "workload.json":
        (out / entry).mkdir()
    else:
        (out / entry).write_text("keep")
    assert _extract(tiny_dirs, out) == 2
    assert f"holds files fxworkload did not write ({entry})" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [entry]


def test_a_failed_write_keeps_the_old_output_and_leaves_no_temp(tmp_path):
    out = tmp_path / "out"
    publish(out, {"workload.tsv": "old\n"}, {"seq": 1})
    with pytest.raises(UserError, match="nothing was changed there"):
        publish(out, {"workload.tsv": "new\n", "workload.json/x": "cannot be a file name"}, {"seq": 2})
    assert (out / "workload.tsv").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_runs_temp_folder_is_removed_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    dead_pid = 2 ** 22 + 12345  # above the kernel's pid_max: no such process
    stale = tmp_path / f".out.fxworkload-{dead_pid}-abc123"
    stale.mkdir()
    (stale / "workload.tsv").write_text("half")
    remove_stale_temps(out)
    assert not stale.exists()


def test_plot_writes_only_regular_files(tmp_path):
    """Issue 16.6: --plot replaced whatever was at PATH, device files included."""
    from fxworkload.formats.files import write_file

    (tmp_path / "folder.png").mkdir()
    (tmp_path / "link.png").symlink_to("/dev/null")
    for path in (tmp_path / "folder.png", tmp_path / "link.png"):
        with pytest.raises(UserError, match=r"--plot .* exists and is not a regular file; choose another --plot path"):
            write_file(path, b"png")
    assert write_file(tmp_path / "plot.png", b"png").read_bytes() == b"png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.png", "link.png", "plot.png"]
