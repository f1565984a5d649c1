"""Per-node costs checked by hand: the backward split of a Linear, bytes moved, the roofline."""

from __future__ import annotations

import pytest

from fxworkload.cost.devices import DeviceProfile, load
from fxworkload.pipeline import extract
from fxworkload.cost.roofline import estimate_ns

from ..conftest import tiny_config

B, S = 2, 16


@pytest.fixture(scope="module")
def gpt2(tiny_dirs):
    return extract(str(tiny_dirs["gpt2"]), batch=B, seq=S)


def _row(workload, name):
    return next(r for r in workload.node_rows if r.name == name)


def test_linear_backward_is_one_dx_gemm_plus_one_dw_gemm_and_a_bias_sum(gpt2):
    h = tiny_config("gpt2").n_embd
    m, k, n = B * S, h, 4 * h  # c_fc: hidden -> 4·hidden
    row = _row(gpt2.workload, "transformer_h_0_mlp_c_fc")
    assert row.forward.op == "aten.addmm.default"
    assert row.forward.flops == 2 * m * k * n
    assert row.forward.bytes == 4 * (n + m * k + k * n + m * n)  # bias, x, W read; y written
    dx = [op for op in row.input_grad if op.kind == "matmul"]
    dw = [op for op in row.weight_grad if op.kind == "matmul"]
    assert [op.flops for op in dx] == [2 * m * k * n] and [op.flops for op in dw] == [2 * m * k * n]
    assert dw[0].output_shapes == [[k, n]] and dx[0].output_shapes == [[m, k]]
    bias = [op for op in row.weight_grad if op.kind == "reduction"]
    assert len(bias) == 1 and bias[0].output_shapes in ([[1, n]], [[n]])


def test_layer_norm_backward_is_input_grad_and_its_parameter_gradients_weight_grad(gpt2):
    row = _row(gpt2.workload, "transformer_h_0_ln_1")
    assert [op.op for op in row.input_grad if op.kind == "norm"] == ["aten.native_layer_norm_backward.default"]


def test_views_move_nothing_and_take_no_time(gpt2):
    views = [op for op in gpt2.workload.ops() if op.kind == "view"]
    assert views and all(op.bytes == 0 and op.flops == 0 and op.estimated_ns == 0 for op in views)


def test_every_traced_op_lands_in_exactly_one_row(gpt2, tiny_dirs):
    import torch

    from fxworkload.capture import models
    from fxworkload.capture.trace import capture_training_step

    from fxworkload.cost.devices import load as load_device
    from fxworkload.pipeline import trace_target

    module = models.build_meta_model(models.resolve(str(tiny_dirs["gpt2"])), torch.float32)
    capture = capture_training_step(module, B, S, gpu=trace_target("auto", load_device("a100-80gb")))
    names = [op.fx_name for op in gpt2.workload.ops()]
    assert len(names) == len(set(names)) == len(capture.phase)


def test_row_times_add_up_to_the_phase_totals(gpt2):
    totals = gpt2.workload.totals
    rows = gpt2.workload.node_rows
    assert sum(r.forward.estimated_ns for r in rows) == pytest.approx(totals["forward_estimated_ns"])
    assert sum(r.backward_ns for r in rows) == pytest.approx(totals["input_grad_estimated_ns"])
    assert sum(r.weight_grad_ns for r in rows) == pytest.approx(totals["weight_grad_estimated_ns"])


def test_roofline_by_hand():
    device = DeviceProfile(name="t", description="", matmul_flops_per_s={"fp32": 1e12, "bf16": 4e12, "fp16": 4e12},
                           vector_flops_per_s=5e11, memory_bytes_per_s=1e11, compute_efficiency=0.5,
                           memory_efficiency=0.5, kernel_launch_ns=1000.0)
    import torch
    # compute-bound GEMM in bf16: 4e9 FLOPs / (4e12 · 0.5) = 2 ms
    assert estimate_ns(4_000_000_000, 1_000, torch.bfloat16, device, uses_matmul_units=True) \
        == pytest.approx(1000 + 2e6)
    # memory-bound elementwise: 1e6 bytes / (1e11 · 0.5) = 20 us
    assert estimate_ns(1_000, 1_000_000, torch.float32, device, uses_matmul_units=False) == pytest.approx(1000 + 2e4)
    assert estimate_ns(0, 0, torch.float32, device, uses_matmul_units=False) == 0


