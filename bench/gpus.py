"""GEMM times on ten GPUs the kernel model was not fitted on, against NeuSight's measurements of them.

    .venv/bin/python bench/neusight.py /path/to/NeuSight   # once: bench/data/neusight-gemm.csv.gz (shipped)
    .venv/bin/python bench/gpus.py

Every row of ``bench/data/neusight-gemm.csv.gz`` (NeuSight's test sets: single fp32 ``bmm`` and ``Linear`` calls,
timed between CUDA events, bench/neusight.py) is estimated with the GPU model (cost/gpu.py: ``gemm_ns``, fp32
on the FP32 units as torch runs it without TF32) on the GPU's datasheet profile, and the error
estimated / measured - 1 is summarised per GPU and op: median (signed), median |error|, 90th percentile
|error|. The model's free parameters were fitted on one H100's kernels (fits/h100-sxm.json), so every GPU
here but the H100 is held out, and the H100's rows are a different measurement (one call each, with its
launch gap) from the fit's (kernels in a profiler trace). No figure here is fitted on these rows.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tabulate import tabulate  # noqa: E402

from fxworkload.cost import devices  # noqa: E402
from fxworkload.cost.gpu import gemm_ns  # noqa: E402
from neusight import load  # noqa: E402

PROFILES = {"NVIDIA A100 80GB PCIe": "a100-pcie-80gb", "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
            "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA L4": "l4", "Tesla P100-PCIE-16GB": "p100-pcie",
            "Tesla P4": "p4", "Tesla T4": "t4", "Tesla V100-PCIE-32GB": "v100-pcie", "AMD Instinct MI100": "mi100",
            "AMD Instinct MI210": "mi210"}


def gemm_shape(row: dict) -> tuple[int, int, int, int]:
    """(m, k, n, batch): a Linear(N, K) on a (B, M, N) input is one (B·M)×N·N×K GEMM; a bmm is B of M×N·N×K."""
    if row["op"] == "linear":
        return row["batch"] * row["m"], row["n"], row["k"], 1
    return row["m"], row["n"], row["k"], row["batch"]


def estimate_ms(row: dict, profile) -> float:
    m, k, n, batch = gemm_shape(row)
    return gemm_ns(m, k, n, batch, "fp32", (k, n, n), profile.gpu_facts(), profile.gpu_model()) / 1e6


def main() -> int:
    errors: dict[tuple[str, str], list[float]] = {}
    for row in load():
        profile = devices.load(PROFILES[row["gpu"]])
        errors.setdefault((PROFILES[row["gpu"]], row["op"]), []).append(estimate_ms(row, profile) / row["latency_ms"] - 1)
    table = []
    for (name, op), values in sorted(errors.items()):
        magnitudes = sorted(abs(e) for e in values)
        table.append([name, op, len(values), f"{statistics.median(values):+.1%}", f"{statistics.median(magnitudes):.1%}",
                      f"{magnitudes[int(0.9 * (len(magnitudes) - 1))]:.1%}"])
    print(tabulate(table, headers=["profile", "op", "rows", "median error", "median |error|", "p90 |error|"],
                   tablefmt="github"))
    every = [abs(e) for values in errors.values() for e in values]
    within = sum(1 for (name, _), values in errors.items() if abs(statistics.median(values)) <= 0.10)
    print(f"\nall {len(every)} rows: median |error| {statistics.median(every):.1%}; "
          f"{within} of {len(errors)} GPU-op pairs with a signed median within ±10 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
