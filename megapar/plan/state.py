"""Weights, gradients and optimizer state of one rank, byte for byte as megapar-train holds them.

megapar keeps fp32 parameters, their gradients in one buffer (`GradBuckets`) and AdamW's two
moments plus a float32 step count per parameter. With ZeRO-1 (dp > 1) the gradient buffer is
cut into buckets padded to a multiple of dp, the parameters move into a parameter buffer of the
same layout, and each dp rank keeps AdamW state only for its pieces (its slice of each bucket,
cut inside parameters): laid out here by `bucket_layout` and `slice_pieces`, the functions the
real code lays them out with, over the parameter list of the stage (`params.stage_tensors`).
The dry run (`megapar.dryrun`) reads the same figures off the real tensors and
`megapar-plan --verify` compares the two.

ZeRO-2 and ZeRO-3 in the same terms (fp32 parameters, gradients, AdamW; r = dp x cp): ZeRO-2
keeps whole parameters and this rank's shard of each padded bucket of gradients (4 + (4 + 8) / r
bytes per parameter); ZeRO-3 shards parameters, gradients and state by unit as `ShardedParams`
makes them (`params.stage_units`: each block; per chunk the root, split into an embedding and a
root unit; the parameters under --zero3-persistence-threshold elements in one persistent unit;
each flattened and padded to a multiple of r: 16 / r) and holds gathered units at the peak as
its hooks do (`gathered_peak`), and its full gradient buffers as its reductions free them
(`grad_buffers_peak`); an experts' unit whose group is one rank (ep = cp x dp) is kept whole,
with neither (nor traffic). `Offload` moves the optimizer state with host copies of the
stepped tensors and their gradients (--offload-optimizer), or ZeRO-3's parameter shards
(--offload-params), to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapar.data_parallel.buckets import bucket_layout, slice_pieces
from megapar.pipeline.schedules import SPLIT_BACKWARD
from megapar.plan.params import StageLayout, stage_tensors, stage_units
from megapar.plan.sharding import dp_traffic
from megapar.plan.zero3_peaks import gathered_peak, grad_buffers_peak, in_backward, phases

ADAM_MOMENTS = 2
"""AdamW's exp_avg and exp_avg_sq, each of the parameter's (piece's) shape and dtype."""
STEP_BYTES = 4
"""torch keeps Adam's step as a float32 scalar tensor per parameter (per ZeRO-1 piece)."""
MOMENTS = {"adamw": ADAM_MOMENTS, "lamb": ADAM_MOMENTS, "muon": ADAM_MOMENTS, "sgd": 1, "lars": 1}
"""Tensors of a parameter's (piece's) shape and dtype that megapar-train's --optimizer keeps per
parameter: AdamW's and LAMB's two moments (Muon's for what AdamW steps), SGD's and LARS's one
momentum buffer (megapar-train runs both with momentum 0.9)."""
STEPS = {"adamw": STEP_BYTES, "lamb": STEP_BYTES, "muon": STEP_BYTES, "sgd": 0, "lars": 0}
"""Bytes of the step count kept per parameter (piece): Adam's and LAMB's float32 scalar; SGD and
LARS keep none."""


@dataclass(frozen=True)
class RankState:
    """What one rank holds besides activations, in bytes (params: elements)."""

    params: int
    weights: int
    """Parameters held between steps (ZeRO-3: the shards, and persistent parameters whole)."""
    grads: int
    """Gradients held between steps (ZeRO-2 / 3: this rank's shard)."""
    optimizer: int
    """AdamW's moments and step counts (ZeRO >= 1: of this rank's pieces)."""
    master: int = 0
    """--offload-optimizer: the host copies of the stepped tensors and of their gradients."""
    gathered: int = 0
    """ZeRO-3: full buffers of the units gathered at the peak (`gathered_peak`)."""
    host: int = 0
    """Of all these, the bytes in host memory (offload)."""
    grad_buffers: int = 0
    """ZeRO-3: the units' full gradient buffers at the peak (`grad_buffers_peak`)."""
    gathered_top: int = 0
    """ZeRO-3: of `gathered`, what is gathered at the top of the backward (`phases`)."""
    gathered_end: int = 0
    """ZeRO-3: of `gathered`, what is gathered at the end of the backward (`phases`)."""
    grad_buffers_top: int = 0
    """ZeRO-3: of `grad_buffers`, the buffers alive at the top of the backward (`phases`)."""
    in_backward: tuple[int, int, int, int] = (0, 0, 0, 0)
    """ZeRO-3: the units gathered, the gradient buffers alive, the reduced block's buffer and
    the blocks finished before it, as a block is reduced inside the backward
    (`zero3_peaks.in_backward`)."""

    @property
    def device(self) -> int:
        """The bytes in device memory."""
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.master
            + self.gathered
            + self.grad_buffers
            - self.host
        )


