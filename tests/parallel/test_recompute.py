"""--recompute with Megatron-LM's meanings: what each mode saves, and the forward time it adds to
backward in every output."""

from __future__ import annotations

import pytest
import torch

from fxworkload.capture.trace import FORWARD, INPUT_GRAD
from fxworkload.cli import main
from fxworkload.formats import simai
from fxworkload.parallel.layout import Parallel
from fxworkload.pipeline import extract
from fxworkload.workload.layers import layer_of

from ..conftest import tiny_config

BATCH, SEQ, HIDDEN = 2, 16, 64


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    tiny_config("llama", num_hidden_layers=4).save_pretrained(path)
    return str(path)


def _run(model, **parallel):
    return extract(model, batch=BATCH, seq=SEQ, dtype="bf16", device="h100-sxm", parallel=Parallel(**parallel))


def _layer_rows(result, layers):
    return [r for r in result.workload.node_rows if layer_of(r.module, result.facts.stack) in layers]


def test_full_keeps_each_layers_input_and_runs_its_forward_again(four_layers):
    plain, full = _run(four_layers), _run(four_layers, recompute="full")
    for layer in range(4):
        assert sum(r.saved_bytes for r in _layer_rows(full, {layer})) == BATCH * SEQ * HIDDEN * 2  # bf16 input
    forward_ns = sum(r.forward.estimated_ns for r in _layer_rows(plain, set(range(4))))
    added_ns = full.totals[f"{INPUT_GRAD}_estimated_ns"] - plain.totals[f"{INPUT_GRAD}_estimated_ns"]
    assert added_ns == pytest.approx(forward_ns, rel=1e-9) and forward_ns > 0
    assert full.memory.activations_bytes < plain.memory.activations_bytes
    assert full.totals[f"{FORWARD}_estimated_ns"] == plain.totals[f"{FORWARD}_estimated_ns"]


