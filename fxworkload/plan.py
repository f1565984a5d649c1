"""``fxworkload plan``: every parallel layout of a model on N GPUs, filtered by memory, ranked by step time.

A layout is TP x PP x DP (EP carved out of DP for a mixture of experts), with sequence
parallelism whenever TP > 1, a ZeRO stage, a micro-batch size, activation recomputation and
virtual pipeline stages. TP stays inside a node and divides the heads; PP divides the layers;
the global batch (in sequences) is micro-batch x micro-batches x DP.

The step of one micro-batch is captured once per distinct rank shape (TP, EP, micro-batch size;
the graph cache keeps it for later runs) and every layout of that shape is evaluated from it:
recomputation, the cluster's step (cluster/step.py) and each stage's memory. The shapes are
spread over a local process pool, or over a Ray cluster with ``ray`` (the engine for a sweep
that outgrows one machine): each shape is one task.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, replace

from .errors import UserError
from .limits import MAX_GLOBAL_BATCH, MAX_MICRO_BATCHES, MAX_WORLD, check_count
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


def candidate_layouts(gpus: int, global_batch: int, facts, gpus_per_node: int,
                      seq: int | None = None) -> tuple[dict, dict[str, int]]:
    """Shape -> its layouts (Parallel), and how many combinations each rule turned away. With ``seq``,
    a tp whose sequence parallelism cannot split the sequence is turned away too."""
    from .parallel.layout import Parallel

    dropped = {"tp does not divide the heads or exceeds a node": 0,
               "sequence parallelism: tp does not divide the sequence": 0, "global batch does not divide": 0,
               f"more than {MAX_MICRO_BATCHES:,} micro-batches": 0,
               "virtual stages do not divide the layers or micro-batches": 0}
    groups: dict[Shape, list] = {}
    experts = facts.experts or 1
    for tp, pp in itertools.product(_divisors(gpus), _divisors(facts.layers)):
        if gpus % (tp * pp):
            continue
        if tp > gpus_per_node or facts.heads % tp or (facts.kv_heads and facts.kv_heads % tp):
            dropped["tp does not divide the heads or exceeds a node"] += 1
            continue
        if seq is not None and tp > 1 and seq % tp:  # plan's layouts run SP whenever tp > 1
            dropped["sequence parallelism: tp does not divide the sequence"] += 1
            continue
        dp = gpus // (tp * pp)
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
                if vpp > 1 and (pp == 1 or facts.layers % (pp * vpp) or m % pp):
                    dropped["virtual stages do not divide the layers or micro-batches"] += 1
                    continue
                groups.setdefault(Shape(tp, ep, b), []).append(Parallel(
                    dp=dp, tp=tp, pp=pp, ep=ep, sp=tp > 1, micro_batches=m, zero=zero, recompute=recompute,
                    vpp=vpp, vocab_multiple=vocab_multiple))
    return groups, dropped


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def evaluate_shape(model: str, shape: Shape, layouts: list, seq: int, dtype: str, device: str,
                   stack: str = "eager", grad_dtype: str | None = None, fp8: bool = False) -> list[dict]:
    """Capture (or read from the cache) one rank shape and evaluate each of its layouts."""
    from .cluster.step import cluster_step
    from .dtypes import DTYPES
    from .parallel.memory import rank_memory
    from .parallel.recompute import with_recompute
    from .pipeline import extract

    first = layouts[0]
    grad_dtype = grad_dtype or dtype
    base = extract(model, batch=shape.micro_batch, seq=seq, dtype=dtype, grad_dtype=grad_dtype, device=device, stack=stack,
                   fp8=fp8,
                   parallel=replace(first, pp=1, vpp=1, pp_layers=None, micro_batches=1, zero=0, recompute="none",
                                    recompute_layers=None))
    facts, captured, profile = base.facts, base.model_workload, base.device
    seq = base.settings["seq_per_rank"]
    saved_bytes = captured.saved_bytes
    recomputed = {}
    rows = []
    for p in layouts:
        key = (p.recompute, p.recompute_layers, p.sp, p.vpp, p.pp, p.pp_layers)  # what with_recompute reads
        if key not in recomputed:
            layer_input = shape.micro_batch * seq * facts.hidden * DTYPES[dtype].itemsize // (p.tp if p.sp else 1)
            recomputed[key] = with_recompute(captured, p, facts.stack, facts.layers, layer_input)
        workload, regenerated = recomputed[key]
        step = cluster_step(facts, workload, captured, p, shape.micro_batch, seq, dtype, grad_dtype, profile)
        peak = 0
        for d in sorted({0, p.pp - 1}):  # the first stage holds the most micro-batches, the last the head
            memory = rank_memory(replace(p, stage=d), step.device_units[d], workload, dtype, grad_dtype, saved_bytes,
                                 regenerated, profile.memory_capacity_bytes)
            peak = max(peak, memory.total_peak_bytes)
        rows.append({"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "sp": p.sp, "vpp": p.vpp, "zero": p.zero,
                     "recompute": p.recompute, "recompute_layers": p.recompute_layers, "micro_batch": shape.micro_batch, "micro_batches": p.micro_batches,
                     "step_ms": step.step_ns / 1e6, "mfu": step.mfu, "hfu": step.hfu,
                     "step_low_ms": (step.step_interval_ns or (step.step_ns,) * 2)[0] / 1e6,
                     "step_high_ms": (step.step_interval_ns or (step.step_ns,) * 2)[1] / 1e6,
                     "tflops_per_gpu": step.tflops_per_gpu, "tokens_per_s_per_gpu": step.tokens_per_s_per_gpu,
                     "bubble": step.bubble_fraction, "peak_bytes": peak,
                     "exposed_gather_ms": step.exposed_ns["zero3_gather"] / 1e6,
                     "fits": peak <= profile.memory_capacity_bytes if profile.memory_capacity_bytes else None})
    return rows


def plan(model: str, gpus: int, global_batch: int, seq: int, device: str = "h100-sxm", dtype: str = "bf16",
         workers: int | None = None, ray: str | None = None, progress: bool = False, stack: str = "eager") -> dict:
    from .pipeline import load_device
    from .workload.stacks import check_stack

    check_plan_counts(gpus, global_batch)
    check_stack(stack)
    profile = load_device(device)
    if not (profile.intra_node_bytes_per_s and profile.inter_node_bytes_per_s and profile.memory_capacity_bytes):
        raise UserError(f"device '{profile.name}' lacks interconnect or memory figures a plan needs; use a GPU "
                        "profile such as --device h100-sxm")
    facts = _facts(model, dtype)
    groups, dropped = candidate_layouts(gpus, global_batch, facts, profile.gpus_per_node, seq)
    if not groups:
        raise UserError(f"no layout of {gpus} GPUs runs {facts.name} with global batch {global_batch}: tensor "
                        f"parallelism must divide its {facts.heads} heads within a node of {profile.gpus_per_node}, "
                        f"pipeline stages its {facts.layers} layers, and data parallelism x micro-batch the global "
                        "batch; choose a GPU count and batch those divide")
    rows = _run(model, groups, seq, dtype, device, workers, ray, progress, stack)
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: (r["step_ms"], -r["mfu"]))
    for row in fitting:  # within the best's error interval: the estimates cannot tell them apart
        row["overlaps_best"] = row["step_low_ms"] <= fitting[0]["step_high_ms"]
    dropped["does not fit in memory"] = sum(1 for r in rows if not r["fits"])
    return {"model": facts.name, "gpus": gpus, "global_batch": global_batch, "seq": seq, "dtype": dtype,
            "stack": stack, "device": profile.name, "evaluated": len(rows), "shapes": len(groups), "dropped": dropped,
            "ranked": fitting}


def check_plan_counts(gpus: int, global_batch: int) -> None:
    check_count("--gpus", gpus, MAX_WORLD)
    check_count("--global-batch", global_batch, MAX_GLOBAL_BATCH, "it counts sequences per step")


def _facts(model: str, dtype: str):
    from .capture import models
    from .dtypes import DTYPES
    from .parallel.facts import model_facts

    spec = models.resolve(model)
    return model_facts(spec, models.build_meta_model(spec, DTYPES[dtype]))


def _run(model, groups, seq, dtype, device, workers, ray_address, progress, stack) -> list[dict]:
    from tqdm import tqdm

    bar = tqdm(total=sum(len(v) for v in groups.values()), unit="layout", leave=False,
               disable=not (progress and sys.stderr.isatty()))  # a bar for a person, not for a log
    rows = []
    if ray_address is not None:
        ray = _ray(ray_address)
        task = ray.remote(evaluate_shape)
        pending = {task.remote(model, shape, layouts, seq, dtype, device, stack): len(layouts)
                   for shape, layouts in groups.items()}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            rows += ray.get(ready[0])
            bar.update(pending.pop(ready[0]))
    else:
        count = workers or min(len(groups), os.cpu_count() or 1)
        tasks = [(model, shape, layouts, seq, dtype, device, stack) for shape, layouts in groups.items()]
        # Pool.__exit__ terminates the workers: Ctrl-C, SIGTERM (Terminated) or an error here ends them at once
        total = sum(len(v) for v in groups.values())
        lines = progress and not on_terminal()  # a log gets a line at least every 10 s instead of the bar

        def status() -> str:
            return f"plan: {len(rows):,} of {total:,} layouts evaluated ({len(done)} of {len(tasks)} rank shapes)"

        done: list = []
        # After a SIGKILL of this process, Python's resource tracker (started for the spawn context) frees the
        # pool's semaphores and warns of each on the caller's stderr: freeing them is all that is wanted.
        quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
        if quiet not in sys.warnoptions:
            sys.warnoptions.append(quiet)  # passed to the tracker as -W when it starts
        # Pool.__exit__ terminates the workers: Ctrl-C, SIGTERM (Terminated) or an error here ends them at once.
        # Spawned, not forked: a fork of this threaded process (torch's, the caller's threads) can inherit a
        # lock another thread held and hang in the child.
        with multiprocessing.get_context("spawn").Pool(count, initializer=_worker_start) as pool, \
                (heartbeat(status) if lines else contextlib.nullcontext()):
            for part in pool.imap_unordered(_evaluate, tasks):
                rows += part
                done.append(part)
                bar.update(len(part))
    bar.close()
    return rows


def _evaluate(task: tuple) -> list[dict]:
    return evaluate_shape(*task)


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
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # a `| tee` or `$(...)` of the plan sees its end when the plan ends
        os.dup2(devnull, fd)

    def watch() -> None:  # where the kernel cannot tie the worker to its parent (not Linux)
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


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
    """Ray retries an unreachable head for a minute; a closed port is known at once."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        raise UserError(f"--ray {address}: cannot reach a Ray cluster there ({exc}); start one with "
                        "'ray start --head' or leave --ray out for a local process pool") from None
