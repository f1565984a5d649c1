"""The built-in models and where a model argument's config.json is (no torch, no transformers here)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "models"


def builtin_names() -> list[str]:
    return sorted(p.parent.name for p in BUILTIN_DIR.glob("*/config.json"))


def locate(model: str) -> tuple[str, Path, Path | None]:
    """(name, config.json path, checkpoint folder or None) of a model argument: a built-in name,
    a checkpoint folder, or a config.json; UserError if it is none of them."""
    from ..errors import UserError

    path = Path(model)
    if (BUILTIN_DIR / model / "config.json").is_file() and not path.exists():
        return model, BUILTIN_DIR / model / "config.json", None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{model}: folder has no config.json; point at a HuggingFace checkpoint folder")
        return path.resolve().name, path / "config.json", path
    if path.is_file():
        return (path.resolve().parent.name if path.name == "config.json" else path.stem), path, None
    raise UserError(f"unknown model '{model}': use a checkpoint folder, a config.json, or one of: "
                    + ", ".join(builtin_names()))
