"""Device profiles: frozen data, one JSON file per device, a source per figure.

Shipped profiles (datasheet peaks) live in ``fxworkload/cost/device_profiles/``. Measured ones, written
by ``fxworkload calibrate``, live in the cache folder: ``cpu`` (this machine) and any GPU
profile a user calibrated under a name of their own.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .. import store
from ..errors import UserError
from ..store import cache_dir  # noqa: F401 (the cache folder, where measured profiles live)
from ..names import NAME, check_name as check_a_name
from .gpu import FP32_ISSUE_BOUND, RESIDENT_THREADS, SM_THREADS, GpuFacts, GpuModel
from .topology import Topology, check as check_topology, generation as topology_generation

DATA_DIR = Path(__file__).resolve().parent / "device_profiles"


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
    # GPU datasheet facts; with sm_count set, kernel times come from the mechanics model (gpu.py):
    arch: str = ""  # compute capability, "sm90"
    sm_count: int = 0
    l2_bytes: int = 0
    memory_capacity_bytes: int = 0
    sdpa_priority: list[str] = field(default_factory=list)  # SDPA backends in the order PyTorch tries them
    # The model's fitted parameters: named by a file in fits/ (shipped profiles) or given inline (calibrated).
    gpu_model_fit: str = ""
    gpu_model_parameters: dict[str, float] = field(default_factory=dict)
    power_limit_w: float = 0.0  # the board's power limit (TDP), W; 0 = not given
    process_nm: float = 0.0  # the GPU die's process node, nm (TSMC 4N/4NP count as 5); 0 = not given
    # A board run below its nominal power limit (nvidia-smi -pl, or a platform's default), W; 0 = nominal.
    # Tensor-core work slows by gpu.capped_clock_fraction, which needs the idle power beside it.
    power_cap_w: float = 0.0
    idle_power_w: float = 0.0  # what the board draws idle, W; 0 = not given (the cap's law then takes 0)
    # The host memory tier, one GPU's share (offload, cluster/offload.py); 0 = not given:
    host_link_bytes_per_s: float = 0.0  # the GPU's link to host memory, one direction (PCIe, NVLink-C2C)
    host_memory_bytes_per_s: float = 0.0  # its share of the host's DRAM bandwidth
    host_memory_capacity_bytes: int = 0  # its share of the host's memory
    # The network this GPU sits in (cost/topology.py), any of Topology's fields; the rest from the figures above
    topology: dict = field(default_factory=dict)

    def network(self) -> Topology:
        """The device's topology: its ``topology`` block over what the interconnect figures above imply
        (an NVLink domain of gpus_per_node, one NIC a GPU at inter_node_bytes_per_s, no NVLink SHARP)."""
        found = self.__dict__.get("_network")
        if found is None:
            base = {"nvlink_domain_gpus": self.gpus_per_node, "nvlink_bytes_per_s": self.intra_node_bytes_per_s,
                    "gpus_per_node": self.gpus_per_node, "nics_per_node": self.gpus_per_node,
                    "nic_bytes_per_s": self.inter_node_bytes_per_s, "generation": topology_generation(self.arch)}
            found = Topology(**(base | self.topology))
            object.__setattr__(self, "_network", found)  # frozen: cache it once, as functools.cached_property would
        return found

    def gpu_facts(self) -> GpuFacts:
        return GpuFacts(sm_count=self.sm_count, tensor_flops_per_s=self.matmul_flops_per_s,
                        memory_bytes_per_s=self.memory_bytes_per_s, l2_bytes=self.l2_bytes,
                        power_limit_w=self.power_limit_w, process_nm=self.process_nm,
                        power_cap_w=self.power_cap_w, idle_power_w=self.idle_power_w,
                        threads_per_sm=RESIDENT_THREADS.get(self.arch, SM_THREADS),
                        fp32_issue_bound=self.arch in FP32_ISSUE_BOUND, arch=self.arch)

    def gpu_model(self) -> GpuModel:
        return _model(self.gpu_model_fit, tuple(sorted(self.gpu_model_parameters.items())))

    def error_intervals(self) -> dict[str, tuple[float, float]]:
        """Per kernel family (gemm, sdpa, vector), the 90 % interval of measured / estimated of the
        held-out rows its fit was checked on (fits/<fit>.json, bench/kernels.py); {} if none."""
        if not self.gpu_model_fit:
            return {}
        return {family: (float(low), float(high))
                for family, (low, high) in fit_chain(self.gpu_model_fit).get("intervals", {}).items()}

    def compute_capability(self) -> tuple[int, int]:
        """(major, minor) as torch.cuda.get_device_capability reports it; on ROCm a gfx target
        gfxMmS reads as (M, m): gfx942 (MI300X) -> (9, 4)."""
        if self.arch.startswith("gfx"):
            digits = self.arch.removeprefix("gfx")
            return int(digits[:-2]), int(digits[-2], 16)
        digits = self.arch.removeprefix("sm")
        return int(digits[:-1]), int(digits[-1])

    def figure_kinds(self) -> dict[str, str]:
        """Per figure with a source: datasheet (a published fact), fitted (measured data fitted on a
        GPU the source names) or assumed (neither: a stated guess, or another GPU's fit carried over)."""
        return {figure: figure_kind(text) for figure, text in self.sources.items()}


def figure_kind(source: str) -> str:
    text = source.lower()
    if text.startswith("assumed") or "no public" in text or "publishes no" in text:
        return "assumed"
    if text.startswith(("fitted", "measured", "the free parameters")):
        return "fitted"
    return "datasheet"


@functools.cache
def _model(fit: str, inline: tuple) -> GpuModel:
    parameters = dict(fit_chain(fit)["parameters"]) if fit else {}
    parameters.update(dict(inline))
    return GpuModel.of(parameters)


def fit_chain(name: str, seen: tuple = ()) -> dict:
    """A fit with its ``base`` folded in: a cross-GPU fit (fits/cross-gpu-*.json) names the one-GPU fit
    whose parameters it leaves as they are, and replaces the rest (its intervals too, where it has any)."""
    if name in seen:
        raise UserError(f"{FIT_DIR / name}.json: its 'base' chain returns to itself; reinstall fxworkload")
    fit = read_fit(name)
    if not fit.get("base"):
        return fit
    base = fit_chain(check_a_name(str(fit["base"]), "base", "fit name"), (*seen, name))
    return {**base, **fit, "parameters": {**base["parameters"], **fit["parameters"]},
            "intervals": fit.get("intervals") or base.get("intervals", {})}


FIT_DIR = Path(__file__).resolve().parent / "fits"
GPU_FACTS = ("arch", "sm_count", "memory_capacity_bytes", "sdpa_priority")


def read_fit(name: str) -> dict:
    path = FIT_DIR / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read the fitted GPU model ({exc}); reinstall fxworkload") from None


def names() -> list[str]:
    found = store.folder("devices")
    measured = [p.stem for p in (found.glob("*.json") if found else ())
                if not p.stem.startswith("cpu-") and _NAME.fullmatch(p.stem)]
    return sorted({p.stem for p in DATA_DIR.glob("*.json")} | set(measured) | {"cpu"})


def measured_cpu_paths() -> list[Path]:
    """Every measured CPU profile (one per torch build and thread count), found without importing torch."""
    found = store.folder("devices")
    return sorted(found.glob("cpu-torch*-threads*.json")) if found else []


_NAME = NAME


# A profile run below its nominal power limit: NAME@WATTSw (e.g. h100-sxm@500w), as `nvidia-smi -pl` sets it.
CAPPED = re.compile(r"(?P<base>[^@]+)@(?P<watts>\d{1,5}(?:\.\d+)?)[wW]")


def check_name(name: str, option: str = "--device") -> str:
    """A profile name is a name (letters, digits, '.', '_', '-'), never a path; NAME@WATTSw caps its board."""
    if "@" in (name or ""):
        capped = CAPPED.fullmatch(name)
        if not capped:
            raise UserError(f"{option} {name!r}: a board capped below its power limit is written NAME@WATTSw, "
                            "e.g. h100-sxm@500w")
        check_a_name(capped["base"], option, "device profile name")
        return name
    return check_a_name(name, option, "device profile name")


def load(name: str) -> DeviceProfile:
    """A shipped datasheet profile, or one ``fxworkload calibrate`` measured; never measures. NAME@WATTSw:
    that profile's board capped at WATTS (``power_cap_w``)."""
    check_name(name)
    capped = CAPPED.fullmatch(name)
    if capped:
        return with_power_cap(load(capped["base"]), float(capped["watts"]), name)
    for path in ((measured_path(name),) if name == "cpu" else (DATA_DIR / f"{name}.json", measured_path(name))):
        if path.parent != DATA_DIR and store.folder("devices") is None:
            continue  # no measured profiles yet (and a folder others can write is refused there)
        if path.is_file():
            return read(path)
    if name == "cpu":
        raise UserError("no measured profile of this CPU yet: run 'fxworkload calibrate' first")
    near = did_you_mean(name, names())
    raise UserError(f"unknown device '{name}'{f' (did you mean {near}?)' if near else ''}: use one of "
                    f"{', '.join(names())}, or measure this machine's GPU with 'fxworkload calibrate --on cuda --name NAME'")


def did_you_mean(name: str, known: list[str]) -> str:
    """The known names a mistyped one may mean: those containing it whatever its case ('H100': h100-sxm,
    h100-pcie, ...), else the closest spellings (difflib)."""
    lowered = name.lower()
    found = [k for k in known if lowered in k] or difflib.get_close_matches(lowered, known, n=3, cutoff=0.6)
    return " or ".join(", ".join(found).rsplit(", ", 1)) if found else ""


def _gpu_tokens(text: str) -> set[str]:
    """A GPU's model, memory and (for the other boards) form as names spell them:
    'NVIDIA H100 80GB HBM3' -> {'H100', '80GB'}, 'NVIDIA H100 PCIe' -> {'H100', 'PCIE'},
    'NVIDIA GB200' -> {'GB200'}, 'NVIDIA L40S' -> {'L40S'}, 'NVIDIA L4' -> {'L4'}."""
    return set(re.findall(r"\b[A-Z]{1,2}\d{1,3}[A-Z]?\b|\b\d+GB\b|\bPCIE\b|\bNVL\b", text.upper().replace("-", " ")))


def matching_gpu(device_name: str) -> str | None:
    """The shipped GPU profile of the GPU torch names (model and, where the name gives it, memory)."""
    found = _gpu_tokens(device_name)
    for path in sorted(DATA_DIR.glob("*.json")):
        profile = read(path)
        name = profile.name
        if not profile.sm_count or profile.power_cap_w:  # a board's cap is not in the name torch gives it
            continue
        tokens = _gpu_tokens(profile.description)
        forms = {"PCIE", "NVL"}
        sizes = {t for t in tokens if t.endswith("GB")}
        models = tokens - sizes - forms
        if (models and models <= found and tokens & forms == found & forms
                and (not {t for t in found if t.endswith("GB")} or sizes <= found)):
            return name
    return None


def exists(name: str) -> bool:
    if name != "cpu" and (DATA_DIR / f"{name}.json").is_file():
        return True
    return store.folder("devices") is not None and measured_path(name).is_file()


def read(path: Path) -> DeviceProfile:
    try:
        profile = DeviceProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, RecursionError) as exc:
        raise UserError(f"{path}: not a device profile ({exc}); delete it and run 'fxworkload calibrate'") from None
    problem = _bad_figure(profile)
    if problem:
        raise UserError(f"{path}: {problem}; fix the profile or delete it and run 'fxworkload calibrate'")
    if profile.sm_count or profile.arch:
        missing = [name for name in GPU_FACTS if not getattr(profile, name)]
        missing += [] if profile.matmul_flops_per_s.get("fp32") else ["matmul_flops_per_s.fp32"]
        if not profile.memory_bytes_per_s:
            missing.append("memory_bytes_per_s")
        if missing:
            raise UserError(f"{path}: GPU profile is missing the datasheet field '{missing[0]}'; add it with its source")
    return profile


