"""An output folder is never left half-written: a run killed (SIGKILL) or interrupted (SIGINT) at
every step of its write phase leaves --out holding the complete old output or the complete new
one; after SIGINT no temporary folder remains, and what SIGKILL leaves the next run removes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..test_cli import fxworkload

OLD = {"workload.tsv": "old table\n", "workload.json": '{"old": 1}\n', "workload.simai.txt": "old simai\n"}
NEW = {"workload.tsv": "new table\n" * 1000, "workload.json": '{"new": 2}\n'}

# Runs publish() with every step of the write phase counted (each file written, the swap, the
# removal of the old folder); at step KILL_AT the process sends itself the signal.
DRIVER = textwrap.dedent("""
    import json, os, shutil, signal, sys
    from pathlib import Path
    from fxworkload.errors import Terminated, on_signal
    from fxworkload.formats import files

    signal.signal(signal.SIGTERM, on_signal)  # as the CLI's main does
    signal.signal(signal.SIGINT, on_signal)
    out, contents, kill_at, signum = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    step = 0

    def counted(function):
        def wrapper(*args, **kwargs):
            global step
            step += 1
            if step == kill_at:
                os.kill(os.getpid(), signum)
            return function(*args, **kwargs)
        return wrapper

    files._write = counted(files._write)
    files._swap_into_place = counted(files._swap_into_place)
    files.shutil.rmtree = counted(shutil.rmtree)
    try:
        files.publish(out, contents, {"run": "new"})
    except KeyboardInterrupt:
        sys.exit(130)
    except Terminated:
        sys.exit(143)
    print("steps", step)
""")


def _publish_until(out: Path, kill_at: int, signum: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER, str(out), json.dumps(NEW), str(kill_at), str(int(signum))],
                          capture_output=True, text=True)


def _state(out: Path) -> str:
    found = {p.name: p.read_text() for p in out.iterdir()}
    manifest = json.loads(found.pop("manifest.json"))
    assert sorted(manifest["files"]) == sorted(found)  # the folder holds exactly what its manifest lists
    if found == OLD:
        return "old"
    assert found == NEW, sorted(found)
    return "new"


def _steps(tmp_path: Path) -> int:
    """How many counted steps a whole publish takes: the driver run to the end counts them."""
    run = _publish_until(tmp_path / "count" / "out", 0, signal.SIGINT)  # step 0: never signalled
    assert run.returncode == 0 and run.stdout.startswith("steps "), run.stderr
    return int(run.stdout.split()[1])


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_a_kill_at_any_step_of_the_write_leaves_the_old_or_the_new_output(signum, tmp_path):
    from fxworkload.formats.files import publish

    seen = set()
    for kill_at in range(1, _steps(tmp_path) + 1):
        parent = tmp_path / f"at{kill_at}"
        out = parent / "out"
        publish(out, OLD, {"run": "old"})
        run = _publish_until(out, kill_at, signum)
        expected = {signal.SIGKILL: -signal.SIGKILL, signal.SIGINT: 130, signal.SIGTERM: 143}[signum]
        assert run.returncode == expected, run.stderr
        assert "Traceback" not in run.stderr
        seen.add(_state(out))
        leftovers = [p.name for p in parent.iterdir() if p.name != "out"]
        if signum != signal.SIGKILL:  # handled: the temporary folder is removed on the way out
            assert leftovers == []
        else:
            publish(out, OLD, {"run": "again"})  # the next run into the same place removes what was left
            assert [p.name for p in parent.iterdir()] == ["out"] and _state(out) == "old"
    assert seen == {"old", "new"}  # the kills fell both before and after the swap


def test_the_driver_counts_every_step(tmp_path):
    """Each file and the manifest, the swap, and at least one removal of the staging folder."""
    assert _steps(tmp_path) >= len(NEW) + 1 + 2


def test_ctrl_c_during_an_extract_exits_130_and_leaves_no_temp(tiny_dirs, tmp_path):
    """The CLI's own write phase, interrupted while its files are being written."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from fxworkload.formats import files
        from fxworkload.cli import main
        original = files._write
        def interrupted(path, content):
            if path.name == "workload.json":
                os.kill(os.getpid(), signal.SIGINT)
            return original(path, content)
        files._write = interrupted
        sys.exit(main(["extract", {str(tiny_dirs["gpt2"])!r}, "--seq", "16", "--out", {str(tmp_path / "out")!r}]))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 130 and run.stderr.strip().splitlines()[-1] == "fxworkload: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_a_symlinked_out_is_followed_never_replaced(tiny_dirs, tmp_path):
    target = tmp_path / "real"
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)  # dangling until the first run
    for seq in ("8", "16"):
        run = fxworkload("extract", tiny_dirs["gpt2"], "--seq", seq, "--out", link)
        assert run.returncode == 0, run.stderr
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert json.loads((target / "workload.json").read_text())["settings"]["seq"] == int(seq)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no hidden leftovers
