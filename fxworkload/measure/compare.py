"""Estimated against measured op times: per op, per op kind, and end to end.

Both files hold the same rows (the same model and settings give the same row names in the same
order); within a row and phase, ops are paired by kind and by their order among the ops of that
kind, so a graph captured for CUDA (another fused-attention kernel) still pairs with one captured
for the CPU. An op that shapes or row names show to come from another step is an error.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

from tabulate import tabulate

from ..capture.trace import PHASES
from ..errors import UserError
from ..figures import png_bytes, pyplot
from ..inputs import load_json, read_input
from ..cost.flops import KINDS


@dataclass(frozen=True)
class OpPair:
    row: str
    op: str
    kind: str
    phase: str
    estimated_ns: float
    measured_ns: float

    @property
    def ratio(self) -> float | None:
        return self.estimated_ns / self.measured_ns if self.measured_ns > 0 else None

    @property
    def absolute_error(self) -> float | None:
        """|estimated − measured| / measured; None for ops that launch no kernel (estimated 0)."""
        if self.estimated_ns <= 0 or self.measured_ns <= 0:
            return None
        return abs(self.estimated_ns - self.measured_ns) / self.measured_ns


@dataclass
class Comparison:
    pairs: list[OpPair]
    unpaired_ops: int  # ops present on one side only (e.g. the extra outputs of another attention kernel)
    estimated_ns: dict[str, float]  # phase -> total, every op
    measured_ns: dict[str, float]
    eager_step_ns: float | None
    estimated_settings: dict
    measured_settings: dict
    step_peak_bytes: tuple[int | None, int | None] = (None, None)  # estimated, measured (GPU runs only)
    trace: dict | None = None  # a profiler trace's totals: attributed_fraction, unattributed_ns, ...
    measured_warning: str | None = None  # why the measured op timings are not to be trusted (profile's own check)
    estimated_optimizer_ns: float | None = None  # the estimate's optimizer step (its cluster step's), to set a trace's against
    estimated_dropout_ops: int = 0  # the estimate's dropout kernels (native_dropout, bernoulli_)
    # (side, op, kind, estimated ns) of each op on one side only, the side that has it
    unpaired: list = field(default_factory=list)


def load_document(path: Path, expected_name: str) -> dict:
    """A workload.json or measured.json, from its path, its folder, or the .tsv beside it."""
    if path.is_dir():
        path = path / expected_name
    elif path.suffix == ".tsv":
        path = path.with_suffix(".json")
    document = load_json(path, f"the {expected_name} fxworkload wrote, or its folder")
    time_key = "estimated_ns" if expected_name == "workload.json" else "measured_ns"
    if not isinstance(document, dict) or not _has_op_times(document, time_key):
        raise UserError(f"{path}: not a {expected_name} (no rows with per-op '{time_key}'); "
                        f"pass the {expected_name} that fxworkload wrote")
    problem = _malformed(document, time_key)
    if problem:
        raise UserError(f"{path}: {problem}; pass the {expected_name} that fxworkload wrote, unedited")
    document["path"] = str(path)
    return document


MEASURED_FORMATS = ("auto", "measured", "torch-profiler", "megatron")


def detect_format(path: Path) -> str:
    """measured (fxworkload profile's measured.json), torch-profiler (a Kineto JSON trace, maybe
    gzipped) or megatron (a per-rank timing log), from the file's first bytes."""
    raw = read_input(path, "measured.json, a profiler trace (.json, .json.gz) or a Megatron timing log")
    head = raw[:1 << 16].decode("utf-8", errors="replace").lstrip()
    if head.startswith("rank:"):
        return "megatron"
    if '"traceEvents"' in head or '"schemaVersion"' in head:
        return "torch-profiler"
    if head.startswith("{"):
        return "measured"
    raise UserError(f"{path}: neither measured.json, a profiler trace nor a Megatron timing log (it starts with "
                    f"{head[:40]!r}); name its format with --measured-format")


def _check_kind(kind: str) -> None:
    if kind not in MEASURED_FORMATS:
        raise UserError(f"unknown --measured-format {kind!r}: use one of {', '.join(MEASURED_FORMATS)}")


