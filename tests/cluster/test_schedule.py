"""Pipeline schedules against the published formulas (Narayanan et al. 2021, section 2.2)."""

from __future__ import annotations

import pytest

from fxworkload.cluster.schedule import BACKWARD, FORWARD, device_order, simulate


@pytest.mark.parametrize("pp, m", [(2, 2), (4, 8), (8, 16), (3, 7)])
def test_1f1b_takes_m_plus_p_minus_1_passes(pp, m):
    """With uniform passes and free transfers, 1F1B's step is (m + p - 1)(tf + tb)."""
    tf, tb = 1.0, 2.0
    passes = simulate(pp, 1, m, [[tf]] * pp, [[tb]] * pp, 0.0)
    assert max(p.end_ns for p in passes) == pytest.approx((m + pp - 1) * (tf + tb))
    assert len(passes) == 2 * pp * m


@pytest.mark.parametrize("pp, v, m", [(4, 2, 8), (4, 4, 8), (2, 3, 4), (8, 2, 16)])
def test_interleaving_divides_the_bubble_by_v(pp, v, m):
    """Each device holds v chunks of 1/v the work: bubble (p - 1)(tf + tb) / v."""
    tf, tb = 1.0, 2.0
    passes = simulate(pp, v, m, [[tf / v] * v] * pp, [[tb / v] * v] * pp, 0.0)
    assert max(p.end_ns for p in passes) == pytest.approx(m * (tf + tb) + (pp - 1) * (tf + tb) / v)


def test_megatron_order_by_hand():
    """1F1B on the first of 4 devices with 6 micro-batches: 3 warm-up forwards, then alternate."""
    order = device_order(4, 1, 6, 0)
    assert [(k, mb) for k, _, mb in order] == [
        (FORWARD, 0), (FORWARD, 1), (FORWARD, 2), (FORWARD, 3), (BACKWARD, 0), (FORWARD, 4), (BACKWARD, 1),
        (FORWARD, 5), (BACKWARD, 2), (BACKWARD, 3), (BACKWARD, 4), (BACKWARD, 5)]
    # Interleaved, 2 devices x 2 chunks, 4 micro-batches: groups of pp micro-batches per chunk.
    order = device_order(2, 2, 4, 0)
    warmup = [(k, c, mb) for k, c, mb in order[:4]]
    assert warmup == [(FORWARD, 0, 0), (FORWARD, 0, 1), (FORWARD, 1, 0), (FORWARD, 1, 1)]
    assert order[5] == (BACKWARD, 1, 0)  # the first backward runs the last chunk


def test_transfers_delay_each_boundary():
    """One micro-batch through p stages: p forwards, p backwards and 2(p - 1) transfers in a row."""
    pp, transfer = 4, 0.5
    passes = simulate(pp, 1, 1, [[1.0]] * pp, [[1.0]] * pp, transfer)
    assert max(p.end_ns for p in passes) == pytest.approx(2 * pp + 2 * (pp - 1) * transfer)



def _event_timeline(pp, v, m, forward_ns, backward_ns, transfer_ns):
    """The oracle: a discrete-event simulation in time order. Of the devices whose next pass (in Megatron's
    order) has its input, the one that can start earliest runs it; its output reaches the next pass
    (the next virtual stage's forward, the previous one's backward) a transfer later, the last stage's
    forward its own backward at once."""
    orders = [device_order(pp, v, m, d) for d in range(pp)]
    last = pp * v - 1
    ready = {(FORWARD, 0, mb): 0.0 for mb in range(m)}  # (kind, virtual stage, micro-batch) -> input there
    at, free, out = [0] * pp, [0.0] * pp, {}
    while any(at[d] < len(orders[d]) for d in range(pp)):
        startable = []
        for d in range(pp):
            if at[d] < len(orders[d]):
                kind, chunk, mb = orders[d][at[d]]
                if (kind, chunk * pp + d, mb) in ready:
                    startable.append((max(free[d], ready[(kind, chunk * pp + d, mb)]), d))
        start, d = min(startable)
        kind, chunk, mb = orders[d][at[d]]
        stage = chunk * pp + d
        end = start + (forward_ns if kind == FORWARD else backward_ns)[d][chunk]
        out[(d, kind, chunk, mb)] = (start, end)
        at[d], free[d] = at[d] + 1, end
        if kind == FORWARD:
            ready[(FORWARD, stage + 1, mb) if stage < last else (BACKWARD, stage, mb)] = end + (
                transfer_ns if stage < last else 0.0)
        elif stage > 0:
            ready[(BACKWARD, stage - 1, mb)] = end + transfer_ns
    return out


@pytest.mark.parametrize("pp, v, m", [(2, 1, 5), (4, 1, 8), (3, 1, 2), (4, 2, 8), (2, 4, 6), (8, 2, 16), (5, 3, 10)])
def test_the_sweep_matches_an_event_simulation(pp, v, m):
    """Uneven pass times per device and chunk, and a transfer: every pass starts and ends when a discrete-event
    simulation taking passes in time order has it, though the sweep (schedule.py) never orders them by time."""
    import random

    rng = random.Random(pp * 100 + v * 10 + m)
    forward = [[rng.uniform(0.5, 2.0) for _ in range(v)] for _ in range(pp)]
    backward = [[rng.uniform(1.0, 4.0) for _ in range(v)] for _ in range(pp)]
    ours = {(p.device, p.kind, p.chunk, p.micro_batch): (p.start_ns, p.end_ns)
            for p in simulate(pp, v, m, forward, backward, 0.3)}
    oracle = _event_timeline(pp, v, m, forward, backward, 0.3)
    assert ours.keys() == oracle.keys()
    for key, times in oracle.items():
        assert ours[key] == pytest.approx(times), key
