"""The network a device sits in: its NVLink domain, its NICs and the fabric above them, as one frozen record.

A device profile carries its platform's topology (a ``topology`` block in its JSON, a source per figure);
``--topology`` replaces any of its fields for a user's own cluster (``parse`` below). Collective times
(cluster/network.py) read nothing else about the network.

- ``nvlink_domain_gpus``: GPUs one NVLink/NVSwitch fabric joins (8 on HGX/DGX H100, H200 and B200; 72 on a
  GB200 NVL72, whose 18 trays of 4 share one NVLink switch tray set). NCCL treats such a domain as one
  "node" for its algorithms (one NVLS multicast group, rings inside it over NVLink).
- ``nvlink_bytes_per_s``: one GPU's NVLink bandwidth into that fabric, one direction.
- ``nics_per_node`` x ``nic_bytes_per_s`` over ``gpus_per_node``: one GPU's share of the scale-out network,
  one direction (a rail-optimised HGX node has one 400 Gb/s NIC per GPU: 50 GB/s).
- ``nvlink_sharp``: the NVSwitches reduce in the switch (NVLink SHARP, NCCL's NVLS and NVLS-tree algorithms);
  third-generation NVSwitch (Hopper) and later.
- ``gpu_speed_spread``: how much the cluster's GPUs differ in speed, sigma / mean of a GPU's time for the same
  work (0: all alike); a synchronous step waits for the slowest (cluster/stragglers.py).
- ``leaf_gpus`` and ``oversubscription``: a group wider than one leaf (one rail group of a rail-optimised
  fabric, e.g. a 32-node DGX SuperPOD scalable unit = 256 GPUs) crosses the spine, whose bandwidth is the
  leaves' divided by ``oversubscription`` (1 = non-blocking, as SuperPODs are built).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..errors import UserError


@dataclass(frozen=True)
class Topology:
    nvlink_domain_gpus: int
    nvlink_bytes_per_s: float
    gpus_per_node: int
    nics_per_node: int
    nic_bytes_per_s: float
    nvlink_sharp: bool = False
    leaf_gpus: int = 0  # 0: one leaf holds every GPU (no oversubscribed spine)
    oversubscription: float = 1.0
    generation: str = "hopper"  # NCCL's per-architecture tuning row: volta, ampere, hopper, blackwell
    gpu_speed_spread: float = 0.0  # sigma / mean of a GPU's time for the same work across the cluster

    @property
    def nic_share_bytes_per_s(self) -> float:
        """One GPU's share of its node's scale-out bandwidth, one direction."""
        return self.nics_per_node * self.nic_bytes_per_s / self.gpus_per_node


# --topology's keys, each with the field it sets and how its value reads
_KEYS = {"nvlink-domain": ("nvlink_domain_gpus", int), "nvlink-gbps": ("nvlink_bytes_per_s", "gbit"),
         "gpus-per-node": ("gpus_per_node", int), "nics-per-node": ("nics_per_node", int),
         "nic-gbps": ("nic_bytes_per_s", "gbit"), "nvlink-sharp": ("nvlink_sharp", bool),
         "leaf-gpus": ("leaf_gpus", int), "oversubscription": ("oversubscription", float),
         "gpu-spread": ("gpu_speed_spread", float)}
EXAMPLE = "nvlink-domain=8,nics-per-node=8,nic-gbps=400,oversubscription=2,leaf-gpus=256"


def parse(text: str, base: Topology) -> Topology:
    """``--topology key=value,...`` over a device's own topology; UserError naming the first bad item."""
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in _KEYS or not value:
            raise UserError(f"--topology: '{item}' is not key=value with a key among {', '.join(_KEYS)} "
                            f"(e.g. --topology {EXAMPLE})")
        name, kind = _KEYS[key]
        changes[name] = _value(key, value, kind)
    if not changes:
        raise UserError(f"--topology names nothing to change: give key=value pairs, e.g. --topology {EXAMPLE}")
    topology = replace(base, **changes)
    problem = check(topology)
    if problem:
        raise UserError(f"--topology: {problem}")
    return topology


def _value(key: str, text: str, kind) -> int | float | bool:
    if kind is bool:
        if text not in ("on", "off"):
            raise UserError(f"--topology: {key}={text} must be on or off")
        return text == "on"
    try:
        number = int(text) if kind is int else float(text)
    except ValueError:
        raise UserError(f"--topology: {key}={text} is not a {'whole ' if kind is int else ''}number") from None
    return number * 1e9 / 8 if kind == "gbit" else number  # Gb/s (as links are sold) to bytes/s


def check(topology: Topology) -> str | None:
    """The first field that cannot be a network's; None when all are sane."""
    for f in fields(topology):
        value = getattr(topology, f.name)
        if f.name == "generation":
            if value not in ("volta", "ampere", "hopper", "blackwell"):
                return f"generation = {value!r} must be volta, ampere, hopper or blackwell"
        elif f.name == "nvlink_sharp":
            if not isinstance(value, bool):
                return f"nvlink_sharp = {value!r} must be true or false"
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{f.name} = {value!r} is not a finite number"
        elif f.name in ("nvlink_domain_gpus", "gpus_per_node", "nics_per_node") and (int(value) != value or value < 1):
            return f"{f.name} = {value!r} must be a whole number, 1 or more"
        elif f.name == "leaf_gpus" and (int(value) != value or value < 0):
            return f"leaf_gpus = {value!r} must be a whole number, 0 (one leaf) or more"
        elif f.name == "oversubscription" and value < 1:
            return f"oversubscription = {value!r} must be 1 (non-blocking) or more"
        elif f.name == "gpu_speed_spread" and not 0 <= value < 0.5:
            return f"gpu_speed_spread = {value!r} must be a fraction from 0 to below 0.5 (0.03: GPUs differ by 3 %)"
        elif f.name in ("nvlink_bytes_per_s", "nic_bytes_per_s") and value <= 0:
            return f"{f.name} = {value!r} must be more than 0"
    return None


def generation(arch: str) -> str:
    """NCCL's tuning row for a compute capability (tuning.cc: compCapIndex): sm100+ Blackwell, sm90 Hopper."""
    digits = arch.removeprefix("sm")
    major = int(digits[:-1]) if digits.isdigit() and len(digits) > 1 else 9
    return "blackwell" if major >= 10 else "hopper" if major >= 9 else "ampere" if major >= 8 else "volta"
