"""`megapar-plan --verify K`: the plan's bytes per rank against a dry run of the same job.

For a planned layout, `verify_layout` dry-runs the job megapar-train would run (the plan's
model, batch, sequence length, precision and layout) on the default sample of ranks, and
compares each rank's weights, gradients, optimizer bytes (with offload, its host copies and
host bytes; ZeRO-3's gathered units) and parameter count with what the
planner counts for that rank (`megapar.plan.state.rank_state`), and its activations with the
plan's for its stage (`megapar.plan.stage_memory`, with megapar's fused attention, as the dry
run models it), and its transients (the modelled buffers at the peak: the LM head's logits, a
layer rebuilt under recomputation, cp's K/V blocks) with the plan's buffers: the dry run
models both from the job it was given, so a setting that does not reach its model shows.
They must be equal to the byte; a layout too large for the planner to read the executor's
programs (`megapar.plan.pipeline.held_is_exact`) has its activations estimated,
and they are not compared (`Verified.note` says so). Under expert parallelism each rank's
all-to-all bytes per step are compared with the plan's (`megapar.plan.experts.step_alltoall`)
where the dry run's even routing gives every rank the mean rows (the micro-batch's T k rows a
multiple of the experts; otherwise the note says they were not), under --cp-comm-type a2a
the attention's all-to-all bytes with the plan's (`megapar.plan.context_parallel.step_a2a`), and
under the ring and the all-gather the cp group's send / receive, all-gather and reduce-scatter
bytes with the plan's (`megapar.plan.context_parallel.step_cp_bytes`). Under ZeRO 1-3 each
rank's reduce-scatters and all-gathers over cp x dp (and the expert-data-parallel group) per
step, calls and bytes, are compared with the plan's (`megapar.plan.state.groups_traffic`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from megapar.dryrun import dry_run, sample_ranks
from megapar.mesh import Layout
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.placement import placement_of
from megapar.plan import experts, pipeline, stage_memory
from megapar.plan.context_parallel import step_a2a, step_cp_bytes
from megapar.plan.estimate import layout_of, offload_of
from megapar.plan.sharding import reduce_scale
from megapar.plan.state import DENSE, EXPERTS, groups_traffic, rank_state, w_reported, zero_traffic
from megapar.training.config import TrainConfig

FIELDS = ("params", "weights", "grads", "optimizer", "master", "gathered", "grad_buffers", "host")


@dataclass
class Verified:
    """One layout's verification."""

    ranks: int
    """Ranks dry-run."""
    seconds: float
    differences: list = field(default_factory=list)
    """(rank, field, planned, dry run) wherever they differ."""
    error: str = ""
    """The error the job gave instead (a layout the plan accepts but megapar-train refuses)."""
    note: str = ""
    """What was not compared (activations the plan estimates at this size; a ZeRO stage this
    megapar-train lacks, whose state the dry run takes from the plan)."""

    def add_note(self, text: str) -> None:
        """Append `text` to `note` (after a "; "), unless it says that already (each sampled
        rank finds the same)."""
        if text not in self.note:
            self.note = "; ".join(filter(None, [self.note, text]))


def train_config(problem, candidate):
    """The megapar-train settings of a planned layout."""

    c = candidate
    cfg = TrainConfig(
        tp=c.tp,
        pp=c.pp,
        dp=c.dp,
        cp=c.cp,
        cp_comm_type=c.cp_comm if c.cp > 1 else "auto",
        ep=c.ep,
        expert_tensor_parallel_size=c.etp,
        micro_batch_size=c.mbs,
        global_batch_size=problem.global_batch,
        seq_len=problem.seq_len,
        schedule=c.schedule,
        virtual_stages=c.v,
        decoder_first_pipeline_num_layers=problem.pipeline_split.first,
        decoder_last_pipeline_num_layers=problem.pipeline_split.last,
        account_for_embedding_in_pipeline_split=problem.pipeline_split.embedding,
        account_for_loss_in_pipeline_split=problem.pipeline_split.loss,
        recompute=c.recompute,
        sequence_parallel=c.sp,
        sp_regather=problem.sp_regather and c.sp and c.tp > 1,
        zero=c.zero,
        precision=problem.precision,
        grad_bucket_mb=problem.grad_bucket_mb,
        offload_optimizer=c.offload_optimizer,
        offload_params=c.offload_params,
        zero3_keep_params=c.keep_params,
        zero3_reduce=c.zero3_reduce,
        zero3_persistence_threshold=problem.zero3_persistence_threshold if c.zero == 3 else 0,
        loss_chunk_tokens=problem.loss_chunk_tokens,
        fp8=problem.fp8,
        fp8_layers=problem.fp8_layers if problem.fp8 != "off" else "auto",
        compile=problem.compile,
        optimizer=problem.optimizer,
        attention_mask_type=problem.attention_mask_type,
        # the masks' shapes need no real end-of-document id (a dry run without data: 0)
        eod_id=0 if problem.attention_mask_type == "block_causal" else None,
    )
    return cfg


