"""Published training layouts, re-estimated: TFLOP/s per GPU of the cluster step against the papers'.

- Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM"), Table 1 (weak scaling): GPT models, seq 2048, vocabulary 51,200, fp16 mixed
  precision on DGX A100 80GB; their TFLOP/s count eq. 3, 96·B·s·l·h²(1 + s/6h + V/16lh), which
  includes the recomputed forward (they recompute activations).
- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), Table 3
  (configurations) and Table 5 (iteration time of "present work": sequence parallelism with selective
  recomputation): GPT models of 22B, 175B, 530B and 1T, seq 2048, vocabulary 51,200, on DGX A100
  80GB, tensor parallelism 8; their MFU counts eq. 3 without the recomputed forward
  (72·B·s·l·h²(1 + s/6h + V/12lh)); here, as TFLOP/s per GPU of that count over their time.
- The Llama 3 paper (Dubey et al. 2024), Table 4: Llama 3 405B (126 layers, hidden 16,384, 128
  heads, 8 KV heads, FFN 53,248, vocabulary 128,256; positions up to 131,072 as Llama 3.1's config) on
  H100 80GB, bf16: seq 8,192 on 8,192 and
  16,384 GPUs, and seq 131,072 with context parallelism 16 (TP8 CP16 PP16 DP8, 16 sequences per
  DP rank), whose CP all-gathers keys and values (its section 3.3.2). The paper reports MFU and
  TFLOP/s per GPU but not its FLOP count; here, as FlashAttention's benchmarks count a causal
  kernel (benchmarks/benchmark_flash_attention.py: ``4·b·s²·heads·head_dim // (2 if causal else 1)``),
  6 FLOPs per parameter per token (the embedding's lookup not counted) plus 6·l·s·h per token for
  causal attention's two matmuls, forward and backward. At seq 131,072 attention is 40 % of that
  count; counted without the causal half (torch's FlopCounterMode), it would be 58 %.

Every row runs with the stack its paper used (``--stack fused``: Megatron-LM's fused kernels, and
Meta's for Llama 3); the two Megatron-LM papers predate flash attention, so their GPT rows run the
unfused attention core (transformers' eager attention: QK^T, fused scale-mask-softmax, dropout, AV),
which Korthikanti et al.'s selective recomputation runs again. Narayanan et al.'s runs recompute every layer (their eq. 3 counts the recomputed forward), so full
recomputation is used for those rows. The paper predates sequence parallelism (Korthikanti et al.
2022) and Megatron-LM's distributed optimizer (added after it), so its rows run tensor parallelism
with all-reduces (layer norms and dropouts on every tensor-parallel rank) and a plain data-parallel
all-reduce (ZeRO 0) that starts when backward ends (Megatron-LM overlapped it with backward only
from 2023, ``--overlap-grad-reduce``, still off by default); the Llama 3 rows use sequence
parallelism, ZeRO 1 and fp32 gradients (the paper's section 3.3.2, "Numerical stability": gradients accumulated over
micro-batches and reduce-scattered in FP32). Left unsaid by the
papers and chosen here as plan would: the micro-batch size (1, 2 or 4), the virtual stages of the
interleaved schedule (1, 2 or 4 where they divide), recomputation for Llama 3 (none, selective or
full), and for Llama 3 the uneven first and last stages (126 layers on 16 stages: 7, 8 x 14, 7,
interleaved with the short chunks where the embedding and the head sit, as the paper's adjusted
schedule allows); the fastest layout that fits is kept.

- Megatron-Bridge's "Performance" page (NVIDIA NeMo 25.11 container), pre-training with FP8 current
  scaling on DGX-H100 (Llama 3 70B on 64 GPUs, TP4 PP8 VP5; Llama 3.1 405B on 1,024 GPUs, TP8 PP8 CP2
  VP8) and DGX-B200 (Llama 3.1 405B on 128 GPUs, TP4 PP8 CP2 VP8): tokens/s per GPU, compared as
  such (no FLOP convention needed). They run ``--fp8`` (Transformer Engine's FP8 linear layers),
  ``--stack fused``, sequence parallelism, ZeRO 1 and Megatron-Core's ring CP; the recomputation is
  chosen as for Llama 3.

    .venv/bin/python bench/published.py                 # all rows (several minutes: one capture per row)
    .venv/bin/python bench/published.py --only 1.7B,18.4B
    .venv/bin/python bench/published.py --only torchtitan   # the PyTorch-native runs alone
"""

from __future__ import annotations

import argparse
import json
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fxworkload.cost.system import System  # noqa: E402
from fxworkload.parallel.execution import Execution  # noqa: E402
from fxworkload.parallel.layout import Parallel  # noqa: E402
from fxworkload.plan import Shape, evaluate_shape  # noqa: E402

GPT = dict(model_type="gpt2", vocab_size=51200, n_positions=2048, activation_function="gelu_new",
           architectures=["GPT2LMHeadModel"], attn_implementation="eager")
