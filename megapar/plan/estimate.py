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
  backward (with SP: all-gather + reduce-scatter, the same bytes; MLA's attention input: its
  latents' width, `timing.attention_inputs`), ring cost 2 (t-1)/t x bytes /
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

The step is the compute, the exposed communication (`Estimate.comm_s`: the busiest rank's own
tp / cp / ep collectives, and what is outside the schedule) and the busiest rank's idle time in
the pipeline (`Estimate.idle_s`), summed.

MFU counts the model's FLOPs (`megapar.models.flops.training_flops_per_token`, what
megapar-train logs its MFU with) against GPUs x peak; every rank computes at least its share of
them at peak x efficiency, so MFU <= efficiency. `hw_tflops` adds recomputation (what Narayanan
et al. report).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from megapar.device import host_copies_wanted
from megapar.models.flops import heads, matmul_flops, training_flops_per_token
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.placement import placement_of
from megapar.plan import experts, fp8, pipeline
from megapar.plan import memory as mem
from megapar.plan.context_parallel import cp_buffers, cp_document_call_bytes, cp_method
from megapar.plan.layouts import Candidate, regathers
from megapar.plan.params import (
    StageLayout,
    alike_stages,
    piece_counts,
    stage_expert_params,
    stage_layer_counts,
    stage_params,
    stage_tensors,
)
from megapar.plan.problem import Problem
from megapar.plan.process import ProcessPeak, process_floor, process_peak
from megapar.plan.sharding import dp_seconds, pcie_seconds, reduce_scale
from megapar.plan.shared import Shared
from megapar.plan.slices import most_loaded
from megapar.plan.state import Offload, RankState, w_reported, whole_grads
from megapar.plan.timing import (
    ChunkTime,
    chunk_shapes,
    chunk_times,
    pipeline_time,
    ring_seconds,
)
from megapar.tensor_parallel.partition import local_size


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
    process: ProcessPeak | None = None
    """The most loaded rank's process figure (`plan.process`): what `fits` is decided on."""
    idle_s: float = 0.0
    """Seconds the busiest rank waits in the pipeline (its share of the bubble): the step is
    `compute_s` + the exposed communication (`comm_s`) + this."""
    stages: tuple = ()
    """Per pipeline rank (its blocks, its process figure in bytes, its busy seconds a step: the
    F, B and W of its chunks over the step's micro-batches): how evenly the stages are loaded
    (`--decoder-first-pipeline-num-layers` and the like move blocks between them)."""

    @property
    def comm_share(self) -> float:
        """The exposed communication's share of the step (0 to 1)."""
        return sum(self.comm_s.values()) / self.step_s if self.step_s else 0.0


@dataclass(frozen=True)
class ActivationSizes:
    """Bytes per micro-batch of one rank's pieces, of this cp rank's s / cp tokens."""

    per_layer: float
    """A block's activations kept for backward, under the candidate's recompute."""
    full: float
    """A block's activations without recompute (the one rebuilt during backward)."""
    embedding: float
    """The embedding's activations."""
    head: float
    """The LM head's and loss's activations."""
    message: float
    """An activation or its gradient in flight between stages."""
    vocab_local: int
    """This tp rank's (padded) vocabulary shard."""
    per_moe_layer: float = 0.0
    """A mixture-of-experts layer's activations kept for backward (its routed tokens'
    `experts.routed_bytes` at the plan's imbalance included); 0 for a dense model."""
    full_moe: float = 0.0
    """A MoE layer's activations without recompute."""
    document_mask: float = 0.0
    """--attention-mask-type block_causal: one additive mask of the whole sequence
    (`memory.document_mask_bytes`), which a model chunk makes per micro-batch and sliding
    window (`memory.document_masks`) and its attention keeps until the backward; 0 for causal
    attention, and under context parallelism by the ring or the all-gather (a block per kernel
    call: `_stage_buffers`)."""

    def blocks(self, k: int, k_moe: int) -> float:
        """The activations kept by `k` blocks of which `k_moe` are MoE layers."""
        return (k - k_moe) * self.per_layer + k_moe * self.per_moe_layer


def _shape(c: Candidate) -> tuple:
    """The fields of `c` that its activations and chunk times read: all but the ZeRO stage and
    its options (offload, kept parameters, when ZeRO-3 reduces)."""
    return (
        c.tp,
        c.cp,
        c.cp_comm,
        c.pp,
        c.dp,
        c.ep,
        c.etp,
        c.mbs,
        c.schedule,
        c.v,
        c.recompute,
        c.sp,
    )