def _bad_figure(profile: DeviceProfile) -> str | None:
    """The first figure that cannot be a device's: a rate not finite and positive, an efficiency
    outside (0, 1], a negative time; None when every figure is sane."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(profile.matmul_flops_per_s, dict) or "fp32" not in profile.matmul_flops_per_s:
        return "matmul_flops_per_s must give at least the fp32 rate (and each 16-bit or FP8 rate the GPU has)"
    positive = {f"matmul_flops_per_s.{k}": v for k, v in profile.matmul_flops_per_s.items()}
    positive |= {"vector_flops_per_s": profile.vector_flops_per_s, "memory_bytes_per_s": profile.memory_bytes_per_s}
    positive |= {f"vector_flops_per_s_by_op.{k}": v for k, v in _items(profile.vector_flops_per_s_by_op)}
    positive |= {f"memory_bytes_per_s_by_bytes[{i}]": v for i, row in enumerate(_rows(profile.memory_bytes_per_s_by_bytes))
                 for v in row}
    positive |= {f"matmul_flops_per_s_by_shape.{k}[{i}]": v for k, table in _items(profile.matmul_flops_per_s_by_shape)
                 for i, row in enumerate(_rows(table)) for v in row}
    for name, value in positive.items():
        if not number(value) or value <= 0:
            return f"{name} = {value!r} is not a positive finite number"
    for name in ("intra_node_bytes_per_s", "inter_node_bytes_per_s", "kernel_launch_ns", "sm_count", "l2_bytes",
                 "memory_capacity_bytes", "power_limit_w", "process_nm", "power_cap_w", "idle_power_w",
                 "host_link_bytes_per_s", "host_memory_bytes_per_s", "host_memory_capacity_bytes"):
        value = getattr(profile, name)
        if not number(value) or value < 0:
            return f"{name} = {value!r} must be a finite number, 0 or more"
    if profile.power_cap_w and not profile.idle_power_w < profile.power_cap_w <= profile.power_limit_w:
        return (f"power_cap_w = {profile.power_cap_w!r} must lie above idle_power_w ({profile.idle_power_w!r}) and "
                f"at most power_limit_w ({profile.power_limit_w!r}), the nominal limit it caps")
    for name in ("compute_efficiency", "memory_efficiency"):
        value = getattr(profile, name)
        if not number(value) or not 0 < value <= 1:
            return f"{name} = {value!r} must be a fraction in (0, 1]"
    if not isinstance(profile.gpus_per_node, int) or profile.gpus_per_node < 1:
        return f"gpus_per_node = {profile.gpus_per_node!r} must be a whole number, 1 or more"
    for name, value in _items(profile.gpu_model_parameters):
        if not number(value):
            return f"gpu_model_parameters.{name} = {value!r} is not a finite number"
    return _bad_topology(profile)


def check_dtype(profile: DeviceProfile, dtype: str) -> None:
    """A dtype the GPU has no rate for (Volta and Turing have no BF16, Pascal no tensor cores) is refused."""
    if dtype not in profile.matmul_flops_per_s:
        has = ", ".join(d for d in ("fp32", "fp16", "bf16") if d in profile.matmul_flops_per_s)
        raise UserError(f"device '{profile.name}' has no {dtype} rate in its profile (the GPU lacks it): use --dtype "
                        f"{has.replace(', ', ' or ')}")


def with_power_cap(profile: DeviceProfile, watts: float, name: str) -> DeviceProfile:
    """The profile's board run at ``watts``, below its nominal limit: its tensor-core work keeps the clock
    gpu.capped_clock_fraction gives."""
    if not profile.power_limit_w:
        raise UserError(f"--device {name}: '{profile.name}' gives no nominal power limit (power_limit_w) to cap "
                        "below; add it to the profile with its source")
    if not profile.idle_power_w < watts <= profile.power_limit_w:
        raise UserError(f"--device {name}: the cap must lie above the board's idle power ({profile.idle_power_w:g} W) "
                        f"and at most its nominal limit ({profile.power_limit_w:g} W)")
    return replace(profile, name=name, description=f"{profile.description}, capped at {watts:g} W",
                   power_cap_w=watts, sources={**profile.sources, "power_cap_w": f"--device {name}: the user's cap"})


def with_topology(profile: DeviceProfile, text: str | None) -> DeviceProfile:
    """The profile on the network ``--topology key=value,...`` describes (cost/topology.py), or as it is."""
    if not text:
        return profile
    if not (profile.intra_node_bytes_per_s and profile.inter_node_bytes_per_s):
        raise UserError(f"--topology: device '{profile.name}' has no interconnect figures to change; use a GPU "
                        "profile such as --device h100-sxm")
    from .topology import parse

    return replace(profile, topology=asdict(parse(text, profile.network())))


def _bad_topology(profile: DeviceProfile) -> str | None:
    if not isinstance(profile.topology, dict):
        return "topology must be a mapping of Topology's fields"
    if not (profile.intra_node_bytes_per_s and profile.inter_node_bytes_per_s):
        return None  # no network figures (CPU and measured profiles): no collectives to time (network.check_device)
    try:
        topology = profile.network()
    except TypeError as exc:
        return f"topology: {exc}"
    problem = check_topology(topology)
    return f"topology: {problem}" if problem else None


def _items(mapping) -> list:
    return list(mapping.items()) if isinstance(mapping, dict) else [("?", None)]


def _rows(table) -> list:
    return [row if isinstance(row, list) else [None] for row in table] if isinstance(table, list) else [[None]]


def measured_path(name: str) -> Path:
    """Where a measured profile is kept; ``cpu`` is keyed by torch version and thread count."""
    if name == "cpu":
        import torch  # only a CPU profile needs it: its rates depend on torch's build and threads

        name = f"cpu-torch{torch.__version__}-threads{torch.get_num_threads()}"
    return cache_dir() / "devices" / f"{name}.json"


def save(profile: DeviceProfile, path: Path) -> Path:
    """Write the profile atomically, through a temporary file created exclusively (mode 0600) in a
    folder checked as every cache folder is (store.py); OSError if it cannot be written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    store.check_folder(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(asdict(profile), indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
