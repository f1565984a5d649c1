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
