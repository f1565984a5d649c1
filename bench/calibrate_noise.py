"""Does calibrate know when it measured noise? Two runs on the machine as it is, then one with a busy
loop per core beside it: each run's verdict (saved, or refused and why) and the GPT-2 step (batch 1,
seq 128) each saved profile estimates. Run it on an idle machine; about 2 minutes on 2 cores.

    .venv/bin/python bench/calibrate_noise.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FXWORKLOAD = [sys.executable, "-m", "fxworkload"]


def run(cache: Path, busy: bool) -> tuple[str, float | None]:
    env = {**os.environ, "FXWORKLOAD_CACHE_DIR": str(cache)}
    burners = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count() or 1)] if busy else []
    try:
        calibrated = subprocess.run([*FXWORKLOAD, "calibrate"], capture_output=True, text=True, env=env)
    finally:
        for burner in burners:
            burner.kill()
    verdict = calibrated.stderr.strip().splitlines()[-1] if calibrated.returncode else "saved"
    if calibrated.returncode:
        return verdict, None
    out = cache / "gpt2"
    extracted = subprocess.run([*FXWORKLOAD, "extract", "gpt2", "--seq", "128", "--device", "cpu", "--out", str(out)],
                               capture_output=True, text=True, env=env)
    assert extracted.returncode == 0, extracted.stderr
    return verdict, json.loads((out / "workload.json").read_text())["totals"]["step_estimated_ns"] / 1e6


def main() -> int:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, busy in (("quiet 1", False), ("quiet 2", False), ("busy", True)):
            verdict, step_ms = run(Path(tmp) / label.replace(" ", ""), busy)
            results[label] = {"verdict": verdict[:300], "gpt2_step_ms": step_ms}
            print(f"{label}: {verdict[:200]}; GPT-2 seq 128 step {step_ms if step_ms is None else f'{step_ms:.0f} ms'}",
                  flush=True)
    quiet = [r["gpt2_step_ms"] for k, r in results.items() if k.startswith("quiet") and r["gpt2_step_ms"]]
    summary = {"quiet_runs_agree_pct": round(100 * (max(quiet) / min(quiet) - 1), 1) if len(quiet) == 2 else None,
               "busy": "refused" if results["busy"]["gpt2_step_ms"] is None else
               f"{100 * (results['busy']['gpt2_step_ms'] / min(quiet) - 1):+.1f}% vs quiet" if quiet else "saved"}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
