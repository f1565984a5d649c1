"""extract --format html (formats/html_report.py): one self-contained page, read back with Python's own HTML
parser and, where one is installed, a real headless browser."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from fxworkload.capture.trace import PHASES
from fxworkload.formats.html_report import TOP_NODES, breakdown_ms, part_of
from fxworkload.formats.tables import node_records
from fxworkload.pipeline import extract

from ..test_cli import fxworkload


class _Page(HTMLParser):
    """The page's title, headings, table rows and images, as the standard library's parser reads them."""

    def __init__(self):
        super().__init__()
        self.tags, self.text, self.images, self.rows = [], {}, [], 0
        self._open = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._open = tag
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag == "tr":
            self.rows += 1

    def handle_data(self, data):
        if self._open in ("title", "h1"):
            self.text[self._open] = self.text.get(self._open, "") + data


@pytest.fixture(scope="module")
def reports(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    for name in ("a", "b"):
        run = fxworkload("extract", tiny_dirs["gpt2"], "--seq", 16, "--device", "h100-sxm", "--format", "tables,html",
                         "--out", out / name)
        assert run.returncode == 0, run.stderr
    return out


def test_the_page_parses_and_holds_the_summary_chart_and_costliest_nodes(reports, tiny_dirs):
    text = (reports / "a" / "report.html").read_text()
    page = _Page()
    page.feed(text)
    assert page.text["title"] == page.text["h1"] and "h100-sxm" in page.text["title"]
    assert "script" not in page.tags and "link" not in page.tags  # self-contained, nothing runs
    (image,) = page.images
    assert base64.b64decode(image.removeprefix("data:image/png;base64,")).startswith(b"\x89PNG\r\n\x1a\n")
    nodes = node_records(extract(str(tiny_dirs["gpt2"]), seq=16, device="h100-sxm").workload)
    assert page.rows == 1 + min(TOP_NODES, len(nodes))  # the header and the costliest nodes
    assert text == (reports / "b" / "report.html").read_text()  # the same command writes the same bytes


def test_the_chart_parts_add_up_to_the_steps_phases_and_name_each_layer(tiny_dirs):
    """Oracle: the workload's own per-phase totals; a decoder layer's nodes are its 'layer N'."""
    workload = extract(str(tiny_dirs["gpt2"]), seq=16, device="h100-sxm").workload
    parts = breakdown_ms(workload)
    for phase in PHASES:
        assert sum(p[phase] for p in parts.values()) == pytest.approx(workload.totals[f"{phase}_estimated_ns"] / 1e6)
    assert part_of({"name": "transformer_h_1_mlp_c_fc", "module": "transformer.h.1.mlp.c_fc"}) == "layer 1"
    assert part_of({"name": "model_layers_12_self_attn_q_proj", "module": "model.layers.12"}) == "layer 12"
    assert part_of({"name": "lm_head", "module": "lm_head"}) == "lm_head"


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def test_a_real_headless_browser_renders_the_page(reports):
    browser = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if browser is None:
        pytest.skip(f"no headless browser installed here (looked for {', '.join(BROWSERS)} on PATH)")
    page = (reports / "a" / "report.html").resolve()
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    title = re.search(r"<h1>(.*?)</h1>", (reports / "a" / "report.html").read_text()).group(1)
    assert f"<h1>{title}</h1>" in run.stdout and run.stdout.count("<tr>") > 1
