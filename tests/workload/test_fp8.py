"""FP8 training against hand counts from the config (which GEMMs, how many weights, the casts'
bytes) and the datasheet (the FP8 tensor peak is twice the BF16 one on Hopper, reached at a lower clock)."""

from __future__ import annotations

import pytest

from fxworkload.cost.devices import load
from fxworkload.cost.gpu import gemm_ns
from fxworkload.errors import UserError
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract

# tiny llama (tests/conftest.py): hidden 64, 4 heads of 16, 2 key/value heads, FFN 112, 2 layers
HIDDEN, KV, FFN, LAYERS = 64, 2 * 16, 112, 2
LINEAR_WEIGHTS = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * FFN)  # q, o; k, v; gate, up, down


def test_a_large_fp8_gemm_runs_at_twice_the_bf16_rate_per_clock_on_hopper():
    h100 = load("h100-sxm")
    facts, model = h100.gpu_facts(), h100.gpu_model()
    bf16 = gemm_ns(8192, 8192, 8192, 1, "bf16", (8192, 8192, 8192), facts, model)
    fp8 = gemm_ns(8192, 8192, 8192, 1, "fp8", (8192, 8192, 8192), facts, model)
    assert h100.matmul_flops_per_s["fp8"] == pytest.approx(2 * h100.matmul_flops_per_s["bf16"], rel=1e-3)  # 3,958 vs 1,979
    # compute-bound: the same tiles at twice the rate per clock, at the lower clock FP8 holds at the power
    # limit (median 1,312 against 1,455 MHz on the lent H200: bench/data/lent-gpus/h200/power/samples.csv)
    assert fp8 / bf16 == pytest.approx(0.5 * 1455 / 1312, rel=0.02)


@pytest.fixture(scope="module")
def steps(tiny_dirs):
    args = dict(batch=2, seq=32, dtype="bf16", device="h100-sxm")
    return extract(str(tiny_dirs["llama"]), **args), extract(str(tiny_dirs["llama"]), fp8=True, **args)


def test_only_the_decoder_layers_linear_gemms_run_in_fp8(steps):
    _, fp8 = steps
    rows = fp8.workload.node_rows
    converted = [(row.module, phase) for row in rows for phase in ("forward", "input_grad", "weight_grad")
                 for op in row.ops(phase) if op.gemm_dtype == "fp8"]
    # seven linear layers per decoder layer, each with its forward, input- and weight-gradient GEMM
    assert len(converted) == LAYERS * 7 * 3
    assert all(".layers." in module for module, _ in converted)  # not lm_head, not the embedding
    assert not any(op.gemm_dtype for row in rows for op in row.ops("forward") if op.sdpa_backend)  # attention stays


def test_fp8_weights_and_cast_bytes_are_counted_by_hand(steps):
    bf16, fp8 = steps
    assert fp8.workload.fp8_weight_elements == LINEAR_WEIGHTS
    assert fp8.memory.fp8_weights_bytes == 2 * LINEAR_WEIGHTS  # one rank holds all: an FP8 copy and its transpose
    tokens = 2 * 32
    q_proj = next(r for r in fp8.workload.node_rows
                  if r.module.endswith("layers.0.self_attn.q_proj") and r.forward.gemm_mkn)
    plain = next(r for r in bf16.workload.node_rows if r.name == q_proj.name)
    # the forward GEMM's input cast: read 2 bytes, write 1 + 1 (the FP8 value and its transpose) per element
    assert q_proj.forward.bytes - plain.forward.bytes == tokens * HIDDEN * 4
    assert q_proj.forward.flops == plain.forward.flops  # the same arithmetic, at another rate


def test_fp8_is_refused_where_it_cannot_run(tiny_dirs):
    with pytest.raises(UserError, match="no FP8 tensor cores"):
        extract(str(tiny_dirs["llama"]), seq=16, dtype="bf16", device="a100-80gb", fp8=True)
    with pytest.raises(UserError, match="--dtype bf16"):
        extract(str(tiny_dirs["llama"]), seq=16, dtype="fp32", device="h100-sxm", fp8=True)


