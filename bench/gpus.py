"""Kernel times on GPUs the model was not fitted on: NeuSight's single calls, one GPU left out at a time.

    .venv/bin/python bench/neusight.py /path/to/NeuSight     # once: bench/data/neusight-*.csv.gz (shipped)
    .venv/bin/python bench/gpus.py                           # the tables (also: bench/kernels.py --leave-one-gpu-out)
    .venv/bin/python bench/gpus.py --write-fit               # fit on every GPU: fits/cross-gpu-{nvidia,amd}.json

The data (bench/neusight.py): single fp32 ``bmm`` and ``Linear`` calls on ten GPUs, and elementwise, LayerNorm
and softmax calls on seven, each timed alone between two CUDA events (so each time holds the call's launch
gap as well as its kernel). Every row is estimated with cost/gpu.py on the GPU's datasheet profile: GEMMs with
``gemm_ns`` (fp32 on the FP32 units, as torch runs it without TF32), memory-bound ops with ``memory_ns`` over
the bytes they read and write (the second pass of softmax's block kernel and of layer norm over a row read
from memory where the rows in flight overflow L2: ``softmax_rereads``, ``layer_norm_rereads``), plus the
measurement's launch gap.

Five parameters are fitted across GPUs, none per GPU: the FP32 GEMM efficiency of each vendor's library
(cuBLAS; rocBLAS/Tensile on CDNA) and the FP32 issue share of NVIDIA's single-issue 128-lane SMs
(gpu.FP32_ISSUE_BOUND), the watts per FP32 TFLOP/s per nm a GEMM draws (which sets the share of its boost
clock a low-power board holds, gpu.sustained_clock_fraction), a tile's fixed work beside its main loop in k
elements (gemm_fp32_tile_overhead_k: what makes attention-shaped GEMMs, k = 64-128, slower per FLOP than
long-k ones) and the launch gap of one call timed alone (a host fact, kept out of the kernel model:
``isolated_call_ns``). Every other parameter is the H100 fit's (fits/h100-sxm.json: kernels in one H100's
profiler traces), so the memory-bound rows are held out whatever GPU is left out.

The first table is the H100 fit on every GPU with no launch gap (what shipped before the cross-GPU fit);
the second scores each GPU with the parameters fitted on the others only (leave one GPU out),
per op class: median signed error (estimated / measured - 1), median and 90th percentile |error|; the third
splits the second's GEMM rows by how long a call took (the power limiter's time, see docs/gpu-model.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tabulate import tabulate  # noqa: E402

from fxworkload.cost import devices  # noqa: E402
from fxworkload.cost.gpu import (gemm_ns, layer_norm_rereads, memory_ns, softmax_rereads,  # noqa: E402
                                 sustained_clock_fraction)
from neusight import MEMORY_OUT, load  # noqa: E402

PROFILES = {"NVIDIA A100 80GB PCIe": "a100-pcie-80gb", "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
            "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA L4": "l4", "Tesla P100-PCIE-16GB": "p100-pcie",
            "Tesla P4": "p4", "Tesla T4": "t4", "Tesla V100-PCIE-32GB": "v100-pcie", "AMD Instinct MI100": "mi100",
            "AMD Instinct MI210": "mi210"}
BASE_FIT = "h100-sxm"
FIT_FILES = {"nvidia": "cross-gpu-nvidia", "amd": "cross-gpu-amd"}
BINARY = {"add", "mul", "pow", "div"}  # two tensors in, one out; the rest one in, one out
# The grids the fit searches (coordinate descent, three rounds): coarse enough to run in a minute.
GRID = {"gemm_fp32_efficiency": [x / 100 for x in range(40, 131, 2)],
        "fp32_watts_per_tflop_nm": [x / 20 for x in range(10, 61)],
        "gemm_fp32_issue_share": [x / 100 for x in range(40, 101, 2)],
        "gemm_fp32_tile_overhead_k": [float(x) for x in range(0, 49, 4)],
        "isolated_call_ns": [x * 1000.0 for x in range(0, 25, 1)]}  # at most the fastest call measured (24 us)


def vendor(profile_name: str) -> str:
    return "amd" if devices.load(profile_name).arch.startswith("gfx") else "nvidia"


def op_class(row: dict) -> str:
    if "m" in row:
        return row["op"]
    return {"ln": "layer_norm", "softmax": "softmax"}.get(row["op"], "elementwise")


LENGTHS_MS = (32, 512)  # call-length classes of the GEMM rows, measured ms


def call_length(row: dict) -> str:
    """The class of a row's measured call length: under 32 ms, 32-512 ms, at least 512 ms."""
    short, long = LENGTHS_MS
    return (f"0-{short} ms" if row["latency_ms"] < short else f"{short}-{long} ms" if row["latency_ms"] < long
            else f"{long}+ ms")


