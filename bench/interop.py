"""Our workload files run through the simulators they are written for: SimAI 1.6 and ASTRA-sim 2.0.

For each layout this writes every pipeline stage's SimAI file and the Chakra traces of every rank
(with their communicator-group file), runs SimAI's analytical simulator on each stage's file and
ASTRA-sim's analytical backend on the traces (through the ``run.sh`` scripts of
``../shared/simulators``), and prints:

- SimAI's total compute against our per-step compute of that rank (the worst stage): the files
  must carry the step's compute, every micro-batch of it;
- SimAI's total time (the slowest stage) against our cluster step: SimAI adds its own bubble
  formula and collective times and overlaps nothing of the data-parallel reduction;
- ASTRA-sim's slowest rank against our cluster step: ASTRA-sim runs the dependency graph with its
  own collective times.

Each simulator gets the device's own network (its topology block, docs/network.md): SimAI its NVLink and
NIC bandwidths as NCCL reaches them (``NVLINK_GBPS``, ``NIC_GBPS``: 370 and 47 GB/s on an H100) and its
GPUs per server; ASTRA-sim the same NVLink domain as a switch and, for layouts wider than one domain, a
second switch dimension joining the domains rail by rail (GPU i of every node: a rail-optimised fabric,
each GPU on its own NIC), each dimension at half its per-direction bandwidth (ASTRA-sim's ring moves data
both ways round the ring at once) and link latency 936.25 ns (ASTRA-sim's own HGX-H100-validated network),
with ring collectives in every dimension. The bench prints one 100 MB all-reduce over 8 ranks under both
models to show they agree. The last line is a JSON summary.

    .venv/bin/python bench/interop.py ../shared/simulators/simai/run.sh ../shared/simulators/astra-sim/run.sh
    .venv/bin/python bench/interop.py SIMAI_RUN ASTRA_RUN --only gpt2-mb8,llama-8b-full
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fxworkload.capture.trace import FORWARD, INPUT_GRAD, PHASES  # noqa: E402
from fxworkload.cluster.network import NIC_EFFICIENCY, choose, nvlink_bus_bytes_per_s  # noqa: E402
from fxworkload.cluster.step import blocking_tp_copies_ns, exposed_by_ns  # noqa: E402
from fxworkload.cost.devices import load  # noqa: E402
from fxworkload.formats import simai  # noqa: E402
from fxworkload.formats.chakra import GROUPS_FILE, chakra_files  # noqa: E402
from fxworkload.parallel.layout import Parallel  # noqa: E402
from fxworkload.pipeline import extract  # noqa: E402

DEVICE = "h100-sxm"
ASTRA_LATENCY_NS = 936.25  # astra-sim examples/network/analytical/HGX-H100-validated.yml
# name: (model, seq, micro-batch size, dtype, layout)
LAYOUTS = {
    "gpt2-mb1": ("gpt2", 1024, 8, "bf16", Parallel(tp=2, dp=4, vocab_multiple=128)),
    "gpt2-mb8": ("gpt2", 1024, 4, "bf16", Parallel(tp=2, pp=2, dp=2, micro_batches=8, vocab_multiple=128)),
    "gpt2-vpp2": ("gpt2", 1024, 4, "bf16", Parallel(tp=2, pp=2, dp=2, vpp=2, micro_batches=8, vocab_multiple=128)),
    "gpt2-zero3": ("gpt2", 1024, 4, "bf16", Parallel(dp=8, micro_batches=2, zero=3)),
    # FSDP2 without gradient sync until the last micro-batch: one reduce-scatter a unit a step, the sums as compute
    "gpt2-zero3-summed": ("gpt2", 1024, 4, "bf16", Parallel(dp=8, micro_batches=4, zero=3, accumulate_unsharded=True)),
    # FSDP2's reshard_after_forward=8 on 16 ranks: the backward gathers over each node's 8 (Chakra's groups list
    # them; SimAI's workload names no group smaller than DP, so only ASTRA-sim runs it)
    "gpt2-zero3-reshard8": ("gpt2", 1024, 4, "bf16", Parallel(dp=16, micro_batches=2, zero=3, reshard_after_forward=8)),
    "llama-8b-full": ("llama-3-8b", 4096, 1, "bf16", Parallel(tp=2, pp=2, dp=2, sp=True, micro_batches=8, zero=1,
                                                            recompute="full")),
    "llama-8b-tp8": ("llama-3-8b", 8192, 1, "bf16", Parallel(tp=8, sp=True, micro_batches=4)),
    # each TP collective pipelined with its own GEMMs (--tp-comm-overlap): Chakra's first chunk, then the rest beside
    # a node of those GEMMs; SimAI's file folds what they expose into compute
    "llama-8b-tp8-overlap": ("llama-3-8b", 8192, 1, "bf16", Parallel(tp=8, sp=True, micro_batches=4,
                                                                     tp_comm_overlap=True)),
    # half the layers' activations on the host: the waits ride as compute in both files (cluster/activation_offload.py)
    "llama-8b-offload": ("llama-3-8b", 8192, 1, "bf16", Parallel(tp=2, sp=True, dp=4, micro_batches=2, zero=1,
                                                                activation_offload_layers=16)),
    "mixtral-ep2": ("mixtral-8x7b", 4096, 1, "bf16", Parallel(tp=2, pp=2, dp=2, ep=2, sp=True, micro_batches=4,
                                                             zero=1)),
    # DeepEP's kernels: both files carry each as an all-to-all of its per-rank bytes (one copy per token and rank)
    "mixtral-ep2-deepep": ("mixtral-8x7b", 4096, 1, "bf16", Parallel(tp=2, pp=2, dp=2, ep=2, sp=True, micro_batches=4,
                                                                    zero=1, ep_comm="deepep")),
    "llama-8b-cp-ring": ("llama-3-8b", 8192, 1, "bf16", Parallel(tp=2, cp=2, pp=2, sp=True, micro_batches=4, zero=1)),
    "llama-8b-cp-allgather": ("llama-3-8b", 8192, 1, "bf16", Parallel(tp=2, cp=4, sp=True, micro_batches=2,
                                                                        cp_comm="allgather")),
    # across nodes: ZeRO 3 on 32 ranks (4 nodes, 8 ranks a node in every data-parallel group) and a 128-rank
    # Megatron layout (16 nodes; its data-parallel groups have 2 ranks a node)
    "llama-8b-zero3-32": ("llama-3-8b", 4096, 1, "bf16", Parallel(dp=32, micro_batches=2, zero=3)),
    "llama-8b-128": ("llama-3-8b", 4096, 1, "bf16", Parallel(tp=4, pp=2, dp=16, sp=True, micro_batches=8, zero=1)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("simai_run", help="SimAI's run.sh (../shared/simulators/simai/run.sh)")
    parser.add_argument("astra_run", help="ASTRA-sim's run.sh (../shared/simulators/astra-sim/run.sh)")
    parser.add_argument("--only", help="comma-separated layout names (default: all)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(LAYOUTS)
    rows, summary = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"ASTRA-sim network check: {ring_check(Path(tmp), args.astra_run)}", flush=True)
        for name in names:
            started = time.perf_counter()
            result = run_layout(name, Path(tmp) / name, args.simai_run, args.astra_run)
            rows.append([name, result["layout"], _ms(result["ours_compute_ms"]), _ms(result["simai_compute_ms"]),
                         _pct(result["simai_compute_err"]), f"{result['ours_step_ms']:.2f}",
                         _ms(result["simai_total_ms"]), _pct(result["simai_total_err"]),
                         f"{result['astra_ms']:.2f}", _pct(result["astra_err"]), "yes" if result["trace_ends"] else "NO"])
            summary[name] = {k: v for k, v in result.items() if k != "layout"}
            print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["layout", "parallel", "our compute ms (rank)", "SimAI comp ms", "diff",
                                  "our cluster step ms", "SimAI total ms", "diff", "ASTRA-sim ms", "diff",
                                  "trace ends at step"], tablefmt="github"))
    worst = {key: max(abs(s[key]) for s in summary.values() if s[key] is not None)
             for key in ("simai_compute_err", "simai_total_err", "astra_err")}
    print(json.dumps({"layouts": len(summary), "worst_pct": {k: round(100 * v, 2) for k, v in worst.items()},
                      "traces_end_at_step": all(s["trace_ends"] for s in summary.values()),
                      "per_layout": {n: {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}
                                     for n, s in summary.items()}}, sort_keys=True))
    return 0


def run_layout(name: str, folder: Path, simai_run: str, astra_run: str) -> dict:
    model, seq, batch, dtype, parallel = LAYOUTS[name]
    first = extract(model, batch=batch, seq=seq, dtype=dtype, device=DEVICE, parallel=parallel)
    cluster = first.cluster
    simai_totals, compute_errors = [], []
    for stage in range(parallel.pp if not parallel.post_forward_ranks else 0):  # SimAI names no smaller group
        result = first if stage == 0 else extract(model, batch=batch, seq=seq, dtype=dtype, device=DEVICE,
                                                  parallel=replace(parallel, stage=stage))
        path = folder / f"stage{stage}.simai.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(simai.text(simai.from_rank(result.rank, result.device, result.cluster)))
        comp_us, total_us = run_simai(simai_run, path, parallel.world, result.device)
        summary = result.cluster.devices[stage]
        ours_us = (parallel.micro_batches * sum(u.ns(ph) for u in result.rank.units for ph in PHASES)
                   + summary.zero3_copy_ns + summary.offload_wait_ns + summary.host_wait_ns
                   + parallel.micro_batches * (summary.blocking_comm_ns.get("cp", 0.0)
                                               + folded_tp_ns(result.rank.units, result.rank.parallel,
                                                              result.device))) / 1e3
        # FSDP2's copies, the waits on activation copies and on the host's dispatch are compute in the files,
        # as the step runs them; so is what CP's exchanges and the overlapped TP collectives expose, and torch's copies
        # around the blocking ones, every micro-batch (SimAI has no CP group and would block on an overlapped
        # collective: formats/simai.py folds them)
        compute_errors.append((comp_us / ours_us - 1, ours_us, comp_us))
        simai_totals.append(total_us)
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, content in chakra_files(cluster).items():
        target = folder / file_name
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    astra_ns = run_astra(astra_run, folder / "workload", parallel.world, folder / GROUPS_FILE, first.device)
    worst = max(compute_errors, key=lambda e: abs(e[0])) if compute_errors else (None, None, None)
    trace = json.loads(first.files(["chrome-trace"])["workload.trace.json"])
    cluster_end_us = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] >= 1000)
    step_ms = cluster.step_ns / 1e6
    simai_total_ms = max(simai_totals) / 1e3 if simai_totals else None
    return {"layout": _describe(parallel, batch, seq), "ours_compute_ms": worst[1] and worst[1] / 1e3,
            "simai_compute_ms": worst[2] and worst[2] / 1e3, "simai_compute_err": worst[0], "ours_step_ms": step_ms,
            "simai_total_ms": simai_total_ms, "simai_total_err": simai_total_ms and simai_total_ms / step_ms - 1,
            "astra_ms": astra_ns / 1e6, "astra_err": astra_ns / 1e6 / step_ms - 1,
            "trace_ends": abs(cluster_end_us * 1e3 - cluster.step_ns) <= 1.0}


def folded_tp_ns(units, parallel, device) -> float:
    """What one micro-batch's overlapped TP collectives expose (--tp-comm-overlap), with AsyncTP's own kernels, and
    the copies torch makes around the blocking ones (a sequence on dim 1): the files carry both as compute."""
    return sum(exposed_by_ns(u, phase, [c for c in u.comms[phase] if c.group == "tp" and c.overlapped], parallel,
                             device) + blocking_tp_copies_ns(u, phase, device)
               for u in units for phase in (FORWARD, INPUT_GRAD))


def run_simai(run_sh: str, path: Path, world: int, device) -> tuple[float, float]:
    """(total comp, Total time) in microseconds from SimAI's end-to-end summary, on the device's own links."""
    topology = device.network()
    env = {**os.environ, "NVLINK_GBPS": f"{nvlink_bus_bytes_per_s(topology) / 1e9:.1f}",
           "NIC_GBPS": f"{topology.nic_share_bytes_per_s * NIC_EFFICIENCY / 1e9:.1f}"}
    out = subprocess.run([run_sh, str(path), str(world), str(min(world, topology.nvlink_domain_gpus))],
                         capture_output=True, text=True, timeout=900, env=env)
    lines = out.stdout.splitlines()
    if out.returncode or len(lines) < 2:
        raise SystemExit(f"SimAI failed on {path}:\n{out.stdout}{out.stderr}")
    keys = [k.strip() for k in lines[0].split(",")]
    values = [v.strip().split(" ")[0] for v in lines[1].split(",")]
    row = dict(zip(keys, values))
    return float(row["total comp"]), float(row["Total time"])


def run_astra(run_sh: str, prefix: Path, npus: int, groups: Path, device) -> float:
    """The slowest rank's finish time in ns. Run as run.sh runs the simulator, with the device's network and a
    system file giving ring collectives in each of its dimensions (run.sh's file names one)."""
    here = Path(run_sh).resolve().parent
    network, system = prefix.parent / "network.yml", prefix.parent / "system.json"
    text, dimensions = network_yml(npus, device)
    network.write_text(text)
    config = json.loads((here / "examples/system/native_collectives/HGX-H100-validated.json").read_text())
    for key in ("all-reduce-implementation", "all-gather-implementation", "reduce-scatter-implementation",
                "all-to-all-implementation"):
        config[key] = ["ring"] * dimensions
    system.write_text(json.dumps(config))
    command = [str(here / "AstraSim_Analytical_Congestion_Unaware"), f"--workload-configuration={prefix}",
               f"--system-configuration={system}",
               f"--remote-memory-configuration={here / 'examples/remote_memory/analytical/no_memory_expansion.json'}",
               f"--network-configuration={network}", f"--comm-group-configuration={groups}"]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=prefix.parent)
    out = subprocess.CompletedProcess(ran.args, ran.returncode, "\n".join(
        f"rank {m.group(1)}: {m.group(2)} ns" for m in re.finditer(r"sys\[(\d+)\] finished, (\d+) cycles", ran.stdout)),
        ran.stderr + ran.stdout[-2000:])
    finished = [int(m.group(1)) for m in re.finditer(r"rank \d+: (\d+) ns", out.stdout)]
    if out.returncode or len(finished) != npus:
        raise SystemExit(f"ASTRA-sim failed on {prefix}:\n{out.stdout}{out.stderr}")
    return max(finished)


