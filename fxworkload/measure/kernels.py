"""Measured kernel times (gemm.csv, sdpa.csv, vector.csv) held against the GPU model, and the fit.

The files have the columns documented in shared/gpu-kernels/README.md (and written by
``calibrate --on cuda``). Every row is turned into the aten ops PyTorch runs for it by tracing the
call on fake tensors through the same capture and costing path as ``extract`` (GEMM operands laid
out as the row's layout says, SDPA through the GPU dispatch rules), so what is checked is the model
that extract uses. A row's estimate is the steady state of back-to-back calls, as measured: the
larger of the host's dispatch and the GPU's kernels. Rows timed as single calls, each alone between two
events (``timing="isolated"``, as NeuSight and many papers time them), hold the call's launch gap as well
as its kernels: their estimate is that gap plus the kernels, the gap a fact of the host measured from the
fastest rows, and the fixed costs per kernel stay the starting profile's (a gap and a fixed cost cannot
be told apart on isolated calls; fitting both would charge the gap to every kernel of a step).
"""

from __future__ import annotations

import csv
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..capture.attention import GpuDispatch, GpuTarget
from ..capture.trace import FORWARD
from ..cost.devices import DeviceProfile
from ..cost.gpu import GpuModel
from ..dtypes import DTYPES
from ..errors import UserError
from ..inputs import finite_number, whole_number
from ..workload.table import OpCost, cost_of, kernel_family, op_dispatch_ns, op_estimate_ns

COLUMNS = {"gemm.csv": ("dtype", "m", "k", "n", "layout", "us"),
           "sdpa.csv": ("dtype", "batch", "heads", "kv_heads", "seq", "head_dim", "causal", "dropout", "mask",
                        "fwd_us", "bwd_us", "fwd_kernels"),
           "vector.csv": ("op", "dtype", "rows", "cols", "us")}
SIZES = {"m", "k", "n", "batch", "heads", "kv_heads", "seq", "head_dim", "rows", "cols"}
TIMES = {"us", "fwd_us", "bwd_us"}
CHOICES = {"dtype": tuple(DTYPES), "layout": ("NN", "NT", "TN"), "causal": ("True", "False")}
MAX_SIZE = 1 << 24  # one dimension of a measured kernel: a GEMM side, a sequence, rows
MAX_US = 1e7  # ten seconds: no kernel of a training step runs longer
MIN_ROWS = 4  # kernel times per family: a fit from fewer (half of them held out) is no fit


@dataclass(frozen=True)
class Sample:
    """One measured time and the ops that make it up."""
    family: str  # gemm, sdpa, vector
    group: str  # the class it is reported under (e.g. "bf16 aligned NT", "cudnn causal fwd", "softmax")
    measured_ns: float
    ops: tuple[OpCost, ...]
    row: int  # line in its file


