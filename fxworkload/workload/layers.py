"""The fast path: capture a short model once and re-emit its middle decoder layer for every layer.

A transformer repeats one decoder layer L times. When every layer of the model is structurally
identical (same module types, parameter shapes and settings, ignoring the layer index), the same
model is captured with 2 and with 3 layers instead. Each table is prefix (embeddings) + one block
of rows per layer + suffix (final norm, head, loss). The first and last layers may differ from the
middle ones in backward (the gradient of a layer's input is summed over its two uses, and that
add belongs to the layer below). When the two captures agree (same prefix, suffix, first and last
layer; every middle layer identical up to its index), nothing outside the middle layers depends
on the layer count, and the full table is prefix + first layer + the middle layer renumbered for
layers 1..L-2 + the last layer renumbered as L-1 + suffix. Row names are built from module
paths (see workload._row_names), so they are the names the full trace gives. Anything else
(mixed dense and MoE layers, sliding-window layers, ops between layers) returns None and the
caller traces every layer.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable

import torch

from ..capture.attention import GpuTarget
from ..capture.trace import capture_training_step
from .table import GradRow, Workload, build

SHORT_LAYERS = (2, 3)  # the fewest with a middle layer, and a second copy to check it and the peaks against
_SKIPPED_ATTRIBUTES = re.compile(r"layer_idx|layer_id|layer_number|layer_index|training")


def uniform_stack(spec, model: torch.nn.Module) -> str | None:
    """The path of the model's decoder layers where one layer may stand for all (more layers than the
    short copies, every one alike), else None."""
    from ..capture.models import setting  # transformers: only when capturing

    layers = setting(spec.config, "num_hidden_layers", 0)
    stack = layer_stack(model, layers)
    if layers <= max(SHORT_LAYERS) or stack is None or not homogeneous(model.get_submodule(stack)):
        return None
    return stack


def fast_workload(spec, stack: str, batch: int, seq: int, dtype: torch.dtype,
                  grad_dtype: torch.dtype, gpu: GpuTarget | None = None,
                  prepare: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m,
                  execution_stack: str = "eager") -> Workload | None:
    """The device-free table of the full model from 2- and 3-layer captures, or None if they disagree.
    ``stack``: ``uniform_stack``'s; ``prepare`` turns each freshly built short model into what is traced
    (one parallel rank's share)."""
    from ..capture.models import setting  # transformers: only when capturing

    layers = setting(spec.config, "num_hidden_layers", 0)
    shorts = [_short_workload(spec, n, batch, seq, dtype, grad_dtype, gpu, prepare, execution_stack, stack)
              for n in SHORT_LAYERS]
    tables = [_split(short.rows, stack, n) for short, n in zip(shorts, SHORT_LAYERS)]
    if any(table is None for table in tables) or not _consistent(tables, stack):
        return None
    prefix, blocks, suffix = tables[-1]
    middle = [row for i in range(1, layers - 1) for row in _renumbered(blocks[1], stack, 1, i)]
    last = _renumbered(blocks[-1], stack, len(blocks) - 1, layers - 1)
    return Workload.of_rows(prefix + blocks[0] + middle + last + suffix, grad_dtype,
                            step_peak_bytes=_extrapolated(shorts, "step_peak_bytes", layers),
                            activation_peak_bytes=_extrapolated(shorts, "activation_peak_bytes", layers),
                            stack=execution_stack,
                            # the allocator's holes are made by one layer's shapes and re-used by the next
                            # identical layer: the slack does not grow with the layers (GPT-2: 2.30 GiB with
                            # 2 layers, 2.31 with 3, 2.34 with all 12), so the longer copy's stands for all
                            reserved_slack_bytes=shorts[-1].reserved_slack_bytes)


def _extrapolated(shorts: list[Workload], figure: str, layers: int) -> int:
    """Identical layers add the same to a peak: it grows by the 3-layer copy's excess per layer."""
    low, high = (getattr(short, figure) for short in shorts)
    return low + (layers - SHORT_LAYERS[0]) * (high - low)


def _short_workload(spec, layers, batch, seq, dtype, grad_dtype, gpu, prepare, execution_stack,
                    layers_path: str) -> Workload:
    from ..capture import models  # transformers: only when capturing

    short_spec = models.ModelSpec(name=spec.name, config=_short_config(spec.config, layers), task=spec.task,
                                  folder=spec.folder)
    short_model = prepare(models.build_meta_model(short_spec, dtype))
    capture = capture_training_step(short_model, batch, seq, gpu=gpu)
    return build(capture, short_model, None, grad_dtype, execution_stack, layers_path)


def _consistent(tables, stack: str) -> bool:
    """The captures agree: the same prefix, suffix, first and last layer, and every middle layer the longer
    copy's first middle one, up to the layer index."""
    (prefix_a, blocks_a, suffix_a), (prefix_b, blocks_b, suffix_b) = tables
    middle = _normalized(blocks_b[1], stack, 1)
    return (_normalized(prefix_a, stack, 0) == _normalized(prefix_b, stack, 0)
            and _normalized(suffix_a, stack, 0) == _normalized(suffix_b, stack, 0)
            and _normalized(blocks_a[0], stack, 0) == _normalized(blocks_b[0], stack, 0)
            and _normalized(blocks_a[-1], stack, len(blocks_a) - 1)
            == _normalized(blocks_b[-1], stack, len(blocks_b) - 1)
            and all(_normalized(block, stack, i) == middle for blocks in (blocks_a, blocks_b)
                    for i, block in enumerate(blocks[1:-1], start=1)))


def layer_stack(model: torch.nn.Module, layers: int) -> str | None:
    """Path of the ModuleList that holds the decoder layers (``model.layers``, ``transformer.h``)."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers and path:
            return path
    return None


def homogeneous(stack: torch.nn.ModuleList) -> bool:
    signatures = {_signature(layer) for layer in stack}
    return len(signatures) == 1


def _signature(layer: torch.nn.Module) -> str:
    parts = []
    for path, module in layer.named_modules():
        settings = sorted((k, v) for k, v in vars(module).items()
                          if not k.startswith("_") and not _SKIPPED_ATTRIBUTES.search(k)
                          and isinstance(v, (bool, int, float, str, tuple, type(None))))
        shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters(recurse=False)]
        parts.append((path, type(module).__qualname__, settings, shapes))
    return repr(parts)


def _short_config(config, layers: int):
    """A copy whose language model has ``layers`` layers (a multimodal model's text sub-config)."""
    from ..capture.models import text_config

    short = copy.deepcopy(config)
    text, short_text = text_config(config), text_config(short)
    short_text.num_hidden_layers = layers
    for name, value in vars(text).items():  # per-layer lists (layer_types): keep the first entries
        if isinstance(value, list) and len(value) == text.num_hidden_layers:
            setattr(short_text, name, value[:layers])
    return short


@functools.lru_cache(maxsize=1 << 16)  # a layout search asks it of the same few thousand paths millions of times
@functools.lru_cache(maxsize=1 << 16)  # a layout search asks it of the same rows again and again
def within_any(module: str, paths: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``paths`` or inside one: any of its dotted prefixes is a path."""
    held = frozenset(paths)
    parts = module.split(".")
    return any(".".join(parts[:i]) in held for i in range(1, len(parts) + 1))


def layer_of(module: str, stack: str | None) -> int | None:
    """The index of the decoder layer a module path lies in, or None outside the layers."""
    if not stack or not module.startswith(stack + "."):
        return None
    index = module[len(stack) + 1:].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def _split(rows: list, stack: str, layers: int):
    """prefix, the per-layer blocks in order, suffix; None unless each layer's rows are contiguous."""
    prefix, blocks, suffix = [], [[] for _ in range(layers)], []
    current = -1
    for row in rows:
        layer = layer_of(row.module, stack)
        if layer is None:
            if current == -1:
                prefix.append(row)
                continue
            current = layers
            suffix.append(row)
            continue
        if layer < current or current == layers:
            return None
        current = layer
        blocks[layer].append(row)
    if any(not block for block in blocks):
        return None
    return prefix, blocks, suffix


def _renamer(stack: str, old: int, new: int):
    dotted, underscored = f"{stack}.{old}", f"{stack}.{new}"
    flat_old, flat_new = dotted.replace(".", "_"), underscored.replace(".", "_")

    def path(text: str) -> str:
        return underscored + text[len(dotted):] if text == dotted or text.startswith(dotted + ".") else text

    def name(text: str) -> str:
        return flat_new + text[len(flat_old):] if text.startswith(flat_old + "_") else text
    return path, name


def _renumbered(block: list, stack: str, old: int, new: int) -> list:
    path, name = _renamer(stack, old, new)
    return [GradRow(name=name(r.name), module=path(r.module), parameters=[path(p) for p in r.parameters],
                    elements=r.elements, bytes=r.bytes) if isinstance(r, GradRow)
            else r.renamed(name(r.name), path(r.module)) for r in block]


def _normalized(block: list, stack: str, layer: int) -> list:
    """The rows renumbered from ``layer`` to layer 1, op identities dropped: what must match."""
    def op_key(op):
        return (op.op, op.kind, op.phase, op.input_shapes, op.input_dtypes, op.output_shapes, op.output_dtypes,
                op.flops, op.bytes, op.has_flop_rule, op.gemm_mkn)
    keys = []
    for row in _renumbered(block, stack, layer, 1):
        if isinstance(row, GradRow):
            keys.append(("grad", row.name, row.module, row.parameters, row.elements, row.bytes))
        else:
            keys.append(("node", row.name, row.module, op_key(row.forward), row.saved_bytes,
                         [op_key(op) for op in row.input_grad], [op_key(op) for op in row.weight_grad]))
    return keys
