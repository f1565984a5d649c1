"""Parallel layouts against hand computations: Megatron-LM's FLOP and activation formulas, parameter
counts worked out from the config, the ZeRO paper's communication volumes (Rajbhandari et al. 2020, §7)."""

from __future__ import annotations

import pytest

from fxworkload.capture.trace import FORWARD, INPUT_GRAD, PHASES, WEIGHT_GRAD
from fxworkload.parallel.collectives import ALLREDUCE, ALLTOALL, volume_bytes

from ..conftest import tiny_config
from fxworkload.pipeline import extract
from fxworkload.parallel.layout import Parallel, stage_layers
from .test_megatron import _matmul_flops, megatron_flops

ITEMSIZE = {"fp32": 4, "bf16": 2}


def _units(result):
    return [u for u in result.rank.units if u.block != "dp"]


def _comms(result, phase, group):
    return [c for u in result.rank.units for c in u.comms[phase] if c.group == group]


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mixtral", "bert"])
def test_one_rank_units_add_up_to_the_plain_extraction(tiny_dirs, model_type):
    result = extract(str(tiny_dirs[model_type]), batch=2, seq=16)
    totals = result.workload.totals
    units = _units(result)
    assert units[0].name == "embedding" and units[-1].name == "head"
    for phase in PHASES:
        assert sum(u.flops(phase) for u in units) == totals[f"{phase}_flops"]
        assert sum(u.ns(phase) for u in units) == pytest.approx(totals[f"{phase}_estimated_ns"], rel=1e-12)
    assert all(not u.comms[phase] for u in result.rank.units for phase in PHASES)
    assert sum(g.elements for u in units for g in u.grads) == totals["parameter_count"]


def test_gpt2_flops_per_tp_rank_are_megatrons_over_tp():
    """Every matmul of GPT-2 is split (heads, MLP, vocabulary-parallel head): 1/tp of Megatron's count,
    with the vocabulary padded as Megatron pads it."""
    batch, seq, tp = 1, 64, 4
    result = extract("gpt2", batch=batch, seq=seq, parallel=Parallel(tp=tp, vocab_multiple=128), trace_on="cpu")
    c = result.spec.config
    assert c.vocab_size == 99 * 512  # 50257 padded up to a multiple of 128 x tp
    assert _matmul_flops(result) * tp == pytest.approx(megatron_flops(batch, seq, c.n_layer, c.n_embd, c.vocab_size),
                                                      rel=1e-12)


def test_llama_split_ops_carry_one_tp_share_of_the_flops(tiny_dirs):
    """Every GEMM and attention op of the attention and MLP blocks, forward and backward, does half the
    work at tp = 2; the norms outside them do all of it on every rank."""
    def gemm_flops(workload, select):
        rows = {r.name: [op.flops for op in (r.forward, *r.input_grad, *r.weight_grad)
                         if op.kind in ("matmul", "attention")] for r in workload.node_rows if select(r.module)}
        return {name: flops for name, flops in rows.items() if flops}

    def in_blocks(module):
        return ".self_attn" in module or ".mlp" in module

    whole = extract(str(tiny_dirs["llama"]), batch=2, seq=16)
    share = extract(str(tiny_dirs["llama"]), batch=2, seq=16, parallel=Parallel(tp=2))
    full, half = gemm_flops(whole.workload, in_blocks), gemm_flops(share.workload, in_blocks)
    assert sum(map(len, full.values())) >= 2 * 7 * 3 and full.keys() == half.keys()
    assert {name: [2 * f for f in flops] for name, flops in half.items()} == full
    norms = [(r.forward.flops, r.forward.op) for r in whole.workload.node_rows if "layernorm" in r.module]
    assert norms and norms == [(r.forward.flops, r.forward.op) for r in share.workload.node_rows if "layernorm" in r.module]


