"""Context-parallel attention's cost in the planner: what one layer sends per micro-batch
(`cp_traffic`; per step as a dry run counts it: `step_cp_bytes`, `step_a2a`), the transient
buffers it holds (`cp_buffers`) and the seconds of it not hidden behind the attention
(`cp_layer_seconds`), for the ring, the all-gather or the all-to-all megapar runs."""

from __future__ import annotations

import functools

from megapar.context_parallel import method_for
from megapar.context_parallel.attention import plan as attention_calls
from megapar.models.blocks import CP_COMM_TYPES
from megapar.models.flops import head_size, heads, kv_heads_per_rank
from megapar.plan.layouts import Candidate
from megapar.plan.problem import Problem, attention_dropout


def _heads(cfg) -> int:
    return heads(cfg)


def value_size(cfg) -> int:
    """A value head's size: Multi-head Latent Attention's v_head_dim, the head size otherwise."""
    return getattr(cfg, "v_head_dim", head_size(cfg))


def kv_width(cfg, t: int) -> int:
    """Elements per token of this tp rank's keys and values together, as the ring and the
    all-gather send them: its kv heads x (the head size + the value head size: Multi-head
    Latent Attention's v_head_dim, the head size otherwise). A grouped-query model keeping its
    kv heads whole when tp does not divide them uses those its query heads need (the busiest
    rank's)."""
    return kv_heads_per_rank(cfg, t) * (head_size(cfg) + value_size(cfg))


def cp_method(cfg, comm: str = "auto") -> str:
    """The context-parallel attention megapar runs for this model under --cp-comm-type `comm`
    (`CP_COMM_TYPES`): "ring", "all-gather" or "a2a"; auto: the model's own (`method_for`)."""
    method = CP_COMM_TYPES[comm]
    return method or method_for(_heads(cfg), getattr(cfg, "kv_heads", _heads(cfg)))


def a2a_heads(cfg, t: int, cp: int) -> tuple[int, int]:
    """(query heads, kv heads) a tp rank's all-to-all of q, k and v carries (`a2a.py`): its
    query heads, and its kv heads where they divide over cp (`a2a.kv_plan`: each cp rank's
    query heads then use only its own kv heads), else one per query head (expanded first)."""
    q = _heads(cfg) // t
    kv_total = getattr(cfg, "kv_heads", _heads(cfg))
    kv = kv_total // t if kv_total % t == 0 else 0
    return q, kv if kv and kv % cp == 0 else q


