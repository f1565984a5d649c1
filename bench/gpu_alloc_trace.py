"""On this machine's GPU: the caching allocator's own record of bench/steps.py's first case (GPT-2, batch
8, seq 1024, bf16), the model built on an empty pool, then four eager steps (bench/gpu_graphs.py's
``eager_step``): every allocation, free and segment ``cudaMalloc`` in order
(``torch.cuda.memory._record_memory_history``, no stack frames), written as JSON rows
``[action, address, bytes]`` with the index where each step begins, and reserved and allocated after
each step. What workload/allocator.py's replay is checked against, event by event.

    python bench/gpu_alloc_trace.py OUT_DIR        # writes OUT_DIR/alloc-trace.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_graphs import eager_step, gpt2  # noqa: E402

STEPS = 4


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    model, ids = gpt2(8, 1024)
    torch.cuda.synchronize()
    after = [{"reserved_bytes": torch.cuda.memory_reserved(), "allocated_bytes": torch.cuda.memory_allocated()}]
    marks = []
    for _ in range(STEPS):
        marks.append(len(torch.cuda.memory._snapshot()["device_traces"][0]))
        torch.cuda.reset_peak_memory_stats()
        eager_step(model, ids)
        torch.cuda.synchronize()
        after.append({"reserved_bytes": torch.cuda.memory_reserved(), "allocated_bytes": torch.cuda.memory_allocated(),
                      "max_reserved_bytes": torch.cuda.max_memory_reserved(),
                      "max_allocated_bytes": torch.cuda.max_memory_allocated()})
    snapshot = torch.cuda.memory._snapshot()
    events = [[e["action"], e["addr"], e["size"]] for e in snapshot["device_traces"][0]]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "step_starts": marks,
              "after": after, "events": events,
              "parameters": [[n, p.numel() * p.element_size()] for n, p in model.named_parameters()]}
    (out / "alloc-trace.json").write_text(json.dumps(result) + "\n")
    print(json.dumps({"events": len(events), "step_starts": marks, "after": after}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
