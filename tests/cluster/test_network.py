"""Collective times: NCCL's tuner (src/graph/tuning.cc: its latency table, its algorithms and protocols,
the fastest pair per call) on the device's topology, checked by hand and against published nccl-tests."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from fxworkload.cluster.network import (NIC_EFFICIENCY, SIMPLE_LINK_EFFICIENCY, _candidates, bus_bytes_per_s, choose,
                                        collective_ns, group_layout, p2p_ns)
from fxworkload.cost import devices, topology
from fxworkload.errors import UserError
from fxworkload.parallel.layout import Parallel

NVLINK_EFFECTIVE_H100 = 370e9  # nccl-tests#212: "an effective NVLink bandwidth of 370GB/s" on H100


def test_nvls_all_reduce_inside_an_h100_node_by_hand_and_as_published():
    """NVLS: each GPU moves D (1 + 1/8) bytes over 370 GB/s of NVLink x tuning.cc's Hopper nvlsEfficiency 0.85;
    latency 25 us (hwLat NVLink, NVLS). The busbw nccl-tests prints for it on 8 H100s: ~480 GB/s (NCCL's
    maintainer in nccl-tests#212; 479.4 measured at 8 GiB in nccl-tests#347)."""
    h100 = devices.load("h100-sxm")
    nbytes = 8 << 30
    algorithm_bw = NVLINK_EFFECTIVE_H100 * 0.85 * 8 / 9
    call = choose("ALLREDUCE", nbytes, 8, 1, h100.network())
    assert (call.algorithm, call.protocol) == ("nvls", "Simple")
    assert call.time_ns == pytest.approx(25_000 + nbytes / algorithm_bw * 1e9)
    busbw = nbytes / call.time_ns * 1e9 * 2 * 7 / 8  # nccl-tests' busbw of an all-reduce: algbw x 2(n-1)/n
    assert busbw == pytest.approx(480e9, rel=0.05)


def test_an_a100_node_has_no_nvls_and_runs_the_ring_by_hand():
    """A100's NVSwitch does not reduce: ring, Simple, 8.4 us + 14 NVLink steps of 3.4 us, 300 GB/s x 370/450."""
    a100 = devices.load("a100-80gb")
    nbytes = 1 << 30
    bus = 300e9 * 370 / 450
    call = choose("ALLREDUCE", nbytes, 8, 1, a100.network())
    assert (call.algorithm, call.protocol) == ("ring", "Simple")
    assert call.time_ns == pytest.approx(8_400 + 14 * 3_400 + nbytes / (bus * 8 / 14) * 1e9)


def test_a_small_all_reduce_takes_the_ll_protocol_by_hand():
    """8 KiB on 8 A100s: ring LL, 6.6 us + 14 x 0.6 us, at min(llMaxBw Ampere 87.7 GB/s, bus / 2) x 8 / 14."""
    a100 = devices.load("a100-80gb")
    call = choose("ALLREDUCE", 8192, 8, 1, a100.network())
    assert (call.algorithm, call.protocol) == ("ring", "LL")
    assert call.time_ns == pytest.approx(6_600 + 14 * 600 + 8192 / (87.7e9 * 8 / 14) * 1e9)


def test_every_candidate_obeys_nccls_rules():
    """Which (algorithm, protocol) pairs exist (tuning.cc): tree and NVLS-tree only for all-reduce across
    domains, NVLS only for all-reduce inside one, PAT only for all-gather / reduce-scatter with one rank a domain."""
    h100 = devices.load("h100-sxm").network()
    pairs = lambda *a: {(c.algorithm, c.protocol) for c in _candidates(*a, h100)}  # noqa: E731
    rings = {("ring", p) for p in ("LL", "LL128", "Simple")}
    assert pairs("ALLREDUCE", 1 << 20, 8, 1) == rings | {("nvls", "Simple")}
    assert pairs("ALLREDUCE", 1 << 20, 16, 2) == rings | {("tree", p) for p in ("LL", "LL128", "Simple")} | {
        ("nvls_tree", "Simple")}
    assert pairs("ALLGATHER", 1 << 20, 16, 2) == rings
    assert pairs("REDUCESCATTER", 1 << 20, 16, 16) == rings | {("pat", "Simple")}
    assert collective_ns("ALLREDUCE", 1 << 20, 1, 1, devices.load("h100-sxm")) == 0.0


def test_an_all_reduce_over_many_nodes_takes_the_tree_by_hand():
    """256 ranks, one a node (a data-parallel group under TP 8), 16 MiB. Ring/Simple: 510 steps, 2 x 255 of them
    across nodes at tree's network latency (one rank a node), the rest at the 3 us network overhead, x1.4
    plateau; tree/Simple: 8.4 + 2 x log2(256) x 14 us at 0.92 x 47 GB/s / 2 x tuning.cc's correction for 16 MiB
    (treeCorrectionFactor[Simple][log2(16 MiB / 64) = 18] = 0.7); tree/LL128: 14 + 16 x 8.5 us at 120/128 of
    it x 0.9 (its row's entry 18). The fastest, LL128, is taken."""
    h100 = devices.load("h100-sxm")
    nbytes, nic = 16 << 20, 50e9 * NIC_EFFICIENCY
    ring = 1.4 * (8.4 + 510 * 14.0) * 1e3 + nbytes / (nic * 256 / 510) * 1e9
    tree = (8.4 + 16 * 14.0) * 1e3 + nbytes / (0.92 * nic / 2 * 0.7) * 1e9
    tree_ll128 = (14.0 + 16 * 8.5) * 1e3 + nbytes / (0.92 * nic * 120 / 128 / 2 * 0.9) * 1e9
    assert tree_ll128 < tree < ring
    call = choose("ALLREDUCE", nbytes, 256, 256, h100.network())
    assert (call.algorithm, call.protocol) == ("tree", "LL128") and call.time_ns == pytest.approx(tree_ll128)


def test_pat_takes_a_small_all_gather_with_one_rank_a_node_by_hand():
    """PAT (tuning.cc): 8 us + log2(64) x 14/3.5 us + 64 x 2.8 us, at 3/4 of the ring's 47 GB/s, not converted."""
    h100 = devices.load("h100-sxm")
    nbytes = 1 << 20
    call = choose("ALLGATHER", nbytes, 64, 64, h100.network())
    assert call.algorithm == "pat"
    assert call.time_ns == pytest.approx((8.0 + 6 * 4.0 + 64 * 2.8) * 1e3 + nbytes / (0.75 * 50e9 * NIC_EFFICIENCY) * 1e9)


@pytest.mark.parametrize("tp, dp, per_node, bus", [
    (1, 64, 8, NVLINK_EFFECTIVE_H100),  # 8 NIC shares = 8 x 47 = 376 GB/s, capped by NVLink's 370
    (2, 32, 4, 4 * 47e9),  # 4 ranks a node (the other 4 NIC shares carry the other tp rank's group, at the same time)
    (4, 16, 2, 2 * 47e9),
    (8, 8, 1, 47e9),  # one rank a node: its own NIC
])
def test_a_group_across_nodes_moves_through_its_ranks_nics(tp, dp, per_node, bus):
    """The data-parallel group of 64 GPUs: its ranks per node under Megatron's order, each with one GPU's share
    of the node's network (DGX H100: eight 400 Gb/s NICs; 46-48 GB/s each as NCCL reaches them, nccl-tests#290)."""
    h100 = devices.load("h100-sxm")
    ranks, nodes = group_layout("dp", Parallel(tp=tp, dp=dp), 8)
    assert (ranks, ranks // nodes) == (dp, per_node)
    assert bus_bytes_per_s(ranks, nodes, h100) == pytest.approx(bus)
    nbytes = 1 << 30
    steps, inter = dp - 1, nodes - 1
    # ring/Simple: inside a node the step's latency is at least the 3 us network overhead
    ring = (8.4 + (steps - inter) * 3.4 + inter * 14.0) * 1e3 + nbytes / (bus * dp / steps) * 1e9
    assert collective_ns("ALLGATHER", nbytes, ranks, nodes, h100) <= ring + 1e-6


def test_an_nvlink_domain_of_72_keeps_a_group_on_nvlink():
    """GB200 NVL72: one NVLink domain of 72 GPUs (900 GB/s each way); a group of 144 spans two domains,
    whose 72 NIC shares each (800 Gb/s a GPU) exceed NVLink: the ring runs at NVLink's effective rate."""
    gb200 = devices.load("gb200")
    assert gb200.network().nvlink_domain_gpus == 72
    ranks, nodes = group_layout("dp", Parallel(dp=144), 72)
    assert (ranks, nodes) == (144, 2)
    assert bus_bytes_per_s(ranks, nodes, gb200) == pytest.approx(900e9 * SIMPLE_LINK_EFFICIENCY)


def test_an_oversubscribed_spine_slows_a_group_wider_than_a_leaf():
    """--topology oversubscription=2,leaf-gpus=256: a group over 64 nodes (512 GPUs) crosses the spine at half
    its NIC shares; one over 32 nodes (one leaf) does not."""
    h100 = devices.load("h100-sxm")
    spined = replace(h100, topology=h100.topology | {"leaf_gpus": 256, "oversubscription": 2.0})
    assert bus_bytes_per_s(64, 64, spined) == pytest.approx(47e9 / 2)
    assert bus_bytes_per_s(32, 32, spined) == pytest.approx(47e9)


def test_megatron_rank_order_places_groups():
    p = Parallel(tp=8, dp=16, pp=4, ep=4)
    assert group_layout("tp", p, 8) == (8, 1)  # one node
    assert group_layout("dp", p, 8) == (16, 16)  # stride 8: a rank on each of 16 nodes
    assert group_layout("ep", p, 8) == (4, 4)
    assert group_layout("dp_ep", p, 8) == (4, 4)  # stride 32: 4 ranks, each on its own node, 4 nodes apart
    assert group_layout("tp", Parallel(tp=2, dp=4), 8) == (2, 1)
    assert group_layout("dp", Parallel(tp=2, dp=4), 8) == (4, 1)  # 8 GPUs: one node


def test_all_to_all_crosses_nodes_at_each_gpus_own_nic_by_hand():
    """64 ranks on 8 nodes: each sends 56/64 of its buffer off-node through its own 47 GB/s NIC (an all-to-all
    cannot aggregate NICs) and 7/64 over NVLink at once; 8.4 + 14 us of latency."""
    h100 = devices.load("h100-sxm")
    nbytes = 256 << 20
    expected = (8.4 + 14.0) * 1e3 + nbytes * 56 / 64 / 47e9 * 1e9
    assert collective_ns("ALLTOALL", nbytes, 64, 8, h100) == pytest.approx(expected)


def test_deepep_runs_at_the_busier_links_share_of_line_rate_by_hand():
    """By hand: DeepSeek-V3's routing (256 experts, top 8) for 4,096 tokens of hidden 7,168 in bf16 (58.7 MB a copy).
    EP 8 in one node: a token reaches 8 x (1 - C(224, 8) / C(256, 8)) ranks, 7/8 of them over NVLink at 153/200 of
    its 450 GB/s. EP 16 on two nodes: over RDMA once per node it reaches (2 x (1 - C(128, 8) / C(256, 8))), half
    of them the other node, at 43/50 of the NIC's 50 GB/s; the NVLink side is the lighter."""
    from fxworkload.cluster.network import deepep_ns

    h100 = devices.load("h100-sxm")
    token_bytes = 4096 * 7168 * 2
    ranks8 = 8 * (1 - math.comb(224, 8) / math.comb(256, 8))
    expected = (8.4 + 3.4) * 1e3 + token_bytes * ranks8 * 7 / 8 / (450e9 * 153 / 200) * 1e9
    assert deepep_ns((token_bytes, 256, 8), 8, 1, h100) == pytest.approx(expected)
    nodes2 = 2 * (1 - math.comb(128, 8) / math.comb(256, 8))
    expected = (8.4 + 14.0) * 1e3 + token_bytes * nodes2 / 2 / (50e9 * 43 / 50) * 1e9
    assert deepep_ns((token_bytes, 256, 8), 16, 2, h100) == pytest.approx(expected)


def test_pipeline_transfer():
    h100 = devices.load("h100-sxm")
    assert p2p_ns(1 << 20, Parallel(pp=1), h100) == 0.0
    across = p2p_ns(1 << 20, Parallel(tp=8, pp=2), h100)
    assert across == pytest.approx(8_400 + 14_000 + (1 << 20) / 47e9 * 1e9)
    inside = p2p_ns(1 << 20, Parallel(tp=2, pp=2), h100)
    assert inside == pytest.approx(8_400 + 3_400 + (1 << 20) / NVLINK_EFFECTIVE_H100 * 1e9)


def test_topology_option_reads_key_value_pairs():
    base = devices.load("h100-sxm").network()
    changed = topology.parse("nic-gbps=200,nics-per-node=4,oversubscription=3,leaf-gpus=128,nvlink-sharp=off", base)
    assert changed.nic_bytes_per_s == 25e9 and changed.nics_per_node == 4 and changed.nic_share_bytes_per_s == 12.5e9
    assert (changed.oversubscription, changed.leaf_gpus, changed.nvlink_sharp) == (3.0, 128, False)
    assert changed.nvlink_domain_gpus == base.nvlink_domain_gpus


@pytest.mark.parametrize("text, says", [
    ("nic-gbps", "key=value"), ("speed=4", "key=value"), ("nic-gbps=fast", "not a number"),
    ("nvlink-domain=0", "1 or more"), ("oversubscription=0.5", "1 (non-blocking) or more"),
    ("nvlink-sharp=yes", "on or off"), (",", "names nothing"), ("nic-gbps=nan", "finite"),
])
def test_topology_option_refuses_bad_values(text, says):
    with pytest.raises(UserError, match=re.escape(says)):
        topology.parse(text, devices.load("h100-sxm").network())


def test_every_shipped_profile_has_a_sane_topology_with_sources():
    for name in devices.names():
        if name == "cpu":
            continue
        profile = devices.load(name)
        assert topology.check(profile.network()) is None, name
        for key in profile.topology:
            assert f"topology.{key}" in profile.sources, (name, key)
    assert math.isclose(devices.load("h100-sxm").network().nic_share_bytes_per_s, 50e9)
