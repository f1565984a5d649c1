"""Writers: the per-node TSV (the reference layout), the full JSON, and the stdout summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, fields

from tabulate import tabulate

from ..capture.trace import PHASES
from ..limits import SUM_OF_OPS_TOLERANCE, sum_of_ops_warning  # noqa: F401 (re-exported: profile's check)
from ..workload.stacks import STACKS
from ..workload.table import GradRow, NodeRow, OpCost, Workload

TSV_COLUMNS = ["name", "forward_compute_time", "forward_comm_type", "forward_comm_size",
               "backward_compute_time", "backward_comm_type", "backward_comm_size",
               "weight_grad_compute_time", "weight_grad_comm_type", "weight_grad_comm_size", "process_time"]
GRAD_COMM_TYPE = "ALLREDUCE_ASYNC"
NO_COMM = "None"


def _ms(ns: float) -> str:
    return repr(ns / 1e6)


def estimated(op: OpCost) -> float:
    return op.estimated_ns


def tsv_text(workload: Workload, size_unit: str, op_ns: Callable[[OpCost], float] = estimated) -> str:
    """The 11-column table; node times are ``op_ns`` summed per phase (estimates, or measured medians)."""
    lines = ["\t".join(TSV_COLUMNS)]
    for row in workload.rows:
        if isinstance(row, GradRow):
            size = row.bytes if size_unit == "bytes" else row.elements
            fields = [row.name, "0", NO_COMM, "0", "0", GRAD_COMM_TYPE, str(size), "0", NO_COMM, "0", "0"]
        else:
            forward_ns, input_grad_ns, weight_grad_ns = phase_ns(row, op_ns)
            fields = [row.name, _ms(forward_ns), NO_COMM, "0", _ms(input_grad_ns), NO_COMM, "0",
                      _ms(weight_grad_ns), NO_COMM, "0", "0"]
        lines.append("\t".join(fields))
    return "\n".join(lines) + "\n"


NODE_COLUMNS = ["name", "module", "op", "kind", "forward_ms", "input_grad_ms", "weight_grad_ms", "forward_flops",
                "input_grad_flops", "weight_grad_flops", "forward_bytes", "backward_bytes", "saved_bytes",
                "gradient_bytes"]


def node_records(workload: Workload) -> list[dict]:
    """One record per graph node that does work (FLOPs, bytes moved or time in some phase; views and aliases,
    which move nothing, are left out), its module's gradient bytes on the node that owns them: the table a user
    opens first, every figure with its unit in its name."""
    gradients = {row.module: row.bytes for row in workload.rows if isinstance(row, GradRow)}
    records = []
    for row in workload.node_rows:
        phases = {phase: row.ops(phase) for phase in PHASES}
        times = {phase: sum(op.estimated_ns for op in ops) for phase, ops in phases.items()}
        flops = {phase: sum(op.flops for op in ops) for phase, ops in phases.items()}
        moved = {phase: sum(op.bytes for op in ops) for phase, ops in phases.items()}
        if not (any(times.values()) or any(flops.values()) or any(moved.values())):
            continue
        records.append({"name": row.name, "module": row.module, "op": row.forward.op, "kind": row.forward.kind,
                        **{f"{phase}_ms": times[phase] / 1e6 for phase in PHASES},
                        **{f"{phase}_flops": flops[phase] for phase in PHASES},
                        "forward_bytes": moved["forward"], "backward_bytes": moved["input_grad"] + moved["weight_grad"],
                        "saved_bytes": row.saved_bytes, "gradient_bytes": gradients.pop(row.module, 0)})
    return records


def nodes_tsv_text(workload: Workload) -> str:
    """nodes.tsv: ``node_records`` as tab-separated text, times in ms to the ns."""
    lines = ["\t".join(NODE_COLUMNS)]
    for record in node_records(workload):
        lines.append("\t".join(f"{record[c]:.6f}" if c.endswith("_ms") else str(record[c]) for c in NODE_COLUMNS))
    return "\n".join(lines) + "\n"


def phase_ns(row: NodeRow, op_ns: Callable[[OpCost], float]) -> tuple[float, ...]:
    return tuple(sum(map(op_ns, row.ops(phase))) for phase in PHASES)


def json_text(workload: Workload, settings: dict, device_profile: dict, memory: dict | None = None,
              cluster: dict | None = None) -> str:
    unruled = sorted({op.op for op in workload.ops() if not op.has_flop_rule})
    document = {"settings": settings, "device": device_profile, "totals": workload.totals,
                **({"memory": memory} if memory is not None else {}),
                **({"cluster": cluster} if cluster is not None else {}),
                "unruled_ops": unruled, "rows": row_documents(workload, "estimated", estimated, op_document)}
    return document_text(document)


def document_text(document: dict) -> str:
    """JSON with one top-level key per line and one row per line: readable with grep and diff, and
    written by json's C encoder (an indented dump takes its pure-Python path, ~10x slower on 70B)."""
    parts = []
    for key, value in document.items():
        if key == "rows":
            body = ",\n".join(json.dumps(row) for row in value)
            parts.append(f'"rows": [\n{body}\n]')
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


