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
    head_dim_config: int = 0  # values per attention head, where the config says (0: hidden / heads)
    max_positions: int = 0  # the longest sequence the model takes (max_position_embeddings); 0: no limit

    @property
    def head_dim(self) -> int:
        return self.head_dim_config or (self.hidden // self.heads if self.heads else 0)


def model_facts(spec, model) -> ModelFacts:
    """The facts of a resolved spec and its (meta) model."""
    from ..capture.models import max_positions, setting
    from ..workload.layers import layer_stack
    from .tensor_parallel import path_of, plan_for

    config = spec.config
    plan = plan_for(model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    heads = _count(setting(config, "num_attention_heads", 0))  # 0: no attention (state-space models)
    layers = _count(setting(config, "num_hidden_layers", 0))
    return ModelFacts(
        name=spec.name, model_type=config.model_type, task=spec.task, layers=layers,
        hidden=_count(setting(config, "hidden_size", 0)), heads=heads,
        kv_heads=_count(setting(config, "num_key_value_heads", 0)) or heads,
        vocab=_count(setting(config, "vocab_size", 0)), experts=experts_of(config),
        top_k=_count(setting(config, "num_experts_per_tok", 1)) or 1,
        stack=layer_stack(model, layers) if layers else None,
        row_parallel=tuple(plan.row_parallel_modules()) if plan else (),
        tied_embedding=path_of(model, embedding) if tied else None,
        head_dim_config=_count(setting(config, "head_dim", 0)), max_positions=max_positions(config) or 0)


def _count(value) -> int:
    """A size the parallel checks can divide: an int, else 0 (a model without it, or one kept per layer)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def experts_of(config) -> int:
    from ..capture.models import setting

    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if _count(setting(config, name)):
            return setting(config, name)
    return 0


def check_positions(facts: ModelFacts, seq: int) -> None:
    """The whole sequence (all context-parallel ranks' tokens) within the model's positions."""
    from ..errors import UserError

    if facts.max_positions and seq > facts.max_positions:
        raise UserError(f"--seq {seq} exceeds {facts.name}'s max_position_embeddings ({facts.max_positions}); "
                        "use a shorter --seq")
