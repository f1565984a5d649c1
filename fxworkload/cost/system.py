"""Where a step runs, as one object (Calculon's *system*): a device profile, by name, with the memory tiers
and network it describes (cost/devices.py), and the user's ``--topology`` over that network
(cost/topology.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class System:
    device: str = "a100-80gb"  # a profile's name (``fxworkload devices``); NAME@WATTSw: that board capped
    topology: str | None = None  # ``key=value,...`` over the profile's own network; None: the profile's


FIELDS = frozenset(f.name for f in fields(System))
