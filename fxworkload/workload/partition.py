"""What ``torch.compile`` keeps for backward: AOTAutograd's min-cut partitioner run on our step's graph.

The captured step is a joint forward-backward graph; AOTAutograd's joint graph differs only in its
names and its backward seed: inputs are ``primals_*``, and the loss's incoming gradient is an input
``tangents_1`` instead of autograd's ``ones_like(loss)``. A copy of our graph is put in that form and
handed to ``torch._functorch.partitioners.min_cut_rematerialization_partition`` (as inductor calls it,
on fake tensors: no memory, no GPU); the backward module's inputs other than the tangent are the
values it keeps.
"""

from __future__ import annotations

import torch

from ..capture.trace import Capture, FORWARD


def partitioner_saved(capture: Capture) -> frozenset[torch.fx.Node]:
    """The nodes of ``capture``'s graph whose values the partitioner keeps for backward."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graph = torch.fx.Graph()
    copy_of: dict[torch.fx.Node, torch.fx.Node] = {}
    output = graph.graph_copy(capture.graph, copy_of)
    graph.output(output)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        node.target = node.name = f"primals_{i + 1}"
    seed = _backward_seed(capture)
    if seed is not None:
        copied = copy_of[seed]
        with graph.inserting_after(placeholders[-1]):
            tangent = graph.placeholder("tangents_1")
        tangent.meta.update(copied.meta)
        copied.replace_all_uses_with(tangent)
        graph.erase_node(copied)
    joint = torch.fx.GraphModule(capture.graph_module, graph)
    _, backward = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=1)
    original = {copy.name: node for node, copy in copy_of.items()}
    kept = (original.get(n.name) for n in backward.graph.nodes
            if n.op == "placeholder" and not n.name.startswith("tangents"))
    return frozenset(n for n in kept if n is not None and n.op == "call_function")


def _backward_seed(capture: Capture) -> torch.fx.Node | None:
    """Autograd's ``ones_like(loss)``: the first backward op, made from the loss alone."""
    for node in capture.graph.nodes:
        if node.op == "call_function" and capture.phase.get(node, FORWARD) != FORWARD:
            inputs = node.all_input_nodes
            if len(inputs) == 1 and capture.phase.get(inputs[0]) == FORWARD and "like" in str(node.target):
                return node
            return None
    return None
