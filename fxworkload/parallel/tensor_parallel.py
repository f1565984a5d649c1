"""One tensor- and expert-parallel rank's share of a model, built on the meta device.

The plan saying which projections are column- and which row-parallel is the model config's own
``base_model_tp_plan`` (Llama, Mistral, Qwen2, Mixtral…) or, for models whose config has none,
a plan shipped in ``models/tp_plans/<model_type>.json`` (GPT-2, BERT). Sharding replaces each
split parameter by one rank's slice, so capturing the sharded model gives the rank's real graph
and backward: every per-rank FLOP and byte comes from flop_counter on the rank's own shapes.
As in Megatron-LM, the input embedding and the output projection are vocabulary-parallel, and
with expert parallelism each rank holds num_experts / ep experts.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field

import torch
from transformers.pytorch_utils import Conv1D

from ..errors import UserError
from ..capture.builtin import BUILTIN_DIR
from ..capture.models import text_config

COLUMN = "column"
ROW = "row"
PLAN_DIR = BUILTIN_DIR / "tp_plans"
# transformers' tensor-parallel styles -> the Megatron-LM split they make; other styles
# (replicate, moe_tp_experts, grouped_gemm…) split no parameter of their own.
STYLE_SPLIT = {"colwise": COLUMN, "packed_colwise": COLUMN, "colwise_gather_output": COLUMN, "local_colwise": COLUMN,
               "rowwise": ROW, "packed_rowwise": ROW, "rowwise_split_input": ROW, "local_rowwise": ROW}


@dataclass(frozen=True)
class Plan:
    source: str
    splits: dict[str, str]  # full module or parameter path -> COLUMN or ROW
    divide_attributes: dict[str, list[str]] = field(default_factory=dict)  # module path -> attributes / tp
    parameter_paths: frozenset[str] = frozenset()  # the entries of splits that name a parameter

    def row_parallel_modules(self) -> list[str]:
        """Module paths whose output Megatron all-reduces (or reduce-scatters) in forward."""
        return [path.rpartition(".")[0] if path in self.parameter_paths else path
                for path, split in self.splits.items() if split == ROW]


def plan_for(model: torch.nn.Module) -> Plan | None:
    """The model's plan with patterns expanded to its own paths, or None if it has none."""
    config = model.config
    raw, divide, source = getattr(config, "base_model_tp_plan", None), {}, f"{type(config).__name__}.base_model_tp_plan"
    shipped = PLAN_DIR / f"{config.model_type}.json"
    if not raw and shipped.is_file():
        data = json.loads(shipped.read_text())
        raw, divide, source = data["plan"], data.get("divide_attributes", {}), f"models/tp_plans/{shipped.name}"
    if not raw:
        return None
    prefix = _base_prefix(model)
    parameters = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names = [n for n, _ in model.named_modules()] + parameters
    splits = {path: STYLE_SPLIT[style] for pattern, style in raw.items() if style in STYLE_SPLIT
              for path in _expand(prefix + pattern, names)}
    attributes = {path: attrs for pattern, attrs in divide.items() for path in _expand(prefix + pattern, names)}
    return Plan(source=source, splits=splits, divide_attributes=attributes,
                parameter_paths=frozenset(splits) & frozenset(parameters))


