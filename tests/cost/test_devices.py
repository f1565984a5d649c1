"""The shipped GPU profiles against their datasheets' figures, written here as the datasheets state
them (dense tensor peaks: half the "with sparsity" figures the NVIDIA datasheets print)."""

from __future__ import annotations

import statistics

import pytest

from fxworkload.cost.devices import load

MIB = 2 ** 20
# What CUDA reports as total_memory (torch.cuda.get_device_properties), MiB, where it was measured or published:
# the lent H100 SXM and H200 (bench/data/lent-gpus/*/gpu.txt), an A100 80GB PCIe (ekondis/mixbench issue 47:
# "Total global mem: 81049 MB"), an A100-SXM4-40GB (bottlerocket-os/bottlerocket pull 3873, deviceQuery: "40339
# MBytes"), a Tesla T4 (NVIDIA/DALI issue 1813, TensorFlow: "deviceMemorySize: 14.75GiB")
CUDA_TOTAL_MIB = {"h100-sxm": 81079, "h200": 143155, "a100-pcie-80gb": 81049, "a100-40gb": 40339, "t4": 14.75 * 1024}
# nvidia-smi's memory.total, MiB, on the lent boards and as modal-labs/modal-client pull 2797 lists it (ECC on)
NVIDIA_SMI_MIB = {"h100-sxm": 81559, "h200": 143771, "l4": 23034, "l40s": 46068}
SIBLING = {"a100-80gb": "a100-pcie-80gb", "a100-pcie-40gb": "a100-40gb"}  # the same memory, another board


def cuda_total_bytes(name: str, gb: float) -> float:
    """What CUDA reports for a GPU whose datasheet says ``gb`` GB: measured where it was (or on the board with
    the same memory); from nvidia-smi's figure times the share CUDA reports of it on the lent boards; else the
    datasheet's GB read as GiB (memory chips are sized in GiB) times the median share CUDA reported of that on
    the four boards measured."""
    name = SIBLING.get(name, name)
    if name in CUDA_TOTAL_MIB:
        return CUDA_TOTAL_MIB[name] * MIB
    if name in NVIDIA_SMI_MIB:
        share = statistics.mean(CUDA_TOTAL_MIB[n] / NVIDIA_SMI_MIB[n] for n in ("h100-sxm", "h200"))
        return NVIDIA_SMI_MIB[name] * MIB * share
    share = statistics.median(CUDA_TOTAL_MIB[n] / (nominal * 1024) for n, nominal in
                              (("h100-sxm", 80), ("h200", 141), ("a100-pcie-80gb", 80), ("a100-40gb", 40)))
    return gb * 2 ** 30 * share

# name: (FP32 TFLOPS, BF16/FP16 tensor TFLOPS as printed, FP8 tensor TFLOPS as printed (None: no FP8),
#        printed with sparsity?, memory TB/s, memory GB, SMs or CUs)
DATASHEETS = {
    "h100-sxm": (67, 1979, 3958, True, 3.35, 80, 132),  # NVIDIA H100 datasheet, SXM column; SMs: H100 whitepaper
    "h100-pcie": (51, 1513, 3026, True, 2.0, 80, 114),  # same datasheet, PCIe column; SMs: H100 whitepaper
    "h100-nvl": (60, 1671, 3341, True, 3.9, 94, 132),  # same datasheet (2024), H100 NVL column
    "h200": (67, 1979, 3958, True, 4.8, 141, 132),  # NVIDIA H200 datasheet
    # the H100 SXM's peaks and SMs; memory as torchtitan's Grand Teton hardware section states it (96GB HBM2e, 2.4 TB/s)
    "h100-sxm-96gb": (67, 1979, 3958, True, 2.4, 96, 132),
    "a100-80gb": (19.5, 312, None, False, 2.039, 80, 108),  # NVIDIA A100 datasheet, SXM 80GB; SMs: A100 whitepaper
    "a100-40gb": (19.5, 312, None, False, 1.555, 40, 108),
    "l40s": (91.6, 362.05, 733, False, 0.864, 48, 142),  # NVIDIA L40S datasheet (dense figures printed beside the sparse)
    "b200": (600 / 8, 36000 / 8, 72000 / 8, True, 64 / 8, 1440 / 8, 148),  # DGX/HGX B200 datasheet, eight GPUs
    "gb200": (5760 / 72, 360000 / 72, 720000 / 72, True, 576 / 72, 13400 / 72, 148),  # GB200 NVL72 datasheet, 72 GPUs
    "h20": (44, 148, 296, False, 4.0, 96, 78),  # partners' specification sheet as reported (no NVIDIA datasheet)
    "mi300x": (163.4, 1307.4, 2614.9, False, 5.3, 192, 304),  # AMD Instinct MI300X data sheet (dense figures)
    "mi325x": (163.4, 1307.4, 2614.9, False, 6.0, 256, 304),  # AMD Instinct MI325X data sheet
    "l4": (30.3, 242, 485, True, 0.3, 24, 58),  # NVIDIA L4 datasheet (2023); SMs: Ada whitepaper
    "a100-pcie-40gb": (19.5, 312, None, False, 1.555, 40, 108),  # NVIDIA A100 datasheet, PCIe 40GB
    "a100-pcie-80gb": (19.5, 312, None, False, 1.935, 80, 108),  # NVIDIA A100 datasheet, 80GB PCIe
}
# GPUs without BF16 (or any 16-bit tensor rate): name: (FP32 TFLOPS, FP16 TFLOPS or None, memory TB/s, GB, SMs or
# CUs, board power W)
OLDER = {
    "v100-pcie": (14, 112, 0.9, 32, 80, 250),  # NVIDIA Tesla V100 datasheet, PCIe 32GB (FP16: Tensor Cores)
    "t4": (8.1, 65, 0.32, 16, 40, 70),  # NVIDIA T4 datasheet (FP16: mixed-precision Tensor Cores)
    "p100-pcie": (9.3, 18.7, 0.732, 16, 56, 250),  # NVIDIA Tesla P100 datasheet, PCIe 16GB (FP16 on the FP32 units)
    "p4": (5.5, None, 0.192, 8, 20, 75),  # NVIDIA Tesla P4 datasheet (no FP16 rate; INT8 22 TOPS)
}


