"""Timing logs of instrumented Megatron-LM runs (the Echo format), and their comparison with an estimate.

One line per operation of one rank::

    rank:R:OP(stage_id=…,batch_id=…,mg_state=warmup|steady|cooldown|finalize,duration=<ms>,
              description=…,group_kind=pp|dp|ep|ep_dp|None,input__shape=[…],input__dtype=torch.…,
              timestamp=<host ms at the end>,sub_operations=['k=v,…', …])

``description`` may hold commas and shapes hold them too, so fields are cut at the known keys, in
their order. ``sub_operations`` are the collectives called inside the op (their time is inside its
duration). In the steady 1F1B phase ``send_forward`` and ``recv_backward`` are one fused call,
logged twice with the same duration and timestamp: it is counted once.
"""

from __future__ import annotations

import ast
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..inputs import read_input

FIELDS = ("stage_id", "batch_id", "mg_state", "duration", "description", "group_kind", "input__shape",
          "input__dtype", "timestamp", "sub_operations")
SUB_FIELDS = ("trace_src_func", "duration", "timestamp", "input__shape", "input__dtype", "func_name", "group",
              "comm_func")
LINE = re.compile(r"^rank:(?P<rank>\d+):(?P<op>[A-Za-z_][A-Za-z0-9_]*)\((?P<body>.*)\)\s*$")
DTYPE_BYTES = {"torch.float32": 4, "torch.float": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.half": 2,
               "torch.int64": 8, "torch.long": 8, "torch.int32": 4, "torch.bool": 1, "torch.uint8": 1,
               "torch.int8": 1, "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1}
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
PIPELINE_OPS = ("send_forward", "recv_forward", "send_backward", "recv_backward")
MAX_LITERAL_CHARS = 1 << 20  # a line's shape or sub-operation list: real ones are a few hundred characters
MAX_FIGURE = 1e13  # ms, ids and counts: a year is 3e10 ms


@dataclass(frozen=True)
class Collective:
    name: str  # the op, or the function a sub-operation was called from
    comm: str  # allreduce, all_to_all, broadcast, send/recv, ...
    group: str  # tp, pp, dp, ep, ep_dp, exp, ...
    shape: tuple[int, ...] | None
    dtype: str | None
    duration_ms: float

    @property
    def bytes(self) -> int | None:
        if self.shape is None or self.dtype not in DTYPE_BYTES:
            return None
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass
class Record:
    rank: int
    op: str
    stage: int
    batch: int
    state: str
    duration_ms: float
    description: str
    group: str
    shape: tuple[int, ...] | None
    dtype: str | None
    timestamp_ms: float
    calls: list[Collective] = field(default_factory=list)


def parse(path: Path) -> list[Record]:
    try:
        text = read_input(path, "a Megatron timing log (lines 'rank:R:OP(…)')").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: cannot read it as a text log ({exc})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            records.append(_record(line.strip(), f"{path}:{number}"))
    if not records:
        raise UserError(f"{path}: an empty log; pass a Megatron timing log (lines 'rank:R:OP(…)')")
    return records


def _record(line: str, where: str) -> Record:
    match = LINE.match(line)
    if not match:
        raise UserError(f"{where}: not a Megatron timing line (expected 'rank:R:OP(key=value,…)'): {line[:60]!r}")
    values = _fields(match["body"], FIELDS, where)
    calls = []
    for text in _literal(values["sub_operations"], where, "sub_operations"):
        sub = _fields(str(text), SUB_FIELDS, where, required=("duration", "comm_func"))
        calls.append(Collective(name=sub.get("func_name") or sub.get("trace_src_func") or "?", comm=sub["comm_func"],
                                group=sub.get("group") or "None", shape=_shape(sub.get("input__shape"), where),
                                dtype=_none(sub.get("input__dtype")), duration_ms=_number(sub["duration"], where)))
    return Record(rank=int(match["rank"]), op=match["op"], stage=int(_number(values["stage_id"], where)),
                  batch=int(_number(values["batch_id"], where)), state=values["mg_state"],
                  duration_ms=_number(values["duration"], where), description=values["description"],
                  group=values["group_kind"], shape=_shape(values["input__shape"], where),
                  dtype=_none(values["input__dtype"]), timestamp_ms=_number(values["timestamp"], where), calls=calls)


def _fields(body: str, keys: tuple[str, ...], where: str, required: tuple[str, ...] | None = None) -> dict[str, str]:
    """Cut ``k1=v1,k2=v2,…`` at the known keys, which come in their order (a value may hold commas,
    and the sub-operations at the end hold keys of their own)."""
    found, start = [], 0
    for key in keys:
        match = re.compile(rf"(?:^|,){key}=").search(body, start)
        if match:
            found.append((match.start(), match.end(), key))
            start = match.end()
    values = {key: body[end:(found[i + 1][0] if i + 1 < len(found) else len(body))]
              for i, (_, end, key) in enumerate(found)}
    missing = [k for k in (required if required is not None else keys) if k not in values]
    if missing:
        raise UserError(f"{where}: the line lacks {', '.join(missing)}; a Megatron timing log line holds "
                        f"{', '.join(keys)}")
    return values


def _literal(text: str, where: str, what: str) -> list:
    try:
        value = ast.literal_eval(text) if len(text) <= MAX_LITERAL_CHARS else None
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        raise UserError(f"{where}: {what} is not a list ({text[:40]!r})") from None
    if not isinstance(value, list):
        raise UserError(f"{where}: {what} is not a list ({text[:40]!r})")
    return value


def _shape(text: str | None, where: str) -> tuple[int, ...] | None:
    if text is None or text == "None":
        return None
    value = _literal(text, where, "input__shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1 << 40 for d in value):
        raise UserError(f"{where}: input__shape {text!r} is not a list of sizes")
    return tuple(value)


def _number(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_FIGURE:
        raise UserError(f"{where}: {text[:40]!r} is not a time or count (0 to {MAX_FIGURE:.0e})")
    return value


def _none(text: str | None) -> str | None:
    return None if text in (None, "None") else text


@dataclass
class RankSummary:
    rank: int
    stage: int
    forward_ms: dict[int, float]  # micro-batch -> forward_step duration
    backward_ms: dict[int, float]
    collectives: list[Collective]  # every communication, fused steady-state pairs once
    optimizer_ms: float
    seq: int | None  # from the activations sent between stages, [seq, micro-batch, hidden]
    micro_batch: int | None
    hidden: int | None
    dtype: str | None


def summarize(records: list[Record], rank: int | None = None) -> RankSummary:
    ranks = sorted({r.rank for r in records})
    rank = ranks[0] if rank is None else rank
    if rank not in ranks:
        raise UserError(f"--rank {rank}: the log holds ranks {', '.join(map(str, ranks))}")
    mine = [r for r in records if r.rank == rank]
    forward = {r.batch: r.duration_ms for r in mine if r.op == "forward_step"}
    backward = {r.batch: r.duration_ms for r in mine if r.op == "backward_step"}
    if not forward:
        raise UserError(f"rank {rank} of the log has no forward_step line; a Megatron timing log of a training "
                        "step has one per micro-batch")
    collectives, fused = [], set()
    for record in mine:
        for call in record.calls:
            collectives.append(call)
        if record.op in PIPELINE_OPS or record.group not in ("None", ""):
            key = (record.timestamp_ms, record.duration_ms)
            if record.state == "steady" and record.op in PIPELINE_OPS and key in fused:
                continue  # the other half of a fused send_forward + recv_backward
            fused.add(key)
            collectives.append(Collective(name=record.op, comm=_comm_of(record), group=record.group,
                                          shape=record.shape, dtype=record.dtype, duration_ms=record.duration_ms))
    activation = next((r for r in mine if r.op in PIPELINE_OPS and r.shape and len(r.shape) == 3), None)
    seq, micro_batch, hidden = activation.shape if activation else (None, None, None)
    return RankSummary(rank=rank, stage=mine[0].stage, forward_ms=forward, backward_ms=backward,
                       collectives=collectives, optimizer_ms=sum(r.duration_ms for r in mine if r.op == "optimizer_step"),
                       seq=seq, micro_batch=micro_batch, hidden=hidden,
                       dtype=DTYPE_NAMES.get(activation.dtype) if activation else None)


def _comm_of(record: Record) -> str:
    if record.op in PIPELINE_OPS:
        return record.op.split("_")[0]
    return record.op.split("_")[-1]  # dp_allreduce -> allreduce


def compare_log(estimated: dict, summary: RankSummary) -> dict:
    """Per micro-batch forward and backward, the rank's compute, the DP gradient reduction; the
    settings the log shows checked against the estimate's first."""
    settings = estimated.get("settings", {})
    parallel = settings.get("parallel") or {}
    theirs = {"--seq": summary.seq, "--batch": summary.micro_batch, "--dtype": summary.dtype,
              "--micro-batches": len(summary.forward_ms)}
    ours = {"--seq": settings.get("seq"), "--batch": settings.get("batch"), "--dtype": settings.get("dtype"),
            "--micro-batches": parallel.get("micro_batches", 1)}
    differ = [f"{k} {theirs[k]} in the log vs {ours[k]} estimated" for k in theirs
              if theirs[k] is not None and theirs[k] != ours[k]]
    if differ:
        raise UserError(f"the log and the estimate describe different steps ({'; '.join(differ)}); "
                        "extract with the log's settings")
    totals = estimated.get("totals", {})
    forward_ms = totals.get("forward_estimated_ns", 0.0) / 1e6
    backward_ms = (totals.get("input_grad_estimated_ns", 0.0) + totals.get("weight_grad_estimated_ns", 0.0)) / 1e6
    measured_forward = statistics.median(summary.forward_ms.values())
    measured_backward = statistics.median(summary.backward_ms.values()) if summary.backward_ms else None
    micro_batches = len(summary.forward_ms)
    phases = [
        _phase("forward per micro-batch", forward_ms, measured_forward),
        _phase("backward per micro-batch", backward_ms, measured_backward),
        _phase(f"compute of {micro_batches} micro-batches", micro_batches * (forward_ms + backward_ms),
               sum(summary.forward_ms.values()) + sum(summary.backward_ms.values())),
    ]
    groups: dict[tuple[str, str, str], list[Collective]] = defaultdict(list)
    for call in summary.collectives:
        groups[(call.group, call.comm, call.name)].append(call)
    collectives = [{"group": g, "comm": c, "name": n, "count": len(calls),
                    "bytes_each": calls[0].bytes, "measured_ms": sum(x.duration_ms for x in calls)}
                   for (g, c, n), calls in sorted(groups.items())]
    dp_bytes = sum(x.bytes or 0 for x in summary.collectives if x.group in ("dp", "ep_dp") and x.comm == "allreduce")
    return {"rank": summary.rank, "stage": summary.stage, "micro_batches": micro_batches,
            "settings": {"log": theirs, "estimated": ours, "hidden_in_log": summary.hidden},
            "phases": phases, "collectives": collectives,
            "gradient_reduction": {"estimated_bytes": totals.get("gradient_bytes"), "measured_bytes": dp_bytes or None},
            "optimizer_ms": summary.optimizer_ms,
            "forward_ms_by_micro_batch": summary.forward_ms, "backward_ms_by_micro_batch": summary.backward_ms}


def _phase(span: str, estimated_ms: float, measured_ms: float | None) -> dict:
    error = (estimated_ms - measured_ms) / measured_ms if measured_ms else None
    return {"span": span, "estimated_ms": estimated_ms, "measured_ms": measured_ms, "error": error}


def log_report_text(result: dict, estimated_settings: dict) -> str:
    from tabulate import tabulate

    head = (f"estimated: {estimated_settings.get('model')} on device profile '{estimated_settings.get('device')}', "
            f"stage {(estimated_settings.get('parallel') or {}).get('stage', 0)}; measured: Megatron log, rank "
            f"{result['rank']} (stage {result['stage']}), {result['micro_batches']} micro-batches")
    phases = [[p["span"], f"{p['estimated_ms']:.3f}", "-" if p["measured_ms"] is None else f"{p['measured_ms']:.3f}",
               "-" if p["error"] is None else f"{100 * p['error']:+.1f}%"] for p in result["phases"]]
    calls = [[c["group"], c["comm"], c["name"], c["count"], "-" if c["bytes_each"] is None else f"{c['bytes_each']:,}",
              f"{c['measured_ms']:.3f}"] for c in result["collectives"]]
    reduction = result["gradient_reduction"]
    notes = [f"optimizer step (measured): {result['optimizer_ms']:.3f} ms",
             "blocking receives include the time spent waiting for the other stages"]
    if reduction["measured_bytes"]:
        estimated = reduction["estimated_bytes"]
        notes.append(f"data-parallel gradient reduction: {reduction['measured_bytes']:,} bytes in the log, "
                     f"{estimated:,} bytes estimated for this rank" if estimated is not None else
                     f"data-parallel gradient reduction: {reduction['measured_bytes']:,} bytes in the log")
    return "\n\n".join([
        head,
        tabulate(phases, headers=["span", "estimated_ms", "measured_ms", "error"], tablefmt="simple"),
        "\n".join(notes),
        "Communication in the log:\n" + tabulate(
            calls, headers=["group", "comm", "call", "count", "bytes_each", "measured_ms"], tablefmt="simple"),
    ]) + "\n"
