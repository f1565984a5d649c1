"""FP8 training as Transformer Engine runs it (``te.fp8_autocast`` around the decoder layers; NVIDIA's
"Using FP8 with Transformer Engine" and Micikevicius et al. 2022, "FP8 Formats for Deep Learning").

Which GEMMs: the linear layers of the decoder layers, forward and both backward GEMMs (input and
weight gradient). Attention's core, the norms, the embedding and the output layer (Megatron-LM
builds it outside TE) stay in the step's dtype. Each FP8 GEMM is timed by the same tile/wave model
as the others (cost/gpu.py), at the GPU's dense FP8 tensor peak with one-byte operands.

What FP8 adds around them, as memory-bound kernels at the casting kernels' rate (Little's law,
cost/gpu.py): before the forward GEMM the input is cast to FP8 with its transpose (for the weight
gradient), its amax taken in the same pass (TE's ``cast_transpose``): read 2 bytes, write 1 + 1, per
element; before the input-gradient GEMM the output gradient likewise. The weights' FP8 copies (and
transposes) are made once per step, after the optimizer, and kept: 2 bytes per weight in memory
(cluster/step.py, parallel/memory.py).

What backward keeps: TE saves a linear's input as its FP8 cast, one byte per element where the step
saved two. The 16-bit input was saved by the op that made it (a norm's output, a fused kernel's, the
attention core's); that op's saved bytes lose one byte per element of the input, once however many
linear layers read it (q, k and v; gate and up). The producer is the nearest row before the linear, in
its layer, that saved at least the input's 16-bit bytes and made a tensor of the input's size; linear
layers of one input size with only views between them (q, k, v) read the same input.

ZeRO's parameter all-gathers move the FP8 weights in FP8 with ``--fp8-param-gather``
(parallel/collectives.py ``parameter_bytes``; Megatron-LM's flag of that name, which under ZeRO 1/2
also keeps the weights in FP8, and torchao's FSDP2 float8 all-gather under ZeRO 3).

``--fp8-recipe torchao`` runs torchao's Float8Linear as torchtitan enables it (dynamic tensor-wise scaling,
torchao/float8/float8_linear.py): each operand's scale is its amax taken just before its cast, a reduction
over the whole tensor that must end before the cast starts, so every cast reads its 16-bit tensor twice
(amax, then the cast with its transpose: 2 + 2 read, 1 + 1 written per element); and the weights are cast
the same way in every forward (no FP8 copy kept from step to step), so they cost no memory between steps
and no cast after the optimizer.

Under ``--stack compiled`` torchao's amax and cast kernels are inductor's (torchtitan compiles the blocks
with Float8Linear in them): they take the generated kernels' factor over the roofline
(cost/gpu.py ``generated_kernel_slowdown``). Transformer Engine's are its own, hand-written.

Linear layers that read one tensor (q, k and v; gate and up) cast it once with torchao where the step is
compiled or the tensor is gathered: each Float8Linear's cast of its input is the same deterministic ops
(amax, scale, scaled clamp, to FP8) on the same tensor, which AOTAutograd's common-subexpression pass merges
(torch/_functorch/partitioners.py ``min_cut_rematerialization_partition``: ``if config.cse: fx_graph_cse``,
on by default, before inductor sees the graph); and under sequence parallelism torchao's
``PrepareFloat8ModuleInput`` casts the block input once before the one all-gather its q, k and v (gate and up)
read. Transformer Engine's separate ``Linear`` modules each cast their own input; Megatron-Core's one linear for
q, k and v (gate and up) casts it once (``--stack fused``, siblings.py).

``--fp8-recipe torchao-rowwise`` runs torchao's row-wise recipe (``Float8LinearConfig.from_recipe_name("rowwise")``,
torchao/float8/config.py; float8_linear.py ``matmul_with_hp_or_float8_args``): each of a linear's three GEMMs casts
its own two operands from their 16-bit copies, each scaled per row or column along that GEMM's reduction axis
(e4m3 throughout), so backward keeps the 16-bit input (``ctx.save_for_backward(input_hp, weight_hp_t)``: nothing
saved in FP8) and casts six times where tensor-wise casts three:
- forward, input and weight scaled along k, each row's amax and cast in one pass (read 2, write 1);
- input gradient: the output gradient along n (one pass), the weight along n, down its columns (the columns'
  amax first, then the cast, written transposed for the GEMM: read 2 + 2, write 1);
- weight gradient: the output gradient and the saved input along m, down their columns (the same two passes).
The forward GEMM is ``_scaled_mm`` with row-wise scales and fast accumulation, PyTorch's CUTLASS kernel, timed
as the tensor-wise cuBLAS one (pytorch/pytorch#147971: most shapes at 90-100 % of its rate, a tail to 50 % not
modelled); the two backward GEMMs run without fast accumulation, which torchao sends to the tensor-wise cuBLAS
kernel with unit scales and then scales the 16-bit output by the outer product of the row and column scales
(float8_ops.py ``addmm_float8_unwrapped``: "the rowwise CUTLASS-based kernel is so slow without fast-accum"),
one pass over the output (read 2, write 2). Sequence parallelism's all-gathers stay 16-bit (torchtitan runs
regular tensor parallelism with the row-wise recipes), and so do FSDP's (torchtitan refuses its float8
all-gather with a recipe name).

``--fp8-recipe te-current`` runs Transformer Engine's current scaling (``recipe.Float8CurrentScaling``, Megatron-LM's
``--fp8-recipe tensorwise``, NeMo's FP8 recipes of 2025): each cast's scale is the amax of the tensor it casts, so
``Float8CurrentScalingQuantizer::quantize_impl`` (transformer_engine/pytorch/csrc/quantizer.cpp) runs an amax kernel
over the 16-bit tensor before the cast (2 + 2 read, 1 + 1 written per element), except where the kernel that made the
tensor took its amax as it wrote it (``create_hp_tensor_with_amax``): LayerNormLinear's norm (under ``--stack fused``, a
linear whose input's producer is a norm: Megatron-Core's linear_qkv and linear_fc1) and TE's activations (not
Megatron-Core's SwiGLU, which feeds linear_fc2 in 16 bits). Its weights are kept in FP8
a step, as delayed scaling's. Not modelled: the amax all-reduce over the tensor-parallel group of a sequence-parallel
input (one float).

Not modelled: delayed scaling's amax history; torchao's ``rowwise_with_gw_hp``.
"""

