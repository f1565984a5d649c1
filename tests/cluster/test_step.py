"""The cluster step against hand sums, the SimAI file of the same layout, and Megatron's FLOP formula."""

from __future__ import annotations

import pytest
from transformers import GPT2Config

from fxworkload.capture.trace import PHASES
from fxworkload.formats.simai import from_rank
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract

from ..conftest import tiny_config


def test_one_gpu_step_is_its_passes_and_the_optimizer(tiny_dirs):
    result = extract(str(tiny_dirs["llama"]), batch=2, seq=16, device="h100-sxm",
                     parallel=Parallel(micro_batches=3))
    cluster = result.cluster
    # each unit's pass: its kernels, or its ops' host dispatch where that is longer (this tiny model is
    # host-bound: the GPU waits on the host), summed by hand from the ops' figures
    per_micro_batch = sum(max(sum(op.estimated_ns for op in u.ops(ph)), sum(op.dispatch_ns for op in u.ops(ph)))
                          for u in result.rank.units for ph in PHASES)
    assert per_micro_batch > sum(result.workload.totals[f"{ph}_estimated_ns"] for ph in PHASES)
    assert cluster.step_ns == pytest.approx(3 * per_micro_batch + cluster.exposed_ns["optimizer"])
    assert cluster.exposed_ns["host"] == pytest.approx(
        3 * (per_micro_batch - sum(result.workload.totals[f"{ph}_estimated_ns"] for ph in PHASES)))
    assert cluster.bubble_fraction == pytest.approx(0.0) and cluster.exposed_ns["dp"] == 0.0
    flops = sum(result.workload.totals[f"{ph}_flops"] for ph in PHASES)
    assert cluster.model_flops == 3 * flops == cluster.hardware_flops
    assert cluster.tokens == 2 * 16 * 3
    parameters = result.workload.totals["parameter_count"]
    # Adam in mixed precision? fp32 here: 2 x 8 state bytes + fp32 gradient + fp32 parameter per parameter
    assert cluster.exposed_ns["optimizer"] == pytest.approx(
        parameters * (16 + 4 + 4) / (result.device.memory_bytes_per_s * result.device.memory_efficiency) * 1e9)


def test_simai_file_and_cluster_step_agree_on_each_ranks_compute(tiny_dirs):
    layout = dict(tp=2, pp=2, dp=2, micro_batches=4)
    for stage in range(2):
        result = extract(str(tiny_dirs["llama"]), batch=1, seq=16, dtype="bf16", device="h100-sxm",
                         parallel=Parallel(**layout, stage=stage))
        simai = from_rank(result.rank)
        simai_ns = sum(r.forward_ns + r.input_grad_ns + r.weight_grad_ns for r in simai.rows)  # every micro-batch
        device = result.cluster.devices[stage]
        compute_ns = device.compute_ns - 4 * sum(device.blocking_comm_ns.values())
        assert compute_ns == pytest.approx(simai_ns, abs=len(simai.rows))  # SimAI rounds each row to 1 ns


def test_model_flops_follow_megatrons_formula(tmp_path):
    """Narayanan et al. 2021, eq. 3 without recomputation: 72·B·s·l·h²·(1 + s/6h + V/16lh) per step."""
    layers, hidden, seq, vocab, batch = 4, 512, 256, 8192, 4
    GPT2Config(n_layer=layers, n_embd=hidden, n_head=8, vocab_size=vocab, n_positions=seq,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    result = extract(str(tmp_path), batch=batch, seq=seq, dtype="bf16", device="h100-sxm")
    formula = 72 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    assert result.cluster.model_flops == pytest.approx(formula, rel=0.1)


def test_recomputation_raises_hfu_not_mfu(tiny_dirs):
    plain = extract(str(tiny_dirs["gpt2"]), batch=2, seq=16, device="h100-sxm", parallel=Parallel(micro_batches=2))
    full = extract(str(tiny_dirs["gpt2"]), batch=2, seq=16, device="h100-sxm",
                   parallel=Parallel(micro_batches=2, recompute="full"))
    assert full.cluster.model_flops == pytest.approx(plain.cluster.model_flops)
    assert full.cluster.hardware_flops > full.cluster.model_flops
    assert full.cluster.hfu > full.cluster.mfu
    assert full.cluster.step_ns > plain.cluster.step_ns


def test_interleaving_shrinks_the_bubble(tmp_path):
    tiny_config("llama", num_hidden_layers=4).save_pretrained(tmp_path)
    base = dict(pp=2, micro_batches=4)
    one = extract(str(tmp_path), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**base)).cluster
    two = extract(str(tmp_path), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**base, vpp=2)).cluster
    assert two.bubble_fraction < one.bubble_fraction
    assert [len([x for x in two.passes if x.device == d]) for d in range(2)] == [2 * 2 * 4] * 2


