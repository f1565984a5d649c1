"""Sibling linears (workload/siblings.py): which linears read one tensor, and Megatron-Core's one GEMM for each
group, against the shapes Megatron-Core builds (megatron/core/transformer/attention.py ``linear_qkv``:
hidden -> query_projection_size + 2 * kv_projection_size; mlp.py ``linear_fc1``: hidden -> 2 * ffn_hidden_size
where gated) timed by the GPU model's GEMM rule."""

from __future__ import annotations

import pytest

from fxworkload.cost import devices
from fxworkload.cost.gpu import gemm_ns
from fxworkload.pipeline import extract
from fxworkload.workload.siblings import sibling_groups

from ..conftest import tiny_config

HIDDEN, HEADS, KV_HEADS, FFN = 1024, 16, 4, 2816
TOKENS = 2 * 512


@pytest.fixture(scope="module")
def gqa_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("siblings-llama")
    tiny_config("llama", num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, max_position_embeddings=1024).save_pretrained(path)
    return str(path)


def _layer_linears(path, stack):
    run = extract(path, batch=2, seq=512, dtype="bf16", device="h100-sxm", stack=stack)
    linears = {r.module.rsplit(".", 1)[1]: r for r in run.workload.node_rows
               if r.forward.gemm_mkn and ".layers.0." in r.module}
    return run, linears


def test_q_k_v_and_gate_up_are_the_groups_that_read_one_tensor(gqa_llama, tiny_dirs):
    run, _ = _layer_linears(gqa_llama, "eager")
    rows = run.workload.rows
    names = [[rows[i].module.rsplit(".", 1)[1] for i in group] for group in sibling_groups(rows, run.facts.stack)]
    assert names == [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]
    gpt2 = extract(str(tiny_dirs["gpt2"]), batch=2, seq=32, dtype="fp32", device="h100-sxm")
    assert sibling_groups(gpt2.workload.rows, gpt2.facts.stack) == []  # c_attn is one linear already; c_fc alone


def test_a_moe_blocks_shared_expert_pairs_and_its_routers_stand_alone(tmp_path):
    """Qwen2-MoE: the shared expert's gate and up read the normed block input, as the router and the shared
    expert's gate do (other widths: 4 experts, 1), which Megatron-Core builds as linears of their own."""
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING["qwen2_moe"](hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                max_position_embeddings=64).save_pretrained(tmp_path)
    run = extract(str(tmp_path), batch=2, seq=16, dtype="fp32", device="h100-sxm")
    rows = run.workload.rows
    groups = [[rows[i].module.split(".layers.0.")[1] for i in group]
              for group in sibling_groups(rows, run.facts.stack)]
    assert groups == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                      ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]]


def test_megatron_cores_stack_runs_each_group_as_one_gemm(gqa_llama):
    device = devices.load("h100-sxm")
    facts, model = device.gpu_facts(), device.gpu_model()
    _, eager = _layer_linears(gqa_llama, "eager")
    _, fused = _layer_linears(gqa_llama, "fused")
    head_dim = HIDDEN // HEADS
    groups = {"q_proj k_proj v_proj": HIDDEN + 2 * KV_HEADS * head_dim, "gate_proj up_proj": 2 * FFN}
    for names, width in groups.items():
        members = [fused[name] for name in names.split()]
        # forward: tokens x hidden by hidden x width; input gradient: tokens x width by width x hidden;
        # weight gradient: width x tokens by tokens x hidden (the captured GEMMs' orientation)
        one = {"forward": gemm_ns(TOKENS, HIDDEN, width, 1, "bf16", (HIDDEN, HIDDEN, width), facts, model),
               "input_grad": gemm_ns(TOKENS, width, HIDDEN, 1, "bf16", (width, HIDDEN, HIDDEN), facts, model),
               "weight_grad": gemm_ns(width, TOKENS, HIDDEN, 1, "bf16", (width, HIDDEN, HIDDEN), facts, model)}
        ops = {"forward": [r.forward for r in members],
               "input_grad": [op for r in members for op in r.input_grad if op.gemm_mkn],
               "weight_grad": [op for r in members for op in r.weight_grad if op.gemm_mkn]}
        for phase, expected_ns in one.items():
            assert len(ops[phase]) == len(members)
            assert sum(op.estimated_ns for op in ops[phase]) == pytest.approx(expected_ns, rel=1e-9), (names, phase)
            flops = sum(op.flops for op in ops[phase])
            assert flops == 2 * TOKENS * HIDDEN * width  # each row keeps its own FLOPs
            for op in ops[phase]:  # shared by FLOPs
                assert op.estimated_ns == pytest.approx(expected_ns * op.flops / flops, rel=1e-9)
    for name in ("o_proj", "down_proj"):  # alone: as eager times them
        assert fused[name].forward.estimated_ns == eager[name].forward.estimated_ns
    for name in ("k_proj", "v_proj"):  # eager: each its own GEMM
        m, k, n = eager[name].forward.gemm_mkn
        assert (m, k, n) == (TOKENS, HIDDEN, KV_HEADS * head_dim)
        assert eager[name].forward.estimated_ns == gemm_ns(m, k, n, 1, "bf16", eager[name].forward.gemm_leading,
                                                           facts, model)
