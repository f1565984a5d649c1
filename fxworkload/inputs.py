"""Files other programs wrote (profiler traces, timing logs, kernel CSVs, measured files), read once
and bounded: what is read, inflated or nested past a real file's size is refused in one line.

A path is read once per run: a pipe (``<(zcat trace.json.gz)``) can be sniffed for its format and
then parsed. Gzip input is inflated in steps, so a small file that would inflate to gigabytes
stops at the bound instead of exhausting memory.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

from .errors import UserError

MAX_INPUT_BYTES = 1 << 30  # 1 GiB of (inflated) text: a profiler trace of a large step is a few hundred MB
_READ: dict[str, bytes] = {}


def read_input(path: Path, what: str) -> bytes:
    """The file's bytes, gzip inflated, at most MAX_INPUT_BYTES; one clean line if it cannot be read."""
    key = str(path)
    if key not in _READ:
        if len(_READ) >= 4:
            _READ.clear()
        _READ[key] = _inflate(_read_raw(path, what), path)
    return _READ[key]


def _read_raw(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_INPUT_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; pass {what}") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a folder; pass {what}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc}); pass {what}") from None
    if len(raw) > MAX_INPUT_BYTES:
        raise UserError(f"{path}: larger than {MAX_INPUT_BYTES >> 30} GiB, more than any file of {what}; "
                        "pass a trace of one or a few steps")
    return raw


def _inflate(raw: bytes, path: Path) -> bytes:
    if raw[:2] != b"\x1f\x8b":
        return raw
    inflater = zlib.decompressobj(wbits=31)  # gzip framing
    parts, size, pending = [], 0, raw
    try:
        while pending:
            part = inflater.decompress(pending, 1 << 24)
            size += len(part)
            if size > MAX_INPUT_BYTES:
                raise UserError(f"{path}: inflates past {MAX_INPUT_BYTES >> 30} GiB, more than any real trace; "
                                "pass a trace of one or a few steps")
            parts.append(part)
            pending = inflater.unconsumed_tail
            if inflater.eof:
                break
    except zlib.error as exc:
        raise UserError(f"{path}: a damaged gzip file ({exc}); export or copy it again") from None
    if not inflater.eof:
        raise UserError(f"{path}: a truncated gzip file; export or copy it again")
    return b"".join(parts)


def load_json(path: Path, what: str):
    """The file's JSON (NaN and infinities refused, nesting bounded by the parser's recursion limit)."""
    try:
        text = read_input(path, what).decode("utf-8")
        return json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; pass {what}") from None
    except RecursionError:
        raise UserError(f"{path}: nested deeper than any real file of {what}; pass {what}") from None
    except _Constant as exc:
        raise UserError(f"{path}: {exc}: the file holds a non-finite value where a figure belongs; "
                        f"pass {what}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not complete JSON ({exc}); a truncated or partly written file? "
                        f"pass {what}") from None


class _Constant(ValueError):
    pass


def _no_constant(name: str):
    raise _Constant(f"{name} is not a JSON number")


def finite_number(value, low: float = 0.0, high: float = math.inf) -> bool:
    """A real number (not a bool) within [low, high]: the check every time and size read from a file takes."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def whole_number(value, low: int = 0, high: int = 1 << 62) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