def _size_fields(p: Problem, c: Candidate) -> tuple:
    """What `activation_sizes` reads of candidate `c` (its `Shared` key): tp, cp and the cp
    attention it runs, the micro-batch size, recomputation, SP, ep, etp, and of the rest (pp,
    dp, the schedule) only whether `--sp-regather` applies and whether the loss makes its
    gradients in the forward."""
    return (
        c.tp,
        c.cp,
        cp_method(p.config, c.cp_comm) if c.cp > 1 else None,
        c.mbs,
        c.recompute,
        c.sp,
        c.ep,
        c.etp,
        regathers(p, c),
        pipeline.loss_grads_in_forward(p, c),
    )


def activation_sizes(p: Problem, c: Candidate) -> ActivationSizes:
    """The activation bytes per micro-batch of a block, the embedding, the head and a stage
    boundary's message, on one rank of candidate `c`. `full` is the larger of a dense and a
    MoE block's, without recompute (the block rebuilt, a block's backward working set)."""
    cfg, s, b, t = p.config, p.seq_len // c.cp, c.mbs, c.tp  # s: this cp rank's tokens
    h, a = cfg.hidden_size, heads(cfg)
    sp_t = t if c.sp else 1
    fused = p.fused_attention or c.cp > 1  # cp attention keeps a log-sum-exp, never scores
    method = cp_method(cfg, c.cp_comm) if c.cp > 1 else None

    def block(recompute: str, moe: bool = False) -> float:
        kept = mem.layer_bytes(
            s,
            b,
            h,
            a,
            t,
            c.sp,
            recompute,
            p.act_bytes,
            p.dropout,
            fused,
            norm_stats=True,
            terms=mem.block_terms(cfg, moe, method),
            regather=regathers(p, c),  # never under full recompute
        )
        if moe and recompute != "full":  # the routed tokens, replicated over tp
            tokens = experts.routed_tokens(p.seq_len, b, c.cp, experts.routing_split(c))
            scored = experts.routed_tokens(p.seq_len, b, c.cp, sp_t)
            imbalance = experts.imbalance_of(cfg, p.moe_imbalance)
            kept += experts.routed_bytes(cfg, tokens, p.act_bytes, imbalance, c.ep, c.etp, scored)
        return kept

    moe = experts.is_moe(cfg)
    per_layer, full = block(c.recompute), block("none")
    per_moe = block(c.recompute, True) if moe else 0.0
    full_moe = block("none", True) if moe else 0.0
    if moe and experts.moe_layers(cfg, range(cfg.num_layers)) == cfg.num_layers:
        per_layer, full = per_moe, full_moe  # no dense layer
    terms = mem.block_terms(cfg)  # the embedding's and the head's (norm kind, positions)
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
        sp_t=sp_t,
        grads_in_forward=pipeline.loss_grads_in_forward(p, c),
    )
    message = s * b * h * p.act_bytes / sp_t  # an activation or its gradient in flight
    whole_mask = method in (None, "a2a")  # else a block per call
    mask = (
        mem.document_mask_bytes(p.seq_len, b, p.act_bytes)
        if p.attention_mask_type == "block_causal" and whole_mask
        else 0.0
    )
    return ActivationSizes(
        per_layer,
        max(full, full_moe),
        embedding,
        head,
        message,
        vocab_local,
        per_moe,
        full_moe,
        mask,
    )


def stage_memory(
    p: Problem, c: Candidate, counts=None, simulate: bool = True, sp_saved: bool | None = None
) -> list[mem.MemoryBreakdown]:
    """Memory of one rank of every pipeline stage. Activations: each model chunk's bytes per
    micro-batch (its blocks, plus the embedding on the first chunk, the head on the last)
    weighted by the micro-batches in flight on it, plus the pipeline's message buffers (a sent
    output lives on in its send until the peer has it), at the worst point of the stage's
    program; every per-token figure is of this cp rank's s / cp tokens. `counts`: {stage:
    `pipeline.stage_held` of its program} to use instead of the schedule's (the dry run passes
    its own, whatever the size); `simulate=False` takes the in-flight counts from the
    schedule's formula instead. `sp_saved`: under sequence parallelism also fill
    `MemoryBreakdown.sp_saved` (the stages' memory once more without SP), which only the CPU
    figure counts; by default where the plan is for CPU ranks (`Problem.target`)."""
    return _stage_memory(p, c, activation_sizes(p, c), counts, simulate, sp_saved)


