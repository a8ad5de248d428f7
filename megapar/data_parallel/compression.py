"""Compressed data-parallel gradient reduction: `--grad-compression none|fp16|bf16|powersgd`.

Each compressor takes a bucket's packed gradient (already divided by dp), replaces it in place
with the dp sum (so the average) and returns the bytes it put on the wire.

- fp16 / bf16 (Horovod's fp16 compression): cast, all-reduce in the narrow type, cast back.
  fp16 is scaled against overflow and underflow first: the ranks agree (one MAX all-reduce of
  a scalar) on the largest |g| of the bucket and multiply by a power of two S so that the dp
  sum stays below 2^15, then divide by S after the reduction (exact: S is a power of two; S is
  computed on the device, `fp16_scale`, so the host does not wait inside the backward).
  bf16 has fp32's range and needs no scale. Bound (stated and tested): every element of the
  result is within (dp + 1) * u * sum_r |g_r| of the exact average, u = 2^-11 (fp16), 2^-8
  (bf16) the unit roundoff, plus for fp16 an absolute 2^-24 / S from subnormals.
- powersgd (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression", the
  algorithm of torch's DDP powerSGD_hook, here on megapar's buckets): each gradient matrix
  M (n x m, plus its error-feedback residual) is sent as rank-r factors: P = M Q, all-reduce P,
  orthonormalise P, Q = M^T P, all-reduce Q, result P Q^T ((n + m) r numbers instead of n m).
  Q is warm-started from the previous step; the first Q of a parameter is seeded by its
  canonical name and shape (`name_params`), so it is the same on every rank of the group and
  in every layout and bucketing that holds the same matrix (pp, virtual stages, cp,
  --grad-bucket-mb: a parameter's place in its bucket changes with them). P is made
  orthonormal column by column (`orthonormal_columns`), and a column that the matrix does not
  fill (M of fewer directions than r: a vocab-parallel embedding shard's rows for the few
  tokens a batch holds) is dropped rather than normalised: what is left of it is the
  all-reduce's rounding, which differs with how the batch is split over the ranks, and
  normalised it chose the direction sent next (torch's hook keeps it: `torch.linalg.qr`). Its
  Q column restarts from the first Q's, so the result depends on the group's sum alone in
  every layout, to fp32 rounding. The
  residual e = M - P P^T M stays on the rank and is added to the next step's gradient (error
  feedback), so sum_t result_t + sum_r e_r,T = sum_t mean_r g_r,t exactly: nothing is lost,
  only delayed (but at a skipped step, a non-finite one or an fp16 overflow, whose state is
  dropped: `after_step`; the residuals follow fp16's loss scale). Vectors, and matrices that
  would not shrink ((n + m) r >= n m), go uncompressed in fp32.

A compressor reduces whatever group it is handed a bucket for, and keeps its state (residual,
Q) per parameter: under expert parallelism the experts' buckets come with the
expert-data-parallel group (`buckets.GradBuckets`), so an expert's factors are summed over the
ranks holding that expert, its residual stays on its rank, and its Q is warm-started within
that group; the dense buckets' over cp x dp. A one-rank group (the experts' at dp == ep) is not
handed over: there is nothing to reduce, and its gradient stays exact.

Compressed reductions run when a bucket is ready, synchronously (no overlap with the rest of
the backward); `none` keeps the asynchronous all-reduce.
"""

from __future__ import annotations

import itertools
import zlib

import torch
import torch.distributed as dist

GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")

FP16_TARGET = 2.0**15
"""fp16: the scaled dp sum's largest magnitude stays below this (fp16's max is 65504)."""


def fp16_scale(amax: torch.Tensor, dp: int) -> torch.Tensor:
    """The power of two S (float32, on `amax`'s device) that keeps the dp sum of a bucket whose
    largest |g| over the group is `amax` below `FP16_TARGET`: 2^floor(log2(target / (amax dp)))
    (`frexp`'s exponent, exact), 1 where that product is 0 or not finite. Computed on the
    device: reading `amax` on the host would wait for the device inside the backward."""
    top = amax.double() * dp
    exponent = torch.frexp(FP16_TARGET / top).exponent - 1  # target / top = m 2^e, m in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(top), exponent)
    return torch.where(torch.isfinite(top) & (top > 0), scale, torch.ones_like(top)).float()


