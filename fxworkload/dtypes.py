"""The dtypes a step can be captured in, by the names the CLI and the files use, and the step's basic settings check."""

from __future__ import annotations

import torch

from .errors import UserError
from .limits import MAX_BATCH, MAX_SEQ, MAX_TOKENS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def check_settings(batch: int, seq: int | None, dtype: str, grad_dtype: str | None = None) -> None:
    for name, value, limit in (("batch", batch, MAX_BATCH), ("seq", seq, MAX_SEQ)):
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be a positive integer, got {value}")
        if value is not None and value > limit:
            raise UserError(f"--{name} {value:,} exceeds {limit:,}, more than any real training step; check it")
    if seq is not None and batch * seq > MAX_TOKENS:
        raise UserError(f"--batch x --seq = {batch * seq:,} tokens per micro-batch exceeds {MAX_TOKENS:,}; "
                        "use a smaller --batch (and more --micro-batches)")
    for name, value in (("dtype", dtype), ("grad-dtype", grad_dtype)):
        if value is not None and value not in DTYPES:
            raise UserError(f"unknown --{name} '{value}': use one of {', '.join(DTYPES)}")
