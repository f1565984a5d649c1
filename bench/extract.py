"""Wall time and peak RSS of extraction, one fresh process per run (issue 5's figures).

    .venv/bin/python bench/extract.py            # the cases, the layer sweep and re-costing
    .venv/bin/python bench/extract.py --repeat 3 # median of 3 runs per case
    .venv/bin/python bench/extract.py --parallel-only  # just the parallel layouts (SimAI file included)
    .venv/bin/python bench/extract.py --startup-only   # the CLI start-up ratio alone

Wall time is measured in-process after imports (model resolution, capture, costing and the text
of both tables); peak RSS is the child's ru_maxrss. Every run but the re-costing one bypasses the
graph cache, so it captures. Re-costing reads the step llama-3-70b's first run cached and costs
it on another device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [("gpt2", 8, 1024, "fp32"), ("llama-3-70b", 1, 4096, "bf16")]
SWEEP_MODEL, SWEEP_LAYERS = "llama-3-70b", (8, 16, 32, 64, 80)
# One rank of a 1024-GPU layout: the tensor/expert-sharded capture, the rank's units and its SimAI text.
PARALLEL_CASES = [
    ("llama-3-70b", 1, 4096, "bf16", dict(tp=8, pp=8, dp=16, sp=True, micro_batches=16, zero=1)),
    ("mixtral-8x7b", 1, 4096, "bf16", dict(tp=2, pp=4, dp=128, ep=8, sp=True, micro_batches=16)),
]

CHILD = """
import json, resource, time, sys
from dataclasses import asdict
from fxworkload.pipeline import extract
from fxworkload.formats.tables import tsv_text, json_text
from fxworkload.parallel.layout import Parallel
from fxworkload.formats import simai
model, batch, seq, dtype, device, use_cache, every_layer, parallel = sys.argv[1:9]
start = time.perf_counter()
result = extract(model, batch=int(batch), seq=int(seq), dtype=dtype, device=device, use_cache=use_cache == "1",
                 every_layer=every_layer == "1", parallel=Parallel(**json.loads(parallel)))
tsv = tsv_text(result.workload, "bytes")
doc = json_text(result.workload, result.settings, asdict(result.device))
text = simai.text(simai.from_rank(result.rank))
wall = time.perf_counter() - start
print(json.dumps({"wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rows": len(result.workload.rows), "ops": len(result.workload.ops())}))
"""


def run(model, batch, seq, dtype, repeat, device="a100-80gb", use_cache=False, every_layer=False, env=None,
        parallel=None):
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", CHILD, model, str(batch), str(seq), dtype, device,
                              "1" if use_cache else "0", "1" if every_layer else "0", json.dumps(parallel or {})],
                             capture_output=True, text=True, check=True, env=env)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return (statistics.median(r["wall_s"] for r in runs), max(r["peak_rss_mb"] for r in runs),
            runs[0]["rows"], runs[0]["ops"])


def line(case, wall, rss, rows, ops):
    print(f"{case:64s} {wall:8.2f} {rss:12.0f} {rows:7d} {ops:7d}", flush=True)


def _wall_s(argv: list[str], env=None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, env=env)
    return time.perf_counter() - start


def startup(repeat: int) -> None:
    """The whole `fxworkload extract llama-3-70b` command (warm graph cache), and the quick commands,
    each as a ratio to a bare `python -c "import torch, transformers"` timed in the same run."""
    cli = str(Path(sys.executable).with_name("fxworkload"))
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(Path(tmp) / "cache")}
        extract_70b = [cli, "extract", "llama-3-70b", "--out", str(Path(tmp) / "out")]
        _wall_s(extract_70b, env)  # fills the graph cache
        bare, extract, quick = [], [], {}
        for _ in range(max(repeat, 3)):
            bare.append(_wall_s([sys.executable, "-c", "import torch, transformers"]))
            extract.append(_wall_s(extract_70b, env))
            for command in ("--help", "models", "devices"):
                quick.setdefault(command, []).append(_wall_s([cli, command], env))
    bare_s, extract_s = statistics.median(bare), statistics.median(extract)
    print("CLI start-up (median of runs; ratio to a bare 'import torch, transformers' in the same run)")
    print(f"{'bare import torch, transformers':40s} {bare_s:6.2f} s")
    print(f"{'fxworkload extract llama-3-70b (cached)':40s} {extract_s:6.2f} s  ratio {extract_s / bare_s:.2f}x")
    for command, walls in quick.items():
        print(f"{'fxworkload ' + command:40s} {statistics.median(walls):6.2f} s")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--every-layer", action="store_true", help="also time the full trace of each case")
    parser.add_argument("--parallel-only", action="store_true", help="only the parallel layouts")
    parser.add_argument("--startup-only", action="store_true", help="only the CLI start-up ratio")
    args = parser.parse_args()
    startup(args.repeat)
    if args.startup_only:
        return
    header = f"{'case':64s} {'wall_s':>8s} {'peak_rss_mb':>12s} {'rows':>7s} {'ops':>7s}"
    print("one rank of a parallel layout (tensor/expert-sharded capture, units, SimAI text)")
    print(header)
    for model, batch, seq, dtype, parallel in PARALLEL_CASES:
        layout = " ".join(f"{k}={v}" for k, v in parallel.items())
        line(f"{model} {layout}", *run(model, batch, seq, dtype, args.repeat, parallel=parallel))
    if args.parallel_only:
        return
    print()
    print(header)
    for model, batch, seq, dtype in CASES:
        line(f"{model} B={batch} S={seq} {dtype}", *run(model, batch, seq, dtype, args.repeat))
        if args.every_layer:
            line(f"{model} B={batch} S={seq} {dtype}, every layer traced",
                 *run(model, batch, seq, dtype, args.repeat, every_layer=True))

    print(f"\nlayer sweep: {SWEEP_MODEL} B=1 S=4096 bf16 with its layer count changed")
    print(header)
    config = json.loads((Path(__file__).resolve().parent.parent / "models" / SWEEP_MODEL / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for layers in SWEEP_LAYERS:
            folder = Path(tmp) / f"{SWEEP_MODEL}-{layers}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
            line(f"{layers} layers", *run(str(folder), 1, 4096, "bf16", args.repeat))

        print(f"\nre-costing a cached step: {SWEEP_MODEL} B=1 S=4096 bf16")
        print(header)
        env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(Path(tmp) / "cache")}
        line("first run (captures, fills the cache)", *run(SWEEP_MODEL, 1, 4096, "bf16", 1, use_cache=True, env=env))
        line("again on h100-sxm (reads the cache)",
             *run(SWEEP_MODEL, 1, 4096, "bf16", args.repeat, device="h100-sxm", use_cache=True, env=env))


if __name__ == "__main__":
    main()
