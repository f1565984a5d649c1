"""Families beyond the Llama shape extract: state-space models without attention heads, RWKV,
multimodal models whose language model is a text sub-config (issue 17: these once crashed on
``num_attention_heads`` and a top-level ``vocab_size``). Each is transformers' default config with
its language model cut to 2 layers, saved with save_pretrained; the oracle is the module that
transformers builds from the same config."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING

from fxworkload.capture import models
from fxworkload.pipeline import extract
from fxworkload.parallel.layout import Parallel

FAMILIES = ("mamba", "rwkv", "gemma3", "llama4", "mllama", "fuyu")
LAYERS = 2


def _two_layer_config(model_type: str):
    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config(decoder=True)
    before = text.num_hidden_layers
    text.num_hidden_layers = LAYERS
    for name, value in vars(text).items():  # per-layer lists (layer_types, ...) keep their first entries
        if isinstance(value, list) and len(value) == before:
            setattr(text, name, value[:LAYERS])
    return config


@pytest.mark.parametrize("model_type", FAMILIES)
def test_extracts_and_every_parameter_gets_one_gradient(model_type, tmp_path):
    _two_layer_config(model_type).save_pretrained(tmp_path)
    result = extract(str(tmp_path), seq=16, use_cache=False, parallel=Parallel(dp=2))
    module = models.build_meta_model(models.resolve(str(tmp_path)), torch.float32)
    assert result.workload.totals["forward_flops"] > 0
    named = [p for row in result.workload.grad_rows for p in row.parameters]
    assert sorted(named) == sorted(name for name, p in module.named_parameters() if p.requires_grad)
    assert result.facts.layers == LAYERS
    assert result.facts.vocab == module.get_output_embeddings().weight.shape[0]
    assert result.workload.totals["parameter_count"] == sum(p.numel() for p in module.parameters() if p.requires_grad)
    if model_type == "mamba":
        assert result.facts.heads == 0  # no attention: the parallel checks have no heads to divide


def test_per_layer_sizes_are_checked_element_by_element(tmp_path):
    """Gemma 3n keeps intermediate_size per layer: a list of sizes is a size too (each checked)."""
    from fxworkload.errors import UserError

    config = CONFIG_MAPPING["gemma3n_text"]()
    assert isinstance(config.intermediate_size, list)
    models.check_sizes(config, tmp_path / "config.json")  # no error
    config.intermediate_size = [*config.intermediate_size[:-1], 0]
    with pytest.raises(UserError, match=r"intermediate_size = 0 \(in a per-layer list\) is not a model size"):
        models.check_sizes(config, tmp_path / "config.json")
