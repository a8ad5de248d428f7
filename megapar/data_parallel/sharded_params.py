"""ZeRO-3 (FSDP-style): each unit's parameters sharded over the data-parallel group, gathered
for each use and freed after it.

A *unit* is a transformer block (`chunk.layers[i]`) or, per model chunk, the *root*: the rest
of the chunk (embedding, final norm, head; a tied weight once), split in two as below. Its
trainable parameters are laid out back to back in one flat fp32 buffer, zero-padded to a
multiple of the group size g (dp, or cp x dp under context parallelism); rank r keeps slice r
of it (`Unit.shard`, the fp32 master the optimizer steps) and the gradient of that slice
(`Unit.grad_shard`). Each ``param.data`` is a view into the unit's full buffer (`Unit.full`),
whose storage exists only while the unit is gathered (``untyped_storage().resize_(0)`` frees
it; autograd's saved references to the weights survive, and see the values again when the unit
is re-gathered into the same storage).

Hooks attached from outside the model (the model knows nothing of this):

- forward: the chunk's pre-hook gathers the root and prefetches the first block; a block's
  pre-hook waits for its own gather and starts the next block's (async, overlapped with this
  block's compute); its post-hook frees it. The root is freed after the chunk's forward.
- backward: a hook on the unit's output gradient (it fires before the unit's backward runs)
  gathers the unit again and prefetches the block before it; an identity autograd function on
  the block's input frees the block once its input gradient is computed (nothing after that
  reads the weights: a weight gradient reads the activations only). The root is gathered
  when the chunk's backward starts. Where the chunk has an `embed` module, the root is two
  units: the *tail* (final norm, head, a tied word embedding), freed once the backward has
  passed the last block, and the *embedding* (its own parameters), gathered when the backward
  reaches the first block (a LayerNorm after the embedding reads its weight; an embedding's
  backward reads none). Both are freed when the micro-batch's backward ends.
- a recomputed forward (full recomputation) runs inside backward: the unit is gathered then,
  and its hooks neither free nor prefetch.

`keep=True` (``--zero3-keep-params``, torchtitan's ``reshard_after_forward=False``): a unit,
once gathered, stays gathered until the step's `finish()`: one gather per unit and step
instead of two per micro-batch, at the price of the stage's whole parameters during the step.

Gradients: a unit's full gradient buffer (``.grad`` views) is made when its backward first
gathers it. With ``reduce="step"`` (--zero3-reduce step) it accumulates all micro-batches of
the step (ZeRO-2's "keep full gradients until the last one"); when every parameter of the unit
is final (the executor's grad-sync protocol, as `GradBuckets`: `begin_step`, `arm`,
`before_last_backward`, `grads_ready`, `finish`) it is divided by dp, reduce-scattered into
`grad_shard` (async) and freed once that is waited for: before the next unit's reduce-scatter
is launched (`MAX_REDUCES_IN_FLIGHT`, on gloo and NCCL alike), so the backward does not hold
the stage's whole gradient. With ``reduce="micro-batch"`` (DeepSpeed's stage 3) every
micro-batch's backward reduce-scatters each unit once its gradients are there, in rounds as
ZeRO-2's buckets (`_launch_round`), into a staging slice added into `grad_shard`; the next
micro-batch's backward makes a new buffer (after the previous round's reductions are waited
for). Gradients reported once per step (ZB-H1's W, the tied embedding over stages) hold their
units, and those after them in the round, until then. Units launch in a fixed order (the blocks from the last, then the root) whatever
order hooks fire in, and gathers are issued in program order, so every rank of the group
issues the same collectives in the same order (NCCL's rule). The root goes last and, with a
tied embedding over pipeline stages (`defer`), only after `before_reduce`.

`offload=True` (``--offload-params``, DeepSpeed's offload_param): each unit's shard is held in
host memory (`Unit.host_shard`, pinned on CUDA; on the CPU only with `HOST_COPIES_ENV`, else
nothing moves) and `Unit.shard` is a device staging buffer, filled from the host just before
each gather and freed once the gather is done; the optimizer steps the host shards
(`Zero3Optimizer` with offload).

Traffic per step without pp (m micro-batches): 2 m all-gathers of every unit and one
reduce-scatter (1.5x an all-reduce's bytes at m = 1), m per micro-batch; with `keep`, one
all-gather per unit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import nn

from megapar import device as _device
from megapar.mesh import group_size

REDUCES = ("step", "micro-batch")
"""--zero3-reduce: when each unit's gradient is reduce-scattered (`ShardedParams`)."""


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One gathered-together group of parameters (a block, or a chunk's root)."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], shards: int,
                 rank: int, offload: bool = False):
        self.name, self.module, self.params = name, module, params
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // shards) * shards
        """Elements of the flat buffer: numel rounded up to a multiple of the group size."""
        self.start = 0
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"--zero 3 unit {name} mixes parameter dtypes "
                             f"{sorted(map(str, dtypes))}")
        device = params[0].device
        size = self.padded // shards
        self.lo, self.hi = rank * size, (rank + 1) * size
        full = torch.zeros(self.padded, dtype=params[0].dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:
                full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
        self.shard = full[self.lo:self.hi].clone()
        """This rank's slice of the parameters (fp32 master, stepped by the optimizer)."""
        self.grad_shard = torch.zeros_like(self.shard)
        """This rank's slice of the dp-averaged gradient (written by the reduce-scatter)."""
        self.shard_nbytes = self.shard.untyped_storage().nbytes()
        self.host_shard: torch.Tensor | None = None
        """--offload-params (with separate host copies: on CUDA, or `HOST_COPIES_ENV`): the
        slice in host memory (pinned on CUDA), the weights the optimizer steps; `shard` is then
        a device staging buffer, its storage only there while the unit's gather runs."""
        if offload and _device.host_copies_wanted(device):
            self.host_shard = _device.host_buffer(self.shard)
            self.host_shard.copy_(self.shard)
            self.shard.untyped_storage().resize_(0)
        self.full = full
        """The gathered parameters; storage of size 0 while freed."""
        self.nbytes = full.untyped_storage().nbytes()
        offset = 0
        for p in params:
            p.data = full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.grad_full: torch.Tensor | None = None
        self.gathered, self.handle, self.reduce_handle = True, None, None
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
        """The first block of a split root: the embedding unit, gathered when this block's
        input gradient is complete."""
        self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def launch_gather(self, group, piece: int | None = None) -> None:
        """Start the all-gather of the unit into its full buffer (no-op when gathered).
        `piece`: gather synchronously, `piece` elements of each rank's slice at a time through
        a staging buffer (gloo, which copies whole buffers in flight: see `ShardedParams`)."""
        if self.gathered or self.handle is not None:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        if self.host_shard is not None:  # to the device staging shard first
            self.shard.untyped_storage().resize_(self.shard_nbytes)
            self.shard.copy_(self.host_shard, non_blocking=True)
        size = self.hi - self.lo
        if piece is None or size <= piece:
            self.handle = _all_gather(self.full, self.shard, group)
            return
        ranks = self.padded // size
        for j in range(0, size, piece):
            n = min(piece, size - j)
            stage = self.shard.new_empty(ranks * n)
            _all_gather(stage, self.shard[j:j + n], group).wait()
            self.full.view(ranks, size)[:, j:j + n].copy_(stage.view(ranks, n))
        self.gathered = True
        self._free_staging()

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, group,
                       piece: int | None = None):
        """Reduce-scatter the full gradient `flat` into `out` (this rank's slice): async
        (returns the work), or with `piece` synchronously through a staging buffer, as
        `launch_gather` (None)."""
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        size = self.hi - self.lo
        if piece is None or size <= piece:
            return fn(out, flat, group=group, async_op=True)
        ranks = self.padded // size
        for j in range(0, size, piece):
            n = min(piece, size - j)
            stage = flat.view(ranks, size)[:, j:j + n].reshape(-1)
            fn(out[j:j + n], stage, group=group, async_op=True).wait()
        return None

    def wait_gather(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self.gathered = True
            self._free_staging()

    def _free_staging(self) -> None:
        """--offload-params: free the device staging shard once its gather is done (the
        current stream is ordered after the gather)."""
        if self.host_shard is not None:
            self.shard.untyped_storage().resize_(0)

    def keep_shard(self) -> None:
        """Take this rank's slice of the gathered (possibly rewritten) parameters as its
        shard: the host shard under --offload-params."""
        held = self.shard if self.host_shard is None else self.host_shard
        held.copy_(self.full[self.lo:self.hi])

    def grads(self) -> torch.Tensor:
        """The full gradient buffer (made on first use in a step, holding any gradient
        autograd accumulated before; ``.grad`` views)."""
        if self.grad_full is None:
            self.grad_full = self.shard.new_zeros(self.padded)
            offset = 0
            for p in self.params:
                view = self.grad_full[offset:offset + p.numel()].view_as(p)
                if p.grad is not None:  # accumulated before the buffer was made
                    view.copy_(p.grad)
                p.grad = view
                offset += p.numel()
        return self.grad_full

    def adopt_replaced_grads(self) -> None:
        """A ``.grad`` autograd replaced instead of accumulating in place is copied in."""
        flat, offset = self.grads(), 0
        for p in self.params:
            view = flat[offset:offset + p.numel()]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            offset += p.numel()

    def take_grads(self) -> torch.Tensor:
        """The full gradient buffer (made if none, as `grads`), detached from the unit: the
        ``.grad`` are dropped and the next gradient goes into a new buffer."""
        flat = self.grads()
        self.grad_full = None
        for p in self.params:
            p.grad = None
        return flat


class _Reduction:
    """A unit's reduce-scatter in flight: holds the full gradient buffer it reads until it is
    waited for; `add_to`: the result lands in a staging slice, added into this tensor then
    (a reduce-scatter per micro-batch), else it was written in place."""

    def __init__(self, work, flat: torch.Tensor, staging: torch.Tensor | None = None,
                 add_to: torch.Tensor | None = None):
        self.work, self.flat, self.staging, self.add_to = work, flat, staging, add_to

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.add_to is not None:
            self.add_to.add_(self.staging)
        self.work = self.flat = self.staging = self.add_to = None


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, shard, group=group, async_op=True)


