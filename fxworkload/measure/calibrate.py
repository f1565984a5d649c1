"""Fit a device profile from micro-benchmarks on this machine's CPU or GPU.

Each figure is measured, not a datasheet peak, so both efficiencies are 1.0. Every rate is taken
net of the per-kernel overhead, so that ``overhead + amount / rate`` gives the measured time:
- per-kernel overhead: the median time of small out-of-place ops (add, mul, clone of 4 Ki
  elements): dispatch plus the allocation every op of a training step makes;
- GEMM throughput per dtype over a grid of shapes m, k, n in {64, 256, 1024, 4096, 32768}
  (transformer GEMMs are skinny, tokens x hidden x 4·hidden, and LM heads have a vocabulary-sized
  side: a square-only fit overrates them), leaving out shapes whose single call would take over
  0.05 s (large ones, and fp16 on CPUs without native support);
- memory bandwidth as a function of bytes moved: out-of-place adds x + y from 64 KiB to 256 MiB
  (CPU) or 1 GiB (GPU) per operand, 3 x size bytes; out of place, because every op of a training step
  writes a fresh tensor, and on a CPU large fresh tensors cost page faults;
- per-op vector rates: common elementwise, softmax, norm and random ops on 1 Mi fp32 elements,
  FLOPs counted by fxworkload's own per-element rules; their median is the rate of other ops.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from pathlib import Path

import torch

from ..cost import flops as flop_rules
from ..cost import devices
from ..cost.devices import DeviceProfile
from ..dtypes import DTYPES
from ..errors import UserError
from ..progress import say  # noqa: F401  (the CLI and bench/accuracy.py print calibrate's progress with it)
from .timing import Clock, describe, device_for

aten = torch.ops.aten
GEMM_DIMS = (64, 256, 1024, 4096, 32768)
MAX_GEMM_SECONDS = 0.05
ALWAYS_TIMED_FLOPS = 2 * 256 ** 3  # small shapes are timed even if an early, noisy sample predicts them slow
VECTOR_ELEMENTS = 1 << 20


def measure(on: str = "cpu", name: str = "cpu", progress=lambda text: None) -> DeviceProfile:
    device = device_for(on)
    clock = Clock(device)
    launch_ns = _overhead_ns(clock)
    progress(f"per-kernel overhead {launch_ns / 1e3:.2f} us")
    gemm_tables = {}
    for dtype_name, dtype in DTYPES.items():
        gemm_tables[dtype_name] = _gemm_table(clock, dtype, launch_ns)
        largest = _largest(gemm_tables[dtype_name])
        progress(f"{dtype_name} GEMM: {len(gemm_tables[dtype_name])} shapes, largest "
                 f"{'x'.join(str(d) for d in largest[:3])} at {rate_text(largest[3])}")
    memory_curve = _memory_curve(clock, launch_ns)
    rates = [rate for _, rate in memory_curve]
    progress(f"bandwidth {min(rates) / 1e9:.1f} to {max(rates) / 1e9:.1f} GB/s, "
             f"{memory_curve[-1][1] / 1e9:.1f} GB/s at {memory_curve[-1][0] / 2 ** 20:.0f} MiB")
    vector_by_op = _vector_rates(clock, launch_ns)
    vector = statistics.median(vector_by_op.values())
    progress(f"vector rates {min(vector_by_op.values()) / 1e9:.2f} to {max(vector_by_op.values()) / 1e9:.2f} GFLOP/s "
             f"over {len(vector_by_op)} ops")
    how = f"measured by 'fxworkload calibrate' on {describe(device)}"
    return DeviceProfile(
        name=name, description=describe(device),
        matmul_flops_per_s={k: _largest(table)[3] for k, table in gemm_tables.items()},
        vector_flops_per_s=vector,
        memory_bytes_per_s=memory_curve[-1][1],
        compute_efficiency=1.0, memory_efficiency=1.0, kernel_launch_ns=launch_ns,
        matmul_flops_per_s_by_shape=gemm_tables, memory_bytes_per_s_by_bytes=memory_curve,
        vector_flops_per_s_by_op=vector_by_op,
        sources={"matmul_flops_per_s": f"{how}: the best rate of its GEMM table",
                 "matmul_flops_per_s_by_shape": f"{how}: m, k, n in {GEMM_DIMS} per dtype, 2mkn / net median time",
                 "memory_bytes_per_s_by_bytes": f"{how}: x + y, x and y of 64 KiB and up, "
                                                "3 x size / net median time",
                 "memory_bytes_per_s": f"{how}: the rate of the largest add of the curve",
                 "vector_flops_per_s_by_op": f"{how}: each op on {VECTOR_ELEMENTS} fp32 elements",
                 "vector_flops_per_s": f"{how}: the median of the per-op vector rates",
                 "kernel_launch_ns": f"{how}: median time of add, mul, clone of 4096 elements",
                 "compute_efficiency": "1.0: the rates are measured, not peaks",
                 "memory_efficiency": "1.0: the bandwidth is measured, not a peak"})


# A measurement is trusted when the machine was its own (the process got this share of the CPU time its
# threads could use while a reference GEMM ran: 1.00 idle on the 2-core development machine, 0.50
# beside one busy loop per core), when that reference and the per-op overhead, timed first and last,
# agree, and when two measurements of the same memory-bound work agree: the bandwidth curve has the
# shape caches allow (a smaller copy at most 2x slower per byte than a larger one), and add's vector
# rate is within 5x of what the curve's bandwidth gives for its bytes (1 FLOP per 12 bytes).
MIN_CPU_SHARE = 0.8
MAX_DRIFT = 0.15
MAX_SLOWER_SMALLER = 2.0
MAX_ADD_MISMATCH = 5.0


def measure_checked(on: str = "cpu", name: str = "cpu", progress=lambda text: None,
                    refuse_early: bool = False) -> tuple[DeviceProfile | None, list[str]]:
    """``measure``, with what says whether to trust it: the machine's share of CPU time during the run, a
    reference GEMM and the per-op overhead timed before and after, and the shapes of the measured
    curves. Returns the profile and the reasons not to trust it (none: trusted). ``refuse_early``: a CPU
    already shared when the first reference GEMM runs (a second in) is refused then, with no profile
    (None), instead of after the minutes the measurement takes."""
    clock = Clock(device_for(on))
    reference = _reference(clock)
    load = _load()
    if refuse_early and clock.device.type == "cpu" and reference[2] < MIN_CPU_SHARE:
        return None, [f"the process got {reference[2]:.0%} of the CPU its {torch.get_num_threads()} threads could "
                      f"use before measuring (other work is running: load {load:.1f} on {os.cpu_count()} cores)"]
    profile = measure(on, name, progress)
    again = _reference(clock)
    problems = []
    if clock.device.type == "cpu":
        share = min(reference[2], again[2])
        if share < MIN_CPU_SHARE:
            problems.append(f"the process got {share:.0%} of the CPU its {torch.get_num_threads()} threads could use "
                            f"(other work is running: load {load:.1f} on {os.cpu_count()} cores)")
    for what, before, after in (("a 1024^3 fp32 GEMM", reference[0], again[0]), ("the per-op overhead",
                                                                                 reference[1], again[1])):
        if abs(after / before - 1) > MAX_DRIFT:
            problems.append(f"{what} took {before / 1e3:.1f} us first and {after / 1e3:.1f} us last "
                            f"({after / before - 1:+.0%})")
    problems += curve_problems(profile)
    return profile, problems


def curve_problems(profile: DeviceProfile) -> list[str]:
    """Measured curves whose shape no cache hierarchy makes."""
    problems = []
    curve = profile.memory_bytes_per_s_by_bytes or []
    for i, (size, rate) in enumerate(curve):
        faster = max((r for s, r in curve[i + 1:]), default=0.0)
        if faster > MAX_SLOWER_SMALLER * rate:
            problems.append(f"bandwidth {rate / 1e9:.3g} GB/s at {size / 2 ** 10:.0f} KiB beside "
                            f"{faster / 1e9:.3g} GB/s for a larger copy")
            break
    add = (profile.vector_flops_per_s_by_op or {}).get("add")
    if add and curve:
        add_bytes = 3 * 4 * VECTOR_ELEMENTS  # two fp32 inputs read, one written
        bandwidth = min(curve, key=lambda point: abs(point[0] - add_bytes))[1]
        expected = bandwidth * VECTOR_ELEMENTS / add_bytes
        if not 1 / MAX_ADD_MISMATCH <= add / expected <= MAX_ADD_MISMATCH:
            problems.append(f"add ran at {add / 1e9:.3g} GFLOP/s where the bandwidth measured for its "
                            f"{add_bytes / 2 ** 20:.0f} MiB gives {expected / 1e9:.3g}")
    return problems


def _reference(clock: Clock) -> tuple[float, float, float]:
    """A 1024^3 fp32 GEMM's median ns, the per-op overhead, and the share of CPU time the threads got
    while the GEMM ran (process time over wall time x threads)."""
    a, b = (torch.randn(1024, 1024, device=clock.device) for _ in range(2))
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    gemm_ns = clock.median_ns(lambda: torch.mm(a, b), repeat=9, warmup=2)
    share = (time.process_time() - started_cpu) / ((time.perf_counter() - started_wall) * torch.get_num_threads())
    return gemm_ns, _overhead_ns(clock), share


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def rate_text(flops_per_s: float) -> str:
    """A rate in the unit that shows its digits: a CPU's bf16 GEMM is GFLOP/s, not 0.000 TFLOP/s."""
    for scale, unit in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.3g} {unit}"
    return f"{flops_per_s:.3g} FLOP/s"


