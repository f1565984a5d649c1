"""What the caching allocator reserves over an eager step, ours beside the lent H100's.

For each of bench/steps.py's cases, the step is captured with every layer and replayed through
workload/allocator.py (PyTorch's CUDACachingAllocator rules), parameters first, three steps; the
measured figures are bench/data/lent-gpus/h100/graphs/reserved.json (bench/gpu_graphs.py: each case in a
process of its own, the pool empty before the model is built; ``max_memory_reserved`` and
``max_memory_allocated`` over a step after four). Nothing here was fitted to them.

    .venv/bin/python bench/reserved.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from steps import CASES, case_dir  # noqa: E402

from fxworkload.capture import models  # noqa: E402
from fxworkload.capture.trace import capture_training_step  # noqa: E402
from fxworkload.cost import devices  # noqa: E402
from fxworkload.cost.flops import register_transformers_ops  # noqa: E402
from fxworkload.dtypes import DTYPES  # noqa: E402
from fxworkload.pipeline import trace_target  # noqa: E402
from fxworkload.workload.memory import activation_memory  # noqa: E402

MEASURED = Path(__file__).resolve().parent / "data" / "lent-gpus" / "h100" / "graphs" / "reserved.json"
GIB = 1 << 30


def ours(folder: Path, batch: int, seq: int, dtype: str) -> tuple[int, int]:
    spec = models.resolve(str(folder))
    module = models.build_meta_model(spec, DTYPES[dtype])
    capture = capture_training_step(module, batch, seq, gpu=trace_target("auto", devices.load("h100-sxm")))
    memory = activation_memory(capture)
    return memory.reserved_peak_bytes, memory.allocated_peak_bytes


def main() -> int:
    register_transformers_ops()
    measured = {row["case"]: row for row in json.loads(MEASURED.read_text())["cases"]}
    rows, errors = [], {"reserved": [], "allocated": [], "slack": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for index, (name, model, layers, changes, batch, seq, dtype, _, _) in enumerate(CASES):
            reserved, allocated = ours(case_dir(Path(root) / f"case{index}", model, layers, changes), batch, seq, dtype)
            m = measured[name]
            m_reserved, m_allocated = m["steady_max_reserved_bytes"], m["steady_max_allocated_bytes"]
            errors["reserved"].append(reserved / m_reserved - 1)
            errors["allocated"].append(allocated / m_allocated - 1)
            rows.append([name, f"{allocated / GIB:.2f}", f"{m_allocated / GIB:.2f}", f"{reserved / GIB:.2f}",
                         f"{m_reserved / GIB:.2f}", f"{100 * (reserved / m_reserved - 1):+.1f}%",
                         f"{reserved / allocated:.3f}", f"{m_reserved / m_allocated:.3f}"])
    print(tabulate(rows, headers=["case (lent H100)", "allocated GiB ours", "measured", "reserved GiB ours",
                                  "measured", "reserved error", "reserved/allocated ours", "measured"]))
    reserved_abs = sorted(abs(e) for e in errors["reserved"])
    allocated_abs = sorted(abs(e) for e in errors["allocated"])
    print(f"\nreserved: median |error| {100 * reserved_abs[len(reserved_abs) // 2]:.1f}%, max {100 * reserved_abs[-1]:.1f}%;"
          f" allocated: median |error| {100 * allocated_abs[len(allocated_abs) // 2]:.1f}%, max "
          f"{100 * allocated_abs[-1]:.1f}% ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