def test_measured_profile_curves_interpolate_log_linearly_by_hand():
    """A GEMM grid and a bandwidth curve replace the flat rates; between points, log-log interpolation."""
    import torch
    grid = [[m, k, n, 1e9 * (4 if m == 100 else 1)] for m in (10, 100) for k in (10, 100) for n in (10, 100)]
    device = DeviceProfile(name="t", description="", matmul_flops_per_s={"fp32": 4e9, "bf16": 1, "fp16": 1},
                           vector_flops_per_s=1e9, memory_bytes_per_s=1e12, compute_efficiency=1.0,
                           memory_efficiency=1.0, kernel_launch_ns=0.0, matmul_flops_per_s_by_shape={"fp32": grid},
                           memory_bytes_per_s_by_bytes=[[1e3, 1e9], [1e5, 1e11]],
                           vector_flops_per_s_by_op={"tanh": 1e8})
    # m = sqrt(10 · 100) lies halfway in log space: rate = exp((ln 1e9 + ln 4e9) / 2) = 2e9
    flops = 10_000_000
    assert estimate_ns(flops, 1, torch.float32, device, uses_matmul_units=True, gemm=(10 ** 1.5, 50, 50)) \
        == pytest.approx(1e9 * flops / 2e9)
    # beyond the grid the rate is held: m = 1000 uses the m = 100 rate, 4e9
    assert estimate_ns(flops, 1, torch.float32, device, uses_matmul_units=True, gemm=(1000, 100, 100)) \
        == pytest.approx(1e9 * flops / 4e9)
    # bandwidth at 1e4 bytes, halfway between 1e3 and 1e5 in log space: 1e10 bytes/s -> 1 us
    assert estimate_ns(0, 10_000, torch.float32, device, uses_matmul_units=False) == pytest.approx(1e3)
    # a per-op vector rate wins over the generic one: 1e6 FLOPs of tanh at 1e8/s = 10 ms
    assert estimate_ns(1_000_000, 1, torch.float32, device, uses_matmul_units=False, op_name="tanh") \
        == pytest.approx(1e7)
    assert estimate_ns(1_000_000, 1, torch.float32, device, uses_matmul_units=False, op_name="exp") \
        == pytest.approx(1e6)


def test_shipped_device_profiles_cite_a_source_for_every_figure():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h200"):
        profile = load(name)
        for figure in ("matmul_flops_per_s", "vector_flops_per_s", "memory_bytes_per_s", "compute_efficiency",
                       "memory_efficiency", "kernel_launch_ns"):
            assert profile.sources.get(figure), (name, figure)
    assert load("a100-80gb").matmul_flops_per_s["bf16"] == 312e12  # dense, not the 624 sparse figure


def test_gather_ops_read_only_the_rows_they_gather():
    """An embedding lookup reads the indices and one table row per output row, not the whole table."""
    import torch

    from fxworkload.cost.traffic import bytes_moved
    table, ids, out = torch.empty(50_000, 16), torch.zeros(2, 3, dtype=torch.long), torch.empty(2, 3, 16)
    assert bytes_moved(torch.ops.aten.embedding.default, (table, ids), {}, out) == 6 * 8 + 2 * (6 * 16 * 4)


