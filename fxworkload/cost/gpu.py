"""Kernel time on an NVIDIA GPU from its mechanics: tiles and waves over the SMs, alignment, bandwidth.

Datasheet facts come from the device profile (SM count, tensor-core peak per dtype, FP32 peak,
memory bandwidth); the few free parameters (``GpuModel``) were fitted once on kernels measured on an
H100 and are shipped with their source, or fitted by ``fxworkload calibrate --on cuda``.

- GEMM (``gemm_ns``): cuBLAS tiles the m×n output; a tile of tm×tn costs 2·tm·tn·k FLOPs at one SM's
  share of the peak, derated for small tiles (edge cost ∝ tm + tn); the tiles run in waves of SM-count
  CTAs, so a last partial wave costs a whole one; split-K cuts k when there are too few tiles, at the
  price of an fp32 reduction. The kernel family follows the operands' leading dimensions: multiples of
  16 bytes run the Hopper/Ampere tensor-core kernels, 4–8-byte multiples sm80 CUTLASS ones, 2-byte
  (odd element counts) the ``align1`` fallback; fp32 (no TF32) runs on the FP32 units, each tile paying a
  fitted fixed work (its prologue's loads and epilogue's stores) as k elements more of its loop. A thin GEMM is
  bound by reading its operands.
- Power (``sustained_clock_fraction``): an FP32-unit GEMM draws power in proportion to the FLOPs it runs
  (below the voltage floor a clock's power is linear in it), so a board whose power limit is small beside
  its FP32 peak cannot hold its boost clock: the share it holds is the power limit over the power the
  peak would draw, at a fitted energy per FLOP per nanometre of process node (fitted across GPUs, see
  bench/gpus.py). The 70-72 W L4 and T4 hold about a third and half; a 250-700 W data-centre GPU all.
  Tensor-core work is power-bound at a Hopper board's nominal limit already (the fitted efficiencies
  hold that clock; FP8 holds a measured ``fp8_clock_share`` of BF16's); a board capped below its limit
  keeps the cube root of its power above idle as clock (``capped_clock_fraction``: f·V², V ~ f).
- Attention (``attention_ns``): FLOPs at a per-kernel efficiency of the tensor peak (cuDNN, flash,
  memory-efficient; forward and backward apart), counting only the score tiles a causal kernel visits
  (an explicit mask visits them all) and the head dimension padded to the kernel's 64-wide tiles,
  in waves of one 128-query block per CTA over the SMs (FlashAttention-2's causal forward: its grid's
  blocks of unequal work started in launch order as slots free, so the grid's tail), plus the softmax
  per score element (a cost in S² that does not shrink with the head dim, in FP32-unit operations at
  the GPU's FP32 peak);
  head dims above 128 cost a fitted fraction more (smaller tiles); dropout's random numbers cost
  operations per score element likewise, and a fitted fraction more (per backend, forward and
  backward apart); the op's tensors are read and written a fitted number
  of times outside the main loop (the backward's dot(dO, O) and dQ conversion passes); an explicit
  mask costs a fitted fraction of the main loop more (its bias loaded and added in every block).
- Memory-bound ops (``memory_ns``): a fixed cost per kernel plus its bytes at the streaming rate:
  DRAM's reachable share of the datasheet bandwidth; a kernel that converts dtypes is bound lower,
  by the bytes its SMs keep in flight (Little's law: SMs x a per-SM rate), which does not grow with
  the bandwidth. A (log-)softmax over long rows reads them again per reduction where PyTorch's
  kernel choice keeps them neither in registers, shared memory nor L2 (``softmax_rereads``).
- Host (``dispatch_ns``): each eager op costs the CPU a fitted dispatch time, plus a fitted time per
  output tensor past the first (its allocation); a step whose kernels are shorter than their
  dispatch waits on the host (see ``two_stream_ns``). Both are facts of the host the kernels were
  measured beside, fitted with them.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import asdict, dataclass, fields

# Output tiles cuBLAS chooses among on sm80/sm90 (rows x columns of C per CTA).
GEMM_TILES = ((128, 256), (256, 128), (128, 128), (64, 128), (128, 64), (64, 64))
SPLIT_K = (1, 2, 4, 8)
ATTENTION_TILE = 128  # query/key block of the fused attention kernels (causal skipping works per block)
HEAD_DIM_TILE = 64
# FlashAttention-2's forward as PyTorch vendors it (aten/src/ATen/native/transformers/cuda/flash_attn/
# flash_fwd_launch_template.h, run_mha_fwd_hdim128): head dim 128 without dropout runs 128-query x 64-key
# tiles of 4 warps on sm80 and sm90 (sm86/sm89 take 64 x 64 for causal masks; head dims 32 and 64 run
# 128 x 128, whose causal blocks carry the same shares of a row), one CTA per query block in a grid (query
# blocks, batch, heads) launched in that order (flash_fwd_kernel.h compute_attn: m_block = blockIdx.x, no
# reordering). Each CTA's thread uses 255 registers (ptxas's log of the sm80 build, Dao-AILab/flash-attention
# #1630), 128 x 255 of an SM's 65,536: two CTAs share an SM (taken for every head dim up to 128).
FLASH_FORWARD_TILE = (128, 64)
FLASH_FORWARD_CTAS_PER_SM = 2
FLASH_SM8X = frozenset({"sm86", "sm87", "sm89"})
LIST_SCHEDULE_MAX_CTAS = 1 << 17  # past this the grid's tail is under a percent of its time: the mean is used
# FlexAttention's generated Triton kernels (capture/flex.py) against FlashAttention-2, PyTorch's flash backend, on
# the same dense shapes, as their authors published them (D. Guessous et al., "FlexAttention: The Flexibility of
# PyTorch With the Performance of FlashAttention", GTC 2025, and arXiv 2412.05496): on A100s 90 % of FA2's speed
# forward and 85 % backward (its backward recomputes more than FA2's); on H100s forward ~25 % faster than FA2 and
# backward ~3 % faster (Triton issues Hopper's warp-group MMAs, FA2 does not). (forward, backward) speed over
# flash's; other GPUs are assumed to be as the nearest measured one (sm80's below sm90, sm90's from it on).
FLEX_OVER_FLASH = {"sm80": (0.90, 0.85), "sm90": (1.25, 1.03)}


@dataclass(frozen=True)
class GpuModel:
    """The free parameters; every other figure is a datasheet fact of the profile."""
    gemm_tensor_efficiency: float = 0.86  # fraction of the tensor peak a full wave of large tiles reaches
    gemm_sm80_efficiency: float = 0.28  # 4- or 8-byte-aligned leading dimensions (CUTLASS sm80 kernels)
    gemm_align1_efficiency: float = 0.16  # odd leading dimensions (cutlass_75 align1 kernels)
    gemm_fp32_efficiency: float = 0.91  # fp32 without TF32, of the FP32 (non-tensor) peak
    # On SMs whose partitions have as many FP32 lanes as a warp has threads and issue one instruction a clock
    # (FP32_ISSUE_BOUND), an FP32 GEMM's FFMAs get only the issue slots its loads and address arithmetic leave:
    # the share of the FP32 peak it keeps beside a 16-lane partition's. Fitted across GPUs (bench/gpus.py):
    # the instruction mix of cuBLAS's kernels is not published. 1: not applied (the H100 fit's own
    # efficiency already holds its GPU's share).
    gemm_fp32_issue_share: float = 1.0
    # An FP32 (SIMT) GEMM tile's fixed work beside its main loop: the prologue's first loads before any FFMA,
    # the epilogue's stores of its tm x tn outputs after the last, in k elements of that loop (the tile costs
    # k + this). Invisible beside a long k; a sixth of a tile's time at attention's k = 64 (12 fitted). Fitted
    # across GPUs (bench/gpus.py): how much of it other resident CTAs hide is not published. 0: not applied.
    gemm_fp32_tile_overhead_k: float = 0.0
    # torch._grouped_mm (MoE experts; a CUTLASS grouped kernel on sm90): not in the shared H100 data.
    # Set to the published H100 figures of pytorch/ao#2490 (bench_grouped_mm.py, bf16, 8,192 tokens over
    # 16 experts, K x N = 5,120 x 8,192 and 8,192 x 5,120: 1.31 and 1.26 ms; this model gives 1.29 for both).
    gemm_grouped_efficiency: float = 0.65
    # Board watts an FP32-unit GEMM draws per TFLOP/s of the FP32 peak per nm of process node, at the boost
    # clock; 0: no board is power-bound (the H100 fit: its 700 W is never the limit).
    fp32_watts_per_tflop_nm: float = 0.0
    # The clock an FP8 GEMM holds at the board's power limit, over a BF16 GEMM's: FP8 tensor work draws
    # more power per clock, so the power manager holds it lower. Measured on the lent H200 at its 700 W
    # limit, 8,192^3 GEMMs back to back for 9 s each (bench/gpu_power.sh, bench/data/lent-gpus/h200/power/):
    # BF16 653.4 TFLOP/s at a median 1,455 MHz, FP8 1,183.8 TFLOP/s (1.81x, not the peaks' 2x) at 1,312 MHz
    # (0.902 of it): per clock the two reach the same share of their peaks. The share from the FLOP rates:
    fp8_clock_share: float = 1183.8 / 653.4 / 2
    gemm_tile_edge: float = 13.6  # elements: a tile's efficiency is tm·tn / (tm·tn + edge·(tm + tn))
    gemm_kernel_ns: float = 5580.0  # fixed cost of one GEMM call (launch, prologue, epilogue)
    gemm_min_ns: float = 25200.0  # the shortest a cuBLAS call took back to back in eager PyTorch
    # Memory-bound kernels as mechanisms, not one GPU's fractions of its bandwidth:
    # - DRAM: the fraction of the datasheet bandwidth a streaming kernel reaches once enough bytes are
    #   in flight (row-buffer and refresh losses, ECC);
    memory_efficiency: float = 0.79
    # - Little's law: an SM keeps a bounded number of bytes in flight, so it streams at most that over
    #   the memory latency; the GPU at most its SMs times that. PyTorch's vectorized elementwise kernel
    #   keeps enough in flight to reach DRAM's limit; the unrolled kernel with dynamic casting that a
    #   dtype-converting op runs (Loops.cuh) keeps fewer, and is bound by this, not by the bandwidth.
    #   Bytes per second per SM (in flight / latency), fitted, the same for every GPU of this kind;
    memory_cast_bytes_per_s_per_sm: float = 14.6e9
    vector_kernel_ns: float = 3000.0  # fixed cost of one memory-bound kernel
    host_dispatch_ns: float = 10000.0  # CPU time of one eager aten op (Python, dispatcher, launch)
    # and for each output past the first (native_layer_norm's mean and rstd, dropout's mask): the
    # caching allocator's call and the tensor's construction on the host
    host_output_ns: float = 5000.0
    # Host time of one CUDA graph replay (cudaGraphLaunch from torch.cuda.CUDAGraph.replay): measured on the
    # lent H100's host, GPT-2's whole training step (batch 1, seq 128, ~900 kernels) replayed: 0.051 ms
    # (bench/gpu_graphs.py, bench/data/lent-gpus/h100/graphs/graphs.json)
    host_graph_launch_ns: float = 51000.0
    # How much longer a kernel torch.compile's inductor generates (Triton: a fused pointwise or reduction chain)
    # takes than the memory roofline at memory_efficiency (fitted on ATen's hand-written kernels) says. No
    # published figure; fitted on the lent H100's GPT-2 step under torch.compile (b8 s1024 bf16, 26.6 ms measured,
    # 23.4 ms estimated of which 5.45 ms in generated kernels: 1 + 3.19 / 5.45), judged on the lent H200's and
    # torchtitan's compiled runs (bench/lent_gpus.py, bench/published.py)
    generated_kernel_slowdown: float = 1.585
    attention_kernel_ns: float = 10000.0
    cudnn_forward_efficiency: float = 0.45
    cudnn_backward_efficiency: float = 0.35
    flash_forward_efficiency: float = 0.40
    flash_backward_efficiency: float = 0.30
    efficient_forward_efficiency: float = 0.25
    efficient_backward_efficiency: float = 0.18
    # Extra time, as a fraction, of a kernel with dropout (its random numbers), per backend and direction.
    cudnn_forward_dropout_cost: float = 0.15
    cudnn_backward_dropout_cost: float = 0.2
    flash_forward_dropout_cost: float = 0.15
    flash_backward_dropout_cost: float = 0.2
    efficient_forward_dropout_cost: float = 0.2
    efficient_backward_dropout_cost: float = 0.2
    # Softmax per score element (exp, max, sum: the special-function units, ~3.9 T/s on an H100 per the
    # FlashAttention-3 paper, against 989 T/s of matmul): a cost in S² independent of the head dim, in
    # FP32-unit operations per score element, so that it runs at each GPU's FP32 (non-tensor) peak.
    attention_forward_score_flops: float = 20.0
    attention_backward_score_flops: float = 40.0
    attention_large_head_forward_cost: float = 0.2  # head dim > 128: smaller tiles; extra fraction of time
    attention_large_head_backward_cost: float = 0.5
    # Passes over the op's tensors (q, k, v, o, dO, the gradients) outside the main loop: the backward's
    # dot(dO, O) preprocess, the fp32 dQ conversion and the GQA head reduction (kernels seen in the data).
    attention_forward_memory_passes: float = 1.0
    attention_backward_memory_passes: float = 2.0
    # An explicit mask (bias) tensor: the kernel visits every score block (no causal skipping) and
    # loads and adds the bias in each; extra fraction of the main loop's time. The H100 data put the
    # masked kernels at 1.6-1.9x the unmasked non-causal ones from seq 1,024 up, for any mask shape
    # (a sliding window costs what a causal mask does): a cost per score block, not bytes read.
    attention_mask_forward_cost: float = 0.8
    attention_mask_backward_cost: float = 0.8
    # Dropout's random numbers (Philox) per score element, in FP32-unit operations: a cost in S² that does
    # not shrink with the head dim. The H100 data: cuDNN's forward with dropout costs 0.83-0.96 ps more
    # per visited score element than without (56-64 operations at 67 TFLOP/s), for head dims 64-128,
    # causal or not, seq 256-8,192.
    attention_forward_dropout_flops: float = 54.0
    attention_backward_dropout_flops: float = 7.0

    @classmethod
    def of(cls, values: dict) -> GpuModel:
        known = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in values.items() if k in known})

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GpuFacts:
    """Datasheet facts of one GPU, from its profile."""
    sm_count: int
    tensor_flops_per_s: dict  # dtype name -> dense tensor-core peak (fp32: the FP32-unit peak, no TF32)
    memory_bytes_per_s: float
    l2_bytes: int = 0  # 0: unknown (nothing is taken to stay in L2)
    power_limit_w: float = 0.0  # the board's power limit; 0: unknown (never power-bound)
    process_nm: float = 0.0  # the die's process node (TSMC 4N counts as 5); 0: unknown
    power_cap_w: float = 0.0  # the limit the board is run at, below its nominal one (nvidia-smi -pl); 0: nominal
    idle_power_w: float = 0.0  # what the board draws doing nothing (leakage, memory refresh); 0: unknown
    threads_per_sm: int = 2048  # resident threads per SM (RESIDENT_THREADS by compute capability)
    fp32_issue_bound: bool = False  # FP32_ISSUE_BOUND: its FFMAs need every issue slot of a partition
    arch: str = ""  # compute capability, e.g. "sm90" ("": unknown)


ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}  # dtypes by fxworkload's names (dtypes.DTYPES; fp8: --fp8 GEMMs)


def alignment_bytes(leading_dims: tuple[int, ...], itemsize: int) -> int:
    """The largest power of two (up to 16) that every leading dimension's byte stride is a multiple of."""
    return min(math.gcd(ld * itemsize, 16) for ld in leading_dims)


