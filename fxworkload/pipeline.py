"""The extraction pipeline as one call: model argument in, Workload and its settings out.

This is the Python API (``fxworkload.extract``): the result's properties hold the figures, and
``write`` puts the files the CLI writes into a folder. A step captured before is read from the
graph cache with the model's facts; such a run reads the config.json as JSON and never imports
transformers or the model's code.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path

import torch

from . import __version__
from .capture.attention import GpuTarget, enabled
from .capture.builtin import locate, without_dropout
from .capture.sdpa_backends import check_sdpa_backends
from .cost import devices
from .cost.devices import DeviceProfile
from .cost.system import FIELDS as SYSTEM_FIELDS
from .cost.system import System
from .cost.gpu import RESIDENT_THREADS, SM_THREADS
from .dtypes import DTYPES
from .memo import Memo
from .errors import UserError
from .names import check_name
from .parallel.facts import ModelFacts, check_positions
from .parallel.layout import Parallel, padded_vocab
from .parallel.layout import check as check_parallel
from .parallel.layout import check_sequence
from .parallel.memory import RankMemory, rank_memory
from .parallel.rank import RankWorkload, rank_workload
from .parallel.recompute import with_recompute
from .parallel.context_parallel import with_context_parallel
from .parallel.execution import FIELDS as EXECUTION_FIELDS
from .parallel.execution import Execution
from .parallel.sequence_parallel import with_sequence_parallel
from .progress import say as print_progress
from .workload import cache as graph_cache
from .workload.cuda_graphs import with_cuda_graphs
from .workload.fp8 import with_fp8
from .workload.fp8_recipes import check_fp8
from .workload.siblings import with_merged_siblings
from .workload.stacks import check_stack
from .workload.table import Workload, recost


FORMATS = ("tables", "simai", "chrome-trace", "chakra", "html")


@dataclass
class Extraction:
    """One extracted training step. ``workload``: per-node rows of one micro-batch on one tensor/
    expert-parallel shard, every layer; ``rank``: the --stage rank's layer-level units and collectives."""
    facts: ModelFacts
    workload: Workload
    device: DeviceProfile
    settings: dict
    rank: RankWorkload
    memory: RankMemory  # the --stage rank's memory at its peak, part by part
    model: str = field(default="", repr=False)  # the model argument, for ``spec``
    model_workload: Workload | None = field(default=None, repr=False)  # before recomputation: the model's FLOPs
    execution: Execution = field(default_factory=Execution, repr=False)  # as run, its sequence resolved

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def totals(self) -> dict:
        """Flops, bytes and estimated ns per phase and for the step (one micro-batch, one shard)."""
        return self.workload.totals

    @property
    def nodes(self) -> list:
        """The per-node rows (NodeRow: name, forward/input_grad/weight_grad OpCosts)."""
        return self.workload.node_rows

    def summary(self, top: int = 10, formats=None) -> str:
        """The text ``fxworkload extract`` prints, each figure labelled with what it covers. Given
        the formats written, the rank's view is left out of a plain single-GPU tables run, and a
        SimAI file without data parallelism gets a note."""
        from .formats.tables import cluster_summary_text, memory_summary_text, rank_summary_text, summary_text

        parallel = self.rank.parallel
        text = summary_text(self.workload, self.settings, top=top)
        if formats is None or parallel != Parallel() or list(formats) != ["tables"]:
            text += "\n" + rank_summary_text(self.rank)
        text += "\n" + memory_summary_text(self.memory, self.device.name, self.rank.parallel)
        if self.cluster_or_none() is not None:
            text += "\n" + cluster_summary_text(self.cluster, self.settings.get("fp8", False))
        if formats is not None and "simai" in formats and parallel.vpp > 1:
            text += (f"\nnote: --vpp {parallel.vpp}: the SimAI file holds this device's {parallel.vpp} chunks, once per "
                     "micro-batch in the schedule's forward order, and vpp in its header for SimAI's bubble formula; "
                     "SimAI runs every forward before every backward and has no row for the transfers between "
                     "chunks\n")
        if formats is not None and "simai" in formats and parallel.replicas == 1:
            text += ("\nnote: --dp 1: the SimAI file has no gradient all-reduce; pass --dp N for the data-parallel "
                     "collectives of an N-replica run\n")
        return text

    def files(self, formats=("tables",)) -> dict[str, str | bytes]:
        """File name -> content of each format: tables (workload.tsv, workload.json), simai
        (workload.simai.txt), chrome-trace (workload.trace.json), chakra (workload.<rank>.et each and
        workload.comm_groups.json)."""
        from .formats.tables import json_text, nodes_tsv_text, tsv_text

        formats = check_formats(formats)
        files = {}
        if "tables" in formats:
            files["workload.tsv"] = tsv_text(self.workload, self.settings["size_unit"])
            files["nodes.tsv"] = nodes_tsv_text(self.workload)
            cluster = self.cluster_or_none()
            files["workload.json"] = json_text(self.workload, self.settings, asdict(self.device), self.memory.as_dict(),
                                               None if cluster is None else cluster.as_dict())
        if "simai" in formats:
            from .formats import simai
            files["workload.simai.txt"] = simai.text(simai.from_rank(self.rank, self.device, self.cluster_or_none()))
        if "chrome-trace" in formats:
            from .formats.chrome_trace import trace_json
            files["workload.trace.json"] = trace_json(self.rank, self.device, self.cluster, self.settings["stack"])
        if "chakra" in formats:
            from .formats.chakra import chakra_files
            files.update(chakra_files(self.cluster))
        if "html" in formats:
            from .formats.html_report import report_html
            files["report.html"] = report_html(self.workload, self.settings, self.summary(10, formats))
        return files

    def _repr_html_(self) -> str:
        """A notebook's view of the extraction: its costliest nodes with their FLOPs, bytes and ms."""
        from .formats.html_report import nodes_table_html

        return nodes_table_html(self.workload)

    def to_pandas(self):
        """The nodes that do work as a pandas DataFrame (formats.tables.node_records: times in ms, FLOPs, bytes),
        for a notebook; needs pandas (installed with the ``traces`` extra)."""
        try:
            import pandas
        except ImportError:
            raise UserError("to_pandas needs pandas: pip install pandas (or the 'traces' extra)") from None
        from .formats.tables import NODE_COLUMNS, node_records

        return pandas.DataFrame(node_records(self.workload), columns=NODE_COLUMNS)

    def write(self, out: str | Path, formats=("tables",)) -> list[Path]:
        """Replace the folder ``out`` with these formats' files and a manifest.json; all or none."""
        from .formats.files import publish

        return publish(Path(out), self.files(formats), self.settings)

    @functools.cached_property
    def cluster(self):
        """The whole cluster's step (cluster/step.py): every stage's passes under the pipeline
        schedule, the collectives' times, MFU. Needs the profile's interconnect when world > 1."""
        from .cluster.step import cluster_step
        from .cluster.network import check_device

        check_device(self.device, self.rank.parallel)
        return cluster_step(self.facts, self.workload, self.model_workload or self.workload,
                            replace(self.execution, parallel=self.rank.parallel), self.device)

    def cluster_or_none(self):
        """The cluster step, or None where the profile lacks the interconnect its collectives need."""
        try:
            return self.cluster
        except UserError:
            return None

    @functools.cached_property
    def spec(self):
        """The resolved ModelSpec (transformers config): resolved on first use, since a cached run needs none."""
        from .capture import models

        return _with_padded_vocab(models.resolve(self.model), self.settings["parallel"]["vocab_multiple"],
                                  self.settings["parallel"]["tp"])


