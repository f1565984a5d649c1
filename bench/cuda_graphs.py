"""CUDA graphs on and off: GPT-2's training step (forward, loss, backward; bf16) eager and replayed from
graphs, ours (``--cuda-graphs layers|step`` on ``h100-sxm``) beside the lent H100's
(bench/data/lent-gpus/h100/graphs/graphs.json, bench/gpu_graphs.py: the median of 10 steps between CUDA
events); then under torch.compile, default against mode="reduce-overhead" (compiled.json). Nothing here was fitted to those measurements but ``host_graph_launch_ns`` (one replay's host
time, read from the ``step`` row at batch 1, seq 128).

    .venv/bin/python bench/cuda_graphs.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxworkload.parallel.layout import Parallel  # noqa: E402
from fxworkload.pipeline import extract  # noqa: E402

MEASURED = ROOT / "bench" / "data" / "lent-gpus" / "h100" / "graphs" / "graphs.json"


def step_ms(batch: int, seq: int, scope: str, stack: str = "eager") -> float:
    result = extract(str(ROOT / "models" / "gpt2"), batch=batch, seq=seq, dtype="bf16", device="h100-sxm",
                     stack=stack, parallel=Parallel(cuda_graphs=scope))
    return result.workload.totals["step_estimated_ns"] / 1e6


def main() -> int:
    started = time.perf_counter()
    measured = json.loads(MEASURED.read_text())
    rows = []
    for row in measured["rows"]:
        batch, seq, scope = row["batch"], row["seq"], row["capture"]
        eager, graphed = step_ms(batch, seq, "none"), step_ms(batch, seq, scope)
        ours_change, their_change = 100 * (graphed / eager - 1), 100 * (row["graphed_ms"] / row["eager_ms"] - 1)
        rows.append([f"{scope}, b{batch} s{seq}", f"{eager:.2f} / {row['eager_ms']:.2f}",
                     f"{100 * (eager / row['eager_ms'] - 1):+.1f}%", f"{graphed:.2f} / {row['graphed_ms']:.2f}",
                     f"{100 * (graphed / row['graphed_ms'] - 1):+.1f}%", f"{ours_change:+.1f} / {their_change:+.1f}",
                     f"{ours_change - their_change:+.1f}"])
    print(f"GPT-2 bf16 on {measured['gpu']} (host: {measured['cpu']}, torch {measured['torch']}); ms ours / measured")
    print(tabulate(rows, headers=["capture, shape", "eager ms", "error", "graphed ms", "error",
                                  "change % ours / measured", "points apart"]))
    compiled = MEASURED.with_name("compiled.json")  # torch.compile, default and mode="reduce-overhead"
    if compiled.exists():
        rows = []
        for row in json.loads(compiled.read_text())["rows"]:
            batch, seq = row["batch"], row["seq"]
            plain, graphed = (step_ms(batch, seq, scope, "compiled") for scope in ("none", "step"))
            ours_change = 100 * (graphed / plain - 1)
            their_change = 100 * (row["reduce_overhead_ms"] / row["compiled_ms"] - 1)
            rows.append([f"b{batch} s{seq}", f"{plain:.2f} / {row['compiled_ms']:.2f}",
                         f"{100 * (plain / row['compiled_ms'] - 1):+.1f}%",
                         f"{graphed:.2f} / {row['reduce_overhead_ms']:.2f}",
                         f"{100 * (graphed / row['reduce_overhead_ms'] - 1):+.1f}%",
                         f"{ours_change:+.1f} / {their_change:+.1f}", f"{ours_change - their_change:+.1f}"])
        print("\ntorch.compile (--stack compiled) against mode=\"reduce-overhead\" (--cuda-graphs step):")
        print(tabulate(rows, headers=["shape", "compiled ms", "error", "reduce-overhead ms", "error",
                                      "change % ours / measured", "points apart"]))
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
