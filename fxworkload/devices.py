"""Device profiles: frozen data, one JSON file per device, a source per figure.

Shipped profiles (datasheet peaks) live in ``fxworkload/device_profiles/``. Measured ones, written
by ``fxworkload calibrate``, live in the cache folder: ``cpu`` (this machine, measured on first use
if never calibrated) and any GPU profile a user calibrated under a name of their own.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import UserError

DATA_DIR = Path(__file__).resolve().parent / "device_profiles"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    matmul_flops_per_s: dict[str, float]  # dense peak per dtype name (fp32, bf16, fp16)
    vector_flops_per_s: float  # elementwise, norm and reduction ops
    memory_bytes_per_s: float
    compute_efficiency: float  # fraction of the peak FLOP rate a kernel reaches
    memory_efficiency: float  # fraction of the peak bandwidth a kernel reaches
    kernel_launch_ns: float  # added to every op that launches a kernel
    # Interconnect, for collective times in timelines; 0 = unknown (CPU and measured profiles):
    intra_node_bytes_per_s: float = 0.0  # one GPU's NVLink bandwidth, one direction
    inter_node_bytes_per_s: float = 0.0  # one GPU's share of the node's network bandwidth, one direction
    gpus_per_node: int = 8
    sources: dict[str, str] = field(default_factory=dict)
    # Measured profiles only; each replaces peak x efficiency where it applies (see roofline.py):
    # per dtype, [[m, k, n, achieved FLOP/s], ...] over a grid of GEMM shapes;
    matmul_flops_per_s_by_shape: dict[str, list[list[float]]] = field(default_factory=dict)
    # [[bytes moved, achieved bytes/s], ...], bytes ascending;
    memory_bytes_per_s_by_bytes: list[list[float]] = field(default_factory=list)
    # aten op name -> achieved FLOP/s (FLOPs as fxworkload's per-element rules count them).
    vector_flops_per_s_by_op: dict[str, float] = field(default_factory=dict)


def names() -> list[str]:
    measured = [p.stem for p in (cache_dir() / "devices").glob("*.json")]
    return sorted({p.stem for p in DATA_DIR.glob("*.json")} | set(measured) | {"cpu"})


def load(name: str) -> DeviceProfile:
    if name == "cpu":
        return cpu_profile()
    for path in (DATA_DIR / f"{name}.json", measured_path(name)):
        if path.is_file():
            return read(path)
    raise UserError(f"unknown device '{name}': use one of {', '.join(names())}, "
                    "or measure this machine's GPU with 'fxworkload calibrate --on cuda --name NAME'")


def read(path: Path) -> DeviceProfile:
    try:
        return DeviceProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{path}: not a device profile ({exc}); delete it and run 'fxworkload calibrate'") from None


def cache_dir() -> Path:
    root = os.environ.get("FXWORKLOAD_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fxworkload"
    return Path(root)


def measured_path(name: str) -> Path:
    """Where a measured profile is kept; ``cpu`` is keyed by torch version and thread count."""
    if name == "cpu":
        name = f"cpu-torch{torch.__version__}-threads{torch.get_num_threads()}"
    return cache_dir() / "devices" / f"{name}.json"


def save(profile: DeviceProfile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(profile), indent=2) + "\n")
    tmp.replace(path)
    return path


def cpu_profile() -> DeviceProfile:
    """This machine's profile: the one ``fxworkload calibrate`` saved, or measured now and cached."""
    path = measured_path("cpu")
    if path.is_file():
        return read(path)
    from .calibrate import measure

    print("measuring this CPU once (run 'fxworkload calibrate' to redo it)...", file=sys.stderr)
    profile = measure("cpu", "cpu")
    try:
        save(profile, path)
    except OSError:
        pass  # an unwritable cache only costs a new measurement next time
    return profile