def _overhead_ns(clock: Clock) -> float:
    """Called as the captured graph calls them: through the aten overload, from Python."""
    x = torch.ones(4096, device=clock.device)
    return statistics.median(clock.median_ns(lambda: op(*args), repeat=101, warmup=10)
                             for op, args in ((aten.add.Tensor, (x, x)), (aten.mul.Tensor, (x, x)),
                                              (aten.clone.default, (x,))))


def _net_rate(amount: float, median_ns: float, launch_ns: float) -> float:
    """Rate such that launch + amount / rate equals the measured time (overhead-dominated: 10% floor)."""
    return amount / (1e-9 * max(median_ns - launch_ns, 0.1 * median_ns))


def _gemm_table(clock: Clock, dtype: torch.dtype, launch_ns: float) -> list[list[float]]:
    table, rate = [], None
    for m, k, n in sorted(itertools.product(GEMM_DIMS, repeat=3), key=lambda s: s[0] * s[1] * s[2]):
        flops = 2 * m * k * n
        if flops > ALWAYS_TIMED_FLOPS and rate is not None and flops / rate > MAX_GEMM_SECONDS:
            continue  # predicted from the shapes so far: too slow to be worth timing
        a = torch.randn(m, k, device=clock.device).to(dtype)
        b = torch.randn(k, n, device=clock.device).to(dtype)
        median_ns = clock.median_ns(lambda: torch.mm(a, b), repeat=3, warmup=1)
        table.append([m, k, n, _net_rate(flops, median_ns, launch_ns)])
        rate = max(row[3] for row in table)
    return table


