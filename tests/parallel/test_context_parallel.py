"""Context parallelism against hand computations: attention's work grows with the square of the
tokens, everything else linearly, so a rank of cp holding seq / cp tokens of a load-balanced causal
split does 1/cp of the whole step's work; the key/value exchange's size from the config; the rank
groups of Megatron-Core's order "tp-cp-ep-dp-pp" written out by hand."""

from __future__ import annotations

import pytest

from fxworkload.capture.trace import FORWARD, INPUT_GRAD, PHASES
from fxworkload.errors import UserError
from fxworkload.formats.chakra import group_members
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract

SEQ = 32


def _core_flops(workload) -> int:
    return sum(op.flops for op in workload.ops() if op.sdpa_backend)


def _other_flops(workload) -> int:
    return sum(op.flops for op in workload.ops() if not op.sdpa_backend)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_context_parallel_rank_does_one_cp_th_of_the_step(tiny_dirs, cp):
    whole = extract(str(tiny_dirs["llama"]), batch=1, seq=SEQ, dtype="bf16", device="h100-sxm")
    rank = extract(str(tiny_dirs["llama"]), batch=1, seq=SEQ, dtype="bf16", device="h100-sxm",
                   parallel=Parallel(cp=cp))
    assert rank.settings["seq"] == SEQ and rank.settings["seq_per_rank"] == SEQ // cp
    # attention: the rank's queries against every key, a 1/cp share of the causal square
    assert _core_flops(rank.workload) * cp == _core_flops(whole.workload)
    # the rest (GEMMs, norms, the loss): linear in the tokens
    assert _other_flops(rank.workload) * cp == pytest.approx(_other_flops(whole.workload), rel=1e-6)  # integer rounding
    # so the cluster counts the same model FLOPs for the same tokens, cp ranks doing them
    assert rank.cluster.model_flops == pytest.approx(whole.cluster.model_flops, rel=1e-6)
    assert rank.cluster.tokens == whole.cluster.tokens == SEQ
    assert rank.rank.parallel.world == cp


def test_the_key_value_exchange_is_the_whole_sequences_keys_and_values(tiny_dirs):
    """tiny llama: 4 heads of 16 values (hidden 64), 2 key/value heads; bf16. One layer's keys and
    values of the whole sequence: 2 x seq x 2 heads x 16 x 2 bytes, split over tp 2."""
    tp, cp = 2, 2
    result = extract(str(tiny_dirs["llama"]), batch=1, seq=SEQ, dtype="bf16", device="h100-sxm",
                     parallel=Parallel(tp=tp, cp=cp, cp_comm="allgather"))
    whole_kv = 2 * SEQ * 2 * 16 * 2 // tp
    for phase, types in ((FORWARD, ["ALLGATHER"]), (INPUT_GRAD, ["ALLGATHER", "REDUCESCATTER"])):
        per_unit = [[c for c in u.comms[phase] if c.group == "cp"] for u in result.rank.units]
        with_cp = [comms for comms in per_unit if comms]
        assert len(with_cp) == 2  # one per attention block: two layers
        assert all([c.type for c in comms] == types and comms[0].bytes == whole_kv for comms in with_cp)
    ring = extract(str(tiny_dirs["llama"]), batch=1, seq=SEQ, dtype="bf16", device="h100-sxm",
                   parallel=Parallel(tp=tp, cp=cp))
    backward = [c.type for u in ring.rank.units for c in u.comms[INPUT_GRAD] if c.group == "cp"]
    assert backward == ["ALLGATHER", "REDUCESCATTER"] * 2  # the ring moves keys again, gradients back
    assert all(c.overlapped for u in ring.rank.units for ph in PHASES for c in u.comms[ph] if c.group == "cp")