STACK = "fused"
# name: (heads, hidden, layers, tp, pp, gpus, global batch, published TFLOP/s per GPU)
MEGATRON = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512, 137), "3.6B": (32, 3072, 30, 2, 1, 64, 512, 138),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512, 142), "18.4B": (48, 6144, 40, 8, 1, 256, 1024, 135),
    "39.1B": (64, 8192, 48, 8, 2, 512, 1536, 138), "76.1B": (80, 10240, 60, 8, 4, 1024, 1792, 140),
    "145.6B": (96, 12288, 80, 8, 8, 1536, 2304, 148), "310.1B": (128, 16384, 96, 8, 16, 1920, 2160, 155),
    "529.6B": (128, 20480, 105, 8, 35, 2520, 2520, 163),
}
# name: (heads, hidden, layers, tp, pp, gpus, global batch, micro batch, published iteration time s)
KORTHIKANTI = {"22B": (64, 6144, 48, 8, 1, 8, 4, 4, 1.10), "175B": (96, 12288, 96, 8, 8, 64, 64, 1, 13.75),
               "530B": (128, 20480, 105, 8, 35, 280, 280, 1, 37.83), "1T": (160, 25600, 128, 8, 64, 512, 512, 1, 71.49)}
LLAMA_405B = dict(model_type="llama", hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                  num_attention_heads=128, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                  rope_theta=500000.0, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])
# Megatron-Bridge "Performance" page, 25.11 NeMo container, pre-training with FP8 current scaling
# (FP8-CS), DDP, seq 8192, micro-batch 1; tokens/s per GPU.
# name: (config, layers, device, gpus, tp, pp, cp, vp, global batch, pp_layers, published tokens/s/GPU)
NEMO_FP8 = {"Llama 3 70B FP8 H100": ("llama-3-70b", 80, "h100-sxm", 64, 4, 8, 1, 5, 128, None, 1602),
            "Llama 3.1 405B FP8 H100": ("405b", 126, "h100-sxm", 1024, 8, 8, 2, 8, 512, (15, *[16] * 6, 15), 292),
            "Llama 3.1 405B FP8 B200": ("405b", 126, "b200", 128, 4, 8, 2, 8, 64, (15, *[16] * 6, 15), 661)}
# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (PyTorch-native: FSDP2, torch.compile, torchao Float8,
# AsyncTP; Grand Teton H100s with 96 GB of HBM2e at their default 500 W: the h100-sxm-96gb profile). Held out:
# nothing is fitted on these. Their PyTorch (nightlies of December 2024) ran SDPA's flash kernel (FlashAttention-2):
# cuDNN attention was opt-in from 2.5.1 (pytorch/pytorch#138522) until torch 2.10's cuDNN 9.15 put it first, and
# pytorch/pytorch#142132 shows the nightly of 2024-12-04 taking flash on an H100; with context parallelism
# torchtitan enables flash and efficient only (torchtitan/distributed/utils.py, get_train_context).
TORCHTITAN_SDPA = ("flash", "efficient", "math")
TORCHTITAN_CP_SDPA = ("flash", "efficient")


class TorchtitanRun(NamedTuple):
    """One published torchtitan run: its layout as run, and what it published."""
    model: str
    dp: int  # FSDP
    tp: int
    batch: int  # local batch
    seq: int
    recompute: str
    stack: str
    fp8_recipe: str | None
    async_tp: bool
    tokens_per_s: float  # published, per GPU
    memory_gib: float | None  # published peak memory (torch.cuda.max_memory_reserved), GiB; None: not published


