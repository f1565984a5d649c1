"""On this machine's GPU: GPT-2's training step eager and under torch.compile, with and without the
optimizer, then a minute of back-to-back GEMMs to see whether the clock holds (the long-run
throttle the cost model's sustained clock stands for).

Steps: the shipped models/gpt2 config (random weights, seed 0), batch 8, seq 1024, bf16 parameters;
each figure the median of 10 steps between CUDA events after 3 warm-ups (the compile inside them).
"step" is forward, loss, backward with the gradients freed before; "+ adamw" adds
``torch.optim.AdamW(fused=True)``'s step and ``zero_grad``.

Sustained GEMMs: 8192³ bf16 products for SECONDS, the rate over each second and nvidia-smi's SM
clock, power and temperature read beside it (NVML through nvidia-ml-py).

    python bench/gpu_stacks.py OUT_DIR        # writes OUT_DIR/stacks.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxworkload.capture import models  # noqa: E402
from fxworkload.measure.timing import Clock  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"
BATCH, SEQ = 8, 1024
SECONDS = 60
GEMM_SIZE = 8192


def step_ms(model, ids, optimizer=None) -> float:
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        if optimizer is not None:
            optimizer.step()
    return Clock(torch.device("cuda")).median_ns(step, repeat=10, warmup=3) / 1e6


def steps() -> dict:
    spec = models.resolve(str(MODELS / "gpt2"))
    model = models.build_real_model(spec, torch.bfloat16, torch.device("cuda"), seed=0)
    ids = torch.randint(0, spec.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    figures = {"eager_step_ms": step_ms(model, ids), "eager_adamw_step_ms": step_ms(model, ids, optimizer)}
    print(json.dumps(figures), flush=True)
    started = time.perf_counter()
    compiled = torch.compile(model)
    figures["compile_step_ms"] = step_ms(compiled, ids)
    figures["compile_seconds"] = round(time.perf_counter() - started, 1)
    figures["compile_adamw_step_ms"] = step_ms(compiled, ids, optimizer)
    print(json.dumps(figures), flush=True)
    return figures


def sustained() -> list[dict]:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16)
    rows, end = [], time.perf_counter() + SECONDS
    while time.perf_counter() < end:
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < 1.0:
            for _ in range(20):
                torch.mm(a, b)
            torch.cuda.synchronize()
            calls += 20
        elapsed = time.perf_counter() - start
        rows.append({"second": len(rows), "tflops": round(2 * GEMM_SIZE ** 3 * calls / elapsed / 1e12, 1),
                     "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                     "power_w": round(pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3, 1),
                     "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)})
    print(json.dumps(rows[0]), json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": BATCH, "seq": SEQ}
    for name, measure in (("gpt2", steps), ("sustained_gemm", sustained)):
        try:
            result[name] = measure()
        except Exception as exc:  # one part's failure must not lose the other
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        (out / "stacks.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
