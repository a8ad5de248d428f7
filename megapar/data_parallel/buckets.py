"""Bucketed, overlapped gradient averaging over the data-parallel group.

`GradBuckets` implements the executor's grad-sync protocol:

- ``begin_step()``: before the schedule; hooks are inactive, so gradient accumulation over the
  first m - 1 micro-batches communicates nothing.
- ``before_last_backward()``: right before this stage's last backward; arms the hooks.
- during that backward, ``register_post_accumulate_grad_hook`` tells us when each parameter's
  gradient is final. When every gradient of a bucket is final, the bucket is packed into one
  flat tensor, divided by dp and all-reduced asynchronously, overlapping with the rest of the
  backward.
- ``finish()``: launches the buckets that never became ready (parameters unused on this stage),
  waits for every all-reduce and copies the averages back into ``param.grad``.

Buckets are launched strictly in bucket order (a ready bucket waits for the ones before it), so
every dp rank issues the same all-reduces in the same order whatever order hooks fire in.
Parameters are bucketed in reverse registration order, which is roughly the order their
gradients become final in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from megapar.mesh import group_size


@dataclass
class Bucket:
    """A group of parameters whose gradients are averaged in one all-reduce."""

    params: list[torch.nn.Parameter]
    """Parameters of the bucket, in the order they are packed."""
    ready: set[int] = field(default_factory=set)
    """ids of the parameters whose gradient is final in the current step."""
    flat: torch.Tensor | None = None
    """The packed gradients while an all-reduce is in flight."""
    handle: object | None = None
    """The async work handle of the in-flight all-reduce."""

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def make_buckets(params: list[torch.nn.Parameter], bucket_mb: float) -> list[Bucket]:
    """Parameters in reverse order, cut into buckets of at most bucket_mb MB (a larger single
    parameter gets a bucket of its own); a bucket never mixes dtypes."""
    limit = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (p.dtype != current[0].dtype or size + nbytes > limit):
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(current))
    return buckets


class GradBuckets:
    """Average gradients over `dp_group` in ~`bucket_mb` MB buckets, overlapped with backward.

    With a dp group of size 1 (or None) every method is a no-op.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], dp_group, bucket_mb: float = 25.0,
                 compressor=None):
        if bucket_mb <= 0:
            raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb}")
        self.group = dp_group
        self.dp = group_size(dp_group)
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[Bucket] = []
        self.active = self.in_step = False
        self.next_launch = 0
        self._handles = []
        self.compressor = compressor
        """A `compression.py` compressor (synchronous reduction), or None (async all-reduce)."""
        self.bytes_sent = 0
        """Bytes this rank has put into dp reductions (all steps; payloads of the collectives)."""
        if self.dp == 1:
            return
        self.buckets = make_buckets(self.params, bucket_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # protocol ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a step: disarm the hooks and forget the previous step's buckets."""
        for b in self.buckets:
            if b.handle is not None:
                raise RuntimeError("GradBuckets.begin_step() called while a previous step's "
                                   "all-reduce is still in flight; call finish() first")
            b.ready.clear()
        self.next_launch = 0
        self.active = False
        self.in_step = True

    def before_last_backward(self) -> None:
        """Arm the hooks: gradients become final during the next backward."""
        self.active = self.dp > 1

    def finish(self) -> None:
        """Launch any bucket not launched yet, wait for all, write the averages to param.grad."""
        if self.dp == 1:
            return
        if not self.in_step:
            raise RuntimeError("GradBuckets.finish() without begin_step(): call begin_step() "
                               "before each step's first backward (the executor does)")
        self.active = self.in_step = False
        for b in self.buckets:
            b.ready.update(id(p) for p in b.params)
        self._launch_ready()
        for b in self.buckets:
            b.handle.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(b.flat[offset:offset + n].view_as(p.grad))
                offset += n
            b.flat, b.handle = None, None

    def remove_hooks(self) -> None:
        """Detach from the parameters (the object is unusable afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # internals --------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self.active:
            return
        self._bucket_of[id(param)].ready.add(id(param))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self.next_launch += 1

    def _launch(self, b: Bucket) -> None:
        # A parameter without a gradient (unused on this stage) is packed as zeros; its grad
        # stays None afterwards. Unused parameters are the same on every dp rank (same stage).
        parts = [(p.grad.detach() if p.grad is not None
                  else torch.zeros_like(p, memory_format=torch.contiguous_format)).reshape(-1)
                 for p in b.params]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        flat.div_(self.dp)
        b.flat = flat
        if self.compressor is not None:
            self.bytes_sent += self.compressor.reduce(flat, b.params, self.group)
            b.handle = _Done()
            return
        self.bytes_sent += flat.numel() * flat.element_size()
        b.handle = dist.all_reduce(flat, group=self.group, async_op=True)


class _Done:
    """The handle of a reduction that has already completed."""

    def wait(self) -> bool:
        return True
