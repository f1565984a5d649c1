"""Per-node times from torch.profiler: every fx node's GPU kernels (CUPTI) and its host dispatch.

The captured step runs under ``torch.profiler`` with each call_function node inside a
``record_function`` range named ``fx::<node>``. The trace torch exports is read back with
HolisticTraceAnalysis (as ``compare`` reads a user's trace): HTA ties every kernel to the runtime
call that launched it (its correlation id), and that call sits inside the range of the node that
made it. Per node and per profiled step:

- ``kernel_ns``: the summed duration of the GPU kernels, copies and memsets the node launched;
- ``dispatch_ns``: the node's range on the host, from the call into the op to its return (the
  dispatcher, allocator and kernel launches: the host's share of an eager step).

A CPU trace has no kernels: there a node's time is its host range. What the node ranges hold is
checked against the profiler's own total of the step's kernels; kernels no node launched are
reported, not spread.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from .profiler_trace import GPU_CATEGORIES, Event, read_events

NODE_MARK = "fx::"
# The share of the profiler's kernel time that must lie in node ranges for the per-node figures to
# stand for the step (the acceptance: the sums agree within 2 %).
AGREEMENT_TOLERANCE = 0.02


@dataclass(frozen=True)
class NodeKernels:
    kernel_ns: list[float]  # per profiled step
    dispatch_ns: list[float]
    kernels: int  # kernels one run of the node launched (its first profiled step)


@dataclass(frozen=True)
class KernelTimes:
    nodes: dict[str, NodeKernels]
    step_kernel_ns: float  # median over steps of every kernel the profiler recorded in the step
    node_kernel_ns: float  # median over steps of the kernels inside node ranges
    steps: int
    gpu: bool

    @property
    def agreement(self) -> float:
        """The node ranges' kernel time as a share of the profiler's (1.0 on a CPU trace)."""
        return self.node_kernel_ns / self.step_kernel_ns if self.step_kernel_ns else 1.0

    @property
    def agrees(self) -> bool:
        return abs(1.0 - self.agreement) <= AGREEMENT_TOLERANCE


class AnnotatedRun(torch.fx.Interpreter):
    """Runs a graph with every op inside a profiler range named after its node."""

    def run_node(self, node: torch.fx.Node):
        if node.op != "call_function":
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        with torch.profiler.record_function(NODE_MARK + node.name):
            return node.target(*args, **kwargs)


def record(graph_module: torch.fx.GraphModule, inputs: tuple, device: torch.device, repeat: int, warmup: int,
           path: Path) -> None:
    """Run the graph warmup + repeat times under the profiler (only the last ``repeat`` recorded,
    each a ProfilerStep) and export the Chrome trace to ``path``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=repeat, repeat=1)
    with torch.no_grad(), torch.profiler.profile(activities=activities, schedule=schedule) as profiler:
        for _ in range(warmup + repeat):
            AnnotatedRun(graph_module).run(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            profiler.step()
    profiler.export_chrome_trace(str(path))


def measure(graph_module, inputs: tuple, device: torch.device, repeat: int, warmup: int) -> KernelTimes:
    with tempfile.TemporaryDirectory(prefix="fxworkload-profile-") as folder:
        path = Path(folder) / "trace.json"
        record(graph_module, inputs, device, repeat, warmup, path)
        return node_times(path)


def node_times(path: Path) -> KernelTimes:
    """Each ``fx::`` range's kernels and host time per ProfilerStep of the trace at ``path``."""
    events, _ = read_events(path)
    gpu = any(e.category in GPU_CATEGORIES for e in events)
    ranges = [e for e in events if e.category == "user_annotation" and e.name.startswith(NODE_MARK)]
    steps = sorted({e.step for e in ranges})
    kernel = {step: defaultdict(float) for step in steps}
    launched = {step: defaultdict(int) for step in steps}
    step_total = defaultdict(float)
    for event in events:
        if event.category not in GPU_CATEGORIES:
            continue
        node = _enclosing_range(event)
        step = node.step if node is not None else _launch_step(event)
        step_total[step] += event.dur_ns
        if node is not None:
            kernel[step][node.name] += event.dur_ns
            launched[step][node.name] += 1
    dispatch = {step: defaultdict(float) for step in steps}
    for event in ranges:
        dispatch[event.step][event.name] += event.dur_ns
    nodes = {}
    for name in dict.fromkeys(e.name for e in ranges):  # events come in time order: the graph's order
        host = [dispatch[s][name] for s in steps]
        device_ns = [kernel[s][name] for s in steps] if gpu else host
        nodes[name.removeprefix(NODE_MARK)] = NodeKernels(device_ns, host, launched[steps[0]][name] if steps else 0)
    if gpu:
        step_kernel_ns = statistics.median(step_total[s] for s in steps) if steps else 0.0
        node_kernel_ns = statistics.median(sum(kernel[s].values()) for s in steps) if steps else 0.0
    else:
        step_kernel_ns = node_kernel_ns = 0.0
    return KernelTimes(nodes, step_kernel_ns, node_kernel_ns, len(steps), gpu)


def _enclosing_range(event: Event) -> Event | None:
    parent = event.parent
    while parent is not None:
        if parent.category == "user_annotation" and parent.name.startswith(NODE_MARK):
            return parent
        parent = parent.parent
    return None


def _launch_step(event: Event) -> int:
    """The ProfilerStep a kernel belongs to: its launching call's, else its own."""
    return event.parent.step if event.parent is not None else event.step