def test_rules_added_for_the_coverage_architectures_by_hand():
    import torch

    from fxworkload.cost.flops import node_flops, op_kind
    aten = torch.ops.aten
    a, b = torch.randn(3, 5, 5), torch.randn(3, 5, 2)
    solved = torch.linalg.solve_triangular(a, b, upper=True)
    # 3 triangular 5x5 systems with 2 right-hand sides: n^2 k = 50 FLOPs each
    assert node_flops(aten.linalg_solve_triangular.default, (a, b), {"upper": True}, solved) == 3 * 5 * 5 * 2
    assert op_kind(aten.linalg_solve_triangular.default, False) == "matmul"
    x = torch.randn(4, 6)
    assert node_flops(aten.softplus.default, (x,), {}, x) == 3 * 24
    assert node_flops(aten.flip.default, (x, [0]), {}, x) == 0


def test_safe_softmax_moves_the_bytes_of_its_four_kernels():
    """By hand, from SoftMax.cpp: softmax reads x and writes y; eq(x, -inf) reads x and writes a bool
    per element; all() reads those; where() reads y and writes the result (the row flags aside)."""
    import torch

    from fxworkload.cost.traffic import bytes_moved
    x = torch.randn(2, 3, 4, 8)
    y = torch.ops.aten._safe_softmax(x, -1)
    size, n = 192 * 4, 192
    assert bytes_moved(torch.ops.aten._safe_softmax.default, (x, -1), {}, y) == (2 * size + (size + n) + n + 2 * size)
    assert bytes_moved(torch.ops.aten._softmax.default, (x, -1, False), {}, y) == 2 * size


def test_the_nll_loss_reads_one_log_probability_per_row():
    """By hand: the forward reads the targets and the one entry each picks (not the N x C input); the
    backward writes the N x C gradient once (zeros, then the picked entries) and reads the targets."""
    import torch

    from fxworkload.cost.traffic import bytes_moved
    log_probs, target = torch.randn(16, 1000).log_softmax(-1), torch.randint(0, 1000, (16,))
    out = torch.ops.aten.nll_loss_forward(log_probs, target, None, 1, -100)
    forward = bytes_moved(torch.ops.aten.nll_loss_forward.default, (log_probs, target, None, 1, -100), {}, out)
    assert forward == 16 * 8 + 16 * 4 + 2 * 4
    grad = torch.ops.aten.nll_loss_backward(torch.tensor(1.0), log_probs, target, None, 1, -100, out[1])
    backward = bytes_moved(torch.ops.aten.nll_loss_backward.default,
                           (torch.tensor(1.0), log_probs, target, None, 1, -100, out[1]), {}, grad)
    assert backward == 4 + 16 * 8 + 16 * 1000 * 4 + 16 * 4


def test_a_copy_that_converts_dtypes_runs_at_the_casting_rate():
    """By hand: bf16 -> fp32 is TensorIterator's unrolled casting kernel, bound by what its SMs keep in
    flight (SMs x the fitted per-SM rate); an fp32 copy and a bf16 add of a 0-dim fp32 scalar tensor stay
    vectorized, at DRAM's reachable share of the bandwidth."""
    import torch

    from fxworkload.cost.devices import load
    from fxworkload.cost.optime import gpu_op_ns
    from fxworkload.measure.kernels import _traced_ops

    device = load("h100-sxm")
    model, facts = device.gpu_model(), device.gpu_facts()
    x = torch.randn(1024, 1024, dtype=torch.bfloat16)
    cast, = [op for op in _traced_ops(lambda x: x.float(), [x]) if op.bytes]
    assert cast.bytes == 1024 * 1024 * 6
    assert gpu_op_ns(cast, device, "bf16") == pytest.approx(
        model.vector_kernel_ns + 1e9 * cast.bytes / (facts.sm_count * model.memory_cast_bytes_per_s_per_sm))
    add, = [op for op in _traced_ops(lambda x: x + torch.tensor(2.0), [x]) if op.op == "aten.add.Tensor"]
    assert gpu_op_ns(add, device, "bf16") == pytest.approx(
        model.vector_kernel_ns + 1e9 * add.bytes / (facts.memory_bytes_per_s * model.memory_efficiency))
