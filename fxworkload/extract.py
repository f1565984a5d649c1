"""The extraction pipeline as one call: model argument in, Workload and its settings out.

A step captured before is read from the graph cache with the model's facts; such a run reads the
config.json as JSON and never imports transformers or the model's code.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata

import torch

from . import __version__
from .capture.attention import GpuTarget
from .capture.builtin import locate
from .cost import devices
from .cost.devices import DeviceProfile
from .dtypes import DTYPES, check_settings
from .errors import UserError
from .parallel.facts import ModelFacts
from .parallel.layout import Parallel, padded_vocab
from .parallel.layout import check as check_parallel
from .parallel.rank import RankWorkload, rank_workload
from .workload import cache as graph_cache
from .workload.table import Workload, recost


@dataclass
class Extraction:
    facts: ModelFacts
    workload: Workload  # the whole model on one tensor/expert-parallel rank (every layer, all stages)
    device: DeviceProfile
    settings: dict
    rank: RankWorkload  # the --stage rank's layer-level units and collectives
    model: str = field(default="", repr=False)  # the model argument, for ``spec``

    @functools.cached_property
    def spec(self):
        """The resolved ModelSpec (transformers config): resolved on first use, since a cached run needs none."""
        from .capture import models

        return _with_padded_vocab(models.resolve(self.model), self.settings["parallel"]["vocab_multiple"],
                                  self.settings["parallel"]["tp"])


def extract(model: str, batch: int = 1, seq: int | None = None, dtype: str = "fp32",
            grad_dtype: str | None = None, device: str = "a100-80gb", size_unit: str = "bytes",
            trace_on: str = "auto", use_cache: bool = True, every_layer: bool = False,
            progress: bool = False, parallel: Parallel | None = None) -> Extraction:
    """``trace_on`` is whose dispatch the graph follows: ``auto`` (the device profile's: a GPU profile
    records the fused attention kernel that GPU would choose), ``cpu`` or ``cuda`` (no GPU needed);
    ``every_layer`` traces all layers even where one layer could stand for all (see layers.py);
    ``batch`` is the micro-batch of one rank; with tp or ep > 1 the rank's share of the model is traced."""
    grad_dtype = grad_dtype or dtype
    parallel = parallel or Parallel()
    check_settings(batch, seq, dtype, grad_dtype)
    profile = load_device(device, say=print_progress if progress else None)
    gpu = trace_target(trace_on, profile)
    traced_on = "cpu" if gpu is None else f"cuda sm{gpu.arch[0]}{gpu.arch[1]} sdpa {'>'.join(gpu.priority)}"
    say = print_progress if progress else (lambda text: None)

    start = time.perf_counter()
    _, config_path, _ = locate(model)
    cache_key = graph_cache.key(_raw_config(config_path), batch, seq, dtype, grad_dtype, traced_on,
                                shards=(parallel.tp, parallel.ep), vocab_multiple=parallel.vocab_multiple,
                                every_layer=every_layer)
    cached = graph_cache.load(cache_key) if use_cache else None
    if cached is not None and isinstance(cached.facts, ModelFacts):
        say(f"read the captured step from the cache ({graph_cache.path_of(cache_key)})")
        check_parallel(parallel, cached.facts)
        workload, seq, facts = cached.workload, cached.seq, cached.facts
    else:
        workload, seq, facts = _capture(model, batch, seq, dtype, grad_dtype, gpu, every_layer, say, parallel)
        say(f"captured {len(workload.ops())} ops in {time.perf_counter() - start:.1f} s")
        if use_cache:
            graph_cache.save(cache_key, graph_cache.CachedStep(workload=workload, seq=seq, facts=facts))
    say(f"costing on {profile.name}...")
    workload = recost(workload, profile)
    settings = {"model": facts.name, "model_type": facts.model_type, "task": facts.task,
                "batch": batch, "seq": seq, "dtype": dtype, "grad_dtype": grad_dtype, "device": profile.name,
                "traced_on": traced_on, "size_unit": size_unit, "parallel": parallel.as_dict(),
                "fxworkload_version": __version__, "torch_version": torch.__version__,
                "transformers_version": metadata.version("transformers")}
    rank = rank_workload(facts, workload, parallel, batch, seq, dtype, grad_dtype)
    return Extraction(facts=facts, workload=workload, device=profile, settings=settings, rank=rank, model=model)


