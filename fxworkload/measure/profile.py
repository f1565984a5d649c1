"""Measure one training step node by node on real tensors, on this machine's CPU or GPU.

The step is the same captured joint graph that ``extract`` costs (same ops, same row names),
captured over fake tensors of the device it will run on and then run on real ones by an fx
Interpreter that times every op. On a GPU the timer is torch.profiler (``kernel_times``): each
node's GPU kernels as CUPTI recorded them, and its host dispatch beside them (a CUDA event pair
around one call would time the host's launch gap for a short kernel, not the kernel). On the CPU
it is ``perf_counter_ns`` around each call (``--timer profiler`` uses the profiler there too).
After warm-up, every op's median over ``repeat`` runs is kept, with its spread.

Before timing, the run is checked against the model itself: the loss and every parameter
gradient of the node-by-node run must equal a plain eager ``model(...).loss.backward()`` on the
same inputs with the same random seed (dropout masks included).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from .. import __version__

from ..capture import models
from ..capture.models import step_seq
from ..capture.trace import capture_training_step
from ..dtypes import DTYPES
from ..limits import check_settings
from ..errors import UserError
from ..progress import heartbeat
from ..cost.flops import register_transformers_ops
from . import kernel_times
from .profiler_trace import check_trace_reader
from .timing import Clock, describe, device_for
from ..workload.table import Workload, build

SEED = 0
# Largest gradient difference, relative to the gradient's largest magnitude, still called equal.
GRAD_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}


@dataclass(frozen=True)
class OpTiming:
    median_ns: float
    min_ns: float
    max_ns: float

    @classmethod
    def of(cls, samples_ns: list[float]) -> OpTiming:
        return cls(statistics.median(samples_ns), min(samples_ns), max(samples_ns))


@dataclass
class Measurement:
    spec: models.ModelSpec
    workload: Workload  # the rows of the step; its estimated times are 0
    timings: dict[str, OpTiming]  # fx node name -> its time
    verification: dict
    eager_step_ns: float  # median wall time of a plain eager training step, for reference
    settings: dict
    step_peak_bytes: int | None = None  # max_memory_allocated over an eager step (GPU only)
    dispatch: dict[str, OpTiming] | None = None  # fx node name -> its host time (profiler timer only)
    kernel_check: dict | None = None  # node kernels against the profiler's step total (GPU only)

    def op_ns(self, op) -> float:
        return self.timings[op.fx_name].median_ns


class NodeTimer(torch.fx.Interpreter):
    """Runs a graph and records how long each op took (its arguments are fetched before timing starts)."""

    def __init__(self, module: torch.fx.GraphModule, clock: Clock):
        super().__init__(module)
        self.clock = clock
        self.laps = {}

    def run_node(self, node: torch.fx.Node):
        if node.op != "call_function":
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        started = self.clock.start()
        result = node.target(*args, **kwargs)
        self.laps[node.name] = self.clock.stop(started)
        return result


MAX_RUNS = 1000
# The run holds the weights, the graph run's gradients and eager autograd's (the check): three
# copies of the parameters; and at least the logits, their softmax and its gradient per token.
PARAMETER_COPIES = 3
LOGIT_COPIES = 3


def check_memory(spec, dtype: torch.dtype, device: torch.device, tokens: int) -> None:
    """Refuse up front a step whose parameters and logits alone would not fit, instead of
    allocating for half a minute and dying with the allocator's error."""
    parameters = models.trainable_parameter_count(models.build_meta_model(spec, dtype))
    logits = tokens * (models.setting(spec.config, "vocab_size", 0) or 0)
    needed_bytes = (PARAMETER_COPIES * parameters + LOGIT_COPIES * logits) * dtype.itemsize
    available_bytes = _available_bytes(device)
    if available_bytes is not None and needed_bytes > available_bytes:
        raise UserError(f"{spec.name} has {parameters:,} parameters: profiling it needs at least "
                        f"{needed_bytes / 2 ** 30:.1f} GiB (its parameters x {PARAMETER_COPIES} and logits x {LOGIT_COPIES} "
                        f"in {str(dtype).removeprefix('torch.')}) "
                        f"but {device} has {available_bytes / 2 ** 30:.1f} GiB free; use a smaller model or "
                        "'fxworkload extract', which needs no weight memory")


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


TIMERS = ("auto", "clock", "profiler")