def gemm_ns(m: int, k: int, n: int, batch: int, dtype: str, leading_dims: tuple[int, ...],
            facts: GpuFacts, model: GpuModel, grouped: bool = False) -> float:
    """``batch`` GEMMs of m×k·k×n in one kernel; ``grouped``: the groups of a grouped GEMM (no split-K)."""
    itemsize = ITEMSIZE[dtype]
    overhead_k = model.gemm_fp32_tile_overhead_k if itemsize == 4 else 0.0
    if itemsize == 4:
        efficiency = model.gemm_fp32_efficiency * sustained_clock_fraction(facts, model)
        if facts.fp32_issue_bound:
            efficiency *= model.gemm_fp32_issue_share
    elif grouped:
        efficiency = model.gemm_grouped_efficiency * capped_clock_fraction(facts)
    else:
        align = alignment_bytes(leading_dims, itemsize)
        efficiency = (model.gemm_tensor_efficiency if align >= 16 else model.gemm_sm80_efficiency if align >= 4
                      else model.gemm_align1_efficiency) * capped_clock_fraction(facts)
        if dtype == "fp8":
            efficiency *= model.fp8_clock_share
    per_sm = facts.tensor_flops_per_s[dtype] * efficiency / facts.sm_count
    bandwidth = streaming_bytes_per_s(facts, model)
    compute_s = math.inf
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        tile_rate = per_sm * tm * tn / (tm * tn + model.gemm_tile_edge * (tm + tn))
        for split in (1,) if grouped else SPLIT_K:
            if split > 1 and tiles * split > 2 * facts.sm_count:
                break
            waves = math.ceil(tiles * split / facts.sm_count)
            seconds = waves * 2 * tm * tn * (math.ceil(k / split) + overhead_k) / tile_rate
            if split > 1:  # fp32 partial tiles written and read back by the reduction
                seconds += 2 * m * n * batch * split * 4 / bandwidth
            compute_s = min(compute_s, seconds)
    memory_s = (m * k + k * n + m * n) * batch * itemsize / bandwidth
    return max(model.gemm_min_ns, model.gemm_kernel_ns + 1e9 * max(compute_s, memory_s))


