"""Estimated against measured kernel times, for every row of a kernel data folder (issue 12's figures).

    .venv/bin/python bench/kernels.py ../shared/gpu-kernels/h100-sxm --device h100-sxm
    .venv/bin/python bench/kernels.py DATA_DIR --device h100-sxm --write-fit   # refit, ship the parameters

Each row of gemm.csv, sdpa.csv and vector.csv is traced through extract's own capture and costing
path (see fxworkload/measure/kernels.py) and estimated with the device profile's GPU model. Tables
per class give the median and p90 absolute error and the signed median. The held-out check fits the
model's free parameters on half of the rows (every other row of a seeded shuffle) and reports the
other half. The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from tabulate import tabulate

from fxworkload.cost import devices
from fxworkload.cost.devices import FIT_DIR
from fxworkload.errors import UserError
from fxworkload.pipeline import trace_target
from fxworkload.measure import kernels


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--write-fit", action="store_true",
                        help="fit on all rows and write the parameters to fxworkload/cost/fits/<device>.json")
    args = parser.parse_args()
    try:
        device = devices.load(args.device)
        if not device.sm_count:
            raise UserError(f"device '{args.device}' is not a GPU profile (no sm_count)")
        samples = kernels.samples(args.data_dir, trace_target("auto", device))
    except UserError as exc:
        print(f"bench/kernels.py: error: {exc}", file=sys.stderr)
        return 2
    if args.write_fit:
        model = kernels.fit(samples, device)
        path = FIT_DIR / f"{args.device}.json"
        path.write_text(json.dumps({"source": f"fitted by bench/kernels.py --write-fit on every row of {args.data_dir.name}/ "
                                              "(gemm.csv, sdpa.csv, vector.csv: kernels measured on one H100 80GB HBM3, "
                                              "PyTorch 2.11+cu130, shared/gpu-kernels/README.md)",
                                    "parameters": model.as_dict()}, indent=2) + "\n")
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
    order = list(range(len(samples)))
    random.Random(0).shuffle(order)
    train = [samples[i] for i in order[::2]]
    test = [samples[i] for i in order[1::2]]
    held_device = kernels.with_model(device, kernels.fit(train, device))
    held_gemm = [e for s, e in zip(test, kernels.relative_errors(test, held_device)) if s.family == "gemm"]
    held_all = kernels.relative_errors(test, held_device)
    print("\nfitted on half the rows, checked on the other half:")
    for family in ("gemm", "sdpa", "vector"):
        errs = [e for s, e in zip(test, held_all) if s.family == family]
        print(f"  {family:7s} {len(errs):5d} rows  median {_stats(errs)[0]:.1f}%  p90 {_stats(errs)[1]:.1f}%")
    summary = {"gemm_aligned_median_pct": round(_stats(aligned)[0], 1),
               "gemm_unaligned_median_pct": round(_stats(unaligned)[0], 1),
               "gemm_p90_pct": round(_stats(gemm_errors)[1], 1),
               "sdpa_worst_class_median_pct": round(max(sdpa.values()), 1),
               "vector_median_pct": round(_stats(by_family["vector"][1])[0], 1),
               "holdout_gemm_median_pct": round(_stats(held_gemm)[0], 1)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
