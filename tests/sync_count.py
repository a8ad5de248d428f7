"""Count host-device synchronisations a block of code would make on a GPU.

On CUDA, reading a tensor's value on the host (`.item()`, `bool(t)`, `int(t)`, `.tolist()`,
`.cpu()`, `.numpy()`), asking for data-dependent shapes (`nonzero`, boolean-mask indexing,
`masked_select`) or copying host data to the device (`torch.tensor(..., device=...)`) makes the
host wait for the device's queue to drain: inside a micro-batch that stalls a GPU pipeline.
The CPU tests cannot observe the stall, so `count_syncs()` wraps those calls and records where
each one comes from (file:line of the first megapar frame). On CUDA,
`torch.cuda.set_sync_debug_mode` is the device's own check of the same thing.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch

_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero",
            "masked_select")
_FUNCTIONS = ("nonzero", "masked_select")


def _is_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/megapar/" in frame.filename and "sync_count" not in frame.filename:
            return f"{frame.filename.split('/megapar/')[-1]}:{frame.lineno}"
    return "outside megapar"


@contextlib.contextmanager
def count_syncs():
    """`with count_syncs() as syncs:` a Counter {(call, where): n} of the calls above."""
    syncs: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS}
    saved_fns = {name: getattr(torch, name) for name in _FUNCTIONS}
    getitem, tensor = torch.Tensor.__getitem__, torch.tensor

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            syncs[name, _where()] += 1
            return fn(*args, **kwargs)
        return wrapper

    def getitem_wrapper(self, index):
        if _is_mask(index):
            syncs["mask index", _where()] += 1
        return getitem(self, index)

    def tensor_wrapper(data, *args, **kwargs):
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
            syncs["torch.tensor(host data, device=...)", _where()] += 1
        return tensor(data, *args, **kwargs)

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    for name, fn in saved_fns.items():
        setattr(torch, name, wrap(f"torch.{name}", fn))
    torch.Tensor.__getitem__, torch.tensor = getitem_wrapper, tensor_wrapper
    try:
        yield syncs
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in saved_fns.items():
            setattr(torch, name, fn)
        torch.Tensor.__getitem__, torch.tensor = getitem, tensor
