"""Megatron timing logs: the two real logs in fixtures/ (the shared seeds 000 and 001), read by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import GPT2Config

from fxworkload.errors import UserError
from fxworkload.measure.compare import detect_format
from fxworkload.measure.megatron_log import compare_log, parse, summarize
from fxworkload.pipeline import extract
from fxworkload.parallel.layout import Parallel

from ..test_cli import fxworkload

FIXTURES = Path(__file__).parent.parent / "fixtures"
DENSE = FIXTURES / "megatron_dense_tp_rank0.txt"  # seed 000
MOE = FIXTURES / "megatron_moe_ep2_pp4_rank0.txt"  # seed 001

# Read off seed 001's 16 forward_step and backward_step lines, in batch order.
MOE_FORWARD_MS = [12.59, 12.55, 12.71, 12.67, 12.11, 12.19, 12.15, 12.4, 12.19, 12.23, 12.53, 12.12, 11.25, 11.1,
                  11.13, 11.61]
MOE_BACKWARD_MS = [18.96, 18.65, 18.86, 18.66, 19.43, 18.51, 18.75, 18.56, 18.78, 18.73, 18.95, 18.5, 18.88, 18.99,
                   18.81, 19.04]


def test_dense_log_by_hand():
    summary = summarize(parse(DENSE))
    assert detect_format(DENSE) == "megatron"
    assert (summary.rank, summary.stage) == (0, 0)
    assert summary.forward_ms == {0: 34.03} and summary.backward_ms == {0: 52.72}
    assert (summary.seq, summary.micro_batch, summary.hidden, summary.dtype) == (256, 1, 4096, "bf16")
    assert summary.optimizer_ms == 132.78
    calls = {(c.group, c.comm, c.name): (c.bytes, c.duration_ms) for c in summary.collectives}
    assert calls == {
        ("tp", "broadcast", "tokens"): (1 * 256 * 8, 0.0),
        ("tp", "broadcast", "attention_mask"): (256 * 256 * 1, 0.13),
        ("tp", "broadcast", "position_ids"): (256 * 8, 0.06),
        ("tp", "allreduce", "embedding_fwd"): (256 * 4096 * 2, 0.02),
        ("pp", "send", "send_forward"): (256 * 4096 * 2, 0.21),
        ("pp", "recv", "recv_backward"): (256 * 4096 * 2, 254.25),
        ("dp", "allreduce", "dp_allreduce"): (3221225472 * 4, 49.91),
        ("ep", "allreduce", "ep_allreduce"): (50304 * 4096 * 4, 6.56),
    }


def test_moe_log_by_hand():
    summary = summarize(parse(MOE))
    assert list(summary.forward_ms.values()) == MOE_FORWARD_MS
    assert list(summary.backward_ms.values()) == MOE_BACKWARD_MS
    assert (summary.seq, summary.micro_batch, summary.hidden, summary.dtype) == (1024, 1, 4096, "bf16")
    assert summary.optimizer_ms == 31.79
    by_kind = {}
    for call in summary.collectives:
        by_kind.setdefault((call.group, call.comm), []).append(call)
    # Per micro-batch: forward 2 allgathers and 4 all-to-alls, backward 4 all-to-alls (expert parallel).
    assert len(by_kind[("exp", "allgather")]) == 2 * 16
    assert len(by_kind[("exp", "all_to_all")]) == 8 * 16
    # 16 send_forward and 16 recv_backward lines; the 13 steady-state pairs are one fused call each.
    pipeline = by_kind[("pp", "send")] + by_kind[("pp", "recv")]
    assert len(pipeline) == 32 - 13
    assert by_kind[("dp", "allreduce")][0].bytes == 290013184 * 4
    assert by_kind[("ep_dp", "allreduce")][0].bytes == 1409286144 * 4
    assert by_kind[("exp", "all_to_all")][0].bytes == 2048 * 4096 * 2


@pytest.fixture(scope="module")
def dense_estimate(tmp_path_factory):
    """The dense seed's model as far as the log tells it: GPT, hidden 4096, seq 256, bf16, vocabulary 50304."""
    folder = tmp_path_factory.mktemp("gpt16")
    GPT2Config(n_layer=16, n_embd=4096, n_head=32, vocab_size=50304, n_positions=256,
               architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    result = extract(str(folder), seq=256, dtype="bf16", device="a100-80gb",
                     parallel=Parallel(pp=2, micro_batches=1, stage=0))
    result.write(folder / "estimated", ["tables"])
    return folder / "estimated"


def test_compare_log_against_the_estimate(dense_estimate, tmp_path):
    run = fxworkload("compare", dense_estimate, DENSE, "--out", tmp_path / "cmp")
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    estimated = json.loads((dense_estimate / "workload.json").read_text())["totals"]
    forward, backward, step = result["phases"]
    assert forward["measured_ms"] == 34.03 and backward["measured_ms"] == 52.72
    assert forward["estimated_ms"] == pytest.approx(estimated["forward_estimated_ns"] / 1e6)
    assert backward["estimated_ms"] == pytest.approx(
        (estimated["input_grad_estimated_ns"] + estimated["weight_grad_estimated_ns"]) / 1e6)
    assert forward["error"] == pytest.approx((forward["estimated_ms"] - 34.03) / 34.03)
    assert result["gradient_reduction"]["measured_bytes"] == 3221225472 * 4
    assert "dp_allreduce" in run.stdout


def test_a_log_of_other_settings_names_them(dense_estimate):
    estimated = json.loads((dense_estimate / "workload.json").read_text())
    with pytest.raises(UserError, match=r"--seq 1024 in the log vs 256 estimated.*--micro-batches 16 in the log vs 1"):
        compare_log(estimated, summarize(parse(MOE)))


@pytest.mark.parametrize("text, says", [
    ("", "an empty log"),
    ("rank:0:forward_step(stage_id=0,batch_id=0,mg_state=warmup,description=None)\n", "lacks duration"),
    ("rank:0:forward_step(stage_id=0,batch_id=0,mg_state=warmup,duration=abc,description=None,group_kind=None,"
     "input__shape=None,input__dtype=None,timestamp=1.0,sub_operations=[])\n", "'abc' is not a number"),
    ("rank:0:send_forward(stage_id=0,batch_id=0,mg_state=warmup,duration=1.0,description=None,group_kind=pp,"
     "input__shape=[256, 1, 4096],input__dtype=torch.bfloat16,timestamp=1.0,sub_operations=[])\n", "no forward_step"),
    ("rank:0:forward_step(stage_id=0,batch_id=0,mg_state=warmup,duration=1.0,description=None,group_kind=None,"
     "input__shape=None,input__dtype=None,timestamp=1.0,sub_operations=['duration=0.1'])\n", "lacks comm_func"),
    ("rank:0:forward_step(stage_id=0,batch_id=0,mg_state=warmup,duration=1.0,description=None,group_kind=None,"
     "input__shape=None,input__dtype=None,timestamp=1.0,sub_operations=[oops)\n", "sub_operations is not a list"),
])
def test_a_broken_log_is_one_line(dense_estimate, tmp_path, text, says):
    log = tmp_path / "rank0.txt"
    log.write_text(text)
    run = fxworkload("compare", dense_estimate, log, "--measured-format", "megatron", "--out", tmp_path / "never")
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


def test_a_rank_the_log_lacks(dense_estimate, tmp_path):
    run = fxworkload("compare", dense_estimate, DENSE, "--rank", 3, "--out", tmp_path / "x")
    assert run.returncode == 2 and "--rank 3: the log holds ranks 0" in run.stderr