def network_yml(npus: int, device) -> tuple[str, int]:
    """ASTRA-sim's network for the device's topology, and its dimension count: the NVLink domain as one switch,
    and past it one switch per rail joining the domains (each GPU's NIC share)."""
    topology = device.network()
    domain = min(npus, topology.nvlink_domain_gpus)
    nvlink = nvlink_bus_bytes_per_s(topology) / 2 / 1e9
    if npus <= domain:
        return (f"topology: [ Switch ]\nnpus_count: [ {npus} ]\nbandwidth: [ {nvlink:.2f} ]  # GB/s\n"
                f"latency: [ {ASTRA_LATENCY_NS} ]  # ns\n"), 1
    nic = topology.nic_share_bytes_per_s * NIC_EFFICIENCY / 2 / 1e9
    return (f"topology: [ Switch, Switch ]\nnpus_count: [ {domain}, {npus // domain} ]\n"
            f"bandwidth: [ {nvlink:.2f}, {nic:.2f} ]  # GB/s\nlatency: [ {ASTRA_LATENCY_NS}, {ASTRA_LATENCY_NS} ]  # ns\n"), 2


def ring_check(folder: Path, astra_run: str) -> str:
    """One 100 MB all-reduce over 8 ranks in ASTRA-sim (our network file) and in NCCL's model (network.py)."""
    from chakra.schema.protobuf import et_def_pb2 as pb
    from chakra.src.third_party.utils.protolib import encodeMessage

    folder.mkdir(parents=True, exist_ok=True)
    size, ranks = 100_000_000, 8
    for rank in range(ranks):
        with open(folder / f"ring.{rank}.et", "wb") as handle:
            encodeMessage(handle, pb.GlobalMetadata(version="0.0.4"))
            node = pb.Node(id=0, name="all-reduce", type=pb.COMM_COLL_NODE)
            node.attr.extend([pb.AttributeProto(name="is_cpu_op", bool_val=False),
                              pb.AttributeProto(name="comm_type", int64_val=pb.ALL_REDUCE),
                              pb.AttributeProto(name="comm_size", int64_val=size),
                              pb.AttributeProto(name="pg_name", string_val="1")])
            encodeMessage(handle, node)
    (folder / "ring.groups.json").write_text(json.dumps({"1": list(range(ranks))}))
    device = load(DEVICE)
    astra_us = run_astra(astra_run, folder / "ring", ranks, folder / "ring.groups.json", device) / 1e3
    ours_us = choose("ALLREDUCE", size, ranks, 1, device.network(), ("ring",)).time_ns / 1e3
    chosen = choose("ALLREDUCE", size, ranks, 1, device.network())
    return (f"100 MB all-reduce over 8 ranks: ASTRA-sim {astra_us:.0f} us, NCCL's model {ours_us:.0f} us as a ring "
            f"({chosen.time_ns / 1e3:.0f} us as NCCL's tuner runs it: {chosen.algorithm}/{chosen.protocol})")


def _describe(p: Parallel, batch: int, seq: int) -> str:
    parts = [f"tp{p.tp}{'+sp' if p.sp else ''}", *([f"cp{p.cp} ({p.cp_comm})"] if p.cp > 1 else []),
             f"pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp > 1 else ""), f"dp{p.dp}"]
    parts += [f"ep{p.ep}" + (f" ({p.ep_comm})" if p.ep_comm != "alltoall" else "")] if p.ep > 1 else []
    parts += [f"zero{p.zero}"] if p.zero else []
    parts += [f"recompute {p.recompute}"] if p.recompute != "none" else []
    parts += [f"{p.activation_offload_layers} layers' activations on the host"] if p.activation_offload_layers else []
    return " ".join(parts) + f", {p.micro_batches}x{batch}x{seq}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def _ms(x: float | None) -> str:
    return "n/a (SimAI)" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