@dataclass(frozen=True)
class CostedStep:
    """One micro-batch's step of a rank shape, captured and costed, before any layout's own choices."""
    facts: ModelFacts
    workload: Workload  # as captured (the rank's share: tp, ep, cp, sp; fp8), costed on ``device``
    device: DeviceProfile
    execution: Execution  # its sequence resolved; the layout's capture settings (pp, zero, ... are the layouts')


def extract(model: str, execution: Execution | None = None, system: System | None = None, *,
            name: str | None = None, size_unit: str = "bytes", trace_on: str = "auto", use_cache: bool = True,
            every_layer: bool = False, progress: bool = False, rank_view: bool = True, **fields) -> Extraction:
    """One training step of ``model`` (a built-in name, checkpoint folder, config.json or cached
    HuggingFace id) run as ``execution`` says (parallel/execution.py: micro-batch, sequence, dtypes, layout,
    stack, FP8, attention) on ``system`` (cost/system.py: the device profile and ``--topology`` over its
    network). ``fields``: any of those two objects' fields by name, replacing theirs (``extract("gpt2",
    batch=2, dtype="bf16", device="h100-sxm")``).
    ``name`` replaces the model's name in the outputs; ``trace_on`` is whose dispatch the graph follows:
    ``auto`` (the device profile's: a GPU profile records the fused attention kernel that GPU would
    choose), ``cpu`` or ``cuda`` (no GPU needed); ``every_layer`` traces all layers even where one layer
    could stand for all (see layers.py). With tp or ep > 1 the rank's share of the model is traced.
    ``rank_view=False`` stops at the costed step (a ``CostedStep``: what a layout search evaluates
    its layouts from), without the rank's units and memory for the execution's layout."""
    execution, system = _with_fields(execution, system, fields)
    execution = replace(execution, grad_dtype=execution.gradients).checked()
    parallel, dtype, grad_dtype = execution.parallel, execution.dtype, execution.grad_dtype
    if name is not None:
        check_name(name, "--name")
    profile = devices.with_topology(load_device(system.device, say=print_progress if progress else None),
                                    system.topology)
    devices.check_dtype(profile, dtype)
    if parallel.optimizer_offload or parallel.activation_offload_layers:
        from .cluster.offload import check_host_tier

        check_host_tier(profile)
    if execution.fp8:
        check_fp8(profile, dtype)
    gpu = trace_target(trace_on, profile, execution.sdpa_backends)
    platform = (f"rocm {profile.arch}" if profile.arch.startswith("gfx")  # ROCm's torch: the "cuda" device type
                else f"cuda sm{gpu.arch[0]}{gpu.arch[1]}" if gpu is not None else "")
    traced_on = "cpu" if gpu is None else f"{platform} sdpa {'>'.join(gpu.priority)}"
    say = print_progress if progress else (lambda text: None)

    if parallel.cp > 1:  # each rank is captured on its own tokens (context_parallel.py)
        if execution.seq is None:
            raise UserError(f"--cp {parallel.cp} splits the sequence: give its length with --seq")
        check_sequence(parallel, execution.seq)
    seq = None if execution.seq is None else execution.seq_per_rank  # the capture's, and its cache key's
    start = time.perf_counter()
    located_name, config_path, _ = locate(model)
    name = located_name if name is None else name
    raw_config = _raw_config(config_path)
    # the kernels' scratch (workload/scratch.py) follows the GPU's SMs: two sm90 boards differ
    trace_device = traced_on if gpu is None else f"{traced_on} {gpu.sm_count}x{gpu.threads_per_sm}"
    attention = execution.attention
    keyed_config = raw_config if attention is None else {**raw_config, "_attn_implementation": attention}
    cache_key = graph_cache.key(keyed_config if execution.dropout else without_dropout(keyed_config),
                                execution.batch, seq, dtype, grad_dtype, trace_device,
                                shards=(parallel.tp, parallel.ep), vocab_multiple=parallel.vocab_multiple,
                                every_layer=every_layer, stack=execution.stack)
    cached = graph_cache.load(cache_key, ModelFacts) if use_cache else None
    if cached is not None:
        check_parallel(parallel, cached.facts)  # before any progress line: a bad layout is the only thing said
        check_positions(cached.facts, cached.seq * parallel.cp)
        say(f"read the captured step from the cache ({graph_cache.path_of(cache_key)})")
        workload, seq, facts = cached.workload, cached.seq, cached.facts
    else:
        workload, seq, facts = _capture(model, execution, seq, gpu, every_layer, say)
        say(f"captured {len(workload.ops())} ops in {time.perf_counter() - start:.1f} s")
        if use_cache:
            graph_cache.save(cache_key, graph_cache.CachedStep(workload=workload, seq=seq, facts=facts))
    facts = replace(facts, name=name)  # the cache is keyed by config: another path may share the step
    check_sequence(parallel, seq * parallel.cp)
    execution = replace(execution, seq=seq * parallel.cp)  # the model's own sequence where none was given
    say(f"costing on {profile.name}...")
    workload = captured = _costed(workload, execution, facts, profile)
    if not rank_view:
        return CostedStep(facts=facts, workload=captured, device=profile, execution=execution)
    captured_saved_bytes = workload.saved_bytes
    layer_input_bytes = (execution.batch * execution.seq_per_rank * facts.hidden * DTYPES[dtype].itemsize
                         // (parallel.tp if parallel.sp else 1))
    workload, regenerated_bytes = with_recompute(workload, parallel, facts.stack, facts.layers, layer_input_bytes)
    settings = _settings(facts, execution, system, profile, traced_on, size_unit)
    rank = rank_workload(facts, workload, execution)
    memory = rank_memory(rank.parallel, rank.units, workload, dtype, grad_dtype, captured_saved_bytes,
                         regenerated_bytes, profile.memory_capacity_bytes, profile.host_memory_capacity_bytes)
    return Extraction(facts=facts, workload=workload, device=profile, settings=settings, rank=rank, memory=memory,
                      model=model, model_workload=captured, execution=execution)


def _with_fields(execution: Execution | None, system: System | None, fields: dict) -> tuple[Execution, System]:
    """The execution and system with the fields named by keyword replaced (a field neither has is a TypeError,
    as an unknown keyword is)."""
    unknown = set(fields) - EXECUTION_FIELDS - SYSTEM_FIELDS
    if unknown:
        raise TypeError(f"extract() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    execution = replace(execution or Execution(), **{k: v for k, v in fields.items() if k in EXECUTION_FIELDS})
    system = replace(system or System(), **{k: v for k, v in fields.items() if k in SYSTEM_FIELDS})
    return execution, system


def _costed(workload: Workload, execution: Execution, facts: ModelFacts, profile: DeviceProfile) -> Workload:
    """The captured step costed on ``profile`` as the execution runs it: sequence and context parallelism's
    collectives and kernels, FP8's GEMMs and casts, CUDA graphs' launches, sibling linears run as one GEMM."""
    parallel = execution.parallel
    workload = with_context_parallel(
        with_sequence_parallel(recost(workload, profile), parallel, facts.stack, facts.row_parallel,
                               profile.kernel_launch_ns), parallel, profile)
    if execution.fp8:
        workload = with_fp8(workload, profile, facts.stack, execution.fp8_recipe,
                            sp_tp=parallel.tp if parallel.sp else 1, row_parallel=facts.row_parallel)
    # last: one GEMM for each group of sibling linears, timed as the passes above left its rows' GEMMs
    return with_merged_siblings(with_cuda_graphs(workload, profile, parallel.cuda_graphs, facts.stack), profile,
                                facts.stack)


def _settings(facts: ModelFacts, execution: Execution, system: System, profile: DeviceProfile, traced_on: str,
              size_unit: str) -> dict:
    """What the outputs record of the run (workload.json's ``settings``)."""
    settings = {"model": facts.name, "model_type": facts.model_type, "task": facts.task,
                "batch": execution.batch, "seq": execution.seq, "seq_per_rank": execution.seq_per_rank,
                "dtype": execution.dtype, "fp8": execution.fp8, "stack": execution.stack,
                "grad_dtype": execution.gradients, "device": profile.name, "dropout": execution.dropout,
                **({"fp8_recipe": execution.fp8_recipe} if execution.fp8 else {}),
                "traced_on": traced_on, "size_unit": size_unit, "parallel": execution.parallel.as_dict(),
                "fxworkload_version": __version__, "torch_version": torch.__version__,
                "transformers_version": metadata.version("transformers")}
    if system.topology:
        settings["topology"] = system.topology
    if execution.sdpa_backends is not None:
        settings["sdpa_backends"] = list(execution.sdpa_backends)
    if execution.attention is not None:
        settings["attention"] = execution.attention
    return settings


def check_formats(formats) -> list[str]:
    formats = [formats] if isinstance(formats, str) else list(formats)
    unknown = [str(f) for f in formats if f not in FORMATS]
    if not formats:
        raise UserError(f"--format names no format: use one or more of {', '.join(FORMATS)}")
    if unknown:
        raise UserError(f"unknown --format {','.join(unknown)!r}: use one or more of {', '.join(FORMATS)}")
    return formats


def _raw_config(path) -> dict:
    """config.json as JSON, for the cache key; a file transformers cannot read fails later, on capture."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {"unreadable": str(path)}
    return data if isinstance(data, dict) else {"not_an_object": str(path)}


def _capture(model, execution: Execution, seq: int | None, gpu, every_layer, say):
    """Resolve with transformers, check the layout, and capture the rank's step: (workload, the tokens of its
    sequence, facts); ``seq``: the rank's tokens (extract's, from Execution.seq_per_rank); None, the model's own."""
    from .capture import models
    from .capture.models import step_seq
    from .capture.trace import capture_training_step
    from .cost.flops import register_transformers_ops
    from .parallel import tensor_parallel
    from .parallel.loss_parallel import with_vocab_parallel_loss
    from .workload.layers import SHORT_LAYERS, fast_workload, piecewise_workload
    from .workload.table import build

    parallel, dtype, stack, batch = execution.parallel, execution.dtype, execution.stack, execution.batch
    spec = _with_padded_vocab(models.resolve(model), parallel.vocab_multiple, parallel.tp)
    if not execution.dropout:
        spec = models.spec_without_dropout(spec)
    spec = models.spec_with_attention(spec, execution.attention)
    if parallel.cp > 1:  # the rank's tokens are captured; the whole sequence must fit the model's positions
        step_seq(spec, seq * parallel.cp)
    seq = step_seq(spec, seq)
    check_sequence(parallel, seq * parallel.cp)
    facts, stack_alike, kinds = _built_facts(spec, dtype)
    check_parallel(parallel, facts)  # before any progress line: a bad layout is the only thing said
    say(f"built {spec.name} on the meta device ({dtype})")

    def prepare(module: torch.nn.Module) -> torch.nn.Module:
        rank = tensor_parallel.shard(module, tensor_parallel.plan_for(module), parallel.tp, parallel.ep)
        return with_vocab_parallel_loss(rank, check_stack(stack).vocab_parallel_loss) if parallel.tp > 1 else rank

    register_transformers_ops()
    if not every_layer and facts.layers > max(SHORT_LAYERS):
        if stack_alike is not None:
            say(f"capturing one training step (batch {batch}, seq {seq}) of {SHORT_LAYERS[0]}- and {SHORT_LAYERS[1]}-layer copies...")
            workload = fast_workload(spec, stack_alike, batch, seq, DTYPES[dtype], DTYPES[execution.gradients], gpu, prepare,
                                     stack)
            if workload is not None:
                return workload, seq, facts
        elif kinds is not None:
            say(f"capturing one training step (batch {batch}, seq {seq}) of copies keeping one middle repetition of "
                "each repeated run of its layers...")
            workload = piecewise_workload(spec, *kinds, batch, seq, DTYPES[dtype], DTYPES[execution.gradients], gpu,
                                          prepare, stack)
            if workload is not None:
                return workload, seq, facts
        say("its layers differ: capturing every layer...")
    else:
        say(f"capturing one training step (batch {batch}, seq {seq}), every layer...")
    module = prepare(models.build_meta_model(spec, DTYPES[dtype]))
    capture = capture_training_step(module, batch, seq, gpu=gpu)
    return build(capture, module, None, DTYPES[execution.gradients], stack, facts.stack), seq, facts