# torch.compile pads unaligned GEMMs (torch/_inductor/fx_passes/pad_mm.py, ``config.shape_padding``, on
# by default): each of m, k, n not a multiple of the dtype's alignment (get_alignment_size_dtype: 8
# elements for 16-bit types, 4 for fp32) is padded with zeros, when the GEMM is compute-bound
# (is_mm_compute_bound: m·k·n / (m·k + k·n + m·n) above half the GPU's tensor peak over its DRAM
# bandwidth) and the padded GEMM, its operands' padding copies included, is faster by inductor's
# multiplier (is_padded_faster: 1.1). Inductor decides by timing both at compile time; here both are
# this model's estimates.
PAD_ALIGNMENT_ELEMENTS = {2: 8, 4: 4}
PAD_SPEEDUP = 1.1


def padded_gemm_ns(m: int, k: int, n: int, batch: int, dtype: str, leading_dims: tuple[int, ...],
                   facts: GpuFacts, model: GpuModel) -> float:
    """A GEMM as torch.compile runs it: padded to aligned shapes where inductor's pad_mm would pad it."""
    unpadded_ns = gemm_ns(m, k, n, batch, dtype, leading_dims, facts, model)
    itemsize = ITEMSIZE[dtype]
    pm, pk, pn = padded_sizes(m, k, n, itemsize)
    if (pm, pk, pn) == (m, k, n) or not _compute_bound(m, k, n, dtype, facts):
        return unpadded_ns
    copies = [(rows * cols, padded_rows * padded_cols) for rows, cols, padded_rows, padded_cols
              in ((m, k, pm, pk), (k, n, pk, pn)) if (rows, cols) != (padded_rows, padded_cols)]
    padded_ns = gemm_ns(pm, pk, pn, batch, dtype, (pk, pn, pn), facts, model) + sum(
        memory_ns((read + written) * batch * itemsize, facts, model) for read, written in copies)
    return padded_ns if unpadded_ns > PAD_SPEEDUP * padded_ns else unpadded_ns


