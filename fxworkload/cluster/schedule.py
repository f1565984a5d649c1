"""Megatron-LM's pipeline schedules, simulated: 1F1B and interleaved 1F1B (virtual stages).

Each device runs its forward (F) and backward (B) passes in the order Megatron-LM issues them
(megatron/core/pipeline_parallel/schedules.py): warm-up forwards, then one forward and one
backward in turn, then the remaining backwards. With v virtual stages a device holds v model
chunks; virtual stage c·pp + d is chunk c of device d, and micro-batches go through the chunks in
groups of pp. A pass starts when its device is free and its input has arrived: a forward needs
the previous virtual stage's forward of the same micro-batch, a backward the next virtual stage's
backward (the last one its own forward), each plus the point-to-point transfer between devices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Pass:
    device: int
    kind: str  # F or B
    chunk: int
    micro_batch: int
    start_ns: float
    end_ns: float


@functools.lru_cache(maxsize=4096)
def device_order(pp: int, vpp: int, micro_batches: int, device: int) -> tuple[tuple[str, int, int], ...]:
    """(kind, chunk, micro-batch) in the order Megatron-LM runs them on ``device``."""
    total = micro_batches * vpp
    if vpp == 1:
        warmup = min(pp - device - 1, micro_batches)
    else:
        warmup = min((pp - device - 1) * 2 + (vpp - 1) * pp, total)

    def which(k: int, forward: bool) -> tuple[int, int]:
        in_group = k % (pp * vpp)
        chunk = in_group // pp
        micro_batch = (k // (pp * vpp)) * pp + in_group % pp
        return (chunk if forward else vpp - 1 - chunk), micro_batch

    order = [(FORWARD, *which(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order.append((FORWARD, *which(warmup + k, True)))
        order.append((BACKWARD, *which(k, False)))
    order += [(BACKWARD, *which(k, False)) for k in range(total - warmup, total)]
    return tuple(order)


def simulate(pp: int, vpp: int, micro_batches: int, forward_ns, backward_ns, transfer_ns: float) -> list[Pass]:
    """forward_ns[device][chunk], backward_ns[device][chunk]: one micro-batch's pass times."""
    return [Pass(d, *entry) for d, timeline in enumerate(timelines(pp, vpp, micro_batches, forward_ns, backward_ns,
                                                                    transfer_ns)) for entry in timeline]


def timelines(pp: int, vpp: int, micro_batches: int, forward_ns, backward_ns, transfer_ns: float) -> list[list[tuple]]:
    """Per device, its passes in order as (kind, chunk, micro-batch, start_ns, end_ns). A layout search
    asks for the same schedule many times (layouts that differ only in ZeRO or the data-parallel side):
    each is simulated once; the lists returned are not to be changed."""
    return _timelines(pp, vpp, micro_batches, tuple(map(tuple, forward_ns)), tuple(map(tuple, backward_ns)),
                      transfer_ns)


@functools.lru_cache(maxsize=1024)
def _timelines(pp: int, vpp: int, micro_batches: int, forward_ns: tuple, backward_ns: tuple,
               transfer_ns: float) -> list[list[tuple]]:
    """One sweep over the passes in an order where each comes after what it waits for (``_order``: the
    same for every pass time), so each start is known when it is reached."""
    durations = [ns for times in (forward_ns, backward_ns) for per_device in times for ns in per_device]
    ends = [0.0] * (pp * micro_batches * vpp * 2)
    free = [0.0] * pp
    out: list[list[tuple]] = [[] for _ in range(pp)]
    for i, (d, after, moved, slot, entry) in enumerate(_order(pp, vpp, micro_batches)):
        ready = 0.0 if after < 0 else ends[after] + (transfer_ns if moved else 0.0)
        start = free[d] if free[d] > ready else ready
        free[d] = ends[i] = end = start + durations[slot]
        out[d].append((*entry, start, end))
    return out


@functools.lru_cache(maxsize=256)
def _order(pp: int, vpp: int, micro_batches: int) -> tuple[tuple[int, int, bool, int, tuple], ...]:
    """Every pass as (device, the index of the pass it waits for or -1, whether that pass's output crosses
    devices, its time's index in forward then backward [device][chunk], (kind, chunk, micro-batch)), in
    the order Megatron's devices can run them: each device in its own order, a pass taken once what it
    waits for is placed."""
    orders = [device_order(pp, vpp, micro_batches, d) for d in range(pp)]
    last = pp * vpp - 1
    placed: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro-batch) -> index
    at = [0] * pp
    out: list[tuple] = []
    while len(out) < sum(map(len, orders)):
        progressed = False
        for d in range(pp):
            while at[d] < len(orders[d]):
                kind, chunk, mb = entry = orders[d][at[d]]
                stage = chunk * pp + d
                if kind == FORWARD:
                    waits, moved = ((FORWARD, stage - 1, mb), True) if stage else (None, False)
                elif stage == last:
                    waits, moved = (FORWARD, stage, mb), False
                else:
                    waits, moved = (BACKWARD, stage + 1, mb), True
                if waits is not None and waits not in placed:
                    break
                placed[(kind, stage, mb)] = len(out)
                slot = (0 if kind == FORWARD else pp * vpp) + d * vpp + chunk
                out.append((d, placed[waits] if waits else -1, moved, slot, entry))
                at[d] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # Megatron's orders never do
    return tuple(out)
