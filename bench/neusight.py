"""Fetch-and-convert: NeuSight's per-GPU GEMM measurements as a small, versioned table the project can fit on.

NeuSight (sitar-lab/NeuSight, ASPLOS 2025) measured single ``torch.bmm`` and ``torch.nn.Linear`` calls on many
GPUs. How they were timed (neusight/Dataset/collect.py): fp32 tensors (TF32 off: ``allow_tf32`` False, and
torch's matmul default), each call alone between two CUDA events, 25 calls of which the 5 fastest are
averaged (warm L2: the same inputs every call), the kernel names from one profiled call. A linear is
``Linear(N, K, bias=True)`` on a (B, M, N) input; a bmm is (B, M, N) @ (B, N, K): 2·B·M·N·K FLOPs either way.
One call between events includes the launch gap, so a tiny GEMM's time is mostly that gap.

This script reads a NeuSight checkout (a work tree, or a bare git directory such as `fetch` leaves) and
writes ``bench/data/neusight-gemm.csv.gz``: NeuSight's *test* op sets (``scripts/asplos/data/dataset/test``,
``dataset_amd/test/collect``), one row per call, with the commit it came from on the first line; and
``bench/data/neusight-memory.csv.gz``: its memory-bound test sets (elementwise, LayerNorm, softmax on seven
NVIDIA GPUs), timed the same way. NeuSight's
whole-model labels (``label/``, ``summary/``) are not read: they are a held-out check, not data to fit.

    .venv/bin/python bench/neusight.py /path/to/NeuSight     # a checkout or a bare clone
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "neusight-gemm.csv.gz"
MEMORY_OUT = OUT.with_name("neusight-memory.csv.gz")
SOURCES = ["scripts/asplos/data/dataset/test/linear.csv", "scripts/asplos/data/dataset/test/bmm.csv",
           "scripts/asplos/data/dataset_amd/test/collect/linear/p2.4.1/AMD Instinct MI100.csv",
           "scripts/asplos/data/dataset_amd/test/collect/linear/p2.4.1/AMD Instinct MI210.csv",
           "scripts/asplos/data/dataset_amd/test/collect/bmm/p2.4.1/AMD Instinct MI100.csv",
           "scripts/asplos/data/dataset_amd/test/collect/bmm/p2.4.1/AMD Instinct MI210.csv"]
COLUMNS = ["gpu", "op", "batch", "m", "n", "k", "latency_ms", "kernel"]
# Memory-bound ops on a (B, H) fp32 tensor (neusight/Dataset/collect.py): add, mul, pow, div of two tensors;
# addu, mulu, powu, divu with a scalar; relu, gelu, tanh; LayerNorm(H); softmax over H. NVIDIA GPUs only.
MEMORY_SOURCES = [f"scripts/asplos/data/dataset/test/{name}.csv" for name in ("elem", "ln", "softmax")]
MEMORY_COLUMNS = ["gpu", "op", "batch", "hidden", "latency_ms", "kernel"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def read(repo: Path, path: str) -> str:
    if (repo / path).is_file():
        return (repo / path).read_text()
    return git(repo, "show", f"HEAD:{path}")


def rows(text: str):
    for record in csv.DictReader(io.StringIO(text)):
        yield [record["Device"].strip(), record["OPName"], int(record["B"]), int(record["M"]), int(record["N"]),
               int(record["K"]), f"{float(record['Latency']):.6g}", record["Kernel Name"]]


def memory_rows(text: str):
    for record in csv.DictReader(io.StringIO(text)):
        yield [record["Device"].strip(), record["OPName"], int(record["B"]), int(record["H"]),
               f"{float(record['Latency']):.6g}", record["Kernel Name"]]


def write(path: Path, commit: str, sources: list[str], columns: list[str], table: list[list]) -> None:
    buffer = io.StringIO()
    buffer.write(f"# sitar-lab/NeuSight@{commit}: {', '.join(sources)}; bench/neusight.py\n")
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(path, "wb", mtime=0) as handle:  # mtime 0: the same input writes the same bytes
        handle.write(buffer.getvalue().encode())
    gpus = sorted({row[0] for row in table})
    print(f"{len(table)} rows of {len(gpus)} GPUs ({', '.join(gpus)}) from {commit[:12]} -> {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", type=Path, help="a NeuSight checkout or bare git directory")
    args = parser.parse_args()
    commit = git(args.repo, "rev-parse", "HEAD").strip()
    write(OUT, commit, SOURCES, COLUMNS, sorted(row for path in SOURCES for row in rows(read(args.repo, path))))
    write(MEMORY_OUT, commit, MEMORY_SOURCES, MEMORY_COLUMNS,
          sorted(row for path in MEMORY_SOURCES for row in memory_rows(read(args.repo, path))))
    return 0


def load(path: Path = OUT) -> list[dict]:
    """The converted table: one dict per call, numbers as numbers."""
    with gzip.open(path, "rt") as handle:
        lines = [line for line in handle if not line.startswith("#")]
    out = []
    for record in csv.DictReader(lines):
        out.append({**record, **{k: int(v) for k, v in record.items() if k in ("batch", "m", "n", "k", "hidden")},
                    "latency_ms": float(record["latency_ms"])})
    return out


if __name__ == "__main__":
    sys.exit(main())
