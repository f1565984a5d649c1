"""Command line: ``fxworkload extract | models | devices``."""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from .errors import UserError

DEFAULT_DEVICE = "a100-80gb"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage block
        raise UserError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxworkload", description="Turn a HuggingFace model into a per-node training workload.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    extract = commands.add_parser("extract", help="capture one training step and write the workload tables")
    extract.add_argument("model", help="built-in name (see 'fxworkload models'), checkpoint folder, or config.json")
    extract.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    extract.add_argument("--seq", type=int, default=None,
                         help="sequence length (default min(1024, max_position_embeddings))")
    extract.add_argument("--dtype", default="fp32", help="parameter and activation dtype: fp32, bf16, fp16 (default fp32)")
    extract.add_argument("--grad-dtype", default=None, help="gradient dtype for all-reduce sizes (default: --dtype)")
    extract.add_argument("--device", default=DEFAULT_DEVICE, help=f"device profile (default {DEFAULT_DEVICE}; see 'fxworkload devices')")
    extract.add_argument("--size-unit", choices=["bytes", "elements"], default="bytes",
                         help="unit of the gradient all-reduce sizes in workload.tsv (default bytes)")
    extract.add_argument("--out", type=Path, default=None, help="output folder (default outputs/<model>/)")
    extract.add_argument("--top", type=int, default=10, help="costliest nodes listed in the summary (default 10)")
    extract.set_defaults(func=run_extract)

    commands.add_parser("models", help="list the built-in models").set_defaults(func=run_models)
    commands.add_parser("devices", help="list the device profiles").set_defaults(func=run_devices)
    return parser


def run_extract(args) -> int:
    from .extract import extract
    from .output import json_text, prepare_out_dir, summary_text, tsv_text, write_files

    result = extract(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, grad_dtype=args.grad_dtype,
                     device=args.device, size_unit=args.size_unit, progress=True)
    out = prepare_out_dir(args.out or Path("outputs") / result.spec.name)
    written = write_files(out, {
        "workload.tsv": tsv_text(result.workload, args.size_unit),
        "workload.json": json_text(result.workload, result.settings, asdict(result.device)),
    })
    print(summary_text(result.workload, result.settings, top=args.top), end="")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def run_models(args) -> int:
    import torch
    from tabulate import tabulate

    from . import models

    rows = []
    for name in models.builtin_names():
        spec = models.resolve(name)
        config = spec.config
        module = models.build_meta_model(spec, torch.float32)
        rows.append([name, config.model_type, spec.task, config.num_hidden_layers, config.hidden_size,
                     config.num_attention_heads, f"{models.trainable_parameter_count(module):,}"])
    print(tabulate(rows, headers=["name", "model_type", "task", "layers", "hidden", "heads", "parameters"]))
    return 0


def run_devices(args) -> int:
    from tabulate import tabulate

    from . import devices

    rows = []
    for name in devices.names():
        d = devices.load(name)
        rows.append([name, d.description, *(f"{d.matmul_flops_per_s[k] / 1e12:.1f}" for k in ("fp32", "bf16", "fp16")),
                     f"{d.vector_flops_per_s / 1e12:.2f}", f"{d.memory_bytes_per_s / 1e9:.0f}",
                     d.compute_efficiency, d.memory_efficiency, f"{d.kernel_launch_ns / 1e3:.2f}"])
    print(tabulate(rows, headers=["name", "description", "fp32_tflops", "bf16_tflops", "fp16_tflops",
                                  "vector_tflops", "memory_gb_per_s", "e_compute", "e_memory", "launch_us"]))
    print(f"\nSources of every figure: the JSON files in {devices.DATA_DIR}/ (cpu: measured, cached in {devices.cache_dir()}/)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UserError as exc:
        print(f"fxworkload: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fxworkload: interrupted", file=sys.stderr)
        return 130
