"""MLCommons Chakra execution traces of the cluster's step: one ``workload.<rank>.et`` per rank.

Written with the ``mlc-chakra`` package (its protobuf schema, ``et_def_pb2``, and its ``protolib``
length-delimited encoder), as ASTRA-sim 2.0 reads them: a GlobalMetadata message, then one Node
per operation. Each rank runs its stage's passes in the pipeline schedule's order
(cluster/schedule.py); within a pass its units' compute (``COMP_NODE``: ``duration_micros``,
``num_ops`` FLOPs, ``tensor_size`` bytes moved) and the tensor/expert-parallel collectives
Megatron-LM runs there (``COMM_COLL_NODE``: ``comm_type``, ``comm_size`` bytes, ``pg_name`` the
group), one after another (control dependencies). A pass waits for its input from the
neighbouring stage (``COMM_RECV_NODE`` / ``COMM_SEND_NODE`` with ``comm_src``, ``comm_dst``,
``comm_tag``: data dependencies). Data-parallel buckets follow the compute node that completes
them (data dependency) and each other (control dependency), off the compute chain.

Ranks are numbered as Megatron-LM does: tensor-parallel innermost, then data-parallel, pipeline
stage outermost.
"""

from __future__ import annotations

import io

from ..capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from ..errors import UserError

MAX_RANKS = 1024  # one file per rank: past this the folder is larger than any simulator run wants
COMM_TYPES = {"ALLREDUCE": "ALL_REDUCE", "ALLGATHER": "ALL_GATHER", "REDUCESCATTER": "REDUCE_SCATTER",
              "ALLTOALL": "ALL_TO_ALL"}


def _schema():
    try:
        from chakra.schema.protobuf import et_def_pb2
        from chakra.src.third_party.utils.protolib import encodeMessage
    except ImportError:
        raise UserError("--format chakra needs MLCommons Chakra: pip install 'fxworkload[chakra]' "
                        "(make run installs it)") from None
    return et_def_pb2, encodeMessage


def check_world(parallel) -> None:
    if parallel.world > MAX_RANKS:
        raise UserError(f"--format chakra writes one trace per rank: {parallel.world:,} ranks exceed {MAX_RANKS:,}; "
                        "simulate a smaller --dp (the ranks of a stage differ only in their peers)")


def chakra_files(cluster) -> dict[str, bytes]:
    check_world(cluster.parallel)
    pb, encode = _schema()
    p = cluster.parallel
    stage_ranks = p.tp * p.dp
    files = {}
    for rank in range(p.world):
        stage, within = divmod(rank, stage_ranks)
        nodes = _rank_nodes(pb, cluster, stage, within, stage_ranks)
        out = io.BytesIO()
        encode(out, pb.GlobalMetadata(version="0.0.4"))
        for node in nodes:
            encode(out, node)
        files[f"workload.{rank}.et"] = out.getvalue()
    return files


class _Builder:
    def __init__(self, pb):
        self.pb, self.nodes, self.last = pb, [], None

    def add(self, name: str, kind, chained: bool = True, data_deps=(), **attrs):
        node = self.pb.Node(id=len(self.nodes), name=name, type=kind)
        node.attr.append(self.pb.AttributeProto(name="is_cpu_op", bool_val=False))
        for key, value in attrs.items():
            if key == "duration_ns":
                node.duration_micros = round(value / 1e3)
            elif key == "pg_name":
                node.attr.append(self.pb.AttributeProto(name=key, string_val=value))
            elif key == "comm_type":
                node.attr.append(self.pb.AttributeProto(name=key, int64_val=getattr(self.pb, COMM_TYPES[value])))
            elif key == "tensor_size":
                node.attr.append(self.pb.AttributeProto(name=key, uint64_val=int(value)))
            else:
                node.attr.append(self.pb.AttributeProto(name=key, int64_val=int(value)))
        if chained and self.last is not None:
            node.ctrl_deps.append(self.last)
        node.data_deps.extend(data_deps)
        self.nodes.append(node)
        if chained:
            self.last = node.id
        return node.id


def _rank_nodes(pb, cluster, stage: int, within: int, stage_ranks: int) -> list:
    from ..cluster.network import comm_ns

    p = cluster.parallel
    units = cluster.device_units[stage]
    chunks = cluster.device_chunks[stage]
    b = _Builder(pb)
    completes: dict[int, int] = {}  # id(unit) -> its last backward compute node of the step
    last_virtual = p.pp * p.vpp - 1
    boundary = cluster.boundary_bytes
    for kind, chunk, mb, _, _ in cluster.device_passes[stage]:
        virtual = chunk * p.pp + stage
        forward = kind == "F"
        source = virtual - 1 if forward else virtual + 1
        deps = []
        if 0 <= source <= last_virtual and not (not forward and virtual == last_virtual):
            peer = (source % p.pp) * stage_ranks + within
            deps.append(b.add(f"recv {'activation' if forward else 'gradient'} mb{mb}", pb.COMM_RECV_NODE,
                              comm_src=peer, comm_dst=stage * stage_ranks + within, comm_size=boundary,
                              comm_tag=_tag(forward, source, mb)))
        sequence = chunks[chunk] if forward else list(reversed(chunks[chunk]))
        for unit in sequence:
            phases = (FORWARD,) if forward else (INPUT_GRAD, WEIGHT_GRAD)
            for phase in phases:
                node = b.add(f"mb{mb} {unit.name} {phase}", pb.COMP_NODE, data_deps=deps,
                             duration_ns=unit.costs[phase][0], num_ops=unit.costs[phase][1],
                             tensor_size=sum(op.bytes for op in unit.ops(phase)))
                deps = []
                if not forward:
                    completes[id(unit)] = node
            for comm in unit.comms[FORWARD if forward else INPUT_GRAD]:
                b.add(f"mb{mb} {unit.name} {comm.type} {comm.group}", pb.COMM_COLL_NODE, comm_type=comm.type,
                      comm_size=comm.bytes, pg_name=comm.group, duration_ns=comm_ns(comm, p, cluster.profile))
        target = virtual + 1 if forward else virtual - 1
        if 0 <= target <= last_virtual and not (forward and virtual == last_virtual):
            b.add(f"send {'activation' if forward else 'gradient'} mb{mb}", pb.COMM_SEND_NODE,
                  comm_src=stage * stage_ranks + within, comm_dst=(target % p.pp) * stage_ranks + within,
                  comm_size=boundary, comm_tag=_tag(forward, virtual, mb))
    _data_parallel(b, pb, units, completes, cluster)
    return b.nodes


def _data_parallel(b: _Builder, pb, units, completes, cluster) -> None:
    """Buckets after the compute that completes them, one after another, off the compute chain."""
    from ..cluster.network import comm_ns

    previous, ready = None, None
    for unit in reversed(units):
        if unit.block != "dp":
            ready = completes.get(id(unit), ready)
            continue
        for comm in unit.comms[WEIGHT_GRAD]:
            node = b.add(f"{unit.name} {comm.type} {comm.group}", pb.COMM_COLL_NODE, chained=False,
                         data_deps=[ready] if ready is not None else [], comm_type=comm.type, comm_size=comm.bytes,
                         pg_name=comm.group, duration_ns=comm_ns(comm, cluster.parallel, cluster.profile))
            if previous is not None:
                b.nodes[node].ctrl_deps.append(previous)
            previous = node


def _tag(forward: bool, virtual_stage: int, micro_batch: int) -> int:
    """One tag per transfer: direction, the sending virtual stage, the micro-batch."""
    return (micro_batch * 100_000 + virtual_stage) * 2 + (0 if forward else 1)
