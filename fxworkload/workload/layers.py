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
paths (see workload._row_names), so they are the names the full trace gives.

Where the layers differ but repeat (DeepSeek-V3's three dense layers then 58 MoE ones, gpt-oss's
sliding and full attention in turn, Gemma 3's five local layers to one global: ``repeats``), the
model is built whole and its layer list cut down before it is traced (``piecewise_workload``): each
run of a repeated unit of layers keeps its first, one middle and its last repetition, the layers
around the runs all kept, each in its own place between the same neighbours. Every middle
repetition is then the kept middle one renumbered. A second capture per run, with two middle
repetitions, must agree with the first (its extra repetition equal to the kept middle one, every
other layer equal), and gives what a repetition adds to the peaks. Anything else (ops between
layers, captures that disagree, nothing repeated four times) returns None and the caller traces
every layer.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

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


MAX_PERIOD = 8  # the longest unit of layers looked for (Gemma 3's is 6)
MIN_TIMES = 4  # a unit repeated fewer times is kept whole: its first, a middle and its last are all it has


@dataclass(frozen=True)
class Repeat:
    """A unit of ``period`` layers repeated ``times`` in a row from layer ``start``."""
    start: int
    period: int
    times: int

    def kept(self, extra: bool = False) -> list[int]:
        """The repetitions kept in a short copy: the first, one middle (two with ``extra``) and the last."""
        return [0, 1, 2, self.times - 1] if extra else [0, 1, self.times - 1]


def layer_kinds(model: torch.nn.Module, layers: int) -> tuple[str, tuple[int, ...]] | None:
    """The decoder layers' path and each layer's kind (layers alike share one, numbered as first seen)."""
    stack = layer_stack(model, layers)
    if stack is None:
        return None
    numbers: dict[str, int] = {}
    return stack, tuple(numbers.setdefault(_signature(layer), len(numbers)) for layer in model.get_submodule(stack))


def repeats(kinds: tuple[int, ...]) -> list[Repeat]:
    """The runs of a repeated unit of layers, left to right: at each layer, the unit (of up to MAX_PERIOD
    layers, the shortest of those covering the most) repeated the most layers on from it, if MIN_TIMES or more."""
    found, i = [], 0
    while i < len(kinds):
        best = None
        for period in range(1, MAX_PERIOD + 1):
            unit = kinds[i:i + period]
            times = 0
            while kinds[i + times * period:i + (times + 1) * period] == unit and len(unit) == period:
                times += 1
            if times >= MIN_TIMES and (best is None or period * times > best.period * best.times):
                best = Repeat(i, period, times)
        if best is None:
            i += 1
        else:
            found.append(best)
            i += best.period * best.times
    return found


def kept_layers(layers: int, runs: list[Repeat], extra: Repeat | None = None) -> list[int]:
    """The layers a short copy keeps, in order: every layer outside the runs, and each run's kept repetitions."""
    dropped = set()
    for run in runs:
        kept = set(run.kept(run == extra))
        dropped |= {run.start + j * run.period + o for j in range(run.times) if j not in kept for o in range(run.period)}
    return [i for i in range(layers) if i not in dropped]


def standing_for(layer: int, runs: list[Repeat]) -> int:
    """The layer of the short copy (a full-model index) that stands for ``layer``: itself outside the runs, the
    kept middle repetition's for a middle one."""
    for run in runs:
        j, offset = divmod(layer - run.start, run.period)
        if run.start <= layer < run.start + run.period * run.times:
            return run.start + (j if j in (0, run.times - 1) else 1) * run.period + offset
    return layer


def piecewise_workload(spec, stack: str, kinds: tuple[int, ...], batch: int, seq: int, dtype: torch.dtype,
                       grad_dtype: torch.dtype, gpu: GpuTarget | None = None,
                       prepare: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m,
                       execution_stack: str = "eager") -> Workload | None:
    """The device-free table of a model whose layers differ but repeat, from short copies (module docstring),
    or None where it has no run to shorten or its copies disagree."""
    layers, runs = len(kinds), repeats(kinds)
    kept = kept_layers(layers, runs)
    if len(kept) * (1 + len(runs)) + sum(run.period for run in runs) >= layers:
        return None  # the copies would trace as many layers as the model has, or more
    short = _pruned_workload(spec, stack, kept, batch, seq, dtype, grad_dtype, gpu, prepare, execution_stack)
    table = _split(short.rows, stack, len(kept))
    if table is None:
        return None
    prefix, blocks, suffix = table
    position = {layer: i for i, layer in enumerate(kept)}
    figures = {name: getattr(short, name) for name in ("step_peak_bytes", "activation_peak_bytes")}
    slack = short.reserved_slack_bytes
    for run in runs:  # one more middle repetition of this run: the same layers, and what a repetition adds
        longer_kept = kept_layers(layers, runs, extra=run)
        longer = _pruned_workload(spec, stack, longer_kept, batch, seq, dtype, grad_dtype, gpu, prepare,
                                  execution_stack)
        if not _agrees(table, _split(longer.rows, stack, len(longer_kept)), kept, longer_kept, runs, stack):
            return None
        for name in figures:
            figures[name] += (run.times - len(run.kept())) * (getattr(longer, name) - getattr(short, name))
        slack = max(slack, longer.reserved_slack_bytes)
    rows = list(prefix)
    for layer in range(layers):
        rows += _renumbered(blocks[position[standing_for(layer, runs)]], stack, position[standing_for(layer, runs)],
                            layer)
    return Workload.of_rows(rows + suffix, grad_dtype, stack=execution_stack, reserved_slack_bytes=slack, **figures)


def _agrees(table, longer_table, kept: list[int], longer_kept: list[int], runs: list[Repeat], stack: str) -> bool:
    """The longer copy's prefix and suffix are the short copy's, and each of its layers the short copy's layer
    standing for it (its extra middle repetition the kept middle one)."""
    if longer_table is None:
        return False
    (prefix, blocks, suffix), (longer_prefix, longer_blocks, longer_suffix) = table, longer_table
    position = {layer: i for i, layer in enumerate(kept)}
    return (_normalized(prefix, stack, 0) == _normalized(longer_prefix, stack, 0)
            and _normalized(suffix, stack, 0) == _normalized(longer_suffix, stack, 0)
            and all(_normalized(block, stack, i)
                    == _normalized(blocks[position[standing_for(layer, runs)]], stack, position[standing_for(layer, runs)])
                    for i, (layer, block) in enumerate(zip(longer_kept, longer_blocks))))


def _pruned_workload(spec, stack: str, kept: list[int], batch, seq, dtype, grad_dtype, gpu, prepare,
                     execution_stack) -> Workload:
    """``pruned_model`` traced as one rank's share."""
    model = prepare(pruned_model(spec, stack, kept, dtype))
    return build(capture_training_step(model, batch, seq, gpu=gpu), model, None, grad_dtype, execution_stack, stack)


def pruned_model(spec, stack: str, kept: list[int], dtype: torch.dtype) -> torch.nn.Module:
    """The model built whole, its layer list cut to ``kept``. Each layer keeps its own settings (its attention
    kind, its index into the config's per-layer lists, read through its own config); the module that loops over
    the layers gets a copy of the config whose per-layer lists are the kept layers' (transformers' loops read a
    layer's mask by its place in the list: ``causal_mask_mapping[self.config.layer_types[i]]``)."""
    from ..capture import models  # transformers: only when capturing

    model = models.build_meta_model(spec, dtype)
    parent, _, name = stack.rpartition(".")
    holder, every = (model.get_submodule(parent) if parent else model), model.get_submodule(stack)
    setattr(holder, name, torch.nn.ModuleList(every[i] for i in kept))
    config = getattr(holder, "config", None)
    if config is not None:
        local = copy.copy(config)
        for key, value in vars(config).items():
            if isinstance(value, list) and len(value) == len(every):
                setattr(local, key, [value[i] for i in kept])
        holder.config = local
    return model


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
