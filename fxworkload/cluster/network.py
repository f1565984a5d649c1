"""Collective and point-to-point times as NCCL runs them: its algorithms and protocols, chosen per call by
its own tuner, on the network the device's topology describes (cost/topology.py).

NCCL times every (algorithm, protocol) pair a call could use as latency + bytes / bandwidth and runs the
fastest (src/graph/tuning.cc: ncclTopoTuneModel, ncclTopoGetAlgoTime; NVIDIA/nccl at 5067397, 2026). Here,
with NCCL's own latency table and its rules for which pairs exist:
- ring (every collective) with the LL, LL128 and Simple protocols;
- tree (all-reduce across NVLink domains), with tuning.cc's size correction;
- NVLS (all-reduce inside an NVLink domain whose NVSwitches reduce: NVLink SHARP) and NVLS-tree
  (NVLS inside each domain, a tree between them);
- PAT (all-gather and reduce-scatter with one rank per domain: logarithmic latency, 3/4 of the ring's
  bandwidth).
Bandwidths are what nccl-tests reports as bus bandwidth, from the links the call crosses:
- inside an NVLink domain, the GPU's NVLink x ``SIMPLE_LINK_EFFICIENCY`` (370 of 450 GB/s on H100: NCCL's
  protocol overhead, as its maintainers give it);
- across domains, the group's ranks per domain x one GPU's share of the node's NICs x ``NIC_EFFICIENCY``
  (46-48 of 50 GB/s per 400 Gb/s NIC), divided by the fabric's oversubscription once the group is wider
  than a leaf, and capped by NVLink: NCCL runs one ring per channel and spreads its channels over the NICs
  near the group's GPUs (rail-optimised nodes give each GPU its own NIC; PXN lets a GPU use another rail's
  NIC through NVLink). Every group of a layout runs at once (each tensor-parallel rank has its own
  data-parallel group), so a group with r ranks a node gets r GPUs' shares of the node's network;
- NVLS moves D (1 + 1/n) bytes a GPU for an n-rank all-reduce of D bytes (multimem load-reduce of its
  1/n, multimem store of it back), at NVLink x the Simple efficiency x tuning.cc's nvlsEfficiency;
- LL and LL128 at tuning.cc's fractions of Simple's bandwidth (1/2, capped at llMaxBws; 0.92).
An all-to-all is NCCL's grouped send/receive, not a collective algorithm: its cross-domain part runs at
each GPU's own NIC share (an all-to-all cannot aggregate several NICs, as NCCL's maintainers say), its
in-domain part at NVLink.

Ranks are placed as Megatron-LM orders them (its default order "tp-cp-ep-dp-pp"): tensor-parallel
innermost, then context-parallel, then data-parallel (expert-parallel carved out of it), pipeline
outermost; a group's GPUs span consecutive NVLink domains. Gradients are reduced over the data- and
context-parallel ranks together (group "dp": dp x cp ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cost.devices import DeviceProfile
from ..cost.topology import Topology
from ..errors import UserError
from ..memo import Memo
from ..parallel.layout import POST_FORWARD, Parallel

if TYPE_CHECKING:  # a type only: the units import torch, and plan's "why" reads this module without it
    from ..parallel.units import Comm

# NVIDIA/nccl-tests#212 (S. Jeaugey, NCCL): "450GB/s is the line rate. With the protocol overhead (~20%) NCCL
# can get an effective NVLink bandwidth of 370GB/s" on H100.
SIMPLE_LINK_EFFICIENCY = 370 / 450
# NVIDIA/nccl-tests#290 (NCCL team): "For NDR @ 400Gbps you should see 46-48GB/s per NIC"; 47 of 50.
NIC_EFFICIENCY = 47 / 50
# DeepEP's normal kernels against the line rates of the links they run on, as its V1 README measured them
# (docs/legacy.md, DeepSeek-V3's setting: 4,096 tokens, hidden 7,168, top-8 experts, on H800s): intranode dispatch
# at EP 8, 153 GB/s over the H800's NVLink (400 GB/s both ways: 200 GB/s a direction); internode dispatch at
# EP 16 (two nodes), 43 GB/s over a CX7 400 Gb/s NIC (50 GB/s)
DEEPEP_NVLINK_SHARE = 153 / 200
DEEPEP_RDMA_SHARE = 43 / 50
# tuning.cc nvlsEfficiency: Hopper 0.85, Blackwell 0.74 (no NVLS before Hopper)
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}
LL128_FRACTION = 0.92  # tuning.cc: ring LL128 busBw * 0.92 (120/128 bytes carry data)
TREE_FRACTION = 0.92  # tuning.cc: tree all-reduce busBw * .92
PAT_FRACTION = 0.75  # tuning.cc: PAT busBw * .75
# tuning.cc llMaxBws (GB/s) by [one domain: GPU generation; several: CPU (Intel row)][1, 2, more domains]
LL_MAX_ONE_DOMAIN_GBPS = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
LL_MAX_GBPS = {2: 39.0, 3: 20.4}
# tuning.cc ncclTunerConstantsDefaults, in µs: baseLatencies and hwLatencies [NVLink, network]
BASE_US = {"tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4}, "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
           "nvls": {"Simple": 0.0}, "nvls_tree": {"Simple": 0.0}, "pat": {"Simple": 8.0}}
NVLINK_US = {"tree": {"LL": 0.6, "LL128": 1.25, "Simple": 4.0}, "ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
             "nvls": {"Simple": 25.0}, "nvls_tree": {"Simple": 25.0}, "pat": {"Simple": 4.0}}
NETWORK_US = {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 14.0}, "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
              "nvls": {"Simple": 18.0}, "nvls_tree": {"Simple": 20.9}, "pat": {"Simple": 14.0}}
NET_OVERHEAD_US = 1.0  # tuning.cc getNetOverhead (x86 Intel; x3 for Simple), a floor on each ring step's latency
RING_PLATEAU = 1.4  # tuning.cc: multi-node ring/Simple all-reduce latency x1.4 on Ampere and later
# tuning.cc treeCorrectionFactor, Simple protocol: tree all-reduce bandwidth by log2(bytes / 64), 64 B to 256 MiB
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9)
TREE_CORRECTION_LL = (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0,
                      1.0, 1.0)
TREE_CORRECTION_LL128 = (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0,
                         1.0, 1.0)
STEPS = {"ALLREDUCE": lambda n: 2 * (n - 1), "ALLGATHER": lambda n: n - 1, "REDUCESCATTER": lambda n: n - 1}


@dataclass(frozen=True)
class Call:
    """One collective as NCCL would run it: the pair its tuner picks, the time, and nccl-tests' bus bandwidth."""
    algorithm: str
    protocol: str
    time_ns: float
    bus_bytes_per_s: float


