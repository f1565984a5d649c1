"""Resolve a model argument to a HuggingFace config and build the model on the meta device.

A model argument is a built-in name (a folder under ``models/`` with a ``config.json``), a local
checkpoint folder, or a path to a ``config.json``. Nothing is ever downloaded.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
)

from .builtin import is_dropout_setting, locate
from .sdpa_backends import ATTENTION_IMPLEMENTATIONS
from ..errors import UserError
from ..limits import MAX_LAYERS

CAUSAL_LM = "causal-lm"
MASKED_LM = "masked-lm"


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the built-in name, or the folder / file name of a local config
    config: PretrainedConfig
    task: str  # CAUSAL_LM or MASKED_LM
    folder: Path | None = None  # the checkpoint folder, when the argument was one


def resolve(model: str) -> ModelSpec:
    """Turn a model argument into a ModelSpec, or raise UserError saying why not."""
    name, config_path, folder = locate(model)
    return _spec(name, config_path, folder=folder)


def _spec(name: str, config_path: Path, folder: Path | None = None) -> ModelSpec:
    config = load_config(config_path)
    return ModelSpec(name=name, config=config, task=task_of(config), folder=folder)


def load_config(config_path: Path) -> PretrainedConfig:
    try:
        data = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_path}: cannot read it ({exc}); check the path and permissions") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_path}: malformed JSON at line {exc.lineno} column {exc.colno}; "
                        "fix the file or re-save it with save_pretrained") from None
    except RecursionError:
        raise UserError(f"{config_path}: JSON nested too deeply to be a config; re-save it with save_pretrained") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"{config_path}: no 'model_type' key; this is not a HuggingFace config.json")
    model_type = data["model_type"]
    if not isinstance(model_type, str):
        raise UserError(f"{config_path}: 'model_type' must be a string, got {type(model_type).__name__}; fix the file")
    architectures = data.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        raise UserError(f"{config_path}: 'architectures' must be a list of class names; fix the file")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{config_path}: model_type '{model_type}' is unknown to this transformers "
                        "version; use a supported architecture or upgrade transformers")
    try:  # from_json_file decodes what save_pretrained encodes (infinite floats)
        config = CONFIG_MAPPING[model_type].from_json_file(config_path)
    except Exception as exc:  # transformers' validators raise their own error classes
        raise UserError(f"{config_path}: invalid {model_type} config ({_first_line(exc)}); fix the file") from None
    check_sizes(config, config_path)
    return config


# Sizes past these are no real model's (the largest have ~10^2 layers, widths ~10^4, vocabularies
# ~10^6): a typo, and building such a model would take minutes or the machine's memory.
SIZE_LIMITS = {"num_hidden_layers": MAX_LAYERS, "hidden_size": 1 << 20, "num_attention_heads": 1 << 16,
               "intermediate_size": 1 << 22, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 24,
               "num_local_experts": 1 << 16, "num_experts": 1 << 16, "num_experts_per_tok": 1 << 16}


def check_sizes(config: PretrainedConfig, config_path: Path) -> None:
    """Each size the language model sets is a positive integer of a real model's order (XLNet's -1
    positions, "no limit", aside)."""
    for name, limit in SIZE_LIMITS.items():
        value = setting(config, name)
        if value is None or (name == "max_position_embeddings" and value == -1):
            continue
        for size in value if isinstance(value, (list, tuple)) and value else [value]:  # per-layer sizes too
            if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= limit:
                shown = repr(value) if len(repr(value)) <= 40 else f"{repr(size)} (in a per-layer list)"
                raise UserError(f"{config_path}: {name} = {shown} is not a model size (a whole number from 1 "
                                f"to {limit:,}); fix the file")
    experts = setting(config, "num_local_experts") or setting(config, "num_experts")
    top_k = setting(config, "num_experts_per_tok")
    if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
        raise UserError(f"{config_path}: num_experts_per_tok = {top_k} routes each token to more experts than the "
                        f"{experts} there are; fix the file")


def task_of(config: PretrainedConfig) -> str:
    """The training objective: the causal-LM loss, or the masked-LM loss for encoder families."""
    architectures = getattr(config, "architectures", None) or []
    if architectures and architectures[0].endswith("ForMaskedLM"):
        return MASKED_LM
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return CAUSAL_LM
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return MASKED_LM
    raise UserError(f"unsupported architecture '{config.model_type}': it has no causal-LM or masked-LM "
                    "head in transformers; use a language model")


def spec_without_dropout(spec: ModelSpec) -> ModelSpec:
    config = copy.deepcopy(spec.config)
    for holder in [config, *(v for v in vars(config).values() if isinstance(v, PretrainedConfig))]:
        for name, value in list(vars(holder).items()):
            if is_dropout_setting(name, value):
                setattr(holder, name, 0.0)
    return replace(spec, config=config)


def spec_with_attention(spec: ModelSpec, attention: str | None) -> ModelSpec:
    """The spec whose model runs ``attention`` (transformers' attn_implementation), refused with one line where
    the model's class does not support it (its ``_supports_sdpa`` / ``_supports_flex_attn``)."""
    if attention is None:
        return spec
    implementation = ATTENTION_IMPLEMENTATIONS[attention]
    model_class = _auto_class(spec)._model_mapping.get(type(spec.config), None)
    flag = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}.get(implementation)
    if model_class is not None and flag and not getattr(model_class, flag, False):
        raise UserError(f"{spec.name} ({spec.config.model_type}) does not support --attention {attention} in "
                        f"transformers; leave --attention out for its default")
    config = copy.deepcopy(spec.config)
    config._attn_implementation = implementation
    return replace(spec, config=config)