class CastCompressor:
    """fp16 / bf16 cast-before-reduce (fp16 with a shared power-of-two scale)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def after_step(self, skipped: bool, rescale: float) -> None:
        """Stateless: nothing to do after a step (`PowerSGDCompressor.after_step`)."""

    def reduce(self, flat: torch.Tensor, params, group) -> int:
        dp = dist.get_world_size(group)
        scale: torch.Tensor | float = 1.0
        sent = 0
        if self.dtype == torch.float16:
            amax = flat.abs().max().float().reshape(1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            sent += amax.numel() * amax.element_size()
            scale = fp16_scale(amax, dp)
        narrow = (flat * scale).to(self.dtype)
        dist.all_reduce(narrow, group=group)
        flat.copy_(narrow.float() / scale)
        return sent + narrow.numel() * narrow.element_size()


class PowerSGDCompressor:
    """Rank-`rank` PowerSGD with error feedback; state per parameter (residual, Q)."""

    def __init__(self, rank: int = 4, seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.seed = rank, seed
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self.first_qs: dict[int, torch.Tensor] = {}
        self.names: dict[int, str] = {}

    def name_params(self, named) -> None:
        """Seed each parameter's first Q by its canonical name: `named` the stage's (name,
        parameter) pairs (a tied copy takes the name it is tied to, so both copies of a tied
        embedding start from the same Q). Unnamed parameters are seeded by their place in
        their bucket."""
        for name, p in named:
            self.names[id(p)] = getattr(p, "tied_to", None) or name

    def _matrix_shape(self, p: torch.Tensor) -> tuple[int, int] | None:
        if p.dim() < 2:
            return None
        n, m = p.shape[0], p.numel() // p.shape[0]
        return (n, m) if (n + m) * self.rank < n * m else None

    def initial_q(self, place: str | int, n: int, m: int) -> torch.Tensor:
        """The first Q (m x rank) of an n x m matrix: the same on every rank of the group,
        seeded by the compressor's seed, the parameter's canonical name (`name_params`; or
        its index in its bucket, an int) and the shape."""
        salt = zlib.crc32(place.encode()) if isinstance(place, str) else place
        gen = torch.Generator().manual_seed(self.seed * 100003 + salt * 7919 + n * 31 + m)
        return torch.randn(m, self.rank, generator=gen)

    @torch.no_grad()
    def after_step(self, skipped: bool, rescale: float) -> None:
        """After the step's skip decision and loss-scale update (`TrainStep.step`, every
        rank). A skipped step's state is dropped: an overflow's inf reached every rank's
        residuals and Q through the P all-reduce, and would make every later step non-finite,
        so the next step starts as the first did (Q re-seeded, no residual; what the residuals
        held is lost with the skipped step). `rescale` (the new loss scale over the one the
        step ran with) puts the residuals, kept in the loss scale's units, into the next
        step's."""
        if skipped:
            self.errors.clear()
            self.qs.clear()
        elif rescale != 1.0:
            for error in self.errors.values():
                error.mul_(rescale)

    @torch.no_grad()
    def reduce(self, flat: torch.Tensor, params, group) -> int:
        """Reduce the bucket `flat` in place; its products in fp32 whatever the step's autocast
        (the buckets reduce during the backward, inside it: fp16 products of loss-scaled
        gradients overflow)."""
        with torch.autocast(flat.device.type, enabled=False):
            return self._reduce(flat, params, group)

    def _reduce(self, flat: torch.Tensor, params, group) -> int:
        views: list[tuple[int, torch.Tensor, tuple[int, int], str | int]] = []
        plain: list[tuple[int, torch.Tensor, None, int]] = []
        offset = 0
        for i, p in enumerate(params):
            piece = flat[offset : offset + p.numel()]
            shape = self._matrix_shape(p)
            if shape:
                views.append((id(p), piece, shape, self.names.get(id(p), i)))
            else:
                plain.append((id(p), piece, shape, i))
            offset += p.numel()
        sent = 0
        if plain:
            rest = torch.cat([piece for _, piece, _, _ in plain])
            dist.all_reduce(rest, group=group)
            sent += rest.numel() * rest.element_size()
            start = 0
            for _, piece, _, _ in plain:
                piece.copy_(rest[start : start + piece.numel()])
                start += piece.numel()
        if not views:
            return sent
        views.sort(key=lambda view: view[2][0])  # (stable) P's of n rows side by side in p_flat
        groups = [(n, len(list(run))) for n, run in itertools.groupby(v[2][0] for v in views)]
        ms, ps = [], []
        for key, piece, (n, m), place in views:
            mat = piece.view(n, m)
            if key in self.errors:
                mat.add_(self.errors[key])
            if key not in self.first_qs:
                self.first_qs[key] = self.initial_q(place, n, m).to(mat)
            if key not in self.qs:
                self.qs[key] = self.first_qs[key].clone()
            ms.append(mat)
            ps.append(mat @ self.qs[key])
        p_flat = torch.cat([p.reshape(-1) for p in ps])
        dist.all_reduce(p_flat, group=group)
        sent += p_flat.numel() * p_flat.element_size()
        orth: list[torch.Tensor] = []
        lives: list[torch.Tensor] = []
        qs, start = [], 0
        for n, count in groups:  # the matrices of n rows orthonormalised together
            stack, live = orthonormal_columns(
                p_flat[start : start + count * n * self.rank].view(count, n, self.rank)
            )
            start += count * n * self.rank
            orth += stack.unbind(0)
            lives += live.unbind(0)
        for (key, _, _, _), mat, p in zip(views, ms, orth):
            qs.append(mat.t() @ p)
            self.errors[key] = mat - p @ (p.t() @ mat)  # the part of M this rank could not send
        q_flat = torch.cat([q.reshape(-1) for q in qs])
        dist.all_reduce(q_flat, group=group)
        sent += q_flat.numel() * q_flat.element_size()
        start = 0
        for (key, _, (_n, m), _), mat, p, live in zip(views, ms, orth, lives):
            q = q_flat[start : start + m * self.rank].view(m, self.rank)
            start += m * self.rank
            mat.copy_(p @ q.t())
            self.qs[key] = torch.where(live, q, self.first_qs[key])  # a dropped column restarts
        return sent


