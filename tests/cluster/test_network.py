"""Collective times: NCCL's Simple-protocol ring and tree cost model (src/graph/tuning.cc), by hand."""

from __future__ import annotations

import pytest

from fxworkload.cluster.network import collective_ns, group_layout, p2p_ns
from fxworkload.cost import devices
from fxworkload.parallel.layout import Parallel


def test_all_reduce_inside_a_node_by_hand():
    h100 = devices.load("h100-sxm")
    nbytes = 1 << 30
    # 8 ranks: 14 steps of 3.4 us on NVLink after the 8.4 us base; bus bandwidth x 8 / 14. The tree
    # (a chain inside a node: 8.4 + 2 x 7 x 4.0 us, bandwidth x 0.92 / 2) is slower: the ring is taken.
    expected = 8_400 + 14 * 3_400 + nbytes / (h100.intra_node_bytes_per_s * 8 / 14) * 1e9
    assert collective_ns("ALLREDUCE", nbytes, 8, 1, h100) == pytest.approx(expected)


def test_an_all_reduce_over_many_nodes_takes_the_tree():
    """256 ranks, one per node (a data-parallel group under TP 8), 16 MiB. Ring: 510 network steps
    of 14 us; tree: 2 x log2(256) = 16 of them, at 0.92 / 2 of the bus bandwidth. By hand."""
    h100 = devices.load("h100-sxm")
    nbytes, bus = 16 << 20, h100.inter_node_bytes_per_s
    ring = 8_400 + 510 * 14_000 + nbytes / (bus * 256 / 510) * 1e9
    tree = 8_400 + 2 * 8 * 14_000 + nbytes / (bus * 0.92 / 2) * 1e9
    assert tree < ring and collective_ns("ALLREDUCE", nbytes, 256, 256, h100) == pytest.approx(tree)
    # an all-gather has no tree in NCCL: the ring, whatever it costs
    assert collective_ns("ALLGATHER", nbytes, 256, 256, h100) == pytest.approx(
        8_400 + 255 * 14_000 + nbytes / (bus * 256 / 255) * 1e9)


def test_all_gather_across_nodes_by_hand():
    h100 = devices.load("h100-sxm")
    nbytes = 256 << 20
    # 64 ranks on 8 nodes: 63 steps, 7 of them between nodes; 8 ranks a node move their data through 8 GPUs'
    # NICs (DGX H100: eight 400 Gb/s ports, 50 GB/s each): 400 GB/s, under NVLink's 450
    expected = 8_400 + 56 * 3_400 + 7 * 14_000 + nbytes / (400e9 * 64 / 63) * 1e9
    assert collective_ns("ALLGATHER", nbytes, 64, 8, h100) == pytest.approx(expected)
    assert collective_ns("ALLGATHER", nbytes, 1, 1, h100) == 0.0


@pytest.mark.parametrize("tp, dp, per_node, bus", [
    (1, 64, 8, 400e9),  # 8 ranks a node: 8 x 50 GB/s
    (2, 32, 4, 200e9),  # 4 ranks a node (the other 4 NIC shares carry the other tp rank's group, at the same time)
    (4, 16, 2, 100e9),
    (8, 8, 1, 50e9),  # one rank a node: its own NIC
])
def test_a_group_across_nodes_moves_through_its_ranks_nics(tp, dp, per_node, bus):
    """The data-parallel group of 64 GPUs: its ranks per node under Megatron's order, each with one GPU's share
    of the node's network (DGX H100 datasheet: eight ConnectX-7 400 Gb/s = 50 GB/s each), by hand."""
    from fxworkload.cluster.network import bus_bytes_per_s

    h100 = devices.load("h100-sxm")
    ranks, nodes = group_layout("dp", Parallel(tp=tp, dp=dp), 8)
    assert (ranks, ranks // nodes) == (dp, per_node)
    assert bus_bytes_per_s(ranks, nodes, h100) == pytest.approx(bus)
    nbytes = 1 << 30
    steps, inter = dp - 1, nodes - 1
    assert collective_ns("ALLGATHER", nbytes, ranks, nodes, h100) == pytest.approx(
        8_400 + (steps - inter) * 3_400 + inter * 14_000 + nbytes / (bus * dp / steps) * 1e9)


def test_an_nvlink_domain_of_72_caps_the_network_at_nvlink():
    """GB200 NVL72: 72 GPUs a node (one NVLink domain, 900 GB/s each way); 72 ranks a node x 100 GB/s of
    network exceed NVLink, so a group over two domains runs at NVLink's 900 GB/s."""
    from fxworkload.cluster.network import bus_bytes_per_s

    gb200 = devices.load("gb200")
    ranks, nodes = group_layout("dp", Parallel(dp=144), gb200.gpus_per_node)
    assert (ranks, nodes) == (144, 2) and bus_bytes_per_s(ranks, nodes, gb200) == pytest.approx(900e9)


def test_megatron_rank_order_places_groups():
    p = Parallel(tp=8, dp=16, pp=4, ep=4)
    assert group_layout("tp", p, 8) == (8, 1)  # one node
    assert group_layout("dp", p, 8) == (16, 16)  # stride 8: a rank on each of 16 nodes
    assert group_layout("ep", p, 8) == (4, 4)
    assert group_layout("dp_ep", p, 8) == (4, 4)  # stride 32: 4 ranks, each on its own node, 4 nodes apart
    assert group_layout("tp", Parallel(tp=2, dp=4), 8) == (2, 1)
    assert group_layout("dp", Parallel(tp=2, dp=4), 8) == (4, 1)  # 8 GPUs: one node


def test_pipeline_transfer():
    h100 = devices.load("h100-sxm")
    assert p2p_ns(1 << 20, Parallel(pp=1), h100) == 0.0
    across = p2p_ns(1 << 20, Parallel(tp=8, pp=2), h100)
    assert across == pytest.approx(8_400 + 14_000 + (1 << 20) / h100.inter_node_bytes_per_s * 1e9)
    inside = p2p_ns(1 << 20, Parallel(tp=2, pp=2), h100)
    assert inside == pytest.approx(8_400 + 3_400 + (1 << 20) / h100.intra_node_bytes_per_s * 1e9)
