"""Parallel training settings (Megatron-LM's layout), their checks against a model, and the pipeline stages."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UserError
from ..limits import MAX_BUCKET_MB, MAX_MICRO_BATCHES, MAX_VOCAB_MULTIPLE, MAX_WORLD


CUDA_GRAPH_SCOPES = ("none", "layers", "step")  # --cuda-graphs: eager, per decoder layer, the whole step
# the group a ZeRO 3 unit's backward gather runs over where its parameters stayed sharded over N ranks of the
# data-parallel group between its forward and backward (FSDP2's reshard_after_forward=N: Parallel.post_forward_ranks)
POST_FORWARD = "dp_post_forward"


@dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel replicas
    tp: int = 1  # tensor-parallel ranks
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel ranks, carved out of dp as in Megatron-LM
    sp: bool = False  # sequence parallelism (needs tp > 1)
    micro_batches: int = 1  # per step and pipeline (gradient accumulation)
    zero: int = 0  # ZeRO stage 0-3
    bucket_mb: float = 25.0  # gradient bucket cap in MiB (PyTorch DDP's default); 0 = one per parameter group
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None = balanced
    stage: int = 0  # the pipeline stage whose rank the SimAI file describes
    vocab_multiple: int = 1  # pad the vocabulary to a multiple of this x tp (Megatron's --make-vocab-size-divisible-by)
    recompute: str = "none"  # activation recomputation: none, selective (attention core) or full (whole layers)
    recompute_layers: int | None = None  # recompute the first N layers of each stage; None = all
    vpp: int = 1  # virtual pipeline stages (model chunks) per device: Megatron's interleaved 1F1B schedule
    # ZeRO 3 / FSDP: free gathered parameters after forward and gather them again in backward (True); keep them
    # (False); or, as FSDP2's int, keep a shard of them over N ranks of the data-parallel group, so backward
    # gathers over those N only (post_forward_ranks)
    reshard_after_forward: bool | int = True
    # ZeRO 3 with gradient accumulation: every micro-batch but the last accumulates its gradients unsharded and
    # reduce-scatters nothing; the last reduce-scatters the sum (FSDP2's set_requires_gradient_sync(False) on all
    # but the last micro-batch: Accelerate's no_sync, torch.distributed.pipelining's schedules); False: each
    # micro-batch reduce-scatters its own (FSDP2's default)
    accumulate_unsharded: bool = False
    # the gradients' data-parallel reduction overlaps backward, bucket by bucket (PyTorch DDP, FSDP; Megatron-LM's
    # --overlap-grad-reduce); False: it starts when the last backward ends (Megatron-LM's default, and its only
    # way before 2023)
    overlap_grad_reduce: bool = True
    # ZeRO 1/2 (Megatron-LM's distributed optimizer): the updated parameters' all-gathers run bucket by bucket
    # under the next step's first forward, each bucket's waited for by the first module that needs it
    # (Megatron-LM's --overlap-param-gather); False: they run after the optimizer, before the next step
    overlap_param_gather: bool = False
    # tensor-parallel communication overlapped with the GEMMs beside it (Transformer Engine's userbuffers, on in
    # NeMo's recipes: Megatron-LM's --tp-comm-overlap; torch's AsyncTP does the same with symmetric memory)
    tp_comm_overlap: bool = False
    # context parallelism: the sequence split over cp ranks in 2·cp load-balanced chunks (rank r holds
    # chunks r and 2cp-1-r of the causal sequence); keys and values exchanged by a ring of point-to-point
    # steps overlapped with attention (Megatron-Core, "p2p") or one all-gather before it (Llama 3, "allgather")
    cp: int = 1
    cp_comm: str = "p2p"
    # how an MoE layer's tokens reach their experts and come back: NCCL all-to-alls of one copy per (token,
    # expert) (Megatron-Core's alltoall dispatcher, torchtitan's default: "alltoall"), or DeepEP's normal
    # kernels (Megatron-Core's flex dispatcher with --moe-enable-deepep, torchtitan's deepep backend:
    # "deepep"), one copy per (token, destination rank) and across nodes one per (token, node)
    ep_comm: str = "alltoall"
    # --fp8: ZeRO's parameter all-gathers move the FP8 linear weights in FP8, one byte each (Megatron-LM's
    # --fp8-param-gather, which also keeps those weights in FP8; torchao's FSDP2 float8 all-gather under ZeRO 3)
    fp8_param_gather: bool = False
    # the share of each rank's optimizer shard stepped on the host CPU, its Adam moments in host memory
    # (Megatron-Core's --optimizer-cpu-offload --optimizer-offload-fraction: HybridDeviceOptimizer)
    optimizer_offload: float = 0.0
    # the saved activations of the rank's first N decoder layers copied to host memory in forward and back
    # in backward (Megatron-Core's --cpu-offloading --cpu-offloading-num-layers N: cluster/activation_offload.py)
    activation_offload_layers: int = 0
    # CUDA graphs: none, each decoder layer's forward and backward captured apart (Megatron-Core's
    # --enable-cuda-graph, Transformer Engine's make_graphed_callables), or the whole step (workload/cuda_graphs.py)
    cuda_graphs: str = "none"  # one of CUDA_GRAPH_SCOPES

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters, over which gradients are reduced and ZeRO shards:
        data- and context-parallel ones (Megatron-Core's data-parallel group with CP)."""
        return self.dp * self.cp

    @property
    def post_forward_ranks(self) -> int | None:
        """FSDP2's reshard_after_forward=N: the ranks each unit's parameters stay sharded over from its forward to
        its backward, whose gather runs over them (N consecutive ranks of the data-parallel group:
        _fsdp_init._get_post_forward_mesh_info views the shard mesh as (-1, N)); None: the whole group or none."""
        value = self.reshard_after_forward
        return value if type(value) is int and value < self.replicas else None

    @property
    def expert_replicas(self) -> int:
        """The ranks holding the same expert parameters (Megatron-Core's expert-data-parallel group)."""
        return expert_replicas(self.replicas, self.ep)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["pp_layers"] = list(self.pp_layers) if self.pp_layers else None
        return out | {"world": self.world}


