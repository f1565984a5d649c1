"""Wall time and peak RSS of extraction (capture + costing + table text), one fresh process per case.

    .venv/bin/python bench/extract.py            # gpt2 B=8 S=1024 fp32, llama-3-70b B=1 S=4096 bf16
    .venv/bin/python bench/extract.py --repeat 3 # median of 3 runs per case

Wall time is measured in-process after imports; peak RSS is the child's ru_maxrss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = [("gpt2", 8, 1024, "fp32"), ("llama-3-70b", 1, 4096, "bf16")]

CHILD = """
import json, resource, time, sys
from fxworkload.extract import extract
from fxworkload.output import tsv_text, json_text
from dataclasses import asdict
model, batch, seq, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
result = extract(model, batch=batch, seq=seq, dtype=dtype)
tsv = tsv_text(result.workload, "bytes")
doc = json_text(result.workload, result.settings, asdict(result.device))
wall = time.perf_counter() - start
print(json.dumps({"wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rows": len(result.workload.rows), "ops": len(result.workload.ops())}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"{'case':40s} {'wall_s (median)':>16s} {'peak_rss_mb':>12s} {'rows':>7s} {'ops':>7s}")
    for model, batch, seq, dtype in CASES:
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, "-c", CHILD, model, str(batch), str(seq), dtype],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        wall = statistics.median(r["wall_s"] for r in runs)
        rss = max(r["peak_rss_mb"] for r in runs)
        case = f"{model} B={batch} S={seq} {dtype}"
        print(f"{case:40s} {wall:16.2f} {rss:12.0f} {runs[0]['rows']:7d} {runs[0]['ops']:7d}", flush=True)


if __name__ == "__main__":
    main()