@pytest.mark.parametrize("model", ["gpt2", "llama-3-8b"])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_collectives_move_batch_seq_hidden(model, sp):
    """Megatron-LM: per layer, two all-reduces forward and two backward of b·s·h values (with SP an
    all-gather and a reduce-scatter instead of each)."""
    batch, seq, tp, dtype = 2, 32, 4, "bf16"
    result = extract(model, batch=batch, seq=seq, dtype=dtype, parallel=Parallel(tp=tp, sp=sp, vocab_multiple=128))
    hidden = result.spec.config.hidden_size
    layers = result.spec.config.num_hidden_layers
    per_layer = 4 if sp else 2
    for phase in (FORWARD, INPUT_GRAD):
        layer_comms = [c for u in _units(result) if u.layer is not None for c in u.comms[phase]]
        assert len(layer_comms) == per_layer * layers
        assert {c.bytes for c in layer_comms} == {batch * seq * hidden * ITEMSIZE[dtype]}
    loss = [c for c in _comms(result, FORWARD, "tp") if "cross entropy" in c.what]
    assert [c.bytes for c in loss] == [batch * seq * 4] * 3


@pytest.mark.parametrize("recipe, gathered_itemsize", [("torchao", 1), ("te", 1), (None, 2)])
def test_fp8_tensor_parallelism_gathers_in_fp8(recipe, gathered_itemsize):
    """torchao/float8/float8_tensor_parallel.py: PrepareFloat8ModuleInput casts a block's input to float8 before
    its all-gather, and Float8RowwiseParallel casts a row-parallel output's gradient before the backward's
    all-gather ("fwd noop bwd cast"); Transformer Engine's LayerNormLinear gathers its quantized norm output,
    and grad_output_preprocess gathers the gradient with its quantizer: one byte an element either way;
    the reduce-scatters stay bf16, as everything does without FP8."""
    batch, seq, tp = 2, 32, 4
    result = extract("llama-3-8b", batch=batch, seq=seq, dtype="bf16", fp8=recipe is not None,
                     fp8_recipe=recipe or "te", device="h100-sxm", parallel=Parallel(tp=tp, sp=True, vocab_multiple=128))
    hidden = result.spec.config.hidden_size
    for phase in (FORWARD, INPUT_GRAD):
        layer_comms = [c for u in _units(result) if u.layer is not None for c in u.comms[phase]]
        assert {c.bytes for c in layer_comms if c.type == "ALLGATHER"} == {batch * seq * hidden * gathered_itemsize}
        assert {c.what.endswith(" in FP8") for c in layer_comms if c.type == "ALLGATHER"} == {recipe is not None}
        assert {c.bytes for c in layer_comms if c.type == "REDUCESCATTER"} == {batch * seq * hidden * 2}


