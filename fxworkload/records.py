"""Dataclasses to JSON values and back, checked against their annotations.

What the caches keep is data: a record is written as plain JSON (objects, arrays, strings, numbers,
booleans, null) and read back only into the dataclass the reader names, every field checked against
its annotation (``int`` is an int and not a bool, ``float`` is finite, ``tuple[int, int, int]`` has
three ints, no field missing and none extra). Nothing read can name a class, a function or a module,
so nothing read can run code (unlike pickle, which calls whatever its stream names).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing


class RecordError(ValueError):
    """A value that is not what its annotation says: the entry is not used."""


def encode(value):
    """A JSON value of ``value``: dataclasses as objects of their fields, tuples and sets as arrays."""
    kind = type(value)
    if kind in _PLAIN:  # most values: checked first (a captured 70B step encodes ~400,000 of them)
        return value
    if kind is float:
        if not math.isfinite(value):
            raise RecordError(f"a non-finite number ({value}) is not written")
        return value
    if kind in (list, tuple):
        return [encode(v) for v in value]
    if kind is dict:
        if not all(isinstance(k, str) for k in value):
            raise RecordError("a dict with keys other than strings cannot be written as JSON")
        return {k: encode(v) for k, v in value.items()}
    if kind in (set, frozenset):
        return sorted(encode(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: encode(getattr(value, name)) for name in _field_names(kind)}
    raise RecordError(f"{kind.__name__} is not a record field type")


_PLAIN = frozenset({str, int, bool, type(None)})


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def decode(value, hint, where: str = "entry"):
    """``value`` (parsed JSON) as ``hint`` says, or RecordError naming where it is wrong."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _dataclass(value, hint, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return decode(value, option, where)
            except RecordError as exc:
                errors.append(str(exc))
        raise RecordError(errors[0] if len(errors) == 1 else f"{where}: matches none of {hint}")
    if hint is typing.Any or hint is object:
        return _plain(value, where)
    if hint is bool:
        return _expect(value, bool, where)
    if hint is int:
        if isinstance(value, bool):
            raise RecordError(f"{where}: expected an integer, got a boolean")
        return _expect(value, int, where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RecordError(f"{where}: expected a finite number, got {value!r:.40}")
        return float(value)
    if hint is str:
        return _expect(value, str, where)
    if hint in (list, dict):
        return _plain(_expect(value, hint, where), where)
    if origin is list:
        return [decode(v, args[0], f"{where}[{i}]") for i, v in enumerate(_expect(value, list, where))]
    if origin in (frozenset, set):
        return origin(decode(v, args[0], f"{where}[{i}]") for i, v in enumerate(_expect(value, list, where)))
    if origin is tuple:
        items = _expect(value, list, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(v, args[0], f"{where}[{i}]") for i, v in enumerate(items))
        if len(items) != len(args):
            raise RecordError(f"{where}: expected {len(args)} items, got {len(items)}")
        return tuple(decode(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(items, args)))
    if origin is dict:
        items = _expect(value, dict, where)
        return {decode(k, args[0], where): decode(v, args[1], f"{where}.{k}") for k, v in items.items()}
    raise RecordError(f"{where}: {hint} is not a record field type")


def _dataclass(value, cls, where: str):
    items = _expect(value, dict, where)
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(items) - names
    if extra:
        raise RecordError(f"{where}: unknown field {sorted(extra)[0]!r} of {cls.__name__}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = required - set(items)
    if missing:
        raise RecordError(f"{where}: {cls.__name__} lacks {sorted(missing)[0]!r}")
    return cls(**{name: decode(v, hints[name], f"{where}.{name}") for name, v in items.items()})


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _expect(value, kind, where: str):
    if not isinstance(value, kind):
        raise RecordError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _plain(value, where: str):
    """An unannotated JSON value: only JSON's own types, numbers finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RecordError(f"{where}: a non-finite number")
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise RecordError(f"{where}: {type(value).__name__} is not JSON")