def verify_layout(problem, candidate, ranks=None) -> Verified:
    """Dry-run `candidate` (default ranks: `sample_ranks`) and compare with the plan."""

    c, start = candidate, time.perf_counter()
    layout = Layout(c.tp, c.pp, c.dp, cp=c.cp, ep=c.ep)
    ranks = sample_ranks(layout, c.zero) if ranks is None else ranks
    cfg = train_config(problem, c)
    try:
        reports = dry_run(
            cfg,
            problem.config,
            layout,
            ranks,
            problem.gpus_per_node,
        )
    except Exception as exc:  # noqa: BLE001 - reported: the plan accepted what the job refuses
        return Verified(0, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    out = Verified(len(reports), time.perf_counter() - start)
    m = problem.global_batch // (c.mbs * c.dp)
    exact = pipeline.held_is_exact(c.pp, m, c.v)
    if exact:  # the dry run models megapar's fused attention (no a x s^2 scores kept), and
        # a mixture of experts' default imbalance
        modelled = dataclasses.replace(problem, fused_attention=True, moe_imbalance=None)
        stages = stage_memory(modelled, c)
    else:
        out.note = (
            f"activations not compared: pp x m x V = {c.pp * m * c.v:,} forwards, more "
            f"than the {pipeline.MAX_HELD_FORWARDS:,} the plan reads off the executor's "
            f"programs (it estimates them)"
        )
    if any(r.modelled for r in reports):
        out.add_note(
            f"--zero {c.zero} as planned is not served by this megapar-train: the dry run's "
            f"state is the plan's model (equal by construction), its tp / cp / pp and "
            f"checkpoint rehearsed"
        )
    for r in reports:
        # gradients and ZeRO-1 slices are over cp x dp: dp rank d, cp rank c is d * cp + c
        planned = rank_state(
            layout_of(problem, c, r.pp_rank),
            r.dp_rank * c.cp + r.cp_rank,
            offload_of(c, m),
        )
        out.differences += [
            (r.rank, f, getattr(planned, f), getattr(r, f))
            for f in FIELDS
            if getattr(planned, f) != getattr(r, f)
        ]
        if exact:
            stage = stages[r.pp_rank]
            out.differences += [
                (r.rank, name, int(planned_bytes), counted)
                for name, planned_bytes, counted in (
                    ("activations", stage.activations, r.activations),
                    ("transients", stage.buffers, r.transients),
                )
                if int(planned_bytes) != counted
            ]
        out.differences += _alltoall_difference(problem, c, r, out)
        out.differences += _cp_difference(problem, c, r, out)
        if not r.modelled:  # a modelled stage's traffic is the plan's (equal by construction)
            out.differences += _dp_difference(problem, c, cfg, m, r, out)
    return out


def _dp_difference(problem, c, cfg, m: int, r, out: Verified) -> list:
    """[(rank, "<group> <collective>", planned, dry run)] for each of ZeRO's reduce-scatters and
    all-gathers of a step (calls, then bytes) over cp x dp and the expert-data-parallel group
    whose figure in rank report `r` differs from the plan's (`groups_traffic`, the gradients in
    the reduce dtype of the job `cfg`). Where cp x dp is the cp group (dp 1), the dry run names
    its traffic cp's, with cp attention's all-gathers and reduce-scatters: not compared.
    Under LAMB / LARS the dry run does not run the optimizer step (its trust ratios read norms),
    so ZeRO-1 / 2's parameter all-gathers after it are not compared (a note)."""
    scale = reduce_scale(c.zero, cfg.precision, cfg.grad_reduce_dtype)
    planned = groups_traffic(
        zero_traffic(layout_of(problem, c, r.pp_rank)),
        c.zero,
        m,
        c.pp,
        keep_params=c.keep_params,
        per_micro_batch=c.zero3_reduce == "micro-batch",
        once_a_step=w_reported(c.schedule, c.pp, m, c.v),
        grad_scale=scale,
    )
    dense = "dp" if c.cp == 1 else ("dp x cp" if c.dp > 1 else None)
    differences = []
    for group, ops in planned.items():
        if group == EXPERTS:
            name = next((n for n in r.comm if n.endswith(EXPERTS)), EXPERTS)
        elif group == DENSE and dense is not None:
            name = dense
        else:
            continue
        for op, calls, nbytes in ops:
            if op == "all_gather" and c.zero in (1, 2) and cfg.optimizer in ("lamb", "lars"):
                out.add_note(
                    f"ZeRO-{c.zero}'s parameter all-gathers not compared ({cfg.optimizer}: the "
                    f"dry run does not run its step)"
                )
                continue
            counted = r.comm.get(name, {}).get(op, {"count": 0, "bytes": 0})
            for what, plan, dry in (
                ("calls", calls, counted["count"]),
                ("bytes", int(nbytes), counted["bytes"]),
            ):
                if plan != dry:
                    differences.append((r.rank, f"{name} {op} {what}", plan, dry))
    return differences


def _held_layers(problem, c, pp_rank: int) -> list[int]:
    """The layers pipeline rank `pp_rank` holds (every chunk's)."""
    cfg = problem.config
    specs = chunk_specs(
        cfg.num_layers, c.pp, pp_rank, c.v, placement_of(c.schedule), problem.pipeline_split
    )
    return [i for s in specs for i in s.layers]


def _cp_difference(problem, c, r, out: Verified) -> list:
    """[(rank, "cp_<collective>", planned, dry run)] for each of the cp group's collectives of
    the ring or the all-gather attention (`step_cp_bytes`: send and receive, or all_gather and
    reduce_scatter) whose bytes per step in rank report `r` differ from the plan's. Under ZeRO
    where the cp group is also dp x cp's (dp 1) or expert dp's, the state's all-gathers and
    reduce-scatters share its name in the dry run: those two are then not compared (a note)."""
    planned = step_cp_bytes(problem, c, len(_held_layers(problem, c, r.pp_rank)))
    name = next((n for n in r.comm if n == "cp" or n.startswith("cp = ")), "cp")
    if c.zero and (c.dp == 1 or name != "cp"):
        shared = [op for op in ("all_gather", "reduce_scatter") if planned.pop(op, 0)]
        if shared:
            out.add_note(
                "cp all-gather and reduce-scatter bytes not compared (ZeRO's share the cp group)"
            )
    group = r.comm.get(name, {})
    counted = {op: group.get(op, {}).get("bytes", 0) for op in planned}
    return [
        (r.rank, f"cp_{op}", planned[op], counted[op])
        for op in planned
        if counted[op] != planned[op]
    ]


def _alltoall_difference(problem, c, r, out: Verified) -> list:
    """[(rank, "all_to_all", planned, dry run)] if rank report `r`'s all-to-all bytes per step
    differ from the plan's: expert parallelism's (ep > 1, where the dry run's even routing is
    the mean: T k rows a multiple of the experts; else a note) and --cp-comm-type a2a's
    attention (`step_a2a`), summed over the ep and cp groups (the dry run names a cp all-to-all
    over the ep group's ranks ep's)."""
    cfg = problem.config
    held = _held_layers(problem, c, r.pp_rank)
    planned = step_a2a(problem, c, len(held))
    if c.ep > 1:
        tokens = experts.routed_tokens(problem.seq_len, c.mbs, c.cp, c.tp if c.sp else 1)
        if tokens * cfg.num_experts_per_tok % cfg.num_local_experts:
            out.add_note("all-to-all bytes not compared (uneven even split)")
            return []
        planned += experts.step_alltoall(problem, c, experts.moe_layers(cfg, held))
    elif not planned:
        return []
    counted = sum(
        r.comm.get(group, {}).get("all_to_all_single", {}).get("bytes", 0) for group in ("ep", "cp")
    )
    return [] if counted == planned else [(r.rank, "all_to_all", planned, counted)]