def _check_post_forward(p: Parallel) -> None:
    problem = post_forward_problem(p)
    if problem:
        raise UserError(problem)


def post_forward_problem(p: Parallel) -> str | None:
    """FSDP2's checks of an int reshard_after_forward (torch/distributed/fsdp/_fully_shard/_fsdp_init.py
    _get_post_forward_mesh_info; _fsdp_param.py to_sharded_post_forward), each as one line; None where it is
    accepted (or not an int). The check of --reshard-after-forward and the choices plan tries (plan.fsdp2_options)."""
    ranks = p.reshard_after_forward
    if type(ranks) is bool:
        return None
    if type(ranks) is not int or ranks < 2 or p.replicas % ranks:
        return (f"--reshard-after-forward {ranks!r} is the ranks each unit's parameters stay sharded over "
                f"between forward and backward: a divisor of the data-parallel group ({p.replicas} ranks) "
                "from 2 up (--keep-gathered keeps them whole)")
    if p.zero != 3:
        return "--reshard-after-forward reshards ZeRO 3's gathered parameters: it needs --zero 3"
    if p.tp > 1 or p.ep > 1:  # the parameters are DTensors on the tensor- or expert-parallel mesh
        return ("--reshard-after-forward N with --tp or --ep above 1: FSDP2 does not reshard DTensor "
                "parameters to a smaller mesh ('not supported for DTensor parameters yet'); use --tp 1 --ep 1")
    return None


RECOMPUTE_MODES = ("none", "selective", "op", "full")
CP_COMMS = ("p2p", "allgather")
EP_COMMS = ("alltoall", "deepep")


