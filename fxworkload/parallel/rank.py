"""One device's layer-level workload: the units of its model chunks with every collective it runs.

A device holds one pipeline stage, or with ``--vpp`` v model chunks (virtual stages c·pp + d,
Megatron-LM's interleaved schedule). Its units are split from the per-node table once per table
(a layout search evaluates many layouts of one) and copied per layout, which attaches its
collectives and tied gradients to the copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..capture.trace import FORWARD, INPUT_GRAD, WEIGHT_GRAD
from ..dtypes import DTYPES
from ..memo import Memo
from ..workload.stacks import STACKS
from ..workload.table import Workload
from .collectives import add_model_parallel, data_parallel_units, stage_units
from .context_parallel import kv_bytes
from .execution import Execution
from .facts import ModelFacts
from .layout import Parallel, virtual_stage_layers
from .recompute import recomputed_layers
from .units import EMBEDDING, HEAD, Unit, split


@dataclass
class RankWorkload:
    parallel: Parallel
    units: list[Unit]  # forward order, chunk after chunk, data-parallel rows included
    chunks: list[list[Unit]]  # the device's model chunks (one unless --vpp), the same Unit objects
    chunk_layers: list[range]  # each chunk's decoder layers
    pp_comm_bytes: int  # one stage-boundary send (0 with pp = 1)

    @property
    def layers(self) -> list[int]:
        return [layer for chunk in self.chunk_layers for layer in chunk]


def rank_workload(facts: ModelFacts, workload: Workload, execution: Execution) -> RankWorkload:
    """The units and collectives of ``execution``'s rank (its layout's ``stage``); ``workload`` is the rank's
    per-node table (captured from the tensor/expert-sharded model)."""
    parallel, micro_batch, seq = execution.parallel, execution.batch, execution.seq_per_rank
    dtype, grad_dtype = execution.dtype, execution.gradients
    chunks, units = device_chunks(facts, workload, parallel, parallel.stage, micro_batch, seq, dtype, grad_dtype)
    ranges = virtual_stage_layers(parallel, facts.layers)
    boundary = micro_batch * seq * facts.hidden * DTYPES[dtype].itemsize // (parallel.tp if parallel.sp else 1)
    return RankWorkload(parallel=parallel, units=units, chunks=chunks,
                        chunk_layers=[ranges[c * parallel.pp + parallel.stage] for c in range(parallel.vpp)],
                        pp_comm_bytes=boundary if parallel.pp > 1 else 0)


def device_chunks(facts: ModelFacts, workload: Workload, p: Parallel, device: int, micro_batch: int, seq: int,
                  dtype: str, grad_dtype: str) -> tuple[list[list[Unit]], list[Unit]]:
    """Device ``device``'s model chunks (units, collectives attached) and its units in forward order
    with the data-parallel rows inserted where DDP issues them."""
    chunks = model_parallel_chunks(facts, workload, p, device, micro_batch, seq, dtype)
    mine = [u for chunk in chunks for u in chunk]
    return chunks, data_parallel_units(mine, p, DTYPES[grad_dtype].itemsize, DTYPES[dtype].itemsize,
                                       workload.fp8_modules)


# A layout search asks for the same device's chunks under every ZeRO stage, data-parallel degree and
# micro-batch count (and again for its memory): they are made once; the chunks returned are not to be changed.
_CHUNKS = Memo(4096)
MODEL_PARALLEL_FIELDS = ("pp", "vpp", "pp_layers", "tp", "sp", "cp", "cp_comm", "ep", "vocab_multiple", "tp_comm_overlap",
                         "recompute", "recompute_layers")


def model_parallel_chunks(facts: ModelFacts, workload: Workload, p: Parallel, device: int, micro_batch: int,
                          seq: int, dtype: str) -> list[list[Unit]]:
    """Device ``device``'s model chunks with their tensor-, context- and expert-parallel collectives:
    what the data-parallel degree, ZeRO and the micro-batch count leave unchanged."""
    key = (id(workload), device, micro_batch, seq, dtype, *(getattr(p, name) for name in MODEL_PARALLEL_FIELDS))
    return _CHUNKS.get(key, (workload,), lambda: _model_parallel_chunks(facts, workload, p, device, micro_batch, seq,
                                                                         dtype))


def _model_parallel_chunks(facts: ModelFacts, workload: Workload, p: Parallel, device: int, micro_batch: int,
                           seq: int, dtype: str) -> list[list[Unit]]:
    units = split_once(facts, workload)
    chunks = [[_fresh(u) for u in chunk] for chunk in model_chunks(facts, units, p, device)]
    mine = [u for chunk in chunks for u in chunk]
    if device == p.pp - 1 and p.pp > 1 and facts.tied_embedding is not None:
        keep_tied_copy(facts.tied_embedding, units, mine)
    act_itemsize = DTYPES[dtype].itemsize
    again = frozenset(recomputed_layers(p, facts.layers)) if p.recompute == "full" else frozenset()
    add_model_parallel(mine, p, micro_batch, seq, facts.hidden, act_itemsize, facts.top_k,
                       kv_bytes(micro_batch, seq, facts.kv_heads or facts.heads, facts.head_dim, p.tp, act_itemsize),
                       again, STACKS[workload.stack], workload.fp8_tp_gathers, facts.experts,
                       bool(workload.fp8_modules))
    return chunks


def model_chunks(facts: ModelFacts, units: list[Unit], p: Parallel, device: int) -> list[list[Unit]]:
    """The units of each of the device's chunks: its layers, the embedding on virtual stage 0, the head on the last."""
    ranges = virtual_stage_layers(p, facts.layers)
    last = len(ranges) - 1
    return [stage_units(units, ranges[c * p.pp + device], c * p.pp + device == 0, c * p.pp + device == last)
            for c in range(p.vpp)]


