"""Capture: from a model argument to an aten-level fx graph of one training step.

Holds model resolution and meta-device building (``models``) and the make_fx capture of forward,
loss and the real autograd backward, with every node labelled by phase and owner (``trace``).
May import: ``fxworkload.errors``, ``fxworkload.dtypes``, torch, transformers. Nothing above it.
"""
