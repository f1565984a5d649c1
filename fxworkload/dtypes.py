"""The dtypes a step can be captured in, by the names the CLI and the files use, and the step's basic settings check."""

from __future__ import annotations

import torch

from .errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def check_settings(batch: int, seq: int | None, dtype: str, grad_dtype: str | None = None) -> None:
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be a positive integer, got {value}")
    for name, value in (("dtype", dtype), ("grad-dtype", grad_dtype)):
        if value is not None and value not in DTYPES:
            raise UserError(f"unknown --{name} '{value}': use one of {', '.join(DTYPES)}")
