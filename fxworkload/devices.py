"""Device profiles: frozen data, one JSON file per device under ``fxworkload/device_profiles/``, a source per figure.

``cpu`` is this machine, measured by a short micro-benchmark on first use and cached.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
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
    sources: dict[str, str] = field(default_factory=dict)


def names() -> list[str]:
    return sorted([p.stem for p in DATA_DIR.glob("*.json")] + ["cpu"])


def load(name: str) -> DeviceProfile:
    if name == "cpu":
        return cpu_profile()
    path = DATA_DIR / f"{name}.json"
    if not path.is_file():
        raise UserError(f"unknown device '{name}': use one of {', '.join(names())}")
    return DeviceProfile(**json.loads(path.read_text()))


def cache_dir() -> Path:
    root = os.environ.get("FXWORKLOAD_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fxworkload"
    return Path(root)


def cpu_profile() -> DeviceProfile:
    """This machine's profile, measured once and then read from the cache."""
    path = cache_dir() / f"cpu-torch{torch.__version__}-threads{torch.get_num_threads()}.json"
    if path.is_file():
        return DeviceProfile(**json.loads(path.read_text()))
    print("measuring this CPU (matmul throughput, memory bandwidth; once, then cached)...", file=sys.stderr)
    profile = measure_cpu()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(profile), indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a new measurement next time
    return profile


def _median_s(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cpu() -> DeviceProfile:
    n = 1024
    matmul = {}
    for dtype_name, dtype in DTYPES.items():
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        matmul[dtype_name] = 2 * n ** 3 / _median_s(lambda: torch.mm(a, b), 5)
    small = torch.randn(1 << 16)  # cache-resident: arithmetic rate, not bandwidth
    vector = 64 * small.numel() / _median_s(lambda: [small.mul_(1.0) for _ in range(64)], 5)
    src, dst = torch.randn(1 << 25), torch.empty(1 << 25)  # 128 MiB each
    bandwidth = 2 * src.numel() * 4 / _median_s(lambda: dst.copy_(src), 5)
    one = torch.ones(1)
    launch_ns = 1e9 * _median_s(lambda: [one.add(one) for _ in range(1000)], 5) / 1000
    how = f"measured on this machine by fxworkload.devices.measure_cpu with {torch.get_num_threads()} threads"
    return DeviceProfile(
        name="cpu", description=f"this machine's CPU ({torch.get_num_threads()} threads)",
        matmul_flops_per_s=matmul, vector_flops_per_s=vector, memory_bytes_per_s=bandwidth,
        compute_efficiency=1.0, memory_efficiency=1.0, kernel_launch_ns=launch_ns,
        sources={"matmul_flops_per_s": f"{how}: median of 5 {n}x{n} mm per dtype",
                 "vector_flops_per_s": f"{how}: in-place multiply of a cache-resident 256 KiB tensor",
                 "memory_bytes_per_s": f"{how}: 128 MiB copy, read + write bytes",
                 "kernel_launch_ns": f"{how}: median time of a 1-element add",
                 "compute_efficiency": "1.0: the rates are measured, not peaks",
                 "memory_efficiency": "1.0: the bandwidth is measured, not a peak"})
