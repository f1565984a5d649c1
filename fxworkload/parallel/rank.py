"""One rank's layer-level workload: the units of its pipeline stage with every collective it runs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .facts import ModelFacts
from .collectives import add_model_parallel, data_parallel_units, stage_units
from ..dtypes import DTYPES
from .layout import Parallel, stage_layers
from .units import EMBEDDING, HEAD, Unit, split
from ..workload.table import Workload


@dataclass
class RankWorkload:
    parallel: Parallel
    units: list[Unit]  # forward order, data-parallel rows included
    layers: range  # the stage's decoder layers
    pp_comm_bytes: int  # one stage-boundary send (0 with pp = 1)


def rank_workload(facts: ModelFacts, workload: Workload, parallel: Parallel, micro_batch: int, seq: int,
                  dtype: str, grad_dtype: str) -> RankWorkload:
    """``workload`` is the rank's per-node table (captured from the tensor/expert-sharded model)."""
    units = split(workload, facts.stack, list(facts.row_parallel))
    stages = stage_layers(parallel, facts.layers)
    last = parallel.stage == parallel.pp - 1
    mine = stage_units(units, stages[parallel.stage], parallel.stage == 0, last)
    if last and parallel.pp > 1 and facts.tied_embedding is not None:
        keep_tied_copy(facts.tied_embedding, units, mine)
    act_itemsize, grad_itemsize = DTYPES[dtype].itemsize, DTYPES[grad_dtype].itemsize
    add_model_parallel(mine, parallel, micro_batch, seq, facts.hidden, act_itemsize, facts.top_k)
    boundary = micro_batch * seq * facts.hidden * act_itemsize // (parallel.tp if parallel.sp else 1)
    return RankWorkload(parallel=parallel, units=data_parallel_units(mine, parallel, grad_itemsize, act_itemsize),
                        layers=stages[parallel.stage], pp_comm_bytes=boundary if parallel.pp > 1 else 0)


def keep_tied_copy(embedding_path: str, units: list[Unit], mine: list[Unit]) -> None:
    """With pipeline stages, a head tied to the input embedding keeps its own copy of the weight on
    the last stage (Megatron-LM), whose gradient that stage's data-parallel group reduces too."""
    tied = [g for u in units if u.block == EMBEDDING for g in u.grads if g.module == embedding_path]
    for unit in mine:
        if unit.block == HEAD:
            unit.grads.extend(replace(g, name=f"{g.name}_tied_copy") for g in tied)
