"""A KV cache for generation: each causal attention module keeps the keys and values of the
positions its queries can still see, so a new token's forward runs over that one position only.

The cache is per attention module (`kv_cache`, None when off) and holds the heads as the
module computes them: this tp rank's heads (Llama's kv heads unexpanded), of this pipeline
stage's layers only. The first forward with the cache on (the prompt, the prefill) fills it;
each later one appends its positions and attends to the cached ones. A cache counts the
positions it has seen (`length`, the slots from the prompt's first): positions stay absolute
whatever it keeps. A step's mask is made once and shared by the layers' caches (`StepMasks`).
Positions follow the cache: Llama rotates q and k by their absolute positions (the cache's
length onwards), GPT-2's first stage is given the first new position as the batch's
"positions_from".

A layer of full attention keeps every position, in one buffer of the generation's `capacity`
(its longest sequence). A layer with a sliding window (`window`: Mistral's, Qwen's sliding
layers) keeps only what a later query can see: after each forward the last window - 1
positions, in a rolling buffer (Mistral's, transformers' sliding-window cache) of window - 1 +
the most positions a forward after the first adds (the prefill attends over its own keys and
keeps their last window - 1; each decode step adds one: a buffer of `window`, read whole). The
keys of slot p live at index p mod that size, so a step writes one index and copies nothing;
the keys are read in the buffer's order and the mask places each by its slot
(`KVCache.key_slots`), so one decode step attends over `window` keys at most. A window no
shorter than the capacity cuts nothing: that layer keeps every position as a full one does.

A batch of prompts of different lengths is left-padded (`pads`: each row's count of padding
slots before its prompt). Its pad slots are attended by no query of another slot, and a row's
positions start at its first real token (slot - pads, as transformers' position_ids from the
attention_mask): Llama's rotary angles through `positions`, GPT-2's position embedding through
a "positions_from" of [batch, 1]. The window holds in slots (a row's positions are its slots
less its pads: the same distances). A row that has finished is dropped from every cache
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
    """Keys and values [batch, heads, slots, head_dim] of a generation of up to `capacity`
    positions, allocated at the first `append` in its dtype and on its device; `pads` [batch]
    (int64): each row's left padding, None where no row has any; `window`: the layer's sliding
    window (None: full attention), whose cache keeps only the positions its queries can still
    see (`trims`)."""

    def __init__(
        self,
        capacity: int,
        pads: torch.Tensor | None = None,
        masks: StepMasks | None = None,
        window: int | None = None,
    ):
        self.capacity, self.window = capacity, window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0  # the positions (slots) seen, absolute: the next one's slot
        self.pads = pads
        self.kept = 0  # how many times rows were dropped (`keep_rows`): part of a mask's key
        self.masks = masks or StepMasks()

    @property
    def trims(self) -> bool:
        """Whether this cache keeps only the last window - 1 positions between forwards (a
        rolling buffer): a window shorter than the capacity."""
        return self.window is not None and self.window < self.capacity

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
        """Add the keys and values of the next positions; the keys and values the new queries
        attend over, these included: every cached one, in order; under a trimming window the
        first forward's own, then the rolling buffer's filled indices (at least the last
        window - 1 slots before these; each one's slot: `key_slots`)."""
        b, h, s, d = k.shape
        end = self.length + s
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold {end}")
        if self.trims:
            return self._roll(k, v)
        if self.k is None or self.v is None:
            self.k = k.new_empty(b, h, self.capacity, d)
            self.v = v.new_empty(b, h, self.capacity, v.shape[-1])
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def _roll(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`append` to the rolling buffer of a trimming window: slot p's keys at index p mod
        its size, room for the last window - 1 slots and the new ones (grown, those slots
        moved, where a forward adds more than it has room for). The first forward's keys are
        its own (the buffer keeps their last window - 1); a later one's, the buffer's first
        min(length, size) indices."""
        assert self.window is not None
        s, start, end = k.shape[2], self.length, self.length + k.shape[2]
        first = start == 0
        size = min(self.capacity, self.window - 1 + (1 if first else s))
        if self.k is None or self.v is None or self.k.shape[2] < size:
            kept = min(start, self.window - 1)  # the slots a new query can still see
            old = [self._read(t, kept) for t in (self.k, self.v) if t is not None]
            self.k = k.new_empty(*k.shape[:2], size, k.shape[-1])
            self.v = v.new_empty(*v.shape[:2], size, v.shape[-1])
            for buffer, t in zip((self.k, self.v), old, strict=False):
                self._write(buffer, start - kept, t)
        self.length = end
        if first:  # the prefill attends over its own keys; their last window - 1 stay
            tail = min(s, self.window - 1)
            self._write(self.k, end - tail, k[:, :, s - tail :])
            self._write(self.v, end - tail, v[:, :, s - tail :])
            return k, v
        self._write(self.k, start, k)
        self._write(self.v, start, v)
        n = min(end, self.k.shape[2])
        return self.k[:, :, :n], self.v[:, :, :n]

    @staticmethod
    def _write(buffer: torch.Tensor, slot: int, t: torch.Tensor) -> None:
        """Write `t`'s slots (slot, slot + 1, ...) to `buffer` at their indices mod its size."""
        size, n = buffer.shape[2], t.shape[2]
        i = slot % size
        head = min(n, size - i)
        buffer[:, :, i : i + head] = t[:, :, :head]
        if head < n:
            buffer[:, :, : n - head] = t[:, :, head:]

    def _read(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        """The last `n` slots before `length` in the rolling `buffer`, in order (a copy)."""
        size = buffer.shape[2]
        i = (self.length - n) % size
        if i + n <= size:
            return buffer[:, :, i : i + n].clone()
        return torch.cat([buffer[:, :, i:], buffer[:, :, : i + n - size]], dim=2)

    def wrapped(self, total: int) -> int | None:
        """The rolling buffer's size where the `total` keys of this forward are the whole
        buffer and it has wrapped (its indices are not the slots' order); None where the keys
        are the slots length - total .. length - 1 in order."""
        if not self.trims or self.k is None or total != self.k.shape[2]:
            return None
        return total if self.length > total else None

    def key_slots(self, total: int, device) -> torch.Tensor:
        """The slot (a row's position before its pads) of each of the `total` keys this
        forward's queries attend over: in order up to `length`, or at a wrapped rolling
        buffer's index i the last slot p < length with p = i mod its size."""
        size = self.wrapped(total)
        i = torch.arange(total, device=device)
        if size is None:
            return i + (self.length - total)
        return i + torch.div(self.length - 1 - i, size, rounding_mode="floor") * size

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of the queries `q` of the next positions over the cached keys,
        after appending `k` and `v`; `index` [query heads]: the kv head of each query head
        (grouped-query attention), None where they are as many. Under the cache's `window`
        each query attends to the `window` keys up to itself only (a sliding window).
        `scale`: the softmax scale (None: 1 / sqrt(head size))."""
        k, v = self.append(k, v)
        if index is not None:
            k, v = k.index_select(1, index), v.index_select(1, index)
        s, total = q.shape[2], k.shape[2]
        key = (s, self.length, self.kept, (self.window, total))
        mask = self.masks.get(key, lambda: self._mask(s, total, self.window, q.device))
        if mask is None and s == total:  # the prefill, every position from 0: the fused path
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def _mask(self, s: int, total: int, window: int | None, device) -> torch.Tensor | None:
        """The boolean mask of the last `s` positions' queries over the `total` keys of this
        forward (None: every key seen, or where s == total the plain causal rule): a row's
        pads, the window, or causality among several new positions."""
        if self.pads is not None or self.wrapped(total) is not None:
            return self._slot_mask(s, total, window, device)
        # the keys are the last `total` positions in order, the queries their last s
        cut = window_mask(s, total, window, device) if window and window < total else None
        if cut is not None or s == total or s == 1:  # the window cuts the cached positions;
            return cut  # the prefill is causal; one new position sees all
        # query i is position total - s + i
        return torch.ones(s, total, dtype=torch.bool, device=device).tril(total - s)

    def _slot_mask(self, s: int, total: int, window: int | None, device) -> torch.Tensor | None:
        """The mask by each key's slot (`key_slots`): query slot q sees key slot j <= q (within
        the window: j > q - window) that is not padding, and itself (a pad slot sees only
        itself: no row of all -inf, whose softmax would be NaN, as transformers unmasks such
        rows). [batch, 1, s, total] with `pads`; without, [s, total] or None where a lone new
        position sees every key."""
        keys = self.key_slots(total, device)
        queries = torch.arange(self.length - s, self.length, device=device)
        if self.pads is None:
            if s == 1 and (window is None or total <= window):
                return None
            return in_window(queries, keys, window) if window else keys[None] <= queries[:, None]
        seen = in_window(queries, keys, window) if window else keys[None] <= queries[:, None]
        real = keys[None, :] >= self.pads.to(device)[:, None]  # [batch, total]
        itself = keys[None, :] == queries[:, None]
        return (seen[None] & (real[:, None, :] | itself[None]))[:, None]


class StepMasks:
    """The attention masks of one generation step, made by the first layer's cache that needs
    each and shared by every other (the same rows, pads, positions, window and cached keys
    give the same mask): one mask per step and kind of layer instead of one per layer. Keyed
    by (new positions, positions seen, rows dropped so far, (window, keys attended)): the
    last part tells a full layer (every position), a trimmed one (its rolling buffer) and
    another window apart within a step, whichever order the layers come in; a new step's key
    drops the last ones."""

    def __init__(self) -> None:
        self.step: tuple | None = None
        self.made: dict = {}

    def get(self, key: tuple, make):
        """The mask of `key` (s, length, kept, (window, keys)), from `make()` the first time."""
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
    left-padded by `pads`, None: none; a module's `window`, where it has one, trims its
    cache) while the block runs; none after. Yields the caches."""
    modules = cached_attention(model)
    masks = StepMasks()  # one mask per step and kind of layer, shared by the layers
    caches = [KVCache(capacity, pads, masks, getattr(m, "window", None)) for m in modules]
    for m, cache in zip(modules, caches, strict=True):
        m.kv_cache = cache  # type: ignore[assignment]  # a plain attribute
    try:
        yield caches
    finally:
        for m in modules:
            m.kv_cache = None  # type: ignore[assignment]
