"""The README and docs/ as a newcomer uses them: a short landing page, and every command shown runs as
written in a fresh clone (it parses, and reads only files that exist or that an earlier command on the
same page writes). Placeholders in angle brackets are the reader's own files."""

from __future__ import annotations

import re
import shlex
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
