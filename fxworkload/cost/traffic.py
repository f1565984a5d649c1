"""Bytes one op moves through memory: every tensor it reads plus every tensor it writes.

Gather ops (embedding, index_select, gather, index) read only the rows they gather, so their
source table counts at the output's size, not its own; so does the negative log-likelihood loss
(one log-probability per row). Aliasing ops (views, reshapes, getitem of
a multi-output op, detach) move 0 bytes, and so do allocations that no kernel fills (``empty``).
Sizes are logical: numel × element size of each tensor as the op sees it (a broadcast input is
counted at its broadcast size).
"""

from __future__ import annotations

import math

import torch

from .flops import is_flex_attention

# Ops whose schema is not marked as a view but that alias their input or launch no kernel.
NO_KERNEL_OPS = frozenset({"_unsafe_view", "alias", "detach", "lift_fresh", "empty", "empty_like",
                           "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "_reshape_alias"})


def is_alias(target) -> bool:
    if is_flex_attention(target):
        return False  # a kernel of its own (capture/flex.py)
    if not isinstance(target, torch._ops.OpOverload):  # operator.getitem and other Python callables
        return True
    return target.is_view or target.overloadpacket.__name__ in NO_KERNEL_OPS


def tensor_bytes(tree) -> int:
    leaves = torch.utils._pytree.tree_leaves(tree)
    # the shape's product, not numel(): a fake tensor's numel() dispatches (tens of µs each, per op of a capture)
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in leaves if isinstance(t, torch.Tensor))


# op name -> index of the argument rows are gathered from
GATHER_SOURCE = {"embedding": 0, "index_select": 0, "gather": 0, "index": 0}


def _safe_softmax_bytes(args, kwargs, out) -> int:
    """``_safe_softmax`` is one op but four kernels (SoftMax.cpp): softmax, ``eq(-inf)`` into a bool
    tensor, ``all`` over the rows of that, and ``where`` writing zeros for fully masked rows."""
    size = tensor_bytes(out)
    elements = out.numel()
    return 2 * size + (size + elements) + elements + 2 * size


def _nll_loss_forward_bytes(args, kwargs, out) -> int:
    """Reads the target and, per row, the one log-probability it picks (not the whole input)."""
    log_probs, target = args[0], args[1]
    return tensor_bytes(target) + target.numel() * log_probs.element_size() + tensor_bytes(out)


def _nll_loss_backward_bytes(args, kwargs, out) -> int:
    """Writes the input-sized gradient (zeros, then the picked entries) and reads the target."""
    grad_output, target = args[0], args[2]
    return tensor_bytes(grad_output) + tensor_bytes(target) + tensor_bytes(out) + target.numel() * out.element_size()


# ops whose memory traffic is not every tensor read plus every tensor written: several kernels (each
# pass over memory counted) or a gather: op name -> bytes(args, kwargs, out)
COMPOSITE_BYTES = {"_safe_softmax": _safe_softmax_bytes, "nll_loss_forward": _nll_loss_forward_bytes,
                   "nll_loss_backward": _nll_loss_backward_bytes}


def bytes_moved(target, args, kwargs, out) -> int:
    if is_alias(target):
        return 0
    name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    composite = COMPOSITE_BYTES.get(name)
    if composite is not None:
        return composite(args, kwargs, out)
    source = GATHER_SOURCE.get(name)
    if source is not None and isinstance(args[source], torch.Tensor):
        others = [a for i, a in enumerate(args) if i != source]
        return tensor_bytes((others, kwargs)) + 2 * tensor_bytes(out)
    return tensor_bytes((args, kwargs)) + tensor_bytes(out)
