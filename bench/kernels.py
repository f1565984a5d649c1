"""Estimated against measured kernel times, for every row of a kernel data folder (issue 12's figures).

    .venv/bin/python bench/kernels.py ../shared/gpu-kernels/h100-sxm --device h100-sxm
    .venv/bin/python bench/kernels.py DATA_DIR --device h100-sxm --write-fit   # refit, ship the parameters
    .venv/bin/python bench/kernels.py --leave-one-gpu-out   # ten GPUs, each scored by a fit on the others (bench/gpus.py)

Each row of gemm.csv, sdpa.csv and vector.csv is traced through extract's own capture and costing
path (see fxworkload/measure/kernels.py) and estimated with the device profile's GPU model. Tables
per class give the median and p90 absolute error and the signed median. The held-out check fits the
model's free parameters on half of the rows (every other row of a seeded shuffle) and reports the
other half; the held-out regimes fit on one regime (16-bit or fp32 rows, small or large tensors) and
check on the other, as a GPU's workloads the fit never saw would. The last line is one JSON object
with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from tabulate import tabulate

from fxworkload.cost import devices
from fxworkload.cost.devices import FIT_DIR
from fxworkload.cost.gpu import GpuModel
from fxworkload.errors import UserError
from fxworkload.pipeline import trace_target
from fxworkload.measure import kernels


def _written(model, flash_from_paper: bool) -> dict:
    """The parameters a refit writes: those it fitted (and FlashAttention-2's, from the paper's speeds), and any
    other that is not GpuModel's default; the rest are left to the defaults, whose comments give their sources,
    so that the file does not present a default as a fit of these data."""
    fitted = {name for names in kernels.FAMILY_PARAMETERS.values() for name in names}
    if flash_from_paper:
        fitted |= {"flash_forward_efficiency", "flash_backward_efficiency"}
    defaults = GpuModel().as_dict()
    return {name: value for name, value in model.as_dict().items() if name in fitted or value != defaults[name]}


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def _stats(errors: list[float]) -> tuple[float, float, float]:
    absolute = [abs(e) for e in errors]
    return 100 * statistics.median(absolute), 100 * _p90(absolute), 100 * statistics.median(errors)


def _table(title: str, samples, errors) -> dict:
    groups = defaultdict(list)
    for sample, error in zip(samples, errors):
        groups[sample.group].append(error)
    rows = [[group, len(e), *(f"{x:+.1f}" if i == 2 else f"{x:.1f}" for i, x in enumerate(_stats(e)))]
            for group, e in sorted(groups.items())]
    print(f"\n{title}")
    print(tabulate(rows, headers=["class", "rows", "median_abs_%", "p90_abs_%", "signed_median_%"]))
    return {group: _stats(e)[0] for group, e in groups.items()}


# --write-fit descends from the shipped fit until no step lowers the loss by more than a millionth (a fixed
# point), so that refitting the same data writes the same file, byte for byte.
REFIT_ROUNDS = 40
REFIT_MIN_GAIN = 1e-6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path, nargs="?")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--leave-one-gpu-out", action="store_true",
                        help="score every GPU of NeuSight's data with the cross-GPU terms fitted on the others "
                             "(bench/gpus.py; no data_dir needed)")
    parser.add_argument("--write-fit", action="store_true",
                        help="fit on all rows and write the parameters to fxworkload/cost/fits/<device>.json")
    args = parser.parse_args()
    if args.leave_one_gpu_out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpus  # bench/gpus.py: the cross-GPU data and fit
        return gpus.main([])
    if args.data_dir is None:
        parser.error("give the kernel data folder (or --leave-one-gpu-out)")
    try:
        device = devices.load(args.device)
        if not device.sm_count:
            raise UserError(f"device '{args.device}' is not a GPU profile (no sm_count)")
        samples = kernels.samples(args.data_dir, trace_target("auto", device))
    except UserError as exc:
        print(f"bench/kernels.py: error: {exc}", file=sys.stderr)
        return 2
    if args.write_fit:
        model = kernels.fit(samples, device, rounds=REFIT_ROUNDS, min_gain=REFIT_MIN_GAIN)
        flash_from_paper = not any(s.group.startswith("flash") for s in samples)
        if flash_from_paper:  # no flash kernel measured (an H100 runs cuDNN): FlashAttention-2's published speeds
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import attention  # bench/attention.py

            model = replace(model, **attention.fit_flash(kernels.with_model(device, model)))
        train, test = _halves(samples)
        half_fit = kernels.fit(train, device, rounds=REFIT_ROUNDS, min_gain=REFIT_MIN_GAIN)
        intervals = kernels.error_intervals(test, kernels.with_model(device, half_fit))
        path = FIT_DIR / f"{args.device}.json"
        path.write_text(json.dumps({"source": f"fitted by bench/kernels.py --write-fit on every row of {args.data_dir.name}/ "
                                              "(gemm.csv, sdpa.csv, vector.csv: kernels measured on one H100 80GB HBM3, "
                                              "PyTorch 2.11+cu130, shared/gpu-kernels/README.md)" + (
                                                  "; flash_forward/backward_efficiency on FlashAttention-2's H100 speeds "
                                                  "in the FlashAttention-3 paper (bench/attention.py --fit)"
                                                  if flash_from_paper else ""),
                                    "parameters": _written(model, flash_from_paper),
                                    "host": "host_dispatch_ns and host_output_ns are the host CPU's beside the "
                                            "measured H100 (back-to-back eager calls; its CPU model is not recorded "
                                            "with the data): a GPU profile assumes that host",
                                    "intervals_source": "per family, the 5th and 95th percentiles over its classes of "
                                                        "each class's median measured / estimated on the held-out "
                                                        "half (fitted on the other half)",
                                    "intervals": intervals}, indent=2) + "\n")
        print(f"wrote {path}")
        devices._model.cache_clear()
        device = devices.load(args.device)

    errors = kernels.relative_errors(samples, device)
    by_family = defaultdict(lambda: ([], []))
    for sample, error in zip(samples, errors):
        by_family[sample.family][0].append(sample)
        by_family[sample.family][1].append(error)
    print(f"{len(samples)} measured times from {args.data_dir}, estimated on '{args.device}' "
          f"(fit: {device.gpu_model_fit or 'inline'})")
    _table("GEMM (torch.mm), by alignment and layout", *by_family["gemm"])
    sdpa = _table("SDPA by backend, dtype, mask, dropout and direction", *by_family["sdpa"])
    _table("memory-bound ops", *by_family["vector"])

    gemm_samples, gemm_errors = by_family["gemm"]
    aligned = [e for s, e in zip(gemm_samples, gemm_errors) if s.group.startswith("aligned")]
    unaligned = [e for s, e in zip(gemm_samples, gemm_errors) if s.group.startswith("unaligned")]
    train, test = _halves(samples)
    held_device = kernels.with_model(device, kernels.fit(train, device))
    held_gemm = [e for s, e in zip(test, kernels.relative_errors(test, held_device)) if s.family == "gemm"]
    held_all = kernels.relative_errors(test, held_device)
    print("\nfitted on half the rows, checked on the other half:")
    for family in ("gemm", "sdpa", "vector"):
        errs = [e for s, e in zip(test, held_all) if s.family == family]
        print(f"  {family:7s} {len(errs):5d} rows  median {_stats(errs)[0]:.1f}%  p90 {_stats(errs)[1]:.1f}%")
    regimes = _held_out_regimes(samples, device, args.data_dir)
    summary = {"gemm_aligned_median_pct": round(_stats(aligned)[0], 1),
               "gemm_unaligned_median_pct": round(_stats(unaligned)[0], 1),
               "gemm_p90_pct": round(_stats(gemm_errors)[1], 1),
               "sdpa_worst_class_median_pct": round(max(sdpa.values()), 1),
               "vector_median_pct": round(_stats(by_family["vector"][1])[0], 1),
               "holdout_gemm_median_pct": round(_stats(held_gemm)[0], 1),
               "regime_worst_median_pct": round(max(regimes.values()), 1)}
    print(json.dumps(summary))
    return 0


def _halves(samples):
    """Every other row of a seeded shuffle: the fit's half and the held-out half."""
    order = list(range(len(samples)))
    random.Random(kernels.HOLDOUT_SEED).shuffle(order)
    return [samples[i] for i in order[::2]], [samples[i] for i in order[1::2]]


