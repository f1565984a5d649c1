"""The dtypes a step can be captured in, by the names the CLI and the files use (their check: limits.py)."""

from __future__ import annotations

import torch

from .limits import STEP_DTYPES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
assert tuple(DTYPES) == STEP_DTYPES  # the names limits.py checks without importing torch
