"""Activation memory of one training step, read off the captured joint graph.

The graph's nodes are in the order the eager step ran them. Each tensor storage an op creates is
allocated at that op and released after the last op that reads any view of it (the graph's
outputs, the loss and the parameter gradients, stay; a value the model's own forward holds, until
that forward returns). Beside them each kernel's own scratch is made and given back at its op
(scratch.py). A forward storage that a backward op reads
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

from ..capture.trace import FORWARD, Capture, grad_fn_of
from .allocator import CachingAllocator
from .fusion import Regions
from .scratch import handle_workspaces, scratch_bytes

ALLOCATION_ROUNDING_BYTES = 512  # CUDACachingAllocator's kMinBlockSize: every block is a multiple of it
SCRATCH = "scratch"  # the key of a kernel's own request: (SCRATCH, node, index)


@dataclass(frozen=True)
class ActivationMemory:
    saved_bytes: dict[torch.fx.Node, int]  # forward node -> bytes of the storages it creates that backward reads
    step_peak_bytes: int  # highest live activations, temporaries and parameter gradients during the step
    activation_peak_bytes: int  # the same without the parameter gradients (kept in their own buffer)
    saved_total_bytes: int  # held from the end of forward until backward reads them
    # PyTorch's caching allocator replayed over the step (allocator.py), the parameters first, then steps
    # one after another, each freeing the last one's gradients first (``zero_grad(set_to_none=True)``):
    # the highest reserved and allocated bytes of a later step, parameters and gradients included, as
    # ``max_memory_reserved`` and ``max_memory_allocated`` report them
    reserved_peak_bytes: int = 0
    allocated_peak_bytes: int = 0


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
    # what a kernel takes from the allocator for itself and gives back as it returns (scratch.py): made after
    # its op's outputs, freed at its op (never read)
    for node in nodes:
        for i, nbytes in enumerate(scratch_bytes(node, capture.gpu, fused=keep is not None)):
            created[(SCRATCH, node, i)] = (node, allocated_bytes(nbytes))
    last_read: dict[StorageWeakRef, int] = {}
    read_by_backward: set[StorageWeakRef] = set()
    forward_end = max((position[n] for n in nodes if n.op == "call_function"
                       and capture.phase.get(n, FORWARD) == FORWARD), default=0)
    node_end = _autograd_node_ends(nodes, position)
    for node in nodes:
        backward = node.op == "call_function" and capture.phase.get(node, FORWARD) != FORWARD
        reader_top = _top_module(capture.module.get(node, "")) if node.op == "call_function" and not backward else None
        for source in node.all_input_nodes:
            keys = [key for key, _ in _storages(source)]
            if backward and keep is not None:
                reader = capture.owner.get(node)
                keys = [k for key in keys for k in keep.read_as(key, created, value_of, made_by, resident, reader)]
            for key in keys:
                read_at = position[node] if node.op != "output" else len(nodes)  # outputs stay
                if reader_top is not None and _top_module(capture.module.get(made_by.get(key), "")) != reader_top:
                    read_at = forward_end  # held by the model's own forward (see _top_module)
                if backward and capture.phase.get(made_by.get(key), None) == FORWARD:
                    read_at = max(read_at, node_end.get(grad_fn_of(node), read_at))  # see _autograd_node_ends
                last_read[key] = max(last_read.get(key, 0), read_at)
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
    resident_bytes = [nbytes for node in nodes if node.op == "placeholder" for _, nbytes in _storages(node)]
    kept_for_good = [(position[node], nbytes) for node, nbytes in handle_workspaces(
        nodes, lambda node: capture.phase.get(node, FORWARD) != FORWARD, capture.gpu)]
    reserved, allocated = replayed_peaks(resident_bytes, created, last_read, position, outputs, kept_for_good)
    return ActivationMemory(saved_bytes=saved, step_peak_bytes=peak, activation_peak_bytes=activation_peak,
                            saved_total_bytes=sum(saved.values()), reserved_peak_bytes=reserved,
                            allocated_peak_bytes=allocated)


def _autograd_node_ends(nodes: list, position: dict) -> dict:
    """The position of each autograd node's last op in backward. A node's saved tensors are released when its
    backward function returns (torch/csrc/autograd/engine.cpp, ``Engine::evaluate_function`` calls
    ``fn.release_variables()`` after ``call_function``), not at their last read inside it: where a formula is
    several ops (a custom Function's, as parallel/loss_parallel.py's), what it saved is held through all of them."""
    ends = {}
    for node in nodes:
        grad_fn = grad_fn_of(node)
        if grad_fn is not None:
            ends[grad_fn] = position[node]
    return ends


def _top_module(path: str) -> str:
    """The top-level module a module path lies in. A value one of the model's top-level modules hands another,
    or the model's own forward (the decoder's last hidden state, the logits the loss reads), is a local variable
    of that forward in eager PyTorch: it stays referenced until the forward returns, past its last read
    (transformers' ``CausalLM.forward`` keeps ``outputs`` and ``logits`` while its loss function makes the fp32
    copy and the log-softmax). Inside a top-level module the graph's last read stands for the variable's life."""
    return path.partition(".")[0]


STEPS_REPLAYED = 3  # the pool a step leaves is what the next one allocates from; by the third it repeats


def replayed_peaks(resident_bytes: list[int], created: dict, last_read: dict, position: dict,
                   kept: set, kept_for_good: list[tuple[int, int]] = ()) -> tuple[int, int]:
    """(reserved, allocated) peaks of the last of STEPS_REPLAYED steps through the caching allocator:
    the resident storages first, in the graph's order, then each step's storages made at their op and
    freed after their last read; ``kept`` (the gradients and the loss) stay until the next step begins;
    ``kept_for_good``: (position, bytes) requests the first step makes after its op's and never frees (the
    library handles' workspaces, scratch.handle_workspaces)."""
    allocator = CachingAllocator()
    for nbytes in resident_bytes:
        allocator.malloc(nbytes)
    made: dict[int, list] = {}
    freed: dict[int, list] = {}
    for key, (node, nbytes) in created.items():
        made.setdefault(position[node], []).append((key, nbytes))
        if key not in kept:
            freed.setdefault(last_read.get(key, position[node]), []).append(key)
    for keys in freed.values():  # a kernel's scratch is given back inside its op, before the op's inputs, the
        keys.sort(key=_scratch_first)  # last request first (C++ destroys its locals in reverse)
    once: dict[int, list] = {}
    for step, nbytes in kept_for_good:
        once.setdefault(step, []).append(nbytes)
    held_over: list[int] = []
    for replayed in range(STEPS_REPLAYED):
        for address in held_over:
            allocator.free(address)
        allocator.reset_peaks()
        held_over, live = [], {}
        first_only = {} if replayed else once
        for step in sorted(made.keys() | freed.keys() | first_only.keys()):
            for key, nbytes in made.get(step, ()):
                live[key] = allocator.malloc(nbytes)
                if key in kept:
                    held_over.append(live[key])
            for nbytes in first_only.get(step, ()):
                allocator.malloc(nbytes)
            for key in freed.get(step, ()):
                allocator.free(live.pop(key))
    return allocator.peak_reserved_bytes, allocator.peak_allocated_bytes


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
    scope: frozenset[torch.fx.Node] | None = None  # where ``saved`` rules (a compiled region); None: everywhere

    def bound(self, saved_keys) -> SavePolicy:
        return replace(self, saved_keys=frozenset(saved_keys))

    def recomputing(self, nodes) -> SavePolicy:
        return replace(self, recomputed=frozenset(nodes))

    def allocated(self, key, value: torch.fx.Node) -> bool:
        return self.regions is None or self.regions.leaves(value) or key in self.saved_keys

    def kept(self, key, value: torch.fx.Node, maker: torch.fx.Node, reader: torch.fx.Node | None) -> bool:
        if maker in self.recomputed and reader in self.recomputed:  # re-made for its own backward only
            return False
        if (self.saved is not None and self.regions.phase.get(value) == FORWARD
                and (self.scope is None or value in self.scope)):
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


def _scratch_first(key) -> tuple[int, int]:
    return (0, -key[2]) if isinstance(key, tuple) and key[0] == SCRATCH else (1, 0)


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