def read_rows(path: Path) -> list[dict]:
    """The rows of one kernel CSV, each field checked: sizes whole and positive, times finite and positive,
    dtypes, layouts and flags among those the benchmarks write; one line naming the file, line and column."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in COLUMNS[path.name] if c not in header]
            if missing:
                raise UserError(f"{path}: missing column '{missing[0]}'; the columns are {', '.join(COLUMNS[path.name])}")
            rows = list(reader)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; pass the CSV that calibrate --on cuda or the benchmark wrote") from None
    except csv.Error as exc:
        raise UserError(f"{path}: not a CSV file ({exc})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    for number, row in enumerate(rows, start=2):
        for column in COLUMNS[path.name]:
            problem = _field_problem(column, row.get(column), _is_error(row))
            if problem:
                raise UserError(f"{path}:{number}: column '{column}' is {str(row.get(column))[:40]!r}, {problem}")
        if path.name == "sdpa.csv" and not _is_error(row) and int(row["heads"]) % int(row["kv_heads"]):
            raise UserError(f"{path}:{number}: {row['heads']} heads do not share {row['kv_heads']} key/value heads "
                            "evenly; a measured attention has heads a multiple of kv_heads")
        row["_line"] = number
    return rows


def _field_problem(column: str, value, failed: bool) -> str | None:
    """Why a CSV field is not what the benchmarks write, or None."""
    value = (value or "").strip()
    if column in SIZES:
        if not value.isdigit() or not 1 <= int(value) <= MAX_SIZE:
            return f"not a whole size from 1 to {MAX_SIZE:,}"
    elif column in TIMES and not failed:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and 0 < number <= MAX_US):
            return f"not a time in µs (above 0, at most {MAX_US:.0e})"
    elif column in CHOICES and value not in CHOICES[column]:
        return f"not one of {', '.join(CHOICES[column])}"
    elif column == "dropout":
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not 0 <= number < 1:
            return "not a dropout probability (0 to below 1)"
    elif column == "mask" and value not in ("none", "bool_causal") and not value.startswith("sliding"):
        return "not a mask the benchmarks use (none, bool_causal, sliding<window>)"
    elif column == "op" and value not in VECTOR_OPS:
        return f"not an op of vector.csv ({', '.join(VECTOR_OPS)})"
    return None


def _is_error(row: dict) -> bool:
    return str(row.get("fwd_kernels", "")).startswith("error")


def read_folder(data_dir: Path) -> dict[str, list[dict]]:
    """The checked rows of a kernel data folder's three files."""
    if not data_dir.is_dir():
        raise UserError(f"{data_dir}: no such folder; a kernel data folder holds gemm.csv, sdpa.csv and vector.csv")
    found = {}
    for name in COLUMNS:
        path = data_dir / name
        if not path.is_file():
            raise UserError(f"{data_dir}: no {name}; a kernel data folder holds gemm.csv, sdpa.csv and vector.csv")
        found[name] = read_rows(path)
    return found


def samples(data_dir: Path, target: GpuTarget) -> list[Sample]:
    rows = read_folder(data_dir)
    return (gemm_samples(rows["gemm.csv"]) + sdpa_samples(rows["sdpa.csv"], target)
            + vector_samples(rows["vector.csv"], target))


def _fake(*shape, dtype, requires_grad=False):
    return torch.empty(*shape, dtype=dtype, requires_grad=requires_grad)


def _traced_ops(fn: Callable, inputs: list) -> list[OpCost]:
    """The costed-free OpCosts of every call_function node fn runs, in order."""
    graph = make_fx(fn, tracing_mode="fake")(*inputs).graph
    return [cost_of(node, FORWARD, None) for node in graph.nodes if node.op == "call_function"]


def gemm_samples(rows: list[dict]) -> list[Sample]:
    out = []
    for row in rows:
        dtype, m, k, n, layout = DTYPES[row["dtype"]], int(row["m"]), int(row["k"]), int(row["n"]), row["layout"]
        with FakeTensorMode():
            a = _fake(k, m, dtype=dtype).t() if layout == "TN" else _fake(m, k, dtype=dtype)
            b = _fake(n, k, dtype=dtype).t() if layout == "NT" else _fake(k, n, dtype=dtype)
        ops = tuple(_traced_ops(torch.mm, [a, b]))
        itemsize = dtype.itemsize
        leading = ops[0].gemm_leading
        aligned = "fp32" if itemsize == 4 else (
            "aligned" if all(ld * itemsize % 16 == 0 for ld in leading) else "unaligned")
        out.append(Sample("gemm", f"{row['dtype'] if aligned == 'fp32' else aligned} {layout}",
                          float(row["us"]) * 1e3, ops, row["_line"]))
    return out


