"""The optimizer stepped on the host (cluster/offload.py, Megatron-Core's HybridDeviceOptimizer)."""

from __future__ import annotations

import pytest
import torch

from fxworkload.cluster.offload import HOST_LINK_EFFICIENCY, HOST_MEMORY_EFFICIENCY, offloaded_step_ns
from fxworkload.cost import devices
from fxworkload.errors import UserError
from fxworkload.parallel.layout import Parallel, check_values
from fxworkload.parallel.memory import _offloaded

from ..test_cli import fxworkload


def _pipelined_ns(count: int, d2h: float, cpu: float, h2d: float) -> float:
    """A hand-built three-stream timeline: ``count`` equal parameters, each copied to the host on the D2H stream
    (one after another), stepped on the CPU once copied and once the previous one is stepped, and copied back
    on the H2D stream once stepped and once the previous copy back is done."""
    copied = stepped = back = 0.0
    for _ in range(count):
        copied += d2h
        stepped = max(stepped, copied) + cpu
        back = max(back, stepped) + h2d
    return back


def test_the_offloaded_share_takes_its_slowest_stage_as_the_hand_built_pipeline_does():
    """1e9 parameters of an H100's shard: gradients (4 bytes) over PCIe Gen5 x16 at 80 % of 64 GB/s, the CPU's
    Adam (28 bytes a parameter) at 70 % of the GPU's 76.8 GB/s share of DDR5, the fp32 parameters back. Split
    into 2,000 parameters, the hand-built pipeline ends within 0.2 % of the model's slowest stage."""
    h100 = devices.load("h100-sxm")
    stages = offloaded_step_ns(1e9, 4, h100)
    assert stages["d2h"] == pytest.approx(1e9 * 4 / (64e9 * HOST_LINK_EFFICIENCY) * 1e9)
    assert stages["cpu_adam"] == pytest.approx(1e9 * 28 / (76.8e9 * HOST_MEMORY_EFFICIENCY) * 1e9)
    timeline = _pipelined_ns(2000, *(stages[k] / 2000 for k in ("d2h", "cpu_adam", "h2d")))
    assert max(stages.values()) == pytest.approx(timeline, rel=2e-3)


def test_the_cpu_adam_moves_what_torchs_own_fused_adamw_moves_on_cpu_tensors():
    """The oracle is torch: AdamW as Megatron-Core builds its CPU optimizer (fused, weight decay on) stepped on a
    CPU parameter under a dispatch mode that adds up, for every aten op it runs, the bytes of the parameter-sized
    tensors it reads, those it changes in place (a tensor whose values the op altered) and those it returns
    new. Per parameter that is the CPU Adam's bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from fxworkload.cluster.offload import CPU_ADAM_BYTES_PER_PARAMETER

    n = 1 << 14
    parameter = torch.nn.Parameter(torch.randn(n))
    parameter.grad = torch.randn(n)
    optimizer = torch.optim.AdamW([parameter], lr=1e-3, weight_decay=0.01, fused=True)
    optimizer.step()  # the moments made

    def sized(tree):
        return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.numel() == n]

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {t.untyped_storage().data_ptr(): t for t in sized((args, kwargs or {}))}
            before = {ptr: t.clone() for ptr, t in inputs.items()}
            out = func(*args, **(kwargs or {}))
            changed = [t.nbytes for ptr, t in inputs.items() if not torch.equal(t, before[ptr])]
            fresh = [t.nbytes for t in sized(out) if t.untyped_storage().data_ptr() not in inputs]
            Moved.total += sum(t.nbytes for t in inputs.values()) + sum(changed) + sum(fresh)
            return out

    with Moved():
        optimizer.step()
    assert Moved.total / n == CPU_ADAM_BYTES_PER_PARAMETER


def test_offloading_frees_the_moments_and_the_host_holds_copy_moments_and_gradients():
    """By hand, a bf16 run's shard of 1,000 parameters (Adam: 12 bytes each), half offloaded: the GPU frees
    500 x 8 bytes of moments (12,000 -> 8,000; the fp32 main parameters stay); the host holds 500 x (12 + 4)."""
    states, host = _offloaded((2000, 4000, 12000), 0.5, "bf16", 4)
    assert states == (2000, 4000, 8000) and host == 8000
    assert _offloaded((2000, 4000, 12000), 0.0, "bf16", 4) == ((2000, 4000, 12000), 0)


def test_offload_needs_the_distributed_optimizer_and_a_host_tier(tiny_dirs, tmp_path):
    with pytest.raises(UserError, match="needs --zero 1, 2 or 3"):
        check_values(Parallel(dp=2, optimizer_offload=1.0))
    with pytest.raises(UserError, match="0 to 1"):
        check_values(Parallel(dp=2, zero=1, optimizer_offload=1.5))
    run = fxworkload("extract", tiny_dirs["gpt2"], "--seq", 16, "--dp", 2, "--zero", 1, "--optimizer-offload", 1,
                     "--device", "l4", "--out", tmp_path / "o")
    assert run.returncode == 2 and "no host memory tier" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_extract_steps_the_offloaded_optimizer_beside_the_gpus_share(tiny_dirs, tmp_path):
    """The step's optimizer part with offload is the larger of the GPU's share and the host's slowest stage
    (cluster/offload.py), and the rank's memory moves the moments to the host."""
    import json

    runs = {}
    for share in (0, 1):
        out = tmp_path / f"o{share}"
        run = fxworkload("extract", tiny_dirs["gpt2"], "--seq", 16, "--dp", 2, "--zero", 1, "--dtype", "bf16",
                         "--optimizer-offload", share, "--device", "h100-sxm", "--out", out)
        assert run.returncode == 0, run.stderr
        runs[share] = json.loads((out / "workload.json").read_text())
    on_gpu, offloaded = runs[0], runs[1]
    assert offloaded["memory"]["host_bytes"] > 0 and on_gpu["memory"]["host_bytes"] == 0
    assert offloaded["memory"]["optimizer_bytes"] == pytest.approx(on_gpu["memory"]["optimizer_bytes"] / 3, rel=1e-3)
    parameters = on_gpu["memory"]["optimizer_bytes"] / 12  # the rank's shard
    host = offloaded_step_ns(parameters, 4, devices.load("h100-sxm"))
    assert offloaded["cluster"]["exposed_ns"]["optimizer"] == pytest.approx(max(host.values()), rel=1e-3)


