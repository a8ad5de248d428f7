"""ZeRO-3 (FSDP-style): each unit's parameters (`zero3_units.py`) sharded over the
data-parallel group, gathered for each use and freed after it; also the stage's grad sync.

Hooks attached from outside the model (the model knows nothing of this):

- forward: the chunk's pre-hook gathers the root and prefetches the first block; a block's
  pre-hook waits for its own gather and starts the next block's (async, overlapped with this
  block's compute); its post-hook frees it. After the chunk's forward the embedding unit is
  freed, and the *tail* (the root's final norm and head, or the whole root where it is not
  split) too unless a backward of the chunk's output is to come: that backward reads it
  first, so it stays gathered until then (FSDP2 keeps its root so: one gather of the tail
  per micro-batch, not two).
- backward: a hook on the unit's output gradient (it fires before the unit's backward runs)
  gathers the unit again and prefetches the block before it; an identity autograd function on
  the block's input frees the block once its input gradient is computed (nothing after that
  reads the weights: a weight gradient reads the activations only). When the chunk's backward
  starts the tail is waited for and the chunk's last block prefetched (its gather overlaps
  the head's backward). Where the root is split, the tail is freed once the backward has
  passed the last block, and the *embedding* prefetched when the first block's backward
  starts and waited for at its input gradient (a LayerNorm after the embedding reads its
  weight; an embedding's backward reads none). Both are freed when the micro-batch's
  backward ends.
- a recomputed forward (full recomputation) runs inside backward: the unit is gathered then,
  and its hooks neither free nor prefetch.

`keep=True` (``--zero3-keep-params``, torchtitan's ``reshard_after_forward=False``): a unit,
once gathered, stays gathered until the step's `finish()`: one gather per unit and step
instead of two per micro-batch, at the price of the stage's whole parameters during the step.

Under expert parallelism (`expert_group` given) a block's expert parameters are a unit of
their own, sharded over the expert-data-parallel group (`zero3_units.UnitMaker`) and led by
the block's unit: every gather, prefetch and release of the block takes both, the block's first
and its experts' second, the same on every rank, so each group's collectives are issued in the
same order on all its ranks. Where that group is one rank (ep = cp x dp) the experts'
units are whole (`Unit.resident`): their gathers and frees do nothing and their gradients
accumulate in their shards, with no collective (`zero3_units.py`).

Gradients (`zero3_grads.UnitGradSync`, which this class is): each unit's full gradient is
reduce-scattered over its unit's group, once a step or per micro-batch (--zero3-reduce), in a
fixed launch order; gathers are issued in program order.

Traffic per step without pp (m micro-batches): 2 m all-gathers of every unit but the tail
(m), and one reduce-scatter, m per micro-batch; with `keep`, one all-gather per unit.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from megapar import device as _device
from megapar.data_parallel.zero3_float8 import Float8Gather, float8_weights
from megapar.data_parallel.zero3_grads import REDUCES as REDUCES
from megapar.data_parallel.zero3_grads import UnitGradSync
from megapar.data_parallel.zero3_half import HalfGather, half_weights
from megapar.data_parallel.zero3_units import (
    FreeAfterBackward,
    Shards,
    Unit,
    UnitMaker,
    in_backward,
    stage_units,
)
from megapar.tensor_parallel.fp8 import Fp8WeightCache
from megapar.tensor_parallel.partition import is_shared_embedding


def split_tied(stage: nn.Module) -> bool:
    """Whether `stage` holds a tied word embedding (or its copy) that another pipeline stage or
    model chunk holds too (pp > 1: a chunk that does not both embed and end in the head),
    which its units then lay out alone (`UnitMaker.tied_apart`)."""
    chunks = list(getattr(stage, "chunks", [stage]))
    shared = any(is_shared_embedding(p) for p in stage.parameters())
    return shared and any(not (c.pre_process and c.post_process) for c in chunks)


class ShardedParams(UnitGradSync):
    """The units of a stage (`stage.chunks` or the stage itself), sharded over `group` (and
    the expert parameters over `expert_group`), with their hooks; also the stage's grad sync
    (ZeRO-3's kind of the `GradSync` protocol, `UnitGradSync`)."""

    HOST_PIECE_MB = 16.0
    """gloo: a unit whose slice is larger than this is gathered and reduce-scattered
    synchronously, this many MB of each rank's slice at a time through a staging buffer (gloo
    holds up to two copies of a collective's whole buffer until it is waited for). NCCL runs
    every collective in place, whole."""

    def __init__(
        self,
        stage: nn.Module,
        group,
        average_over: int | None = None,
        keep: bool = False,
        persist_below: int = 0,
        offload: bool = False,
        reduce: str = "step",
        expert_group=None,
        float8: bool = False,
        half: torch.dtype | None = None,
    ):
        """`persist_below`: parameters with fewer elements go into one *persistent* unit of
        the stage, gathered at the stage's first forward of a step and kept until the step
        ends (DeepSpeed's stage3_param_persistence_threshold: biases and norms are not
        gathered per use). `offload` (--offload-params): each unit's shard is held in host
        memory and copied to a device staging shard for each gather (`Unit.host_shard`).
        `reduce` (--zero3-reduce, `REDUCES`): as `UnitGradSync`'s. `expert_group` (expert
        parallelism: `Mesh.expert_dp_group`): the group the expert parameters are sharded
        over (None: they are sharded over `group` with the others). `float8`: the weights of
        the stage's tensorwise float8 linears gather in float8 during a step (`step_scope`,
        `zero3_float8.py`). `half` (bf16 / fp16: the autocast dtype): the other linears of the
        blocks gather in it during a step (`zero3_half.py`); None: in fp32. A tied word
        embedding or its copy on a stage of several (`split_tied`) is a unit of its own
        (`UnitMaker.tied_apart`)."""
        dense = Shards.of(group)
        self.group, self.dp, self.dp_rank = group, dense.size, dense.rank
        self.keep = keep
        self.persist_below = persist_below
        self.offload = offload
        experts = Shards.of(expert_group) if expert_group is not None else None
        weights8 = float8_weights(stage) if float8 else {}
        weights16 = half_weights(stage) if half is not None else {}
        maker = UnitMaker(dense, experts, offload, weights8, weights16, half, split_tied(stage))
        made = stage_units(stage, maker, persist_below)
        self.chunks, self.roots, self.first = made.chunks, made.roots, made.first
        self.persistent = made.persistent
        """The unit of the parameters under `persist_below` elements (None: none)."""
        if not made.units:
            raise ValueError("--zero 3: the stage has no trainable parameters to shard")
        super().__init__(made.units, average_over or self.dp, reduce)
        self.host_waits = _device.polls_host(self.params[0].device)
        self.piece = (
            int(self.HOST_PIECE_MB * 2**20) // self.params[0].element_size()
            if self.host_waits
            else None
        )
        """Elements per synchronous piece of a large unit's collectives (gloo), else None."""
        tp_group = next((spec.group for spec in weights8.values()), None)
        self.float8 = Float8Gather(self.units, tp_group)
        """The float8 units and their step (`step_scope`); none unless `float8`."""
        self.half = HalfGather(self.units)
        """The 16-bit units and their step (`step_scope`); none unless `half`."""
        self._attach_hooks()

    # the optimizer's view (ZeroOptimizer.state_tensors reads these) ------------------------
    @property
    def buckets(self) -> list[Unit]:
        """The units, as the optimizer reads `GradBuckets.buckets`."""
        return self.units

    def reduced_part(self, param: nn.Parameter) -> torch.Tensor:
        """What this rank holds of `param`'s reduced gradient once `finish` returned, in
        place: its unit's gradient shard, `param` being the unit's only parameter (the tied
        embedding's, made so at pp > 1: `split_tied`)."""
        u = self._unit_of[id(param)]
        if len(u.params) != 1:
            raise ValueError(
                f"ShardedParams.reduced_part: unit {u.name} holds {len(u.params)} parameters, "
                f"so its slices are not one parameter's; only the tied embedding's units "
                f"at pp > 1 (split_tied) hold one"
            )
        return u.grad_shard

    def shard_range(self, u: Unit) -> tuple[int, int]:
        """This rank's slice [lo, hi) of unit `u`'s flat buffer."""
        return u.lo, u.hi

    def gathered_bytes(self) -> int:
        """Bytes of the units' full buffers gathered now, 16-bit and float8 ones included,
        and of the shards the gathers in flight send that live only while they run (1 / dp of
        their buffers, made at the launch and freed when the gather is waited for): the 16-bit
        and float8 gathers' cast shards and, under --offload-params, an offloaded unit's device
        staging shard (copied in from its host shard). A `Unit.resident` unit's buffer is its
        shard, held between steps: not counted; nor is the slice a fp32 gather of a unit on
        the device sends (its shard, held anyway)."""
        return sum(
            u.full.untyped_storage().nbytes()
            + (
                0
                if u.cast is None
                else u.cast.full.untyped_storage().nbytes()
                + u.cast.shard.untyped_storage().nbytes()
            )
            + (0 if u.host_shard is None else u.shard.untyped_storage().nbytes())
            for u in self.units
            if not u.resident
        )

    @contextlib.contextmanager
    def step_scope(self, cache: Fp8WeightCache | None):
        """The context of one optimizer step's forwards and backwards: the 16-bit weights
        gathered in 16 bits inside (`HalfGather.step`), and with `cache` (--fp8) the float8
        weights in float8, their casts in `cache` (`Float8Gather.step`: collective;
        `cache.per_step()` with no float8 unit)."""
        with (
            self.half.step(),
            contextlib.nullcontext() if cache is None else self.float8.step(cache),
        ):
            yield

    def held_bytes(self) -> int:
        """Bytes of parameter and gradient shards this rank holds on its device between steps
        (without the parameter shards under --offload-params: those are in host memory)."""
        return sum(u.shard.untyped_storage().nbytes() + u.grad_shard.nbytes for u in self.units)

    # hooks ---------------------------------------------------------------------------------
    def _attach_hooks(self) -> None:
        me = weakref.ref(self)  # the modules hold the hooks: no cycle keeping the group alive

        def call(method, *args):
            obj = me()
            return None if obj is None else getattr(obj, method)(*args)

        for ci, chunk in enumerate(self.chunks):
            roots, first = self.roots[ci], self.first.get(ci)
            chunk.register_forward_pre_hook(
                lambda m, args, r=roots, f=first: call("_chunk_pre", r, f)
            )
            chunk.register_forward_hook(lambda m, args, out, r=roots: call("_chunk_post", r, out))
            tail, embed = roots
            if first is not None:
                last = first
                while last.next is not None:
                    last = last.next
                if tail is not None:
                    tail.last = last
                if embed is not None:
                    first.embedding = embed
                    last.tail = tail
        for u in self.units:
            if u.lead is None and u.module not in self.chunks and u is not self.persistent:
                u.module.register_forward_pre_hook(lambda m, args, u=u: call("_block_pre", u, args))
                u.module.register_forward_hook(
                    lambda m, args, out, u=u: call("_block_post", u, out)
                )
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p: call("_on_grad_ready", p))

    def gather(self, u: Unit | None) -> None:
        """Gather `u` and its experts' unit (both launched, then both waited for)."""
        if u is None:
            return
        for v in u.members():
            self._launch_gather(v)
        for v in u.members():
            v.wait_gather()

    def prefetch(self, u: Unit | None) -> None:
        """Launch the gathers of `u` and its experts' unit (waited for by `gather`)."""
        if u is not None:
            for v in u.members():
                self._launch_gather(v)

    def _launch_gather(self, v: Unit) -> None:
        if not v.gathered and v.handle is None:
            v.launch_gather(self.piece)

    def release(self, u: Unit | None) -> None:
        """Free `u` and its experts' unit (unless kept: `keep`, the persistent unit, or a
        gather in flight)."""
        if u is None or self.keep or u is self.persistent:
            return
        for v in u.members():
            if v.handle is None:
                v.free()

    def _chunk_pre(self, roots: tuple, first: Unit | None) -> None:
        for u in (self.persistent, *roots):  # the persistent unit: once per step
            self.gather(u)
        self.prefetch(first)

    def _chunk_post(self, roots: tuple, out) -> None:
        """The chunk's forward is done: the embedding unit is freed; the tail too, unless a
        backward of this output will run (it is the first unit that backward reads, so it
        stays gathered until then, as FSDP2 keeps its root: one gather of the tail per
        micro-batch, not two)."""
        tail, embed = roots
        backward = (
            torch.is_grad_enabled()
            and isinstance(out, torch.Tensor)
            and out.requires_grad
            and (tail or embed)
        )
        if backward:
            out.register_hook(lambda g: self._root_backward(tail, embed))
        else:
            self.release(tail)
        self.release(embed)

    def _root_backward(self, tail: Unit | None, embed: Unit | None) -> None:
        """The chunk's backward starts: the tail is gathered (kept since the forward) and the
        chunk's last block prefetched, so its gather overlaps the head's backward (the
        embedding unit is prefetched when the first block's backward starts); both roots are
        freed when the backward ends."""
        if tail is not None:
            self.gather(tail)
            self._grads(tail)
            self.prefetch(tail.last)
        if self.persistent is not None:
            self._grads(self.persistent)

        def done() -> None:
            self.release(tail)
            self.release(embed)

        torch.autograd.Variable._execution_engine.queue_callback(done)

    def _block_input_ready(self, u: Unit) -> None:
        """A block's input gradient is complete: free it; at the first block, gather the
        chunk's embedding unit for the embedding's backward."""
        self.release(u)
        if u.embedding is not None:
            self.gather(u.embedding)
            self._grads(u.embedding)

    def _block_pre(self, u: Unit, args: tuple):
        if in_backward():  # recomputation: gathered by the backward hook
            self.gather(u)
            return None
        self.gather(u)
        self.prefetch(u.next)
        if (
            torch.is_grad_enabled()
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].requires_grad
        ):
            return (FreeAfterBackward.apply(args[0], lambda: self._block_input_ready(u)), *args[1:])
        return None

    def _block_post(self, u: Unit, out):
        if in_backward():
            return None
        self.release(u)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: self._block_backward(u))
            if u.tail is not None:  # the tail's backward is done when this gradient is
                return FreeAfterBackward.apply(out, lambda: self.release(u.tail))
        return None

    def _block_backward(self, u: Unit) -> None:
        self.gather(u)
        self._grads(u)
        self.prefetch(u.prev if u.prev is not None else u.embedding)

    # checkpoints ---------------------------------------------------------------------------
    def held_weights(self) -> list[torch.Tensor]:
        """This rank's parameter shards (what it holds of the weights between steps; on the
        host under --offload-params)."""
        return [u.shard if u.host_shard is None else u.host_shard for u in self.units]

    @torch.no_grad()
    def host_params(
        self, keep_on: bool, keep_experts: bool | None = None
    ) -> dict[int, torch.Tensor]:
        """id(param) -> a host copy of the gathered parameter, one unit (with its experts'
        unit) gathered at a time (collective over the units' groups); copies of the units
        sharded over the dense group only where `keep_on` (the checkpoint writer), of the
        experts' units (under expert parallelism) only where `keep_experts` (the ranks that
        gather the experts whole over ep for the writer; default `keep_on`)."""
        keep_experts = keep_on if keep_experts is None else keep_experts
        out = {}
        for u in self.units:
            if u.lead is not None:  # gathered with its lead
                continue
            was = [v.gathered for v in u.members()]
            self.gather(u)
            for v, kept in zip(u.members(), was):
                if keep_on if v.group is self.group else keep_experts:
                    for p in v.params:
                        out[id(p)] = p.detach().to("cpu", copy=True)
                if not kept:
                    v.free()
        return out

    @contextlib.contextmanager
    def whole(self):
        """Every unit gathered inside (e.g. for loading weights into the parameters); on
        exit each rank's shard is taken from the (possibly rewritten) full parameters and the
        units are freed. Collective."""
        with torch.no_grad():
            for u in self.units:
                self.gather(u)
        try:
            yield
        finally:
            with torch.no_grad():
                for u in self.units:
                    u.keep_shard()
                    u.free()


class HostStage:
    """A stand-in for a ZeRO-3 stage when it is saved: the stage's config and its parameters'
    host copies (`ShardedParams.host_params`), with their attributes (``tp_dim``, ``tied_to``,
    ...); parameters without a copy (on ranks that do not write) are left out; buffers: the
    stage's own."""

    def __init__(self, stage: nn.Module, copies: dict[int, torch.Tensor]):
        self.config = stage.config
        self.named_buffers = stage.named_buffers  # ZeRO-3 shards no buffer
        self._named = []
        for name, p in stage.named_parameters():
            if id(p) in copies:
                t = copies[id(p)]
                t.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
                self._named.append((name, t))

    def named_parameters(self):
        return iter(self._named)
