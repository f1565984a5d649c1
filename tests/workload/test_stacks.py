"""The execution stacks (workload/stacks.py): what ``compiled`` keeps against torch's own AOTAutograd
partition of the real model, and what a ``fused`` kernel moves against a hand count."""

from __future__ import annotations

import re

import pytest
import torch
from functorch.compile import aot_module, make_boxed_func, min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import AutoModelForCausalLM

from fxworkload.capture.trace import _unpacked_sequences
from fxworkload.errors import UserError
from fxworkload.pipeline import extract
from fxworkload.workload.memory import ALLOCATION_ROUNDING_BYTES

from ..conftest import tiny_config


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_ROUNDING_BYTES) * ALLOCATION_ROUNDING_BYTES


def _torch_compiled_saved_bytes(config, batch: int, seq: int) -> int:
    """Run the real model (CPU, real tensors) through AOTAutograd with the min-cut partitioner, as
    torch.compile does, and add up the storages its forward hands to backward (the forward graph's
    outputs after the loss), inputs (parameters, buffers, ids) left out: what a compiled step keeps."""
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    recorded = {}

    def forward_compiler(gm, example_inputs):
        def run(args):
            recorded["inputs"] = list(args)
            recorded["outputs"] = gm(*args)
            return recorded["outputs"]
        run._boxed_call = True
        return run

    def backward_compiler(gm, example_inputs):
        recorded["kept"] = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        return make_boxed_func(gm)

    compiled = aot_module(model, fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                          partition_fn=min_cut_rematerialization_partition)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with _unpacked_sequences():  # transformers would build a mask where eager sees none (see test_memory)
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    inputs = {StorageWeakRef(t.untyped_storage()) for t in recorded["inputs"] if isinstance(t, torch.Tensor)}
    kept = [t for t in recorded["outputs"][-len(recorded["kept"]):] if isinstance(t, torch.Tensor)]
    storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in kept}
    return sum(_rounded(n) for key, n in storages.items() if key not in inputs)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_the_compiled_stack_keeps_what_aotautograds_partitioner_keeps(model_type, tmp_path):
    """(aot_module's functional_call refuses a tied head and embedding: GPT-2 here unties them.)"""
    settings = {"tie_word_embeddings": False} if model_type == "gpt2" else {}
    tiny_config(model_type, **settings).save_pretrained(tmp_path)
    ours = extract(str(tmp_path), batch=2, seq=16, trace_on="cpu", stack="compiled", use_cache=False)
    oracle = _torch_compiled_saved_bytes(tiny_config(model_type, **settings), 2, 16)
    assert ours.workload.saved_bytes == oracle
    eager = extract(str(tmp_path), batch=2, seq=16, trace_on="cpu", use_cache=False)
    assert ours.workload.saved_bytes < eager.workload.saved_bytes  # the partitioner re-makes cheap values


