"""Self-attention over a sequence split across the context-parallel group.

Each cp rank holds its two chunks of every sequence (`split.py`) and their queries, keys and
values ([b, heads, 2c, d], c = s / 2cp). A query needs the keys and values of the whole
sequence (the earlier part of it under a causal mask). They come block by block: the keys /
values of source rank j (its two chunks) meet this rank's queries in at most a few kernel calls
(`plan`), and the results are merged with their log-sum-exp (`kernels.merge`), so no rank ever
holds a score matrix larger than chunk x 2 chunks. Two ways to get the blocks:

- ``"ring"`` (`RingAttention`): the K/V blocks travel around the cp group, one point-to-point
  exchange per step (`ring.py`), the next block's transfer running while this block's attention
  is computed; only one remote block is held at a time. Backward sends the blocks around again
  with the gradients of the keys / values travelling behind them, back to their owner.
  Per layer and micro-batch: cp - 1 exchanges of a K/V block forward, cp - 1 plus cp (dK/dV,
  fp32) backward.
- ``"all-gather"`` (`AllGatherAttention`, Llama 3's choice): one all-gather of every rank's K/V
  block, then the attention of the local queries; backward gathers them again and reduce-
  scatters their gradients (fp32) to their owners. Fewer, larger collectives that cannot
  overlap with compute, and the whole sequence's keys / values held during the layer's
  attention: cheap when there are few kv heads.

A third method, ``"a2a"`` (`a2a.py`, DeepSpeed-Ulysses), trades heads for the sequence by
all-to-alls around ordinary attention; `LayerAttention` runs it when its method is set so
(``--cp-comm-type a2a``). By default `method_for(q_heads, kv_heads)` chooses: all-gather for
grouped-query attention (kv heads fewer than query heads: the gathered K/V are a fraction of the
queries' size, as in Llama 3 with 8 kv heads of 32, and two collectives beat 3cp - 2 exchanges),
the ring otherwise (GPT-2, BERT, multi-head Llama: all-gathered K/V would be as large as the
whole sequence's queries, which is the memory context parallelism exists to split). Both compose
with grouped-query heads (kv heads are sent unexpanded and expanded per block), BERT's padding
mask (each rank holds the whole mask, so no mask travels), tensor parallelism (this rank's heads
only) and dropout.

Causal rule (global chunk ids): query chunk a sees key chunk k fully when k < a, causally when
k == a, not at all when k > a; with the load-balanced split every rank makes the same number of
kernel calls of the same sizes.

Sliding window (`Spec.window`; Mistral, Qwen's sliding layers): the query at global position i
sees the keys i - window + 1 .. i. A kernel call whose keys are all out of its queries' window
is left out (no work; the K/V block still travels on, the exchanges are the same), one whose
keys are all within it runs as above, and one the window cuts runs with an additive mask of
the window and the causal rule (`window_bias`, from the global positions; made on the device
once per layer and shape).

Packed documents (`megapar.models.documents`, ``--attention-mask-type block_causal``): every rank
holds the document of each token of the whole sequence (from the micro-batch's ids), so each
kernel call's queries and keys are masked where their documents differ (`_Pass._document_bias`:
the dtype's lowest value, made per call on the device; nothing more travels), on top of the
causal rule and any window.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megapar.context_parallel import a2a
from megapar.context_parallel.kernels import (
    DropoutMasks,
    block_backward,
    block_forward,
    choose_kernel,
    in_window,
    merge,
    wide,
)
from megapar.context_parallel.ring import Ring
from megapar.context_parallel.split import chunk_ids, split
from megapar.graph_break import graph_break
from megapar.tensor_parallel.sequence_parallel import (
    all_gather_flat,
    reduce_scatter_flat,
)

METHODS = ("ring", "all-gather", "a2a")
"""The cp attentions: the ring and the all-gather (here) and the all-to-all (`a2a.py`)."""


def method_for(q_heads: int, kv_heads: int) -> str:
    """The cp attention of a model: all-gather with grouped-query kv heads, else the ring."""
    return "all-gather" if kv_heads < q_heads else "ring"


@dataclass(frozen=True)
class Call:
    """One kernel call: query rows `q` against key columns `kv` of a source's block; `window`:
    the sliding window cuts it (its mask is `window_bias`, which holds the causal rule too:
    `causal` is then False)."""

    q: slice
    kv: slice
    causal: bool
    window: bool = False


def _chunk_positions(cp: int, rank: int, c: int, cols: slice) -> list[range]:
    """The global positions of rank `rank`'s block's rows / columns `cols`, chunk by chunk."""
    chunks = chunk_ids(cp, rank)[cols.start // c : cols.stop // c]
    return [range(chunk * c, (chunk + 1) * c) for chunk in chunks]


def plan(
    cp: int, rank: int, source: int, c: int, causal: bool, window: int | None = None
) -> list[Call]:
    """The kernel calls of this rank's queries against source rank `source`'s K/V block
    (chunk length c). Bidirectional: one call of everything. Causal: per query chunk, the
    source's earlier chunks in one call (they are adjacent) and its own chunk causally; with a
    sliding `window` (causal only) the calls outside it left out, those it cuts marked."""
    if not causal:
        return [Call(slice(0, 2 * c), slice(0, 2 * c), False)]
    calls = []
    kv_chunks = chunk_ids(cp, source)
    for qi, qc in enumerate(chunk_ids(cp, rank)):
        rows = slice(qi * c, (qi + 1) * c)
        earlier = [ki for ki, kc in enumerate(kv_chunks) if kc < qc]
        if earlier:  # [0] or [0, 1]: a source's first chunk is always its earlier one
            calls.append(Call(rows, slice(earlier[0] * c, (earlier[-1] + 1) * c), False))
        calls += [
            Call(rows, slice(ki * c, (ki + 1) * c), True)
            for ki, kc in enumerate(kv_chunks)
            if kc == qc
        ]
    if window is None:
        return calls
    windowed = []
    for call in calls:
        (q_rows,) = _chunk_positions(cp, rank, c, call.q)  # a call's rows are one chunk
        q_first, q_last = q_rows[0], q_rows[-1]
        keys = _chunk_positions(cp, source, c, call.kv)
        k_first, k_last = min(r[0] for r in keys), max(r[-1] for r in keys)
        if k_last <= q_first - window:  # every key out of every query's window
            continue
        if k_first > q_last - window:  # every key (up to the query) within it
            windowed.append(call)
        else:
            windowed.append(Call(call.q, call.kv, False, True))
    return windowed


def window_bias(
    cp: int, rank: int, source: int, c: int, call: Call, window: int, dtype, device
) -> torch.Tensor:
    """[1, 1, rows, columns] additive mask of a call the window cuts: 0 where the query at
    global position i sees the key (i - window < key <= i), the dtype's lowest value elsewhere
    (finite, as `_source_bias`'s)."""
    q = torch.cat(
        [
            torch.arange(r.start, r.stop, device=device)
            for r in _chunk_positions(cp, rank, c, call.q)
        ]
    )
    k = torch.cat(
        [
            torch.arange(r.start, r.stop, device=device)
            for r in _chunk_positions(cp, source, c, call.kv)
        ]
    )
    keep = in_window(q, k, window)
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, _lowest(dtype))[
        None, None
    ]


