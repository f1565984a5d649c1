"""The communication of one rank in a Megatron-LM style layout: which collectives, of what size, where.

Tensor parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism):
without SP a block's row-parallel output is all-reduced in forward and its column-parallel
input gradient in backward; with SP each becomes an all-gather / reduce-scatter pair. The
embedding is vocabulary-parallel (its output is all-reduced, or reduce-scattered with SP) and so
is the cross entropy (three all-reduces of one fp32 value per token: max logit, sum of
exponentials, target logit). Every activation collective moves micro-batch·seq·hidden values.
Expert parallelism: each MoE layer dispatches and combines its routed tokens with all-to-alls in
forward, and again in backward. Data parallelism (PyTorch DDP, ZeRO): gradients are reduced in
buckets assigned as DDP assigns them; ZeRO 1/2 reduce-scatter them and all-gather the
updated parameters; ZeRO 3 also all-gathers the parameters before forward and backward use.
Expert parameters are reduced over the expert-data-parallel group (dp / ep ranks).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import replace
from itertools import accumulate
from operator import attrgetter

from ..capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from ..memo import Memo
from ..workload.stacks import STACKS, Stack
from .layout import POST_FORWARD, Parallel
from .recompute import is_recomputed
from .units import DGRAD, EMBEDDING, HEAD, LAYER, PRODUCER, READERS, WGRAD, Comm, Unit, is_expert, linears

ALLREDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL = "ALLREDUCE", "ALLGATHER", "REDUCESCATTER", "ALLTOALL"
LOSS_BYTES_PER_TOKEN = 4  # Megatron's vocab-parallel cross entropy reduces fp32 values
FIRST_BUCKET_BYTES = 1 << 20  # PyTorch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


def expected_destinations(experts: int, top_k: int, groups: int) -> float:
    """How many of ``groups`` equal groups of ``experts`` a token's ``top_k`` distinct experts fall in, expected
    over routings that pick every set of top_k experts alike: groups x (1 - C(E - E/g, k) / C(E, k))."""
    if groups <= 1:
        return 1.0
    missed = math.comb(experts - experts // groups, top_k) / math.comb(experts, top_k)
    return groups * (1 - missed)


def _ep_comms(p: Parallel, token_bytes: int, experts: int, top_k: int) -> list[list[Comm]]:
    """An MoE layer's dispatch and combine, forward and backward (the backward of a dispatch is a combine and
    the other way round): with all-to-alls one copy per (token, expert); with DeepEP one per (token, rank)
    holding any of its experts (deep_ep's is_token_in_rank), its node-level sends counted on the network."""
    if p.ep_comm == "deepep" and experts:
        copies = expected_destinations(experts, top_k, p.ep)
        routing = (token_bytes, experts, top_k)
    else:
        copies, routing = top_k, None
    return [[Comm(ALLTOALL, "ep", round(token_bytes * copies), f"token {what} ({phase})", deepep=routing,
                  follows_gemm=what == "combine" and phase == "forward") for what in ("dispatch", "combine")]
            for phase in ("forward", "backward")]


def stage_units(units: list[Unit], stage_layers: range, first: bool, last: bool) -> list[Unit]:
    """The units one pipeline stage runs: its layers, the embedding on the first, the head on the last."""
    return [u for u in units if (u.layer in stage_layers) or (u.block == EMBEDDING and first)
            or (u.block == HEAD and last)]


def add_model_parallel(units: list[Unit], p: Parallel, micro_batch: int, seq: int, hidden: int,
                       act_itemsize: int, top_k: int, rank_kv_bytes: int = 0,
                       recomputed: frozenset[int] = frozenset(), stack: Stack = STACKS["eager"],
                       fp8_gathers: bool = False, experts: int = 0, fp8_linears: bool = False) -> None:
    """Attach the tensor-, context- and expert-parallel collectives to each unit, in the order they run.
    ``seq``: the rank's tokens (seq / cp); ``rank_kv_bytes``: one layer's keys and values on this rank;
    ``recomputed``: the layers whose whole forward runs again before their backward (full recomputation:
    Megatron-Core's CheckpointFunction and torch.utils.checkpoint re-run the block's collectives with it),
    whose backward starts with their forward's collectives again; ``stack``: how --tp-comm-overlap overlaps a
    block's (workload/stacks.py, ``tp_overlap``) and where sequence parallelism shards (``sequence_dim``);
    ``fp8_gathers``: a decoder block's sequence-parallel all-gathers move FP8, one byte an element
    (Workload.fp8_tp_gathers), not ``act_itemsize``; ``experts``: the MoE layers' routed experts (how DeepEP's
    sends are counted, ``p.ep_comm``); ``fp8_linears``: the decoder layers' linears run FP8 GEMMs.
    Units of one kind share the same (frozen) Comm objects."""
    act = micro_batch * seq * hidden * act_itemsize
    fp8_gathered = micro_batch * seq * hidden if fp8_gathers else 0
    tokens = micro_batch * seq // (p.tp if p.sp else 1)
    cp_forward, cp_backward = cp_comms(p, rank_kv_bytes)
    tp_comms = _tp_comms(p, act, micro_batch * seq * LOSS_BYTES_PER_TOKEN, fp8_gathered) if p.tp > 1 else {}
    dim1_batches = p.sp and stack.sequence_dim == 1 and micro_batch > 1  # torch moves [b, s, h]'s dim 1 to dim 0
    if p.tp_comm_overlap:  # the decoder blocks' linear layers overlap their collectives with their GEMMs
        tp_comms[None] = _overlapped_tp(*tp_comms[None], stack.tp_overlap, p.tp, flatten_copies=dim1_batches,
                                        wgrad_copies=stack.sequence_dim == 1 and not fp8_linears)
    if tp_comms and p.sp and stack.sequence_dim == 1:  # torch's blocking collectives on HF's [batch, seq, hidden]
        tp_comms[None] = _sequence_dim_copies(*tp_comms[None], micro_batch, stack.generates_kernels)
    asynctp_inputs = p.tp_comm_overlap and stack.tp_overlap != "userbuffers" and dim1_batches
    scatter_inputs: dict[tuple, list[Comm]] = {}  # AsyncTP's fused reduce-scatters with their GEMM input's copy
    ep_comms = _ep_comms(p, tokens * hidden * act_itemsize, experts, top_k) if p.ep > 1 else None
    again: dict[tuple[Comm, ...], list[Comm]] = {}
    for unit in units:
        fwd, bwd = unit.comms[FORWARD], unit.comms[INPUT_GRAD]
        if cp_forward and unit.core_ns and unit.core_ns[FORWARD]:  # before the block's own collectives: mid-block
            fwd.extend(cp_forward)
            bwd.extend(cp_backward)
        if tp_comms:
            forward, backward = tp_comms[unit.block if unit.block in (EMBEDDING, HEAD) else None]
            if asynctp_inputs and unit.block not in (EMBEDDING, HEAD):
                forward = _with_producer_input_copy(forward, unit, act_itemsize if not fp8_linears else 1,
                                                    scatter_inputs)
            fwd.extend(forward)
            bwd.extend(backward)
        if ep_comms and unit.moe:
            fwd.extend(ep_comms[0])
            bwd.extend(ep_comms[1])
        if unit.layer in recomputed and fwd:  # the same forward collectives, so the same Comms again
            key = tuple(fwd if _last_gemm_recomputed(unit) else [c for c in fwd if not c.follows_gemm])
            bwd[:0] = again.setdefault(key, [replace(c, what=f"{c.what}, recomputed forward") for c in key])


def _last_gemm_recomputed(unit: Unit) -> bool:
    """Whether the unit's last GEMM runs again in its backward (recompute.py: not under torch.compile's
    partitioner when only the residual add reads its output). A whole-layer unit's one pair of collectives
    stands for its attention's too, whose GEMM does run again: kept."""
    gemm = next((row for row in reversed(unit.rows) if row.forward.kind == "matmul"), None)
    return gemm is None or unit.block == LAYER or is_recomputed(gemm)


def _overlapped_tp(forward: list[Comm], backward: list[Comm], how: str, tp: int, flatten_copies: bool = False,
                   wgrad_copies: bool = False) -> tuple[list[Comm], list[Comm]]:
    """A decoder block's (forward, backward) sequence-parallel collectives as --tp-comm-overlap runs them, each
    pipelined with the GEMMs it feeds or follows (Comm.beside), never with the block's other GEMMs: a chunk's
    GEMM can start only once its chunk has arrived, and the next collective waits on GEMMs still to come.
    Forward, both stacks: the block input's gather beside the GEMMs reading it (q/k/v or gate/up), the output's
    reduce-scatter beside the one making its input (o or down). Transformer Engine's userbuffers, backward: the
    output gradient's gather beside the o/down input-gradient GEMM, the input gradient's reduce-scatter beside
    the q/k/v (gate/up) weight-gradient GEMMs (its bulk wgrad overlap, on in Megatron-Core's default
    tp_comm_bulk_wgrad). torch's AsyncTP (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses an all-gather
    with the matmuls reading its output and a reduce-scatter with the one matmul producing its input; in
    backward only the output gradient's gather matches (the weight gradient reads it transposed, which the pass
    does not match), while the input gradient's reduce-scatter reads the sum of the q/k/v (gate/up)
    input-gradient matmuls, no single matmul, and stays a blocking NCCL call. A fused reduce-scatter's partial
    products are copied to their owners unreduced and summed by a kernel of its own on the compute stream
    (_fused_matmul_reduce_scatter_impl: the tp partials, the whole buffer, read; 1/tp of it written), where
    NCCL reduces inside its kernel; a fused all-gather first copies the rank's shard into its symmetric-memory
    buffer on the compute stream, before the first chunk's matmul (_pipelined_multi_all_gather_and_consume's
    "mv", not overlapped: "giving up the chance to overlap mv and b with the first shard_consumer"). The tp
    chunk matmuls run on two streams in turn, so one's last wave overlaps the next ("greatly reducing
    quantization inefficiency"): costed as the one GEMM they make up. On the sequence dim of [batch, seq, hidden]
    (torch's sequence parallelism) with more than one sequence (``flatten_copies``), the fused ops move that dim
    to the front and flatten it with the batch (``movedim(gather_dim, 0).flatten(0, -2)``), which copies: a
    gather's shard once more, a reduce-scatter's GEMM input (_with_producer_input_copy). The gathered tensor comes
    back as a view with the batch and sequence dims interleaved (``unflatten``): a 16-bit weight-gradient GEMM
    that reads it as [tokens, features] makes a contiguous copy first (``wgrad_copies``; torchao's FP8 casts read
    the view as it is) -- the block input's and the output gradient's, carried with the backward's gather. A
    fused reduce-scatter's sum writes its output contiguous: no copy. Transformer Engine's userbuffers gather into
    and scatter from buffers of their own: no copy either."""
    asynctp = how != "userbuffers"
    fused = [replace(c, overlapped=True, beside=READERS if c.type == ALLGATHER else PRODUCER,
                     copy_bytes=_asynctp_copy_bytes(c, tp, flatten_copies) if asynctp else 0)
             for c in forward]
    gather, scatter = backward
    if not asynctp:
        return fused, [replace(gather, overlapped=True, beside=DGRAD), replace(scatter, overlapped=True, beside=WGRAD)]
    wgrad = 2 * (gather.bytes + next(c.bytes for c in forward if c.type == ALLGATHER)) if wgrad_copies else 0
    return fused, [replace(gather, overlapped=True, beside=DGRAD,
                           copy_bytes=_asynctp_copy_bytes(gather, tp, flatten_copies) + wgrad), scatter]


def _with_producer_input_copy(forward: list[Comm], unit: Unit, itemsize: int, made: dict) -> list[Comm]:
    """A block's forward collectives with AsyncTP's copy of its row-parallel GEMM's input (read and written) on the
    fused reduce-scatter: ``_fused_matmul_reduce_scatter_impl`` moves the scatter dim to the front and flattens
    it with the batch, a copy for more than one sequence. Shared by the blocks whose GEMM inputs are alike."""
    layers = linears(unit.rows)
    if not layers:
        return forward
    m, k, _ = layers[-1].forward.gemm_mkn
    input_bytes = m * k * itemsize
    return made.setdefault((id(forward[0]), input_bytes), [
        replace(c, copy_bytes=c.copy_bytes + 2 * input_bytes) if c.type == REDUCESCATTER else c for c in forward])


def _sequence_dim_copies(forward: list[Comm], backward: list[Comm], micro_batch: int, compiled: bool
                         ) -> tuple[list[Comm], list[Comm]]:
    """A decoder block's sequence-parallel collectives with the copies torch makes around them when the sequence
    is dim 1 ([batch, seq, hidden], HF's layout, DTensor's Shard(1): torchtitan's plan), copy_bytes read and
    written. NCCL gathers and scatters along dim 0: an all-gather's result is re-concatenated along dim 1
    (torch._utils._maybe_view_chunk_cat: a view only when every dim before it is 1, so a copy for a micro-batch
    of two sequences or more), and a reduce-scatter's input is split along dim 1 and concatenated along dim 0
    first (torch._utils._chunk_or_narrow_cat, always a copy). Under a compiler the input gradient's
    reduce-scatter input is the sum of the q/k/v (gate/up) input gradients, which inductor writes straight into
    the concatenation (a pointwise kernel writing each slice); behind an extern GEMM (the row-parallel output) or
    a collective (a gather) the copy is a kernel of its own. Megatron's [seq, batch, hidden] shards dim 0: none.
    Only blocking collectives: overlapped ones are AsyncTP's fused ops or userbuffers', which copy as they do
    (_overlapped_tp)."""
    def copied(comm: Comm, needed: bool) -> Comm:
        return replace(comm, copy_bytes=2 * comm.bytes) if needed and not comm.overlapped else comm

    gathers = micro_batch > 1
    (gather, scatter), (gradient_gather, input_gradient_scatter) = forward, backward
    return ([copied(gather, gathers), copied(scatter, True)],
            [copied(gradient_gather, gathers), copied(input_gradient_scatter, not compiled)])


def _asynctp_copy_bytes(comm: Comm, tp: int, flatten_copies: bool = False) -> int:
    """What AsyncTP's own kernels on the compute stream move for a fused collective: a reduce-scatter's sum of
    the partial products (all tp read, one written), an all-gather's copy of the shard (read and written), twice
    where the shard is flattened with the batch first (_overlapped_tp)."""
    if comm.type == REDUCESCATTER:
        return comm.bytes + comm.bytes // tp
    return 2 * (comm.bytes // tp) * (2 if flatten_copies else 1)


def _tp_comms(p: Parallel, act: int, loss: int, fp8_gathered: int = 0
              ) -> dict[str | None, tuple[list[Comm], list[Comm]]]:
    """(forward, backward) tensor-parallel collectives of the embedding, the head and a decoder block (None);
    ``fp8_gathered``: the bytes a decoder block's all-gathers move where they move FP8 (0: ``act``, 16-bit)."""
    gathered = fp8_gathered or act
    fp8 = " in FP8" if fp8_gathered else ""
    if p.sp:
        block = ([Comm(ALLGATHER, "tp", gathered, f"block input (sequence-parallel){fp8}"),
                  Comm(REDUCESCATTER, "tp", act, "row-parallel output", follows_gemm=True)],
                 [Comm(ALLGATHER, "tp", gathered, f"row-parallel output gradient{fp8}"),
                  Comm(REDUCESCATTER, "tp", act, "column-parallel input gradient")])
    else:
        block = ([Comm(ALLREDUCE, "tp", act, "row-parallel output", follows_gemm=True)],
                 [Comm(ALLREDUCE, "tp", act, "column-parallel input gradient")])
    embedding = ([Comm(REDUCESCATTER if p.sp else ALLREDUCE, "tp", act, "vocab-parallel embedding output")],
                 [Comm(ALLGATHER, "tp", act, "embedding output gradient")] if p.sp else [])
    head = ([Comm(ALLGATHER, "tp", act, "head input (sequence-parallel)")] if p.sp else []) + [
        Comm(ALLREDUCE, "tp", loss, f"vocab-parallel cross entropy: {what}")
        for what in ("max logit", "target logit", "sum of exponentials")]
    return {EMBEDDING: embedding, HEAD: (head, [Comm(REDUCESCATTER if p.sp else ALLREDUCE, "tp", act,
                                                      "head input gradient")]), None: block}


def cp_comms(p: Parallel, rank_kv_bytes: int) -> tuple[list[Comm], list[Comm]]:
    """(forward, backward) context-parallel collectives of one attention block (context_parallel.py): the
    whole gathered keys and values, cp x one rank's, as NCCL counts an all-gather; Megatron-Core's ring
    overlaps the attention core, Llama 3's all-gather does not."""
    if p.cp == 1:
        return [], []
    gathered = rank_kv_bytes * p.cp
    overlapped = p.cp_comm == "p2p"
    how = "ring, overlapped with attention" if overlapped else "all-gather"
    forward = [Comm(ALLGATHER, "cp", gathered, f"keys and values ({how})", overlapped=overlapped)]
    backward = [Comm(ALLGATHER, "cp", gathered, f"keys and values again ({how})", overlapped=overlapped),
                Comm(REDUCESCATTER, "cp", gathered, f"key and value gradients ({how})", overlapped=overlapped)]
    return forward, backward


# A layout search builds the same buckets for every layout of a stage that shares dp, ep, ZeRO and
# the bucket size (thousands of rows for a large model with TP 1); the rows are read-only once made.
_DP_ROWS = Memo(1024)


def zero_rows(zero: int) -> int:
    """The ZeRO stages whose data-parallel rows are the same: 1 and 2 (a reduce-scatter per bucket, the
    updated parameters' all-gather) differ only in what a rank keeps."""
    return 1 if zero == 2 else zero


def parameter_bytes(grads, itemsize: int, fp8_modules: frozenset = frozenset()) -> int:
    """Bytes of these parameters as ZeRO's all-gather moves them: one per element for the FP8 linear
    layers' weights gathered in FP8 (``fp8_modules``, --fp8-param-gather), ``itemsize`` for the rest."""
    return sum(g.elements * (1 if g.module in fp8_modules else itemsize) for g in grads)


def fsdp_units(units: list[Unit]) -> list[list[Unit]]:
    """ZeRO 3's units of sharding, in forward order: a decoder layer's units together (FSDP's transformer wrap
    policy, DeepSpeed's per-module fetch), the embedding and the head each one."""
    layers: dict = {}
    for u in units:
        layers.setdefault(u.layer if u.layer is not None else u.name, []).append(u)
    return list(layers.values())


def fsdp_comms(members: list[Unit], p: Parallel, param_itemsize: int, grad_itemsize: int,
               fp8_modules: frozenset = frozenset()) -> tuple[list[Comm], list[Comm]]:
    """One FSDP unit's (parameter all-gathers, gradient reduce-scatters), one of each per group its parameters
    are sharded over: the data-parallel group, and the expert-data-parallel one for expert weights."""
    shards: dict[str, list] = {"dp": [], "dp_ep": []}
    for g in (g for u in members for g in u.grads):
        shards["dp_ep" if is_expert(g.module) and p.ep > 1 else "dp"].append(g)
    sizes = {"dp": p.replicas, "dp_ep": p.dp // p.ep}
    kept = {group: grads for group, grads in shards.items() if grads and sizes[group] > 1}
    gathers = []
    for group, grads in kept.items():  # FSDP2's copy-out reads the gathered buffer and writes the parameters
        gathered = parameter_bytes(grads, param_itemsize, fp8_modules)
        gathers.append(Comm(ALLGATHER, group, gathered, "parameters", copy_bytes=2 * gathered))
    # its copy-in reads the gradients in the parameters' dtype and writes them in the reduce dtype
    scatters = [Comm(REDUCESCATTER, group, elements * grad_itemsize, "gradients",
                     copy_bytes=elements * (param_itemsize + grad_itemsize), copy_casts=param_itemsize != grad_itemsize)
                for group, elements in ((group, sum(g.elements for g in grads)) for group, grads in kept.items())]
    return gathers, scatters


# --accumulate-unsharded: what a ZeRO 3 micro-batch's backward does with its gradients (micro_batch_kind)
EVERY, FIRST, MIDDLE, LAST = "every", "first", "middle", "last"
NONE = "NONE"  # a kernel on the compute stream beside ZeRO 3's collectives, carrying its bytes: no collective


def micro_batch_kind(p: Parallel, micro_batch: int) -> str:
    """Which of the step's backwards micro-batch ``micro_batch`` (0-based) is to ZeRO 3's gradients: every one
    alike (each reduce-scatters its own), or under --accumulate-unsharded the first, a middle one or the last."""
    if not (p.accumulate_unsharded and p.micro_batches > 1):
        return EVERY
    return FIRST if micro_batch == 0 else LAST if micro_batch == p.micro_batches - 1 else MIDDLE


def micro_batch_kinds(p: Parallel) -> list[tuple[str, int]]:
    """(kind, how many of the step's micro-batches are of it), for the kinds that occur."""
    counts: dict[str, int] = {}
    for micro_batch in range(p.micro_batches):
        kind = micro_batch_kind(p, micro_batch)
        counts[kind] = counts.get(kind, 0) + 1
    return list(counts.items())


def micro_batch_scatters(scatters: list[Comm], kind: str) -> list[Comm]:
    """What an FSDP unit's gradient reduce-scatters become in a backward of ``kind`` (_micro_batch_scatter), in
    order: the one rule the step, the SimAI rows and the Chakra traces share."""
    return [kernel for scatter in scatters for kernel in _micro_batch_scatter(scatter, kind)]


def _micro_batch_scatter(scatter: Comm, kind: str) -> list[Comm]:
    """What one FSDP unit's gradient reduce-scatter (fsdp_comms: its buffer e·g bytes, its copy-in e·(p + g),
    e elements of the reduce dtype's g bytes read from the parameters' p) becomes in a backward of ``kind``,
    as FSDP2 runs a backward without gradient sync (torch/distributed/fsdp/_fully_shard: _fsdp_param_group.py
    post_backward without reduce_grads; _fsdp_param.py to_accumulated_grad_if_needed and
    accumulate_unsharded_grad_if_needed), each of its kernels a ``NONE`` Comm that only carries its bytes:
    - the first: the unsharded gradient cast to the reduce dtype and kept (``.to(reduce_dtype)``: e·(p + g));
      nothing where the two dtypes are one (the gradient stays in ``.grad``);
    - a middle one: the new gradient added to the kept one (``+=``: the kept read and written, the new read,
      e·(2g + p));
    - the last: that add, then the reduce-scatter of the sum, whose copy-in reads it in the reduce dtype (2·e·g)."""
    if kind == EVERY:
        return [scatter]
    added = replace(scatter, type=NONE, bytes=0, what="gradients accumulated unsharded",
                    copy_bytes=scatter.bytes + scatter.copy_bytes)
    if kind == FIRST:
        return [replace(added, what="gradients kept unsharded", copy_bytes=scatter.copy_bytes)] \
            if scatter.copy_casts else []
    if kind == MIDDLE:
        return [added]
    return [added, replace(scatter, copy_bytes=2 * scatter.bytes, copy_casts=False)]


def backward_gathers(gathers: list[Comm], p: Parallel) -> list[Comm]:
    """An FSDP unit's parameter gathers before its backward: over the data-parallel group, or with FSDP2's
    reshard_after_forward=N over the N ranks its parameters stayed sharded over (POST_FORWARD)."""
    if not p.post_forward_ranks:
        return gathers
    return [replace(c, group=POST_FORWARD) if c.group == "dp" else c for c in gathers]


def post_forward_copies(gathers: list[Comm], p: Parallel) -> list[Comm]:
    """With reshard_after_forward=N, the kernel that keeps the rank's 1/N of each gathered unit after its forward
    (_fsdp_param.py to_sharded_post_forward: the slice cloned out of the gathered buffer, read and written), on
    the compute stream; none otherwise."""
    ranks = p.post_forward_ranks
    return [replace(c, type=NONE, bytes=0, what="parameters resharded after forward", copy_bytes=2 * c.bytes // ranks,
                    copy_casts=False) for c in gathers if c.group == "dp"] if ranks else []


def data_parallel_units(units: list[Unit], p: Parallel, grad_itemsize: int, param_itemsize: int,
                        fp8_modules: frozenset = frozenset()) -> list[Unit]:
    """The stage's units with its data-parallel rows inserted: a gradient bucket's row sits just before
    the unit whose backward completes the bucket, so the simulator issues it there. ZeRO 3's rows are per
    FSDP unit (``_zero3_rows``)."""
    grads = [g for u in units for g in u.grads]
    # the rows name their group, not its size: layouts that differ only in dp share them
    gathered_fp8 = fp8_modules if p.fp8_param_gather else frozenset()
    key = (tuple(map(id, grads)), tuple(len(u.grads) for u in units), p.replicas > 1, p.dp // p.ep > 1, p.ep > 1,
           zero_rows(p.zero), p.bucket_mb, grad_itemsize, param_itemsize, gathered_fp8,
           p.zero == 3 and p.reshard_after_forward, p.post_forward_ranks)
    if p.zero == 3:
        return _DP_ROWS.get(key, tuple(grads), lambda: _zero3_rows(units, p, grad_itemsize, param_itemsize,
                                                                   gathered_fp8))
    top, before = _DP_ROWS.get(key, tuple(grads), lambda: _data_parallel_rows(units, p, grad_itemsize, param_itemsize,
                                                                             gathered_fp8))
    out = list(top)
    for i, unit in enumerate(units):
        out.extend(before.get(i, []))
        out.append(unit)
    return out


def _zero3_rows(units: list[Unit], p: Parallel, grad_itemsize: int, param_itemsize: int,
                fp8_modules: frozenset) -> list[Unit]:
    """ZeRO 3 / FSDP as the cluster step runs it (cluster/zero3.py), every micro-batch: around each FSDP unit,
    its gradients' reduce-scatter just before it (SimAI runs the rows backward in reverse, so the row comes
    right after the unit's backward), and after it the parameters' all-gather for backward (none with FSDP2's
    reshard_after_forward=False: the forward's gather is kept) and for forward."""
    out = []
    for members in fsdp_units(units):
        gathers, scatters = fsdp_comms(members, p, param_itemsize, grad_itemsize, fp8_modules)
        name = members[0].name if members[0].layer is None else f"layer{members[0].layer}"
        out += [_dp_row(f"{c.group}_reducescatter_{name}", c) for c in scatters]
        out += members
        phases = ("backward", "forward") if p.reshard_after_forward else ("forward",)
        out += [_dp_row(f"{c.group}_param_allgather_{name}_{phase}", replace(c, what=GATHERED_FOR + phase))
                for phase in phases for c in (backward_gathers(gathers, p) if phase == "backward" else gathers)]
    return out


GATHERED_FOR = "parameters for "  # a ZeRO 3 row's gather: "parameters for forward" or "... for backward"


def gathered_for(comm: Comm) -> str | None:
    """The pass ("forward" or "backward") a ZeRO 3 row's parameter gather serves; None for another collective."""
    return comm.what.removeprefix(GATHERED_FOR) if comm.what.startswith(GATHERED_FOR) else None


def _data_parallel_rows(units: list[Unit], p: Parallel, grad_itemsize: int, param_itemsize: int,
                        fp8_modules: frozenset) -> tuple[list[Unit], dict[int, list[Unit]]]:
    """The rows issued first (ZeRO's gathers) and, per unit index, the bucket rows issued before it."""
    expert_dp = p.dp // p.ep
    groups = [("dp", p.replicas, [g for u in units for g in u.grads if not is_expert(g.module)]),
              ("dp_ep", expert_dp, [g for u in units for g in u.grads if is_expert(g.module)])]
    owner = {id(g): i for i, u in enumerate(units) for g in u.grads}
    before: dict[int, list[Unit]] = {}
    top: list[Unit] = []
    for group, size, grads in groups:
        if size == 1 or not grads:
            continue
        reduce = ALLREDUCE if p.zero == 0 else REDUCESCATTER
        for k, bucket in enumerate(_buckets_once(grads, p.bucket_mb)):
            nbytes = sum(g.elements for g in bucket) * grad_itemsize
            row = _dp_row(f"{group}_{reduce.lower()}_bucket{k}", Comm(reduce, group, nbytes, "gradient bucket"))
            before.setdefault(min(owner[id(g)] for g in bucket), []).append(row)
        params = parameter_bytes(grads, param_itemsize, fp8_modules)
        if p.zero in (1, 2):
            top.append(_dp_row(f"{group}_param_allgather", Comm(ALLGATHER, group, params, "updated parameters")))
    return top, before


def volume_bytes(comm: Comm, ranks: int) -> float:
    """Bytes each rank sends in a ring implementation: 2(n-1)/n·S for all-reduce, (n-1)/n·S otherwise."""
    share = (ranks - 1) / ranks * comm.bytes
    return 2 * share if comm.type == ALLREDUCE else share


_BUCKETS = Memo(4096)


def _buckets_once(grads: list, bucket_mb: float) -> list[list]:
    """``_buckets``, once per list of gradient rows (every ZeRO stage of a layout search shares them)."""
    return _BUCKETS.get((tuple(map(id, grads)), bucket_mb), tuple(grads), lambda: _buckets(grads, bucket_mb))


def _buckets(grads: list, bucket_mb: float) -> list[list]:
    """DDP's assignment (torch.distributed._compute_bucket_assignment_by_size): parameter groups in
    definition order, a bucket closed once it reaches its cap, 1 MiB for the first (the groups defined
    first, whose gradients come last) and bucket_mb MiB after; returned in the order backward fills
    them, last-defined first. bucket_mb 0 = one bucket per group."""
    if bucket_mb == 0:
        return [[g] for g in reversed(grads)]
    filled = list(accumulate(map(attrgetter("bytes"), grads)))  # bytes up to and including each group
    buckets, start = [], 0
    while start < len(grads):
        cap = FIRST_BUCKET_BYTES if not buckets else int(bucket_mb * (1 << 20))
        closing = bisect_left(filled, (filled[start - 1] if start else 0) + cap, lo=start)  # the group reaching the cap
        end = min(closing + 1, len(grads))
        buckets.append(grads[start:end])
        start = end
    return list(reversed(buckets))


def _dp_row(name: str, comm: Comm) -> Unit:
    return Unit(name=name, block="dp", comms={FORWARD: [], INPUT_GRAD: [], WEIGHT_GRAD: [comm]})
