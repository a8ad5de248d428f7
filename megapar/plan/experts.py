"""What a mixture-of-experts layer adds to a plan: its routed tokens' activations and, under
expert parallelism, the all-to-all bytes of its token exchange.

A MoE layer routes each of the T tokens a rank holds (a micro-batch's s b, / cp, / t under
sequence parallelism: the routed experts are replicated over tp, so without SP every tp rank
routes all of them) to k experts: T k rows. With each expert split over tp (etp = tp) every
tp rank runs all s b / cp tokens' rows through its I / t units of each expert, under SP too
(the tp group all-gathers its routed tokens: `routing_split`).

**All-to-all bytes** (`alltoall_bytes`, per MoE layer and micro-batch, what one rank puts into
`dist.all_to_all_single`, whose payload counts every row, the ones it keeps for itself too, as
`megapar.comm_count` counts it): the count exchange (E int64 counts), the dispatch (the T k
rows, h wide, in the compute dtype: fp32, or under bf16 / fp16 autocast the 16-bit dtype the
experts' linears read, `tensor_parallel.mappings.to_wire_dtype`), the combine (the rows it received
back, T k under uniform routing, in the experts' output dtype: the compute dtype), and in the
backward the same two exchanges of the gradients (the combine's
gradient out, T k rows; the dispatch's back, the received ones). Full recomputation repeats the
forward's two row exchanges (the recompute reuses its route: no second count exchange). Over an
ep group the received rows sum to the sent ones, so the group's total is exact whatever the
routing; one rank's is exact under uniform routing. Of a rank's rows, (ep - 1) / ep leave it
under uniform routing: what the time model prices (`leaving`).

**Activations** (`routed_bytes`, per MoE layer and micro-batch, kept for the backward): per
routed row, the expert's input and its SwiGLU's gate / up output, activation and product
(h + 4 I elements) on the rank that holds the expert, and two h-wide rows on the rank that
routed it (the combined output kept for the weighting, and the gathered input); per token the
router's fp32 logits and scores (2 E x 4 bytes), its top-k weights and ids (k x 12 bytes) and 8
bytes more (per token it scores: T / t with experts split over tp under SP), per row its int64
sort index and token index and fp32 weight (20 bytes); `tests/test_plan.py` holds it
against a Mixtral block's saved tensors at ep 1. The expert side is
scaled by the imbalance: the busiest rank receives `imbalance` x the mean rows (dropless
routing has no bound; with a capacity factor c no expert keeps more than c x its mean share,
so c bounds it). `Problem.moe_imbalance` (megapar-plan's --moe-imbalance) states the
assumption (default `DEFAULT_IMBALANCE`, or the model's capacity factor when it has one).

**Expert tensor parallelism** (`expert_tp_collectives`, per MoE layer and micro-batch, the
tp collectives of `megapar.models.moe` with each expert split over tp, as `comm_count`
records them: an all-reduce's tensor, an all-gather's input, a reduce-scatter's input; the
tokens and the output in the activations' dtype, the weights and choices in fp32).
Without sequence parallelism, T tokens on every tp rank: forward one all-reduce of the
weighted output (T h), backward one of the combine weights' gradient (T k fp32) and one of
the tokens' (T h). Under it, T / t tokens a rank: forward an all-gather of the weights and
chosen experts (T / t x 2k fp32, + T / t with padding) and of the tokens (T / t x h), a
reduce-scatter of the output (T h); backward the output gradient's all-gather (T / t x h)
and the reduce-scatters of the tokens' gradient (T h) and of the weights' (T x 2k).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IMBALANCE = 1.25
"""The busiest ep rank's received rows over the mean, assumed by default under dropless routing
(megapar logs each step's per-expert max / mean as `moe_imbalance`; a rank's, over E / ep
experts, is lower). A model with a capacity factor uses that factor instead."""

COUNT_BYTES = 8
"""One expert's row count in the count exchange (int64)."""


def is_moe(config) -> bool:
    """Whether `config` has mixture-of-experts layers."""
    return bool(getattr(config, "num_moe_layers", 0))


def moe_layers(config, layers) -> int:
    """How many of `layers` (indices) are MoE layers."""
    moe = getattr(config, "is_moe_layer", None)
    return sum(1 for i in layers if moe and moe(i)) if is_moe(config) else 0


def layer_kinds(config) -> tuple[int, ...]:
    """Per layer, 1 for a MoE layer and 0 for a dense one (`moe_layers` of each alone)."""
    return tuple(moe_layers(config, (i,)) for i in range(config.num_layers))


def imbalance_of(config, stated: float | None) -> float:
    """The imbalance a plan assumes: `stated`, else the model's capacity factor (the most an
    expert keeps, relative to its mean share), else `DEFAULT_IMBALANCE`."""
    if stated is not None:
        return stated
    return getattr(config, "moe_capacity_factor", None) or DEFAULT_IMBALANCE


