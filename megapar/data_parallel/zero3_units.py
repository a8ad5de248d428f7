"""ZeRO-3's units: a stage's parameters grouped into units, each laid out flat and sharded
over the data-parallel group (`ShardedParams` gathers and reduces them).

A *unit* is a transformer block (`chunk.layers[i]`) or, per model chunk, the *root*: the rest
of the chunk (embedding, final norm, head; a tied weight once), split in two where the chunk
has an `embed` module (`stage_units`): the *tail* (final norm, head, a tied word embedding)
and the *embedding* (its own parameters). Parameters under a size threshold may go into one
*persistent* unit of the stage instead. A unit's trainable parameters are laid out back to
back in one flat fp32 buffer, zero-padded to a multiple of the group size g (dp, or cp x dp
under context parallelism); rank r keeps slice r of it (`Unit.shard`, the fp32 master the
optimizer steps) and the gradient of that slice (`Unit.grad_shard`). Each ``param.data`` is a
view into the unit's full buffer (`Unit.full`), whose storage exists only while the unit is
gathered (``untyped_storage().resize_(0)`` frees it; autograd's saved references to the
weights survive, and see the values again when the unit is re-gathered into the same
storage).

Under expert parallelism (`stage_units` given the expert group) the expert parameters
(`megapar.expert_parallel.is_expert`) of a block (or a root) form a unit of their own, sharded
over the expert-data-parallel group (the ranks holding the same experts) instead of the
cp x dp group: the block's unit leads it (`Unit.experts`), gathered, freed and given gradient
buffers with it, dense first, then experts, on every rank.

A unit whose group is one rank (`Unit.alone`; under ep = cp x dp every experts' unit: each
rank holds experts no other rank holds) is kept whole, as FSDP keeps an unsharded parameter:
its shard is its full buffer and the parameters are views into it (`Unit.resident`), so its
gathers and frees do nothing and no second copy exists; its gradients accumulate straight into
`Unit.grad_shard` (`Unit.grads`), with no full gradient buffer and no reduce-scatter
(`UnitGradSync` divides them by dp as it does the reduced units'). Under --offload-params
(with host copies) its shard stays in host memory and a gather is a copy of it into the full
buffer, with no collective.

`offload=True` (``--offload-params``, DeepSpeed's offload_param): each unit's shard is held in
host memory (`Unit.host_shard`, pinned on CUDA; on the CPU only with `HOST_COPIES_ENV`, else
nothing moves) and `Unit.shard` is a device staging buffer, filled from the host just before
each gather and freed once the gather is done (a 16-bit unit in a step rounds the staging shard
into its 16-bit shard on the device and frees it before gathering: `zero3_half.HalfShard`); the
optimizer steps the host shards (`Zero3Optimizer` with offload).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapar import device as _device
from megapar.data_parallel.zero3_float8 import Float8Shard
from megapar.data_parallel.zero3_half import HalfShard
from megapar.expert_parallel import is_expert
from megapar.mesh import group_size
from megapar.tensor_parallel.partition import is_shared_embedding


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class Shards:
    """The group a unit's flat buffer is sharded over, as this rank sees it."""

    group: Any
    """The process group (None: this rank alone)."""
    size: int
    """Its ranks: the buffer is padded to a multiple of it, one slice each."""
    rank: int
    """This rank's index in it: the slice it keeps."""

    @classmethod
    def of(cls, group) -> Shards:
        """The shards of `group` (collective-free: reads its size and this rank's index)."""
        size = group_size(group)
        return cls(group, size, dist.get_rank(group) if size > 1 else 0)