def _dtype(sample) -> str:
    return next((d for op in sample.ops for d in op.input_dtypes if d in ("float32", "bfloat16", "float16")), "float32")


def _working_set_bytes(sample) -> int:
    return sum(op.bytes for op in sample.ops)


# Regimes a new GPU's workloads could sit in that the fit never saw: each is fitted on one side and
# checked on the other (the rows of kernels the fitted side also has).
REGIMES = {
    "16-bit -> fp32": lambda s: _dtype(s) != "float32",
    "fp32 -> 16-bit": lambda s: _dtype(s) == "float32",
    "small -> large (64 MiB moved)": lambda s: _working_set_bytes(s) < 64 << 20,
    "large -> small": lambda s: _working_set_bytes(s) >= 64 << 20,
}


def _kernel(sample) -> tuple[str, str]:
    """What a row's parameters belong to: its family, and for attention its backend (cuDNN's are
    fitted on 16-bit rows only: fp32 runs other kernels, so it cannot stand for them)."""
    return sample.family, sample.group.split()[0] if sample.family == "sdpa" else ""


def _held_out_regimes(samples, device, data_dir) -> dict[str, float]:
    """Median absolute error per regime and family, fitted on the regime's rows, checked on the rest."""
    print("\nheld-out regimes (fitted on the rows before the arrow, checked on the others):")
    rows, worst = [], {}
    for name, fitted_on in REGIMES.items():
        train = [x for x in samples if fitted_on(x)]
        seen = {_kernel(x) for x in train}
        test = [x for x in samples if not fitted_on(x) and _kernel(x) in seen]
        held = kernels.with_model(device, kernels.fit(train, device))
        errors = kernels.relative_errors(test, held)
        for family in ("gemm", "sdpa", "vector"):
            mine = [e for x, e in zip(test, errors) if x.family == family]
            if mine and any(x.family == family for x in train):
                median, p90, signed = _stats(mine)
                rows.append([name, family, len(mine), f"{median:.1f}", f"{p90:.1f}", f"{signed:+.1f}"])
                worst[f"{name} {family}"] = median
    print(tabulate(rows, headers=["regime", "family", "rows", "median_abs_%", "p90_abs_%", "signed_median_%"]))
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