def profile(model: str, batch: int = 1, seq: int | None = None, dtype: str = "fp32", on: str = "auto",
            repeat: int = 5, warmup: int = 2, progress: bool = False, timer: str = "auto") -> Measurement:
    check_settings(batch, seq, dtype)
    if timer not in TIMERS:
        raise UserError(f"unknown --timer {timer!r}: use auto (the profiler on a GPU, the clock on a CPU), clock "
                        "or profiler")
    for name, value, least in (("repeat", repeat, 1), ("warmup", warmup, 0)):
        if value < least:
            raise UserError(f"--{name} must be at least {least}, got {value}")
        if value > MAX_RUNS:
            raise UserError(f"--{name} {value:,} exceeds {MAX_RUNS:,} runs: more add nothing to a median")
    device = device_for(on)
    if _by_profiler(timer, device):  # its per-node times are read back from the trace it records
        check_trace_reader()
    spec = models.resolve(model)
    seq = step_seq(spec, seq)
    phase = ["loading the model"]

    def say(text: str) -> None:
        if progress:
            phase[0] = text.rstrip(".")
            print(text, file=sys.stderr, flush=True)

    check_memory(spec, DTYPES[dtype], device, batch * seq)
    try:  # each phase says when it starts; a long one says it is still running every 10 s
        with heartbeat(lambda: f"still {phase[0]}") if progress else contextlib.nullcontext():
            return _measure(spec, batch, seq, dtype, device, repeat, warmup, say, timer)
    except (MemoryError, torch.OutOfMemoryError):
        raise OutOfMemory(spec, batch, seq, dtype, device) from None
    except RuntimeError as exc:
        if "out of memory" in str(exc) or "can't allocate memory" in str(exc):
            raise OutOfMemory(spec, batch, seq, dtype, device) from None
        raise


class OutOfMemory(UserError):
    """The step did not fit in the device's memory; the CLI adds what it needs (extract's figure)."""

    def __init__(self, spec, batch: int, seq: int, dtype: str, device: torch.device):
        free = _available_bytes(device)
        self.batch, self.seq, self.dtype = batch, seq, dtype
        super().__init__(f"profiling {spec.name} (batch {batch}, seq {seq}, {dtype}) ran out of memory on {device}"
                         f"{f' ({free / 2 ** 30:.1f} GiB free)' if free else ''}; use a smaller --batch or --seq, or "
                         "'fxworkload extract', which needs no memory for the model")


def _measure(spec, batch: int, seq: int, dtype: str, device: torch.device, repeat: int, warmup: int, say,
             timer: str) -> Measurement:
    source = "its checkpoint weights" if models.has_weights(spec) else f"random weights (seed {SEED})"
    module = models.build_real_model(spec, DTYPES[dtype], device, seed=SEED)
    say(f"loaded {spec.name} with {source} on {device} ({dtype})")
    say(f"capturing one training step (batch {batch}, seq {seq})...")
    capture = capture_training_step(module, batch, seq, device=device.type)
    register_transformers_ops()
    workload = build(capture, module, None, DTYPES[dtype])

    parameters = dict(module.named_parameters())
    values = [p.detach() for p in parameters.values()] + [b for _, b in module.named_buffers()]
    generator = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(0, models.setting(spec.config, "vocab_size"), (batch, seq), generator=generator).to(device)

    say("checking the node-by-node run against eager loss.backward()...")
    verification = verify(module, capture.graph_module, values, input_ids, list(parameters), dtype)
    clock = Clock(device)
    by_profiler = _by_profiler(timer, device)
    say(f"timing every op{' with torch.profiler' if by_profiler else ''}: {warmup} warm-up and {repeat} timed runs...")
    dispatch = kernel_check = None
    if by_profiler:
        timings, dispatch, kernel_check = profiled_ops(capture.graph_module, (values, input_ids), device, repeat, warmup)
    else:
        timings = time_ops(capture.graph_module, (values, input_ids), clock, repeat, warmup)
    eager_step_ns = clock.median_ns(lambda: _eager_step(module, input_ids), repeat=repeat, warmup=1)
    step_peak_bytes = measured_step_peak_bytes(module, input_ids, device)
    settings = {"model": spec.name, "model_type": spec.config.model_type, "task": spec.task, "batch": batch,
                "seq": seq, "dtype": dtype, "weights": source, "device": describe(device),
                "timer": _timer_name(by_profiler, device),
                "threads": torch.get_num_threads(), "repeat": repeat, "warmup": warmup,
                "fxworkload_version": __version__, "torch_version": torch.__version__,
                "transformers_version": transformers.__version__}
    return Measurement(spec=spec, workload=workload, timings=timings, verification=verification,
                       eager_step_ns=eager_step_ns, settings=settings, step_peak_bytes=step_peak_bytes,
                       dispatch=dispatch, kernel_check=kernel_check)