_SPLIT = Memo(64)


def split_once(facts: ModelFacts, workload: Workload) -> list[Unit]:
    """The workload's units with their summed costs, split once per table."""
    return _SPLIT.get(id(workload), (workload,), lambda: _split_with_costs(facts, workload))


def _split_with_costs(facts: ModelFacts, workload: Workload) -> list[Unit]:
    units = split(workload, facts.stack, list(facts.row_parallel))
    for u in units:
        u.costs, u.core_ns, u.host_wait_ns = {}, {}, {}
        for ph in (FORWARD, INPUT_GRAD, WEIGHT_GRAD):
            ops = u.ops(ph)
            u.costs[ph] = (u.pass_ns(ph), sum(op.flops for op in ops))  # the host's pace where it is the slower
            u.host_wait_ns[ph] = u.host_wait(ph)
            u.core_ns[ph] = sum(op.estimated_ns for op in ops if op.sdpa_backend)
        u.saved_bytes = sum(row.saved_bytes for row in u.rows)
    return units


def _fresh(unit: Unit) -> Unit:
    """A copy a layout may attach its collectives and tied gradients to."""
    fresh = object.__new__(Unit)  # not dataclasses.replace or copy.copy: a layout search makes thousands
    fresh.__dict__.update(unit.__dict__)
    fresh.grads = list(unit.grads)
    fresh.comms = {FORWARD: [], INPUT_GRAD: [], WEIGHT_GRAD: []}
    return fresh


def keep_tied_copy(embedding_path: str, units: list[Unit], mine: list[Unit]) -> None:
    """With pipeline stages, a head tied to the input embedding keeps its own copy of the weight on
    the last stage (Megatron-LM), whose gradient that stage's data-parallel group reduces too."""
    tied = [g for u in units if u.block == EMBEDDING for g in u.grads if g.module == embedding_path]
    for unit in mine:
        if unit.block == HEAD:
            unit.grads.extend(replace(g, name=f"{g.name}_tied_copy") for g in tied)