def test_backward_keeps_each_linear_input_in_fp8_once(steps):
    """Per layer four distinct linear inputs (q/k/v's, o's, gate/up's, down's), 64 tokens each:
    hidden 64, heads x head_dim 64, hidden 64, FFN 112; each saved at one byte instead of two."""
    bf16, fp8 = steps
    tokens = 2 * 32
    assert bf16.workload.saved_bytes - fp8.workload.saved_bytes == LAYERS * tokens * (HIDDEN + 64 + HIDDEN + FFN)


def test_zero3_holds_the_fp8_copies_of_its_shard_only(tiny_dirs):
    from fxworkload.parallel.layout import Parallel

    sharded = extract(str(tiny_dirs["llama"]), batch=2, seq=32, dtype="bf16", device="h100-sxm", fp8=True,
                      parallel=Parallel(dp=2, zero=3))
    assert sharded.memory.fp8_weights_bytes == 2 * LINEAR_WEIGHTS // 2


def test_fp8_parameter_gathers_move_a_byte_per_linear_weight(tiny_dirs):
    """Megatron-LM's --fp8-param-gather (ZeRO 1) and torchao's FSDP2 float8 all-gather (ZeRO 3): the
    parameter all-gathers carry the FP8 linear weights at one byte, the rest at bf16's two; under ZeRO 1
    the weights are kept in FP8 too (one byte less each), with only their transposes beside them."""
    from fxworkload.parallel.collectives import ALLGATHER
    from fxworkload.parallel.layout import Parallel

    def run(zero, gather):
        return extract(str(tiny_dirs["llama"]), batch=2, seq=32, dtype="bf16", device="h100-sxm", fp8=True,
                       parallel=Parallel(dp=2, zero=zero, fp8_param_gather=gather))

    for zero in (1, 3):
        plain, fp8_gather = run(zero, False), run(zero, True)
        total = plain.workload.parameter_count
        # ZeRO 1: one gather of every parameter after the optimizer; ZeRO 3: one per FSDP unit before forward
        # (and again before backward), together every parameter
        gathers = [sum(c.bytes for u in r.rank.units for c in u.comms["weight_grad"]
                       if c.type == ALLGATHER and c.what in ("updated parameters", "parameters for forward"))
                   for r in (plain, fp8_gather)]
        assert gathers[0] == 2 * total
        assert gathers[1] == 2 * (total - LINEAR_WEIGHTS) + LINEAR_WEIGHTS
    plain, fp8_gather = run(1, False), run(1, True)
    assert plain.memory.parameters_bytes - fp8_gather.memory.parameters_bytes == LINEAR_WEIGHTS
    assert fp8_gather.memory.fp8_weights_bytes == LINEAR_WEIGHTS  # the transposes only
    with pytest.raises(UserError, match="needs --fp8"):
        extract(str(tiny_dirs["llama"]), seq=16, dtype="bf16", device="h100-sxm",
                parallel=Parallel(dp=2, zero=1, fp8_param_gather=True))
    with pytest.raises(UserError, match="--zero 1, 2 or 3"):
        extract(str(tiny_dirs["llama"]), seq=16, dtype="bf16", device="h100-sxm", fp8=True,
                parallel=Parallel(dp=2, fp8_param_gather=True))