def test_data_parallel_reduction_overlaps_backward(tiny_dirs):
    """Buckets reduce while the last backward runs: what is exposed is at most their total."""
    result = extract(str(tiny_dirs["llama"]), batch=2, seq=16, device="h100-sxm", parallel=Parallel(dp=4, bucket_mb=0))
    cluster = result.cluster
    spans = cluster.data_parallel_spans
    assert spans and all(end > start for _, _, start, end, _ in spans)
    total = sum(end - start for _, _, start, end, _ in spans)
    assert 0 <= cluster.exposed_ns["dp"] < total
    assert spans[0][2] < cluster.pipeline_ns  # the first bucket starts before backward ends


def test_without_overlap_the_reduction_starts_when_backward_ends(tiny_dirs):
    """Megatron-LM without --overlap-grad-reduce: the buckets run one after another from the end of
    the last backward, so all of their time is exposed (a hand sum of the spans)."""
    layout = Parallel(dp=4, bucket_mb=0, overlap_grad_reduce=False)
    cluster = extract(str(tiny_dirs["llama"]), batch=2, seq=16, device="h100-sxm", parallel=layout).cluster
    spans = cluster.data_parallel_spans
    assert spans[0][2] == cluster.pipeline_ns
    assert cluster.exposed_ns["dp"] == pytest.approx(sum(end - start for _, _, start, end, _ in spans))
    overlapped = extract(str(tiny_dirs["llama"]), batch=2, seq=16, device="h100-sxm",
                         parallel=Parallel(dp=4, bucket_mb=0)).cluster
    assert cluster.step_ns > overlapped.step_ns


def test_uneven_stages_interleave_with_the_short_chunks_at_the_ends(tmp_path):
    """The Llama 3 layout in miniature: 8 layers on 3 stages as 2, 4, 2, two chunks each. By hand, in
    virtual-stage order (chunk 0 of devices 0, 1, 2, then chunk 1): device 0 holds [0] and [4], device 1
    [1, 2] and [5, 6], device 2 [3] and [7]. Interleaving still shrinks the bubble."""
    from fxworkload.parallel.layout import virtual_stage_layers

    tiny_config("llama", num_hidden_layers=8).save_pretrained(tmp_path)
    uneven = Parallel(pp=3, vpp=2, pp_layers=(2, 4, 2), micro_batches=6)
    assert [list(r) for r in virtual_stage_layers(uneven, 8)] == [[0], [1, 2], [3], [4], [5, 6], [7]]
    llama3 = Parallel(pp=4, vpp=2, pp_layers=(3, 4, 4, 3), micro_batches=8)
    sizes = [len(r) for r in virtual_stage_layers(llama3, 14)]
    assert sizes == [1, 2, 2, 2, 2, 2, 2, 1] and sum(sizes) == 14  # embedding's and head's chunks short
    one = extract(str(tmp_path), batch=1, seq=16, device="h100-sxm",
                  parallel=Parallel(pp=3, pp_layers=(2, 4, 2), micro_batches=6)).cluster
    two = extract(str(tmp_path), batch=1, seq=16, device="h100-sxm", parallel=uneven).cluster
    assert two.bubble_fraction < one.bubble_fraction
    assert two.model_flops == pytest.approx(one.model_flops)


