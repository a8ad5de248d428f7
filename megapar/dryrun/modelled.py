"""What a dry run takes from the planner for a rehearsed rank: the activations and transient
buffers of its stage at the worst point of its action list (`megapar.plan.stage_memory`), and
its process peak on a GPU and on a CPU (`megapar.plan.process`) from its real state and those
modelled figures."""

from __future__ import annotations

from dataclasses import replace

from megapar.mesh import Layout
from megapar.pipeline import messages
from megapar.pipeline.placement import chunks_per_rank, placement_of
from megapar.plan import Candidate, Problem, stage_memory
from megapar.plan.estimate import activation_sizes, estimate, stage_roles, stage_states
from megapar.plan.experts import is_moe
from megapar.plan.host import gib
from megapar.plan.problem import runs_fused_attention
from megapar.plan.process import TARGETS, process_peak
from megapar.training.validate import explicit


def planned_job(cfg, config, layout: Layout, target: str = "gpu") -> tuple[Problem, Candidate]:
    """The planner's problem and candidate for megapar-train's job `cfg` (a `TrainConfig`) of
    model `config` on `layout`, for `target`'s ranks (`Problem.target`), with the job's own
    settings that the planner reads: --cp-comm-type, --optimizer, --attention-mask-type, --fp8,
    --fp8-layers and --compile (which turns ZeRO-3's float8 all-gather off), --grad-bucket-mb,
    the offloads and ZeRO-3's --zero3-keep-params, --zero3-reduce and
    --zero3-persistence-threshold (which units are gathered and which gradient buffers alive at
    the top and at the end of the backward, where `plan.process` takes the peak), and the
    attention kernel it runs there (`runs_fused_attention`), its --gpus-per-node and a given
    --peak-tflops (the step time and bubble, as megapar-plan's for the same flags). Besides the
    state its real code holds, a dry run takes its activations, transients and process peak
    from these."""
    problem = Problem(
        config,
        layout.world_size,
        cfg.gpus_per_node,
        global_batch=cfg.global_batch_size,
        seq_len=cfg.seq_len,
        precision=cfg.precision,
        master_weights="fp32",
        fused_attention=runs_fused_attention(config, target),
        loss_chunk_tokens=cfg.loss_chunk_tokens,
        sp_regather=cfg.sp_regather,
        fp8=cfg.fp8,
        fp8_layers=cfg.fp8_layers,
        compile=cfg.compile,
        target=target,
        grad_bucket_mb=cfg.grad_bucket_mb,
        zero3_persistence_threshold=cfg.zero3_persistence_threshold if cfg.zero == 3 else 0,
        optimizer=cfg.optimizer,
        attention_mask_type=cfg.attention_mask_type,
        pipeline_split=cfg.pipeline_split,
        **({"peak_tflops": cfg.peak_tflops} if "peak_tflops" in explicit(cfg) else {}),
    )
    candidate = Candidate(
        layout.tp,
        layout.pp,
        layout.dp,
        cfg.micro_batch_size,
        cfg.schedule,
        chunks_per_rank(cfg.schedule, cfg.virtual_stages),
        cfg.recompute,
        bool(cfg.sequence_parallel and layout.tp > 1),
        cfg.zero,
        layout.cp,
        offload_optimizer=cfg.offload_optimizer,
        offload_params=cfg.offload_params,
        keep_params=cfg.zero3_keep_params,
        zero3_reduce=cfg.zero3_reduce,
        ep=layout.ep,
        etp=cfg.expert_tensor_parallel_size,
        cp_comm=cfg.cp_comm_type if layout.cp > 1 else "auto",
    )
    return problem, candidate


ETP_NOTE_BYTES = 2**30
"""`expert_tp_note` speaks where the split saves a rank at least this (1 GiB): below it the
choice changes no GPU's fit by much (1.25 % of an 80 GB GPU). A share of the rank's state would
speak on tiny runs whose experts are most of it (mixtral-tiny with a 1,000-token vocabulary:
4 against 3 MiB)."""


