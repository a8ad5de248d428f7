"""All-to-all context parallelism (DeepSpeed-Ulysses; Megatron-core's ``--cp-comm-type a2a``).

Each cp rank holds its two chunks of every sequence (`split.py`) and its tp rank's heads. Before
the attention core one all-to-all over the cp group turns this rank's q, k and v ([b, heads,
2c, d], c = s / 2cp) into [b, heads / cp, s, d]: a cp-th of the heads over the whole sequence,
put back into sequence order (the load-balanced split's chunks undone); each rank then runs
ordinary full-sequence attention on its heads (causal, a sliding window's plain mask, BERT's
padding mask, dropout), and one all-to-all after it turns the output back into this rank's
chunks of every head. q, k and v travel in one fused all-to-all; backward mirrors both
(the output's gradient in, q / k / v's gradients out), in the activation dtype.

Per layer and micro-batch a rank sends (and receives) 2 all-to-alls forward and 2 backward of
b x (2 x heads + 2 x kv heads) x s / cp x d elements in all: q + k + v + out, each a cp-th of a
whole-sequence activation. The split sizes are the same on every rank and fixed by the shapes
(no host synchronisation), and every cp rank issues the same all-to-alls in the same order.

Heads: the query heads of a tp rank must be divisible by cp. Grouped-query kv heads travel
unexpanded when they divide over cp along with their query heads (each rank's query heads use
only its own kv heads); otherwise (fewer kv heads than cp, or a tp rank's replicated kv heads
split unevenly) k and v are expanded to one per query head first (replicated, as Megatron and
DeepSpeed do), which costs the traffic of multi-head attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapar.context_parallel.kernels import in_window
from megapar.context_parallel.split import chunk_ids


def _to_heads(tensors, cp: int, group) -> list[torch.Tensor]:
    """[b, h_i, 2c, d] each (this rank's two chunks of h_i heads, h_i divisible by cp) ->
    [b, h_i / cp, s, d] each: this cp rank's h_i / cp heads over the whole sequence, in
    sequence order. One all-to-all of every tensor together."""
    b, _, rows, d = tensors[0].shape
    sizes = [t.shape[1] // cp for t in tensors]
    send = torch.cat(
        [t.reshape(b, cp, h, rows, d).transpose(0, 1) for t, h in zip(tensors, sizes)], dim=2
    ).contiguous()  # [cp (destination), b, heads / cp, 2c, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    c = rows // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for source in range(cp):  # source's tokens: its chunks, one after the other
        first, second = chunk_ids(cp, source)
        chunks[first], chunks[second] = recv[source, ..., :c, :], recv[source, ..., c:, :]
    whole = torch.cat(chunks, dim=-2)  # type: ignore[arg-type]  # every chunk is filled
    return list(whole.split(sizes, dim=1))


def _to_sequence(tensors, cp: int, group) -> list[torch.Tensor]:
    """The inverse of `_to_heads`: [b, h_i / cp, s, d] each -> [b, h_i, 2c, d] each."""
    b, _, s, d = tensors[0].shape
    sizes = [t.shape[1] for t in tensors]
    chunks = torch.cat(list(tensors), dim=1).chunk(2 * cp, dim=2)
    send = torch.stack(
        [torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim=2) for rank in range(cp)]
    )  # [cp (destination), b, heads / cp, 2c, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out, start = [], 0
    for h in sizes:  # source j's part holds heads j x h ... (j + 1) x h - 1
        part = recv[:, :, start : start + h].transpose(0, 1)
        out.append(part.reshape(b, cp * h, part.shape[3], d))
        start += h
    return out


class _ToHeads(torch.autograd.Function):
    """`_to_heads` with `_to_sequence` of the gradients as its backward."""

    @staticmethod
    def forward(ctx, group, cp, *tensors):
        ctx.group, ctx.cp = group, cp
        return tuple(_to_heads(tensors, cp, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_to_sequence(grads, ctx.cp, ctx.group))


class _ToSequence(torch.autograd.Function):
    """`_to_sequence` with `_to_heads` of the gradients as its backward."""

    @staticmethod
    def forward(ctx, group, cp, *tensors):
        ctx.group, ctx.cp = group, cp
        return tuple(_to_sequence(tensors, cp, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_to_heads(grads, ctx.cp, ctx.group))


def heads_error(heads: int, cp: int) -> str | None:
    """Why a tp rank's `heads` query heads cannot be split over cp by the all-to-all (None: they
    can)."""
    if heads % cp == 0:
        return None
    return (
        f"all-to-all context parallelism gives each cp rank a cp-th of a tp rank's attention "
        f"heads, and {heads} {'head' if heads == 1 else 'heads'} per tp rank "
        f"{'does' if heads == 1 else 'do'} not divide over cp {cp}"
    )


def kv_plan(kv_index: list[int] | None, kv_heads: int, cp: int) -> list[int] | None:
    """How grouped-query k / v travel: each cp rank's local kv head of its query heads
    (the same list on every rank) when the kv heads divide over cp with their query heads,
    else None (k and v expanded to the query heads before the all-to-all)."""
    if kv_index is None or kv_heads % cp:
        return None
    q_per, kv_per = len(kv_index) // cp, kv_heads // cp
    local = [kv_index[j] - (j // q_per) * kv_per for j in range(len(kv_index))]
    if any(not 0 <= i < kv_per for i in local) or any(
        local[j] != local[j % q_per] for j in range(len(local))
    ):
        return None
    return local[:q_per]


def attention(
    q,
    k,
    v,
    cp: int,
    group,
    causal: bool,
    key_mask=None,
    kv_index=None,
    local_index=None,
    dropout_p: float = 0.0,
    window: int | None = None,
    masks: dict | None = None,
    attn_mask=None,
):
    """Attention of this rank's tokens over the whole (cp-split) sequence by all-to-alls.

    q: [b, heads, 2c, d]; k, v: [b, kv heads, 2c, d] with `kv_index` [heads] (a tensor) naming
    each query head's kv head (None: one each); `local_index`: after the all-to-all, the
    rank's query heads' kv heads among its own (a tensor, `kv_plan`), or None: k and v are
    expanded by kv_index before it. key_mask: [b, s] bool of the whole sequence (True: a
    real token). `masks`: where the window's mask is kept (one per shape). `attn_mask`: an
    additive mask [b, 1, s, s] of the whole sequence in sequence order (packed documents: the
    causal rule and any window included), used instead of the causal rule, window and key
    mask. Returns [b, heads, 2c, d]."""
    if kv_index is not None and local_index is None:
        k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
    q, k, v = _ToHeads.apply(group, cp, q, k, v)
    if local_index is not None:
        k, v = k.index_select(1, local_index), v.index_select(1, local_index)
    s = q.shape[2]
    if attn_mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        return _ToSequence.apply(group, cp, out)[0]
    mask = None
    if window is not None and causal and window < s:
        key = (s, window, str(q.device))
        mask = masks.get(key) if masks is not None else None
        if mask is None:
            positions = torch.arange(s, device=q.device)
            mask = in_window(positions, positions, window)
            if masks is not None:
                masks[key] = mask
    if key_mask is not None:
        keep = key_mask[:, None, None, :].bool()
        if causal and mask is None:
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = keep if mask is None else mask & keep
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None
    )
    return _ToSequence.apply(group, cp, out)[0]
