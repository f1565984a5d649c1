"""The built-in models: folders under the repository's ``models/``, each with a config.json (no torch here)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "models"


def builtin_names() -> list[str]:
    return sorted(p.parent.name for p in BUILTIN_DIR.glob("*/config.json"))
