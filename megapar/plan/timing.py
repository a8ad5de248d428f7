"""The planner's time model of one step's compute: what one micro-batch costs on every model
chunk of every pipeline rank (`chunk_times`, tp and cp communication included) and the seconds
of the pipeline they make (`pipeline_time`: simulated or the formula's bubble)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megapar.mesh import Layout
from megapar.models.flops import matmul_flops
from megapar.pipeline.partition import EVEN, PipelineSplit, chunk_specs
from megapar.pipeline.placement import placement_of
from megapar.plan import experts, fp8, pipeline
from megapar.plan.context_parallel import cp_layer_seconds
from megapar.plan.layouts import Candidate, regathers
from megapar.plan.problem import Problem
from megapar.tensor_parallel.partition import local_size


def ring_seconds(n: int, nbytes: float, gbps: float, latency_us: float = 0.0) -> float:
    """Ring all-reduce: 2 (n-1) steps, each moving 1/n of the bytes."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * (nbytes / n * 8 / (gbps * 1e9) + latency_us * 1e-6)


def attention_inputs(config) -> tuple[int, ...]:
    """Numbers a token of each tensor that enters a layer's attention tp region, each in a
    collective of its own (its gradient's all-reduce in the backward; under SP its all-gather
    in the forward and reduce-scatter in the backward; under --sp-regather one more all-gather
    in the backward). Megatron's attention: the normed hidden states, h. DeepSeek-V3's
    Multi-head Latent Attention (`megapar.models.deepseek`), whose down projections are whole on
    every tp rank: their outputs, the q latent, the normed kv latent and the shared rotary key,
    as one tensor (q_lora_rank + kv_lora_rank + qk_rope_head_dim; 2,112 against h = 7,168 in
    DeepSeek-V3), re-gathered once for q_b and kv_b, which read its columns
    (`tensor_parallel.regather.split_keeping_shard`); with a plain q projection (q_lora_rank
    None) the kv latent and rotary key, and q's own input (h)."""
    h = config.hidden_size
    if not getattr(config, "mla", False):
        return (h,)
    kv = config.kv_lora_rank + config.qk_rope_head_dim
    if config.q_lora_rank is None:
        return (kv, h)
    return (config.q_lora_rank + kv,)


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
    ep: float = 0.0
    """Of F + B + W, the seconds of the MoE layers' all-to-alls (expert parallelism)."""
    fp8_flops: float = 0.0
    """Of `flops`, the float8 linears' products (--fp8), run at `Problem.fp8_speedup` x the
    rate."""

    @property
    def total(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


def recompute_stops_before_mlp_output(cfg) -> bool:
    """Whether a fully recomputed block stops before its MLP's output reduction: torch's
    checkpoint re-runs the forward only up to the last tensor the backward reads, and in a
    pre-norm block without dropout (GPT-2 at resid_pdrop 0, Llama) nothing after that
    reduction keeps one (the residual add keeps none). A dropout there (GPT-2's resid_pdrop,
    BERT's hidden_dropout_prob) keeps its mask, and BERT's post-norm its input, so the reduction
    runs again (`megapar-train --dry-run` counts it)."""
    if getattr(cfg, "model_type", "") == "bert":
        return False
    return not getattr(cfg, "resid_pdrop", 0) > 0


def chunk_times(p: Problem, c: Candidate) -> list[list[ChunkTime]]:
    """Per pipeline rank, per model chunk, what one micro-batch costs (`ChunkTime`): the
    chunk's blocks, plus the LM head on the chunk that holds it (the last virtual stage: rank
    pp - 1, or rank 0 in the V placement) and the embedding's tp reduction on the first; matmul
    FLOPs (`megapar.models.flops`, this tp rank's share, s / cp tokens) at peak x efficiency.

    Under --fp8 (`plan.fp8`) the float8 linears' products run at `Problem.fp8_speedup` x that
    rate (their casts' memory traffic not modelled: an upper bound on the gain), their weight
    gradients in B (a zero-bubble schedule does not defer them), and each of their amax
    all-reduces over tp or cp costs its messages' latency (the weights' casts, once a step,
    spread over the step's micro-batches' forwards)."""
    cfg, b, t, n = p.config, c.mbs, c.tp, c.cp
    tokens = p.seq_len // n * b  # this cp rank's tokens
    fl = matmul_flops(cfg, p.seq_len, t, etp=c.etp)
    rate = p.peak_tflops * 1e12 * p.efficiency

    def rings(width: int) -> float:  # one all-reduce of `width` numbers a token
        return ring_seconds(t, tokens * width * p.act_bytes, p.intra_gbps, p.latency_us)

    def fp32_rings(width: int) -> float:  # the same of fp32 numbers
        return ring_seconds(t, tokens * width * 4, p.intra_gbps, p.latency_us)

    ring = rings(cfg.hidden_size)  # one all-reduce of the activations
    # every tp collective of activations or their gradients moves the activations' dtype, as
    # Megatron's: megapar-train's autocast keeps the residual stream, the norms' outputs and the
    # embedding's output in fp32, but casts them to the autocast dtype where they enter a tp
    # collective (`tensor_parallel.mappings.to_wire_dtype`): the paper's 2 + 2 all-reduces of
    # s b h x 2 bytes a layer under bf16 / fp16
    half = 0.5 if c.sp else 1.0  # SP: an all-gather or reduce-scatter
    # per layer, the attention: its output's all-reduce in the forward (the row-parallel
    # projection's) and its inputs' gradients' in the backward (`attention_inputs`: MLA's
    # latents, not h); SP: an all-gather of each input and a reduce-scatter of the output in
    # the forward, the reverse in the backward, each half an all-reduce's ring bytes
    inputs = attention_inputs(cfg)
    entry = sum(rings(width) for width in inputs)
    attn_f = (entry + ring) / 2 if c.sp else ring
    attn_b = attn_f if c.sp else entry
    # a dense MLP (and a MoE layer's shared experts, split over tp like it; its routed experts
    # are whole on every tp rank): its output's all-reduce forward, its input's gradient's
    # backward, of s b h each (SP: as the attention's)
    shared = bool(getattr(cfg, "shared_expert_intermediate_size", 0))
    stops = recompute_stops_before_mlp_output(cfg)  # the model's, the same for every chunk
    # --sp-regather: one more all-gather of each input in the backward (the attention's,
    # the MLP's), counted exposed (the run overlaps it with one input-gradient matmul: an upper
    # bound)
    regather = regathers(p, c)
    attn_regather = entry / 2 if regather else 0.0
    mlp_regather = ring / 2 if regather else 0.0
    # with the routed experts split over tp (etp): their output's all-reduce in the forward and
    # the tokens' gradient's in the backward (under SP an all-gather and a reduce-scatter
    # each, the same ring bytes), in the activations' dtype, and the combine weights'
    # gradient (T k fp32); under SP the weights and choices ([T, 2k] fp32) are gathered in the
    # forward too, their gradient reduce-scattered (`experts.expert_tp_collectives`)
    k_routed = getattr(cfg, "num_experts_per_tok", 0)
    picks = fp32_rings(2 * k_routed) / 2 if c.sp else 0.0
    etp_f = ring + picks if c.etp > 1 else 0.0
    etp_b = (
        ring + fp32_rings(k_routed) + (etp_f if c.recompute == "full" else 0.0)
        if c.etp > 1
        else 0.0
    )
    cp_f, cp_b = cp_layer_seconds(p, c, tokens * fl.attention / rate)
    cp_b += cp_f if c.recompute != "none" else 0.0
    extra = {"none": 0.0, "selective": fl.attention, "full": fl.layer()}[c.recompute]
    logits = 2 * cfg.hidden_size * local_size(cfg.vocab_size, t, cfg.make_vocab_size_divisible_by)
    in_forward = pipeline.loss_grads_in_forward(p, c)
    ep_f, ep_b = alltoall_seconds(p, c)
    f8 = fp8.converted_flops(p, t)  # per kind of block, per token: the float8 products
    amax = fp8.block_reductions(p, c)  # per kind of block: (tp F, tp B, cp F, cp B) counts
    lat = p.latency_us  # an amax all-reduce: a scalar or a row of scales, its latency
    amax_tp, amax_cp = ring_seconds(t, 0, p.intra_gbps, lat), ring_seconds(n, 0, p.intra_gbps, lat)
    full = 1 if c.recompute == "full" else 0  # the forward's casts and products again in B
    m = max(p.global_batch // (c.mbs * c.dp), 1)  # micro-batches a step

    def cost(k: int, first: bool, last: bool, k_moe: int) -> ChunkTime:
        x8 = tokens * ((k - k_moe) * f8.get(False, 0.0) + k_moe * f8.get(True, 0.0))
        cut = x8 * (1 - 1 / p.fp8_speedup)  # one pass of the float8 products, FLOP-equivalent
        n8 = [
            (k - k_moe) * a + k_moe * b
            for a, b in zip(amax.get(False, (0,) * 5), amax.get(True, (0,) * 5), strict=True)
        ]
        # the weights' casts, once a step: their all-reduces spread over its micro-batches
        tp8_f, cp8_f = (n8[0] + n8[4] / m) * amax_tp, n8[2] * amax_cp
        tp8_b = (n8[1] + full * n8[0]) * amax_tp
        cp8_b = (n8[3] + full * n8[2]) * amax_cp
        head = fl.head if last else 0.0
        # the chunked loss at tp 1 with one loss in flight makes the head's input and weight
        # gradients in its forward (the logits computed once); else its backward recomputes them
        fused = last and in_forward
        recomputed = logits if last and p.loss_chunk_tokens and not in_forward else 0.0
        moved = logits if fused else 0.0  # the logits' share of the head (BERT: + transform)
        f = tokens * (k * fl.layer() + head + 2 * moved)
        w = tokens * (k * fl.block + head - moved)
        bi = tokens * (k * (fl.block + 2 * fl.attention + extra) + head - moved + recomputed)
        emb_comm = ring * half if first else 0.0  # the vocab-parallel lookup's reduction
        emb_b = ring * 0.5 if first and c.sp else 0.0  # SP: its output's gradient gathered
        head_f = ring * 0.5 if last and c.sp else 0.0  # SP: its input gathered
        head_b = ring * half if last else 0.0  # its input's gradient
        mlps = k - k_moe + (k_moe if shared else 0)  # MLPs split over tp
        tp_fwd = k * attn_f + mlps * ring
        # full recompute re-runs each layer's forward up to the last tensor its backward
        # reads (torch.utils.checkpoint's early stop): a layer whose MLP is split over tp
        # stops before that MLP's output reduction (SP: its reduce-scatter) unless something
        # after it keeps a tensor (`recompute_stops_before_mlp_output`)
        again = tp_fwd - (mlps * ring * half if stops else 0.0)
        tp_bwd = k * attn_b + mlps * ring + (again if c.recompute == "full" else 0.0)
        regathered = k * attn_regather + mlps * mlp_regather
        return ChunkTime(
            (f - cut) / rate
            + k_moe * etp_f
            + tp_fwd
            + k * cp_f
            + emb_comm
            + head_f
            + k_moe * ep_f
            + tp8_f
            + cp8_f,
            (bi + x8 - cut * (2 + full)) / rate
            + k_moe * etp_b
            + tp_bwd
            + k * cp_b
            + regathered
            + emb_b
            + head_b
            + k_moe * ep_b
            + tp8_b
            + cp8_b,
            (w - x8) / rate,
            f + bi + w,
            tp_fwd
            + tp_bwd
            + k_moe * (etp_f + etp_b)
            + regathered
            + emb_comm
            + emb_b
            + head_f
            + head_b
            + tp8_f
            + tp8_b,
            k * (cp_f + cp_b) + cp8_f + cp8_b,
            k_moe * (ep_f + ep_b),
            x8 * (3 + full),
        )

    shapes = chunk_shapes(
        cfg.num_layers, c.pp, c.v, placement_of(c.schedule), p.layer_kinds, p.pipeline_split
    )
    costs = {shape: cost(*shape) for shape in {x for row in shapes for x in row}}
    return [[costs[x] for x in row] for row in shapes]


@lru_cache(maxsize=4096)
def ep_span(tp: int, pp: int, dp: int, cp: int, ep: int) -> int:
    """The most consecutive global ranks an ep group spans (last - first + 1; megapar-train's
    groups, `Layout.ep_block`, in the default rank order; the groups at other tp and pp
    coordinates are shifted copies)."""
    layout = Layout(tp, pp, dp, cp=cp, ep=ep)
    blocks = (layout.ep_block(0, 0, b) for b in range(dp * cp // ep))
    return max(block[-1] - block[0] + 1 for block in blocks)


def alltoall_seconds(p: Problem, c: Candidate) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's all-to-alls per micro-batch under ep
    (`experts.alltoall_bytes`): the share of the rows that leaves the rank, (ep - 1) / ep
    under uniform routing, over the link the ep group spans (ep consecutive ranks of the cp x
    dp index: within a node while the global ranks it spans fit one, `ep_span`), plus ep - 1
    message latencies per all-to-all (three forward, two backward; full recomputation repeats
    the forward's two rows'). Not overlapped: the experts wait for their rows and the next
    layer for the combine."""
    if c.ep == 1:
        return 0.0, 0.0
    cfg = p.config
    tokens = experts.routed_tokens(p.seq_len, c.mbs, c.cp, experts.routing_split(c))
    nbytes = experts.alltoall_bytes(cfg, tokens, c.ep, p.act_bytes, c.recompute)
    span = ep_span(c.tp, c.pp, c.dp, c.cp, c.ep)
    gbps = p.intra_gbps if span <= p.gpus_per_node else p.inter_gbps
    share, lat = experts.leaving(c.ep), (c.ep - 1) * p.latency_us * 1e-6

    def seconds(n: float, calls: int) -> float:
        return n * share * 8 / (gbps * 1e9) + calls * lat

    full = c.recompute == "full"
    return (
        seconds(nbytes.counts + nbytes.forward, 3),
        seconds(nbytes.backward + nbytes.recompute, 4 if full else 2),
    )


@lru_cache(maxsize=4096)
def chunk_shapes(
    num_layers: int,
    pp: int,
    v: int,
    placement: str,
    kinds: tuple = (),
    split: PipelineSplit = EVEN,
) -> tuple:
    """Per rank, per model chunk: (blocks, holds the embedding, holds the head, MoE blocks);
    `kinds`: 1 for each MoE layer, 0 for a dense one (none: a dense model); the blocks cut as
    `split` says."""
    return tuple(
        tuple(
            (
                len(spec.layers),
                spec.pre_process,
                spec.post_process,
                sum(kinds[i] for i in spec.layers) if kinds else 0,
            )
            for spec in chunk_specs(num_layers, pp, stage, v, placement, split)
        )
        for stage in range(pp)
    )


def pipeline_time(
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