def _torch_block_compiled_saved_bytes(config, batch: int, seq: int) -> int:
    """Run the real model (CPU, real tensors) with each decoder layer alone through AOTAutograd and the min-cut
    partitioner, as torchtitan's apply_compile compiles each block, the embedding, head and loss eager; add up
    the storages autograd is handed to keep for backward (saved_tensors_hooks sees both the eager ops' saved
    tensors and each compiled block's), inputs (parameters, buffers, ids) left out."""
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    layers = model.get_decoder().layers if hasattr(model.get_decoder(), "layers") else model.transformer.h
    for i, layer in enumerate(layers):
        layers[i] = aot_module(layer, fw_compiler=lambda gm, _: make_boxed_func(gm),
                               bw_compiler=lambda gm, _: make_boxed_func(gm),
                               partition_fn=min_cut_rematerialization_partition)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    inputs = {StorageWeakRef(t.untyped_storage()) for t in (ids, *model.parameters(), *model.buffers())}
    kept = {}

    def pack(tensor):
        kept[StorageWeakRef(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        return tensor

    with _unpacked_sequences(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return sum(_rounded(n) for key, n in kept.items() if key not in inputs)


def test_the_block_compiled_stack_keeps_what_torch_keeps_with_each_block_compiled(tmp_path):
    """--stack compiled-blocks against the real model with each Llama layer through AOTAutograd's partitioner and
    the rest eager: within one allocation block (512 bytes, a storage of a few bytes the real step keeps and the
    graph does not; eager's own figure is off by the same block), where the whole model compiled and eager are
    60 KB apart."""
    tiny_config("llama").save_pretrained(tmp_path)
    ours = {stack: extract(str(tmp_path), batch=2, seq=16, trace_on="cpu", stack=stack, use_cache=False).workload.saved_bytes
            for stack in ("eager", "compiled", "compiled-blocks")}
    oracle = _torch_block_compiled_saved_bytes(tiny_config("llama"), 2, 16)
    assert abs(ours["compiled-blocks"] - oracle) <= ALLOCATION_ROUNDING_BYTES
    assert ours["compiled"] < ours["compiled-blocks"] < ours["eager"] - 10 * ALLOCATION_ROUNDING_BYTES


def test_the_block_compiled_stack_runs_the_blocks_compiled_and_the_rest_eager(tmp_path):
    """Outside the decoder layers (embedding, final norm, head, loss) every forward and backward op costs what
    eager gives it; inside, ops fuse into kernels, none holding ops of two layers (each block is its own
    graph) or of the eager rest; fusing moves work, it does not drop it."""
    from fxworkload.workload.layers import layer_of

    tiny_config("llama").save_pretrained(tmp_path)
    tables = {stack: extract(str(tmp_path), batch=2, seq=16, device="h100-sxm", stack=stack, use_cache=False).workload
              for stack in ("eager", "compiled-blocks")}
    rows, eager_rows = tables["compiled-blocks"].node_rows, tables["eager"].node_rows
    assert [r.module for r in rows] == [r.module for r in eager_rows]  # one row per forward op, in order
    outside = [(row, eager) for row, eager in zip(rows, eager_rows) if layer_of(row.module, "model.layers") is None]
    assert len(outside) > 10
    for row, eager in outside:
        for ours, theirs in ((row.forward, eager.forward), *zip(row.input_grad + row.weight_grad,
                                                               eager.input_grad + eager.weight_grad)):
            assert (ours.flops, ours.bytes, ours.estimated_ns, ours.fused) == (
                theirs.flops, theirs.bytes, theirs.estimated_ns, theirs.fused), row.name
    from fxworkload.capture import models
    from fxworkload.capture.trace import capture_training_step
    from fxworkload.workload.fusion import regions
    from fxworkload.workload.table import compiled_scope

    module = models.build_meta_model(models.resolve(str(tmp_path)), torch.float32)
    capture = capture_training_step(module, 2, 16)
    scope = compiled_scope(capture, "model.layers")
    kernels = regions(capture, scope).members.values()
    assert len(kernels) > 10 and {scope[n] for members in kernels for n in members} == {"model.layers.0",
                                                                                         "model.layers.1"}
    assert all(len({scope[n] for n in members}) == 1 for members in kernels)  # one layer's ops a kernel
    for phase in ("forward", "input_grad", "weight_grad"):
        assert tables["compiled-blocks"].totals[f"{phase}_flops"] == tables["eager"].totals[f"{phase}_flops"]
    assert tables["compiled-blocks"].totals["forward_bytes"] < tables["eager"].totals["forward_bytes"]


def test_a_fused_gelu_chain_reads_its_gemm_output_once_and_writes_once(tmp_path):
    """gelu_new (0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³)))) is eight aten ops; fused, one kernel that
    reads the c_fc output (b·s·4h) and writes the activation (b·s·4h): 2 × b·s·4h × 4 bytes in fp32."""
    batch, seq, hidden = 2, 16, 64
    tiny_config("gpt2", activation_function="gelu_new").save_pretrained(tmp_path)
    result = extract(str(tmp_path), batch=batch, seq=seq, trace_on="cpu", stack="fused", use_cache=False)
    act = [row for row in result.workload.node_rows if row.module.endswith("h.0.mlp.act")]
    kernels = [row.forward for row in act if row.forward.fused_ops]
    assert len(kernels) == 1 and kernels[0].fused_ops >= 7
    assert kernels[0].bytes == 2 * batch * seq * 4 * hidden * 4
    assert all(row.forward.fused and row.forward.bytes == 0 for row in act if row.forward is not kernels[0]
               and row.forward.kind != "view")
    eager = extract(str(tmp_path), batch=batch, seq=seq, trace_on="cpu", use_cache=False)
    for phase in ("forward", "input_grad", "weight_grad"):  # fusing moves work, it does not drop it
        assert result.workload.totals[f"{phase}_flops"] == eager.workload.totals[f"{phase}_flops"]
    assert result.workload.totals["forward_bytes"] < eager.workload.totals["forward_bytes"]


def test_the_outputs_say_which_stack_they_assume(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    result = extract(str(tmp_path), batch=1, seq=16, trace_on="cpu", stack="fused", device="h100-sxm")
    assert result.settings["stack"] == "fused"
    assert re.search(r"execution stack \(--stack\) +fused: Megatron-LM", result.summary())
    with pytest.raises(UserError, match="unknown --stack 'jit'"):
        extract(str(tmp_path), stack="jit")


def test_a_kernel_inductor_generates_is_costed_at_its_own_share_of_the_roofline(tmp_path):
    """The same fused GELU kernel on an H100: under --stack fused (hand-written) at the memory roofline that
    memory_ns gives for its bytes, under --stack compiled (inductor's Triton) generated_kernel_slowdown times
    that; the bytes and the region are the stacks' same."""
    from fxworkload.cost.gpu import memory_ns

    tiny_config("gpt2", activation_function="gelu_new").save_pretrained(tmp_path)
    kernels = {}
    for stack in ("fused", "compiled"):
        result = extract(str(tmp_path), batch=2, seq=16, device="h100-sxm", stack=stack, use_cache=False)
        act = [row.forward for row in result.workload.node_rows if row.module.endswith("h.0.mlp.act")
               and row.forward.fused_ops]
        kernels[stack] = act[0]
    device = result.device
    facts, model = device.gpu_facts(), device.gpu_model()
    assert not kernels["fused"].generated and kernels["compiled"].generated
    assert kernels["fused"].bytes == kernels["compiled"].bytes
    roofline = memory_ns(kernels["fused"].bytes, facts, model)
    assert kernels["fused"].estimated_ns == pytest.approx(roofline)
    assert kernels["compiled"].estimated_ns == pytest.approx(roofline * model.generated_kernel_slowdown)
    assert model.generated_kernel_slowdown > 1
