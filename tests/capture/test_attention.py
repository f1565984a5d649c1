"""SDPA dispatch as the GPU makes it: the backend rules against the kernels that ran on an H100,
and a GPU-target capture that records the fused ops (no GPU needed)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from fxworkload.capture import models
from fxworkload.capture.attention import SdpaCall, choose
from fxworkload.capture.trace import capture_training_step
from fxworkload.cost.devices import load
from fxworkload.pipeline import trace_target

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _measured_rows():
    with open(FIXTURES / "h100_sdpa_kernels.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_backend_choice_matches_every_kernel_measured_on_an_h100():
    """Oracle: the kernel names torch.profiler recorded for 366 SDPA configurations (torch 2.11, H100)."""
    target = trace_target("auto", load("h100-sxm"))
    wrong = []
    for row in _measured_rows():
        heads, kv_heads = int(row["heads"]), int(row["kv_heads"])
        masked = row["mask"] != "none"
        call = SdpaCall(dtype=DTYPE[row["dtype"]], batch=int(row["batch"]), heads=heads, kv_heads=kv_heads,
                        q_len=int(row["seq"]), kv_len=int(row["seq"]), head_dim=int(row["head_dim"]),
                        v_head_dim=int(row["head_dim"]), has_mask=masked, dropout=float(row["dropout"]),
                        is_causal=row["causal"] == "True" and not masked, enable_gqa=heads != kv_heads)
        if choose(call, target) != row["backend"]:
            wrong.append((row, choose(call, target)))
    assert len(_measured_rows()) == 366 and wrong == []


def test_a100_prefers_flash_and_masks_move_it_to_memory_efficient():
    target = trace_target("auto", load("a100-80gb"))
    call = SdpaCall(dtype=torch.bfloat16, batch=1, heads=32, kv_heads=8, q_len=4096, kv_len=4096, head_dim=128,
                    v_head_dim=128, has_mask=False, dropout=0.0, is_causal=True, enable_gqa=True)
    assert choose(call, target) == "flash"
    masked = SdpaCall(**{**call.__dict__, "has_mask": True, "kv_heads": 32, "enable_gqa": False})
    assert choose(masked, target) == "efficient"


def _ops(model_dir, dtype, device):
    module = models.build_meta_model(models.resolve(str(model_dir)), dtype)
    capture = capture_training_step(module, 2, 16, gpu=trace_target("auto", load(device)) if device else None)
    return [str(n.target) for n in capture.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("model, dtype, kernel", [("llama", torch.bfloat16, "cudnn"), ("gpt2", torch.float32, "efficient")])
def test_a_gpu_capture_records_the_fused_kernel_and_its_backward(tiny_dirs, model, dtype, kernel):
    """bf16 GQA takes cuDNN on an H100; fp32 without GQA the memory-efficient kernel (as measured)."""
    ops = _ops(tiny_dirs[model], dtype, "h100-sxm")
    assert ops.count(f"aten._scaled_dot_product_{kernel}_attention.default") == 2  # one per layer
    assert ops.count(f"aten._scaled_dot_product_{kernel}_attention_backward.default") == 2
    assert not any("for_cpu" in op for op in ops)


def test_a_cpu_capture_keeps_the_cpu_kernel(tiny_dirs):
    ops = _ops(tiny_dirs["llama"], torch.float32, None)
    assert ops.count("aten._scaled_dot_product_flash_attention_for_cpu.default") == 2


def test_dropout_is_one_fused_kernel_on_the_gpu_and_three_ops_on_the_cpu(tmp_path):
    from ..conftest import tiny_config

    tiny_config("gpt2", resid_pdrop=0.1).save_pretrained(tmp_path)
    gpu, cpu = _ops(tmp_path, torch.bfloat16, "h100-sxm"), _ops(tmp_path, torch.bfloat16, None)
    assert gpu.count("aten.native_dropout.default") == 2 * 2 and "aten.bernoulli_.float" not in gpu
    assert "aten.native_dropout.default" not in cpu and "aten.bernoulli_.float" in cpu


def test_an_unpacked_batch_passes_no_mask_as_eager_does(tiny_dirs):
    """transformers skips the causal mask for an unpacked batch in eager mode; the trace must too,
    or the GPU would be charged the masked (memory-efficient) kernel."""
    ops = _ops(tiny_dirs["llama"], torch.bfloat16, "a100-80gb")
    assert ops.count("aten._scaled_dot_product_flash_attention.default") == 2


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_key_value_heads_without_gqa_broadcast_only_when_there_is_one(kv_heads):
    """Falcon passes one key/value head without enable_gqa: torch broadcasts it (math path); two
    heads for four query heads is an error. Oracle: torch's own SDPA on the CPU."""
    q, kv = torch.zeros(1, 4, 8, 16), torch.zeros(1, kv_heads, 8, 16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv)
        eager = "runs"
    except RuntimeError:
        eager = "error"
    call = SdpaCall(dtype=torch.bfloat16, batch=1, heads=4, kv_heads=kv_heads, q_len=8, kv_len=8, head_dim=16,
                    v_head_dim=16, has_mask=False, dropout=0.0, is_causal=False)
    chosen = choose(call, trace_target("auto", load("h100-sxm")))
    assert (chosen == "error") == (eager == "error") and chosen in ("math", "error")


