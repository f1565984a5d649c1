"""Which architectures can fxworkload extract? One tiny config per model type (issue 5's table).

Every model type in transformers' causal-LM registry (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), plus the
masked-LM family we ship (bert), is built from its config class's defaults with at most 4 layers
(every layer count in it, sub-configs and per-layer lists and tables too; 4 keeps one full-
attention layer in hybrids that interleave 3 linear-attention layers with it; the widths stay
the defaults, which cost nothing on the meta device and keep every dimension consistent), with
is_decoder set where the config has it (these are causal LMs), and the few sizes some default
configs leave None though every checkpoint sets them (head_dim, KV heads, expert counts) filled
with the usual values; saved with save_pretrained and extracted (B=1, S=32) in this process.
Prints one line per architecture (ok, or the one-line reason) and the share ok.

    .venv/bin/python bench/coverage.py [--markdown] [--only llama,gpt2] [--timeout 120]
"""

from __future__ import annotations

import argparse
import math
import re
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import CONFIG_MAPPING, PretrainedConfig  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from fxworkload.errors import UserError  # noqa: E402
from fxworkload.pipeline import extract  # noqa: E402

SHIPPED_OTHER_FAMILIES = {"bert": "BertForMaskedLM"}
LAYER_CUTS = (2, 4, None)  # tried in turn; None keeps the default layer count
LAYER_COUNTS = re.compile(r"^(num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers|encoder_layers|"
                          r"num_decoder_layers|num_encoder_layers|num_blocks)$")


USUAL_VALUES = {"num_experts_per_tok": 2, "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1}


def complete(config: PretrainedConfig) -> PretrainedConfig:
    """Fill the sizes a default config leaves None (a checkpoint's config always sets them)."""
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            complete(value)
        elif value is None and name in USUAL_VALUES:
            setattr(config, name, USUAL_VALUES[name])
    settings = vars(config)  # not getattr: per-layer configs refuse global reads of per-layer sizes
    heads = settings.get("num_attention_heads")
    if "head_dim" in settings and settings["head_dim"] is None and heads:
        config.head_dim = config.hidden_size // heads
    if "num_key_value_heads" in settings and settings["num_key_value_heads"] is None and heads:
        config.num_key_value_heads = heads
    return config


def tiny(config: PretrainedConfig, layers: int | None) -> PretrainedConfig:
    """The config with every layer count cut to ``layers``, per-layer lists cut to match, sub-configs too."""
    if layers is None:
        return config
    counts = {name: value for name, value in vars(config).items()
              if LAYER_COUNTS.match(name) and isinstance(value, int) and value > layers}
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            tiny(value, layers)
        elif name in counts:
            setattr(config, name, layers)
        elif isinstance(value, list) and len(value) in counts.values():
            setattr(config, name, value[:layers])
    return config


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def check(model_type: str, folder: Path, timeout: int) -> tuple[str, int, float, str]:
    """The first layer cut that extracts, or the reason the last one failed."""
    for layers in LAYER_CUTS:
        status, ops, seconds = _check(model_type, folder / str(layers) / model_type, timeout, layers)
        if status.startswith("ok"):
            break
    return status, ops, seconds, "default" if layers is None else str(layers)


def _check(model_type: str, folder: Path, timeout: int, layers: int | None) -> tuple[str, int, float]:
    architectures = [SHIPPED_OTHER_FAMILIES[model_type]] if model_type in SHIPPED_OTHER_FAMILIES else None
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        config = tiny(complete(CONFIG_MAPPING[model_type]()), layers)
        if architectures:
            config.architectures = architectures
        elif hasattr(config, "is_decoder"):
            config.is_decoder = True
        config.save_pretrained(folder)
        seq = math.prod(getattr(config, "axial_pos_shape", None) or (32,))  # Reformer wants exactly this
        result = extract(str(folder), seq=seq, use_cache=False)
        unruled = sorted({op.op for op in result.workload.ops() if not op.has_flop_rule})
        status = "ok" if not unruled else f"ok, {len(unruled)} ops without a FLOP rule: {', '.join(unruled)}"
        return status, len(result.workload.ops()), time.perf_counter() - start
    except Timeout:
        return f"timed out after {timeout} s", 0, time.perf_counter() - start
    except UserError as exc:
        return str(exc), 0, time.perf_counter() - start
    except Exception as exc:  # the bench reports, it does not stop
        text = " ".join(str(exc).split())[:200]
        return f"uncaught {type(exc).__name__}: {text}", 0, time.perf_counter() - start
    finally:
        signal.alarm(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per architecture")
    parser.add_argument("--markdown", action="store_true", help="print the table as GitHub markdown")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    types = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(SHIPPED_OTHER_FAMILIES))
    if args.only:
        types = [t for t in types if t in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            status, ops, seconds, layers = check(model_type, Path(tmp) / model_type, args.timeout)
            rows.append([model_type, layers, status, ops, f"{seconds:.1f}"])
            print(f"{model_type:28s} {seconds:6.1f}s  {status[:160]}", file=sys.stderr, flush=True)
    ok = sum(row[2].startswith("ok") for row in rows)
    print(tabulate(rows, headers=["model_type", "layers", "result", "ops", "seconds"],
                   tablefmt="github" if args.markdown else "simple"))
    print(f"\n{ok} of {len(rows)} architectures ok ({100 * ok / len(rows):.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
