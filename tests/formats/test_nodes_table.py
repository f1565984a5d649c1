"""nodes.tsv and Extraction.to_pandas: the per-node table a user opens first, with FLOPs, bytes and units (issue 40)."""

from __future__ import annotations

import csv
import io

import pytest

from fxworkload.formats.tables import NODE_COLUMNS
from fxworkload.pipeline import extract


def test_nodes_table_has_units_work_only_and_adds_up_to_the_totals(tiny_dirs):
    """Every column names its unit (or is a name); no row without work (workload.tsv's views and aliases); the
    FLOPs, bytes and gradient bytes add up to workload.json's totals, the gradients to parameters x 4 (fp32)."""
    result = extract(str(tiny_dirs["gpt2"]), batch=2, seq=16)
    rows = list(csv.DictReader(io.StringIO(result.files()["nodes.tsv"]), delimiter="\t"))
    assert list(rows[0]) == NODE_COLUMNS
    assert all(c in ("name", "module", "op", "kind") or c.endswith(("_ms", "_flops", "_bytes")) for c in NODE_COLUMNS)
    work = ("forward_ms", "input_grad_ms", "weight_grad_ms", "forward_flops", "input_grad_flops", "weight_grad_flops",
            "forward_bytes", "backward_bytes")
    assert rows and all(any(float(r[c]) for c in work) for r in rows)
    assert len(rows) < len(result.files()["workload.tsv"].splitlines()) - 1
    totals = result.workload.totals
    for phase in ("forward", "input_grad", "weight_grad"):
        assert sum(int(r[f"{phase}_flops"]) for r in rows) == totals[f"{phase}_flops"]
        assert sum(float(r[f"{phase}_ms"]) for r in rows) == pytest.approx(totals[f"{phase}_estimated_ns"] / 1e6,
                                                                         abs=1e-6 * len(rows))
    assert sum(int(r["gradient_bytes"]) for r in rows) == result.workload.gradient_bytes \
        == 4 * result.workload.parameter_count


def test_to_pandas_is_the_same_table(tiny_dirs):
    result = extract(str(tiny_dirs["gpt2"]), batch=2, seq=16)
    frame = result.to_pandas()
    rows = list(csv.DictReader(io.StringIO(result.files()["nodes.tsv"]), delimiter="\t"))
    assert list(frame.columns) == NODE_COLUMNS and len(frame) == len(rows)
    assert frame["forward_flops"].sum() == result.workload.totals["forward_flops"]
