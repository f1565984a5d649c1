"""profile's profiler timer: kernels tied to fx nodes through their launches, host dispatch beside them.

No GPU here: a real CPU profile of an annotated graph run is turned into a CUDA-style trace by
giving every op that computes a kernel of a known duration, launched through cudaLaunchKernel and
linked by correlation id as Kineto writes them. The oracle is what was put in, summed by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxworkload.formats.tables import measured_json_text
from fxworkload.measure import kernel_times
from fxworkload.measure.profile import profile

from ..test_cli import fxworkload
from .cuda_events import NO_KERNEL, kernel, launch, write

def _step(x, w1, w2):
    hidden = torch.relu(x @ w1)
    return torch.softmax(hidden @ w2, -1).sum()


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    inputs = (torch.randn(32, 16), torch.randn(16, 64), torch.randn(64, 8))
    graph = make_fx(_step)(*inputs)
    path = tmp_path_factory.mktemp("kt") / "cpu.json"
    kernel_times.record(graph, inputs, torch.device("cpu"), repeat=3, warmup=1, path=path)
    return graph, path


def _ranges(document: dict) -> list[dict]:
    return [e for e in document["traceEvents"] if e.get("cat") == "user_annotation"
            and e["name"].startswith(kernel_times.NODE_MARK)]


def _with_kernels(path, out, outside_us: float) -> dict:
    """Every computing op a node calls launches one kernel (1–7 µs); each step also gets
    a kernel launched inside its ProfilerStep but outside any node range (``outside_us``), and the
    trace one kernel nothing launched. Returns kernel µs per (step start ts, node)."""
    document = json.loads(path.read_text())
    ops = sorted((e for e in document["traceEvents"] if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
                 key=lambda e: (e["ts"], -e["dur"]))
    ranges = _ranges(document)
    steps = sorted((e for e in document["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    outermost = [op for op in ops if not any(o is not op and o["ts"] <= op["ts"] and op["ts"] + op["dur"] <= o["ts"] + o["dur"]
                                             for o in ops)]
    expected, added, correlation = {}, [], 0

    def launch_at(parent: dict, ts: float, duration_us: float, name: str) -> None:
        nonlocal correlation
        correlation += 1
        added.extend(launch(parent, ts, 0.001, name, duration_us, correlation, kernel_ts=ts + 0.5))

    for op in outermost:
        if op["name"] in NO_KERNEL:
            continue
        node = next((r for r in ranges if r["ts"] <= op["ts"] and op["ts"] + op["dur"] <= r["ts"] + r["dur"]), None)
        if node is None:
            continue
        step = next(s for s in steps if s["ts"] <= op["ts"] <= s["ts"] + s["dur"])
        duration_us = 1.0 + (correlation % 7)
        launch_at(op, op["ts"] + op["dur"] / 2, duration_us, f"void kernel_{op['name']}")
        key = (step["ts"], node["name"].removeprefix(kernel_times.NODE_MARK))
        expected[key] = expected.get(key, 0.0) + duration_us
    for step in steps:
        inside = [r for r in ranges if step["ts"] <= r["ts"] <= step["ts"] + step["dur"]]
        gap = max(r["ts"] + r["dur"] for r in inside)
        launch_at(step, gap + 0.001, outside_us, "void outside_kernel")
    last = steps[-1]
    added.append(kernel("void orphan_kernel", last["ts"] + last["dur"] + 50, 9.0, 999999))
    write(document, added, out)
    return {"expected": expected, "steps": [s["ts"] for s in steps], "ranges": ranges}


def test_cpu_trace_gives_each_node_its_host_range(cpu_trace):
    graph, path = cpu_trace
    found = kernel_times.node_times(path)
    computing = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    assert list(found.nodes) == computing and found.steps == 3 and not found.gpu
    document = json.loads(path.read_text())
    for name, node in found.nodes.items():
        durations = sorted(1e3 * r["dur"] for r in _ranges(document) if r["name"] == kernel_times.NODE_MARK + name)
        assert sorted(node.dispatch_ns) == pytest.approx(durations) and node.kernel_ns == node.dispatch_ns
    assert found.agreement == 1.0


@pytest.mark.parametrize("outside_us", [0.01, 40.0])
def test_kernels_are_tied_to_the_node_that_launched_them(cpu_trace, tmp_path, outside_us):
    _, path = cpu_trace
    built = _with_kernels(path, tmp_path / "cuda.json", outside_us)
    found = kernel_times.node_times(tmp_path / "cuda.json")
    assert found.gpu and found.steps == 3
    for index, step_ts in enumerate(built["steps"]):
        for name, node in found.nodes.items():
            assert node.kernel_ns[index] == pytest.approx(1e3 * built["expected"].get((step_ts, name), 0.0))
    mm = found.nodes["mm"]
    assert mm.kernels == 1 and mm.kernel_ns[0] > 0 and mm.dispatch_ns[0] > mm.kernel_ns[0] / 1e3
    per_step = [sum(v for (ts, _), v in built["expected"].items() if ts == step_ts) for step_ts in built["steps"]]
    node_ns = 1e3 * sorted(per_step)[1]
    assert found.node_kernel_ns == pytest.approx(node_ns)
    # The kernel launched outside the node ranges counts in the step's total; the orphan, in no step.
    assert found.step_kernel_ns == pytest.approx(1e3 * sorted(p + outside_us for p in per_step)[1])
    assert found.agrees == (outside_us * 1e3 / (node_ns + outside_us * 1e3) <= kernel_times.AGREEMENT_TOLERANCE)


def test_profile_with_the_profiler_timer_times_every_node(tiny_dirs):
    result = profile(str(tiny_dirs["gpt2"]), batch=1, seq=8, on="cpu", repeat=2, warmup=1, timer="profiler")
    ops = result.workload.ops()
    assert {op.fx_name for op in ops} <= set(result.timings) and result.kernel_check is None
    assert all(result.dispatch[op.fx_name].median_ns > 0 for op in ops)
    document = json.loads(measured_json_text(result))
    forward = [r["forward"] for r in document["rows"] if r.get("forward")]
    assert forward and all(op["measured_dispatch_ns"] == op["measured_ns"] > 0 for op in forward)  # a CPU: no kernels
    assert document["totals"]["dispatch_sum_ns"] == pytest.approx(sum(t.median_ns for t in result.dispatch.values()))
    assert "torch.profiler" in result.settings["timer"]


def test_an_unknown_timer_is_one_line(tiny_dirs, tmp_path):
    run = fxworkload("profile", str(tiny_dirs["gpt2"]), "--seq", "8", "--timer", "events", "--out", tmp_path / "o")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "unknown --timer 'events'" in run.stderr
    assert not (tmp_path / "o").exists()