OP_FIELDS = tuple(f.name for f in fields(OpCost) if f.name != "fx_name")


def op_document(op: OpCost) -> dict:
    return {name: getattr(op, name) for name in OP_FIELDS}


def row_documents(workload: Workload, label: str, op_ns: Callable[[OpCost], float],
                  op_document: Callable[[OpCost], dict]) -> list[dict]:
    """Every row as a dict; node rows carry their ops, ``<phase>_<label>_ns`` the per-phase sums.
    Layers that one captured layer stands for share their op objects: each is documented once."""
    documented: dict[int, dict] = {}

    def document(op: OpCost) -> dict:
        if id(op) not in documented:
            documented[id(op)] = op_document(op)
        return documented[id(op)]

    rows = []
    for row in workload.rows:
        if isinstance(row, GradRow):
            rows.append({"type": "gradient_allreduce", "comm_type": GRAD_COMM_TYPE, **asdict(row)})
            continue
        times = phase_ns(row, op_ns)
        rows.append({"type": "node", "name": row.name, "module": row.module,
                     **{f"{phase}_{label}_ns": ns for phase, ns in zip(PHASES, times)},
                     "saved_bytes": row.saved_bytes,
                     "forward": document(row.forward),
                     "input_grad": [document(op) for op in row.input_grad],
                     "weight_grad": [document(op) for op in row.weight_grad]})
    return rows


def _attention_row(workload: Workload, settings: dict) -> list[list[str]]:
    """The attention kernels the step runs and the order the trace tried them in (a GPU trace's
    ``traced_on``: "cuda sm90 sdpa cudnn>flash>..."); none for a CPU trace or a step without SDPA."""
    ran = sorted({op.sdpa_backend for row in workload.node_rows for op in (row.forward, *row.input_grad)
                  if op.sdpa_backend})
    tried = settings.get("traced_on", "").partition(" sdpa ")[2]
    if not ran or not tried:
        return []
    return [["attention kernel (--sdpa-backends)", f"{', '.join(ran)} (tried in order: {tried.replace('>', ', ')})"]]


