"""Writers: the per-node TSV (the reference layout), the full JSON, and the stdout summary."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from tabulate import tabulate

from .errors import UserError
from .workload import GradRow, NodeRow, Workload

TSV_COLUMNS = ["name", "forward_compute_time", "forward_comm_type", "forward_comm_size",
               "backward_compute_time", "backward_comm_type", "backward_comm_size",
               "weight_grad_compute_time", "weight_grad_comm_type", "weight_grad_comm_size", "process_time"]
GRAD_COMM_TYPE = "ALLREDUCE_ASYNC"
NO_COMM = "None"


def _ms(ns: float) -> str:
    return repr(ns / 1e6)


def tsv_text(workload: Workload, size_unit: str) -> str:
    lines = ["\t".join(TSV_COLUMNS)]
    for row in workload.rows:
        if isinstance(row, GradRow):
            size = row.bytes if size_unit == "bytes" else row.elements
            fields = [row.name, "0", NO_COMM, "0", "0", GRAD_COMM_TYPE, str(size), "0", NO_COMM, "0", "0"]
        else:
            fields = [row.name, _ms(row.forward.estimated_ns), NO_COMM, "0", _ms(row.backward_ns), NO_COMM, "0",
                      _ms(row.weight_grad_ns), NO_COMM, "0", "0"]
        lines.append("\t".join(fields))
    return "\n".join(lines) + "\n"


def json_text(workload: Workload, settings: dict, device_profile: dict) -> str:
    rows = []
    for row in workload.rows:
        if isinstance(row, GradRow):
            rows.append({"type": "gradient_allreduce", "comm_type": GRAD_COMM_TYPE, **asdict(row)})
        else:
            rows.append({"type": "node", "name": row.name, "module": row.module,
                         "forward_estimated_ns": row.forward.estimated_ns,
                         "input_grad_estimated_ns": row.backward_ns,
                         "weight_grad_estimated_ns": row.weight_grad_ns,
                         "forward": asdict(row.forward),
                         "input_grad": [asdict(op) for op in row.input_grad],
                         "weight_grad": [asdict(op) for op in row.weight_grad]})
    unruled = sorted({op.op for op in workload.ops() if not op.has_flop_rule})
    document = {"settings": settings, "device": device_profile, "totals": workload.totals(),
                "unruled_ops": unruled, "rows": rows}
    return json.dumps(document, indent=1) + "\n"


def prepare_out_dir(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".fxworkload-probe-")
        probe.close()
    except OSError as exc:
        raise UserError(f"cannot write to output folder {out} ({exc.strerror}); choose another --out") from None
    return out


def write_files(out: Path, texts: dict[str, str]) -> list[Path]:
    """Write every file to a temporary name first, then rename them all: no partial outputs."""
    temps = []
    try:
        for name, text in texts.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o666 & ~_umask())
            temps.append((Path(tmp), out / name))
        for tmp, final in temps:
            tmp.replace(final)
    except OSError as exc:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write to output folder {out} ({exc.strerror}); choose another --out") from None
    return [final for _, final in temps]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def summary_text(workload: Workload, settings: dict, top: int = 10) -> str:
    totals = workload.totals()
    tokens = settings["batch"] * settings["seq"]
    key_figures = [
        ["model", settings["model"]],
        ["device", settings["device"]],
        ["dtype / grad dtype", f"{settings['dtype']} / {settings['grad_dtype']}"],
        ["trainable parameters", f"{totals['parameters']:,}"],
        ["tokens per step (batch x seq)", f"{tokens:,} ({settings['batch']} x {settings['seq']})"],
        ["gradient all-reduce bytes", f"{totals['gradient_bytes']:,}"],
    ]
    phases = [[phase, f"{totals[f'{phase}_flops']:.4e}", f"{totals[f'{phase}_bytes']:.4e}",
               f"{totals[f'{phase}_estimated_ns'] / 1e6:.3f}"]
              for phase in ("forward", "input_grad", "weight_grad")]
    phases.append(["step", f"{sum(totals[f'{p}_flops'] for p in ('forward', 'input_grad', 'weight_grad')):.4e}",
                   f"{sum(totals[f'{p}_bytes'] for p in ('forward', 'input_grad', 'weight_grad')):.4e}",
                   f"{totals['step_estimated_ns'] / 1e6:.3f}"])
    costliest = sorted(workload.node_rows, key=lambda r: r.total_ns, reverse=True)[:top]
    top_rows = [[r.name, r.forward.op, f"{r.forward.estimated_ns / 1e6:.4f}", f"{r.backward_ns / 1e6:.4f}",
                 f"{r.weight_grad_ns / 1e6:.4f}", f"{r.total_ns / 1e6:.4f}"] for r in costliest]
    return "\n\n".join([
        tabulate(key_figures, tablefmt="simple"),
        tabulate(phases, headers=["phase", "flops", "bytes", "estimated_ms"], tablefmt="simple"),
        f"The {len(top_rows)} costliest nodes (estimated ms):\n" + tabulate(
            top_rows, headers=["name", "op", "forward", "input_grad", "weight_grad", "total"], tablefmt="simple"),
    ]) + "\n"