def test_a_rank_saves_its_own_tokens_activations(tiny_dirs):
    """Transformer Engine's CP attention saves the rank's own q, k, v (and gathers again in backward):
    a rank of cp saves what the whole-sequence step saves over cp, layer by layer."""
    cp, seq = 2, 64  # every saved tensor a multiple of the allocator's 512-byte blocks at seq / cp
    whole = extract(str(tiny_dirs["llama"]), batch=1, seq=seq, dtype="bf16", device="h100-sxm")
    for comm in ("p2p", "allgather"):
        rank = extract(str(tiny_dirs["llama"]), batch=1, seq=seq, dtype="bf16", device="h100-sxm",
                       parallel=Parallel(cp=cp, cp_comm=comm))
        layer = [sum(r.saved_bytes for u in result.rank.units if u.layer == 1 for r in u.rows)
                 for result in (whole, rank)]
        assert layer[1] * cp == pytest.approx(layer[0], rel=0.02)


@pytest.mark.parametrize("link_bytes_per_s", [None, 1e6])
def test_the_ring_hides_what_the_attention_core_covers(tiny_dirs, link_bytes_per_s):
    """The same rank exchanging the same keys and values, as Llama 3's all-gather (before the core) and as
    Megatron-Core's ring (beside it). On the H100's links each exchange (tens of microseconds) is shorter
    than its layer's core: the ring hides it whole. On links of 1 MB/s every exchange outlasts its core:
    the ring is shorter by exactly the cores' time, every layer's forward and backward core in each of the
    3 micro-batches, summed here from the table's attention ops."""
    from dataclasses import replace

    from fxworkload.cluster.step import cluster_step

    steps = {}
    for comm in ("allgather", "p2p"):
        run = extract(str(tiny_dirs["llama"]), batch=1, seq=SEQ, dtype="bf16", device="h100-sxm",
                      parallel=Parallel(cp=2, micro_batches=3, cp_comm=comm))
        device = run.device if link_bytes_per_s is None else replace(
            run.device, intra_node_bytes_per_s=link_bytes_per_s, inter_node_bytes_per_s=link_bytes_per_s)
        steps[comm] = cluster_step(run.facts, run.workload, run.model_workload,
                                   replace(run.execution, parallel=run.rank.parallel), device)
    cores_ns = sum(op.estimated_ns for op in run.workload.ops() if op.sdpa_backend)
    saved = steps["allgather"].step_ns - steps["p2p"].step_ns
    if link_bytes_per_s is None:
        assert steps["p2p"].exposed_ns["cp"] == 0 and 0 < steps["allgather"].exposed_ns["cp"] < 3 * cores_ns
        assert saved == pytest.approx(steps["allgather"].exposed_ns["cp"], rel=1e-9)
    else:
        assert steps["p2p"].exposed_ns["cp"] > 3 * cores_ns
        assert saved == pytest.approx(3 * cores_ns, rel=1e-9)


def test_rank_groups_follow_megatron_cores_tp_cp_dp_order():
    """tp 2, cp 2, dp 2, pp 2 (16 ranks): rank = pp x 8 + dp x 4 + cp x 2 + tp, by hand."""
    p = Parallel(tp=2, cp=2, dp=2, pp=2)
    assert group_members("tp", 5, p) == [4, 5]
    assert group_members("cp", 5, p) == [5, 7]
    assert group_members("dp", 5, p) == [1, 3, 5, 7]  # gradients: the data- and context-parallel ranks
    assert group_members("cp", 9, p) == [9, 11]  # the second stage


def test_bad_context_parallel_settings_are_one_line_errors(tiny_dirs):
    with pytest.raises(UserError, match="multiple of"):
        extract(str(tiny_dirs["llama"]), batch=1, seq=30, parallel=Parallel(cp=4))  # 8 chunks
    with pytest.raises(UserError, match="--seq"):
        extract(str(tiny_dirs["llama"]), batch=1, parallel=Parallel(cp=2))
    with pytest.raises(UserError, match="--cp-comm"):
        extract(str(tiny_dirs["llama"]), batch=1, seq=SEQ, parallel=Parallel(cp=2, cp_comm="ring"))


# A core op's attention, as cost/optime.py records it: E = 1 x 4 x 8 x 2 = 64 output elements, K = 1 x 2 x 8 x 2 = 32
ATTENTION = {"backend": "flash", "batch": 1, "heads": 4, "kv_heads": 2, "q_len": 8, "kv_len": 8, "head_dim": 2,
             "is_causal": True, "has_mask": False, "dropout": 0.0}


