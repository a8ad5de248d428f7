"""Count the collectives a block of code issues, by wrapping torch.distributed's functions.

`with count_collectives() as calls:` records one `Call` per collective or point-to-point call
made through `torch.distributed` (every megapar module calls `dist.<op>` at call time, so the
wrapper sees them all): the op, the payload's element count, bytes, dtype and device, and the
size of the group it ran over. Point-to-point messages are counted one `Call` each ("isend" /
"irecv") where they are issued, in `dist.batch_isend_irecv` (which checks that its ops are
torch's own isend / irecv, so those two are not wrapped).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

# op -> (positional index, keyword) of the tensor whose size is the payload
_PAYLOAD = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"),
            "send": (0, "tensor"), "recv": (0, "tensor"),
            "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
            "reduce_scatter_tensor": (1, "input"), "gather": (0, "tensor"),
            "all_gather_single": (1, "input_tensor"), "reduce_scatter_single": (1, "input"),
            "reduce_scatter": (0, "output"), "all_to_all_single": (1, "input")}


@dataclass(frozen=True)
class Call:
    op: str
    numel: int
    bytes: int
    dtype: torch.dtype
    device: torch.device
    group_size: int


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


@contextlib.contextmanager
def count_collectives(device: torch.device | None = None):
    """Record every call; with `device`, a payload on another device raises at once."""
    calls: list[Call] = []
    originals = {op: getattr(dist, op) for op in _PAYLOAD}

    def wrap(op, fn):
        index, key = _PAYLOAD[op]

        def wrapper(*args, **kwargs):
            t = kwargs[key] if key in kwargs else args[index]
            if device is not None and t.device != device:
                raise AssertionError(f"dist.{op} called with a tensor on {t.device}; the mesh "
                                     f"device is {device}")
            calls.append(Call(op, t.numel(), t.numel() * t.element_size(), t.dtype, t.device,
                              _group_size(kwargs.get("group"))))
            return fn(*args, **kwargs)
        return wrapper

    batch = dist.batch_isend_irecv

    def batch_wrapper(ops):
        for p2p in ops:
            t = p2p.tensor
            if device is not None and t.device != device:
                raise AssertionError(f"a p2p message on {t.device}; the mesh device is {device}")
            calls.append(Call("isend" if p2p.op is dist.isend else "irecv", t.numel(),
                              t.numel() * t.element_size(), t.dtype, t.device,
                              _group_size(p2p.group)))
        return batch(ops)

    for op, fn in originals.items():
        setattr(dist, op, wrap(op, fn))
    dist.batch_isend_irecv = batch_wrapper
    try:
        yield calls
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
        dist.batch_isend_irecv = batch


def summary(calls: list[Call]) -> Counter:
    """How many calls of each (op, numel, group size)."""
    return Counter((c.op, c.numel, c.group_size) for c in calls)
