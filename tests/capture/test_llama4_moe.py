"""Llama 4's text MoE counted as training runs it (routed top-k), not as transformers' eager fallback (every token
through every expert): issue 40."""

from __future__ import annotations

import torch
from transformers import Llama4TextConfig

from fxworkload.capture.trace import _llama4_routed
from fxworkload.pipeline import extract

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 64, 128, 16, 1, 2


def _config() -> Llama4TextConfig:
    return Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=INTER, intermediate_size_mlp=INTER,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=256, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            max_position_embeddings=256, interleave_moe_layer_step=1, attention_chunk_size=64)


def test_the_routed_moe_computes_what_transformers_eager_moe_computes():
    """The oracle is transformers' own Llama4TextMoe.forward: same output and router logits, to fp32 rounding."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    torch.manual_seed(0)
    moe = Llama4TextMoe(_config())
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    x = torch.randn(3, 10, HIDDEN)
    expected, expected_logits = moe(x)
    with _llama4_routed():
        routed, logits = moe(x)
    torch.testing.assert_close(routed, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits)


def test_expert_flops_are_the_routed_tokens_not_every_expert(tmp_path):
    """16 experts at top-1: the experts' GEMMs do 2·tokens·top_k·(h·2i + i·h) FLOPs a layer forward, twice that
    backward (by hand); transformers' eager code would do 16x."""
    _config().save_pretrained(tmp_path)
    batch, seq = 2, 32
    workload = extract(str(tmp_path), batch=batch, seq=seq, dtype="fp32", device="h100-sxm", use_cache=False,
                       every_layer=True).workload
    gemm = sum(op.flops for row in workload.node_rows if "experts" in row.module.split(".")
               for phase in ("forward", "input_grad", "weight_grad") for op in row.ops(phase) if op.kind == "matmul")
    forward = 2 * batch * seq * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    assert gemm == 3 * forward * LAYERS