def padded_sizes(m: int, k: int, n: int, itemsize: int) -> tuple[int, int, int]:
    """m, k and n rounded up to pad_mm's alignment for the dtype (unchanged for a dtype it does not pad)."""
    align = PAD_ALIGNMENT_ELEMENTS.get(itemsize, 1)
    return tuple(-(-size // align) * align for size in (m, k, n))


def _compute_bound(m: int, k: int, n: int, dtype: str, facts: GpuFacts) -> bool:
    intensity = m * k * n / (m * k + k * n + m * n)
    return intensity > 0.5 * facts.tensor_flops_per_s[dtype] / facts.memory_bytes_per_s


def sustained_clock_fraction(facts: GpuFacts, model: GpuModel) -> float:
    """Share of its boost clock a GPU holds through an FP32-unit GEMM: its power limit over what the
    FP32 peak would draw at ``fp32_watts_per_tflop_nm`` (1 where either is unknown)."""
    board_w = facts.power_cap_w or facts.power_limit_w
    if not (board_w and facts.process_nm and model.fp32_watts_per_tflop_nm):
        return 1.0
    peak_tflop_per_s = facts.tensor_flops_per_s["fp32"] / 1e12
    return min(1.0, board_w / (peak_tflop_per_s * facts.process_nm * model.fp32_watts_per_tflop_nm))


def capped_clock_fraction(facts: GpuFacts) -> float:
    """Share of its clock at the nominal power limit that tensor-core work keeps on a board capped below it.

    At the nominal limit such work is already power-bound (a BF16 GEMM on the lent 700 W H100 and H200 runs
    at 1,335-1,455 MHz of 1,980, with the driver's "SW Power Cap" active: bench/gpu_power.sh), and the
    fitted efficiencies hold that clock. Below it, the power manager lowers clock and voltage together
    along the DVFS curve: dynamic power goes as f·V², V roughly as f, so the power above idle as f³, and
    the clock as the cube root of the power left above idle. Memory-bound kernels are not taken to slow:
    the lent H200 streamed 4.2 TB/s at its full 1,980 MHz drawing 480 W."""
    if not (facts.power_cap_w and facts.power_limit_w) or facts.power_cap_w >= facts.power_limit_w:
        return 1.0
    above_idle = (facts.power_cap_w - facts.idle_power_w) / (facts.power_limit_w - facts.idle_power_w)
    return max(0.0, above_idle) ** (1 / 3)


def causal_fraction(q_len: int, kv_len: int) -> float:
    """Share of the score blocks a causal kernel computes: the blocks on and below the diagonal."""
    blocks = math.ceil(max(q_len, kv_len) / ATTENTION_TILE)
    return (blocks + 1) / (2 * blocks)


def _makespan(works: tuple[int, ...], slots: int) -> int:
    """When the last of ``works`` ends, each started in order on the first of ``slots`` to come free."""
    free = [0] * slots
    for work in works:
        heapq.heappush(free, heapq.heappop(free) + work)
    return max(free)


@functools.lru_cache(maxsize=256)
def flash_causal_grid_ratio(sequences: int, q_len: int, kv_len: int, sm_count: int) -> float:
    """FlashAttention-2's causal forward time over its unmasked time on the same shapes: each CTA runs its
    query block against the key blocks on and below the diagonal (bottom-right aligned, as FlashAttention
    >= 2.1 and PyTorch's copy align it), the CTAs start in launch order as slots free, so the heaviest
    blocks of the last sequences start last and the grid ends on a tail that a mean of the work does not
    see. ``sequences``: batch x heads."""
    block_q, block_k = FLASH_FORWARD_TILE
    rows = math.ceil(q_len / block_q)
    full = math.ceil(kv_len / block_k)
    causal = tuple(min(full, max(0, math.ceil(((m + 1) * block_q + kv_len - q_len) / block_k)))
                   for m in range(rows))
    slots = sm_count * FLASH_FORWARD_CTAS_PER_SM
    ctas = sequences * rows
    if not (ctas and full):  # an empty kernel: nothing to schedule
        return 1.0
    if ctas > LIST_SCHEDULE_MAX_CTAS:
        return sum(causal) / (rows * full)
    unmasked = math.ceil(ctas / slots) * full
    return _makespan(causal * sequences, slots) / unmasked


def flex_over_flash(arch: str, backward: bool) -> float:
    """FlexAttention's kernel speed over FlashAttention-2's on ``arch`` (FLEX_OVER_FLASH)."""
    hopper_on = arch.startswith("sm") and arch[2:].isdigit() and int(arch[2:]) >= 90
    return FLEX_OVER_FLASH["sm90" if hopper_on else "sm80"][backward]


# The memory-efficient kernel on 16-bit inputs runs no faster than FlashAttention-2: PyTorch's is xformers' CUTLASS
# FMHA (fmha_cutlassF_bf16_aligned_*_sm80 and its backward), built on sm80's mma.sync tensor-core instructions as
# FlashAttention-2 is, and slower than it where both ran (FlashAttention-2 paper, Dao 2023, its A100 benchmarks
# against xformers). Its fitted efficiencies come from the H100 data's fp32 rows, a kernel on the FP32 units whose
# share of that peak says nothing of the tensor cores': taken on the BF16 peak they gave 0.66 of it, where the
# H100's measured sm80 CUTLASS GEMMs reach 0.28 (gemm_sm80_efficiency). So a 16-bit call takes the lower of its own
# and flash's efficiency: an upper bound on its speed, no measurement of it being at hand.
def attention_ns(flops: int, backend: str, backward: bool, dtype: str, *, batch: int, heads: int, q_len: int,
                 kv_len: int, head_dim: int, is_causal: bool, has_mask: bool, dropout: float,
                 facts: GpuFacts, model: GpuModel, nbytes: int = 0, visited_share: float = 1.0) -> float:
    """A fused attention kernel's time. ``backend`` flex: FlexAttention's kernel, which visits ``visited_share``
    of the score tiles (its block mask's partial and full ones), flash's kernel on them over FLEX_OVER_FLASH."""
    speed = 1.0
    if backend == "flex":
        backend, speed = "flash", flex_over_flash(facts.arch, backward)
    work = flops * math.ceil(head_dim / HEAD_DIM_TILE) * HEAD_DIM_TILE / head_dim
    direction = "backward" if backward else "forward"
    ctas = batch * heads * math.ceil(q_len / ATTENTION_TILE)  # one query block per CTA
    quantization = math.ceil(ctas / facts.sm_count) / (ctas / facts.sm_count)  # a last partial wave costs a whole one
    grid = quantization * visited_share  # the grid's time over its work at a full wave's rate
    if is_causal and not has_mask:
        if backend == "flash" and not backward and head_dim <= 128 and not dropout and facts.arch not in FLASH_SM8X:
            grid *= flash_causal_grid_ratio(batch * heads, q_len, kv_len, facts.sm_count)
        else:
            grid *= causal_fraction(q_len, kv_len)
    efficiency = getattr(model, f"{backend}_{direction}_efficiency")
    if backend == "efficient" and ITEMSIZE.get(dtype, 4) < 4:
        efficiency = min(efficiency, getattr(model, f"flash_{direction}_efficiency"))  # above attention_ns
    efficiency *= capped_clock_fraction(facts)
    seconds = grid * work / (facts.tensor_flops_per_s[dtype] * efficiency)
    scores = batch * heads * q_len * kv_len
    alu_per_s = facts.tensor_flops_per_s["fp32"] * capped_clock_fraction(facts)  # the same SMs' clock
    seconds += grid * scores * getattr(model, f"attention_{direction}_score_flops") / alu_per_s
    if has_mask:
        seconds *= 1 + getattr(model, f"attention_mask_{direction}_cost")
    if head_dim > 128:
        seconds *= 1 + getattr(model, f"attention_large_head_{direction}_cost")
    if dropout > 0:
        seconds *= 1 + getattr(model, f"{backend}_{direction}_dropout_cost")
        seconds += grid * scores * getattr(model, f"attention_{direction}_dropout_flops") / alu_per_s
    seconds += getattr(model, f"attention_{direction}_memory_passes") * nbytes / streaming_bytes_per_s(facts, model)
    return model.attention_kernel_ns + 1e9 * seconds / speed


# SoftMax.cu's kernel choice for rows along the last dimension (torch 2.11): rows of up to 1,024 run the
# persistent warp kernel; longer ones a block of up to 1,024 threads per row, keeping the row in registers
# while it needs fewer than 10 per thread (forward only), else in shared memory when it fits a block's
# 48 KB and divides into 16-byte vectors; otherwise the plain block kernel reads the row again for
# each reduction: the forward three times (max, sum of exp, output), the backward twice (sum, output).
SOFTMAX_BLOCK_THREADS = 1024
SOFTMAX_SHARED_BYTES = 48 * 1024  # sharedMemPerBlock of every NVIDIA GPU since Kepler
SM_THREADS = 2048  # resident threads per SM (sm60-sm70, sm80, sm87, sm90, sm100): two 1,024-thread blocks
# The CUDA C++ Programming Guide's "Technical Specifications per Compute Capability": maximum resident
# threads per SM where it is not 2,048 (Turing 1,024; GA10x and Ada 1,536).
RESIDENT_THREADS = {"sm75": 1024, "sm86": 1536, "sm89": 1536, "sm120": 1536}
# Compute capabilities whose SM partitions hold 32 FP32 lanes (128 FP32 results a clock per SM, the CUDA C++
# Programming Guide's arithmetic-throughput table; 64 on sm60, sm70, sm75 and sm80) behind a scheduler that
# issues one warp instruction a clock (Volta's and later: GA102, AD102 and GH100 whitepapers): an FFMA every
# clock leaves no slot for the loads feeding it. A 16-lane partition takes two clocks per warp FFMA, so its
# other instructions issue between them; Pascal's sm61 (P4: 128 lanes) dispatches two instructions a clock.
FP32_ISSUE_BOUND = frozenset({"sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm120"})
# layer_norm_kernel.cu: the vectorized forward runs one row per block of 32 x 4 threads, and reads its row
# twice (compute_stats' Welford pass, then the pass that normalizes and writes it).
LAYER_NORM_BLOCK_THREADS = 128


def softmax_kernel(row: int, itemsize: int, backward: bool) -> str:
    """Which SoftMax.cu kernel runs a (log-)softmax over rows of ``row`` elements: warp, registers,
    shared or block (the one that reads the row again per reduction)."""
    if row <= 1024:
        return "warp"
    if not backward and -(-row // SOFTMAX_BLOCK_THREADS) < 10:
        return "registers"
    reduction_bytes = SOFTMAX_BLOCK_THREADS // 32 * 4
    if row < (SOFTMAX_SHARED_BYTES - reduction_bytes) // itemsize and row % (16 // itemsize) == 0:
        return "shared"
    return "block"


def softmax_block_threads(row: int, itemsize: int) -> int:
    """SoftMax.cu's SoftMax_getBlockSize: up to 1,024 threads, one per 16-byte vector of the row, halved so
    that half the row at least is read in vectors, rounded up to a power of two, a warp at least."""
    vector = max(16 // itemsize, 1)
    most = min(row // vector, SOFTMAX_BLOCK_THREADS)
    if vector > 1:
        most //= 2
    block = 1
    while block < most:
        block *= 2
    return max(block, 32)


def l2_miss_fraction(row_bytes: int, block_threads: int, facts: GpuFacts) -> float:
    """Share of a row-per-block kernel's second reads of its row that miss L2 and go to memory. Between a
    block's two passes over its row, the other resident blocks (every SM full of them) read between half
    a row each and a whole one (they started at staggered times), so the reuse distance spreads evenly over
    W/2..W, W the rows in flight times their bytes: every re-read hits L2 while W <= L2, none does from
    W >= 2 x L2, and the share between falls off in proportion."""
    if not facts.l2_bytes:
        return 1.0  # no L2 known: from memory
    in_flight_bytes = facts.sm_count * max(facts.threads_per_sm // block_threads, 1) * row_bytes
    return min(max(2 - 2 * facts.l2_bytes / in_flight_bytes, 0.0), 1.0)


def softmax_rereads(row: int, itemsize: int, backward: bool, facts: GpuFacts, kernel: str = "") -> float:
    """Extra reads from memory of a (log-)softmax's first input, rows of ``row`` elements; ``kernel`` names
    the kernel that ran where it is known (a measurement's), else PyTorch's choice (softmax_kernel)."""
    if (kernel or softmax_kernel(row, itemsize, backward)) != "block":
        return 0.0
    passes = 1 if backward else 2
    return passes * l2_miss_fraction(row * itemsize, softmax_block_threads(row, itemsize), facts)


def layer_norm_rereads(row: int, itemsize: int, facts: GpuFacts) -> float:
    """Extra reads from memory of a layer norm forward's input: its second pass over each row, as far as
    the rows in flight overflow L2 (none on GPUs of 40 MB of L2 or more at today's hidden sizes)."""
    return l2_miss_fraction(row * itemsize, LAYER_NORM_BLOCK_THREADS, facts)


def streaming_bytes_per_s(facts: GpuFacts, model: GpuModel, casts: bool = False) -> float:
    """The rate a streaming kernel moves bytes at: DRAM's reachable share of the datasheet bandwidth,
    or, for the casting kernel, the lesser of that and what its SMs keep in flight (Little's law)."""
    dram = facts.memory_bytes_per_s * model.memory_efficiency
    return min(dram, facts.sm_count * model.memory_cast_bytes_per_s_per_sm) if casts else dram


def memory_ns(nbytes: int, facts: GpuFacts, model: GpuModel, kernels: int = 1, casts: bool = False) -> float:
    return kernels * model.vector_kernel_ns + 1e9 * nbytes / streaming_bytes_per_s(facts, model, casts)


def two_stream_ns(ops: list[tuple[float, float]]) -> float:
    """End time of a sequence of (host dispatch ns, kernel ns): the host issues each op after the
    previous one; the GPU starts a kernel when it is issued and the previous kernel has ended."""
    host = gpu = 0.0
    for dispatch, kernel in ops:
        host += dispatch
        if kernel > 0:
            gpu = max(gpu, host) + kernel
    return max(host, gpu)