# How torchtitan compiled: each decoder block alone (apply_compile), the embedding, final norm and output projection
# eager; the loss eager in 2024 (before 2024-10-22 its .float() sat in the model's head; from 2024-12-18, train.py:
# "compiling loss function causes CUDA errors") and compiled on its own from 2025-04-02 (bbb1b616e): its 2024 rows
# run --stack compiled-blocks, its 2025-06 rows --stack compiled (blocks and loss compiled, the head's norm and
# projection fused as the whole model's would be).
TORCHTITAN = {
    "torchtitan 8B FSDP": TorchtitanRun("llama-3-8b", 8, 1, 2, 8192, "op", "eager", None, False, 5762, 82.4),
    "torchtitan 8B FSDP compile": TorchtitanRun("llama-3-8b", 8, 1, 2, 8192, "op", "compiled-blocks", None, False,
                                                6667, 77.0),
    "torchtitan 8B FSDP compile Float8": TorchtitanRun("llama-3-8b", 8, 1, 2, 8192, "op", "compiled-blocks", "torchao",
                                                       False, 8532, 76.8),
    # its docs/performance.md as commit 904913f7 (2024-08-21) added it: Llama 3.1 405B on 128 of the same 95 GB
    # lower-TDP H100s, local batch 2, full recomputation, FSDP 16 x TP 8 ("Optimizations: None", Float8, + AsyncTP).
    # Its config compiled the blocks; "None" is read as no compile either (compiled, ours reads 130 tok/s, +19 %).
    "torchtitan 405B FSDP+TP": TorchtitanRun("405b", 16, 8, 2, 8192, "full", "eager", None, False, 109, None),
    "torchtitan 405B FSDP+TP Float8": TorchtitanRun("405b", 16, 8, 2, 8192, "full", "compiled-blocks", "torchao", False,
                                                    177, None),
    "torchtitan 405B FSDP+TP Float8 AsyncTP": TorchtitanRun("405b", 16, 8, 2, 8192, "full", "compiled-blocks",
                                                            "torchao", True, 185, None),
    # benchmarks/llama3_h100_202412_torchtitan.md again: its Table 4 (Llama 3.1 70B, 256 GPUs, local batch 16, full
    # AC, compile, Float8): 2D, then 2D + AsyncTP
    "torchtitan 70B FSDP+TP Float8": TorchtitanRun("llama-3-70b", 32, 8, 16, 8192, "full", "compiled-blocks", "torchao",
                                                   False, 829, 71.9),
    "torchtitan 70B FSDP+TP Float8 AsyncTP": TorchtitanRun("llama-3-70b", 32, 8, 16, 8192, "full", "compiled-blocks",
                                                           "torchao", True, 876, 67.6),
    # its Table 3 (Llama 3.1 8B, 128 GPUs over 16 nodes, local batch 2, selective op recomputation)
    "torchtitan 8B FSDP 128 GPUs": TorchtitanRun("llama-3-8b", 128, 1, 2, 8192, "op", "eager", None, False, 5605, 67.0),
    "torchtitan 8B FSDP compile 128 GPUs": TorchtitanRun("llama-3-8b", 128, 1, 2, 8192, "op", "compiled-blocks", None,
                                                         False, 6514, 62.0),
    "torchtitan 8B FSDP compile Float8 128 GPUs": TorchtitanRun("llama-3-8b", 128, 1, 2, 8192, "op", "compiled-blocks",
                                                                "torchao", False, 8380, 61.8),
    # its benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (the same Grand Teton H100s at 500 W; torch of
    # 2025-06-14; the markdown table of commit 8b6770a1): AsyncTP against vanilla TP, torch.compile, seq 8,192 (the
    # train configs' default), no memory published. Its float8 rowwise rows are left out: their vanilla baseline is
    # a bug it names (pytorch/torchtitan#1207), slower than bf16.
    "torchtitan 2025-06 70B TP bf16": TorchtitanRun("llama-3-70b", 32, 8, 16, 8192, "full", "compiled", None, False,
                                                    597.3, None),
    "torchtitan 2025-06 70B AsyncTP bf16": TorchtitanRun("llama-3-70b", 32, 8, 16, 8192, "full", "compiled", None, True,
                                                         652.4, None),
    "torchtitan 2025-06 70B TP Float8": TorchtitanRun("llama-3-70b", 32, 8, 16, 8192, "full", "compiled", "torchao",
                                                      False, 809.8, None),
    "torchtitan 2025-06 70B AsyncTP Float8": TorchtitanRun("llama-3-70b", 32, 8, 16, 8192, "full", "compiled",
                                                           "torchao", True, 942.4, None),
    "torchtitan 2025-06 8B TP bf16": TorchtitanRun("llama-3-8b", 8, 8, 12, 8192, "op", "compiled", None, False, 4378,
                                                   None),
    "torchtitan 2025-06 8B AsyncTP bf16": TorchtitanRun("llama-3-8b", 8, 8, 12, 8192, "op", "compiled", None, True,
                                                        4809.4, None),
    "torchtitan 2025-06 8B TP Float8": TorchtitanRun("llama-3-8b", 8, 8, 12, 8192, "op", "compiled", "torchao", False,
                                                     5078.1, None),
    "torchtitan 2025-06 8B AsyncTP Float8": TorchtitanRun("llama-3-8b", 8, 8, 12, 8192, "op", "compiled", "torchao",
                                                          True, 5570.1, None),
    # torchao's own e2e benchmark (docs/source/workflows/training.md "e2e training benchmarks", NVIDIA H100; the
    # torchao/float8/README.md table of pytorch/ao#1793, 2025-03): torchtitan 0.0.2 on 8 H100s, local batch 1, seq
    # 8,192, torch.compile, FSDP2, per-op SAC; torch 2.7.0a0+gitb98af95 (its blocks compiled, the loss not yet: as
    # the 2024 rows), torchao 0.10.0+git890e0ac8. Its H100s are taken as Meta's 500 W 96 GB boards, as torchtitan's
    # published runs (the page says "H100"); its "Peak Memory (GB)" as torchtitan logs it, reserved GiB.
    "torchao 8B bf16": TorchtitanRun("llama-3-8b", 8, 1, 1, 8192, "op", "compiled-blocks", None, False, 6150, 47.65),
    "torchao 8B Float8 tensorwise": TorchtitanRun("llama-3-8b", 8, 1, 1, 8192, "op", "compiled-blocks", "torchao",
                                                  False, 7689.5, 47.77),
    "torchao 8B Float8 rowwise": TorchtitanRun("llama-3-8b", 8, 1, 1, 8192, "op", "compiled-blocks", "torchao-rowwise",
                                               False, 6768, 47.79),
}
# Rows whose train config gathers the Float8 linears' weights in FP8 under FSDP2 (torchao's float8 all-gather,
# ``--fp8-param-gather``): the 405B config of torchtitan at 904913f7, train_configs/llama3_405b.toml [float8]
# enable_fsdp_float8_all_gather = true, precompute_float8_dynamic_scale_for_fsdp = true. The 8B and 70B configs
# leave float8 off, and the flags the runs added to them are not published: the option's default, off.
FSDP_FLOAT8_GATHER = {"torchtitan 405B FSDP+TP Float8", "torchtitan 405B FSDP+TP Float8 AsyncTP",
                      "torchao 8B Float8 tensorwise"}  # torchao's "tensorwise with float8 all-gather"
# torchao's recipes against each other and against bf16, as its benchmark published them: (baseline, changed)
FLOAT8_RECIPE_PAIRS = (("torchao 8B bf16", "torchao 8B Float8 tensorwise"), ("torchao 8B bf16", "torchao 8B Float8 rowwise"),
                       ("torchao 8B Float8 tensorwise", "torchao 8B Float8 rowwise"))
