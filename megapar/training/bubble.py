"""Measure the pipeline bubble of the real engine.

`measure()` runs the executor on real processes (one per rank) for a few steps of a model whose
stages are equal and compute-bound (a small vocabulary, so the embedding and head add little),
and returns pp rank 0's view of the last step's timeline, aligned across stages. Its result,
the costs read off its timeline and the simulation from costs (`simulate`) are
`training.bubble_run`'s, which needs no torch.
"""

from __future__ import annotations

import torch

from megapar.host_memory import keep_freed_host_memory
from megapar.launcher import run_local
from megapar.mesh import Mesh
from megapar.models import GPT2Config
from megapar.models.config import config_from_dict
from megapar.models.recipes import resolve_model
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.partition import build_stage
from megapar.pipeline.schedules import (
    check_schedule,
    chunks_per_rank,
    in_flight_peak,
    placement_of,
    schedule_actions,
)
from megapar.pipeline.timeline import Timeline, bubble_stats
from megapar.pipeline.trace import gather_timeline
from megapar.training.bubble_run import BubbleRun, mean_costs, stage_costs, theory
from megapar.training.bubble_run import simulate as simulate


def bench_config(model: str | None, pp: int, virtual_stages: int = 1):
    """The model to measure: a recipe, or by default a compute-bound GPT-2 with 2 blocks per
    stage (one per chunk with V=2, V per rank beyond) and a 256-token vocabulary (so stages
    are nearly equal)."""

    if model:
        return resolve_model(model)
    return GPT2Config(
        vocab_size=256,
        n_positions=256,
        n_embd=512,
        n_layer=max(2, virtual_stages) * pp,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


class _HeldBytes:
    """Bytes of activations autograd holds for backward: now, and the peak of the step.
    Tensors that share storage with a parameter (weights saved by linear layers) are not
    activations and are left out."""

    def __init__(self, params):
        self.now = self.peak = 0
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}

    def pack(self, t):
        if t.untyped_storage().data_ptr() in self.param_storages:
            return _Held(self, t, counted=False)
        return _Held(self, t)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    def __init__(self, owner: _HeldBytes, t: torch.Tensor, counted: bool = True):
        self.owner, self.tensor = owner, t
        self.bytes = t.numel() * t.element_size() if counted else 0
        owner.now += self.bytes
        owner.peak = max(owner.peak, owner.now)

    def __del__(self):
        self.owner.now -= self.bytes


def _worker(config_dict, tp, pp, m, schedule, steps, mbs, seq_len, virtual_stages=1, cp=1):
    config = config_from_dict(config_dict)
    mesh = Mesh.from_env(tp, pp, 1, cp=cp)
    model = build_stage(
        config,
        mesh,
        seed=0,
        virtual_stages=chunks_per_rank(schedule, virtual_stages),
        placement=placement_of(schedule),
    )
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, config.vocab_size, (mbs, seq_len + 1), generator=gen) for _ in range(m)]
    micro = [
        {"input_ids": t[:, :-1].to(mesh.device), "labels": t[:, 1:].to(mesh.device)} for t in ids
    ]
    executor = PipelineExecutor(
        model,
        mesh,
        schedule,
        (mbs, seq_len // cp, config.hidden_size),
        virtual_stages=virtual_stages,
    )
    keep_freed_host_memory()  # the model is built: the steps' tensors are kept
    held = _HeldBytes(model.parameters())
    timeline = None
    for _step in range(steps + 1):  # step 0 warms up
        model.zero_grad(set_to_none=True)
        held.peak = held.now
        with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
            executor.run(micro)
        timeline = gather_timeline(executor.last_timeline, mesh)
    peak = in_flight_peak(schedule_actions(schedule, pp, m, mesh.pp_rank, virtual_stages))
    parts = gather_stage_info(mesh, [float(peak), held.peak / 2**20])
    if mesh.rank != 0:
        return None
    return timeline.to_json(), [int(p[0]) for p in parts], [float(p[1]) for p in parts]


def gather_stage_info(mesh, values: list[float]) -> list[list[float]]:
    """Every pp stage's `values` (same length everywhere), in stage order; collective over
    the pp group, on the mesh device (NCCL rejects CPU tensors)."""
    info = torch.tensor(values, dtype=torch.float64, device=mesh.device)
    if mesh.pp_group is None:
        return [info.tolist()]
    parts = [torch.zeros_like(info) for _ in range(mesh.pp)]
    torch.distributed.all_gather(parts, info, group=mesh.pp_group)
    return [p.tolist() for p in parts]


def measure(
    pp: int,
    m: int,
    schedule: str,
    tp: int = 1,
    model: str | None = None,
    steps: int = 3,
    micro_batch_size: int = 4,
    seq_len: int = 64,
    virtual_stages: int = 1,
    cp: int = 1,
) -> BubbleRun:
    """Run the real engine on pp*tp*cp local processes; the last of `steps` steps' timeline
    (cp rank 0's pipeline; the cp ranks' costs include their attention exchanges).

    activation_mb is, per stage, the peak of the tensors autograd held for backward during
    the step (parameters left out, even where a layer saves its weight): what the schedule's
    in-flight count bounds."""
    check_schedule(schedule, pp, m, virtual_stages)
    config = bench_config(model, pp, chunks_per_rank(schedule, virtual_stages))
    results = run_local(
        _worker,
        pp * tp * cp,
        config.to_dict(),
        tp,
        pp,
        m,
        schedule,
        steps,
        micro_batch_size,
        seq_len,
        virtual_stages,
        cp,
        timeout_s=600,
        optimizers=False,
    )
    timeline_json, in_flight, act = results[0]
    timeline = Timeline.from_json(timeline_json)
    stats = bubble_stats(timeline)
    costs = mean_costs(timeline, schedule)
    return BubbleRun(
        timeline,
        stats,
        theory(pp, m, schedule, virtual_stages, costs),
        in_flight,
        act,
        costs=costs,
        stage_costs=stage_costs(timeline, costs["p2p_ms"]),
    )
