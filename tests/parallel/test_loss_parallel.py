"""Loss parallelism (parallel/loss_parallel.py) against torch's own cross entropy, and the memory its
decomposition holds against a count of its tensors by hand from torch/distributed/tensor/parallel/loss.py."""

from __future__ import annotations

import pytest
import torch

from fxworkload.capture import models
from fxworkload.capture.trace import capture_training_step
from fxworkload.cost.flops import register_transformers_ops
from fxworkload.parallel.loss_parallel import loss_parallel_causal_lm, with_loss_parallel
from fxworkload.workload.memory import activation_memory
from tests.conftest import tiny_config


def test_the_decomposed_loss_and_its_gradient_are_torchs_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 16, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 16))
    labels[0, 3] = -100  # an ignored position
    ours = loss_parallel_causal_lm(logits, labels, 50)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    oracle = torch.nn.functional.cross_entropy(logits.float().view(-1, 50), shifted.reshape(-1), ignore_index=-100)
    assert ours.item() == pytest.approx(oracle.item(), rel=1e-6)
    (ours_grad,) = torch.autograd.grad(ours, logits)
    (oracle_grad,) = torch.autograd.grad(oracle, logits)
    assert torch.allclose(ours_grad.float(), oracle_grad.float(), atol=1e-6)


def _step_peak_bytes(loss_parallel: bool, vocab: int, tokens: int) -> int:
    register_transformers_ops()
    config = tiny_config("llama", vocab_size=vocab, num_hidden_layers=1)
    spec = models.ModelSpec(name="tiny", config=config, task=models.CAUSAL_LM, folder=None)
    model = models.build_meta_model(spec, torch.bfloat16)
    model = with_loss_parallel(model) if loss_parallel else model
    return activation_memory(capture_training_step(model, 1, tokens)).step_peak_bytes


def test_its_backward_holds_one_more_fp32_logits_tensor_than_the_fused_log_softmax():
    """At the loss's backward the fused kernels hold the saved log-probabilities, nll_loss_backward's
    gradient and _log_softmax_backward_data's output: three fp32 [tokens, vocabulary] tensors. loss.py's
    _nll_loss_and_log_softmax_backward holds the saved result, grad_input, exp(result) and their sum: four.
    With a vocabulary far wider than the model the step's peak is there, one tensor apart."""
    vocab, tokens = 16384, 64
    one_logits_fp32_bytes = tokens * vocab * 4
    difference = _step_peak_bytes(True, vocab, tokens) - _step_peak_bytes(False, vocab, tokens)
    assert difference == pytest.approx(one_logits_fp32_bytes, rel=0.05)