# AsyncTP off and on at one layout, as published: (off, on) rows of TORCHTITAN
ASYNC_TP_PAIRS = (("torchtitan 405B FSDP+TP Float8", "torchtitan 405B FSDP+TP Float8 AsyncTP"),
                  ("torchtitan 70B FSDP+TP Float8", "torchtitan 70B FSDP+TP Float8 AsyncTP"),
                  ("torchtitan 2025-06 70B TP bf16", "torchtitan 2025-06 70B AsyncTP bf16"),
                  ("torchtitan 2025-06 70B TP Float8", "torchtitan 2025-06 70B AsyncTP Float8"),
                  ("torchtitan 2025-06 8B TP bf16", "torchtitan 2025-06 8B AsyncTP bf16"),
                  ("torchtitan 2025-06 8B TP Float8", "torchtitan 2025-06 8B AsyncTP Float8"))
# its Table 2 (Llama 3.1 8B, 8 GPUs, FSDP + CP, compile + Float8, local batch 1, full recomputation; torchtitan's
# context parallelism rotates keys and values by all-gather, its default): name -> (fsdp, cp, seq, tok/s, GiB)
CP_STACK = "compiled-blocks"  # torchtitan of 2024-12-26 (9dec370), as TORCHTITAN's 2024 rows
TORCHTITAN_CP = {"torchtitan 8B CP1 32k": (8, 1, 32768, 3890, 83.9), "torchtitan 8B CP2 64k": (4, 2, 65536, 2540, 84.2),
                 "torchtitan 8B CP4 128k": (2, 4, 131072, 1071, 84.0), "torchtitan 8B CP8 256k": (1, 8, 262144, 548, 84.5)}
# its Tables 5 and 6 (Llama 3.1 405B on 512 GPUs, TP 8 x PP 8 x FSDP (x CP) 8, compile, Float8, AsyncTP, full
# recomputation; Table 5 local batch 32 at seq 8,192, Table 6 local batch 8 with 1F1B). What torchtitan of 2024-12
# ran there, from its source: micro-batches unset, one per pipeline stage over all ranks, 8 for 1F1B and 16 for
# Interleaved 1F1B's two a rank (parallelisms/pipelining_utils.py, build_pipeline_schedule, generate_split_points:
# see torchtitan_pp_layers); FSDP under PP keeps the gathered parameters ("For PP, do not reshard after forward to
# avoid per-microbatch all-gathers", parallelize_llama.py apply_fsdp), and torch's pipelining stage turns FSDP's
# gradient sync off until the last backward (torch/distributed/pipelining/stage.py, backward_maybe_with_nosync);
# Float8 gathers in FP8 as the 405B train config says (FSDP_FLOAT8_GATHER). name -> (fsdp, cp, stages a rank,
# local batch, seq, tok/s, GiB reserved)
TORCHTITAN_PP = {"torchtitan 405B PP 1F1B": (8, 1, 1, 32, 8192, 100, 82.5),
                 "torchtitan 405B PP Interleaved 1F1B": (8, 1, 2, 32, 8192, 128, 72.7),
                 "torchtitan 405B PP CP1 32k": (8, 1, 1, 8, 32768, 76, 75.3),
                 "torchtitan 405B PP CP2 64k": (4, 2, 1, 8, 65536, 47, 75.9),
                 "torchtitan 405B PP CP4 128k": (2, 4, 1, 8, 131072, 31, 77.1),
                 "torchtitan 405B PP CP8 256k": (1, 8, 1, 8, 262144, 16, 84.9)}
PP_DEGREE = 8
# An optimizer-offload ablation: NVIDIA-NeMo/RL pull request 3628 (Megatron-Core's HybridDeviceOptimizer, one
# H100, Qwen3-0.6B; mean step of steps 11-100): offload fraction -> published step s (0: disabled; both
# offloaded rows with overlap_cpu_optimizer_d2h_h2d on, as Megatron-Core's default and ours)
OFFLOAD_PAIR = {0.0: 0.752, 0.5: 1.216, 1.0: 1.678}
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960)
# name: (tp, cp, pp, dp, seq, sequences per DP rank, published TFLOP/s per GPU)
LLAMA = {"405B 8192 GPUs": (8, 1, 16, 64, 8192, 32, 430), "405B 16384 GPUs": (8, 1, 16, 128, 8192, 16, 400),
         "405B 131072 tokens": (8, 16, 16, 8, 131072, 16, 380)}


def gpt_folder(root: Path, name: str, layers: int, hidden: int, heads: int) -> str:
    """A GPT config of Megatron's shape; attn_implementation is written into config.json (save_pretrained
    leaves it out), so the model built from it runs the unfused attention core."""
    from transformers import GPT2Config

    folder = root / f"gpt-{name}"
    GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, **{k: v for k, v in GPT.items() if k != "model_type"}
               ).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"attn_implementation": GPT["attn_implementation"]}))
    return str(folder)


def megatron_row(name: str, root: Path) -> list:
    heads, hidden, layers, tp, pp, gpus, batch, published = MEGATRON[name]
    folder = gpt_folder(root, name, layers, hidden, heads)
    dp = gpus // (tp * pp)
    best = best_layout(folder, tp, pp, dp, batch, 2048, "fp16", "a100-80gb", layers,
                       recompute=("full",), pp_layers=None, sp=False, zero=0, overlap_grad_reduce=False)
    seq, vocab = 2048, 51200
    paper_flops = 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    ours = paper_flops / (best["step_ms"] / 1e3) / gpus / 1e12
    return [f"GPT {name}", f"tp{tp} pp{pp} dp{dp}", gpus, describe(best), published, f"{ours:.0f}",
            f"{100 * (ours / published - 1):+.2f}%"]