@pytest.mark.parametrize("causal, kv_heads", [(True, 2), (False, 4)])
def test_the_gpu_math_path_is_torchs_own_with_dropout_fused(causal, kv_heads):
    """Oracle: torch's _scaled_dot_product_attention_math traced op for op. On CUDA tensors its
    at::dropout is one native_dropout kernel; on the CPU tensors of a trace it is bernoulli_, div_, mul."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxworkload.capture.attention import cuda_math_attention

    aten = torch.ops.aten
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 16, 8, requires_grad=True) for _ in range(2))
    gqa = kv_heads != 4

    def ops(fn):
        return [str(n.target) for n in make_fx(fn, tracing_mode="fake")(q, k, v).graph.nodes if n.op == "call_function"]

    torch_ops = ops(lambda q, k, v: aten._scaled_dot_product_attention_math(q, k, v, None, 0.1, causal, None,
                                                                               enable_gqa=gqa)[0].sum())
    ours = ops(lambda q, k, v: cuda_math_attention(q, k, v, None, 0.1, causal, None, gqa).sum())
    at = torch_ops.index("aten.empty_like.default")
    assert torch_ops[at:at + 4] == ["aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar",
                                    "aten.mul.Tensor"]
    getitem = "<built-in function getitem>"
    assert ours == torch_ops[:at] + ["aten.native_dropout.default", getitem, getitem] + torch_ops[at + 4:]


def test_enabled_backends_keep_the_builds_order_and_drop_the_rest():
    """torch.nn.attention.sdpa_kernel(backends) (set_priority=False) enables those backends and leaves the
    order alone: on an H100 whose build tries cuDNN first, enabling flash and efficient (torchtitan's context
    parallelism) runs flash for Llama's bf16 GQA call; efficient alone cannot take GQA, and with math
    disabled nothing can (select_sdp_backend's "No available kernel"); math enabled takes it."""
    from fxworkload.capture.attention import enabled

    h100 = trace_target("auto", load("h100-sxm"))
    call = SdpaCall(dtype=torch.bfloat16, batch=1, heads=32, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128,
                    v_head_dim=128, has_mask=False, dropout=0.0, is_causal=True, enable_gqa=True)
    assert choose(call, h100) == "cudnn"
    assert enabled(h100, ("efficient", "flash")).priority == ("flash", "efficient")
    assert choose(call, enabled(h100, ("flash", "efficient"))) == "flash"
    assert choose(call, enabled(h100, ("efficient",))) == "error"
    assert choose(call, enabled(h100, ("efficient", "math"))) == "math"
    # cuDNN, which an A100's order leaves out, comes last when enabled: only math still precedes it
    a100 = trace_target("auto", load("a100-80gb"))
    assert enabled(a100, ("cudnn", "flash")).priority == ("flash", "cudnn")


def test_a_capture_with_only_flash_and_efficient_records_flash_on_an_h100(tiny_dirs):
    module = models.build_meta_model(models.resolve(str(tiny_dirs["llama"])), torch.bfloat16)
    target = trace_target("auto", load("h100-sxm"), ("flash", "efficient"))
    ops = [str(n.target) for n in capture_training_step(module, 2, 16, gpu=target).graph.nodes
           if n.op == "call_function"]
    assert ops.count("aten._scaled_dot_product_flash_attention.default") == 2
    assert ops.count("aten._scaled_dot_product_flash_attention_backward.default") == 2
    assert not any("cudnn" in op for op in ops)


@pytest.mark.parametrize("backends, trace_on, said", [(("bogus",), "auto", "name one or more of"),
                                                      ((), "auto", "name one or more of"),
                                                      (("flash",), "cpu", "follows the CPU's dispatch")])
def test_a_backend_list_that_cannot_apply_is_refused(backends, trace_on, said):
    from fxworkload.errors import UserError

    with pytest.raises(UserError, match=said):
        trace_target(trace_on, load("h100-sxm"), backends)


def test_an_extraction_with_only_flash_enabled_costs_flash_and_says_so(tiny_dirs, tmp_path, monkeypatch):
    """The cache holds each enabled set's capture apart (its key carries the order tried): the second run
    is not handed the first one's cuDNN step."""
    from fxworkload.pipeline import extract

    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path))
    runs = {backends: extract(str(tiny_dirs["llama"]), seq=64, dtype="bf16", device="h100-sxm",
                              sdpa_backends=backends) for backends in (None, ("flash", "efficient"))}

    def attention(run):
        return {op.sdpa_backend: op.estimated_ns for row in run.nodes for op in [row.forward] if op.sdpa_backend}

    default, flash = runs[None], runs[("flash", "efficient")]
    assert set(attention(default)) == {"cudnn"} and set(attention(flash)) == {"flash"}
    assert flash.settings["sdpa_backends"] == ["flash", "efficient"] and "sdpa_backends" not in default.settings
    assert flash.settings["traced_on"].endswith("sdpa flash>efficient")
    said = [line.split(None, 3)[-1] for line in flash.summary(10, ["tables"]).splitlines()
            if line.startswith("attention kernel (--sdpa-backends)")]
    assert said == ["flash (tried in order: flash, efficient)"]
