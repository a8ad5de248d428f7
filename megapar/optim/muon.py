"""Muon (Keller Jordan's MomentUm Orthogonalized by Newton-Schulz) for the blocks' matrices, with
AdamW for everything else, as Moonlight, torchtitan and Megatron train with it.

Which parameter takes which update (`is_muon_matrix`): every 2-D weight inside a transformer
block (``layers.N.``: attention's q / k / v (or fused qkv) and output projections, the MLP's
matrices, a MoE layer's router and shared experts) takes Muon; the embeddings, the output head
(BERT's head transform with it), norms, biases and the routed experts' stacked tensors take
AdamW with megapar's weight-decay groups and the --adam-* settings.

The Muon update of one matrix W with gradient G is torch.optim.Muon's (torch 2.9+):
``B = mu B + (1 - mu) G`` (the momentum buffer, as torch keeps it: ``B.lerp_(G, 1 - mu)``),
``U = G.lerp(B, mu)`` (Nesterov), ``O = NS5(U)`` (five quintic Newton-Schulz iterations in
bfloat16 with coefficients (3.4445, -4.775, 2.0315), after dividing by the Frobenius norm),
``W *= 1 - lr * wd``, ``W -= lr * ratio * O``. The ratio is `adjust_lr`'s: "match_rms_adamw"
(Moonlight's 0.2 sqrt(max(A, B)), the default: the update's RMS is AdamW's, so --lr and
--weight-decay tuned for AdamW carry over and one --lr serves both halves) or "original"
(Keller's sqrt(max(1, A / B)) of the [out, in] shape of torch's Linear weight).

A fused qkv weight (GPT-2 and BERT: rows head-major, [heads x (q, k, v) x head_dim, hidden],
`partition.fuse_heads`) is orthogonalised as its three projections q, k and v separately, as
the models with separate q / k / v projections (Moonlight's, torchtitan's Llama) are and as
modded-nanogpt splits GPT-2's: each is a [hidden, hidden] matrix of its own. The parameter
carries ``muon_split = (3, head_dim)`` (set by the attention layer).

Newton-Schulz needs the whole matrix. Under tensor parallelism a column- or row-parallel weight
is split over the tp ranks: each rank computes U of its shard (the momentum is elementwise, so
the buffer stays a shard, the same shape as the parameter, which is what the checkpoint holds),
the shards are all-gathered over tp (one all-gather per tp-split Muon matrix per step),
every tp rank orthogonalises the whole matrix and keeps its own rows / columns of O. Under
ZeRO-1 / 2 / 3 (`zero.py`, `zero3.py`) a rank steps flat *pieces* of parameters: the pieces' U
is all-gathered over the dp (x cp) group bucket (ZeRO-3: unit) by bucket first
(`zero_muon.muon_whole`), then as above.
Under pp every matrix lives on one stage; dp replicas (no ZeRO) orthogonalise the same averaged
gradient. By default every rank of a tp (dp) group computes every whole matrix's NS. Distributed
Muon (`--muon-distributed`, ZeRO 1 / 2 / 3: `zero_muon.muon_split`) assigns each matrix to
one dp x tp slot (`place_owners`: balanced by `ns_cost`, on the dp rank whose ZeRO slices hold
the most of it where the balance allows): its pieces' U go to the owning dp rank in an
all-to-all, whose tp group gathers a tp-split matrix to the owning tp rank (`owner_updates`),
and the results go back the same way: each matrix orthogonalised once, the same result.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megapar.comm_count import issued_for
from megapar.expert_parallel import is_expert
from megapar.tensor_parallel.partition import (
    full_shape,
    gather_full,
    join_shards,
    tp_dim,
    tp_parts,
    unpad,
)

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR = ("match_rms_adamw", "original")
"""`--muon-adjust-lr` choices (torch.optim.Muon's `adjust_lr_fn`)."""

_BLOCK = re.compile(r"(^|\.)layers\.\d+\.")


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon steps the 2-D weights inside the transformer blocks (a MoE layer's router and
    shared experts with them); AdamW the rest, the routed experts too (their stacked tensors
    are split over ep, which Muon does not gather)."""
    return param.dim() == 2 and _BLOCK.search(name) is not None and not is_expert(param)


def newton_schulz(
    g: torch.Tensor, dtype: torch.dtype = torch.bfloat16, steps: int = NS_STEPS, eps: float = NS_EPS
) -> torch.Tensor:
    """The orthogonalised ~U V^T of `g` (2-D) by torch.optim.Muon's quintic Newton-Schulz
    iteration (the same operations in the same order), in `dtype`: bfloat16 as torch's, or
    float32."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def lr_ratio(shape: tuple[int, ...], adjust_lr: str) -> float:
    """torch.optim.Muon's `_adjust_lr` factor for a matrix of `shape` ([out, in])."""
    rows, cols = shape[0], shape[1]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def orthogonalised(
    whole: torch.Tensor, split, adjust_lr: str, dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """(O, ratio) of one whole parameter's update `whole`: NS (in `dtype`) of the matrix, or of
    each of its fused projections (`split` = (n, head_dim): rows [heads, n, head_dim]) put back
    in place."""
    if split is None:
        o = newton_schulz(whole, dtype).to(whole.dtype)
        return o, lr_ratio(tuple(whole.shape), adjust_lr)
    n, head_dim = split
    rows, cols = whole.shape
    grid = whole.view(rows // (n * head_dim), n, head_dim, cols)
    out = torch.empty_like(grid)
    ratio = 1.0
    for j in range(n):
        part = grid[:, j].reshape(-1, cols)
        out[:, j] = newton_schulz(part, dtype).to(whole.dtype).view(-1, head_dim, cols)
        ratio = lr_ratio(tuple(part.shape), adjust_lr)  # the same for q, k and v
    return out.view(rows, cols), ratio


def whole_updates(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    tp_group,
    adjust_lr: str,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[torch.Tensor, float]]:
    """(this rank's shard of O, ratio) per (tp shard of a) parameter and its update U of the
    same shape: U all-gathered over `tp_group` where the parameter is tp-split (collective: the
    ranks of the group pass the same parameters in the same order)."""
    out = []
    for p, u in zip(params, updates):
        dim, full = tp_dim(p), full_shape(p)
        whole = gather_full(u, dim, full, tp_group)
        o, ratio = orthogonalised(whole, getattr(p, "muon_split", None), adjust_lr, dtype)
        if dim is not None and tuple(whole.shape) != tuple(u.shape):
            rank = dist.get_rank(tp_group)
            o = o.narrow(dim, rank * u.shape[dim], u.shape[dim])
        out.append((o, ratio))
    return out


def owner_updates(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    tp_owners: list[int],
    tp_group,
    adjust_lr: str,
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """This rank's (tp shard of) O of each parameter, from its update U of the same shape,
    each tp-split matrix orthogonalised by one tp rank: its shards gathered to tp rank
    `tp_owners[i]` of `tp_group`, which runs Newton-Schulz and scatters the result's shards
    back; a matrix that is not tp-split is orthogonalised by every tp rank (each has it
    whole). Collective over `tp_group` (its ranks pass the same parameters in the same order:
    every gather, then every scatter)."""
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    me = dist.get_rank(tp_group) if size > 1 else 0
    out: list[torch.Tensor | None] = [None] * len(params)
    gathered = {}
    for i, (p, u) in enumerate(zip(params, updates)):
        if tp_dim(p) is None or size == 1:
            split = getattr(p, "muon_split", None)
            out[i] = orthogonalised(unpad(u, tp_dim(p), full_shape(p)), split, adjust_lr, dtype)[0]
            continue
        root = dist.get_global_rank(tp_group, tp_owners[i])
        shards = [torch.empty_like(u) for _ in range(size)] if me == tp_owners[i] else None
        dist.gather(u.contiguous(), shards, dst=root, group=tp_group)
        if shards is not None:
            gathered[i] = shards
    for i, (p, u) in enumerate(zip(params, updates)):
        if out[i] is not None:
            continue
        dim = tp_dim(p)
        assert dim is not None and tp_parts(p) == 1  # a routed expert's parts are not Muon's
        chunks = None
        if i in gathered:
            whole = unpad(join_shards(gathered.pop(i), dim, tp_parts(p)), dim, full_shape(p))
            o, _ = orthogonalised(whole, getattr(p, "muon_split", None), adjust_lr, dtype)
            padded = torch.zeros(
                *u.shape[:dim],
                u.shape[dim] * size,
                *u.shape[dim + 1 :],
                dtype=o.dtype,
                device=o.device,
            )
            padded.narrow(dim, 0, o.shape[dim]).copy_(o)
            chunks = [c.contiguous() for c in padded.chunk(size, dim=dim)]
        mine = torch.empty_like(u)
        root = dist.get_global_rank(tp_group, tp_owners[i])
        dist.scatter(mine, chunks, src=root, group=tp_group)
        out[i] = mine
    return [o for o in out if o is not None]


def matrices_of(p: torch.Tensor) -> list[tuple[int, int]]:
    """The (rows, cols) of each matrix Newton-Schulz orthogonalises in parameter `p` (its whole
    shape over tp; a fused qkv weight's q, k and v apart)."""
    rows, cols = full_shape(p)
    split = getattr(p, "muon_split", None)
    return [(rows // split[0], cols)] * split[0] if split is not None else [(rows, cols)]


def ns_cost(p: torch.Tensor) -> int:
    """Newton-Schulz's cost of parameter `p`, ~ m n min(m, n) per matrix (the Gram products)."""
    return sum(m * n * min(m, n) for m, n in matrices_of(p))


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """The rank (of `ranks`) that orthogonalises each matrix of cost `costs[i]`: the longest
    first to the least-loaded rank (ties: the earlier matrix, the lower rank). Deterministic:
    every rank that passes the same costs gets the same assignment."""
    load = [0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def slices_held(numels: Sequence[int], padded: int, n: int) -> list[list[int]]:
    """For parameters of these sizes laid out back to back from 0 in a bucket (ZeRO-3: unit) of
    `padded` elements cut into `n` equal slices (ZeRO's dp ranks, `slice_pieces`): the elements
    of each parameter inside each slice, [parameter][slice]."""
    size = padded // n
    out, start = [], 0
    for numel in numels:
        end = start + numel
        out.append([max(0, min(end, (r + 1) * size) - max(start, r * size)) for r in range(n)])
        start = end
    return out


def place_owners(costs: list[int], held: list[list[int]], tp: int = 1) -> list[int]:
    """The slot (dp rank x `tp` + tp rank) that orthogonalises each matrix of cost `costs[i]`,
    whose update lies `held[i][r]` elements on dp rank r (`slices_held`; tp ranks hold the same
    layout): `assign_owners`' balance, placed where the updates lie.

    The cap is the heaviest slot's load under `assign_owners` (longest first to the
    least-loaded slot). Matrices go longest first (ties: the earlier); each goes to the
    least-loaded slot of the dp rank holding the most of it, else of the one holding the next
    most, and so on, taking the first such slot from which longest-first placement of the
    matrices still to come (the placement finished as `assign_owners` would) stays within the
    cap; where none does, to the least-loaded slot, which always does (it is longest-first's
    own step). So no slot ends with more Newton-Schulz work than the cap, and a matrix leaves
    the ranks that hold it only where the balance needs it. Deterministic: every rank that
    passes the same costs and layout gets the same placement."""
    n = len(held[0]) if held else 1
    slots = n * tp
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    lpt = assign_owners(costs, slots)
    cap = max((sum(c for c, s in zip(costs, lpt) if s == r) for r in range(slots)), default=0)
    load = [0] * slots
    owner = [0] * len(costs)

    def finishes(k: int, r: int) -> bool:
        """Whether, with matrix order[k] on slot r, longest-first placement of order[k + 1:]
        keeps every slot within the cap."""
        heap = list(load)
        heap[r] += costs[order[k]]
        if heap[r] > cap:
            return False
        heapq.heapify(heap)
        for i in order[k + 1 :]:
            least = heapq.heappop(heap) + costs[i]
            if least > cap:
                return False
            heapq.heappush(heap, least)
        return True

    for k, i in enumerate(order):
        ranks = sorted((r for r in range(n) if held[i][r] > 0), key=lambda r: (-held[i][r], r))
        slot = min(range(slots), key=lambda s: (load[s], s))
        for r in ranks:
            mine = min(range(r * tp, (r + 1) * tp), key=lambda s: (load[s], s))
            if finishes(k, mine):
                slot = mine
                break
        owner[i] = slot
        load[slot] += costs[i]
    return owner


def exchange_elements(held: list[list[int]], owners: list[int]) -> list[int]:
    """Per dp rank, the elements distributed Muon's two all-to-alls carry across the wire into
    it (the same number leave it): each matrix's elements held by the other dp ranks go to its
    owner `owners[i]` (a dp rank) in the first and come back in the second; what a rank holds
    of its own matrices stays."""
    n = len(held[0]) if held else 1
    into = [0] * n
    for parts, o in zip(held, owners):
        for r, k in enumerate(parts):
            if r != o:
                into[o] += k  # to the owner
                into[r] += k  # and back
    return into


def muon_ratio(p: torch.Tensor, adjust_lr: str) -> float:
    """The lr factor `orthogonalised` gives parameter `p` (its matrices' shape, one for all)."""
    return lr_ratio(matrices_of(p)[0], adjust_lr)


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the groups marked ``"muon": True``, torch's AdamW over the others (sharing this
    optimizer's groups and state). `tp_group` gathers tp-split matrices; `ns_dtype`: the
    Newton-Schulz dtype; `whole`, when set (ZeRO's pieces), replaces `whole_updates`:
    (tensors, updates) -> [(O of each, ratio)]."""

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        adjust_lr: str = "match_rms_adamw",
        tp_group=None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"unknown Muon lr adjustment {adjust_lr!r}; expected {ADJUST_LR}")
        super().__init__(groups, {"lr": lr, "muon": False})
        for g in self.param_groups:
            g.setdefault("momentum" if g["muon"] else "betas", momentum if g["muon"] else betas)
            for p in g["params"] if g["muon"] else ():
                if p.dim() not in (1, 2):
                    raise ValueError(f"Muon steps matrices (or their flat pieces), not {p.shape}")
        self.tp_group, self.adjust_lr, self.ns_dtype = tp_group, adjust_lr, ns_dtype
        adam = [g for g in self.param_groups if not g["muon"]]
        self.adamw = None
        if adam:
            params = [p for g in adam for p in g["params"]]
            fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
            self.adamw = torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps, fused=fused or None)
            self.adamw.state = self.state  # one state: checkpoints and ZeRO read this one
        self.defaults.update(fused=bool(self.adamw and self.adamw.defaults.get("fused")))
        self.whole: Callable | None = None

    @torch.no_grad()
    def step(self, closure=None):
        tensors, updates, groups = [], [], []
        for g in self.param_groups:
            if not g["muon"]:
                continue
            mu = g["momentum"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                tensors.append(p)
                updates.append(p.grad.lerp(buf, mu))
                groups.append(g)
        with issued_for("muon"):  # the dry run names these collectives Muon's
            if self.whole is not None:
                done = self.whole(tensors, updates)
            else:
                done = whole_updates(tensors, updates, self.tp_group, self.adjust_lr, self.ns_dtype)
        for p, g, (o, ratio) in zip(tensors, groups, done):
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(o.view_as(p), alpha=-(g["lr"] * ratio))
        if self.adamw is not None:
            self.adamw.step()