def _llama_stage_parameters(config, layers: int, tp: int, first: bool, last: bool) -> int:
    """One tensor-parallel rank's parameters, counted by hand from the config (norms are replicated)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = (h * h + 2 * h * kv + h * h) // tp + 3 * h * i // tp + 2 * h
    return layers * per_layer + (v * h // tp if first else 0) + ((h + v * h // tp) if last else 0)


@pytest.mark.parametrize("zero,volume", [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_data_parallel_bytes_and_zero_volumes(tiny_dirs, zero, volume):
    """ZeRO 0: the all-reduced bytes are the rank's stage parameters; each rank moves 2Ψ (ring all-reduce),
    2Ψ for ZeRO 1/2 (reduce-scatter + all-gather), 3Ψ for ZeRO 3, times (n-1)/n."""
    config_dir = tiny_dirs["llama"]
    dp, tp, pp = 4, 2, 2
    for stage in range(pp):
        result = extract(str(config_dir), batch=1, seq=16, parallel=Parallel(dp=dp, tp=tp, pp=pp, zero=zero, stage=stage))
        c = result.spec.config
        psi = 4 * _llama_stage_parameters(c, c.num_hidden_layers // pp, tp, stage == 0, stage == pp - 1)
        dp_comms = _comms(result, WEIGHT_GRAD, "dp")
        reduced = [x for x in dp_comms if "gradient" in x.what]
        assert sum(x.bytes for x in reduced) == psi
        assert all(x.type == (ALLREDUCE if zero == 0 else "REDUCESCATTER") for x in reduced)
        assert sum(volume_bytes(x, dp) for x in dp_comms) == pytest.approx(volume * psi * (dp - 1) / dp)


def test_buckets_follow_ddp(tiny_dirs):
    """A 0 MiB cap gives one collective per parameter group; a model smaller than DDP's first 1 MiB
    bucket is one collective whatever the cap (the caps themselves: the test below)."""
    per_group = extract(str(tiny_dirs["gpt2"]), batch=1, seq=16, parallel=Parallel(dp=2, bucket_mb=0))
    groups = [g for u in _units(per_group) for g in u.grads]
    assert len(_comms(per_group, WEIGHT_GRAD, "dp")) == len(groups)
    one = extract(str(tiny_dirs["gpt2"]), batch=1, seq=16, parallel=Parallel(dp=2, bucket_mb=1e6))
    assert len(_comms(one, WEIGHT_GRAD, "dp")) == 1  # the tiny model fits in DDP's first 1 MiB bucket


@pytest.mark.parametrize("bucket_mb", [25, 5])
def test_buckets_are_ddps_own_assignment(bucket_mb):
    """PyTorch DDP's bucketing function, run over one tensor per parameter group of GPT-2 (124M
    parameters: the caps matter), gives the same buckets, in reverse (the order backward fills them)."""
    import torch
    import torch.distributed as dist

    result = extract("gpt2", batch=1, seq=64, parallel=Parallel(dp=2, bucket_mb=bucket_mb))
    groups = [g for u in _units(result) for g in u.grads]
    tensors = [torch.empty(g.elements, device="meta") for g in groups]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, bucket_mb * (1 << 20)]
    ddp, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    expected = [sum(groups[i].bytes for i in bucket) for bucket in reversed(ddp)]
    rows = sorted((int(u.name.rpartition("bucket")[2]), u.comms[WEIGHT_GRAD][0].bytes)
                  for u in result.rank.units if u.block == "dp")
    assert len(expected) > 3 and [nbytes for _, nbytes in rows] == expected


def test_expert_parallel_all_to_alls_and_expert_gradients(tiny_dirs):
    batch, seq, dp, ep = 2, 16, 4, 2
    result = extract(str(tiny_dirs["mixtral"]), batch=batch, seq=seq, parallel=Parallel(dp=dp, ep=ep))
    c = result.spec.config
    routed = batch * seq * c.num_experts_per_tok * c.hidden_size * 4
    for phase in (FORWARD, INPUT_GRAD):
        a2a = _comms(result, phase, "ep")
        assert [x.type for x in a2a] == [ALLTOALL] * 2 * c.num_hidden_layers
        assert {x.bytes for x in a2a} == {routed}
    expert_bytes = sum(x.bytes for x in _comms(result, WEIGHT_GRAD, "dp_ep"))
    assert expert_bytes == 4 * c.num_hidden_layers * 3 * c.hidden_size * c.intermediate_size * c.num_local_experts // ep


@pytest.mark.parametrize("experts, top_k, groups", [(8, 2, 4), (16, 4, 4), (12, 3, 3), (8, 2, 8)])
def test_expected_destinations_count_every_routing_alike(experts, top_k, groups):
    """Oracle: every set of top_k distinct experts enumerated, experts split into equal consecutive groups."""
    import itertools

    from fxworkload.parallel.collectives import expected_destinations

    per_group = experts // groups
    routings = list(itertools.combinations(range(experts), top_k))
    mean = sum(len({e // per_group for e in chosen}) for chosen in routings) / len(routings)
    assert expected_destinations(experts, top_k, groups) == pytest.approx(mean)


def test_deepep_sends_a_token_once_to_each_rank_holding_its_experts(tiny_dirs):
    """By hand: tiny Mixtral (4 experts, top 2) on ep 2: a token misses a rank's two experts in C(2, 2) of C(4, 2)
    routings, so it goes to 2 x (1 - 1/6) = 5/3 ranks, where the all-to-alls send one copy per expert (2)."""
    batch, seq = 2, 16
    c = tiny_config("mixtral")
    token_bytes = batch * seq * c.hidden_size * 4
    for ep_comm, copies in (("alltoall", 2), ("deepep", 5 / 3)):
        result = extract(str(tiny_dirs["mixtral"]), batch=batch, seq=seq, parallel=Parallel(dp=4, ep=2, ep_comm=ep_comm))
        for phase in (FORWARD, INPUT_GRAD):
            assert {x.bytes for x in _comms(result, phase, "ep")} == {round(token_bytes * copies)}


def test_stages_split_layers_and_the_boundary_send():
    p = Parallel(pp=4)
    assert stage_layers(p, 32) == [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]
    assert stage_layers(Parallel(pp=2, pp_layers=(5, 27)), 32) == [range(0, 5), range(5, 32)]
    batch, seq = 1, 64
    for stage in (0, 1):
        result = extract("llama-3-8b", batch=batch, seq=seq, dtype="bf16",
                         parallel=Parallel(pp=2, tp=4, sp=True, stage=stage))
        names = [u.name for u in _units(result)]
        assert ("embedding" in names) == (stage == 0) and ("head" in names) == (stage == 1)
        assert {u.layer for u in _units(result) if u.layer is not None} == set(range(16 * stage, 16 * stage + 16))
        assert result.rank.pp_comm_bytes == batch * seq * 4096 * 2 // 4


def test_last_stage_reduces_its_copy_of_a_tied_head(tiny_dirs):
    """GPT-2's head shares wte: with two stages the last keeps its own copy (Megatron-LM), and its
    data-parallel bytes count it: one layer (12h² + 13h), the final norm (2h) and the vocab × h copy."""
    result = extract(str(tiny_dirs["gpt2"]), batch=1, seq=16, parallel=Parallel(dp=2, pp=2, stage=1))
    c = result.spec.config
    h = c.n_embd
    assert sum(x.bytes for x in _comms(result, WEIGHT_GRAD, "dp")) == 4 * (12 * h * h + 13 * h + 2 * h + c.vocab_size * h)


def _copies(fn, *args) -> bool:
    """Whether torch's function returns new storage (a copy) rather than a view of its input."""
    out = fn(*args)
    return out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()


