"""MLCommons Chakra execution traces of the cluster's step: one ``workload.<rank>.et`` per rank and
``workload.comm_groups.json``, the communicator groups those traces name.

Written with the ``mlc-chakra`` package (its protobuf schema, ``et_def_pb2``, and its ``protolib``
length-delimited encoder) as ASTRA-sim 2.0 runs them (astra-sim c459ab61, Chakra 214f2c55):
a GlobalMetadata message, then one Node per operation. What its feeder and workload layer read:
- ``pg_name`` of a collective is a communicator-group id, parsed with ``std::stoi`` and looked up
  in the ``--comm-group-configuration`` file (astra-sim/workload/Workload.cc, extract_comm_group);
  the file maps each id to its member ranks (initialize_comm_groups);
- ``comm_src``, ``comm_dst`` and ``comm_tag`` are read as ``int32_val``, ``comm_size`` and
  ``comm_type`` as ``int64_val``, ``tensor_size`` as ``uint64_val`` (src/feeder/et_feeder_node.cpp);
  a send and a receive pair up by (tag, source, destination, size);
- a node is released when its ``data_deps`` are done (ETFeeder::freeChildrenNodes): every ordering
  here is a data dependency, ``ctrl_deps`` are not written;
- a compute node lasts ``duration_micros`` (whole microseconds); a collective's time is the
  simulator's own; one compute and one collective or send run at a time (HardwareResource.cc).

Each rank runs its device's passes in the pipeline schedule's order (cluster/schedule.py): a pass
waits for its input from the neighbouring stage (receive), then runs its units' compute
(``COMP_NODE``: ``num_ops`` FLOPs, ``tensor_size`` bytes moved) with the tensor/expert-parallel
collectives Megatron-LM runs there (``COMM_COLL_NODE``), one after another, and sends its output
without waiting for the transfer. ZeRO 3 gathers a chunk's parameters beside each pass, which
ends when both are done. Data-parallel buckets follow the compute that completes them and each
other; the optimizer step follows the last pass and the last bucket, and ZeRO 1/2's parameter
gathers follow it, as in the cluster step.

Ranks are numbered as Megatron-LM does: tensor-parallel innermost, then context-parallel, then
data-parallel (expert-parallel groups are consecutive data-parallel ranks), pipeline stage
outermost. Gradients are reduced over the data- and context-parallel ranks together. Context
parallelism's key and value exchange is a collective of its group: Llama 3's all-gather on the
compute chain before the attention block; Megatron-Core's ring beside the block's compute, which
the next node also waits for (the ring overlaps the block).
"""

from __future__ import annotations

import io
import json

from ..capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from ..errors import UserError
from ..parallel.collectives import (ALLGATHER, NONE, gathered_for, micro_batch_kind, micro_batch_scatters,
                                    post_forward_copies)
from ..parallel.layout import POST_FORWARD
from ..parallel.units import PRODUCER, WGRAD, gemms_beside

MAX_RANKS = 1024  # one file per rank: past this the folder is larger than any simulator run wants
COMM_TYPES = {"ALLREDUCE": "ALL_REDUCE", "ALLGATHER": "ALL_GATHER", "REDUCESCATTER": "REDUCE_SCATTER",
              "ALLTOALL": "ALL_TO_ALL"}
GROUPS_FILE = "workload.comm_groups.json"
GROUP_KINDS = ("tp", "cp", "dp", "ep", "dp_ep", POST_FORWARD)
INT32_FIELDS = ("comm_src", "comm_dst", "comm_tag")


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