class Unit:
    """One gathered-together group of parameters (a block, or a chunk's root), sharded over
    one group (`Shards`)."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[nn.Parameter],
        shards: Shards,
        offload: bool = False,
        cast=None,
    ):
        """`cast`: for a unit whose weights gather in the precision their matmuls read during
        a step, what makes its `CastShard` from (params, (lo, hi), padded): float8
        (`zero3_float8.Float8Shard`) or 16-bit (`zero3_half.HalfShard`); None: an fp32
        unit."""
        self.name, self.module, self.params = name, module, params
        self.group, self.group_size, self.group_rank = shards.group, shards.size, shards.rank
        """The group the unit is sharded, gathered and reduced over, its size and this rank's
        index in it (the names `Bucket` has)."""
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // shards.size) * shards.size
        """Elements of the flat buffer: numel rounded up to a multiple of the group size."""
        self.start = 0
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"--zero 3 unit {name} mixes parameter dtypes {sorted(map(str, dtypes))}"
            )
        device = params[0].device
        size = self.padded // shards.size
        self.lo, self.hi = shards.rank * size, (shards.rank + 1) * size
        full = torch.zeros(self.padded, dtype=params[0].dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:
                full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
        offloaded = offload and _device.host_copies_wanted(device)
        self.alone = shards.size == 1
        """The group is this rank alone (under ep = cp x dp, an experts' unit): there is
        nothing to gather or reduce. Its gradient accumulates straight into `grad_shard`
        (``.grad`` views; no full gradient buffer, no reduce-scatter: `UnitGradSync` divides
        it by dp at the step's end), and its gathers copy the host shard in (`resident`: none
        at all)."""
        self.resident = self.alone and not offloaded
        """`alone` and not offloaded: the parameters are views into the shard itself, which
        is the whole unit, never gathered or freed (FSDP's unsharded parameters)."""
        self.shard = full if self.resident else full[self.lo : self.hi].clone()
        """This rank's slice of the parameters (fp32 master, stepped by the optimizer)."""
        self.grad_shard = torch.zeros_like(self.shard)
        """This rank's slice of the dp-averaged gradient (written by the reduce-scatter; an
        `alone` unit's: accumulated into by autograd, divided by dp in place)."""
        self.shard_nbytes = self.shard.untyped_storage().nbytes()
        self.host_shard: torch.Tensor | None = None
        """--offload-params (with separate host copies: on CUDA, or `HOST_COPIES_ENV`): the
        slice in host memory (pinned on CUDA), the weights the optimizer steps; `shard` is then
        a device staging buffer, its storage only there while the unit's gather runs."""
        if offloaded:
            self.host_shard = _device.host_buffer(self.shard)
            self.host_shard.copy_(self.shard)
            self.shard.untyped_storage().resize_(0)
        self.full = full
        """The gathered parameters; storage of size 0 while freed."""
        self.nbytes = full.untyped_storage().nbytes()
        offset = 0
        for p in params:
            p.data = full[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.grad_full: torch.Tensor | None = None
        self.gathered, self.handle = True, None
        self.reduce_handle: Reduction | None = None
        self.launched_round = 0
        """The round (micro-batch) of the step its last reduce-scatter was launched in."""
        self.ready: set[int] = set()
        self.deferred = False
        self.prev: Unit | None = None
        self.next: Unit | None = None
        self.tail: Unit | None = None
        """The last block of a split root: the tail unit, freed after this block's output
        gradient is complete."""
        self.embedding: Unit | None = None
        """The first block of a split root: the embedding unit, prefetched when this block's
        backward starts and waited for when its input gradient is complete."""
        self.last: Unit | None = None
        """The tail of a split root: the chunk's last block, prefetched when the chunk's
        backward starts."""
        self.experts: Unit | None = None
        """Under expert parallelism: the unit of this module's expert parameters (over the
        expert-data-parallel group), gathered, freed and given gradient buffers with this
        one; None: none."""
        self.tied: list[Unit] = []
        """At pp > 1 (`UnitMaker.tied_apart`): the units of this module's tied word embedding
        or its copy, one parameter each, so that the first and the last stage cut it into the
        same slices (`pipeline.tied.equal_tied_grads`); gathered, freed and given gradient
        buffers with this one."""
        self.casts: list[Unit] = []
        """The units of this module's weights gathered in their matmuls' precision during a
        step (its 16-bit and its float8 weights: `zero3_half.py`, `zero3_float8.py`),
        gathered, freed and given gradient buffers with this one."""
        self.lead: Unit | None = None
        """The unit this one is one of the `casts` or the `experts` of (None: it leads
        itself)."""
        self.cast = None if cast is None else cast(params, (self.lo, self.hi), self.padded)
        """A cast unit's shard and buffer in its weights' matmul precision (a `CastShard`:
        `zero3_float8.Float8Shard`, `zero3_half.HalfShard`); None: fp32 only."""
        self.free()

    def members(self) -> list[Unit]:
        """This unit, its cast units, its tied embedding's and its experts' unit (those it
        has): what a gather or a release of it takes, in this order on every rank."""
        experts = [self.experts] if self.experts is not None else []
        return [self, *self.casts, *self.tied, *experts]

    @property
    def in_cast(self) -> bool:
        """A cast unit inside a step: its gathers move its `cast` precision's bytes."""
        return self.cast is not None and self.cast.active

    def free(self) -> None:
        """Free the full buffer's storage (a `resident` unit keeps it: it is the shard) and a
        cast unit's cast buffer."""
        if self.resident:
            return
        if not self.full.untyped_storage().resizable():  # shared with numpy: never resized
            self._rebind_full()
        self.full.untyped_storage().resize_(0)
        if self.cast is not None:
            self.cast.full.untyped_storage().resize_(0)
        self.gathered = False

    def _rebind_full(self) -> None:
        """Give the parameters a new full buffer to be views of: a parameter read with
        ``.numpy()`` while whole (`ShardedParams.whole`) made the old one's storage
        unresizable for good, so it could never be freed again; numpy's arrays keep it."""
        full = torch.empty(self.padded, dtype=self.full.dtype, device=self.full.device)
        offset = 0
        for p in self.params:
            p.data = full[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.full = full

    def launch_gather(self, piece: int | None = None) -> None:
        """Start the all-gather of the unit over its group into its full buffer (no-op when
        gathered).
        `piece`: gather synchronously, `piece` elements of each rank's slice at a time through
        a staging buffer (gloo, which copies whole buffers in flight: see `ShardedParams`)."""
        if self.gathered or self.handle is not None:
            return
        if self.in_cast:  # in the matmuls' precision: the fp32 buffer stays freed
            c = self.cast
            assert c is not None
            c.full.untyped_storage().resize_(c.nbytes)
            if self.host_shard is None:
                c.cast(self.shard)
            else:  # --offload-params: the fp32 host shard up to the staging shard, rounded
                self.shard.untyped_storage().resize_(self.shard_nbytes)  # there, then freed
                self.shard.copy_(self.host_shard, non_blocking=True)
                c.cast(self.shard)
                self.shard.untyped_storage().resize_(0)  # stream-ordered after the cast
            per = None if piece is None else piece * self.full.element_size() // c.itemsize
            self.handle = _gather_into(c.full, c.shard, self.group, per)
            if self.handle is None:
                self.gathered = True
                c.drop_shard()
            return
        self.full.untyped_storage().resize_(self.nbytes)
        if self.alone:  # offloaded (a resident unit is always gathered): the host shard is all
            assert self.host_shard is not None
            self.full.copy_(self.host_shard, non_blocking=True)
            self.gathered = True
            return
        if self.host_shard is not None:  # to the device staging shard first
            self.shard.untyped_storage().resize_(self.shard_nbytes)
            self.shard.copy_(self.host_shard, non_blocking=True)
        self.handle = _gather_into(self.full, self.shard, self.group, piece)
        if self.handle is None:
            self.gathered = True
            self._free_staging()

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, piece: int | None = None):
        """Reduce-scatter the full gradient `flat` over the unit's group into `out` (this
        rank's slice): async (returns the work), or with `piece` synchronously through a
        staging buffer, as `launch_gather` (None)."""
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        size, group = self.hi - self.lo, self.group
        if piece is None or size <= piece:
            return fn(out, flat, group=group, async_op=True)
        ranks = self.padded // size
        for j in range(0, size, piece):
            n = min(piece, size - j)
            stage = flat.view(ranks, size)[:, j : j + n].reshape(-1)
            fn(out[j : j + n], stage, group=group, async_op=True).wait()
        return None

    def settle(self) -> None:
        """Wait for a gather in flight and free the unit: a cast unit at a step's start or end,
        whose next gather is in the other precision."""
        self.wait_gather()
        self.free()

    def wait_gather(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self.gathered = True
            self._free_staging()

    def _free_staging(self) -> None:
        """Free what a gather sent once it is done (the current stream is ordered after the
        gather): the device staging shard under --offload-params, a cast shard."""
        if self.host_shard is not None:
            self.shard.untyped_storage().resize_(0)
        if self.cast is not None:
            self.cast.drop_shard()

    def keep_shard(self) -> None:
        """Take this rank's slice of the gathered (possibly rewritten) parameters as its
        shard: the host shard under --offload-params (a `resident` unit's parameters are its
        shard already)."""
        if self.resident:
            return
        held = self.shard if self.host_shard is None else self.host_shard
        held.copy_(self.full[self.lo : self.hi])

    def grads(self) -> torch.Tensor:
        """The full gradient buffer (made on first use in a step, holding any gradient
        autograd accumulated before; ``.grad`` views); an `alone` unit's is its `grad_shard`
        (no second buffer: the ``.grad`` views pointed into it, where they are not)."""
        if self.alone:
            self._point_grads(self.grad_shard)
            return self.grad_shard
        if self.grad_full is None:
            self.grad_full = self.shard.new_zeros(self.padded)
            self._point_grads(self.grad_full)
        return self.grad_full

    def _point_grads(self, flat: torch.Tensor) -> None:
        """Point each ``.grad`` at its view of `flat`, copying in a gradient autograd put
        elsewhere (accumulated before the buffer was made, or replaced)."""
        offset = 0
        for p in self.params:
            view = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
            offset += p.numel()

    def adopt_replaced_grads(self) -> None:
        """A ``.grad`` autograd replaced instead of accumulating in place is copied in."""
        self._point_grads(self.grads())

    def take_grads(self) -> torch.Tensor:
        """The full gradient buffer (made if none, as `grads`), detached from the unit: the
        ``.grad`` are dropped and the next gradient goes into a new buffer."""
        flat = self.grads()
        self.grad_full = None
        for p in self.params:
            p.grad = None
        return flat


class Reduction:
    """A unit's reduce-scatter in flight: holds the full gradient buffer it reads until it is
    waited for; `add_to`: the result lands in a staging slice, added into this tensor then
    (a reduce-scatter per micro-batch), else it was written in place."""

    def __init__(
        self,
        work,
        flat: torch.Tensor,
        staging: torch.Tensor | None = None,
        add_to: torch.Tensor | None = None,
    ):
        self.work = work
        self.flat: torch.Tensor | None = flat
        self.staging, self.add_to = staging, add_to

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.add_to is not None:
            assert self.staging is not None  # given with `add_to`
            self.add_to.add_(self.staging)
        self.work = self.flat = self.staging = self.add_to = None


def _gather_into(full: torch.Tensor, shard: torch.Tensor, group, piece: int | None):
    """All-gather every rank's `shard` into `full` over `group`: async (returns the work), or
    with `piece` synchronously, `piece` elements of each shard at a time through a staging
    buffer (returns None)."""
    size = shard.numel()
    if piece is None or size <= piece:
        return all_gather(full, shard, group)
    ranks = full.numel() // size
    for j in range(0, size, piece):
        n = min(piece, size - j)
        stage = shard.new_empty(ranks * n)
        all_gather(stage, shard[j : j + n], group).wait()
        full.view(ranks, size)[:, j : j + n].copy_(stage.view(ranks, n))
    return None


def all_gather(output: torch.Tensor, shard: torch.Tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, shard, group=group, async_op=True)


class FreeAfterBackward(torch.autograd.Function):
    """Identity on a block's input; its backward (the block's input gradient is complete)
    frees the block."""

    @staticmethod
    def forward(ctx, x, release):
        ctx.release = release
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.release()
        return grad, None


@dataclass(frozen=True)
class UnitMaker:
    """How a stage's units are made: the groups they are sharded over, where the shards are
    held, and which weights are gathered in their matmuls' precision during a step."""

    dense: Shards
    """The group of every parameter but the experts' (cp x dp)."""
    experts: Shards | None = None
    """Under expert parallelism, the group of the expert parameters (the expert-data-parallel
    group); None: they go with the others."""
    offload: bool = False
    """--offload-params: each shard held in host memory (`Unit.host_shard`)."""
    float8: dict = field(default_factory=dict)
    """id(weight) -> `Fp8Spec` of the weights gathered in float8 during a step
    (`zero3_float8.float8_weights`); empty: none."""
    half: dict = field(default_factory=dict)
    """id(weight) -> the linear that reads it, for the weights gathered in the autocast dtype
    during a step (`zero3_half.half_weights`); empty: none."""
    half_dtype: torch.dtype | None = None
    """That autocast dtype (bf16 / fp16) where `half` has weights."""
    tied_apart: bool = False
    """At pp > 1: the tied word embedding and its copy (`is_shared_embedding`) each form a
    unit of their own, led by the unit they would be in, so both ends shard them alike."""

    def unit(self, name: str, module: nn.Module, params: list) -> Unit | None:
        """The unit of `params` (None if there are none). Under expert parallelism the
        expert parameters among them form a unit of their own over the experts' group; the
        16-bit weights (`half`) and the float8 weights (`float8`) one each over the dense
        group, and with `tied_apart` each tied embedding (or copy) one; the unit of the others
        leads them (or the first of those there is)."""
        split = self.experts is not None
        moe = [p for p in params if split and is_expert(p)]
        dense = [p for p in params if not (split and is_expert(p))]
        sharded = self.dense.size > 1
        f8 = [p for p in dense if sharded and id(p) in self.float8]
        hf = [p for p in dense if sharded and id(p) in self.half and id(p) not in self.float8]
        shared = [p for p in dense if self.tied_apart and is_shared_embedding(p)]
        cast_ids = {id(p) for p in f8 + hf + shared}
        rest = [p for p in dense if id(p) not in cast_ids]
        experts = half = fp8 = None
        if moe and self.experts is not None:
            experts = Unit(f"{name} experts", module, moe, self.experts, self.offload)
        if hf:
            linears, dtype = [self.half[id(p)] for p in hf], self.half_dtype

            def half_cast(ps, rng, n):
                return HalfShard(ps, linears, dtype, rng, n)

            half = Unit(f"{name} {dtype}", module, hf, self.dense, self.offload, half_cast)
        if f8:
            specs = [self.float8[id(p)] for p in f8]

            def float8_cast(ps, rng, n):
                return Float8Shard(ps, specs, rng, n)

            fp8 = Unit(f"{name} float8", module, f8, self.dense, self.offload, float8_cast)
        tied = [Unit(f"{name} tied", module, [p], self.dense, self.offload) for p in shared]
        others = Unit(name, module, rest, self.dense, self.offload) if rest else None
        parts = [u for u in (others, half, fp8, *tied, experts) if u is not None]
        if not parts:
            return None
        lead = parts[0]
        for u in parts[1:]:
            u.lead = lead
        lead.casts = [u for u in (half, fp8) if u is not None and u is not lead]
        lead.tied = [u for u in tied if u is not lead]
        lead.experts = experts if experts is not lead else None
        return lead


@dataclass
class StageUnits:
    """A stage's units, as `stage_units` makes them."""

    chunks: list[nn.Module]
    """The stage's model chunks (`stage.chunks`, or the stage itself)."""
    roots: dict[int, tuple[Unit | None, Unit | None]]
    """Per chunk, its (tail, embedding) root units (either may be None)."""
    first: dict[int, Unit]
    """Per chunk with blocks, its first block's unit."""
    persistent: Unit | None
    """The unit of the parameters under `persist_below` elements (None: none)."""
    units: list[Unit]
    """Every unit, in the order their gradients reduce (later chunks, later blocks first;
    each chunk's root after its blocks; the persistent unit last; a unit's experts just
    before it: in a block's backward the experts' gradients are final first)."""


def stage_units(stage: nn.Module, make: UnitMaker, persist_below: int = 0) -> StageUnits:
    """The units of `stage`, made by `make`: one per block with parameters of at least
    `persist_below` elements, each chunk's roots (`chunk_roots`), and one persistent unit of
    the smaller ones; blocks linked to their neighbours. The units named here lead (their
    experts' units, under expert parallelism, go with them)."""
    chunks = list(getattr(stage, "chunks", [stage]))
    roots: dict[int, tuple[Unit | None, Unit | None]] = {}
    first: dict[int, Unit] = {}
    per_chunk: list[list[Unit]] = []
    for ci, chunk in enumerate(chunks):
        layers = getattr(chunk, "layers", None)
        blocks = list(layers.items()) if layers is not None else []
        made = [
            u
            for n, b in blocks
            if (u := make.unit(f"chunk {ci} layer {n}", b, _at_least(b, persist_below)))
        ]
        tail, embed = chunk_roots(ci, chunk, blocks, bool(made), make, persist_below)
        roots[ci] = (tail, embed)
        for a, b in pairwise(made):
            a.next, b.prev = b, a
        if made:
            first[ci] = made[0]
        per_chunk.append([*reversed(made)] + [u for u in (embed, tail) if u is not None])
    small = [p for p in stage.parameters() if p.requires_grad and p.numel() < persist_below]
    persistent = make.unit("persistent", stage, small)
    leads = [u for units in reversed(per_chunk) for u in units] + (
        [persistent] if persistent is not None else []
    )
    units = [v for u in leads for v in reversed(u.members())]
    return StageUnits(chunks, roots, first, persistent, units)


def _at_least(module: nn.Module, persist_below: int) -> list[nn.Parameter]:
    """`module`'s trainable parameters of at least `persist_below` elements."""
    return [p for p in module.parameters() if p.requires_grad and p.numel() >= persist_below]


def chunk_roots(
    ci: int, chunk: nn.Module, blocks: list, split: bool, make: UnitMaker, persist_below: int
) -> tuple[Unit | None, Unit | None]:
    """The chunk's parameters outside its blocks as (tail, embedding) units. With blocks
    and an `embed` module, the embedding's own parameters (not a tied word embedding the
    head reads) are a unit of their own, needed in backward only after the blocks' (a
    LayerNorm's weight; an embedding's backward reads no weight): the tail unit (final
    norm, head, tied weights) is freed once the backward has passed the last block, and
    the embedding unit is gathered when it reaches the first. Else one root unit."""
    inside = {id(p) for _, b in blocks for p in b.parameters()}
    every = [p for p in _at_least(chunk, 0) if id(p) not in inside]
    root = [p for p in every if p.numel() >= persist_below]
    embed = getattr(chunk, "embed", None)
    own: set[int] = set()
    if split and isinstance(embed, nn.Module):
        tail_ids = {
            id(p)
            for name, m in chunk.named_children()
            if name not in ("embed", "layers")
            for p in m.parameters()
        }
        tail_ids |= {id(p) for p in chunk.parameters(recurse=False)}
        own = {id(p) for p in embed.parameters() if id(p) not in tail_ids}
        # a tail (a head, even one whose parameters all persist): tied weights are read there,
        # in its backward too, after the embedding unit is freed
        if any(id(p) not in own for p in every):
            own -= {id(p) for p in root if is_shared_embedding(p)}
    pre = [p for p in root if id(p) in own]
    post = [p for p in root if id(p) not in own]
    tail = make.unit(f"chunk {ci} root", chunk, post)
    return tail, make.unit(f"chunk {ci} embedding", chunk, pre)
