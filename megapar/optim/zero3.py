"""ZeRO-3's optimizer: AdamW (or LAMB, LARS, SGD, Muon) stepping only this rank's shards.

The parameters are sharded by `ShardedParams` (`megapar.data_parallel.sharded_params`): per
unit, rank r of the dp (x cp) group holds slice r of the unit's flat fp32 parameters and of its
dp-averaged gradient. This optimizer's *pieces* are the parts of parameters inside those
slices (views into `Unit.shard`, with views into `Unit.grad_shard` as ``.grad``), exactly as
ZeRO-1's pieces are the parts inside its buffer slices, so clipping, the non-finite check,
LAMB / LARS's whole-parameter norms and the canonical checkpoint (`state_tensors`, gathered a
unit and a state key at a time to rank 0 of the unit's group: dp rank 0 for the dense units,
expert-data-parallel rank 0 for the experts' units under expert parallelism, as ZeRO-1's expert
buckets) are ZeRO-1's (`ZeroOptimizer`). What differs:
there is no all-gather after the step (each unit is gathered when it is next used), and under
sequence parallelism the replicated parameters' partial gradients are summed over tp on the
pieces (`ZeroOptimizer.sum_partial_over_tp`), after the reduce-scatter.

With offload (``--offload-optimizer``) the pieces are stepped on the host (`HostStep`); when
`ShardedParams` holds the shards on the host (``--offload-params``) the host step's masters are
views into those host shards, and the pieces (views into the freed device staging shard) only
carry the device gradients.

Per rank between steps, in fp32 with Adam: 4 bytes of parameter shard + 4 of gradient shard +
8 of moments per element of the stage's padded units, over g = dp (x cp): 16 / g bytes per
parameter.
"""

from __future__ import annotations

import torch

from megapar.data_parallel.buckets import slice_pieces
from megapar.optim.zero import ZeroOptimizer


class Zero3Optimizer(ZeroOptimizer):
    """The optimizer over `ShardedParams`' shards; `attach(sharded_params, ...)` (done by
    `TrainStep`) before the first step when dp x cp > 1. With a group of 1 it is the plain
    optimizer."""

    zero = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.zero = 3  # ZeroOptimizer.__init__ sets its stage (1) on the instance

    @torch.no_grad()
    def attach(self, grad_sync, last=(), before_reduce=None) -> None:
        """Take this rank's pieces of `grad_sync`'s units (a `ShardedParams` over the same
        parameters); `last` / `before_reduce`: the tied-embedding sync (`ShardedParams.defer`)."""
        if self.dp == 1 or self.sharded:
            return
        self._check_sync(grad_sync)
        grad_sync.defer(last, before_reduce)
        self.grad_sync, self.sharded = grad_sync, True
        first = grad_sync.units[0].shard
        self.param_buffers = {first.dtype: first}  # where the state lives (its device)
        offloaded = grad_sync.units[0].host_shard is not None
        if offloaded and not self.offload:
            raise ValueError(
                "ShardedParams keeps the parameter shards on the host "
                "(offload): the optimizer must step there too (offload=True)"
            )
        host_masters: dict[int, torch.Tensor] = {}
        self.host_masters = host_masters if offloaded else None
        for u in grad_sync.units:
            if offloaded:  # views of the staging shard need its storage while they are made
                u.shard.untyped_storage().resize_(u.shard_nbytes)
            offset = 0
            for p in u.params:
                self._offset[id(p)] = offset
                offset += p.numel()
            for i, start, end in slice_pieces([p.numel() for p in u.params], u.lo, u.hi):
                p = u.params[i]
                at = self._offset[id(p)] - u.lo
                piece = u.shard[at + start : at + end]
                piece.grad = u.grad_shard[at + start : at + end]
                if offloaded:  # the weights live in the host shard: the host step's masters
                    host_masters[id(piece)] = u.host_shard[at + start : at + end]
                self.pieces.append(piece)
                self._piece_of.append((p, start, end))
            if offloaded:
                u.shard.untyped_storage().resize_(0)
        self._build_inner()
        if self._pending is not None:
            self.load_state_tensors(self._pending)
            self._pending = None

    def _after_step(self) -> None:
        """Nothing to gather: each unit is gathered from the shards at its next use."""