def group_members(kind: str, rank: int, p) -> list[int]:
    """The ranks of ``rank``'s tensor-, context-, data- (with the context-parallel ranks), expert- or
    expert-data-parallel group."""
    stage_ranks = p.tp * p.cp * p.dp
    stage, within = divmod(rank, stage_ranks)
    d, rest = divmod(within, p.tp * p.cp)
    c, t = divmod(rest, p.tp)
    if kind == "tp":
        peers = [(d, c, x) for x in range(p.tp)]
    elif kind == "cp":
        peers = [(d, x, t) for x in range(p.cp)]
    elif kind == "dp":
        peers = [(x, y, t) for x in range(p.dp) for y in range(p.cp)]
    elif kind == POST_FORWARD:  # N consecutive members of the data-parallel group (Parallel.post_forward_ranks)
        members = group_members("dp", rank, p)
        n = p.post_forward_ranks or 1
        start = members.index(rank) // n * n
        return members[start:start + n]
    elif kind == "ep":
        peers = [(d - d % p.ep + x, c, t) for x in range(p.ep)]
    else:
        peers = [(x, c, t) for x in range(d % p.ep, p.dp, p.ep)]
    return sorted(stage * stage_ranks + x * p.tp * p.cp + y * p.tp + z for x, y, z in peers)


def comm_groups(p) -> dict[tuple[str, int], int]:
    """(group kind, rank) -> the group's id, numbered from 1 in order of kind and first member; kinds
    with the same members (dp and dp_ep without expert parallelism) share one communicator; groups
    of one rank (no collective runs there) get none."""
    ids: dict[tuple[int, ...], int] = {}
    out = {}
    for kind in GROUP_KINDS:
        for rank in range(p.world):
            members = tuple(group_members(kind, rank, p))
            if len(members) > 1:
                out[(kind, rank)] = ids.setdefault(members, len(ids) + 1)
    return out


def groups_json(p) -> str:
    members: dict[int, list[int]] = {}
    for (kind, rank), gid in comm_groups(p).items():
        members.setdefault(gid, group_members(kind, rank, p))
    return json.dumps({str(gid): ranks for gid, ranks in sorted(members.items())}, indent=1) + "\n"


def chakra_files(cluster) -> dict[str, bytes | str]:
    check_world(cluster.parallel)
    pb, encode = _schema()
    p = cluster.parallel
    groups = comm_groups(p)
    files: dict[str, bytes | str] = {}
    for rank in range(p.world):
        out = io.BytesIO()
        encode(out, pb.GlobalMetadata(version="0.0.4"))
        for node in _rank_nodes(pb, cluster, rank, groups):
            encode(out, node)
        files[f"workload.{rank}.et"] = out.getvalue()
    files[GROUPS_FILE] = groups_json(p)
    return files


class _Builder:
    """Nodes in file order; ``last`` is the end of the compute stream's chain."""

    def __init__(self, pb, rank: int, groups: dict, parallel):
        self.pb, self.rank, self.groups, self.parallel = pb, rank, groups, parallel
        self.nodes: list = []
        self.last: list[int] = []  # what the next node of the chain waits for

    def add(self, name: str, kind, deps, chained: bool = True, **attrs) -> int:
        node = self.pb.Node(id=len(self.nodes), name=name, type=kind)
        node.attr.append(self.pb.AttributeProto(name="is_cpu_op", bool_val=False))
        for key, value in attrs.items():
            if key == "duration_ns":
                node.duration_micros = round(value / 1e3)
            elif key == "group":
                node.attr.append(self.pb.AttributeProto(name="pg_name", string_val=str(self.groups[(value, self.rank)])))
            elif key == "comm_type":
                node.attr.append(self.pb.AttributeProto(name=key, int64_val=getattr(self.pb, COMM_TYPES[value])))
            elif key == "tensor_size":
                node.attr.append(self.pb.AttributeProto(name=key, uint64_val=int(value)))
            elif key in INT32_FIELDS:
                node.attr.append(self.pb.AttributeProto(name=key, int32_val=int(value)))
            else:
                node.attr.append(self.pb.AttributeProto(name=key, int64_val=int(value)))
        node.data_deps.extend(sorted(set(deps)))
        self.nodes.append(node)
        if chained:
            self.last = [node.id]
        return node.id

    def comm_size(self, comm) -> int:
        """ASTRA-sim's ring takes an all-gather's size as each rank's input, the whole buffer divided by the
        group (Ring.cc: All_Gather final_data_size = data_size * nodes_in_ring); the other collectives' as
        the whole buffer (All_Reduce, Reduce_Scatter, All_to_All: msg_size = data_size / nodes_in_ring)."""
        if comm.type != ALLGATHER:
            return comm.bytes
        return comm.bytes // len(group_members(comm.group, self.rank, self.parallel))

    def chain(self, name: str, kind, extra=(), **attrs) -> int:
        return self.add(name, kind, [*self.last, *extra], **attrs)

    def collective(self, name: str, comm, duration_ns: float, deps=None) -> int:
        attrs = dict(comm_type=comm.type, comm_size=self.comm_size(comm), group=comm.group, duration_ns=duration_ns)
        if deps is None:
            return self.chain(name, self.pb.COMM_COLL_NODE, **attrs)
        return self.add(name, self.pb.COMM_COLL_NODE, deps, chained=False, **attrs)