# A layout search captures many rank shapes of one model in a process: its whole meta model is built once,
# for its facts and whether one layer may stand for all (the fast path captures short copies instead).
_BUILT = Memo(16)


def _built_facts(spec, dtype: str) -> tuple[ModelFacts, str | None, tuple[str, tuple[int, ...]] | None]:
    """The model's facts, ``uniform_stack``, and where that is None ``layer_kinds`` (the layers' path and each
    one's kind), from the whole model built on the meta device."""
    key = (spec.name, spec.task, spec.config.to_json_string(use_diff=False), dtype)
    return _BUILT.get(key, (), _facts_of_built, spec, dtype)


def _facts_of_built(spec, dtype: str) -> tuple[ModelFacts, str | None]:
    from .capture import models
    from .parallel.facts import model_facts
    from .workload.layers import layer_kinds, uniform_stack

    module = models.build_meta_model(spec, DTYPES[dtype])
    facts, alike = model_facts(spec, module), uniform_stack(spec, module)
    return facts, alike, None if alike is not None else layer_kinds(module, facts.layers)


def _with_padded_vocab(spec, vocab_multiple: int, tp: int):
    import copy
    from dataclasses import replace

    from .capture.models import setting, text_config

    vocab = setting(spec.config, "vocab_size")
    if not isinstance(vocab, int) or padded_vocab(Parallel(tp=tp, vocab_multiple=vocab_multiple), vocab) == vocab:
        return spec
    config = copy.deepcopy(spec.config)
    text_config(config).vocab_size = padded_vocab(Parallel(tp=tp, vocab_multiple=vocab_multiple), vocab)
    return replace(spec, config=config)


