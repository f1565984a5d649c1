"""Long commands say they are alive: a line at least every EVERY_S seconds on a non-terminal stderr."""

from __future__ import annotations

import contextlib
import io
import re
import threading
import time

from fxworkload import progress
from fxworkload.cli import main


def test_a_heartbeat_beats_while_the_work_runs_and_stops_with_it():
    """Three beats come while the block waits for them (however busy the machine), none after it ends."""
    lines, three = [], threading.Event()

    def out(line: str) -> None:
        lines.append(line)
        if len(lines) >= 3:
            three.set()

    with progress.heartbeat(lambda: "working", every_s=0.01, out=out):
        assert three.wait(600)
    count = len(lines)
    time.sleep(0.1)
    assert len(lines) == count and all(re.fullmatch(r"working \(\d+ s\)", x) for x in lines)


def test_a_long_capture_says_which_stage_is_still_running(tiny_dirs, tmp_path, monkeypatch):
    """The capture runs until the heartbeat has spoken (a capture slower than EVERY_S, without a clock)."""
    import fxworkload.pipeline as pipeline

    real, err = pipeline._capture, io.StringIO()

    def slow_capture(*args):
        done = real(*args)
        for _ in range(60000):
            if "still working" in err.getvalue():
                break
            time.sleep(0.01)
        return done

    monkeypatch.setattr(pipeline, "_capture", slow_capture)
    monkeypatch.setattr(progress, "EVERY_S", 0.01)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["extract", str(tiny_dirs["gpt2"]), "--seq", "16", "--no-cache", "--out", str(tmp_path / "o")]) == 0
    assert re.search(r"^(capturing one training step|built \S+ on the meta device)[^\n]*: still working \(\d+ s\)$",
                     err.getvalue(), re.M), err.getvalue()


def _stderr_of(argv, monkeypatch) -> str:
    monkeypatch.setattr(progress, "EVERY_S", 0.2)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main([str(a) for a in argv]) == 0
    return err.getvalue()


def test_plan_reports_its_sweep_to_a_log(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))  # a sweep to do, not one read back
    err = _stderr_of(["plan", tiny_dirs["llama4"], "--gpus", 4, "--global-batch", 8, "--seq", 16, "--workers", 1,
                      "--out", tmp_path / "p"], monkeypatch)
    assert re.search(r"plan: [\d,]+ of [\d,]+ layouts evaluated \(\d+ of \d+ rank shapes\) \(\d+ s\)", err), err


def test_profile_says_which_phase_is_still_running(tiny_dirs, tmp_path, monkeypatch):
    err = _stderr_of(["profile", tiny_dirs["gpt2"], "--seq", 16, "--on", "cpu", "--repeat", 30, "--warmup", 1,
                      "--out", tmp_path / "m"], monkeypatch)
    assert re.search(r"still (capturing|checking|timing|loading)[^\n]* \(\d+ s\)", err), err


def test_the_interval_is_read_from_the_environment_and_a_bad_value_keeps_ten_seconds(monkeypatch):
    for value, expected in (("2.5", 2.5), ("0", 10.0), ("-1", 10.0), ("nan", 10.0), ("soon", 10.0)):
        monkeypatch.setenv("FXWORKLOAD_PROGRESS_EVERY_S", value)
        assert progress._every_s() == expected
    monkeypatch.delenv("FXWORKLOAD_PROGRESS_EVERY_S")
    assert progress._every_s() == 10.0
