"""SimAI / ASTRA-sim workload files (policy HYBRID_TRANSFORMER_FWD_IN_BCKWD): write one rank's, read any.

Line 1 is the policy and a ``key: value`` header, line 2 the row count, then one row per unit:
name, -1, then for forward, input-grad and weight-grad each compute ns, comm type, comm bytes,
and last the update delay. The simulator parses times and sizes as integers. A plain comm type
in the forward and input-grad columns runs over the tensor-parallel group, in the weight-grad
column over the data-parallel group; ``_EP`` and ``_DP_EP`` name the expert groups. A unit with
more collectives than one per column gets extra rows with no compute, in the order they run.

What SimAI 1.6 does with the file (aliyun/SimAI f5efb5a9, astra-sim-alibabacloud/astra-sim/workload/):
- it runs the rows as written, once: every row's forward, then every row's backward in reverse
  (Workload.cc, iterate_hybrid_parallel_Transformer_fwd_in_bckwd). So the rows of a step are the
  device's units once per micro-batch, in the order its schedule runs their forwards, as AICB
  writes them (``for _ in range(self.ga_num): for layer in layers``), and the data-parallel rows
  once, with the first micro-batch, whose backward SimAI runs last;
- ``ga:`` and ``vpp:`` only enter its bubble, (pp - 1) / (ga x vpp) x the rows' compute and
  blocking collectives (Layer.cc, ``pre_bubble_time *= (PP_size - 1) / (GA * vpp)``): with the
  rows repeated ga times that is (pp - 1) / vpp micro-batch passes, Megatron's 1F1B bubble when
  ``vpp`` holds the virtual stages per device. (AICB writes the layer count there, which divides
  its bubble by the layers; we write --vpp.) The rows named ``embedding_layer`` are left out of it.
- its groups are TP, DP, EP, DP_EP and PP (Workload.cc reads no other): context parallelism's key and
  value exchange has no column, so its exposed time (all of it for ``allgather``, what outlasts the
  attention core for the ring) is added to the compute time of the phase it runs in, and the header's
  ``all_gpus`` counts the context-parallel ranks as data-parallel ones (their gradients are reduced
  together, as Megatron-Core does).
- its forward and input-gradient columns run only tensor-, expert- and expert-data-parallel groups
  (Workload.cc: a plain ``ALLGATHER`` there is the TP group), so ZeRO 3's parameter gathers, data-parallel,
  ride in the weight-gradient column of rows beside their FSDP unit, every micro-batch: SimAI issues them in
  backward, and a row's forward waits for its weight-gradient collective of the pass before
  (``is_weight_grad_comm_finished_blocking``), so the next micro-batch's forward waits for them there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..capture.trace import PHASES
from ..cluster.schedule import FORWARD as FORWARD_PASS, device_order
from ..errors import UserError
from ..parallel.collectives import EVERY, REDUCESCATTER, gathered_for, micro_batch_kind, micro_batch_scatters
from ..parallel.rank import RankWorkload
from ..parallel.units import EMBEDDING, Comm, Unit

POLICY = "HYBRID_TRANSFORMER_FWD_IN_BCKWD"
UPDATE_DELAY_NS = 100  # the seed files' per-row weight-update time; SimAI adds it after a row's weight grad
COMM_TYPES = ("NONE", "ALLREDUCE", "ALLGATHER", "REDUCESCATTER", "ALLTOALL")
GROUP_SUFFIX = {"tp": "", "dp": "", "ep": "_EP", "dp_ep": "_DP_EP"}
EMBEDDING_ROW = "embedding_layer"  # the name SimAI's bubble formula leaves out (Layer.cc: id != "embedding_layer")
FIELDS = 12


@dataclass(frozen=True)
class SimaiRow:
    name: str
    forward_ns: int
    forward_comm: str
    forward_comm_bytes: int
    input_grad_ns: int
    input_grad_comm: str
    input_grad_comm_bytes: int
    weight_grad_ns: int
    weight_grad_comm: str
    weight_grad_comm_bytes: int
    update_delay_ns: int = UPDATE_DELAY_NS


@dataclass(frozen=True)
class SimaiWorkload:
    policy: str
    header: dict[str, int]
    rows: list[SimaiRow]


def from_rank(rank: RankWorkload, device=None, cluster=None) -> SimaiWorkload:
    """``device``: the profile that times context-parallel exchanges (needed only with --cp > 1); ``cluster``: the
    step (cluster/step.py), whose waits on activation copies the rows fold in (--activation-offload-layers)."""
    p = rank.parallel
    check_layout(p)
    header = {"model_parallel_NPU_group": p.tp, "ep": p.ep, "pp": p.pp, "vpp": p.vpp, "ga": p.micro_batches,
              "all_gpus": p.world, "checkpoints": 0, "checkpoint_initiates": 0, "pp_comm": rank.pp_comm_bytes}
    waits = _copy_waits(rank, cluster) | _hook_waits(rank, device)
    return SimaiWorkload(policy=POLICY, header=header,
                         rows=[row for unit in step_units(rank) for row in _rows(unit, p, device, waits)])


def check_layout(p) -> None:
    """What a SimAI workload cannot say, in one line, before any work."""
    if p.post_forward_ranks:
        raise UserError(f"--format simai: SimAI's workload names no group smaller than the data-parallel one, and "
                        f"--reshard-after-forward {p.post_forward_ranks} gathers over {p.post_forward_ranks} of its ranks; "
                        "write --format chakra (its groups are listed) or leave the flag out")


def _hook_waits(rank: RankWorkload, device) -> dict[tuple[int, str], float]:
    """ZeRO 3: (id of a unit, phase) -> what an FSDP unit's pass waits on the host running FSDP2's hooks
    (cluster/step.py, fsdp2_hooks_wait_ns), folded into compute as the step runs it: its forward's on its first
    unit, its backward's on its last (SimAI runs backward in reverse)."""
    from ..cluster.step import fsdp2_hooks_wait_ns
    from ..parallel.collectives import fsdp_units

    if rank.parallel.zero != 3:
        return {}
    waits = {}
    for chunk in rank.chunks:
        for members in fsdp_units([u for u in chunk if u.block != "dp"]):
            waits[id(members[0]), PHASES[0]] = fsdp2_hooks_wait_ns(members, True, device)
            waits[id(members[-1]), PHASES[1]] = fsdp2_hooks_wait_ns(members, False, device)
    return waits


