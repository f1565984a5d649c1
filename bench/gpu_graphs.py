"""On this machine's GPU: GPT-2's eager training step with and without CUDA graphs, the host's time to
issue it, and what the caching allocator reserves over bench/steps.py's steps.

CUDA graphs, two ways a stack captures them, each beside its own eager baseline (the same modules):
- ``layers``: each transformer block captured alone (``torch.cuda.make_graphed_callables``, forward and
  backward), the embeddings, the final norm, the head and the loss eager: Megatron-Core's and
  Transformer Engine's per-layer capture. The blocks run without the attention mask (causal SDPA), in
  both the eager and the graphed step, so the two run the same kernels.
- ``step``: the whole forward, loss and backward captured as one graph (``torch.cuda.graph``), the
  whole-network capture of PyTorch's CUDA-graph notes; replayed with the gradients it wrote.
Each step time is the median of 10 between CUDA events after 3 warm-ups; ``host_issue_ms`` is the
median host time to return from an eager step without synchronising (the host's pace where the GPU
keeps up, else the GPU's, as the launch queue fills).

Reserved memory: each case of bench/steps.py's CASES, its model built after ``empty_cache``, then
``memory_reserved`` and ``memory_allocated`` before the first step, the peaks over the first step,
and over a later step (the steady state, the pool kept from before), with the segments' sizes.

    python bench/gpu_graphs.py OUT_DIR        # writes OUT_DIR/graphs.json and OUT_DIR/reserved.json
    python bench/gpu_graphs.py OUT_DIR reserved=2   # case 2 alone: OUT_DIR/reserved-2.json
    python bench/gpu_graphs.py OUT_DIR compile      # torch.compile default and reduce-overhead: OUT_DIR/compiled.json
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from steps import CASES, case_dir  # noqa: E402

from fxworkload.capture import models  # noqa: E402
from fxworkload.dtypes import DTYPES  # noqa: E402
from fxworkload.measure.timing import Clock  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"
SHAPES = ((1, 128), (4, 512), (8, 1024))  # (batch, seq) of GPT-2 in bf16: host-bound to GPU-bound
REPEAT, WARMUP = 10, 3


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor()


class Block(torch.nn.Module):
    """A GPT-2 block called with its hidden states only (no mask: causal SDPA), one tensor out."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden):
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class Called(torch.nn.Module):
    """Stands in a block list's place: takes the model's call, passes the hidden states only."""

    def __init__(self, inner, as_tuple: bool):
        super().__init__()
        self.inner, self.as_tuple = inner, as_tuple  # as the block it replaces returned (transformers < 5.x)

    def forward(self, hidden, *args, **kwargs):
        out = self.inner(hidden)
        return (out,) if self.as_tuple else out


def median_ms(fn) -> float:
    return Clock(torch.device("cuda")).median_ns(fn, repeat=REPEAT, warmup=WARMUP) / 1e6


def host_issue_ms(fn) -> float:
    times = []
    for _ in range(REPEAT):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - started))
        torch.cuda.synchronize()
    return statistics.median(times)


def gpt2(batch: int, seq: int):
    spec = models.resolve(str(MODELS / "gpt2"))
    model = models.build_real_model(spec, torch.bfloat16, torch.device("cuda"), seed=0)
    ids = torch.randint(0, spec.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).cuda()
    return model, ids


