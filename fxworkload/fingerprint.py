"""What a cached result depends on besides its inputs: this package's source and the libraries' versions.

Light on purpose (no torch): the planner checks its caches before importing anything heavy.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

from . import __version__


@functools.cache
def code_hash() -> str:
    """Every source file of the package: a changed rule or model invalidates what was cached with it."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode() + source.read_bytes())
    return digest.hexdigest()


def versions() -> dict[str, str]:
    return {"fxworkload": __version__, "torch": metadata.version("torch"),
            "transformers": metadata.version("transformers"), "code": code_hash()}
