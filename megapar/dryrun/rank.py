"""One rank of the job, rehearsed: the real start-up and one step's bookkeeping on fake tensors.

`rehearse_rank` runs, as rank r of the job's layout inside `fake_process_group` and `fake_tensors`:

1. the real start-up: `Engine(cfg, config, mesh)` on the real `Mesh` (DeviceMesh, every group,
   the rank order), so the stage is built (its layers, chunks, tp shards, padded vocabulary,
   split or replicated kv heads), the optimizer made (ZeRO-1 slices), the gradient buffer cut
   into buckets and the pipeline executor set up, exactly as in a run (but for the weights'
   initialisation: fake tensors hold no values to fill);
2. the executor on one micro-batch (the first one of the data, when there is data): every
   chunk's forward and backward, its messages, the gradient buckets' reduction and the loss
   broadcast, with every collective counted; then the gradient syncs after the schedule and the
   optimizer step (which creates the optimizer state and, under ZeRO-1, all-gathers the
   weights). A step of m micro-batches repeats the per-micro-batch part m times (each
   micro-batch takes the same code path), so its traffic is the counted micro-batch's times m
   plus the once-per-step part;
3. what the first save would write: this (tp, pp) coordinate's shard file (name and exact size;
   dp rank 0 writes it), laid out by the checkpoint writer's own `shard_contents`;
4. the schedule's action list for the real m, its in-flight peak, and the planner's activation
   model (`megapar.plan.stage_memory`) for this stage at that peak: activations are modelled,
   not measured.

Weights, gradients and optimizer state are the bytes of the distinct storages behind the real
(fake) tensors: parameters (ZeRO-1: the flat parameter buffer, padding included), gradients
(the gradient buffer) and every tensor of the optimizer's state; with --offload-optimizer its
host copies (made as on a GPU), and the state and copies counted as host memory. ZeRO-3 runs
the real `ShardedParams` and `Zero3Optimizer` (each collective whole and async, as NCCL runs
it): weights and gradients are the units' shards, and the gathered units the most bytes of
units' full buffers allocated at once in the rehearsed micro-batch (its hooks gather and free
them as in a run). A ZeRO stage this megapar-train lacks (not among --zero's choices), or a
ZeRO-3 option it refuses (`check_zero3`), is rehearsed at ZeRO-1, with the planner's state and
dp traffic in place of ZeRO-1's, and a note saying so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from megapar.checkpoint.distributed import planned_shard
from megapar.comm_count import Call, count_collectives
from megapar.device import host_copies_wanted
from megapar.dryrun.modelled import modelled_stage, process_peaks
from megapar.dryrun.watch import run_micro_batch
from megapar.dryrun.world import fake_process_group, fake_tensors, held_bytes
from megapar.mesh import Layout, Mesh
from megapar.pipeline.placement import chunks_per_rank, placement_of
from megapar.pipeline.schedules import in_flight_peak, schedule_actions
from megapar.plan.params import GatherCasts, StageLayout
from megapar.plan.sharding import reduce_scale
from megapar.plan.state import (
    DENSE,
    EXPERTS,
    Offload,
    groups_traffic,
    rank_state,
    w_reported,
    whole_grads,
    zero_traffic,
)
from megapar.training.config import TrainConfig, flag_choices
from megapar.training.data import continue_order, make_sampler
from megapar.training.engine import Engine
from megapar.training.engine_parts import fp8_note
from megapar.training.validate import UsageError, check_zero3

NOT_RUN = (
    "the gradient-norm all-reduce (tp x pp, and dp x cp under ZeRO-1), the loss all-reduce "
    "over dp, fp16's overflow flag over all ranks and --loss-mean token's labelled-token count "
    "over dp: scalars whose values the step reads; with experts, the router statistics' "
    "all-reduce (layers x (experts + 4) fp32 values over dp x cp, and their sums over pp)"
)
"""Per-step collectives the rehearsal does not run (it has no values to read)."""


@dataclass
class RankReport:
    """What one rank of the job holds and sends, in bytes unless named otherwise."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    node: int
    """rank // ranks per node."""
    params: int
    """Parameter elements this rank holds (tied copy and vocabulary padding included)."""
    weights: int
    grads: int
    optimizer: int
    activations: int
    """Modelled: the planner's bytes per micro-batch of each chunk, weighted by the
    micro-batches in flight on it at the worst point of this stage's action list."""
    in_flight: float
    """Most micro-batches in flight on this stage, from its action list, in stages' worth of
    activations (a chunk counts 1/V: megapar-bubble's per-chunk count divided by `chunks`)."""
    actions: int
    """Actions in this stage's schedule for one step."""
    buckets: int
    """Gradient buckets reduced (each one reduction per step; none over a group of one rank)."""
    comm: dict = field(default_factory=dict)
    """{group: {"ranks": size, "crosses_nodes": bool, op: {"count": n, "bytes": b}}} per step."""
    checkpoint_file: str = ""
    checkpoint_bytes: int = 0
    """Size of this coordinate's shard file in the first save."""
    cp_rank: int = 0
    """Context-parallel rank (0 without cp)."""
    ep_rank: int = 0
    """Expert-parallel rank (0 without ep): which of the MoE layers' experts it holds."""
    writes_checkpoint: bool = False
    """This rank writes that file (dp rank 0 does)."""
    first_batch: list | None = None
    """Sample indices of this rank's micro-batches in the first global batch (with data)."""
    notes: list = field(default_factory=list)
    master: int = 0
    """--offload-optimizer: its host copies of the stepped tensors and their gradients."""
    gathered: int = 0
    """ZeRO-3: the most bytes of units' gathered parameters held at once (measured on the
    rehearsed micro-batch; with --zero3-keep-params every unit)."""
    grad_buffers: int = 0
    """ZeRO-3: the most bytes of units' full gradient buffers held at once (every unit's at
    the end of the backward: each is freed when its reduce-scatter is waited for, in
    finish())."""
    host: int = 0
    """Of weights, gradients, optimizer and host copies, the bytes in host memory."""
    device: int = 0
    """Weights, gradients, optimizer, host copies, gathered units and full gradient buffers in
    device memory (the activations are apart)."""
    zero: int = 0
    """The ZeRO stage."""
    modelled: bool = False
    """The state and dp traffic are the planner's (this megapar-train lacks the ZeRO stage or
    refuses its ZeRO-3 options)."""
    chunks: int = 1
    """Model chunks per rank (`placement.chunks_per_rank`): 2 for zb-v and dualpipev."""
    transients: int = 0
    """Modelled: the planner's transient buffers of this stage (one chunk's logits, a layer
    rebuilt by recomputation, cp's K/V in flight; `MemoryBreakdown.buffers`)."""
    peak_gpu: int = 0
    """Modelled: what a GPU holds for this rank at its peak (`plan.process`, target gpu): the
    real state, the modelled activations and transients, the allocator's reserve and the CUDA
    context."""
    peak_cpu: int = 0
    """Modelled: the rise of this rank's peak resident set on a CPU (`plan.process`, target
    cpu; the process's baseline, `plan.process.CPU_BASELINE`, apart)."""
    peak_cpu_settled: int = 0
    """Modelled: `peak_cpu` once a run's heap has settled after its first steps
    (`plan.process.ProcessPeak.settled`: the terms some runs' heap grows to)."""
    cpu_baseline: int = 0
    """The process's resident set before the job on a CPU (`plan.process.cpu_baseline`):
    `peak_cpu` above it is the OS's peak resident set."""
    peak_phase: str = ""
    """Where the tensors peak: at the top or at the end of the backward."""

    def to_json(self) -> dict:
        return asdict(self)


