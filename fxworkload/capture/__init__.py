"""Capture: from a model argument to an aten-level fx graph of one training step.

Holds where a model argument's config is (``builtin``, no torch), model resolution and meta-device
building (``models``), the make_fx capture of forward, loss and the real autograd backward, with
every node labelled by phase and owner (``trace``), and the GPU's SDPA and dropout dispatch that a
capture for a GPU follows (``attention``).
May import: ``fxworkload.errors``, ``fxworkload.dtypes``, torch, transformers. Nothing above it.
"""
