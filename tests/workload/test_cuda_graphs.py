"""CUDA graphs (workload/cuda_graphs.py): what the host issues and what the GPU runs, against timelines
worked by hand from the ops' own figures."""

from __future__ import annotations

import pytest

from fxworkload.cost import devices
from fxworkload.cost.gpu import two_stream_ns
from fxworkload.errors import UserError
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract
from fxworkload.workload.layers import layer_of

from ..conftest import tiny_config

LAYERS = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs-llama")
    tiny_config("llama", num_hidden_layers=LAYERS).save_pretrained(path)
    return str(path)


def _run(path, scope):
    return extract(path, batch=2, seq=16, dtype="bf16", device="h100-sxm", parallel=Parallel(cuda_graphs=scope))


def test_a_whole_step_graph_is_one_launch_then_the_kernels_back_to_back(llama):
    eager, graphed = _run(llama, "none"), _run(llama, "step")
    launch_ns = devices.load("h100-sxm").gpu_model().host_graph_launch_ns
    ops = graphed.workload.execution_order()
    assert sum(op.dispatch_ns for op in ops) == launch_ns  # the host: one replay, nothing per op
    # the GPU: each kernel as eager times it, less the back-to-back cuBLAS floor (gemm_min_ns): the GEMMs
    # this small all sat on the floor eagerly, and none does replayed
    model = devices.load("h100-sxm").gpu_model()
    eager_gemms = [op for op in eager.workload.execution_order() if op.gemm_mkn is not None and op.gemm_leading]
    graphed_gemms = [op for op in ops if op.gemm_mkn is not None and op.gemm_leading]
    assert eager_gemms and all(op.estimated_ns == model.gemm_min_ns for op in eager_gemms)
    assert all(op.estimated_ns < model.gemm_min_ns for op in graphed_gemms)
    others = [(a, b) for a, b in zip(eager.workload.execution_order(), ops) if a.gemm_mkn is None]
    assert all(a.estimated_ns == b.estimated_ns for a, b in others)
    # the timeline by hand: the GPU starts when the launch is issued and never waits again
    kernels = sum(op.estimated_ns for op in ops)
    assert graphed.workload.totals["step_estimated_ns"] == pytest.approx(launch_ns + kernels)


def test_per_layer_graphs_launch_twice_a_layer_and_leave_the_rest_eager(llama):
    eager, graphed = _run(llama, "none"), _run(llama, "layers")
    launch_ns = devices.load("h100-sxm").gpu_model().host_graph_launch_ns
    stack = graphed.facts.stack
    inside = [r for r in graphed.workload.node_rows if layer_of(r.module, stack) is not None]
    outside = [(a, b) for a, b in zip(eager.workload.node_rows, graphed.workload.node_rows)
               if layer_of(a.module, stack) is None]
    assert inside and outside
    launches = [op for r in inside for op in (r.forward, *r.input_grad, *r.weight_grad) if op.dispatch_ns]
    assert len(launches) == 2 * LAYERS and all(op.dispatch_ns == launch_ns for op in launches)
    for a, b in outside:  # embeddings, final norm, head, loss: issued op by op as before
        assert [op.dispatch_ns for op in (a.forward, *a.input_grad, *a.weight_grad)] == \
               [op.dispatch_ns for op in (b.forward, *b.input_grad, *b.weight_grad)]
    # the step is the two streams over the new host figures (a hand-written queue: host issues, GPU follows)
    host = gpu = 0.0
    for op in graphed.workload.execution_order():
        host += op.dispatch_ns
        if op.estimated_ns:
            gpu = max(gpu, host) + op.estimated_ns
    assert graphed.workload.totals["step_estimated_ns"] == pytest.approx(max(host, gpu))
    assert graphed.workload.totals["step_estimated_ns"] < eager.workload.totals["step_estimated_ns"] / 2


def test_the_cluster_step_waits_on_the_host_where_it_issues_slower_than_the_gpu_runs(llama):
    """One GPU, one micro-batch: each unit's pass takes the longer of its kernels and its host dispatch;
    eager this tiny model is host-bound, replayed from one graph it is not."""
    for scope in ("none", "step"):
        result = _run(llama, scope)
        units = result.rank.units
        by_hand = sum(max(sum(op.estimated_ns for op in u.ops(ph)), sum(op.dispatch_ns for op in u.ops(ph)))
                      for u in units for ph in ("forward", "input_grad", "weight_grad"))
        device = result.cluster.devices[0]
        assert device.compute_ns == pytest.approx(by_hand, rel=1e-9)
    eager, graphed = _run(llama, "none"), _run(llama, "step")
    assert eager.cluster.devices[0].compute_ns >= eager.workload.totals["dispatch_sum_ns"]  # the host's pace
    launch_ns = devices.load("h100-sxm").gpu_model().host_graph_launch_ns
    kernels = graphed.workload.totals["kernel_sum_ns"]  # the one launch may outlast the embedding's kernels
    assert kernels <= graphed.cluster.devices[0].compute_ns <= kernels + launch_ns < eager.cluster.devices[0].compute_ns


def test_an_unknown_scope_is_one_clear_error(llama):
    with pytest.raises(UserError, match="--cuda-graphs"):
        _run(llama, "everything")


def test_two_stream_of_a_replay_is_the_launch_plus_the_kernels():
    assert two_stream_ns([(51.0, 10.0), (0.0, 20.0), (0.0, 5.0)]) == 51.0 + 35.0


def test_a_replayed_fp8_linear_keeps_its_fp8_gemm_and_casts(tmp_path):
    """A graph replays the kernels eager launched: an FP8 linear's GEMM (in FP8) and its casts (fp8.py) keep
    their time; a GEMM this large was above eager's back-to-back floor, so nothing comes off it."""
    tiny_config("llama", num_hidden_layers=1, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                num_key_value_heads=16, max_position_embeddings=1024).save_pretrained(tmp_path)

    def fp8_ops(scope):
        result = extract(str(tmp_path), batch=4, seq=1024, dtype="bf16", device="h100-sxm", fp8=True,
                         parallel=Parallel(cuda_graphs=scope))
        return [op for r in result.workload.node_rows for op in (r.forward, *r.input_grad, *r.weight_grad)
                if op.gemm_dtype == "fp8"]

    eager, graphed = fp8_ops("none"), fp8_ops("layers")
    assert len(eager) == len(graphed) == 7 * 3  # seven linears, three GEMMs each
    # 2 x 4,096 x 2,048 x 2,048 FLOPs and up: 34 µs at the full FP8 peak, above the 25.2 µs floor
    assert all(op.flops >= 2 * 4096 * 2048 * 2048 for op in eager)
    assert all(op.graphed and op.dispatch_ns == 0 for op in graphed)
    assert [op.estimated_ns for op in graphed] == [op.estimated_ns for op in eager]
