"""The cross entropy over a vocabulary shard (parallel/loss_parallel.py) against torch's own cross entropy, and
the memory each implementation holds against a count of its tensors by hand from its source: torch's
torch/distributed/tensor/parallel/loss.py and Megatron-LM's megatron/core/tensor_parallel/cross_entropy.py."""

from __future__ import annotations

import pytest
import torch

from fxworkload.capture import models
from fxworkload.capture.trace import capture_training_step
from fxworkload.cost.flops import register_transformers_ops
from fxworkload.parallel.loss_parallel import VOCAB_PARALLEL_LOSSES, with_vocab_parallel_loss
from fxworkload.workload.memory import activation_memory
from tests.conftest import tiny_config


@pytest.mark.parametrize("kind", sorted(VOCAB_PARALLEL_LOSSES))
def test_each_loss_and_its_gradient_are_torchs_cross_entropy(kind):
    torch.manual_seed(0)
    logits = torch.randn(2, 16, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 16))
    labels[0, 3] = -100  # an ignored position
    ours = VOCAB_PARALLEL_LOSSES[kind](logits, labels, 50)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    oracle = torch.nn.functional.cross_entropy(logits.float().view(-1, 50), shifted.reshape(-1), ignore_index=-100)
    assert ours.item() == pytest.approx(oracle.item(), rel=1e-6)
    (ours_grad,) = torch.autograd.grad(ours, logits)
    (oracle_grad,) = torch.autograd.grad(oracle, logits)
    assert ours_grad.dtype == logits.dtype
    assert torch.allclose(ours_grad.float(), oracle_grad.float(), atol=1e-6)


def _step_peak_bytes(kind: str | None, vocab: int, tokens: int) -> int:
    register_transformers_ops()
    config = tiny_config("llama", vocab_size=vocab, num_hidden_layers=1)
    spec = models.ModelSpec(name="tiny", config=config, task=models.CAUSAL_LM, folder=None)
    model = models.build_meta_model(spec, torch.bfloat16)
    model = with_vocab_parallel_loss(model, kind) if kind else model
    return activation_memory(capture_training_step(model, 1, tokens)).step_peak_bytes


VOCAB, TOKENS = 16384, 64
LOGITS_FP32_BYTES = TOKENS * VOCAB * 4  # with a vocabulary far wider than the model, the step's peak is the loss's


def test_torchs_loss_parallel_backward_holds_one_more_fp32_logits_tensor_than_the_fused_log_softmax():
    """At the loss's backward the fused kernels hold the saved log-probabilities, nll_loss_backward's
    gradient and _log_softmax_backward_data's output: three fp32 [tokens, vocabulary] tensors. loss.py's
    _nll_loss_and_log_softmax_backward holds the saved result, grad_input, exp(result) and their sum: four."""
    difference = _step_peak_bytes("loss-parallel", VOCAB, TOKENS) - _step_peak_bytes(None, VOCAB, TOKENS)
    assert difference == pytest.approx(LOGITS_FP32_BYTES, rel=0.05)


def test_megatrons_in_place_cross_entropy_holds_one_fp32_copy_and_its_cast():
    """Megatron-LM's forward makes one fp32 copy and works on it in place; its backward updates that saved
    softmax in place and returns it, which autograd casts to the bf16 logits' dtype: one and a half fp32
    tensors at its peak, against the fused kernels' three."""
    difference = _step_peak_bytes(None, VOCAB, TOKENS) - _step_peak_bytes("megatron", VOCAB, TOKENS)
    assert difference == pytest.approx(1.5 * LOGITS_FP32_BYTES, rel=0.05)
