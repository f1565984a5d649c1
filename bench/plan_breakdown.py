"""Where a cold plan's CPU goes: the 70B plan's rank shapes evaluated one after another in this process
(an empty cache, the cyclic collector off as in plan's workers), with the wall time of each stage.

    .venv/bin/python bench/plan_breakdown.py

Stages: the traces (torch's make_fx over fake tensors, a 2- and a 3-layer copy per shape), the rest of
each shape's capture (its tables, costs and transforms), recomputation's tables, each layout's memory,
and the cluster steps of the layouts that fit. Measure on an idle machine.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import tempfile
import time

from tabulate import tabulate


def main() -> None:
    os.environ["FXWORKLOAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxworkload-plan-breakdown-")
    from fxworkload import pipeline, plan
    from fxworkload.parallel import recompute
    from fxworkload.workload import layers

    gc.collect()
    gc.disable()
    facts = plan._facts("llama-3-70b", "bf16")
    profile = plan._plan_device("h100-sxm", False, "bf16")
    run = plan.Run("llama-3-70b", gpus=1024, global_batch=1024, seq=4096)
    groups, _ = plan.candidate_layouts(run, facts, profile.gpus_per_node, profile.network().nvlink_domain_gpus)
    execution, system = plan._execution(run), plan.Systems((profile,)).system("h100-sxm")
    spent: collections.Counter = collections.Counter()
    for module, name in ((layers, "capture_training_step"), (pipeline, "extract"), (recompute, "with_recompute"),
                         (plan, "_peak_bytes"), (plan, "_step")):
        setattr(module, name, _timed(getattr(module, name), name, spent))
    started = time.perf_counter()
    for shape, layouts in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        plan._evaluate(("llama-3-70b", ("h100-sxm", shape), layouts, execution, system))
    total = time.perf_counter() - started
    stages = {"traces (make_fx)": spent["capture_training_step"],
              "rest of the captures": spent["extract"] - spent["capture_training_step"],
              "recomputation's tables": spent["with_recompute"], "memory": spent["_peak_bytes"],
              "cluster steps (layouts that fit)": spent["_step"]}
    stages["other"] = total - sum(stages.values())
    print(tabulate([[name, f"{s:.2f}", f"{100 * s / total:.0f} %"] for name, s in stages.items()]
                   + [["total", f"{total:.2f}", "100 %"]], headers=["stage", "s", "share"], tablefmt="github"))
    print(f"\n{len(groups)} shapes, {sum(map(len, groups.values())):,} layouts, one process", file=sys.stderr)


def _timed(function, name: str, spent: collections.Counter):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started
    return timed


if __name__ == "__main__":
    main()
