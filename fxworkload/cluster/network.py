"""Collective and point-to-point times from NCCL's own cost model (Simple protocol, ring and tree).

NCCL picks an algorithm per call from a table of latency + bytes / bandwidth (src/graph/tuning.cc,
ncclTopoTuneModel and ncclTopoGetAlgoTime); for the large buffers of training (MiB and up) the
protocol is Simple, and the figures here are that protocol's in the current table (NCCL 2.2x):
- ring: latency = baseLat + (steps - inter-node steps) x NVLink hop + inter-node steps x network
  hop, with steps = 2(n-1) for all-reduce, n-1 for all-gather and reduce-scatter, n for
  all-to-all, and inter-node steps the same counts over nodes; bandwidth: the bus bandwidth of
  the slowest link the ring crosses (NVLink inside a node; across nodes, the network share of the
  group's ranks on a node: see below) times n / steps;
- tree (all-reduce only, as in NCCL): latency = baseLat + 2((n/nodes - 1) x NVLink hop + log2(nodes)
  x network hop), bandwidth 0.92 x the bus bandwidth x 1/2 (a reduce up and a broadcast down);
- an all-reduce takes the faster of the two, as NCCL's tuner does: the tree once a group spans
  enough nodes that the ring's linear latency outweighs the tree's 8 % less bandwidth.

Across nodes, NCCL runs one ring (or tree) per channel and spreads its channels over the NICs near
the group's GPUs (rail-optimised HGX/DGX systems give each GPU its own NIC; PXN lets a GPU use a
rail's NIC through NVLink): a group with r ranks on each node moves its data through r GPUs' NICs.
Every group of a layout runs its collective at the same time (each tensor-parallel rank has its own
data-parallel group), so the node's network is shared in proportion to the GPUs: a group gets r x
``inter_node_bytes_per_s`` (one GPU's share of the node's NICs), capped by NVLink. A data-parallel
group of 64 ranks over 8 nodes at tp 1 therefore moves 8 GPUs' share (400 GB/s on a DGX H100's eight
400 Gb/s ports, under NVLink's 450), while at tp 8 each of its ranks is alone on its node (50 GB/s).

Ranks are placed as Megatron-LM orders them (its default order "tp-cp-ep-dp-pp"): tensor-parallel
innermost, then context-parallel, then data-parallel (expert-parallel carved out of it), pipeline
outermost; a group's GPUs span consecutive nodes. Gradients are reduced over the data- and
context-parallel ranks together (group "dp": dp x cp ranks).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..cost.devices import DeviceProfile
from ..errors import UserError
from ..memo import Memo
from ..parallel.layout import Parallel

if TYPE_CHECKING:  # a type only: the units import torch, and plan's "why" reads this module without it
    from ..parallel.units import Comm

# NVIDIA/nccl src/graph/tuning.cc, Simple protocol: baseLat and hwLat (NVLink, network), in µs there.
BASE_LATENCY_NS = 8_400.0
NVLINK_HOP_NS = 3_400.0
NETWORK_HOP_NS = 14_000.0
TREE_NVLINK_HOP_NS = 4_000.0
TREE_NETWORK_HOP_NS = 14_000.0
TREE_BUS_EFFICIENCY = 0.92  # "busBw*.92" for tree all-reduce
STEPS = {"ALLREDUCE": lambda n: 2 * (n - 1), "ALLGATHER": lambda n: n - 1, "REDUCESCATTER": lambda n: n - 1,
         "ALLTOALL": lambda n: n}


def group_layout(group: str, p: Parallel, gpus_per_node: int) -> tuple[int, int]:
    """(ranks, nodes holding them) of a tensor-, expert- or data-parallel group under Megatron's rank order."""
    if group == "tp":
        ranks, stride = p.tp, 1
    elif group == "dp":
        ranks, stride = p.replicas, p.tp
    elif group == "cp":
        ranks, stride = p.cp, p.tp
    elif group == "ep":
        ranks, stride = p.ep, p.tp * p.cp
    elif group == "dp_ep":
        ranks, stride = p.dp // p.ep, p.tp * p.cp * p.ep
    else:
        raise KeyError(group)
    if stride >= gpus_per_node:  # each rank on a node of its own (the nodes between hold other groups)
        return ranks, ranks
    return ranks, max(1, math.ceil(ranks * stride / gpus_per_node))


