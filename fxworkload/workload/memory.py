"""Activation memory of one training step, read off the captured joint graph.

The graph's nodes are in the order the eager step ran them. Each tensor storage an op creates is
allocated at that op and released after the last op that reads any view of it (the graph's
outputs, the loss and the parameter gradients, stay). A forward storage that a backward op reads
is *saved for backward*: it is what a micro-batch holds between its forward and its backward.
Parameters, buffers and the input ids are resident and not counted here.

The step peak is the highest live total over the step with the gradients freed beforehand: what
``torch.cuda.max_memory_allocated()`` shows above the resident state over a step of a model whose
``.grad`` are None. Sizes are rounded up as PyTorch's caching allocator rounds them (512 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..capture.trace import FORWARD, Capture

ALLOCATION_ROUNDING_BYTES = 512  # CUDACachingAllocator's kMinBlockSize: every block is a multiple of it


@dataclass(frozen=True)
class ActivationMemory:
    saved_bytes: dict[torch.fx.Node, int]  # forward node -> bytes of the storages it creates that backward reads
    step_peak_bytes: int  # highest live activations, temporaries and parameter gradients during the step
    activation_peak_bytes: int  # the same without the parameter gradients (kept in their own buffer)
    saved_total_bytes: int  # held from the end of forward until backward reads them


def activation_memory(capture: Capture) -> ActivationMemory:
    nodes = [n for n in capture.graph.nodes if n.op in ("placeholder", "call_function", "output")]
    position = {node: i for i, node in enumerate(nodes)}
    resident = {key for node in nodes if node.op == "placeholder" for key, _ in _storages(node)}
    created: dict[StorageWeakRef, tuple[torch.fx.Node, int]] = {}  # storage -> (creating node, bytes)
    last_read: dict[StorageWeakRef, int] = {}
    read_by_backward: set[StorageWeakRef] = set()
    for node in nodes:
        if node.op == "call_function":
            for key, nbytes in _storages(node):
                if key not in resident and key not in created:
                    created[key] = (node, nbytes)
        for source in node.all_input_nodes:
            for key, _ in _storages(source):
                last_read[key] = position[node] if node.op != "output" else len(nodes)  # outputs stay
                if node.op == "call_function" and capture.phase.get(node, FORWARD) != FORWARD:
                    read_by_backward.add(key)

    outputs = {key for node in nodes if node.op == "output" for source in node.all_input_nodes
               for key, _ in _storages(source)}
    peak = _peak(created, last_read, position, len(nodes), skip=set())
    activation_peak = _peak(created, last_read, position, len(nodes), skip=outputs)

    saved: dict[torch.fx.Node, int] = {}
    for key in read_by_backward & created.keys():
        node, nbytes = created[key]
        if capture.phase.get(node) == FORWARD:
            saved[node] = saved.get(node, 0) + nbytes
    return ActivationMemory(saved_bytes=saved, step_peak_bytes=peak, activation_peak_bytes=activation_peak,
                            saved_total_bytes=sum(saved.values()))


def _peak(created, last_read, position, length: int, skip: set) -> int:
    events = [0] * (length + 2)
    for key, (node, nbytes) in created.items():
        if key not in skip:
            events[position[node]] += nbytes
            events[last_read.get(key, position[node]) + 1] -= nbytes  # never read: a temporary of its op
    live, peak = 0, 0
    for change in events:
        live += change
        peak = max(peak, live)
    return peak


def _storages(node: torch.fx.Node) -> list[tuple[StorageWeakRef, int]]:
    """The storages behind a node's tensor outputs, with their allocated sizes."""
    found = []
    for value in torch.utils._pytree.tree_leaves(node.meta.get("val")):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            found.append((StorageWeakRef(storage), _rounded(storage.nbytes())))
    return found


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_ROUNDING_BYTES) * ALLOCATION_ROUNDING_BYTES
