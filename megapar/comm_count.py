"""Count the collectives a block of code issues, by wrapping torch.distributed's functions.

`with count_collectives() as calls:` records one `Call` per collective or point-to-point call
made through `torch.distributed` (every megapar module calls `dist.<op>` at call time, so the
wrapper sees them all; point-to-point messages grouped by `dist.batch_isend_irecv` are recorded
one per message): the op, the payload's element count, bytes, dtype and device, the size of the
group it ran over and its ranks. The tests count a step's traffic with it, and the dry
run (`megapar.dryrun`) counts what each rank of a large job would send.

Code whose collectives serve one purpose that their group does not tell (Muon's exchanges over
dp and tp, `megapar.optim.muon`) issues them inside `issued_for(purpose)`: its calls are
recorded with that `Call.purpose`, which the dry run reports them under.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# op -> (positional index, keyword) of the tensor whose size is the payload
_PAYLOAD = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "isend": (0, "tensor"),
    "irecv": (0, "tensor"),
    "send": (0, "tensor"),
    "recv": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "gather": (0, "tensor"),
    "scatter": (0, "tensor"),
    "all_gather_single": (1, "input_tensor"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter": (0, "output"),
    "all_to_all_single": (1, "input"),
}


CANONICAL = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}
"""Ops recorded under one name whichever form torch has: megapar calls torch 2.13's
`*_single` where they exist and the `*_tensor` forms of older versions otherwise."""


@dataclass(frozen=True)
class Call:
    op: str
    numel: int
    bytes: int
    dtype: torch.dtype
    device: torch.device
    group_size: int
    ranks: tuple[int, ...] | None = field(default=None, compare=False)
    """Global ranks of the group it ran over (None: the default group, every rank)."""
    purpose: str = field(default="", compare=False)
    """What issued it, where `issued_for` said so ("muon": Muon's exchanges); "" otherwise."""


_PURPOSE: contextvars.ContextVar[str] = contextvars.ContextVar("purpose", default="")


@contextlib.contextmanager
def issued_for(purpose: str):
    """The collectives issued inside are recorded with `purpose` (`Call.purpose`) by any
    `count_collectives` around them; outside one it changes nothing."""
    token = _PURPOSE.set(purpose)
    try:
        yield
    finally:
        _PURPOSE.reset(token)


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


@contextlib.contextmanager
def count_collectives(device: torch.device | None = None):
    """Record every call; with `device`, a payload on another device raises at once."""
    calls: list[Call] = []
    originals = {op: getattr(dist, op) for op in _PAYLOAD if hasattr(dist, op)}
    batching = [False]  # inside batch_isend_irecv: its messages are recorded there

    def record(op: str, t: torch.Tensor, group) -> None:
        if device is not None and t.device != device:
            raise AssertionError(
                f"dist.{op} called with a tensor on {t.device}; the mesh device is {device}"
            )
        calls.append(
            Call(
                CANONICAL.get(op, op),
                t.numel(),
                t.numel() * t.element_size(),
                t.dtype,
                t.device,
                _group_size(group),
                None if group is None else tuple(dist.get_process_group_ranks(group)),
                _PURPOSE.get(),
            )
        )

    def wrap(op, fn):
        index, key = _PAYLOAD[op]

        def wrapper(*args, **kwargs):
            if not batching[0]:
                record(op, kwargs[key] if key in kwargs else args[index], kwargs.get("group"))
            return fn(*args, **kwargs)

        wrapper.__name__ = op
        return wrapper

    batch = dist.batch_isend_irecv

    def batch_wrapper(ops):
        for p in ops:
            record(getattr(p.op, "__name__", "p2p"), p.tensor, p.group)
        batching[0] = True
        try:
            return batch(ops)
        finally:
            batching[0] = False

    # `dist.P2POp(dist.isend, ...)` accepts only c10d's own isend / irecv: they are wrapped
    # there too, so ops built while counting pass its check
    p2p = {op: getattr(c10d, op) for op in ("isend", "irecv")}
    for op, fn in originals.items():
        setattr(dist, op, wrap(op, fn))
        if op in p2p:
            setattr(c10d, op, getattr(dist, op))
    dist.batch_isend_irecv = batch_wrapper
    try:
        yield calls
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
        for op, fn in p2p.items():
            setattr(c10d, op, fn)
        dist.batch_isend_irecv = batch


def summary(calls: list[Call]) -> Counter:
    """How many calls of each (op, numel, group size)."""
    return Counter((c.op, c.numel, c.group_size) for c in calls)