def _by_profiler(timer: str, device: torch.device) -> bool:
    return timer == "profiler" or (timer == "auto" and device.type == "cuda")


def _timer_name(by_profiler: bool, device: torch.device) -> str:
    if by_profiler:
        return "torch.profiler (CUPTI kernel time)" if device.type == "cuda" else "torch.profiler (host op ranges)"
    return "CUDA events" if device.type == "cuda" else "time.perf_counter_ns"


def profiled_ops(graph_module, inputs, device: torch.device, repeat: int, warmup: int):
    """Per node: its kernels' median time, its host dispatch's; and how the node kernels add up
    against the profiler's total of the step (None on a CPU)."""
    found = kernel_times.measure(graph_module, inputs, device, repeat, warmup)
    timings = {name: OpTiming.of(node.kernel_ns) for name, node in found.nodes.items()}
    dispatch = {name: OpTiming.of(node.dispatch_ns) for name, node in found.nodes.items()}
    check = None
    if found.gpu:
        check = {"node_kernel_ns": found.node_kernel_ns, "profiler_kernel_ns": found.step_kernel_ns,
                 "agreement": found.agreement, "tolerance": kernel_times.AGREEMENT_TOLERANCE,
                 "agrees": found.agrees, "steps": found.steps}
    return timings, dispatch, check


def measured_step_peak_bytes(module, input_ids, device: torch.device) -> int | None:
    """On a GPU, ``max_memory_allocated`` over one eager step with the gradients freed before it,
    above what was allocated at its start (the comparison for the estimate's step_peak_bytes);
    None on a CPU, where torch keeps no such counter."""
    if device.type != "cuda":
        return None
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    module(input_ids, labels=input_ids).loss.backward()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def time_ops(graph_module, inputs, clock: Clock, repeat: int, warmup: int) -> dict[str, OpTiming]:
    samples: dict[str, list[float]] = defaultdict(list)
    with torch.no_grad():
        for run in range(warmup + repeat):
            timer = NodeTimer(graph_module, clock)
            timer.run(*inputs)
            clock.sync()
            if run >= warmup:
                for name, lap in timer.laps.items():
                    samples[name].append(lap.ns)
    return {name: OpTiming.of(ns) for name, ns in samples.items()}


def verify(module, graph_module, values, input_ids, parameter_names, dtype: str) -> dict:
    """Loss and gradients of the captured graph vs. the eager model; UserError if they differ."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        graph_loss, graph_grads = graph_module(values, input_ids)
    torch.manual_seed(SEED)
    eager_loss = _eager_step(module, input_ids)
    parameters = dict(module.named_parameters())
    worst_name, worst = "", 0.0
    for name, grad in zip(parameter_names, graph_grads):
        reference = parameters[name].grad
        if reference is None or grad is None:
            if (reference is None) != (grad is None):
                raise UserError(f"the captured step and eager autograd disagree on whether '{name}' gets a gradient")
            continue
        scale = reference.abs().max().item() or 1.0
        difference = (grad.float() - reference.float()).abs().max().item() / scale
        if difference > worst:
            worst_name, worst = name, difference
    loss_difference = abs(graph_loss.item() - eager_loss.item()) / max(abs(eager_loss.item()), 1e-12)
    tolerance = GRAD_TOLERANCE[dtype]
    if worst > tolerance or loss_difference > tolerance:
        raise UserError(f"the node-by-node step does not reproduce eager autograd: relative loss difference "
                        f"{loss_difference:.2e}, gradient of '{worst_name}' differs by {worst:.2e} of its largest "
                        f"value (tolerance {tolerance:g}); please report this model")
    return {"graph_loss": graph_loss.item(), "eager_loss": eager_loss.item(),
            "loss_relative_difference": loss_difference, "max_gradient_relative_difference": worst,
            "worst_parameter": worst_name, "tolerance": tolerance, "equal": True}


def _eager_step(module, input_ids) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    loss = module(input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach()