def test_a_rings_merges_move_what_torch_and_te_move_per_step_by_hand():
    """By hand, from torch's _SDPAMerger and _templated_ring_attention_backward at cp 3 on the last rank:
    fused (inductor's, or Transformer Engine's corrections), forward: the first block's output to fp32 (2 + 4
    bytes an element), two later merges (fp32 output read and written, the block's 16-bit output read: 10),
    the result to 16-bit (4 + 2): 32 x 64 bytes in four kernels; backward: fp32 accumulators begun from the
    first step's gradients (6 an output element, 2 x 6 a key's), two later updates (10, and 2 x 10: the received
    fp32 key and value gradients plus the block's, written for the next rank), and back to 16-bit (6 and 2 x 6):
    32 x 64 + 64 x 32 bytes in eight. Eager, forward: the fp32 copy and the keys' and values' concatenation
    (6 and 8), two merges of five kernels (6 + 12 + 8 + 12 an element, the concatenation again: 8), the result
    (6): 88 x 64 + 24 x 32 bytes in thirteen kernels."""
    from fxworkload.parallel.context_parallel import merge_bytes

    assert merge_bytes(ATTENTION | {"backward": False}, 3, "fused") == (32 * 64, 4)
    assert merge_bytes(ATTENTION | {"backward": True}, 3, "fused") == (32 * 64 + 64 * 32, 8)
    assert merge_bytes(ATTENTION | {"backward": False}, 3, "eager") == (88 * 64 + 24 * 32, 13)


def test_only_a_ring_that_steps_merges_its_outputs():
    """torch's context parallelism steps through the ring whatever its rotate method (eager: unfused merges;
    compiled: inductor's); Transformer Engine's p2p ring steps, its all-gather (Llama 3's) runs one kernel per
    local chunk over the gathered keys."""
    from fxworkload.parallel.context_parallel import merging

    assert merging("eager", "allgather") == "eager" and merging("compiled", "allgather") == "fused"
    assert merging("fused", "p2p") == "fused" and merging("fused", "allgather") is None


def test_the_merges_time_is_their_bytes_at_the_streaming_rate_beside_cp_kernels():
    """The ring's core op costs cp times the captured kernel plus its merges as memory-bound kernels
    (cost/gpu.py memory_ns) on the device; the Llama 3 all-gather under --stack fused, cp times alone."""
    from dataclasses import replace

    from fxworkload.cost.devices import load
    from fxworkload.cost.gpu import memory_ns
    from fxworkload.parallel.context_parallel import merge_bytes, with_context_parallel
    from fxworkload.workload.table import NodeRow, OpCost, Workload

    core = OpCost(fx_name="sdpa", op="aten._scaled_dot_product_flash_attention.default", kind="attention",
                  phase=FORWARD, input_shapes=[], input_dtypes=[], output_shapes=[], output_dtypes=[], flops=1000,
                  bytes=100, estimated_ns=50.0, has_flop_rule=True, attention=ATTENTION | {"backward": False},
                  sdpa_backend="flash")
    row = NodeRow(name="sdpa", module="model.layers.0.self_attn", forward=core)
    device = load("h100-sxm")
    for stack, cp_comm, merged in (("eager", "allgather", True), ("fused", "allgather", False)):
        workload = Workload(rows=[row], parameter_count=0, gradient_bytes=0, stack=stack)
        ring = with_context_parallel(workload, Parallel(dp=2, cp=2, cp_comm=cp_comm), device).rows[0].forward
        extra, kernels = merge_bytes(core.attention, 2, "eager")
        expected = 100.0 + (memory_ns(extra, device.gpu_facts(), device.gpu_model(), kernels) if merged else 0.0)
        assert ring.estimated_ns == pytest.approx(expected) and ring.bytes == 200 + (extra if merged else 0)
        assert replace(ring, estimated_ns=0.0, bytes=0).flops == 2000