@pytest.mark.parametrize("name", sorted(OLDER))
def test_each_older_gpu_profile_holds_its_datasheets_figures_and_lacks_bf16(name):
    fp32, fp16, tb_per_s, gb, sms, watts = OLDER[name]
    profile = load(name)
    assert profile.matmul_flops_per_s["fp32"] == pytest.approx(fp32 * 1e12)
    assert profile.matmul_flops_per_s.get("fp16") == (pytest.approx(fp16 * 1e12) if fp16 else None)
    assert "bf16" not in profile.matmul_flops_per_s and "fp8" not in profile.matmul_flops_per_s
    assert profile.memory_bytes_per_s == pytest.approx(tb_per_s * 1e12)
    assert profile.memory_capacity_bytes == pytest.approx(cuda_total_bytes(name, gb), rel=2e-3)
    assert (profile.sm_count, profile.power_limit_w) == (sms, watts)
    assert profile.sources.get("power_limit_w") and profile.sources.get("matmul_flops_per_s")


@pytest.mark.parametrize("name, fp32_matrix, fp16, bf16, tb_per_s, cus", [
    ("mi100", 46.1, 184.6, 92.3, 1.2288, 120),  # AMD Instinct MI100 data sheet (2020); CUs: CDNA whitepaper
    ("mi210", 45.3, 181, 181, 1.6384, 104),  # AMD Instinct MI210 data sheet (2022); CUs: CDNA 2 whitepaper
])
def test_each_cdna_profile_holds_its_data_sheets_figures(name, fp32_matrix, fp16, bf16, tb_per_s, cus):
    profile = load(name)
    assert profile.matmul_flops_per_s["fp32"] == pytest.approx(fp32_matrix * 1e12)  # FP32 matrix (MFMA) peak
    assert profile.matmul_flops_per_s["fp16"] == pytest.approx(fp16 * 1e12)
    assert profile.matmul_flops_per_s["bf16"] == pytest.approx(bf16 * 1e12)
    assert profile.memory_bytes_per_s == pytest.approx(tb_per_s * 1e12)
    assert profile.sm_count == cus and profile.power_limit_w == 300


def test_a_dtype_the_gpu_lacks_is_refused_in_one_line(tiny_dirs, tmp_path):
    """A V100 has no BF16: extract and plan say so and name the dtypes it has."""
    from ..test_cli import fxworkload

    run = fxworkload("extract", tiny_dirs["llama"], "--seq", 16, "--dtype", "bf16", "--device", "v100-pcie",
                     "--out", tmp_path / "o")
    assert run.returncode != 0 and not (tmp_path / "o").exists()
    assert "device 'v100-pcie' has no bf16 rate" in run.stderr and "--dtype fp32 or fp16" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    run = fxworkload("extract", tiny_dirs["llama"], "--seq", 16, "--dtype", "fp16", "--device", "v100-pcie",
                     "--out", tmp_path / "o")
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_each_gpu_profile_holds_its_datasheets_figures(name):
    fp32, tensor, fp8, sparse, tb_per_s, gb, sms = DATASHEETS[name]
    profile = load(name)
    dense = tensor / 2 if sparse else tensor
    if fp8 is None:
        assert "fp8" not in profile.matmul_flops_per_s
    else:
        assert profile.matmul_flops_per_s["fp8"] == pytest.approx((fp8 / 2 if sparse else fp8) * 1e12, rel=1e-3)
    assert profile.matmul_flops_per_s["fp32"] == pytest.approx(fp32 * 1e12)
    assert profile.matmul_flops_per_s["bf16"] == profile.matmul_flops_per_s["fp16"] == pytest.approx(dense * 1e12,
                                                                                                       rel=1e-3)
    assert profile.memory_bytes_per_s == pytest.approx(tb_per_s * 1e12)
    assert profile.memory_capacity_bytes == pytest.approx(cuda_total_bytes(name, gb), rel=2e-3)
    assert profile.sm_count == sms
    for figure in ("matmul_flops_per_s", "memory_bytes_per_s", "sm_count", "memory_capacity_bytes", "arch",
                   "intra_node_bytes_per_s", "gpu_model_fit"):
        assert profile.sources.get(figure), (name, figure)  # every figure names where it comes from


