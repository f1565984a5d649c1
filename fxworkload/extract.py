"""The extraction pipeline as one call: model argument in, Workload and its settings out."""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, replace

import torch
import transformers

from . import __version__, devices, graph_cache, models, tensor_parallel
from .capture import capture_training_step
from .devices import DTYPES, DeviceProfile
from .errors import UserError
from .flops import register_transformers_ops
from .layers import SHORT_LAYERS, fast_workload
from .parallel import Parallel, padded_vocab
from .parallel import check as check_parallel
from .rank import RankWorkload, rank_workload
from .timing import device_for
from .workload import Workload, build, recost


@dataclass
class Extraction:
    spec: models.ModelSpec
    workload: Workload  # the whole model on one tensor/expert-parallel rank (every layer, all stages)
    device: DeviceProfile
    settings: dict
    rank: RankWorkload  # the --stage rank's layer-level units and collectives


def extract(model: str, batch: int = 1, seq: int | None = None, dtype: str = "fp32",
            grad_dtype: str | None = None, device: str = "a100-80gb", size_unit: str = "bytes",
            trace_on: str = "cpu", use_cache: bool = True, every_layer: bool = False,
            progress: bool = False, parallel: Parallel | None = None) -> Extraction:
    """``trace_on`` is the device whose kernels the graph dispatches to (fused attention differs);
    ``every_layer`` traces all layers even where one layer could stand for all (see layers.py);
    ``batch`` is the micro-batch of one rank; with tp or ep > 1 the rank's share of the model is traced."""
    grad_dtype = grad_dtype or dtype
    parallel = parallel or Parallel()
    check_settings(batch, seq, dtype, grad_dtype)
    profile = devices.load(device)
    spec = _with_padded_vocab(models.resolve(model), parallel)
    seq = step_seq(spec, seq)
    check_parallel(parallel, spec.config)
    trace_device = device_for(trace_on)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)

    start = time.perf_counter()
    cache_key = graph_cache.key(spec.config, spec.task, batch, seq, dtype, grad_dtype, trace_device.type,
                                shards=(parallel.tp, parallel.ep))
    workload = graph_cache.load(cache_key) if use_cache else None
    if workload is not None:
        say(f"read the captured step from the cache ({graph_cache.path_of(cache_key)})")
    else:
        workload = _capture(spec, batch, seq, dtype, grad_dtype, trace_device.type, every_layer, say, parallel)
        say(f"captured {len(workload.ops())} ops in {time.perf_counter() - start:.1f} s")
        if use_cache:
            graph_cache.save(cache_key, workload)
    say(f"costing on {profile.name}...")
    workload = recost(workload, profile)
    settings = {"model": spec.name, "model_type": spec.config.model_type, "task": spec.task,
                "batch": batch, "seq": seq, "dtype": dtype, "grad_dtype": grad_dtype, "device": profile.name,
                "traced_on": trace_device.type, "size_unit": size_unit, "parallel": parallel.as_dict(),
                "fxworkload_version": __version__, "torch_version": torch.__version__,
                "transformers_version": transformers.__version__}
    rank = rank_workload(spec, workload, parallel, batch, seq, dtype, grad_dtype)
    return Extraction(spec=spec, workload=workload, device=profile, settings=settings, rank=rank)


def _capture(spec, batch, seq, dtype, grad_dtype, trace_device, every_layer, say, parallel) -> Workload:
    say(f"building {spec.name} on the meta device ({dtype})...")

    def prepare(module: torch.nn.Module) -> torch.nn.Module:
        return tensor_parallel.shard(module, tensor_parallel.plan_for(module), parallel.tp, parallel.ep)

    module = prepare(models.build_meta_model(spec, DTYPES[dtype]))
    register_transformers_ops()
    if not every_layer and (getattr(spec.config, "num_hidden_layers", None) or 0) > max(SHORT_LAYERS):
        say(f"capturing one training step (batch {batch}, seq {seq}) of 4- and 5-layer copies...")
        workload = fast_workload(spec, module, batch, seq, DTYPES[dtype], DTYPES[grad_dtype], trace_device, prepare)
        if workload is not None:
            return workload
        say("its layers differ: capturing every layer...")
    else:
        say(f"capturing one training step (batch {batch}, seq {seq}), every layer...")
    capture = capture_training_step(module, batch, seq, device=trace_device)
    return build(capture, module, None, DTYPES[grad_dtype])


def _with_padded_vocab(spec: models.ModelSpec, parallel: Parallel) -> models.ModelSpec:
    vocab = padded_vocab(parallel, spec.config.vocab_size)
    if vocab == spec.config.vocab_size:
        return spec
    config = copy.deepcopy(spec.config)
    config.vocab_size = vocab
    return replace(spec, config=config)


def check_settings(batch: int, seq: int | None, dtype: str, grad_dtype: str | None = None) -> None:
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be a positive integer, got {value}")
    for name, value in (("dtype", dtype), ("grad-dtype", grad_dtype)):
        if value is not None and value not in DTYPES:
            raise UserError(f"unknown --{name} '{value}': use one of {', '.join(DTYPES)}")


def step_seq(spec: models.ModelSpec, seq: int | None) -> int:
    """The sequence length of the step: the one asked for, else min(1024, the model's limit)."""
    limit = models.max_positions(spec.config)
    seq = seq or min(1024, limit or 1024)
    if limit is not None and seq > limit:
        raise UserError(f"--seq {seq} exceeds {spec.name}'s max_position_embeddings ({limit}); use a shorter --seq")
    return seq
