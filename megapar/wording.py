"""How messages name a count of things: "1 byte", "0 bytes", "1,234 bytes".

`counted` is the one place that chooses between a noun's singular and plural for a number
shown to a user, `first_few` the one that names the first of many things and how many more,
`or_list` the one that offers alternatives, `and_list` the one that names several things
together, `scale_text` the one that shows an fp16 loss scale (standard library only:
megapar-data and megapar-convert use them before torch is imported).
"""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` with `noun` in the number it takes: "1 byte", "2 bytes", "1,234 documents", "0
    tokens"; `plural` where adding "s" is wrong (``counted(m, "micro-batch",
    "micro-batches")``). Thousands are separated by commas."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def or_list(names: list[str]) -> str:
    """`names` as prose: "a", "a or b", "a, b or c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def and_list(names: list[str], word: str = "and") -> str:
    """`names` as prose: "a", "a and b", "a, b and c" (`word` "or": "a, b or c")."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def first_few(items: list[str], most: int) -> str:
    """The first `most` of `items` joined by commas, and how many more: "a, b, c and 3 more";
    all of them as prose where they are no more than `most` ("a, b and c")."""
    if len(items) <= most:
        return and_list(items)
    return f"{', '.join(items[:most])} and {len(items) - most} more"


def scale_text(scale: float) -> str:
    """An fp16 loss scale as a user gives it: 65536 and 8388608 whole, not 6.554e+04 or
    8.38861e+06; 0.5 (a floor below 1) and 1e+30 as `g` shows them (2^40 whole; 1e30 not as
    31 digits)."""
    whole = 1 <= scale < 1e12 and scale == int(scale)
    return f"{scale:.0f}" if whole else f"{scale:g}"