def _rank_nodes(pb, cluster, rank: int, groups: dict) -> list:
    from ..cluster.network import comm_ns

    p = cluster.parallel
    stage_ranks = p.tp * p.cp * p.dp
    stage, within = divmod(rank, stage_ranks)
    units, chunks = cluster.device_units[stage], cluster.device_chunks[stage]
    b = _Builder(pb, rank, groups, p)
    completes: dict[int, int] = {}  # id(unit) -> its last backward compute node of the step
    last_virtual = p.pp * p.vpp - 1
    boundary = cluster.boundary_bytes
    fsdp = _fsdp_groups(units) if p.zero == 3 else {}
    stream: list[int] = []  # ZeRO 3's communication stream: its collectives run one after another, in issue order

    def issue(mb: int, comm, unit, deps: list[int]) -> int:
        nonlocal stream
        name = f"mb{mb} {comm.type} {comm.group} {comm.what} (ZeRO {p.zero} {unit.name})"
        stream = [b.collective(name, comm, comm_ns(comm, p, cluster.profile), deps=[*deps, *stream])]
        return stream[0]

    copy_waits = cluster.copy_waits(chunks[0], True)  # --activation-offload-layers (pp 1: one chunk)
    back_waits = cluster.copy_waits(list(reversed(chunks[0])), False)
    for kind, chunk, mb, _, _ in cluster.device_passes[stage]:
        virtual = chunk * p.pp + stage
        forward = kind == "F"
        source = virtual - 1 if forward else virtual + 1
        if 0 <= source <= last_virtual and not (not forward and virtual == last_virtual):
            b.chain(f"recv {'activation' if forward else 'gradient'} mb{mb}", pb.COMM_RECV_NODE,
                    comm_src=(source % p.pp) * stage_ranks + within, comm_dst=rank, comm_size=boundary,
                    comm_tag=_tag(forward, source, mb, p))
        # FSDP units in the order the pass runs them (zero3.py): each waits for its parameters' gather, issued
        # when the unit before it starts (the first one's when the pass starts); in backward each unit's
        # gradients are reduce-scattered when its compute ends
        groups, seen = [], set()
        if forward and chunk == 0 and mb == 0 and cluster.param_gathers:  # --overlap-param-gather: the step's start
            groups = [(tuple(units), tuple(gathers), (), ()) for units, gathers in cluster.param_gathers[stage] if units]
            seen = {id(u) for units, *_ in groups for u in units}
        for unit in chunks[chunk] if forward else reversed(chunks[chunk]):
            group = fsdp.get(id(unit), ((unit,), (), (), ()))
            if id(group[0][0]) not in seen:
                seen.add(id(group[0][0]))
                groups.append(group)
        phase_gathers = 1 if forward else 2
        ready = [issue(mb, c, groups[0][0][0], list(b.last)) for c in groups[0][phase_gathers]] if groups else []
        for i, group in enumerate(groups):
            members, scatters = group[0], group[3]
            b.last = [*b.last, *ready]
            if i + 1 < len(groups):
                ready = [issue(mb, c, groups[i + 1][0][0], list(b.last)) for c in groups[i + 1][phase_gathers]]
            _copy_node(b, pb, f"mb{mb} {members[0].name} FSDP2 copy-out", group[phase_gathers], cluster)
            if p.zero == 3:
                _hooks_node(b, pb, f"mb{mb} {members[0].name} waits on the host (FSDP2's hooks)", members, forward,
                            cluster)
            for unit in members if forward else reversed(members):
                wait = copy_waits.get(id(unit), 0.0) if forward else back_waits.get(id(unit), 0.0)
                if wait > 0:  # --activation-offload-layers: the layer waits for its activations' copy first
                    b.chain(f"mb{mb} {unit.name} waits for activation copies", pb.COMP_NODE, duration_ns=wait,
                            num_ops=0, tensor_size=0)
                _unit_nodes(b, pb, unit, forward, mb, p, cluster, completes)
            if forward:  # --reshard-after-forward N: the unit's 1/N kept after its forward
                _copy_node(b, pb, f"mb{mb} {members[0].name} FSDP2 post-forward reshard",
                           post_forward_copies(list(group[1]), p), cluster)
            if not forward:  # --accumulate-unsharded: only the last micro-batch reduce-scatters (the sum)
                scatters = micro_batch_scatters(scatters, micro_batch_kind(p, mb))
                _copy_node(b, pb, f"mb{mb} {members[0].name} FSDP2 copy-in", scatters, cluster)
                for c in (c for c in scatters if c.type != NONE):
                    issue(mb, c, members[0], list(b.last))
        target = virtual + 1 if forward else virtual - 1
        if 0 <= target <= last_virtual and not (forward and virtual == last_virtual):
            b.add(f"send {'activation' if forward else 'gradient'} mb{mb}", pb.COMM_SEND_NODE, b.last, chained=False,
                  comm_src=rank, comm_dst=(target % p.pp) * stage_ranks + within, comm_size=boundary,
                  comm_tag=_tag(forward, virtual, mb, p))
    last_bucket = stream if p.zero == 3 else _data_parallel(b, units, completes, cluster)
    if cluster.param_gathers and stream:  # the optimizer waits for the overlapped gathers too
        last_bucket = [*last_bucket, *stream]
    summary = cluster.devices[stage]
    if summary.optimizer_ns > 0:
        b.chain("optimizer step (Adam)", pb.COMP_NODE, extra=last_bucket, duration_ns=summary.optimizer_ns)
    elif last_bucket:
        b.last = [*b.last, *last_bucket]
    if p.zero in (1, 2) and not cluster.param_gathers:
        for unit in units:
            for comm in unit.comms[WEIGHT_GRAD] if unit.block == "dp" else ():
                if comm.type == ALLGATHER:
                    b.collective(f"{unit.name} {comm.type} {comm.group}", comm, comm_ns(comm, p, cluster.profile))
    return b.nodes