def orthonormal_columns(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P (n x r, or a stack of them: ... x n x r) with orthonormal columns spanning what P's
    columns span, in order (Gram-Schmidt, each projection applied twice, enough in floating
    point), and which columns live: a column whose part outside the columns before it is at
    most n * eps * its matrix's largest column norm (the rounding of a column that lies in
    their span, the bound numpy's `matrix_rank` takes) is zero in the result and False in the
    mask (... x r). Both stay on P's device (no host sync)."""
    n, r = p.shape[-2:]
    norms = torch.linalg.vector_norm(p, dim=-2)
    tol = n * torch.finfo(p.dtype).eps * norms.amax(dim=-1, keepdim=True)
    cols: list[torch.Tensor] = []
    lives: list[torch.Tensor] = []
    for j in range(r):
        c = p[..., j : j + 1]
        if cols:
            before = torch.cat(cols, dim=-1)
            for _ in range(2):
                c = c - before @ (before.transpose(-2, -1) @ c)
        norm = torch.linalg.vector_norm(c, dim=-2, keepdim=True)
        live = norm > tol[..., None]
        cols.append(torch.where(live, c / torch.where(live, norm, 1.0), 0.0))
        lives.append(live[..., 0, 0])
    return torch.cat(cols, dim=-1), torch.stack(lives, dim=-1)


def make_compressor(kind: str, powersgd_rank: int = 4, seed: int = 0):
    """The compressor for --grad-compression (None for "none")."""
    if kind == "none":
        return None
    if kind in ("fp16", "bf16"):
        return CastCompressor(torch.float16 if kind == "fp16" else torch.bfloat16)
    if kind == "powersgd":
        return PowerSGDCompressor(powersgd_rank, seed)
    raise ValueError(f"unknown --grad-compression {kind!r}; expected one of {GRAD_COMPRESSIONS}")
