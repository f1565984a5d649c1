"""Stop signals at any instant: one line, the shell's exit status (130, 143, 129), no traceback, no half import.

The interpreter's own start-up (before the first line of fxworkload runs: `site` and its `.pth` files,
10-20 ms) is Python's: a Ctrl-C there is Python's KeyboardInterrupt. These tests start timing at the
instant fxworkload has installed its handlers, which /proc shows: SIGHUP becomes a caught signal then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxworkload import errors

EXPECTED = {signal.SIGINT: (130, "fxworkload: interrupted"), signal.SIGTERM: (143, "fxworkload: terminated"),
            signal.SIGHUP: (129, "fxworkload: hung up")}


def command() -> list[str]:
    """The installed console script where there is one (what a user runs), else ``python -m fxworkload``."""
    script = Path(sys.executable).parent / "fxworkload"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "fxworkload"]


def handlers_installed(pid: int) -> bool:
    """SIGHUP is caught: fxworkload.start has run its first lines (Python itself never catches SIGHUP)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGHUP - 1)))


def wait_for_handlers(run: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while not handlers_installed(run.pid):
        assert run.poll() is None and time.monotonic() < deadline, "the command never installed its handlers"
        time.sleep(0.001)


def test_a_signal_during_an_import_waits_for_the_import_to_finish(tmp_path, monkeypatch):
    """Raised inside an import, SIGTERM would leave a half-initialised module (a C extension then refuses to
    load again); held, it stops the run once the import is done."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.2)\nFINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = errors.install()
    try:
        with pytest.raises(errors.Terminated) as stopped:
            import slow_module  # noqa: F401
            for _ in range(600000):  # the held signal is raised within RETRY_S of the import's end
                time.sleep(0.001)
        assert stopped.value.signum == signal.SIGTERM
        assert sys.modules["slow_module"].FINISHED is True
    finally:
        errors.restore(previous)
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.modules.pop("slow_module", None)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads a process's caught signals from /proc (Linux)")
@pytest.mark.parametrize("sig", list(EXPECTED))
@pytest.mark.parametrize("after_s", [0.0, 0.3])
def test_a_stop_signal_from_the_first_instant_is_one_line_and_its_status(tmp_path, sig, after_s):
    """From the instant the handlers are in (while the CLI and torch import) and a little later."""
    env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
    run = subprocess.Popen([*command(), "extract", "gpt2", "--no-cache", "--out", str(tmp_path / "out")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        wait_for_handlers(run)
        time.sleep(after_s)
        run.send_signal(sig)
        out, err = run.communicate(timeout=300)
    finally:
        run.kill()
    status, line = EXPECTED[sig]
    assert (run.returncode, err.decode().strip().splitlines()[-1:]) == (status, [line]), err
    assert b"Traceback" not in err and b"internal error" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("raised", [errors.UserError("cannot build m (llama): trying to pop from empty mode stack"),
                                    RuntimeError("trying to pop from empty mode stack")])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_an_error_a_stop_signal_caused_is_reported_as_the_stop(tiny_dirs, tmp_path, monkeypatch, raised, sig):
    """The fuzzer's case: Ctrl-C inside the meta model's build unwound torch's mode stack, and the build's
    handler reported "cannot build ... check the config" (exit 2). A run that received a stop signal stops."""
    import fxworkload.pipeline as pipeline

    from .test_cli import in_process

    def interrupted(*args, **kwargs):
        errors.record_signal(sig, None)  # the signal came, a library caught what it raised...
        raise raised  # ...and raised its own error instead

    monkeypatch.setattr(pipeline, "extract", interrupted)
    run = in_process("extract", tiny_dirs["gpt2"], "--seq", 16, "--out", tmp_path / "out")
    status, line = EXPECTED[sig]
    assert (run.returncode, run.stderr.strip().splitlines()) == (status, [line]), run.stderr


def test_a_spawned_worker_keeps_the_default_sigterm(tmp_path):
    """The fuzzer's hang: a plan worker runs the console script again as it starts (spawn), which imported
    start.py, whose handler held the SIGTERM of Pool.terminate; the worker lived on and the plan waited for it
    forever. A child multiprocessing is preparing installs nothing."""
    script = tmp_path / "entry.py"
    script.write_text(
        "import signal, sys\n"
        "import fxworkload.start  # what the console script imports first\n"
        "def default_sigterm():\n"
        "    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "if __name__ == '__main__':\n"
        "    import multiprocessing\n"
        "    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the command itself: handled\n"
        "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "        print(pool.apply(default_sigterm))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout.strip()) == (0, "True"), run.stderr


def test_a_signal_swallowed_by_a_destructor_before_the_run_still_stops_it(tmp_path):
    """A CI failure: Ctrl-C at the first instant landed in a ZipFile's __del__ while the CLI imported; Python
    printed "Exception ignored" and went on, and the CLI's start forgot the signal: the run wrote its output and
    exited 0. Here the signal is delivered inside a destructor on purpose, before main() imports the CLI."""
    script = tmp_path / "entry.py"
    script.write_text(
        "import os, signal, sys\n"
        "from fxworkload import errors\n"
        "from fxworkload.start import main\n"
        "errors.install()  # as main() does first\n"
        "class Dying:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # the handler's KeyboardInterrupt is ignored here\n"
        "        for _ in range(1000):  # the pending handler runs before the destructor returns\n"
        "            pass\n"
        "dying = Dying()\n"
        "del dying\n"
        "sys.argv = ['fxworkload', 'models']\n"
        "sys.exit(main())\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "Exception ignored" in run.stderr  # the swallowing this test is about happened
    assert (run.returncode, run.stderr.strip().splitlines()[-1], run.stdout) == (130, "fxworkload: interrupted", "")


def test_a_signal_after_the_command_is_over_leaves_its_status(tmp_path):
    """The fuzzer's case: a run whose output was written got SIGHUP while the interpreter exited (torch's teardown
    is about 0.8 s) and died of it with no line. Once the command is over a stop signal changes nothing."""
    marker = tmp_path / "exiting"
    script = tmp_path / "entry.py"
    script.write_text(
        "import atexit, sys, time\n"
        "from fxworkload.start import main\n"
        f"atexit.register(lambda: (open({str(marker)!r}, 'w').close(), time.sleep(2)))  # a slow exit\n"
        "sys.argv = ['fxworkload', 'models']\n"
        "sys.exit(main())\n")
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
            time.sleep(0.01)
        run.send_signal(signal.SIGHUP)
        out, err = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0 and b"gpt2" in out and err == b"", err
