"""Count host-device synchronisations a block of code would make on a GPU.

On CUDA, reading a tensor's value on the host (`.item()`, `bool(t)`, `int(t)`, `.tolist()`,
`.cpu()`, `.numpy()`), asking for data-dependent shapes (`nonzero`, boolean-mask indexing,
`masked_select`) or copying host data to the device (`torch.tensor(..., device=...)`) makes the
host wait for the device's queue to drain: inside a micro-batch that stalls a GPU pipeline.
The CPU tests cannot observe the stall, so `count_syncs()` wraps those calls and records where
each one comes from (file:line of the first megapar frame).

Python wrappers cannot see what torch's C++ does without calling back into Python: a tensor
used as an index or a size (`__index__`, an `int` argument), a boolean-mask assignment
(`t[mask] = v`), `torch.where(cond)` with one argument, `unique`, `bincount`, `torch.equal`,
`repeat_interleave` without `output_size`. A `TorchDispatchMode` sees every aten op, so it
counts those too, by the op that waits: `_local_scalar_dense` (the scalar read behind every
`item`, `bool`, `int`, `float` and `__index__`) and the ops whose output size depends on the
data. An op already counted by a Python wrapper above is not counted again. On CUDA,
`torch.cuda.set_sync_debug_mode` is the device's own check of the same thing.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero",
            "masked_select")
_FUNCTIONS = ("nonzero", "masked_select")
_DATA_SIZED = frozenset({"nonzero", "nonzero_static", "masked_select", "argwhere", "_unique",
                         "_unique2", "unique_dim", "unique_consecutive", "bincount", "histc",
                         "equal", "is_nonzero", "_local_scalar_dense"})
"""aten ops that read a value on the host or size their output by the data."""


def _is_mask(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in items)


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/megapar/" in frame.filename and "sync_count" not in frame.filename:
            return f"{frame.filename.split('/megapar/')[-1]}:{frame.lineno}"
    return "outside megapar"


class _AtenSyncs(TorchDispatchMode):
    """Counts the aten ops that wait for the device, outside the Python wrappers' calls."""

    def __init__(self, syncs: Counter, inside: list[int]):
        super().__init__()
        self.syncs, self.inside = syncs, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside[0]:
            name = func._schema.name.split("::")[-1]
            if name in _DATA_SIZED:
                self.syncs[f"aten.{name}", _where()] += 1
            elif name.startswith("index_put") or name == "_index_put_impl_":
                if _is_mask(args[1]):
                    self.syncs["mask assignment", _where()] += 1
            elif name == "index" and _is_mask(args[1]):
                self.syncs["mask index", _where()] += 1
            elif name == "repeat_interleave" and kwargs.get("output_size") is None and (
                    len(args) == 1 or isinstance(args[1], torch.Tensor)):
                if len(args) < 4 or args[3] is None:
                    self.syncs["repeat_interleave without output_size", _where()] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_syncs():
    """`with count_syncs() as syncs:` a Counter {(call, where): n} of the calls above."""
    syncs: Counter = Counter()
    inside = [0]  # inside a wrapped call: its aten ops are that call's
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS}
    saved_fns = {name: getattr(torch, name) for name in _FUNCTIONS}
    getitem, tensor = torch.Tensor.__getitem__, torch.tensor

    def counted(name, fn, *args, **kwargs):
        syncs[name, _where()] += 1
        inside[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            inside[0] -= 1

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            return counted(name, fn, *args, **kwargs)
        return wrapper

    def getitem_wrapper(self, index):
        if _is_mask(index):
            return counted("mask index", getitem, self, index)
        return getitem(self, index)

    def tensor_wrapper(data, *args, **kwargs):
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
            return counted("torch.tensor(host data, device=...)", tensor, data, *args, **kwargs)
        return tensor(data, *args, **kwargs)

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    for name, fn in saved_fns.items():
        setattr(torch, name, wrap(f"torch.{name}", fn))
    torch.Tensor.__getitem__, torch.tensor = getitem_wrapper, tensor_wrapper
    try:
        with _AtenSyncs(syncs, inside):
            yield syncs
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in saved_fns.items():
            setattr(torch, name, fn)
        torch.Tensor.__getitem__, torch.tensor = getitem, tensor