def summary_text(workload: Workload, settings: dict, top: int = 10) -> str:
    totals = workload.totals
    p = settings["parallel"]
    tokens = settings["batch"] * settings["seq"]
    sharded = p["tp"] > 1 or p["ep"] > 1
    scope = f"one tp {p['tp']} / ep {p['ep']} shard, all layers" if sharded else "whole model"
    per_step = "" if p["micro_batches"] == 1 and p["dp"] == 1 else (
        f"; per step {tokens * p['micro_batches'] * p['dp']:,} ({p['micro_batches']} micro-batches x dp {p['dp']})")
    key_figures = [
        ["model", settings["model"]],
        ["device", settings["device"]],
        ["dtype / grad dtype", f"{settings['dtype']} / {settings['grad_dtype']}"],
        ["execution stack (--stack)", f"{settings.get('stack', 'eager')}: {STACKS[settings.get('stack', 'eager')].source}"],
        ["recomputation (--recompute)", _recompute_text(p)],
        *_attention_row(workload, settings),
        ["gradient reduction over dp", "overlapped with backward, bucket by bucket" if p.get("overlap_grad_reduce", True)
         else "after the last backward (--grad-reduce-after-backward)"],
        [f"trainable parameters ({scope})", f"{totals['parameter_count']:,}"],
        ["tokens per micro-batch (batch x seq)", f"{tokens:,} ({settings['batch']} x {settings['seq']}){per_step}"],
        [f"gradient bytes ({scope})", f"{totals['gradient_bytes']:,}"],
    ]
    pass_label = "one micro-batch" + (f", {scope}" if sharded or p["pp"] > 1 else "")
    kernels_ns = sum(totals[f"{ph}_estimated_ns"] for ph in PHASES)
    if abs(totals["step_estimated_ns"] - kernels_ns) > 1e-3 * kernels_ns:  # the host, not the device, sets the pace
        pass_label += "; ms: kernels beside the host's dispatch of each op, so more than their sum"
    phases = [[phase, f"{totals[f'{phase}_flops']:.4e}", f"{totals[f'{phase}_bytes']:.4e}",
               f"{totals[f'{phase}_estimated_ns'] / 1e6:.3f}"]
              for phase in ("forward", "input_grad", "weight_grad")]
    phases.append([f"fwd+bwd ({pass_label})", f"{sum(totals[f'{ph}_flops'] for ph in PHASES):.4e}",
                   f"{sum(totals[f'{ph}_bytes'] for ph in PHASES):.4e}",
                   f"{totals['step_estimated_ns'] / 1e6:.3f}"])
    if "step_low_ns" in totals:
        phases.append(["  90 % interval (the kernel families' held-out errors)", "", "",
                       f"{totals['step_low_ns'] / 1e6:.3f}-{totals['step_high_ns'] / 1e6:.3f}"])
    host = host_bound_text(workload)
    costliest = sorted(workload.node_rows, key=lambda r: r.total_ns, reverse=True)[:top]
    top_rows = [[r.name, r.forward.op, f"{r.forward.estimated_ns / 1e6:.4f}", f"{r.backward_ns / 1e6:.4f}",
                 f"{r.weight_grad_ns / 1e6:.4f}", f"{r.total_ns / 1e6:.4f}"] for r in costliest]
    return "\n\n".join([
        tabulate(key_figures, tablefmt="simple"),
        tabulate(phases, headers=["phase", "flops", "bytes", "estimated_ms"], tablefmt="simple") + host,
        f"The {len(top_rows)} costliest nodes (estimated ms):\n" + tabulate(
            top_rows, headers=["name", "op", "forward", "input_grad", "weight_grad", "total"], tablefmt="simple"),
    ]) + "\n"


def rank_summary_text(rank) -> str:
    """One rank's layer-level view: compute per micro-batch and the bytes of each kind of collective."""
    p = rank.parallel
    units = [u for u in rank.units if u.block != "dp"]
    comm_bytes: dict[str, int] = {}
    for unit in rank.units:
        for phase in PHASES:
            for comm in unit.comms[phase]:
                key = f"{comm.type} over {comm.group}"
                comm_bytes[key] = comm_bytes.get(key, 0) + comm.bytes
    context = f", cp {p.cp} ({p.cp_comm})" if p.cp > 1 else ""
    lines = [["rank", f"stage {p.stage} of {p.pp}, layers {_ranges(rank.chunk_layers)}, "
                      f"tp {p.tp}{context}, dp {p.dp}, ep {p.ep}, sp {'on' if p.sp else 'off'}, zero {p.zero}"],
             ["world size", f"{p.world}"],
             ["units (layer-level rows)", f"{len(units)}"],
             *([f"{phase} estimated ms per micro-batch (this rank's layers)", f"{sum(u.ns(phase) for u in units) / 1e6:.3f}"]
               for phase in PHASES),
             [f"compute ms per step on this rank ({p.micro_batches} micro-batch{'es' if p.micro_batches > 1 else ''}; "
              "no pipeline bubble or collectives)",
              f"{p.micro_batches * sum(u.ns(phase) for u in units for phase in PHASES) / 1e6:.3f}"],
             ["pipeline send bytes", f"{rank.pp_comm_bytes:,}"]]
    lines += [[f"{key} bytes (dp: per step; others: per micro-batch)", f"{value:,}"]
              for key, value in sorted(comm_bytes.items())]
    return tabulate(lines, tablefmt="simple") + "\n"


