"""Context-parallel attention's cost in the planner: what one layer sends per micro-batch
(`cp_traffic`), the transient buffers it holds (`cp_buffers`) and the seconds of it not hidden
behind the attention (`cp_layer_seconds`), for the ring or the all-gather megapar runs."""

from __future__ import annotations

from megapar.context_parallel import method_for
from megapar.models.flops import head_size, heads, kv_heads_per_rank
from megapar.plan.layouts import Candidate
from megapar.plan.problem import Problem


def _heads(cfg) -> int:
    return heads(cfg)


def kv_width(cfg, t: int) -> int:
    """Elements per token of this tp rank's keys (as many for values): its kv heads x head size
    (a grouped-query model keeping its kv heads whole when tp does not divide them uses those
    its query heads need; the busiest rank's)."""
    return kv_heads_per_rank(cfg, t) * head_size(cfg)


def cp_method(cfg) -> str:
    """The context-parallel attention megapar uses for this model (`method_for`)."""

    return method_for(_heads(cfg), getattr(cfg, "kv_heads", _heads(cfg)))


def cp_block(p: Problem, c: Candidate) -> int:
    """Elements of this rank's K/V block (keys and values of its s / cp tokens)."""
    return 2 * (p.seq_len // c.cp) * c.mbs * kv_width(p.config, c.tp)


def cp_traffic(p: Problem, c: Candidate) -> dict[str, list[tuple[str, int, int]]]:
    """What one layer's context-parallel attention sends per micro-batch, as megapar issues it:
    {"forward" / "backward": [(operation, calls, payload bytes of each)]} (empty at cp 1).
    A ring exchange is one send (and one receive) of a block; an all-gather's payload is this
    rank's block, a reduce-scatter's the cp blocks of gradients (fp32)."""
    if c.cp == 1:
        return {"forward": [], "backward": []}
    n, block = c.cp, cp_block(p, c)
    if cp_method(p.config) == "ring":
        return {
            "forward": [("send", n - 1, block * p.act_bytes)],
            "backward": [("send", n - 1, block * p.act_bytes), ("send", n, block * 4)],
        }
    return {
        "forward": [("all-gather", 1, block * p.act_bytes)],
        "backward": [("all-gather", 1, block * p.act_bytes), ("reduce-scatter", 1, n * block * 4)],
    }


def cp_buffers(p: Problem, c: Candidate) -> float:
    """Transient bytes of context-parallel attention in one layer (0 at cp 1): the ring's K/V
    block sent, received and stacked, and backward's fp32 dK/dV the same; the all-gather's K/V
    of the whole sequence and, backward, their fp32 gradients."""
    if c.cp == 1:
        return 0.0
    block = cp_block(p, c)
    if cp_method(p.config) == "ring":
        return 3 * block * (p.act_bytes + 4)
    return c.cp * block * (p.act_bytes + 4)


def cp_layer_seconds(p: Problem, c: Candidate, attention_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's context-parallel communication that are not
    hidden (`cp_traffic` over the intra-node link while tp x cp fits a node): a ring exchange
    overlaps the block attention it runs beside (a cp-th of `attention_s`, the layer's attention
    forward; twice that backward), the all-gather's ring collectives ((cp - 1) steps of a
    block) do not."""
    n = c.cp
    gbps = p.intra_gbps if c.tp * n <= p.gpus_per_node else p.inter_gbps

    def seconds(op: str, nbytes: int, hide: float) -> float:
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
