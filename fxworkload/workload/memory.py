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

import operator
from dataclasses import dataclass, replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..capture.trace import FORWARD, Capture
from .fusion import Regions

ALLOCATION_ROUNDING_BYTES = 512  # CUDACachingAllocator's kMinBlockSize: every block is a multiple of it


@dataclass(frozen=True)
class ActivationMemory:
    saved_bytes: dict[torch.fx.Node, int]  # forward node -> bytes of the storages it creates that backward reads
    step_peak_bytes: int  # highest live activations, temporaries and parameter gradients during the step
    activation_peak_bytes: int  # the same without the parameter gradients (kept in their own buffer)
    saved_total_bytes: int  # held from the end of forward until backward reads them


def activation_memory(capture: Capture, keep: SavePolicy | None = None) -> ActivationMemory:
    """``keep``: how a fusing stack stores less than eager (see SavePolicy); None: eager PyTorch."""
    nodes = [n for n in capture.graph.nodes if n.op in ("placeholder", "call_function", "output")]
    position = {node: i for i, node in enumerate(nodes)}
    resident = {key for node in nodes if node.op == "placeholder" for key, _ in _storages(node)}
    created: dict[StorageWeakRef, tuple[torch.fx.Node, int]] = {}  # storage -> (creating node, bytes)
    value_of: dict[StorageWeakRef, torch.fx.Node] = {}  # storage -> the node whose value it is
    for node in nodes:
        if node.op == "call_function":
            for key, nbytes in _storages(node):
                if key not in resident and key not in created:
                    created[key] = (node, nbytes)
                takes_apart = node.target is operator.getitem and created.get(key, (None,))[0] is node.args[0]
                if takes_apart or key not in value_of:  # a multi-output op's value: its getitem
                    value_of[key] = node
    made_by = {key: node for key, (node, _) in created.items()}
    if keep is not None:
        keep = keep.bound({key for node in keep.saved or () for key, _ in _storages(node)})
        created = {key: made for key, made in created.items() if keep.allocated(key, value_of[key])}
    last_read: dict[StorageWeakRef, int] = {}
    read_by_backward: set[StorageWeakRef] = set()
    for node in nodes:
        backward = node.op == "call_function" and capture.phase.get(node, FORWARD) != FORWARD
        for source in node.all_input_nodes:
            keys = [key for key, _ in _storages(source)]
            if backward and keep is not None:
                reader = capture.owner.get(node)
                keys = [k for key in keys for k in keep.read_as(key, created, value_of, made_by, resident, reader)]
            for key in keys:
                last_read[key] = position[node] if node.op != "output" else len(nodes)  # outputs stay
                if backward:
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


@dataclass(frozen=True)
class SavePolicy:
    """What a stack materialises and keeps. ``regions``: its fused kernels, whose internal values are
    never written (None: every op is a kernel of its own); ``saved``: where only these forward values
    are kept for backward (AOTAutograd's partition), None where every written value backward reads
    is kept (eager autograd; fused kernels, which re-make their internal values from their kept
    inputs); ``recomputed``: forward ops run again in backward (recomputation), whose values are not
    kept for their own backward (another op's backward, as the out-projection's of the attention
    core's output, still reads the kept value). A backward read of a value not kept reads the kept
    values it is re-made from."""
    regions: Regions | None = None
    saved: frozenset[torch.fx.Node] | None = None
    recomputed: frozenset[torch.fx.Node] = frozenset()
    saved_keys: frozenset = frozenset()  # the storages of ``saved``

    def bound(self, saved_keys) -> SavePolicy:
        return replace(self, saved_keys=frozenset(saved_keys))

    def recomputing(self, nodes) -> SavePolicy:
        return replace(self, recomputed=frozenset(nodes))

    def allocated(self, key, value: torch.fx.Node) -> bool:
        return self.regions is None or self.regions.leaves(value) or key in self.saved_keys

    def kept(self, key, value: torch.fx.Node, maker: torch.fx.Node, reader: torch.fx.Node | None) -> bool:
        if maker in self.recomputed and reader in self.recomputed:  # re-made for its own backward only
            return False
        if self.saved is not None and self.regions.phase.get(value) == FORWARD:
            return key in self.saved_keys
        return self.allocated(key, value)

    def read_as(self, key, created, value_of, made_by, resident, reader=None) -> list:
        """The storages a backward op owned by forward op ``reader`` reads for ``key``."""
        found, todo, seen = [], [key], set()
        while todo:
            current = todo.pop()
            if current in seen or current in resident:
                continue
            seen.add(current)
            value = value_of.get(current)
            kept = current in created and self.kept(current, value, made_by[current], reader)
            if value is None or current not in made_by or kept:
                found.append(current)
                continue
            todo.extend(k for source in made_by[current].all_input_nodes for k, _ in _storages(source))
        return found


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
            found.append((StorageWeakRef(storage), allocated_bytes(storage.nbytes())))
    return found


def allocated_bytes(nbytes: int) -> int:
    """What the caching allocator holds for a tensor of ``nbytes``."""
    return -(-nbytes // ALLOCATION_ROUNDING_BYTES) * ALLOCATION_ROUNDING_BYTES