@dataclass
class Spec:
    """What a cp attention call needs besides its tensors."""

    cp: int
    rank: int
    """This rank's index in the cp group."""
    causal: bool
    comm: Ring | dist.ProcessGroup | None
    """A `ring.Ring` (ring) or the cp process group (all-gather)."""
    dropout_p: float = 0.0
    kernel: str | None = None
    """The kernel of `kernels.block_forward` / `block_backward`: "flash", "cuda-flash",
    "cuda-efficient" or "math"; None chooses by device, dtype, mask and dropout
    (`kernels.choose_kernel`)."""
    label: str = "attention"
    """Names the layer in a timeout's message."""
    masks: DropoutMasks | None = field(default=None, repr=False)
    window: int | None = None
    """A sliding window (causal only): each query sees the `window` keys up to itself."""
    biases: dict | None = field(default=None, repr=False, compare=False)
    """Where `window_bias`'s masks are kept (a layer's, so each is made once per shape)."""


def _lowest(dtype: torch.dtype) -> float:
    return torch.finfo(dtype if dtype.is_floating_point else torch.float32).min


def _source_bias(key_mask, cp: int, source: int, dtype):
    """The additive key mask of source rank `source`'s block (None: no padding mask)."""
    if key_mask is None:
        return None
    keep = split(key_mask, cp, source, dim=-1)[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
        ~keep, _lowest(dtype)
    )


