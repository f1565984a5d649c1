"""``fxworkload plan``: every parallel layout of a model on N GPUs, filtered by memory, ranked by step time.

A layout is TP x CP x PP x DP (EP carved out of DP for a mixture of experts), with sequence
parallelism whenever TP > 1, a ZeRO stage, a micro-batch size, activation recomputation and
virtual pipeline stages, on each device asked for. TP stays inside a node and divides the heads;
CP is one of the degrees asked for (``--cp``) and splits the sequence into 2·CP chunks; PP is any
divisor of the GPUs up to the layer count, with layers / PP each or, where that does not divide,
Llama 3's uneven split (the stages at both ends one layer short); the global batch (in sequences) is
micro-batch x micro-batches x DP.

The step of one micro-batch is captured once per distinct rank shape (TP, EP, CP, micro-batch size;
the graph cache keeps it for later runs) and every layout of that shape is evaluated from it:
recomputation, the cluster's step (cluster/step.py) and each stage's memory; what a layout shares
with others of its shape (a device's passes, its gradient buckets) is computed once. Each shape's
evaluated rows are cached too, keyed by everything they depend on (the config, the layouts, the
device profile, this package's source): a plan asked again reads them without importing torch.
The shapes left are spread over a local process pool, or over a Ray cluster with ``ray`` (the
engine for a sweep that outgrows one machine): each shape is one task.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import itertools
import json
import multiprocessing
import multiprocessing.pool
import os
import signal
import socket
import sys
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .errors import UserError
from .memo import Memo
from .limits import MAX_GLOBAL_BATCH, MAX_MICRO_BATCHES, MAX_WORLD, check_count, check_workers, cores
from .progress import heartbeat, on_terminal

MICRO_BATCH_SIZES = (1, 2, 4, 8)
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")
VIRTUAL_STAGES = (1, 2, 4)


@dataclass(frozen=True)
class Shape:
    """What a capture depends on: the rank's share of the model and its micro-batch."""
    tp: int
    ep: int
    micro_batch: int
    cp: int = 1  # the rank holds seq / cp tokens


@dataclass(frozen=True)
class Run:
    """What is trained and how, the same for every layout searched (Calculon's application and execution):
    the model on ``gpus`` GPUs, the global batch (sequences) and sequence, dtype, stack, FP8, and the options
    every layout runs with or is also tried with."""
    model: str
    gpus: int
    global_batch: int
    seq: int | None = None  # None: no layout is turned away for how it splits the sequence
    dtype: str = "bf16"
    stack: str = "eager"
    cps: tuple[int, ...] = (1,)  # the context-parallel degrees searched
    fp8: bool = False
    overlap_param_gather: bool = False  # every ZeRO 1/2 layout overlaps its parameter gathers (Megatron-LM's flag)
    tp_comm_overlap: bool = False  # every layout with tp > 1 overlaps its blocks' TP collectives with their GEMMs
    offload: bool = False  # every ZeRO 1-3 layout is also tried with its optimizer on the host (cluster/offload.py)
    cuda_graphs: str = "none"  # every layout replays its layers or its step from CUDA graphs (workload/cuda_graphs.py)
    sdpa_backends: tuple[str, ...] | None = None  # the attention kernels enabled (torch.nn.attention.sdpa_kernel)
    attention: str | None = None  # transformers' attention implementation (sdpa, eager, flex); None: the model's
    ep_comm: str = "alltoall"  # how every layout's MoE tokens reach their experts (Parallel.ep_comm)
    fp8_recipe: str = "te"  # with fp8: how its GEMMs are scaled (workload/fp8.py)


@dataclass(frozen=True)
class Systems:
    """Where it may run: each device profile asked for (its memory and its network, the user's ``--topology``
    applied), each the ``System`` (cost/system.py) of the layouts evaluated on it."""
    profiles: tuple
    topology: str | None = None

    def system(self, device: str):
        from .cost.system import System

        return System(device, self.topology)