def eager_step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def layers_pair(batch: int, seq: int) -> dict:
    model, ids = gpt2(batch, seq)
    blocks = model.transformer.h
    hidden = torch.randn(batch, seq, model.config.n_embd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        as_tuple = isinstance(blocks[0](hidden), tuple)
    wrapped = [Block(b) for b in blocks]
    for i, w in enumerate(wrapped):
        blocks[i] = Called(w, as_tuple)
    row = {"eager_ms": median_ms(lambda: eager_step(model, ids)),
           "eager_host_issue_ms": host_issue_ms(lambda: eager_step(model, ids))}
    graphed = torch.cuda.make_graphed_callables(tuple(wrapped), tuple((hidden,) for _ in wrapped))
    for i, g in enumerate(graphed):
        blocks[i] = Called(g, as_tuple)
    row["graphed_ms"] = median_ms(lambda: eager_step(model, ids))
    row["graphed_host_issue_ms"] = host_issue_ms(lambda: eager_step(model, ids))
    return row


def step_pair(batch: int, seq: int) -> dict:
    model, ids = gpt2(batch, seq)
    row = {"eager_ms": median_ms(lambda: eager_step(model, ids)),
           "eager_host_issue_ms": host_issue_ms(lambda: eager_step(model, ids))}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch's whole-network capture does
        for _ in range(3):
            eager_step(model, ids)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    row["graphed_ms"] = median_ms(graph.replay)
    row["graphed_host_issue_ms"] = host_issue_ms(graph.replay)
    return row


def graphs() -> list[dict]:
    rows = []
    for how, pair in (("layers", layers_pair), ("step", step_pair)):
        for batch, seq in SHAPES:
            row = {"capture": how, "model": "gpt2", "batch": batch, "seq": seq, "dtype": "bf16"}
            try:
                row.update({k: round(v, 3) for k, v in pair(batch, seq).items()})
            except Exception as exc:  # one capture's failure must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def compiled_pairs() -> list[dict]:
    """GPT-2 under torch.compile, default mode against mode="reduce-overhead" (inductor's CUDA graph trees
    over the compiled forward and backward), each step marked to cudagraph trees as a new one."""
    rows = []
    for batch, seq in ((1, 128), (8, 1024)):
        row = {"capture": "compile", "model": "gpt2", "batch": batch, "seq": seq, "dtype": "bf16"}
        try:
            for key, mode in (("compiled_ms", "default"), ("reduce_overhead_ms", "reduce-overhead")):
                torch._dynamo.reset()
                model, ids = gpt2(batch, seq)
                compiled = torch.compile(model, mode=mode)

                def step():
                    torch.compiler.cudagraph_mark_step_begin()
                    compiled.zero_grad(set_to_none=True)
                    compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                row[key] = round(Clock(torch.device("cuda")).median_ns(step, repeat=REPEAT, warmup=6) / 1e6, 3)
                del model, compiled
                torch.cuda.empty_cache()
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def reserved_case(folder: Path, batch: int, seq: int, dtype: str) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    spec = models.resolve(str(folder))
    module = models.build_real_model(spec, DTYPES[dtype], torch.device("cuda"), seed=0)
    ids = torch.randint(0, models.setting(spec.config, "vocab_size"), (batch, seq),
                        generator=torch.Generator().manual_seed(0)).cuda()
    torch.cuda.synchronize()
    row = {"model_allocated_bytes": torch.cuda.memory_allocated() - base_allocated,
           "model_reserved_bytes": torch.cuda.memory_reserved() - base_reserved,
           "parameter_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
           "parameter_count": sum(1 for _ in module.parameters())}
    torch.cuda.reset_peak_memory_stats()
    eager_step(module, ids)
    torch.cuda.synchronize()
    row["first_step_max_allocated_bytes"] = torch.cuda.max_memory_allocated() - base_allocated
    row["first_step_max_reserved_bytes"] = torch.cuda.max_memory_reserved() - base_reserved
    for _ in range(3):
        eager_step(module, ids)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    eager_step(module, ids)
    torch.cuda.synchronize()
    row["steady_max_allocated_bytes"] = torch.cuda.max_memory_allocated() - base_allocated
    row["steady_max_reserved_bytes"] = torch.cuda.max_memory_reserved() - base_reserved
    row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    row["segment_bytes"] = sorted((s["total_size"] for s in torch.cuda.memory_snapshot()), reverse=True)
    del module
    return row


def reserved(only: int | None = None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for index, (name, model, layers, changes, batch, seq, dtype, _, _) in enumerate(CASES):
            if only is not None and index != only:
                continue
            row = {"case": name, "batch": batch, "seq": seq, "dtype": dtype}
            try:
                row.update(reserved_case(case_dir(Path(root) / f"case{index}", model, layers, changes),
                                         batch, seq, dtype))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "segment_bytes"}), flush=True)
    return rows


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    facts = {"gpu": torch.cuda.get_device_name(), "cpu": cpu_name(), "torch": torch.__version__}
    what = sys.argv[2:] or ["reserved", "graphs"]
    for item in what:  # reserved=N: case N alone, in a process of its own (a pool no earlier case left)
        if item.startswith("reserved="):
            index = int(item.split("=")[1])
            (out / f"reserved-{index}.json").write_text(json.dumps({**facts, "cases": reserved(index)}, indent=1) + "\n")
    if "reserved" in what:
        (out / "reserved.json").write_text(json.dumps({**facts, "cases": reserved()}, indent=1) + "\n")
    if "compile" in what:
        (out / "compiled.json").write_text(json.dumps({**facts, "rows": compiled_pairs()}, indent=1) + "\n")
    if "graphs" in what:
        (out / "graphs.json").write_text(json.dumps({**facts, "rows": graphs()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
