"""One bounded memo for what a layout search computes again and again from the same objects.

A layout search asks the same questions of the same tables, units and profiles thousands of times
(a table's units, a device's passes, a chunk's gradient buckets, a collective's time). Those objects
are not hashable by value, so the questions are keyed by their ``id``: the memo keeps the objects
themselves with each answer, so an id cannot be reused by another object while its answer is held.
Past ``limit`` answers the memo starts again (a search's working set is far smaller).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class Memo:
    def __init__(self, limit: int):
        self.limit = limit
        self.held: dict[Hashable, tuple[tuple, Any]] = {}

    def get(self, key: Hashable, keep: tuple, make: Callable[..., Any], *args) -> Any:
        """The answer for ``key``, made once as ``make(*args)``; ``keep``: the objects whose ids are in the key."""
        held = self.held.get(key)
        if held is None:
            if len(self.held) >= self.limit:
                self.held.clear()
            held = self.held[key] = (keep, make(*args))
        return held[1]
