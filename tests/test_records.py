"""Records read back from JSON only as the dataclass the reader names, every field checked by its annotation."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest

from fxworkload.parallel.facts import ModelFacts
from fxworkload.records import RecordError, decode, encode
from fxworkload.workload.table import OpCost


@dataclass(frozen=True)
class Sample:
    count: int
    rate: float
    shape: tuple[int, int, int] | None
    names: frozenset[str] = frozenset()
    sizes: dict[str, tuple[float, float]] = field(default_factory=dict)


GOOD = Sample(count=3, rate=0.5, shape=(1, 2, 3), names=frozenset({"b", "a"}), sizes={"gemm": (0.9, 1.1)})


def test_a_record_reads_back_equal_through_json_text():
    assert decode(json.loads(json.dumps(encode(GOOD))), Sample) == GOOD
    assert encode(GOOD)["names"] == ["a", "b"]  # sets sorted: the same record is the same text


@pytest.mark.parametrize("change, says", [
    ({"count": True}, "expected an integer, got a boolean"),
    ({"count": 2.0}, "expected int"),
    ({"rate": "1"}, "expected a finite number"),
    ({"rate": float("inf")}, "expected a finite number"),
    ({"shape": [1, 2]}, "expected 3 items"),
    ({"shape": [1, 2, "3"]}, "expected int"),
    ({"names": "ab"}, "expected list"),
    ({"sizes": {"gemm": [0.9]}}, "expected 2 items"),
    ({"extra": 1}, "unknown field 'extra'"),
])
def test_a_field_not_as_annotated_is_refused(change, says):
    with pytest.raises(RecordError, match=says):
        decode(encode(GOOD) | change, Sample)


def test_a_required_field_missing_is_refused_and_a_defaulted_one_takes_its_default():
    data = encode(GOOD)
    with pytest.raises(RecordError, match="lacks 'count'"):
        decode({k: v for k, v in data.items() if k != "count"}, Sample)
    assert decode({k: v for k, v in data.items() if k != "names"}, Sample).names == frozenset()


def test_non_finite_numbers_are_never_written():
    with pytest.raises(RecordError):
        encode(Sample(count=1, rate=math.nan, shape=None))


def test_the_cached_classes_read_back_equal():
    facts = ModelFacts(name="m", model_type="llama", task="causal-lm", layers=2, hidden=64, heads=4, kv_heads=2,
                       vocab=96, experts=0, top_k=1, stack="model.layers", row_parallel=("a.o_proj",),
                       tied_embedding=None, head_dim_config=0, max_positions=64)
    op = OpCost(fx_name="mm", op="aten.mm.default", kind="matmul", phase="forward", input_shapes=[[2, 3], [3, 4]],
                input_dtypes=["float32"] * 2, output_shapes=[[2, 4]], output_dtypes=["float32"], flops=48, bytes=80,
                estimated_ns=0.0, has_flop_rule=True, gemm_mkn=(2, 3, 4), gemm_leading=(3, 4, 4))
    for value in (facts, op):
        assert decode(json.loads(json.dumps(encode(value))), type(value)) == value


def _mutations(value):
    """Every value one change away from ``value`` (a parsed JSON tree): each leaf, list and object replaced by
    values of the other JSON kinds, each list cut short and grown, each object given an unknown key and each key
    dropped in turn."""
    others = (None, True, 0, 2, -1, 0.5, math.inf, "x", [], {}, [1], 10 ** 400)
    for other in others:
        if other is not value and not (type(other) is type(value) and other == value):
            yield other
    if isinstance(value, list):
        if value:
            yield value[:-1]
            yield value + value[-1:]
        for i, item in enumerate(value):
            for changed in _mutations(item):
                yield value[:i] + [changed] + value[i + 1:]
    if isinstance(value, dict):
        yield value | {"unknown": 1}
        for key in value:
            yield {k: v for k, v in value.items() if k != key}
            for changed in _mutations(value[key]):
                yield value | {key: changed}


def _outcome(read, data, hint):
    try:
        return "read", read(data, hint)
    except RecordError:
        return "refused", None


def test_the_compiled_readers_accept_and_refuse_exactly_what_reflecting_on_each_annotation_does():
    """``decode`` reads through a reader compiled once per annotation; the reflective reader it replaced
    (kept as ``_checked``, for its messages) is the oracle: for every value one change away from a valid
    record of each cached class, both read the same record or both refuse it."""
    from fxworkload.records import _checked, _reader

    facts = ModelFacts(name="m", model_type="llama", task="causal-lm", layers=2, hidden=64, heads=4, kv_heads=2,
                       vocab=96, experts=0, top_k=1, stack="model.layers", row_parallel=("a.o_proj",),
                       tied_embedding=None, head_dim_config=0, max_positions=64)
    op = OpCost(fx_name="mm", op="aten.mm.default", kind="matmul", phase="forward", input_shapes=[[2, 3], [3, 4]],
                input_dtypes=["float32"] * 2, output_shapes=[[2, 4]], output_dtypes=["float32"], flops=48, bytes=80,
                estimated_ns=0.0, has_flop_rule=True, gemm_mkn=(2, 3, 4), gemm_leading=None,
                attention={"q_len": 4, "nested": [[1, 2.5], None]})
    compared = 0
    for record in (GOOD, facts, op):
        hint = type(record)
        valid = json.loads(json.dumps(encode(record)))
        for data in [valid, *_mutations(valid)]:
            compiled = _outcome(lambda d, h: _reader(h)(d), data, hint)
            assert compiled == _outcome(lambda d, h: _checked(d, h, "entry"), data, hint), data
            assert _outcome(decode, data, hint) == compiled
            compared += 1
    assert compared > 300


def test_an_integer_past_floats_range_is_refused_as_a_number_not_raised():
    with pytest.raises(RecordError, match="expected a finite number"):
        decode(encode(GOOD) | {"rate": 10 ** 400}, Sample)