from __future__ import annotations

from dataclasses import replace

from ..cost.devices import DeviceProfile
from ..cost.gpu import memory_ns
from ..cost.optime import gpu_op_ns
from .fp8_recipes import ROWWISE, TE_RECIPES, check_recipe
from .layers import within_any
from .siblings import input_producer, linear_in_layer, makers_of_input_size
from .stacks import STACKS
from .table import NodeRow, OpCost, Workload

CAST_BYTES_PER_ELEMENT = 2 + 1 + 1  # read a 16-bit value, write its FP8 cast and the cast's transpose
# Bytes per element of one operand's cast, by recipe: Transformer Engine's cast_transpose takes the amax in the
# same pass; torchao's dynamic scaling reads the tensor once more for its amax first.
RECIPE_CAST_BYTES = {"te": CAST_BYTES_PER_ELEMENT, "torchao": 2 + CAST_BYTES_PER_ELEMENT,
                     "te-current": 2 + CAST_BYTES_PER_ELEMENT}
# torchao's row-wise recipe, bytes per element (module docstring): a cast scaled along the tensor's rows (its
# contiguous dim), amax and cast in one pass; one scaled down its columns, two passes and a transposed write;
# the 16-bit output of a backward GEMM scaled after cuBLAS's tensor-wise kernel
ROW_CAST_BYTES = 2 + 1
COLUMN_CAST_BYTES = 2 + 2 + 1
RESCALE_BYTES = 2 + 2


