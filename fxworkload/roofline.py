"""Estimated time of one op on a device: a roofline plus a per-kernel launch cost.

    time_ns = launch_ns + 1e9 · max(flops / (peak[dtype] · e_compute), bytes / (bandwidth · e_memory))

GEMM and attention ops use the device's matmul peak for their dtype; every other op the vector
peak. Ops that launch no kernel (views, getitem, empty) take 0 ns.
"""

from __future__ import annotations

import torch

from .devices import DeviceProfile

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def estimate_ns(flops: int, nbytes: int, uses_matmul_units: bool, dtype: torch.dtype | None,
                device: DeviceProfile) -> float:
    if flops == 0 and nbytes == 0:
        return 0.0
    if uses_matmul_units:
        peak = device.matmul_flops_per_s[DTYPE_NAMES.get(dtype, "fp32")]
    else:
        peak = device.vector_flops_per_s
    compute_s = flops / (peak * device.compute_efficiency)
    memory_s = nbytes / (device.memory_bytes_per_s * device.memory_efficiency)
    return device.kernel_launch_ns + 1e9 * max(compute_s, memory_s)
