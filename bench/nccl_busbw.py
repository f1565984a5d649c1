"""Our collectives' bus bandwidth beside published nccl-tests figures, each with its source.

    .venv/bin/python bench/nccl_busbw.py

For each row: the device profile (its topology block: NVLink, NICs, NVLink SHARP), the collective, the ranks
and the nodes (NVLink domains) they span, the message size, and the bus bandwidth nccl-tests printed for it
(``busbw``: algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and reduce-scatter). Ours is the time
cluster/network.py gives (NCCL's tuner: the fastest algorithm and protocol, or the one the row forced with
NCCL_ALGO), converted the same way. Sources are GitHub threads of NVIDIA/nccl and NVIDIA/nccl-tests where
NCCL's developers state the figure a platform should reach, or users post their nccl-tests output; the
figure is what the thread gives, rounded as it gives it. None of these figures was used to set a constant:
the constants are tuning.cc's, the NVLink efficiency one maintainer statement (370 of 450 GB/s on H100) and
the NIC efficiency another (46-48 GB/s per 400 Gb/s NIC); rows that quote those same statements are marked.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxworkload.cluster.network import choose  # noqa: E402
from fxworkload.cost import devices  # noqa: E402

GIB = 1 << 30
# device, collective, ranks, nodes, bytes, forced algorithms, published busbw GB/s, source, used to set a constant
ROWS = [
    ("h100-sxm", "ALLREDUCE", 8, 1, 8 * GIB, (), 479.4,
     "NVIDIA/nccl-tests#347: 8 H100 (one node), all_reduce_perf at 8 GiB, busbw 479.41 (out-of-place)", False),
    ("h100-sxm", "ALLREDUCE", 8, 1, 8 * GIB, (), 480.0,
     "NVIDIA/nccl-tests#212 (S. Jeaugey, NCCL): 'On 8 GPUs, you should reach a peak busBw of ~480GB/s' (NVLS)", False),
    ("h100-sxm", "ALLREDUCE", 8, 1, 8 * GIB, ("ring",), 370.0,
     "NVIDIA/nccl-tests#212: 'effective NVLink bandwidth of 370GB/s ... with NCCL_ALGO=RING'", True),
    ("h100-sxm", "ALLGATHER", 8, 1, 16 * GIB, (), 360.0,
     "NVIDIA/nccl-tests#326 (S. Jeaugey): all_gather on 8 H100 at ~360 GB/s 'is exactly what we'd expect'", False),
    ("h100-sxm", "REDUCESCATTER", 8, 1, 8 * GIB, (), 360.0,
     "NVIDIA/nccl#1281: nccl-tests on H100, reduce_scatter busbw 360 GB/s", False),
    ("h100-sxm", "ALLGATHER", 8, 1, 8 * GIB, (), 350.0,
     "NVIDIA/nccl#1281: nccl-tests on H100, all_gather busbw 350 GB/s", False),
    ("h200", "ALLREDUCE", 8, 1, 4 * GIB, (), 475.0,
     "NVIDIA/nccl-tests#272: 8 H200 (NVLink4), all_reduce_perf up to 4 GiB, peak busbw 475 GB/s", False),
    ("h100-sxm", "ALLREDUCE", 16, 2, 16 * GIB, (), 470.0,
     "NVIDIA/nccl-tests#309: 2 HGX H100 nodes, 16 GPU-NIC pairs (400G), all_reduce_perf_mpi to 16 GiB: 470 GB/s", False),
    ("h100-sxm", "ALLREDUCE", 32, 4, 16 * GIB, (), 365.84,
     "NVIDIA/nccl-tests#309: 4 HGX H100 nodes, 32 GPU-NIC pairs, all_reduce_perf_mpi to 16 GiB: max busbw 365.84", False),
    ("b200", "ALLREDUCE", 8, 1, 8 * GIB, (), 830.0,
     "NVIDIA/nccl#1807: all_reduce_perf on 8 B200 (one node), 'Ours is 830+' GB/s", False),
    ("a100-80gb", "ALLREDUCE", 8, 1, 4 * GIB, (), 232.54,
     "NVIDIA/nccl-tests#175: one A100 node, all_reduce_perf -b 8 -e 4G -g 8: 232.54 GB/s", False),
    ("a100-80gb", "ALLREDUCE", 16, 2, 8 * GIB, (), 192.0,
     "NVIDIA/nccl#812, quoted in #1576 (NCCL team): 'On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and "
     "we measure 192GB/s AllReduce BusBW' (two nodes taken)", False),
]


# small messages, compared by time: device, collective, ranks, nodes, bytes, forced algorithms, published us, source
SMALL = [
    ("h20", "ALLREDUCE", 16, 2, 4, ("nvls_tree",), 47.54,
     "NVIDIA/nccl#1244: 2 HGX H20 nodes, 16 GPUs, 16 NDR NICs, NCCL 2.21.5, NCCL_ALGO=NVLSTree, 4 B: 47.54 us"),
]


# Reduce-scatter bus bandwidth by node count on HGX H100 clusters, as one user reported it (NVIDIA/nccl#1229,
# 2024-03-16: "when I run GPU cluster(H100) by 4/8/16/32/64/128 nodes ... the bus BW of Reduce-scatter is
# Linear decline, just like 360,345,320,300,280,260"); eight GPUs a node. The thread gives neither the message
# size nor the NCCL version, so ours is printed at the sizes nccl-tests runs commonly end at, and no row is
# scored: what it checks is the slope over 32-1,024 GPUs, which ring latency (nsteps x per-step latency,
# tuning.cc) sets here.
SCALING = {"source": "NVIDIA/nccl#1229 (H100, reduce_scatter, size not stated)", "device": "h100-sxm",
           "collective": "REDUCESCATTER", "busbw_by_nodes": {4: 360.0, 8: 345.0, 16: 320.0, 32: 300.0, 64: 280.0,
                                                            128: 260.0}}
SCALING_SIZES = (1 * GIB, 2 * GIB, 4 * GIB, 8 * GIB)


def bus_factor(collective: str, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks if collective == "ALLREDUCE" else (ranks - 1) / ranks


def header(figure: str) -> str:
    return (f"{'device':<10} {'collective':<13} {'ranks':>5} {'nodes':>5} {'bytes':>7} {'algorithm':<17} "
            f"{figure:>9} {'published':>9} {'error':>8}  source")


def line(row: tuple, size: str, call, ours: float, published: float, note: str = "") -> str:
    device, collective, ranks, nodes, _, forced = row[:6]
    return (f"{device:<10} {collective:<13} {ranks:>5} {nodes:>5} {size:>7} "
            f"{call.algorithm + '/' + call.protocol + (' (forced)' if forced else ''):<17} {ours:>9.1f} "
            f"{published:>9.1f} {ours / published - 1:>+8.1%}  {note}")


def main() -> int:
    print(header("ours GB/s"))
    errors = []
    for row in ROWS:
        device, collective, ranks, nodes, nbytes, forced, published, source, constant = row
        call = choose(collective, nbytes, ranks, nodes, devices.load(device).network(), forced)
        ours = nbytes / call.time_ns * bus_factor(collective, ranks)  # bytes/ns = GB/s
        if not constant:
            errors.append(abs(ours / published - 1))
        print(line(row, f"{nbytes / GIB:.0f}Gi", call, ours, published,
                   source + (" [sets a constant]" if constant else "")))
    print(f"\n{len(errors)} rows not used for any constant: median |error| {statistics.median(errors):.1%}, "
          f"max {max(errors):.1%}")
    print(f"\nsmall messages (time):\n{header('ours us')}")
    for row in SMALL:
        device, collective, ranks, nodes, nbytes, forced, published_us, source = row
        call = choose(collective, nbytes, ranks, nodes, devices.load(device).network(), forced)
        print(line(row, str(nbytes), call, call.time_ns / 1e3, published_us, source))
    scaling()
    return 0


def scaling() -> None:
    """Ours beside NVIDIA/nccl#1229's reduce-scatter bus bandwidths from 4 to 128 nodes, at each candidate size."""
    network = devices.load(SCALING["device"]).network()
    print(f"\nby node count, {SCALING['source']}: ours GB/s (error) at each size")
    print(f"{'ranks':>5} {'nodes':>5} {'published':>9}  " + "  ".join(f"{s // GIB:>3} GiB{'':>8}" for s in SCALING_SIZES))
    for nodes, published in SCALING["busbw_by_nodes"].items():
        ranks = 8 * nodes
        cells = []
        for nbytes in SCALING_SIZES:
            call = choose(SCALING["collective"], nbytes, ranks, nodes, network, ())
            ours = nbytes / call.time_ns * bus_factor(SCALING["collective"], ranks)
            cells.append(f"{ours:>6.1f} ({ours / published - 1:>+6.1%})")
        print(f"{ranks:>5} {nodes:>5} {published:>9.1f}  " + "  ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
