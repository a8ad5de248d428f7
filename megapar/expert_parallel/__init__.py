"""Expert parallelism: tokens dispatched to the ep rank holding their experts and combined back
(all-to-all of variable splits), and which parameters are experts' (reduced over the
expert-data-parallel group instead of dp)."""

from megapar.expert_parallel.dispatch import Route, combine, dispatch, plan_route
from megapar.expert_parallel.params import is_expert, local_experts, mark_expert

__all__ = [
    "Route",
    "combine",
    "dispatch",
    "is_expert",
    "local_experts",
    "mark_expert",
    "plan_route",
]
