"""FlexAttention (--attention flex): the tiles its kernel visits, against torch's own block mask; its graph, its
FLOPs and what it saves, against hand counts and transformers' eager attention."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers import GptOssConfig

from fxworkload.capture import flex
from fxworkload.pipeline import extract

from ..test_cli import in_process


def causal(b, h, q, kv):
    return kv <= q


def window(size):
    def mask(b, h, q, kv):
        return (kv <= q) & (q - kv < size)
    return mask


def _torch_counts(mask_mod, q_len, kv_len):
    """Oracle: torch's create_block_mask (real tensors, uncompiled): its partial and full tile counts."""
    block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu")
    return int(block_mask.kv_num_blocks.sum()), int(block_mask.full_kv_num_blocks.sum())


@pytest.mark.parametrize("mask_mod, q_len, kv_len", [(causal, 1024, 1024), (causal, 1000, 1000),
                                                      (window(64), 1024, 1024), (window(200), 900, 900),
                                                      (window(128), 640, 1280)])
def test_block_counts_match_torchs_block_mask(mask_mod, q_len, kv_len):
    partial, full, tiles = flex.block_counts(mask_mod, q_len, kv_len)
    assert (partial, full) == _torch_counts(mask_mod, q_len, kv_len)
    assert tiles == math.ceil(q_len / 128) * math.ceil(kv_len / 128)


@pytest.mark.parametrize("mask_mod", [causal, window(200)])
def test_sampled_block_counts_match_for_masks_wider_than_the_sample_grid(monkeypatch, mask_mod):
    """Past EXACT_EVALUATIONS a tile is judged from every 16th row and column and its last: exact for masks whose
    features are wider than 16 positions."""
    monkeypatch.setattr(flex, "EXACT_EVALUATIONS", 0)
    partial, full, _ = flex.block_counts(mask_mod, 1100, 1100)
    assert (partial, full) == _torch_counts(mask_mod, 1100, 1100)


SEQ = 1024


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """GPT-OSS's shape in small: sinks, a sliding window of 64 on every other layer, grouped-query heads."""
    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    GptOssConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=96,
                 sliding_window=64, max_position_embeddings=2048).save_pretrained(path)
    return path


def _attention_ops(run):
    return [op for op in run.workload.ops() if op.attention is not None]


def test_flex_capture_records_the_kernels_with_the_tiles_each_layer_visits(tiny_gpt_oss):
    run = extract(str(tiny_gpt_oss), batch=1, seq=SEQ, dtype="bf16", device="h100-sxm", attention="flex",
                  use_cache=False)
    ops = _attention_ops(run)
    forward = [op for op in ops if not op.attention["backward"]]
    backward = [op for op in ops if op.attention["backward"]]
    assert [op.op for op in forward] == ["flex_attention"] * 2 and len(backward) == 2
    # FLOPs as torch's FlopCounterMode counts flex attention (dense): 4·B·H·Q·KV·D forward, 2.5 times that backward
    dense = 4 * 1 * 4 * SEQ * SEQ * 16
    assert [op.flops for op in forward] == [dense, dense]
    assert [op.flops for op in backward] == [int(2.5 * dense)] * 2
    # by hand: 8 query tiles; the window of 64 visits the diagonal and the one below it (8 + 7 of 64),
    # the causal layer the diagonal and all below (8 · 9 / 2 = 36 of 64)
    shares = sorted({op.attention["visited_share"] for op in ops})
    assert shares == [15 / 64, 36 / 64]


def test_flex_keeps_no_score_matrix_where_eager_keeps_one_a_layer(tiny_gpt_oss):
    """transformers' eager attention with sinks saves its (seq x seq + 1) softmax; flex saves none."""
    runs = {attention: extract(str(tiny_gpt_oss), batch=1, seq=SEQ, dtype="bf16", device="h100-sxm",
                               attention=attention, use_cache=False) for attention in ("eager", "flex")}
    score_elements = 4 * SEQ * SEQ  # one layer's heads x seq x seq

    def largest_output(run):
        return max(math.prod(shape) for op in run.workload.ops() for shape in op.output_shapes)

    assert largest_output(runs["eager"]) >= score_elements
    assert largest_output(runs["flex"]) < score_elements / 8
    assert runs["flex"].memory.total_peak_bytes < runs["eager"].memory.total_peak_bytes


def test_flex_with_attention_dropout_and_unsupported_models_say_what_to_do(tiny_dirs, tiny_gpt_oss, tmp_path):
    GptOssConfig.from_pretrained(tiny_gpt_oss).save_pretrained(tmp_path)
    run = in_process("extract", tiny_dirs["gpt2"], "--seq", 16, "--attention", "flex", "--out", tmp_path / "o")
    assert run.returncode == 2 and "does not support --attention flex" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
    bad = in_process("extract", tiny_gpt_oss, "--seq", 16, "--attention", "flash2")
    assert bad.returncode == 2 and "unknown --attention 'flash2'" in bad.stderr