def korthikanti_row(name: str, root: Path) -> list:
    heads, hidden, layers, tp, pp, gpus, batch, micro_batch, published_s = KORTHIKANTI[name]
    folder = gpt_folder(root, name, layers, hidden, heads)
    dp = gpus // (tp * pp)
    best = best_layout(folder, tp, pp, dp, batch, 2048, "bf16", "a100-80gb", layers, recompute=("selective",),
                       pp_layers=None, sp=True, zero=0, micro_batches=(micro_batch,))
    seq, vocab = 2048, 51200
    model_flops = 72 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    published = model_flops / published_s / gpus / 1e12
    ours = model_flops / (best["step_ms"] / 1e3) / gpus / 1e12
    return [f"GPT {name} (Korthikanti)", f"tp{tp} pp{pp} dp{dp} sp", gpus, describe(best), f"{published:.0f}",
            f"{ours:.0f}", f"{100 * (ours / published - 1):+.2f}%"]


def llama_row(name: str, root: Path) -> list:
    tp, cp, pp, dp, seq, per_dp, published = LLAMA[name]
    folder = _llama_405b(root)
    best = best_layout(str(folder), tp, pp, dp, dp * per_dp, seq, "bf16", "h100-sxm", 126,
                       recompute=("none", "selective", "full"), pp_layers=(7, *[8] * 14, 7), sp=True, zero=1,
                       grad_dtype="fp32", cp=cp, cp_comm="allgather", partial_recompute=True)
    gpus = tp * cp * pp * dp
    ours = llama_flops_per_token(seq) * dp * per_dp * seq / (best["step_ms"] / 1e3) / gpus / 1e12
    return [f"Llama 3 {name}", f"tp{tp} cp{cp} pp{pp} dp{dp}", gpus, describe(best), published,
            f"{ours:.0f}", f"{100 * (ours / published - 1):+.2f}%"]


def llama_flops_per_token(seq: int) -> float:
    """Training FLOPs per token of Llama 3 405B: 6 per non-embedding parameter, and causal attention's
    QK^T and AV (2·2·s·h forward over the whole square, half of it causal, three passes)."""
    c = LLAMA_405B
    h, layers, ffn, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn
    parameters = layers * per_layer + h * vocab  # the output head; norms are negligible
    return 6 * parameters + 6 * layers * seq * h


def nemo_fp8_row(name: str, root: Path) -> list:
    """Tokens/s per GPU, which needs no FLOP convention. The 405B rows' 126 layers on 8 x 8 virtual
    stages: one layer short on the first and the last stage (Megatron-Bridge accounts the embedding and
    the loss as a layer each)."""
    config, layers, device, gpus, tp, pp, cp, vpp, batch, pp_layers, published = NEMO_FP8[name]
    model = config if config != "405b" else str(_llama_405b(root))
    dp = gpus // (tp * pp * cp)
    best = best_layout(model, tp, pp, dp, batch, 8192, "bf16", device, layers, recompute=("none", "selective", "full"),
                       pp_layers=pp_layers, sp=True, zero=1, micro_batches=(1,), cp=cp, vpps=(vpp,), fp8=True,
                       fp8_recipe="te-current", partial_recompute=True)  # the page's FP8 current scaling
    ours = best["tokens_per_s_per_gpu"]
    return [name, f"tp{tp} cp{cp} pp{pp} vp{vpp} dp{dp}", gpus, describe(best), f"{published} tok/s",
            f"{ours:.0f} tok/s", f"{100 * (ours / published - 1):+.2f}%"]


def torchtitan_row(name: str, root: Path, tokens_per_s: dict | None = None) -> list:
    """One published torchtitan run at its layout: tokens/s per GPU and peak memory, both the caching
    allocator's reserved peak (ours: the allocated peak and the slack of the allocator's rules replayed over
    the captured step, RankMemory.reserved_peak_bytes)."""
    from fxworkload.pipeline import extract

    config, dp, tp, batch, seq, recompute, stack, recipe, async_tp, published, published_gib = TORCHTITAN[name]
    model = config if config != "405b" else str(_llama_405b(root))
    parallel = Parallel(dp=dp, tp=tp, sp=tp > 1, zero=3, recompute=recompute, tp_comm_overlap=async_tp,
                        fp8_param_gather=name in FSDP_FLOAT8_GATHER)
    run = extract(model, batch=batch, seq=seq, dtype="bf16", grad_dtype="fp32", device="h100-sxm-96gb", stack=stack,
                  fp8=recipe is not None, fp8_recipe=recipe or "te", parallel=parallel, sdpa_backends=TORCHTITAN_SDPA)
    if tokens_per_s is not None:
        tokens_per_s[name] = run.cluster.tokens_per_s_per_gpu
    said = (f"{stack}{', Float8 (' + recipe + ')' if recipe else ''}{', FP8 FSDP gathers' if name in FSDP_FLOAT8_GATHER else ''}"
            f"{', AsyncTP' if async_tp else ''}, recompute {recompute}")
    return native_row(name, f"fsdp{dp} tp{tp}", dp * tp, said, run, published, published_gib)