def test_overlapped_buckets_slow_the_backward_they_run_beside(tiny_dirs):
    """The ZeRO-3 stream model's SM share, applied to DDP's buckets: the backward is longer by
    NCCL_CHANNELS / sm_count of the time buckets and backward passes overlap (a hand sum)."""
    from fxworkload.cluster.zero3 import NCCL_CHANNELS

    result = extract(str(tiny_dirs["llama"]), batch=2, seq=16, device="h100-sxm", parallel=Parallel(dp=4, bucket_mb=0))
    cluster, device = result.cluster, result.device
    backward = [(x.start_ns, x.end_ns) for x in cluster.passes if x.kind == "B"]
    overlap = sum(max(0.0, min(end, b_end) - max(start, b_start))
                  for _, _, start, end, _ in cluster.data_parallel_spans for b_start, b_end in backward)
    assert overlap > 0
    slowed = cluster.devices[0].bucket_slowdown_ns
    assert slowed == pytest.approx(overlap * NCCL_CHANNELS / device.sm_count)
    assert cluster.devices[0].pipeline_end_ns == pytest.approx(backward[-1][1] + slowed)
    after = extract(str(tiny_dirs["llama"]), batch=2, seq=16, device="h100-sxm",
                    parallel=Parallel(dp=4, bucket_mb=0, overlap_grad_reduce=False)).cluster
    assert after.devices[0].bucket_slowdown_ns == 0  # nothing runs beside the backward


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, zero=3, micro_batches=3), dict(tp=2, micro_batches=2)])
def test_no_pipeline_has_no_bubble_not_a_rounding_error_below_zero(tiny_dirs, layout):
    """Issue 38: without a pipeline the bubble read -4.4e-16 (the busiest stage's compute summed in another
    order than its pipeline's end). One stage has no bubble: exactly 0."""
    cluster = extract(str(tiny_dirs["llama"]), batch=1, seq=16, device="h100-sxm", parallel=Parallel(**layout)).cluster
    assert cluster.bubble_fraction == 0.0 and cluster.exposed_ns["pp_bubble"] == 0.0


def test_fp8_utilisation_says_which_peak_it_is_over(tiny_dirs):
    """Issue 38: with --fp8 the summary printed HFU 110 % 'over the dense peak' (the BF16 one). It now names
    the peak (bf16, 989.4 TFLOP/s on the H100 datasheet) and the FP8 GEMMs' own (1,979 dense)."""
    result = extract(str(tiny_dirs["llama"]), batch=1, seq=16, dtype="bf16", device="h100-sxm", fp8=True)
    line = next(line for line in result.summary().splitlines() if line.startswith("MFU / HFU"))
    assert "over the bf16 dense peak, 989.4 TFLOP/s; --fp8 GEMMs run at up to 1,979" in line


def test_overlapped_parameter_gather_hides_all_but_what_the_first_forward_waits_for(tiny_dirs):
    """Megatron-LM's --overlap-param-gather (ZeRO 1/2): the buckets' all-gathers run under the next step's first
    forward, prefetched one bucket ahead (Megatron-Core's param_and_grad_buffer). The step owes at least the
    first bucket's gather (nothing computes before it arrives) and at most the gathers it ran after the
    optimizer before; the rest of the step is unchanged."""
    from fxworkload.cluster.network import comm_ns

    def run(overlap):
        return extract(str(tiny_dirs["llama"]), batch=2, seq=64, dtype="bf16", device="h100-sxm",
                       parallel=Parallel(dp=16, zero=1, micro_batches=2, overlap_param_gather=overlap)).cluster

    plain, overlapped = run(False), run(True)
    first_bucket = sum(comm_ns(c, overlapped.parallel, overlapped.profile)
                       for c in overlapped.param_gathers[0][0][1])
    assert first_bucket > 0
    exposed = overlapped.exposed_ns["zero_gather"]
    assert first_bucket <= exposed <= plain.exposed_ns["zero_gather"]
    assert overlapped.step_ns - exposed == pytest.approx(plain.step_ns - plain.exposed_ns["zero_gather"])
    # every bucket's gather is in the groups: together they move what the plain step's one gather moves
    assert sum(c.bytes for _, gathers in overlapped.param_gathers[0] for c in gathers) == pytest.approx(
        sum(c.bytes for u in plain.device_units[0] if u.block == "dp" for c in u.comms["weight_grad"]
            if c.type == "ALLGATHER"), rel=1e-6)


def test_overlap_param_gather_needs_zero_1_or_2(tiny_dirs):
    from fxworkload.errors import UserError

    with pytest.raises(UserError, match="needs --zero 1 or 2"):
        extract(str(tiny_dirs["llama"]), seq=16, device="h100-sxm", parallel=Parallel(dp=2, overlap_param_gather=True))


# a decoder block's linears by name (HF Llama): those reading the gathered block input, and the row-parallel one
READERS = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
PRODUCERS = {"o_proj", "down_proj"}


def _linear_rows(unit, names):
    return [r for r in unit.rows if r.forward.kind == "matmul" and r.module.rsplit(".", 1)[-1] in names]


