"""FlexAttention as a GPU run traces it: transformers' ``attn_implementation="flex_attention"`` on fake CPU tensors.

``torch.nn.attention.flex_attention`` is a higher-order op: make_fx records it, and its backward
(``flex_attention_backward``), as one node each, holding the block mask's tables and the mask and score
functions as subgraphs. Three things stand between a CPU trace and the graph a GPU run compiles, and
``flex_capture`` patches each for the trace only:

- transformers calls ``torch.compile(flex_attention)`` and ``create_block_mask(..., _compile=True)``
  (integrations/flex_attention.py, masking_utils.py); make_fx cannot trace into a compiled function.
  The uncompiled op records the same node inductor lowers to its Triton kernel.
- transformers returns the log-sum-exp, which attention sinks need, only off the CPU
  (``return_lse = query.device.type != "cpu"``), and torch refuses flex's backward on CPU tensors
  (``_validate_device``): the fake CPU tensors of a trace stand for GPU ones, so the GPU path is taken.
- ``create_block_mask`` evaluates the mask on every (query, key) pair; traced, those [Q, KV] tensors would
  be costed as kernels and held in memory, where the compiled mask builder keeps them in registers. Here
  the block tables are made in the graph (their shapes) and which blocks the kernel visits is counted
  outside it on real indices: ``block_counts``, tagged on the tables' op (``FLEX_BLOCKS_KEY``), read by
  the cost model (cost/optime.py), which runs a kernel over the visited blocks only.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from .attention import BACKEND_KEY, tagged_meta

FLEX = "flex"  # the attention kernel's name beside SDPA's backends (attention.BACKEND_KEY)
FLEX_ATTENTION = "flex_attention"  # transformers' attn_implementation
FLEX_BLOCKS_KEY = "fxworkload_flex_blocks"  # node.meta["custom"]: (partial, full, all) blocks of one head
BLOCK_SIZE = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE, which create_block_mask and transformers use
# Above this many mask evaluations a block is judged from a grid of its rows and columns (every 16th, and its
# last) rather than all of them: a mask feature thinner than 16 positions can then be missed.
EXACT_EVALUATIONS = 1 << 26
SAMPLE_STRIDE = 16


def block_counts(mask_mod, q_len: int, kv_len: int, block: int = BLOCK_SIZE) -> tuple[int, int, int]:
    """(partial, full, all) ``block`` x ``block`` tiles of one batch element and head: a tile is full where the
    mask holds at every position of it (the kernel skips the mask there), partial where it holds at some,
    empty (skipped) where at none. ``mask_mod(b, h, q_idx, kv_idx)`` on broadcast index tensors."""
    q_blocks, kv_blocks = math.ceil(q_len / block), math.ceil(kv_len / block)
    stride = 1 if q_len * kv_len <= EXACT_EVALUATIONS else SAMPLE_STRIDE
    offsets = sorted(set(range(0, block, stride)) | {block - 1})
    kv_index = _positions(kv_blocks, offsets, block)
    zero = torch.zeros((), dtype=torch.int64)
    partial = full = 0
    for first in range(0, q_blocks, 64):  # 64 block rows at a time: [64 x |offsets|, KV samples] booleans
        rows = range(first, min(first + 64, q_blocks))
        q_index = _positions(len(rows), offsets, block, start=first)
        mask = torch.as_tensor(mask_mod(zero, zero, q_index[:, None], kv_index[None, :]), dtype=torch.bool)
        # a short last tile's positions past the sequence are masked, as torch pads the mask with False
        mask = mask & (q_index < q_len)[:, None] & (kv_index < kv_len)[None, :]
        mask = mask.reshape(len(rows), len(offsets), kv_blocks, len(offsets))
        any_true, all_true = mask.any(3).any(1), mask.all(3).all(1)
        full += int(all_true.sum())
        partial += int((any_true & ~all_true).sum())
    return partial, full, q_blocks * kv_blocks


def _positions(blocks: int, offsets: list[int], block: int, start: int = 0) -> torch.Tensor:
    """The sampled positions of ``blocks`` tiles from tile ``start``."""
    starts = (torch.arange(start, start + blocks) * block)[:, None]
    return (starts + torch.tensor(offsets)[None, :]).reshape(-1)


def traced_block_mask(mask_mod=None, B=None, H=None, Q_LEN=None, KV_LEN=None, device="cpu",
                      BLOCK_SIZE=BLOCK_SIZE, _compile=False):  # noqa: N803 (create_block_mask's own names)
    """``create_block_mask`` inside a trace: tables of the right shapes made in the graph, tagged with the
    counts ``block_counts`` finds on real indices (their values are a fake tensor's: never read)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.nn.attention.flex_attention import BlockMask

    block = BLOCK_SIZE if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE[0]
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        counts = block_counts(mask_mod, Q_LEN, KV_LEN, block)
    batch, heads = B or 1, H or 1
    q_blocks, kv_blocks = math.ceil(Q_LEN / block), math.ceil(KV_LEN / block)
    with tagged_meta(**{FLEX_BLOCKS_KEY: counts}):
        tables = [torch.zeros(shape, dtype=torch.int32, device=device) for shape in
                  ((batch, heads, q_blocks), (batch, heads, q_blocks, kv_blocks)) * 2]
    return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None,
                           position_bias=None, **kwargs):
    """transformers' ``flex_attention_forward`` (integrations/flex_attention.py) as it runs on a GPU: the
    uncompiled op with its log-sum-exp, the sinks renormalised from it after the kernel."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError("flex attention runs without attention dropout (transformers refuses it in training): "
                         "give --no-dropout")
    if position_bias is not None or (attention_mask is not None and not isinstance(attention_mask, BlockMask)):
        raise ValueError("flex attention with a dense mask or a position bias is not modelled: use --attention sdpa")

    def soft_capped(score, batch_idx, head_idx, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    heads = query.shape[1]
    enable_gqa = not heads & (heads - 1)  # transformers repeats the key/value heads for other counts (TP shards)
    if not enable_gqa:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    with tagged_meta(**{BACKEND_KEY: FLEX}):
        out, aux = flex_attention(query, key, value, score_mod=soft_capped if softcap is not None else None,
                                  block_mask=attention_mask, scale=scaling, enable_gqa=enable_gqa,
                                  return_aux=AuxRequest(lse=True))
    lse = aux.lse.to(value.dtype)
    if s_aux is not None:  # log(exp(lse) + exp(sink)): the sink's share taken out of each row's softmax
        batch, heads, seq, _ = out.shape
        sinks = s_aux.view(1, -1, 1, 1).expand(batch, heads, seq, 1)
        lse = lse.unsqueeze(-1)
        combined = torch.logsumexp(torch.cat([lse, sinks], dim=-1), dim=-1, keepdim=True)
        out = (out * torch.exp(lse - combined)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def flex_capture():
    """While a step is traced: transformers' flex attention and block masks as a GPU run makes them."""
    import torch.nn.attention.flex_attention as torch_flex
    import transformers.masking_utils as masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = (masking_utils.create_block_mask, torch_flex._validate_device,
             ALL_ATTENTION_FUNCTIONS.get(FLEX_ATTENTION))
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
    masking_utils.create_block_mask = traced_block_mask
    torch_flex._validate_device = lambda query, key, value: None  # fake CPU tensors standing for GPU ones
    ALL_ATTENTION_FUNCTIONS[FLEX_ATTENTION] = flex_attention_forward
    try:
        yield
    finally:
        masking_utils.create_block_mask, torch_flex._validate_device = saved[0], saved[1]
        ALL_ATTENTION_FUNCTIONS[FLEX_ATTENTION] = saved[2]