def test_selective_runs_only_the_attention_core_again(four_layers):
    plain, selective = _run(four_layers), _run(four_layers, recompute="selective")
    core = [r for r in plain.workload.node_rows if r.forward.sdpa_backend is not None]
    kernels = [r.forward.kind for r in core if r.forward.kind != "view"]
    assert kernels == ["attention"] * 4  # one fused cuDNN kernel per layer on an H100, and its views
    added_ns = selective.totals[f"{INPUT_GRAD}_estimated_ns"] - plain.totals[f"{INPUT_GRAD}_estimated_ns"]
    assert added_ns == pytest.approx(sum(r.forward.estimated_ns for r in core), rel=1e-9)
    # what the core saved is dropped but its output (b·s·h, bf16), which o_proj's backward reads too
    output_bytes = -(-BATCH * SEQ * HIDDEN * 2 // 512) * 512
    assert selective.workload.saved_bytes == plain.workload.saved_bytes - sum(r.saved_bytes for r in core) \
        + 4 * output_bytes


def test_recompute_layers_takes_the_first_of_each_stage_and_shows_in_the_simai_file(four_layers):
    plain = _run(four_layers, pp=2, stage=1, dp=2)
    some = _run(four_layers, pp=2, stage=1, dp=2, recompute="full", recompute_layers=1)
    changed = {layer_of(a.module, plain.facts.stack) for a, b in zip(plain.workload.node_rows, some.workload.node_rows)
               if len(a.input_grad) != len(b.input_grad)}
    assert changed == {0, 2}  # the first layer of stage 0 (layers 0-1) and of stage 1 (layers 2-3)
    rows = {layer: _layer_rows(plain, {layer}) for layer in (2, 3)}

    def backward_pass(result, layer):  # a unit's pass: its kernels, or its ops' host dispatch where longer
        return sum(max(sum(op.estimated_ns for op in u.ops(INPUT_GRAD)), sum(op.dispatch_ns for op in u.ops(INPUT_GRAD)))
                   for u in result.rank.units if u.layer == layer)

    added = backward_pass(some, 2) - backward_pass(plain, 2)
    assert added > 0 and backward_pass(some, 3) == backward_pass(plain, 3)
    assert sum(r.forward.estimated_ns for r in rows[2]) > 0
    before = sum(r.input_grad_ns for r in simai.from_rank(plain.rank).rows)
    after = sum(r.input_grad_ns for r in simai.from_rank(some.rank).rows)
    assert after - before == pytest.approx(added, abs=len(rows[2]) + 2)  # rounding to whole ns per unit


@pytest.mark.parametrize("args, message", [
    (["--recompute", "some"], "unknown --recompute 'some': use none, selective, op, full"),
    (["--recompute-layers", "1"], "--recompute-layers needs --recompute selective or full"),
    (["--recompute", "full", "--pp", "2", "--recompute-layers", "3"],
     "--recompute-layers 3 exceeds the 2 layers of the smallest pipeline stage"),
])
def test_impossible_recompute_settings_are_one_line(args, message, four_layers, tmp_path, capsys):
    assert main(["extract", four_layers, "--seq", "16", *args, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "o").exists()


def _torchtitan_op_policy():
    """torchtitan's op-level policy (torchtitan/distributed/activation_checkpoint.py): save mm and the
    GPU SDPA kernels' outputs, but recompute every second mm; everything else is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default}
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        count[mode] += func == torch.ops.aten.mm.default
        keep = func in save and not (func == torch.ops.aten.mm.default and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _held_after_forward(config, op_level: bool, batch: int, seq: int) -> int:
    """MemTracker's live bytes after an eager forward under FakeTensorMode (parameters and buffers
    left out), each decoder layer wrapped in torch's selective checkpoint with torchtitan's policy."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    from transformers import AutoModelForCausalLM

    from fxworkload.capture.trace import _unpacked_sequences

    config.use_cache = False
    with FakeTensorMode(), _unpacked_sequences():
        model = AutoModelForCausalLM.from_config(config).train()
        for layer in model.model.layers if op_level else ():
            def checkpointed(*args, _forward=layer.forward, **kwargs):
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs,
                                  context_fn=lambda: create_selective_checkpoint_contexts(_torchtitan_op_policy()))
            layer.forward = checkpointed
        ids = torch.zeros(batch, seq, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(ids, labels=ids)
            held = next(iter(tracker.get_tracker_snapshot("current").values()))
    held = {str(kind).rsplit(".", 1)[-1]: value for kind, value in held.items()}
    return held["Total"] - held["PARAM"] - held["BUFFER"]


def test_op_level_recomputation_keeps_what_torchs_selective_checkpoint_keeps(tmp_path):
    """torch's own selective checkpoint, torchtitan's policy, on the real (fake-tensor) model: what a
    forward leaves held with it and without, against our saved activations with and without."""
    tiny_config("llama", num_hidden_layers=4).save_pretrained(tmp_path)
    plain = extract(str(tmp_path), batch=2, seq=16, trace_on="cpu")
    op_level = extract(str(tmp_path), batch=2, seq=16, trace_on="cpu", parallel=Parallel(recompute="op"))
    freed = plain.workload.saved_bytes - op_level.workload.saved_bytes
    oracle = (_held_after_forward(tiny_config("llama", num_hidden_layers=4), False, 2, 16)
              - _held_after_forward(tiny_config("llama", num_hidden_layers=4), True, 2, 16))
    assert abs(freed - oracle) / oracle <= 0.02, (freed, oracle)
    added_ns = op_level.totals[f"{INPUT_GRAD}_estimated_ns"] - plain.totals[f"{INPUT_GRAD}_estimated_ns"]
    assert added_ns > 0  # the recomputed ops run in backward


def _partitioned_gemm_counts(config) -> tuple[int, int]:
    """torch.compile's own answer: the GEMM nodes (aten.mm, aten.addmm) AOTAutograd's min-cut partitioner puts
    into the forward and the backward graph of one layer wrapped in torch.utils.checkpoint (full recomputation)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    hidden = torch.randn(BATCH, SEQ, config.hidden_size, requires_grad=True)
    if config.model_type == "bert":
        layer, kwargs = AutoModelForMaskedLM.from_config(config).bert.encoder.layer[0], {}
    else:
        model = AutoModelForCausalLM.from_config(config)
        layer = model.model.layers[0]
        kwargs = {"position_embeddings": model.model.rotary_emb(hidden, torch.arange(SEQ)[None].expand(BATCH, -1))}
    graphs = []

    def kept(graph_module, _inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    def block(h):
        out = layer(h, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    compiled = torch.compile(lambda h: checkpoint(block, h, use_reentrant=False), fullgraph=True,
                             backend=aot_autograd(fw_compiler=kept, bw_compiler=kept))
    compiled(hidden).sum().backward()
    torch._dynamo.reset()
    gemm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    forward, backward = ([n for n in g.graph.nodes if n.target in gemm] for g in graphs)
    return len(forward), len(backward)


# model type: the GEMMs torch's partitioner puts in the forward and the backward graph of a checkpointed layer
PARTITIONED = {"llama": (7, 20),  # q k v o gate up down; their 14 gradients and 6 again: not down_proj
               "bert": (6, 18)}  # post-norm: the closing LayerNorm's backward reads its input, so every GEMM again


@pytest.mark.parametrize("model_type", PARTITIONED)
def test_compiled_full_recomputation_runs_again_only_what_backward_reads(model_type, tmp_path):
    """Under torch.compile the partitioner recomputes only what a checkpointed layer's backward reads: not a
    Llama layer's down_proj, whose output only the residual add reads; every GEMM of a post-norm BERT layer.
    Oracle: the GEMMs torch's partitioner puts into the backward graph of the same layer (checked against the
    counts above); eager checkpointing runs every forward GEMM again."""
    config = tiny_config(model_type, num_hidden_layers=1)
    config.save_pretrained(tmp_path)
    forward_gemms, backward_gemms = _partitioned_gemm_counts(config)
    assert (forward_gemms, backward_gemms) == PARTITIONED[model_type]

    def ours(stack):
        run = extract(str(tmp_path), batch=BATCH, seq=SEQ, stack=stack, trace_on="cpu",
                      parallel=Parallel(recompute="full"))
        return [op for row in _layer_rows(run, {0}) for op in row.input_grad + row.weight_grad
                if op.op in ("aten.mm.default", "aten.addmm.default")]

    assert len(ours("compiled")) == backward_gemms
    assert len(ours("eager")) == 3 * forward_gemms


def test_compiled_full_recomputation_does_not_reduce_the_mlp_output_again(four_layers):
    """With tensor and sequence parallelism, the recomputed MLP of a compiled layer stops before down_proj, so
    its row-parallel output's reduce-scatter does not run again; the attention's (o_proj's output feeds the
    MLP's norm) does. Eager checkpointing runs both again."""
    def recomputed_scatters(stack):
        run = extract(four_layers, batch=BATCH, seq=SEQ, stack=stack, device="h100-sxm",
                      parallel=Parallel(tp=2, sp=True, recompute="full"))
        return {u.block: [c.what for c in u.comms[INPUT_GRAD] if "recomputed" in c.what]
                for u in run.rank.units if u.layer == 0}

    compiled, eager = recomputed_scatters("compiled"), recomputed_scatters("eager")
    assert compiled["attention"] == eager["attention"] == [
        "block input (sequence-parallel), recomputed forward", "row-parallel output, recomputed forward"]
    assert eager["mlp"] == eager["attention"]
    assert compiled["mlp"] == ["block input (sequence-parallel), recomputed forward"]