@dataclass(frozen=True)
class Offload:
    """What a layout keeps in host memory, and whether ZeRO-3 keeps gathered parameters."""

    optimizer: bool = False
    """--offload-optimizer."""
    params: bool = False
    """--offload-params (ZeRO-3)."""
    keep_params: bool = False
    """ZeRO-3 (--zero3-keep-params): a stage's gathered parameters kept over the step."""
    whole_grads: bool = True
    """ZeRO-3: every unit's full gradient buffer alive at once in the step (`whole_grads`);
    False: as few as the reductions in flight leave (`grad_buffers_peak`)."""
    micro_batches: int = 1
    """Micro-batches per step (ZeRO-3: past the first, the units reduced once a step keep
    their buffers from the backward's start)."""

    def at_zero(self, zero: int) -> Offload:
        """These settings as a rank's state under ZeRO stage `zero` depends on them: below
        ZeRO-3 only `optimizer` (the others are ZeRO-3's), so that layouts differing in the
        rest share one cached state (`slices.most_loaded`; the layout's own:
        `StageLayout.trimmed`)."""
        return self if zero >= 3 else Offload(self.optimizer)


def whole_grads(schedule: str, pp: int, m: int, v: int, reduce: str = "step") -> bool:
    """ZeRO-3: whether a step holds every unit's full gradient buffer at once: with more than
    one micro-batch reduced once per step (`reduce` "step": each buffer accumulates until the
    last one's backward), more than one model chunk per rank, or weight gradients computed
    apart from the backward (a zero-bubble schedule's W: every buffer is made in B, reduced
    after W, reported once per step). Reduced per micro-batch, each micro-batch's backward
    frees them as one alone does."""
    return (m > 1 and reduce == "step") or v > 1 or w_reported(schedule, pp, m, v)


def w_reported(schedule: str, pp: int, m: int, v: int) -> bool:
    """Whether `schedule` computes weight gradients in W actions apart from B (ZB-H1, ZB-V,
    DualPipeV: `SPLIT_BACKWARD`, at any pp, m and v): each chunk's last W reports them once a
    step, so a reduction per micro-batch (ZeRO-2, ZeRO-3's --zero3-reduce micro-batch) of what
    holds them runs once a step, and every bucket or unit after it in the launch order waits
    for it."""
    return schedule in SPLIT_BACKWARD


def muon_matrix(t) -> bool:
    """Whether --optimizer muon steps tensor `t` (a `TensorSpec`) with Muon: a block's 2-D
    weight, not a routed expert's (`optim.muon.is_muon_matrix`)."""
    return t.block and t.matrix and not t.expert


def state_bytes(t, elements: int, optimizer: str) -> int:
    """Optimizer-state bytes of `elements` of tensor `t` (a whole parameter or one piece) under
    --optimizer `optimizer`: its `MOMENTS` and `STEPS` (AdamW's and LAMB's two moments and
    float32 step count, SGD's and LARS's momentum buffer), or under --optimizer muon a block's
    2-D weight's one momentum buffer (no step count)."""
    if optimizer == "muon" and muon_matrix(t):
        return elements * t.dtype.itemsize
    return MOMENTS[optimizer] * elements * t.dtype.itemsize + STEPS[optimizer]