def _unit_nodes(b: _Builder, pb, unit, forward: bool, mb: int, p, cluster, completes: dict) -> None:
    """One unit's pass: CP's ring beside its compute, its compute, then its blocking collectives. Each
    --tp-comm-overlap collective is pipelined with its own GEMMs (Comm.beside), as the cluster step has it
    (cluster/step.py, exposed_comms_ns): beside a wait for its first chunk and a compute node of those GEMMs,
    both waited for by the chain's next node (_pipelined_nodes); the GEMMs that feed a collective (the
    row-parallel output's in forward, the weight gradients' in backward) after the pass's other compute, the
    others before it. The copies that go with the TP collectives (AsyncTP's partial sums and shard copies; torch's
    copies around a collective on the sequence dim) follow on the chain."""
    from ..cluster.network import comm_ns

    comms_phase = FORWARD if forward else INPUT_GRAD
    comms = unit.comms[comms_phase]
    # CP's ring: beside the block's compute, which the chain's next node waits for too; in backward the ring's two
    # collectives share its links, one after the other (the cluster step adds them up); a blocking CP all-gather
    # runs before the compute, the blocking TP/EP collectives after it
    ring = []
    for comm in (c for c in comms if c.group == "cp"):
        name = f"mb{mb} {unit.name} {comm.type} {comm.group} ({comm.what})"
        if comm.overlapped:
            ring.append(b.collective(name, comm, comm_ns(comm, p, cluster.profile), deps=ring[-1:] or b.last))
        else:
            b.collective(name, comm, comm_ns(comm, p, cluster.profile))
    paired: dict[str, list] = {}
    for comm in comms:
        if comm.overlapped and comm.beside:
            paired.setdefault(comm.beside, []).append(comm)
    for phase in (FORWARD,) if forward else (INPUT_GRAD, WEIGHT_GRAD):
        mine = {beside: group for beside, group in paired.items() if (beside == WGRAD) == (phase == WEIGHT_GRAD)}
        after = {beside: group for beside, group in mine.items() if beside in (PRODUCER if forward else "", WGRAD)}
        rest_ns, rest_flops = unit.costs[phase]
        rest_bytes = sum(op.bytes for op in unit.ops(phase))
        for beside, group in mine.items():
            gemms = gemms_beside(unit.rows, comms_phase, beside)
            rest_ns -= sum(op.estimated_ns for op in gemms)
            rest_flops -= sum(op.flops for op in gemms)
            rest_bytes -= sum(op.bytes for op in gemms)
        for beside in (x for x in mine if x not in after):
            _pipelined_nodes(b, pb, f"mb{mb} {unit.name}", mine[beside], gemms_beside(unit.rows, comms_phase, beside),
                             p, cluster)
        node = b.chain(f"mb{mb} {unit.name} {phase}", pb.COMP_NODE, duration_ns=max(rest_ns, 0.0),
                       num_ops=max(rest_flops, 0), tensor_size=max(rest_bytes, 0))
        for beside, group in after.items():
            _pipelined_nodes(b, pb, f"mb{mb} {unit.name}", group, gemms_beside(unit.rows, comms_phase, beside),
                             p, cluster)
        if not forward:
            completes[id(unit)] = b.last[0] if after else node
    b.last = [*b.last, *ring]
    own = [c for c in comms if c.group == "tp" and c.copy_bytes]
    if own:  # AsyncTP's, and torch's copies around its collectives on the sequence dim (parallel/collectives.py)
        _copy_node(b, pb, f"mb{mb} {unit.name} copies around its tensor-parallel collectives", own, cluster)
    for comm in (c for c in comms if c.group != "cp" and not c.overlapped):
        b.collective(f"mb{mb} {unit.name} {comm.type} {comm.group}", comm, comm_ns(comm, p, cluster.profile))