def shard(model: torch.nn.Module, plan: Plan | None, tp: int, ep: int) -> torch.nn.Module:
    """Turn the meta model into one rank's share, in place."""
    if tp > 1:
        if plan is None:
            raise UserError(f"{model.config.model_type} has no tensor-parallel plan (no base_model_tp_plan in its "
                            f"config, none in {PLAN_DIR}); use --tp 1 or add a plan file there")
        done: set[int] = set()
        for path, split in plan.splits.items():
            _shard_path(model, path, split, tp, done)
        for embedding in (model.get_input_embeddings(), model.get_output_embeddings()):
            if embedding is not None:  # vocabulary-parallel: each rank holds vocab / tp rows
                _shard_module(model, embedding, path_of(model, embedding), COLUMN, tp, done)
        _divide_vocab_size(model, tp)
        for path, attributes in plan.divide_attributes.items():
            module = model.get_submodule(path)
            for attribute in attributes:
                setattr(module, attribute, getattr(module, attribute) // tp)
    if ep > 1:
        banks = [(path, module) for path, module in model.named_modules() if _is_expert_bank(module)]
        if not banks:
            raise UserError(f"--ep {ep}: {model.config.model_type} keeps no expert weights stacked as "
                            "[experts, out, in] parameters, which is what expert parallelism splits here; use --ep 1")
        for path, module in banks:
            for name in list(module._parameters):
                _replace(model, module, name, 0, ep, f"{path}.{name}")
            module.num_experts //= ep
    return model


def _divide_vocab_size(model: torch.nn.Module, tp: int) -> None:
    """The loss reshapes the logits by the vocabulary size (config.vocab_size, or a copy of it some
    heads keep as an attribute): make it one rank's share, on a copy of the caller's config."""
    old, new = model.config, copy.deepcopy(model.config)
    old_text, new_text = text_config(old), text_config(new)
    new_text.vocab_size //= tp
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new
        elif getattr(module, "config", None) is old_text:
            module.config = new_text
        if getattr(module, "vocab_size", None) == old_text.vocab_size:
            module.vocab_size = new_text.vocab_size


def _is_expert_bank(module: torch.nn.Module) -> bool:
    experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return isinstance(experts, int) and bool(params) and all(p.dim() == 3 and p.shape[0] == experts for p in params)


def _shard_path(model, path: str, split: str, tp: int, done: set[int]) -> None:
    owner_path, _, name = path.rpartition(".")
    owner = model.get_submodule(owner_path)
    if name in owner._parameters:  # a parameter entry (stacked expert weights [experts, out, in])
        if id(owner._parameters[name]) not in done:
            done.add(id(_replace(model, owner, name, -2 if split == COLUMN else -1, tp, path)))
        return
    _shard_module(model, model.get_submodule(path), path, split, tp, done)


def _shard_module(model, module: torch.nn.Module, path: str, split: str, tp: int, done: set[int]) -> None:
    """Linear weight [out, in]; Conv1D weight [in, out]; Embedding weight [vocab, hidden]."""
    transposed = isinstance(module, Conv1D)
    weight_dim = (1 if transposed else 0) if split == COLUMN else (0 if transposed else 1)
    if id(module.weight) not in done:  # else a tied weight, already split through its other owner
        done.add(id(_replace(model, module, "weight", weight_dim, tp, path)))
    bias = getattr(module, "bias", None)
    if split == COLUMN and isinstance(bias, torch.nn.Parameter) and id(bias) not in done:
        done.add(id(_replace(model, module, "bias", 0, tp, path)))
    for attribute in ("out_features", "nf", "num_embeddings") if split == COLUMN else ("in_features",):
        if hasattr(module, attribute):
            setattr(module, attribute, getattr(module, attribute) // tp)


def _replace(model, module: torch.nn.Module, name: str, dim: int, parts: int, path: str) -> torch.nn.Parameter:
    """Swap a parameter for its 1/parts slice along dim, in every module that shares it (tied weights)."""
    old = module._parameters[name]
    shape = list(old.shape)
    if shape[dim] % parts:
        raise UserError(f"{path} has {shape[dim]} rows/columns along dimension {dim}, "
                        f"which does not divide into {parts} parts; choose a --tp/--ep that divides it")
    shape[dim] //= parts
    new = torch.nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=old.requires_grad)
    for owner in model.modules():
        for key, param in owner._parameters.items():
            if param is old:
                owner._parameters[key] = new
    return new


def _base_prefix(model: torch.nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and hasattr(model, prefix) else ""


def _expand(pattern: str, names: list[str]) -> list[str]:
    regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
    return [name for name in dict.fromkeys(names) if regex.match(name)]


def path_of(model: torch.nn.Module, target: torch.nn.Module) -> str:
    return next(path for path, module in model.named_modules() if module is target)
