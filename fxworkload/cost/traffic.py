"""Bytes one op moves through memory: every tensor it reads plus every tensor it writes.

Gather ops (embedding, index_select, gather, index) read only the rows they gather, so their
source table counts at the output's size, not its own. Aliasing ops (views, reshapes, getitem of
a multi-output op, detach) move 0 bytes, and so do allocations that no kernel fills (``empty``).
Sizes are logical: numel × element size of each tensor as the op sees it (a broadcast input is
counted at its broadcast size).
"""

from __future__ import annotations

import torch

# Ops whose schema is not marked as a view but that alias their input or launch no kernel.
NO_KERNEL_OPS = frozenset({"_unsafe_view", "alias", "detach", "lift_fresh", "empty", "empty_like",
                           "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "_reshape_alias"})


def is_alias(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload):  # operator.getitem and other Python callables
        return True
    return target.is_view or target.overloadpacket.__name__ in NO_KERNEL_OPS


def tensor_bytes(tree) -> int:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


# op name -> index of the argument rows are gathered from
GATHER_SOURCE = {"embedding": 0, "index_select": 0, "gather": 0, "index": 0}


def _safe_softmax_bytes(args, kwargs, out) -> int:
    """``_safe_softmax`` is one op but four kernels (SoftMax.cpp): softmax, ``eq(-inf)`` into a bool
    tensor, ``all`` over the rows of that, and ``where`` writing zeros for fully masked rows."""
    size = tensor_bytes(out)
    elements = out.numel()
    return 2 * size + (size + elements) + elements + 2 * size


# ops that run several kernels, each pass over memory counted: op name -> bytes(args, kwargs, out)
COMPOSITE_BYTES = {"_safe_softmax": _safe_softmax_bytes}


def bytes_moved(target, args, kwargs, out) -> int:
    if is_alias(target):
        return 0
    composite = COMPOSITE_BYTES.get(target.overloadpacket.__name__)
    if composite is not None:
        return composite(args, kwargs, out)
    source = GATHER_SOURCE.get(target.overloadpacket.__name__)
    if source is not None and isinstance(args[source], torch.Tensor):
        others = [a for i, a in enumerate(args) if i != source]
        return tensor_bytes((others, kwargs)) + 2 * tensor_bytes(out)
    return tensor_bytes((args, kwargs)) + tensor_bytes(out)