def _pipelined_nodes(b: _Builder, pb, name: str, comms: list, gemms: list, p, cluster) -> None:
    """Collectives pipelined in tp chunks with these GEMMs: the collectives, one after another, beside a wait for
    their first chunk (1/tp of their time, a compute node as the files carry every wait) followed by one compute
    node of the GEMMs; the chain's next node waits for both. Their span is the cluster step's: the longer of the
    collectives and the first chunk and the GEMMs. (A chunk sent as a collective of its own would pay the
    simulator's per-collective latency again.)"""
    from ..cluster.network import comm_ns

    start, beside, wait_ns = b.last, [], 0.0
    for comm in comms:
        ns = comm_ns(comm, p, cluster.profile)
        beside.append(b.collective(f"{name} {comm.type} {comm.group} ({comm.what})", comm, ns,
                                   deps=beside[-1:] or start))
        wait_ns += ns / p.tp
    b.chain(f"{name} waits for the first of {p.tp} chunks", pb.COMP_NODE, duration_ns=wait_ns, num_ops=0,
            tensor_size=0)
    b.chain(f"{name} {comms[0].beside} GEMMs", pb.COMP_NODE, duration_ns=sum(op.estimated_ns for op in gemms),
            num_ops=sum(op.flops for op in gemms), tensor_size=sum(op.bytes for op in gemms))
    b.last = [*b.last, *beside]