def cluster_summary_text(cluster, fp8: bool = False) -> str:
    """The whole cluster's step: schedule, what the collectives expose, utilisation (over --dtype's dense peak,
    as Megatron-LM and NeMo count it for FP8 runs too)."""
    p = cluster.parallel
    schedule = "no pipeline" if p.pp == 1 else (f"1F1B over {p.pp} stages" if p.vpp == 1
                                                else f"interleaved 1F1B, {p.pp} stages x {p.vpp} chunks")
    exposed = cluster.exposed_ns
    gpus = f"{p.world} GPU{'s' if p.world > 1 else ''}"
    micro = f"{p.micro_batches} micro-batch{'es' if p.micro_batches > 1 else ''}"
    interval = cluster.step_interval_ns
    lines = [[f"cluster step ms ({gpus}, {schedule}, {micro})",
              f"{cluster.step_ns / 1e6:.3f}" + (f" (90 %: {interval[0] / 1e6:.3f}-{interval[1] / 1e6:.3f})"
                                               if interval else "")],
             ["pipeline bubble (busiest stage idle)", f"{100 * cluster.bubble_fraction:.1f}%"],
             ["exposed ms: tp / cp / ep collectives (blocking)",
              f"{exposed['tp'] / 1e6:.3f} / {exposed.get('cp', 0.0) / 1e6:.3f} / {exposed['ep'] / 1e6:.3f}"],
             ["exposed ms: dp gradient reduction / ZeRO parameter gather",
              f"{exposed['dp'] / 1e6:.3f} / {(exposed['zero_gather'] + exposed['zero3_gather']) / 1e6:.3f}"],
             ["backward slowed by overlapped dp buckets ms (SMs held by NCCL)",
              f"{exposed.get('dp_bucket_slowdown', 0.0) / 1e6:.3f}"],
             *([["ZeRO 3 copy kernels ms (FSDP2's copy-out after each gather, copy-in before each reduce-scatter"
                 + (", the gradients' sums between micro-batches)" if cluster.parallel.accumulate_unsharded else ")"),
                 f"{exposed['zero3_copies'] / 1e6:.3f}"]] if exposed.get("zero3_copies") else []),
             *([["GPU waiting on the host ms (its dispatch of eager ops, which --cuda-graphs removes; FSDP2's hooks; in the compute)",
                 f"{exposed['host'] / 1e6:.3f}"]] if exposed.get("host") else []),
             *([["exposed ms: activation copies to and from the host (compute waiting on them)",
                 f"{exposed['activation_offload'] / 1e6:.3f}"]] if exposed.get("activation_offload") else []),
             ["optimizer step ms (Adam, memory-bound)", f"{exposed['optimizer'] / 1e6:.3f}"],
             [(f"MFU / HFU (model / hardware FLOPs over the {_peak_name(cluster)} dense peak, "
               f"{cluster.peak_flops_per_s / 1e12:,.1f} TFLOP/s{_fp8_note(cluster, fp8)})" if cluster.profile is None or
               cluster.profile.arch else "FLOPs utilisation (model / hardware FLOPs over this CPU's measured "
                                         "GEMM rate, not a datasheet peak)"),
              f"{100 * cluster.mfu:.1f}% / {100 * cluster.hfu:.1f}%"],
             ["TFLOP/s per GPU (model FLOPs)", f"{cluster.tflops_per_gpu:.1f}"],
             ["tokens per s per GPU", f"{cluster.tokens_per_s_per_gpu:,.1f}"]]
    if cluster.gpu_speed_spread:
        slowest = cluster.slowest_gpu_step_ns
        lines.append([f"step ms at the slowest of the {gpus} (GPU speeds spread {100 * cluster.gpu_speed_spread:g} %)",
                      f"{slowest / 1e6:.3f} (+{100 * (slowest / cluster.step_ns - 1):.1f}%)"])
    return tabulate(lines, tablefmt="simple") + "\n"