def rank_state(layout: StageLayout, dp_rank: int, offload: Offload = Offload()) -> RankState:
    """The state of dp rank `dp_rank` of pipeline rank `layout.stage` (any tp rank: they hold
    equal shapes) under megapar-train with `layout.optimizer` (`state_bytes`) and
    `layout`'s gradient buckets or units.
    ZeRO-1 is the real code's layout; ZeRO-2 / 3 are modelled on it (see
    `docs/guides/precision-zero.md`). `layout.dp` and `dp_rank` are over cp x dp (the
    gradients' group: dp_rank x cp + cp_rank); under expert parallelism (`layout.ep` > 1) the
    rank holds E / ep routed experts, in buckets of their own sliced over the
    expert-data-parallel group (`expert_rank`)."""
    tensors, units, specs = _layout(layout)
    dp, ep = layout.dp, layout.ep
    kind = layout.optimizer
    if not units:  # no ZeRO: every parameter whole, its own state
        nbytes = sum(t.numel * t.dtype.itemsize for t in tensors)
        state = sum(state_bytes(t, t.numel, kind) for t in tensors)
        return _finish(tensors, units, specs, layout, nbytes, state, offload)
    stepped = state = 0
    for idx, padded in units:
        n = _shards(tensors, idx, dp, ep)
        size, r = padded // n, dp_rank if n == dp else expert_rank(dp_rank, ep)
        pieces = slice_pieces([tensors[i].numel for i in idx], r * size, (r + 1) * size)
        stepped += sum(e - s for _, s, e in pieces) * tensors[idx[0]].dtype.itemsize
        state += sum(state_bytes(tensors[idx[i]], e - s, kind) for i, s, e in pieces)
    return _finish(tensors, units, specs, layout, stepped, state, offload)


def expert_rank(rank, ep: int):
    """The place in its expert-data-parallel group of the rank at place `rank` (an int or a
    numpy array of them) of the cp x dp group (`rank` = dp_rank x cp + cp_rank): the index of
    its block of ep consecutive places, its edp rank, as `Mesh.expert_dp_group` orders them."""
    return rank // ep


def _shards(tensors, idx, dp: int, ep: int) -> int:
    """The ranks a bucket is sharded over: cp x dp, or an experts' bucket under ep > 1 the
    expert-data-parallel group's cp x dp / ep."""
    return dp // ep if ep > 1 and tensors[idx[0]].expert else dp


def _gathered(u, nbytes: int) -> int:
    """The bytes a gather of ZeRO-3 unit `u` (a `UnitSpec`) fills, of its fp32 buffer's
    `nbytes`: a 16-bit unit's are 2 of fp32's 4, a float8 unit's 1 (`UnitSpec.cast`)."""
    return nbytes // CAST_BYTES[u.cast] if u.cast else nbytes


CAST_BYTES = {"half": 2, "float8": 4}
"""fp32's bytes per byte a cast unit gathers (`UnitSpec.cast`)."""


def _deferred(tensors, units, pp: int) -> set[int]:
    """The buckets (ZeRO-1 / 2) or units (ZeRO-3) holding the tied embedding over pipeline
    stages: reduced once, in the grad sync's `finish()`, after its sum over the first and last
    stage (a ZeRO-2 bucket not every micro-batch)."""
    return {k for k, (idx, _) in enumerate(units) if pp > 1 and any(tensors[i].shared for i in idx)}


