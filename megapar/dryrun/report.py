"""What a dry run prints: the job, each rehearsed rank, the first checkpoint, what was not run.

Text for people (`describe_job`, `describe_rank`, `describe_checkpoint`), or one JSON object per
rank (`RankReport.to_json`) for scripts. Every figure but the activations is read off the real
code's tensors and collectives; the activations are the planner's model, and say so.
"""

from __future__ import annotations

from megapar.dryrun.rank import NOT_RUN, RankReport
from megapar.plan.memory import document_mask_bytes
from megapar.training.loop import batch_phrase, stages_phrase
from megapar.wording import first_few

_OPS = {
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
    "all_to_all_single": "all-to-all",
}


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (B, KiB, ... TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} TiB"


def _order(layout) -> str:
    """The rank order, fastest axis first, with cp next to tp when there is one (and then the
    --rank-order that gives it, which names no cp)."""
    if layout.cp == 1:
        return layout.order
    return f"{layout.order.replace('tp-', 'tp-cp-', 1)} (--rank-order {layout.order})"


def describe_job(cfg, config, layout, gpus_per_node: int, n_params: int, choice: str) -> str:
    """The job's line, then which ranks are rehearsed and why (`sample.describe_choice`)."""
    m = cfg.global_batch_size // (cfg.micro_batch_size * layout.dp)
    nodes = -(-layout.world_size // gpus_per_node)
    v = f" V {cfg.virtual_stages}" if cfg.virtual_stages > 1 else ""
    offloaded = [
        name
        for name, on in (("optimizer", cfg.offload_optimizer), ("parameters", cfg.offload_params))
        if on
    ]
    extras = (
        [f"{cfg.precision}", f"recompute {cfg.recompute}"]
        + ([f"ZeRO-{cfg.zero}"] if cfg.zero and layout.dp * layout.cp > 1 else [])
        + ([f"offload: {', '.join(offloaded)}"] if offloaded else [])
        + (["sequence parallel"] if cfg.sequence_parallel and layout.tp > 1 else [])
        + (
            [f"each expert split over tp {cfg.expert_tensor_parallel_size}"]
            if cfg.expert_tensor_parallel_size > 1
            else []
        )
        + (
            [f"--cp-comm-type {cfg.cp_comm_type}"]
            if layout.cp > 1 and cfg.cp_comm_type != "auto"
            else []
        )
        + (["--sp-regather"] if cfg.sp_regather and cfg.sequence_parallel and layout.tp > 1 else [])
        + (["--compile (rehearsed with the blocks eager)"] if cfg.compile else [])
        + (["--loss-mean token"] if cfg.loss_mean == "token" else [])
        + ([f"--label-smoothing {cfg.label_smoothing:g}"] if cfg.label_smoothing else [])
        + ([f"--z-loss {cfg.z_loss:g}"] if cfg.z_loss else [])
    )
    stages, size = stages_phrase(cfg, config.num_layers, layout.pp), cfg.micro_batch_size
    return (
        f"megapar-train --dry-run: {config.model_type} with {n_params:,} parameters on "
        f"{layout.world_size:,} rank{'s' if layout.world_size > 1 else ''} (tp {layout.tp} x "
        + (f"cp {layout.cp} x " if layout.cp > 1 else "")
        + f"pp {layout.pp} x dp {layout.dp}"
        + (f" with ep {layout.ep} in dp x cp" if getattr(layout, "ep", 1) > 1 else "")
        + ", "
        f"rank order {_order(layout)}; {nodes:,} node{'s' if nodes > 1 else ''} of "
        f"{gpus_per_node}); schedule {cfg.schedule}{v}, "
        + (f"{stages}, " if stages else "")
        + f"{batch_phrase(cfg.global_batch_size, cfg.seq_len, layout.dp, m, size)}; "
        f"{', '.join(extras)}\nrehearsing {choice}; on this CPU (fake process group, fake "
        f"tensors: nothing is communicated or allocated)"
    )


def describe_bubble(bubble: float, source: str, schedule: str) -> str:
    """The job's pipeline bubble line (`modelled.planned_bubble`)."""
    formula = "the schedule's formula on the busiest stage's times; " if source == "formula" else ""
    how = f" ({formula}a stage holding more, such as the LM head's, adds to the others' wait)"
    return (
        f"pipeline bubble (modelled, megapar-plan's estimate, {source}): {schedule} leaves "
        f"the pp ranks idle {100 * bubble:.1f} % of the step on average{how}; megapar-bubble "
        f"measures it"
    )


def bubble_json(bubble: float, source: str) -> dict:
    """The job's pipeline bubble (`modelled.planned_bubble`) in each rank's --json line."""
    return {"bubble_modelled": round(bubble, 6), "bubble_source": source}


GROUPS = ("tp", "cp", "pp", "dp", "dp x cp", "embedding", "mp", "world")
"""Order groups are listed in (others after)."""


def _traffic(comm: dict) -> str:
    parts = []
    for group, entry in sorted(
        comm.items(),
        key=lambda kv: (GROUPS.index(kv[0]) if kv[0] in GROUPS else len(GROUPS), kv[0]),
    ):
        ops = ", ".join(
            f"{v['count']:,} {_OPS.get(op, op)}{'s' if v['count'] > 1 else ''} {size(v['bytes'])}"
            for op, v in entry.items()
            if isinstance(v, dict)
        )
        where = "across nodes" if entry["crosses_nodes"] else "in a node"
        parts.append(f"{group} ({entry['ranks']} ranks, {where}): {ops}")
    return "; ".join(parts) or "nothing"


def fits(r: RankReport, gpu_gib: float) -> bool:
    """Whether rank report `r`'s modelled peak on a GPU fits a GPU of `gpu_gib` GiB."""
    return r.peak_gpu <= gpu_gib * 2**30


def describe_rank(r: RankReport, step_dir: str, gpu_gib: float | None = None) -> str:
    worth = "stages' worth of " if r.chunks > 1 else ""  # a chunk counts 1 / chunks
    cp = f", cp {r.cp_rank}" if r.cp_rank or any(k.startswith("cp") for k in r.comm) else ""
    ep = f", ep {r.ep_rank}" if r.ep_rank or "ep" in r.comm else ""
    lines = [
        f"rank {r.rank} (tp {r.tp_rank}{cp}, pp {r.pp_rank}, dp {r.dp_rank}{ep}; node "
        f"{r.node}): "
        f"{r.params:,} parameters; weights {size(r.weights)}, gradients {size(r.grads)}, "
        f"optimizer {size(r.optimizer)}"
        + (f", host copies {size(r.master)}" if r.master else "")
        + (
            f", gathered units {size(r.gathered)} at the peak"
            + (" (modelled)" if r.modelled else "")
            if r.gathered
            else ""
        )
        + (f", full gradient buffers {size(r.grad_buffers)} at the peak" if r.grad_buffers else "")
        + f", activations {size(r.activations)} (modelled, "
        f"{r.in_flight:g} {worth}"
        f"micro-batch{'' if r.in_flight == 1 else 'es'} in flight at the "
        f"peak of its {r.actions} actions"
        + (
            f": {r.in_flight * r.chunks:g} counted per chunk, as megapar-bubble and "
            f"--certify count them, each chunk 1 / {r.chunks} of the stage's layers"
            if r.chunks > 1
            else ""
        )
        + ")",
        f"  memory besides activations: device {size(r.device)}, host {size(r.host)}"
        + (f" (ZeRO-{r.zero}{', modelled' if r.modelled else ''})" if r.zero else ""),
        f"  at its peak (modelled, at the {r.peak_phase}; megapar-plan's terms): a GPU holds "
        f"{size(r.peak_gpu)} (transients {size(r.transients)} and the tensors made in the "
        f"backward, the allocator's reserve, the CUDA context)"
        + (
            ""
            if gpu_gib is None
            else f", which {'fits' if fits(r, gpu_gib) else 'does NOT fit'} a GPU of "
            f"{gpu_gib:g} GiB (--gpu-memory-gb)"
        )
        + f"; on a CPU the resident set rises {size(r.peak_cpu)} over the process's baseline"
        + (
            f" of {size(r.cpu_baseline)} (at the OS's peak: "
            f"{size(r.cpu_baseline + r.peak_cpu)}"
            + (
                f", up to {size(r.cpu_baseline + r.peak_cpu_settled)} after the first steps"
                if r.peak_cpu_settled > r.peak_cpu
                else ""
            )
            + ")"
            if r.cpu_baseline
            else ""
        ),
        f"  per step: {_traffic(r.comm)}"
        + (  # the data-parallel group's reductions, whichever group the line ends with
            f"; the dp reductions in {r.buckets} "
            f"{'ZeRO-3 unit' if r.zero == 3 and not r.modelled else 'gradient bucket'}"
            f"{'s' if r.buckets > 1 else ''}"
            if r.buckets
            else ""
        ),
        f"  checkpoint: {step_dir}/{r.checkpoint_file} {size(r.checkpoint_bytes)} "
        + (
            "(this rank writes it)"
            if r.writes_checkpoint
            else "(written by its dp rank 0" + (", cp rank 0)" if cp else ")")
        ),
    ]
    if r.first_batch is not None:
        flat = [i for mb in r.first_batch for i in mb]
        shown = ", ".join(map(str, flat[:8])) + (", ..." if len(flat) > 8 else "")
        lines.append(
            f"  first batch: samples {shown} ({len(r.first_batch)} micro-batch"
            f"{'es' if len(r.first_batch) > 1 else ''})"
        )
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def describe_checkpoint(reports: list[RankReport], layout, step_dir: str) -> str:
    """The first save's shard files: their total when every stage's size is known (a sampled
    writer per stage whose tp ranks all hold files of one size), else what was seen."""
    sizes: dict[int, set[int]] = {}
    seen: dict[str, int] = {}
    for r in reports:
        if r.writes_checkpoint:
            sizes.setdefault(r.pp_rank, set()).add(r.checkpoint_bytes)
            seen[r.checkpoint_file] = r.checkpoint_bytes
    files = layout.tp * layout.pp
    noun = "shard file" if files == 1 else "shard files"
    head = f"checkpoint of the first save: {step_dir}/ with {files:,} {noun}"
    tail = ", rng.safetensors and manifest.json (not sized)"
    if len(seen) == files:
        return f"{head}, {size(sum(seen.values()))} in all{tail}"
    if len(sizes) == layout.pp and all(len(s) == 1 for s in sizes.values()):
        total = sum(next(iter(s)) for s in sizes.values()) * layout.tp
        return (
            f"{head}, {size(total)} in all (each stage's file size seen on its sampled "
            f"writer; a stage's tp ranks hold equal shapes){tail}"
        )
    return f"{head}; {len(seen)} of them sized above{tail}"


def over_gpu_memory(reports: list[RankReport], gpu_gib: float) -> str | None:
    """One line naming the rehearsed ranks whose modelled peak on a GPU exceeds `gpu_gib` GiB
    (the most loaded first) and what to try, or None where every one fits."""
    over = sorted((r for r in reports if not fits(r, gpu_gib)), key=lambda r: -r.peak_gpu)
    if not over:
        return None
    named = first_few([f"rank {r.rank} {size(r.peak_gpu)}" for r in over], 4)
    return (
        f"the job would run out of GPU memory: {named} at their modelled peak, over the "
        f"{gpu_gib:g} GiB of a GPU (--gpu-memory-gb); megapar-plan ranks the layouts that fit "
        f"(the model's terms within about 10 %: a figure near the limit may also fail)"
    )


def footer(seconds: float, ranks: int, world: int) -> str:
    return (
        f"communication: per step and group, the calls and the size of the tensors they "
        f"reduce, gather or send (an all-gather's output, a reduce-scatter's input)\n"
        f"not run: {NOT_RUN}\nactivations are modelled (megapar-plan's activation model at "
        f"the schedule's in-flight peak, with a fused attention kernel's log-sum-exp and no "
        f"a*s^2 scores, as on GPUs; a CPU's figure counts the scores where the model has "
        f"attention dropout, as megapar-train runs there; megapar-plan the same by --target); "
        f"every other figure is the "
        f"real code's tensors and collectives\n"
        f"rehearsed {ranks:,} of {world:,} rank{'s' if world > 1 else ''} in {seconds:.1f} s"
    )


def documents_note(cfg) -> str | None:
    """How the modelled activations count --attention-mask-type block_causal's additive mask:
    b x s x s in the attention's dtype (`plan.memory.document_mask_bytes`), one per micro-batch
    in flight and sliding window on each model chunk, as megapar-plan counts it (under the
    ring and the all-gather a block per kernel call instead, a transient)."""
    if cfg.attention_mask_type != "block_causal":
        return None
    act_bytes = 4 if cfg.precision == "fp32" else 2
    nbytes = document_mask_bytes(cfg.seq_len, cfg.micro_batch_size, act_bytes)
    return (
        f"dry run: --attention-mask-type block_causal's mask ({cfg.micro_batch_size} x "
        f"{cfg.seq_len} x {cfg.seq_len}, {size(nbytes)} per micro-batch in flight and sliding "
        f"window on a model chunk; under --cp by the ring or the all-gather a block per kernel "
        f"call instead, a transient) is counted in the modelled activations below, as "
        f"megapar-plan counts it"
    )
