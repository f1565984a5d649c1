"""What the steps after capture need to know of a model, as plain data.

A cached step is stored with its ModelFacts, so that re-costing it and cutting a rank from it
import neither transformers nor the model's code: the facts are read once, from the model built
on the meta device, when the step is captured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    name: str
    model_type: str
    task: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int  # as traced (padded when --vocab-multiple asks)
    experts: int  # 0 for a dense model
    top_k: int  # experts per token (1 for a dense model)
    stack: str | None  # path of the ModuleList holding the decoder layers
    row_parallel: tuple[str, ...]  # modules whose output Megatron reduces (from the TP plan)
    tied_embedding: str | None  # path of the input embedding when the head shares its weight


def model_facts(spec, model) -> ModelFacts:
    """The facts of a resolved spec and its (meta) model."""
    from ..workload.layers import layer_stack
    from .tensor_parallel import path_of, plan_for

    config = spec.config
    plan = plan_for(model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    heads = getattr(config, "num_attention_heads", None) or 0  # 0: no attention (state-space models)
    layers = getattr(config, "num_hidden_layers", None) or 0
    return ModelFacts(
        name=spec.name, model_type=config.model_type, task=spec.task, layers=layers,
        hidden=getattr(config, "hidden_size", None) or 0, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        vocab=config.vocab_size, experts=experts_of(config),
        top_k=getattr(config, "num_experts_per_tok", 1) or 1, stack=layer_stack(model, layers) if layers else None,
        row_parallel=tuple(plan.row_parallel_modules()) if plan else (),
        tied_embedding=path_of(model, embedding) if tied else None)


def experts_of(config) -> int:
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return 0