def _peak_name(cluster) -> str:
    """The dtype whose dense peak the utilisation is over (--dtype's: bf16 for an --fp8 step too)."""
    rates = cluster.profile.matmul_flops_per_s if cluster.profile is not None else {}
    return next((name for name in ("bf16", "fp16", "fp32") if rates.get(name) == cluster.peak_flops_per_s), "--dtype")


def _fp8_note(cluster, fp8: bool) -> str:
    """With --fp8 the linear GEMMs run at the FP8 peak, so the utilisation over --dtype's peak can pass 100 %."""
    rates = cluster.profile.matmul_flops_per_s if cluster.profile is not None else {}
    return f"; --fp8 GEMMs run at up to {rates['fp8'] / 1e12:,.0f}" if fp8 and "fp8" in rates else ""


def memory_summary_text(memory, device_name: str, parallel=None) -> str:
    """The rank's memory at its peak, part by part, and whether it fits the device (``parallel``: its layout)."""
    from ..parallel.memory import describe_fit

    gib = 2 ** 30
    lines = [["parameters (GiB, this rank, after ZeRO)", f"{memory.parameters_bytes / gib:.3f}"],
             ["gradients", f"{memory.gradients_bytes / gib:.3f}"],
             ["optimizer states (Adam)", f"{memory.optimizer_bytes / gib:.3f}"],
             *([["gathered parameters kept forward to backward (" + (
                 f"--reshard-after-forward {ranks}: a 1/{ranks} shard)"
                 if parallel is not None and (ranks := parallel.post_forward_ranks)
                 else "--keep-gathered)"),
                 f"{memory.gathered_parameters_bytes / gib:.3f}"]] if memory.gathered_parameters_bytes else []),
             *([["gradients summed unsharded over micro-batches (--accumulate-unsharded)",
                 f"{memory.accumulated_gradients_bytes / gib:.3f}"]] if memory.accumulated_gradients_bytes else []),
             [f"saved activations ({memory.micro_batches_in_flight} micro-batch"
              f"{'es' if memory.micro_batches_in_flight > 1 else ''} in flight)",
              f"{memory.activations_bytes / gib:.3f}"],
             ["transient at the step's peak", f"{memory.transient_bytes / gib:.3f}"],
             ["peak memory per rank", describe_fit(memory, device_name)],
             *([["reserved by PyTorch's caching allocator (max_memory_reserved)",
                 f"{memory.reserved_peak_bytes / gib:.3f}"]] if memory.reserved_peak_bytes else [])]
    return tabulate(lines, tablefmt="simple") + "\n"


def measured_json_text(measurement) -> str:
    """measured.json: the rows of workload.json, each op with its measured median and spread."""
    def measured_op(op: OpCost) -> dict:
        document = {k: v for k, v in op_document(op).items() if k not in ("estimated_ns", "has_flop_rule")}
        timing = measurement.timings[op.fx_name]
        timed = {**document, "measured_ns": timing.median_ns, "measured_min_ns": timing.min_ns,
                 "measured_max_ns": timing.max_ns}
        if measurement.dispatch is not None:
            timed["measured_dispatch_ns"] = measurement.dispatch[op.fx_name].median_ns
        return timed

    document = {"settings": measurement.settings, "verification": measurement.verification,
                "totals": measured_totals(measurement),
                "rows": row_documents(measurement.workload, "measured", measurement.op_ns, measured_op)}
    return document_text(document)


def measured_totals(measurement) -> dict:
    totals = {f"{phase}_measured_ns": sum(map(measurement.op_ns, measurement.workload.ops(phase))) for phase in PHASES}
    totals["step_measured_ns"] = sum(totals.values())
    totals["eager_step_ns"] = measurement.eager_step_ns
    totals["step_peak_bytes"] = measurement.step_peak_bytes  # null on a CPU
    if measurement.dispatch is not None:
        totals["dispatch_sum_ns"] = sum(t.median_ns for t in measurement.dispatch.values())
    if measurement.kernel_check is not None:
        totals["kernel_check"] = measurement.kernel_check
    return totals


