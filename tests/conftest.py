"""Tiny model configs written with save_pretrained into temp folders; nothing is downloaded."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

# Progress lines come every FXWORKLOAD_PROGRESS_EVERY_S seconds of wall time: on a busy CI machine a slow config
# read would put one before a bad input's one-line error. The suite's commands say none (before fxworkload is
# imported, for this process and the commands it starts); the tests of progress set their own interval.
os.environ["FXWORKLOAD_PROGRESS_EVERY_S"] = "86400"

import pytest  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Dropout 0 so that an eager CPU step takes the same kernels as the trace (CPU flash SDPA has no dropout).
TINY = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=64,
                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, architectures=["GPT2LMHeadModel"]),
    "llama": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=112, vocab_size=96, max_position_embeddings=64, architectures=["LlamaForCausalLM"]),
    "bert": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=96,
                 max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                 architectures=["BertForMaskedLM"]),
    "mixtral": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, vocab_size=96, max_position_embeddings=64, num_local_experts=4,
                    num_experts_per_tok=2, architectures=["MixtralForCausalLM"]),
}


@pytest.fixture(scope="session")
def alloc_trace() -> dict:
    """The lent H100's allocator record of GPT-2's build and four steps (tests/fixtures/README.md), read once."""
    return json.loads(gzip.decompress((FIXTURES / "h100_gpt2_alloc_trace.json.gz").read_bytes()))


def tiny_config(model_type: str, **overrides):
    return CONFIG_MAPPING[model_type](**{**TINY[model_type], **overrides})


@pytest.fixture(scope="session", autouse=True)
def _seeded_cpu_profile(tmp_path_factory):
    """The session's cache holds a measured CPU profile (tests/fixtures/README.md) before any test or
    module fixture runs, instead of 30 s of measuring in every test worker."""
    import os

    from fxworkload.cost import devices

    os.environ["FXWORKLOAD_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "cache")
    cpu = devices.measured_path("cpu")
    cpu.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FIXTURES / "cpu_profile.json", cpu)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """model_type -> a folder holding only that tiny model's config.json."""
    dirs = {}
    for model_type in TINY:
        path = tmp_path_factory.mktemp(f"tiny-{model_type}")
        tiny_config(model_type).save_pretrained(path)
        dirs[model_type] = path
    dirs["llama4"] = tmp_path_factory.mktemp("tiny-llama4")  # four layers: pp 2 x vpp 2
    tiny_config("llama", num_hidden_layers=4).save_pretrained(dirs["llama4"])
    return dirs


def pytest_collection_modifyitems(items):
    """Tests marked long first (a stable sort, the same order on every xdist worker): started last, one
    would keep the suite running minutes after the other workers are done."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
