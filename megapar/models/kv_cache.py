"""A KV cache for generation: each causal attention module keeps the keys and values of the
positions it has seen, so a new token's forward runs over that one position only.

The cache is per attention module (`kv_cache`, None when off) and holds the heads as the
module computes them: this tp rank's heads (Llama's kv heads unexpanded), of this pipeline
stage's layers only. The first forward with the cache on (the prompt, the prefill) fills it;
each later one appends its positions and attends to every cached one (in a layer with a
sliding window, to the window's last keys: `window_mask`; the cache keeps every position).
A step's mask is made once and shared by the layers' caches (`StepMasks`).
Positions follow the cache: Llama rotates q and k by their absolute positions (the cache's
length onwards), GPT-2's first stage is given the first new position as the batch's
"positions_from".

A batch of prompts of different lengths is left-padded (`pads`: each row's count of padding
slots before its prompt). Its pad slots are attended by no query of another slot, and a row's
positions start at its first real token (slot - pads, as transformers' position_ids from the
attention_mask): Llama's rotary angles through `positions`, GPT-2's position embedding through
a "positions_from" of [batch, 1]. A row that has finished is dropped from every cache
(`keep_rows`), so it is computed no further.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megapar.context_parallel.kernels import in_window
from megapar.models.config import CAUSAL_LM_TYPES


class KVCache:
    """Keys and values [batch, heads, positions, head_dim] of up to `capacity` positions,
    allocated at the first `append` in its dtype and on its device; `pads` [batch] (int64):
    each row's left padding, None where no row has any."""

    def __init__(
        self, capacity: int, pads: torch.Tensor | None = None, masks: StepMasks | None = None
    ):
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self.pads = pads
        self.kept = 0  # how many times rows were dropped (`keep_rows`): part of a mask's key
        self.masks = masks or StepMasks()

    def positions(self, s: int, device) -> torch.Tensor:
        """The positions [batch, s] of the next `s` slots of each row: slot - pads (the pad
        slots at 0; nothing attends to them). Only with `pads`."""
        assert self.pads is not None
        slots = torch.arange(self.length, self.length + s, device=device)
        return (slots[None, :] - self.pads.to(device)[:, None]).clamp_min(0)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (int64 indices, in order): the others finished."""
        if self.k is not None and self.v is not None:
            self.k = self.k.index_select(0, rows.to(self.k.device))
            self.v = self.v.index_select(0, rows.to(self.v.device))
        if self.pads is not None:
            self.pads = self.pads.index_select(0, rows.to(self.pads.device))
        self.kept += 1

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the keys and values of the next positions; the cached ones, these included."""
        b, h, s, d = k.shape
        if self.k is None or self.v is None:
            self.k = k.new_empty(b, h, self.capacity, d)
            self.v = v.new_empty(b, h, self.capacity, v.shape[-1])
        end = self.length + s
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of the queries `q` of the next positions over every cached key,
        after appending `k` and `v`; `index` [query heads]: the kv head of each query head
        (grouped-query attention), None where they are as many; `window`: each query attends
        to the `window` keys up to itself only (a sliding window; None: to every one)."""
        k, v = self.append(k, v)
        if index is not None:
            k, v = k.index_select(1, index), v.index_select(1, index)
        s, total = q.shape[2], k.shape[2]
        mask = self.masks.get(
            (s, total, self.kept, window), lambda: self._mask(s, total, window, q.device)
        )
        if mask is None and s == total:  # the prefill, every position from 0: the fused path
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _mask(self, s: int, total: int, window: int | None, device) -> torch.Tensor | None:
        """The boolean mask of the last `s` of `total` cached positions' queries (None: every
        key seen, or where s == total the plain causal rule): a row's pads, the window, or
        causality among several new positions."""
        cut = window_mask(s, total, window, device) if window and window < total else None
        if self.pads is not None:  # a left-padded batch (slots and positions differ by a row's
            padded = self._padded_mask(s, total)  # pads alone: the window holds in slots too)
            return padded & cut if cut is not None else padded
        if cut is not None or s == total or s == 1:  # the window cuts the cached positions;
            return cut  # the prefill is causal; one new position sees all
        # query i is position total - s + i
        return torch.ones(s, total, dtype=torch.bool, device=device).tril(total - s)

    def _padded_mask(self, s: int, total: int) -> torch.Tensor:
        """[batch, 1, s, total]: query slot i (of the last s) sees key slot j <= i that is not
        padding, and itself (a pad slot sees only itself: no row of all -inf, whose softmax
        would be NaN, as transformers unmasks such rows)."""
        assert self.pads is not None and self.k is not None
        device = self.k.device
        keys = torch.arange(total, device=device)
        queries = torch.arange(total - s, total, device=device)
        causal = keys[None, :] <= queries[:, None]  # [s, total]
        real = keys[None, :] >= self.pads.to(device)[:, None]  # [batch, total]
        itself = keys[None, :] == queries[:, None]
        return (causal[None] & (real[:, None, :] | itself[None]))[:, None]


class StepMasks:
    """The attention masks of one generation step, made by the first layer's cache that needs
    each and shared by every other (the same rows, pads, positions and window give the same
    mask): one mask per step and window instead of one per layer. Keyed by (new positions,
    cached positions, rows dropped so far, window); a new step's key drops the last ones."""

    def __init__(self) -> None:
        self.step: tuple | None = None
        self.made: dict = {}

    def get(self, key: tuple, make):
        """The mask of `key` (s, total, kept, window), from `make()` the first time."""
        if key[:3] != self.step:
            self.step, self.made = key[:3], {}
        if key[3] not in self.made:
            self.made[key[3]] = make()
        return self.made[key[3]]


def window_mask(queries: int, keys: int, window: int, device) -> torch.Tensor:
    """[queries, keys] True where the query attends to the key: the last `queries` of `keys`
    positions, each over the `window` keys up to itself (transformers' sliding window: key >
    query - window, key <= query). Made on the device from arange."""
    return in_window(
        torch.arange(keys - queries, keys, device=device), torch.arange(keys, device=device), window
    )


def cached_attention(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that take a KV cache (GPT-2's and Llama's attention)."""
    return [m for m in model.modules() if hasattr(m, "kv_cache")]


def takes_kv_cache(model: nn.Module) -> bool:
    """Whether generation from `model` (a causal LM stage) can use the KV cache: a GPT-2 or
    Llama-family model without context or sequence parallelism and with dropless MoE layers
    if any (a capacity drops tokens by how many are routed together). Decided from the config
    and mesh, so every pipeline stage decides alike."""
    config, mesh = getattr(model, "config", None), getattr(model, "mesh", None)
    if config is None or mesh is None:
        return False
    if getattr(config, "model_type", None) not in CAUSAL_LM_TYPES:
        return False
    if mesh.cp > 1 or mesh.sequence_parallel:
        return False
    return getattr(config, "moe_capacity_factor", None) is None


@contextlib.contextmanager
def kv_cache(model: nn.Module, capacity: int, pads: torch.Tensor | None = None):
    """Every attention module of `model` with an empty cache of `capacity` positions (rows
    left-padded by `pads`, None: none) while the block runs; none after. Yields the caches."""
    modules = cached_attention(model)
    masks = StepMasks()  # one mask per step, shared by the layers
    caches = [KVCache(capacity, pads, masks) for _ in modules]
    for m, cache in zip(modules, caches, strict=True):
        m.kv_cache = cache  # type: ignore[assignment]  # a plain attribute
    try:
        yield caches
    finally:
        for m in modules:
            m.kv_cache = None  # type: ignore[assignment]