def native_row(name: str, layout: str, gpus: int, said: str, run, published: float,
               published_gib: float | None) -> list:
    """A PyTorch-native run's row: how it ran and our reserved peak beside the published one (if any), then
    tokens/s per GPU, published and ours."""
    ours = run.cluster.tokens_per_s_per_gpu
    memory = run.memory.reserved_peak_bytes / 2 ** 30
    memory_text = f"{memory:.1f} GiB" + (f" vs {published_gib} ({100 * (memory / published_gib - 1):+.1f}%)"
                                         if published_gib else "")
    return [name, layout, gpus, f"{said}; {memory_text}", f"{published} tok/s", f"{ours:.0f} tok/s",
            f"{100 * (ours / published - 1):+.2f}%"]


def pair_rows(pairs: tuple, tokens_per_s: dict, name=lambda off, on: on.replace(" AsyncTP", "")) -> list:
    """Each published (baseline, changed) pair whose two rows ran: the change in tokens/s it published and ours."""
    rows = []
    for off, on in pairs:
        if off in tokens_per_s and on in tokens_per_s:
            published = 100 * (TORCHTITAN[on].tokens_per_s / TORCHTITAN[off].tokens_per_s - 1)
            ours = 100 * (tokens_per_s[on] / tokens_per_s[off] - 1)
            rows.append([name(off, on), f"{published:+.1f} %", f"{ours:+.1f} %", f"{ours - published:+.1f}",
                         "yes" if abs(ours - published) <= 3 else "no"])
    return rows


def torchtitan_cp_row(name: str, root: Path) -> list:
    """One of torchtitan's long-context runs at its layout (as torchtitan_row), on Llama 3 8B's shapes with
    positions up to the run's longest sequence (torchtitan takes its max_seq_len from the job, past 3.1's 131,072)."""
    from transformers import LlamaConfig

    from fxworkload.pipeline import extract

    folder = root / "llama-3.1-8b-262k"
    if not folder.exists():
        config = json.loads((Path(__file__).resolve().parents[1] / "models/llama-3-8b/config.json").read_text())
        LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"} | {
            "max_position_embeddings": 262144}).save_pretrained(folder)
    fsdp, cp, seq, published, published_gib = TORCHTITAN_CP[name]
    parallel = Parallel(dp=fsdp, cp=cp, cp_comm="allgather", zero=3, recompute="full")
    run = extract(str(folder), batch=1, seq=seq, dtype="bf16", grad_dtype="fp32", device="h100-sxm-96gb",
                  stack=CP_STACK, fp8=True, fp8_recipe="torchao", parallel=parallel,
                  sdpa_backends=TORCHTITAN_CP_SDPA if cp > 1 else TORCHTITAN_SDPA)
    said = f"{CP_STACK}, Float8 (torchao), recompute full, seq {seq:,}"
    return native_row(name, f"fsdp{fsdp} cp{cp}", fsdp * cp, said, run, published, published_gib)


def torchtitan_pp_layers(layers: int, pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """Decoder layers per pipeline rank as torchtitan of 2024-12 split them without split points
    (generate_split_points): pp x stages_per_rank stages of layers // stages each, the middle stages one more
    while the remainder lasts, the last stage what is left; rank r holds stages r, r + pp, ... (loop style)."""
    stages = pp * stages_per_rank
    base, extra = divmod(layers, stages)
    sizes = [base]
    for _ in range(stages - 2):
        sizes.append(base + (extra > 0))
        extra -= extra > 0
    sizes.append(layers - sum(sizes))
    return tuple(sum(sizes[rank::pp]) for rank in range(pp))


def torchtitan_pp_row(name: str, root: Path) -> list:
    """One of torchtitan's pipelined 405B runs at its layout (as torchtitan_row)."""
    from fxworkload.pipeline import extract

    fsdp, cp, vpp, local_batch, seq, published, published_gib = TORCHTITAN_PP[name]
    micro_batches = PP_DEGREE * vpp
    parallel = Parallel(dp=fsdp, cp=cp, cp_comm="allgather", tp=8, sp=True, pp=PP_DEGREE, vpp=vpp, zero=3,
                        micro_batches=micro_batches, recompute="full", tp_comm_overlap=True, fp8_param_gather=True,
                        pp_layers=torchtitan_pp_layers(LLAMA_405B["num_hidden_layers"], PP_DEGREE, vpp),
                        reshard_after_forward=False, accumulate_unsharded=True)
    run = extract(str(_llama_405b(root, seq)), batch=local_batch // micro_batches, seq=seq, dtype="bf16",
                  grad_dtype="fp32", device="h100-sxm-96gb", stack=CP_STACK, fp8=True, fp8_recipe="torchao",
                  parallel=parallel, sdpa_backends=TORCHTITAN_CP_SDPA if cp > 1 else TORCHTITAN_SDPA)
    schedule = "Interleaved 1F1B" if vpp > 1 else "1F1B"
    return native_row(name, f"fsdp{fsdp} cp{cp} tp8 pp8", fsdp * cp * 64,
                      f"{CP_STACK}, Float8 (torchao), FP8 FSDP gathers, AsyncTP, recompute full, {schedule}, "
                      f"{micro_batches} micro-batches, seq {seq:,}", run, published, published_gib)


def offload_rows(root: Path) -> list:
    """What offloading a share of the optimizer adds to a step, ours against the pull request's. The run's
    batch and sequence are not given, and the added time does not depend on them (the optimizer follows
    backward), so ours is the step with the share offloaded minus the step without, set against the
    published step without it: the change in the step, in points, each side."""
    from transformers import Qwen3Config

    from fxworkload.pipeline import extract

    folder = root / "qwen3-0.6b"
    if not folder.exists():
        Qwen3Config(**QWEN3_06B).save_pretrained(folder)

    def step_s(share: float) -> float:
        run = extract(str(folder), batch=1, seq=4096, dtype="bf16", grad_dtype="fp32", device="h100-sxm",
                      parallel=Parallel(zero=1, optimizer_offload=share))
        return run.cluster.step_ns / 1e9

    base, published_base = step_s(0.0), OFFLOAD_PAIR[0.0]
    rows = []
    for share in (0.5, 1.0):
        added, published_added = step_s(share) - base, OFFLOAD_PAIR[share] - published_base
        rows.append([f"Qwen3-0.6B, {share:.0%} of the optimizer on the host", f"+{published_added:.3f} s",
                     f"+{added:.3f} s", f"{100 * (added / published_added - 1):+.1f}%",
                     f"{100 * published_added / published_base:+.1f} vs {100 * added / published_base:+.1f}"])
    return rows


# A second optimizer-offload pair, held out: Megatron-Bridge's docs/training/cpu-offloading.md (NVIDIA-NeMo/
# Megatron-Bridge b00deab, "Expected Metric Changes", measured): Qwen3-30B-A3B pre-training (the recipe
# qwen3_30b_a3b_pretrain_config: sequence parallelism, full recomputation; seq 4,096 taken, the common
# default) at TP2 PP2 EP4 on 2 H100 nodes, global batch 8, micro-batch 1; with the whole optimizer on the host
# and overlap_cpu_optimizer_d2h_h2d the step is 3.9x; each 25 % offloaded frees 3.8 GB, 15.3 GB at 100 %.
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])  # Qwen/Qwen3-30B-A3B config.json
MOE_OFFLOAD = {"step_ratio": 3.9, "freed_gb": 15.3}


