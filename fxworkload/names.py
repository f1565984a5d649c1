"""What a name may be: output names (--name) and device profile names become file and folder
names, so they are names, never paths."""

from __future__ import annotations

import re

from .errors import UserError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_name(value: str, option: str, what: str = "name") -> str:
    if not NAME.fullmatch(value or ""):
        raise UserError(f"{option} {value!r} is not a {what}: use up to 100 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit")
    return value