def test_each_stage_casts_the_fp8_weights_it_holds(tiny_dirs):
    """Two pipeline stages, one decoder layer each: after the optimizer each casts its own layer's linear
    weights (read 2 bytes, write the FP8 copy and its transpose: 4 bytes a weight), whatever else the stage
    holds (the embedding on the first, the head on the last: not cast)."""
    from fxworkload.cost.gpu import memory_ns
    from fxworkload.parallel.layout import Parallel

    def run(fp8):
        return extract(str(tiny_dirs["llama"]), batch=2, seq=32, dtype="bf16", device="h100-sxm", fp8=fp8,
                       parallel=Parallel(pp=2, micro_batches=2))

    plain, fp8 = run(False), run(True)
    h100 = load("h100-sxm")
    per_layer = memory_ns(LINEAR_WEIGHTS // LAYERS * 4, h100.gpu_facts(), h100.gpu_model(), casts=True)
    for before, after in zip(plain.cluster.devices, fp8.cluster.devices):
        assert after.optimizer_ns - before.optimizer_ns == pytest.approx(per_layer, rel=1e-9)


def test_torchaos_recipe_reads_each_cast_tensor_once_more_and_casts_the_weights_every_forward(tiny_dirs, steps):
    """By hand, per decoder linear's forward (m tokens x k in, k x n weight): Transformer Engine casts the input
    in one pass (read 2 bytes, write 1 + 1); torchao's dynamic scaling takes its amax first (2 bytes more) and
    casts the weight too, the same way (6 bytes a weight). So each forward GEMM moves 2·m·k + 6·k·n bytes more
    than TE's; torchao keeps no FP8 weights between steps (no memory for them, no cast after the optimizer)."""
    _, te = steps
    torchao = extract(str(tiny_dirs["llama"]), batch=2, seq=32, dtype="bf16", device="h100-sxm", fp8=True,
                      fp8_recipe="torchao")
    for a, b in zip(te.workload.node_rows, torchao.workload.node_rows):
        if a.forward.gemm_dtype == "fp8":
            m, k, n = a.forward.gemm_mkn
            assert b.forward.bytes - a.forward.bytes == 2 * m * k + 6 * k * n
    assert te.memory.fp8_weights_bytes == 2 * LINEAR_WEIGHTS and torchao.memory.fp8_weights_bytes == 0
    assert torchao.settings["fp8_recipe"] == "torchao"
    with pytest.raises(UserError, match="needs --fp8"):
        extract(str(tiny_dirs["llama"]), seq=32, dtype="bf16", device="h100-sxm", fp8_recipe="torchao")
    with pytest.raises(UserError, match="unknown --fp8-recipe"):
        extract(str(tiny_dirs["llama"]), seq=32, dtype="bf16", device="h100-sxm", fp8=True, fp8_recipe="mxfp8")


def test_sequence_parallel_casts_the_gathered_tensors_on_the_ranks_share(tiny_dirs):
    """With TP 2 and sequence parallelism the all-gathers move FP8, so what they gather is cast before them on the
    rank's half (torchao's PrepareFloat8ModuleInput and Float8RowwiseParallel; TE's LayerNormLinear and its
    grad_output quantizer): by hand, q_proj's forward input cast is tokens/2 x hidden x 4 bytes, and o_proj's
    input-gradient GEMM casts its output gradient (tokens x hidden, gathered) on tokens/2 x hidden; o_proj's own
    input (the rank's heads, not gathered) and q_proj's output gradient (its own columns) are cast whole."""
    args = dict(batch=2, seq=32, dtype="bf16", device="h100-sxm", parallel=Parallel(tp=2, sp=True))
    bf16, fp8 = (extract(str(tiny_dirs["llama"]), fp8=on, **args) for on in (False, True))
    tokens = 2 * 32

    def added(suffix):
        row, plain = (next(r for r in run.workload.node_rows if r.module.endswith(suffix) and r.forward.gemm_mkn)
                      for run in (fp8, bf16))
        gemm_grads = [(a.bytes - b.bytes, a.gemm_mkn) for a, b in zip(row.input_grad, plain.input_grad) if a.gemm_mkn]
        return row.forward.bytes - plain.forward.bytes, row.forward.gemm_mkn, gemm_grads[0]

    q_forward, (m, k, n), (q_grad, _) = added("layers.0.self_attn.q_proj")
    assert q_forward == tokens // 2 * HIDDEN * 4 and m == tokens and k == HIDDEN
    assert q_grad == m * n * 4  # q's output gradient: the rank's own columns, not gathered
    o_forward, (m, k, n), (o_grad, _) = added("layers.0.self_attn.o_proj")
    assert o_forward == m * k * 4  # the rank's heads' attention output, not gathered
    assert o_grad == tokens // 2 * HIDDEN * 4


def test_torchaos_casts_under_compile_are_generated_kernels(tiny_dirs):
    """Under --stack compiled torchao's amax and cast kernels are inductor's: the FP8 GEMM's time over the same
    GEMM's without casts is the casts' memory time times generated_kernel_slowdown; Transformer Engine's are its
    own kernels under every stack."""
    from fxworkload.cost.gpu import memory_ns
    from fxworkload.cost.optime import gpu_op_ns
    from fxworkload.workload.fp8 import RECIPE_CAST_BYTES

    h100 = load("h100-sxm")
    facts, model = h100.gpu_facts(), h100.gpu_model()
    for recipe, factor in (("torchao", model.generated_kernel_slowdown), ("te", 1.0)):
        run = extract(str(tiny_dirs["llama"]), batch=2, seq=32, dtype="bf16", device="h100-sxm", fp8=True,
                      fp8_recipe=recipe, stack="compiled")
        row = next(r for r in run.workload.node_rows if r.module.endswith("layers.0.self_attn.q_proj")
                   and r.forward.gemm_mkn)
        m, k, n = row.forward.gemm_mkn
        cast_elements = m * k + (k * n if recipe == "torchao" else 0)
        cast_ns = memory_ns(cast_elements * RECIPE_CAST_BYTES[recipe], facts, model, casts=True)
        assert row.forward.estimated_ns - gpu_op_ns(row.forward, h100, "fp8") == pytest.approx(cast_ns * factor)


def test_torchaos_rowwise_recipe_casts_each_gemms_operands_from_16_bits(tiny_dirs):
    """By hand from torchao's row-wise recipe (float8_linear.py matmul_with_hp_or_float8_args; float8_ops.py
    addmm_float8_unwrapped), per decoder linear (m tokens x k in, k x n weight), over the bf16 step's bytes:
    the forward GEMM casts its input and weight along k, each row in one pass (3 bytes an element); the
    input-gradient GEMM casts the output gradient along n (3), the weight along n down its columns (read twice,
    written once: 5), and scales its 16-bit m x k output after cuBLAS (read and written: 4); the weight-gradient
    GEMM casts the output gradient and the input along m down their columns (5 each) and scales its k x n output
    (4). Backward keeps the 16-bit input (ctx.save_for_backward(input_hp, ...)): the saved bytes are bf16's,
    where the tensor-wise recipe saves one byte less an element of each linear's input."""
    args = dict(batch=2, seq=32, dtype="bf16", device="h100-sxm")
    bf16 = extract(str(tiny_dirs["llama"]), **args)
    tensorwise, rowwise = (extract(str(tiny_dirs["llama"]), fp8=True, fp8_recipe=recipe, **args)
                           for recipe in ("torchao", "torchao-rowwise"))
    checked = 0
    for plain, row in zip(bf16.workload.node_rows, rowwise.workload.node_rows):
        if row.forward.gemm_dtype != "fp8":
            continue
        m, k, n = row.forward.gemm_mkn
        dgrad, wgrad = ([(a.bytes - b.bytes) for a, b in zip(row.ops(phase), plain.ops(phase)) if a.gemm_mkn]
                        for phase in ("input_grad", "weight_grad"))
        assert row.forward.bytes - plain.forward.bytes == 3 * (m * k + k * n)
        assert dgrad == [3 * m * n + 5 * k * n + 4 * m * k]
        assert wgrad == [5 * (m * n + m * k) + 4 * k * n]
        checked += 1
    assert checked == LAYERS * 7
    assert rowwise.workload.saved_bytes == bf16.workload.saved_bytes > tensorwise.workload.saved_bytes
    assert rowwise.memory.fp8_weights_bytes == 0 and not rowwise.workload.fp8_tp_gathers
    assert tensorwise.workload.fp8_tp_gathers


def test_compiled_rowwise_linears_that_read_one_tensor_cast_it_once_each_way(tiny_dirs):
    """The row-wise recipe under torch.compile, by hand as above: k and v read q's input and up gate's, and
    AOTAutograd's CSE merges their identical casts of it, so they skip the forward's cast of the input along k
    (3 bytes an element) and the weight gradient's cast of it along m, down its columns (5); every other cast,
    and the rescaled outputs, are each linear's own."""
    args = dict(batch=2, seq=32, dtype="bf16", device="h100-sxm", stack="compiled")
    bf16 = extract(str(tiny_dirs["llama"]), **args)
    rowwise = extract(str(tiny_dirs["llama"]), fp8=True, fp8_recipe="torchao-rowwise", **args)
    checked = 0
    for plain, row in zip(bf16.workload.node_rows, rowwise.workload.node_rows):
        if row.forward.gemm_dtype != "fp8":
            continue
        m, k, n = row.forward.gemm_mkn
        input_share = 0 if row.module.rsplit(".", 1)[1] in ("k_proj", "v_proj", "up_proj") else 1
        dgrad, wgrad = ([(a.bytes - b.bytes) for a, b in zip(row.ops(phase), plain.ops(phase)) if a.gemm_mkn]
                        for phase in ("input_grad", "weight_grad"))
        assert row.forward.bytes - plain.forward.bytes == 3 * (m * k * input_share + k * n), row.module
        assert dgrad == [3 * m * n + 5 * k * n + 4 * m * k]
        assert wgrad == [5 * (m * n + m * k * input_share) + 4 * k * n], row.module
        checked += 1
    assert checked == LAYERS * 7


def test_rowwise_gathers_stay_16_bit_and_refuse_an_fp8_fsdp_gather(tiny_dirs):
    """torchtitan runs regular tensor parallelism with the row-wise recipes ('float8 all-gather with TP is only
    supported for tensorwise'): with TP 2 and sequence parallelism the block's all-gathers move bf16, 2 bytes an
    element as without FP8, and the casts are of the gathered, whole tensors; torchao's FSDP float8 all-gather is
    refused with a recipe name (torchtitan's float8 converter: 'not supported')."""
    args = dict(batch=2, seq=32, dtype="bf16", device="h100-sxm", parallel=Parallel(tp=2, sp=True))
    bf16, rowwise = (extract(str(tiny_dirs["llama"]), **args, **extra)
                     for extra in ({}, dict(fp8=True, fp8_recipe="torchao-rowwise")))

    def gathers(run):
        return sorted(c.bytes for u in run.rank.units for ph in ("forward", "input_grad") for c in u.comms[ph]
                      if c.type == "ALLGATHER" and c.group == "tp")

    assert gathers(rowwise) == gathers(bf16) and gathers(bf16)
    q_proj = next(r for r in rowwise.workload.node_rows if r.module.endswith("layers.0.self_attn.q_proj")
                  and r.forward.gemm_mkn)
    plain = next(r for r in bf16.workload.node_rows if r.name == q_proj.name)
    m, k, n = q_proj.forward.gemm_mkn
    assert m == 2 * 32 and q_proj.forward.bytes - plain.forward.bytes == 3 * (m * k + k * n)  # the whole gathered input
    with pytest.raises(UserError, match="tensor-wise only"):
        extract(str(tiny_dirs["llama"]), seq=32, dtype="bf16", device="h100-sxm", fp8=True,
                fp8_recipe="torchao-rowwise", parallel=Parallel(dp=2, zero=3, fp8_param_gather=True))


def test_torchaos_sibling_linears_cast_their_shared_input_once_where_it_is_merged(tiny_dirs):
    """By hand, per decoder layer, the forward GEMM's bytes over bf16's: q, o, gate and down cast their input
    (6 bytes an element with torchao: amax, then cast and transpose) and their weight (6); k and v read q's
    input and up gate's, so under torch.compile (AOTAutograd's CSE merges the identical casts) and under
    sequence parallelism (torchao's PrepareFloat8ModuleInput casts the block input once) they cast their
    weight only. In eager without a gather each Float8Linear casts its own input; Transformer Engine's
    separate Linear modules always do (4 bytes: cast and transpose), but Megatron-Core's one linear for q, k
    and v (gate and up) casts once."""
    tokens = 2 * 32

    def extra_bytes(**args):
        run, plain = (extract(str(tiny_dirs["llama"]), batch=2, seq=32, dtype="bf16", device="h100-sxm", **extra)
                      for extra in (dict(fp8=True, **args), {k: v for k, v in args.items() if k != "fp8_recipe"}))
        out = {}
        for row, base in zip(run.workload.node_rows, plain.workload.node_rows):
            if row.forward.gemm_dtype == "fp8" and ".layers.0." in row.module:
                out[row.module.rsplit(".", 1)[1]] = (row.forward.bytes - base.forward.bytes, row.forward.gemm_mkn)
        return out

    compiled = extra_bytes(fp8_recipe="torchao", stack="compiled")
    assert len(compiled) == 7  # q, k, v, o, gate, up, down: none missed by the checks below
    for name, (added, (m, k, n)) in compiled.items():
        shares = name in ("k_proj", "v_proj", "up_proj")
        assert added == (0 if shares else 6 * m * k) + 6 * k * n, name
    eager = extra_bytes(fp8_recipe="torchao")
    assert len(eager) == 7
    assert all(added == 6 * m * k + 6 * k * n for added, (m, k, n) in eager.values())
    te = extra_bytes(fp8_recipe="te", stack="compiled")
    assert len(te) == 7
    assert all(added == 4 * m * k for added, (m, k, n) in te.values())
    megatron = extra_bytes(fp8_recipe="te", stack="fused")  # one linear_qkv, one linear_fc1: one cast each
    assert len(megatron) == 7
    for name, (added, (m, k, n)) in megatron.items():
        assert added == (0 if name in ("k_proj", "v_proj", "up_proj") else 4 * m * k), name
    gathered = extra_bytes(fp8_recipe="torchao", parallel=Parallel(tp=2, sp=True))
    added, (m, k, n) = gathered["k_proj"]
    assert added == 6 * k * n and m == tokens  # q's cast of the rank's shard, gathered once for all three
    added, (m, k, n) = gathered["q_proj"]
    assert added == 6 * (tokens // 2) * HIDDEN + 6 * k * n


def test_te_current_scaling_reads_each_tensor_once_more_for_its_amax_unless_a_norm_took_it(tiny_dirs):
    """By hand from Transformer Engine's current scaling (quantizer.cpp Float8CurrentScalingQuantizer::quantize_impl:
    an amax kernel over the 16-bit tensor, then the cast and its transpose: 2 + 2 read, 1 + 1 written an element),
    over bf16's bytes: every output gradient's cast 6 bytes an element; an input's cast 6, but 4 where
    LayerNormLinear's norm took the amax as it wrote its output (create_hp_tensor_with_amax: Megatron-Core's
    linear_qkv and linear_fc1 under --stack fused, whose k/v and up share q's and gate's cast); weights kept in
    FP8 a step, as delayed scaling's (no cast in the forward)."""
    def per_element(**args):
        run, plain = (extract(str(tiny_dirs["llama"]), batch=2, seq=32, dtype="bf16", device="h100-sxm", **extra)
                      for extra in (dict(fp8=True, fp8_recipe="te-current", **args), args))
        out = {}
        for row, base in zip(run.workload.node_rows, plain.workload.node_rows):
            if row.forward.gemm_dtype == "fp8" and ".layers.0." in row.module:
                m, k, n = row.forward.gemm_mkn
                dgrad = [a.bytes - b.bytes for a, b in zip(row.input_grad, base.input_grad) if a.gemm_mkn]
                out[row.module.rsplit(".", 1)[1]] = ((row.forward.bytes - base.forward.bytes) / (m * k),
                                                     dgrad[0] / (m * n))
        return out

    megatron = per_element(stack="fused")
    assert megatron == {"q_proj": (4, 6), "k_proj": (0, 6), "v_proj": (0, 6), "o_proj": (6, 6),
                        "gate_proj": (4, 6), "up_proj": (0, 6), "down_proj": (6, 6)}
    eager = per_element()  # TE's separate Linear modules: each computes its input's amax
    assert len(eager) == 7 and set(eager.values()) == {(6, 6)}
    # TP 2 + SP: a gathered tensor is cast on the rank's half before the gather (the column-parallel q's and
    # gate's input, the row-parallel o's and down's output gradient): per element of the gathered tensor, half
    gathered = per_element(stack="fused", parallel=Parallel(tp=2, sp=True))
    assert gathered == {"q_proj": (2, 6), "k_proj": (0, 6), "v_proj": (0, 6), "o_proj": (6, 3),
                        "gate_proj": (2, 6), "up_proj": (0, 6), "down_proj": (6, 3)}
