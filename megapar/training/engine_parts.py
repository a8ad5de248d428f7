"""The parts of an `Engine` its `TrainConfig` describes: the mesh (from the environment, or
checked against the config), the model stage (its linears in float8 under --fp8), the
optimizer (ZeRO-3's over the shards) and `train_step`'s
non-finite guard (megapar-train's rules)."""

from __future__ import annotations

from typing import Any

import torch

from megapar.expert_parallel.params import is_expert
from megapar.faults.stop import NonFiniteGuard
from megapar.host_memory import share_host_arena
from megapar.mesh import Mesh
from megapar.models import set_cp_comm, set_loss_chunk_tokens, set_loss_terms, set_sp_regather
from megapar.models.compile import compile_blocks
from megapar.models.documents import set_documents
from megapar.optim import Precision, build_optimizer
from megapar.pipeline.partition import build_stage
from megapar.pipeline.schedules import chunks_per_rank, placement_of
from megapar.tensor_parallel.fp8_convert import (
    all_layers_hint,
    convert_to_fp8,
    none_kept_by_size,
)
from megapar.training.config import TrainConfig
from megapar.training.documents import reads_documents
from megapar.training.validate_fp8 import fp8_layout_problem

API_ADVICE = (
    "the optimizer step was skipped: the weights and the optimizer state are those "
    "before this step. Check the model's weights and the batch, or lower lr{clip}; "
    "prepare(..., on_nonfinite='skip') skips such steps and returns their loss "
    "instead"
)
"""What `train_step`'s NonFiniteError adds after the reason."""


def mesh_for(cfg: TrainConfig, mesh: Mesh | None) -> Mesh:
    """`mesh` (checked against cfg's sequence parallelism), else the mesh cfg's layout makes
    from the environment; TF32 set on a GPU as cfg says (process-wide in torch)."""
    share_host_arena()  # before the process group's threads allocate (torchrun)
    mesh = mesh or Mesh.from_env(
        cfg.tp,
        cfg.pp,
        cfg.dp,
        timeout_s=cfg.timeout_s,
        order=cfg.rank_order,
        cp=cfg.cp,
        sequence_parallel=cfg.sequence_parallel,
        ep=cfg.ep,
        expert_tp=cfg.expert_tensor_parallel_size,
    )
    if mesh.sequence_parallel != (cfg.sequence_parallel and mesh.tp > 1):
        raise ValueError(
            f"the mesh's sequence_parallel={mesh.sequence_parallel} differs from "
            f"the config's {cfg.sequence_parallel}; build the mesh with "
            f"Mesh(..., sequence_parallel={cfg.sequence_parallel})"
        )
    if getattr(mesh, "etp", 1) != cfg.expert_tensor_parallel_size:
        raise ValueError(
            f"the mesh's expert_tp={getattr(mesh, 'etp', 1)} differs from the config's "
            f"expert_tensor_parallel_size={cfg.expert_tensor_parallel_size}; build the mesh "
            f"with Mesh(..., expert_tp={cfg.expert_tensor_parallel_size})"
        )
    if mesh.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
    return mesh


def stage_for(cfg: TrainConfig, model_config, mesh: Mesh):
    """(this rank's model stage, built and initialised as cfg says (a dry run's is not
    initialised: its fake tensors hold no values); under --fp8 the line that
    names its float8 and high-precision linears, with its pipeline rank at pp > 1, else
    None)."""
    model = build_stage(
        model_config,
        mesh,
        cfg.seed,
        cfg.recompute,
        init=not cfg.dry_run,  # a rehearsal's fake tensors hold no values to initialise
        virtual_stages=chunks_per_rank(cfg.schedule, cfg.virtual_stages),
        placement=placement_of(cfg.schedule),
        split=cfg.pipeline_split,
    )
    set_loss_chunk_tokens(model, cfg.loss_chunk_tokens)
    set_loss_terms(model, cfg.label_smoothing, cfg.z_loss)
    set_sp_regather(model, cfg.sp_regather)  # kept off under --recompute full
    set_cp_comm(model, cfg.cp_comm_type)
    if reads_documents(cfg):
        set_documents(model, cfg.attention_mask_type, cfg.reset_position_ids, cfg.eod_id)
    where = f" on pipeline rank {mesh.pp_rank} of {mesh.pp}" if mesh.pp > 1 else ""
    summary = (
        None
        if cfg.fp8 == "off"
        else convert_to_fp8(model, cfg.fp8, cfg.fp8_emulate, cfg.fp8_layers, mesh.cp_group, where)
        + _experts_kept(model)
    )
    if cfg.compile and not cfg.dry_run:  # the rehearsal's fake tensors run eagerly
        compile_blocks(model)  # after fp8's conversion, before any hook on the blocks
    return model, summary


def fp8_note(summary: str, cfg: TrainConfig, config, tp: int) -> str:
    """megapar-train's --fp8 line: the stage's `summary` (`stage_for`) and, where the size rule
    kept every linear in high precision (a small model `config`), the flag that converts them
    anyway and, where `tp` cannot run them so, the tp that can (`all_layers_hint`), as
    `megapar.prepare`'s warning names fp8_layers='all'."""
    if none_kept_by_size(summary, cfg.fp8_layers):
        return f"{summary}; {all_layers_hint(fp8_layout_problem(config, tp, cfg.fp8, 'all'), tp)}"
    return summary


def _experts_kept(model) -> str:
    """What the --fp8 line adds for a mixture-of-experts stage: the share of its parameters the
    routed experts hold (`convert_to_fp8`'s line names them among the modules always in high
    precision); "" without."""
    experts = sum(p.numel() for p in model.parameters() if is_expert(p))
    if not experts:
        return ""
    share = experts / sum(p.numel() for p in model.parameters())
    return f"; the routed experts hold {share:.0%} of this rank's parameters"


def optimizer_for(cfg: TrainConfig, model, mesh: Mesh, lr: float):
    """The optimizer of `model`'s parameters under cfg (ZeRO-3's over the shards)."""
    return build_optimizer(
        model,
        mesh,
        lr,
        cfg.weight_decay,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        zero=cfg.zero,
        kind=cfg.optimizer,
        offload=cfg.offload_optimizer,
        **_muon_settings(cfg),
    )


def _muon_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The optimizer's Muon keywords under cfg (none unless --optimizer muon): its momentum,
    lr adjustment and Newton-Schulz dtype (fp32 under --precision fp32, where every layout then
    equals the one process to fp32 rounding; else bf16, torch.optim.Muon's)."""
    if cfg.optimizer != "muon":
        return {}
    return {
        "momentum": cfg.muon_momentum,
        "muon_adjust_lr": cfg.muon_adjust_lr,
        "muon_ns_dtype": torch.float32 if cfg.precision == "fp32" else torch.bfloat16,
        "muon_distributed": cfg.muon_distributed,
    }


def api_guard(cfg: TrainConfig, precision: Precision) -> NonFiniteGuard:
    """megapar-train's guard for `train_step`: the first non-finite step raises; in fp16 an
    overflow with a finite loss is the loss scaler's business (skipped, not counted), so as in
    megapar-train only max_nonfinite_steps non-finite losses (or overflows at a static scale) in
    a row, or an overflow at the scale's floor, do."""
    return NonFiniteGuard(
        cfg.max_nonfinite_steps if cfg.precision == "fp16" else 1,
        cfg.precision,
        precision.scaler,
        advice=API_ADVICE.format(clip="" if cfg.clip_grad else " or set clip_grad"),
        keywords=True,
    )
