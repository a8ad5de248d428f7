"""Layer-wise trust-ratio optimizers for large batches: LAMB and LARS, correct under tp and ZeRO.

Both scale each parameter's update by a *trust ratio* built from norms of the whole parameter
(one "layer" = one parameter tensor):

- LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2, with Adam's
  bias correction): u = m_hat / (sqrt(v_hat) + eps) + wd * w, then
  w -= lr * r * u with r = ||w|| / ||u|| (1 when either norm is 0).
- LARS (You et al. 2017, "Large Batch Training of Convolutional Networks"):
  local_lr = eta * ||w|| / (||g|| + wd * ||w||) (1 when either norm is 0),
  v = mu * v + lr * local_lr * (g + wd * w), w -= v.

Under tensor parallelism a rank holds a shard of a parameter, so the norms are reduced over the
tp group: the squared norms of a tp-sharded parameter's shards are summed (padding rows of a
vocab-parallel tensor are zero and add nothing); a replicated parameter (tp_dim None) is whole
on every tp rank and is not summed. All of a rank's parameters share one all-reduce per step.
Under expert parallelism an expert parameter (the stacked [E, ...] experts of a MoE layer) is
split over the ep group by its experts, so its norms are summed over `ep_group` likewise (the
ratio is the one process's, of the whole stacked tensor; one more all-reduce, experts' rows).
Under ZeRO-1/2/3 (`zero.py`) a rank steps *pieces* of parameters; the optimizer sets `norms`
to a function that sums the pieces' squares per parameter over dp (and tp) instead. The squares
are summed in fp64 (`clip.squares_each`) and the norms rounded to fp32, so a ratio does not
depend on how ZeRO's buckets slice its parameter. Under
pp every parameter lives on one stage (the tied LM-head copy gets the same gradient and so the
same ratio as the embedding), so nothing crosses pp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar.expert_parallel import is_expert
from megapar.mesh import group_size
from megapar.optim.clip import squares_each


def full_norms(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], params: list, tp_group, ep_group=None
) -> list[tuple[float, float]]:
    """(||a||, ||b||) of the full tensors for each (a, b) shard pair (collective over tp_group,
    and over ep_group for expert parameters: every rank of a group must pass the same
    parameters in the same order)."""
    if not pairs:
        return []
    sq = squares_each([x for pair in pairs for x in pair]).view(-1, 2)
    sq = sum_where(sq, [getattr(p, "tp_dim", None) is not None for p in params], tp_group)
    sq = sum_where(sq, [is_expert(p) for p in params], ep_group)
    return [(float(a), float(b)) for a, b in sq.sqrt().float().tolist()]


def sum_where(sq: torch.Tensor, rows: list[bool], group) -> torch.Tensor:
    """`sq` with the marked rows summed over `group` (all-reduced when one is marked and the
    group has more than one rank; the marks are the same on every rank of the group)."""
    if group_size(group) == 1 or not any(rows):
        return sq
    marked = torch.tensor(rows, device=sq.device).unsqueeze(1)
    summed = torch.where(marked, sq, torch.zeros_like(sq))
    dist.all_reduce(summed, group=group)
    return torch.where(marked, summed, sq)


def _ratio(num: float, den: float) -> float:
    return num / den if num > 0 and den > 0 else 1.0


class LAMB(torch.optim.Optimizer):
    """LAMB over (shards of) parameters; `tp_group` reduces the norms of tp-sharded ones,
    `ep_group` (expert parallelism's) those of expert parameters."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        tp_group=None,
        ep_group=None,
    ):
        super().__init__(
            params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        )
        self.tp_group, self.ep_group = tp_group, ep_group
        self.norms = None
        """Optional (pairs, params) -> full norms, replacing `full_norms` (ZeRO's pieces)."""

    def _norms(self, pairs, params):
        if self.norms is not None:
            return self.norms(pairs, params)
        return full_norms(pairs, params, self.tp_group, self.ep_group)

    @torch.no_grad()
    def step(self, closure=None):
        updates, params, pairs = [], [], []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    u.add_(p, alpha=group["weight_decay"])
                updates.append((p, u, group["lr"]))
                params.append(p)
                pairs.append((p, u))
        for (p, u, lr), (w_norm, u_norm) in zip(updates, self._norms(pairs, params)):
            p.add_(u, alpha=-lr * _ratio(w_norm, u_norm))


class LARS(torch.optim.Optimizer):
    """LARS (momentum SGD with a layer-wise learning rate); `trust_coefficient` is eta."""

    def __init__(
        self,
        params,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 1e-3,
        tp_group=None,
        ep_group=None,
    ):
        super().__init__(
            params,
            {
                "lr": lr,
                "momentum": momentum,
                "weight_decay": weight_decay,
                "trust_coefficient": trust_coefficient,
            },
        )
        self.tp_group, self.ep_group = tp_group, ep_group
        self.norms = None
        """Optional (pairs, params) -> full norms, replacing `full_norms` (ZeRO's pieces)."""

    _norms = LAMB._norms

    @torch.no_grad()
    def step(self, closure=None):
        entries, params, pairs = [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    entries.append((p, group))
                    params.append(p)
                    pairs.append((p, p.grad))
        for (p, group), (w_norm, g_norm) in zip(entries, self._norms(pairs, params)):
            wd = group["weight_decay"]
            local_lr = (
                group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm)
                if w_norm > 0 and g_norm > 0
                else 1.0
            )
            d = p.grad.add(p, alpha=wd) if wd else p.grad.clone()
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.zeros_like(p)
            buf.mul_(group["momentum"]).add_(d, alpha=group["lr"] * local_lr)
            p.sub_(buf)