def _auto_class(spec: ModelSpec):
    spec.config.use_cache = False
    return AutoModelForCausalLM if spec.task == CAUSAL_LM else AutoModelForMaskedLM


def build_meta_model(spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The model with every parameter on the meta device (shapes only, no weight memory), in train mode."""
    config = spec.config
    auto = _auto_class(spec)
    try:
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype)
    except Exception as exc:  # the model's own constructor, whatever it raises
        raise UserError(f"cannot build {spec.name} ({config.model_type}): {_first_line(exc)}; "
                        "check the config's hyper-parameters") from None
    return model.train()


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def has_weights(spec: ModelSpec) -> bool:
    return spec.folder is not None and any((spec.folder / name).is_file() for name in WEIGHT_FILES)


def build_real_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The model with real tensors, in train mode: the checkpoint's weights if it has any, else random.

    Weights are read from the local folder only. A checkpoint whose tensors do not fit its config
    (a missing, unexpected or differently shaped tensor) is a UserError naming the first such tensor.
    """
    auto = _auto_class(spec)
    if not has_weights(spec):
        torch.manual_seed(seed)
        with torch.device(device):
            return auto.from_config(spec.config, dtype=dtype).train()
    try:
        model, info = auto.from_pretrained(spec.folder, config=spec.config, dtype=dtype, local_files_only=True,
                                           ignore_mismatched_sizes=True, output_loading_info=True)
    except PermissionError as exc:
        raise UserError(f"{spec.folder}: cannot read its weights (permission denied: {exc.filename}); "
                        "check the files' permissions") from None
    except Exception as exc:  # safetensors' SafetensorError and torch's unpickling errors share no base class
        raise UserError(f"{spec.folder}: cannot load its weights ({type(exc).__name__}: {_first_line(exc)}); "
                        "the weight files are damaged or truncated: re-save the checkpoint with save_pretrained") from None
    _check_loaded(spec, info)
    return model.to(device).train()


def _check_loaded(spec: ModelSpec, info: dict) -> None:
    problems = [(str(key), "is missing from the checkpoint") for key in info.get("missing_keys", ())]
    problems += [(str(key), "is in the checkpoint but not in the model its config builds")
                 for key in info.get("unexpected_keys", ())]
    for entry in info.get("mismatched_keys", ()):
        key, *shapes = entry if isinstance(entry, (tuple, list)) else (entry,)
        saved, built = (list(shape) for shape in shapes) if len(shapes) == 2 else ("?", "?")
        problems.append((str(key), f"has shape {saved} in the checkpoint but {built} in its config"))
    if problems:
        tensor, what = min(problems)
        raise UserError(f"{spec.folder}: weights do not fit config.json: tensor '{tensor}' {what}; "
                        "use the config the checkpoint was saved with")


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: a multimodal model's text (decoder) sub-config, else the config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def setting(config: PretrainedConfig, name: str, default=None):
    """One hyper-parameter of the language model, or ``default`` where it has none or keeps it per
    layer (per-layer configs refuse a global read of such a size)."""
    try:
        value = getattr(text_config(config), name, default)
    except Exception:  # transformers' per-layer attribute errors have no common base class
        return default
    return default if value is None else value


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the model takes; None where the config sets no limit (XLNet's -1)."""
    limit = setting(config, "max_position_embeddings")
    return limit if isinstance(limit, int) and limit > 0 else None


def trainable_parameter_count(model: torch.nn.Module) -> int:
    """Trainable parameters, tied weights counted once (named_parameters de-duplicates them)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def step_seq(spec: ModelSpec, seq: int | None) -> int:
    """The sequence length of the step: the one asked for, else min(1024, the model's limit)."""
    limit = max_positions(spec.config)
    seq = seq or min(1024, limit or 1024)
    if limit is not None and seq > limit:
        raise UserError(f"--seq {seq} exceeds {spec.name}'s max_position_embeddings ({limit}); use a shorter --seq")
    if spec.task == CAUSAL_LM and seq < 2:  # the shifted labels would be empty: a NaN loss, no gradient
        raise UserError(f"--seq {seq}: a causal LM predicts each next token, so a step needs --seq 2 or more")
    return seq


def _first_line(exc: BaseException) -> str:
    """The message on one line (validators spread theirs over several), at most 300 characters."""
    text = " ".join(str(exc).split())
    return text[:300] if text else type(exc).__name__