def moe_offload_rows(root: Path) -> list:
    """The step with the whole optimizer on the host over the step without it, and the GPU memory it frees."""
    from transformers import Qwen3MoeConfig

    from fxworkload.pipeline import extract

    folder = root / "qwen3-30b-a3b"
    if not folder.exists():
        Qwen3MoeConfig(**QWEN3_30B_A3B).save_pretrained(folder)
    runs = {share: extract(str(folder), batch=1, seq=4096, dtype="bf16", grad_dtype="fp32", device="h100-sxm",
                           stack="fused", parallel=Parallel(tp=2, sp=True, pp=2, dp=4, ep=4, zero=1, micro_batches=2,
                                                            recompute="full", optimizer_offload=share))
            for share in (0.0, 1.0)}
    ratio = runs[1.0].cluster.step_ns / runs[0.0].cluster.step_ns
    freed = (runs[0.0].memory.total_peak_bytes - runs[1.0].memory.total_peak_bytes) / 1e9
    return [["Qwen3-30B-A3B TP2 PP2 EP4, 16 H100s: step with all of the optimizer on the host",
             f"{MOE_OFFLOAD['step_ratio']:.1f}x", f"{ratio:.2f}x", f"{100 * (ratio / MOE_OFFLOAD['step_ratio'] - 1):+.1f}%"],
            ["the same: GPU memory it frees", f"{MOE_OFFLOAD['freed_gb']:.1f} GB", f"{freed:.2f} GB",
             f"{100 * (freed / MOE_OFFLOAD['freed_gb'] - 1):+.1f}%"]]


def _llama_405b(root: Path, seq: int = 0) -> Path:
    """Llama 3 405B's config; positions up to ``seq`` where it runs past 3.1's 131,072 (torchtitan takes its
    max_seq_len from the job)."""
    from transformers import LlamaConfig

    positions = max(LLAMA_405B["max_position_embeddings"], seq)
    folder = root / ("llama-3-405b" if positions == LLAMA_405B["max_position_embeddings"] else f"llama-3-405b-{positions}")
    if not folder.exists():
        LlamaConfig(**{k: v for k, v in LLAMA_405B.items() if k != "model_type"}
                    | {"max_position_embeddings": positions}).save_pretrained(folder)
    return folder


