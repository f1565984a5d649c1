"""``plan.png`` (plan --plot): every layout that fits, step time against peak memory, the Pareto front (no
layout both faster and smaller), the best marked with its 90 % interval. matplotlib is imported only here."""

from __future__ import annotations

from ..figures import png_bytes, pyplot
from .plan_text import offloaded


def pareto_front(ranked: list[dict]) -> list[dict]:
    """The layouts no other beats on both step time and peak memory, smallest memory first."""
    front, fastest = [], float("inf")
    for row in sorted(ranked, key=lambda r: (r["peak_bytes"], r["step_ms"])):
        if row["step_ms"] < fastest:
            front.append(row)
            fastest = row["step_ms"]
    return front


def plan_png(result: dict) -> bytes:
    plt = pyplot()
    ranked = result["ranked"]
    figure, axes = plt.subplots(figsize=(7.5, 5.5), dpi=120)
    on_gpu = [r for r in ranked if not offloaded(r)]
    on_host = [r for r in ranked if offloaded(r)]
    for rows, label, marker in ((on_gpu, "layouts that fit", "o"), (on_host, "optimizer or activations on the host", "x")):
        if rows:
            axes.scatter([r["peak_bytes"] / 2 ** 30 for r in rows], [r["step_ms"] / 1e3 for r in rows], s=9,
                         alpha=0.5, marker=marker, label=f"{label} ({len(rows):,})")
    front = pareto_front(ranked)
    if front:  # a staircase: from each front layout's memory on, no layout is faster until the next one's
        right = max(r["peak_bytes"] for r in ranked) / 2 ** 30
        axes.plot([r["peak_bytes"] / 2 ** 30 for r in front] + [right], [r["step_ms"] / 1e3 for r in front]
                  + [front[-1]["step_ms"] / 1e3], color="black", linewidth=1.0, drawstyle="steps-post",
                  label=f"Pareto front ({len(front)})")
    if ranked:
        best = ranked[0]
        low, high = best["step_low_ms"] / 1e3, best["step_high_ms"] / 1e3
        step = best["step_ms"] / 1e3
        axes.errorbar([best["peak_bytes"] / 2 ** 30], [step], yerr=[[step - low], [high - step]], fmt="*",
                      color="red", markersize=12, capsize=4,
                      label=f"best: tp {best['tp']} cp {best['cp']} pp {best['pp']} dp {best['dp']} zero {best['zero']}")
    axes.set_xlabel("peak memory per GPU (GiB)")
    axes.set_ylabel("step (s)")
    axes.set_title(f"{result['model']} on {result['gpus']:,} x {result['device']}, global batch {result['global_batch']} "
                   f"x seq {result['seq']}", fontsize=10)
    return png_bytes(figure, axes)
