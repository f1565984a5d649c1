"""Loss parallelism as torch runs it: a tensor-parallel rank's cross entropy over its vocabulary shard.

torchtitan (its default under tensor parallelism, ``--training.disable_loss_parallel`` off) keeps the
output projection's logits sharded over the vocabulary (``ColwiseParallel(output_layouts=Shard(-1))``)
and computes ``cross_entropy(pred.flatten(0, 1).float(), labels)`` under ``loss_parallel()``, which
dispatches to torch's own decomposition (torch/distributed/tensor/parallel/loss.py):

- forward, ``_log_softmax``: ``amax``, ``shifted = x - max``, ``sum(exp(shifted))``, ``log``,
  ``result = shifted - logsumexp`` (two all-reduces between them, costed with the layout's
  collectives), then ``_nll_loss_forward``'s gather of the target's log-probability;
- backward, ``_nll_loss_and_log_softmax_backward``: ``zeros_like``, the target set to -1, then
  ``(grad_input + exp(result)) * grad_output``; ``_log_softmax_backward_handler`` passes it on.

Each is a separate fp32 tensor of the logits' shard, where the fused ``_log_softmax`` and its
backward the HuggingFace loss runs hold fewer at once: the backward holds four at its peak (the
saved result, ``grad_input``, ``exp(result)`` and their sum) against the fused kernel's three. The
rank's step is captured with this loss in place of the model's (``with_loss_parallel``), so its
kernels and the memory the allocator replays are this decomposition's.
"""

from __future__ import annotations

import torch


class _LossParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of fp32 logits [tokens, vocabulary shard] as loss.py computes it on one rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        x = x.to(dtype=torch.float32, memory_format=torch.contiguous_format)  # _log_softmax
        x_max = torch.amax(x, 1, keepdim=True)  # all-reduced (max) over the vocabulary shards
        shifted = x - x_max
        shifted_sumexp = torch.sum(torch.exp(shifted), 1, keepdim=True)  # all-reduced (sum)
        result = shifted - torch.log(shifted_sumexp)
        kept = target != ignore_index  # _nll_loss_forward
        safe_target = torch.where(kept, target, 0)
        picked = -torch.gather(result, 1, safe_target.unsqueeze(1)).squeeze(1)  # all-reduced (masked partial)
        picked = torch.where(kept, picked, 0)
        total_weight = kept.sum().to(result)
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(result, target, total_weight)
        return picked.sum() / total_weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        result, target, total_weight = ctx.saved_tensors  # _nll_loss_and_log_softmax_backward
        grad_output = grad / total_weight
        kept = (target != ctx.ignore_index).unsqueeze(1)
        safe_target = torch.where(kept.squeeze(1), target, 0)
        grad_input = torch.zeros_like(result)
        grad_input[torch.arange(result.shape[0], device=result.device), safe_target] = -1.0
        grad_output = torch.where(kept, grad_output, 0)
        return (grad_input + torch.exp(result)) * grad_output, None, None


def loss_parallel_causal_lm(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                            shift_labels=None, **kwargs) -> torch.Tensor:
    """transformers' ForCausalLMLoss (the logits upcast, the labels shifted) with torch's loss-parallel cross
    entropy in place of ``nn.functional.cross_entropy``."""
    logits = logits.float()
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    loss = _LossParallelCrossEntropy.apply(logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device),
                                           ignore_index)
    return loss if num_items_in_batch is None else loss * (shift_labels != ignore_index).sum() / num_items_in_batch


def with_loss_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The tensor-parallel rank's model with torch's loss-parallel cross entropy, where its loss is the causal
    LM's (other heads' losses are left as the model computes them)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    # transformers' PreTrainedModel.loss_function, read without its warning for a config with no loss_type
    loss_type = getattr(model, "loss_type", None)
    causal = LOSS_MAPPING.get(loss_type if loss_type in LOSS_MAPPING else "ForCausalLM") is LOSS_MAPPING["ForCausalLM"]
    if causal and "_loss_function" not in vars(model):
        model.loss_function = loss_parallel_causal_lm
    return model
