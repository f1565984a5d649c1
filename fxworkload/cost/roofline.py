"""Estimated time of one op on a device: a roofline plus a per-kernel launch cost.

    time_ns = launch_ns + 1e9 · max(flops / compute_rate, bytes / memory_rate)

GEMM and attention ops compute at the device's matmul rate for their dtype; every other op at
the vector rate. A datasheet profile gives every rate as peak × efficiency. A measured profile
(``fxworkload calibrate``) gives
- the GEMM rate over a grid of (m, k, n) shapes, interpolated log-linearly between grid points
  and held flat beyond them (ops that are not plain GEMMs use the cube of their FLOPs' size); a
  measured GEMM rate already holds the GEMM's memory traffic, so no bandwidth bound is added;
- the bandwidth as a curve over bytes moved, interpolated the same way;
- a vector rate per op, where the op was measured.
Ops that launch no kernel (views, getitem, empty) take 0 ns.
"""

from __future__ import annotations

import bisect
import itertools
import math

import torch

from ..dtypes import DTYPE_NAMES
from .devices import DeviceProfile


def estimate_ns(flops: int, nbytes: int, dtype: torch.dtype | None, device: DeviceProfile, *,
                uses_matmul_units: bool, op_name: str = "", gemm: tuple[int, int, int] | None = None) -> float:
    if flops == 0 and nbytes == 0:
        return 0.0
    if uses_matmul_units:
        dtype_name = DTYPE_NAMES.get(dtype, "fp32")
        table = device.matmul_flops_per_s_by_shape.get(dtype_name)
        if table:
            compute_rate = _grid_rate(table, gemm or (max(flops / 2, 1.0) ** (1 / 3),) * 3)
        else:
            compute_rate = device.matmul_flops_per_s[dtype_name] * device.compute_efficiency
    else:
        vector_rate = device.vector_flops_per_s_by_op.get(op_name, device.vector_flops_per_s)
        compute_rate = vector_rate * device.compute_efficiency
    if uses_matmul_units and measured(device):  # a measured GEMM rate holds the GEMM's own traffic
        return device.kernel_launch_ns + 1e9 * flops / compute_rate
    memory_rate = _curve_rate(device.memory_bytes_per_s_by_bytes, nbytes,
                              device.memory_bytes_per_s * device.memory_efficiency)
    return device.kernel_launch_ns + 1e9 * max(flops / compute_rate, nbytes / memory_rate)


def measured(device: DeviceProfile) -> bool:
    """A profile whose rates were measured (``calibrate``), not datasheet peaks times efficiencies."""
    return device.compute_efficiency == 1.0 and device.memory_efficiency == 1.0


def _bracket(points: list[float], x: float) -> list[tuple[float, float]]:
    """The grid points around x with their log-linear weights; one point (weight 1) outside the range."""
    i = bisect.bisect_left(points, x)
    if i == 0:
        return [(points[0], 1.0)]
    if i == len(points):
        return [(points[-1], 1.0)]
    x0, x1 = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return [(x0, 1.0 - t), (x1, t)]


def _curve_rate(curve: list[list[float]], size: float, flat_rate: float) -> float:
    if not curve or size <= 0:
        return flat_rate
    rate_at = dict((x, y) for x, y in curve)
    return math.exp(sum(w * math.log(rate_at[x]) for x, w in _bracket(sorted(rate_at), size)))


_GRIDS: dict[int, tuple] = {}


def _grid(table: list[list[float]]) -> tuple:
    """Axes and log-rates of a GEMM table, built once per table (held with it, so its id stays unique)."""
    cached = _GRIDS.get(id(table))
    if cached is None or cached[0] is not table:
        log_rate = {(m, k, n): math.log(rate) for m, k, n, rate in table}
        axes = [sorted({key[i] for key in log_rate}) for i in range(3)]
        cached = _GRIDS[id(table)] = (table, axes, log_rate)
    return cached[1:]


def _grid_rate(table: list[list[float]], shape: tuple) -> float:
    """Trilinear interpolation of log-rate in log-shape over the measured grid points around ``shape``.

    Corners that were not measured (too slow to time) drop out and the others are re-weighted.
    """
    axes, log_rate = _grid(table)
    total = weight = 0.0
    for corner in itertools.product(*(_bracket(axis, x) for axis, x in zip(axes, shape))):
        key = tuple(point for point, _ in corner)
        w = math.prod(w for _, w in corner)
        if key in log_rate and w > 0:
            total += w * log_rate[key]
            weight += w
    if weight == 0:  # no measured corner: the nearest measured shape
        key = min(log_rate, key=lambda k: sum((math.log(a) - math.log(b)) ** 2 for a, b in zip(k, shape)))
        return math.exp(log_rate[key])
    return math.exp(total / weight)