def best_layout(model, tp, pp, dp, batch, seq, dtype, device, layers, recompute, pp_layers, sp, zero,
                micro_batches=(1, 2, 4), overlap_grad_reduce=True, grad_dtype=None, cp=1, cp_comm="p2p",
                partial_recompute=False, vpps=(1, 2, 4), fp8=False, fp8_recipe="te") -> dict:
    rows = []
    for micro_batch in micro_batches:
        if batch % (dp * micro_batch):
            continue
        m = batch // (dp * micro_batch)
        layouts = [Parallel(tp=tp, pp=pp, dp=dp, cp=cp, cp_comm=cp_comm, sp=sp and tp > 1, micro_batches=m, zero=zero,
                            recompute=r, recompute_layers=n, vpp=v, pp_layers=pp_layers,
                            overlap_grad_reduce=overlap_grad_reduce)
                   for r, v in itertools.product(recompute, vpps)
                   if v == 1 or (pp > 1 and m % pp == 0 and (min(pp_layers) >= v if pp_layers
                                                            else layers % (pp * v) == 0))
                   for n in _partial(r, v, pp_layers or (layers // pp,), partial_recompute)]
        rows += evaluate_shape(model, Shape(tp, 1, micro_batch, cp), layouts,
                               Execution(seq=seq, dtype=dtype, grad_dtype=grad_dtype, stack=STACK, fp8=fp8,
                                         fp8_recipe=fp8_recipe),
                               System(device))
    fitting = [r for r in rows if r["fits"]] or rows
    return min(fitting, key=lambda r: r["step_ms"]) | {"any_fits": any(r["fits"] for r in rows)}


def _partial(recompute: str, vpp: int, pp_layers, wanted: bool) -> list:
    """None (every layer), and with ``wanted`` full recomputation of the first 1 .. n-1 layers of each
    model chunk too (Megatron-LM's --recompute-num-layers): as little as makes the step fit."""
    if not wanted or recompute != "full":
        return [None]
    fewest, most = min(pp_layers) // vpp, -(-max(pp_layers) // vpp)  # layers of the smallest and largest chunk
    return [None, *range(1, min(fewest, most - 1) + 1)]


def describe(row: dict) -> str:
    layers = f" ({row['recompute_layers']} layers/chunk)" if row.get("recompute_layers") else ""
    return (f"mbs {row['micro_batch']}, vpp {row['vpp']}, recompute {row['recompute']}{layers}, "
            f"{row['step_ms'] / 1e3:.2f} s/step, {row['peak_bytes'] / 2 ** 30:.0f} GiB"
            + ("" if row["any_fits"] else " (none fits)"))


def accuracy_line(rows: list, within_pct: float = 15.0) -> str:
    """How many rows' last column (ours against published, "+x.xx%") lie within ``within_pct``, and the mean and
    median of their |error|."""
    errors = [abs(float(row[-1].rstrip("%"))) for row in rows]
    if not errors:
        return ""
    inside = sum(error <= within_pct for error in errors)
    return (f"{inside} of {len(errors)} within ±{within_pct:.0f} %; mean |error| {statistics.mean(errors):.1f} %, "
            f"median {statistics.median(errors):.1f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated row names (e.g. 1.7B,405B 8192 GPUs)")
    args = parser.parse_args()
    wanted = None if args.only is None else set(args.only.split(","))
    root = Path(tempfile.mkdtemp(prefix="fxworkload-published-"))
    rows, started = [], time.perf_counter()
    for name in MEGATRON:
        if wanted is None or name in wanted:
            rows.append(megatron_row(name, root))
            print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    for name in KORTHIKANTI:
        if wanted is None or name in wanted:
            rows.append(korthikanti_row(name, root))
            print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    for name in LLAMA:
        if wanted is None or name in wanted:
            rows.append(llama_row(name, root))
            print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    for name in NEMO_FP8:
        if wanted is None or name in wanted:
            rows.append(nemo_fp8_row(name, root))
            print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model", "layout", "gpus", "chosen (unsaid by the paper)",
                                  "published (TFLOP/s per GPU, or tok/s)", "ours", "ours_vs_published"],
                   tablefmt="github"))
    print(accuracy_line(rows))
    native, tokens_per_s = [], {}
    for name in TORCHTITAN:
        if wanted is None or name in wanted or "torchtitan" in wanted:
            native.append(torchtitan_row(name, root, tokens_per_s))
            print(" | ".join(map(str, native[-1])), file=sys.stderr, flush=True)
    for name in TORCHTITAN_CP:
        if wanted is None or name in wanted or "torchtitan" in wanted:
            native.append(torchtitan_cp_row(name, root))
            print(" | ".join(map(str, native[-1])), file=sys.stderr, flush=True)
    for name in TORCHTITAN_PP:
        if wanted is None or name in wanted or "torchtitan" in wanted:
            native.append(torchtitan_pp_row(name, root))
            print(" | ".join(map(str, native[-1])), file=sys.stderr, flush=True)
    if native:
        print("\nPyTorch-native runs (torchtitan; held out):")
        print(tabulate(native, headers=["run", "layout", "gpus", "as run; peak memory ours vs published (reserved)",
                                        "published", "ours", "ours_vs_published"], tablefmt="github"))
        print(accuracy_line(native))
    pairs = pair_rows(ASYNC_TP_PAIRS, tokens_per_s)
    if pairs:
        print("\nAsyncTP off and on (torchtitan, held out; issue 39: within 3 points of the published change):")
        print(tabulate(pairs, headers=["pair", "published change", "ours", "points apart", "within 3 points"],
                       tablefmt="github", disable_numparse=True))
    recipes = pair_rows(FLOAT8_RECIPE_PAIRS, tokens_per_s, lambda off, on: f"{on.split('8B ')[1]} over {off.split('8B ')[1]}")
    if recipes:
        print("\nFloat8 recipes (torchao's benchmark, Llama 3 8B on 8 H100s, held out):")
        print(tabulate(recipes, headers=["change", "published", "ours", "points apart", "within 3 points"],
                       tablefmt="github", disable_numparse=True))
    if wanted is None or "offload" in wanted:
        print("\nOptimizer offload on and off (NVIDIA-NeMo/RL#3628, one H100, Megatron-Core's HybridDeviceOptimizer):")
        print(tabulate(offload_rows(root), headers=["run", "published: added to the step", "ours: added",
                                                    "ours_vs_published", "step change, points: published vs ours"],
                       tablefmt="github"))
        print("\nOptimizer offload on a MoE model (Megatron-Bridge docs/training/cpu-offloading.md, measured):")
        print(tabulate(moe_offload_rows(root), headers=["run", "published", "ours", "ours_vs_published"],
                       tablefmt="github"))
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
