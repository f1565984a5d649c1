"""Pointwise chains run as one kernel: the regions a fusing stack (Megatron-LM / Transformer Engine's
fused kernels, inductor's) turns into single kernels, and the bytes each such kernel moves.

A region is a connected set of fusible ops (elementwise, casts and copies, row reductions, views) of
one phase that lie between the same non-fusible kernels (GEMMs, attention, norms, gathers, the
loss): every fusible op gets a *level*, the number of non-fusible ops on its longest path from the
graph's inputs, and only ops of one level join, so no region both feeds and waits for a GEMM
(which would make it two kernels). A region's kernel reads each tensor from outside it once and
writes only what is read outside it; the values between its ops stay in registers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..capture.trace import FORWARD, Capture
from ..cost import flops as flop_rules
from ..cost.traffic import is_alias, tensor_bytes

# Norms stay kernels of their own (Megatron-LM's fused layer norm, apex / TE), which keep their input.
FUSIBLE_KINDS = frozenset({flop_rules.ELEMENTWISE, flop_rules.REDUCTION, flop_rules.DATA_MOVEMENT, flop_rules.VIEW})
# Of those kinds, ops that run as kernels of their own in these stacks: gathers and scatters by index
# (embedding and its backward, the loss's pick), sorts and scans; allocations no kernel fills.
NOT_FUSED = frozenset({"embedding", "embedding_dense_backward", "index", "gather", "scatter", "scatter_add",
                       "index_add", "index_put", "index_select", "masked_select", "_unsafe_index", "topk", "sort",
                       "cumsum", "histc", "nll_loss_forward", "nll_loss_backward", "argmax", "slice_scatter",
                       "select_scatter", "empty", "empty_like", "empty_strided", "zeros", "ones", "full", "arange",
                       "scalar_tensor", "eye"})
# Ops whose outputs cannot be recomputed from their inputs (random): their masks are kept.
RANDOM = frozenset({"native_dropout", "bernoulli", "rand_like", "randn_like", "uniform", "normal", "exponential"})


@dataclass(frozen=True)
class Regions:
    of: dict[torch.fx.Node, int]  # fusible node -> its region
    members: dict[int, list[torch.fx.Node]]  # region -> its nodes, in graph order (views included)
    phase: dict[torch.fx.Node, str]

    def lead(self, region: int) -> torch.fx.Node | None:
        """The node whose op stands for the region's kernel: its last kernel-launching node."""
        return next((n for n in reversed(self.members[region]) if not is_alias(n.target)), None)

    def leaves(self, node: torch.fx.Node) -> bool:
        """Whether the kernel of the node's region writes the node's value to memory: an op of the
        same phase outside the region reads it (or a view of it), or it is a step output, or it is
        random (a dropout mask is kept for backward; it cannot be made again)."""
        region = self.of.get(node)
        if region is None:
            return True
        source = node.args[0] if node.target is operator.getitem else node
        kept_anyway = is_random(source)  # read by any phase: backward reads the mask
        todo, seen = [node], set()
        while todo:
            for user in todo.pop().users:
                if user in seen:
                    continue
                seen.add(user)
                outside = self.of.get(user) != region
                if user.op == "output" or (outside and (kept_anyway or self.phase.get(user) == self.phase.get(node))):
                    return True
                if self.of.get(user) == region and is_alias(user.target):
                    todo.append(user)
        return False


def fusible(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = flop_rules.op_name(node.target)
    kind = flop_rules.op_kind(node.target, is_alias(node.target))
    return kind in FUSIBLE_KINDS and name not in NOT_FUSED and not name.endswith("_")


def is_random(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and flop_rules.op_name(node.target).rstrip("_") in RANDOM


def regions(capture: Capture, scope: dict | None = None) -> Regions:
    """The fused kernels of ``capture``'s step; ``scope``: node -> the compiled graph it lies in (a block
    compiled alone: no kernel fuses ops of two), None: one graph of every node; a node outside it runs as a
    kernel of its own."""
    nodes = [n for n in capture.graph.nodes if n.op in ("placeholder", "get_attr", "call_function")]
    is_fusible = {n: fusible(n) and (scope is None or n in scope) for n in nodes}
    unit = scope or {}
    level: dict[torch.fx.Node, int] = {}
    for node in nodes:
        level[node] = max((level.get(i, 0) + (0 if is_fusible.get(i) else 1) for i in node.all_input_nodes), default=0)
    parent = {n: n for n in nodes if is_fusible[n]}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in parent:
        for source in node.all_input_nodes:
            same_kernel = level[source] == level[node] and capture.phase.get(source) == capture.phase.get(node)
            if source in parent and same_kernel and unit.get(source) == unit.get(node):
                parent[root(node)] = root(source)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in parent:  # graph order
        groups.setdefault(root(node), []).append(node)
    kernels = [group for group in groups.values() if sum(not is_alias(n.target) for n in group) > 1]
    of = {node: i for i, group in enumerate(kernels) for node in group}
    return Regions(of=of, members=dict(enumerate(kernels)), phase=capture.phase)


def traffic_bytes(region: int, regions: Regions, read_as=lambda node: [node]) -> int:
    """Bytes the region's one kernel moves: each outside tensor it reads, once (``read_as`` names what
    a read of a node really reads: a fused backward reads what its forward kept, not the forward
    kernel's internal values), and each of its values that leaves it, once."""
    members = regions.members[region]
    read = {source for node in members if not is_alias(node.target) for i in _outside_inputs(node, region, regions)
            for source in read_as(i)}
    written = {value for node in members if not is_alias(node.target) for value in _values(node)
               if regions.leaves(value)}
    return sum(_value_bytes(n) for n in read | written)


def made_from(node: torch.fx.Node, regions: Regions) -> list[torch.fx.Node]:
    """What a backward kernel reads in place of ``node``: the node, or where it is a forward fused
    kernel's internal value, the kernel's written values and outside inputs it is made from."""
    found, todo, seen = [], [node], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op != "call_function" or regions.phase.get(current) != FORWARD or regions.leaves(current):
            found.append(current)
        else:
            todo.extend(current.all_input_nodes)
    return found


def _outside_inputs(node: torch.fx.Node, region: int, regions: Regions) -> list[torch.fx.Node]:
    """The values from outside the region a node reads, seen through the region's views of them."""
    found, todo = [], list(node.all_input_nodes)
    while todo:
        current = todo.pop()
        if regions.of.get(current) != region:
            found.append(current)
        elif is_alias(current.target):
            todo.extend(current.all_input_nodes)
    return found


def _values(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node, or for a multi-output op the getitems that take its outputs apart."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        return [user for user in node.users if user.target is operator.getitem]
    return [node]


def _value_bytes(node: torch.fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))