def _stage_memory(
    p: Problem,
    c: Candidate,
    sizes: ActivationSizes,
    counts=None,
    simulate: bool = True,
    sp_saved: bool | None = None,
    shared: Shared | None = None,
) -> list[mem.MemoryBreakdown]:
    """`stage_memory` with the candidate's `activation_sizes` given (`shared`: the search's
    `Shared` work, for the stages' activations and state)."""
    m = p.global_batch // (c.mbs * c.dp)
    placement = placement_of(c.schedule)
    if counts is None and shared is not None:
        activations = shared.get(
            ("activations", _shape(c), simulate),
            lambda: _stage_activations(p, c, sizes, None, simulate),
        )
        states = shared.get(
            ("states of", *_state_fields(c)),
            lambda: shared.get(_state_key(p, c, m), lambda: _stage_states_of(p, c, m, placement)),
        )
    else:
        activations = _stage_activations(p, c, sizes, counts, simulate)
        states = _stage_states_of(p, c, m, placement)
    out = [
        mem.MemoryBreakdown(
            stage,
            held.weights,
            held.grads,
            held.optimizer,
            kept,
            in_flight,
            buffers,
            held.master,
            held.gathered,
            held.host,
            held.grad_buffers,
            held.gathered_top,
            held.gathered_end,
            held.grad_buffers_top,
            *held.in_backward,
        )
        for stage, ((kept, in_flight, buffers), held) in enumerate(zip(activations, states))
    ]
    if c.recompute != "none":  # the layer a block's backward rebuilds (`plan.process`)
        rebuilt = max(sizes.full - sizes.per_layer, sizes.full_moe - sizes.per_moe_layer)
        for s_ in out:  # made just above: set in place, not replaced
            s_.rebuilt_layer = rebuilt
    if sp_saved is None:
        sp_saved = p.target == "cpu"
    if sp_saved and c.sp and c.tp > 1:  # what SP saves: a CPU's heap keeps it (`plan.process`)
        whole = stage_memory(p, dataclasses.replace(c, sp=False), counts, simulate)
        out = [
            dataclasses.replace(
                s_,
                sp_saved=max(0.0, w.activations - s_.activations),
                sp_copies=sp_grouped_copies(p, c, s_.stage, s_.in_flight),
            )
            for s_, w in zip(out, whole)
        ]
    return out


def _stage_activations(
    p: Problem, c: Candidate, sizes: ActivationSizes, counts, simulate: bool
) -> list[tuple[float, float, float]]:
    """Per pipeline stage (activation bytes at its worst point, micro-batches in flight,
    transient buffer bytes): what `stage_memory` counts besides the state. It
    reads only the candidate's `_shape`."""
    cfg = p.config
    m = p.global_batch // (c.mbs * c.dp)
    totals, _ = pipeline.in_flight(c.schedule, c.pp, m, c.v, simulate)
    shapes = chunk_shapes(
        cfg.num_layers, c.pp, c.v, placement_of(c.schedule), p.layer_kinds, p.pipeline_split
    )
    buffers = {}  # by whether the stage holds the head
    out = []
    for stage, shape in enumerate(shapes):
        chunks = [
            sizes.blocks(k, k_moe) + (sizes.embedding if pre else 0) + (sizes.head if post else 0)
            for k, pre, post, k_moe in shape
        ]
        if sizes.document_mask:  # each chunk's masks, one per window its layers cut with
            specs = chunk_specs(
                cfg.num_layers, c.pp, stage, c.v, placement_of(c.schedule), p.pipeline_split
            )
            chunks = [
                w + mem.document_masks(cfg, spec.layers, p.seq_len) * sizes.document_mask
                for w, spec in zip(chunks, specs)
            ]
        seen = (counts or {}).get(stage) or (
            pipeline.stage_held(c.schedule, c.pp, m, c.v, stage) if simulate else None
        )
        if seen:
            activations, in_flight = _peak_activations(seen, chunks, sizes.message, c.v)
        else:  # the formula's count over the chunks, each output held
            in_flight = totals[stage]
            per_chunk = pipeline.chunk_counts(c.schedule, c.pp, m, c.v, stage)
            activations = sum(
                k * (w + (0 if post else sizes.message))
                for k, w, (_, _, post, _) in zip(per_chunk, chunks, shape)
            )
        has_head = any(post for _, _, post, _ in shape)
        if has_head not in buffers:
            buffers[has_head] = _stage_buffers(p, c, sizes, has_head)
        out.append((activations, in_flight, buffers[has_head]))
    return out


SP_GROUPED_COPIES = 2
"""Whole-sequence copies sequence parallelism makes per dense block with more than one sequence
per micro-batch: each of the block's two reduce-scatters (the attention's output projection,
the MLP's second layer) first copies its input so that each rank's slices of all sequences lie
together (`tensor_parallel.sequence_parallel.reduce_scatter_sequence`; one sequence needs no
copy)."""


