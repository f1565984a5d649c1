"""The estimates against what was measured on the GPUs lent to this project (bench/data/lent-gpus/,
written by bench/on_gpu.sh; the folder's README says what, when and with which software). Nothing
here is fitted to those measurements: the H100 profile's GPU model was fitted on another H100's
kernels (shared/gpu-kernels), the H200 has never been fitted on.

1. Whole eager steps (bench/steps.py's cases) and GPT-2 under torch.compile: measured, estimated
   (workload.json's step_estimated_ns; the compiled rows with --stack compiled), the error, and
   whether the 90 % interval covers the measurement.
   Then each step's peak memory (max_memory_allocated) against the estimate's step_peak_bytes.
2. Each step's torch.profiler trace through ``fxworkload compare``: the step's kernel time against
   the estimate, the share of the trace's kernel time tied to graph nodes, and each kind's
   time-weighted error.
3. The kernel CSVs ``calibrate --on cuda`` measured, against the shipped profile of that GPU:
   each family's median absolute error before any fit.
4. A minute of 8192³ bf16 GEMMs: the sustained rate, SM clock and power, against the fastest
   GEMM of the kernel CSVs (short back-to-back samples).
5. ``calibrate --from`` the H100's GPT-2 trace (the GPU model refitted to its ops' kernel times), then
   every H100 step estimated with that profile beside the shipped one: the other five runs are held out.

    .venv/bin/python bench/lent_gpus.py            # about 2 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from steps import CASES, case_dir  # noqa: E402

from fxworkload.cost import devices  # noqa: E402
from fxworkload.measure.kernels import median_abs_pct, samples, target_of  # noqa: E402
from fxworkload.pipeline import extract  # noqa: E402

DATA = ROOT / "bench" / "data" / "lent-gpus"
PROFILES = {"h100": "h100-sxm", "h200": "h200"}


def _pct(estimated: float, measured: float) -> str:
    return f"{100 * (estimated - measured) / measured:+.1f}%"


def step_rows(root: Path) -> list[list]:
    rows = []
    for gpu, profile in PROFILES.items():
        measured = {c["case"]: c for c in json.loads((DATA / gpu / "steps.json").read_text())["cases"]}
        for index, (name, model, layers, changes, batch, seq, dtype, _, _) in enumerate(CASES):
            folder = case_dir(root / f"{gpu}-{index}", model, layers, changes)
            totals = extract(str(folder), batch=batch, seq=seq, dtype=dtype, device=profile).totals
            rows.append(_step_row(gpu, name, measured[name]["measured_ms"], totals))
        stacks = json.loads((DATA / gpu / "stacks.json").read_text())["gpt2"]
        totals = extract(str(ROOT / "models" / "gpt2"), batch=8, seq=1024, dtype="bf16", device=profile,
                         stack="compiled").totals
        rows.append(_step_row(gpu, "gpt2, b8 s1024 bf16, torch.compile", stacks["compile_step_ms"], totals))
    return rows


def memory_rows(root: Path) -> list[list]:
    """Each eager step's measured peak (max_memory_allocated over one step, above what was allocated before it:
    the parameters) against the estimate's step_peak_bytes, which counts the same (profile.py)."""
    rows = []
    for gpu, profile in PROFILES.items():
        measured = {c["case"]: c for c in json.loads((DATA / gpu / "steps.json").read_text())["cases"]}
        for index, (name, model, layers, changes, batch, seq, dtype, _, _) in enumerate(CASES):
            folder = case_dir(root / f"mem-{gpu}-{index}", model, layers, changes)
            estimated = extract(str(folder), batch=batch, seq=seq, dtype=dtype, device=profile).totals["step_peak_bytes"]
            peak = measured[name]["step_peak_bytes"]
            rows.append([gpu, name, f"{peak / 2 ** 30:.2f}", f"{estimated / 2 ** 30:.2f}", _pct(estimated, peak)])
    return rows


def _step_row(gpu: str, name: str, measured_ms: float, totals: dict) -> list:
    estimated_ms = totals["step_estimated_ns"] / 1e6
    low_ms, high_ms = totals["step_low_ns"] / 1e6, totals["step_high_ns"] / 1e6
    return [gpu, name, f"{measured_ms:.1f}", f"{estimated_ms:.1f}", _pct(estimated_ms, measured_ms),
            f"{low_ms:.1f}-{high_ms:.1f}", "yes" if low_ms <= measured_ms <= high_ms else "no"]