def gemm_shape(row: dict) -> tuple[int, int, int, int]:
    """(m, k, n, batch): a Linear(N, K) on a (B, M, N) input is one (B·M)×N·N×K GEMM; a bmm is B of M×N·N×K."""
    if row["op"] == "linear":
        return row["batch"] * row["m"], row["n"], row["k"], 1
    return row["m"], row["n"], row["k"], row["batch"]


def memory_bytes(row: dict, facts) -> int:
    elements = row["batch"] * row["hidden"]
    if row["op"] == "softmax":  # the kernel torch 2.1 ran, as the row names it: the warp or the block kernel
        kernel = "block" if "cunn_SoftMaxForward<" in row["kernel"] else "warp"
        return int(elements * 4 * (2 + softmax_rereads(row["hidden"], 4, False, facts, kernel)))
    if row["op"] == "ln":  # x in (twice where its rows in flight overflow L2), y out; each row's mean and rstd
        return int(elements * 4 * (2 + layer_norm_rereads(row["hidden"], 4, facts))) + row["batch"] * 8
    return elements * 4 * (3 if row["op"] in BINARY else 2)


def kernel_ms(row: dict, profile, parameters: dict) -> float:
    """The kernel alone (cost/gpu.py), under the H100 fit with ``parameters`` in place of its own."""
    model = replace(devices.load(BASE_FIT).gpu_model(), **{k: v for k, v in parameters.items() if k != "isolated_call_ns"})
    model = replace(model, gemm_min_ns=0.0)  # a floor of back-to-back calls in a step, not of one call alone
    facts = profile.gpu_facts()
    if "m" in row:
        m, k, n, batch = gemm_shape(row)
        return gemm_ns(m, k, n, batch, "fp32", (k, n, n), facts, model) / 1e6
    return memory_ns(memory_bytes(row, facts), facts, model) / 1e6


def errors(rows: list[dict], parameters: dict) -> list[float]:
    profiles = {}
    out = []
    for row in rows:
        profile = profiles.setdefault(row["profile"], devices.load(row["profile"]))
        estimate_ms = kernel_ms(row, profile, parameters) + parameters.get("isolated_call_ns", 0.0) / 1e6
        out.append(estimate_ms / row["latency_ms"] - 1)
    return out


# The fit searches a grid of the product efficiency x sustained clock share and of the tile overhead; each GEMM
# row's kernel time is computed exactly (gemm_ns) at every point of PRODUCTS x OVERHEADS once, and read between
# points by interpolation (a row's time is linear in the overhead while its tile choice holds).
PRODUCTS = np.geomspace(0.05, 1.6, 45)
OVERHEADS = (0.0, 16.0, 32.0, 48.0)


