"""Parallel training settings (Megatron-LM's layout), their checks against a model, and the pipeline stages."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UserError


@dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel replicas
    tp: int = 1  # tensor-parallel ranks
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel ranks, carved out of dp as in Megatron-LM
    sp: bool = False  # sequence parallelism (needs tp > 1)
    micro_batches: int = 1  # per step and pipeline (gradient accumulation)
    zero: int = 0  # ZeRO stage 0-3
    bucket_mb: float = 25.0  # gradient bucket cap in MiB (PyTorch DDP's default); 0 = one per parameter group
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None = balanced
    stage: int = 0  # the pipeline stage whose rank the SimAI file describes
    vocab_multiple: int = 1  # pad the vocabulary to a multiple of this x tp (Megatron's --make-vocab-size-divisible-by)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def as_dict(self) -> dict:
        out = asdict(self)
        out["pp_layers"] = list(self.pp_layers) if self.pp_layers else None
        return out | {"world": self.world}


def check(parallel: Parallel, facts) -> None:
    """Reject, in one line, any setting this model cannot be split by."""
    p = parallel
    for name in ("dp", "tp", "pp", "ep", "micro_batches", "vocab_multiple"):
        if getattr(p, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(p, name)}")
    if p.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero must be 0, 1, 2 or 3, got {p.zero}")
    if p.bucket_mb < 0:
        raise UserError(f"--bucket-mb must be 0 (one collective per parameter group) or positive, got {p.bucket_mb}")
    if p.sp and p.tp == 1:
        raise UserError("--sp splits the sequence over the tensor-parallel group: it needs --tp > 1")
    if not 0 <= p.stage < p.pp:
        raise UserError(f"--stage {p.stage} is not a pipeline stage: use 0..{p.pp - 1}")
    if p.dp % p.ep:
        raise UserError(f"--ep {p.ep} must divide --dp {p.dp}: expert-parallel ranks are drawn from the data-parallel ones")
    experts = facts.experts
    for count, what in ((facts.heads, "attention heads"), (facts.kv_heads, "key/value heads"), (facts.vocab, "vocabulary")):
        if count and count % p.tp:  # a count of 0: the model has none (no attention heads), nothing to split
            hint = " or pad it with --vocab-multiple 128 as Megatron-LM does" if what == "vocabulary" else ""
            raise UserError(f"--tp {p.tp} does not divide the model's {count} {what}; "
                            f"choose a --tp that divides it{hint}")
    if p.ep > 1 and not experts:
        raise UserError(f"--ep {p.ep} needs a mixture-of-experts model; {facts.model_type} has no experts")
    if experts and experts % p.ep:
        raise UserError(f"--ep {p.ep} does not divide the model's {experts} experts; choose an --ep that divides it")
    stage_layers(p, facts.layers)


def padded_vocab(parallel: Parallel, vocab: int) -> int:
    """Megatron-LM's padding: up to a multiple of vocab_multiple x tp (unchanged when vocab_multiple is 1)."""
    if parallel.vocab_multiple == 1:
        return vocab
    step = parallel.vocab_multiple * parallel.tp
    return -(-vocab // step) * step


def stage_layers(parallel: Parallel, layers: int) -> list[range]:
    """The decoder layers of each pipeline stage: --pp-layers, else layers / pp each."""
    p = parallel
    if p.pp_layers is not None:
        counts = list(p.pp_layers)
        if len(counts) != p.pp or sum(counts) != layers or min(counts) < 0:
            raise UserError(f"--pp-layers {','.join(map(str, counts))} must give {p.pp} non-negative counts "
                            f"summing to the model's {layers} layers")
    elif layers % p.pp:
        raise UserError(f"--pp {p.pp} does not divide the model's {layers} layers; "
                        "choose a --pp that divides it or give --pp-layers")
    else:
        counts = [layers // p.pp] * p.pp
    starts = [sum(counts[:i]) for i in range(p.pp)]
    return [range(start, start + count) for start, count in zip(starts, counts)]
