"""Activation memory read off the joint graph, against torch's own MemTracker (an eager step under
FakeTensorMode) and Korthikanti et al. 2022's per-layer formulas."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from fxworkload.capture.trace import _unpacked_sequences
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract
from fxworkload.workload.layers import layer_of

from ..conftest import tiny_config


def _memtracker_step_peak(config, batch: int, seq: int) -> int:
    """MemTracker's peak over an eager step (grads None before it), above the parameters and buffers;
    without the key/value cache, which a training step does not keep. Over fake tensors transformers
    cannot see that each row holds one sequence, as it does on real ones, and would build a mask:
    _unpacked_sequences answers as it does on real tensors."""
    config.use_cache = False
    with FakeTensorMode(), _unpacked_sequences():
        model = AutoModelForCausalLM.from_config(config).train()
        ids = torch.zeros(batch, seq, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(ids, labels=ids).loss.backward()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    resident = {str(kind).rsplit(".", 1)[-1]: value for kind, value in peak.items()}
    return resident["Total"] - resident["PARAM"] - resident["BUFFER"]


@pytest.mark.parametrize("model_type, batch, seq, tolerance", [("llama", 4, 64, 0.01), ("gpt2", 2, 16, 0.06), ("gpt2", 4, 64, 0.06)])
def test_step_peak_matches_memtracker(model_type, batch, seq, tolerance, tiny_dirs):
    """Llama agrees to 0.02 %. GPT-2's eager peak is 4.5 % (b2 s16) and 5.8 % (b4 s64) higher:
    eager frees a tensor when its last Python reference goes, which can be after the graph's last
    read of it; not found which tensors (README: known limits)."""
    ours = extract(str(tiny_dirs[model_type]), batch=batch, seq=seq, trace_on="cpu").workload.step_peak_bytes
    oracle = _memtracker_step_peak(tiny_config(model_type), batch, seq)
    assert abs(ours - oracle) / oracle <= tolerance, (ours, oracle)


def test_the_one_layer_fast_path_gives_the_every_layer_peaks(tmp_path):
    tiny_config("llama", num_hidden_layers=7).save_pretrained(tmp_path)
    fast = extract(str(tmp_path), batch=2, seq=16, use_cache=False, trace_on="cpu").workload
    full = extract(str(tmp_path), batch=2, seq=16, use_cache=False, every_layer=True, trace_on="cpu").workload
    assert (fast.step_peak_bytes, fast.activation_peak_bytes, fast.saved_bytes) == (
        full.step_peak_bytes, full.activation_peak_bytes, full.saved_bytes)
    for policy in ("selective", "op"):  # what each row keeps under recomputation is carried to every layer too
        fast, full = (extract(str(tmp_path), batch=2, seq=16, use_cache=False, every_layer=every, trace_on="cpu",
                              parallel=Parallel(recompute=policy)).workload for every in (False, True))
        assert fast.saved_bytes == full.saved_bytes, policy


def _megatron_gpt(folder, activation: str, attention: str | None = None):
    """HF GPT-2 shaped as Megatron's GPT layer (h 256, a 4), with dropout 0.1; ``attention`` "eager"
    for the unfused attention core of the paper's time (config.json's attn_implementation)."""
    config = CONFIG_MAPPING["gpt2"](n_layer=2, n_embd=256, n_head=4, vocab_size=512, n_positions=256,
                                    activation_function=activation)
    config.save_pretrained(folder)
    if attention is not None:
        data = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(data | {"attn_implementation": attention}))


def _saved_per_layer(result) -> collections.Counter:
    per_layer = collections.Counter()
    for row in result.workload.node_rows:
        per_layer[layer_of(row.module, result.facts.stack)] += row.saved_bytes
    return per_layer


@pytest.mark.parametrize("tp, sp, sbh_bytes_per_layer", [(1, False, 34), (2, False, 10 + 24 / 2), (2, True, 34 / 2),
                                                         (4, True, 34 / 4)])
def test_a_megatron_shaped_gpt_saves_what_korthikanti_counts(tp, sp, sbh_bytes_per_layer, tmp_path):
    """Korthikanti et al. 2022: a GPT layer saves sbh(34 + 5as/h) bytes in 16-bit (masks 1 byte);
    with a fused attention kernel the 5as/h term (scores, softmax, its dropout) is not stored, as
    with their selective recomputation: sbh·34, sbh(10 + 24/t) with tensor parallelism t, and
    sbh·34/t with sequence parallelism too.
    HF GPT-2 with exact GELU (one aten op) and dropout 0.1 is that layer, in eager; traced as an H100 runs it."""
    hidden, seq, batch = 256, 128, 2
    _megatron_gpt(tmp_path, "gelu")
    result = extract(str(tmp_path), batch=batch, seq=seq, dtype="bf16", device="h100-sxm",
                     parallel=Parallel(tp=tp, sp=sp))
    formula = seq * batch * hidden * sbh_bytes_per_layer
    per_layer = _saved_per_layer(result)
    for layer in (0, 1):
        assert abs(per_layer[layer] - formula) / formula <= 0.05, (layer, per_layer[layer], formula)


# Korthikanti et al. 2022, Table 2 (per layer, 16-bit, t-way tensor parallelism): no parallelism
# sbh(34 + 5as/h); tensor parallel sbh(10 + 24/t + 5as/(ht)); + sequence parallel sbh(34/t + 5as/(ht));
# + selective recomputation sbh(34/t). Here a = 4, s = 128, h = 256: 5as/h = 10.
KORTHIKANTI_TABLE_2 = [(1, False, "none", 34 + 10), (2, False, "none", 10 + 24 / 2 + 10 / 2),
                       (2, True, "none", 34 / 2 + 10 / 2), (4, True, "none", 34 / 4 + 10 / 4),
                       (2, True, "selective", 34 / 2), (4, True, "selective", 34 / 4)]


@pytest.mark.parametrize("tp, sp, recompute, sbh_bytes_per_layer", KORTHIKANTI_TABLE_2)
def test_the_fused_stack_saves_what_korthikantis_table_2_counts(tp, sp, recompute, sbh_bytes_per_layer, tmp_path):
    """GPT-2's gelu_new is eight aten ops, each keeping its inputs in eager (1.5-1.7x the formula);
    Megatron's fused bias-GeLU keeps the GEMM output alone, and its fused scale-mask-softmax, dropout
    and layer norm keep what the paper counts. With the unfused attention core of the paper's time
    (attn_implementation eager), every row of the paper's Table 2 within 5 %."""
    hidden, seq, batch = 256, 128, 2
    _megatron_gpt(tmp_path, "gelu_new", attention="eager")
    formula = seq * batch * hidden * sbh_bytes_per_layer
    result = extract(str(tmp_path), batch=batch, seq=seq, dtype="bf16", device="h100-sxm", stack="fused",
                     parallel=Parallel(tp=tp, sp=sp, recompute=recompute))
    for layer in (0, 1):
        assert abs(_saved_per_layer(result)[layer] - formula) / formula <= 0.05, (layer, formula)
    eager = extract(str(tmp_path), batch=batch, seq=seq, dtype="bf16", device="h100-sxm", stack="eager",
                    parallel=Parallel(tp=tp, sp=sp, recompute=recompute))
    assert _saved_per_layer(eager)[0] > 1.2 * formula  # the eager GeLU chain's saves: what the stack removes
