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
