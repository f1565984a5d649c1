"""GPT-2 training matmul FLOPs against Megatron-LM's formula (Narayanan et al. 2021, no recomputation):
72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""

from __future__ import annotations

import pytest

from fxworkload.pipeline import extract


def megatron_flops(batch, seq, layers, hidden, vocab) -> float:
    return 72 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def _matmul_flops(result) -> int:
    return sum(op.flops for op in result.workload.ops() if op.kind in ("matmul", "attention"))


@pytest.mark.parametrize("model,batch,seq", [("gpt2", 2, 128), ("gpt2-medium", 1, 256)])
def test_gpt2_matmul_flops_match_megatron(model, batch, seq):
    """The shipped GPT-2 configs have attention dropout 0.1, so attention runs as plain GEMMs
    (PyTorch's math SDPA path): no recomputation, the formula holds exactly."""
    result = extract(model, batch=batch, seq=seq, trace_on="cpu")
    config = result.spec.config
    expected = megatron_flops(batch, seq, config.n_layer, config.n_embd, config.vocab_size)
    assert _matmul_flops(result) == pytest.approx(expected, rel=0.02)
    assert _matmul_flops(result) == expected


def test_fused_attention_adds_exactly_the_recomputed_scores(tiny_dirs):
    """With dropout 0, attention is the fused flash kernel, whose backward recomputes QKᵀ:
    2·B·s²·h FLOPs per layer on top of Megatron's count, and nothing else."""
    batch, seq = 2, 32
    result = extract(str(tiny_dirs["gpt2"]), batch=batch, seq=seq, trace_on="cpu")
    c = result.spec.config
    residual = c.n_layer * 2 * batch * seq ** 2 * c.n_embd
    assert _matmul_flops(result) == megatron_flops(batch, seq, c.n_layer, c.n_embd, c.vocab_size) + residual
