"""Kernel micro-benchmarks of the families the GPU model is fitted on, written as gemm.csv, sdpa.csv
and vector.csv in the format of shared/gpu-kernels (``calibrate --on cuda``).

Method, as that data was measured: the op is called N times back to back between two marks (CUDA
events on a GPU, so the stream stays busy and launch latency hides as inside a training step), the
figure is the mean per call, and the median of 5 such samples after 3 warm-up calls is kept. N is
chosen from one call's time, 2 to 50. One more call under torch.profiler lists the kernels it
launched (names cut at 80 characters, ``|``-separated): which implementation ran.

The shapes are a subset of that data's, sized for about two minutes on one GPU: the three GEMMs of
a Linear layer (forward NT, input gradient NN, weight gradient TN) at transformer widths and
vocabularies, aligned and not (GPT-2's 50,257); SDPA with and without masks, dropout and GQA, in
bf16 and fp32; the memory-bound ops of vector.csv at three sizes.
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..dtypes import DTYPES
from .kernels import COLUMNS, VECTOR_OPS
from .timing import Clock

WARMUP_CALLS = 3
SAMPLES = 5
SAMPLE_NS = 2e6  # N calls of about this long per sample
MIN_CALLS, MAX_CALLS = 2, 50
KERNEL_NAME_CHARS = 80

# gemm.csv's and sdpa.csv's extra columns, as the shared data has them.
GEMM_HEADER = (*COLUMNS["gemm.csv"], "tflops", "kernels")
SDPA_HEADER = (*COLUMNS["sdpa.csv"], "bwd_kernels")
VECTOR_HEADER = ("op", "dtype", "rows", "cols", "numel", "us", "kernels")

TOKENS = (512, 2048, 8192)
HIDDEN = (768, 4096, 8192)
VOCABULARIES = (32000, 50257, 50304)


def gemm_shapes() -> list[tuple[str, int, int, int, str]]:
    """(dtype, m, k, n, layout): per token count and width, the MLP's up projection, a square
    projection and the LM head over three vocabularies, in the three layouts; a few in fp32."""
    shapes = []
    for m in TOKENS:
        for hidden in HIDDEN:
            for k, n in ((hidden, 4 * hidden), (hidden, hidden), *((hidden, v) for v in VOCABULARIES)):
                shapes += [("bf16", m, k, n, layout) for layout in ("NT", "NN", "TN")]
    shapes += [("fp32", 2048, hidden, n, layout) for hidden in (768, 4096) for n in (hidden, 50257)
               for layout in ("NT", "NN", "TN")]
    return shapes


def sdpa_configs() -> list[tuple]:
    """(dtype, batch, heads, kv_heads, seq, head_dim, causal, dropout, mask)."""
    configs = []
    for batch, seq in ((8, 1024), (2, 4096), (1, 8192)):
        for heads, kv_heads, head_dim in ((12, 12, 64), (32, 8, 128), (32, 32, 128)):
            for dropout, mask in ((0.0, "none"), (0.1, "none"), (0.0, "bool_causal")):
                configs.append(("bf16", batch, heads, kv_heads, seq, head_dim, True, dropout, mask))
        configs.append(("bf16", batch, 32, 8, seq, 128, True, 0.0, "sliding4096"))
    configs += [("fp32", 4, 12, 12, 1024, 64, True, dropout, "none") for dropout in (0.0, 0.1)]
    return configs


def vector_cases() -> list[tuple[str, str, int, int]]:
    """(op, dtype, rows, cols): every op of vector.csv at about 1, 16 and 64 Mi elements."""
    cases = []
    for op in VECTOR_OPS:
        for rows, cols in ((1365, 768), (4096, 4096), (1336, 50257)):
            cases.append((op, "bf16", rows, cols))
    return cases


def time_us(fn: Callable[[], object], clock: Clock) -> float:
    """Median over samples of the mean time of N back-to-back calls, in microseconds."""
    single_ns = clock.median_ns(fn, repeat=1, warmup=WARMUP_CALLS, calls=1)
    calls = int(min(MAX_CALLS, max(MIN_CALLS, SAMPLE_NS / max(single_ns, 1.0))))
    return clock.median_ns(fn, repeat=SAMPLES, warmup=0, calls=calls) / 1e3


def kernel_names(fn: Callable[[], object], device: torch.device) -> str:
    """The GPU kernels one call launches, in order (empty on a CPU, which launches none)."""
    if device.type != "cuda":
        return ""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize(device)
    kernels = sorted((e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    return "|".join(e.name[:KERNEL_NAME_CHARS] for e in kernels)


def gemm_rows(shapes, device: torch.device, progress=lambda done: None) -> list[dict]:
    clock, rows = Clock(device), []
    for dtype_name, m, k, n, layout in shapes:
        dtype = DTYPES[dtype_name]
        a = torch.randn(k, m, device=device, dtype=dtype).t() if layout == "TN" else torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(n, k, device=device, dtype=dtype).t() if layout == "NT" else torch.randn(k, n, device=device, dtype=dtype)
        with _no_tf32():
            us = time_us(lambda: torch.mm(a, b), clock)
            kernels = kernel_names(lambda: torch.mm(a, b), device)
        rows.append({"dtype": dtype_name, "m": m, "k": k, "n": n, "layout": layout, "us": f"{us:.3f}",
                     "tflops": f"{2 * m * k * n / (us * 1e-6) / 1e12:.4g}", "kernels": kernels})
        progress(1)
    return rows


def sdpa_rows(configs, device: torch.device, progress=lambda done: None) -> list[dict]:
    clock, rows = Clock(device), []
    for dtype_name, batch, heads, kv_heads, seq, head_dim, causal, dropout, mask_kind in configs:
        dtype = DTYPES[dtype_name]
        q, k, v = (torch.randn(batch, h, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        mask = _mask(mask_kind, seq, device)

        def forward():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=causal and mask is None, enable_gqa=heads != kv_heads)

        row = {"dtype": dtype_name, "batch": batch, "heads": heads, "kv_heads": kv_heads, "seq": seq,
               "head_dim": head_dim, "causal": str(causal), "dropout": dropout, "mask": mask_kind}
        try:
            out = forward()
            grad = torch.randn_like(out)

            def backward():
                return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

            row.update(fwd_us=f"{time_us(forward, clock):.3f}", bwd_us=f"{time_us(backward, clock):.3f}",
                       fwd_kernels=kernel_names(forward, device), bwd_kernels=kernel_names(backward, device))
        except RuntimeError as exc:  # a configuration no kernel takes: recorded as the data records it
            row.update(fwd_us="nan", bwd_us="nan", fwd_kernels=f"error: {str(exc).splitlines()[0][:KERNEL_NAME_CHARS]}",
                       bwd_kernels="")
        rows.append(row)
        progress(1)
    return rows


def _mask(kind: str, seq: int, device: torch.device) -> torch.Tensor | None:
    if kind == "none":
        return None
    position = torch.arange(seq, device=device)
    distance = position[:, None] - position[None, :]
    if kind == "bool_causal":
        return distance >= 0
    window = int(kind.removeprefix("sliding"))
    return (distance >= 0) & (distance < window)


def vector_rows(cases, device: torch.device, progress=lambda done: None) -> list[dict]:
    clock, rows = Clock(device), []
    for op, dtype_name, r, c in cases:
        dtype = DTYPES[dtype_name]
        x = torch.randn(r, c, device=device, dtype=dtype)
        w = torch.randn(c, device=device, dtype=dtype)
        t = torch.randint(0, c, (r,), device=device)
        call = VECTOR_OPS[op]
        rows.append({"op": op, "dtype": dtype_name, "rows": r, "cols": c, "numel": r * c,
                     "us": f"{time_us(lambda: call(x, w, t), clock):.3f}",
                     "kernels": kernel_names(lambda: call(x, w, t), device)})
        progress(1)
    return rows


def csv_text(header: tuple[str, ...], rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def measure(device: torch.device, gemm=None, sdpa=None, vector=None, progress=lambda done: None) -> dict[str, str]:
    """The three files' text; each family's cases default to the module's own."""
    gemm = gemm_shapes() if gemm is None else gemm
    sdpa = sdpa_configs() if sdpa is None else sdpa
    vector = vector_cases() if vector is None else vector
    return {"gemm.csv": csv_text(GEMM_HEADER, gemm_rows(gemm, device, progress)),
            "sdpa.csv": csv_text(SDPA_HEADER, sdpa_rows(sdpa, device, progress)),
            "vector.csv": csv_text(VECTOR_HEADER, vector_rows(vector, device, progress))}


def case_count(gemm=None, sdpa=None, vector=None) -> int:
    return sum(len(x if x is not None else default()) for x, default in
               ((gemm, gemm_shapes), (sdpa, sdpa_configs), (vector, vector_cases)))


@contextlib.contextmanager
def _no_tf32():
    """fp32 GEMMs on the FP32 units, as the data was measured (TF32 off)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(folder / name)
    return folder
