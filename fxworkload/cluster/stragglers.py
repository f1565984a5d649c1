"""Stragglers: a synchronous step waits for its slowest GPU.

Identical GPUs are not identical: Sinha et al. (SC22, "Not All GPUs Are Created Equal") measured 8 %
average (up to 22 %) performance variation across GPUs of one SKU in five large clusters, outliers 1.5x
slower than the median, from manufacturing variation under power management. A GPU that is slower stays
slower for the whole run, and every step of synchronous training waits for it: the tensor- and
pipeline-parallel groups hand work on every layer and micro-batch, and the data-parallel reduction joins
every replica once a step. So the step's GPU-bound time (everything but its exposed communication) runs at
the pace of the slowest of the job's GPUs.

A GPU's speed spread is a coefficient of variation (``Topology.gpu_speed_spread``: sigma / mean of a GPU's
time for the same work, a user's measured figure); the GPUs are taken as independent normal draws, so
the slowest of N is expected at mean x (1 + spread x e(N)), e(N) the expected maximum of N standard normals:
e(2) = 1/sqrt(pi) = 0.564, e(8) = 1.424, e(100) = 2.508 (Tippett 1925), e(1,024) = 3.248, e(16,384) = 3.971.
"""

from __future__ import annotations

import functools
import math

# Exposed communication on the device that ends the step: it does not run slower on a slower GPU.
COMMUNICATION = ("tp", "cp", "ep", "dp", "zero_gather", "zero3_gather")


@functools.cache
def expected_max_standard_normal(n: int) -> float:
    """E[max of n independent standard normals] = integral of x n phi(x) Phi(x)^(n-1) dx, by Simpson's rule
    over [-9, 9] in 6,000 steps (the integrand below 1e-17 outside it for n up to a million)."""
    if n <= 1:
        return 0.0
    steps, low, high = 6000, -9.0, 9.0
    width = (high - low) / steps
    total = 0.0
    for i in range(steps + 1):
        x = low + i * width
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        value = x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * cdf ** (n - 1)
        total += value * (1 if i in (0, steps) else 4 if i % 2 else 2)
    return total * width / 3


def gpu_bound_ns(step_ns: float, exposed_ns: dict[str, float]) -> float:
    """The step's time that a slower GPU stretches: all of it but its exposed communication."""
    return max(step_ns - sum(exposed_ns.get(kind, 0.0) for kind in COMMUNICATION), 0.0)


def slowest_step_ns(step_ns: float, exposed_ns: dict[str, float], gpus: int, spread: float) -> float:
    """The step at the pace of the slowest of ``gpus`` GPUs whose speeds spread by ``spread`` (sigma / mean)."""
    return step_ns + gpu_bound_ns(step_ns, exposed_ns) * spread * expected_max_standard_normal(gpus)