def group_layout(group: str, p: Parallel, domain_gpus: int) -> tuple[int, int]:
    """(ranks, NVLink domains holding them) of a tensor-, expert- or data-parallel group under Megatron's rank order."""
    if group == "tp":
        ranks, stride = p.tp, 1
    elif group == "dp":
        ranks, stride = p.replicas, p.tp
    elif group == POST_FORWARD:  # consecutive ranks of the data-parallel group (Parallel.post_forward_ranks)
        ranks, stride = p.post_forward_ranks or p.replicas, p.tp
    elif group == "cp":
        ranks, stride = p.cp, p.tp
    elif group == "ep":
        ranks, stride = p.ep, p.tp * p.cp
    elif group == "dp_ep":
        ranks, stride = p.dp // p.ep, p.tp * p.cp * p.ep
    else:
        raise KeyError(group)
    if stride >= domain_gpus:  # each rank in a domain of its own (the domains between hold other groups)
        return ranks, ranks
    return ranks, max(1, math.ceil(ranks * stride / domain_gpus))


def collective_ns(comm_type: str, nbytes: float, ranks: int, nodes: int, device: DeviceProfile) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return choose(comm_type, nbytes, ranks, nodes, device.network()).time_ns


def nvlink_bus_bytes_per_s(topology: Topology) -> float:
    return topology.nvlink_bytes_per_s * SIMPLE_LINK_EFFICIENCY