def with_fp8(workload: Workload, device: DeviceProfile, stack: str | None, recipe: str = "te", sp_tp: int = 1,
             row_parallel: tuple[str, ...] = ()) -> Workload:
    """The table with its decoder layers' linear GEMMs in FP8 (and their casts); the rest as it was. ``sp_tp``:
    the tensor-parallel ranks under sequence parallelism, whose all-gathers move FP8 (Workload.fp8_tp_gathers):
    the tensors they gather, a column-parallel linear's input and a row-parallel one's output gradient
    (``row_parallel``: those modules), are cast on the rank's 1/tp share before the gather, not whole."""
    rowwise = check_recipe(recipe) == ROWWISE
    per_element = RECIPE_CAST_BYTES.get(recipe, 0)
    te = recipe in TE_RECIPES
    weights_each_forward = not te  # torchao keeps no FP8 copy: the weight cast in every forward
    model = device.gpu_model()
    cast_factor = model.generated_kernel_slowdown if not te and STACKS[workload.stack].generates_kernels \
        else 1.0  # torchao's casts under torch.compile are inductor's kernels (module docstring)
    retimed: dict[int, OpCost] = {}
    # sibling linears cast their shared input once (module docstring): where the stack builds them as one linear
    # (Megatron-Core's, siblings.py); with torchao under a compiler's CSE, or torchao's PrepareFloat8ModuleInput
    # before a sequence-parallel gather (tensor-wise: row-wise gathers stay 16-bit)
    stack_of = STACKS[workload.stack]
    one_input_cast = stack_of.merges_sibling_linears or (
        not te and (stack_of.generates_kernels or (sp_tp > 1 and not rowwise)))
    cast_inputs: set[int] = set()  # the rows whose output some linear's input cast has read already

    def fp8(op: OpCost, cast_bytes: int) -> OpCost:
        if op.gemm_mkn is None or op.sdpa_backend:
            return op
        if id(op) not in retimed:
            cast_ns = memory_ns(cast_bytes, device.gpu_facts(), model, casts=True) * cast_factor if cast_bytes else 0.0
            retimed[id(op)] = replace(op, gemm_dtype="fp8", bytes=op.bytes + cast_bytes,
                                      estimated_ns=gpu_op_ns(op, device, "fp8") + cast_ns)
        return retimed[id(op)]

    rows, weights, halved, modules = [], 0, set(), set()
    previous = None  # (input elements, rows so far) of the last linear while only views follow it
    for row in workload.rows:
        if not (isinstance(row, NodeRow) and linear_in_layer(row, stack)):
            rows.append(row)
            if isinstance(row, NodeRow) and row.forward.kind != "view":
                previous = None
            continue
        m, k, n = row.forward.gemm_mkn
        batch = row.forward.gemm_batch
        elements = m * k * batch
        sibling = previous is not None and previous[0] == elements  # q after k after v: only views between
        if not sibling and not rowwise:
            _save_input_in_fp8(rows, row, elements, stack, halved)  # row-wise backward recasts the 16-bit input
        producer = input_producer(rows, row, elements, stack) if one_input_cast else None
        input_cast_shared = one_input_cast and (sibling or producer in cast_inputs)
        if producer is not None:
            cast_inputs.add(producer)
        previous = (elements, len(rows))
        input_share = 0 if input_cast_shared else 1  # of this linear's own cast of its input
        if rowwise:  # six casts from 16 bits and two rescaled outputs (module docstring); gathers stay 16-bit
            casts = ((m * k * input_share + k * n) * ROW_CAST_BYTES * batch,
                     (m * n * ROW_CAST_BYTES + k * n * COLUMN_CAST_BYTES + m * k * RESCALE_BYTES) * batch,
                     ((m * n + m * k * input_share) * COLUMN_CAST_BYTES + k * n * RESCALE_BYTES) * batch)
        else:
            weight_elements = k * n * batch if weights_each_forward else 0
            row_wise = within_any(row.module, row_parallel)
            input_cast = m * k // (1 if row_wise else sp_tp) * input_share  # a gathered input: the rank's shard
            gradient_cast = m * n // (sp_tp if row_wise else 1)  # likewise a gathered output gradient
            # current scaling: LayerNormLinear's norm took its output's amax as it wrote it (module docstring)
            amax_in_norm = recipe == "te-current" and stack_of.merges_sibling_linears and _is_norm(rows, producer)
            input_per_element = CAST_BYTES_PER_ELEMENT if amax_in_norm else per_element
            casts = (input_cast * input_per_element + weight_elements * per_element, gradient_cast * per_element, 0)
        rows.append(row.with_ops(fp8(row.forward, casts[0]),
                                 [fp8(op, casts[1] if op.gemm_mkn else 0) for op in row.input_grad],
                                 [fp8(op, casts[2] if op.gemm_mkn else 0) for op in row.weight_grad]))
        weights += k * n * row.forward.gemm_batch
        modules.add(row.module)
    removed = workload.saved_bytes - sum(r.saved_bytes for r in rows if isinstance(r, NodeRow))
    return replace(workload, rows=rows, fp8_weight_elements=weights, fp8_modules=frozenset(modules),
                   fp8_weights_kept=not weights_each_forward, fp8_gathers_cast=not rowwise,
                   step_peak_bytes=max(workload.step_peak_bytes - removed, 0),
                   activation_peak_bytes=max(workload.activation_peak_bytes - removed, 0))


def _save_input_in_fp8(rows: list, linear: NodeRow, elements: int, stack: str | None, halved: set) -> None:
    """The row that saved the linear's 16-bit input now saves it in FP8: one byte per element less."""
    for i in makers_of_input_size(rows, linear, elements, stack):
        if i in halved:  # another reader of the same input (up after gate): already one byte
            return
        row = rows[i]
        if row.saved_bytes >= 2 * elements:
            halved.add(i)
            rows[i] = row.with_ops(row.forward, row.input_grad, row.weight_grad, saved_bytes=row.saved_bytes - elements)
            return


def _is_norm(rows: list, index: int | None) -> bool:
    """Whether the row at ``index`` is a norm: a norm op, or the last op of a norm module decomposed (HF's RMSNorm,
    ``input_layernorm``, ``ln_1``)."""
    if index is None:
        return False
    row = rows[index]
    name = row.module.rsplit(".", 1)[-1].lower()
    return row.forward.kind == "norm" or "norm" in name or name.startswith("ln")