def trace_rows(root: Path) -> tuple[list[list], list[str]]:
    rows, kinds = [], []
    for gpu, profile in PROFILES.items():
        for trace in sorted((DATA / gpu).glob("trace-*.json.gz")):
            index = int(trace.name.split("-")[1].split(".")[0])
            name, model, layers, changes, batch, seq, dtype, _, _ = CASES[index]
            folder = case_dir(root / f"trace-{gpu}-{index}", model, layers, changes)
            estimated, compared = root / f"est-{gpu}-{index}", root / f"cmp-{gpu}-{index}"
            for command in (["extract", str(folder), "--batch", str(batch), "--seq", str(seq), "--dtype", dtype,
                             "--device", profile, "--out", str(estimated)],
                            ["compare", str(estimated), str(trace), "--out", str(compared)]):
                subprocess.run([sys.executable, "-m", "fxworkload", *command], check=True, capture_output=True)
            result = json.loads((compared / "comparison.json").read_text())
            step = next(p for p in result["phases"] if p["span"] == "step")
            per_kind = {k["kind"]: k["time_weighted_error"] for k in result["kinds"]}
            kinds = kinds or list(per_kind)
            rows.append([gpu, name, f"{step['measured_ns'] / 1e6:.1f}", f"{step['estimated_ns'] / 1e6:.1f}",
                         _pct(step["estimated_ns"], step["measured_ns"]),
                         f"{100 * result['attributed_fraction']:.1f}%",
                         *(f"{100 * per_kind[k]:.0f}%" if per_kind.get(k) is not None else "-" for k in kinds)])
    return rows, kinds


def kernel_rows() -> list[list]:
    rows = []
    for gpu, profile in PROFILES.items():
        base = devices.load(profile)
        measured = samples(DATA / gpu / "kernels", target_of(base))
        errors = median_abs_pct(measured, base, None)
        rows.append([gpu, profile, *(f"{errors[f]:.1f}%" for f in ("gemm", "sdpa", "vector"))])
    return rows


def sustained_rows() -> list[list]:
    rows = []
    for gpu in PROFILES:
        seconds = json.loads((DATA / gpu / "stacks.json").read_text())["sustained_gemm"]
        burst = max(float(line.split(",")[6]) for line in (DATA / gpu / "kernels" / "gemm.csv").read_text().splitlines()[1:]
                    if line.startswith("bf16"))
        tflops = statistics.median(s["tflops"] for s in seconds)
        rows.append([gpu, f"{burst:.0f}", f"{tflops:.0f}", _pct(tflops, burst),
                     f"{statistics.median(s['sm_clock_mhz'] for s in seconds):.0f}",
                     f"{statistics.median(s['power_w'] for s in seconds):.0f}", len(seconds)])
    return rows


def trace_fit_rows(root: Path) -> list[list]:
    case = CASES[0]
    folder = case_dir(root / "fit-case", case[1], case[2], case[3])
    estimated = root / "fit-estimated"
    env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(root / "cache")}
    for command in (["extract", str(folder), "--batch", str(case[4]), "--seq", str(case[5]), "--dtype", case[6],
                     "--device", "h100-sxm", "--out", str(estimated)],
                    ["calibrate", "--from", str(DATA / "h100" / "trace-0.json.gz"), "--estimated", str(estimated),
                     "--name", "h100-from-trace"]):
        subprocess.run([sys.executable, "-m", "fxworkload", *command], check=True, capture_output=True, env=env)
    os.environ["FXWORKLOAD_CACHE_DIR"] = env["FXWORKLOAD_CACHE_DIR"]  # extract below reads the fitted profile
    measured = {c["case"]: c for c in json.loads((DATA / "h100" / "steps.json").read_text())["cases"]}
    rows = []
    for index, (name, model, layers, changes, batch, seq, dtype, _, _) in enumerate(CASES):
        folder = case_dir(root / f"fit-{index}", model, layers, changes)
        cells = [name + (" (the fitted trace's)" if index == 0 else ""), f"{measured[name]['measured_ms']:.1f}"]
        for profile in ("h100-sxm", "h100-from-trace"):
            ms = extract(str(folder), batch=batch, seq=seq, dtype=dtype, device=profile).totals["step_estimated_ns"] / 1e6
            cells += [f"{ms:.1f}", _pct(ms, measured[name]["measured_ms"])]
        rows.append(cells)
    return rows


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        print("Whole steps (median of 10, CUDA events)\n")
        print(tabulate(step_rows(root), headers=["gpu", "case", "measured_ms", "estimated_ms", "error",
                                                 "interval_90pct_ms", "covered"], tablefmt="github"))
        print("\nPeak memory of each eager step (allocated, above the parameters)\n")
        print(tabulate(memory_rows(root), headers=["gpu", "case", "measured_gib", "estimated_gib", "error"],
                       tablefmt="github"))
        rows, kinds = trace_rows(root)
        print("\nProfiler traces through fxworkload compare (kernel time per step; time-weighted error per kind)\n")
        print(tabulate(rows, headers=["gpu", "case", "trace_ms", "estimated_ms", "error", "tied", *kinds],
                       tablefmt="github"))
        fitted = trace_fit_rows(root)
    print("\nKernel CSVs of calibrate --on cuda against the shipped profile (median |error|, no fit)\n")
    print(tabulate(kernel_rows(), headers=["gpu", "profile", "gemm", "sdpa", "vector"], tablefmt="github"))
    print("\n8192³ bf16 GEMMs for a minute against the fastest GEMM of the kernel CSVs\n")
    print(tabulate(sustained_rows(), headers=["gpu", "burst_tflops", "sustained_tflops", "change",
                                              "sm_clock_mhz", "power_w", "seconds"], tablefmt="github"))
    print("\nH100 steps with the shipped profile and with one fitted to the GPT-2 trace (calibrate --from)\n")
    print(tabulate(fitted, headers=["case", "measured_ms", "h100-sxm_ms", "error", "from_trace_ms", "error"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