def is_megatron_log(path: Path, kind: str = "auto") -> bool:
    _check_kind(kind)
    return kind == "megatron" or (kind == "auto" and not path.is_dir() and detect_format(path) == "megatron")


def load_measured(path: Path, estimated: dict, kind: str = "auto") -> dict:
    """The measured side of a comparison, from any of the formats compare reads."""
    _check_kind(kind)
    if path.is_dir():
        return load_document(path, "measured.json")
    kind = detect_format(path) if kind == "auto" else kind
    if kind == "measured":
        return load_document(path, "measured.json")
    if kind == "torch-profiler":
        from .profiler_trace import measured_document
        return measured_document(path, estimated)
    raise UserError(f"{path}: a Megatron timing log has phases, not ops; pass it to 'fxworkload compare'")


# Settings that define the step both files describe, with the option that sets each; the measured
# side (profile) traces one whole model, so its tp, ep and padding are 1.
STEP_SETTINGS = {"model_type": "MODEL", "batch": "--batch", "seq": "--seq", "dtype": "--dtype",
                 "tp": "--tp", "ep": "--ep", "vocab_multiple": "--vocab-multiple"}


def step_settings(settings: dict) -> dict:
    parallel = settings.get("parallel") if isinstance(settings.get("parallel"), dict) else {}
    return {key: settings.get(key, parallel.get(key, 1)) for key in STEP_SETTINGS}


def check_same_step(estimated: dict, measured: dict) -> None:
    ours, theirs = (step_settings(d.get("settings") if isinstance(d.get("settings"), dict) else {})
                    for d in (estimated, measured))
    differ = [key for key in STEP_SETTINGS if ours[key] != theirs[key]]
    if differ:
        what = ", ".join(f"{STEP_SETTINGS[k]} {ours[k]} estimated vs {theirs[k]} measured" for k in differ)
        raise UserError(f"the two files describe different steps ({what}); extract with the settings the "
                        "measurement used")


def _malformed(document: dict, time_key: str) -> str | None:
    """The first field compare reads that is missing, of the wrong type, or not a time (finite, ≥ 0)."""
    label = time_key.removesuffix("_ns")
    if not isinstance(document.get("settings", {}), dict):
        return "'settings' is not an object"
    totals = document.get("totals", {})
    if not isinstance(totals, dict):
        return "'totals' is not an object"
    for key in ("eager_step_ns", "step_peak_bytes"):
        if totals.get(key) is not None and not _is_time(totals[key]):
            return f"totals '{key}' = {totals[key]!r} is not a figure (finite, 0 or more)"
    for index, row in enumerate(document["rows"], start=1):
        if not isinstance(row, dict):
            return f"row {index} is not an object"
        if row.get("type") != "node":
            continue
        if not isinstance(row.get("name"), str):
            return f"row {index} has no name"
        for phase in PHASES:
            total = row.get(f"{phase}_{label}_ns")
            if not _is_time(total):
                return f"row {index} '{row['name']}': {phase}_{label}_ns = {total!r} is not a time in ns (finite, 0 or more)"
            ops = [row.get(phase)] if phase == "forward" else row.get(phase)
            if not isinstance(ops, list):
                return f"row {index} '{row['name']}': '{phase}' is not a list of ops"
            for op in ops:
                if not (isinstance(op, dict) and isinstance(op.get("op"), str) and isinstance(op.get("kind"), str)
                        and isinstance(op.get("input_shapes"), list)):
                    return f"row {index} '{row['name']}': a {phase} op lacks its op, kind or input_shapes"
                if not _is_time(op.get(time_key)):
                    return (f"row {index} '{row['name']}': a {phase} op's {time_key} = {op.get(time_key)!r} is not a "
                            "time in ns (finite, 0 or more)")
    return None


