"""One rank's layer-level workload: the units of its pipeline stage with every collective it runs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..capture import models
from .collectives import add_model_parallel, data_parallel_units, stage_units
from ..dtypes import DTYPES
from ..workload.layers import layer_stack
from .layout import Parallel, stage_layers
from .tensor_parallel import path_of, plan_for
from .units import EMBEDDING, HEAD, Unit, split
from ..workload.table import Workload


@dataclass
class RankWorkload:
    parallel: Parallel
    units: list[Unit]  # forward order, data-parallel rows included
    layers: range  # the stage's decoder layers
    pp_comm_bytes: int  # one stage-boundary send (0 with pp = 1)


def rank_workload(spec: models.ModelSpec, workload: Workload, parallel: Parallel, micro_batch: int, seq: int,
                  dtype: str, grad_dtype: str) -> RankWorkload:
    """``workload`` is the rank's per-node table (captured from the tensor/expert-sharded model)."""
    config = spec.config
    model = models.build_meta_model(spec, DTYPES[dtype])
    plan = plan_for(model)
    stack = layer_stack(model, config.num_hidden_layers)
    units = split(workload, stack, plan.row_parallel_modules() if plan else [])
    stages = stage_layers(parallel, config.num_hidden_layers)
    last = parallel.stage == parallel.pp - 1
    mine = stage_units(units, stages[parallel.stage], parallel.stage == 0, last)
    if last and parallel.pp > 1:
        _keep_tied_copy(model, units, mine)
    act_itemsize, grad_itemsize = DTYPES[dtype].itemsize, DTYPES[grad_dtype].itemsize
    add_model_parallel(mine, parallel, micro_batch, seq, config.hidden_size, act_itemsize,
                       getattr(config, "num_experts_per_tok", 1) or 1)
    boundary = micro_batch * seq * config.hidden_size * act_itemsize // (parallel.tp if parallel.sp else 1)
    return RankWorkload(parallel=parallel, units=data_parallel_units(mine, parallel, grad_itemsize, act_itemsize),
                        layers=stages[parallel.stage], pp_comm_bytes=boundary if parallel.pp > 1 else 0)


def _keep_tied_copy(model, units: list[Unit], mine: list[Unit]) -> None:
    """With pipeline stages, a head tied to the input embedding keeps its own copy of the weight on
    the last stage (Megatron-LM), whose gradient that stage's data-parallel group reduces too."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return
    path = path_of(model, embedding)
    tied = [g for u in units if u.block == EMBEDDING for g in u.grads if g.module == path]
    for unit in mine:
        if unit.block == HEAD:
            unit.grads.extend(replace(g, name=f"{g.name}_tied_copy") for g in tied)
