"""``plan.txt``: the layouts that fit, fastest first, why the best wins, and why the others were dropped.

Imports no torch: a plan read from the cache prints without it.
"""

from __future__ import annotations

from tabulate import tabulate


def offloaded(row: dict) -> bool:
    """A plan row that keeps something on the host: its optimizer, or some layers' activations."""
    return bool(row.get("optimizer_offload") or row.get("activation_offload_layers"))


def fsdp2_text(row: dict) -> str:
    """A ZeRO 3 row's FSDP2 options as plan.txt names them: what its forward does with the gathered parameters
    (reshard_after_forward: "reshard", "keep", "reshard N") and, where set, "summed" (accumulate_unsharded);
    "-" for a row without ZeRO 3."""
    if row.get("zero") != 3:
        return "-"
    reshard = row.get("reshard_after_forward", True)
    named = "reshard" if reshard is True else "keep" if reshard is False else f"reshard {reshard}"
    return named + (", summed" if row.get("accumulate_unsharded") else "")


def plan_text(result: dict, top: int = 10) -> str:
    ranked = result["ranked"] if top <= 0 else result["ranked"][:top]
    several = "," in result["device"]
    rows = [[i + 1, *([r["device"]] if several else []), r["tp"], r["cp"], r["pp"], r["vpp"], r["dp"], r["ep"],
             "on" if r["sp"] else "off", r["zero"], fsdp2_text(r), _recompute(r), r["micro_batch"], r["micro_batches"],
             f"{r['step_ms']:.1f}", f"{100 * r['mfu']:.1f}%", f"{r['tflops_per_gpu']:.0f}",
             f"{r['tokens_per_s_per_gpu']:,.0f}", f"{100 * r['bubble']:.1f}%",
             f"{r['exposed_gather_ms']:.1f}" if r["zero"] == 3 else "-",
             f"{r['peak_bytes'] / 2 ** 30:.1f}" + ("*" if offloaded(r) else ""),
             "~" if r.get("overlaps_best") else ""] for i, r in enumerate(ranked)]
    precision = f"{result['dtype']}{' + fp8 GEMMs' if result.get('fp8') else ''}"
    kernels = f" (attention: {','.join(result['sdpa_backends'])})" if result.get("sdpa_backends") else ""
    head = (f"{result['model']} on {result['gpus']} x {result['device']}, global batch {result['global_batch']} x seq "
            f"{result['seq']}, {precision}, stack {result['stack']}{kernels}, cp {','.join(map(str, result['cp']))}: "
            f"{result['evaluated']:,} layouts evaluated from {result['shapes']} captured rank shapes, "
            f"{len(result['ranked']):,} fit")
    dropped = "\n".join(f"dropped: {count:,} {why}" for why, count in result["dropped"].items() if count)
    close = sum(1 for r in result["ranked"] if r.get("overlaps_best"))
    if result["ranked"] and close > 1:
        best = result["ranked"][0]
        dropped = (f"~best: {close - 1:,} more layouts' 90 % intervals overlap the best's "
                   f"({best['step_low_ms']:.0f}-{best['step_high_ms']:.0f} ms): the estimates cannot order them\n"
                   + dropped)
    why = "\n".join([*(f"why: {line}" for line in result.get("why", [])), *result.get("offload", [])])
    table = tabulate(rows, headers=["#", *(["device"] if several else []), "tp", "cp", "pp", "vpp", "dp", "ep", "sp",
                                    "zero", "fsdp2", "recompute", "mbs", "mb", "step_ms", "mfu", "tflops", "tok/s/gpu",
                                    "bubble", "zero3_gather_ms", "peak_gib", "~best"], tablefmt="simple")
    parts = [head, table if rows else "no layout fits in memory", why, dropped]
    return "\n\n".join(part for part in parts if part) + "\n"


def _recompute(row: dict) -> str:
    layers = row.get("recompute_layers")
    return row["recompute"] + (f" ({layers} layers)" if layers else "")
