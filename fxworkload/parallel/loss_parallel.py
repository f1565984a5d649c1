"""A tensor-parallel rank's cross entropy over its vocabulary shard, as torch and Megatron-LM run it.

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
saved result, ``grad_input``, ``exp(result)`` and their sum) against the fused kernel's three.

Megatron-LM's ``vocab_parallel_cross_entropy`` (megatron/core/tensor_parallel/cross_entropy.py) works on
one fp32 copy of the logits in place: ``-= max``, ``exp(out=)``, ``div_`` by the sum, saved as the
softmax, and in backward the targets' ``-= 1`` and ``mul_`` by the incoming gradient on that same tensor,
which it returns: one fp32 shard at each peak (and autograd's cast of it to the logits' dtype).

The rank's step is captured with the stack's loss in place of the model's (``with_vocab_parallel_loss``),
so its kernels and the memory the allocator replays are that implementation's.
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


class _MegatronVocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's _VocabParallelCrossEntropy on one rank (no label smoothing), as its ops run."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        logits = logits.float()  # calculate_logits_max
        logits_max = torch.max(logits, dim=-1)[0]  # all-reduced (max)
        logits -= logits_max.unsqueeze(dim=-1)  # calculate_predicted_logits: in place
        target_mask = target == ignore_index  # Megatron: the targets outside the rank's vocabulary slice
        masked_target = target.clone()
        masked_target[target_mask] = 0
        arange_1d = torch.arange(logits.shape[0], device=logits.device)
        predicted_logits = logits[arange_1d, masked_target].clone().contiguous()  # all-reduced (sum)
        predicted_logits[target_mask] = 0.0
        torch.exp(logits, out=logits)
        sum_exp_logits = logits.sum(dim=-1)  # all-reduced (sum)
        loss = torch.log(sum_exp_logits) - predicted_logits  # calculate_cross_entropy_loss
        logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(logits, target_mask, masked_target)
        kept = ~target_mask  # the caller's mean over the tokens that count
        return (loss * kept).sum() / kept.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, target_mask, masked_target = ctx.saved_tensors
        grad_input = softmax  # prepare_gradient_calculation_operands: in place
        arange_1d = torch.arange(softmax.shape[0], device=softmax.device)
        softmax_update = 1.0 - target_mask.float()
        grad_input[arange_1d, masked_target] -= softmax_update  # calculate_gradients
        kept = ~target_mask
        grad_input.mul_((grad * kept / kept.sum()).unsqueeze(dim=-1))
        return grad_input, None, None


def _causal_lm(cross_entropy, logits, labels, vocab_size: int, num_items_in_batch, ignore_index: int,
               shift_labels) -> torch.Tensor:
    """transformers' ForCausalLMLoss (the labels shifted, tokens flattened) with ``cross_entropy`` (an autograd
    Function above) in place of ``nn.functional.cross_entropy``."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    loss = cross_entropy.apply(logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device), ignore_index)
    return loss if num_items_in_batch is None else loss * (shift_labels != ignore_index).sum() / num_items_in_batch


def loss_parallel_causal_lm(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                            shift_labels=None, **kwargs) -> torch.Tensor:
    """torch's loss-parallel cross entropy on the fp32 logits, as ForCausalLMLoss upcasts them first."""
    return _causal_lm(_LossParallelCrossEntropy, logits.float(), labels, vocab_size, num_items_in_batch, ignore_index,
                      shift_labels)


def megatron_causal_lm(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                       shift_labels=None, **kwargs) -> torch.Tensor:
    """Megatron-LM's vocab-parallel cross entropy, which takes the logits in their own dtype and makes the one
    fp32 copy itself."""
    return _causal_lm(_MegatronVocabParallelCrossEntropy, logits, labels, vocab_size, num_items_in_batch,
                      ignore_index, shift_labels)


VOCAB_PARALLEL_LOSSES = {"loss-parallel": loss_parallel_causal_lm, "megatron": megatron_causal_lm}


def with_vocab_parallel_loss(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """The tensor-parallel rank's model with ``kind``'s cross entropy over its vocabulary shard
    (VOCAB_PARALLEL_LOSSES), where its loss is the causal LM's (other heads' losses are left as the model
    computes them)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    # transformers' PreTrainedModel.loss_function, read without its warning for a config with no loss_type
    loss_type = getattr(model, "loss_type", None)
    causal = LOSS_MAPPING.get(loss_type if loss_type in LOSS_MAPPING else "ForCausalLM") is LOSS_MAPPING["ForCausalLM"]
    if causal and "_loss_function" not in vars(model):
        model.loss_function = VOCAB_PARALLEL_LOSSES[kind]
    return model