def _is_time(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _has_op_times(document: dict, time_key: str) -> bool:
    rows = document.get("rows")
    nodes = [r for r in rows if isinstance(r, dict) and r.get("type") == "node"] if isinstance(rows, list) else []
    return bool(nodes) and all(isinstance(r.get("forward"), dict) and time_key in r["forward"] for r in nodes)


def compare(estimated: dict, measured: dict) -> Comparison:
    check_same_step(estimated, measured)
    pairs, one_sided = [], []
    estimated_rows, measured_rows = _node_rows(estimated), _node_rows(measured)
    for index, (e_row, m_row) in enumerate(zip_longest(estimated_rows, measured_rows), start=1):
        if e_row is None or m_row is None or e_row["name"] != m_row["name"]:
            raise UserError(f"row {index} does not match: estimated has {_name(e_row)}, measured has {_name(m_row)}; "
                            "compare files of the same model, batch, seq and dtype")
        for phase in PHASES:
            row_pairs, row_one_sided = _pair_ops(e_row, m_row, phase, index)
            pairs += row_pairs
            one_sided += row_one_sided
    return Comparison(
        pairs=pairs, unpaired_ops=len(one_sided), unpaired=one_sided,
        estimated_ns={p: sum(r[f"{p}_estimated_ns"] for r in estimated_rows) for p in PHASES},
        measured_ns={p: sum(r[f"{p}_measured_ns"] for r in measured_rows) for p in PHASES},
        eager_step_ns=measured.get("totals", {}).get("eager_step_ns"),
        step_peak_bytes=(estimated.get("totals", {}).get("step_peak_bytes"),
                         measured.get("totals", {}).get("step_peak_bytes")),
        estimated_settings=estimated.get("settings", {}), measured_settings=measured.get("settings", {}),
        trace=measured.get("trace"), measured_warning=_measured_warning(measured.get("totals", {})),
        estimated_optimizer_ns=((estimated.get("cluster") or {}).get("exposed_ns") or {}).get("optimizer"),
        estimated_dropout_ops=sum(1 for row in estimated_rows for op in row_ops(row)
                                  if op.get("op", "").startswith(("aten.native_dropout", "aten.bernoulli_"))))


def row_ops(row: dict) -> list[dict]:
    """A node row's ops, forward first (a measured row's forward is None where the trace did not run it)."""
    forward = [row["forward"]] if row.get("forward") is not None else []
    return [*forward, *(row.get("input_grad") or []), *(row.get("weight_grad") or [])]


def _measured_warning(totals: dict) -> str | None:
    """profile's own check of its timings (the ops' medians against the eager step), read back from measured.json."""
    from ..limits import sum_of_ops_warning

    if not (_is_time(totals.get("step_measured_ns")) and _is_time(totals.get("eager_step_ns"))):
        return None
    return sum_of_ops_warning(totals)


def _node_rows(document: dict) -> list[dict]:
    return [r for r in document["rows"] if r.get("type") == "node"]


def _name(row: dict | None) -> str:
    return f"'{row['name']}'" if row else "no more rows"


def _ops(row: dict, phase: str) -> list[dict]:
    if phase == "forward":  # None: a profiler trace did not run this row's op
        return [row[phase]] if row[phase] is not None else []
    return row[phase]


def _by_kind(ops: list[dict]) -> dict[tuple[str, int], dict]:
    seen: dict[str, int] = defaultdict(int)
    keyed = {}
    for op in ops:
        keyed[(op["kind"], seen[op["kind"]])] = op
        seen[op["kind"]] += 1
    return keyed


# Why an op is on one side only, by side and op (checked in order; the first that matches says it)
UNPAIRED_REASONS = (
    ("estimate", ("getitem", "aten.detach", "aten.view", "aten.alias", "aten.t.", "aten.transpose"),
     "a view or a tuple index: no kernel, nothing for the trace to time"),
    ("estimate", ("aten.add.Tensor",), "autograd's sum of a tensor's gradients from its several uses, which the "
                                       "trace files under the autograd engine rather than this row"),
    ("estimate", ("aten.ones_like",), "the loss gradient's seed: the trace runs it first in backward, among the untied"),
    ("estimate", ("aten.mm", "aten.addmm", "aten.bmm"), "a GEMM the trace did not run in this row with these shapes "
                                                         "(another kernel choice, or its time tied elsewhere)"),
)


def unpaired_reason(side: str, op: str) -> str:
    return next((why for s, ops, why in UNPAIRED_REASONS if s == side and op.startswith(ops)),
                "the other side ran no such op in this row: another kernel choice, or one fused into its neighbour")


def _pair_ops(e_row: dict, m_row: dict, phase: str, index: int) -> tuple[list[OpPair], list[tuple]]:
    """The row's phase's ops paired by kind and order; and (side, op, kind, estimated ns) of each op only one
    side has."""
    estimated, measured = _by_kind(_ops(e_row, phase)), _by_kind(_ops(m_row, phase))
    pairs = []
    for key in [k for k in estimated if k in measured]:  # the row's own op order: the same in every process
        e_op, m_op = estimated[key], measured[key]
        if e_op["op"] == m_op["op"] and e_op["input_shapes"] != m_op["input_shapes"]:
            raise UserError(f"row {index} '{e_row['name']}' does not match: its {phase} {e_op['op']} reads shapes "
                            f"{e_op['input_shapes']} estimated but {m_op['input_shapes']} measured; "
                            "profile with the same model, --batch, --seq and --dtype as the extraction")
        pairs.append(OpPair(row=e_row["name"], op=e_op["op"], kind=e_op["kind"], phase=phase,
                            estimated_ns=e_op["estimated_ns"], measured_ns=m_op["measured_ns"]))
    pairs.sort(key=lambda pair: (PHASES.index(pair.phase), pair.kind, pair.op))
    one_sided = ([("estimate", estimated[k]["op"], estimated[k]["kind"], estimated[k]["estimated_ns"])
                  for k in estimated if k not in measured]
                 + [("measurement", measured[k]["op"], measured[k]["kind"], 0.0) for k in measured if k not in estimated])
    return pairs, one_sided


def relative_error(estimated_ns: float, measured_ns: float) -> float | None:
    return (estimated_ns - measured_ns) / measured_ns if measured_ns > 0 else None


def kind_summary(comparison: Comparison) -> list[dict]:
    by_kind: dict[str, list[OpPair]] = defaultdict(list)
    for pair in comparison.pairs:
        by_kind[pair.kind].append(pair)
    summary = []
    for kind in sorted(by_kind, key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
        pairs = by_kind[kind]
        errors = [e for e in (p.absolute_error for p in pairs) if e is not None]
        summary.append({"kind": kind, "count": len(pairs),
                        "estimated_ns": sum(p.estimated_ns for p in pairs),
                        "measured_ns": sum(p.measured_ns for p in pairs),
                        "median_abs_error": statistics.median(errors) if errors else None,
                        # a few long ops outweigh many short ones here, as they do in the step
                        "time_weighted_error": _weighted(pairs)})
    return summary


def overall(comparison: Comparison) -> list[dict]:
    e, m = comparison.estimated_ns, comparison.measured_ns
    spans = {"forward": ("forward",), "input_grad": ("input_grad",), "weight_grad": ("weight_grad",),
             "backward": ("input_grad", "weight_grad"), "step": PHASES}
    out = []
    for name, phases in spans.items():
        estimated_ns, measured_ns = sum(e[p] for p in phases), sum(m[p] for p in phases)
        out.append({"span": name, "estimated_ns": estimated_ns, "measured_ns": measured_ns,
                    "error": relative_error(estimated_ns, measured_ns)})
    if comparison.trace and comparison.trace.get("communication_ns"):
        # One rank's workload rows hold compute; its collectives are sized, not timed, per op.
        out.append({"span": "communication", "estimated_ns": None,
                    "measured_ns": comparison.trace["communication_ns"], "error": None})
    return out


def time_weighted_error(comparison: Comparison) -> float | None:
    """Σ |estimated − measured| / Σ measured over every paired op."""
    return _weighted(comparison.pairs)


def _weighted(pairs: list[OpPair]) -> float | None:
    measured = sum(p.measured_ns for p in pairs)
    return sum(abs(p.estimated_ns - p.measured_ns) for p in pairs) / measured if measured else None


def _pct(fraction: float | None, signed: bool = False) -> str:
    return "-" if fraction is None else f"{100 * fraction:+.1f}%" if signed else f"{100 * fraction:.1f}%"


def report_text(comparison: Comparison, top: int = 15) -> str:
    e_settings, m_settings = comparison.estimated_settings, comparison.measured_settings
    head = (f"estimated: {e_settings.get('model')} on device profile '{e_settings.get('device')}'; "
            f"measured: {m_settings.get('model')} on {m_settings.get('device')}, "
            f"batch {m_settings.get('batch')} x seq {m_settings.get('seq')}, {m_settings.get('dtype')}")
    spans = [[s["span"], "-" if s["estimated_ns"] is None else f"{s['estimated_ns'] / 1e6:.3f}",
              f"{s['measured_ns'] / 1e6:.3f}", _pct(s["error"], True)] for s in overall(comparison)]
    notes = [f"time-weighted error over {len(comparison.pairs)} paired ops: {_pct(time_weighted_error(comparison))}"]
    if comparison.eager_step_ns:
        notes.append(f"measured eager step (wall, for reference): {comparison.eager_step_ns / 1e6:.3f} ms")
    estimated_peak, measured_peak = comparison.step_peak_bytes
    if isinstance(estimated_peak, int) and isinstance(measured_peak, int) and measured_peak > 0:
        notes.append(f"step peak memory: estimated {estimated_peak / 2 ** 20:.1f} MiB, measured "
                     f"{measured_peak / 2 ** 20:.1f} MiB (max_memory_allocated), "
                     f"{_pct(relative_error(estimated_peak, measured_peak), True)}")
    if comparison.unpaired_ops:
        notes.append(f"{comparison.unpaired_ops} ops ran on one side only: they count in the phase totals above but in "
                     "no op pair below; each kind with why (a kernel choice that differs: extract with the "
                     "measurement's device and --trace-on):")
        notes += [f"  unpaired {count} x {op} ({side} only, {ns / 1e6:.3f} ms estimated): {unpaired_reason(side, op)}"
                  for (side, op), (count, ns) in unpaired_groups(comparison)]
    notes += _trace_notes(comparison.trace, e_settings)
    notes += _own_loop_notes(comparison)
    if comparison.measured_warning:  # the verdict first: the errors above compare with noise
        notes.insert(0, "VERDICT: not a comparison: the measured side failed its own check ("
                     + comparison.measured_warning.removeprefix("WARNING: ") + "); the errors above are that noise, "
                     "not the estimate's")
    kinds = [[k["kind"], k["count"], f"{k['estimated_ns'] / 1e6:.3f}", f"{k['measured_ns'] / 1e6:.3f}",
              _pct(k["median_abs_error"]), _pct(k["time_weighted_error"])] for k in kind_summary(comparison)]
    longest = sorted(comparison.pairs, key=lambda p: p.measured_ns, reverse=True)
    ops = [[p.row, p.phase, p.op, f"{p.estimated_ns / 1e6:.4f}", f"{p.measured_ns / 1e6:.4f}",
            "-" if p.ratio is None else f"{p.ratio:.2f}"] for p in (longest[:top] if top > 0 else longest)]
    return "\n\n".join([
        head,
        tabulate(spans, headers=["span", "estimated_ms", "measured_ms", "error"], tablefmt="simple"),
        "\n".join(notes),
        tabulate(kinds, headers=["kind", "ops", "estimated_ms", "measured_ms", "median_abs_error", "time_weighted_error"],
                 tablefmt="simple"),
        f"{'All' if top <= 0 else f'The {len(ops)} longest'} ops by measured time:\n" + tabulate(
            ops, headers=["row", "phase", "op", "estimated_ms", "measured_ms", "ratio"], tablefmt="simple"),
    ]) + "\n"


def _trace_notes(trace: dict | None, estimated: dict) -> list[str]:
    if not trace:
        return []
    notes = [f"profiler trace: {trace['steps']} step(s), {trace['unit']} time {trace['total_ns'] / 1e6:.3f} ms per step, "
             f"{_pct(trace['attributed_fraction'])} of it tied to graph nodes"]
    if trace.get("unmarked_steps", 0) > 1:
        notes.append(f"WARNING: the trace holds {trace['unmarked_steps']} training steps but no ProfilerStep markers, "
                     "so they were read as one step: profile with torch.profiler.schedule(...) and call prof.step() "
                     "after each step, or profile a single step")
    mismatch = _dispatch_mismatch(trace, estimated)
    if mismatch:
        notes.append(mismatch)
    if trace["communication_ns"]:
        notes.append(f"communication (nccl kernels, c10d ops): {trace['communication_ns'] / 1e6:.3f} ms per step")
    lost = list(trace["unattributed_ns"].items())
    if lost:  # each is listed with its reason below (_own_loop_notes)
        notes.append(f"tied to no graph node: {sum(ns for _, ns in lost) / 1e6:.3f} ms per step, each below with why")
    return notes


# What a training loop as HF users write it runs beside the step's graph, by the trace's op name: the reason
# an op of the trace is tied to no node (checked in this order; the first that matches names it).
UNTIED_REASONS = (
    ("optimizer step", "the optimizer, set against the estimate's above"),
    ("aten::dropout", "dropout called with the model in eval mode: it returns its input, no kernel"),
    ("aten::empty", "a tensor made outside the step's graph (the batch, a buffer)"),
    ("aten::lift_fresh", "a tensor made outside the step's graph (the batch, a buffer)"),
    ("aten::cat", "the KV cache the model builds while use_cache is on (a training loop can pass use_cache=False)"),
    ("CatBackward0", "the KV cache's concatenation, differentiated"),
    ("aten::ones_like", "the loss gradient's seed, loss.backward()'s first op"),
    ("aten::zero_", "zero_grad(set_to_none=False), or a gradient buffer zeroed"),
    ("aten::detach_", "autograd's bookkeeping of a leaf, outside the step's graph"),
    ("aten::to", "a copy of the batch to the device, or a dtype cast outside the model"),
    ("aten::copy_", "a copy of the batch to the device, or a dtype cast outside the model"),
    ("(kernels no op launched)", "GPU kernels with no CPU op above them (NCCL, cudaMemcpy)"),
)


def untied_reason(name: str) -> str:
    return next((why for key, why in UNTIED_REASONS if key in name),
                "an op the estimate's graph has no node for: another kernel choice, or work outside the model's "
                "step (data loading, logging)")


def own_loop(comparison: Comparison) -> dict | None:
    """A user's own trace against the estimate: the optimizer set against the estimate's, every op tied to no
    node with its reason, and whether the loop ran its dropouts off where the estimate trains with them."""
    trace = comparison.trace
    if not trace:
        return None
    lost = trace["unattributed_ns"]
    optimizer_ns = sum(ns for name, ns in lost.items() if name.startswith("optimizer step"))
    set_against = trace["attributed_ns"] + (optimizer_ns if comparison.estimated_optimizer_ns else 0.0)
    return {"optimizer_measured_ns": optimizer_ns or None, "optimizer_estimated_ns": comparison.estimated_optimizer_ns,
            "set_against_fraction": set_against / trace["total_ns"] if trace["total_ns"] else 0.0,
            "untied": [{"name": name, "ns": ns, "reason": untied_reason(name)} for name, ns in lost.items()],
            "dropout_off_in_measured": bool(trace.get("dropout_calls") and not trace.get("dropout_kernels")
                                            and comparison.estimated_dropout_ops
                                            and comparison.estimated_settings.get("dropout", True))}


def unpaired_groups(comparison: Comparison) -> list[tuple[tuple[str, str], tuple[int, float]]]:
    """The one-sided ops by (side, op): count and estimated ns, the costliest first."""
    groups: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for side, op, _, ns in comparison.unpaired:
        groups[(side, op)][0] += 1
        groups[(side, op)][1] += ns
    return sorted(((key, tuple(value)) for key, value in groups.items()), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))


def _own_loop_notes(comparison: Comparison) -> list[str]:
    found = own_loop(comparison)
    if found is None:
        return []
    notes = []
    if found["dropout_off_in_measured"]:
        notes.append("the measured loop ran its dropouts off (the model in eval mode: from_pretrained leaves it so "
                     "until model.train()), the estimate trains with them: call model.train() in the loop, or "
                     "extract with --no-dropout to compare the same step")
    measured, estimated = found["optimizer_measured_ns"], found["optimizer_estimated_ns"]
    if measured and estimated:
        notes.append(f"optimizer step: measured {measured / 1e6:.3f} ms, estimated {estimated / 1e6:.3f} ms "
                     f"({_pct(relative_error(estimated, measured), True)}); with it, "
                     f"{_pct(found['set_against_fraction'])} of the trace's {comparison.trace['unit']} time is set "
                     "against the estimate")
    notes += [f"  untied {u['ns'] / 1e6:.3f} ms {u['name']}: {u['reason']}" for u in found["untied"]]
    return notes


def _dispatch_mismatch(trace: dict, estimated: dict) -> str | None:
    """A trace from another device than the one whose dispatch the estimate's graph follows, and the
    extract command that follows the trace's."""
    traced_on = str(estimated.get("traced_on", ""))
    on_cpu = trace.get("unit") == "cpu op"
    if on_cpu == traced_on.startswith("cpu"):
        return None
    command = (f"fxworkload extract {estimated.get('model', 'MODEL')} --batch {estimated.get('batch')} "
               f"--seq {estimated.get('seq')} --dtype {estimated.get('dtype')} "
               + ("--trace-on cpu --device cpu" if on_cpu else "--trace-on cuda --device <the GPU's profile>"))
    return (f"WARNING: the trace ran on {'the CPU' if on_cpu else trace.get('device', 'a GPU')} but the estimate's "
            f"graph follows {'CUDA' if on_cpu else 'the CPU'}'s dispatch (traced on '{traced_on}'): attention and "
            f"fused ops differ, so fewer ops pair up; extract to match the trace: {command}")


def comparison_json(comparison: Comparison) -> str:
    """comparison.json: every paired op, per-kind and per-phase totals, and what a trace left unattributed."""
    pairs = [{"row": p.row, "phase": p.phase, "op": p.op, "kind": p.kind, "estimated_ns": p.estimated_ns,
              "measured_ns": p.measured_ns, "ratio": p.ratio} for p in comparison.pairs]
    rows: dict[str, dict] = {}
    for pair in comparison.pairs:
        row = rows.setdefault(pair.row, {"row": pair.row, **{f"{ph}_{side}_ns": 0.0 for ph in PHASES
                                                              for side in ("estimated", "measured")}})
        row[f"{pair.phase}_estimated_ns"] += pair.estimated_ns
        row[f"{pair.phase}_measured_ns"] += pair.measured_ns
    trace = comparison.trace or {}
    document = {
        "estimated_settings": comparison.estimated_settings, "measured_settings": comparison.measured_settings,
        "phases": overall(comparison), "kinds": kind_summary(comparison),
        "time_weighted_error": time_weighted_error(comparison), "unpaired_ops": comparison.unpaired_ops,
        "attributed_fraction": trace.get("attributed_fraction"), "trace": trace or None,
        "measured_warning": comparison.measured_warning, "own_loop": own_loop(comparison),
        "unpaired": [{"side": side, "op": op, "count": count, "estimated_ns": ns, "reason": unpaired_reason(side, op)}
                     for (side, op), (count, ns) in unpaired_groups(comparison)],
        "nodes": list(rows.values()), "ops": pairs}
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


def plot_png(comparison: Comparison) -> bytes:
    """Estimated vs measured ms per op, log-log, one colour per op kind, with the y = x line, as PNG bytes."""
    plt = pyplot()
    points = [p for p in comparison.pairs if p.estimated_ns > 0 and p.measured_ns > 0]
    figure, axes = plt.subplots(figsize=(7, 6), dpi=120)
    for kind in KINDS:
        mine = [p for p in points if p.kind == kind]
        if mine:
            axes.scatter([p.measured_ns / 1e6 for p in mine], [p.estimated_ns / 1e6 for p in mine],
                         s=10, alpha=0.7, label=f"{kind} ({len(mine)})")
    if points:
        low = min(min(p.measured_ns, p.estimated_ns) for p in points) / 1e6 / 1.5
        high = max(max(p.measured_ns, p.estimated_ns) for p in points) / 1e6 * 1.5
        axes.plot([low, high], [low, high], color="black", linewidth=0.8, label="y = x")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("measured ms")
    axes.set_ylabel("estimated ms")
    settings = comparison.measured_settings
    axes.set_title(f"{settings.get('model')} B={settings.get('batch')} S={settings.get('seq')} "
                   f"{settings.get('dtype')}: estimated vs measured per op", fontsize=10)
    return png_bytes(figure, axes)