def _copy_waits(rank: RankWorkload, cluster) -> dict[tuple[int, str], float]:
    """(id of a unit, phase) -> what the pass waits there on activation copies (cluster/activation_offload.py),
    folded into that unit's compute as the cluster step runs it: a layer's forward wait on its first unit, its
    backward wait on its last (SimAI runs backward in reverse)."""
    if rank.parallel.activation_offload_layers and cluster is None:
        raise ValueError("an offloading rank's SimAI rows need its cluster step: its waits on the copies are compute")
    if cluster is None or cluster.activation_copies is None:
        return {}
    by_layer: dict[int, list[Unit]] = {}
    for unit in rank.chunks[0]:
        if unit.block != "dp" and unit.layer is not None:
            by_layer.setdefault(unit.layer, []).append(unit)
    waits = {}
    for layer, units in by_layer.items():
        waits[id(units[0]), PHASES[0]] = cluster.activation_wait_ns(layer, True)
        waits[id(units[-1]), PHASES[1]] = cluster.activation_wait_ns(layer, False)
    return waits


def step_units(rank: RankWorkload) -> list[Unit]:
    """The rank's units as SimAI runs them: each chunk's units once per micro-batch in the order the
    pipeline schedule runs their forwards; each data-parallel row once, in the first micro-batch's
    copy of the chunk whose unit it precedes. ZeRO 3's rows (collectives.py: a reduce-scatter before each
    FSDP unit, its gathers after it) are in every micro-batch's copy, as the cluster step runs them."""
    p = rank.parallel
    chunk_of = {id(u): c for c, chunk in enumerate(rank.chunks) for u in chunk}
    with_dp: list[list[Unit]] = [[] for _ in rank.chunks]
    pending: list[Unit] = []  # data-parallel rows waiting for the unit they precede
    previous = None  # the chunk of the last unit: ZeRO 3's gathers follow their FSDP unit
    for unit in rank.units:
        if unit.block == "dp" and p.zero == 3 and "_param_allgather_" in unit.name and previous is not None:
            with_dp[previous].append(unit)
        elif unit.block == "dp":
            pending.append(unit)
        else:
            previous = chunk_of[id(unit)]
            with_dp[previous] += [*pending, unit]
            pending = []
    with_dp[-1] += pending
    out, seen = [], set()
    for kind, chunk, micro_batch in device_order(p.pp, p.vpp, p.micro_batches, p.stage):
        if kind != FORWARD_PASS:
            continue
        first = chunk not in seen
        seen.add(chunk)
        for unit in with_dp[chunk]:
            if p.zero == 3:
                out += _micro_batch_rows(unit, micro_batch_kind(p, micro_batch))
            elif first or unit.block != "dp":
                out.append(unit)
    return out


def _micro_batch_rows(unit: Unit, kind: str) -> list[Unit]:
    """A ZeRO 3 gradient row as a micro-batch of ``kind`` runs it (--accumulate-unsharded,
    collectives.micro_batch_scatters): where it reduce-scatters nothing, a row whose only work is its kernels
    on the gradients (a NONE collective carrying their bytes, folded into compute as the copy-in is), or none."""
    scatters = [c for c in unit.comms[PHASES[2]] if c.type == REDUCESCATTER] if unit.block == "dp" else []
    if not scatters or kind == EVERY:
        return [unit]
    comms = micro_batch_scatters(scatters, kind)
    return [replace(unit, comms={**unit.comms, PHASES[2]: comms})] if comms else []


