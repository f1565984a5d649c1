"""fxworkload: a HuggingFace model's training step as a per-node workload table."""

__version__ = "0.1.0"
