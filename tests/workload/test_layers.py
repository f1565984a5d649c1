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