def sdpa_samples(rows: list[dict], target: GpuTarget) -> list[Sample]:
    out = []
    for row in rows:
        if _is_error(row):
            continue
        dtype = DTYPES[row["dtype"]]
        b, h, hkv, s, d = (int(row[c]) for c in ("batch", "heads", "kv_heads", "seq", "head_dim"))
        causal, dropout, mask_kind = row["causal"] == "True", float(row["dropout"]), row["mask"]
        with FakeTensorMode():
            q, k, v = (_fake(b, heads, s, d, dtype=dtype, requires_grad=True) for heads in (h, hkv, hkv))
            grad = _fake(b, h, s, d, dtype=dtype)
            mask = None if mask_kind == "none" else _fake(s, s, dtype=torch.bool)
        window = mask is not None

        def forward(q, k, v, mask):
            with GpuDispatch(target):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                      is_causal=causal and not window, enable_gqa=h != hkv)

        def step(q, k, v, grad, mask):
            out = forward(q, k, v, mask)
            return torch.autograd.grad(out, (q, k, v), grad)

        forward_ops = _traced_ops(forward, [q, k, v, mask])
        all_ops = _traced_ops(step, [q, k, v, grad, mask])
        backend = next((op.sdpa_backend for op in forward_ops if op.sdpa_backend), "math")
        what = f"{backend} {row['dtype']} {'causal' if causal else 'full'} {mask_kind} dropout={dropout:g}"
        out.append(Sample("sdpa", f"{what} fwd", float(row["fwd_us"]) * 1e3, tuple(forward_ops), row["_line"]))
        out.append(Sample("sdpa", f"{what} bwd", float(row["bwd_us"]) * 1e3,
                          tuple(all_ops[len(forward_ops):]), row["_line"]))
    return out


