"""ZeRO stages 1 and 2 as Megatron's distributed optimizer: state and updates sharded by buffer
slice (stage 1), and the reduced gradients too (stage 2, DeepSpeed's ZeRO-2).

The gradients live in `Zero1Buckets`' flat buffer (one per dtype, cut into buckets; its grad
sync, `data_parallel/zero_buckets.py`): every bucket is zero-padded to a multiple of dp and
reduce-scattered, so dp rank r gets the dp-averaged gradient of the r-th equal slice of each
bucket (one contiguous slice of the buffer when there is one bucket). Slices are element ranges,
cut inside parameters. The parameters themselves are moved into a flat parameter buffer with
the same layout (each ``param.data`` becomes a view into it), so per step:

1. reduce-scatter each gradient bucket (overlapped with the last backward, in `Zero1Buckets`);
2. the global gradient norm (clipping, non-finite check) from the local slices: a squared sum
   all-reduced over tp x pp and over dp, each parameter counted once (`clip.py`'s rule);
3. AdamW (or LAMB / LARS / SGD) on this rank's *pieces* (the parts of parameters inside its
   slices): views into the parameter buffer, with views into the gradient buffer as ``.grad``;
   optimizer state exists only for the pieces (1/dp of it, up to padding);
4. all-gather each parameter bucket in place, so every rank has the full weights (the 16-bit
   buckets in 16 bits, below).

Traffic per step: one reduce-scatter and one all-gather of the padded buffer, the same as one
all-reduce (less the 16-bit buckets' half).

Stage 2 (`stage=2`): `Zero2Buckets` keeps only this rank's slices of the reduced gradients
(`Zero2Buckets.shards`, reduce-scattered every micro-batch and accumulated there); the pieces'
``.grad`` are views into them, and everything above runs on them unchanged. Traffic per step:
m reduce-scatters of the buffer (the deferred tied-embedding bucket once) and one all-gather.

Parameters are fp32 in every precision (autocast casts on the fly), so the parameter buffer is
also the fp32 master: each rank's own slices of it are exact fp32 at all times.

16-bit all-gather (`half`, under bf16 / fp16: `TrainConfig.zero12_half`), as Megatron's
distributed optimizer gathers bf16 parameters and FSDP2 with ``param_dtype=torch.bfloat16``: the
blocks' non-float8 column- and row-parallel linear weights (`zero3_half.half_weights`, experts'
left out) fill buckets of their own (`Bucket.half`). After a step each rank rounds its slice of
such a bucket to the autocast dtype, the ranks all-gather the 16-bit values (half the bytes),
and each copies the others' slices into its fp32 buffer, keeping its own exact
(`_gather_half`). Those copies hold the rounded values, and that is all a step or an
evaluation reads of them: under autocast a linear multiplies by its weight cast to the 16-bit
dtype, the cast of a rounded value is bit for bit the cast of the exact one (rounding twice to
the same format rounds once), and the weight gradient does not depend on the weight. Whatever
reads whole parameters outside a step (checkpoints, exports, `Engine.params_whole`) calls
`exact_params` first: one fp32 all-gather restores the exact values everywhere, as each rank's
own slice is exact. Every other bucket (norms, biases, embeddings, the head, float8 linears,
experts) gathers fp32.

LAMB / LARS need norms of whole parameters: each piece's squared sums are all-reduced over dp
(one small tensor, two entries per parameter), then over tp for tp-sharded parameters. Under
expert parallelism that one sum serves the experts too: an expert parameter (the stacked
[E, ...] experts) is split over the ep group by experts and each ep rank's part sliced over the
expert-data-parallel group, and ep x expert dp is the dp (x cp) group, so the sum over it adds
every element of the stacked tensor once: the one process's norm, whose ratio the whole
stacked tensor shares.

Muon needs whole matrices: `zero_muon.py` makes them from the pieces, all-gathered so that every
rank orthogonalises every matrix, or (`muon_distributed`) sent to one owner per matrix and back.

Checkpoints keep the canonical format: `state_tensors()` gathers each bucket's slices to rank 0
of the bucket's group (dp rank 0, the rank that writes the shard file, for dense buckets;
expert-data-parallel rank 0 for expert buckets, whose experts the checkpoint then gathers over
ep), a bucket at a time through host memory; `load_state_tensors` takes each rank's slices out
of the full per-parameter tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, NoReturn, overload

import torch
import torch.distributed as dist
from torch import nn

from megapar.comm_count import issued_for
from megapar.data_parallel import shard_comm
from megapar.data_parallel.buckets import slice_pieces
from megapar.mesh import all_reduce, group_size
from megapar.optim.clip import (
    is_counted,
    norm_of,
    scale_to,
    squares_each,
    squares_of,
)
from megapar.optim.optimizer import AdamWOptimizer, step_state
from megapar.optim.trust_ratio import sum_where
from megapar.optim.zero_muon import MuonPlan, muon_split, muon_whole, plan_muon


class ZeroOptimizer(AdamWOptimizer):
    """The distributed optimizer; `attach(grad_sync, ...)` (done by `TrainStep`) must be called
    before the first step when dp > 1. With dp == 1 it is the plain optimizer."""

    zero = 1

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        dp_group,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        kind: str = "adamw",
        tp_group=None,
        stage: int = 1,
        offload: bool = False,
        momentum: float = 0.9,
        muon_adjust_lr: str = "match_rms_adamw",
        muon_ns_dtype: torch.dtype = torch.bfloat16,
        muon_distributed: bool = False,
    ):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer stage must be 1 or 2, got {stage}")
        self.zero = stage
        """1: optimizer state sharded over dp; 2: the reduced gradients too (`attach`)."""
        self.group, self.tp_group = dp_group, tp_group
        self.dp = group_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group) if self.dp > 1 else 0
        self.sharded = False
        self.pieces: list[torch.Tensor] = []
        """This rank's parameter pieces (views into the parameter buffer; ``.grad`` set)."""
        self._piece_of: list[tuple[nn.Parameter, int, int]] = []
        """(parameter, start, end) in the parameter's flattened elements, per piece."""
        self._offset: dict[int, int] = {}
        """id(parameter) -> its offset inside its bucket."""
        self._pending: dict | None = None
        self.grad_sync: Any = None
        """The sharded grad sync attached (`Zero1Buckets` / `Zero2Buckets`, ZeRO-3's
        `ShardedParams`); None before `attach`."""
        self.param_buffers: dict[torch.dtype, torch.Tensor] = {}
        self.half: torch.dtype | None = None
        """The dtype the 16-bit buckets (`Bucket.half`: the blocks' linear weights) are
        all-gathered in after a step (the grad sync's `half`, the autocast dtype); None: every
        bucket gathers fp32."""
        self.muon_distributed = muon_distributed
        """Muon: each whole matrix orthogonalised by one rank of the dp group
        (`zero_muon.muon_split`), not by every rank (`zero_muon.muon_whole`)."""
        self.muon_plan: MuonPlan | None = None
        """The distributed Muon's assignment and exchange indices (`zero_muon.plan_muon`, at
        attach)."""
        self.rounded = False
        """Other ranks' slices of the 16-bit buckets hold their 16-bit-rounded values (since
        the last step's gather); `exact_params` gathers them in fp32 again."""
        super().__init__(
            named_params,
            lr,
            weight_decay,
            betas,
            eps,
            kind,
            tp_group,
            momentum=momentum,
            offload=offload,
            muon_adjust_lr=muon_adjust_lr,
            muon_ns_dtype=muon_ns_dtype,
        )

    def owned_params(self) -> list[nn.Parameter]:
        """Parameters this rank updates (a slice of): all with dp == 1, none before attach."""
        if self.dp == 1:
            return self.params
        return list({id(p): p for p, _, _ in self._piece_of}.values())

    # setup ----------------------------------------------------------------------------------
    @torch.no_grad()
    def attach(self, grad_sync, last: Iterable[nn.Parameter] = (), before_reduce=None) -> None:
        """Shard this optimizer over dp as `grad_sync` (the `Zero1Buckets` / `Zero2Buckets` of
        this stage's parameters, `build_grad_sync`) shards the gradients: parameters move into
        a flat buffer laid out like the gradient buffer. `last` / `before_reduce`: the
        tied-embedding sync, deferred by `grad_sync.defer`."""
        if self.dp == 1 or self.sharded:
            return
        self._check_sync(grad_sync)
        grad_sync.defer(last, before_reduce)
        self.grad_sync, self.sharded = grad_sync, True
        self.half = grad_sync.half
        device = self.params[0].device
        self.param_buffers = {
            dt: torch.zeros(n, dtype=dt, device=device)
            for dt, n in grad_sync.buffer_sizes().items()
        }
        for b in grad_sync.buckets:
            lo, hi = grad_sync.shard_range(b)
            pflat = self.param_buffers[b.params[0].dtype][b.start : b.start + b.padded]
            offset = 0
            for p in b.params:
                self._offset[id(p)] = offset
                view = pflat[offset : offset + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
                offset += p.numel()
            for i, start, end in slice_pieces([p.numel() for p in b.params], lo, hi):
                p = b.params[i]
                at = self._offset[id(p)]
                piece = pflat[at + start : at + end]
                piece.grad = (
                    b.flat[at + start : at + end]
                    if b.shard is None
                    else b.shard[at + start - lo : at + end - lo]
                )
                self.pieces.append(piece)
                self._piece_of.append((p, start, end))
        self._build_inner()
        if self._pending is not None:
            self.load_state_tensors(self._pending)
            self._pending = None

    def _watched(self, stepped: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each piece's parameter: a checkpoint or weights loaded into it write through the
        parameter, whose version counter is its own, not the pieces' (views of the buffer).
        ZeRO-3's pieces are its shards', which such a load writes itself: None."""
        if not self.sharded or self.zero == 3:
            return None
        param_of = {id(t): p for t, (p, _, _) in zip(self.pieces, self._piece_of)}
        return [param_of[id(t)] for t in stepped]

    def _check_sync(self, grad_sync) -> None:
        """`grad_sync` must be the sharded grad sync of this stage's parameters over the same
        group, for this optimizer's stage."""
        if (
            grad_sync is None
            or not grad_sync.sharded
            or grad_sync.stage != self.zero
            or grad_sync.dp != self.dp
        ):
            raise ValueError(
                f"the ZeRO-{self.zero} optimizer needs the ZeRO-{self.zero} grad "
                f"sync of its dp group (build_grad_sync(..., zero={self.zero}))"
            )
        if {id(p) for p in grad_sync.params} != {id(p) for p in self.params}:
            raise ValueError(
                f"{type(grad_sync).__name__} and the optimizer hold different parameters"
            )

    def _build_inner(self) -> None:
        groups, self._inner_group_of = [], []
        for i, g in enumerate(self.param_groups):
            members = {id(p) for p in g["params"]}
            pieces = [t for t, (p, _, _) in zip(self.pieces, self._piece_of) if id(p) in members]
            if pieces:
                muon = {"muon": g["muon"]} if "muon" in g else {}
                groups.append(
                    {"params": pieces, "lr": g["lr"], "weight_decay": g["weight_decay"], **muon}
                )
                self._inner_group_of.append(i)
        self.inner = self._make_inner(groups) if groups else None
        if self.inner is not None and hasattr(self.inner, "norms"):
            self.inner.norms = self._full_norms
        if self.kind == "muon" and self.muon_distributed:
            self.muon_plan = plan_muon(self)
        if self.inner is not None and hasattr(self.inner, "whole"):
            self.inner.whole = partial(muon_split if self.muon_plan else muon_whole, self)
        self.allocate_state()  # into the room the parameters moved out of

    # step -----------------------------------------------------------------------------------
    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        if self.dp > 1 and not self.sharded:
            raise RuntimeError(
                "ZeroOptimizer.step() before attach(grad_sync): the distributed "
                "optimizer needs the dp gradient buffer (TrainStep attaches it)"
            )
        if self.sharded and self.inner is None and self.kind in ("lamb", "lars"):
            self._full_norms([], [])  # own nothing, but the norm all-reduces are collective
        if self.sharded and self.inner is None and self.kind == "muon":
            # own nothing, but Muon's gathers / exchanges are collective
            with issued_for("muon"):
                (muon_split if self.muon_plan else muon_whole)(self, [], [])
        super().step(closure)

    @torch.no_grad()
    def _after_step(self) -> None:
        """All-gather every parameter bucket in place: each rank contributes its slice, the
        16-bit buckets' rounded to `half` (their other slices then hold rounded values)."""
        if self.sharded:
            self._gather(self.param_buffers, self.half)
            self.rounded = self.half is not None and any(b.half for b in self.grad_sync.buckets)

    @torch.no_grad()
    def exact_params(self) -> None:
        """Make every rank's parameters exact fp32 again where the last step gathered them in
        16 bits: one fp32 all-gather of the 16-bit buckets (each rank's own slices are exact;
        the other buckets are already). For whatever reads whole parameters outside a step
        (checkpoints, exports, the finiteness check); collective over the dp group, a no-op
        (no communication) where nothing is rounded, the same on every rank."""
        if not self.rounded:
            return
        self._gather(self.param_buffers, only=[b for b in self.grad_sync.buckets if b.half])
        self.rounded = False

    def _gather(
        self, buffers: dict[torch.dtype, torch.Tensor], half=None, only: list | None = None
    ) -> None:
        """All-gather each bucket of `buffers` (or the buckets `only`) in place; with `half`, a
        dtype, the 16-bit buckets (`Bucket.half`) in that dtype (`_gather_half`). On gloo,
        which holds a bucket-sized copy per all-gather until it is waited for, at most
        `Zero1Buckets.MAX_COPIES_IN_FLIGHT` are in flight, and a large bucket goes in pieces
        (`shard_comm.all_gather`); elsewhere at most `HALF_BUFFERS_IN_FLIGHT` 16-bit buffers."""
        host = self.grad_sync.host_waits
        bound = self.grad_sync.MAX_COPIES_IN_FLIGHT if host else None
        halves = self.grad_sync.MAX_COPIES_IN_FLIGHT if host else self.HALF_BUFFERS_IN_FLIGHT
        handles: list[Any] = []
        for b in self.grad_sync.buckets if only is None else only:
            flat = buffers[b.params[0].dtype][b.start : b.start + b.padded]
            sixteen = half is not None and b.half
            if bound is not None and len(handles) >= bound:
                handles.pop(0).wait()
            while sixteen and sum(isinstance(h, _HalfGathered) for h in handles) >= halves:
                handles.pop(0).wait()
            if sixteen:
                handles.append(self._gather_half(b, flat, half, host))
            else:
                handles.append(shard_comm.all_gather(flat, b.group_size, b.group, host))
        for h in handles:
            h.wait()

    HALF_BUFFERS_IN_FLIGHT = 2
    """At most this many 16-bit gather buffers (each half its bucket's fp32 bytes) are alive
    at a time (on gloo: `Zero1Buckets.MAX_COPIES_IN_FLIGHT`). They live after the step, when
    autocast's 16-bit copies of the same weights (held through the forwards and backwards, at
    least as many bytes) are freed."""

    def _gather_half(self, b, flat: torch.Tensor, half: torch.dtype, host: bool):
        """Start the 16-bit all-gather of bucket `b` (`flat`: its range of the fp32 parameter
        buffer): this rank's slice rounded to `half` (as autocast's cast rounds it) into a
        bucket-sized 16-bit buffer, gathered there; waiting the handle copies the other ranks'
        slices into `flat` (this rank's stays exact: the master) and frees the buffer."""
        lo, hi = self.grad_sync.shard_range(b)
        wire = torch.empty(b.padded, dtype=half, device=flat.device)
        wire[lo:hi].copy_(flat[lo:hi])
        work = shard_comm.all_gather(wire, b.group_size, b.group, host)
        return _HalfGathered(work, wire, flat, lo, hi)

    @torch.no_grad()
    def sum_partial_over_tp(self, tp_group) -> int:
        """Sum the gradient pieces of parameters whose gradients are partial over tp (sequence
        parallelism's replicated parameters, replicated kv heads) over the tp group, in one
        all-reduce, after the dp reduction (the sum is linear): for the grad syncs whose
        reduced gradients are only this rank's slices (ZeRO-2, ZeRO-3). Every tp rank has the
        same bucket (unit) layout, so its pieces line up. Returns the pieces summed."""
        if group_size(tp_group) == 1 or not self.sharded:
            return 0
        grads = [
            _grad(t)
            for t, (p, _, _) in zip(self.pieces, self._piece_of)
            if getattr(p, "sequence_parallel", False)
        ]
        flat = (
            torch.cat([g.reshape(-1) for g in grads])
            if grads
            else torch.zeros(0, device=self.param_buffers[next(iter(self.param_buffers))].device)
        )
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return len(grads)

    def grad_tensors(self) -> Sequence[torch.Tensor]:
        """Tensors whose ``.grad`` this rank's step reads (for the fp16 unscale / inf check)."""
        return self.pieces if self.sharded else self.params

    @torch.no_grad()
    def clip_grad_norm(self, mesh, max_norm: float) -> float:
        """Global gradient norm from the local slices (all-reduce over tp x pp, then dp), each
        parameter counted once as in `clip.py`; clip the local slices to max_norm."""

        counted = [
            _grad(t) for t, (p, _, _) in zip(self.pieces, self._piece_of) if is_counted(p, mesh)
        ]
        total = squares_of(counted, mesh.device)
        all_reduce(total, mesh.mp_group)
        all_reduce(total, self.group)
        norm = norm_of(total)
        scale_to(max_norm, norm, [_grad(t) for t in self.pieces])
        return norm

    def _full_norms(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], pieces: list[torch.Tensor]
    ) -> list[tuple[float, float]]:
        """LAMB / LARS: (||a||, ||b||) over whole parameters for each piece pair (collective
        over dp and tp: one row per parameter of the stage; an expert's row sums its slices
        over expert dp and its experts over ep, together the dp group)."""
        row = {id(p): i for i, p in enumerate(self.params)}
        param_of = {id(t): p for t, (p, _, _) in zip(self.pieces, self._piece_of)}
        device = self.param_buffers[next(iter(self.param_buffers))].device
        sq = torch.zeros(len(self.params), 2, dtype=torch.float64, device=device)
        rows = [row[id(param_of[id(t)])] for t in pieces]
        if pairs:
            each = squares_each([x for pair in pairs for x in pair]).view(-1, 2)
            for k, i in enumerate(rows):  # in order (a parameter's slices are few)
                sq[i] += each[k]
        dist.all_reduce(sq, group=self.group)
        sharded = [getattr(p, "tp_dim", None) is not None for p in self.params]
        sq = sum_where(sq, sharded, self.tp_group)
        norms = sq.sqrt().float().tolist()
        return [(norms[i][0], norms[i][1]) for i in rows]

    # checkpoints ----------------------------------------------------------------------------
    @torch.no_grad()
    def state_tensors(self, copy: bool = True) -> dict[str, dict[str, torch.Tensor]]:
        """Every non-tied parameter's full (local tp / pp / ep shard) state, in host memory, on
        rank 0 of the group its bucket is sharded over: dp rank 0 (cp rank 0) for the dense
        parameters, expert-data-parallel rank 0 for the experts' (under ep, the ranks of the
        checkpoint writer's ep group, `checkpoint.stage_tensors.expert_blocks`); absent
        elsewhere ({} on ranks that are rank 0 of no group). Collective over every bucket's
        group. Sharded, the state is always gathered into host copies (`copy` matters only
        unsharded).

        One bucket and one state key at a time: each rank's slice of the bucket is gathered to
        its group's rank 0 into one bucket-sized buffer on the device, copied to the host and
        freed, so a save needs one bucket of device memory on top of training, never the
        stage's whole state (3-4x the fp32 parameters)."""
        if not self.sharded:
            return super().state_tensors(copy)
        names = {id(p): n for n, p in self._checkpointed()}
        piece = {id(p): (t, s, e) for t, (p, s, e) in zip(self.pieces, self._piece_of)}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for b in self.grad_sync.buckets:
            for key in self.state_keys:
                if not any(key in self.keys_of(p) for p in b.params):
                    continue  # Muon's: no parameter of the bucket has this state
                host = self._gather_state(b, key, piece)
                for p in b.params:
                    if host is not None and id(p) in names and key in self.keys_of(p):
                        at = self._offset[id(p)]
                        view = host[at : at + p.numel()].view_as(p).clone()
                        out.setdefault(names[id(p)], {})[key] = view
        return out

    def _gather_state(self, b, key: str, piece: dict) -> torch.Tensor | None:
        """State `key` of bucket `b` (padded, flat) in host memory on rank 0 of the bucket's
        group, gathered from every rank's slice; None on the group's other ranks. `piece`:
        {id(parameter): (the piece this rank steps, its start, its end)}."""
        lo, hi = self.grad_sync.shard_range(b)
        dtype = b.params[0].dtype
        device = self.param_buffers[dtype].device
        group, size, rank = b.group, b.group_size, b.group_rank  # a bucket's or unit's own
        first = rank == 0
        parts = [
            torch.zeros(hi - lo, dtype=dtype, device=device) for _ in range(size if first else 1)
        ]
        mine = parts[0]  # rank 0's own slice is gathered in place
        for p in b.params:
            if id(p) in piece:
                assert self.inner is not None  # it steps this piece
                t, s, e = piece[id(p)]
                state = self.inner.state.get(t, {}).get(key)
                if state is not None:
                    at = self._offset[id(p)] + s - lo
                    mine[at : at + e - s] = state.reshape(-1)
        root = dist.get_global_rank(group, 0)
        dist.gather(mine, parts if first else None, dst=root, group=group)
        return torch.cat([part.cpu() for part in parts]) if first else None

    def _held_state(self) -> list[tuple[nn.Parameter, dict]]:
        if not self.sharded:
            return super()._held_state()
        if self.inner is None:  # no piece: it owns nothing
            return []
        return [
            (p, {**self.inner.state[t], "elements": (s, e)})
            for t, (p, s, e) in zip(self.pieces, self._piece_of)
            if t in self.inner.state
        ]

    def _hold_state(self, p: nn.Parameter, state: dict) -> None:
        if not self.sharded:
            return super()._hold_state(p, state)
        state = dict(state)
        elements = tuple(state.pop("elements", ()))
        for t, (q, s, e) in zip(self.pieces, self._piece_of):
            if q is p and elements == (s, e):
                assert self.inner is not None  # it steps this piece
                self.inner.state[t] = {
                    k: v.to(t.device) if k != "step" else v for k, v in state.items()
                }
                return
        raise ValueError(
            "the optimizer state_dict holds another slice of a parameter than "
            "this rank's (another dp size or ZeRO layout); load megapar "
            "checkpoints with engine.load instead"
        )

    @torch.no_grad()
    def load_state_tensors(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load canonical per-parameter state: each rank keeps its slices of it."""
        if not self.sharded:
            if self.dp > 1:
                self._pending = d  # applied by attach()
                return
            return super().load_state_tensors(d)
        if self.inner is None:
            return
        names = {id(p): n for n, p in self.named}
        for t, (p, s, e) in zip(self.pieces, self._piece_of):
            name = names[id(p)]
            entry = self._checked_entry(d, name, p)
            state = (
                {"step": step_state(self.inner, self.num_steps, p)} if self.counts_steps(p) else {}
            )
            for k, full in entry.items():
                state[k] = full.reshape(-1)[s:e].to(device=t.device, dtype=t.dtype).clone()
            self.inner.state[t] = state


class _HalfGathered:
    """A 16-bit bucket's all-gather in flight (`ZeroOptimizer._gather_half`): waiting copies
    the gathered slices but this rank's own into the fp32 bucket and frees the 16-bit one."""

    def __init__(self, work, wire: torch.Tensor, flat: torch.Tensor, lo: int, hi: int):
        self.work, self.lo, self.hi = work, lo, hi
        self.wire: torch.Tensor | None = wire
        self.flat: torch.Tensor | None = flat

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            assert self.wire is not None and self.flat is not None  # dropped with work
            self.flat[: self.lo].copy_(self.wire[: self.lo])
            self.flat[self.hi :].copy_(self.wire[self.hi :])
        self.work = self.wire = self.flat = None
        return True


def _grad(t: torch.Tensor) -> torch.Tensor:
    """A piece's gradient (`attach` gives every piece one)."""
    assert t.grad is not None
    return t.grad
