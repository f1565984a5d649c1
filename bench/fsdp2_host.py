"""What FSDP2's hooks cost the host per unit (issue 38: "the CPU-side cost per module where it can outpace the
GPU"): the figures behind ``cluster/zero3.py``'s ``HOOK_US``.

    .venv/bin/python bench/fsdp2_host.py            # 2.5 min on a 2-core machine; run it idle

FSDP2 (``torch.distributed.fsdp.fully_shard``) runs Python around every unit it wraps: before a unit's forward
it all-gathers the unit's parameters and swaps the unsharded ones in (``FSDPParamGroup.pre_forward``: unshard,
copy-out, one ``setattr`` per parameter, the post-backward hook's registration), after it swaps the sharded ones
back (``post_forward``); in backward the same gather (``pre_backward``), then ``post_backward``: the gradients'
copy-in, the reduce-scatter, a sharded gradient DTensor per parameter. On a GPU those run on the host while the
GPU works through what was issued before: they cost the step only where the host is already the slower.

Measured on this machine's CPU in one process, on torch's fake process group (world size 2: every parameter
really sharded in two, every collective issued and returning at once, so no collective's own time is in it), a
stack of 32 tiny units, each a Llama decoder layer's 9 parameters (and units of two such layers, 18, for the cost
per parameter): the median eager forward, and forward and backward, with and without ``fully_shard`` on each unit
(and on the stack, as torchtitan wraps the root); their difference over the 32 units is the hooks' cost (the root's
own share of it, once a step, spread over them). Three runs, their medians. Not in it: the CUDA driver's launch of
the few kernels and collectives the hooks issue (a few microseconds each).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN = 8
UNITS = 32
REPEATS = 200  # steps timed; the first 20 are left out
RUNS = 3


class Layer(nn.Module):
    """A Llama decoder layer's parameters (two norms; q, k, v, o; gate, up, down), tiny."""

    def __init__(self) -> None:
        super().__init__()
        h = HIDDEN
        self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.g, self.u = nn.Linear(h, 2 * h, bias=False), nn.Linear(h, 2 * h, bias=False)
        self.d = nn.Linear(2 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.n1(x)
        x = x + self.o(self.q(y) + self.k(y) + self.v(y))
        y = self.n2(x)
        return x + self.d(nn.functional.silu(self.g(y)) * self.u(y))


def stack(layers_a_unit: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(*[Layer() for _ in range(layers_a_unit)]) for _ in range(UNITS)])


def median_s(fn) -> float:
    times = []
    gc.disable()  # a collection inside one step would be charged to whichever variant it fell in
    try:
        for _ in range(REPEATS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times[20:])


def step_times(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(forward, forward and backward) medians, s."""
    forward = median_s(lambda: model(x))
    step = median_s(lambda: model(x).sum().backward())
    return forward, step


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(layers_a_unit: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(1, 4, HIDDEN)
    plain = stack(layers_a_unit)
    with Count() as count:
        plain(x).sum().backward()
    plain_forward, plain_step = step_times(plain, x)
    op_s = plain_step / count.ops
    sharded = stack(layers_a_unit)
    for unit in sharded:
        torch.distributed.fsdp.fully_shard(unit)
    torch.distributed.fsdp.fully_shard(sharded)
    fsdp_forward, fsdp_step = step_times(sharded, x)
    forward_s = (fsdp_forward - plain_forward) / UNITS
    backward_s = (fsdp_step - fsdp_forward - (plain_step - plain_forward)) / UNITS
    return {"op_us": op_s * 1e6, "forward_hooks_us": forward_s * 1e6, "backward_hooks_us": backward_s * 1e6}


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    # torch's fake process group: every collective returns at once, so what is timed is FSDP2's Python, the
    # collectives' issue and the ops it runs (at world size 2 each parameter is really sharded in two)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        runs = [[measure(n) for n in (1, 2)] for _ in range(RUNS)]
    finally:
        dist.destroy_process_group()
    print(f"load {os.getloadavg()[0]:.2f}; torch {torch.__version__}; {RUNS} runs, medians")
    figures = {}
    for pass_ in ("forward", "backward"):
        one = statistics.median(run[0][f"{pass_}_hooks_us"] for run in runs)
        two = statistics.median(run[1][f"{pass_}_hooks_us"] for run in runs)
        per_parameter = (two - one) / 9
        figures[pass_] = {"fixed_us": round(one - 9 * per_parameter, 1), "per_parameter_us": round(per_parameter, 1)}
        print(f"{pass_}: {one:.0f} us a unit of 9 parameters, {two:.0f} us of 18: {one - 9 * per_parameter:.0f} us "
              f"+ {per_parameter:.1f} us a parameter")
    op_us = statistics.median(run[0]["op_us"] for run in runs)
    print(f"beside: an aten op of the plain step {op_us:.2f} us")
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(main())
