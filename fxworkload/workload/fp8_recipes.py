"""The FP8 recipes ``--fp8-recipe`` names (workload/fp8.py costs them), apart so that checking one needs no torch: a
plan read from its cache never imports it; nor checking that a device and dtype can train in FP8."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    from ..cost.devices import DeviceProfile

ROWWISE = "torchao-rowwise"
TE_RECIPES = ("te", "te-current")  # Transformer Engine's: its own kernels, its weights' FP8 copies kept a step
FP8_RECIPES = (*TE_RECIPES, "torchao", ROWWISE)


def check_recipe(recipe: str) -> str:
    if recipe not in FP8_RECIPES:
        raise UserError(f"unknown --fp8-recipe {recipe!r}: use te (Transformer Engine, delayed scaling), te-current "
                        "(its current scaling), torchao (torchao's Float8Linear, dynamic tensor-wise scaling) or "
                        "torchao-rowwise (its row-wise recipe)")
    return recipe


def check_fp8(device: DeviceProfile, dtype: str) -> None:
    if dtype not in ("bf16", "fp16"):
        raise UserError(f"--fp8 runs the linear layers' GEMMs in FP8 around a 16-bit step: use --dtype bf16, not {dtype}")
    if "fp8" not in device.matmul_flops_per_s:
        raise UserError(f"device '{device.name}' has no FP8 tensor cores in its profile (matmul_flops_per_s.fp8); "
                        "--fp8 needs Hopper, Ada, Blackwell or CDNA 3 (see 'fxworkload devices')")
    if not device.sm_count:
        raise UserError(f"--fp8 times GEMMs with the GPU model: device '{device.name}' is not a GPU profile")
