"""How fast ``plan`` searches: wall time and layouts per second, with an empty cache and warm.

Three plans: issue 29's Llama 3 70B on 1,024 H100s (global batch 1,024 x 4,096 tokens) and Llama 3
405B on 16,384 H100s at 131,072 tokens with context parallelism (1 to 16) and FP8 in the space
(global batch 128 sequences, 16M tokens, as the Llama 3 paper's long-context stage); and DeepSeek-V3
(transformers' DeepseekV3Config defaults: 671B, three dense layers then 58 MoE ones of 256 experts)
on 2,048 H100s at its pretraining batch (15,360 x 4,096 tokens, DeepSeek-V3 technical report, section
4.2), FP8, Megatron's fused stack: the layers that differ, traced from short copies. Each runs once
with an empty cache (a fresh FXWORKLOAD_CACHE_DIR: every shape captured) and once more warm (the
same command: captures, facts and evaluated rows read from the cache); with ``--runs N`` each cold
run N times (a fresh cache each), the median quoted with the fastest and slowest. Measure on an idle
machine: the process pool uses every core.

    .venv/bin/python bench/plan_speed.py
    .venv/bin/python bench/plan_speed.py --only 70b --runs 5
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

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from published import LLAMA_405B  # noqa: E402


def plans(root: Path) -> dict[str, list[str]]:
    from transformers import LlamaConfig

    folder = root / "llama-3-405b"
    LlamaConfig(**{k: v for k, v in LLAMA_405B.items() if k != "model_type"}).save_pretrained(folder)
    from transformers import DeepseekV3Config

    DeepseekV3Config().save_pretrained(root / "deepseek-v3")
    return {"70b": ["llama-3-70b", "--gpus", "1024", "--global-batch", "1024", "--seq", "4096", "--device", "h100-sxm"],
            "405b-cp-fp8": [str(folder), "--gpus", "16384", "--global-batch", "128", "--seq", "131072",
                            "--device", "h100-sxm", "--cp", "1,2,4,8,16", "--fp8", "--stack", "fused"],
            "deepseek-v3": [str(root / "deepseek-v3"), "--gpus", "2048", "--global-batch", "15360", "--seq", "4096",
                            "--device", "h100-sxm", "--fp8", "--stack", "fused"]}


def timed(args: list[str], cache: Path, out: Path) -> float:
    env = os.environ | {"FXWORKLOAD_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fxworkload", "plan", *args, "--out", str(out)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="70b, 405b-cp-fp8 or deepseek-v3")
    parser.add_argument("--runs", type=int, default=1, help="cold runs per plan (the median is quoted)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fxworkload-plan-speed-"))
    rows = []
    for name, plan_args in plans(root).items():
        if args.only and name != args.only:
            continue
        out = root / f"out-{name}"
        colds = [timed(plan_args, root / f"cache-{name}-{run}", out) for run in range(max(args.runs, 1))]
        warm = timed(plan_args, root / f"cache-{name}-0", root / f"out-{name}-warm")
        result = json.loads((out / "plan.json").read_text())
        same = (out / "plan.json").read_bytes() == (root / f"out-{name}-warm" / "plan.json").read_bytes()
        best = result["ranked"][0] if result["ranked"] else None
        cold = statistics.median(colds)
        rows.append([name, result["evaluated"], result["shapes"], f"{cold:.1f}",
                     f"{min(colds):.1f}-{max(colds):.1f} ({len(colds)} runs)", f"{result['evaluated'] / cold:,.0f}",
                     f"{warm:.2f}", f"{result['evaluated'] / warm:,.0f}", "yes" if same else "NO", _describe(best)])
        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["plan", "layouts", "shapes", "cold_s (median)", "cold_s range", "cold_layouts_per_s",
                                  "warm_s", "warm_layouts_per_s", "warm_identical", "best"], tablefmt="github"))
    print(f"\n{os.cpu_count()} cores")


def _describe(row: dict | None) -> str:
    if row is None:
        return "none fits"
    from fxworkload.formats.plan_text import fsdp2_text

    fsdp2 = f" ({fsdp2_text(row)})" if row["zero"] == 3 else ""
    return (f"tp{row['tp']} cp{row['cp']} pp{row['pp']} vpp{row['vpp']} dp{row['dp']} zero{row['zero']}{fsdp2} "
            f"{row['recompute']} mbs{row['micro_batch']}: {row['step_ms'] / 1e3:.2f} s, {row['tflops_per_gpu']:.0f} "
            f"TFLOP/s/GPU, {row['peak_bytes'] / 2 ** 30:.0f} GiB")


if __name__ == "__main__":
    main()