class Sampled:
    """One GPU's GEMM rows (every 8th: the fit in a minute), each row's kernel time at every point of the grid."""

    def __init__(self, profile_name: str, rows: list[dict]):
        self.profile = devices.load(profile_name)
        rows = rows[::8]
        self.measured_ms = np.array([row["latency_ms"] for row in rows])
        self.kernel_ms = np.array([[[kernel_ms(row, self.profile, {"gemm_fp32_efficiency": float(p),
                                                                    "fp32_watts_per_tflop_nm": 0.0,
                                                                    "gemm_fp32_tile_overhead_k": overhead})
                                     for p in PRODUCTS] for overhead in OVERHEADS] for row in rows])

    def errors(self, parameters: dict) -> np.ndarray:
        model = replace(self.profile.gpu_model(), fp32_watts_per_tflop_nm=parameters["fp32_watts_per_tflop_nm"])
        facts = self.profile.gpu_facts()
        product = parameters["gemm_fp32_efficiency"] * sustained_clock_fraction(facts, model)
        if facts.fp32_issue_bound:
            product *= parameters["gemm_fp32_issue_share"]
        overhead = parameters["gemm_fp32_tile_overhead_k"]
        i = int(np.clip(np.searchsorted(OVERHEADS, overhead) - 1, 0, len(OVERHEADS) - 2))
        share = (overhead - OVERHEADS[i]) / (OVERHEADS[i + 1] - OVERHEADS[i])
        sampled = self.kernel_ms[:, i] * (1 - share) + self.kernel_ms[:, i + 1] * share
        j = int(np.clip(np.searchsorted(PRODUCTS, product) - 1, 0, len(PRODUCTS) - 2))
        weight = (np.log(product) - np.log(PRODUCTS[j])) / (np.log(PRODUCTS[j + 1]) - np.log(PRODUCTS[j]))
        kernel = sampled[:, j] * (1 - weight) + sampled[:, j + 1] * weight
        return (kernel + parameters["isolated_call_ns"] / 1e6) / self.measured_ms - 1


def loss(sampled: dict[str, Sampled], parameters: dict) -> float:
    """Per GPU, median |error| plus |median error|, summed: each GPU counts once, whatever its row count."""
    total = 0.0
    for gpu in sampled.values():
        e = gpu.errors(parameters)
        total += float(np.median(np.abs(e)) + abs(np.median(e)))
    return total


def fit(sampled: dict[str, Sampled], start: dict, names=tuple(GRID)) -> dict:
    """Coordinate descent over GRID, three rounds, on the GEMM rows of the GPUs given."""
    parameters = dict(start)
    for _ in range(3):
        for name in names:
            parameters[name] = min(GRID[name], key=lambda v: loss(sampled, {**parameters, name: v}))
    return parameters


def table(title: str, scored: dict[tuple[str, str], list[float]], label: str = "op class") -> list[list]:
    rows = []
    for (gpu, group), e in sorted(scored.items()):
        magnitudes = sorted(abs(x) for x in e)
        rows.append([gpu, group, len(e), f"{statistics.median(e):+.1%}", f"{statistics.median(magnitudes):.1%}",
                     f"{magnitudes[int(0.9 * (len(magnitudes) - 1))]:.1%}"])
    print(f"\n{title}")
    print(tabulate(rows, headers=["profile", label, "rows", "median error", "median |error|", "p90 |error|"],
                   tablefmt="github"))
    return rows


def summary(scored: dict[tuple[str, str], list[float]]) -> dict:
    gemm = [abs(x) for (gpu, group), e in scored.items() if group in ("bmm", "linear") for x in e]
    memory = [abs(x) for (gpu, group), e in scored.items() if group not in ("bmm", "linear") for x in e]
    worst = max(((abs(statistics.median(e)), gpu, group) for (gpu, group), e in scored.items()
                 if group in ("bmm", "linear")))
    return {"gemm_median_abs_error": round(statistics.median(gemm), 4),
            "memory_median_abs_error": round(statistics.median(memory), 4),
            "worst_gemm_signed_median": [worst[1], worst[2], round(worst[0], 4)]}


def read_rows() -> dict[str, list[dict]]:
    by_gpu: dict[str, list[dict]] = {}
    for row in load() + load(MEMORY_OUT):
        row["profile"] = PROFILES[row["gpu"]]
        by_gpu.setdefault(row["profile"], []).append(row)
    return by_gpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-fit", action="store_true",
                        help="fit on every GPU and write fxworkload/cost/fits/cross-gpu-{nvidia,amd}.json")
    args = parser.parse_args(argv)
    by_gpu = read_rows()
    print("sampling each GPU's GEMM rows over the efficiency grid ...", file=sys.stderr)
    sampled = {gpu: Sampled(gpu, [r for r in rows if "m" in r]) for gpu, rows in sorted(by_gpu.items())}
    if args.write_fit:
        return write_fits(sampled)
    shipped, held_out, by_length = {}, {}, {}
    for gpu, rows in sorted(by_gpu.items()):
        for row, e in zip(rows, errors(rows, {})):
            shipped.setdefault((gpu, op_class(row)), []).append(e)
        parameters = fit_without(sampled, gpu)
        for row, e in zip(rows, errors(rows, parameters)):
            held_out.setdefault((gpu, op_class(row)), []).append(e)
            if "m" in row:
                by_length.setdefault((gpu, call_length(row)), []).append(e)
        print(f"left out {gpu}: fitted on the others {json.dumps(parameters)}", file=sys.stderr)
    table("The H100 fit on every GPU, no launch gap (before the cross-GPU fit)", shipped)
    table("Leave one GPU out (the cross-GPU parameters fitted on the other GPUs)", held_out)
    table("The same GEMM rows by the call's measured length (NeuSight averages the 5 fastest of 25 calls in a "
          "row: a short call's fastest run before a board's power limiter slows it; a step's GEMMs run back to "
          "back, at the sustained clock the model gives)", by_length, "GEMM call")
    print(json.dumps({"h100_fit_everywhere": summary(shipped), "leave_one_gpu_out": summary(held_out)}))
    return 0