def routing_split(c) -> int:
    """How many ways the tokens a rank's experts see are split over tp for `Candidate` `c`: tp
    under sequence parallelism with whole experts; 1 without it, and with experts split over tp
    (whose tp ranks all-gather the sequence's routed tokens)."""
    return c.tp if c.sp and getattr(c, "etp", 1) == 1 else 1


def routed_tokens(seq_len: int, mbs: int, cp: int = 1, sp_t: int = 1) -> int:
    """T: the tokens one rank routes per micro-batch (its cp share; its tp slice under SP)."""
    return seq_len // cp * mbs // sp_t


@dataclass(frozen=True)
class AllToAll:
    """One rank's all-to-all payload bytes of one MoE layer and micro-batch."""

    counts: int
    """The count exchange (forward only)."""
    forward: int
    """The dispatch and the combine."""
    backward: int
    """Their gradients' exchanges."""
    recompute: int = 0
    """Full recomputation's repeated dispatch and combine."""

    @property
    def total(self) -> int:
        return self.counts + self.forward + self.backward + self.recompute


def alltoall_bytes(
    config, tokens: int, ep: int, row_bytes: int = 4, recompute: str = "none"
) -> AllToAll:
    """One rank's all-to-all payloads of one MoE layer and micro-batch under ep (none at ep 1):
    `tokens` routed (`routed_tokens`), rows of `row_bytes` elements (the compute dtype's: 2
    under bf16 / fp16, 4 under fp32) out and back, the same sizes for their gradients; the
    received rows taken as sent (uniform routing; exact for an ep group's sum)."""
    if ep == 1:
        return AllToAll(0, 0, 0)
    rows = tokens * config.num_experts_per_tok * config.hidden_size
    row_pair = 2 * rows * row_bytes
    return AllToAll(
        config.num_local_experts * COUNT_BYTES,
        row_pair,
        row_pair,
        row_pair if recompute == "full" else 0,
    )


def leaving(ep: int) -> float:
    """The share of a rank's all-to-all rows that leave it under uniform routing."""
    return (ep - 1) / ep


def routed_bytes(
    config,
    tokens: int,
    act_bytes: int,
    imbalance: float = 1.0,
    ep: int = 1,
    etp: int = 1,
    router_tokens: int | None = None,
) -> float:
    """Bytes one MoE layer keeps for its routed tokens per micro-batch on the busiest rank (see
    the module docstring); `imbalance` scales the rows its experts receive (at ep 1 a rank
    holds every expert and receives exactly its T k rows); with each expert split over `etp`
    ranks a row's SwiGLU terms are its I / etp units'. `router_tokens`: the tokens this rank's
    router scores, where they are fewer than `tokens` (with experts split over tp under SP the
    router scores this rank's T / t and the tp group all-gathers its choices)."""
    h, k, e = config.hidden_size, config.num_experts_per_tok, config.num_local_experts
    rows = tokens * k
    received = rows * (imbalance if ep > 1 else 1.0)
    expert_side = received * (h + 4 * config.expert_size // etp) * act_bytes
    scored = tokens if router_tokens is None else router_tokens
    token_side = rows * 2 * h * act_bytes + rows * 20 + scored * (2 * e * 4 + k * 12 + 8)
    return expert_side + token_side


def step_alltoall(p, c, moe_layers_on_rank: int) -> int:
    """One rank's all-to-all payload bytes per step of a `Problem` planned as `Candidate` `c`,
    for the MoE layers its pipeline rank holds: `alltoall_bytes` (rows in the activations'
    dtype, both ways) x the layers x the micro-batches of its dp rank."""
    tokens = routed_tokens(p.seq_len, c.mbs, c.cp, routing_split(c))
    m = p.global_batch // (c.mbs * c.dp)
    one = alltoall_bytes(p.config, tokens, c.ep, p.act_bytes, c.recompute)
    return one.total * moe_layers_on_rank * m


def expert_tp_collectives(
    config, tokens: int, tp: int, sp: bool, padded: bool = False
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) [(op, elements)] of one MoE layer's tp collectives for a
    micro-batch with its experts split over `tp` (module docstring): `tokens` the micro-batch's
    tokens on a tp rank without sequence parallelism, the whole group's with it (`sp`);
    `padded`: a mask rides with the weights. The tokens and the output in the activations'
    dtype (under autocast cast to it, `tensor_parallel.mappings.to_wire_dtype`); the [T, 2k]
    weights and choices in fp32."""
    if tp == 1:
        return [], []
    h, k = config.hidden_size, config.num_experts_per_tok
    if not sp:
        return [("all_reduce", tokens * h)], [
            ("all_reduce", tokens * k),
            ("all_reduce", tokens * h),
        ]
    mine, picks = tokens // tp, 2 * k + (1 if padded else 0)
    forward = [
        ("all_gather_into_tensor", mine * picks),
        ("all_gather_into_tensor", mine * h),
        ("reduce_scatter_tensor", tokens * h),
    ]
    backward = [
        ("all_gather_into_tensor", mine * h),
        ("reduce_scatter_tensor", tokens * h),
        ("reduce_scatter_tensor", tokens * picks),
    ]
    return forward, backward