def expert_tp_note(cfg, config, layout: Layout, given: bool) -> list[str]:
    """megapar-train's start-up note for a mixture-of-experts model at --tp > 1 without
    --expert-tensor-parallel-size (`given`: whether it was given; megapar's default is 1,
    Megatron-core's the tp size): every tp rank holds every routed expert whole (its ep share
    of them under --ep), and the flag
    at --tp splits them, with the state the most loaded rank holds either way (the planner's
    parameters, gradients and optimizer state, `stage_states`; activations not included).
    None where the flag was given, at --tp 1, for a dense model, where --tp does not divide
    the experts' intermediate size (the split would be refused), or where the split saves a
    rank less than `ETP_NOTE_BYTES` (a small model: the choice does not matter)."""
    tp = layout.tp
    if tp == 1 or given or not is_moe(config) or config.expert_size % tp:
        return []
    problem, whole = planned_job(cfg, config, layout)

    def held(c: Candidate) -> int:
        return max(s.weights + s.grads + s.master + s.optimizer for s in stage_states(problem, c))

    whole_bytes, split_bytes = held(whole), held(replace(whole, etp=tp))
    saved = whole_bytes - split_bytes
    if saved < ETP_NOTE_BYTES:
        return []
    experts = config.num_local_experts
    held_experts = (
        f"its {experts // layout.ep} of the {experts} routed experts of each MoE layer (--ep "
        f"{layout.ep}) whole"
        if layout.ep > 1
        else "every routed expert whole"
    )
    return [
        f"--expert-tensor-parallel-size not given: 1 (Megatron-core's default is --tp), so each "
        f"of the {tp} tp ranks holds {held_experts} ({gib(whole_bytes)} of "
        f"parameters, gradients and optimizer state a rank, megapar-plan's count); "
        f"--expert-tensor-parallel-size {tp} splits each expert over them "
        f"({gib(split_bytes)})"
    ]


def planned_bubble(cfg, config, layout: Layout) -> tuple[float, str]:
    """The pipeline bubble of this job as megapar-plan estimates it (`planned_job`): the idle
    fraction of a step and how it was found ("simulated": the schedule run on the layout's
    per-stage costs; "formula": the published one)."""
    e = estimate(*planned_job(cfg, config, layout))
    return e.bubble, e.bubble_source


def modelled_stage(cfg, config, layout: Layout, stage: int, actions, cpu_copies: bool) -> dict:
    """{target: (the planner's problem and candidate for this job on `target`'s ranks
    (`planned_job`), its `MemoryBreakdown` of `stage` at the worst point of the stage's action
    list)} for each of `plan.process.TARGETS`; on CPU ranks without offload's host copies
    (`cpu_copies` False: `megapar.device.host_copies_wanted`, asked before a rehearsal makes
    them), the job without offloads, as a CPU runs it."""
    modelled: dict[str, tuple] = {}
    for target in TARGETS:
        problem, candidate = planned_job(cfg, config, layout, target)
        if target == "cpu" and not cpu_copies:
            candidate = replace(candidate, offload_optimizer=False, offload_params=False)
        if not modelled:
            m = len([a for a in actions if a.kind == "forward"]) // candidate.v
            held = messages.held(
                messages.programs(cfg.schedule, layout.pp, m, cfg.virtual_stages),
                stage,
                placement_of(cfg.schedule),
            )
        # sp_saved: the CPU figure (`process_peaks`) is made for every rank whatever the target
        memory = stage_memory(problem, candidate, {stage: held}, sp_saved=True)[stage]
        modelled[target] = problem, candidate, memory
    return modelled


def process_peaks(modelled: dict, held: dict) -> dict:
    """{target: `plan.process.ProcessPeak`} of this rank: its real state on that target
    (`held[target]`: `held_bytes`' figures with the peak's "gathered" units and full
    "grad_buffers"; on a CPU without offload's host copies, what the offloads keep on the
    host is where it is) with the modelled activations and buffers of its stage there
    (`modelled_stage`)."""
    peaks = {}
    for target, (problem, candidate, stage) in modelled.items():
        real = replace(
            stage,
            params=held[target]["weights"],
            grads=held[target]["grads"],
            optimizer=held[target]["optimizer"],
            master=held[target]["master"],
            host=held[target]["host"],
            gathered=held[target]["gathered"],
            grad_buffers=held[target]["grad_buffers"],
        )
        roles = stage_roles(problem, candidate, stage.stage)
        block = activation_sizes(problem, candidate).full
        peaks[target] = process_peak(problem, candidate, real, *roles, block, target)
    return peaks
