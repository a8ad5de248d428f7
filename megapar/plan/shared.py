"""`Shared`: the work one search's candidate estimates have in common, done once per key."""

from __future__ import annotations


class Shared:
    """Work that the estimates of one `Problem`'s candidates share, done once per key: a
    search's candidates differ in a few fields each, and each part of an estimate reads only
    some (`estimate._shape`: the activations, the chunks' times; `estimate._state_key`: the
    stages' state; `process.process_peak`'s terms that read no memory figure). `plan` passes
    one to every `estimate` of its search; it lives as long as the search, so nothing it holds
    leaks from one search into the next. A key names its part first (a string), then the
    values that part reads."""

    def __init__(self) -> None:
        self._parts: dict = {}

    def get(self, key: tuple, make):
        """The part stored under `key`, made by `make()` the first time."""
        try:
            return self._parts[key]
        except KeyError:
            part = self._parts[key] = make()
            return part