def check_values(parallel: Parallel) -> None:
    """The settings on their own (before any model is read): types, ranges and sizes."""
    p = parallel
    for name in ("dp", "tp", "pp", "ep", "cp", "micro_batches", "vocab_multiple", "vpp"):
        value = getattr(p, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if p.world > MAX_WORLD:
        raise UserError(f"--dp x --cp x --tp x --pp = {p.world:,} GPUs exceeds {MAX_WORLD:,}, more than any real run; "
                        "check the layout")
    if p.micro_batches > MAX_MICRO_BATCHES:
        raise UserError(f"--micro-batches {p.micro_batches:,} exceeds {MAX_MICRO_BATCHES:,}, more than any real run; "
                        "use fewer, larger micro-batches (--batch)")
    if p.vocab_multiple > MAX_VOCAB_MULTIPLE:
        raise UserError(f"--vocab-multiple {p.vocab_multiple:,} exceeds {MAX_VOCAB_MULTIPLE:,}; Megatron-LM uses 128")
    if p.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero must be 0, 1, 2 or 3, got {p.zero}")
    if not isinstance(p.bucket_mb, (int, float)) or not 0 <= p.bucket_mb <= MAX_BUCKET_MB:  # NaN fails too
        raise UserError(f"--bucket-mb must be 0 (one collective per parameter group) or a size up to "
                        f"{MAX_BUCKET_MB:,} MiB, got {p.bucket_mb}")
    if not p.reshard_after_forward and p.zero != 3:
        raise UserError("--keep-gathered keeps ZeRO 3's gathered parameters: it needs --zero 3")
    _check_post_forward(p)
    if p.accumulate_unsharded and p.zero != 3:
        raise UserError("--accumulate-unsharded holds ZeRO 3's gradients unsharded between micro-batches: it needs "
                        "--zero 3 (ZeRO 1/2 and plain data parallelism reduce once a step already)")
    if p.tp_comm_overlap and not (p.tp > 1 and p.sp):
        raise UserError("--tp-comm-overlap overlaps sequence parallelism's all-gathers and reduce-scatters with the "
                        "GEMMs beside them: it needs --tp 2 or more and --sp (Transformer Engine requires both)")
    if p.overlap_param_gather and p.zero not in (1, 2):
        raise UserError("--overlap-param-gather overlaps ZeRO 1/2's parameter all-gathers with the next forward: "
                        "it needs --zero 1 or 2 (ZeRO 3 gathers beside every pass already)")
    if not isinstance(p.optimizer_offload, (int, float)) or not 0 <= p.optimizer_offload <= 1:
        raise UserError(f"--optimizer-offload is the share of the optimizer stepped on the host, 0 to 1; got "
                        f"{p.optimizer_offload}")
    if p.optimizer_offload and p.zero == 0:
        raise UserError("--optimizer-offload offloads the distributed optimizer's shard (Megatron-Core's "
                        "--optimizer-cpu-offload needs --use-distributed-optimizer): it needs --zero 1, 2 or 3")
    if not isinstance(p.activation_offload_layers, int) or p.activation_offload_layers < 0:
        raise UserError(f"--activation-offload-layers is a count of decoder layers, 0 or more; got "
                        f"{p.activation_offload_layers!r}")
    if p.activation_offload_layers and p.pp > 1:  # megatron/core/transformer/transformer_config.py __post_init__
        raise UserError("--activation-offload-layers needs --pp 1: Megatron-Core has 'no support for Pipeline "
                        "parallelism with CPU offloading'")
    if p.activation_offload_layers and p.recompute != "none":
        raise UserError("--activation-offload-layers needs --recompute none: Megatron-Core's 'CPU offloading does not "
                        "work when activation recomputation is enabled'")
    if p.fp8_param_gather and p.zero == 0:
        raise UserError("--fp8-param-gather moves ZeRO's parameter all-gathers in FP8: it needs --zero 1, 2 or 3")
    if p.cuda_graphs not in CUDA_GRAPH_SCOPES:
        raise UserError(f"unknown --cuda-graphs {p.cuda_graphs!r}: use none, layers (each decoder layer captured "
                        "apart, Megatron-Core's) or step (the whole forward and backward as one graph)")
    if p.cp_comm not in CP_COMMS:
        raise UserError(f"unknown --cp-comm {p.cp_comm!r}: use p2p (Megatron-Core's ring) or allgather (Llama 3's)")
    if p.ep_comm not in EP_COMMS:
        raise UserError(f"unknown --ep-comm {p.ep_comm!r}: use alltoall (NCCL all-to-alls) or deepep (DeepEP's kernels)")
    if p.cp > 1 and p.ep > 1:
        raise UserError("--cp with --ep is not modelled (Megatron-Core folds context- into expert-data-parallel "
                        "groups); use one of them")
    if p.recompute not in RECOMPUTE_MODES:
        raise UserError(f"unknown --recompute {p.recompute!r}: use {', '.join(RECOMPUTE_MODES)}")
    if p.recompute_layers is not None and p.recompute == "none":
        raise UserError("--recompute-layers needs --recompute selective or full")
    if p.recompute_layers is not None and (not isinstance(p.recompute_layers, int) or p.recompute_layers < 1):
        raise UserError(f"--recompute-layers must be a positive integer, got {p.recompute_layers}")
    if p.pp_layers is not None and (len(p.pp_layers) != p.pp or min(p.pp_layers) < 1):
        raise UserError(f"--pp-layers {','.join(map(str, p.pp_layers))} must give {p.pp} counts (one per --pp "
                        "stage), each at least 1")


def check_sequence(parallel: Parallel, seq: int) -> None:
    """Context parallelism splits the sequence into 2·cp chunks; sequence parallelism a rank's share
    over the tensor-parallel group. ``seq`` is the whole sequence."""
    if parallel.cp > 1 and seq % (2 * parallel.cp):
        raise UserError(f"--cp {parallel.cp} splits the sequence into {2 * parallel.cp} load-balanced chunks: --seq "
                        f"{seq} does not divide by {2 * parallel.cp}; choose a --seq that is a multiple of it")
    if parallel.sp and (seq // parallel.cp) % parallel.tp:
        what = f"--seq {seq}" if parallel.cp == 1 else f"a rank's {seq // parallel.cp} tokens (--seq / --cp)"
        raise UserError(f"--sp splits the sequence over --tp {parallel.tp}: {what} does not divide by it; "
                        "choose a --seq that is a multiple of --tp" + (" x --cp" if parallel.cp > 1 else ""))


def check(parallel: Parallel, facts) -> None:
    """Reject, in one line, any setting this model cannot be split by."""
    p = parallel
    check_values(p)
    if p.sp and p.tp == 1:
        raise UserError("--sp splits the sequence over the tensor-parallel group: it needs --tp > 1")
    if not 0 <= p.stage < p.pp:
        raise UserError(f"--stage {p.stage} is not a pipeline stage: use 0..{p.pp - 1}")
    if p.dp % p.ep:
        raise UserError(f"--ep {p.ep} must divide --dp {p.dp}: expert-parallel ranks are drawn from the data-parallel ones")
    experts = facts.experts
    for count, what in ((facts.heads, "attention heads"), (facts.kv_heads, "key/value heads"), (facts.vocab, "vocabulary")):
        if count and count % p.tp:  # a count of 0: the model has none (no attention heads), nothing to split
            hint = " or pad it with --vocab-multiple 128 as Megatron-LM does" if what == "vocabulary" else ""
            raise UserError(f"--tp {p.tp} does not divide the model's {count} {what}; "
                            f"choose a --tp that divides it{hint}")
    if p.ep > 1 and not experts:
        raise UserError(f"--ep {p.ep} needs a mixture-of-experts model; {facts.model_type} has no experts")
    if experts and experts % p.ep:
        raise UserError(f"--ep {p.ep} does not divide the model's {experts} experts; choose an --ep that divides it")
    if p.vpp > 1:
        if p.pp == 1:
            raise UserError("--vpp interleaves model chunks over pipeline stages: it needs --pp > 1")
        if p.pp_layers is not None and min(p.pp_layers) < p.vpp:
            raise UserError(f"--vpp {p.vpp} model chunks per stage need at least {p.vpp} layers on every stage; "
                            f"--pp-layers gives one {min(p.pp_layers)}")
        if p.pp_layers is None and facts.layers % (p.pp * p.vpp):
            raise UserError(f"--pp {p.pp} x --vpp {p.vpp} does not divide the model's {facts.layers} layers; "
                            "choose a --vpp that does")
        if p.micro_batches % p.pp:
            raise UserError(f"the interleaved schedule runs micro-batches in groups of --pp {p.pp}: "
                            f"--micro-batches {p.micro_batches} must be a multiple of it")
    if p.activation_offload_layers >= facts.layers:
        raise UserError(f"--activation-offload-layers {p.activation_offload_layers} must be below the model's "
                        f"{facts.layers} layers (Megatron-Core offloads at most all but the last)")
    stage_layers(p, facts.layers)  # checks the counts
    fewest = min(len(chunk) for chunk in virtual_stage_layers(p, facts.layers))
    if p.recompute_layers is not None and p.recompute_layers > fewest:
        raise UserError(f"--recompute-layers {p.recompute_layers} exceeds the {fewest} layers of the smallest "
                        "pipeline stage (model chunk with --vpp); choose 1 to " + str(fewest))


def virtual_stage_layers(parallel: Parallel, layers: int) -> list[range]:
    """The layers of each virtual stage c·pp + d (chunk c of device d), consecutive in that order;
    with vpp 1, the stages. With --pp-layers a device's layers are split over its chunks as evenly as
    they go, the smaller chunks where the embedding (device 0's first) and the head (the last
    device's last) sit: the Llama 3 paper's stages one layer short at both ends, interleaved."""
    if parallel.vpp == 1:
        return stage_layers(parallel, layers)
    p = parallel
    if p.pp_layers is None:
        count = layers // (p.pp * p.vpp)
        return [range(i * count, (i + 1) * count) for i in range(p.pp * p.vpp)]
    stage_layers(p, layers)  # checks the counts
    sizes = [_chunk_sizes(count, p.vpp, fewer_first=device == 0) for device, count in enumerate(p.pp_layers)]
    ranges, start = [], 0
    for virtual in range(p.pp * p.vpp):
        size = sizes[virtual % p.pp][virtual // p.pp]
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _chunk_sizes(count: int, vpp: int, fewer_first: bool) -> list[int]:
    base, extra = divmod(count, vpp)
    larger = set(range(vpp - extra, vpp)) if fewer_first else set(range(extra))
    return [base + (chunk in larger) for chunk in range(vpp)]


def padded_vocab(parallel: Parallel, vocab: int) -> int:
    """Megatron-LM's padding: up to a multiple of vocab_multiple x tp (unchanged when vocab_multiple is 1)."""
    if parallel.vocab_multiple == 1:
        return vocab
    step = parallel.vocab_multiple * parallel.tp
    return -(-vocab // step) * step


def stage_layers(parallel: Parallel, layers: int) -> list[range]:
    """The decoder layers of each pipeline stage: --pp-layers, else layers / pp each."""
    p = parallel
    if p.pp_layers is not None:
        counts = list(p.pp_layers)
        if len(counts) != p.pp or sum(counts) != layers or min(counts) < 1:
            raise UserError(f"--pp-layers {','.join(map(str, counts))} must give {p.pp} counts, each at least 1, "
                            f"summing to the model's {layers} layers")
    elif layers % p.pp:
        raise UserError(f"--pp {p.pp} does not divide the model's {layers} layers; "
                        "choose a --pp that divides it or give --pp-layers")
    else:
        counts = [layers // p.pp] * p.pp
    starts = [sum(counts[:i]) for i in range(p.pp)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def expert_replicas(replicas: int, ep: int) -> int:
    """The data-parallel ranks over the expert-parallel ones: the group an expert parameter is reduced and
    sharded over."""
    return max(replicas // ep, 1)
