"""Memory per rank: model states against the ZeRO paper's figures and the real module's parameter
count; activations in flight under 1F1B; whether the rank fits the device."""

from __future__ import annotations

import pytest
import torch

from fxworkload.capture import models
from fxworkload.parallel.layout import Parallel
from fxworkload.parallel.memory import model_state_bytes
from fxworkload.pipeline import extract


@pytest.mark.parametrize("zero, per_gpu_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_model_states_match_the_zero_papers_example(zero, per_gpu_gb):
    """Rajbhandari et al. 2020, Figure 1: a 7.5B model, mixed-precision Adam, 64 GPUs: 2Ψ + 2Ψ + 12Ψ
    bytes per GPU, 120 GB; ZeRO stages 1, 2, 3: 31.4, 16.6 and 1.9 GB (GB = 10^9 bytes)."""
    states = model_state_bytes(7_500_000_000, 0, "fp16", "fp16", zero, dp=64)
    assert round(sum(states) / 1e9, 1) == per_gpu_gb


def test_rank_model_states_follow_the_real_module_and_the_layout(tiny_dirs):
    real = models.trainable_parameter_count(models.build_meta_model(models.resolve(str(tiny_dirs["llama"])),
                                                                   torch.float32))
    for zero in (0, 1, 2, 3):
        memory = extract(str(tiny_dirs["llama"]), seq=16, dtype="bf16", grad_dtype="fp32",
                         parallel=Parallel(dp=4, zero=zero)).memory
        divide = [4 if zero >= stage else 1 for stage in (3, 2, 1)]
        assert memory.parameters_bytes == -(-real * 2 // divide[0])
        assert memory.gradients_bytes == -(-real * 4 // divide[1])
        assert memory.optimizer_bytes == -(-real * 12 // divide[2])


def test_1f1b_holds_pp_minus_stage_micro_batches_of_saved_activations(tmp_path):
    from ..conftest import tiny_config

    tiny_config("llama", num_hidden_layers=4).save_pretrained(tmp_path)
    results = [extract(str(tmp_path), seq=16, parallel=Parallel(pp=4, dp=1, micro_batches=8, stage=s)) for s in (0, 3)]
    for stage, result in zip((0, 3), results):
        rows = [r for u in result.rank.units if u.block != "dp" for r in u.rows]
        assert result.memory.micro_batches_in_flight == 4 - stage
        assert result.memory.activations_bytes == (4 - stage) * sum(r.saved_bytes for r in rows)


def test_workload_json_says_whether_the_rank_fits(tiny_dirs, tmp_path):
    import json

    from fxworkload.cli import main

    assert main(["extract", str(tiny_dirs["llama"]), "--seq", "16", "--device", "h100-sxm", "--out",
                 str(tmp_path / "o")]) == 0
    memory = json.loads((tmp_path / "o" / "workload.json").read_text())["memory"]
    from fxworkload.cost.devices import load

    assert memory["capacity_bytes"] == load("h100-sxm").memory_capacity_bytes == 81079 * 2 ** 20  # measured (lent H100)
    assert memory["fits"] is True and memory["total_peak_bytes"] < memory["capacity_bytes"]
    assert memory["total_peak_bytes"] == sum(memory[k] for k in ("parameters_bytes", "gradients_bytes",
                                                                  "optimizer_bytes", "activations_bytes",
                                                                  "transient_bytes"))


def test_the_fit_line_says_by_how_much_a_rank_misses():
    from fxworkload.parallel.memory import RankMemory, describe_fit

    gib = 2 ** 30
    over = RankMemory(parameters_bytes=50 * gib, gradients_bytes=20 * gib, optimizer_bytes=10 * gib,
                      activations_bytes=5 * gib, transient_bytes=gib, step_peak_bytes=6 * gib,
                      total_peak_bytes=86 * gib, micro_batches_in_flight=1, capacity_bytes=80 * gib)
    assert over.fits is False
    assert describe_fit(over, "h100-sxm") == "86.00 GiB of 80.0 GiB: does NOT fit, 6.00 GiB over"


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_sequence_parallelism_only_ever_shrinks_a_ranks_memory(tiny_dirs, recompute):
    """SP keeps 1/tp of the norms' and residuals' saves; the step's transient does not grow for it."""
    plain, split = (extract(str(tiny_dirs["llama"]), batch=2, seq=16, dtype="bf16", device="h100-sxm",
                            parallel=Parallel(tp=2, sp=sp, recompute=recompute)).memory for sp in (False, True))
    assert split.activations_bytes < plain.activations_bytes or recompute == "full"
    assert split.transient_bytes <= plain.transient_bytes
    assert split.total_peak_bytes < plain.total_peak_bytes


@pytest.mark.parametrize("vpp", [1, 2, 4])
def test_interleaving_holds_korthikantis_extra_share_of_activations(vpp, tmp_path):
    """The first stage of p stages with v chunks holds p(1 + (p - 1)/(p·v)) micro-batches' worth;
    without interleaving (1F1B), p."""
    from ..conftest import tiny_config

    tiny_config("llama", num_hidden_layers=8).save_pretrained(tmp_path)
    pp = 2
    result = extract(str(tmp_path), batch=1, seq=16, dtype="bf16", device="h100-sxm",
                     parallel=Parallel(pp=pp, vpp=vpp, micro_batches=8))
    saved = sum(row.saved_bytes for u in result.rank.units if u.block != "dp" for row in u.rows)
    factor = pp * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else pp
    assert result.memory.activations_bytes == pytest.approx(saved * factor, abs=1)


def test_keeping_zero3s_gathered_parameters_holds_a_whole_copy_beside_the_shards(tiny_dirs):
    """FSDP2's reshard_after_forward=False: at the end of the forward every unit's all-gathered parameters
    are held: the rank's whole parameters in the step dtype (the real module's count x 2 bytes, bf16)."""
    layout = dict(dp=4, zero=3)
    freed = extract(str(tiny_dirs["llama"]), seq=16, dtype="bf16", parallel=Parallel(**layout)).memory
    kept = extract(str(tiny_dirs["llama"]), seq=16, dtype="bf16",
                   parallel=Parallel(**layout, reshard_after_forward=False)).memory
    real = models.build_meta_model(models.resolve(str(tiny_dirs["llama"])), torch.bfloat16)
    whole = sum(p.numel() for p in real.parameters()) * 2
    assert freed.gathered_parameters_bytes == 0
    assert kept.gathered_parameters_bytes == whole
    assert kept.total_peak_bytes - freed.total_peak_bytes == whole
