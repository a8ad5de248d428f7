"""How a sequence is cut over the context-parallel group (Megatron's load-balanced split).

The sequence of length s is cut into 2 x cp equal chunks; cp rank r holds chunks r and
2cp - 1 - r, one after the other. Under a causal mask the work of a query chunk grows with its
position, so pairing an early chunk with a late one gives every rank the same attention work
(rank 0: the first and the last chunk; rank cp - 1: the two middle ones). The same split serves
bidirectional models (BERT), where any split is balanced, so there is one code path.

Everything here is index arithmetic on the sizes: no communication, no host synchronisation.
"""

from __future__ import annotations

import math

import torch

from megapar.mesh import LayoutError

SEQ_DIM = 1


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) cp rank `rank` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def length_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """What every sequence length must be a multiple of: 2 x cp (the split's chunks) and, under
    sequence parallelism at tp > 1, cp x tp (each cp rank's tokens cut into tp slices)."""
    need = 2 * cp if cp > 1 else 1
    return math.lcm(need, cp * tp) if sequence_parallel and tp > 1 else need


def check_length(seq_len: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """A sequence length the split can cut (2 x cp equal chunks) and, under sequence
    parallelism, each cp rank's part into tp slices; else a LayoutError naming the multiple."""
    need = length_multiple(cp, tp, sequence_parallel)
    if seq_len % need == 0:
        return
    if cp > 1 and need == 2 * cp:
        what = f"2 x cp = {need}"
        why = "context parallelism cuts each sequence into 2 x cp chunks"
    else:
        what = f"lcm(2 x cp, cp x tp) = {need}" if cp > 1 else f"tp = {need}"
        why = (
            f"context parallelism cuts each sequence into 2 x cp = {2 * cp} chunks and "
            if cp > 1
            else ""
        ) + f"sequence parallelism cuts each{' cp' if cp > 1 else ''} rank's tokens into tp slices"
    raise LayoutError(
        f"sequence length {seq_len} is not divisible by {what} ({why}); make it a multiple "
        f"of {need} (megapar-train: --seq-len; megapar.prepare's engine: the batch's sequences, "
        f"padded or cut)"
    )


def split(x: torch.Tensor, cp: int, rank: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the sequence): its two chunks, concatenated."""
    if cp == 1:
        return x
    check_length(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def positions(seq_len: int, cp: int, rank: int, device) -> torch.Tensor:
    """Global positions (0 .. seq_len - 1) of this rank's tokens, in the order it holds them."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    check_length(seq_len, cp)
    c = seq_len // (2 * cp)
    first, second = chunk_ids(cp, rank)
    return torch.cat(
        [
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ]
    )


def unsplit(parts: list[torch.Tensor], dim: int = SEQ_DIM) -> torch.Tensor:
    """The whole sequence from every cp rank's part (`parts[r]` from rank r): the inverse of
    `split`, for tests and tools that gather a result."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks: dict[int, torch.Tensor] = {}  # by position in the sequence
    for rank, part in enumerate(parts):
        first, second = chunk_ids(cp, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat([chunks[i] for i in range(2 * cp)], dim=dim)