def _largest(table: list[list[float]]) -> list[float]:
    return max(table, key=lambda row: row[0] * row[1] * row[2])


def _memory_curve(clock: Clock, launch_ns: float) -> list[list[float]]:
    largest = (1 << 30) if clock.cuda else (256 << 20)
    curve, size = [], 64 << 10
    while size <= largest:
        x, y = (torch.empty(size // 4, device=clock.device).uniform_() for _ in range(2))
        median_ns = clock.median_ns(lambda: x + y, repeat=7, warmup=2)
        curve.append([float(3 * size), _net_rate(3 * size, median_ns, launch_ns)])
        size *= 4
    return curve


def _vector_ops(device) -> list[tuple]:
    x = torch.randn(VECTOR_ELEMENTS // 1024, 1024, device=device)
    w, b = torch.ones(1024, device=device), torch.zeros(1024, device=device)
    return [(aten.add.Tensor, (x, x)), (aten.mul.Tensor, (x, x)), (aten.div.Tensor, (x, x)),
            (aten.exp.default, (x,)), (aten.tanh.default, (x,)), (aten.pow.Tensor_Scalar, (x, 3.0)),
            (aten.gelu.default, (x,)), (aten.silu.default, (x,)), (aten.sigmoid.default, (x,)),
            (aten.tanh_backward.default, (x, x)), (aten.gelu_backward.default, (x, x)),
            (aten._softmax.default, (x, -1, False)), (aten._softmax_backward_data.default, (x, x, -1, x.dtype)),
            (aten.native_layer_norm.default, (x, [1024], w, b, 1e-5)),
            (aten.sum.dim_IntList, (x, [0])), (aten.bernoulli_.float, (torch.empty_like(x), 0.9)),
            (aten.native_dropout.default, (x, 0.1, True))]


def _vector_rates(clock: Clock, launch_ns: float) -> dict[str, float]:
    rates = {}
    for op, args in _vector_ops(clock.device):
        op_flops = flop_rules.node_flops(op, args, {}, op(*args))
        median_ns = clock.median_ns(lambda: op(*args), repeat=7, warmup=2)
        rates[flop_rules.op_name(op)] = _net_rate(op_flops, median_ns, launch_ns)
    return rates


# Ops of at most this many bytes, launched alone, time the per-op overhead in a trace.
SMALL_OP_BYTES = 64 << 10
# The per-op overhead a fit may find: a CPU dispatches an eager op in ~2-20 us, a GPU launches one in
# ~3-10 us; a fit outside 0.1 us to 1 ms read noise or another step, not overhead.
MIN_OVERHEAD_NS, MAX_OVERHEAD_NS = 100.0, 1e6


def fit_from_measured(measured: dict, name: str, source: str) -> DeviceProfile:
    """The figures ``measure`` times with micro-benchmarks, fitted instead from the ops of a measured
    step (a profiler trace tied to its workload): per-op overhead, GEMM rate per dtype, bandwidth
    by bytes moved, vector rate per op. Each rate is net of the overhead, as ``measure``'s are."""
    from .profiler_trace import short_name

    ops = [op for row in measured["rows"] for phase in ("forward", "input_grad", "weight_grad")
           for op in ([row[phase]] if phase == "forward" else row[phase]) if op and op.get("measured_ns", 0) > 0]
    kernels = [op for op in ops if op.get("kind") != "view" and (op.get("flops", 0) or op.get("bytes", 0))]
    small = [op["measured_ns"] for op in kernels if op.get("bytes", 0) <= SMALL_OP_BYTES and op.get("kind") != "matmul"]
    if len(small) < 3 or not any(op.get("kind") == "matmul" for op in kernels):
        raise UserError(f"{source}: too few timed ops to fit a profile from (need GEMMs and at least 3 small ops); "
                        "profile a whole training step")
    launch_ns = statistics.median(small)
    if not MIN_OVERHEAD_NS <= launch_ns <= MAX_OVERHEAD_NS:
        raise UserError(f"{source}: its small ops take {launch_ns / 1e3:,.1f} us each, outside any machine's per-op "
                        f"overhead ({MIN_OVERHEAD_NS / 1e3:g} to {MAX_OVERHEAD_NS / 1e3:,.0f} us): a trace of a busy "
                        "or throttled machine, or of another step; profile again on a quiet machine")
    gemm_rates = {}
    for dtype_name, torch_name in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        gemms = [op for op in kernels if op.get("kind") == "matmul" and torch_name in op.get("input_dtypes", [])]
        if gemms:
            gemm_rates[dtype_name] = _pooled_rate([(op["flops"], op["measured_ns"]) for op in gemms], launch_ns)
    memory_curve = _bucketed_curve([op for op in kernels if op.get("kind") != "matmul" and op.get("bytes", 0) > 0],
                                   launch_ns)
    by_op: dict[str, list] = {}
    for op in kernels:
        if op.get("kind") != "matmul" and op.get("flops", 0) > 0:
            by_op.setdefault(short_name(op["op"]), []).append(op)
    vector_by_op = {key: _pooled_rate([(op["flops"], op["measured_ns"]) for op in group], launch_ns)
                    for key, group in sorted(by_op.items())}
    best_gemm = max(gemm_rates.values())
    how = f"fitted by 'fxworkload calibrate --from' to {len(kernels)} ops of {source}"
    return DeviceProfile(
        name=name, description=f"{measured['settings'].get('device', '?')}, fitted to a profiler trace",
        matmul_flops_per_s={k: gemm_rates.get(k, best_gemm) for k in ("fp32", "bf16", "fp16")},
        vector_flops_per_s=statistics.median(vector_by_op.values()) if vector_by_op else best_gemm / 16,
        memory_bytes_per_s=memory_curve[-1][1] if memory_curve else 1e11,
        compute_efficiency=1.0, memory_efficiency=1.0, kernel_launch_ns=launch_ns,
        memory_bytes_per_s_by_bytes=memory_curve, vector_flops_per_s_by_op=vector_by_op,
        sources={"kernel_launch_ns": f"{how}: median time of its non-GEMM ops of at most {SMALL_OP_BYTES} bytes",
                 "matmul_flops_per_s": f"{how}: per dtype, the GEMMs' FLOPs over their time net of the overhead"
                                       + (f"; not measured, copied from the best rate: "
                                          f"{', '.join(k for k in ('fp32', 'bf16', 'fp16') if k not in gemm_rates)}"
                                          if len(gemm_rates) < 3 else ""),
                 "memory_bytes_per_s_by_bytes": f"{how}: non-GEMM ops bucketed by bytes moved (powers of 4), "
                                                "bytes over time net of the overhead",
                 "memory_bytes_per_s": f"{how}: the rate of the largest bucket",
                 "vector_flops_per_s_by_op": f"{how}: per op, FLOPs over time net of the overhead",
                 "vector_flops_per_s": f"{how}: the median of the per-op vector rates",
                 "compute_efficiency": "1.0: the rates are measured, not peaks",
                 "memory_efficiency": "1.0: the bandwidth is measured, not a peak"})


def _pooled_rate(amounts_and_ns: list[tuple[float, float]], launch_ns: float) -> float:
    """Σ amount / Σ net time: long ops weigh by their time, as in a step's total."""
    amount = sum(a for a, _ in amounts_and_ns)
    net_s = sum(1e-9 * max(ns - launch_ns, 0.1 * ns) for _, ns in amounts_and_ns)
    return amount / net_s


def _bucketed_curve(ops: list[dict], launch_ns: float) -> list[list[float]]:
    buckets: dict[int, list[dict]] = {}
    for op in ops:
        buckets.setdefault(max(op["bytes"].bit_length() - 1, 0) // 2, []).append(op)
    curve = []
    for _, group in sorted(buckets.items()):
        middle = statistics.median(op["bytes"] for op in group)
        curve.append([float(middle), _pooled_rate([(op["bytes"], op["measured_ns"]) for op in group], launch_ns)])
    return curve


def kernels_folder(name: str) -> Path:
    """Where ``calibrate --on cuda --name NAME`` keeps its kernel CSVs: beside the profile."""
    return devices.measured_path(name).with_name(f"{name}-kernels")


def gpu_datasheet(like: str | None) -> str | None:
    """The datasheet profile of this machine's GPU: ``like``, else the shipped one its name matches."""
    return like or devices.matching_gpu(torch.cuda.get_device_name(device_for("cuda")))


def calibrate_gpu(name: str, like: str, kernels_dir: Path | None = None, progress=say,
                  timing: str = "back-to-back") -> tuple[DeviceProfile, dict, Path]:
    """The GPU model of datasheet profile ``like`` (its facts stay; its parameters are the fit's
    start) refitted on kernel times: measured now on this machine's GPU (written as CSV beside the
    profile), or read from ``kernels_dir``."""
    from . import kernel_bench
    from .kernels import fitted_profile, read_folder

    base = devices.load(like)
    if kernels_dir is None:
        device = device_for("cuda")
        gpu_name = torch.cuda.get_device_name(device)
        kernels_dir = kernels_folder(name)
        from tqdm import tqdm

        with tqdm(total=kernel_bench.case_count(), unit="kernel", leave=False, desc="measuring") as bar:
            files = kernel_bench.measure(device, progress=bar.update)
        kernel_bench.write(kernels_dir, files)
        progress(f"measured {kernel_bench.case_count()} kernel cases on {gpu_name} into {kernels_dir}")
        description = f"{gpu_name}, kernels measured by 'fxworkload calibrate --on cuda'"
    else:
        read_folder(kernels_dir)
        description = f"{base.description}, GPU model fitted to the kernels in {kernels_dir}"
    progress(f"fitting {like}'s GPU model to the kernel times...")
    profile, report = fitted_profile(kernels_dir, base, name, description, timing)
    return profile, report, kernels_dir


def fit_report_text(report: dict) -> str:
    """Median absolute error per family: before, after, and held out (fitted on the other half)."""
    lines = []
    for family, rows in report["rows"].items():
        if rows:
            lines.append(f"{family:7s} {rows:5d} rows  median error {report['before_pct'][family]:5.1f} % with the "
                         f"starting parameters, {report['after_pct'][family]:5.1f} % fitted, "
                         f"{report['held_out_pct'][family]:5.1f} % held out")
    if report.get("launch_gap_ns") is not None:
        lines.append(f"each row timed one call alone: a launch gap of {report['launch_gap_ns'] / 1e3:.1f} us, kept "
                     "out of the model (the fixed costs per kernel are the starting profile's)")
    return "\n".join(lines) + "\n"