def _copy_node(b: _Builder, pb, name: str, comms, cluster) -> None:
    """FSDP2's copy kernel that goes with these collectives, on the compute chain (cluster/zero3.py)."""
    from ..cluster.step import copy_kernels_ns

    duration = copy_kernels_ns(list(comms), cluster.profile)
    if duration:
        b.chain(name, pb.COMP_NODE, duration_ns=duration, num_ops=0, tensor_size=sum(c.copy_bytes for c in comms))


def _hooks_node(b: _Builder, pb, name: str, members, forward: bool, cluster) -> None:
    """ZeRO 3: the compute chain idle while the host runs FSDP2's hooks around the unit (cluster/step.py)."""
    from ..cluster.step import fsdp2_hooks_wait_ns

    duration = fsdp2_hooks_wait_ns(list(members), forward, cluster.profile)
    if duration:
        b.chain(name, pb.COMP_NODE, duration_ns=duration, num_ops=0, tensor_size=0)


def _fsdp_groups(units) -> dict[int, tuple]:
    """ZeRO 3's FSDP units from the device's rows (collectives.py: a unit's reduce-scatters before it, its
    gathers for backward and forward after it): per member unit, (members, forward gathers, backward gathers,
    reduce-scatters)."""
    groups, scatters = [], []
    for unit in units:
        if unit.block == "dp":
            for comm in unit.comms[WEIGHT_GRAD]:
                if comm.type == ALLGATHER:
                    groups[-1][2 if gathered_for(comm) == "backward" else 1].append(comm)
                else:
                    scatters.append(comm)
            continue
        key = unit.layer if unit.layer is not None else unit.name
        if not groups or groups[-1][4] != key:
            groups.append(([], [], [], scatters, key))
            scatters = []
        groups[-1][0].append(unit)
    out = {}
    for members, fwd, bwd, rs, _ in groups:
        group = (tuple(members), tuple(fwd), tuple(bwd), tuple(rs))
        out.update({id(u): group for u in members})
    return out


def _data_parallel(b: _Builder, units, completes, cluster) -> list[int]:
    """Buckets after the compute that completes them (without overlap: after the last backward), one
    after another, off the compute chain."""
    from ..cluster.network import comm_ns

    previous, ready = [], None
    after_backward = [] if cluster.parallel.overlap_grad_reduce else list(b.last)
    for unit in reversed(units):
        if unit.block != "dp":
            ready = completes.get(id(unit), ready)
            continue
        for comm in unit.comms[WEIGHT_GRAD]:
            if comm.type == ALLGATHER:
                continue  # ZeRO's parameter gathers: beside each pass (3) or after the optimizer (1, 2)
            deps = previous + (after_backward or ([ready] if ready is not None else []))
            previous = [b.collective(f"{unit.name} {comm.type} {comm.group}", comm,
                                     comm_ns(comm, cluster.parallel, cluster.profile), deps=deps)]
    return previous


def _tag(forward: bool, virtual_stage: int, micro_batch: int, p) -> int:
    """One tag per transfer (direction, sending virtual stage, micro-batch), below 2^31: the feeder reads int32."""
    return (micro_batch * p.pp * p.vpp + virtual_stage) * 2 + (0 if forward else 1)
