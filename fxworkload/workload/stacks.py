"""The execution stacks a step can be costed for: which ops run as one kernel and what is kept for
backward. Each stack's choices are data here, with the source they follow.

- ``eager``: PyTorch eager as the HuggingFace model runs it: one kernel per aten op; autograd keeps
  what each op's derivative formula reads (tools/autograd/derivatives.yaml).
- ``fused``: Megatron-LM / Transformer Engine's fused kernels: each pointwise chain between GEMM
  and attention kernels is one kernel (bias_gelu, bias_dropout_add, FusedScaleMaskSoftmax, fused
  layer/RMS norm, SwiGLU), reading its outside inputs once and writing what leaves it once; its
  backward re-makes the chain's internal values from the chain's kept inputs (Megatron-LM
  megatron/core/fusions/fused_bias_gelu.py keeps the GEMM output, not GeLU's intermediates), and
  dropout masks are kept (1 byte per element, as Korthikanti et al. 2022 count them). Linears that read one
  tensor run as one GEMM (Megatron-Core's ``linear_qkv`` and ``linear_fc1``: workload/siblings.py).
- ``compiled``: ``torch.compile`` (AOTAutograd + inductor) on the whole model and its loss (HF Trainer's
  ``torch_compile``, whose loss the model's forward computes): what is kept is what AOTAutograd's
  ``min_cut_rematerialization_partition`` chooses on the step's joint graph; inductor fuses the
  same pointwise chains (and re-makes the rest inside backward's fused kernels), and pads GEMMs
  whose sizes are not multiples of 16 bytes to ones that are, where that is faster (its pad_mm
  pass: GPT-2's 50,257-word vocabulary runs the Hopper kernels instead of the align1 fallback).
- ``compiled-blocks``: ``torch.compile`` on each decoder block alone, as torchtitan compiles
  (``apply_compile``: ``torch.compile(transformer_block, fullgraph=True)`` per block), the rest eager: the
  embedding, the final norm, the output projection and the loss run as PyTorch eager runs them, one kernel
  an op, autograd keeping what their derivatives read (torchtitan's loss ran eager before 2024-10-22 and
  from 2024-12-18, ``train.py``: "compiling loss function causes CUDA errors", until 2025-04-02, bbb1b616e,
  from which it compiles the loss on its own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UserError

STACK_NAMES = ("eager", "fused", "compiled", "compiled-blocks")


@dataclass(frozen=True)
class Stack:
    name: str
    fuses_pointwise: bool  # pointwise chains between GEMM/attention kernels run as one kernel each
    keeps: str  # "autograd": what eager autograd keeps; "fused": fused kernels' inputs; "partitioner": AOTAutograd's choice
    source: str
    pads_gemms: bool = False  # unaligned GEMMs padded to aligned shapes (inductor's pad_mm; cost/gpu.py padded_gemm_ns)
    # how --tp-comm-overlap overlaps tensor-parallel collectives with GEMMs (parallel/collectives.py):
    # "userbuffers": Transformer Engine's, every forward and backward collective of a block;
    # "symmetric-memory": torch's AsyncTP (inductor's micro-pipeline TP pass), only the patterns it fuses
    tp_overlap: str = "userbuffers"
    generates_kernels: bool = False  # its fused kernels are a compiler's (inductor's Triton), not hand-written
    # how a context-parallel ring's per-step outputs are merged (parallel/context_parallel.py MERGE_BYTES):
    # "eager": torch's unfused merges; "fused": one kernel a step; "fused-p2p": Transformer Engine's, whose
    # p2p ring merges and whose all-gather runs one kernel per chunk with nothing to merge
    ring_merges: str = "eager"
    # under tensor parallelism, the loss over the vocabulary shard (parallel/loss_parallel.py): "loss-parallel",
    # torch's decomposition (torchtitan's default); "megatron": Megatron-LM's in-place vocab-parallel cross entropy
    vocab_parallel_loss: str = "loss-parallel"
    # which ops the stack's fusion, GEMM padding and saved set apply to: "all", or "layers": the decoder layers'
    # ops only, the rest run as eager runs them
    scope: str = "all"
    # linears that read one tensor (q, k and v; gate and up) built as one linear, each group's GEMMs one GEMM
    # (siblings.py): Megatron-Core's linear_qkv and linear_fc1
    merges_sibling_linears: bool = False
    # the dim of a block's activations that sequence parallelism shards: 1, torch's tensor parallelism on the
    # model's [batch, seq, hidden] (DTensor's Shard(1), torchtitan's plan), whose gathers and scatters move dim 0
    # and copy around it (parallel/collectives.py); 0, Megatron's [seq, batch, hidden]
    sequence_dim: int = 1


STACKS = {
    "eager": Stack("eager", False, "autograd", "PyTorch eager; autograd's derivatives.yaml"),
    "fused": Stack("fused", True, "fused", "Megatron-LM / Transformer Engine fused kernels (megatron/core/fusions)",
                   ring_merges="fused-p2p", vocab_parallel_loss="megatron", merges_sibling_linears=True,
                   sequence_dim=0),
    "compiled": Stack("compiled", True, "partitioner",
                      "torch.compile: AOTAutograd min_cut_rematerialization_partition + inductor fusion and "
                      "GEMM padding (torch/_inductor/fx_passes/pad_mm.py)", pads_gemms=True,
                      tp_overlap="symmetric-memory", generates_kernels=True, ring_merges="fused"),
}
STACKS["compiled-blocks"] = replace(
    STACKS["compiled"], name="compiled-blocks", scope="layers",
    source="torch.compile per decoder block (torchtitan's apply_compile), as compiled; the embedding, head and loss "
           "eager (torchtitan train.py, 2024-12-18 to 2025-04-02)")


def check_stack(name: str) -> Stack:
    if name not in STACKS:
        raise UserError(f"unknown --stack {name!r}: use one of {', '.join(STACK_NAMES)}")
    return STACKS[name]


# torchtitan's op-level selective activation checkpointing (torchtitan/distributed/activation_checkpoint.py,
# ``selective_ac_option = "op"``): each decoder block is checkpointed (its input kept); of the ops it
# runs, the outputs of these are kept and the rest is run again in backward; of the GEMMs, every
# second one is run again too (its policy counts ``mm``s and keeps the odd ones). GPT-2's Conv1D GEMM
# (``addmm``, a GEMM with its bias) counts as one.
OP_SAC_SAVED = frozenset({"mm", "addmm", "_scaled_dot_product_efficient_attention",
                          "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                          "_scaled_mm"})
OP_SAC_GEMMS = frozenset({"mm", "addmm"})


def op_level_recomputed(op_names: list[str]) -> list[bool]:
    """For one block's forward ops in order (aten op names), whether op-level checkpointing runs each again."""
    gemms, again = 0, []
    for name in op_names:
        gemms += name in OP_SAC_GEMMS
        again.append(name not in OP_SAC_SAVED or (name in OP_SAC_GEMMS and gemms % 2 == 0))
    return again