def collective_ns(comm_type: str, nbytes: float, ranks: int, nodes: int, device: DeviceProfile) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    ring = ring_ns(comm_type, nbytes, ranks, nodes, device)
    return min(ring, tree_all_reduce_ns(nbytes, ranks, nodes, device)) if comm_type == "ALLREDUCE" else ring


def bus_bytes_per_s(ranks: int, nodes: int, device: DeviceProfile) -> float:
    """A group's bus bandwidth: NVLink inside a node; across nodes, its ranks per node times one GPU's share
    of the node's network, capped by NVLink (the module's docstring)."""
    if nodes == 1:
        return device.intra_node_bytes_per_s
    per_node = max(1, ranks // nodes)
    return min(device.intra_node_bytes_per_s, per_node * device.inter_node_bytes_per_s)


def ring_ns(comm_type: str, nbytes: float, ranks: int, nodes: int, device: DeviceProfile) -> float:
    steps = STEPS[comm_type](ranks)
    inter_steps = STEPS[comm_type](nodes) if nodes > 1 else 0
    latency = BASE_LATENCY_NS + (steps - inter_steps) * NVLINK_HOP_NS + inter_steps * NETWORK_HOP_NS
    return latency + nbytes / (bus_bytes_per_s(ranks, nodes, device) * ranks / steps) * 1e9


def tree_all_reduce_ns(nbytes: float, ranks: int, nodes: int, device: DeviceProfile) -> float:
    per_node = ranks // nodes
    latency = BASE_LATENCY_NS + 2 * ((per_node - 1) * TREE_NVLINK_HOP_NS
                                     + int(math.log2(nodes)) * TREE_NETWORK_HOP_NS)
    return latency + nbytes / (bus_bytes_per_s(ranks, nodes, device) * TREE_BUS_EFFICIENCY / 2) * 1e9


def comm_ns(comm: Comm, p: Parallel, device: DeviceProfile) -> float:
    ranks, nodes = group_layout(comm.group, p, device.gpus_per_node)
    return _TIMES.get((comm.type, comm.bytes, ranks, nodes, id(device)), (device,), collective_ns, comm.type,
                      comm.bytes, ranks, nodes, device)  # no closure per call: asked ~a million times a search


# a layout search times the same collective (a gradient bucket, a layer's all-gather) on the same group
# shape many times
_TIMES = Memo(1 << 16)


def p2p_ns(nbytes: float, p: Parallel, device: DeviceProfile) -> float:
    """One activation (or its gradient) sent to the next pipeline stage: tp x cp x dp GPUs away."""
    if p.pp == 1 or nbytes <= 0:
        return 0.0
    same_node = p.tp * p.cp * p.dp * 2 <= device.gpus_per_node
    hop = NVLINK_HOP_NS if same_node else NETWORK_HOP_NS
    bus = device.intra_node_bytes_per_s if same_node else device.inter_node_bytes_per_s
    return BASE_LATENCY_NS + hop + nbytes / bus * 1e9


def check_device(device: DeviceProfile, parallel: Parallel) -> None:
    """Collective times need the interconnect's figures; a rank with no collective needs none."""
    if parallel.world > parallel.pp and not (device.intra_node_bytes_per_s and device.inter_node_bytes_per_s):
        raise UserError(f"device '{device.name}' has no interconnect figures (intra_node_bytes_per_s, "
                        "inter_node_bytes_per_s) for the collectives of --tp/--dp > 1; add them to its profile "
                        "or use a datasheet profile such as --device h100-sxm for --format chrome-trace")
