"""Whole training steps estimated with default settings and no GPU, against the eager steps issue 12
measured on an H100 (H200 for Mistral): forward, loss, backward; CUDA events, median of 10.

    .venv/bin/python bench/steps.py

Each case is the shipped config from models/ copied with its layers cut (and, for one GPT-2 case,
its dropouts set to 0), extracted with `fxworkload extract DIR --batch B --seq S --dtype bf16
--device D` (the default --trace-on auto: the GPU's dispatch); the figure is workload.json's
step_estimated_ns (the two-stream step: the larger of host dispatch and GPU kernels, in order), and
whether its 90 % interval (step_low_ns-step_high_ns: each kernel family's held-out errors, from the
fit's held-out half, never from these steps) covers the measured step.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from fxworkload.pipeline import extract

MODELS = Path(__file__).resolve().parents[1] / "models"
GPT2_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")

# name, model, layers (None: as shipped), config changes, batch, seq, dtype, device, measured ms
CASES = (
    ("gpt2, shipped config, b8 s1024 bf16", "gpt2", None, {}, 8, 1024, "bf16", "h100-sxm", 50.1),
    ("gpt2, dropout 0, b8 s1024 bf16", "gpt2", None, dict.fromkeys(GPT2_DROPOUTS, 0.0), 8, 1024, "bf16", "h100-sxm",
     48.5),
    ("gpt2, b8 s1024 fp32", "gpt2", None, {}, 8, 1024, "fp32", "h100-sxm", 183.1),
    ("gpt2-xl, 8 layers, b4 s1024 bf16", "gpt2-xl", 8, {}, 4, 1024, "bf16", "h100-sxm", 42.3),
    ("mixtral-8x7b, 2 layers, b1 s4096 bf16", "mixtral-8x7b", 2, {}, 1, 4096, "bf16", "h100-sxm", 57.5),
    ("mistral-7b, 4 layers, b1 s8192 bf16 (H200)", "mistral-7b", 4, {}, 1, 8192, "bf16", "h200", 147.0),
)
LAYER_KEYS = ("num_hidden_layers", "n_layer")


def case_dir(folder: Path, model: str, layers: int | None, changes: dict) -> Path:
    config = json.loads((MODELS / model / "config.json").read_text())
    if layers is not None:
        for key in LAYER_KEYS:
            if key in config:
                config[key] = layers
    config.update(changes)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for extra in (MODELS / model).iterdir():
        if extra.name != "config.json":
            (folder / extra.name).write_bytes(extra.read_bytes())
    return folder


def main() -> int:
    rows, errors, covered = [], [], 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for index, (name, model, layers, changes, batch, seq, dtype, device, measured_ms) in enumerate(CASES):
            folder = case_dir(Path(root) / f"case{index}", model, layers, changes)
            result = extract(str(folder), batch=batch, seq=seq, dtype=dtype, device=device)
            totals = result.totals
            estimated_ms = totals["step_estimated_ns"] / 1e6
            low_ms, high_ms = totals["step_low_ns"] / 1e6, totals["step_high_ns"] / 1e6
            error = (estimated_ms - measured_ms) / measured_ms
            errors.append(error)
            covered += low_ms <= measured_ms <= high_ms
            rows.append([name, f"{measured_ms:.1f}", f"{estimated_ms:.1f}", f"{100 * error:+.1f}%",
                         f"{low_ms:.1f}-{high_ms:.1f}", "yes" if low_ms <= measured_ms <= high_ms else "no"])
            print(f"  {name}: {estimated_ms:.1f} ms", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["case", "measured_ms", "estimated_ms", "error", "interval_90pct_ms", "covered"],
                   tablefmt="github"))
    within = sum(abs(e) <= 0.10 for e in errors)
    print(f"\n{within} of {len(errors)} within ±10 %; the 90 % interval covers {covered} of {len(errors)}; "
          f"{time.perf_counter() - started:.0f} s")
    print(json.dumps({"within_10_pct": within, "cases": len(errors), "covered": covered,
                      "errors_pct": [round(100 * e, 1) for e in errors]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
