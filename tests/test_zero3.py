"""ZeRO-3 (`--zero 3`, `ShardedParams` + `Zero3Optimizer`) against one process, and what it
holds and sends.

Parity: the serial reference of test_parity_3d (plain torch AdamW, clipping on every step, 5
steps, 4 micro-batches of 2 per global batch): losses, grad norms, first-step gradients and
final weights within 1e-5 relative, at dp 2, tp 2 x dp 2 and pp 2 x dp 2 (1F1B and GPipe,
parameters freed per micro-batch or kept).
"""

import pytest
import torch
from test_parity_3d import (
    CONFIG,
    EPS,
    G,
    LR,
    MAX_NORM,
    SEED,
    SEQ,
    WD,
    check_against,
    config,
    global_batches,
    scheduler,
    serial_reference,
)
from tp_utils import to_device

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage
from megapar.training.step import BatchPlan


def build(mesh: Mesh, schedule: str = "1f1b", keep: bool = False, mbs: int = 2,
          precision: str = "fp32", recompute: str = "none", virtual_stages: int = 1,
          model_config=None, kind: str = "adamw"):
    """(model, TrainStep, ShardedParams) for --zero 3 on `mesh`."""
    from megapar.data_parallel.sharded_params import ShardedParams
    from megapar.optim import Precision
    from megapar.optim.zero3 import Zero3Optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.schedules import chunks_per_rank, placement_of
    from megapar.training.step import TrainStep

    cfg = model_config or config()
    model = build_stage(cfg, mesh, SEED, recompute,
                        virtual_stages=chunks_per_rank(schedule, virtual_stages),
                        placement=placement_of(schedule))
    seq = SEQ // mesh.cp // (mesh.tp if mesh.sequence_parallel else 1)
    executor = PipelineExecutor(model, mesh, schedule, (mbs, seq, cfg.hidden_size),
                                virtual_stages=virtual_stages)
    optimizer = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR, WD, eps=EPS,
                               kind=kind, tp_group=mesh.tp_group)
    sharded = ShardedParams(model, mesh.dp_cp_group, average_over=mesh.dp, keep=keep)
    step = TrainStep(model, mesh, executor, optimizer, scheduler(),
                     Precision(precision, mesh.device), MAX_NORM, sharded)
    return model, step, sharded


def _train(tp: int, pp: int, dp: int, schedule: str = "1f1b", keep: bool = False,
           sequence_parallel: bool = False, cp: int = 1, recompute: str = "none",
           order: str = "tp-pp-dp", virtual_stages: int = 1) -> dict:
    import torch.distributed as dist

    from megapar.tensor_parallel.partition import gather_full

    mesh = Mesh(Layout(tp, pp, dp, order, cp), dist.get_rank())
    mesh.sequence_parallel = sequence_parallel
    model, step, sharded = build(mesh, schedule, keep, recompute=recompute,
                                 virtual_stages=virtual_stages)
    optimizer, full_grads = step.optimizer, {}
    optimizer_step = optimizer.step

    def step_and_record_first_grads():
        if not full_grads:
            grads = sharded.full_grads()
            for name, p in model.named_parameters():
                full_grads[name] = gather_full(grads[id(p)], p.tp_dim, p.full_shape,
                                               mesh.tp_group).clone()
        optimizer_step()

    optimizer.step = step_and_record_first_grads
    plan = BatchPlan(G, 2, dp)
    results = [step.step(to_device(plan.split(batch, mesh.dp_rank), mesh.device), i)
               for i, batch in enumerate(global_batches())]
    with sharded.whole():
        weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group).clone()
                   for n, p in model.named_parameters()}
    freed = all(u.full.untyped_storage().nbytes() == 0 for u in sharded.units)
    keep_rank = mesh.dp_rank == 0 and mesh.tp_rank == 0 and mesh.cp_rank == 0
    return {"layout": (tp, pp, dp, 3, schedule, order, cp), "results": results,
            "weights": weights if keep_rank else {}, "grads": full_grads if keep_rank else {},
            "freed": freed}


def _worker(runs: list[tuple]) -> list[dict]:
    return [_train(*run) for run in runs]


@pytest.fixture(scope="module")
def reference():
    return serial_reference()


def test_zero3_parity_dp2_and_tp2_dp2(reference):
    """dp 2 (m 2 per rank) and tp 2 x dp 2: same losses, norms, gradients and weights as one
    process; between steps no unit is gathered."""
    for runs, world in (([(1, 1, 2)], 2), ([(2, 1, 2)], 4)):
        outs = run_local(_worker, world, runs)
        for i in range(len(runs)):
            check_against(reference, [o[i] for o in outs])
            assert all(o[i]["freed"] for o in outs)


def test_zero3_sweep(reference):
    for world, runs in ((4, [(1, 1, 2, "1f1b", False, False, 2), (2, 1, 2, "1f1b", False, True),
                             (1, 2, 2, "zb-v")]),
                        (2, [(1, 1, 2, "1f1b", False, False, 1, "full"),
                             (1, 1, 2, "1f1b", False, False, 1, "selective")])):
        outs = run_local(_worker, world, runs)
        for i in range(len(runs)):
            try:
                check_against(reference, [o[i] for o in outs])
                print("OK", runs[i])
            except AssertionError as e:
                print("FAIL", runs[i], str(e)[:200])
