"""Chakra execution traces, read back with Chakra's own decoder (protolib), checked against the rules
of the program that runs them, ASTRA-sim 2.0 (astra-sim c459ab61 with Chakra 214f2c55), and against
the cluster step they were written from."""

from __future__ import annotations

import json
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
MOE_LAYOUT = dict(tp=2, dp=4, ep=2, sp=True, micro_batches=2, zero=1)
ZERO3_LAYOUT = dict(pp=2, dp=2, vpp=2, micro_batches=2, zero=3)


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


def kind_of(node, name):
    return next((a.WhichOneof("value") for a in node.attr if a.name == name), None)


def _write(dirs, tmp_path_factory, model, layout):
    out = tmp_path_factory.mktemp("chakra") / "out"
    run = fxworkload("extract", dirs[model], "--batch", 1, "--seq", 16, "--device", "h100-sxm",
                     "--format", "chakra", "--out", out,
                     *[x for k, v in layout.items() for x in
                       ((f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", v))])
    assert run.returncode == 0, run.stderr
    fields = {k: v for k, v in layout.items() if k != "keep_gathered"}
    if layout.get("keep_gathered"):
        fields["reshard_after_forward"] = False
    cluster = extract(str(dirs[model]), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**fields)).cluster
    return out, cluster


@pytest.fixture(scope="module")
def written(tiny_dirs, tmp_path_factory):
    return _write(tiny_dirs, tmp_path_factory, "llama", LAYOUT)


@pytest.fixture(scope="module")
def written_moe(tiny_dirs, tmp_path_factory):
    return _write(tiny_dirs, tmp_path_factory, "mixtral", MOE_LAYOUT)


@pytest.fixture(scope="module")
def written_zero3(tiny_dirs, tmp_path_factory):
    return _write(tiny_dirs, tmp_path_factory, "llama4", ZERO3_LAYOUT)


@pytest.fixture(scope="module", params=["written", "written_moe", "written_zero3"])
def any_written(request):
    out, cluster = request.getfixturevalue(request.param)
    return out, cluster, {rank: read(out / f"workload.{rank}.et") for rank in range(cluster.parallel.world)}


def test_one_trace_per_rank_with_every_pass(written):
    out, cluster = written
    assert sorted(p.name for p in out.glob("*.et")) == sorted(f"workload.{r}.et" for r in range(8))
    m = LAYOUT["micro_batches"]
    for rank in range(8):
        stage = rank // 4
        nodes = read(out / f"workload.{rank}.et")
        units = [u for chunk in cluster.device_chunks[stage] for u in chunk]
        passes = [n for n in nodes if n.type == COMP_NODE and n.name.startswith("mb")]
        assert len(passes) == m * 3 * len(units)  # forward, input-grad, weight-grad
        assert [n.name for n in nodes if n.type == COMP_NODE and n not in passes] == ["optimizer step (Adam)"]
        tp = [n for n in nodes if n.type == COMM_COLL_NODE and "tp" in n.name.split()]
        expected = [c.bytes for u in units for c in u.comms[FORWARD] + u.comms[INPUT_GRAD]]
        assert sorted(attr(n, "comm_size") for n in tp) == sorted(expected * m)  # all-reduces: the whole buffer
        flops = sum(attr(n, "num_ops") for n in passes)
        assert flops == m * sum(u.costs[ph][1] for u in units for ph in (FORWARD, INPUT_GRAD, WEIGHT_GRAD))
        compute_us = sum(n.duration_micros for n in passes)
        assert compute_us == pytest.approx(m * sum(u.costs[ph][0] for u in units for ph in
                                                   (FORWARD, INPUT_GRAD, WEIGHT_GRAD)) / 1e3, abs=len(nodes))


def test_pg_name_is_a_group_id_the_group_file_names(any_written):
    """Workload.cc (extract_comm_group): std::stoi(node->pg_name()), then comm_groups.find(id) or exit;
    initialize_comm_groups: the file's keys are std::stoi'd, its values the member ranks."""
    out, cluster, traces = any_written
    groups = json.loads((out / "workload.comm_groups.json").read_text())
    assert all(str(int(key)) == key for key in groups)
    for rank, nodes in traces.items():
        for node in nodes:
            if node.type == COMM_COLL_NODE:
                assert kind_of(node, "pg_name") == "string_val"
                members = groups[str(int(attr(node, "pg_name")))]
                assert rank in members and len(members) > 1


def _members(groups: dict) -> set:
    return {tuple(v) for v in groups.values()}


def test_group_file_members_follow_megatrons_rank_order(written, written_moe):
    """Tensor-parallel innermost, then data-parallel, pipeline outermost (Megatron-LM's
    RankGenerator order tp-dp-pp); expert-parallel groups are consecutive data-parallel ranks and the
    expert-data-parallel groups stride over them (Megatron-Core's expert rank generator, tp-ep-dp)."""
    out, _ = written  # tp 2, dp 2, pp 2
    assert _members(json.loads((out / "workload.comm_groups.json").read_text())) == {
        (0, 1), (2, 3), (4, 5), (6, 7),  # tp
        (0, 2), (1, 3), (4, 6), (5, 7)}  # dp
    out, _ = written_moe  # tp 2, dp 4, ep 2
    assert _members(json.loads((out / "workload.comm_groups.json").read_text())) == {
        (0, 1), (2, 3), (4, 5), (6, 7),  # tp
        (0, 2, 4, 6), (1, 3, 5, 7),  # dp
        (0, 2), (1, 3), (4, 6), (5, 7),  # ep: data-parallel ranks 0-1 and 2-3
        (0, 4), (2, 6), (1, 5), (3, 7)}  # expert-data-parallel: data-parallel ranks 0, 2 and 1, 3


def test_each_collective_names_its_own_kind_of_group(written_moe):
    out, cluster = written_moe
    groups = {int(k): tuple(v) for k, v in json.loads((out / "workload.comm_groups.json").read_text()).items()}
    nodes = read(out / "workload.0.et")
    used = {groups[int(attr(n, "pg_name"))] for n in nodes if n.type == COMM_COLL_NODE and " tp" in n.name}
    assert used == {(0, 1)}
    used = {groups[int(attr(n, "pg_name"))] for n in nodes if n.type == COMM_COLL_NODE and n.name.endswith(" ep")}
    assert used == {(0, 2)}
    used = {groups[int(attr(n, "pg_name"))] for n in nodes if n.type == COMM_COLL_NODE and n.name.endswith(" dp_ep")}
    assert used == {(0, 4)}


def test_point_to_point_fields_are_int32_as_the_feeder_reads_them(written):
    """et_feeder_node.cpp: comm_src, comm_dst and comm_tag are read with attr.int32_val(); comm_size
    and comm_type with int64_val(), tensor_size with uint64_val(), num_ops with int64_val()."""
    out, _ = written
    for rank in range(8):
        for n in read(out / f"workload.{rank}.et"):
            for name in ("comm_src", "comm_dst", "comm_tag"):
                assert kind_of(n, name) in (None, "int32_val")
            for name in ("comm_size", "comm_type", "num_ops"):
                assert kind_of(n, name) in (None, "int64_val")
            assert kind_of(n, "tensor_size") in (None, "uint64_val")
            if n.type in (COMM_SEND_NODE, COMM_RECV_NODE):
                assert attr(n, "comm_src") != attr(n, "comm_dst")  # ASTRA-sim asserts src != dest


def test_every_dependency_is_a_data_dependency_that_resolves(any_written):
    """ETFeeder::freeChildrenNodes releases a node when its data_deps are done; ctrl_deps are never read."""
    _, _, traces = any_written
    for nodes in traces.values():
        assert [n.id for n in nodes] == list(range(len(nodes)))
        for n in nodes:
            assert not n.ctrl_deps
            assert all(d < n.id for d in n.data_deps)  # a DAG in file order: every parent read before its child
        # only the first node of the step may start at once: everything else waits for something
        assert [n.id for n in nodes if not n.data_deps][:1] == [0]


def _ancestors(nodes: list) -> list[set]:
    out: list[set] = []
    for n in nodes:
        seen = set(n.data_deps)
        for d in n.data_deps:
            seen |= out[d]
        out.append(seen)
    return out


def test_dependencies_order_each_ranks_compute_as_the_schedule_does(any_written):
    """Each compute node waits (through data dependencies alone) for the one the pipeline schedule runs
    before it on that device, and a pass that needs another stage's output waits for its receive."""
    _, cluster, traces = any_written
    p = cluster.parallel
    for rank, nodes in traces.items():
        stage = rank // (p.tp * p.dp)
        expected = []
        for kind, chunk, mb, _, _ in cluster.device_passes[stage]:
            units = cluster.device_chunks[stage][chunk]
            for unit in units if kind == "F" else reversed(units):
                expected += [f"mb{mb} {unit.name} {ph}" for ph in ((FORWARD,) if kind == "F" else
                                                                   (INPUT_GRAD, WEIGHT_GRAD))]
        compute = [n for n in nodes if n.type == COMP_NODE and n.name.startswith("mb") and "FSDP2" not in n.name
                   and not n.name.endswith("copies around its tensor-parallel collectives")]
        assert [n.name for n in compute] == expected
        ancestors = _ancestors(nodes)
        for before, after in zip(compute, compute[1:]):
            assert before.id in ancestors[after.id]
        optimizer = next(n for n in nodes if n.name == "optimizer step (Adam)")
        assert compute[-1].id in ancestors[optimizer.id]
        assert all(n.id in ancestors[optimizer.id] for n in nodes if "bucket" in n.name)
        for recv in (n for n in nodes if n.type == COMM_RECV_NODE):
            mb = recv.name.split("mb")[1]
            waiting = next(n for n in compute if n.id > recv.id)
            assert recv.id in ancestors[waiting.id] and waiting.name.startswith(f"mb{mb} ")


def test_sends_and_receives_pair_up_between_stages(written):
    """The analytical network matches a send and a receive by (tag, source, destination, size)
    (CommonNetworkApi::sim_recv, callback_tracker.search_entry)."""
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


def test_all_gather_sizes_are_each_ranks_input_as_astra_sims_ring_reads_them(written_moe, written_zero3):
    """Ring.cc: an All_Gather's final_data_size = data_size * nodes_in_ring, so comm_size is one rank's
    input; an all-reduce's and a reduce-scatter's comm_size is the whole buffer."""
    out, cluster = written_moe
    nodes = read(out / "workload.0.et")
    gathers = [n for n in nodes if n.type == COMM_COLL_NODE and " ALLGATHER tp" in n.name]
    act = 1 * 16 * 64 * 4  # micro-batch x seq x hidden x fp32 bytes: the whole sequence-parallel buffer
    assert gathers and {attr(n, "comm_size") for n in gathers} == {act // 2}
    scatters = [n for n in nodes if n.type == COMM_COLL_NODE and " REDUCESCATTER tp" in n.name]
    assert scatters and {attr(n, "comm_size") for n in scatters} == {act}
    zero1 = [n for n in nodes if "param_allgather" in n.name]
    params = {c.bytes for u in cluster.device_units[0] if u.block == "dp" for c in u.comms[WEIGHT_GRAD]
              if c.type == "ALLGATHER" and c.group == "dp"}
    assert [attr(n, "comm_size") for n in zero1 if n.name.split()[-1] == "dp"] == [params.pop() // 4]
    out, cluster = written_zero3
    gathers = [n for n in read(out / "workload.0.et") if "ZeRO 3" in n.name and " ALLGATHER " in n.name]
    assert gathers and all(attr(n, "comm_size") * 2 == _gathered_bytes(cluster, n) for n in gathers)


def _gathered_bytes(cluster, node) -> int:
    """The parameters (fp32, 4 bytes each) of the FSDP unit a ZeRO 3 gather node names, from the stage's units."""
    name = node.name.rsplit("(ZeRO 3 ", 1)[1].rstrip(")")
    first = next(u for u in cluster.device_units[0] if u.name == name)
    members = [u for u in cluster.device_units[0] if u.block != "dp" and (
        u is first or (first.layer is not None and u.layer == first.layer))]
    return 4 * sum(g.elements for u in members for g in u.grads)


def _zero3_nodes(out, rank: int) -> dict[str, list]:
    nodes = [n for n in read(out / f"workload.{rank}.et") if "ZeRO 3" in n.name]
    return {what: [n for n in nodes if what in n.name] for what in ("for forward", "for backward", "gradients")}


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_zero3_files_carry_every_gather_and_reduce_scatter_the_step_runs(tiny_dirs, tmp_path_factory, keep_gathered):
    """As the cluster step runs ZeRO 3 (cluster/zero3.py), every micro-batch: each FSDP unit (a decoder layer, the
    embedding, the head) gathers its parameters before forward and, unless --keep-gathered (FSDP2's
    reshard_after_forward=False), again before backward, and reduce-scatters its gradients after backward. The
    oracle: the stage's parameter count (the tiny Llama's, fp32) and the micro-batch count."""
    layout = dict(ZERO3_LAYOUT, keep_gathered=True) if keep_gathered else ZERO3_LAYOUT
    out, cluster = _write(tiny_dirs, tmp_path_factory, "llama4", layout)
    stage_units = [u for u in cluster.device_units[0] if u.block != "dp"]
    fsdp = {u.layer if u.layer is not None else u.name for u in stage_units}
    parameter_bytes = 4 * sum(g.elements for u in stage_units for g in u.grads)
    mbs = ZERO3_LAYOUT["micro_batches"]
    for rank in (0, 1):  # the two data-parallel ranks of stage 0
        found = _zero3_nodes(out, rank)
        assert len(found["for forward"]) == mbs * len(fsdp)
        assert len(found["for backward"]) == (0 if keep_gathered else mbs * len(fsdp))
        assert len(found["gradients"]) == mbs * len(fsdp)
        # ASTRA-sim's ring reads an all-gather's size as each rank's input (Ring.cc): half the unit's bytes at dp 2
        assert sum(attr(n, "comm_size") for n in found["for forward"]) * 2 == mbs * parameter_bytes
        assert sum(attr(n, "comm_size") for n in found["gradients"]) == mbs * parameter_bytes


def test_zero3_files_reduce_scatter_once_when_gradients_accumulate_unsharded(tiny_dirs, tmp_path_factory):
    """--accumulate-unsharded: each FSDP unit's gradients are reduce-scattered in the last micro-batch only, the
    stage's parameter bytes once (the tiny Llama, fp32), while every micro-batch still gathers."""
    out, cluster = _write(tiny_dirs, tmp_path_factory, "llama4", dict(ZERO3_LAYOUT, accumulate_unsharded=True))
    stage_units = [u for u in cluster.device_units[0] if u.block != "dp"]
    fsdp = {u.layer if u.layer is not None else u.name for u in stage_units}
    parameter_bytes = 4 * sum(g.elements for u in stage_units for g in u.grads)
    last = f"mb{ZERO3_LAYOUT['micro_batches'] - 1} "
    for rank in (0, 1):
        found = _zero3_nodes(out, rank)
        assert len(found["for forward"]) == ZERO3_LAYOUT["micro_batches"] * len(fsdp)
        assert len(found["gradients"]) == len(fsdp) and all(n.name.startswith(last) for n in found["gradients"])
        assert sum(attr(n, "comm_size") for n in found["gradients"]) == parameter_bytes


def test_resharded_backward_gathers_run_in_the_ranks_fsdp2_reshards_to(tiny_dirs, tmp_path_factory):
    """--reshard-after-forward 4 on 8 data-parallel ranks: FSDP2 views the shard mesh as (-1, 4)
    (_fsdp_init._get_post_forward_mesh_info), so ranks 0-3 and 4-7 each form a group, listed in the groups file
    ASTRA-sim reads; every backward gather of rank 5 names the group of 4-7, every forward gather the group of
    all eight."""
    out, _ = _write(tiny_dirs, tmp_path_factory, "llama4", dict(dp=8, zero=3, micro_batches=2,
                                                                reshard_after_forward=4))
    groups = {int(k): v for k, v in json.loads((out / "workload.comm_groups.json").read_text()).items()}
    assert [0, 1, 2, 3] in groups.values() and [4, 5, 6, 7] in groups.values()
    found = _zero3_nodes(out, 5)
    assert found["for backward"] and {groups[int(attr(n, "pg_name"))] == [4, 5, 6, 7] for n in found["for backward"]} == {True}
    assert {groups[int(attr(n, "pg_name"))] == list(range(8)) for n in found["for forward"]} == {True}


def test_zero3_units_wait_for_their_parameters_and_prefetch_one(written_zero3):
    """Each FSDP unit's first compute waits for its gather; the gather of the unit after it is issued once the
    unit starts (it does not wait for the unit's compute: prefetch of one), so it runs beside that compute."""
    out, _ = written_zero3
    nodes = read(out / "workload.0.et")
    by_id = {n.id: n for n in nodes}
    ancestors = _ancestors(nodes)
    gathers = [n for n in nodes if "ZeRO 3" in n.name and "for forward" in n.name and n.name.startswith("mb0 ")]
    computes = [n for n in nodes if n.type == COMP_NODE and n.name.startswith("mb0 ") and n.name.endswith("forward")]
    for gather in gathers:
        unit = gather.name.rsplit("(ZeRO 3 ", 1)[1].rstrip(")")
        first = next(n for n in computes if n.name == f"mb0 {unit} forward")
        assert gather.id in ancestors[first.id]
    # chunk 0 runs the embedding then layer 0: layer 0's gather is issued as the embedding starts
    embedding = next(n for n in computes if n.name == "mb0 embedding forward")
    layer0 = next(n for n in gathers if n.name.endswith("(ZeRO 3 layer0_attention)"))
    assert embedding.id not in ancestors[layer0.id] and by_id[layer0.id].type == COMM_COLL_NODE
    assert set(ancestors[embedding.id]) & set(ancestors[layer0.id])  # both after the pass's start


def test_the_rings_collectives_run_beside_the_block_one_after_the_other(tiny_dirs, tmp_path_factory):
    """Megatron-Core's ring (cp 2): each forward's key/value exchange, and in backward the keys again then
    their gradients (the same links, so the cluster step adds them up), run beside the attention block's
    compute: neither waits for that compute, the backward's gradients wait for the keys, and the chain's
    next node waits for the last of them."""
    out, _ = _write(tiny_dirs, tmp_path_factory, "llama", dict(cp=2, micro_batches=2))
    nodes = read(out / "workload.0.et")
    by_id = {n.id: n for n in nodes}
    ancestors = _ancestors(nodes)
    ring = [n for n in nodes if n.type == COMM_COLL_NODE and attr(n, "pg_name") and "ring" in n.name]
    backward = [n for n in ring if "again" in n.name or "gradients" in n.name]
    assert len(ring) == 2 * 2 * 3 and len(backward) == 2 * 2 * 2  # 2 layers x 2 micro-batches: 1 forward, 2 backward
    for keys, gradients in zip(backward[::2], backward[1::2]):
        assert "again" in keys.name and "gradients" in gradients.name
        assert keys.id in gradients.data_deps
        beside = [by_id[d] for d in keys.data_deps]
        assert not any(d.type == COMP_NODE and "attention" in d.name and "input_grad" in d.name
                       and d.name.split()[0] == keys.name.split()[0] for d in beside)
        assert any(gradients.id in ancestors[n.id] for n in nodes if n.id > gradients.id and n.type == COMP_NODE)


def test_too_many_ranks_is_one_line(tiny_dirs, tmp_path):
    run = fxworkload("extract", tiny_dirs["llama"], "--device", "h100-sxm", "--format", "chakra", "--dp", 2048,
                     "--out", tmp_path / "x")
    assert run.returncode == 2 and "one trace per rank" in run.stderr and not (tmp_path / "x").exists()


def test_overlapped_parameter_gathers_open_the_step_in_the_chakra_trace(tiny_dirs, tmp_path_factory):
    """--overlap-param-gather: the buckets' parameter all-gathers run at the step's start beside the first forward
    (each unit waits for its bucket's), none after the optimizer, which waits for the last of them."""
    out, cluster = _write(tiny_dirs, tmp_path_factory, "llama", dict(dp=2, zero=1, micro_batches=2,
                                                                     overlap_param_gather=True))
    nodes = read(out / "workload.0.et")
    ancestors = _ancestors(nodes)
    gathers = [n for n in nodes if n.type == COMM_COLL_NODE and "updated parameters (bucket)" in n.name]
    buckets = sum(len(g) for _, g in cluster.param_gathers[0])
    assert gathers and len(gathers) == buckets
    optimizer = next(n for n in nodes if n.name == "optimizer step (Adam)")
    assert all(g.id in ancestors[optimizer.id] for g in gathers)
    assert not any(n.id > optimizer.id and n.type == COMM_COLL_NODE for n in nodes)
    first_forward = next(n for n in nodes if n.type == COMP_NODE and n.name.startswith("mb0 "))
    assert gathers[0].id in ancestors[first_forward.id]


def test_overlapped_tp_collectives_run_beside_their_own_gemms(tiny_dirs, tmp_path_factory):
    """--tp-comm-overlap: each of a block's tensor-parallel collectives is pipelined with its own GEMMs, as the
    cluster step has it (cluster/step.py, exposed_comms_ns: the longer of the collective and its first chunk and
    the GEMMs): the collective runs beside a wait for its first of tp chunks followed by a compute node of those
    GEMMs, and the chain's next node waits for both. By hand: the wait half the collective's time at tp 2; the
    forward's GEMM nodes last q/k/v's (gate/up's) and o's (down's) forward GEMMs, picked by module name; a
    block's forward compute nodes add up to its pass; the head's collectives stay blocking, after its compute."""
    from fxworkload.cluster.network import comm_ns

    out, cluster = _write(tiny_dirs, tmp_path_factory, "llama", dict(tp=2, sp=True, micro_batches=2,
                                                                      tp_comm_overlap=True))
    nodes = read(out / "workload.0.et")
    ancestors = _ancestors(nodes)
    by_name = {n.name: n for n in nodes}
    waits = [n for n in nodes if n.name.endswith("waits for the first of 2 chunks")]
    blocks = [u for u in cluster.device_units[0] if u.layer is not None]
    assert len(waits) == 2 * len(blocks) * 2 * 2  # two micro-batches; each block two collectives a pass, two passes
    for wait in waits:
        collective = nodes[wait.id - 1]  # issued just before it, beside it: both wait on what came before
        assert collective.type == COMM_COLL_NODE and list(collective.data_deps) == list(wait.data_deps)
        assert wait.duration_micros == pytest.approx(collective.duration_micros / 2, abs=1)
        gemms = nodes[wait.id + 1]
        assert gemms.type == COMP_NODE and gemms.name.endswith(" GEMMs") and list(gemms.data_deps) == [wait.id]
        after = next(n for n in nodes if gemms.id in n.data_deps)
        assert collective.id in after.data_deps  # the chain waits for the collective too
    units = {u.name: u for u in cluster.device_units[0]}
    for block, readers, producer in (("layer0_attention", ("q_proj", "k_proj", "v_proj"), ("o_proj",)),
                                     ("layer0_mlp", ("gate_proj", "up_proj"), ("down_proj",))):
        unit = units[block]

        def forward_ns(names):
            return sum(r.forward.estimated_ns for r in unit.rows
                       if r.forward.kind == "matmul" and r.module.rsplit(".", 1)[-1] in names)

        assert by_name[f"mb0 {block} readers GEMMs"].duration_micros == round(forward_ns(readers) / 1e3)
        assert by_name[f"mb0 {block} producer GEMMs"].duration_micros == round(forward_ns(producer) / 1e3)
        compute_us = sum(by_name[f"mb0 {block} {what}"].duration_micros
                         for what in ("forward", "readers GEMMs", "producer GEMMs"))
        assert compute_us == pytest.approx(unit.costs[FORWARD][0] / 1e3, abs=1.5)
        gather = next(c for c in unit.comms[FORWARD] if c.type == "ALLGATHER")
        assert by_name[f"mb0 {block} ALLGATHER tp ({gather.what})"].duration_micros == round(
            comm_ns(gather, cluster.parallel, cluster.profile) / 1e3)
    head = [n for n in nodes if n.type == COMM_COLL_NODE and n.name.split()[1] == "head" and " tp" in n.name]
    assert head and all(by_name[f"{n.name.split()[0]} head forward"].id in ancestors[n.id]
                        for n in head if f"{n.name.split()[0]} head forward" in by_name and "gradient" not in n.name)


def test_zero3_files_carry_fsdp2s_copies_as_the_step_runs_them(written_zero3):
    """FSDP2's copy kernels (cluster/zero3.py) on the compute chain: per micro-batch and FSDP unit a copy-out after
    each gather the pass waits for and a copy-in before each reduce-scatter; their durations on a rank add up to
    its stage's zero3_copy_ns (Chakra holds whole microseconds: within one per node)."""
    out, cluster = written_zero3
    copies = [n for n in read(out / "workload.0.et") if "FSDP2 copy" in n.name]
    assert {n.name.split("FSDP2 ")[1] for n in copies} == {"copy-out", "copy-in"}
    total_us = sum(n.duration_micros for n in copies)
    assert total_us == pytest.approx(cluster.devices[0].zero3_copy_ns / 1e3, abs=len(copies))


def test_zero3_files_carry_the_waits_on_fsdp2s_hooks_as_the_step_runs_them(written_zero3, tiny_dirs):
    """The tiny Llama at seq 16 is host-bound: under ZeRO 3 the step waits on FSDP2's hooks around each unit
    (cluster/zero3.py). Each data-parallel rank of stage 0 holds that wait as compute nodes on its chain, one per
    FSDP unit and pass that waits: they sum to what the stage's step waits on the host beyond the same layout
    under ZeRO 1, within half a µs a node (a compute node lasts whole µs)."""
    out, cluster = written_zero3
    fields = dict(ZERO3_LAYOUT, zero=1)
    zero1 = extract(str(tiny_dirs["llama4"]), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**fields)).cluster
    waited = cluster.devices[0].host_wait_ns - zero1.devices[0].host_wait_ns
    assert waited > 0
    for rank in (0, 1):
        hooks = [n for n in read(out / f"workload.{rank}.et") if "FSDP2's hooks" in n.name]
        assert hooks and all(n.type == COMP_NODE for n in hooks)
        assert sum(n.duration_micros for n in hooks) * 1e3 == pytest.approx(waited, abs=500 * len(hooks))
