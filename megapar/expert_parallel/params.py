"""Which parameters are experts' and which experts an ep rank holds.

An expert parameter (a routed expert's weights, stacked [local experts, ...]) is marked with the
attribute ``expert = True`` (`mark_expert`): its gradient sums the tokens every rank of its ep
group routed to these experts, so it is reduced over the ranks that hold the same experts
(`Mesh.expert_dp_group`) instead of the data-parallel group (`build_grad_sync`). An attribute
rather than a name rule: it travels with the tensor whatever module holds it, the way
tensor-parallel attributes do, and a model marks its experts where it builds them.
"""

from __future__ import annotations

import torch


def mark_expert(*params: torch.nn.Parameter, ep: int = 1, ep_rank: int = 0) -> None:
    """Mark these parameters as experts' (sharded over ep; reduced over expert dp). Under
    ep > 1 each holds block `ep_rank` of `ep` of its dim 0 (its local experts of the stacked
    [E, ...] tensor): ``param.ep_shard = (ep_rank, ep)``, which the layout-independent init
    reads to keep this rank's experts of the seeded whole tensor."""
    for p in params:
        p.expert = True  # type: ignore[attr-defined]
        p.ep_shard = (ep_rank, ep)  # type: ignore[attr-defined]


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` was marked by `mark_expert`."""
    return bool(getattr(param, "expert", False))


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global ids of the experts ep rank `ep_rank` holds: a contiguous block of
    num_experts / ep (ep must divide num_experts)."""
    if num_experts % ep:
        raise ValueError(
            f"{num_experts} experts cannot be split over --ep {ep}: choose an --ep that "
            f"divides the number of experts"
        )
    n = num_experts // ep
    return range(ep_rank * n, (ep_rank + 1) * n)