def _expand(t, kv_index):
    return t if kv_index is None else t.index_select(1, kv_index)


def _reduce(grad, kv_index, kv_heads: int):
    """A gradient of expanded kv heads summed back onto the kv heads."""
    if kv_index is None:
        return grad
    out = grad.new_zeros(grad.shape[0], kv_heads, *grad.shape[2:])
    return out.index_add_(1, kv_index, grad)


class _Pass:
    """The per-source work of one forward or backward, shared by both methods."""

    def __init__(self, spec: Spec, q, key_mask, kv_index, doc_ids=None):
        self.spec, self.q, self.key_mask, self.kv_index = spec, q, key_mask, kv_index
        self.doc_ids = doc_ids
        self.q_docs = None if doc_ids is None else split(doc_ids, spec.cp, spec.rank, dim=-1)
        self.c = q.shape[2] // 2
        self.window = spec.window if spec.causal else None
        if self.window is not None and self.window >= self.c * 2 * spec.cp:
            self.window = None  # no shorter than the sequence: it cuts nothing
        masked = key_mask is not None or self.window is not None or doc_ids is not None
        self.kernel = spec.kernel or choose_kernel(
            q.device, spec.dropout_p, q.dtype, masked, q.shape[-1]
        )

    def calls(self, source: int) -> list[Call]:
        return plan(self.spec.cp, self.spec.rank, source, self.c, self.spec.causal, self.window)

    def bias(self, source: int, call: Call, key_bias):
        """The additive mask of `call`: the key mask's columns, plus the window's where it
        cuts the call (None: neither), the dtype's lowest value where a key is of another
        document than its query (`_document_bias`)."""
        return self._document_bias(source, call, self._key_window_bias(source, call, key_bias))

    def _document_bias(self, source: int, call: Call, bias):
        """`bias` (or 0) with the lowest value where the query's and the key's documents
        differ ([b, 1, rows, columns]), from the documents of their global positions; `bias`
        as it is without documents. Made per call (the documents are the micro-batch's), on
        the device from the ids every rank holds: nothing travels."""
        if self.doc_ids is None:
            return bias
        assert self.q_docs is not None
        keys = split(self.doc_ids, self.spec.cp, source, dim=-1)[:, call.kv]
        same = (self.q_docs[:, call.q][:, :, None] == keys[:, None, :])[:, None]
        dtype = self.q.dtype
        base = bias if bias is not None else torch.zeros((), dtype=dtype, device=same.device)
        lowest = torch.full((), _lowest(dtype), dtype=dtype, device=same.device)
        return torch.where(same, base, lowest)

    def _key_window_bias(self, source: int, call: Call, key_bias):
        bias = None if key_bias is None else key_bias[..., call.kv]
        if not call.window:
            return bias
        assert self.window is not None  # a call is only cut by a window
        spec, dtype, device = self.spec, self.q.dtype, self.q.device
        key = (source, call.q.start, call.kv.start, call.kv.stop, self.c, str(dtype), str(device))
        biases = spec.biases if spec.biases is not None else {}
        cut = biases.get(key)
        if cut is None:
            cut = window_bias(spec.cp, spec.rank, source, self.c, call, self.window, dtype, device)
            if len(biases) >= 64:  # another shape's (evaluation, another --seq-len)
                biases.clear()
            biases[key] = cut
        return cut if bias is None else bias + cut

    def forward(self, source: int, k, v, acc: dict) -> None:
        """Merge the attention of the queries against source's K/V into acc {rows: (o, lse)}."""
        k, v = _expand(k, self.kv_index), _expand(v, self.kv_index)
        bias = _source_bias(self.key_mask, self.spec.cp, source, self.q.dtype)
        for call in self.calls(source):
            out, lse = block_forward(
                self.q[:, :, call.q],
                k[:, :, call.kv],
                v[:, :, call.kv],
                call.causal,
                self.bias(source, call, bias),
                self.kernel,
                self.spec.masks,
            )
            key = (call.q.start, call.q.stop)
            merged_out, merged_lse = acc.get(key, (None, None))
            acc[key] = merge(merged_out, merged_lse, out, lse)

    def backward(self, source: int, k, v, dout, out, lse, dq):
        """Add the queries' gradient share of source's block into dq (fp32); returns the
        block's (dk, dv) in fp32, on the unexpanded kv heads."""
        kv_heads = k.shape[1]
        k, v = _expand(k, self.kv_index), _expand(v, self.kv_index)
        bias = _source_bias(self.key_mask, self.spec.cp, source, self.q.dtype)
        dk, dv = wide(torch.zeros_like(k)), wide(torch.zeros_like(v))
        for call in self.calls(source):
            r, kv = call.q, call.kv
            g = block_backward(
                dout[:, :, r],
                self.q[:, :, r],
                k[:, :, kv],
                v[:, :, kv],
                out[:, :, r],
                lse[:, :, r],
                call.causal,
                self.bias(source, call, bias),
                self.kernel,
                self.spec.masks,
            )
            dq[:, :, r] += g[0]
            dk[:, :, kv] += g[1]
            dv[:, :, kv] += g[2]
        return _reduce(dk, self.kv_index, kv_heads), _reduce(dv, self.kv_index, kv_heads)