def _rows(unit: Unit, p, device, waits: dict | None = None) -> list[SimaiRow]:
    comms = [[c for c in unit.comms[phase] if c.group != "cp" and not c.overlapped] for phase in PHASES]
    copies = _fsdp2_copies(unit, device)
    folded = [_folded_ns(unit, phase, p, device) + copies[phase] + (waits or {}).get((id(unit), phase), 0.0)
              for phase in PHASES]
    name = EMBEDDING_ROW if unit.block == EMBEDDING else unit.name
    rows = []
    for k in range(max(1, *(len(c) for c in comms))):
        times = [round(unit.pass_ns(phase) + extra) if k == 0 else 0 for phase, extra in zip(PHASES, folded)]
        cells = [_cell(c[k] if k < len(c) else None) for c in comms]
        rows.append(SimaiRow(name if k == 0 else f"{unit.name}_comm{k}",
                             *(x for t, (kind, size) in zip(times, cells) for x in (t, kind, size))))
    return rows


def _fsdp2_copies(unit: Unit, device) -> dict[str, float]:
    """A ZeRO 3 row's FSDP2 copy kernels (cluster/zero3.py) as compute in the pass that runs them, as the cluster
    step does: a gather's copy-out in the pass it gathers for, a reduce-scatter's copy-in in backward (the row
    comes right after its unit's backward, which SimAI runs in reverse)."""
    from ..cluster.step import copy_kernels_ns

    forward, input_grad, weight_grad = PHASES
    out = dict.fromkeys(PHASES, 0.0)
    for comm in unit.comms[weight_grad] if unit.block == "dp" else ():
        phase = {"forward": forward, "backward": input_grad}.get(gathered_for(comm), weight_grad)
        out[phase] += copy_kernels_ns([comm], device)
    return out


def _folded_ns(unit: Unit, phase: str, p, device) -> float:
    """What CP's exchanges and the overlapped TP collectives (--tp-comm-overlap) expose, folded into compute:
    SimAI has no CP group, and would run an overlapped TP collective as a blocking one; and the copies torch
    makes around the blocking TP collectives (a sequence on dim 1: parallel/collectives.py), kernels of their own
    on the compute stream."""
    from ..cluster.step import blocking_tp_copies_ns, exposed_by_ns

    folded = [c for c in unit.comms[phase] if c.group == "cp" or c.overlapped]
    return exposed_by_ns(unit, phase, folded, p, device) + blocking_tp_copies_ns(unit, phase, device)


def text(workload: SimaiWorkload) -> str:
    head = " ".join([workload.policy, *(f"{k}: {v}" for k, v in workload.header.items())])
    lines = [head, str(len(workload.rows))]
    for r in workload.rows:
        fields = [r.name, -1, r.forward_ns, r.forward_comm, r.forward_comm_bytes, r.input_grad_ns, r.input_grad_comm,
                  r.input_grad_comm_bytes, r.weight_grad_ns, r.weight_grad_comm, r.weight_grad_comm_bytes,
                  r.update_delay_ns]
        lines.append("\t".join(str(f) for f in fields))
    return "\n".join(lines) + "\n"


def read_simai(path: str | Path) -> SimaiWorkload:
    """Parse a SimAI workload file; a malformed one is a UserError naming the line."""
    lines = Path(path).read_text().splitlines()
    if len(lines) < 2:
        raise UserError(f"{path}: a SimAI workload needs a header line and a row count")
    words = lines[0].split()
    if not words or len(words) % 2 != 1 or any(not k.endswith(":") for k in words[1::2]):
        raise UserError(f"{path}:1: expected '<POLICY> key: value ...', got {lines[0][:80]!r}")
    header = {k[:-1]: _int(v, path, 1) for k, v in zip(words[1::2], words[2::2])}
    count = _int(lines[1].strip(), path, 2)
    body = [line for line in lines[2:] if line.strip()]
    if len(body) != count:
        raise UserError(f"{path}:2: the row count says {count} but {len(body)} rows follow")
    return SimaiWorkload(policy=words[0], header=header, rows=[_row(line, path, i) for i, line in enumerate(body, 3)])


def _row(line: str, path, number: int) -> SimaiRow:
    f = line.split()  # the simulator reads fields with >>: any whitespace separates them
    if len(f) != FIELDS:
        raise UserError(f"{path}:{number}: expected {FIELDS} whitespace-separated fields, got {len(f)}")
    for i in (3, 6, 9):
        if f[i].removesuffix("_DP_EP").removesuffix("_EP") not in COMM_TYPES:
            raise UserError(f"{path}:{number}: unknown comm type {f[i]!r}")
    ints = {i: _int(f[i], path, number) for i in (1, 2, 4, 5, 7, 8, 10, 11)}
    return SimaiRow(f[0], ints[2], f[3], ints[4], ints[5], f[6], ints[7], ints[8], f[9], ints[10], ints[11])


def _cell(comm: Comm | None) -> tuple[str, int]:
    return ("NONE", 0) if comm is None else (comm.type + GROUP_SUFFIX[comm.group], comm.bytes)


def _int(value: str, path, number: int) -> int:
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{path}:{number}: {value!r} is not an integer") from None

