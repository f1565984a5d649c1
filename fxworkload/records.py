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
    """``value`` (parsed JSON) as ``hint`` says, or RecordError naming where it is wrong.

    The reader compiled for ``hint`` (``_reader``: one closure per annotation, its field readers resolved
    once) checks what ``_checked`` checks without tracking where it is; only when it refuses a value is the
    value read again by ``_checked``, for the message that names where. (A cached 671B MoE shape is 2.4
    million fields: reflecting on each annotation per value took 3.6 s of a plan's 5.3 s a shape.)"""
    try:
        return _reader(hint)(value)
    except RecordError as exc:
        _checked(value, hint, where)  # raises, naming where
        raise RecordError(f"{where}: {exc}") from None  # the two readers disagree: still refused


def _checked(value, hint, where: str):
    """``decode`` reflecting on ``hint`` at every value, keeping where it is: the reader of the messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _dataclass(value, hint, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _checked(value, option, where)
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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise RecordError(f"{where}: expected a finite number, got {value!r:.40}")
        return float(value)
    if hint is str:
        return _expect(value, str, where)
    if hint in (list, dict):
        return _plain(_expect(value, hint, where), where)
    if origin is list:
        return [_checked(v, args[0], f"{where}[{i}]") for i, v in enumerate(_expect(value, list, where))]
    if origin in (frozenset, set):
        return origin(_checked(v, args[0], f"{where}[{i}]") for i, v in enumerate(_expect(value, list, where)))
    if origin is tuple:
        items = _expect(value, list, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_checked(v, args[0], f"{where}[{i}]") for i, v in enumerate(items))
        if len(items) != len(args):
            raise RecordError(f"{where}: expected {len(args)} items, got {len(items)}")
        return tuple(_checked(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(items, args)))
    if origin is dict:
        items = _expect(value, dict, where)
        return {_checked(k, args[0], where): _checked(v, args[1], f"{where}.{k}") for k, v in items.items()}
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
    return cls(**{name: _checked(v, hints[name], f"{where}.{name}") for name, v in items.items()})


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


@functools.cache
def _reader(hint):
    """A function reading a parsed JSON value as ``hint`` says (RecordError without where), built once per
    annotation: the same checks, in the same order, as ``_checked``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _dataclass_reader(hint)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        options = [_reader(a) for a in args if a is not type(None)]
        if optional and len(options) == 1:
            only = options[0]
            return lambda value: None if value is None else only(value)

        def union(value):
            if value is None and optional:
                return None
            for option in options:
                try:
                    return option(value)
                except RecordError:
                    pass
            raise RecordError(f"matches none of {hint}")
        return union
    if hint is typing.Any or hint is object:
        return _plain_value
    if hint in _SCALARS:
        return _SCALARS[hint]
    if hint in (list, dict):
        return lambda value: _plain_value(_expect(value, hint, ""))
    if origin is list:
        item = _reader(args[0])
        return lambda value: [item(v) for v in _exactly(value, list)]
    if origin in (frozenset, set):
        item = _reader(args[0])
        return lambda value: origin(item(v) for v in _exactly(value, list))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _reader(args[0])
            return lambda value: tuple(item(v) for v in _exactly(value, list))
        items = tuple(_reader(a) for a in args)

        def fixed(value):
            value = _exactly(value, list)
            if len(value) != len(items):
                raise RecordError(f"expected {len(items)} items, got {len(value)}")
            return tuple(read(v) for read, v in zip(items, value))
        return fixed
    if origin is dict:
        key, item = _reader(args[0]), _reader(args[1])
        return lambda value: {key(k): item(v) for k, v in _exactly(value, dict).items()}
    raise RecordError(f"{hint} is not a record field type")


def _dataclass_reader(cls):
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    names = frozenset(f.name for f in fields)
    required = frozenset(f.name for f in fields
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    readers: dict = {}

    def read(value):
        items = _exactly(value, dict)
        keys = items.keys()
        if not (keys <= names and required <= keys):
            raise RecordError(f"not the fields of {cls.__name__}")
        if not readers:  # resolved at first use: a field's class may be the one being built
            readers.update((name, _reader(hints[name])) for name in names)
        return cls(**{name: readers[name](v) for name, v in items.items()})
    return read


def _exactly(value, kind):
    if not isinstance(value, kind):
        raise RecordError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _read_int(value):
    if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise RecordError("expected an integer")


def _read_float(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise RecordError("expected a finite number")
    return float(value)


def _finite(number) -> bool:
    """Whether a JSON number is finite as a float (an integer past float's range is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def _read_bool(value):
    if type(value) is bool:
        return value
    raise RecordError("expected a boolean")


def _read_str(value):
    if isinstance(value, str):
        return value
    raise RecordError("expected a string")


_SCALARS = {int: _read_int, float: _read_float, bool: _read_bool, str: _read_str}


_ATOMS = frozenset({int, str, bool, type(None)})


def _plain_value(value):
    """``_plain`` without where: JSON's own types only, numbers finite."""
    kind = type(value)
    if kind is int or kind is str or kind is bool or value is None:
        return value
    if kind is list:
        if _ATOMS.issuperset(map(type, value)):  # a shape or a list of names: checked in one C-level pass
            return list(value)
        return [_plain_value(v) for v in value]
    if kind is float:
        if not math.isfinite(value):
            raise RecordError("a non-finite number")
        return value
    if kind is dict:
        return {k: _plain_value(v) for k, v in value.items()}
    return _plain(value, "")  # a subclass of one of them: as _plain says
