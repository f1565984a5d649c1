"""Gradient all-reduce rows: every trainable parameter exactly once, sizes in the gradient dtype."""

from __future__ import annotations

import csv

import pytest
import torch

from fxworkload.capture import models
from fxworkload.capture.builtin import builtin_names
from fxworkload.pipeline import extract
from fxworkload.formats.tables import tsv_text

# Published trainable-parameter counts (model cards / papers), an oracle independent of our configs.
PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
             "gpt2-xl": 1_557_611_200, "llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248,
             "llama-3-70b": 70_553_706_496, "mistral-7b": 7_241_732_096, "qwen2-7b": 7_615_616_512,
             "mixtral-8x7b": 46_702_792_704, "bert-base-uncased": 109_514_298}


def _tsv_rows(workload, size_unit="bytes"):
    return list(csv.DictReader(tsv_text(workload, size_unit).splitlines(), delimiter="\t"))


def test_every_published_model_is_built_in():
    assert sorted(PUBLISHED) == builtin_names()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gradient_sizes_sum_to_the_real_modules_parameters(name):
    result = extract(name, batch=1, seq=8, dtype="bf16", grad_dtype="fp32")
    module = models.build_meta_model(models.resolve(name), torch.bfloat16)
    real = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert real == PUBLISHED[name]
    rows = [r for r in _tsv_rows(result.workload) if r["backward_comm_type"] == "ALLREDUCE_ASYNC"]
    assert sum(int(r["backward_comm_size"]) for r in rows) == real * 4  # fp32 gradients
    named = [p for r in result.workload.grad_rows for p in r.parameters]
    assert len(named) == len(set(named)) == len(list(module.named_parameters()))
    assert sorted({op.op for op in result.workload.ops() if not op.has_flop_rule}) == []


def test_gpt2_tied_embedding_counted_once_and_position_embedding_present():
    result = extract("gpt2", batch=1, seq=8, size_unit="elements")
    rows = {r["name"]: r for r in _tsv_rows(result.workload, "elements")}
    assert int(rows["transformer_wte_grad"]["backward_comm_size"]) == 50257 * 768  # vocab · hidden
    assert int(rows["transformer_wpe_grad"]["backward_comm_size"]) == 1024 * 768
    assert not any(name.startswith("lm_head") and name.endswith("_grad") for name in rows)


def test_grad_row_sits_right_before_its_modules_main_op(tiny_dirs):
    workload = extract(str(tiny_dirs["gpt2"]), batch=1, seq=8).workload
    names = [r.name for r in workload.rows]
    for row in workload.grad_rows:
        assert names[names.index(row.name) + 1] == row.name.removesuffix("_grad")


def test_a_tied_weights_gradient_sum_belongs_to_its_first_use(tiny_dirs):
    """Issue 28 §5: GPT-2's head shares the input embedding's weight; autograd adds the two gradients
    outside any grad_fn, and that add went to whichever forward op came last (a `getitem_1` row no user
    could place). It is the embedding's weight gradient: the row of the weight's first use."""
    from fxworkload.pipeline import extract

    rows = extract(str(tiny_dirs["gpt2"]), seq=16, use_cache=False).nodes
    wte = next(r for r in rows if r.module == "transformer.wte")
    assert [op.op for op in wte.weight_grad][-1] == "aten.add.Tensor"
    assert all(not (r.input_grad or r.weight_grad) for r in rows if r.name.startswith("getitem"))
