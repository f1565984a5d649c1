"""The attention kernels a run may enable (``torch.nn.attention.sdpa_kernel``) and the attention implementation
it may set (``--attention``), by name; no torch here, so ``plan``'s parent process can check them without
importing it."""

from __future__ import annotations

from ..errors import UserError

CUDNN, FLASH, EFFICIENT, MATH = "cudnn", "flash", "efficient", "math"
# torch.nn.attention.SDPBackend's fused kernels and the math path, in the order select_sdp_backend tries them
# by default when it does not prefer cuDNN (sdp_utils.cpp's priority_order: flash, efficient, math, cudnn)
SDPA_BACKENDS = (FLASH, EFFICIENT, MATH, CUDNN)


def check_sdpa_backends(sdpa_backends: tuple[str, ...] | None) -> None:
    """None (every backend) or a non-empty list of known names."""
    if sdpa_backends is None:
        return
    unknown = [b for b in sdpa_backends if b not in SDPA_BACKENDS]
    if unknown or not sdpa_backends:
        raise UserError(f"--sdpa-backends {','.join(sdpa_backends)!r}: name one or more of {', '.join(SDPA_BACKENDS)}, "
                        "comma-separated (torch.nn.attention.SDPBackend's FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH, "
                        "CUDNN_ATTENTION)")


# --attention: transformers' attn_implementation a run sets (None: the model's own default)
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention"}


def check_attention(attention: str | None) -> None:
    if attention is not None and attention not in ATTENTION_IMPLEMENTATIONS:
        raise UserError(f"unknown --attention '{attention}': use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
