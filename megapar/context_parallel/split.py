"""How a sequence is cut over the context-parallel group (Megatron's load-balanced split).

The sequence of length s is cut into 2 x cp equal chunks; cp rank r holds chunks r and
2cp - 1 - r, one after the other. Under a causal mask the work of a query chunk grows with its
position, so pairing an early chunk with a late one gives every rank the same attention work
(rank 0: the first and the last chunk; rank cp - 1: the two middle ones). The same split serves
bidirectional models (BERT), where any split is balanced, so there is one code path.

Everything here is index arithmetic on the sizes: no communication, no host synchronisation.
"""

from __future__ import annotations

import torch

from megapar.mesh import LayoutError

SEQ_DIM = 1


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) cp rank `rank` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def check_length(seq_len: int, cp: int) -> None:
    """A sequence length the split can cut (2 x cp equal chunks), or a LayoutError."""
    if cp > 1 and seq_len % (2 * cp):
        raise LayoutError(
            f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp} "
            f"(context parallelism cuts each sequence into 2 x cp chunks); "
            f"choose a --seq-len that is a multiple of {2 * cp}"
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
