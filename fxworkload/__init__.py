"""fxworkload: a HuggingFace model's training step as a per-node workload table."""

__version__ = "0.1.0"

from .simai import read_simai  # noqa: E402  (after __version__, which the modules it imports read)

__all__ = ["__version__", "read_simai"]
