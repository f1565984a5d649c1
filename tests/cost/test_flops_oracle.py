"""FLOPs against independent oracles: FlopCounterMode on a real eager CPU step, and hand formulas."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from fxworkload.pipeline import extract

from ..conftest import tiny_config

B, S = 2, 32


def _in_torch_registry(op: str) -> bool:
    namespace, name = op.split(".")[:2] if "." in op else ("", op)
    return namespace == "aten" and getattr(torch.ops.aten, name) in flop_registry


def _registry_flops(ops) -> int:
    """FLOPs of the ops that torch's own registry counts (what FlopCounterMode can see)."""
    return sum(op.flops for op in ops if _in_torch_registry(op.op))


def _eager_flops(model_type: str) -> tuple[int, int]:
    torch.manual_seed(0)
    config = tiny_config(model_type)
    auto = AutoModelForMaskedLM if model_type == "bert" else AutoModelForCausalLM
    model = auto.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (B, S))
    with FlopCounterMode(display=False) as forward_counter:
        loss = model(ids, labels=ids).loss
    with FlopCounterMode(display=False) as backward_counter:
        loss.backward()
    return forward_counter.get_total_flops(), backward_counter.get_total_flops()


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert"])
def test_counted_ops_match_flop_counter_mode_on_a_real_step(model_type, tiny_dirs):
    workload = extract(str(tiny_dirs[model_type]), batch=B, seq=S, device="a100-80gb", trace_on="cpu").workload
    forward = _registry_flops(workload.ops("forward"))
    backward = _registry_flops(workload.ops("input_grad") + workload.ops("weight_grad"))
    eager_forward, eager_backward = _eager_flops(model_type)
    assert eager_forward > 0 and eager_backward > 0
    assert forward == pytest.approx(eager_forward, rel=0.01)
    assert backward == pytest.approx(eager_backward, rel=0.01)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_fused_attention_counted_with_the_analytic_formula(model_type, tiny_dirs):
    """FlopCounterMode does not count the CPU flash-SDPA ops; check them by hand: 4·B·h·S²·d forward
    (QKᵀ and PV); backward 10·B·h·S²·d: the four gradient GEMMs (dV, dP, dQ, dK) plus the flash
    kernel's recomputation of QKᵀ, as torch's sdpa_backward_flop_count counts it."""
    config = tiny_config(model_type)
    workload = extract(str(tiny_dirs[model_type]), batch=B, seq=S, trace_on="cpu").workload
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    layers = config.num_hidden_layers
    forward = [op for op in workload.ops("forward") if op.kind == "attention"]
    backward = [op for op in workload.ops("input_grad") + workload.ops("weight_grad") if op.kind == "attention"]
    assert len(forward) == layers and len(backward) == layers
    assert all(op.op == "aten._scaled_dot_product_flash_attention_for_cpu.default" for op in forward)
    assert sum(op.flops for op in forward) == layers * 4 * B * heads * S * S * head_dim
    assert sum(op.flops for op in backward) == layers * (8 + 2) * B * heads * S * S * head_dim
    assert all(op.phase == "input_grad" for op in backward)


def test_moe_expert_gemms_count_only_the_routed_tokens(tiny_dirs):
    """Each token runs top-k experts: expert GEMM FLOPs are those of k dense MLPs, not of all experts."""
    config = tiny_config("mixtral")
    workload = extract(str(tiny_dirs["mixtral"]), batch=B, seq=S, dtype="bf16").workload
    experts = [op for op in workload.ops("forward") if "grouped_mm" in op.op]
    h, f, k = config.hidden_size, config.intermediate_size, config.num_experts_per_tok
    tokens = B * S
    # gate_up (h -> 2f) and down (f -> h) per routed token, per layer
    assert sum(op.flops for op in experts) == config.num_hidden_layers * tokens * k * (2 * h * 2 * f + 2 * f * h)
    backward = [op for op in workload.ops("input_grad") + workload.ops("weight_grad") if "grouped_mm" in op.op]
    assert sum(op.flops for op in backward) == 2 * sum(op.flops for op in experts)
    assert {op.phase for op in backward} == {"input_grad", "weight_grad"}
