"""Command line: ``fxworkload extract | profile | compare | plan | calibrate | models | devices``.

Each command imports what it needs when it runs: parsing, ``--help``, ``models`` and ``devices``
never import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import warnings
from pathlib import Path

from .errors import (Refused, Terminated, UserError, clear_signalled, exit_status, install, restore, signalled, stop,
                     stop_message)
from .parallel.layout import CUDA_GRAPH_SCOPES

DEFAULT_DEVICE = "a100-80gb"
TOPOLOGY_HELP = ("the network, over the device profile's own: nvlink-domain, gpus-per-node, nics-per-node, nic-gbps, "
                 "nvlink-gbps, nvlink-sharp (on/off), leaf-gpus, oversubscription; e.g. nic-gbps=200,oversubscription=2,"
                 "leaf-gpus=256 (see docs/network.md)")
CUDA_GRAPHS_HELP = ("replay from CUDA graphs: layers (each decoder layer's forward and backward captured apart: "
                    "Megatron-Core's --enable-cuda-graph) or step (the whole forward and backward); the host issues one "
                    "launch per graph instead of each op (default none: eager)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage block
        raise UserError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxworkload", description="Turn a HuggingFace model into a per-node training workload.")
    parser.add_argument("--version", action="version", version=f"fxworkload {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    extract = commands.add_parser("extract", help="capture one training step and write the workload tables")
    _add_step_arguments(extract, "built-in name (see 'fxworkload models'), checkpoint folder, or config.json")
    extract.add_argument("--grad-dtype", default=None, help="gradient dtype for all-reduce sizes (default: --dtype)")
    extract.add_argument("--device", default=DEFAULT_DEVICE,
                         help=f"device profile (default {DEFAULT_DEVICE}; see 'fxworkload devices'); NAME@WATTSw caps "
                              "its board below its nominal power, e.g. h100-sxm@500w")
    extract.add_argument("--stack", default="eager", help=STACK_HELP)
    extract.add_argument("--topology", default=None, metavar="KEY=VALUE,...", help=TOPOLOGY_HELP)
    extract.add_argument("--fp8", action="store_true", help=FP8_HELP)
    extract.add_argument("--fp8-recipe", default="te", metavar="RECIPE", help=FP8_RECIPE_HELP)
    extract.add_argument("--sdpa-backends", type=_backends, default=None, metavar="LIST", help=SDPA_BACKENDS_HELP)
    extract.add_argument("--attention", default=None, metavar="IMPL", help=ATTENTION_HELP)
    extract.add_argument("--size-unit", choices=["bytes", "elements"], default="bytes",
                         help="unit of the gradient all-reduce sizes in workload.tsv (default bytes)")
    extract.add_argument("--trace-on", default="auto",
                         help="whose dispatch the trace follows: auto (default: --device's; a GPU profile records the "
                              "fused attention kernel that GPU chooses), cpu, or cuda (no GPU needed)")
    extract.add_argument("--no-cache", action="store_true",
                         help="capture again even if this step was captured before (and do not cache it)")
    extract.add_argument("--no-dropout", action="store_true",
                         help="every dropout of the model off, as a loop runs it in eval mode (from_pretrained leaves "
                              "the model so until model.train()); match a measured loop that never called model.train()")
    extract.add_argument("--every-layer", action="store_true",
                         help="trace every decoder layer instead of one layer standing for all identical ones (or one "
                              "repetition for the middle ones of a repeated run of layers)")
    extract.add_argument("--format", default="tables",
                         help="what to write, comma-separated: tables (workload.tsv, nodes.tsv, workload.json), "
                              "simai (workload.simai.txt), chrome-trace (workload.trace.json), chakra (workload.<rank>.et, "
                              "one Chakra execution trace per rank, and workload.comm_groups.json, ASTRA-sim's "
                              "--comm-group-configuration), html (report.html: the summary, a chart of where the step's "
                              "time goes, the costliest nodes; one page to open in a browser); default tables")
    _add_parallel_arguments(extract)
    extract.add_argument("--out", type=_out_dir, default=None,
                         help="output folder, replaced whole by this run (default outputs/<name>/)")
    extract.add_argument("--name", default=None,
                         help="the model's name in the outputs and the default folder (default: the built-in "
                              "name, checkpoint folder or HuggingFace model name)")
    extract.add_argument("--top", type=int, default=10, help="costliest nodes listed in the summary (default 10)")
    extract.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    extract.set_defaults(func=run_extract)

    profile = commands.add_parser("profile", help="run one training step op by op on this machine and time it")
    _add_step_arguments(profile, "built-in name, checkpoint folder (its weights are loaded), or config.json")
    profile.add_argument("--on", default="auto", help="where to run: cpu, cuda, or auto = cuda if there is one")
    profile.add_argument("--repeat", type=int, default=5, help="timed runs; each op's median is kept (default 5)")
    profile.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    profile.add_argument("--timer", default="auto",
                         help="auto (torch.profiler's kernel times on a GPU, a clock per op on the CPU), clock, or "
                              "profiler (each node's kernels and host dispatch from torch.profiler)")
    profile.add_argument("--out", type=_out_dir, default=None,
                         help="output folder, replaced whole by this run (default outputs/<model>-measured/)")
    profile.set_defaults(func=run_profile)

    compare = commands.add_parser("compare", help="compare estimated and measured op times")
    compare.add_argument("estimated", type=Path, help="workload.json, or the folder holding it")
    compare.add_argument("measured", type=Path,
                         help="measured.json (or its folder), a torch.profiler trace (.json, .json.gz) "
                              "or a Megatron timing log")
    compare.add_argument("--measured-format", default="auto",
                         help="auto (default: told from the file's content), measured, torch-profiler or megatron")
    compare.add_argument("--rank", type=int, default=None,
                         help="the rank of a Megatron log to compare (default the first it holds)")
    compare.add_argument("--top", type=int, default=15, help="ops listed, longest measured first (default 15; 0 = all)")
    compare.add_argument("--plot", type=Path, default=None, help="draw estimated vs measured per op into this PNG")
    compare.add_argument("--out", type=_out_dir, default=None,
                         help="folder for comparison.json and comparison.txt, replaced whole "
                              "(default outputs/<estimated folder>-vs-<measured name>/)")
    compare.set_defaults(func=run_compare)

    plan = commands.add_parser("plan", help="rank every parallel layout of a model on N GPUs by step time")
    plan.add_argument("model", help="built-in name, checkpoint folder, or config.json")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per step (all micro-batches, all replicas)")
    plan.add_argument("--seq", type=int, required=True, help="sequence length")
    plan.add_argument("--device", default="h100-sxm",
                      help="device profile, or several comma-separated to compare them (default h100-sxm)")
    plan.add_argument("--topology", default=None, metavar="KEY=VALUE,...", help=TOPOLOGY_HELP)
    plan.add_argument("--tp-comm-overlap", action="store_true",
                      help="layouts with tp > 1 overlap their blocks' TP collectives with the GEMMs (Transformer "
                           "Engine's userbuffers, on in NeMo's recipes; default: blocking)")
    plan.add_argument("--overlap-param-gather", action="store_true",
                      help="ZeRO 1/2 layouts overlap their parameter all-gathers with the next forward (Megatron-LM's "
                           "--overlap-param-gather, on in NeMo's recipes; default: after the optimizer)")
    plan.add_argument("--cuda-graphs", choices=CUDA_GRAPH_SCOPES, default="none", help=CUDA_GRAPHS_HELP)
    plan.add_argument("--plot", action="store_true",
                      help="also write plan.png: every layout that fits, step time against peak memory, the Pareto "
                           "front and the best with its 90 %% interval (needs matplotlib)")
    plan.add_argument("--offload", action="store_true",
                      help="also try every ZeRO layout with its optimizer stepped on the host CPU (Megatron-Core's "
                           "--optimizer-cpu-offload); says which layouts that makes fit and what it costs")
    plan.add_argument("--cp", default="1", help="context-parallel degrees to search, comma-separated (default 1)")
    plan.add_argument("--fp8", action="store_true", help=FP8_HELP)
    plan.add_argument("--fp8-recipe", default="te", metavar="RECIPE", help=FP8_RECIPE_HELP)
    plan.add_argument("--dtype", default="bf16", help="parameter and activation dtype: fp32, bf16 or fp16 (default bf16, "
                                                      "as large runs train; extract's default is fp32)")
    plan.add_argument("--stack", default="eager", help=STACK_HELP)
    plan.add_argument("--sdpa-backends", type=_backends, default=None, metavar="LIST", help=SDPA_BACKENDS_HELP)
    plan.add_argument("--attention", default=None, metavar="IMPL", help=ATTENTION_HELP)
    plan.add_argument("--ep-comm", default="alltoall", help=EP_COMM_HELP)
    plan.add_argument("--top", type=int, default=10, help="layouts listed (default 10; 0 = all that fit)")
    plan.add_argument("--workers", type=int, default=None,
                      help="local processes, at most one per core (default: one per core)")
    plan.add_argument("--ray", default=None, metavar="ADDRESS",
                      help="spread the sweep over this Ray cluster ('auto' = the one this machine is part of)")
    plan.add_argument("--out", type=_out_dir, default=None,
                      help="folder for plan.json and plan.txt, replaced whole (default outputs/<model>-plan-<gpus>/)")
    plan.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    plan.set_defaults(func=run_plan)

    calibrate = commands.add_parser("calibrate", help="measure this machine's device profile")
    calibrate.add_argument("--on", default="cpu", help="cpu or cuda (default cpu)")
    calibrate.add_argument("--force", action="store_true",
                           help="save a CPU profile even when its checks say the machine was busy or the timings "
                                "noisy (default: refuse, and say why)")
    calibrate.add_argument("--name", default=None,
                           help="profile name (default 'cpu'; required with --on cuda and --from, e.g. my-h100)")
    calibrate.add_argument("--from", dest="from_trace", type=Path, default=None,
                           help="fit the profile to this torch.profiler trace (.json, .json.gz) instead of "
                                "micro-benchmarks; needs --estimated")
    calibrate.add_argument("--like", default=None, metavar="PROFILE",
                           help="with --on cuda or --kernels: the datasheet profile of the GPU (its facts are kept, "
                                "its GPU model refitted; default on a GPU: the shipped profile matching its name)")
    calibrate.add_argument("--kernels", type=Path, default=None, metavar="DIR",
                           help="fit the GPU model to the kernel times in DIR (gemm.csv, sdpa.csv, vector.csv as "
                                "'calibrate --on cuda' writes them) instead of measuring; needs --like")
    calibrate.add_argument("--timing", choices=("back-to-back", "isolated"), default=None,
                           help="with --kernels: how DIR's rows were timed: back-to-back calls (default, as "
                                "'calibrate --on cuda' times them) or each call alone between two events (its "
                                "launch gap is then measured and kept out of the model)")
    calibrate.add_argument("--estimated", type=Path, default=None,
                           help="with --from: workload.json (or its folder) of the traced step, extracted with "
                                "its model, --batch, --seq and --dtype")
    calibrate.set_defaults(func=run_calibrate)

    models = commands.add_parser("models", help="list the built-in models")
    models.add_argument("--parameters", action="store_true",
                        help="also count each model's trainable parameters (builds it on the meta device: imports torch)")
    models.set_defaults(func=run_models)
    shown = commands.add_parser("devices", help="list the device profiles, or one profile's figures and sources")
    shown.add_argument("name", nargs="?", default=None,
                       help="a profile: print each figure, whether it is a datasheet fact, fitted or assumed, and its source")
    shown.set_defaults(func=run_devices)
    return parser


def _version() -> str:
    from . import __version__  # the package's __init__ imports no torch

    return __version__


def _out_dir(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("--out is empty; give a folder name, e.g. --out outputs/run1")
    return Path(text)


FP8_HELP = ("FP8 training as Transformer Engine runs it: the decoder layers' linear GEMMs (forward and both "
            "backward) at the GPU's FP8 peak, with their casts; attention, norms, embedding and head in --dtype")
ATTENTION_HELP = ("transformers' attention implementation the run sets: sdpa, eager, or flex (FlexAttention: its "
                  "kernel visits only the block mask's tiles and keeps no score matrix; GPT-OSS's sinks and sliding "
                  "windows; needs --no-dropout where the model has attention dropout); default: the model's own")
EP_COMM_HELP = ("how MoE tokens reach their experts: alltoall (NCCL all-to-alls, one copy per token and expert; "
                "default) or deepep (DeepEP's dispatch and combine kernels: one copy per token and rank, across "
                "nodes one per token and node)")
SDPA_BACKENDS_HELP = ("the attention kernels the run enables, comma-separated, as torch.nn.attention.sdpa_kernel "
                      "does: flash, efficient, math, cudnn (default: all, in --device's order: cuDNN first on "
                      "H100/H200/B200 as torch 2.10+ with cuDNN > 9.15 chooses; flash,efficient,math is the "
                      "default of torch 2.5.1-2.9; torchtitan's context parallelism runs flash,efficient)")
FP8_RECIPE_HELP = ("with --fp8: te (Transformer Engine's delayed scaling: amax in the cast's pass, FP8 "
                   "weights kept a step; default), te-current (its current scaling, Megatron-LM's "
                   "--fp8-recipe tensorwise: an amax pass before each cast but where LayerNormLinear's norm "
                   "took it), torchao (torchao's Float8Linear as torchtitan runs it: dynamic tensor-wise "
                   "scaling, an amax pass before each cast, weights cast in every forward) or "
                   "torchao-rowwise (its row-wise recipe: each GEMM's operands cast from 16 bits along its "
                   "reduction axis, the input kept in 16 bits, 16-bit gathers)")
STACK_HELP = ("execution stack whose kernels and saved activations are costed: eager (HF eager PyTorch, "
              "default), fused (Megatron-LM / Transformer Engine fused kernels; q, k, v one GEMM, gate and up one, as "
              "Megatron-Core's linear_qkv and linear_fc1), compiled (torch.compile of the "
              "whole model: AOTAutograd's partitioner, inductor's fusion), compiled-blocks (each decoder block "
              "compiled alone, the embedding, head and loss eager: torchtitan's)")


def _backends(text: str) -> tuple[str, ...]:
    """--sdpa-backends' list (its names are checked with the rest of the run's settings)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _add_step_arguments(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The arguments that define one training step: model, batch, sequence length, dtype."""
    parser.add_argument("model", help=model_help)
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence length (default min(1024, max_position_embeddings))")
    parser.add_argument("--dtype", default="fp32",
                        help="parameter and activation dtype: fp32, bf16, fp16 (default fp32)")


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel training (Megatron-LM layout; world = dp x cp x tp x pp)")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    group.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    group.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, a divisor of --dp (default 1)")
    group.add_argument("--sp", action="store_true", help="sequence parallelism over the tensor-parallel group")
    group.add_argument("--cp", type=int, default=1,
                       help="context-parallel ranks: the sequence split over them in load-balanced causal chunks "
                            "(default 1); --seq is the whole sequence")
    group.add_argument("--cp-comm", default="p2p",
                       help="how CP exchanges keys and values: p2p (Megatron-Core's ring, overlapped with attention; "
                            "default) or allgather (Llama 3's, before attention)")
    group.add_argument("--ep-comm", default="alltoall", help=EP_COMM_HELP)
    group.add_argument("--micro-batches", type=int, default=1,
                       help="micro-batches per step, each of --batch sequences (default 1)")
    group.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (default 0: plain all-reduce)")
    group.add_argument("--bucket-mb", type=float, default=25.0,
                       help="gradient bucket cap in MiB (default 25, as PyTorch DDP; 0 = one per parameter group)")
    group.add_argument("--pp-layers", default=None,
                       help="decoder layers per stage, comma-separated (default: balanced)")
    group.add_argument("--stage", type=int, default=0, help="pipeline stage whose rank the SimAI file and trace describe")
    group.add_argument("--vocab-multiple", type=int, default=1,
                       help="pad the vocabulary to a multiple of this x tp, as Megatron-LM's "
                            "--make-vocab-size-divisible-by (default 1: no padding)")
    group.add_argument("--recompute", default="none",
                       help="activation recomputation: none (default); Megatron-LM's selective (the attention "
                            "core runs again in backward) and full (each layer keeps only its input); op "
                            "(torchtitan's op-level checkpointing: GEMM and attention outputs kept, every second "
                            "GEMM and everything else run again)")
    group.add_argument("--recompute-layers", type=int, default=None,
                       help="recompute only the first N layers of each pipeline stage (default: all)")
    group.add_argument("--vpp", type=int, default=1,
                       help="virtual pipeline stages per device: Megatron's interleaved 1F1B schedule (default 1)")
    group.add_argument("--keep-gathered", action="store_true",
                       help="with --zero 3: keep each unit's gathered parameters from forward to backward (FSDP2's "
                            "reshard_after_forward=False; default: free them and gather again, as FSDP and ZeRO-3 do)")
    group.add_argument("--reshard-after-forward", type=int, default=None, metavar="N",
                       help="with --zero 3 (--tp 1, --ep 1): after its forward keep each unit's parameters sharded "
                            "over N consecutive ranks of the data-parallel group, so its backward gathers over those "
                            "N only, at 1/N of the parameters' memory (FSDP2's reshard_after_forward=N, e.g. the GPUs "
                            "of a node; default: free them and gather over the whole group; --keep-gathered: keep "
                            "them whole)")
    group.add_argument("--accumulate-unsharded", action="store_true",
                       help="with --zero 3: every micro-batch but the last keeps its gradients unsharded, summed "
                            "across micro-batches, and reduce-scatters nothing; the last reduce-scatters the sum "
                            "(FSDP2's set_requires_gradient_sync(False) on all but the last micro-batch, as "
                            "Accelerate's no_sync and torch's pipelining schedules run it; default: every micro-batch "
                            "reduce-scatters its own, FSDP2's default)")
    group.add_argument("--fp8-param-gather", action="store_true",
                       help="with --fp8 and --zero 1-3: ZeRO's parameter all-gathers move the FP8 linear weights in "
                            "FP8, one byte each (Megatron-LM's --fp8-param-gather, which under ZeRO 1/2 also keeps "
                            "those weights in FP8; torchao's FSDP2 float8 all-gather under ZeRO 3)")
    group.add_argument("--tp-comm-overlap", action="store_true",
                       help="with --tp > 1 and --sp: each decoder block's all-gathers and reduce-scatters run beside "
                            "the GEMMs they feed or follow (Transformer Engine's userbuffers: Megatron-LM's "
                            "--tp-comm-overlap; torch's AsyncTP); only what outlasts the GEMMs, and at least one "
                            "chunk's transfer, is exposed (default: blocking)")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="with --zero 1 or 2: the updated parameters' all-gathers run bucket by bucket under the next "
                            "step's first forward, each waited for where it is first needed (Megatron-LM's "
                            "--overlap-param-gather; default: after the optimizer)")
    group.add_argument("--optimizer-offload", type=float, default=0.0, metavar="SHARE",
                       help="with --zero 1-3: step this share (0-1) of each rank's optimizer shard on the host CPU, its "
                            "Adam moments in host memory (Megatron-Core's --optimizer-cpu-offload "
                            "--optimizer-offload-fraction); needs a device with a host memory tier")
    group.add_argument("--activation-offload-layers", type=int, default=0, metavar="N",
                       help="with --pp 1 and --recompute none: copy the first N decoder layers' saved activations to "
                            "host memory in forward and back in backward, on one stream beside the compute "
                            "(Megatron-Core's --cpu-offloading --cpu-offloading-num-layers N, Transformer Engine's "
                            "schedule); needs a device with a host memory tier")
    group.add_argument("--cuda-graphs", choices=CUDA_GRAPH_SCOPES, default="none", help=CUDA_GRAPHS_HELP)
    group.add_argument("--grad-reduce-after-backward", action="store_true",
                       help="start the gradients' data-parallel reduction when backward ends (Megatron-LM without "
                            "--overlap-grad-reduce; default: bucket by bucket during backward, as PyTorch DDP)")


def _parallel(args):
    from .parallel.layout import Parallel

    try:
        pp_layers = tuple(int(x) for x in args.pp_layers.split(",")) if args.pp_layers else None
    except ValueError:
        raise UserError(f"--pp-layers must be comma-separated integers, got '{args.pp_layers}'") from None
    return Parallel(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, sp=args.sp, cp=args.cp, cp_comm=args.cp_comm,
                    ep_comm=args.ep_comm,
                    micro_batches=args.micro_batches,
                    zero=args.zero, bucket_mb=args.bucket_mb, pp_layers=pp_layers, stage=args.stage,
                    vocab_multiple=args.vocab_multiple, recompute=args.recompute,
                    recompute_layers=args.recompute_layers, vpp=args.vpp,
                    reshard_after_forward=_reshard_after_forward(args), accumulate_unsharded=args.accumulate_unsharded,
                    overlap_grad_reduce=not args.grad_reduce_after_backward,
                    overlap_param_gather=args.overlap_param_gather, tp_comm_overlap=args.tp_comm_overlap,
                    fp8_param_gather=args.fp8_param_gather, optimizer_offload=args.optimizer_offload,
                    activation_offload_layers=args.activation_offload_layers, cuda_graphs=args.cuda_graphs)


def _reshard_after_forward(args) -> bool | int:
    """FSDP2's reshard_after_forward from --keep-gathered (False) and --reshard-after-forward N (N)."""
    if args.keep_gathered and args.reshard_after_forward is not None:
        raise UserError("--keep-gathered keeps the gathered parameters whole, --reshard-after-forward N keeps a 1/N "
                        "shard of them: give one of the two")
    return False if args.keep_gathered else True if args.reshard_after_forward is None else args.reshard_after_forward


def _formats(text: str) -> list[str]:
    return [f.strip() for f in text.split(",") if f.strip()]


def _quiet_transformers() -> None:
    """Commands that build models: transformers' warnings and progress bars are not ours to print.
    Set through the environment it reads when first imported, so that a run that never builds a
    model (a cached extract) does not import it."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", module="transformers")
    import logging

    # torch logs a fake-tensor kernel's failure with its traceback before raising it; the exception
    # reaches our handler, which says it in one line
    for name in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if "transformers" in sys.modules:  # already imported (in-process callers): set it directly
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()


def run_extract(args) -> int:
    from .progress import heartbeat, set_stage, stage

    set_stage("reading the model's config")
    with heartbeat(lambda: f"{stage()}: still working"):  # a line at least every 10 s, whatever the stage
        return _extract(args, set_stage)


def _extract(args, set_stage) -> int:
    from .pipeline import check_formats, extract

    formats = check_formats(_formats(args.format))
    _check_top(args.top)
    parallel = _parallel(args)
    _check_out(args)
    from .cost.devices import check_name

    check_name(args.device)  # a name, said before the model's config is read
    _quiet_transformers()
    if "chakra" in formats:
        from .formats.chakra import check_world
        check_world(parallel)
    if "simai" in formats:
        from .formats.simai import check_layout
        check_layout(parallel)
    if "chrome-trace" in formats or "chakra" in formats:
        from .cluster.network import check_device
        from .pipeline import load_device
        from .cost.devices import with_topology
        check_device(with_topology(load_device(args.device), args.topology), parallel)
    from .cost.system import System
    from .parallel.execution import Execution

    execution = Execution(batch=args.batch, seq=args.seq, dtype=args.dtype, grad_dtype=args.grad_dtype,
                          parallel=parallel, stack=args.stack, fp8=args.fp8, fp8_recipe=args.fp8_recipe,
                          dropout=not args.no_dropout, sdpa_backends=args.sdpa_backends, attention=args.attention)
    result = extract(args.model, execution, System(args.device, args.topology), name=args.name,
                     size_unit=args.size_unit, trace_on=args.trace_on, use_cache=not args.no_cache,
                     every_layer=args.every_layer, progress=True)
    set_stage(f"writing {', '.join(formats)} of {result.name}")
    summary = result.summary(args.top, formats)
    return _publish(args.out or Path("outputs") / result.name, summary, result.files(formats), result.settings)


def run_profile(args) -> int:
    from .formats.tables import measured_json_text, measured_summary_text, tsv_text
    from .measure.profile import OutOfMemory, profile

    _check_out(args)
    _quiet_transformers()
    try:
        result = profile(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, on=args.on,
                         repeat=args.repeat, warmup=args.warmup, progress=True, timer=args.timer)
    except OutOfMemory as exc:
        raise UserError(f"{exc} (the step needs about {_needed_gib(args.model, exc)} GiB: extract's estimate)") from None
    from .formats.tables import measured_totals, sum_of_ops_warning

    warning = sum_of_ops_warning(measured_totals(result))
    if warning:
        print(f"fxworkload: {warning}", file=sys.stderr)
    return _publish(args.out or Path("outputs") / f"{result.spec.name}-measured", measured_summary_text(result), {
        "measured.tsv": tsv_text(result.workload, "bytes", result.op_ns),
        "measured.json": measured_json_text(result),
    }, result.settings)


def _needed_gib(model: str, exc) -> str:
    from .pipeline import extract

    try:  # the same step on the meta device: no memory for the model
        memory = extract(model, batch=exc.batch, seq=exc.seq, dtype=exc.dtype, trace_on="cpu").memory
    except Exception:  # the figure is a courtesy: the error stands without it
        return "?"
    return f"{memory.total_peak_bytes / 2 ** 30:.1f}"


def _check_out(args) -> None:
    """Before any work: an --out that cannot be written is an error now, not after minutes."""
    from .formats.files import check_out_dir

    if args.out is not None:
        check_out_dir(args.out)


def _publish(out: Path, summary: str, files: dict[str, str], settings: dict, also_written=()) -> int:
    """Replace the output folder with the files and their manifest (all or none), then print the
    summary and every path written (``also_written``: files outside the folder, such as --plot)."""
    from .formats.files import publish

    written = publish(out, files, settings)
    print(summary, end="")
    print("\nwrote " + ", ".join(str(p) for p in [*also_written, *written]))
    return 0


def _check_top(top: int) -> None:
    if top < 0:
        raise UserError(f"--top must be 0 or more, got {top}")


def run_compare(args) -> int:
    from .formats.files import check_one_run, write_file
    from .measure.compare import (compare, comparison_json, is_megatron_log, load_document, load_measured, plot_png,
                                  report_text)

    _check_top(args.top)
    _check_out(args)
    estimated = load_document(args.estimated, "workload.json")
    check_one_run(Path(estimated["path"]))
    out = args.out or Path("outputs") / f"{Path(estimated['path']).parent.name}-vs-{_stem(args.measured)}"
    if is_megatron_log(args.measured, args.measured_format):
        return _compare_log(args, estimated, out)
    measured = load_measured(args.measured, estimated, args.measured_format)
    if "trace" not in measured:  # fxworkload's own measured.json
        check_one_run(Path(measured["path"]))
    comparison = compare(estimated, measured)
    report = report_text(comparison, top=args.top)
    if args.plot is not None:
        write_file(args.plot, plot_png(comparison))
    return _publish(out, report, {"comparison.json": comparison_json(comparison), "comparison.txt": report},
                    {"estimated": estimated["path"], "measured": str(args.measured)},
                    also_written=[args.plot] if args.plot is not None else [])


def _compare_log(args, estimated: dict, out: Path) -> int:
    from .measure.megatron_log import compare_log, log_report_text, parse, summarize

    if args.plot is not None:
        raise UserError("--plot draws op pairs; a Megatron log has phases, not ops: leave --plot out")
    result = compare_log(estimated, summarize(parse(args.measured), args.rank))
    report = log_report_text(result, estimated.get("settings", {}))
    return _publish(out, report, {"comparison.json": json.dumps(result, indent=1, sort_keys=True) + "\n",
                                  "comparison.txt": report},
                    {"estimated": estimated["path"], "measured": str(args.measured)})


def _stem(path: Path) -> str:
    """A file's name without .json, .json.gz, .txt: the folder name of what compare read."""
    name = path.resolve().name if path.is_dir() else path.name
    for suffix in (".gz", ".json", ".txt", ".log"):
        name = name.removesuffix(suffix)
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")
    return cleaned[:64] or "measured"


def run_plan(args) -> int:
    from .limits import check_settings
    from .formats.plan_text import plan_text
    from .plan import check_plan_counts, plan

    _check_top(args.top)
    _check_out(args)
    if args.plot:
        from .figures import pyplot

        pyplot()  # a missing matplotlib is said now, not after the minutes the plan takes
    check_plan_counts(args.gpus, args.global_batch)
    check_settings(1, args.seq, args.dtype)
    _quiet_transformers()
    result = plan(args.model, gpus=args.gpus, global_batch=args.global_batch, seq=args.seq, device=args.device,
                  dtype=args.dtype, workers=args.workers, ray=args.ray, progress=True, stack=args.stack,
                  cp=_degrees(args.cp, "--cp"), fp8=args.fp8, topology=args.topology,
                  overlap_param_gather=args.overlap_param_gather, tp_comm_overlap=args.tp_comm_overlap,
                  offload=args.offload, cuda_graphs=args.cuda_graphs, sdpa_backends=args.sdpa_backends,
                  attention=args.attention, ep_comm=args.ep_comm, fp8_recipe=args.fp8_recipe)
    text = plan_text(result, args.top)
    out = args.out or Path("outputs") / f"{result['model']}-plan-{args.gpus}"
    files = {"plan.json": json.dumps(result, indent=1, sort_keys=True) + "\n", "plan.txt": text}
    if args.plot:
        from .formats.plan_plot import plan_png

        files["plan.png"] = plan_png(result)
    return _publish(out, text, files,
                    {k: result[k] for k in ("model", "gpus", "global_batch", "seq", "dtype", "fp8", "fp8_recipe",
                                            "device", "stack",
                                            "cp", "topology", "overlap_param_gather", "tp_comm_overlap",
                                            "optimizer_offload", "cuda_graphs")
                     if k in result})


def _degrees(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{option} must be comma-separated positive integers, e.g. 1,2,4; got '{text}'") from None


def run_calibrate(args) -> int:
    from .cost import devices
    from .measure.calibrate import gpu_datasheet, measure_checked, say

    if args.on not in ("cpu", "cuda"):
        raise UserError(f"unknown --on {args.on!r}: use cpu or cuda")
    if args.name is not None:
        devices.check_name(args.name, "--name")
    if args.kernels is not None and (args.from_trace is not None or args.estimated is not None):
        raise UserError("--kernels fits a GPU's measured kernel CSVs and --from a profiler trace of a step: "
                        "give one of them")
    if args.from_trace is not None or args.estimated is not None:
        return _calibrate_from(args)
    if (args.on != "cpu" or args.kernels is not None) and not args.name:
        raise UserError(f"{'--kernels' if args.kernels is not None else '--on cuda'} needs --name NAME for the "
                        "measured profile (e.g. --name my-h100)")
    name = args.name or "cpu"
    if name != "cpu" and (devices.DATA_DIR / f"{name}.json").is_file():
        raise UserError(f"--name {name} is a shipped datasheet profile; choose another name")
    if args.like is not None:
        devices.load(args.like)
    if args.timing is not None and args.kernels is None:
        raise UserError("--timing says how --kernels DIR's rows were timed; give --kernels DIR with it")
    if args.kernels is not None:
        if args.like is None:
            raise UserError("--kernels needs --like PROFILE: the datasheet profile of the GPU the kernels ran on "
                            "(e.g. --like h100-sxm)")
        return _calibrate_gpu(name, args.like, args.kernels, args.timing or "back-to-back")
    like = gpu_datasheet(args.like) if args.on == "cuda" else None
    if like is not None:
        return _calibrate_gpu(name, like, None)
    if args.on == "cuda":
        say("no shipped datasheet profile matches this GPU (pass --like PROFILE to fit one's GPU model): "
            "measuring its rates instead")
    profile, problems = measure_checked(args.on, name, progress=say, refuse_early=not args.force)
    if problems and not args.force:
        raise Refused(f"the measurement is not to be trusted, so no profile was saved: {'; '.join(problems)}; "
                      "run it again on a quiet machine, or pass --force to save it anyway")
    for problem in problems:
        say(f"warning (saved with --force): {problem}")
    path = _save_profile(profile, name)
    print(f"saved device profile '{name}' to {path}; use it with --device {name}")
    return 0


def _save_profile(profile, name: str) -> Path:
    from .cost import devices

    try:
        return devices.save(profile, devices.measured_path(name))
    except OSError as exc:
        raise Refused(f"cannot write the profile to {devices.cache_dir()} ({exc.strerror}); "
                        "set FXWORKLOAD_CACHE_DIR to a writable folder") from None


def _calibrate_gpu(name: str, like: str, kernels: Path | None, timing: str = "back-to-back") -> int:
    from .measure.calibrate import calibrate_gpu, fit_report_text, say

    profile, report, folder = calibrate_gpu(name, like, kernels, progress=say, timing=timing)
    path = _save_profile(profile, name)
    print(fit_report_text(report), end="")
    print(f"saved device profile '{name}' ({like}'s facts, the GPU model fitted to {folder}) to {path}; "
          f"use it with --device {name}")
    return 0


def _calibrate_from(args) -> int:
    from .cost import devices
    from .measure.calibrate import fit_from_measured
    from .measure.compare import load_document, load_measured

    if args.from_trace is None or args.estimated is None:
        raise UserError("--from TRACE and --estimated WORKLOAD go together: the trace's times and the workload's "
                        "FLOPs and bytes of the same step")
    if not args.name or args.name == "cpu":
        raise UserError("--from needs --name NAME for the fitted profile (e.g. --name my-cluster-h100)")
    if (devices.DATA_DIR / f"{args.name}.json").is_file():
        raise UserError(f"--name {args.name} is a shipped datasheet profile; choose another name")
    estimated = load_document(args.estimated, "workload.json")
    measured = load_measured(args.from_trace, estimated, "torch-profiler")
    if measured["trace"].get("unit") == "kernel":  # a GPU's kernels: refit the GPU model of its datasheet profile
        return _calibrate_gpu_from_trace(args, estimated, measured)
    profile = fit_from_measured(measured, args.name, args.from_trace.name)
    path = _save_profile(profile, args.name)
    print(f"fitted to {measured['trace']['steps']} step(s) of {args.from_trace}: overhead "
          f"{profile.kernel_launch_ns / 1e3:.2f} us per op, GEMM "
          + ", ".join(f"{k} {v / 1e9:.3g} GFLOP/s" for k, v in profile.matmul_flops_per_s.items())
          + f", {len(profile.vector_flops_per_s_by_op)} vector ops, {len(profile.memory_bytes_per_s_by_bytes)} "
          "bandwidth points")
    print(f"saved device profile '{args.name}' to {path}; use it with --device {args.name}")
    return 0


def _calibrate_gpu_from_trace(args, estimated: dict, measured: dict) -> int:
    from .cost import devices
    from .measure.calibrate import fit_report_text
    from .measure.kernels import fitted_from_trace

    like = args.like or estimated.get("settings", {}).get("device")
    base = devices.load(like) if args.like or (like != "cpu" and like in devices.names()) else None
    if base is None or not base.sm_count:
        raise UserError(f"{args.from_trace.name} is a GPU trace: give --like PROFILE, the datasheet profile of the "
                        "GPU it ran on (e.g. --like h100-sxm), or extract --estimated with --device that profile")
    profile, report = fitted_from_trace(measured, base, args.name, args.from_trace.name)
    path = _save_profile(profile, args.name)
    print(fit_report_text(report), end="")
    print(f"saved device profile '{args.name}' ({like}'s facts, the GPU model fitted to the kernels of "
          f"{args.from_trace}) to {path}; use it with --device {args.name}")
    return 0


# How config.json files spell the figures `models` lists (GPT-2 keeps its own names).
CONFIG_KEYS = {"layers": ("num_hidden_layers", "n_layer"), "hidden": ("hidden_size", "n_embd"),
               "heads": ("num_attention_heads", "n_head")}


def run_models(args) -> int:
    from tabulate import tabulate

    from .capture.builtin import BUILTIN_DIR, builtin_names

    headers = ["name", "model_type", "task", "layers", "hidden", "heads"]
    rows = []
    for name in builtin_names():
        config = json.loads((BUILTIN_DIR / name / "config.json").read_text())
        architectures = config.get("architectures") or [""]
        task = "masked-lm" if str(architectures[0]).endswith("ForMaskedLM") else "causal-lm"
        rows.append([name, config.get("model_type"), task,
                     *(next((config[k] for k in keys if k in config), "-") for keys in CONFIG_KEYS.values())])
    if args.parameters:
        headers.append("parameters")
        for row in rows:
            row.append(f"{_parameter_count(row[0]):,}")
    print(tabulate(rows, headers=headers))
    return 0


def _parameter_count(name: str) -> int:
    import torch

    from .capture import models

    _quiet_transformers()
    return models.trainable_parameter_count(models.build_meta_model(models.resolve(name), torch.float32))


def run_devices(args) -> int:
    from tabulate import tabulate

    from .cost import devices

    if args.name is not None:
        return _device_figures(devices.load(args.name))
    rows = []
    for name in devices.names():
        if name == "cpu":
            paths = devices.measured_cpu_paths()
            if not paths:
                rows.append(["cpu", "this machine's CPU, not measured yet: 'fxworkload calibrate' measures it "
                                    "(extract --device cpu does on first use)", *["-"] * 9])
            rows += [_device_row("cpu", lambda path=path: devices.read(path), f" [{path.stem}]") for path in paths]
            continue
        rows.append(_device_row(name, lambda name=name: devices.load(name)))
    print(tabulate(rows, headers=["name", "description", "fp32_tflops", "bf16_tflops", "fp8_tflops",
                                  "memory_gb_per_s", "memory_gib", "sms", "launch_us", "figures"]))
    print(f"\nmemory_gib: what CUDA reports as the GPU's memory (total_memory), GiB; "
          f"figures: how many of a profile's figures are datasheet facts, fitted on measured kernels, or assumed; "
          f"'fxworkload devices NAME' lists each with its source (the JSON files in {devices.DATA_DIR}/, measured ones "
          f"in {devices.cache_dir()}/devices/)")
    return 0


def _device_row(name: str, load, note: str = "") -> list:
    try:
        d = load()
    except UserError as exc:  # one corrupt measured profile does not hide the others
        return [name, f"unreadable: {exc}", *["-"] * 8]
    kinds = list(d.figure_kinds().values())
    counted = ", ".join(f"{kinds.count(k)} {k}" for k in ("datasheet", "fitted", "assumed") if kinds.count(k))
    fp8 = d.matmul_flops_per_s.get("fp8")
    return [name, d.description + note, *(f"{d.matmul_flops_per_s[k] / 1e12:.4g}" if k in d.matmul_flops_per_s else "-" for k in ("fp32", "bf16")),
            f"{fp8 / 1e12:.4g}" if fp8 else "-", f"{d.memory_bytes_per_s / 1e9:.0f}",
            f"{d.memory_capacity_bytes / 2 ** 30:.1f}" if d.memory_capacity_bytes else "-", d.sm_count or "-",
            f"{d.kernel_launch_ns / 1e3:.2f}", counted or "measured"]


def _device_figures(d) -> int:
    from tabulate import tabulate

    kinds = d.figure_kinds()
    rows = [[figure, _figure_value(d, figure), kinds[figure], source] for figure, source in d.sources.items()]
    print(f"{d.name}: {d.description}")
    print(tabulate(rows, headers=["figure", "value", "kind", "source"], maxcolwidths=[None, 40, None, 90]))
    return 0


def _figure_value(d, figure: str) -> str:
    # "topology.x": the network's field as the profile resolves it (cost/topology.py)
    value = getattr(d.network(), figure.split(".", 1)[1], None) if figure.startswith("topology.") else getattr(
        d, figure, None)
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:.4g}" for k, v in value.items())
    if isinstance(value, list):
        return " > ".join(map(str, value))
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    previous = {}
    try:
        clear_signalled()
        previous = install()
        return _main(argv)
    except (KeyboardInterrupt, Terminated) as exc:  # before _main's own handling starts, or after it ends
        print(stop_message(exc), file=sys.stderr)
        return exit_status(exc)
    finally:
        restore(previous)


def _main(argv: list[str] | None) -> int:
    try:
        if sys.stdout is None:  # started with fd 1 closed (`>&-`): nothing could report what the run did
            raise Refused("standard output is closed; give the command somewhere to print (e.g. > log.txt)")
        args = build_parser().parse_args(argv)
        with _verbose(getattr(args, "verbose", False)):
            code = args.func(args)
        sys.stdout.flush()  # a full disk or a closed pipe on stdout is reported here, not at exit
        return code
    except UserError as exc:
        if signalled():  # a stop signal unwound a library that reported it as its own error: the stop it is
            return _stop_line(signalled())
        print(f"fxworkload: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1 if isinstance(exc, Refused) else 2
    except (KeyboardInterrupt, Terminated) as exc:
        print(stop_message(exc), file=sys.stderr)
        return exit_status(exc)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as SIGPIPE would
        _silence_stdout()
        return 141
    except OSError as exc:  # the disk or the system refused: a full disk, permissions, a name too long
        _silence_stdout()
        where = f": {exc.filename}" if exc.filename else " (writing standard output)"
        print(f"fxworkload: error: {exc.strerror or type(exc).__name__}{where}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug of ours: one line saying so; FXWORKLOAD_DEBUG=1 shows the traceback
        if signalled():  # ...unless a stop signal unwound code that turned it into another error
            return _stop_line(signalled())
        if os.environ.get("FXWORKLOAD_DEBUG"):
            raise
        print(f"fxworkload: internal error: {type(exc).__name__}: {_one_line(str(exc))[:300]} (a bug: please "
              "report it with the command; FXWORKLOAD_DEBUG=1 prints the traceback)", file=sys.stderr)
        return 70


VERBOSE_HELP = "say what the caches did: each entry not used and why (recaptured or evaluated again)"


@contextlib.contextmanager
def _verbose(on: bool):
    """FXWORKLOAD_VERBOSE for this run (and the plan's workers, which inherit the environment)."""
    if not on:
        yield
        return
    before = os.environ.get("FXWORKLOAD_VERBOSE")
    os.environ["FXWORKLOAD_VERBOSE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FXWORKLOAD_VERBOSE", None)
        else:
            os.environ["FXWORKLOAD_VERBOSE"] = before


def _stop_line(signum: int) -> int:
    exc = stop(signum)
    print(stop_message(exc), file=sys.stderr)
    return exit_status(exc)


MAX_MESSAGE_CHARS = 600


def _one_line(text: str) -> str:
    """Messages echo user input: a newline in it must not split the error line, and a value of
    thousands of characters is shown by its ends."""
    line = " ".join(text.replace("\r", "\n").split("\n"))
    return line if len(line) <= MAX_MESSAGE_CHARS else f"{line[:360]} … {line[-200:]}"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush raises nothing more."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
