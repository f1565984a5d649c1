"""How one rank's training step runs, as one object (Calculon's *execution*): what ``extract`` captures and
costs, what ``plan`` evaluates each layout with, and what the cluster's step reads.

The model (Calculon's *application*) is the ``extract`` argument; where the step runs (the *system*:
the device profile, its memory tiers and network) is ``cost.system.System``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..capture.sdpa_backends import check_attention
from ..errors import UserError
from ..limits import check_settings
from ..workload.fp8_recipes import check_recipe
from ..workload.stacks import check_stack
from .layout import Parallel, check_values


@dataclass(frozen=True)
class Execution:
    """One rank's step: its micro-batch and sequence, its dtypes, the layout it belongs to (``parallel``:
    TP/CP/PP/DP/EP, ZeRO, recomputation, the overlaps and offloads), the stack that runs its kernels,
    FP8, and the attention the model runs."""
    batch: int = 1  # the rank's micro-batch, sequences
    seq: int | None = None  # the whole sequence, tokens (a CP rank holds seq / cp); None: the model's own
    dtype: str = "fp32"  # parameters and activations
    grad_dtype: str | None = None  # the gradients' reduction; None: ``dtype``
    parallel: Parallel = field(default_factory=Parallel)
    stack: str = "eager"  # whose kernels and saved activations (workload/stacks.py)
    fp8: bool = False  # the decoder layers' linear GEMMs in FP8 (workload/fp8.py)
    fp8_recipe: str = "te"  # with fp8: Transformer Engine's delayed or current scaling, torchao's tensor-wise or row-wise
    dropout: bool = True  # False: every dropout probability of the config 0 (a loop in eval mode)
    sdpa_backends: tuple[str, ...] | None = None  # the attention kernels enabled; None: all, in the GPU's order
    attention: str | None = None  # transformers' attention implementation (sdpa, eager, flex); None: the model's

    @property
    def gradients(self) -> str:
        """The gradients' dtype, resolved (only None is the default: an empty name is refused, not defaulted)."""
        return self.dtype if self.grad_dtype is None else self.grad_dtype

    @property
    def seq_per_rank(self) -> int:
        """The tokens of the sequence one context-parallel rank holds (``seq`` resolved first)."""
        if self.seq is None:
            raise ValueError("the execution's sequence is not resolved yet")
        return self.seq // self.parallel.cp

    def checked(self) -> Execution:
        """This execution, or one line on what is wrong with it (a UserError) before any work starts."""
        check_settings(self.batch, self.seq, self.dtype, self.grad_dtype)
        check_values(self.parallel)
        check_stack(self.stack)
        check_attention(self.attention)
        if self.fp8:
            check_recipe(self.fp8_recipe)
            if self.fp8_recipe == "torchao-rowwise" and self.parallel.fp8_param_gather:
                raise UserError("--fp8-param-gather with --fp8-recipe torchao-rowwise: torchao's FSDP float8 "
                                "all-gather is tensor-wise only (torchtitan: 'not supported' with a recipe name); "
                                "use --fp8-recipe torchao or leave the flag out")
        elif self.fp8_recipe != "te":
            raise UserError(f"--fp8-recipe {self.fp8_recipe} says how FP8 GEMMs are scaled: it needs --fp8")
        elif self.parallel.fp8_param_gather:
            raise UserError("--fp8-param-gather gathers the FP8 linear weights: it needs --fp8")
        return self


FIELDS = frozenset(f.name for f in fields(Execution))
