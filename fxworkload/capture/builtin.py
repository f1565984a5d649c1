"""The built-in models and where a model argument's config.json is (no torch, no transformers here).

A model argument is a built-in name, a checkpoint folder, a config.json, or a HuggingFace id
(``Qwen/Qwen2.5-0.5B``) found in the local HuggingFace cache: the cache is read, never the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "models"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_SNAPSHOT = re.compile(r"^models--(?:[^/]+--)?(?P<name>[^/]+)$")


def builtin_names() -> list[str]:
    return sorted(p.parent.name for p in BUILTIN_DIR.glob("*/config.json"))


def locate(model: str) -> tuple[str, Path, Path | None]:
    """(name, config.json path, checkpoint folder or None) of a model argument: a built-in name,
    a checkpoint folder, a config.json, or a cached HuggingFace id; UserError if it is none of them."""
    from ..errors import UserError

    path = Path(model)
    if (BUILTIN_DIR / model / "config.json").is_file() and not path.exists():
        return model, BUILTIN_DIR / model / "config.json", None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{model}: folder has no config.json; point at a HuggingFace checkpoint folder")
        return folder_name(path), path / "config.json", path
    if path.is_file():
        return (folder_name(path.parent) if path.name == "config.json" else path.stem), path, None
    if _HUB_ID.match(model) and "/" in model:
        folder = cached_snapshot(model)
        if folder is None:
            raise UserError(f"'{model}' is not in the local HuggingFace cache ({hub_cache_dir()}); fxworkload never "
                            f"downloads: fetch it first (hf download {model} config.json) or pass "
                            "a checkpoint folder")
        return model.rsplit("/", 1)[1], folder / "config.json", folder
    raise UserError(f"unknown model '{model}': use a checkpoint folder, a config.json, a HuggingFace id in the "
                    "local cache (org/name), or one of: " + ", ".join(builtin_names()))


def folder_name(folder: Path) -> str:
    """A checkpoint folder's model name; for a HuggingFace cache snapshot (…/models--org--name/
    snapshots/<commit>) the model's name, not the commit hash."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and (found := _SNAPSHOT.match(resolved.parent.parent.name)):
        return found["name"]
    return resolved.name


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded models, as its environment variables say (read now)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder holding ``repo_id``'s config.json, or None (no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir())
    return Path(found).parent if isinstance(found, str) else None


def is_dropout_setting(name: str, value) -> bool:
    """A config entry that is a dropout probability: attn_pdrop, hidden_dropout_prob, attention_dropout, ..."""
    return ("dropout" in name or "pdrop" in name) and isinstance(value, float)


def without_dropout(settings: dict) -> dict:
    """A config's entries (nested configs too) with every dropout probability 0: the step a loop runs with the
    model in eval mode, as ``from_pretrained`` leaves it until ``model.train()``."""
    return {k: 0.0 if is_dropout_setting(k, v) else without_dropout(v) if isinstance(v, dict) else v
            for k, v in settings.items()}