@pytest.mark.parametrize("stack, micro_batch", [("compiled", 2), ("compiled", 1), ("eager", 2), ("fused", 2)])
def test_sequence_parallel_on_dim_1_copies_where_torchs_collectives_do(tiny_dirs, stack, micro_batch):
    """torch's sequence parallelism shards [batch, seq, hidden] on dim 1 (DTensor's Shard(1)); NCCL gathers and
    scatters dim 0, so torch re-concatenates a gather's result (torch._utils._maybe_view_chunk_cat) and a
    scatter's input (_chunk_or_narrow_cat). Oracle: those functions of torch's, run on tensors of the rank's shapes:
    where they return new storage the collective carries a copy of its whole buffer, read and written, on the
    compute stream; where a view, none. Under inductor the input gradient's scatter reads a sum it writes into the
    concatenation itself; Megatron's [seq, batch, hidden] (--stack fused) shards dim 0: no copy."""
    import torch
    from torch._utils import _chunk_or_narrow_cat, _maybe_view_chunk_cat

    seq, tp = 64, 2
    result = extract(str(tiny_dirs["llama"]), batch=micro_batch, seq=seq, dtype="bf16", device="h100-sxm",
                     stack=stack, parallel=Parallel(tp=tp, sp=True))
    hidden = result.facts.hidden
    gathered = torch.zeros(tp * micro_batch, seq // tp, hidden)  # all_gather_into_tensor's result for gather_dim 1
    gather_copies = _copies(_maybe_view_chunk_cat, gathered, tp, 1)
    scatter_copies = _copies(_chunk_or_narrow_cat, torch.zeros(micro_batch, seq, hidden), tp, 1, 0)
    assert gather_copies == (micro_batch > 1) and scatter_copies
    block = next(u for u in result.rank.units if u.block == "attention")
    (gather, scatter), (gradient_gather, input_gradient_scatter) = (
        [c for c in block.comms[phase] if c.group == "tp"] for phase in (FORWARD, INPUT_GRAD))
    dim1 = stack != "fused"
    assert gather.copy_bytes == (2 * gather.bytes if dim1 and gather_copies else 0)
    assert gradient_gather.copy_bytes == (2 * gradient_gather.bytes if dim1 and gather_copies else 0)
    assert scatter.copy_bytes == (2 * scatter.bytes if dim1 and scatter_copies else 0)
    assert input_gradient_scatter.copy_bytes == (2 * scatter.bytes if stack == "eager" else 0)
