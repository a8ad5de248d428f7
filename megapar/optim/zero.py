"""ZeRO stage 1: AdamW state sharded over the data-parallel group.

Scheme: whole parameters are dealt to dp ranks, largest first, each to the rank holding the
fewest elements so far (deterministic, so every dp rank computes the same assignment). A rank
keeps Adam state only for the parameters it owns and steps only those; then each rank broadcasts
its updated parameters, packed into one flat tensor, to the rest of the dp group.

Gradients are still averaged in full on every rank (ZeRO-1 does not shard them), so clipping and
the inf check see the whole gradient, and each owned parameter gets exactly the update the
unsharded optimizer would give it.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megapar.mesh import group_size
from megapar.optim.optimizer import AdamWOptimizer


def assign_owners(sizes: list[int], dp: int) -> list[int]:
    """Owner dp rank of each parameter (by element count): greedy, largest first."""
    load = [0] * dp
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners


class ZeroOptimizer(AdamWOptimizer):
    """AdamW whose state is split over `dp_group`; same updates as the unsharded optimizer."""

    zero = 1

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], dp_group, lr: float,
                 weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, kind: str = "adamw", tp_group=None):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.group = dp_group
        self.dp = group_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group) if self.dp > 1 else 0
        self.owners = assign_owners([p.numel() for _, p in named], self.dp)
        self._owned = [p for (_, p), r in zip(named, self.owners) if r == self.dp_rank]
        super().__init__(named, lr, weight_decay, betas, eps, kind, tp_group)

    def owned_params(self) -> list[nn.Parameter]:
        return self._owned

    def _params_of(self, r: int) -> list[nn.Parameter]:
        return [p for p, owner in zip(self.params, self.owners) if owner == r]

    def _broadcast_from_owners(self, pieces_of) -> None:
        """For each dp rank r: pack pieces_of(r)'s tensors on r, broadcast, unpack everywhere."""
        for r in range(self.dp):
            targets = pieces_of(r)
            if not targets:
                continue
            if r == self.dp_rank:
                flat = torch.cat([t.detach().reshape(-1) for t in targets])
            else:
                flat = torch.empty(sum(t.numel() for t in targets), dtype=targets[0].dtype,
                                   device=targets[0].device)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, r), group=self.group)
            if r != self.dp_rank:
                offset = 0
                for t in targets:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    @torch.no_grad()
    def _after_step(self) -> None:
        if self.dp > 1:
            self._broadcast_from_owners(self._params_of)

    @torch.no_grad()
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's state, gathered from its owner (collective over the dp group)."""
        keys = self.state_keys
        full = {id(p): {k: self._local_state(p, k) for k in keys} for p in self.params}
        if self.dp > 1:
            self._broadcast_from_owners(
                lambda r: [full[id(p)][k] for p in self._params_of(r) for k in keys])
        return {n: full[id(p)] for n, p in self._checkpointed()}
