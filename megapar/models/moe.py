"""Mixture-of-experts MLP: a top-k router, routed SwiGLU experts run over tokens sorted by expert,
optional shared experts, and the balancing terms (switch-style auxiliary loss, router z-loss,
DeepSeek-V3's auxiliary-loss-free bias).

One `MoE` layer, on the tokens x [T, H] of a micro-batch:

1. `Router`: logits = x W^T (W [E, H]); scores = softmax (Mixtral, Qwen3-MoE) or sigmoid
   (DeepSeek-V3) of the logits in fp32; the k experts with the highest score (+ the balancing
   bias, which only chooses, never weighs); their scores are the combine weights, renormalised to
   sum to 1 when the config says so.
2. `route`: the T x k assignments sorted by expert (stable: token order within an expert), the
   tokens per expert as a device tensor. With a capacity factor an expert keeps at most
   ceil(factor * T * k / E) of its assignments (first come, first kept) and the rest are dropped:
   sorted after every expert's, their output zero, counted. Dropless (no factor) by default.
   Padding (the zeros of a right-padded batch's ``attention_mask``, which the model hands each
   MoE layer as this rank's slice) is not routed: sorted last, output zero, no capacity taken
   (T counts the tokens that are not padding), and left out of the balancing terms and
   statistics, as transformers' attention_mask leaves it out of its load-balancing loss.
3. `GroupedExperts`: the experts' weights stacked [E, 2I, H] (gate and up) and [E, H, I] (down),
   transformers 5's layout, whose dim 0 ep shards (`mark_expert`). `forward(sorted tokens,
   tokens_per_expert)` is the one entry point a dispatch plugs into: on CUDA one
   `torch._grouped_mm` per projection (no host sync); elsewhere a loop over the experts, each a
   contiguous slice of the sorted tokens (never a loop over tokens), whose slice sizes are read
   to the host once: the one host sync of an MoE layer per micro-batch.
4. The weighted outputs are put back in token order and summed over the k choices, plus the
   shared experts' SwiGLU (DeepSeek style: every token, no gate).

The balancing penalty of a layer (coef x the switch loss + z coef x the z-loss, divided by the
number of MoE layers, so the coefficient means what transformers' `router_aux_loss_coef`
means) joins the backward through `_AttachPenalty` (as Megatron's MoEAuxLossAutoScaler): the
layer's output passes through unchanged and the penalty receives the gradient the training
step sets (`set_penalty_grad`: loss scale / micro-batches), so a penalty made on any pipeline
stage reaches the loss without travelling to the last one.

Tensor parallelism keeps the router replicated on every tp rank. The routed experts are whole
on every tp rank by default (`Mesh.etp` 1: each rank computes the same MoE output, no tp
collective; under sequence parallelism each rank routes its slice of the sequence through
them). With expert tensor parallelism (`Mesh.etp` = tp, Megatron's
--expert-tensor-parallel-size) each routed expert's weights are split over the tp group as a
dense MLP's are: `gate_up` by intermediate unit along dim 1 (each rank the gate and up rows of
the same I / tp units: ``tp_parts`` 2 of the one shard rule, `tensor_parallel.partition`),
`down` along dim 2 (row-parallel), and each rank's experts give partial sums of the routed
output, reduced over tp:

- without sequence parallelism every tp rank routes the same tokens; the tokens and the
  combine weights enter the region as `copy_to_tp_region` (their gradients all-reduced in
  backward: [T, H] and [T, k]) and the weighted output [T, H] is all-reduced;
- under sequence parallelism each rank routes its own tokens (the balancing terms as at
  `etp` 1); the tokens, and the combine weights with the chosen experts (one [T/tp, 2k]
  tensor), are all-gathered over tp, every rank runs all T tokens through its slice of the
  experts, and the weighted output is reduce-scattered back to the sequence slices (the
  gathers' backward reduce-scatters the partial gradients). With a capacity factor the
  capacity is then the whole micro-batch's, as one process's.

Expert parallelism composes with it: the ep groups are within one tp coordinate, so the tp
ranks of an ep rank exchange the same rows and each runs its slices of the same experts.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from megapar.expert_parallel import Route, combine, dispatch, local_experts, mark_expert, plan_route
from megapar.graph_break import graph_break
from megapar.mesh import Mesh, all_reduce
from megapar.models.blocks import activation
from megapar.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megapar.tensor_parallel.layers import divide
from megapar.tensor_parallel.mappings import (
    copy_to_tp_region,
    reduce_from_tp_region,
    to_wire_dtype,
)
from megapar.tensor_parallel.partition import set_partition
from megapar.tensor_parallel.sequence_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class Router(nn.Module):
    """Linear scores over E experts and the top-k choice (see the module docstring)."""

    def __init__(self, config, device) -> None:
        super().__init__()
        e, self.k = config.num_local_experts, config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, device=device))
        self.score = config.moe_router_score
        self.renormalize = config.renormalize_topk
        self.scale = config.routed_scale
        self.groups, self.topk_groups = config.expert_groups
        self.bias: torch.Tensor | None
        bias = torch.zeros(e, device=device) if config.router_bias else None
        self.register_buffer("bias", bias)
        """DeepSeek-V3's balancing bias (its e_score_correction_bias; None where the config
        has none, `router_bias`): added to the scores to choose, never to weigh;
        `update_bias` moves it after each step (`moe_bias_update_rate`). A buffer, not a
        parameter: no gradient, no optimizer, but checkpoints keep it (it decides the
        routing, so a resumed run needs it to continue exactly)."""

    def forward(self, x: torch.Tensor):
        """(logits [T, E] in x's dtype, probs [T, E] fp32 (the scores the switch loss
        averages), weights [T, k] fp32, experts [T, k])."""
        logits = F.linear(x, self.weight)
        if self.score == "softmax":
            scores = probs = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            probs = scores / scores.sum(-1, keepdim=True)
        if self.bias is None and self.groups == 1:
            weights, experts = torch.topk(scores, self.k, dim=-1)
        else:
            # the choice needs no gradient: nothing of it is kept for the backward
            choice = scores.detach() if self.bias is None else scores.detach() + self.bias
            if self.groups > 1:
                choice = self._in_chosen_groups(choice)
            experts = torch.topk(choice, self.k, dim=-1).indices
            weights = scores.gather(-1, experts)
        if self.renormalize:
            # DeepSeek-V3's sigmoid weights may all be tiny: transformers adds 1e-20
            eps = 1e-20 if self.score == "sigmoid" else 0.0
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        if self.scale != 1.0:
            weights = weights * self.scale
        return logits, probs, weights, experts

    def _in_chosen_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` [T, E] with the experts outside each token's `topk_groups` best groups at
        -inf (DeepSeek-V3's group-limited routing: a group's score is the sum of its two best
        experts'; the E experts form `groups` groups of consecutive ids)."""
        t, e = choice.shape
        grouped = choice.view(t, self.groups, e // self.groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        chosen = torch.topk(group_scores, self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0)
        return grouped.masked_fill(keep[:, :, None] == 0, float("-inf")).view(t, e)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """b_e += rate * sign(mean load - load_e): an overloaded expert is chosen less."""
        assert self.bias is not None
        self.bias += rate * torch.sign(load.mean() - load)


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `flat`'s expert ids are each of 0..num_experts-1 (bincount's answer with a
    shape known in advance: no host sync, and fake tensors can follow it)."""
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def route(experts: torch.Tensor, num_experts: int, capacity: int | torch.Tensor | None, keep=None):
    """Sort the T x k assignments `experts` [T, k] by expert. Returns (order [T*k]: the flat
    assignment index of each sorted row, tokens_per_expert [E] (kept ones), dropped (a device
    scalar)); dropped assignments, if any, are the last rows of `order`. `keep` [T] (bool, None:
    every token): the tokens routed; the others' assignments (padding) come after every kept
    one, take no capacity and count neither as kept nor as dropped."""
    flat = experts.reshape(-1)
    if keep is not None:  # padding sorted past every expert
        flat = torch.where(keep.repeat_interleave(experts.shape[1]), flat, num_experts)
    order = torch.argsort(flat, stable=True)
    every = expert_counts(flat, num_experts + 1)
    counts = every[:num_experts]
    if capacity is None:
        return order, counts, counts.new_zeros(())
    sorted_experts = flat[order]
    starts = torch.cumsum(every, 0) - every
    rank = torch.arange(flat.numel(), device=flat.device) - starts[sorted_experts]
    key = torch.where(rank < capacity, sorted_experts, num_experts)
    again = torch.argsort(key, stable=True)
    kept = expert_counts(key, num_experts + 1)[:num_experts]
    return order[again], kept, counts.sum() - kept.sum()


def host_counts(tokens_per_expert: torch.Tensor, rows: int) -> list[int]:
    """The tokens per expert on the host: the MoE layer's one host sync per micro-batch. Under
    the dry run's fake tensors (no values) the rows are taken as spread evenly."""
    if is_fake(tokens_per_expert):
        e = tokens_per_expert.shape[0]
        return [rows // e + (i < rows % e) for i in range(e)]
    return tokens_per_expert.tolist()


def grouped_dtype(x: torch.Tensor, size: int) -> torch.dtype | None:
    """bf16 where the experts of intermediate `size` run as grouped matmuls on `x` [N, H]:
    on CUDA, x in bf16 or bf16 autocast on (megapar's master weights stay fp32 and at ep 1 the
    rows reach the experts in fp32 under it; under ep in bf16, `to_wire_dtype`), rows of 16
    bytes; None elsewhere (the loop)."""
    autocast = torch.is_autocast_enabled("cuda") and x.is_cuda
    dtype = torch.get_autocast_dtype("cuda") if autocast else x.dtype
    aligned = x.shape[1] % 8 == 0 and size % 8 == 0  # 16-byte rows
    usable = x.is_cuda and aligned and hasattr(torch, "_grouped_mm")
    return torch.bfloat16 if usable and dtype == torch.bfloat16 else None


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: `gate_up` [E, 2I, H] (gate rows first, then up)
    and `down` [E, H, I] (transformers 5's `MixtralExperts` / `Qwen3MoeExperts` layout)."""

    def __init__(self, num_experts: int, hidden: int, size: int, act: str, device):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * size, hidden, device=device))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, size, device=device))
        self.act = activation(act)

    def forward(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, counts: list[int] | None = None
    ) -> torch.Tensor:
        """Rows of `x` [N, H] sorted by expert, `tokens_per_expert[e]` rows for expert e (the
        sum may be < N: the rows after it get zeros) -> outputs [N, H] in the same order.
        `counts`: the same counts already on the host (expert parallelism's route read them),
        so the loop over experts reads nothing more."""
        if grouped_dtype(x, self.down.shape[2]) is not None:
            return self._grouped(x, tokens_per_expert)
        if counts is None:
            counts = host_counts(tokens_per_expert, x.shape[0])
        # unbind, not gate_up[e]: each indexing's backward would write a whole [E, ...]
        # gradient of zeros (E per projection per step); unbind's stacks the slices once
        gate_ups, downs = self.gate_up.unbind(0), self.down.unbind(0)
        outs: list[torch.Tensor] = []
        for e, part in enumerate(x[: sum(counts)].split(counts)):
            # Without a row for any expert, the last one still runs on its empty slice: the
            # output stays in the graph of x and the weights (zero gradients), so an ep rank
            # that receives no row still issues its backward's all-to-alls and its experts'
            # gradient reductions, as every rank of its groups does.
            if part.shape[0] or (not outs and e == len(counts) - 1):
                gate, up = F.linear(part, gate_ups[e]).chunk(2, dim=-1)
                outs.append(F.linear(self.act(gate) * up, downs[e]))
        rest = x.shape[0] - sum(counts)
        if rest:
            outs.append(x.new_zeros(rest, x.shape[1]))
        return torch.cat(outs)

    def _grouped(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """One grouped matmul per projection; offsets stay on the device (no host sync). The
        kernel leaves the rows past the last group (a capacity's dropped rows) unwritten, in
        its output and in its input's gradient: both are masked."""
        dtype = grouped_dtype(x, self.down.shape[2]) or x.dtype  # bf16: autocast's or x's
        offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        kept = (torch.arange(x.shape[0], device=x.device) < offs[-1])[:, None]
        x = torch.where(kept, x, 0).to(dtype)  # its backward zeroes x's gradient's unwritten rows
        # autocast does not cast _grouped_mm's operands: cast as it would an F.linear's
        h = torch._grouped_mm(x, self.gate_up.to(dtype).transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(self.act(gate) * up, self.down.to(dtype).transpose(1, 2), offs=offs)
        return torch.where(kept, y, 0)


class SharedExperts(nn.Module):
    """The shared experts' SwiGLU (every token, no gate): gate / up column-parallel, down
    row-parallel, as the dense MLP."""

    def __init__(self, hidden: int, size: int, act: str, mesh: Mesh):
        super().__init__()
        self.gate = ColumnParallelLinear(hidden, size, mesh, bias=False, name="shared expert size")
        self.up = ColumnParallelLinear(hidden, size, mesh, bias=False, name="shared expert size")
        self.down = RowParallelLinear(size, hidden, mesh, bias=False, name="shared expert size")
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gate.enter(x)
        return self.down(self.act(self.gate(x, entered=True)) * self.up(x, entered=True))


class _AttachPenalty(torch.autograd.Function):
    """out passes through; in backward, `penalty` gets the gradient `scale` (a number or a
    device scalar), so its term joins the loss wherever the layer runs."""

    @staticmethod
    def forward(ctx, out, penalty, scale):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device) * ctx.scale, None


class RouterStats:
    """A layer's router statistics summed over a step's training micro-batches (device
    tensors, no host sync): kept tokens per expert, the switch loss, the z-loss, dropped
    assignments, micro-batches."""

    def __init__(self, num_experts: int, device):
        self.values = torch.zeros(num_experts + 4, dtype=torch.float32, device=device)

    def add(self, load, switch, z, dropped, share: float = 1.0, counted: bool = True) -> None:
        """`share`: this rank's share of the micro-batch (its tokens are split over ranks);
        `counted`: whether the routed counts (`load`, `dropped`) are this rank's to add (False
        where another rank adds the same gathered micro-batch's: they count as zeros)."""
        if not counted:
            load, dropped = torch.zeros_like(load), torch.zeros_like(dropped)
        extra = torch.stack(
            [switch.float(), z.float(), dropped.float(), torch.ones_like(z) * share]
        )
        self.values += torch.cat([load.float(), extra.to(load.device)])

    def reset(self) -> None:
        self.values.zero_()


class MoE(nn.Module):
    """The MoE MLP of one layer: router, routed experts, optional shared experts (see the
    module docstring). Input and output [b, s, H]."""

    def __init__(self, config, mesh: Mesh):
        super().__init__()
        d = mesh.device
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.router = Router(config, d)
        ep = getattr(mesh, "ep", 1)
        self.ep_group = mesh.ep_group if ep > 1 else None
        """The ep group this layer's tokens are exchanged over (None: ep 1, every expert here);
        from the mesh, as the tp group reaches the tensor-parallel layers."""
        etp = getattr(mesh, "etp", 1)
        self.tp_group = mesh.tp_group if etp > 1 else None
        """The tp group the experts' partial outputs are reduced over (None: `Mesh.etp` 1,
        each expert whole here)."""
        self.tp_gathers = etp > 1 and mesh.sequence_parallel
        """Whether the routed tokens are all-gathered over tp first (expert tensor parallelism
        under sequence parallelism; the module docstring)."""
        self.counts_stats = not self.tp_gathers or mesh.tp_rank == 0
        """Whether this rank adds its routed counts to the statistics: under `tp_gathers`
        every tp rank routes the gathered micro-batch, so tp rank 0 alone adds them."""
        n, size, hidden = (
            len(local_experts(self.num_experts, ep, getattr(mesh, "ep_rank", 0))),
            config.expert_size,
            config.hidden_size,
        )
        local = divide(size, etp, "expert intermediate size (moe_intermediate_size)")
        self.experts = GroupedExperts(n, hidden, local, config.hidden_act, d)
        split = etp > 1
        gate_up = (n, 2 * size, hidden)
        set_partition(self.experts.gate_up, 1 if split else None, gate_up, 2 if split else 1)
        set_partition(self.experts.down, 2 if split else None, (n, hidden, size))
        mark_expert(
            self.experts.gate_up, self.experts.down, ep=ep, ep_rank=getattr(mesh, "ep_rank", 0)
        )
        self.keep_route = False
        """Whether forwards keep their route for the recompute in backward (full recomputation,
        `set_recompute`), so a recompute exchanges and reads no counts again."""
        self.kept_routes: deque[tuple[torch.Tensor, Route]] = deque()
        """Routes of forwards awaiting their recompute, oldest first (each micro-batch's
        backward comes in its forward's order on a layer in every schedule)."""
        self.shared: SharedExperts | None = None
        if config.shared_expert_intermediate_size:
            self.shared = SharedExperts(
                config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act, mesh
            )
        layers = config.num_moe_layers
        self.aux_coef = config.router_aux_loss_coef / layers
        self.z_coef = config.moe_z_loss_coef / layers
        self.capacity_factor = config.moe_capacity_factor
        self.bias_rate = config.moe_bias_update_rate
        self.penalty_grad: float | torch.Tensor = 1.0
        """The gradient of the step's loss w.r.t. this micro-batch's penalty (`set_penalty_grad`;
        1.0: the penalty is added once, as for a plain `loss.backward()`)."""
        self.token_groups = [
            g
            for g, split in (
                (mesh.tp_group, mesh.sequence_parallel and mesh.tp > 1),
                (mesh.cp_group, mesh.cp > 1),
            )
            if split
        ]
        """The groups a micro-batch's tokens are split over (tp under sequence parallelism,
        cp): the switch loss takes the whole micro-batch's load and token count from them (one
        all-reduce of E + 1 numbers per group), each rank adding its tokens' share."""
        self.share = 1.0 / (
            (mesh.tp if mesh.sequence_parallel else 1) * mesh.cp
        )  # of a micro-batch's forwards this rank counts
        self.stats = RouterStats(self.num_experts, d)
        self.last: dict[str, torch.Tensor] = {}
        """The last forward's switch loss, z-loss and router logits (for tests and tools)."""

    def capacity(self, rows: int, keep: torch.Tensor | None = None) -> int | torch.Tensor | None:
        """The most assignments an expert keeps (None: dropless): ceil(factor x T x k / E),
        T the tokens routed: the `rows`, or where `keep` [rows] marks the padding, the tokens
        that are not padding (a device scalar: no host sync), so padding does not widen it."""
        if self.capacity_factor is None:
            return None
        if keep is None:
            return math.ceil(self.capacity_factor * rows * self.top_k / self.num_experts)
        tokens = keep.sum(dtype=torch.float64)
        return torch.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def _plan(self, tokens_per_expert: torch.Tensor, rows: int) -> Route:
        """The route of this forward: planned (one count all-to-all and one host sync), or,
        in a recompute inside backward, the one its first forward kept (checked equal on the
        device, no sync)."""
        recompute = torch._C._current_graph_task_id() != -1
        if recompute and self.kept_routes:
            counts, route = self.kept_routes.popleft()
            if not is_fake(counts):  # the dry run's fake tensors hold no values
                torch._assert_async(
                    (counts == tokens_per_expert).all(),
                    "MoE recompute routed differently from its forward (kept routes out of order)",
                )
            return route
        route = plan_route(tokens_per_expert, self.ep_group, rows)
        if self.keep_route and torch.is_grad_enabled() and self.training and not recompute:
            self.kept_routes.append((tokens_per_expert.detach(), route))
        return route

    def _expert_parallel(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor):
        """Rows sorted by global expert sent to the ep ranks holding their experts, run
        through this rank's experts and combined back, in `rows`' order (rows dropped by a
        capacity, after the kept ones, get zeros). Under mixed precision the rows travel in
        the compute dtype (`to_wire_dtype`: the autocast dtype the experts' linears cast them to
        anyway, rounded before the all-to-all instead of after it), as the experts' outputs come
        back in it."""
        route = self._plan(tokens_per_expert, rows.shape[0])
        kept = sum(route.send_splits)
        local = dispatch(to_wire_dtype(rows[:kept], self.ep_group), route)
        y = combine(self.experts(local, route.tokens_per_local_expert, route.counts), route)
        if kept < rows.shape[0]:
            y = torch.cat([y, y.new_zeros(rows.shape[0] - kept, y.shape[1])])
        return y

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE MLP of [b, s, H] tokens; in training the balancing penalty joins the
        backward and the router statistics accumulate (not in a recompute). `mask` [b, s]
        (0 / 1, None: every token): the tokens that are not padding; padding is not routed
        (its routed output is zero) and counts in no balancing term or statistic."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        keep = None if mask is None else mask.reshape(-1) != 0
        logits, probs, weights, experts = self.router(x)
        if torch.compiler.is_compiling():  # --compile: routed eagerly (a graph break)
            out = self._routed_eagerly(x, logits, probs, weights, experts, keep, shape[0])
        else:
            out = self._routed(x, logits, probs, weights, experts, keep, shape[0])
        out = out.view(shape)
        if self.shared is not None:  # [b, s, H]: under SP it gathers the sequence like any MLP
            out = out + self.shared(hidden)
        return out

    @graph_break
    def _routed_eagerly(self, x, logits, probs, weights, experts, keep, batch=1) -> torch.Tensor:
        """`_routed`, run eagerly inside torch.compile'd code (`--compile`: a graph break on
        purpose, as torchtitan keeps its token dispatch out of the graph): the rows per expert
        are data-dependent shapes (the CPU loop reads them to the host, the ep exchange's
        splits are host integers) and the recompute test reads autograd's state; compiled,
        every micro-batch's new counts would recompile the block."""
        return self._routed(x, logits, probs, weights, experts, keep, batch)

    def _experts_out(self, x, weights, order, tokens_per_expert) -> torch.Tensor:
        """The routed experts' output [T, H] (in the experts' dtype) of tokens `x` [T, H]
        sorted by `order`: each assignment's output weighted and summed over the k choices."""
        rows = order // self.top_k  # the token of each sorted assignment
        if self.ep_group is None:
            y = self.experts(x[rows], tokens_per_expert)
        else:
            y = self._expert_parallel(x[rows], tokens_per_expert)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = y.new_zeros(x.shape[0] * self.top_k, x.shape[1]).index_copy(0, order, y)
        return out.view(x.shape[0], self.top_k, -1).sum(1)

    def _gathered(self, x, weights, experts, keep, batch=1):
        """(this rank's tokens' output [T/tp, H], the micro-batch's kept tokens per expert,
        its dropped assignments) under expert tensor parallelism with sequence parallelism:
        the tokens, combine weights and choices of the tp group all-gathered (one gather of x,
        one of [T/tp, 2k (+1 with padding)] numbers), routed and run through this rank's
        slices of the experts, the partial output reduce-scattered back. The gathered rows
        come rank by rank ([tp, b, s / tp] of the `batch` sequences' slices), so they are routed
        in one process's token order ([b, s]: "first come, first kept" under a capacity keeps
        the same assignments) and the output put back in rank order."""
        group, k = self.tp_group, self.top_k
        picks = [weights, experts.to(weights.dtype)]  # ids < 2^24: exact in fp32
        if keep is not None:
            picks.append(keep.to(weights.dtype)[:, None])
        picked = gather_from_sequence_parallel_region(torch.cat(picks, 1)[None], group)[0]
        # the tokens (and the output back) in the autocast dtype, as Megatron's 16-bit ones
        wire = to_wire_dtype(x, group)
        every = gather_from_sequence_parallel_region(wire[None], group)[0]
        tp = every.shape[0] // x.shape[0]

        def swap(t: torch.Tensor, a: int, b: int) -> torch.Tensor:  # [a, b, r, c] -> [b, a, r, c]
            return t.reshape(a, b, -1, t.shape[-1]).transpose(0, 1).reshape(-1, t.shape[-1])

        picked, every = swap(picked, tp, batch), swap(every, tp, batch)  # one process's order
        weights, experts = picked[:, :k], picked[:, k : 2 * k].detach().long()
        keep = None if keep is None else picked[:, 2 * k].detach() != 0
        order, tokens_per_expert, dropped = route(
            experts, self.num_experts, self.capacity(every.shape[0], keep), keep
        )
        out = self._experts_out(every, weights, order, tokens_per_expert).to(wire.dtype)
        out = swap(out, batch, tp)  # back in rank order
        out = reduce_scatter_to_sequence_parallel_region(out[None], group)[0].to(x.dtype)
        return out, tokens_per_expert, dropped

    def _routed(self, x, logits, probs, weights, experts, keep=None, batch=1) -> torch.Tensor:
        """The routed experts' output [T, H] for tokens `x` [T, H] and the router's choice,
        with the balancing penalty attached and the statistics added; `keep` [T] (bool, None:
        all): the tokens that are not padding."""
        if self.tp_gathers:
            out, tokens_per_expert, dropped = self._gathered(x, weights, experts, keep, batch)
        else:
            order, tokens_per_expert, dropped = route(
                experts, self.num_experts, self.capacity(x.shape[0], keep), keep
            )
            dtype = x.dtype
            if self.tp_group is not None:  # every tp rank's experts give partial sums
                x, weights = (  # the tokens in the autocast dtype (`to_wire_dtype`)
                    copy_to_tp_region(to_wire_dtype(x, self.tp_group), self.tp_group),
                    copy_to_tp_region(weights, self.tp_group),
                )
            out = self._experts_out(x, weights, order, tokens_per_expert).to(x.dtype)
            if self.tp_group is not None:  # reduced in that dtype, back in the stream's
                out = reduce_from_tp_region(out, self.tp_group).to(dtype)
        if keep is None:
            load = expert_counts(experts.reshape(-1), self.num_experts).float()
            whole = torch.cat([load, load.new_full((1,), x.shape[0])])
        else:  # padding counts in no load, token, probability or z term
            real = keep.float()  # 1 on a token, 0 on padding
            load = torch.zeros(self.num_experts, dtype=torch.float32, device=x.device)
            load.scatter_add_(0, experts.reshape(-1), real.repeat_interleave(self.top_k))
            whole = torch.cat([load, real.sum()[None]])
        for group in self.token_groups:  # the micro-batch's load and tokens (no gradient)
            all_reduce(whole, group)
        tokens = whole[-1] if keep is None else whole[-1].clamp(min=1.0)  # padding alone: 0
        # the switch loss E * sum_e f_e P_e, f_e the share of the T x k assignments chosen for
        # e (as transformers' load_balancing_loss_func: counted before any capacity drop, sums
        # to k), P_e the mean router probability of e, both over the whole micro-batch's tokens
        # (padding left out, as transformers' attention_mask leaves it): this rank's tokens'
        # share of it (of the z-loss, mean logsumexp(logits)^2, too). Without padding nothing
        # is weighted (no T-long weights saved for the backward)
        probs_sum = probs.sum(0) if keep is None else (probs * real[:, None]).sum(0)
        switch = self.num_experts * torch.sum(whole[:-1] / tokens * probs_sum / tokens)
        lse2 = torch.logsumexp(logits.float(), dim=-1).square()
        z = (lse2 if keep is None else lse2 * real).sum() / tokens
        self.last = {"switch": switch.detach(), "z": z.detach(), "logits": logits.detach()}
        if torch.is_grad_enabled() and self.training:
            if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
                self.stats.add(
                    tokens_per_expert.detach(),
                    switch.detach(),
                    z.detach(),
                    dropped,
                    self.share,
                    counted=self.counts_stats,
                )
            penalty = self.aux_coef * switch + self.z_coef * z
            if self.aux_coef or self.z_coef:
                out = _AttachPenalty.apply(out, penalty, self.penalty_grad)
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of a model, a stage or model chunks, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_penalty_grad(model: nn.Module, grad: float | torch.Tensor) -> None:
    """The gradient each micro-batch's balancing penalty is backpropagated with: what the loss
    of that micro-batch gets (the loss scale / the number of micro-batches of the step)."""
    for layer in moe_layers(model):
        layer.penalty_grad = grad


def finish_step(model: nn.Module, mesh: Mesh, num_experts: int, update_bias: bool) -> dict:
    """Once per optimizer step, on every rank of a model with MoE layers: each layer's router
    statistics summed over the dp x cp group (one all-reduce), the auxiliary-loss-free bias
    moved from that global load (`update_bias`: the step was applied), and the step's summary
    over all layers of all stages (an all-reduce of the sum and one of the max over pp):
    `aux_loss` / `z_loss` (means over layers and micro-batches), `dropped` (share of the
    assignments dropped), `imbalance` (the largest max / mean tokens per expert of a layer),
    `tokens_per_expert` (summed over layers and the global batch). The statistics restart."""
    layers = moe_layers(model)
    device = mesh.device
    per_layer = (
        torch.stack([layer.stats.values for layer in layers])
        if layers
        else torch.zeros(0, num_experts + 4, device=device)
    )
    if layers and mesh.dp * mesh.cp > 1:  # every rank of the group holds the same layers
        all_reduce(per_layer, mesh.dp_cp_group)
    if layers and mesh.sequence_parallel and mesh.tp > 1:  # each tp rank routed its slice
        all_reduce(per_layer, mesh.tp_group)
    for layer, values in zip(layers, per_layer):
        if update_bias and layer.router.bias is not None:
            layer.router.update_bias(values[:num_experts], layer.bias_rate)
        layer.stats.reset()
        layer.kept_routes.clear()  # every backward of the step has run
    load = per_layer[:, :num_experts]
    total = per_layer.sum(0) if layers else torch.zeros(num_experts + 4, device=device)
    worst = (load.max(1).values / load.mean(1).clamp(min=1e-9)).max() if layers else None
    worst = torch.zeros((), device=device) if worst is None else worst
    if mesh.pp > 1:
        all_reduce(total, mesh.pp_group)
        all_reduce(worst, mesh.pp_group, op=dist.ReduceOp.MAX)
    *values, imbalance = torch.cat([total, worst.reshape(1).to(total.dtype)]).tolist()  # 1 read
    tokens, (switch, z, dropped, forwards) = values[:num_experts], values[num_experts:]
    forwards = max(forwards, 1.0)
    return {
        "aux_loss": switch / forwards,
        "z_loss": z / forwards,
        "dropped": dropped / max(sum(tokens) + dropped, 1.0),
        "imbalance": imbalance,
        "tokens_per_expert": [int(t) for t in tokens],
    }
