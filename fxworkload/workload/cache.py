"""On-disk cache of captured steps, so that re-costing never captures again.

What is cached is the device-free table (rows, ops with FLOPs, bytes, shapes; no times), keyed by
everything that shapes it: the config.json as read (which decides the task), batch, seq, dtype, gradient dtype, the device
the trace dispatched for, the execution stack, the fxworkload, torch and transformers versions, and a hash of this
package's own source (so a changed FLOP rule never reads a stale entry). Entries are pickles
written by this package into the user's own cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

from ..cost.devices import cache_dir
from ..fingerprint import versions
from .table import Workload


@dataclass(frozen=True)
class CachedStep:
    """A captured step with what it was captured from: the resolved sequence length and the model's
    facts (any picklable object the caller keeps with it, e.g. parallel.facts.ModelFacts)."""
    workload: Workload
    seq: int
    facts: object


def key(config: dict, batch: int, seq: int | None, dtype: str, grad_dtype: str, trace_device: str,
        shards: tuple[int, int] = (1, 1), vocab_multiple: int = 1, every_layer: bool = False,
        stack: str = "eager") -> str:
    """``config``: the config.json as read (a dict), so that a cached run needs no transformers.
    ``shards``: the tensor- and expert-parallel degrees the traced model was split by."""
    material = json.dumps({"config": config, "batch": batch, "seq": seq, "dtype": dtype,
                           "grad_dtype": grad_dtype, "trace_device": trace_device, "shards": list(shards),
                           "vocab_multiple": vocab_multiple, "every_layer": every_layer, "stack": stack}
                          | versions(), sort_keys=True, default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def path_of(cache_key: str) -> Path:
    return cache_dir() / "graphs" / f"{cache_key}.pkl"


def load(cache_key: str) -> CachedStep | None:
    try:
        with open(path_of(cache_key), "rb") as f:
            entry = pickle.load(f)
    except Exception:  # absent, damaged, another pickle protocol or package layout: it is a cache, capture again
        return None
    return entry if isinstance(entry, CachedStep) else None


def save(cache_key: str, entry: CachedStep) -> None:
    path = path_of(cache_key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a capture next time