def sp_grouped_copies(p: Problem, c: Candidate, stage: int, in_flight: float) -> float:
    """Bytes of the reduce-scatters' grouped copies (`SP_GROUPED_COPIES` per dense block, each
    s / cp x b x h activations) over the blocks `stage`'s rank holds for backward (`in_flight`
    micro-batches of each): transients, which a CPU's heap keeps as holes (`plan.process`).
    0 without SP, at one sequence per micro-batch, and under full recomputation (its blocks
    keep only their input; not measured). A MoE layer's experts are not counted."""
    if not (c.sp and c.tp > 1) or c.mbs == 1 or c.recompute == "full":
        return 0.0
    cfg = p.config
    specs = chunk_specs(
        cfg.num_layers, c.pp, stage, c.v, placement_of(c.schedule), p.pipeline_split
    )
    blocks = sum(len(spec.layers) - experts.moe_layers(cfg, spec.layers) for spec in specs)
    whole = (p.seq_len // c.cp) * c.mbs * cfg.hidden_size * p.act_bytes
    return in_flight * blocks * SP_GROUPED_COPIES * whole


def _peak_activations(seen, chunks: list, message: float, v: int) -> tuple[float, float]:
    """(activation bytes, micro-batches in flight per chunk) at the worst of a stage's points
    `seen` (`pipeline.stage_held`: each chunk's in-flight count and the messages held)."""

    def held_bytes(point):
        flight, buffers = point
        return sum(k * w for k, w in zip(flight, chunks)) + buffers * message

    peak = max(seen, key=held_bytes)
    return held_bytes(peak), sum(peak[0]) / v


def _stage_buffers(p: Problem, c: Candidate, sizes: ActivationSizes, has_head: bool) -> float:
    """Transient bytes of a stage: cp attention's K/V in flight (under block_causal by the ring
    or the all-gather with its largest kernel call's document mask), the layer rebuilt by
    recompute, and (on the stage with the head) the logits' gradient in backward."""
    s = p.seq_len // c.cp
    buffers = cp_buffers(p, c)  # cp attention's K/V in flight
    if c.cp > 1 and p.attention_mask_type == "block_causal" and not sizes.document_mask:
        buffers += cp_document_call_bytes(p.seq_len, c.mbs, c.cp, p.act_bytes)
    if c.recompute != "none":  # one layer rebuilt during backward
        buffers += max(sizes.full - sizes.per_layer, sizes.full_moe - sizes.per_moe_layer)
    if has_head:  # the logits' gradient in backward
        buffers += mem.logits_buffer_bytes(
            s, c.mbs, sizes.vocab_local, p.act_bytes, p.loss_chunk_tokens
        )
    return buffers


def stage_states(p: Problem, c: Candidate) -> list[RankState]:
    """The parameters, gradients and optimizer state the most loaded rank of each pipeline
    stage holds: what `stage_memory` counts besides activations and buffers, without them."""
    return _stage_states_of(p, c, p.global_batch // (c.mbs * c.dp), placement_of(c.schedule))


def _stage_states_of(p: Problem, c: Candidate, m: int, placement: str) -> list[RankState]:
    """`stage_states` of `m` micro-batches a step and the schedule's `placement`."""
    params = stage_params(
        p.config, c.tp, c.pp, c.v, placement, p.config_json, c.ep, c.etp, p.pipeline_split
    )
    return _stage_states(p, c, params, m, placement)


def _state_fields(c: Candidate) -> tuple:
    """The fields of `c` that its stages' state reads (through `layout_of`, `offload_of` and
    the micro-batches a step): all but its activations' options (recomputation, SP, the cp
    attention). Candidates equal in them share their `_state_key` without making it."""
    return (
        c.tp,
        c.cp,
        c.pp,
        c.dp,
        c.ep,
        c.etp,
        c.mbs,
        c.schedule,
        c.v,
        c.zero,
        c.offload_optimizer,
        c.offload_params,
        c.keep_params,
        c.zero3_reduce,
    )


def _state_key(p: Problem, c: Candidate, m: int) -> tuple:
    """What `stage_states` reads of candidate `c` at `m` micro-batches a step: its state's
    `Shared` key (the layout and offload settings as `most_loaded` takes them)."""
    return (
        "states",
        layout_of(p, c),
        c.offload_optimizer,
        c.offload_params,
        offload_of(c, m).at_zero(c.zero),
    )


def _stage_states(p: Problem, c: Candidate, params, m: int, placement: str) -> list[RankState]:
    """The parameters, gradients and optimizer state one rank of each stage holds (`params`:
    each stage's parameter count, `stage_params`). A plan for CPU ranks (`Problem.target` cpu)
    offloads nothing unless MEGAPAR_HOST_COPIES=1 asks for host copies there
    (`megapar.device.host_copies_wanted`): on a CPU the host is the device, the optimizer steps
    the tensors themselves and the state is the layout's without offload."""
    if p.target == "cpu" and not host_copies_wanted(torch.device("cpu")):
        c = dataclasses.replace(c, offload_optimizer=False, offload_params=False)
    if p.master_weights != "fp32":
        routed = [0] * len(params)
        if c.ep > 1:  # sharded over the expert-data-parallel group, not every cp x dp rank
            routed = stage_expert_params(
                p.config,
                c.tp,
                c.pp,
                c.v,
                placement,
                p.config_json,
                c.ep,
                c.etp,
                p.pipeline_split,
            )
        separate = [_separate(n, e, c) for n, e in zip(params, routed, strict=True)]
        if c.zero != 3:
            return separate
        # ZeRO-3's units gathered and gradient buffers alive at the peak, megapar-train's: its
        # linear weights gathered in 16 bits (a norm's 4 bytes over-count a 16-bit one's 2),
        # its full gradient buffers fp32 as Megatron's main gradients
        ours = dataclasses.replace(p, master_weights="fp32")
        return [
            dataclasses.replace(
                state,
                gathered=held.gathered,
                gathered_top=held.gathered_top,
                gathered_end=held.gathered_end,
                grad_buffers=held.grad_buffers,
                grad_buffers_top=held.grad_buffers_top,
                in_backward=held.in_backward,
            )
            for state, held in zip(
                separate, _stage_states(ours, c, params, m, placement), strict=True
            )
        ]
    # what megapar-train holds, byte for byte; a stage holding the same parameters as a
    # lower one holds the same state
    layout, offload = layout_of(p, c), offload_of(c, m).at_zero(c.zero)
    return [
        most_loaded(dataclasses.replace(layout, stage=alike), offload)
        for alike in alike_stages(p.config_json, c.pp, c.v, placement, p.pipeline_split)
    ]


def offload_of(c: Candidate, m: int = 1) -> Offload:
    """The candidate's offload and ZeRO-3 settings at `m` micro-batches a step, as `plan.state`
    takes them (what it lays out: `layout_of`)."""
    return Offload(
        c.offload_optimizer,
        c.offload_params,
        c.keep_params,
        whole_grads(c.schedule, c.pp, m, c.v, c.zero3_reduce),
        m,
    )


def layout_of(p: Problem, c: Candidate, stage: int = 0) -> StageLayout:
    """Pipeline rank `stage`'s `StageLayout` at candidate `c` of problem `p` (ZeRO over its
    cp x dp ranks; the weights gathered in 16 bits or float8 as `fp8.zero3_casts` gives them),
    trimmed to what its ZeRO stage reads (`StageLayout.trimmed`), as `plan.state` and
    `plan.slices` take it."""
    return StageLayout(
        config_json=p.config_json,
        tp=c.tp,
        pp=c.pp,
        v=c.v,
        stage=stage,
        placement=placement_of(c.schedule),
        split=p.pipeline_split,
        ep=c.ep,
        etp=c.etp,
        dp=c.dp * c.cp,
        zero=c.zero,
        bucket_mb=p.grad_bucket_mb,
        persist_below=p.zero3_persistence_threshold,
        casts=fp8.zero3_casts(p, c),
        optimizer=p.optimizer,
    ).trimmed()


def _separate(n_params: int, n_experts: int, c: Candidate):
    """--master-weights separate: the state of a stage's `n_params` parameters, `n_experts` of
    them routed experts under ep > 1, by formula (`mem.state_bytes`: the others sharded over
    the cp x dp ranks, the experts over the expert-data-parallel group's cp x dp / ep), offload
    moving the optimizer (its fp32 master and moments) or ZeRO-3's 16-bit parameter shards to
    the host; ZeRO-3's gathered units and gradient buffers are added by `_stage_states`."""
    dense = mem.state_bytes(n_params - n_experts, c.dp * c.cp, c.zero, "separate")
    routed = mem.state_bytes(n_experts, c.dp * c.cp // c.ep, c.zero, "separate")
    params, grads, optim = (a + b for a, b in zip(dense, routed, strict=True))
    host = (optim if c.offload_optimizer else 0) + (params if c.offload_params else 0)
    return RankState(n_params, int(params), int(grads), int(optim), host=int(host))


def estimate(
    p: Problem, c: Candidate, simulate: bool = True, shared: Shared | None = None
) -> Estimate:
    """The predicted step of candidate `c`; `simulate=False` takes the pipeline bubble and the
    in-flight micro-batches from their formulas, not the schedule (`plan` ranks so first).
    `shared`: the search's `Shared` work (its candidates' common parts), or None for none."""
    cfg, s, b, t = p.config, p.seq_len, c.mbs, c.tp
    h, n = cfg.hidden_size, c.cp  # every per-token cost below is of s / n tokens
    if shared is None:
        shared = Shared()
    shape = _shape(c)
    sizes = shared.get(("sizes", *_size_fields(p, c)), lambda: activation_sizes(p, c))
    stages = _stage_memory(p, c, sizes, simulate=simulate, shared=shared)
    roles_of: list[tuple[bool, bool]] = shared.get(
        ("roles", c.pp, c.v, placement_of(c.schedule)), lambda: _roles(p, c)
    )
    alike: dict[tuple, ProcessPeak] = {}  # stages equal in all but their index: one figure
    peaks = []
    for s_, roles in zip(stages, roles_of):
        key = (*_not_stage(s_), *roles)
        if p.fp8 != "off":  # its float8 linears: the copies autocast does not make
            key += (fp8.converted_params(p, c, s_.stage),)
        if key not in alike:
            alike[key] = process_peak(p, c, s_, *roles, sizes.full, shared=shared)
        peaks.append(alike[key])
    worst_stage = max(range(len(stages)), key=lambda i: peaks[i].total)
    worst, process = stages[worst_stage], peaks[worst_stage]
    fits = process.total <= p.gpu_memory_gb * mem.GIB
    m = p.global_batch // (c.mbs * c.dp)
    rate = p.peak_tflops * 1e12 * p.efficiency
    # under --fp8 the chunks' amax all-reduces (`fp8.block_reductions`) read the ZeRO options:
    # whether the step caches the float8 weights, whether ZeRO-3 gathers them in float8
    amax = (fp8.weight_cached(p, c), fp8.float8_gathered(p, c)) if p.fp8 != "off" else None
    times, (pipe_s, frac, source), busiest, sums = shared.get(
        ("times", shape, amax, simulate), lambda: _times(p, c, m, simulate)
    )
    compute = m * sums.flops / rate
    act = s // n * b * h * p.act_bytes
    pp_gbps = p.intra_gbps if c.tp * c.pp <= p.gpus_per_node else p.inter_gbps
    p2p = (
        2 * (c.pp - 1) * ((act / (c.tp if c.sp else 1)) * 8 / (pp_gbps * 1e9) + p.latency_us * 1e-6)
    )
    dp_exposed = _dp_exposed(p, c, m, busiest, shared)
    # --offload-optimizer: the stepped gradients to the host and the parameters back
    zero_s = pcie_seconds(worst.master, p.pcie_gbps) if c.offload_optimizer else 0.0
    tied = _tied_seconds(p, c, piece_counts(cfg, t, p.config_json).tied_copy * 4, pp_gbps)
    sync_key = (c.tp, c.pp, c.v, placement_of(c.schedule), c.ep, c.etp, c.sp, c.zero >= 2, c.dp * n)
    tp_sync = shared.get(("tp sync", *sync_key), lambda: tp_sync_seconds(p, c))
    # the busiest rank's own collectives, m micro-batches of them: its busy time is `compute`
    # and these; the rest of the pipeline's makespan it waits (`idle`)
    comm = {
        "tp": m * sums.tp + tp_sync,
        "pp": p2p + tied,
        "dp": dp_exposed,
    }
    if c.offload_optimizer:
        comm["host"] = zero_s
    if n > 1:
        comm["cp"] = m * sums.cp
    if c.ep > 1:
        comm["ep"] = m * sums.ep
    step = pipe_s + p2p + dp_exposed + zero_s + tied + tp_sync
    idle = max(pipe_s - m * sums.total, 0.0)
    tokens = p.global_batch * s

    model, rebuilt = shared.get(("model flops",), lambda: _model_flops(p))
    recompute_flops = tokens * cfg.num_layers * rebuilt[c.recompute]
    blocks = stage_layer_counts(
        cfg.num_layers, c.pp, c.v, placement_of(c.schedule), p.pipeline_split
    )
    per_stage = tuple(
        (k, peak.total, m * sum(x.total for x in row)) for k, peak, row in zip(blocks, peaks, times)
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
        process,
        idle,
        per_stage,
    )


def cannot_fit(p: Problem, c: Candidate, shared: Shared) -> bool:
    """Whether candidate `c` provably does not fit a GPU (its `estimate(..., simulate=False)`
    has `fits` False), from its stages' memory alone, before its process figure and time
    model: some stage's `process.process_floor` exceeds the memory. False for a CPU figure
    (not bounded so)."""
    if p.target != "gpu":
        return False
    sizes = shared.get(("sizes", *_size_fields(p, c)), lambda: activation_sizes(p, c))
    limit = p.gpu_memory_gb * mem.GIB
    stages = _stage_memory(p, c, sizes, simulate=False, shared=shared)
    return any(process_floor(s_) > limit for s_ in stages)


_not_stage = operator.attrgetter(
    *(f.name for f in dataclasses.fields(mem.MemoryBreakdown) if f.name != "stage")
)
"""The fields of a `MemoryBreakdown` other than its stage (a tuple), all of what
`process_peak` reads."""


def _times(p: Problem, c: Candidate, m: int, simulate: bool) -> tuple:
    """(`chunk_times`, `pipeline_time`, the busiest rank's row of chunk times, its
    `_RowSums`) of `c` at `m` micro-batches a step."""
    times = chunk_times(p, c)
    busiest = max(times, key=lambda row: sum(x.total for x in row))
    sums = _RowSums(
        sum(x.flops - x.fp8_flops + x.fp8_flops / p.fp8_speedup for x in busiest),
        sum(x.tp for x in busiest),
        sum(x.cp for x in busiest),
        sum(x.ep for x in busiest),
        sum(x.total for x in busiest),
    )
    return times, pipeline_time(c, m, times, simulate), busiest, sums


class _RowSums(NamedTuple):
    """A row of chunk times summed (one micro-batch on every chunk of a rank), as `estimate`
    reads it."""

    flops: float
    """FLOPs, the float8 linears' at `Problem.fp8_speedup` x the rate counted as fewer."""
    tp: float
    cp: float
    ep: float
    total: float
    """F + B + W seconds."""


def _model_flops(p: Problem) -> tuple[float, dict[str, float]]:
    """(the model's training FLOPs per token, {recompute: the FLOPs per token and layer it
    repeats}): what `estimate` reads of the model's FLOPs, the same for every candidate."""
    cfg, s = p.config, p.seq_len
    whole = matmul_flops(cfg, s, 1, padded=False)
    rebuilt = {"none": 0.0, "selective": whole.attention, "full": whole.layer()}
    return training_flops_per_token(cfg, s), rebuilt


def _roles(p: Problem, c: Candidate) -> list[tuple[bool, bool]]:
    """`stage_roles` of every pipeline stage of `c` (it reads pp, v and the placement)."""
    return [stage_roles(p, c, stage) for stage in range(c.pp)]


def stage_roles(p: Problem, c: Candidate, stage: int) -> tuple[bool, bool]:
    """(holds the embedding, holds the LM head): the first and last virtual stages' chunks of
    pipeline rank `stage`."""
    cfg = p.config
    shape = chunk_shapes(
        cfg.num_layers, c.pp, c.v, placement_of(c.schedule), p.layer_kinds, p.pipeline_split
    )
    return any(pre for _, pre, _, _ in shape[stage]), any(post for _, _, post, _ in shape[stage])


def tp_sync_bytes(p: Problem, c: Candidate, stage: int) -> float:
    """Bytes of the gradients pipeline rank `stage` sums over tp once a step, after the
    schedule (`TrainStep.sync_gradients`, fp32): under sequence parallelism every parameter
    replicated over tp (norms, row-parallel biases, a learned position embedding, a MoE layer's
    router and routed experts), and those partial over tp without it (`TensorSpec.partial`).
    Under ZeRO-2 / 3 this rank's pieces of them, taken as an even share of cp x dp (of
    cp x dp / ep for routed experts): ZeRO-2's exactly, ZeRO-3's units pad and split them
    otherwise (llama-tiny at tp 2, dp 2: 1,152 bytes against the dry run's 1,280)."""
    if c.tp == 1:
        return 0.0
    replicas = c.dp * c.cp
    sharded = c.zero >= 2 and replicas > 1
    total = 0.0
    for t in stage_tensors(layout_of(p, c, stage)):
        if t.partial or (c.sp and t.replicated):
            share = (max(replicas // c.ep, 1) if t.expert else replicas) if sharded else 1
            total += t.numel * t.dtype.itemsize / share
    return total


def tp_sync_seconds(p: Problem, c: Candidate) -> float:
    """The once-a-step tp gradient sum (`tp_sync_bytes`) of the stage with the most, a ring
    all-reduce over tp after the schedule, exposed."""
    if c.tp == 1:
        return 0.0
    nbytes = max(tp_sync_bytes(p, c, stage) for stage in range(c.pp))
    return ring_seconds(c.tp, nbytes, p.intra_gbps, p.latency_us) if nbytes else 0.0


def _tied_seconds(p: Problem, c: Candidate, nbytes: int, gbps: float) -> float:
    """The tied embedding's gradient (`nbytes`) over the first and last stage at pp > 1: its
    sum, an all-reduce of two ranks; and where the dp reduction follows that sum and shards
    or rounds it (ZeRO; without ZeRO, a reduction in 16 bits: fp16's), the first stage's
    reduced part of it broadcast to the last (`pipeline.tied.equal_tied_grads`), under ZeRO
    a slice of 1 / (dp x cp) of it."""
    if c.pp == 1:
        return 0.0
    seconds = ring_seconds(2, nbytes, gbps, p.latency_us)
    ranks = c.dp * c.cp
    if ranks > 1 and (c.zero > 0 or reduce_scale(0, p.precision) < 1):
        part = nbytes / ranks if c.zero else nbytes
        seconds += part * 8 / (gbps * 1e9) + p.latency_us * 1e-6
    return seconds


def _dp_exposed(
    p: Problem, c: Candidate, m: int, busiest: list[ChunkTime], shared: Shared | None = None
) -> float:
    """Seconds of the data-parallel gradient reduction (and ZeRO's gathers) not hidden behind
    the busiest rank's compute (`sharding.dp_seconds`), and under ZeRO-3's float8 all-gather
    its scales' two amax all-reduces a step (`shared`: the search's `Shared` work, for the
    stage's parameters, `_dp_params`)."""
    t, n = c.tp, c.cp
    t_f = sum(x.forward for x in busiest)
    t_b = sum(x.backward_input + x.backward_weight for x in busiest)
    one_node = p.gpus <= p.gpus_per_node
    dp_gbps = p.intra_gbps if one_node else p.inter_gbps
    if shared is None:
        layers, n_params, n_experts, float8, half = _dp_params(p, c)
    else:
        key = (
            "dp params",
            c.tp,
            c.pp,
            c.v,
            placement_of(c.schedule),
            c.ep,
            c.etp,
            fp8.float8_gathered(p, c),
            fp8.half_gathered(p, c),
        )
        layers, n_params, n_experts, float8, half = shared.get(key, lambda: _dp_params(p, c))
    # gradients are reduced in fp32, or fp16 under fp16 (--grad-reduce-dtype auto, Megatron's)
    # but by ZeRO-3, in fp32
    reduced = 4 * reduce_scale(c.zero, p.precision)
    grad_bytes = n_params * reduced
    # the parameters ZeRO gathers: fp32 (megapar-train's), less what it gathers in 16 bits or
    # float8; --master-weights separate: 16-bit parameters, gathered as they are (Megatron's
    # distributed optimizer)
    separate = p.master_weights == "separate"
    param_bytes = n_params * p.act_bytes if separate else n_params * 4 - 3 * float8 - 2 * half
    expert_bytes = n_experts * (p.act_bytes if separate else 4)
    # ZeRO's reductions hide behind the backward, gathers behind the compute, except what is
    # longer; ZeRO-1 / 2's parameter all-gather after the step does not (`plan/sharding.py`)
    replicas = c.dp * n  # gradients are reduced over cp x dp
    shard_up = (
        pcie_seconds((n_params / replicas + n_experts * c.ep / replicas) * 4, p.pcie_gbps)
        if c.offload_params
        else 0.0
    )
    # ZeRO-3's float8 all-gather makes the stage's weight scales at the step's start: one
    # amax all-reduce over cp x dp and one over tp (`Float8Gather._scales`), before any gather,
    # nothing to hide behind; each its messages' latency, as `chunk_times` counts the casts'
    scales = (
        ring_seconds(replicas, 0, dp_gbps, p.latency_us)
        + ring_seconds(t, 0, p.intra_gbps, p.latency_us)
        if float8
        else 0.0
    )
    return scales + dp_seconds(
        c.zero,
        m,
        c.pp,
        c.keep_params,
        replicas,
        grad_bytes,
        param_bytes,
        layers + 1,
        dp_gbps,
        p.latency_us,
        t_f,
        t_b,
        shard_up,
        c.zero3_reduce == "micro-batch",
        w_reported(c.schedule, c.pp, m, c.v),
        (replicas // c.ep, n_experts * reduced, expert_bytes),
    )


def _dp_params(p: Problem, c: Candidate) -> tuple[int, int, int, int, int]:
    """What `_dp_exposed` reads of the stage with the most parameters: (the most layers a stage
    holds, its parameters less its routed experts' under ep > 1, those experts' (0 at ep 1),
    its weights ZeRO gathers in float8, its weights ZeRO gathers in 16 bits). It reads tp, pp,
    v, the schedule's placement, ep, etp and what ZeRO gathers in float8 or 16 bits of `c`."""
    cfg, t = p.config, c.tp
    placement = placement_of(c.schedule)
    layers = max(stage_layer_counts(cfg.num_layers, c.pp, c.v, placement, p.pipeline_split))
    # the most loaded stage's parameters, and of them the routed experts' (under ep > 1
    # reduced and gathered over the expert-data-parallel group)
    split = p.pipeline_split
    every = stage_params(cfg, t, c.pp, c.v, placement, p.config_json, c.ep, c.etp, split)
    routed = stage_expert_params(cfg, t, c.pp, c.v, placement, p.config_json, c.ep, c.etp, split)
    n_params, n_experts, stage = max(zip(every, routed, range(c.pp)))
    # ZeRO-3 gathering linear weights in 16 bits or float8, ZeRO-1 / 2 in 16 bits: 2 or 1
    # bytes an element, not 4
    float8 = fp8.converted_weights(p, c, stage) if fp8.float8_gathered(p, c) else 0
    half = fp8.half_weights(p, c, stage)
    if c.ep > 1:
        n_params -= n_experts
    else:
        n_experts = 0
    return layers, n_params, n_experts, float8, half