def _pipelined_ns(comm_ns_, gemm_ns, tp):
    """A collective pipelined in tp chunks with GEMMs: what it outlasts them by, and at least one chunk."""
    return max(comm_ns_ / tp, comm_ns_ - gemm_ns)


def test_tp_comm_overlap_pipelines_each_collective_with_its_own_gemms(tiny_dirs):
    """--tp-comm-overlap (Transformer Engine's userbuffers): each of a decoder block's sequence-parallel
    collectives is pipelined in tp chunks with the GEMMs it feeds or follows, never with the block's others (a
    chunk's GEMM waits for its chunk; the next collective waits on GEMMs still to come): forward, the input's
    gather beside q/k/v (gate/up) and the output's reduce-scatter beside o (down); backward, the output
    gradient's gather beside o's (down's) input-gradient GEMM and the input gradient's reduce-scatter beside
    q/k/v's (gate/up's) weight-gradient GEMMs (TE's bulk wgrad overlap). As a two-stream timeline by hand, the
    GEMMs picked by module name; the embedding's and the head's collectives stay blocking."""
    from fxworkload.capture.trace import FORWARD, INPUT_GRAD
    from fxworkload.cluster.network import comm_ns
    from fxworkload.cluster.step import exposed_comms_ns

    def run(overlap):  # 2,048 sequences: collectives that outlast some GEMMs, not all of the pass's
        return extract(str(tiny_dirs["llama"]), batch=2048, seq=64, device="h100-sxm",
                       parallel=Parallel(tp=2, sp=True, micro_batches=2, tp_comm_overlap=overlap))

    plain, overlapped = run(False), run(True)
    p, device = overlapped.rank.parallel, overlapped.device
    blocks = [u for u in overlapped.rank.units if u.layer is not None]
    assert {u.block for u in blocks} == {"attention", "mlp"}
    pooled_differs = False
    for unit in blocks:
        readers, (producer,) = _linear_rows(unit, READERS), _linear_rows(unit, PRODUCERS)
        assert len(readers) in (2, 3)
        gather, scatter = [c for c in unit.comms[FORWARD] if c.group == "tp"]
        assert (gather.type, scatter.type) == ("ALLGATHER", "REDUCESCATTER") and gather.overlapped and scatter.overlapped
        g, r = comm_ns(gather, p, device), comm_ns(scatter, p, device)
        forward = exposed_comms_ns(unit, FORWARD, p, device)["tp"]
        assert forward == pytest.approx(_pipelined_ns(g, sum(x.forward.estimated_ns for x in readers), 2)
                                        + _pipelined_ns(r, producer.forward.estimated_ns, 2))
        every_gemm = sum(op.estimated_ns for op in unit.ops(FORWARD) if op.kind == "matmul")
        pooled_differs |= forward != pytest.approx(_pipelined_ns(g + r, every_gemm, 2))
        gather, scatter = [c for c in unit.comms[INPUT_GRAD] if c.group == "tp"]
        assert (gather.type, scatter.type) == ("ALLGATHER", "REDUCESCATTER") and gather.overlapped and scatter.overlapped
        dgrad = [op for op in producer.input_grad if op.kind == "matmul"][-1].estimated_ns
        wgrad = sum(op.estimated_ns for x in readers for op in x.weight_grad if op.kind == "matmul")
        g, r = comm_ns(gather, p, device), comm_ns(scatter, p, device)
        assert exposed_comms_ns(unit, INPUT_GRAD, p, device)["tp"] == pytest.approx(
            _pipelined_ns(g, dgrad, 2) + _pipelined_ns(r, wgrad, 2))
    # the pairing is what is tested: here a forward set against all of its GEMMs would expose less
    assert pooled_differs
    assert not any(c.overlapped for u in overlapped.rank.units if u.layer is None for ph in (FORWARD, INPUT_GRAD)
                   for c in u.comms[ph])
    assert overlapped.cluster.exposed_ns["tp"] < plain.cluster.exposed_ns["tp"]
    assert overlapped.cluster.step_ns < plain.cluster.step_ns


