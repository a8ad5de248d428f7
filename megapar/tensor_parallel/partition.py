"""How a parameter is split across the tensor-parallel group, and slicing full tensors to shards.

Every parameter of a megapar model carries two attributes, set by the layer that owns it:

- ``param.tp_dim``: the dim split across tp ranks, or None when every tp rank holds all of it.
- ``param.full_shape``: the canonical full shape, the same in every layout (for a vocab-parallel
  tensor, the *unpadded* vocabulary size).
- ``param.tp_parts`` (only where it is not 1): dim ``tp_dim`` of the full tensor is that many
  equal parts laid end to end (a routed expert's fused gate and up rows), each split by the rule
  below; a shard is its slice of every part, in part order, so a rank holds the gate and up
  rows of the same intermediate units (`shard_of`, `gather_full`).
- ``param.shared_embedding`` (only where True): the word embedding, or the last pipeline
  stage's tied copy of it, whose gradients are summed over the two stages (`pipeline/tied.py`;
  `shared_embedding_params`).

Shards are contiguous: tp rank r holds rows [r*s, (r+1)*s) of dim ``tp_dim`` of the full tensor
padded along that dim to ``s * tp`` (s = the local size). Rows at or beyond ``full_shape[tp_dim]``
are padding: zero on load, dropped on gather. Checkpoints, conversion, clipping and Hugging Face
import/export all use this one rule.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T", bound=torch.Tensor)


def set_partition(param: T, tp_dim: int | None, full_shape, parts: int = 1) -> T:
    """Tag `param` with its split (``tp_dim``, ``full_shape``, ``tp_parts`` where `parts` is
    not 1) and return it."""
    # plain attributes on the tensor, which torch's stubs do not declare
    param.tp_dim = tp_dim  # type: ignore[attr-defined]
    param.full_shape = tuple(int(x) for x in full_shape)  # type: ignore[attr-defined]
    if parts != 1:
        param.tp_parts = parts  # type: ignore[attr-defined]
    return param


def tp_dim(param: torch.Tensor) -> int | None:
    return getattr(param, "tp_dim", None)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return getattr(param, "full_shape", tuple(param.shape))


def tp_parts(param: torch.Tensor) -> int:
    """How many parts dim ``tp_dim`` of `param`'s full tensor is split as (1 for all but a
    split expert's fused gate and up)."""
    return getattr(param, "tp_parts", 1)


def local_size(full: int, tp: int, multiple: int = 1) -> int:
    """Size of one shard when `full` is padded up to a multiple of tp*multiple and split tp ways."""
    return math.ceil(full / (tp * multiple)) * multiple


def shard_range(full: int, local: int, tp_rank: int) -> tuple[int, int]:
    """[start, stop) of tp rank's shard *within the unpadded full tensor* (may be empty)."""
    start = min(full, tp_rank * local)
    return start, min(full, start + local)


def shard_of(
    full_tensor: torch.Tensor, dim: int | None, local: int | None, tp_rank: int, parts: int = 1
) -> torch.Tensor:
    """The shard of `full_tensor` that tp rank holds, zero-padded to `local` along `dim`
    (`local`: None when `dim` is, nothing being sharded); of `parts` parts along `dim`
    (`tp_parts`), the shard of each, concatenated."""
    if dim is None:
        return full_tensor.clone()
    assert local is not None  # a sharded dim has a local size
    if parts > 1:
        pieces = full_tensor.chunk(parts, dim=dim)
        return torch.cat([shard_of(p, dim, local // parts, tp_rank) for p in pieces], dim=dim)
    start, stop = shard_range(full_tensor.shape[dim], local, tp_rank)
    piece = full_tensor.narrow(dim, start, stop - start)
    if stop - start == local:
        return piece.clone()
    pad_shape = list(full_tensor.shape)
    pad_shape[dim] = local - (stop - start)
    return torch.cat([piece, full_tensor.new_zeros(pad_shape)], dim=dim)


def unpad(gathered: torch.Tensor, dim: int | None, full: tuple[int, ...]) -> torch.Tensor:
    """Drop padding rows from a tensor gathered from all tp shards."""
    if dim is None:
        return gathered
    return gathered.narrow(dim, 0, full[dim])


def gather_full(
    shard: torch.Tensor, dim: int | None, full: tuple[int, ...], group, parts: int = 1
) -> torch.Tensor:
    """The full (unpadded) tensor from every tp rank's shard; collective over `group`. Of
    `parts` parts along `dim` (`tp_parts`, never padded), each part's shards joined in turn."""

    if dim is None or group is None or dist.get_world_size(group) == 1:
        return unpad(shard, dim, full)
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return unpad(join_shards(shards, dim, parts), dim, full)


def join_shards(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Every tp rank's shard (in rank order) joined along `dim` into the padded full tensor;
    of `parts` parts, each part's slices joined, then the parts."""
    if parts == 1:
        return torch.cat(shards, dim=dim)
    cut = [s.chunk(parts, dim=dim) for s in shards]
    return torch.cat([torch.cat([c[i] for c in cut], dim=dim) for i in range(parts)], dim=dim)


def fuse_heads(parts, heads: int) -> torch.Tensor:
    """The canonical fused tensor of per-head projections (attention's q, k, v), head-major.

    `parts` are full tensors of the same shape [heads * head_dim, ...] (q, k and v). The fused
    tensor's rows are [head 0: q, k, v | head 1: q, k, v | ...] (Megatron's layout), so a
    contiguous shard along dim 0 holds whole heads and all three projections of each: the one
    shard rule above applies unchanged, in every tp that divides the heads.
    """
    stacked = torch.stack(list(parts))  # [n, heads * head_dim, ...]
    n, rows = stacked.shape[:2]
    rest = stacked.shape[2:]
    return stacked.reshape(n, heads, rows // heads, *rest).transpose(0, 1).reshape(n * rows, *rest)


def unfuse_heads(fused: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """The inverse of `fuse_heads`: the three per-projection full tensors (q, k, v)."""
    rows, rest = fused.shape[0] // 3, fused.shape[1:]
    split = fused.reshape(heads, 3, rows // heads, *rest).transpose(0, 1)
    return [t.reshape(rows, *rest) for t in split]


def is_shared_embedding(param: torch.Tensor) -> bool:
    """Whether `param` is the word embedding or its tied copy (``shared_embedding``)."""
    return bool(getattr(param, "shared_embedding", False))


def shared_embedding_params(module) -> list:
    """`module`'s parameters for which `is_shared_embedding` holds, in its order."""
    return [p for p in module.parameters() if is_shared_embedding(p)]


def mark_replicated(module) -> None:
    """Give every parameter without a partition the replicated one (tp_dim None, its own shape)."""
    for param in module.parameters():
        if not hasattr(param, "tp_dim"):
            set_partition(param, None, param.shape)
