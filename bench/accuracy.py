"""How close are the estimates to measured times on this machine? (issue 3's figures)

For each case: calibrate a profile of this machine (unless --skip-calibrate), extract the workload
costed on it (and on any --also datasheet profile), profile the same step op by op here, and
compare. Prints the end-to-end step error (target: within 15%) and the median per-op error of
matmul ops (target: within 25%).

    .venv/bin/python bench/accuracy.py                          # gpt2, CPU, B=1 S=128 and B=2 S=256
    python3 bench/accuracy.py --on cuda --cases 8x1024 --dtype bf16 --also h100-sxm
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fxworkload.cost import devices  # noqa: E402
from fxworkload.measure.calibrate import measure, say  # noqa: E402
from fxworkload.measure.compare import compare, kind_summary, overall, time_weighted_error  # noqa: E402
from fxworkload.pipeline import extract  # noqa: E402
from fxworkload.formats.tables import json_text, measured_json_text  # noqa: E402
from fxworkload.measure.profile import profile  # noqa: E402

STEP_TARGET, MATMUL_TARGET = 0.15, 0.25


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--cases", default="1x128,2x256", help="batch x seq, comma-separated")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--on", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--also", default="", help="datasheet profiles to compare too, comma-separated")
    parser.add_argument("--skip-calibrate", action="store_true", help="use the profile already saved")
    args = parser.parse_args()

    measured_name = f"bench-{args.on}"  # its own profile: the user's 'cpu' calibration is left as it is
    if not args.skip_calibrate:
        start = time.perf_counter()
        devices.save(measure(args.on, measured_name, progress=say), devices.measured_path(measured_name))
        say(f"calibrated in {time.perf_counter() - start:.1f} s")
    rows = []
    for case in args.cases.split(","):
        batch, seq = (int(x) for x in case.split("x"))
        measured = profile(args.model, batch=batch, seq=seq, dtype=args.dtype, on=args.on, repeat=args.repeat,
                           progress=True)
        measured_document = json.loads(measured_json_text(measured))
        for device in [measured_name, *filter(None, args.also.split(","))]:
            estimated = extract(args.model, batch=batch, seq=seq, dtype=args.dtype, device=device, trace_on=args.on)
            comparison = compare(json.loads(json_text(estimated.workload, estimated.settings, {})), measured_document)
            step = next(s for s in overall(comparison) if s["span"] == "step")
            matmul = next(k for k in kind_summary(comparison) if k["kind"] == "matmul")
            rows.append([f"{args.model} B={batch} S={seq} {args.dtype}", device,
                         f"{step['estimated_ns'] / 1e6:.2f}", f"{step['measured_ns'] / 1e6:.2f}",
                         f"{100 * step['error']:+.1f}%", "yes" if abs(step["error"]) <= STEP_TARGET else "NO",
                         f"{100 * matmul['median_abs_error']:.1f}%",
                         "yes" if matmul["median_abs_error"] <= MATMUL_TARGET else "NO",
                         f"{100 * time_weighted_error(comparison):.1f}%", f"{measured.eager_step_ns / 1e6:.2f}"])
    print(f"measured on {measured.settings['device']}")
    print(tabulate(rows, headers=["case", "profile", "estimated_step_ms", "measured_step_ms", "step_error",
                                  "within_15%", "matmul_median_abs_error", "within_25%", "time_weighted_error",
                                  "eager_step_ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
