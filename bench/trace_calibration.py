"""A profile fitted to one model's profiler trace, judged on other models' traces (held out).

For each model: an eager training step under torch.profiler (after one warm-up step; --steps
ProfilerSteps, each op's median), the workload extracted on the CPU dispatch, and the share of
the trace's op time tied to graph nodes. Then for each model the trace is fitted
(`calibrate --from`) and every model's step is estimated with that profile: the diagonal is the
fitted step itself, the rest is held out.

    .venv/bin/python bench/trace_calibration.py                 # tiny GPT-2, Llama, Mixtral on this CPU
    .venv/bin/python bench/trace_calibration.py --models gpt2 --batch 2 --seq 128 --full
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from tabulate import tabulate
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fxworkload.cost import devices  # noqa: E402
from fxworkload.measure.calibrate import fit_from_measured  # noqa: E402
from fxworkload.measure.compare import compare, overall  # noqa: E402
from fxworkload.measure.profiler_trace import measured_document  # noqa: E402
from fxworkload.pipeline import extract  # noqa: E402

# The test suite's tiny configs (tests/conftest.py), so that this script needs no test import.
TINY = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=64,
                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=112, vocab_size=96, max_position_embeddings=64),
    "mixtral": dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96, vocab_size=96, max_position_embeddings=64,
                    num_local_experts=4, num_experts_per_tok=2),
}


def config_for(name: str, full: bool):
    if full:
        return AutoConfig.from_pretrained(Path(__file__).resolve().parent.parent / "models" / name)
    settings = dict(TINY[name])
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def trace_step(config, batch: int, seq: int, steps: int, path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=schedule, on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(1 + steps):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            prof.step()


def workload(config, batch: int, seq: int, device: str, folder: Path) -> dict:
    config.save_pretrained(folder)
    result = extract(str(folder), batch=batch, seq=seq, trace_on="cpu", device=device, use_cache=False)
    return json.loads(result.files(["tables"])["workload.json"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,llama,mixtral")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per trace (each op's median)")
    parser.add_argument("--full", action="store_true", help="the shipped configs in models/, not the tiny ones")
    args = parser.parse_args()
    names = args.models.split(",")
    root = Path(tempfile.mkdtemp(prefix="fxworkload-trace-bench-"))
    os.environ["FXWORKLOAD_CACHE_DIR"] = str(root / "cache")  # the fitted profiles stay out of the user's cache
    traces, measured, tied = {}, {}, []
    for name in names:
        config = config_for(name, args.full)
        traces[name] = root / f"{name}.json"
        trace_step(config, args.batch, args.seq, args.steps, traces[name])
        estimated = workload(config, args.batch, args.seq, "cpu", root / name)
        measured[name] = measured_document(traces[name], estimated)
        trace = measured[name]["trace"]
        tied.append([name, trace["steps"], f"{trace['total_ns'] / 1e6:.3f}", f"{100 * trace['attributed_fraction']:.1f}%"])
    print(f"batch {args.batch} x seq {args.seq}, {torch.get_num_threads()} threads, traces in {root}\n")
    print(tabulate(tied, headers=["model", "steps", "op_ms_per_step", "tied_to_nodes"], tablefmt="simple"))
    rows = []
    for fitted_on in names:
        profile = fit_from_measured(measured[fitted_on], f"bench-trace-{fitted_on}", traces[fitted_on].name)
        devices.save(replace(profile), devices.measured_path(profile.name))
        row = [fitted_on]
        for name in names:
            estimated = workload(config_for(name, args.full), args.batch, args.seq, profile.name, root / f"{name}-est")
            step = next(s for s in overall(compare(estimated, measured[name])) if s["span"] == "step")
            row.append(f"{100 * step['error']:+.1f}%" + (" (fitted)" if name == fitted_on else ""))
        rows.append(row)
    print("\nstep error (estimated - measured) / measured, by the trace the profile was fitted on:\n")
    print(tabulate(rows, headers=["fitted on", *names], tablefmt="simple"))


if __name__ == "__main__":
    main()