def test_plan_says_which_layouts_only_offload_makes_fit_and_what_they_cost():
    from fxworkload.plan import offload_lines

    base = {"device": "h100-sxm", "tp": 8, "cp": 1, "pp": 16, "vpp": 1, "ep": 1, "dp": 8, "zero": 1,
            "recompute": "full", "micro_batch": 1, "pp_layers": None, "recompute_layers": None}
    offloaded = base | {"optimizer_offload": 1.0, "fits": True, "peak_bytes": 70 * 2 ** 30, "step_ms": 9000.0,
                        "parts_ms": {"optimizer": 600.0}}
    twin = base | {"optimizer_offload": 0.0, "fits": False, "peak_bytes": 85 * 2 ** 30, "step_ms": 8500.0,
                   "parts_ms": {"optimizer": 40.0}}
    lines = offload_lines([offloaded], [offloaded, twin])
    assert lines[0].startswith("offload: 1 layouts fit only with something on the host (1 the optimizer, 0 activations)")
    assert "the optimizer on the host) holds 15.0 GiB less on the GPU" in lines[0]
    assert lines[1] == "offload: its step 9000 ms against 8500 ms on the GPU (optimizer 600 ms against 40 ms)"
    assert offload_lines([twin | {"fits": True}], [twin | {"fits": True}])[0].startswith("offload: makes no layout fit")
    # the same layout with a third of its layers' activations on the host instead (one stage, no recomputation)
    one_stage = base | {"pp": 1, "recompute": "none", "optimizer_offload": 0.0}
    activations = one_stage | {"activation_offload_layers": 8, "fits": True, "peak_bytes": 75 * 2 ** 30,
                               "step_ms": 9100.0, "parts_ms": {"activation offload": 700.0, "optimizer": 40.0}}
    kept = one_stage | {"activation_offload_layers": 0, "fits": False, "peak_bytes": 90 * 2 ** 30, "step_ms": 8400.0,
                        "parts_ms": {"activation offload": 0.0, "optimizer": 40.0}}
    lines = offload_lines([activations], [activations, kept])
    assert "(0 the optimizer, 1 activations)" in lines[0]
    assert "8 layers' activations on the host) holds 15.0 GiB less on the GPU" in lines[0]
    assert lines[1] == ("offload: its step 9100 ms against 8400 ms on the GPU (activation offload 700 ms against "
                        "0 ms)")


def test_expert_parameters_step_over_the_expert_data_parallel_group(tiny_dirs, tmp_path):
    """With the distributed optimizer, expert parameters are sharded over the expert-data-parallel group (dp / ep
    ranks: Megatron-Core's expert-data-parallel group), dense ones over dp. Mixtral at dp 2, ep 2: the rank steps
    half the dense parameters and its whole half of the experts, counted from the model's own parameters."""
    import json

    from transformers import AutoModelForCausalLM

    from ..conftest import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"))
    expert = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    dense = sum(p.numel() for p in model.parameters()) - expert
    shard = dense / 2 + expert / 2  # the rank's half of the experts, not divided again (expert-dp = 1)
    out = tmp_path / "o"
    run = fxworkload("extract", tiny_dirs["mixtral"], "--seq", 16, "--dp", 2, "--ep", 2, "--zero", 1, "--dtype",
                     "bf16", "--optimizer-offload", 1, "--device", "h100-sxm", "--out", out)
    assert run.returncode == 0, run.stderr
    step = json.loads((out / "workload.json").read_text())
    host = offloaded_step_ns(shard, 4, devices.load("h100-sxm"))
    assert step["cluster"]["exposed_ns"]["optimizer"] == pytest.approx(max(host.values()), rel=1e-3)