def a2a_elements(p: Problem, c: Candidate) -> tuple[int, int]:
    """(q + k + v, output) elements of one layer's two all-to-alls per micro-batch: what a rank
    sends (its own cp-th included) of its s / cp tokens at the heads `a2a_heads` names, every
    one at the head size (Multi-head Latent Attention's v zero-padded to it: q, k and v travel
    as one tensor)."""
    q, kv = a2a_heads(p.config, c.tp, c.cp)
    per_head = c.mbs * (p.seq_len // c.cp) * head_size(p.config)
    return (q + 2 * kv) * per_head, q * per_head


def cp_block(p: Problem, c: Candidate) -> int:
    """Elements of this rank's K/V block (keys and values of its s / cp tokens, `kv_width`)."""
    return (p.seq_len // c.cp) * c.mbs * kv_width(p.config, c.tp)


def cp_traffic(p: Problem, c: Candidate) -> dict[str, list[tuple[str, int, int]]]:
    """What one layer's context-parallel attention sends per micro-batch, as megapar issues it:
    {"forward" / "backward": [(operation, calls, payload bytes of each)]} (empty at cp 1).
    A ring exchange is one send (and one receive) of a block; an all-gather's payload is this
    rank's block, a reduce-scatter's the cp blocks of gradients (fp32); the all-to-all (a2a)
    sends q, k and v in one call and the output in another forward, their gradients backward
    (`a2a_elements`, activation dtype)."""
    if c.cp == 1:
        return {"forward": [], "backward": []}
    n, block = c.cp, cp_block(p, c)
    method = cp_method(p.config, c.cp_comm)
    if method == "a2a":
        qkv, out = a2a_elements(p, c)
        both = [("all-to-all", 1, qkv * p.act_bytes), ("all-to-all", 1, out * p.act_bytes)]
        return {"forward": both, "backward": list(both)}
    if method == "ring":
        return {
            "forward": [("send", n - 1, block * p.act_bytes)],
            "backward": [("send", n - 1, block * p.act_bytes), ("send", n, block * 4)],
        }
    return {
        "forward": [("all-gather", 1, block * p.act_bytes)],
        "backward": [("all-gather", 1, block * p.act_bytes), ("reduce-scatter", 1, n * block * 4)],
    }


def step_a2a(p: Problem, c: Candidate, layers: int) -> int:
    """One rank's all-to-all payload bytes per step of the all-to-all attention (0 for other
    methods and at cp 1): `cp_traffic`'s forward (twice where recomputation repeats the
    attention's forward: selective and full) and backward, x its pipeline rank's `layers`
    attention layers x the micro-batches of its dp rank."""
    if c.cp == 1 or cp_method(p.config, c.cp_comm) != "a2a":
        return 0
    traffic = cp_traffic(p, c)
    forward = sum(calls * nbytes for _, calls, nbytes in traffic["forward"])
    backward = sum(calls * nbytes for _, calls, nbytes in traffic["backward"])
    forwards = 2 if c.recompute != "none" else 1
    m = p.global_batch // (c.mbs * c.dp)
    return (forwards * forward + backward) * layers * m


DRY_RUN_NAMES = {
    "send": ("send", "receive"),
    "all-gather": ("all_gather",),
    "reduce-scatter": ("reduce_scatter",),
}
"""`cp_traffic`'s operations of the ring and the all-gather -> the collectives a dry run counts
them as in the cp group (a ring's send is as many bytes received)."""


def step_cp_bytes(p: Problem, c: Candidate, layers: int) -> dict[str, int]:
    """One rank's cp group bytes per step of the ring or the all-gather attention, by the
    collectives a dry run counts (`DRY_RUN_NAMES`; {} for the all-to-all, `step_a2a`, and at
    cp 1): `cp_traffic`'s forward (twice where recomputation repeats the attention's forward:
    selective and full) and backward, an all-gather counted by its output (cp blocks), x its
    pipeline rank's `layers` attention layers x the micro-batches of its dp rank."""
    if c.cp == 1 or cp_method(p.config, c.cp_comm) == "a2a":
        return {}
    traffic = cp_traffic(p, c)
    forwards = 2 if c.recompute != "none" else 1
    m = p.global_batch // (c.mbs * c.dp)
    out: dict[str, int] = {}
    for way, repeats in (("forward", forwards), ("backward", 1)):
        for op, calls, nbytes in traffic[way]:
            counted = calls * nbytes * (c.cp if op == "all-gather" else 1) * repeats
            for name in DRY_RUN_NAMES[op]:
                out[name] = out.get(name, 0) + counted * layers * m
    return out


FLASH_KV_SPLIT = 512
"""Key columns per tile of the CPU flash kernel's backward (PyTorch's
`_scaled_dot_product_flash_attention_for_cpu_backward`)."""


def _flash_q_split(rows: int) -> int:
    """Query rows per tile of the CPU flash kernel's backward: 256 from 768 rows on, 64 from
    192, else 32 (and never more than the rows)."""
    return min(rows, 256 if rows >= 768 else 64 if rows >= 192 else 32)


MATH_SCORES = 6
"""Score-sized fp32 tensors ([b, heads, r, n]) the unfused kernel's backward
(`kernels.block_backward`, "math") holds at its peak with dropout: the scores and
probabilities, dP, the mask's draw and the mask, then P x mask, dP x mask, dP - delta and dS
(measured: docs/guides/planner.md, "The process at its peak")."""


@functools.cache
def cp_attention_peak(
    method: str,
    cp: int,
    q_elems: int,
    kv_elems: int,
    act_bytes: int,
    rows: int,
    causal: bool = True,
    cpu: bool = False,
    scores_per_elem: int = 0,
    expanded_elems: int = 0,
) -> float:
    """Bytes a rank's context-parallel attention allocates at the peak of its backward
    (`RingAttention.backward` / `AllGatherAttention.backward` with a fused kernel), beyond the
    tensors saved in forward and the incoming gradient, on the busiest cp rank: the walk of every
    rank's sources and kernel calls (`megapar.context_parallel.attention.plan`). q_elems: a rank's
    query elements (b x its heads x s / cp x d); kv_elems: its K/V block (keys and values at its kv
    heads, `cp_block`); rows: its tokens per sequence (s / cp); `cpu`: a CPU rank (gloo's copy, one
    thread's flash tiles); scores_per_elem: with attention dropout (the unfused "math" kernel,
    `kernels.choose_kernel`), b x query heads, else 0; expanded_elems: a block's K and V at the
    query heads (0: 2 x q_elems, v as wide as q; Multi-head Latent Attention's v is narrower).
    Forward holds less (measured).

    Held through the backward: dq accumulated in fp32 (q_elems x 4). Per source block: K/V
    expanded to the query heads (g = query heads / kv heads; a copy only when g > 1) and their
    gradients in fp32 (g x kv_elems x 4). Per kernel call of r query rows against n key
    columns: dout's and out's rows made contiguous and the kernel's dq (3 x the rows' query
    elements, activation dtype), its dK/dV (n columns of the expanded block, activation dtype),
    its fp32 dq accumulator (4 bytes a query element of the rows) and, on a CPU, one thread's
    two fp32 tiles of scores (`_flash_q_split` x `FLASH_KV_SPLIT`; megapar's CPU ranks run one
    thread); the previous call's dq, dK and dV are still held while the next one runs. With
    attention dropout a call also holds `MATH_SCORES` fp32 r x n score-sized tensors a head and
    sequence (the scores, probabilities, dP, the dropout mask and its draw, dS), not the tiles.

    - ring, step i: the block worked on and, before the last step, the next one arriving
      (activation dtype), from step 1 on the dK/dV travelling (sent and received, fp32); or, at
      `ring.start` of a block's dK/dV, the last ones still in flight and the new pair.
    - all-gather, source j: the gathered blocks (cp x kv_elems, activation dtype) and the j
      fp32 dK/dV of the sources before; then the list stacked into one tensor beside it (2 x cp
      fp32 blocks); then the reduce-scatter of that stack (on a CPU gloo copies its input)."""
    a, w = act_bytes, 4
    expanded = expanded_elems or 2 * q_elems  # a block's K and V at the query heads: g x kv_elems
    per_row, per_col = q_elems / rows, expanded / rows
    g = expanded / kv_elems
    held_block = (expanded * a if g > 1 else 0) + expanded * w  # expanded K/V, fp32 dK/dV

    def call_bytes(q: slice, kv: slice) -> tuple[float, float]:
        r, n = q.stop - q.start, kv.stop - kv.start
        tiles = 2 * _flash_q_split(r) * min(FLASH_KV_SPLIT, n) * w if cpu else 0
        if scores_per_elem:
            tiles = MATH_SCORES * r * n * scores_per_elem * w
        outputs = r * per_row * a + n * per_col * a
        return 2 * r * per_row * a + r * per_row * w + tiles + outputs, outputs

    def source_peak(rank: int, source: int) -> float:
        peak, previous = 0.0, 0.0
        for call in attention_calls(cp, rank, source, rows // 2, causal):
            now, outputs = call_bytes(call.q, call.kv)
            peak, previous = max(peak, now + previous), outputs
        return held_block + peak

    dq, block = q_elems * w, kv_elems
    worst = 0.0
    for rank in range(cp):
        for i in range(cp):
            if method == "ring":
                source = (rank - i) % cp
                blocks = block * a * (2 if i + 1 < cp else 1)
                travelling = 2 * block * w if i else 0
                moment = max(travelling + source_peak(rank, source), 4 * block * w if i else 0)
            else:
                source = i
                blocks = cp * block * a
                moment = i * block * w + source_peak(rank, source)
            worst = max(worst, dq + blocks + moment)
    if method != "ring":
        gloo = cp * block * w if cpu else 0
        end = max(2 * cp * block * w, (cp + 1) * block * w + gloo)
        worst = max(worst, dq + cp * block * a + end)
    return worst


def cp_buffers(p: Problem, c: Candidate) -> float:
    """Transient bytes of context-parallel attention in one layer (0 at cp 1): the peak of its
    backward on the most loaded rank (`cp_attention_peak` for the ring or the all-gather,
    `a2a_buffers` for the all-to-all: the method the candidate's --cp-comm-type runs,
    `cp_method`) at the plan's target."""
    if c.cp == 1:
        return 0.0
    cfg = p.config
    rows = p.seq_len // c.cp
    q_elems = rows * c.mbs * (_heads(cfg) // c.tp) * head_size(cfg)
    method = cp_method(cfg, c.cp_comm)
    if method == "a2a":
        return a2a_buffers(p, c)
    return cp_attention_peak(
        method,
        c.cp,
        q_elems,
        cp_block(p, c),
        p.act_bytes,
        rows,
        getattr(cfg, "model_type", "") != "bert",
        p.target == "cpu",
        c.mbs * (_heads(cfg) // c.tp) if attention_dropout(cfg) else 0,
        q_elems + q_elems // head_size(cfg) * value_size(cfg),
    )


def cp_document_call_bytes(s: int, b: int, cp: int, act_bytes: int) -> float:
    """--attention-mask-type block_causal under the ring or the all-gather: the largest kernel
    call's document mask (`attention._Pass._document_bias`), made per call and not kept: one
    chunk's s / (2 cp) queries against two chunks' keys, the boolean comparison and the
    additive mask in the attention's dtype, [b, 1, s / (2 cp), s / cp] each."""
    return b * (s // (2 * cp)) * (s // cp) * (1 + act_bytes)


def a2a_buffers(p: Problem, c: Candidate) -> float:
    """Kept: nothing beyond the layer's terms (`plan.memory.layer_bytes`). During the core each
    rank holds the whole sequence for its cp-th of the heads: q, k and v (k and v at the query
    heads, expanded or picked from its own kv heads) and the output, each b x heads / (tp cp)
    x s x d elements, which is b x heads / tp x s / cp x d: what the layer terms count for its
    s / cp tokens of every head (q, k, v and the output at the query heads' width); the
    all-to-alls' inputs are not kept (`a2a.py`'s functions save nothing). Checked against the
    dry run (tests/test_dry_run.py).

    Transient bytes of the all-to-all attention's backward (activation dtype): the
    attention's gradients of q, k and v at the query heads (3 x q elements: a rank's cp-th of
    the heads over the whole sequence holds as many as its s / cp tokens of every head), then
    their all-to-all back in one call: its send and receive buffers and the chunks reassembled
    (3 x the q + k + v elements, `a2a_elements`)."""
    qkv, out = a2a_elements(p, c)
    return (3 * out + 3 * qkv) * p.act_bytes


def cp_layer_seconds(p: Problem, c: Candidate, attention_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's context-parallel communication that are not
    hidden (`cp_traffic` over the intra-node link while tp x cp fits a node): a ring exchange
    overlaps the block attention it runs beside (a cp-th of `attention_s`, the layer's attention
    forward; twice that backward), the all-gather's ring collectives ((cp - 1) steps of a
    block) do not, nor the all-to-alls ((cp - 1) / cp of each payload leaves the rank)."""
    n = c.cp
    gbps = p.intra_gbps if c.tp * n <= p.gpus_per_node else p.inter_gbps

    def seconds(op: str, nbytes: int, hide: float) -> float:
        if op == "all-to-all":  # (cp - 1) / cp of the payload leaves, in one exchange
            return nbytes * (n - 1) / n * 8 / (gbps * 1e9) + p.latency_us * 1e-6
        steps, size = (
            (1, nbytes) if op == "send" else (n - 1, nbytes / (n if op == "reduce-scatter" else 1))
        )
        wire = steps * (size * 8 / (gbps * 1e9) + p.latency_us * 1e-6)
        return max(0.0, wire - hide) if op == "send" else wire

    traffic = cp_traffic(p, c)
    forward, backward = (
        sum(
            calls * seconds(op, nbytes, hide * attention_s / n)
            for op, calls, nbytes in traffic[way]
        )
        for way, hide in (("forward", 1), ("backward", 2))
    )
    return forward, backward
