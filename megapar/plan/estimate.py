"""Predict one candidate layout: memory of the most loaded rank and the time of one step.

Time model (all per optimizer step):

- compute: matmul FLOPs / (peak TFLOP/s x efficiency), counted per model chunk of every
  pipeline rank for what it holds (`chunk_times`): its blocks, the LM head on the chunk with the
  last virtual stage (rank pp - 1; rank 0 in the V placement of zb-v / dualpipev), the
  embedding (a lookup: its tp reduction, no matmul) on the first. FLOPs are the models' own
  (`megapar.models.flops`: SwiGLU and grouped-query attention for Llama, the padded vocabulary
  shard), this tp rank's share. Backward = 2 x forward, split into B (input gradients, the
  attention core's whole backward) and W (weight gradients) for zero-bubble schedules; full
  recompute adds a forward of the blocks to B, selective the attention core.
- pipeline: the schedule run on megapar's simulator with every chunk's own F / B / W (the step's
  pipeline part is its makespan: the slowest stage sets it), or, for a schedule megapar does
  not run or one too large to simulate, the formula's bubble around the busiest rank; the
  reported bubble is the ranks' idle share of that, averaged (uneven stages included). Plus
  2 (p-1) activation transfers on the fill / drain critical path (steady-state transfers
  overlap compute); a stage boundary uses the inter-node link once tp x pp exceeds a node.
- tensor parallelism: per layer 2 all-reduces of s b h activations in the forward and 2 in the
  backward (with SP: all-gather + reduce-scatter, the same bytes), ring cost 2 (t-1)/t x bytes /
  intra-node bandwidth + 2 (t-1) message latencies, not overlapped (they sit between the
  matmuls); full recompute repeats the forward's. The embedding adds one forward reduction
  (SP: a reduce-scatter, half the bytes), the head its input gradient's all-reduce backward
  (SP: an all-gather forward and a reduce-scatter backward).
- context parallelism (cp > 1): every per-token cost (FLOPs, activations, tp and pp bytes) is of
  s / cp tokens, and attention's s^2 term is split by cp too (load-balanced chunks). Per layer
  and micro-batch the ring (GPT-2, BERT, multi-head Llama) exchanges cp - 1 K/V blocks forward
  (each 2 s/cp b kv-width bytes, on the intra-node link while tp x cp fits a node), overlapped
  with the block's attention (only the part longer than it is exposed), and cp - 1 K/V plus cp
  fp32 dK/dV blocks backward; the all-gather (grouped-query Llama) gathers the K/V forward and
  again backward and reduce-scatters their fp32 gradients, exposed. Full recompute repeats the
  forward's. Transient buffers: one K/V block in flight (ring) or the whole sequence's K/V and
  their gradients (all-gather). Gradients are reduced over cp x dp.
- data parallelism: gradient all-reduce 2 (d-1)/d x gradient bytes / bandwidth (inter-node once
  the job spans nodes), overlapped with the last micro-batch's backward (as megapar's buckets
  do): only the part longer than that backward is exposed. ZeRO-1 (the distributed optimizer)
  reduce-scatters instead, (d-1)/d x gradient bytes, overlapped the same way, and all-gathers
  the parameters after the step, (d-1)/d x parameter bytes, exposed. ZeRO-2 / 3 and offload:
  `plan/sharding.py`. The tied embedding's gradient all-reduce
  between first and last stage (pp > 1) is exposed.
- the optimizer step, the loss and data loading are not modelled.

MFU counts the model's FLOPs (`megapar.models.flops.training_flops_per_token`, what
megapar-train logs its MFU with) against GPUs x peak; every rank computes at least its share of
them at peak x efficiency, so MFU <= efficiency. `hw_tflops` adds recomputation (what Narayanan
et al. report).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from megapar.context_parallel import method_for
from megapar.models.config import ModelConfig
from megapar.models.flops import (
    head_size,
    heads,
    kv_heads_per_rank,
    matmul_flops,
    training_flops_per_token,
)
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.placement import placement_of
from megapar.plan import memory as mem
from megapar.plan import pipeline
from megapar.plan.layouts import Candidate
from megapar.plan.params import (
    piece_counts,
    stage_layer_counts,
    stage_params,
)
from megapar.plan.sharding import dp_seconds, pcie_seconds
from megapar.plan.state import Offload, RankState, most_loaded, w_reported, whole_grads
from megapar.tensor_parallel.linear_cross_entropy import LOSS_CHUNK_TOKENS
from megapar.tensor_parallel.partition import local_size


@dataclass
class Problem:
    """The model, the cluster and the batch a plan is for."""

    config: ModelConfig
    """Model config (GPT2Config / BertConfig / LlamaConfig)."""
    gpus: int
    """Total GPUs (N)."""
    gpus_per_node: int = 8
    """GPUs per node: tp stays within a node."""
    gpu_memory_gb: float = 80.0
    """Memory per GPU in GiB (an "80 GB" A100 has 80 GiB)."""
    global_batch: int = 512
    """Sequences per optimizer step."""
    seq_len: int = 1024
    """Tokens per sequence."""
    precision: str = "bf16"
    """fp32 (4-byte activations) or bf16 / fp16 (2-byte)."""
    master_weights: str = "fp32"
    """fp32: megapar today (fp32 params + grads + Adam, 16 B/param); separate: 16-bit params +
    fp32 grads + fp32 master and moments (Megatron, 18 B/param)."""
    fused_attention: bool = True
    """Count what torch's fused attention kernels keep, a log-sum-exp per head and token, not
    the a s^2 scores: what megapar-train's `scaled_dot_product_attention` runs on GPUs (flash
    or memory-efficient, attention dropout included) and on CPUs without attention dropout.
    False: the scores, their softmax and dropout mask, as the unfused kernel keeps them (the
    paper's count; megapar-train on a CPU with attention dropout). Context parallelism keeps a
    log-sum-exp either way."""
    peak_tflops: float = 312.0
    """Peak dense TFLOP/s of one GPU in `precision` (A100: 312 bf16, 19.5 fp32)."""
    efficiency: float = 0.6
    """Share of peak the matmuls achieve."""
    intra_gbps: float = 2400.0
    """Intra-node bandwidth per GPU, Gbit/s (A100 NVLink: 2400)."""
    inter_gbps: float = 200.0
    """Inter-node bandwidth per GPU, Gbit/s (one 200 Gb/s HDR InfiniBand NIC per GPU)."""
    latency_us: float = 10.0
    """Latency of one message (a ring collective sends 2 (n-1) of them in sequence)."""
    grad_bucket_mb: float = 25.0
    """megapar-train's --grad-bucket-mb (ZeRO-1 pads each bucket to a multiple of dp)."""
    pcie_gbps: float = 200.0
    """Host-device bandwidth per GPU, Gbit/s (offload's copies; PCIe 4.0 x16: about 200)."""
    zero3_persistence_threshold: int = 0
    """megapar-train's --zero3-persistence-threshold for ZeRO-3 layouts (0: none persist)."""
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
    """megapar-train's --loss-chunk-tokens: the head and loss run this many tokens at a time,
    so one chunk's logits are the most held (0: the whole micro-batch's, kept for backward)."""

    @cached_property
    def config_json(self) -> str:
        """The model config as canonical JSON (what `plan.state`'s cached functions take)."""
        return json.dumps(self.config.to_dict(), sort_keys=True)

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def dropout(self) -> bool:
        c = self.config
        return any(
            getattr(c, k, 0) > 0 for k in ("resid_pdrop", "attn_pdrop", "hidden_dropout_prob")
        )


@dataclass
class Estimate:
    """A candidate's predicted memory and time."""

    candidate: Candidate
    memory: mem.MemoryBreakdown
    fits: bool
    step_s: float
    compute_s: float
    bubble: float
    bubble_source: str
    comm_s: dict = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    hw_tflops: float = 0.0

    @property
    def comm_share(self) -> float:
        return sum(self.comm_s.values()) / self.step_s if self.step_s else 0.0


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


def stage_memory(
    p: Problem, c: Candidate, counts=None, simulate: bool = True
) -> list[mem.MemoryBreakdown]:
    """Memory of one rank of every pipeline stage. Activations: each model chunk's bytes per
    micro-batch (its blocks, plus the embedding on the first chunk, the head on the last)
    weighted by the micro-batches in flight on it, plus the pipeline's message buffers (a sent
    output lives on in its send until the peer has it), at the worst point of the stage's
    program; every per-token figure is of this cp rank's s / cp tokens. `counts`: {stage:
    `pipeline.stage_held` of its program} to use instead of the schedule's (the dry run passes
    its own, whatever the size); `simulate=False` takes the in-flight counts from the
    schedule's formula instead."""
    cfg, s, b, t = p.config, p.seq_len // c.cp, c.mbs, c.tp  # s: this cp rank's tokens
    h, a = cfg.hidden_size, _heads(cfg)
    m = p.global_batch // (c.mbs * c.dp)
    totals, _ = pipeline.in_flight(c.schedule, c.pp, m, c.v, simulate)
    sp_t = t if c.sp else 1
    terms = mem.block_terms(cfg)
    fused = p.fused_attention or c.cp > 1  # cp attention keeps a log-sum-exp, never scores
    per_layer = mem.layer_bytes(
        s,
        b,
        h,
        a,
        t,
        c.sp,
        c.recompute,
        p.act_bytes,
        p.dropout,
        fused,
        norm_stats=True,
        terms=terms,
    )
    full = mem.layer_bytes(
        s, b, h, a, t, c.sp, "none", p.act_bytes, p.dropout, fused, norm_stats=True, terms=terms
    )
    vocab_local = local_size(cfg.vocab_size, t, cfg.make_vocab_size_divisible_by)
    embedding = mem.embedding_bytes(s, b, h, p.dropout, sp_t, terms)
    head = mem.head_bytes(
        s,
        b,
        h,
        vocab_local,
        p.act_bytes,
        whole_vocab=cfg.vocab_size if t == 1 else None,
        terms=terms,
        chunk_tokens=p.loss_chunk_tokens,
    )
    message = s * b * h * p.act_bytes / sp_t  # an activation or its gradient in flight
    out, config_json = [], p.config_json
    placement = placement_of(c.schedule)
    for stage, n_params in enumerate(stage_params(cfg, t, c.pp, c.v, placement, config_json)):
        specs = chunk_specs(cfg.num_layers, c.pp, stage, c.v, placement)
        chunks = [
            len(spec.layers) * per_layer
            + (embedding if spec.pre_process else 0)
            + (head if spec.post_process else 0)
            for spec in specs
        ]
        seen = (counts or {}).get(stage) or (
            pipeline.stage_held(c.schedule, c.pp, m, c.v, stage) if simulate else None
        )
        if seen:

            def held_bytes(point, chunks=chunks):  # called in this iteration only
                flight, buffers = point
                return sum(k * w for k, w in zip(flight, chunks)) + buffers * message

            peak = max(seen, key=held_bytes)
            activations, in_flight = held_bytes(peak), sum(peak[0]) / c.v
        else:  # the formula's count over the chunks, each output held
            in_flight = totals[stage]
            per_chunk = pipeline.chunk_counts(c.schedule, c.pp, m, c.v, stage)
            activations = sum(
                k * (w + (0 if spec.post_process else message))
                for k, w, spec in zip(per_chunk, chunks, specs)
            )
        buffers = cp_buffers(p, c)  # cp attention's K/V in flight
        if c.recompute != "none":  # one layer rebuilt during backward
            buffers += full - per_layer
        if any(spec.post_process for spec in specs):  # the logits' gradient in backward
            buffers += mem.logits_buffer_bytes(s, b, vocab_local, p.act_bytes, p.loss_chunk_tokens)
        if p.master_weights == "fp32":  # what megapar-train holds, byte for byte
            held = most_loaded(
                config_json,
                t,
                c.pp,
                c.v,
                stage,
                c.dp * c.cp,
                c.zero,
                p.grad_bucket_mb,
                placement,
                offload_of(c, p.zero3_persistence_threshold, m),
            )
        else:
            held = _separate(n_params, c)
        out.append(
            mem.MemoryBreakdown(
                stage,
                held.weights,
                held.grads,
                held.optimizer,
                activations,
                int(round(in_flight)),
                buffers,
                held.master,
                held.gathered,
                held.host,
                held.grad_buffers,
            )
        )
    return out


def offload_of(c: Candidate, persist_below: int = 0, m: int = 1) -> Offload:
    """The candidate's offload and ZeRO-3 settings (`persist_below`: the persistence
    threshold, for ZeRO-3; `m`: micro-batches per step), as `plan.state` takes them."""
    return Offload(
        c.offload_optimizer,
        c.offload_params,
        c.keep_params,
        persist_below if c.zero == 3 else 0,
        whole_grads(c.schedule, c.pp, m, c.v, c.zero3_reduce),
        m,
    )


def _separate(n_params: int, c: Candidate):
    """--master-weights separate: the state by formula (`mem.state_bytes`), offload moving the
    optimizer (its fp32 master and moments) or ZeRO-3's 16-bit parameter shards to the host;
    gathered units are not counted."""
    params, grads, optim = mem.state_bytes(n_params, c.dp * c.cp, c.zero, "separate")
    host = (optim if c.offload_optimizer else 0) + (params if c.offload_params else 0)
    return RankState(n_params, int(params), int(grads), int(optim), host=int(host))


def _ring(n: int, nbytes: float, gbps: float, latency_us: float = 0.0) -> float:
    """Ring all-reduce: 2 (n-1) steps, each moving 1/n of the bytes."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * (nbytes / n * 8 / (gbps * 1e9) + latency_us * 1e-6)


@dataclass(frozen=True)
class ChunkTime:
    """Seconds of one micro-batch on one model chunk of one rank."""

    forward: float
    """F: the forward, its tp and cp communication included."""
    backward_input: float
    """B: the input gradient (the attention core's whole backward, recomputation, the
    backward's communication)."""
    backward_weight: float
    """W: the weight gradients (a zero-bubble schedule runs them apart; the others in B)."""
    flops: float
    """Matmul FLOPs of F + B + W."""
    tp: float = 0.0
    """Of F + B + W, the seconds of tp collectives."""
    cp: float = 0.0
    """Of F + B + W, the seconds of cp exchanges not hidden."""

    @property
    def total(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


def chunk_times(p: Problem, c: Candidate) -> list[list[ChunkTime]]:
    """Per pipeline rank, per model chunk, what one micro-batch costs (`ChunkTime`): the
    chunk's blocks, plus the LM head on the chunk that holds it (the last virtual stage: rank
    pp - 1, or rank 0 in the V placement) and the embedding's tp reduction on the first; matmul
    FLOPs (`megapar.models.flops`, this tp rank's share, s / cp tokens) at peak x efficiency."""
    cfg, b, t, n = p.config, c.mbs, c.tp, c.cp
    tokens = p.seq_len // n * b  # this cp rank's tokens
    fl = matmul_flops(cfg, p.seq_len, t)
    rate = p.peak_tflops * 1e12 * p.efficiency
    act = tokens * cfg.hidden_size * p.act_bytes
    ring = _ring(t, act, p.intra_gbps, p.latency_us)  # one all-reduce of the activations
    half = 0.5 if c.sp else 1.0  # SP: an all-gather or reduce-scatter
    tp_fwd = 2 * ring  # per layer (SP: 2 AG + 2 RS, same bytes)
    tp_bwd = tp_fwd * (2 if c.recompute == "full" else 1)
    cp_f, cp_b = cp_layer_seconds(p, c, tokens * fl.attention / rate)
    cp_b += cp_f if c.recompute != "none" else 0.0
    extra = {"none": 0.0, "selective": fl.attention, "full": fl.layer()}[c.recompute]
    logits = 2 * cfg.hidden_size * local_size(cfg.vocab_size, t, cfg.make_vocab_size_divisible_by)

    def cost(k: int, first: bool, last: bool) -> ChunkTime:
        head = fl.head if last else 0.0
        f = tokens * (k * fl.layer() + head)
        w = tokens * (k * fl.block + head)
        recomputed = logits if last and p.loss_chunk_tokens else 0.0  # the chunked loss's
        bi = tokens * (k * (fl.block + 2 * fl.attention + extra) + head + recomputed)
        emb_comm = ring * half if first else 0.0  # the vocab-parallel lookup's reduction
        head_f = ring * 0.5 if last and c.sp else 0.0  # SP: its input gathered
        head_b = ring * half if last else 0.0  # its input's gradient
        return ChunkTime(
            f / rate + k * (tp_fwd + cp_f) + emb_comm + head_f,
            bi / rate + k * (tp_bwd + cp_b) + head_b,
            w / rate,
            f + bi + w,
            k * (tp_fwd + tp_bwd) + emb_comm + head_f + head_b,
            k * (cp_f + cp_b),
        )

    shapes = _chunk_shapes(cfg.num_layers, c.pp, c.v, placement_of(c.schedule))
    costs = {shape: cost(*shape) for shape in {x for row in shapes for x in row}}
    return [[costs[x] for x in row] for row in shapes]


@lru_cache(maxsize=4096)
def _chunk_shapes(num_layers: int, pp: int, v: int, placement: str) -> tuple:
    """Per rank, per model chunk: (blocks, holds the embedding, holds the head)."""
    return tuple(
        tuple(
            (len(spec.layers), spec.pre_process, spec.post_process)
            for spec in chunk_specs(num_layers, pp, stage, v, placement)
        )
        for stage in range(pp)
    )


def _bubble(
    c: Candidate, m: int, times: list[list[ChunkTime]], simulate: bool
) -> tuple[float, float, str]:
    """(seconds of the pipeline's micro-batches, idle share of them averaged over ranks,
    source): the schedule simulated with every chunk's own costs, or, above the simulated size
    or for a schedule megapar does not run, the formula's bubble around the busiest rank."""
    busy = [m * sum(x.total for x in row) for row in times]
    if c.pp == 1:
        return busy[0], 0.0, "no pipeline"
    step = (
        pipeline.simulated_step(
            c.schedule,
            c.pp,
            m,
            c.v,
            tuple(
                tuple((x.forward, x.backward_input, x.backward_weight) for x in row)
                for row in times
            ),
        )
        if simulate
        else None
    )
    if step is not None:
        source = "simulated"
    else:
        worst = times[busy.index(max(busy))]
        f, bi, w = (
            sum(getattr(x, a) for x in worst)
            for a in ("forward", "backward_input", "backward_weight")
        )
        step = max(busy) / (1 - pipeline.formula_bubble(c.schedule, c.pp, m, c.v, f, bi, w))
        source = "formula"
    return step, 1 - sum(busy) / (len(busy) * step), source


def estimate(p: Problem, c: Candidate, simulate: bool = True) -> Estimate:
    """The predicted step of candidate `c`; `simulate=False` takes the pipeline bubble and the
    in-flight micro-batches from their formulas, not the schedule (`plan` ranks so first)."""
    cfg, s, b, t = p.config, p.seq_len, c.mbs, c.tp
    h, n = cfg.hidden_size, c.cp  # every per-token cost below is of s / n tokens
    stages = stage_memory(p, c, simulate=simulate)
    worst = max(stages, key=lambda x: x.total)
    fits = worst.total <= p.gpu_memory_gb * mem.GIB
    m = p.global_batch // (c.mbs * c.dp)
    rate = p.peak_tflops * 1e12 * p.efficiency
    layers = max(stage_layer_counts(cfg.num_layers, c.pp, c.v, placement_of(c.schedule)))
    times = chunk_times(p, c)
    pipe_s, frac, source = _bubble(c, m, times, simulate)
    busiest = max(times, key=lambda row: sum(x.total for x in row))
    t_f = sum(x.forward for x in busiest)
    t_b = sum(x.backward_input + x.backward_weight for x in busiest)
    compute = m * sum(x.flops for x in busiest) / rate
    act = s // n * b * h * p.act_bytes
    one_node = p.gpus <= p.gpus_per_node
    pp_gbps = p.intra_gbps if c.tp * c.pp <= p.gpus_per_node else p.inter_gbps
    dp_gbps = p.intra_gbps if one_node else p.inter_gbps
    p2p = (
        2 * (c.pp - 1) * ((act / (c.tp if c.sp else 1)) * 8 / (pp_gbps * 1e9) + p.latency_us * 1e-6)
    )
    n_params = max(stage_params(cfg, t, c.pp, c.v, placement_of(c.schedule), p.config_json))
    # gradients are reduced in fp32, or fp16 under fp16 (--grad-reduce-dtype auto, Megatron's)
    grad_bytes = n_params * (2 if p.precision == "fp16" else 4)
    # ZeRO's reductions hide behind the backward, gathers behind the compute, except what is
    # longer; ZeRO-1 / 2's parameter all-gather after the step does not (`plan/sharding.py`)
    replicas = c.dp * n  # gradients are reduced over cp x dp
    shard_up = pcie_seconds(n_params * 4 / replicas, p.pcie_gbps) if c.offload_params else 0.0
    dp_exposed = dp_seconds(
        c.zero,
        m,
        c.pp,
        c.keep_params,
        replicas,
        grad_bytes,
        n_params * 4,
        layers + 1,
        dp_gbps,
        p.latency_us,
        t_f,
        t_b,
        shard_up,
        c.zero3_reduce == "micro-batch",
        w_reported(c.schedule, c.pp, m, c.v),
    )
    # --offload-optimizer: the stepped gradients to the host and the parameters back
    zero_s = pcie_seconds(worst.master, p.pcie_gbps) if c.offload_optimizer else 0.0
    tied = (
        _ring(2, piece_counts(cfg, t, p.config_json).tied_copy * 4, pp_gbps, p.latency_us)
        if c.pp > 1
        else 0.0
    )
    stretch = m / (1 - frac)  # the busiest rank's share of the pipeline, bubble included
    comm = {"tp": stretch * sum(x.tp for x in busiest), "pp": p2p + tied, "dp": dp_exposed}
    if c.offload_optimizer:
        comm["host"] = zero_s
    if n > 1:
        comm["cp"] = stretch * sum(x.cp for x in busiest)
    step = pipe_s + p2p + dp_exposed + zero_s + tied
    tokens = p.global_batch * s

    model = training_flops_per_token(cfg, s)
    whole = matmul_flops(cfg, s, 1, padded=False)
    recompute_flops = (
        tokens
        * cfg.num_layers
        * {"none": 0.0, "selective": whole.attention, "full": whole.layer()}[c.recompute]
    )
    return Estimate(
        c,
        worst,
        fits,
        step,
        compute,
        frac,
        source,
        comm,
        tokens / step,
        tokens * model / (step * p.gpus * p.peak_tflops * 1e12),
        (tokens * model + recompute_flops) / (step * p.gpus) / 1e12,
    )
