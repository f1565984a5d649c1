"""On-disk cache of captured steps, so that re-costing never captures again.

What is cached is the device-free table (rows, ops with FLOPs, bytes, shapes; no times), keyed by
everything that shapes it: the config.json as read (which decides the task), batch, seq, dtype, gradient dtype, the device
the trace dispatched for, the execution stack, the fxworkload, torch and transformers versions, and a hash of this
package's own source (so a changed FLOP rule never reads a stale entry). Entries are JSON data
(``store.py``: a folder only the user can write, each entry checked against its kind and key), read
back field by field into the table's dataclasses (``records.py``); an op that several rows share (the
fast path's layer copies) is written once and shared again when read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .. import store
from ..fingerprint import versions
from ..records import RecordError, decode, encode
from .stacks import STACKS
from .table import GradRow, NodeRow, OpCost, Workload

KIND = "captured-step"
# the fused attention op's facts (optime.attention_facts): the only field of an op that is not typed by its class
ATTENTION_FIELDS = {"backend": str, "backward": bool, "batch": int, "heads": int, "kv_heads": int, "q_len": int,
                    "kv_len": int, "head_dim": int, "is_causal": bool, "has_mask": bool, "dropout": float,
                    "visited_share": float}


@dataclass(frozen=True)
class CachedStep:
    """A captured step with what it was captured from: the resolved sequence length and the model's facts
    (a dataclass the caller names when it loads: parallel.facts.ModelFacts, a layer above this one)."""
    workload: Workload
    seq: int
    facts: object


def key(config: dict, batch: int, seq: int | None, dtype: str, grad_dtype: str, trace_device: str,
        shards: tuple[int, int] = (1, 1), vocab_multiple: int = 1, every_layer: bool = False,
        stack: str = "eager") -> str:
    """``config``: the config.json as read (a dict), so that a cached run needs no transformers.
    ``shards``: the tensor- and expert-parallel degrees the traced model was split by."""
    material = json.dumps({"config": config, "batch": batch, "seq": seq, "dtype": dtype,
                           "grad_dtype": grad_dtype, "trace_device": trace_device, "shards": list(shards),
                           "vocab_multiple": vocab_multiple, "every_layer": every_layer, "stack": stack}
                          | versions(), sort_keys=True, default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def path_of(cache_key: str) -> Path:
    return store.cache_dir() / "graphs" / f"{cache_key}.json"


def load(cache_key: str, facts_type: type) -> CachedStep | None:
    """The step cached under this key, or None (absent, or not a step written for this key: see store.py)."""
    path = path_of(cache_key)
    data = store.read(path, KIND, cache_key)
    if data is None:
        return None
    try:
        return from_data(data, facts_type)
    except RecordError as exc:
        store.note(f"cache: {path} does not hold a captured step ({exc}): not used, the step is captured again")
        return None


def save(cache_key: str, entry: CachedStep) -> None:
    try:
        data = to_data(entry)
    except RecordError as exc:
        store.note(f"cache: the step was not cached ({exc})")
        return
    store.write(path_of(cache_key), KIND, cache_key, data)


def to_data(entry: CachedStep) -> dict:
    """The step as JSON data: every distinct op once, rows naming their ops by index."""
    index: dict[int, int] = {}
    ops: list = []

    def ref(op: OpCost) -> int:
        if id(op) not in index:
            index[id(op)] = len(ops)
            ops.append(encode(op))
        return index[id(op)]

    rows = []
    for row in entry.workload.rows:
        if isinstance(row, NodeRow):
            rows.append({"node": {"name": row.name, "module": row.module, "forward": ref(row.forward),
                                  "input_grad": [ref(op) for op in row.input_grad],
                                  "weight_grad": [ref(op) for op in row.weight_grad],
                                  "saved_bytes": row.saved_bytes, "selective_saved_bytes": row.selective_saved_bytes}})
        else:
            rows.append({"grad": encode(row)})
    workload = {name: encode(getattr(entry.workload, name)) for name in _WORKLOAD_FIELDS}
    return {"ops": ops, "rows": rows, "workload": workload, "seq": entry.seq, "facts": encode(entry.facts)}


_WORKLOAD_FIELDS = ("parameter_count", "gradient_bytes", "step_peak_bytes", "activation_peak_bytes", "reserved_slack_bytes",
                    "error_intervals", "fp8_weight_elements", "fp8_modules", "stack")


def from_data(data, facts_type: type) -> CachedStep:
    """The step of ``to_data``'s JSON, every field checked (RecordError where one is not what it must be)."""
    data = _object(data, "step")
    if set(data) != {"ops", "rows", "workload", "seq", "facts"}:
        _fail("step", "its fields are not ops, rows, workload, seq, facts")
    ops = [_op(value, f"ops[{i}]") for i, value in enumerate(_list(data["ops"], "ops"))]
    rows = [_row(value, ops, f"rows[{i}]") for i, value in enumerate(_list(data["rows"], "rows"))]
    fields = _object(data["workload"], "workload")
    if set(fields) != set(_WORKLOAD_FIELDS):
        _fail("workload", "its fields differ from a table's")
    hints = {"parameter_count": int, "gradient_bytes": int, "step_peak_bytes": int, "activation_peak_bytes": int,
             "reserved_slack_bytes": int,
             "error_intervals": dict[str, tuple[float, float]], "fp8_weight_elements": int,
             "fp8_modules": frozenset[str], "stack": str}
    workload = Workload(rows=rows, **{name: decode(fields[name], hints[name], f"workload.{name}") for name in hints})
    if workload.stack not in STACKS:
        _fail("workload.stack", "not one of the execution stacks")
    seq = decode(data["seq"], int, "seq")
    if seq < 1:
        _fail("seq", "not a positive length")
    return CachedStep(workload=workload, seq=seq, facts=decode(data["facts"], facts_type, "facts"))


def _op(value, where: str) -> OpCost:
    op = decode(value, OpCost, where)
    if op.attention is not None:
        attention = op.attention
        if set(attention) != set(ATTENTION_FIELDS):
            _fail(f"{where}.attention", "its fields are not a fused attention op's")
        for name, kind in ATTENTION_FIELDS.items():
            decode(attention[name], kind, f"{where}.attention.{name}")
    return op


def _row(value, ops: list[OpCost], where: str):
    item = _object(value, where)
    if set(item) == {"grad"}:
        return decode(item["grad"], GradRow, f"{where}.grad")
    if set(item) != {"node"}:
        _fail(where, "neither a node row nor a gradient row")
    node = _object(item["node"], f"{where}.node")
    if set(node) != {"name", "module", "forward", "input_grad", "weight_grad", "saved_bytes", "selective_saved_bytes"}:
        _fail(where, "its fields are not a node row's")

    def op(i) -> OpCost:
        i = decode(i, int, where)
        if not 0 <= i < len(ops):
            _fail(where, f"names op {i} of {len(ops)}")
        return ops[i]

    return NodeRow(name=decode(node["name"], str, where), module=decode(node["module"], str, where),
                   forward=op(node["forward"]), input_grad=[op(i) for i in _list(node["input_grad"], where)],
                   weight_grad=[op(i) for i in _list(node["weight_grad"], where)],
                   saved_bytes=decode(node["saved_bytes"], int, where),
                   selective_saved_bytes=decode(node["selective_saved_bytes"], int, where))


def _object(value, where: str) -> dict:
    return value if isinstance(value, dict) else _fail(where, "not an object")


def _list(value, where: str) -> list:
    return value if isinstance(value, list) else _fail(where, "not a list")


def _fail(where: str, why: str):
    raise RecordError(f"{where}: {why}")