# Fitted on one vendor's GPUs: its FP32 GEMM library's efficiency, and the issue share of the SMs it has
# (gpu.FP32_ISSUE_BOUND; none of CDNA's, so the AMD fit leaves it at 1); on every GPU: the power term and a
# tile's fixed work (facts of the silicon and of how a GEMM kernel is built, not of one library)
VENDOR_TERMS = ("gemm_fp32_efficiency", "gemm_fp32_issue_share")
SHARED_TERMS = ("fp32_watts_per_tflop_nm", "gemm_fp32_tile_overhead_k")


def vendor_terms(sampled: dict[str, Sampled]) -> tuple[str, ...]:
    """The terms fitted on these GPUs of one vendor: the issue share only where one of them is issue-bound."""
    bound = any(gpu.profile.gpu_facts().fp32_issue_bound for gpu in sampled.values())
    return VENDOR_TERMS if bound else VENDOR_TERMS[:1]


def fit_without(sampled: dict[str, Sampled], left_out: str | None) -> dict:
    """The cross-GPU parameters fitted on every GPU but ``left_out``: every term on all of them (the power term,
    the tile overhead and the launch gap kept), then the vendor terms (VENDOR_TERMS) again on the left-out GPU's
    vendor's (CUDA's libraries and CDNA's differ)."""
    others = {g: s for g, s in sampled.items() if g != left_out}
    start = {"gemm_fp32_efficiency": 1.0, "fp32_watts_per_tflop_nm": 0.0, "isolated_call_ns": 0.0,
             "gemm_fp32_issue_share": 1.0, "gemm_fp32_tile_overhead_k": 0.0}
    parameters = fit(others, start)
    if left_out is None:
        return parameters
    same = {g: s for g, s in others.items() if vendor(g) == vendor(left_out)}
    return fit(same, parameters, names=vendor_terms(same))


def write_fits(sampled: dict[str, Sampled]) -> int:
    parameters = fit_without(sampled, None)
    for name, file in FIT_FILES.items():
        same = {g: s for g, s in sampled.items() if vendor(g) == name}
        terms = vendor_terms(same)
        fitted = fit(same, parameters, names=terms)
        bound = sorted(g for g, s in same.items() if s.profile.gpu_facts().fp32_issue_bound)
        body = {"source": "fitted by bench/gpus.py --write-fit across GPUs on NeuSight's single fp32 GEMM calls "
                          "(sitar-lab/NeuSight@6945927, bench/data/neusight-gemm.csv.gz): the FP32 GEMM efficiency on "
                          f"{', '.join(sorted(same))}"
                          + (f" and the FP32 issue share on its issue-bound ones, {', '.join(bound)}" if bound else "")
                          + "; the watts per TFLOP/s per nm and a tile's fixed work in k (and the launch gap of a call "
                            "timed alone, a fact of the measurement kept out of the model) on all ten GPUs; every other "
                            "parameter the base fit's",
                "base": BASE_FIT,
                "parameters": {name: parameters[name] for name in SHARED_TERMS} | {term: fitted[term] for term in terms},
                "isolated_call_ns": parameters["isolated_call_ns"]}
        path = devices.FIT_DIR / f"{file}.json"
        path.write_text(json.dumps(body, indent=2) + "\n")
        print(f"wrote {path}: {json.dumps(body['parameters'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