def _result(acc: dict, q, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out, lse) of every query row. out is [b, heads, s, d] laid out as
    [b, s, heads, d] in memory, as torch's attention kernels return it, so that the caller's
    transpose(1, 2).reshape(b, s, heads x d) is a view, not a copy kept by the next linear."""
    b, heads, s, _ = q.shape
    out = torch.empty((b, s, heads, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = None
    for (start, stop), (part, part_lse) in acc.items():
        out[:, :, start:stop] = part
        if lse is None:
            lse = part_lse.new_empty((b, heads, s))
        lse[:, :, start:stop] = part_lse
    assert lse is not None  # every query row attends to at least its own block
    return out, lse


def _forward_done(ctx, acc, q, k, v, key_mask, kv_index, spec, doc_ids=None):
    """The merged output; what backward needs is kept (this rank's blocks only)."""
    out, lse = _result(acc, q, v.shape[-1])
    ctx.save_for_backward(q, k, v, out, lse, key_mask, kv_index, doc_ids)
    ctx.spec = spec
    return out


def _backward_start(ctx):
    """(saved tensors, spec, the per-source work, dq zeroed in the accumulation dtype)."""
    saved = ctx.saved_tensors
    q, _, _, _, _, key_mask, kv_index, doc_ids = saved
    work = _Pass(ctx.spec, q, key_mask, kv_index, doc_ids)
    return saved[:7], ctx.spec, work, wide(torch.zeros_like(q))


class RingAttention(torch.autograd.Function):
    """Ring attention: K/V blocks passed around the cp group, overlapped with the attention."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, kv_index, spec: Spec, doc_ids=None):
        work, ring, cp = _Pass(spec, q, key_mask, kv_index, doc_ids), spec.comm, spec.cp
        assert isinstance(ring, Ring)  # `attention` passes the ring method a Ring
        kv = _pack(k, v)
        acc: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(cp):
            source = (spec.rank - i) % cp
            handle = ring.start(kv, f"{spec.label}: K/V step {i + 1}") if i + 1 < cp else None
            work.forward(source, *_unpack(kv, k, v), acc)
            if handle is not None:
                kv = ring.finish(handle)
        return _forward_done(ctx, acc, q, k, v, key_mask, kv_index, spec, doc_ids)

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, out, lse, _, _), spec, work, dq = _backward_start(ctx)
        ring, cp = spec.comm, spec.cp
        kv, grads = _pack(k, v), None
        with _replaying(spec):
            for i in range(cp):
                source = (spec.rank - i) % cp
                handle = (
                    ring.start(kv, f"{spec.label} backward: K/V step {i + 1}")
                    if i + 1 < cp
                    else None
                )
                dkv = _pack(*work.backward(source, *_unpack(kv, k, v), dout, out, lse, dq))
                if grads is not None:  # the gradient of this block's K/V so far, from upstream
                    dkv += ring.finish(grads)
                grads = ring.start(dkv, f"{spec.label} backward: dK/dV step {i + 1}")
                if handle is not None:
                    kv = ring.finish(handle)
            dk, dv = _unpack(ring.finish(grads), k, v)  # own K/V's gradient, back from its trip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class AllGatherAttention(torch.autograd.Function):
    """All-gather attention: every rank's K/V block gathered once (again in backward, whose
    K/V gradients are reduce-scattered to their owners)."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, kv_index, spec: Spec, doc_ids=None):
        work = _Pass(spec, q, key_mask, kv_index, doc_ids)
        acc: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        every = _gather(_pack(k, v), spec)
        for source in range(spec.cp):
            work.forward(source, *_unpack(every[source], k, v), acc)
        return _forward_done(ctx, acc, q, k, v, key_mask, kv_index, spec, doc_ids)

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, out, lse, _, _), spec, work, dq = _backward_start(ctx)
        every = _gather(_pack(k, v), spec)
        with _replaying(spec):
            dkv = torch.stack(
                [
                    _pack(*work.backward(source, *_unpack(every[source], k, v), dout, out, lse, dq))
                    for source in range(spec.cp)
                ]
            )
        mine = torch.empty(dkv.shape[1:], dtype=dkv.dtype, device=dkv.device)
        reduce_scatter_flat(mine, dkv, spec.comm)
        dk, dv = _unpack(mine, k, v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _pack(k, v) -> torch.Tensor:
    """k and v in one flat buffer (k's elements, then v's): one message, whatever v's head size."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(kv, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) views of a `_pack`ed buffer, shaped as k and v."""
    return kv[: k.numel()].view(k.shape), kv[k.numel() :].view(v.shape)


def _gather(kv: torch.Tensor, spec: Spec) -> torch.Tensor:
    """[cp, n]: every cp rank's packed K/V block (`_pack`), in cp rank order."""
    out = torch.empty((spec.cp,) + kv.shape, dtype=kv.dtype, device=kv.device)
    all_gather_flat(out, kv.contiguous(), spec.comm)
    return out


def _replaying(spec: Spec):
    return spec.masks.replaying() if spec.masks is not None else contextlib.nullcontext()


def attention(
    q, k, v, spec: Spec, key_mask=None, kv_index=None, method: str = "ring", doc_ids=None
):
    """Attention of this rank's queries over the whole (cp-split) sequence.

    q: [b, heads, 2c, d] (this rank's two chunks); k: [b, kv heads, 2c, d], v: [b, kv heads,
    2c, d_v] (d_v <= d; k and v travel together as one flat buffer, `_pack`), with
    `kv_index` [heads] naming each query head's kv head (None: one each); key_mask: [b, s] bool
    (True = a real token) of the *whole* sequence, or None; doc_ids: [b, s] the document of
    each token of the whole sequence (causal: a query sees only its document's keys), or None.
    Returns [b, heads, 2c, d_v]."""
    if method not in METHODS[:2]:
        raise ValueError(
            f"unknown context-parallel attention {method!r}; expected one of {METHODS[:2]} "
            f"(the all-to-all is `a2a.attention`)"
        )
    if spec.dropout_p > 0:  # this call's masks (a spec may be reused)
        spec = dataclasses.replace(spec, masks=DropoutMasks(spec.dropout_p, q.device))
    fn = RingAttention if method == "ring" else AllGatherAttention
    return fn.apply(q, k, v, key_mask, kv_index, spec, doc_ids)


class LayerAttention:
    """Context-parallel attention as one attention layer uses it: this rank's place in the cp
    group, the method (`method_for`, or "a2a"; an attribute, so it can be switched) and, for the
    ring, the layer's `Ring` (made on first use). Holds no parameters and no global state.

    `kv_map`: the layer's query head -> kv head map of this tp rank as ints (grouped-query
    attention; None: one kv head each), from which the all-to-all decides once whether k / v
    travel unexpanded (`a2a.kv_plan`)."""

    def __init__(self, mesh, causal: bool, method: str, label: str = "self-attention"):
        if method not in METHODS:
            raise ValueError(
                f"unknown context-parallel attention {method!r}; expected one of {METHODS}"
            )
        self.mesh, self.causal, self.method, self.label = mesh, causal, method, label
        self.ring: Ring | None = None
        self.biases: dict = {}  # a sliding window's masks (`window_bias`), made once per shape
        self.kv_map: list[int] | None = None
        self._local_index: dict[str, torch.Tensor | None] = {}  # a2a: `kv_plan` per device

    def __call__(
        self,
        q,
        k,
        v,
        key_mask=None,
        kv_index=None,
        dropout_p: float = 0.0,
        window=None,
        documents=None,
    ):
        """`window`: a sliding window (None: causal over the whole sequence, or bidirectional).
        `documents`: a micro-batch's packed documents (`megapar.models.documents.Documents`;
        causal only): each query sees only the keys of its own document. The all-to-all takes
        their mask of the whole sequence; the ring and the all-gather mask each kernel call
        from the documents of its queries' and keys' global positions."""
        if documents is not None and documents.ids is None:
            documents = None  # reset positions only: nothing to mask
        if torch.compiler.is_compiling():  # --compile: the exchanges stay eager (a graph break)
            return self._eager(q, k, v, key_mask, kv_index, dropout_p, window, documents)
        return self._run(q, k, v, key_mask, kv_index, dropout_p, window, documents)

    @graph_break
    def _eager(self, q, k, v, key_mask, kv_index, dropout_p, window, documents=None):
        """`_run`, run eagerly inside torch.compile'd code: the ring's point-to-point messages
        and the all-gathers stay the torch.distributed calls (timeouts, counts) they are."""
        return self._run(q, k, v, key_mask, kv_index, dropout_p, window, documents)

    def _run(
        self,
        q,
        k,
        v,
        key_mask=None,
        kv_index=None,
        dropout_p: float = 0.0,
        window=None,
        documents=None,
    ):
        mesh = self.mesh
        if self.method == "a2a":
            attn_mask = None if documents is None else documents.bias(window, q.dtype)
            return self._a2a(q, k, v, key_mask, kv_index, dropout_p, window, attn_mask)
        if self.method == "ring":
            if self.ring is None:
                self.ring = Ring(mesh.cp_group, mesh.timeout_s)
            comm = self.ring
        else:
            comm = mesh.cp_group
        spec = Spec(
            mesh.cp,
            mesh.cp_rank,
            self.causal,
            comm,
            dropout_p,
            label=self.label,
            window=window,
            biases=self.biases,
        )
        doc_ids = None if documents is None else documents.ids
        return attention(q, k, v, spec, key_mask, kv_index, self.method, doc_ids)

    def _a2a(self, q, k, v, key_mask, kv_index, dropout_p, window, attn_mask=None):
        mesh, cp = self.mesh, self.mesh.cp
        why = a2a.heads_error(q.shape[1], cp)
        if why is not None:
            raise ValueError(f"{self.label}: {why}; use another --cp-comm-type or cp")
        local = None
        if kv_index is not None:
            where = str(q.device)
            if where not in self._local_index:  # once per layer and device: no host sync after
                plan = a2a.kv_plan(self.kv_map, k.shape[1], cp)
                self._local_index[where] = (
                    None if plan is None else torch.tensor(plan, device=q.device)
                )
            local = self._local_index[where]
        return a2a.attention(
            q,
            k,
            v,
            cp,
            mesh.cp_group,
            self.causal,
            key_mask,
            kv_index,
            local,
            dropout_p,
            window,
            self.biases,
            attn_mask,
        )