def network_bus_bytes_per_s(ranks: int, domains: int, topology: Topology) -> float:
    """What a group's ranks in one domain move across domains together: their NIC shares, past the spine's
    oversubscription once the group is wider than a leaf."""
    per_domain = max(1, ranks // domains)
    spine = topology.oversubscription if topology.leaf_gpus and domains * topology.nvlink_domain_gpus > \
        topology.leaf_gpus else 1.0
    return per_domain * topology.nic_share_bytes_per_s * NIC_EFFICIENCY / spine


def bus_bytes_per_s(ranks: int, nodes: int, device: DeviceProfile) -> float:
    """A ring's bus bandwidth (Simple protocol): NVLink inside a domain; across domains, the group's NIC
    shares there, capped by NVLink where the ring also runs inside the domain."""
    return _ring_bus(ranks, nodes, device.network())


def choose(comm_type: str, nbytes: float, ranks: int, domains: int, topology: Topology,
           algorithms: tuple[str, ...] = ()) -> Call:
    """The fastest (algorithm, protocol) NCCL's tuner allows for this call; ``algorithms`` narrows the choice
    as NCCL_ALGO does (e.g. ("ring",) for NCCL_ALGO=Ring)."""
    if comm_type == "ALLTOALL":
        return _all_to_all(nbytes, ranks, domains, topology)
    return min((call for call in _candidates(comm_type, nbytes, ranks, domains, topology)
                if not algorithms or call.algorithm in algorithms), key=lambda call: call.time_ns)


def _candidates(comm_type: str, nbytes: float, ranks: int, domains: int, t: Topology):
    ppn = max(1, ranks // domains)
    ring_bus = _ring_bus(ranks, domains, t)
    steps = STEPS[comm_type](ranks)
    ll_max = (LL_MAX_ONE_DOMAIN_GBPS[t.generation] if domains == 1 else LL_MAX_GBPS[min(domains, 3)]) * 1e9
    buses = {"Simple": ring_bus, "LL128": LL128_FRACTION * ring_bus, "LL": min(ll_max, ring_bus / 2)}
    for protocol, bus in buses.items():
        yield _call("ring", protocol, nbytes, _ring_us(comm_type, protocol, nbytes, ranks, domains),
                    bus, bus * ranks / steps)
    sharp = t.nvlink_sharp and t.generation in NVLS_EFFICIENCY and ppn > 1
    if comm_type == "ALLREDUCE" and domains > 1:
        tree = {"Simple": TREE_FRACTION * ring_bus, "LL": min(ll_max, TREE_FRACTION * ring_bus / 3.8),
                "LL128": TREE_FRACTION * ring_bus * 120 / 128}
        corrections = {"Simple": TREE_CORRECTION, "LL": TREE_CORRECTION_LL, "LL128": TREE_CORRECTION_LL128}
        size = int(math.log2(max(1, int(nbytes) >> 6)))
        for protocol, bus in tree.items():
            factor = corrections[protocol][size] if size < 24 else 1.0
            latency = BASE_US["tree"][protocol] + 2 * ((ppn - 1) * NVLINK_US["tree"][protocol]
                                                       + int(math.log2(domains)) * NETWORK_US["tree"][protocol])
            yield _call("tree", protocol, nbytes, latency, bus, bus / 2 * factor)
        if sharp:  # NVLS inside each domain, a tree between them; two domains send both ways at once (tuning.cc)
            bus = min(_nvls_bus(ppn, t), network_bus_bytes_per_s(ranks, domains, t) * (2 if domains == 2 else 1))
            latency = NVLINK_US["nvls_tree"]["Simple"] + 2 * int(math.log2(domains)) * NETWORK_US["nvls_tree"]["Simple"]
            yield _call("nvls_tree", "Simple", nbytes, latency, bus, bus * ranks / steps)
    if comm_type == "ALLREDUCE" and domains == 1 and sharp:
        bus = _nvls_bus(ranks, t)
        yield _call("nvls", "Simple", nbytes, NVLINK_US["nvls"]["Simple"], bus, bus * ranks / steps)
    if comm_type in ("ALLGATHER", "REDUCESCATTER") and ppn == 1 and domains > 1:
        bus = PAT_FRACTION * ring_bus  # tuning.cc: PAT's bandwidth is not converted by n / steps
        latency = BASE_US["pat"]["Simple"] + int(math.log2(domains)) * NETWORK_US["tree"]["Simple"] / 3.5 + ranks * 2.8
        yield _call("pat", "Simple", nbytes, latency, bus, bus)


def _call(algorithm: str, protocol: str, nbytes: float, latency_us: float, bus: float, algorithm_bw: float) -> Call:
    return Call(algorithm, protocol, latency_us * 1e3 + nbytes / algorithm_bw * 1e9, bus)


def _ring_bus(ranks: int, domains: int, t: Topology) -> float:
    if domains == 1:
        return nvlink_bus_bytes_per_s(t)
    across = network_bus_bytes_per_s(ranks, domains, t)
    return across if ranks // domains <= 1 else min(nvlink_bus_bytes_per_s(t), across)


def _ring_us(comm_type: str, protocol: str, nbytes: float, ranks: int, domains: int) -> float:
    """tuning.cc's ring latency: a base, then each step's hop, NVLink inside a domain and network between."""
    steps = STEPS[comm_type](ranks)
    inter = 0 if domains == 1 else STEPS[comm_type](domains)
    intra = NVLINK_US["ring"][protocol]
    network = NETWORK_US["tree" if ranks == domains else "ring"][protocol]  # one rank a domain: fully exposed
    if domains > 1:
        intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
    latency = BASE_US["ring"][protocol] + (steps - inter) * intra + inter * network
    if comm_type == "ALLREDUCE" and protocol == "Simple" and domains > 1 and nbytes / (16 * ranks) >= 64:
        latency *= RING_PLATEAU
    return latency


def _nvls_bus(ranks: int, t: Topology) -> float:
    """NVLS all-reduce: each GPU moves D (1 + 1/n) bytes over its NVLink (load-reduce its 1/n from every
    GPU through the switch, multicast-store the result), so algBw = link x n / (n + 1); bus = algBw x 2(n-1)/n."""
    algorithm_bw = nvlink_bus_bytes_per_s(t) * NVLS_EFFICIENCY[t.generation] * ranks / (ranks + 1)
    return algorithm_bw * 2 * (ranks - 1) / ranks


def _all_to_all(nbytes: float, ranks: int, domains: int, t: Topology) -> Call:
    """Grouped send/receive: each rank sends (n-1)/n of its buffer, (n-r)/n of it to other domains through its
    own NIC share and (r-1)/n over NVLink, both at once."""
    ppn = max(1, ranks // domains)
    inside = nbytes * (ppn - 1) / ranks / nvlink_bus_bytes_per_s(t) if ppn > 1 else 0.0
    across = nbytes * (ranks - ppn) / ranks / (t.nic_share_bytes_per_s * NIC_EFFICIENCY) if domains > 1 else 0.0
    latency_us = BASE_US["ring"]["Simple"] + (NETWORK_US["ring"]["Simple"] if domains > 1 else NVLINK_US["ring"]["Simple"])
    seconds = max(inside, across)
    bus = nbytes * (ranks - 1) / ranks / seconds if seconds else 0.0
    return Call("p2p", "Simple", latency_us * 1e3 + seconds * 1e9, bus)


def comm_ns(comm: Comm, p: Parallel, device: DeviceProfile) -> float:
    ranks, nodes = group_layout(comm.group, p, device.network().nvlink_domain_gpus)
    if comm.deepep is not None:
        return _TIMES.get(("deepep", comm.deepep, ranks, nodes, id(device)), (device,), deepep_ns, comm.deepep,
                          ranks, nodes, device)
    return _TIMES.get((comm.type, comm.bytes, ranks, nodes, id(device)), (device,), collective_ns, comm.type,
                      comm.bytes, ranks, nodes, device)  # no closure per call: asked ~a million times a search


def deepep_ns(routing: tuple[int, int, int], ranks: int, domains: int, device: DeviceProfile) -> float:
    """DeepEP's normal dispatch or combine kernel (deep_ep, V1's intranode and internode kernels): a token goes
    once to each rank holding any of its experts; across NVLink domains once to each domain over RDMA (to
    the rank of the same local index there), which forwards it over NVLink to the domain's ranks that need it.
    Its time is the busier link's, at the share of the link DeepEP's kernels reach (DEEPEP_*_SHARE), after
    one call's latency. ``routing``: one copy of the rank's tokens in bytes, experts, experts per token."""
    from ..parallel.collectives import expected_destinations  # here: collectives imports torch (see above)

    token_bytes, experts, top_k = routing
    t = device.network()
    ppn = max(1, ranks // domains)
    rank_copies = expected_destinations(experts, top_k, ranks)
    # NVLink: the copies for the other ranks of this domain; received ones forwarded alike in other domains
    nvlink_bytes = token_bytes * rank_copies * (ppn - 1) / ranks if ppn > 1 else 0.0
    nvlink_s = nvlink_bytes / (t.nvlink_bytes_per_s * DEEPEP_NVLINK_SHARE)
    network_s = 0.0
    if domains > 1:
        domain_copies = expected_destinations(experts, top_k, domains)
        network_bytes = token_bytes * domain_copies * (domains - 1) / domains
        network_s = network_bytes / (t.nic_share_bytes_per_s * DEEPEP_RDMA_SHARE)
    latency_us = BASE_US["ring"]["Simple"] + (NETWORK_US["ring"]["Simple"] if domains > 1 else NVLINK_US["ring"]["Simple"])
    return latency_us * 1e3 + max(nvlink_s, network_s) * 1e9


# a layout search times the same collective (a gradient bucket, a layer's all-gather) on the same group
# shape many times
_TIMES = Memo(1 << 16)


def p2p_ns(nbytes: float, p: Parallel, device: DeviceProfile) -> float:
    """One activation (or its gradient) sent to the next pipeline stage: tp x cp x dp GPUs away."""
    if p.pp == 1 or nbytes <= 0:
        return 0.0
    t = device.network()
    same_domain = p.tp * p.cp * p.dp * 2 <= t.nvlink_domain_gpus
    hop_us = NVLINK_US["ring"]["Simple"] if same_domain else NETWORK_US["ring"]["Simple"]
    bus = nvlink_bus_bytes_per_s(t) if same_domain else t.nic_share_bytes_per_s * NIC_EFFICIENCY
    return (BASE_US["ring"]["Simple"] + hop_us) * 1e3 + nbytes / bus * 1e9


def check_device(device: DeviceProfile, parallel: Parallel) -> None:
    """Collective times need the interconnect's figures; a rank with no collective needs none."""
    if parallel.world > parallel.pp and not (device.intra_node_bytes_per_s and device.inter_node_bytes_per_s):
        raise UserError(f"device '{device.name}' has no interconnect figures (intra_node_bytes_per_s, "
                        "inter_node_bytes_per_s) for the collectives of --tp/--dp > 1; add them to its profile "
                        "or use a datasheet profile such as --device h100-sxm for --format chrome-trace")