def _finish(
    tensors, units, specs, layout: StageLayout, stepped: int, optimizer: int, offload: Offload
) -> RankState:
    """A rank's state from its stepped bytes and its optimizer-state bytes (`units`: ZeRO's
    buckets or units; `specs`: ZeRO-3's `UnitSpec` of each unit, else None)."""
    dp, zero, ep = layout.dp, layout.zero, layout.ep
    elements = sum(t.numel for t in tensors)
    whole = sum(t.numel * t.dtype.itemsize for t in tensors)
    buffer = sum(padded * tensors[idx[0]].dtype.itemsize for idx, padded in units) or whole
    shard = (
        sum(
            padded // _shards(tensors, idx, dp, ep) * tensors[idx[0]].dtype.itemsize
            for idx, padded in units
        )
        or whole
    )
    weights, grads, gathered, offloaded = buffer, buffer if zero < 2 else shard, 0, 0
    grad_buffers = gathered_top = gathered_end = grad_buffers_top = 0
    mid = (0, 0, 0, 0)
    if zero >= 3 and units:
        weights, offloaded = shard, shard
        # a unit over one rank (ep = cp x dp: the experts') is kept whole, its parameters and
        # gradient its shards: no gathered buffer (unless copied in from the host under
        # --offload-params), no gradient buffer, no reduction
        alone = frozenset(k for k, u in enumerate(units) if _shards(tensors, u[0], dp, ep) == 1)
        nbytes = [padded * tensors[idx[0]].dtype.itemsize for idx, padded in units]
        grad_nbytes = [0 if k in alone else n for k, n in enumerate(nbytes)]
        full = nbytes if offload.params else grad_nbytes
        full = [_gathered(u, n) for u, n in zip(specs, full)]
        # a cast unit's gather sends its 16-bit or float8 shard, and under --offload-params a
        # unit's gather its device staging shard (copied in from the host), held while it runs
        sent = [
            n // _shards(tensors, idx, dp, ep) if u.cast or offload.params and k not in alone else 0
            for k, (u, n, (idx, _)) in enumerate(zip(specs, full, units))
        ]
        gathered = gathered_peak(specs, full, offload.keep_params, sent)
        deferred = _deferred(tensors, units, layout.pp)
        kept = offload.micro_batches > 1
        grad_buffers = grad_buffers_peak(
            specs, grad_nbytes, deferred, whole=offload.whole_grads, kept=kept, alone=alone
        )
        whole, keep = offload.whole_grads, offload.keep_params
        gathered_top, gathered_end, grad_buffers_top = phases(
            specs, full, deferred, whole=whole, keep=keep, kept=kept, grads=grad_nbytes, sent=sent
        )
        mid = in_backward(
            specs,
            full,
            deferred,
            whole=whole,
            keep=keep,
            kept=kept,
            grads=grad_nbytes,
            sent=sent,
            alone=alone,
        )
    master = 2 * stepped if offload.optimizer else 0
    host = optimizer + master if offload.optimizer else 0
    if offload.params and zero >= 3:  # the host-held shards are the optimizer's masters
        weights = 0
        host = max(host, offloaded)  # (--offload-params needs --offload-optimizer)
    return RankState(
        params=elements,
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        master=master,
        gathered=gathered,
        host=host,
        grad_buffers=grad_buffers,
        gathered_top=gathered_top,
        gathered_end=gathered_end,
        grad_buffers_top=grad_buffers_top,
        in_backward=mid,
    )


