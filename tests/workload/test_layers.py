"""The fast path (one middle layer standing for all) and the graph cache against the full trace."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from transformers import CONFIG_MAPPING

from fxworkload.capture import trace
from fxworkload.workload import layers
from fxworkload.capture import models
from fxworkload.pipeline import extract
from fxworkload.formats.tables import json_text, tsv_text

from ..conftest import tiny_config

LAYERS = 7  # more than the 3 the fast path captures, so that middle layers are re-emitted


def _texts(result) -> tuple[str, str]:
    """The table and workload.json, less the allocator's slack: the one figure the fast path takes from its
    longer copy instead of adding up layers (its holes are one layer's, re-used by the next; checked apart)."""
    texts = tsv_text(result.workload, "bytes"), json_text(result.workload, result.settings, asdict(result.device))
    return tuple("\n".join(line for line in text.splitlines() if "reserved_" not in line) for text in texts)


@pytest.fixture(scope="module")
def deep_dirs(tmp_path_factory):
    dirs = {}
    for model_type in ("gpt2", "llama", "mixtral", "bert"):
        path = tmp_path_factory.mktemp(f"deep-{model_type}")
        tiny_config(model_type, num_hidden_layers=LAYERS).save_pretrained(path)
        dirs[model_type] = path
    return dirs


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mixtral", "bert"])
def test_fast_path_table_is_byte_identical_to_the_full_trace(deep_dirs, model_type, monkeypatch):
    used = []
    original = layers.fast_workload
    monkeypatch.setattr(layers, "fast_workload", lambda *a, **k: used.append(1) or original(*a, **k))
    fast = extract(str(deep_dirs[model_type]), batch=2, seq=16, use_cache=False)
    full = extract(str(deep_dirs[model_type]), batch=2, seq=16, use_cache=False, every_layer=True)
    assert used and len(fast.workload.node_rows) > 0
    assert _texts(fast) == _texts(full)
    # the slack differs by less than one of the small pool's 2 MiB segments (CUDACachingAllocator's kSmallBuffer)
    assert abs(fast.workload.reserved_slack_bytes - full.workload.reserved_slack_bytes) < 2 << 20
    spec = models.resolve(str(deep_dirs[model_type]))
    model = models.build_meta_model(spec, torch.float32)
    stack = layers.uniform_stack(spec, model)
    assert stack is not None and layers.fast_workload(spec, stack, 2, 16, torch.float32, torch.float32) is not None


def test_layers_that_differ_are_traced_one_by_one(tmp_path):
    """Qwen2 with sliding-window attention in its upper layers: no layer may stand for the others."""
    config = CONFIG_MAPPING["qwen2"](num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=96, vocab_size=96,
                                     max_position_embeddings=64, use_sliding_window=True, sliding_window=8,
                                     max_window_layers=3, architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(tmp_path)
    spec = models.resolve(str(tmp_path))
    model = models.build_meta_model(spec, torch.float32)
    assert layers.uniform_stack(spec, model) is None
    assert _texts(extract(str(tmp_path), seq=16, use_cache=False)) == \
        _texts(extract(str(tmp_path), seq=16, use_cache=False, every_layer=True))


# Models whose layers differ but repeat: DeepSeek-V3's dense layers before its MoE ones (first_k_dense_replace),
# gpt-oss's sliding-window and full attention in turn (its layer_types).
REPEATING = {
    "deepseek_v3": dict(num_hidden_layers=12, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1,
                        vocab_size=96, max_position_embeddings=64, rope_parameters={"rope_type": "default"}),
    "gpt_oss": dict(num_hidden_layers=16, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=96,
                    max_position_embeddings=64, sliding_window=8),
}
# Gemma 3's five sliding-window layers to one global (its layer_types' default pattern): a unit of six, cut to
# three repetitions only where it has eight or more (the copies trace 18 and 24 layers, together fewer than 48)
REPEATING["gemma3_text"] = dict(num_hidden_layers=48, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64,
                                sliding_window=8)
# gpt-oss's attention in turn for ten pairs, then three full-attention layers: the layers after the run sit 16
# places earlier in the short copy, where the model's loop reads its masks from config.layer_types by position
REPEATING["gpt_oss_tail"] = REPEATING["gpt_oss"] | dict(
    num_hidden_layers=23, layer_types=["sliding_attention", "full_attention"] * 10 + ["full_attention"] * 3)


@pytest.mark.parametrize("model_type", sorted(REPEATING))
def test_layers_that_differ_but_repeat_give_the_full_traces_table_from_short_copies(tmp_path, model_type,
                                                                                     monkeypatch):
    """The piecewise path (a repeated run of layers cut to its first, one middle and its last repetition) writes
    the files the full trace writes, byte for byte (the allocator's slack aside, as for the one-layer path)."""
    CONFIG_MAPPING[model_type.removesuffix("_tail")](**REPEATING[model_type]).save_pretrained(tmp_path)
    spec = models.resolve(str(tmp_path))
    model = models.build_meta_model(spec, torch.float32)
    assert layers.uniform_stack(spec, model) is None
    stack, kinds = layers.layer_kinds(model, REPEATING[model_type]["num_hidden_layers"])
    tables = []
    original = layers.piecewise_workload
    monkeypatch.setattr(layers, "piecewise_workload", lambda *a, **k: tables.append(original(*a, **k)) or tables[-1])
    piecewise = extract(str(tmp_path), batch=2, seq=16, use_cache=False)
    full = extract(str(tmp_path), batch=2, seq=16, use_cache=False, every_layer=True)
    assert len(tables) == 1 and tables[0] is not None  # the short copies agreed and were used
    assert _texts(piecewise) == _texts(full)
    assert abs(piecewise.workload.reserved_slack_bytes - full.workload.reserved_slack_bytes) < 2 << 20


def test_the_loop_over_a_cut_layer_list_reads_each_kept_layers_own_kind_by_its_place(tmp_path):
    """transformers' loop picks a layer's mask by its place in the list (``config.layer_types[i]``): in the cut
    copy, place i must name the kind of the layer that sits there (here the full-attention layers after the run
    would otherwise read the sliding pattern's), while each layer keeps its own."""
    config = REPEATING["gpt_oss_tail"]
    CONFIG_MAPPING["gpt_oss"](**config).save_pretrained(tmp_path)
    spec = models.resolve(str(tmp_path))
    stack, kinds = layers.layer_kinds(models.build_meta_model(spec, torch.float32), config["num_hidden_layers"])
    kept = layers.kept_layers(len(kinds), layers.repeats(kinds))
    assert kept == [0, 1, 2, 3, 18, 19, 20, 21, 22]
    model = layers.pruned_model(spec, stack, kept, torch.float32)
    loop = model.get_submodule(stack.rpartition(".")[0])
    assert loop.config.layer_types == [config["layer_types"][i] for i in kept]
    assert [layer.self_attn.layer_type for layer in loop.layers] == loop.config.layer_types
    assert [layer.self_attn.layer_idx for layer in loop.layers] == kept  # each layer keeps its own index
    assert model.config.layer_types == config["layer_types"]  # the model's own config untouched


@pytest.mark.parametrize("kinds, expected", [
    ((0, 0, 0) + (1,) * 58, [layers.Repeat(3, 1, 58)]),  # DeepSeek-V3: three dense layers, 58 MoE
    ((0, 1) * 12, [layers.Repeat(0, 2, 12)]),  # gpt-oss-20b: sliding and full attention in turn
    ((0,) * 5 + (1,) + ((0,) * 5 + (1,)) * 9 + (0, 0), [layers.Repeat(0, 6, 10)]),  # Gemma 3 27B: 62 layers
    ((0, 0, 0, 1, 1, 1), []),  # nothing four times in a row
    ((0, 1, 1, 1, 1, 2, 2, 2, 2, 2), [layers.Repeat(1, 1, 4), layers.Repeat(5, 1, 5)]),
])
def test_repeated_runs_of_layers_are_found_as_counted_by_hand(kinds, expected):
    assert layers.repeats(kinds) == expected


def test_each_layer_of_a_run_is_stood_for_by_its_first_its_kept_middle_or_its_last_repetition():
    """Layers 0-2 alone, then a unit of two layers repeated 5 times from layer 3 (layers 3-12): the copy keeps
    repetitions 0, 1 and 4 (layers 3, 4 | 5, 6 | 11, 12); repetitions 2 and 3 take the kept middle one's."""
    run = layers.Repeat(3, 2, 5)
    assert layers.kept_layers(13, [run]) == [0, 1, 2, 3, 4, 5, 6, 11, 12]
    assert layers.kept_layers(13, [run], extra=run) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12]
    assert [layers.standing_for(i, [run]) for i in range(13)] == [0, 1, 2, 3, 4, 5, 6, 5, 6, 5, 6, 11, 12]


def test_cached_step_is_recosted_without_capturing(deep_dirs, monkeypatch):
    """The H200 and the H100 dispatch the same kernels (sm90, same SDPA order): one capture serves both."""
    first = extract(str(deep_dirs["llama"]), seq=16, device="h200")

    def no_capture(*args, **kwargs):
        raise AssertionError("captured again although the step is cached")
    monkeypatch.setattr(trace, "capture_training_step", no_capture)
    monkeypatch.setattr(layers, "fast_workload", no_capture)
    again = extract(str(deep_dirs["llama"]), seq=16, device="h100-sxm")
    monkeypatch.undo()
    fresh = extract(str(deep_dirs["llama"]), seq=16, device="h100-sxm", use_cache=False)
    assert _texts(again) == _texts(fresh)
    assert first.workload.totals["step_estimated_ns"] != again.workload.totals["step_estimated_ns"]


def test_no_cache_neither_reads_nor_writes(tmp_path, monkeypatch):
    from fxworkload.workload import cache as graph_cache
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny_config("gpt2")
    config.save_pretrained(tmp_path / "m")
    extract(str(tmp_path / "m"), seq=8, use_cache=False)
    assert not (tmp_path / "cache" / "graphs").exists()
    extract(str(tmp_path / "m"), seq=8)
    assert len(list((tmp_path / "cache" / "graphs").glob("*.json"))) == 1
    config = config.to_dict()
    key_a = graph_cache.key(config, 1, 8, "fp32", "fp32", "cpu")
    assert key_a != graph_cache.key(config, 1, 16, "fp32", "fp32", "cpu")
    assert key_a != graph_cache.key(config, 1, 8, "bf16", "bf16", "cpu")
    assert key_a != graph_cache.key(config, 1, 8, "fp32", "fp32", "cpu", every_layer=True)