def candidate_layouts(run: Run, facts, gpus_per_node: int, domain_gpus: int | None = None
                      ) -> tuple[dict, dict[str, int]]:
    """Shape -> its layouts (Parallel), and how many combinations each rule turned away. With the run's
    ``seq``, a tp whose sequence parallelism cannot split the sequence is turned away too. ``domain_gpus``:
    the GPUs an NVLink domain joins (default: a node's), which ZeRO 3's reshard_after_forward=N tries as N."""
    from .parallel.layout import Parallel

    gpus, global_batch, seq = run.gpus, run.global_batch, run.seq

    dropped = {"tp does not divide the heads or exceeds a node": 0,
               "sequence parallelism: tp does not divide the sequence": 0,
               "context parallelism: 2 x cp does not divide the sequence": 0, "global batch does not divide": 0,
               f"more than {MAX_MICRO_BATCHES:,} micro-batches": 0,
               "virtual stages do not divide the layers or micro-batches": 0}
    groups: dict[Shape, list] = {}
    experts = facts.experts or 1
    stages = [pp for pp in _divisors(gpus) if pp <= facts.layers]
    for tp, cp, pp in itertools.product(_divisors(gpus), run.cps, stages):
        if gpus % (tp * cp * pp) or (cp > 1 and facts.experts):
            continue
        if tp > gpus_per_node or facts.heads % tp or (facts.kv_heads and facts.kv_heads % tp):
            dropped["tp does not divide the heads or exceeds a node"] += 1
            continue
        if seq is not None and cp > 1 and seq % (2 * cp):
            dropped["context parallelism: 2 x cp does not divide the sequence"] += 1
            continue
        if seq is not None and tp > 1 and (seq // cp) % tp:  # plan's layouts run SP whenever tp > 1
            dropped["sequence parallelism: tp does not divide the sequence"] += 1
            continue
        dp = gpus // (tp * cp * pp)
        pp_layers = uneven_stages(facts.layers, pp)
        vocab_multiple = 1 if facts.vocab % tp == 0 else 128  # pad as Megatron-LM does
        for ep, b in itertools.product([e for e in _divisors(dp) if experts % e == 0], MICRO_BATCH_SIZES):
            if ep > 1 and not facts.experts:
                continue
            if global_batch % (dp * b):
                dropped["global batch does not divide"] += 1
                continue
            m = global_batch // (dp * b)
            if m > MAX_MICRO_BATCHES:
                dropped[f"more than {MAX_MICRO_BATCHES:,} micro-batches"] += 1
                continue
            for zero, recompute, vpp in itertools.product(ZERO_STAGES, RECOMPUTE, VIRTUAL_STAGES):
                fits_chunks = min(pp_layers) >= vpp if pp_layers else facts.layers % (pp * vpp) == 0
                if vpp > 1 and (pp == 1 or not fits_chunks or m % pp):
                    dropped["virtual stages do not divide the layers or micro-batches"] += 1
                    continue
                tries = itertools.product(_offloads(run.offload, zero, pp, recompute, facts.layers),
                                          fsdp2_options(zero, dp * cp, tp, ep, m, domain_gpus or gpus_per_node))
                for (share, layers), (reshard, summed) in tries:
                    groups.setdefault(Shape(tp, ep, b, cp), []).append(Parallel(
                        dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, sp=tp > 1, micro_batches=m, zero=zero, recompute=recompute,
                        vpp=vpp, vocab_multiple=vocab_multiple, pp_layers=pp_layers,
                        overlap_param_gather=run.overlap_param_gather and zero in (1, 2),
                        tp_comm_overlap=run.tp_comm_overlap and tp > 1, optimizer_offload=share,
                        activation_offload_layers=layers, cuda_graphs=run.cuda_graphs, ep_comm=run.ep_comm,
                        reshard_after_forward=reshard, accumulate_unsharded=summed))
    return groups, dropped


def fsdp2_options(zero: int, replicas: int, tp: int, ep: int, micro_batches: int, domain_gpus: int
                  ) -> list[tuple[bool | int, bool]]:
    """(reshard_after_forward, accumulate_unsharded) to try for one layout: under ZeRO 3, FSDP2's choices a run
    makes for its memory and network (parallel/layout.py): the gathered parameters freed after forward (its
    default), kept to backward (False), or kept sharded over an NVLink domain's ranks (N, where FSDP2 allows it:
    no tensor- or expert-parallel DTensors, N dividing a data-parallel group wider than N); with gradient
    accumulation, each of those with the gradients summed unsharded until the last micro-batch too."""
    from .parallel.layout import Parallel, post_forward_problem

    if zero != 3:
        return [(True, False)]
    reshards: list[bool | int] = [True, False]
    sharded = Parallel(dp=replicas, tp=tp, ep=ep, zero=3, reshard_after_forward=domain_gpus)
    if domain_gpus < replicas and post_forward_problem(sharded) is None:  # N = the group: FSDP2's True
        reshards.append(domain_gpus)
    return list(itertools.product(reshards, (False, True) if micro_batches > 1 else (False,)))


def _offloads(offload: bool, zero: int, pp: int, recompute: str, layers: int) -> list[tuple[float, int]]:
    """(optimizer share on the host, decoder layers whose activations go to the host) to try for one layout: with
    --offload, the whole optimizer where ZeRO shards it, and where Megatron-Core allows activation offload (one
    stage, no recomputation) a quarter, half, three quarters or all but one of the layers."""
    tries = [(0.0, 0)]
    if offload and zero:
        tries.append((1.0, 0))
    if offload and pp == 1 and recompute == "none":
        tries += [(0.0, n) for n in sorted({max(1, layers * k // 4) for k in (1, 2, 3)} | {layers - 1}) if 0 < n < layers]
    return tries


def uneven_stages(layers: int, pp: int) -> tuple[int, ...] | None:
    """None where pp divides the layers; else the Llama 3 paper's split: every stage layers // pp or one
    more, the shorter stages at both ends (the embedding's and the head's), e.g. 126 on 16: 7, 8 x 14, 7."""
    if layers % pp == 0:
        return None
    base, extra = divmod(layers, pp)
    short = pp - extra
    ends = [base] * ((short + 1) // 2), [base] * (short // 2)
    return (*ends[0], *[base + 1] * extra, *ends[1])


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def evaluate_shape(model: str, shape: Shape, layouts: list, execution, system, time_unfit: bool = True) -> list[dict]:
    """Capture (or read from the cache) one rank shape and evaluate each of its layouts, run as ``execution``
    (parallel/execution.py: its sequence, dtypes, stack, FP8, attention; the shape's micro-batch and each
    layout replace its own) on ``system`` (cost/system.py): its memory first, then, where it fits (or with
    ``time_unfit``), its step. A layout that does not fit gets no step figures (None): a plan ranks only
    those that fit, and most layouts of a large model do not."""
    with _collector_paused():
        return _evaluate_shape(model, shape, layouts, replace(execution, batch=shape.micro_batch), system, time_unfit)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while a shape is captured and evaluated: each of its
    automatic collections scans the objects made since the last (the capture's graph, the tables, the
    units and steps the search's caches keep: hundreds of thousands a shape) and they took half of a
    layout search's time; what they would free is a few MB a shape (the capture's graph cycles)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _evaluate_shape(model, shape, layouts, execution, system, time_unfit) -> list[dict]:
    from .dtypes import DTYPES
    from .parallel.recompute import with_recompute
    from .pipeline import extract

    first = layouts[0]
    base = extract(model, replace(execution, parallel=replace(
        first, pp=1, vpp=1, pp_layers=None, micro_batches=1, zero=0, recompute="none", recompute_layers=None)),
        system, rank_view=False)
    facts, captured, profile, execution = base.facts, base.workload, base.device, base.execution
    seq, dtype = execution.seq_per_rank, execution.dtype
    recomputed, steps = {}, {}
    rows = []
    for p in layouts:
        key = (p.recompute, p.sp) + ((p.recompute_layers, p.vpp, p.pp, p.pp_layers) if p.recompute_layers else ())
        if key not in recomputed:
            layer_input = shape.micro_batch * seq * facts.hidden * DTYPES[dtype].itemsize // (p.tp if p.sp else 1)
            recomputed[key] = with_recompute(captured, p, facts.stack, facts.layers, layer_input)
        workload, regenerated = recomputed[key]
        layout = replace(execution, parallel=p)
        peak, host_fits = _peak_bytes(facts, workload, captured, layout, regenerated, profile)
        fits = peak <= profile.memory_capacity_bytes and host_fits if profile.memory_capacity_bytes else None
        row = _layout_fields(p, profile.name, shape, execution.fp8) | {"peak_bytes": peak, "fits": fits}
        if fits is False and not time_unfit:
            rows.append(row | dict.fromkeys(STEP_FIGURES))
            continue
        # ZeRO 1 and 2 run the same collectives at the same points (a reduce-scatter per bucket, the updated
        # parameters' all-gather): one step; they differ in what each rank keeps (its memory above)
        same_step = (key, replace(p, zero=1) if p.zero == 2 else p)
        if same_step not in steps:
            steps[same_step] = _step(facts, workload, captured, layout, profile)
        rows.append(row | steps[same_step])
    return rows


# a layout's step figures: None for one that does not fit where only those that fit are timed
STEP_FIGURES = ("parts_ms", "step_ms", "mfu", "hfu", "step_low_ms", "step_high_ms", "tflops_per_gpu",
                "tokens_per_s_per_gpu", "bubble", "exposed_gather_ms", "slowest_gpu_step_ms")
_ROW_KEYS = {"device", "tp", "cp", "pp", "pp_layers", "dp", "ep", "sp", "vpp", "zero", "fp8", "recompute",
             "recompute_layers", "micro_batch", "micro_batches", "optimizer_offload", "activation_offload_layers",
             "reshard_after_forward", "accumulate_unsharded", "peak_bytes", "fits",
             *STEP_FIGURES}


_FLAT = Memo(4096)  # a device's units in one list, once per chunks: rank_memory sums each list once


def _peak_bytes(facts, workload, captured, execution, regenerated, profile) -> tuple[int, bool]:
    """The layout's GPU memory at its peak (the first stage holds the most micro-batches, the last the head), and
    whether what it offloads fits in the GPU's share of the host's memory."""
    from .parallel.memory import rank_memory
    from .parallel.rank import model_parallel_chunks

    p, micro_batch, seq = execution.parallel, execution.batch, execution.seq_per_rank
    dtype, grad_dtype = execution.dtype, execution.gradients
    peak, host_fits = 0, True
    for d in sorted({0, p.pp - 1}):
        chunks = model_parallel_chunks(facts, workload, p, d, micro_batch, seq, dtype)
        units = _FLAT.get(id(chunks), (chunks,), lambda: [u for chunk in chunks for u in chunk])
        memory = rank_memory(replace(p, stage=d), units, workload, dtype, grad_dtype, captured.saved_bytes,
                             regenerated, profile.memory_capacity_bytes, profile.host_memory_capacity_bytes)
        peak, host_fits = max(peak, memory.total_peak_bytes), host_fits and memory.host_fits
    return peak, host_fits


def _step(facts, workload, captured, execution, profile) -> dict:
    from .cluster.step import cluster_step

    step = cluster_step(facts, workload, captured, execution, profile, alike=True)
    low, high = step.step_interval_ns or (step.step_ns,) * 2
    figures = {"parts_ms": _parts_ms(step), "step_ms": step.step_ns / 1e6, "mfu": step.mfu, "hfu": step.hfu,
               "step_low_ms": low / 1e6, "step_high_ms": high / 1e6, "tflops_per_gpu": step.tflops_per_gpu,
               "tokens_per_s_per_gpu": step.tokens_per_s_per_gpu, "bubble": step.bubble_fraction,
               "exposed_gather_ms": step.exposed_ns["zero3_gather"] / 1e6,
               "slowest_gpu_step_ms": step.slowest_gpu_step_ns / 1e6}
    return figures


def _parts_ms(step) -> dict[str, float]:
    """The step's time by what it is spent on (ms): the busiest device's compute, the blocking collectives
    per group, the pipeline bubble, and what the data-parallel side leaves exposed."""
    exposed = step.exposed_ns
    blocking = exposed["tp"] + exposed["cp"] + exposed["ep"]
    busiest = max(step.devices, key=lambda d: d.compute_ns)
    copies = exposed.get("zero3_copies", 0.0)  # FSDP2's copy kernels: on the compute stream, in compute_ns
    offload = exposed.get("activation_offload", 0.0)  # the passes' waits on activation copies: in compute_ns too
    host = exposed.get("host", 0.0)  # the GPU waiting on the host (dispatch, FSDP2's hooks): in compute_ns too
    parts = {"compute": busiest.compute_ns + busiest.bucket_slowdown_ns - blocking - copies - offload - host,
             "host": host, "activation offload": offload, "tp": exposed["tp"],
             "cp": exposed["cp"], "ep": exposed["ep"], "bubble": exposed["pp_bubble"], "dp": exposed["dp"],
             "zero gathers": exposed["zero_gather"] + exposed["zero3_gather"], "fsdp copies": copies,
             "optimizer": exposed["optimizer"]}
    return {name: ns / 1e6 for name, ns in parts.items()}


def plan(model: str, gpus: int, global_batch: int, seq: int, device: str = "h100-sxm", dtype: str = "bf16",
         workers: int | None = None, ray: str | None = None, progress: bool = False, stack: str = "eager",
         cp: tuple[int, ...] = (1,), fp8: bool = False, topology: str | None = None,
         overlap_param_gather: bool = False, tp_comm_overlap: bool = False, offload: bool = False,
         cuda_graphs: str = "none", sdpa_backends: tuple[str, ...] | None = None, attention: str | None = None,
         ep_comm: str = "alltoall", fp8_recipe: str = "te") -> dict:
    """``device``: one profile name or several, comma-separated (every layout is evaluated on each);
    ``cp``: the context-parallel degrees to search; ``fp8``: every layout trains in FP8 (workload/fp8.py), its GEMMs
    scaled as ``fp8_recipe`` says;
    ``topology``: ``--topology key=value,...`` over each device's own network (cost/topology.py);
    ``overlap_param_gather``: ZeRO 1/2 layouts overlap their parameter gathers with the next forward;
    ``tp_comm_overlap``: layouts with tp > 1 overlap their blocks' TP collectives with the GEMMs;
    ``offload``: every ZeRO layout is also tried with its optimizer stepped on the host (cluster/offload.py);
    ``cuda_graphs``: none, layers or step: what every layout replays from CUDA graphs (workload/cuda_graphs.py);
    ``sdpa_backends``: the attention kernels every layout's run enables (None: all, in the profile's order);
    ``attention``: transformers' attention implementation every layout runs (None: the model's default);
    ``ep_comm``: alltoall or deepep, how every layout's MoE tokens reach their experts (Parallel.ep_comm)."""
    from .capture.sdpa_backends import check_attention, check_sdpa_backends
    from .parallel.execution import Execution
    from .parallel.layout import Parallel, check_values
    from .workload.stacks import check_stack

    check_plan_counts(gpus, global_batch)
    check_workers(workers)
    check_stack(stack)
    check_values(Parallel(cuda_graphs=cuda_graphs, ep_comm=ep_comm))
    check_sdpa_backends(sdpa_backends)
    check_attention(attention)
    # an unknown recipe, or one without --fp8: said before any worker starts
    Execution(dtype=dtype, fp8=fp8, fp8_recipe=fp8_recipe).checked()
    run = Run(model, gpus, global_batch, seq, dtype, stack, check_cp_degrees(cp), fp8, overlap_param_gather,
              tp_comm_overlap, offload, cuda_graphs, sdpa_backends, attention, ep_comm, fp8_recipe)
    systems = Systems(tuple(_plan_device(name, fp8, dtype, topology) for name in _device_names(device)), topology)
    if offload:
        from .cluster.offload import check_host_tier

        for profile in systems.profiles:
            check_host_tier(profile)
    if ray is not None:
        _probe(ray)  # a wrong address is said now, even when every shape is read from the cache
    _raw_config(model)  # an unknown model is said before any worker starts
    with contextlib.ExitStack() as stack_of_resources:
        # A model not seen before will be captured: the workers start at once, and the first one ready
        # reads the model's facts (this process never imports torch, which the workers have anyway).
        early = (stack_of_resources.enter_context(_pool(workers or cores()))
                 if ray is None and not _facts_cached(model, dtype) else None)
        result = _plan(run, systems, workers, ray, progress, early)
    return result | ({"topology": topology} if topology else {}) | (
        {"overlap_param_gather": True} if overlap_param_gather else {}) | (
        {"tp_comm_overlap": True} if tp_comm_overlap else {}) | ({"optimizer_offload": True} if offload else {}) | (
        {"cuda_graphs": cuda_graphs} if cuda_graphs != "none" else {}) | (
        {"sdpa_backends": list(sdpa_backends)} if sdpa_backends is not None else {}) | (
        {"attention": attention} if attention is not None else {}) | (
        {"ep_comm": ep_comm} if ep_comm != "alltoall" else {}) | (
        {"fp8_recipe": fp8_recipe} if fp8 else {})


def _plan(run: Run, systems: Systems, workers, ray, progress, early) -> dict:
    model, gpus, global_batch, seq, dtype, profiles = (run.model, run.gpus, run.global_batch, run.seq, run.dtype,
                                                       systems.profiles)
    if early is not None:
        facts = early.apply(_facts, (model, dtype))
    else:
        with _signals_held():
            facts = _facts(model, dtype)
    from .parallel.facts import check_positions

    check_positions(facts, seq)  # every CP degree's ranks together hold the whole sequence
    groups, dropped = {}, {}
    for profile in profiles:
        found, turned = candidate_layouts(run, facts, profile.gpus_per_node, profile.network().nvlink_domain_gpus)
        groups.update({(profile.name, shape): layouts for shape, layouts in found.items()})
        dropped = {why: dropped.get(why, 0) + count for why, count in turned.items()}
    if not groups:
        raise UserError(f"no layout of {gpus} GPUs runs {facts.name} with global batch {global_batch}: tensor "
                        f"parallelism must divide its {facts.heads} heads within a node of {profiles[0].gpus_per_node}, "
                        f"pipeline stages at most its {facts.layers} layers, and data parallelism x micro-batch the "
                        "global batch; choose a GPU count and batch those divide")
    settings = {"seq": seq, "dtype": dtype, "stack": run.stack, "fp8": run.fp8, "fp8_recipe": run.fp8_recipe,
                "topology": systems.topology,
                "sdpa_backends": run.sdpa_backends, "attention": run.attention, "devices": {p.name: asdict(p) for p in profiles}, "config": _raw_config(model)}
    rows = _run(model, groups, settings, _execution(run), systems, workers, ray, progress, early)
    fitting = sorted((r for r in rows if r["fits"]), key=rank_key)
    for row in fitting:  # within the best's error interval: the estimates cannot tell them apart
        row["overlaps_best"] = row["step_low_ms"] <= fitting[0]["step_high_ms"]
    dropped["does not fit in memory"] = sum(1 for r in rows if not r["fits"])
    return {"model": facts.name, "gpus": gpus, "global_batch": global_batch, "seq": seq, "dtype": dtype, "fp8": run.fp8,
            "stack": run.stack, "device": ",".join(p.name for p in profiles), "cp": list(run.cps), "evaluated": len(rows),
            "shapes": len(groups), "dropped": dropped, "ranked": fitting,
            "why": why_best(fitting) + network_lines(fitting[:1], profiles) + fsdp_lines(fitting),
            **({"offload": offload_lines(fitting, rows)} if run.offload else {})}


def _order(row: dict) -> tuple:
    """A total order among layouts of equal time: the same ranking on every run and machine."""
    return tuple(str(row.get(k)) for k in ("device", "tp", "cp", "pp", "vpp", "dp", "ep", "zero", "recompute",
                                           "micro_batch", "reshard_after_forward", "accumulate_unsharded"))


CHOICES = ("device", "tp", "cp", "pp", "vpp", "ep", "zero", "recompute", "micro_batch", "optimizer_offload",
           "activation_offload_layers", "reshard_after_forward", "accumulate_unsharded")
OFFLOADS = ("optimizer_offload", "activation_offload_layers")
FSDP2_CHOICES = ("reshard_after_forward", "accumulate_unsharded")  # ZeRO 3's only (fsdp2_options)
TIE_MS = 0.5  # step times closer than this are a tie: the summary prints whole milliseconds


def rank_key(row: dict) -> tuple:
    """Fastest first; a tie (within a microsecond) goes to the layout holding less memory, then to the simpler
    one: fewer model-parallel dimensions, a lower ZeRO stage, less recomputation, fewer virtual stages."""
    return (round(row["step_ms"], 3), row["peak_bytes"], _simplicity(row), _order(row))


def _simplicity(row: dict) -> tuple:
    dimensions = sum(1 for k in ("tp", "cp", "pp", "ep") if row.get(k, 1) > 1)
    reshard = row.get("reshard_after_forward", True)  # FSDP2's default first, then kept, then an int
    return (dimensions, row["zero"], RECOMPUTE.index(row["recompute"]) if row["recompute"] in RECOMPUTE else
            len(RECOMPUTE), row["vpp"], row.get("optimizer_offload", 0.0), row.get("activation_offload_layers", 0),
            0 if reshard is True else 1 if reshard is False else 2, row.get("accumulate_unsharded", False))


def why_best(ranked: list[dict]) -> list[str]:
    """Why the best layout wins, one line per decision: against the fastest layout that differs from it in
    that choice alone (tp, cp, pp, vpp, ep, ZeRO, recomputation, micro-batch, device, FSDP2's options), the parts
    of the step that make the difference, or, where the two tie, the memory or simplicity that decided. Where no
    layout differs in that choice alone because FSDP2's options exist only beside some choices (ZeRO 3, tp 1),
    the fastest that differs in it and in those options."""
    if not ranked:
        return []
    best, lines = ranked[0], []
    for choice in (c for c in CHOICES if c in best):
        others = [r for r in ranked[1:] if r.get(choice) != best[choice]]
        other = next((r for r in others if all(r.get(c) == best.get(c) for c in CHOICES if c != choice)), None)
        if other is None and choice not in FSDP2_CHOICES:  # e.g. tp 2 against reshard 8, which FSDP2 refuses there
            other = next((r for r in others if all(r.get(c) == best.get(c) for c in CHOICES
                                                   if c != choice and c not in FSDP2_CHOICES)), None)
        if other is not None:
            lines.append(f"{choice} {best[choice]} over {other[choice]}: " + _difference(best, other, choice))
    return lines


def _difference(best: dict, other: dict, choice: str) -> str:
    slower_ms = other["step_ms"] - best["step_ms"]
    if slower_ms < TIE_MS:
        saved_gib = (other["peak_bytes"] - best["peak_bytes"]) / 2 ** 30
        because = f"{saved_gib:.1f} GiB less memory" if saved_gib >= 0.05 else "the simpler layout"
        return f"as fast (within {TIE_MS} ms); {because}"
    parts = {k: other["parts_ms"][k] - best["parts_ms"][k] for k in best["parts_ms"]}
    biggest = sorted(parts.items(), key=lambda kv: -abs(kv[1]))[:2]
    said = ", ".join(f"{name} {'+' if ms >= 0 else '-'}{abs(ms):.0f} ms" for name, ms in biggest if abs(ms) >= 0.5)
    return f"the best {choice} {other[choice]} layout is {slower_ms:.0f} ms slower ({said or 'by rounding'})"


def fsdp_lines(ranked: list[dict]) -> list[str]:
    """What FSDP costs the fastest ZeRO 3 layout (FSDP2 as cluster/zero3.py runs it): the compute waiting for
    parameter gathers, the copy kernels on the compute stream and the GPU waiting on the host, against its step."""
    from .formats.plan_text import fsdp2_text

    best = next((r for r in ranked if r.get("zero") == 3), None)
    if best is None:
        return []
    rank = ranked.index(best) + 1
    parts = best["parts_ms"]
    return [f"fsdp: the best ZeRO 3 layout (#{rank}: tp {best['tp']} cp {best['cp']} pp {best['pp']} dp {best['dp']}, "
            f"recompute {best['recompute']}, mbs {best['micro_batch']}, {fsdp2_text(best)}) waits {parts['zero gathers']:.0f} ms for "
            f"parameter gathers, spends {parts.get('fsdp copies', 0.0):.0f} ms in FSDP2's copy kernels and "
            f"{parts.get('host', 0.0):.0f} ms waiting on the host (its dispatch and FSDP2's hooks) of its {best['step_ms']:.0f} ms step"]


def offload_lines(ranked: list[dict], rows: list[dict]) -> list[str]:
    """Which layouts only offload makes fit, and what it costs the best of them: its step against its twin's
    (the same layout with nothing on the host, which does not fit), what the host's part of each is."""
    from .formats.plan_text import offloaded

    def twin_key(row: dict) -> tuple:
        return tuple(str(row.get(k)) for k in (*CHOICES, "dp", "pp_layers", "recompute_layers") if k not in OFFLOADS)

    on_gpu = {twin_key(r): r for r in rows if not offloaded(r)}
    made_fit = [(r, on_gpu[twin_key(r)]) for r in ranked
                if offloaded(r) and twin_key(r) in on_gpu and on_gpu[twin_key(r)]["fits"] is False]
    if not made_fit:
        count = sum(1 for r in ranked if offloaded(r))
        return [f"offload: makes no layout fit that does not fit without it ({count:,} offloaded layouts fit)"]
    best, twin = made_fit[0]
    rank = ranked.index(best) + 1
    over_gib = (twin["peak_bytes"] - best["peak_bytes"]) / 2 ** 30
    by_optimizer = sum(1 for r, _ in made_fit if r.get("optimizer_offload"))
    what = (f"{best['activation_offload_layers']} layers' activations" if best.get("activation_offload_layers")
            else "the optimizer")
    lines = [f"offload: {len(made_fit):,} layouts fit only with something on the host ({by_optimizer:,} the optimizer, "
             f"{len(made_fit) - by_optimizer:,} activations); the best of them (#{rank}: tp {best['tp']} cp {best['cp']} "
             f"pp {best['pp']} dp {best['dp']} zero {best['zero']}, recompute {best['recompute']}, mbs "
             f"{best['micro_batch']}, {what} on the host) holds {over_gib:.1f} GiB less on the GPU"]
    part, name = (("activation offload", "waiting for activation copies") if best.get("activation_offload_layers")
                  else ("optimizer", "the optimizer on the host"))
    if twin["step_ms"] is not None:
        lines.append(f"offload: its step {best['step_ms']:.0f} ms against {twin['step_ms']:.0f} ms on the GPU "
                     f"({part} {best['parts_ms'].get(part, 0.0):.0f} ms against {twin['parts_ms'].get(part, 0.0):.0f} ms)")
    else:
        lines.append(f"offload: its step {best['step_ms']:.0f} ms, {best['parts_ms'].get(part, 0.0):.0f} ms of it {name}")
    if ranked and not offloaded(ranked[0]):
        lines.append(f"offload: the fastest layout keeps everything on the GPU ({ranked[0]['step_ms']:.0f} ms)")
    return lines


def network_lines(best: list[dict], profiles) -> list[str]:
    """Where the best layout's gradients travel: its data-parallel group's NVLink domains and what the network
    gives it there (cluster/network.py: the group's ranks per domain, each with one GPU's share of its node's NICs)."""
    from .cluster.network import bus_bytes_per_s, group_layout, nvlink_bus_bytes_per_s
    from .parallel.layout import Parallel

    if not best:
        return []
    row = best[0]
    profile = next(p for p in profiles if p.name == row["device"])
    topology = profile.network()
    ranks, domains = group_layout("dp", Parallel(dp=row["dp"], tp=row["tp"], cp=row["cp"], pp=row["pp"]),
                                  topology.nvlink_domain_gpus)
    if ranks <= 1:
        return []
    bus = bus_bytes_per_s(ranks, domains, profile) / 1e9
    if domains == 1:
        return [f"network: the data-parallel group of {ranks} stays inside an NVLink domain: {bus:.0f} GB/s"]
    per_domain = ranks // domains
    capped = " (capped by NVLink)" if bus * 1e9 >= nvlink_bus_bytes_per_s(topology) * 0.999 and per_domain > 1 else ""
    unit = "node" if topology.nvlink_domain_gpus == topology.gpus_per_node else "NVLink domain"
    share_gbs = topology.nic_share_bytes_per_s / 1e9  # a GPU's share of its node's NICs, whatever their count
    return [f"network: dp {ranks} over {domains} {unit}s, {per_domain} rank{'s' if per_domain > 1 else ''} a {unit}, "
            f"each with one GPU's share of its node's NICs ({share_gbs:.1f} GB/s): {bus:.0f} GB/s{capped}"]


def check_cp_degrees(cp) -> tuple[int, ...]:
    values = (cp,) if isinstance(cp, int) else tuple(cp)
    if not values:
        raise UserError("--cp names no degree: give one or more, e.g. --cp 1,2,4")
    for value in values:
        check_count("--cp", value, MAX_WORLD)
    return tuple(sorted(set(values)))


def _device_names(device: str) -> list[str]:
    """Comma-separated profile names, each exactly a name (no space, newline or path around it)."""
    from .cost.devices import check_name

    names = device.split(",") if device else []
    if not any(names):
        raise UserError("--device names no profile: give one or more, e.g. --device h100-sxm,b200")
    return list(dict.fromkeys(check_name(name) for name in names))


def _plan_device(name: str, fp8: bool, dtype: str, topology: str | None = None):
    from .cost import devices

    profile = devices.load(name) if name != "cpu" else _cpu_profile()
    if not (profile.intra_node_bytes_per_s and profile.inter_node_bytes_per_s and profile.memory_capacity_bytes):
        raise UserError(f"device '{profile.name}' lacks interconnect or memory figures a plan needs; use a GPU "
                        "profile such as --device h100-sxm")
    profile = devices.with_topology(profile, topology)
    devices.check_dtype(profile, dtype)
    if fp8:
        from .workload.fp8_recipes import check_fp8

        check_fp8(profile, dtype)
    return profile


def _cpu_profile():
    from .pipeline import load_device

    return load_device("cpu")


def check_plan_counts(gpus: int, global_batch: int) -> None:
    check_count("--gpus", gpus, MAX_WORLD)
    check_count("--global-batch", global_batch, MAX_GLOBAL_BATCH, "it counts sequences per step")


def _signals_held():
    """Ctrl-C, SIGTERM and SIGHUP wait while the model is built: a KeyboardInterrupt raised inside torch's or
    transformers' C++ code aborts the process (pybind11's error_already_set, the pool's workers left behind);
    they are remembered and stop the run as soon as the build is done (seconds)."""
    from .errors import signals_held

    return signals_held()


FACTS_KIND, ROWS_KIND = "model-facts", "plan-rows"


def _facts_entry(model: str, dtype: str):
    """Where the model's facts are cached, and the key their entry must carry."""
    from .store import cache_dir

    key = _key({"config": _raw_config(model), "dtype": dtype})
    return cache_dir() / "facts" / f"{key}.json", key


def _cached_facts(model: str, dtype: str):
    """The model's facts from the cache, or None (absent, or not facts written for this model: store.py)."""
    from . import store
    from .parallel.facts import ModelFacts
    from .records import RecordError, decode

    path, key = _facts_entry(model, dtype)
    data = store.read(path, FACTS_KIND, key)
    if data is None:
        return None
    try:
        return decode(data, ModelFacts, "facts")
    except RecordError as exc:
        store.note(f"cache: {path} does not hold a model's facts ({exc}): not used, the model is built again")
        return None


def _facts_cached(model: str, dtype: str) -> bool:
    return _cached_facts(model, dtype) is not None


def _facts(model: str, dtype: str):
    """The model's facts, kept in the cache by its config: a plan asked again builds no model."""
    cached = _cached_facts(model, dtype)
    if cached is not None:
        return cached
    from . import store
    from .capture import models
    from .dtypes import DTYPES
    from .parallel.facts import model_facts
    from .records import encode

    spec = models.resolve(model)
    facts = model_facts(spec, models.build_meta_model(spec, DTYPES[dtype]))
    path, key = _facts_entry(model, dtype)
    store.write(path, FACTS_KIND, key, encode(facts))
    return facts


def _raw_config(model: str) -> dict:
    from .capture.builtin import locate

    _, config_path, _ = locate(model)
    try:
        return json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {"unreadable": str(config_path)}


def _key(material: dict) -> str:
    from .fingerprint import versions

    text = json.dumps(material | versions(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _rows_entry(task: tuple, settings: dict):
    """Where a shape's evaluated rows are cached, and the key their entry must carry."""
    from .store import cache_dir

    model, (device, shape), layouts = task[:3]
    material = {k: v for k, v in settings.items() if k != "devices"} | {
        "device": settings["devices"][device], "shape": asdict(shape), "layouts": [p.as_dict() for p in layouts]}
    key = _key(material)
    return cache_dir() / "plans" / f"{key}.json", key


# a timed row's step figures (all None in a row not timed: a layout that does not fit)
_ROW_STEP = {"step_ms", "mfu", "hfu", "step_low_ms", "step_high_ms", "tflops_per_gpu", "tokens_per_s_per_gpu",
             "bubble", "exposed_gather_ms", "slowest_gpu_step_ms"}


def _cached_rows(entry, task: tuple) -> list[dict] | None:
    """A shape's rows from the cache if they are the rows of exactly its layouts on its device, else None."""
    from . import store

    path, key = entry
    rows = store.read(path, ROWS_KIND, key)
    if rows is None:
        return None
    (device, shape), layouts = task[1], task[2]
    problem = _rows_problem(rows, layouts, device, shape, task[3].fp8)
    if problem:
        store.note(f"cache: {path} does not hold this shape's rows ({problem}): not used, the shape is evaluated again")
        return None
    return rows


def _rows_problem(rows, layouts, device: str, shape, fp8: bool) -> str | None:
    """What makes ``rows`` not the evaluated rows of ``layouts`` (in order), or None."""
    if not isinstance(rows, list) or len(rows) != len(layouts):
        return f"{len(rows) if isinstance(rows, list) else 'no'} rows for {len(layouts)} layouts"
    for i, (row, p) in enumerate(zip(rows, layouts)):
        if not isinstance(row, dict) or set(row) != _ROW_KEYS:
            return f"row {i} has other fields than a plan row"
        expected = _layout_fields(p, device, shape, fp8)
        if any(row[k] != v or type(row[k]) is not type(v) for k, v in expected.items()):
            return f"row {i} is not layout {i}"
        if not _number(row["peak_bytes"]) or not isinstance(row["fits"], (bool, type(None))):
            return f"row {i}'s memory is not a number"
        timed = row["step_ms"] is not None
        if timed and not (all(_number(row[k]) for k in _ROW_STEP) and isinstance(row["parts_ms"], dict)
                          and all(isinstance(k, str) and _number(v) for k, v in row["parts_ms"].items())):
            return f"row {i}'s step figures are not numbers"
        if not timed and (row["fits"] or any(row[k] is not None for k in (*_ROW_STEP, "parts_ms"))):
            return f"row {i} fits but has no step"
    return None


def _layout_fields(p, device: str, shape, fp8: bool) -> dict:
    """A row's fields that say which layout it is (as _evaluate_shape writes them)."""
    return {"device": device, "tp": p.tp, "cp": p.cp, "pp": p.pp,
            "pp_layers": list(p.pp_layers) if p.pp_layers else None, "dp": p.dp, "ep": p.ep, "sp": p.sp,
            "vpp": p.vpp, "zero": p.zero, "fp8": fp8, "recompute": p.recompute,
            "recompute_layers": p.recompute_layers, "micro_batch": shape.micro_batch,
            "micro_batches": p.micro_batches, "optimizer_offload": p.optimizer_offload,
            "activation_offload_layers": p.activation_offload_layers,
            "reshard_after_forward": p.reshard_after_forward, "accumulate_unsharded": p.accumulate_unsharded}


def _number(value) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _execution(run: Run):
    """What every layout of the search runs with (each shape's micro-batch and each layout replace theirs)."""
    from .parallel.execution import Execution

    return Execution(seq=run.seq, dtype=run.dtype, stack=run.stack, fp8=run.fp8, fp8_recipe=run.fp8_recipe,
                     sdpa_backends=run.sdpa_backends, attention=run.attention)


def _run(model, groups, settings, execution, systems: Systems, workers, ray_address, progress, early=None
         ) -> list[dict]:
    """Every shape's rows, read from the cache or evaluated; ``early``: a pool already started, used if any
    shape is left to evaluate."""
    from tqdm import tqdm

    total = sum(len(v) for v in groups.values())
    bar = tqdm(total=total, unit="layout", leave=False,
               disable=not (progress and sys.stderr.isatty()))  # a bar for a person, not for a log
    rows, tasks = [], []
    for (device, shape), layouts in groups.items():
        task = (model, (device, shape), layouts, execution, systems.system(device))
        path = _rows_entry(task, settings)
        cached = _cached_rows(path, task)
        if cached is None:
            tasks.append((task, path))
            continue
        rows += cached
        bar.update(len(cached))
    # the shapes with the most layouts first (longest processing time first): the last ones to finish are
    # short, so the workers end together (the ranking does not depend on the order)
    tasks.sort(key=lambda item: -len(item[0][2]))
    if ray_address is not None and tasks:
        ray = _ray(ray_address)
        remote = ray.remote(_evaluate)
        pending = {remote.remote(task): (task, path) for task, path in tasks}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            part = ray.get(ready[0])
            rows += _kept(part, pending.pop(ready[0])[1])
            bar.update(len(part))
    elif tasks:
        count = workers or min(len(tasks), cores())
        lines = progress and not on_terminal()  # a log gets a line at least every 10 s instead of the bar
        done: list = []

        def status() -> str:
            return f"plan: {len(rows):,} of {total:,} layouts evaluated ({len(done)} of {len(tasks)} rank shapes)"

        with (contextlib.nullcontext(early) if early is not None else _pool(count)) as pool, \
                (heartbeat(status) if lines else contextlib.nullcontext()):
            paths = [path for _, path in tasks]
            for index, part in pool.imap_unordered(_evaluate_indexed, list(enumerate(task for task, _ in tasks))):
                rows += _kept(part, paths[index])
                done.append(index)
                bar.update(len(part))
    bar.close()
    return rows


def _pool(count: int):
    # After a SIGKILL of this process, Python's resource tracker (started for the spawn context) frees the
    # pool's semaphores and warns of each on the caller's stderr: freeing them is all that is wanted.
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)  # passed to the tracker as -W when it starts
    # Pool.__exit__ terminates the workers: Ctrl-C, SIGTERM (Terminated) or an error here ends them at once.
    # Spawned, not forked: a fork of this threaded process (torch's, the caller's threads) can inherit a
    # lock another thread held and hang in the child. (A fork server that imports torch once and forks the
    # workers from it starts them no sooner on two cores, where the spawned workers import side by side.)
    from .errors import signals_held

    made = []
    try:  # a stop signal waits for the pool to be whole (Pool.__init__ cleans up after an Exception only)...
        with _children_quiet(), signals_held():
            made.append(_WorkersOnce(count, initializer=_worker_start, context=multiprocessing.get_context("spawn")))
    except BaseException:  # ...and then ends it: no worker, thread or finalizer of it outlives the run
        for pool in made:
            pool.terminate()
            pool.join()
        raise
    return made[0]


class _WorkersOnce(multiprocessing.pool.Pool):
    """A pool whose workers are all started with it, and none later. multiprocessing's pool replaces a worker
    that exited from its handler thread, at any instant (also while the plan stops: the new process then
    finds its parent's semaphores gone and prints Python's traceback on the caller's stderr). A plan's workers
    never exit on their own (no maxtasksperchild), and a replacement would not run a lost task again anyway."""

    @staticmethod
    def _maintain_pool(ctx, Process, processes, pool, inqueue, outqueue, initializer, initargs, maxtasksperchild,
                       wrap_exception):
        multiprocessing.pool.Pool._join_exited_workers(pool)  # reaped, not replaced


@contextlib.contextmanager
def _children_quiet():
    """Processes started in the block (the pool's workers, multiprocessing's resource tracker) get /dev/null
    for stdout and stderr from their first instant: a worker whose parent stops while it is still reading its
    start-up data from it (multiprocessing's spawn_main, before the initializer runs) would print Python's
    EOFError traceback on the caller's stderr, and would hold the caller's pipe while it does."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:  # no fd 1 or 2 to hide
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def _kept(rows: list[dict], entry) -> list[dict]:
    from . import store

    store.write(*entry[:1], ROWS_KIND, entry[1], rows)
    return rows


def _evaluate_indexed(item: tuple) -> tuple[int, list[dict]]:
    index, task = item
    return index, _evaluate(task)


def _evaluate(task: tuple) -> list[dict]:
    model, (_, shape), layouts, execution, system = task
    return evaluate_shape(model, shape, layouts, execution, system, time_unfit=False)


def _worker_start() -> None:
    """A pool worker lives only as long as the plan that started it, and never holds its caller's pipes:
    the parent ends it (SIGTERM from Pool.terminate: the default action, not our handler), Ctrl-C at a
    terminal reaches the parent alone, and a parent killed outright takes its workers with it."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "SIGHUP"):  # a closed terminal ends the workers with the plan
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # a `| tee` or `$(...)` of the plan sees its end when the plan ends
        os.dup2(devnull, fd)

    def watch() -> None:  # where the kernel cannot tie the worker to its parent (not Linux)
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    # torch and transformers now, not with the first task: both workers import side by side while the
    # model's facts wait for one of them (transformers' modeling_utils alone is about a second: what
    # building any model imports lazily, torch.distributed.tensor among it)
    for module in ("fxworkload.pipeline", "fxworkload.capture.models", "transformers.modeling_utils"):
        importlib.import_module(module)
    # A worker lives for one plan: its cyclic garbage (a few MB per shape: _collector_paused) goes with it.
    gc.disable()


def _die_with_parent() -> None:
    """Linux's PR_SET_PDEATHSIG: the kernel sends SIGKILL to this process when its parent dies."""
    import ctypes

    try:  # the C library already loaded in this process: no search, no subprocess
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
    except (OSError, AttributeError, TypeError):
        pass


def _ray(address: str):
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install 'fxworkload[ray]'") from None
    if not ray.is_initialized():
        _probe(address)
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(f"--ray {address}: cannot reach a Ray cluster there ({str(exc).splitlines()[0][:100]}); "
                            "start one with 'ray start --head' or leave --ray out for a local process pool") from None
    return ray


def _probe(address: str) -> None:
    """Ray retries an unreachable head for a minute; a closed port is known at once. ``auto`` is the cluster
    this machine is part of, found as Ray finds it (RAY_ADDRESS, else the address ``ray start`` leaves in
    the temporary folder); ``local`` starts one in this process; ``ray://host:port`` is a Ray Client server."""
    if address == "local":
        return
    ray = sys.modules.get("ray")
    if address == "auto" and ray is not None and ray.is_initialized():
        return  # this process is already connected (a library caller's ray.init)
    target = _auto_address() if address == "auto" else address.removeprefix("ray://")
    if not target:
        raise UserError("--ray auto: no Ray cluster runs on this machine (no RAY_ADDRESS, and 'ray start' has "
                        "not left an address); start one with 'ray start --head' or leave --ray out for a local "
                        "process pool")
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError, OverflowError) as exc:
        raise UserError(f"--ray {address}: cannot reach a Ray cluster there ({exc}); start one with "
                        "'ray start --head' or leave --ray out for a local process pool") from None


def _auto_address() -> str | None:
    """The address ``ray.init(address='auto')`` would use: Ray's own lookup (RAY_ADDRESS, the address
    ``ray start`` leaves in its temporary folder, a running GCS server), else None."""
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment("auto", None).removeprefix("ray://")
    except ImportError:
        raise UserError("--ray needs Ray: pip install 'fxworkload[ray]'") from None
    except (ConnectionError, AttributeError, TypeError, ValueError):
        pass
    import tempfile

    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"].removeprefix("ray://")
    root = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    try:
        return (Path(root) / "ray" / "ray_current_cluster").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None