def _first_optimizer_step(optimizer, notes: list[str]) -> None:
    """The optimizer step that creates its state (and, under ZeRO-1, all-gathers weights)."""
    if optimizer.kind in ("lamb", "lars"):  # trust ratios read norms: resume-path state instead
        optimizer.load_state_tensors(
            {n: {k: torch.zeros_like(p) for k in optimizer.keys_of(p)} for n, p in optimizer.named}
        )
        notes.append(
            f"{optimizer.kind}: its step reads norms, so the optimizer state is the one "
            f"a resumed run loads, and its norm all-reduces are not counted"
        )
        return
    optimizer.step()


OP_NAMES = {
    "isend": "send",
    "irecv": "receive",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
}
"""torch.distributed's functions by what they do."""


def traffic(calls, mesh: Mesh, per_node: int, repeats: list[int] | None = None) -> dict:
    """{group: {"ranks": n, "crosses_nodes": bool, op: {"count", "bytes"}}} of `calls` (each made
    `repeats[i]` times; default once), groups named after the mesh's (tp, cp, pp, dp, "dp x cp"
    where gradients are reduced under context parallelism, mp, embedding; "ep" for the all-to-alls
    over the ep group, expert parallelism's token exchange, even where its ranks are dp's (also
    --cp-comm-type a2a's where the cp group is the ep group; over another cp group they stay cp's);
    "expert dp" for the expert-data-parallel group, the experts' ZeRO collectives (a group of one at
    dp = ep: tp's ranks at tp 1, where tp issues nothing; "cp = expert dp" where its ranks are
    cp's); "world" for the default group). A call issued for a purpose (`Call.purpose`: Muon's
    gathers, scatters and all-to-alls, "muon") is named by it and its group ("muon over dp",
    "muon over tp"), never "ep". Bytes are the whole tensor each call reduces, gathers,
    scatters or sends (an all-gather's output, a reduce-scatter's input), so an all-gather and the
    reduce-scatter it undoes weigh the same."""

    names: dict[tuple[int, ...], str] = {}
    for name in ("tp", "cp", "pp", "dp", "dp_cp", "mp", "embedding"):
        group = getattr(mesh, f"{name}_group")
        if group is not None:
            names.setdefault(tuple(dist.get_process_group_ranks(group)), name.replace("_", " x "))
    if mesh.layout.ep > 1 and mesh.expert_dp_group is not None:
        ranks = tuple(dist.get_process_group_ranks(mesh.expert_dp_group))
        other = names.get(ranks)
        names[ranks] = "expert dp" if other is None or len(ranks) == 1 else f"{other} = expert dp"
    world = mesh.layout.world_size
    ep_ranks = (
        tuple(dist.get_process_group_ranks(mesh.ep_group)) if mesh.ep_group is not None else None
    )
    out: dict = {}
    for c, times in zip(calls, repeats or [1] * len(calls)):
        ranks = c.ranks or tuple(range(world))
        name = names.get(ranks, "world" if len(ranks) == world else f"group of {len(ranks)}")
        if c.purpose:  # the optimizer's (Muon's), whatever group it runs over
            name = f"{c.purpose} over {name}"
        # the experts' all-to-alls; --cp-comm-type a2a's over another group stay cp's
        elif c.op == "all_to_all_single" and mesh.layout.ep > 1 and ep_ranks in (None, ranks):
            name = "ep"
        op = OP_NAMES.get(c.op, c.op)
        entry = out.setdefault(
            name, {"ranks": len(ranks), "crosses_nodes": len({r // per_node for r in ranks}) > 1}
        )
        totals = entry.setdefault(op, {"count": 0, "bytes": 0})
        totals["count"] += times
        totals["bytes"] += times * c.bytes * (len(ranks) if op == "all_gather" else 1)
    return out


def rehearse_rank(
    cfg, config, layout: Layout, rank: int, gpus_per_node: int = 8, dataset=None, order=None
) -> RankReport:
    """Rank `rank` of a job of `layout` running `cfg` on model `config` (see the module
    docstring); `dataset`: the training split, for the first batch (None: no data); `order`:
    the data order a resumed run continues (`DataPlan.sampler_state`; None: a fresh start)."""
    # whether this machine's CPU ranks would make offload's host copies: asked for here, before
    # the rehearsal makes them as a GPU rank does (`fake_process_group`)
    cpu_copies = host_copies_wanted(torch.device("cpu"))
    with fake_process_group(layout.world_size, rank):
        mesh = Mesh(
            layout,
            rank,
            sequence_parallel=cfg.sequence_parallel,
            expert_tp=cfg.expert_tensor_parallel_size,
        )
        with fake_tensors():
            return _rehearse(cfg, config, mesh, gpus_per_node, dataset, order, cpu_copies)


REHEARSED_AS = {"dualpipev": "zb-v"}
"""Schedules whose one-micro-batch rehearsal runs under another of the same placement."""


def _rehearse(
    cfg, config, mesh: Mesh, gpus_per_node: int, dataset, order, cpu_copies: bool
) -> RankReport:
    """Rank `mesh.rank`'s first step, rehearsed on fake tensors: one micro-batch of the
    schedule, then the gradient syncs and the optimizer's first step, and what they hold and
    send (see the module docstring); `cpu_copies`: whether a CPU rank's figure counts
    offload's host copies (`process_peaks`)."""
    layout = mesh.layout
    notes: list[str] = []
    m = cfg.global_batch_size // (cfg.micro_batch_size * layout.dp)
    # a ZeRO stage (or ZeRO-3 option) this megapar-train lacks is rehearsed at ZeRO-1 (the same
    # model, messages and tp / cp collectives), its state and dp traffic the planner's model
    modelled = _unserved(cfg)
    run_cfg = _run_config(cfg, modelled)
    # the rehearsal runs one micro-batch; DualPipeV takes no fewer than 2 pp, so its one is run
    # under ZB-V: the same V placement, so the same messages and collectives per micro-batch;
    # dry_run: the fake tensors run the blocks eagerly, --compile or not (a `dry_run` call's
    # cfg need not say it is a dry run)
    engine = Engine(
        replace(
            run_cfg,
            schedule=REHEARSED_AS.get(cfg.schedule, cfg.schedule),
            fp8_emulate=True,
            dry_run=True,
        ),
        config,
        mesh,
    )
    if engine.fp8_summary:  # the rehearsal emulates the float8 products; the casts are real
        notes.append(fp8_note(engine.fp8_summary, cfg, config, mesh.tp))
    first_batch = _first_batch(cfg, mesh, dataset, order)
    run_calls, per_step, per_micro_batch_buckets, peak = run_micro_batch(
        cfg, config, engine, layout, m, dataset, first_batch
    )
    with count_collectives() as step_calls:
        engine.step_fn.sync_gradients()
        _first_optimizer_step(engine.optimizer, notes)
    comm = _step_traffic(
        mesh, m, gpus_per_node, run_calls, step_calls, per_step, per_micro_batch_buckets
    )
    optimizer = engine.optimizer
    held, gathered = held_bytes(engine.model, optimizer, engine.sharded_params), peak["gathered"]
    grad_buffers = peak["grad_buffers"]
    if modelled:
        held, gathered, grad_buffers = _modelled_state(cfg, config, mesh, comm, m, notes)
    # the file of this (tp, pp) coordinate, as its dp rank 0 writes it: every parameter with
    # the optimizer's moments, each of its parameter's shape and dtype (what state_tensors()
    # gives the writer; tied copies are not stored)
    moments = {n: {k: p for k in optimizer.keys_of(p)} for n, p in engine.model.named_parameters()}
    file, size = planned_shard(engine.model, mesh, moments)
    actions = schedule_actions(cfg.schedule, layout.pp, m, mesh.pp_rank, cfg.virtual_stages)
    stages = modelled_stage(cfg, config, layout, mesh.pp_rank, actions, cpu_copies)
    stage_mem = stages["gpu"][2]  # the activations and transients of the job's GPUs
    activations = int(stage_mem.activations)
    on_gpu = {**held, "gathered": gathered, "grad_buffers": grad_buffers}
    on_cpu = (
        on_gpu
        if cpu_copies
        else _held_without_copies(cfg, config, mesh, engine, on_gpu, modelled, stages["cpu"][2])
    )
    peaks = process_peaks(stages, {"gpu": on_gpu, "cpu": on_cpu})
    chunks = chunks_per_rank(cfg.schedule, cfg.virtual_stages)
    in_flight = in_flight_peak(actions) / chunks
    return RankReport(
        rank=mesh.rank,
        tp_rank=mesh.tp_rank,
        pp_rank=mesh.pp_rank,
        dp_rank=mesh.dp_rank,
        cp_rank=mesh.cp_rank,
        ep_rank=mesh.ep_rank,
        node=mesh.rank // gpus_per_node,
        **held,
        gathered=gathered,
        grad_buffers=grad_buffers,
        device=held["weights"]
        + held["grads"]
        + held["optimizer"]
        + held["master"]
        + gathered
        + grad_buffers
        - held["host"],
        zero=cfg.zero,
        modelled=bool(modelled),
        activations=activations,
        transients=int(stage_mem.buffers),
        peak_gpu=int(peaks["gpu"].total),
        peak_cpu=int(peaks["cpu"].total),
        peak_cpu_settled=int(peaks["cpu"].settled),
        cpu_baseline=int(peaks["cpu"].baseline),
        peak_phase=peaks["gpu"].phase,
        in_flight=in_flight,
        chunks=chunks,
        actions=len(actions),
        buckets=sum(b.group_size > 1 for b in engine.grad_sync.buckets),
        comm=comm,
        checkpoint_file=file,
        checkpoint_bytes=size,
        writes_checkpoint=mesh.dp_rank == 0 and mesh.cp_rank == 0,
        first_batch=first_batch,
        notes=notes,
    )


def _run_config(cfg: TrainConfig, modelled: str) -> TrainConfig:
    """The configuration the rehearsal runs: `cfg`, or, when megapar-train lacks its ZeRO stage
    or refuses its ZeRO-3 options (`modelled`: why), `cfg` at ZeRO-1 without those options."""
    return (
        replace(
            cfg,
            zero=1,
            offload_params=False,
            zero3_keep_params=False,
            zero3_persistence_threshold=0,
            zero3_reduce="step",
        )
        if modelled
        else cfg
    )


def _first_batch(cfg, mesh: Mesh, dataset, order) -> list | None:
    """This rank's micro-batches of the run's first global batch, as sample indices (None: no
    data): the data order's first, or, resuming, the next one of the checkpoint's `order`."""
    first_batch = None
    if dataset is not None:
        sampler = make_sampler(cfg, dataset, mesh.layout.dp, mesh.dp_rank)
        continue_order(cfg, sampler, order)
        first = next(iter(sampler))
        first_batch = [list(map(int, mb)) for mb in first]
    return first_batch


def _step_traffic(
    mesh: Mesh,
    m: int,
    gpus_per_node: int,
    run_calls: list[Call],
    step_calls: list[Call],
    per_step: set[int],
    per_micro_batch_buckets: set[int],
) -> dict:
    """One step's `traffic` of m micro-batches: the schedule's calls (`run_calls`, one
    micro-batch's) repeated m times where they are made every micro-batch, the rest and the
    calls after the schedule (`step_calls`) once."""
    # inside the schedule, messages, tp / cp collectives and the MoE layers' all-to-alls (ep)
    # belong to the micro-batch; the bucket reductions, the loss broadcast and everything
    # after the schedule to the step
    per_micro_batch = {
        tuple(dist.get_process_group_ranks(g))
        for g in (mesh.tp_group, mesh.cp_group)
        if g is not None
    }
    repeats = [
        m
        if i in per_micro_batch_buckets
        or i not in per_step
        and (c.op in ("isend", "irecv", "all_to_all_single") or c.ranks in per_micro_batch)
        else 1
        for i, c in enumerate(run_calls)
    ] + [1] * len(step_calls)
    comm = traffic(list(run_calls) + list(step_calls), mesh, gpus_per_node, repeats)
    return comm


def _unserved(cfg) -> str:
    """Why megapar-train cannot run `cfg`'s ZeRO stage as given ("" when it can): a stage not
    among --zero's choices, or a ZeRO-3 option it refuses (`check_zero3`)."""
    if cfg.zero not in flag_choices()["zero"]:
        return f"--zero {cfg.zero} is not in this megapar-train"
    if cfg.zero == 3:
        try:
            check_zero3(replace(cfg, dry_run=False))
        except UsageError as exc:
            return str(exc)
    return ""


def _planned_state(cfg, config, mesh: Mesh):
    """The planner's `RankState` of this rank (`megapar.plan.state.rank_state`)."""
    layout = mesh.layout
    m = cfg.global_batch_size // (cfg.micro_batch_size * layout.dp)
    v = chunks_per_rank(cfg.schedule, cfg.virtual_stages)
    return rank_state(
        _stage_layout(cfg, config, mesh),
        mesh.dp_rank * layout.cp + mesh.cp_rank,
        Offload(
            cfg.offload_optimizer,
            cfg.offload_params,
            cfg.zero3_keep_params,
            whole_grads(cfg.schedule, layout.pp, m, v, cfg.zero3_reduce),
            m,
        ),
    )


def _stage_layout(cfg, config, mesh: Mesh) -> StageLayout:
    """This rank's stage as the planner lays it out (`megapar.plan.params.StageLayout`): ZeRO
    over the cp x dp group, its dp rank there dp_rank x cp + cp_rank."""
    layout = mesh.layout
    return StageLayout.of(
        config,
        tp=layout.tp,
        pp=layout.pp,
        v=chunks_per_rank(cfg.schedule, cfg.virtual_stages),
        stage=mesh.pp_rank,
        placement=placement_of(cfg.schedule),
        ep=layout.ep,
        etp=getattr(mesh, "etp", 1),
        dp=layout.dp * layout.cp,
        zero=cfg.zero,
        bucket_mb=cfg.grad_bucket_mb,
        persist_below=cfg.zero3_persistence_threshold,
        casts=zero3_casts(cfg),
    )


def zero3_casts(cfg) -> GatherCasts:
    """The linear weights ZeRO-3 gathers in 16 bits or float8 in a step of `cfg` (a
    `TrainConfig`), or ZeRO-1 / 2 in 16 bits after it, as the planner takes them."""
    half = cfg.zero3_half is not None or cfg.zero12_half is not None
    return GatherCasts(cfg.fp8, cfg.fp8_layers, cfg.zero3_float8 is not None, half)


def _modelled_traffic(cfg, config, mesh: Mesh, comm: dict, m: int) -> None:
    """Replace ZeRO-1's reduce-scatters and all-gathers over the dp (x cp) group and, under
    expert parallelism, the expert-data-parallel group in `comm` (this rank's traffic, the
    gradients in the reduce dtype) by the planner's for --zero
    (`megapar.plan.state.groups_traffic`)."""
    layout = mesh.layout
    v = chunks_per_rank(cfg.schedule, cfg.virtual_stages)
    names = {DENSE: "dp x cp" if layout.cp > 1 else "dp", EXPERTS: "expert dp"}
    planned = zero_traffic(_stage_layout(cfg, config, mesh))
    rehearsed = comm.get(names[DENSE], {})
    if not {"reduce_scatter", "all_gather"} <= rehearsed.keys():
        return
    # the reduced gradients' bytes per fp32 byte (the rehearsal's all-gathers are no measure:
    # in bf16 / fp16 ZeRO-1 gathers the blocks' linear weights in 16 bits)
    scale = reduce_scale(cfg.zero, cfg.precision, cfg.grad_reduce_dtype)
    for name, ops in groups_traffic(
        planned,
        cfg.zero,
        m,
        layout.pp,
        keep_params=cfg.zero3_keep_params,
        per_micro_batch=cfg.zero3_reduce == "micro-batch",
        once_a_step=w_reported(cfg.schedule, layout.pp, m, v),
        grad_scale=scale,
    ).items():
        group = comm.get(names[name])
        if group is None:
            continue
        for op in ("reduce_scatter", "all_gather"):
            group.pop(op, None)
        for op, count, total in ops:
            group[op] = {"count": count, "bytes": int(total)}


def _held_without_copies(
    cfg, config, mesh: Mesh, engine, held: dict, modelled: str, cpu_stage
) -> dict:
    """`held` (with the peak's gathered units and gradient buffers) as a CPU rank holds it
    without offload's host copies (the host is the device,
    `megapar.device.host_copies_wanted`): --offload-params' parameter shards are its weights
    and its gathers copy no staging shard in (the planner's gathered peak of the CPU rank,
    `cpu_stage`), the optimizer's state is where it is, and there are no copies; for a ZeRO
    stage this megapar-train lacks (`modelled`), the planner's state without the offloads."""
    out = {**held, "master": 0, "host": 0}
    if modelled:
        state = _planned_state(
            replace(cfg, offload_optimizer=False, offload_params=False), config, mesh
        )
        out.update(weights=state.weights, grads=state.grads, optimizer=state.optimizer)
    elif cfg.offload_params and engine.sharded_params is not None:
        out["weights"] = sum(u.shard_nbytes for u in engine.sharded_params.units)
    if cfg.offload_params:
        out["gathered"] = int(cpu_stage.gathered)
    return out


def _modelled_state(
    cfg, config, mesh: Mesh, comm: dict, m: int, notes: list[str]
) -> tuple[dict, int, int]:
    """(`held_bytes`' figures, gathered bytes, full gradient buffers' bytes) of a ZeRO stage this
    megapar-train lacks, from the planner's model (`megapar.plan.state.rank_state`, this rank's
    slices), and its dp traffic (`megapar.plan.sharding.dp_traffic`) put in `comm` in place of
    ZeRO-1's."""
    state = _planned_state(cfg, config, mesh)
    _modelled_traffic(cfg, config, mesh, comm, m)  # ZeRO-1's, in the reduce dtype
    notes.append(
        f"{_unserved(cfg)}: --zero {cfg.zero}'s weights, gradients, optimizer state, "
        f"gathered units and dp traffic are the planner's model; the rest is "
        f"rehearsed at --zero 1"
    )
    return (
        {
            "params": state.params,
            "weights": state.weights,
            "grads": state.grads,
            "optimizer": state.optimizer,
            "master": state.master,
            "host": state.host,
        },
        state.gathered,
        state.grad_buffers,
    )
