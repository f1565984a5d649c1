"""``report.html`` (extract --format html): one self-contained page to open in a browser: the summary extract
prints, a chart of where the step's time goes (each decoder layer and the parts outside them, forward, input- and
weight-gradient apart), and the costliest nodes with their FLOPs and bytes. No script, no external file; the chart
is a PNG inside the page (matplotlib; without it the page says so). The same inputs write the same bytes."""

from __future__ import annotations

import base64
import html
import re

from ..capture.trace import PHASES
from ..errors import UserError
from ..workload.table import Workload
from .tables import NODE_COLUMNS, node_records

TOP_NODES = 40  # rows of the costliest-nodes table
_LAYER = re.compile(r"^(?:.*?_)?(?:h|layers|layer|blocks|block)_(\d+)(?:_|$)")


def part_of(record: dict) -> str:
    """The part of the model a node belongs to: 'layer N' for a decoder layer's nodes, else its top module."""
    found = _LAYER.match(record["name"])
    if found:
        return f"layer {int(found.group(1))}"
    return record["module"].split(".")[0] or "(model)"


def breakdown_ms(workload: Workload) -> dict[str, dict[str, float]]:
    """Part -> phase -> estimated ms, the parts in the order the forward meets them."""
    parts: dict[str, dict[str, float]] = {}
    for record in node_records(workload):
        part = parts.setdefault(part_of(record), dict.fromkeys(PHASES, 0.0))
        for phase in PHASES:
            part[phase] += record[f"{phase}_ms"]
    return parts


def chart_png(workload: Workload, title: str) -> bytes | None:
    """Stacked bars of each part's ms per phase, or None without matplotlib."""
    from ..figures import png_bytes, pyplot

    try:
        plt = pyplot()
    except UserError:
        return None
    parts = breakdown_ms(workload)
    names = list(parts)
    figure, axes = plt.subplots(figsize=(max(6.0, 0.35 * len(names) + 2), 4.5), dpi=110)
    bottom = [0.0] * len(names)
    for phase in PHASES:
        values = [parts[name][phase] for name in names]
        axes.bar(range(len(names)), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    axes.set_ylabel("estimated ms")
    axes.set_title(title, fontsize=10)
    return png_bytes(figure, axes)


def nodes_table_html(workload: Workload, top: int = TOP_NODES) -> str:
    """The costliest nodes (estimated ms over the three phases) as an HTML table, units in the headers."""
    records = sorted(node_records(workload), key=lambda r: -sum(r[f"{p}_ms"] for p in PHASES))[:top]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in NODE_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r[c]))}</td>" for c in NODE_COLUMNS) + "</tr>"
                   for r in records)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def report_html(workload: Workload, settings: dict, summary: str) -> str:
    title = (f"{settings.get('model')} on {settings.get('device')}: batch {settings.get('batch')} x seq "
             f"{settings.get('seq')}, {settings.get('dtype')}")
    png = chart_png(workload, title)
    chart = (f'<img alt="estimated ms per part and phase" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
             if png else "<p>(install matplotlib for the chart: pip install 'fxworkload[plot]')</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:1.5em}pre{font-size:12px}table{border-collapse:collapse;"
            "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}"
            "</style></head><body>"
            f"<h1>{html.escape(title)}</h1><h2>Summary</h2><pre>{html.escape(summary)}</pre>"
            f"<h2>Where the step's time goes</h2>{chart}"
            f"<h2>The {TOP_NODES} costliest nodes</h2>{nodes_table_html(workload)}</body></html>\n")