def test_asynctp_overlaps_the_patterns_inductor_fuses_and_no_others(tiny_dirs):
    """--stack compiled --tp-comm-overlap is torch's AsyncTP: inductor's micro-pipeline TP pass
    (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses an all-gather with the matmuls reading it and a
    reduce-scatter with the one matmul making its input. As a two-stream timeline by hand: forward, the gather
    beside q/k/v (gate/up) and the reduce-scatter beside o (down), each what outlasts its GEMMs, at least one
    chunk; backward, the output gradient's gather beside the o/down input-gradient GEMM alone, and the input
    gradient's reduce-scatter, whose input is a sum of q/k/v (gate/up) GEMMs, blocking whole. On the compute
    stream, AsyncTP's own kernels (torch/distributed/_symmetric_memory), each read and written: a fused
    reduce-scatter's partial products summed (_fused_matmul_reduce_scatter_impl: all tp read, one written) and,
    with the sequence on dim 1 and more than one sequence, its GEMM's input flattened with the batch; a fused
    gather's shard flattened so and copied into its symmetric buffer (_pipelined_multi_all_gather_and_consume);
    the gathered views a 16-bit weight gradient reads made contiguous (the block input's, the gradient's)."""
    import torch

    from fxworkload.capture.trace import FORWARD, INPUT_GRAD
    from fxworkload.cluster.network import comm_ns
    from fxworkload.cluster.step import exposed_comms_ns
    from fxworkload.cost.gpu import memory_ns

    result = extract(str(tiny_dirs["llama"]), batch=2048, seq=64, device="h100-sxm", stack="compiled",
                     parallel=Parallel(tp=2, sp=True, micro_batches=2, tp_comm_overlap=True))
    p, device = result.rank.parallel, result.device

    def copy_ns(nbytes):
        return memory_ns(nbytes, device.gpu_facts(), device.gpu_model())

    blocks = [u for u in result.rank.units if u.layer is not None]
    assert {u.block for u in blocks} == {"attention", "mlp"}
    for unit in blocks:
        readers, (producer,) = _linear_rows(unit, READERS), _linear_rows(unit, PRODUCERS)
        gather, scatter = [c for c in unit.comms[FORWARD] if c.group == "tp"]
        assert (gather.type, scatter.type) == ("ALLGATHER", "REDUCESCATTER") and gather.overlapped and scatter.overlapped
        # the shard (half the gathered bytes at tp 2) flattened and copied, each read and written; the two partials
        # read, one written, and the o/down GEMM's input flattened, read and written
        m, k, _ = producer.forward.gemm_mkn
        itemsize = torch.empty(0, dtype=getattr(torch, producer.forward.input_dtypes[0])).element_size()
        gathered_bytes = gather.bytes
        assert (gather.copy_bytes, scatter.copy_bytes) == (2 * gather.bytes, scatter.bytes * 3 // 2 + 2 * m * k * itemsize)
        g, r = comm_ns(gather, p, device), comm_ns(scatter, p, device)
        assert exposed_comms_ns(unit, FORWARD, p, device)["tp"] == pytest.approx(
            _pipelined_ns(g, sum(x.forward.estimated_ns for x in readers), 2)
            + _pipelined_ns(r, producer.forward.estimated_ns, 2) + copy_ns(gather.copy_bytes) + copy_ns(scatter.copy_bytes))
        gather, scatter = [c for c in unit.comms[INPUT_GRAD] if c.group == "tp"]
        assert (gather.type, gather.overlapped, scatter.type, scatter.overlapped) == (
            "ALLGATHER", True, "REDUCESCATTER", False)
        # its shard flattened and copied; the gathered gradient and the block's gathered input made contiguous;
        # the blocking scatter's input written by inductor's sum of the input gradients straight into its order
        assert (gather.copy_bytes, scatter.copy_bytes) == (2 * gather.bytes + 2 * (gather.bytes + gathered_bytes), 0)
        dgrad = [op for op in producer.input_grad if op.kind == "matmul"][-1].estimated_ns
        g, r = comm_ns(gather, p, device), comm_ns(scatter, p, device)
        assert exposed_comms_ns(unit, INPUT_GRAD, p, device)["tp"] == pytest.approx(
            _pipelined_ns(g, dgrad, 2) + r + copy_ns(gather.copy_bytes))


def test_asynctp_under_full_recomputation_pairs_the_recomputed_forward_with_its_own_gemms(tiny_dirs):
    """Full recomputation under AsyncTP: the backward's recomputed forward runs its fused collectives again,
    each beside the recomputed copies of its own GEMMs (q/k/v or gate/up; o, whose output the next norm's
    backward reads through the residual stream), not beside the backward's input- and weight-gradient GEMMs.
    By hand on the attention blocks: every recomputed GEMM is its forward's copy, so the recomputed
    collectives expose what they did in forward."""
    from fxworkload.capture.trace import FORWARD, INPUT_GRAD
    from fxworkload.cluster.network import comm_ns
    from fxworkload.cluster.step import exposed_comms_ns
    from fxworkload.cost.gpu import memory_ns

    result = extract(str(tiny_dirs["llama"]), batch=2048, seq=64, device="h100-sxm", stack="compiled",
                     parallel=Parallel(tp=2, sp=True, micro_batches=2, tp_comm_overlap=True, recompute="full"))
    p, device = result.rank.parallel, result.device
    attention = [u for u in result.rank.units if u.block == "attention"]
    assert attention
    for unit in attention:
        forward = [c for c in unit.comms[FORWARD] if c.group == "tp"]
        backward = [c for c in unit.comms[INPUT_GRAD] if c.group == "tp"]
        again, own = backward[:2], backward[2:]
        assert [c.what for c in again] == [f"{c.what}, recomputed forward" for c in forward]
        for row in _linear_rows(unit, READERS | PRODUCERS):
            assert row.input_grad[0].fx_name == row.forward.fx_name  # recomputed: its copy heads its backward
        gather, scatter = own
        producer, = _linear_rows(unit, PRODUCERS)
        dgrad = [op for op in producer.input_grad if op.kind == "matmul"][-1].estimated_ns
        g, r = comm_ns(gather, p, device), comm_ns(scatter, p, device)
        own_ns = _pipelined_ns(g, dgrad, 2) + r + memory_ns(gather.copy_bytes, device.gpu_facts(), device.gpu_model())
        assert exposed_comms_ns(unit, INPUT_GRAD, p, device)["tp"] == pytest.approx(
            exposed_comms_ns(unit, FORWARD, p, device)["tp"] + own_ns)


def test_full_recomputation_runs_the_blocks_collectives_again_before_their_backward(tiny_dirs):
    """Megatron-Core's CheckpointFunction and torch.utils.checkpoint re-run a recomputed layer's whole forward,
    its tensor-parallel collectives included, before the layer's backward; selective recomputation re-runs only
    the attention core, no collective. By hand: each recomputed block's backward starts with its forward's
    collectives, and the step's tensor-parallel time grows by exactly their time, once per micro-batch, with the
    copies torch makes around them (the sequence on dim 1: each reduce-scatter's input concatenated on dim 0)."""
    from fxworkload.capture.trace import FORWARD, INPUT_GRAD
    from fxworkload.cluster.network import comm_ns
    from fxworkload.cost.gpu import memory_ns

    def run(recompute):
        return extract(str(tiny_dirs["llama"]), batch=2, seq=64, device="h100-sxm",
                       parallel=Parallel(tp=2, sp=True, micro_batches=2, recompute=recompute))

    plain, selective, full = run("none"), run("selective"), run("full")
    p, device = full.rank.parallel, full.device
    again_ns = 0.0
    for unit, before in zip(full.rank.units, plain.rank.units):
        forward, backward = unit.comms[FORWARD], unit.comms[INPUT_GRAD]
        if unit.layer is None:
            assert backward == before.comms[INPUT_GRAD]
            continue
        assert [(c.type, c.bytes) for c in backward[:len(forward)]] == [(c.type, c.bytes) for c in forward]
        assert all(c.what.endswith("recomputed forward") for c in backward[:len(forward)])
        assert backward[len(forward):] == before.comms[INPUT_GRAD]
        again_ns += sum(comm_ns(c, p, device) for c in forward)
        # micro-batches of two sequences: every gather's result and every scatter's input copied, read and written
        assert [c.copy_bytes for c in forward] == [2 * c.bytes for c in forward]
        again_ns += sum(memory_ns(2 * c.bytes, device.gpu_facts(), device.gpu_model()) for c in forward)
    assert again_ns > 0
    assert [u.comms for u in selective.rank.units] == [u.comms for u in plain.rank.units]
    assert full.cluster.exposed_ns["tp"] == pytest.approx(plain.cluster.exposed_ns["tp"] + 2 * again_ns)


def test_tp_comm_overlap_needs_tp_and_sp(tiny_dirs):
    from fxworkload.errors import UserError

    with pytest.raises(UserError, match="needs --tp 2 or more and --sp"):
        extract(str(tiny_dirs["llama"]), seq=16, device="h100-sxm", parallel=Parallel(tp=2, tp_comm_overlap=True))