def _layout(layout: StageLayout):
    """(the stage's tensors, ZeRO's buckets as `bucket_layout` gives them (ZeRO-1 / 2; under
    ep > 1 the experts' buckets apart, padded to a multiple of dp / ep), its units (ZeRO-3:
    each padded to a multiple of dp; under ep > 1 the experts' units of dp / ep), or []
    without, and ZeRO-3's `UnitSpec` per unit (else None))."""
    tensors = stage_tensors(layout)
    dp, ep = layout.dp, layout.ep
    if not (layout.zero and dp > 1):
        return tensors, [], None
    if layout.zero >= 3:
        specs = stage_units(layout)
        units = []
        for u in specs:
            n = _shards(tensors, u.tensors, dp, ep)
            units.append((list(u.tensors), -(-sum(tensors[i].numel for i in u.tensors) // n) * n))
        return tensors, units, specs
    late = [i for i, t in enumerate(tensors) if t.shared] if layout.pp > 1 else []
    experts = [i for i, t in enumerate(tensors) if t.expert] if ep > 1 else []
    sizes = [(t.numel, t.dtype) for t in tensors]
    apart = layout.casts.zero12_half(tensors)
    buckets = bucket_layout(
        sizes, layout.bucket_mb, dp, late, experts, dp // ep, apart, late_alone=True
    )
    return tensors, buckets, None


DENSE, EXPERTS = "dp", "expert dp"
"""The groups ZeRO's collectives run over (`dp_groups_traffic`): the cp x dp ranks, and under
expert parallelism the expert-data-parallel group (cp x dp / ep ranks) of the experts' buckets
or units."""


@dataclass(frozen=True)
class Traffic:
    """What ZeRO reduces and gathers over one group of a stage, as `sharding.dp_traffic` takes
    it (bytes of padded buffers, fp32)."""

    pieces: int = 0
    """Buckets (ZeRO-1 / 2) or units (ZeRO-3)."""
    nbytes: int = 0
    """Their buffers' bytes."""
    gathered: int = 0
    """Their buffers' bytes as gathered: `nbytes`, but half for ZeRO-3's 16-bit units and
    ZeRO-1 / 2's 16-bit buckets, and a quarter for ZeRO-3's float8 units."""
    persistent: int = 0
    """ZeRO-3: gathered bytes of the persistent unit among them (gathered once a step)."""
    deferred: tuple[int, int] = (0, 0)
    """ZeRO-3: (units, bytes) holding the tied embedding over pipeline stages: reduced once a
    step even with --zero3-reduce micro-batch."""
    tail: tuple[int, int] = (0, 0)
    """ZeRO-3: (units, gathered bytes) of root units (a chunk's final norm and head, or its
    whole root where it is not split) and the units they lead: kept gathered from the chunk's
    forward to its backward, so gathered once a micro-batch, not twice."""


def zero_traffic(layout: StageLayout) -> dict[str, Traffic]:
    """{group: `Traffic`} of the buckets (ZeRO-1 / 2) or units (ZeRO-3) ZeRO reduces and
    gathers on stage `layout` over each group (`DENSE`; under ep > 1 also `EXPERTS`, an experts'
    unit counted as its lead is: a root's once a micro-batch, the persistent unit's once a
    step; none where that group is one rank, ep = cp x dp: ZeRO-3 keeps those units whole and
    ZeRO-1 / 2's buckets are their own sum and gather, `shard_comm`); {} without ZeRO."""
    tensors, units, specs = _layout(layout)
    zero, dp, ep = layout.zero, layout.dp, layout.ep
    late = _deferred(tensors, units, layout.pp)
    half = set(layout.casts.zero12_half(tensors)) if zero in (1, 2) else set()
    kinds = [u.kind for u in specs] if specs else [""] * len(units)
    for k, u in enumerate(specs or ()):
        if u.led:  # gathered as its lead is
            kinds[k] = kinds[k - 1]
    out: dict[str, Traffic] = {}
    for k, (idx, padded) in enumerate(units):
        if _shards(tensors, idx, dp, ep) == 1:
            continue  # a unit or bucket over one rank (ep = cp x dp): nothing gathered or reduced
        group = EXPERTS if _shards(tensors, idx, dp, ep) != dp else DENSE
        n = padded * tensors[idx[0]].dtype.itemsize
        if specs is not None:
            g = _gathered(specs[k], n)
        else:  # ZeRO-1 / 2: a 16-bit bucket gathers 2 bytes an element
            g = n // 2 if idx[0] in half else n
        t = out.get(group, Traffic())
        out[group] = Traffic(
            t.pieces + 1,
            t.nbytes + n,
            t.gathered + g,
            t.persistent + (g if kinds[k] == "persistent" else 0),
            (t.deferred[0] + (k in late), t.deferred[1] + (n if k in late else 0)),
            (t.tail[0] + (kinds[k] == "root"), t.tail[1] + (g if kinds[k] == "root" else 0)),
        )
    return out


def groups_traffic(
    traffic: dict[str, Traffic],
    zero: int,
    m: int,
    pp: int,
    *,
    keep_params: bool = False,
    per_micro_batch: bool = False,
    once_a_step: bool = False,
    grad_scale: float = 1.0,
) -> dict[str, list[tuple[str, int, float]]]:
    """{group: `sharding.dp_traffic`'s [(operation, calls, bytes)]} of a step of m micro-batches
    over each group of `zero_traffic`; `grad_scale`: the reduced gradients' bytes per fp32
    byte (the reduce dtype's)."""
    return {
        group: dp_traffic(
            zero,
            m,
            pp,
            keep_params,
            grad_bytes=t.nbytes * grad_scale,
            param_bytes=t.gathered,
            pieces=t.pieces,
            persistent=t.persistent,
            per_micro_batch=per_micro_batch,
            deferred=(t.deferred[0], t.deferred[1] * grad_scale),
            once_a_step=once_a_step,
            tail=t.tail,
        )
        for group, t in traffic.items()
    }