class _FreeAfterBackward(torch.autograd.Function):
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


class ShardedParams:
    """The units of a stage (`stage.chunks` or the stage itself), sharded over `group`, with
    their hooks; also the stage's gradient sync (the `GradBuckets` protocol, reduce-scatter)."""

    sharded = True
    MAX_REDUCES_IN_FLIGHT = 1
    """Reduce-scatters left in flight when the next unit's is launched: the older ones are
    waited for first and their full gradient buffers dropped, on every backend (FSDP2's
    default `reduce_scatter_max_input_buffers`: one reduce-scatter overlaps the backward of
    the unit before it). At most two units' full gradients are then alive from the reductions
    (the one in flight and the one being reduced next) besides those autograd is filling.
    gloo: it also bounds the copies of whole buffers gloo holds until a collective is waited
    for (see `GradBuckets`). NCCL: the wait only orders the current stream after the
    collective (no host sync); ProcessGroupNCCL keeps its own reference to the input until
    the work is waited for (its tensor stash, which replaced ``recordStream``), and the
    buffer dropped after the wait returns to the caching allocator on the current stream,
    so only work ordered after the reduce-scatter can reuse it."""
    HOST_PIECE_MB = 16.0
    """gloo: a unit whose slice is larger than this is gathered and reduce-scattered
    synchronously, this many MB of each rank's slice at a time through a staging buffer (gloo
    holds up to two copies of a collective's whole buffer until it is waited for: 2 x 0.6 GiB
    for GPT-2 124M's root unit at dp 2). NCCL runs every collective in place, whole."""

    def __init__(self, stage: nn.Module, group, average_over: int | None = None,
                 keep: bool = False, persist_below: int = 0, offload: bool = False,
                 reduce: str = "step"):
        """`persist_below`: parameters with fewer elements go into one *persistent* unit of
        the stage, gathered at the stage's first forward of a step and kept until the step
        ends (DeepSpeed's stage3_param_persistence_threshold: biases and norms are not
        gathered per use). `offload` (--offload-params): each unit's shard is held in host
        memory and copied to a device staging shard for each gather (`Unit.host_shard`).
        `reduce` (--zero3-reduce, `REDUCES`): "step" reduces each unit's gradient once, after
        the last micro-batch's backward; "micro-batch" in every micro-batch's backward."""
        if reduce not in REDUCES:
            raise ValueError(f"--zero3-reduce {reduce!r}: choose one of {', '.join(REDUCES)}")
        self.per_micro_batch = reduce == "micro-batch"
        """Reduce-scatter every micro-batch, into a staging slice added into `grad_shard`."""
        self.offload = offload
        self.group = group
        self.dp = group_size(group)
        self.dp_rank = dist.get_rank(group) if self.dp > 1 else 0
        self.average_over = average_over or self.dp
        self.keep = keep
        self.persist_below = persist_below
        self.chunks = list(getattr(stage, "chunks", [stage]))
        self.roots: dict[int, tuple[Unit | None, Unit | None]] = {}
        """Per chunk, its (tail, embedding) root units (either may be None)."""
        self.first: dict[int, Unit] = {}
        per_chunk: list[list[Unit]] = []
        for ci, chunk in enumerate(self.chunks):
            layers = getattr(chunk, "layers", None)
            blocks = list(layers.items()) if layers is not None else []
            made = [Unit(f"chunk {ci} layer {n}", b, ps, self.dp, self.dp_rank, self.offload)
                    for n, b in blocks if (ps := [p for p in b.parameters() if p.requires_grad
                                                  and p.numel() >= persist_below])]
            tail, embed = self._roots(ci, chunk, blocks, bool(made))
            self.roots[ci] = (tail, embed)
            for a, b in pairwise(made):
                a.next, b.prev = b, a
            if made:
                self.first[ci] = made[0]
            per_chunk.append([*reversed(made)] + [u for u in (embed, tail) if u is not None])
        small = [p for p in stage.parameters() if p.requires_grad and p.numel() < persist_below]
        self.persistent = Unit("persistent", stage, small, self.dp, self.dp_rank, self.offload) if small \
            else None
        """The unit of the parameters under `persist_below` elements (None: none)."""
        self.units: list[Unit] = [u for units in reversed(per_chunk) for u in units] + \
            ([self.persistent] if small else [])
        """Every unit, in the order their gradients reduce (later chunks, later blocks first;
        each chunk's root after its blocks)."""
        if not self.units:
            raise ValueError("--zero 3: the stage has no trainable parameters to shard")
        self.params = [p for u in self.units for p in u.params]
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self.host_waits = _device.polls_host(self.params[0].device)
        self.piece = int(self.HOST_PIECE_MB * 2**20) // self.params[0].element_size() \
            if self.host_waits else None
        """Elements per synchronous piece of a large unit's collectives (gloo), else None."""
        self.bytes_gathered = self.bytes_reduced = 0
        """Bytes this rank received from all-gathers (full buffers) / put into reduce-scatters."""
        self.active = self.in_step = False
        self._armed: set[int] = set()
        self._deferred_ok = False
        self.before_reduce = None
        self.next_launch = 0
        self._flight: list[Unit] = []
        """Units whose reduce-scatter is in flight, oldest first."""
        self._round = 0
        """Per micro-batch: the rounds (all non-deferred units reduced once) done this step."""
        self._handles = []
        self._attach_hooks()

    def _roots(self, ci: int, chunk: nn.Module, blocks: list, split: bool):
        """The chunk's parameters outside its blocks as (tail, embedding) units. With blocks
        and an `embed` module, the embedding's own parameters (not a tied word embedding the
        head reads) are a unit of their own, needed in backward only after the blocks' (a
        LayerNorm's weight; an embedding's backward reads no weight): the tail unit (final
        norm, head, tied weights) is freed once the backward has passed the last block, and
        the embedding unit is gathered when it reaches the first. Else one root unit."""
        inside = {id(p) for _, b in blocks for p in b.parameters()}
        root = [p for p in chunk.parameters() if p.requires_grad and id(p) not in inside
                and p.numel() >= self.persist_below]
        embed = getattr(chunk, "embed", None)
        own: set[int] = set()
        if split and isinstance(embed, nn.Module):
            tail_ids = {id(p) for name, m in chunk.named_children() if name not in
                        ("embed", "layers") for p in m.parameters()}
            tail_ids |= {id(p) for p in chunk.parameters(recurse=False)}
            own = {id(p) for p in embed.parameters() if id(p) not in tail_ids}
            if any(id(p) not in own for p in root):  # a tail: tied weights are read there
                own -= {id(p) for p in root if getattr(p, "shared_embedding", False)}
        pre = [p for p in root if id(p) in own]
        post = [p for p in root if id(p) not in own]
        def make(name: str, ps: list) -> Unit | None:
            return Unit(f"chunk {ci} {name}", chunk, ps, self.dp, self.dp_rank, self.offload) if ps else None
        return make("root", post), make("embedding", pre)

    # the optimizer's view (ZeroOptimizer.state_tensors reads these) ------------------------
    @property
    def buckets(self) -> list[Unit]:
        return self.units

    def shard_range(self, u: Unit) -> tuple[int, int]:
        return u.lo, u.hi

    def held_bytes(self) -> int:
        """Bytes of parameter and gradient shards this rank holds on its device between steps
        (without the parameter shards under --offload-params: they are in `host_bytes`)."""
        return sum(u.shard.untyped_storage().nbytes() + u.grad_shard.nbytes for u in self.units)

    def host_bytes(self) -> int:
        """Bytes of parameter shards this rank holds in host memory (--offload-params)."""
        return sum(u.host_shard.nbytes for u in self.units if u.host_shard is not None)

    # hooks ---------------------------------------------------------------------------------
    def _attach_hooks(self) -> None:
        me = weakref.ref(self)  # the modules hold the hooks: no cycle keeping the group alive

        def call(method, *args):
            obj = me()
            return None if obj is None else getattr(obj, method)(*args)

        for ci, chunk in enumerate(self.chunks):
            roots, first = self.roots[ci], self.first.get(ci)
            self._handles.append(chunk.register_forward_pre_hook(
                lambda m, args, r=roots, f=first: call("_chunk_pre", r, f)))
            self._handles.append(chunk.register_forward_hook(
                lambda m, args, out, r=roots: call("_chunk_post", r, out)))
            tail, embed = roots
            if first is not None and embed is not None:
                first.embedding = embed
                last = first
                while last.next is not None:
                    last = last.next
                last.tail = tail
        for u in self.units:
            if u.module not in self.chunks and u is not self.persistent:
                self._handles.append(u.module.register_forward_pre_hook(
                    lambda m, args, u=u: call("_block_pre", u, args)))
                self._handles.append(u.module.register_forward_hook(
                    lambda m, args, out, u=u: call("_block_post", u, out)))
            for p in u.params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda p: call("_on_grad_ready", p)))

    def gather(self, u: Unit | None) -> None:
        if u is None:
            return
        if not u.gathered and u.handle is None:
            self.bytes_gathered += u.nbytes
            u.launch_gather(self.group, self.piece)
        u.wait_gather()

    def prefetch(self, u: Unit | None) -> None:
        if u is not None and not u.gathered and u.handle is None:
            self.bytes_gathered += u.nbytes
            u.launch_gather(self.group, self.piece)

    def release(self, u: Unit | None) -> None:
        if u is not None and not self.keep and u.handle is None and u is not self.persistent:
            u.free()

    def _chunk_pre(self, roots: tuple, first: Unit | None) -> None:
        for u in (self.persistent, *roots):  # the persistent unit: once per step
            self.gather(u)
        self.prefetch(first)

    def _chunk_post(self, roots: tuple, out) -> None:
        tail, embed = roots
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad \
                and (tail or embed):
            out.register_hook(lambda g: self._root_backward(tail, embed))
        self.release(tail)
        self.release(embed)

    def _root_backward(self, tail: Unit | None, embed: Unit | None) -> None:
        """The chunk's backward starts: the tail is gathered (the embedding unit is, at the
        first block's input gradient); both are freed when the backward ends."""
        if tail is not None:
            self.gather(tail)
            self._grads(tail)
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
        if _in_backward():  # recomputation: gathered by the backward hook
            self.gather(u)
            return None
        self.gather(u)
        self.prefetch(u.next)
        if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) \
                and args[0].requires_grad:
            return (_FreeAfterBackward.apply(args[0], lambda: self._block_input_ready(u)),
                    *args[1:])
        return None

    def _block_post(self, u: Unit, out):
        if _in_backward():
            return None
        self.release(u)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: self._block_backward(u))
            if u.tail is not None:  # the tail's backward is done when this gradient is
                return _FreeAfterBackward.apply(out, lambda: self.release(u.tail))
        return None

    def _block_backward(self, u: Unit) -> None:
        self.gather(u)
        self._grads(u)
        self.prefetch(u.prev)

    def _grads(self, u: Unit) -> None:
        """Make `u`'s full gradient buffer for a backward (if it has none); reducing per
        micro-batch, the reduce-scatters still in flight from an earlier round are waited for
        first, so their buffers are gone before the next round's are made (a deferred unit's
        buffer, made once and kept over the step, waits for none)."""
        if u.grad_full is None and not u.deferred:
            for v in [v for v in self._flight if v.launched_round < self._round]:
                self._wait_reduce(v)
        u.grads()

    # checkpoints ---------------------------------------------------------------------------
    def held_weights(self) -> list[torch.Tensor]:
        """This rank's parameter shards (what it holds of the weights between steps; on the
        host under --offload-params)."""
        return [u.shard if u.host_shard is None else u.host_shard for u in self.units]

    @torch.no_grad()
    def host_params(self, keep_on: bool) -> dict[int, torch.Tensor]:
        """id(param) -> a host copy of the gathered parameter, one unit gathered at a time
        (collective over the group); copies only where `keep_on` (the checkpoint writer)."""
        out = {}
        for u in self.units:
            was = u.gathered
            self.gather(u)
            if keep_on:
                for p in u.params:
                    out[id(p)] = p.detach().to("cpu", copy=True)
            if not was:
                u.free()
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

    @torch.no_grad()
    def full_grads(self) -> dict[int, torch.Tensor]:
        """Tests: id(param) -> the dp-averaged full gradient (all-gathers the gradient
        shards; collective)."""
        out = {}
        for u in self.units:
            flat = torch.empty(u.padded, dtype=u.shard.dtype, device=u.shard.device)
            _all_gather(flat, u.grad_shard, self.group).wait()
            offset = 0
            for p in u.params:
                out[id(p)] = flat[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return out

    # the gradient-sync protocol (as GradBuckets) -------------------------------------------
    def defer(self, last: Iterable[nn.Parameter], before_reduce) -> None:
        """Units holding `last` (the tied embedding) reduce only in finish(), after
        `before_reduce()`; they are moved to the end of the launch order."""
        late = {id(p) for p in last}
        if before_reduce is None or not late:
            return
        self.before_reduce = before_reduce
        for u in self.units:
            u.deferred = any(id(p) in late for p in u.params)
        self.units = [u for u in self.units if not u.deferred] + \
            [u for u in self.units if u.deferred]

    def begin_step(self) -> None:
        for u in self.units:
            if u.reduce_handle is not None:
                raise RuntimeError("ShardedParams.begin_step() while a reduce-scatter of the "
                                   "previous step is in flight; call finish() first")
            u.ready.clear()
            if self.per_micro_batch:  # the step's reductions are added into the shards
                u.grad_shard.zero_()
        self.next_launch = self._round = 0
        self.active = self._deferred_ok = False
        self._armed.clear()
        self.in_step = True

    def arm(self, params: Iterable[nn.Parameter]) -> None:
        self._armed.update(id(p) for p in params)

    def before_last_backward(self) -> None:
        self.active = True

    def grads_ready(self, params: Iterable[nn.Parameter]) -> None:
        ready = [p for p in params if self._counts(p)]
        for p in ready:
            self._unit_of[id(p)].ready.add(id(p))
        if ready:
            self._launch_ready()

    def _counts(self, p: nn.Parameter) -> bool:
        """Whether `p`'s gradient, reported now, is ready for a reduction: per micro-batch
        any time in a step, else in the last backward (or its chunk's, once armed)."""
        return self.in_step and (self.per_micro_batch or self.active or id(p) in self._armed)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self._counts(p):
            self._unit_of[id(p)].ready.add(id(p))
            self._launch_ready()

    def _launch_ready(self) -> None:
        if self.per_micro_batch:
            return self._launch_round()
        while self.next_launch < len(self.units):
            u = self.units[self.next_launch]
            if len(u.ready) < len(u.params) or (u.deferred and not self._deferred_ok):
                return
            self._launch(u)
            self.next_launch += 1

    def _launch_round(self) -> None:
        """Per micro-batch: launch the non-deferred units in their order while the next one's
        gradients are all there (its ready set cleared); after the last a new round starts.
        A unit waiting for an earlier one keeps accumulating in its buffer (reduced later,
        whole), as ZeRO-2's buckets do."""
        rnd = [u for u in self.units if not u.deferred]
        while rnd:
            u = rnd[self.next_launch]
            if len(u.ready) < len(u.params):
                return
            u.ready.clear()
            self._launch(u)
            self.next_launch = (self.next_launch + 1) % len(rnd)
            self._round += self.next_launch == 0

    def _launch(self, u: Unit) -> None:
        """Reduce-scatter `u`'s full gradient into its shard (per micro-batch: into a staging
        slice added into it), once the reductions in flight are fewer than
        `MAX_REDUCES_IN_FLIGHT` (the oldest waited for, their buffers freed). The buffer is
        detached from the unit at once: a later backward makes a new one."""
        while self._flight and (len(self._flight) >= self.MAX_REDUCES_IN_FLIGHT
                                or u.reduce_handle is not None):
            self._wait_reduce(self._flight[0])
        u.adopt_replaced_grads()
        flat = u.take_grads()
        if self.average_over > 1:
            flat.div_(self.average_over)
        self.bytes_reduced += flat.nbytes
        staging = torch.empty_like(u.grad_shard) if self.per_micro_batch else None
        work = u.reduce_scatter(flat, u.grad_shard if staging is None else staging,
                                self.group, self.piece)
        u.reduce_handle = _Reduction(work, flat, staging,
                                     u.grad_shard if staging is not None else None)
        u.launched_round = self._round
        self._flight.append(u)

    def _wait_reduce(self, u: Unit) -> None:
        u.reduce_handle.wait()
        u.reduce_handle = None
        self._flight.remove(u)

    def finish(self) -> None:
        """Launch the units not launched yet (a unit without a backward this step reduces a
        zero gradient), wait for every reduce-scatter; with `keep`, free every unit."""
        if not self.in_step:
            raise RuntimeError("ShardedParams.finish() without begin_step()")
        self.active = self.in_step = False
        self._armed.clear()
        if self.per_micro_batch:
            self._finish_rounds()
        else:
            for u in self.units:
                u.ready.update(id(p) for p in u.params)
            self._launch_ready()
            if self.next_launch < len(self.units):
                self.before_reduce()
                self._deferred_ok = True
                self._launch_ready()
        while self._flight:
            self._wait_reduce(self._flight[0])
        for u in self.units:
            if u.handle is not None:  # a prefetch nothing used (cannot happen in a schedule)
                u.wait_gather()
            if u.gathered:
                u.free()

    def _finish_rounds(self) -> None:
        """Per micro-batch: reduce what accumulated since each unit's last reduction (the
        rest of the current round first, then the units before it; a unit without any
        gradient since is skipped: its share is in the shard already), then the deferred
        units after `before_reduce()`. Which units hold a gradient depends only on the model
        and the schedule, the same on every dp rank."""
        rnd = [u for u in self.units if not u.deferred]
        start = self.next_launch
        for u in rnd[start:] + rnd[:start]:
            if u.grad_full is not None or any(p.grad is not None for p in u.params):
                self._launch(u)
            u.ready.clear()
        deferred = [u for u in self.units if u.deferred]
        if deferred:
            self.before_reduce()
            for u in deferred:
                self._launch(u)


class HostStage:
    """A stand-in for a ZeRO-3 stage when it is saved: the stage's config and its parameters'
    host copies (`ShardedParams.host_params`), with their attributes (``tp_dim``, ``tied_to``,
    ...); parameters without a copy (on ranks that do not write) are left out."""

    def __init__(self, stage: nn.Module, copies: dict[int, torch.Tensor]):
        self.config = stage.config
        self._named = []
        for name, p in stage.named_parameters():
            if id(p) in copies:
                t = copies[id(p)]
                t.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
                self._named.append((name, t))

    def named_parameters(self):
        return iter(self._named)
