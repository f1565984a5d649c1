"""Chakra execution traces, read back with Chakra's own decoder (protolib) and checked against the
cluster step they were written from."""

from __future__ import annotations

import pytest
# the 'chakra' extra (make test installs it): Chakra's own schema and decoder read the files back
from chakra.schema.protobuf.et_def_pb2 import (
    COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE, COMP_NODE, GlobalMetadata, Node)
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

from fxworkload.capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract

from ..test_cli import fxworkload

LAYOUT = dict(tp=2, pp=2, dp=2, micro_batches=4)


def read(path) -> list:
    handle = openFileRd(str(path))
    metadata = GlobalMetadata()
    assert decodeMessage(handle, metadata)
    nodes = []
    node = Node()
    while decodeMessage(handle, node):
        nodes.append(node)
        node = Node()
    handle.close()
    return nodes


def attr(node, name):
    for a in node.attr:
        if a.name == name:
            return getattr(a, a.WhichOneof("value"))
    return None


@pytest.fixture(scope="module")
def written(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("chakra") / "out"
    run = fxworkload("extract", tiny_dirs["llama"], "--batch", 1, "--seq", 16, "--device", "h100-sxm",
                     "--format", "chakra", "--out", out, *[x for k, v in LAYOUT.items()
                                                            for x in (f"--{k.replace('_', '-')}", v)])
    assert run.returncode == 0, run.stderr
    cluster = extract(str(tiny_dirs["llama"]), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**LAYOUT)).cluster
    return out, cluster


def test_one_trace_per_rank_with_every_pass(written):
    out, cluster = written
    assert sorted(p.name for p in out.glob("*.et")) == sorted(f"workload.{r}.et" for r in range(8))
    m = LAYOUT["micro_batches"]
    for rank in range(8):
        stage = rank // 4
        nodes = read(out / f"workload.{rank}.et")
        units = [u for chunk in cluster.device_chunks[stage] for u in chunk]
        assert sum(n.type == COMP_NODE for n in nodes) == m * 3 * len(units)  # forward, input-grad, weight-grad
        tp = [n for n in nodes if n.type == COMM_COLL_NODE and attr(n, "pg_name") == "tp"]
        expected = [c.bytes for u in units for c in u.comms[FORWARD] + u.comms[INPUT_GRAD]]
        assert sorted(attr(n, "comm_size") for n in tp) == sorted(expected * m)
        flops = sum(attr(n, "num_ops") for n in nodes if n.type == COMP_NODE)
        assert flops == m * sum(u.costs[ph][1] for u in units for ph in (FORWARD, INPUT_GRAD, WEIGHT_GRAD))
        compute_us = sum(n.duration_micros for n in nodes if n.type == COMP_NODE)
        assert compute_us == pytest.approx(m * sum(u.costs[ph][0] for u in units for ph in
                                                   (FORWARD, INPUT_GRAD, WEIGHT_GRAD)) / 1e3, abs=len(nodes))


def test_dependencies_form_the_schedule(written):
    out, _ = written
    for rank in range(8):
        nodes = read(out / f"workload.{rank}.et")
        ids = [n.id for n in nodes]
        assert ids == list(range(len(nodes)))
        for n in nodes:  # a DAG in file order
            assert all(d < n.id for d in list(n.ctrl_deps) + list(n.data_deps))
        dp = [n for n in nodes if attr(n, "pg_name") == "dp"]
        assert dp and all(nodes[n.data_deps[0]].type == COMP_NODE for n in dp)


def test_sends_and_receives_pair_up_between_stages(written):
    out, _ = written
    sends, receives = set(), set()
    for rank in range(8):
        for n in read(out / f"workload.{rank}.et"):
            key = (attr(n, "comm_src"), attr(n, "comm_dst"), attr(n, "comm_tag"), attr(n, "comm_size"))
            if n.type == COMM_SEND_NODE:
                assert attr(n, "comm_src") == rank and abs(attr(n, "comm_dst") - rank) == 4
                sends.add(key)
            elif n.type == COMM_RECV_NODE:
                assert attr(n, "comm_dst") == rank
                receives.add(key)
    assert sends == receives and len(sends) == 4 * 2 * LAYOUT["micro_batches"]  # 4 rank pairs, both directions


def test_too_many_ranks_is_one_line(tiny_dirs, tmp_path):
    run = fxworkload("extract", tiny_dirs["llama"], "--device", "h100-sxm", "--format", "chakra", "--dp", 2048,
                     "--out", tmp_path / "x")
    assert run.returncode == 2 and "one trace per rank" in run.stderr and not (tmp_path / "x").exists()