def _raw_config(path) -> dict:
    """config.json as JSON, for the cache key; a file transformers cannot read fails later, on capture."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {"unreadable": str(path)}
    return data if isinstance(data, dict) else {"not_an_object": str(path)}


def _capture(model, batch, seq, dtype, grad_dtype, gpu, every_layer, say, parallel):
    """Resolve with transformers, check the layout, and capture: (workload, seq, facts)."""
    from .capture import models
    from .capture.models import step_seq
    from .capture.trace import capture_training_step
    from .cost.flops import register_transformers_ops
    from .parallel import tensor_parallel
    from .parallel.facts import model_facts
    from .workload.layers import SHORT_LAYERS, fast_workload
    from .workload.table import build

    spec = _with_padded_vocab(models.resolve(model), parallel.vocab_multiple, parallel.tp)
    seq = step_seq(spec, seq)
    module = models.build_meta_model(spec, DTYPES[dtype])
    facts = model_facts(spec, module)
    check_parallel(parallel, facts)  # before any progress line: a bad layout is the only thing said
    say(f"built {spec.name} on the meta device ({dtype})")

    def prepare(module: torch.nn.Module) -> torch.nn.Module:
        return tensor_parallel.shard(module, tensor_parallel.plan_for(module), parallel.tp, parallel.ep)

    module = prepare(module)
    register_transformers_ops()
    if not every_layer and facts.layers > max(SHORT_LAYERS):
        say(f"capturing one training step (batch {batch}, seq {seq}) of 4- and 5-layer copies...")
        workload = fast_workload(spec, module, batch, seq, DTYPES[dtype], DTYPES[grad_dtype], gpu, prepare)
        if workload is not None:
            return workload, seq, facts
        say("its layers differ: capturing every layer...")
    else:
        say(f"capturing one training step (batch {batch}, seq {seq}), every layer...")
    capture = capture_training_step(module, batch, seq, gpu=gpu)
    return build(capture, module, None, DTYPES[grad_dtype]), seq, facts


def _with_padded_vocab(spec, vocab_multiple: int, tp: int):
    import copy
    from dataclasses import replace

    vocab = padded_vocab(Parallel(tp=tp, vocab_multiple=vocab_multiple), spec.config.vocab_size)
    if vocab == spec.config.vocab_size:
        return spec
    config = copy.deepcopy(spec.config)
    config.vocab_size = vocab
    return replace(spec, config=config)


def print_progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load_device(name: str, say=None) -> DeviceProfile:
    """The device profile; for ``cpu`` never calibrated on this machine, calibrate it first
    (profiles are only read in ``cost``: measuring is this layer's job)."""
    if name == "cpu" and not devices.exists("cpu"):
        from .measure.calibrate import measure

        (say or print_progress)("measuring this CPU once (run 'fxworkload calibrate' to redo it)...")
        profile = measure("cpu", "cpu")
        try:
            devices.save(profile, devices.measured_path("cpu"))
        except OSError:
            pass  # an unwritable cache only costs a new measurement next time
        return profile
    return devices.load(name)


TRACE_ON = ("auto", "cpu", "cuda")
REFERENCE_GPU = "h100-sxm"  # whose dispatch --trace-on cuda follows when --device is not a GPU


def trace_target(trace_on: str, profile: DeviceProfile) -> GpuTarget | None:
    """The GPU whose SDPA dispatch the trace follows, or None to dispatch as the CPU does."""
    if trace_on not in TRACE_ON:
        raise UserError(f"unknown --trace-on '{trace_on}': use auto (follow --device), cpu or cuda")
    if trace_on == "cpu" or (trace_on == "auto" and not profile.arch):
        return None
    gpu = profile if profile.arch else devices.load(REFERENCE_GPU)
    return GpuTarget(arch=gpu.compute_capability(), priority=tuple(gpu.sdpa_priority))