def _rms_norm_hf(x, weight):
    """HuggingFace's LlamaRMSNorm.forward, op for op."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + 1e-6)
    return weight * hidden.to(x.dtype)


# The ops of vector.csv. add and mul take a scalar second operand: the measured times are those of
# two tensor streams (one read, one write), not three.
VECTOR_OPS: dict[str, Callable] = {
    "add": lambda x, w, t: x + 1.0, "mul": lambda x, w, t: x * 2.0, "gelu": lambda x, w, t: F.gelu(x),
    "gelu_tanh": lambda x, w, t: F.gelu(x, approximate="tanh"), "silu": lambda x, w, t: F.silu(x),
    "softmax": lambda x, w, t: torch.softmax(x, -1), "copy": lambda x, w, t: x.clone(),
    "layer_norm": lambda x, w, t: F.layer_norm(x, (x.shape[-1],), w, w),
    "rms_norm_hf": lambda x, w, t: _rms_norm_hf(x, w), "dropout": lambda x, w, t: F.dropout(x, 0.1, True),
    "to_fp32": lambda x, w, t: x.float(), "sum_lastdim": lambda x, w, t: x.sum(-1),
    "cross_entropy": lambda x, w, t: F.cross_entropy(x.float(), t),
}


def _on_gpu(op: Callable, target: GpuTarget) -> Callable:
    def call(x, w, t):
        with GpuDispatch(target):
            return op(x, w, t)
    return call


def vector_samples(rows: list[dict], target: GpuTarget) -> list[Sample]:
    out = []
    for row in rows:
        if row["op"] not in VECTOR_OPS:
            raise UserError(f"vector.csv:{row['_line']}: unknown op '{row['op']}'; known: {', '.join(VECTOR_OPS)}")
        dtype, r, c = DTYPES[row["dtype"]], int(row["rows"]), int(row["cols"])
        with FakeTensorMode():
            x, w, t = _fake(r, c, dtype=dtype), _fake(c, dtype=dtype), torch.zeros(r, dtype=torch.long)
        ops = tuple(_traced_ops(_on_gpu(VECTOR_OPS[row["op"]], target), [x, w, t]))
        if not any(op.flops or op.bytes for op in ops):
            continue  # the call runs no kernel (x.float() of an fp32 x returns x): no kernel time to model
        out.append(Sample("vector", row["op"], float(row["us"]) * 1e3, ops, row["_line"]))
    return out


TIMINGS = ("back-to-back", "isolated")
# The fixed costs per call a fit on isolated calls leaves as they were (see the module's docstring).
FIXED_COSTS = frozenset({"gemm_kernel_ns", "gemm_min_ns", "vector_kernel_ns", "attention_kernel_ns",
                         "host_dispatch_ns", "host_output_ns"})
FASTEST_SHARE = 0.1  # the launch gap: the median of the fastest tenth's time beyond its kernels


def estimate_ns(sample: Sample, device: DeviceProfile, gap_ns: float | None = None) -> float:
    """Back-to-back calls (``gap_ns`` None): the host issues every op of a call, the GPU runs every kernel;
    the slower wins. A call timed alone: the launch gap, then its kernels (``device`` without the floor
    back-to-back GEMMs meet, ``alone``)."""
    if gap_ns is not None:
        return gap_ns + sum(op_estimate_ns(op, device) for op in sample.ops)
    kernels = sum(op_estimate_ns(op, device) for op in sample.ops)
    dispatch = sum(op_dispatch_ns(op, device) for op in sample.ops)
    return max(kernels, dispatch)


def alone(device: DeviceProfile) -> DeviceProfile:
    """The device as a single call meets it: no back-to-back floor on a GEMM (gemm_min_ns is the host's)."""
    return with_model(device, replace(device.gpu_model(), gemm_min_ns=0.0))


def relative_errors(samples: list[Sample], device: DeviceProfile, gap_ns: float | None = None) -> list[float]:
    if gap_ns is not None:
        device = alone(device)
    return [(estimate_ns(s, device, gap_ns) - s.measured_ns) / s.measured_ns for s in samples]


def launch_gap_ns(samples: list[Sample], device: DeviceProfile) -> float:
    """The launch gap of a call timed alone: over the fastest tenth of the rows (at least one), the
    median of measured time beyond the kernels' estimate, never below 0."""
    fastest = sorted(samples, key=lambda s: s.measured_ns)[:max(1, int(FASTEST_SHARE * len(samples)))]
    single = alone(device)
    return max(0.0, statistics.median(s.measured_ns - estimate_ns(s, single, 0.0) for s in fastest))


# Which parameters each family's rows decide, fitted in this order.
FAMILY_PARAMETERS = {
    "vector": ("memory_efficiency", "memory_cast_bytes_per_s_per_sm", "vector_kernel_ns", "host_dispatch_ns",
               "host_output_ns"),
    "gemm": ("gemm_tensor_efficiency", "gemm_sm80_efficiency", "gemm_align1_efficiency", "gemm_fp32_efficiency",
             "gemm_tile_edge", "gemm_kernel_ns", "gemm_min_ns"),
    "sdpa": ("attention_kernel_ns", "cudnn_forward_efficiency", "cudnn_backward_efficiency",
             "efficient_forward_efficiency", "efficient_backward_efficiency", "cudnn_forward_dropout_cost",
             "cudnn_backward_dropout_cost", "efficient_forward_dropout_cost", "efficient_backward_dropout_cost", "attention_forward_score_flops", "attention_backward_score_flops",
             "attention_large_head_forward_cost", "attention_large_head_backward_cost", "attention_forward_memory_passes", "attention_backward_memory_passes",
             "attention_mask_forward_cost", "attention_mask_backward_cost", "attention_forward_dropout_flops",
             "attention_backward_dropout_flops"),
}
STEPS = (0.5, 0.7, 0.85, 0.93, 1.07, 1.15, 1.4, 2.0)


def with_model(device: DeviceProfile, model: GpuModel) -> DeviceProfile:
    return replace(device, gpu_model_fit="", gpu_model_parameters=model.as_dict())


def fit(samples: list[Sample], device: DeviceProfile, rounds: int = 6, gap_ns: float | None = None,
        by_time: bool = False, min_gain: float = 0.0) -> GpuModel:
    """Coordinate descent in log steps on each family's median plus 0.3 x p90 absolute relative error;
    rows timed alone (``gap_ns`` given) leave the fixed costs per call as they are. ``by_time``: each
    row counts by its measured time (a step's ops: its few long GEMMs decide it, not its many short
    ones), as a time-weighted median and 90th percentile. ``min_gain``: a step is taken only where it
    lowers the loss by more than this, and the descent stops at the first round that takes none (a
    fixed point: refitting its own result changes nothing), after ``rounds`` at most."""
    model = device.gpu_model()
    for family, names in FAMILY_PARAMETERS.items():
        mine = [s for s in samples if s.family == family]
        if not mine:
            continue
        weights = [s.measured_ns for s in mine] if by_time else None

        def loss(candidate: GpuModel) -> float:
            errors = [abs(e) for e in relative_errors(mine, with_model(device, candidate), gap_ns)]
            if weights is None:
                errors.sort()
                return statistics.median(errors) + 0.3 * errors[int(0.9 * (len(errors) - 1))]
            return _quantile(errors, weights, 0.5) + 0.3 * _quantile(errors, weights, 0.9)

        best = loss(model)
        for _ in range(rounds):
            moved = False
            for name in (n for n in names if gap_ns is None or n not in FIXED_COSTS):
                for step in STEPS:
                    candidate = replace(model, **{name: getattr(model, name) * step})
                    score = loss(candidate)
                    if score < best - min_gain:
                        model, best, moved = candidate, score, True
            if not moved and min_gain:
                break
    return model


def _quantile(values: list[float], weights: list[float], q: float) -> float:
    """The weighted q-quantile: the smallest value whose share of the total weight at or below it reaches q."""
    pairs = sorted(zip(values, weights))
    total, running = sum(weights), 0.0
    for value, weight in pairs:
        running += weight
        if running >= q * total:
            return value
    return pairs[-1][0]


HOLDOUT_SEED = 0
INTERVAL = (0.05, 0.95)  # the quantiles of measured / estimated an error interval spans: 90 %


def error_intervals(held_out: list[Sample], device: DeviceProfile) -> dict[str, tuple[float, float]]:
    """Per family, the 5th and 95th percentiles, over its classes (GEMM alignment and layout, attention
    backend x dtype x mask x dropout x direction, memory-bound op), of each class's median measured /
    estimated on rows the fit never saw. A step's kernels of one class share that class's bias; the rest
    of a single kernel's error averages out over a step's many kernels."""
    by_class: dict[tuple[str, str], list[float]] = {}
    for s in held_out:
        by_class.setdefault((s.family, s.group), []).append(s.measured_ns / estimate_ns(s, device))
    out = {}
    for family in sorted({family for family, _ in by_class}):
        medians = sorted(statistics.median(r) for (f, _), r in by_class.items() if f == family)
        out[family] = tuple(round(medians[int(q * (len(medians) - 1))], 4) for q in INTERVAL)
    return out


def target_of(device: DeviceProfile) -> GpuTarget:
    """The SDPA dispatch of the profile's GPU (its compute capability and priority order)."""
    return GpuTarget(arch=device.compute_capability(), priority=tuple(device.sdpa_priority))


def median_abs_pct(samples: list[Sample], device: DeviceProfile, gap_ns: float | None = None) -> dict[str, float]:
    """Per family, the median absolute error of the estimates, in percent."""
    errors = relative_errors(samples, device, gap_ns)
    return {family: 100 * statistics.median(abs(e) for s, e in zip(samples, errors) if s.family == family)
            for family in sorted({s.family for s in samples})}


def fitted_profile(data_dir: Path, base: DeviceProfile, name: str, description: str,
                   timing: str = "back-to-back") -> tuple[DeviceProfile, dict]:
    """``base`` (datasheet facts, the shipped fit as the start) with the GPU model refitted on the
    rows of ``data_dir``; and a report: each family's median error before and after, and after a fit
    on every other row (seeded shuffle) checked on the rows it did not see. ``timing`` says how the rows
    were timed: back-to-back calls (as calibrate --on cuda does), or each call alone between events."""
    _check_gpu(base)
    if timing not in TIMINGS:
        raise UserError(f"unknown --timing {timing!r}: use {' or '.join(TIMINGS)}")
    measured = samples(data_dir, target_of(base))
    if not measured:
        raise UserError(f"{data_dir}: its CSVs hold no measured kernel time (headers only?); measure with "
                        "'fxworkload calibrate --on cuda' on the GPU")
    for family, name in (("gemm", "gemm.csv"), ("sdpa", "sdpa.csv"), ("vector", "vector.csv")):
        count = sum(s.family == family for s in measured)
        if 0 < count < MIN_ROWS:  # a family with none keeps the starting profile's parameters
            raise UserError(f"{data_dir / name}: {count} measured kernel time{'s' if count != 1 else ''}; a fit "
                            f"needs at least {MIN_ROWS} per file (half are held out to check it), or none")
    fitted, report = _fit_and_hold_out(measured, base, timing)
    source = (f"fitted by 'fxworkload calibrate' to {len(measured)} kernel times in {data_dir} "
              f"(gemm.csv, sdpa.csv, vector.csv), starting from {base.name}'s parameters")
    if timing == "isolated":
        source += (f"; the rows timed one call alone, so each held a launch gap ({report['launch_gap_ns'] / 1e3:.1f} "
                   "us, kept out of the model) and the fixed costs per kernel are the starting profile's")
    profile = replace(fitted, name=name, description=description,
                      sources={**base.sources, "gpu_model_parameters": source})
    return profile, report


def fitted_from_trace(measured: dict, base: DeviceProfile, name: str, trace_name: str) -> tuple[DeviceProfile, dict]:
    """``base`` with the GPU model refitted on the kernel times of a GPU profiler trace tied to its
    workload (``compare``'s pairing): each op that launched kernels is one row, its kernels' summed
    CUPTI time the measurement. The report is ``fitted_profile``'s."""
    _check_gpu(base)
    rows = trace_samples(measured)
    families = {family: sum(s.family == family for s in rows) for family in FAMILY_PARAMETERS}
    if families["gemm"] < MIN_ROWS:
        raise UserError(f"{trace_name}: {families['gemm']} GEMMs tied to the workload's ops; a fit needs at least "
                        f"{MIN_ROWS}: profile a whole training step on the GPU")
    thin = [family for family, count in families.items() if 0 < count < MIN_ROWS]
    rows = [s for s in rows if s.family not in thin]  # too few to fit (half held out): the starting parameters stay
    fitted, report = _fit_and_hold_out(rows, base, "kernel", by_time=True)
    source = (f"fitted by 'fxworkload calibrate --from' to {len(rows)} ops' kernel times in the profiler trace "
              f"{trace_name}, starting from {base.name}'s parameters; its fixed costs per kernel and per "
              "host dispatch kept (a trace's kernel durations hold neither)")
    profile = replace(fitted, name=name, description=f"{base.description}, GPU model fitted to {trace_name}",
                      sources={**base.sources, "gpu_model_parameters": source})
    return profile, report


def trace_samples(measured: dict) -> list[Sample]:
    """One sample per op of a GPU trace that ran kernels and is tied to a workload op (views, fused
    ops and ops the trace has no time for left out)."""
    from .compare import row_ops

    found = []
    for index, row in enumerate(measured["rows"]):
        for op in row_ops(row):
            if not finite_number(op.get("measured_ns"), 1.0, MAX_US * 1e3):
                continue
            cost = op_from_json(op, index)
            if cost.kind == "view" or cost.fused or not (cost.flops or cost.bytes):
                continue
            found.append(Sample(kernel_family(cost), cost.kind, float(op["measured_ns"]), (cost,), index))
    return found


def op_from_json(op: dict, row: int) -> OpCost:
    """An op of workload.json as the cost model reads it, every field checked (nothing from the file is
    looked up or run: dtype names must be among torch's floating and integer dtypes)."""
    def bad(field: str) -> UserError:
        return UserError(f"workload.json row {row}: op field '{field}' is not what extract writes; "
                         "pass the folder extract wrote for the traced step")

    def sizes(value, count=None, required=False) -> tuple[int, ...] | None:
        if value is None and not required:
            return None
        if not isinstance(value, list) or (count and len(value) != count) or not all(whole_number(v) for v in value):
            raise ValueError
        return tuple(value)

    fields = {}
    try:
        for key in ("op", "kind", "phase"):
            if not isinstance(op.get(key), str):
                raise bad(key)
            fields[key] = op[key]
        for key in ("input_shapes", "output_shapes"):
            if not isinstance(op.get(key), list):
                raise bad(key)
            fields[key] = [list(sizes(shape, required=True)) for shape in op[key]]
        for key in ("input_dtypes", "output_dtypes"):
            if not isinstance(op.get(key), list) or not all(name in DTYPE_NAMES_READ for name in op[key]):
                raise bad(key)
            fields[key] = list(op[key])
        for key in ("flops", "bytes"):
            if not whole_number(op.get(key)):
                raise bad(key)
            fields[key] = op[key]
        fields.update(gemm_mkn=sizes(op.get("gemm_mkn"), 3), gemm_leading=sizes(op.get("gemm_leading"), 3),
                      grouped_gemm=sizes(op.get("grouped_gemm"), 4))
        batch = op.get("gemm_batch", 1)
        if not whole_number(batch, 1):
            raise bad("gemm_batch")
        attention = op.get("attention")
        if attention is not None and not _attention_ok(attention):
            raise bad("attention")
    except (ValueError, TypeError):  # a size that is not a list of whole numbers, a dtype name that is not a string
        raise bad("shapes or dtypes") from None
    return OpCost(fx_name="", estimated_ns=0.0, has_flop_rule=True, gemm_batch=batch, attention=attention,
                  sdpa_backend=op.get("sdpa_backend") if isinstance(op.get("sdpa_backend"), str) else None,
                  fused_ops=op.get("fused_ops") if whole_number(op.get("fused_ops")) else 0,
                  fused=op.get("fused") is True, gemm_dtype=op.get("gemm_dtype") if op.get("gemm_dtype") in ("", "fp8") else "",
                  gemm_padded=op.get("gemm_padded") is True, **fields)


# torch's dtype names a workload.json may hold (capture's _dtype_name writes torch's attribute names).
DTYPE_NAMES_READ = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


def _attention_ok(attention) -> bool:
    sizes = ("batch", "heads", "kv_heads", "q_len", "kv_len", "head_dim")
    return (isinstance(attention, dict) and attention.get("backend") in ("flash", "efficient", "cudnn")
            and all(whole_number(attention.get(key), 1) for key in sizes)
            and all(isinstance(attention.get(key), bool) for key in ("backward", "is_causal", "has_mask"))
            and finite_number(attention.get("dropout"), 0.0, 1.0))


def _check_gpu(base: DeviceProfile) -> None:
    if not base.sm_count:
        raise UserError(f"device profile '{base.name}' is not a GPU profile (no sm_count): fit a GPU's kernels "
                        "onto the datasheet profile of that GPU, e.g. --like h100-sxm")


def _fit_and_hold_out(measured: list[Sample], base: DeviceProfile, timing: str,
                      by_time: bool = False) -> tuple[DeviceProfile, dict]:
    """The fit on every row, and the report: each family's median error before and after it, and after a
    fit on every other row (seeded shuffle) checked on the rows it did not see."""
    def gap(rows: list[Sample]) -> float | None:
        # "kernel": CUPTI's kernel durations hold no launch gap, host time or back-to-back floor: each
        # row is its kernels alone, and the fixed costs per kernel stay the starting profile's (a step's
        # kernels run back to back, which a trace's durations do not see)
        return {"isolated": launch_gap_ns(rows, base) if timing == "isolated" else None, "kernel": 0.0}.get(timing)

    fitted = with_model(base, fit(measured, base, gap_ns=gap(measured), by_time=by_time))
    order = list(range(len(measured)))
    random.Random(HOLDOUT_SEED).shuffle(order)
    train, held = [measured[i] for i in order[::2]], [measured[i] for i in order[1::2]]
    held_fit = with_model(base, fit(train, base, gap_ns=gap(train), by_time=by_time))
    report = {"rows": {f: sum(s.family == f for s in measured) for f in FAMILY_PARAMETERS},
              "before_pct": median_abs_pct(measured, base, gap(measured)),
              "after_pct": median_abs_pct(measured, fitted, gap(measured)),
              "held_out_pct": median_abs_pct(held, held_fit, gap(train)), "timing": timing}
    if timing == "isolated":
        report["launch_gap_ns"] = gap(measured)
    return fitted, report