def measured_summary_text(measurement) -> str:
    totals = measured_totals(measurement)
    settings, check = measurement.settings, measurement.verification
    key_figures = [["model", f"{settings['model']} ({settings['weights']})"],
                   ["device", f"{settings['device']}, timed with {settings['timer']}"],
                   ["batch x seq, dtype", f"{settings['batch']} x {settings['seq']}, {settings['dtype']}"],
                   ["runs", f"{settings['warmup']} warm-up + {settings['repeat']} timed; medians per op"],
                   ["vs eager loss.backward()", f"loss {check['graph_loss']:.6f} = {check['eager_loss']:.6f}; "
                    f"largest gradient difference {check['max_gradient_relative_difference']:.1e} (relative)"]]
    phases = [[phase, f"{totals[f'{phase}_measured_ns'] / 1e6:.3f}"] for phase in PHASES]
    phases.append(["step (sum of ops)", f"{totals['step_measured_ns'] / 1e6:.3f}"])
    if "dispatch_sum_ns" in totals:
        phases.append(["host dispatch (sum of ops)", f"{totals['dispatch_sum_ns'] / 1e6:.3f}"])
    phases.append(["eager step (wall)", f"{totals['eager_step_ns'] / 1e6:.3f}"])
    check = totals.get("kernel_check")
    if check is not None:
        key_figures.append(["kernels tied to nodes", kernel_check_text(check)])
    parts = [tabulate(key_figures, tablefmt="simple"), tabulate(phases, headers=["phase", "measured_ms"],
                                                               tablefmt="simple")]
    warning = sum_of_ops_warning(totals)
    if warning:
        parts.append(warning)
    return "\n\n".join(parts) + "\n"


def kernel_check_text(check: dict) -> str:
    verdict = "agree" if check["agrees"] else "DO NOT agree"
    return (f"{check['node_kernel_ns'] / 1e6:.3f} ms of the profiler's {check['profiler_kernel_ns'] / 1e6:.3f} ms of "
            f"kernels per step ({100 * check['agreement']:.2f} %): {verdict} within {100 * check['tolerance']:g} %")


HOST_BOUND_SHARE = 0.05  # the host's pace costs the step more than 5 % over its kernels' sum


def host_bound_text(workload: Workload) -> str:
    """Whether the host (Python and the dispatcher issuing each eager op) or the GPU sets the pace of
    one micro-batch, from the ops' dispatch and kernel times; empty where no dispatch is modelled."""
    totals = workload.totals
    dispatch, kernels, step = totals["dispatch_sum_ns"], totals["kernel_sum_ns"], totals["step_estimated_ns"]
    if dispatch <= 0:
        return ""
    issued = sum(1 for op in workload.execution_order() if op.dispatch_ns > 0)
    per_phase = ", ".join(f"{ph} {sum(op.estimated_ns for op in workload.ops(ph)) / 1e6:.3f} / "
                          f"{sum(op.dispatch_ns for op in workload.ops(ph)) / 1e6:.3f}" for ph in PHASES)
    idle = (step - kernels) / step if step else 0.0
    verdict = (f"HOST-BOUND: the GPU waits on the host {100 * idle:.0f}% of the micro-batch"
               if idle > HOST_BOUND_SHARE else f"GPU-bound: the host keeps ahead ({100 * idle:.1f}% idle)")
    return (f"\n{verdict}. Kernels {kernels / 1e6:.3f} ms against the host's dispatch of {issued:,} ops "
            f"{dispatch / 1e6:.3f} ms ({dispatch / max(issued, 1) / 1e3:.1f} us each, the profile's host); "
            f"kernels / dispatch ms per phase: {per_phase}")


def _recompute_text(p: dict) -> str:
    text = {"none": "none: every saved activation kept", "selective": "selective: the attention core runs again "
            "in backward (Megatron-LM)", "op": "op: GEMM and attention outputs kept, every second GEMM and the "
            "rest run again (torchtitan)", "full": "full: each layer keeps its input and runs again in backward"}
    layers = "" if p["recompute"] == "none" or p["recompute_layers"] is None else (
        f", first {p['recompute_layers']} layers of each stage (model chunk with --vpp)")
    return text[p["recompute"]] + layers


def _ranges(ranges: list[range]) -> str:
    """Layer ranges as "0-5" or, for interleaved chunks, "0-2, 12-14"."""
    return ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in ranges if len(r))