@pytest.mark.parametrize("name", ["h100-sxm", "h100-pcie", "l40s"])
def test_an_fp32_peak_is_its_sms_lanes_and_clock(name):
    """A consistency check of three independent figures: FP32 peak = SMs x FP32 lanes per SM (128 on
    Hopper and Ada) x 2 (an FMA) x the boost clock (1,980 MHz H100 SXM, 1,755 MHz H100 PCIe as
    nvidia-smi reports it, 2,520 MHz L40S per its datasheet), within 2 %."""
    clock_hz = {"h100-sxm": 1.98e9, "h100-pcie": 1.755e9, "l40s": 2.52e9}[name]
    profile = load(name)
    assert profile.matmul_flops_per_s["fp32"] == pytest.approx(profile.sm_count * 128 * 2 * clock_hz, rel=0.02)


@pytest.mark.parametrize("name", ["mi300x", "mi325x"])
def test_a_cdna3_peak_is_its_cus_matrix_rate_and_clock(name):
    """AMD CDNA 3 whitepaper (2023), peak FLOPs per clock per CU: 2,048 FP16/BF16 and 4,096 FP8 (dense),
    at the data sheets' 2,100 MHz peak engine clock and 304 CUs."""
    profile = load(name)
    assert profile.matmul_flops_per_s["bf16"] == pytest.approx(304 * 2048 * 2.1e9, rel=1e-3)
    assert profile.matmul_flops_per_s["fp8"] == pytest.approx(304 * 4096 * 2.1e9, rel=1e-3)
    assert profile.compute_capability() == (9, 4)  # what ROCm's torch.cuda.get_device_capability() gives gfx942
    assert "cudnn" not in profile.sdpa_priority  # ROCm builds have no cuDNN attention


def test_each_figure_says_whether_it_is_a_datasheet_fact_fitted_or_assumed():
    h100, h20, mi300x = load("h100-sxm"), load("h20"), load("mi300x")
    assert h100.figure_kinds()["gpu_model_fit"] == "fitted"  # fitted on its own kernels
    assert mi300x.figure_kinds()["gpu_model_fit"] == "assumed"  # an H100's fit carried over
    assert h100.figure_kinds()["memory_bytes_per_s"] == mi300x.figure_kinds()["memory_bytes_per_s"] == "datasheet"
    assert h20.figure_kinds()["memory_bytes_per_s"] == "assumed"  # no NVIDIA datasheet publishes it
    assert mi300x.figure_kinds()["inter_node_bytes_per_s"] == "assumed"


def test_an_amd_profile_traces_rocms_attention(tiny_dirs):
    """ROCm's torch has no cuDNN attention: the step traced for an MI300X records flash or memory-efficient
    SDPA kernels, and says it was traced for ROCm's gfx942."""
    from fxworkload.pipeline import extract

    result = extract(str(tiny_dirs["llama"]), seq=32, dtype="bf16", device="mi300x")
    assert result.settings["traced_on"] == "rocm gfx942 sdpa flash>efficient>math"
    backends = {op.sdpa_backend for op in result.workload.ops() if op.sdpa_backend}
    assert backends and "cudnn" not in backends


# The board power each datasheet states (max thermal design power; a configurable range's top taken), W.
POWER_W = {"h100-sxm": 700, "h100-pcie": 350, "h100-nvl": 400, "h200": 700, "a100-40gb": 400, "a100-80gb": 400,
           "b200": 1000, "l40s": 350, "mi300x": 750, "mi325x": 1000}


@pytest.mark.parametrize("name", sorted(POWER_W))
def test_each_profile_gives_its_datasheets_board_power_with_a_source(name):
    profile = load(name)
    assert profile.power_limit_w == POWER_W[name] and profile.sources.get("power_limit_w")