def load_device(name: str, say=None) -> DeviceProfile:
    """The device profile; for ``cpu`` never calibrated on this machine, calibrate it first
    (profiles are only read in ``cost``: measuring is this layer's job)."""
    if name == "cpu" and not devices.exists("cpu"):
        from .measure.calibrate import measure_checked

        tell = say or print_progress
        tell("measuring this CPU once (run 'fxworkload calibrate' to redo it)...")
        profile, problems = measure_checked("cpu", "cpu")
        if problems:  # good enough for this run, not kept for the next
            tell(f"warning: this CPU's measurement is not to be trusted ({'; '.join(problems)}): used for this run "
                 "only; run 'fxworkload calibrate' on a quiet machine")
            return profile
        try:
            devices.save(profile, devices.measured_path("cpu"))
        except OSError:
            pass  # an unwritable cache only costs a new measurement next time
        return profile
    return devices.load(name)


TRACE_ON = ("auto", "cpu", "cuda")
REFERENCE_GPU = "h100-sxm"  # whose dispatch --trace-on cuda follows when --device is not a GPU


def trace_target(trace_on: str, profile: DeviceProfile, sdpa_backends: tuple[str, ...] | None = None
                 ) -> GpuTarget | None:
    """The GPU whose SDPA dispatch the trace follows, or None to dispatch as the CPU does; ``sdpa_backends``:
    the backends a run enables (``torch.nn.attention.sdpa_kernel``), None for all of them."""
    if trace_on not in TRACE_ON:
        raise UserError(f"unknown --trace-on '{trace_on}': use auto (follow --device), cpu or cuda")
    check_sdpa_backends(sdpa_backends)
    if trace_on == "cpu" or (trace_on == "auto" and not profile.arch):
        if sdpa_backends is not None:
            raise UserError("--sdpa-backends chooses among a GPU's attention kernels, but this trace follows the "
                            f"CPU's dispatch ({profile.name}): give a GPU --device or --trace-on cuda")
        return None
    gpu = profile if profile.arch else devices.load(REFERENCE_GPU)
    # ROCm's reductions launch warps of 64 under other limits (workload/scratch.py counts CUDA's only)
    grid = (gpu.sm_count, RESIDENT_THREADS.get(gpu.arch, SM_THREADS)) if gpu.arch.startswith("sm") else (0, 0)
    target = GpuTarget(arch=gpu.compute_capability(), priority=tuple(gpu.sdpa_priority), sm_count=grid[0],
                       threads_per_sm=grid[1])
    return target if sdpa_backends is None else enabled(target, sdpa_backends)

