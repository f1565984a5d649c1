"""fxworkload: a HuggingFace model's training step as a per-node workload table.

The public names are imported on first use, so that ``import fxworkload.cli`` (and with it
``fxworkload --help``) does not pay for importing torch.
"""

__version__ = "0.1.0"

_PUBLIC = {"extract": "fxworkload.pipeline", "Extraction": "fxworkload.pipeline",
           "Parallel": "fxworkload.parallel.layout", "Execution": "fxworkload.parallel.execution",
           "System": "fxworkload.cost.system", "read_simai": "fxworkload.formats.simai"}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'fxworkload' has no attribute {name!r}")
