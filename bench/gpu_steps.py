"""Measure, on this machine's GPU, the eager training steps bench/steps.py estimates, and record one
torch.profiler trace of each step for ``compare`` and ``calibrate --from``.

Each case of bench/steps.py's CASES: the shipped config from models/ with its layers cut, real
weights where the folder has them (else random, seed 0), parameters in the case's dtype, forward,
loss, backward with the gradients freed before each step (profile.py's own eager step); the time
is the median of 10 steps between CUDA events after 3 warm-ups, and the peak is
``max_memory_allocated`` over one step above what was allocated before it. Each trace is one
more step (after a warm-up step outside it), CPU and CUDA activities, shapes recorded, as
docs/commands.md's round trip records one.

    python bench/gpu_steps.py OUT_DIR          # writes OUT_DIR/steps.json and OUT_DIR/trace-<case>.json.gz

Needs a CUDA GPU; cases that do not fit its memory are written with their error.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from steps import CASES, case_dir  # noqa: E402

from fxworkload.capture import models  # noqa: E402
from fxworkload.dtypes import DTYPES  # noqa: E402
from fxworkload.measure.profile import _eager_step, measured_step_peak_bytes  # noqa: E402
from fxworkload.measure.timing import Clock  # noqa: E402

TIMED_STEPS, WARMUP_STEPS = 10, 3


def measure_case(folder: Path, batch: int, seq: int, dtype: str, device: torch.device) -> dict:
    spec = models.resolve(str(folder))
    module = models.build_real_model(spec, DTYPES[dtype], device, seed=0)
    ids = torch.randint(0, models.setting(spec.config, "vocab_size"), (batch, seq),
                        generator=torch.Generator().manual_seed(0)).to(device)
    step_ns = Clock(device).median_ns(lambda: _eager_step(module, ids), repeat=TIMED_STEPS, warmup=WARMUP_STEPS)
    peak_bytes = measured_step_peak_bytes(module, ids, device)
    return {"measured_ms": step_ns / 1e6, "step_peak_bytes": peak_bytes, "module": module, "ids": ids}


def record_trace(module, ids, path: Path) -> None:
    module.zero_grad(set_to_none=True)
    module(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # warm-up, outside the trace
    module.zero_grad(set_to_none=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
        module(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(path))


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    results = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "cases": []}
    with tempfile.TemporaryDirectory() as root:
        for index, (name, model, layers, changes, batch, seq, dtype, _, _) in enumerate(CASES):
            row = {"case": name, "batch": batch, "seq": seq, "dtype": dtype}
            try:
                measured = measure_case(case_dir(Path(root) / f"case{index}", model, layers, changes),
                                        batch, seq, dtype, device)
                row.update(measured_ms=round(measured["measured_ms"], 3), step_peak_bytes=measured["step_peak_bytes"])
                record_trace(measured["module"], measured["ids"], out / f"trace-{index}.json.gz")
                del measured
            except Exception as exc:  # one case's failure (memory, say) must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            torch.cuda.empty_cache()
            results["cases"].append(row)
            print(json.dumps(row), flush=True)
    (out / "steps.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
