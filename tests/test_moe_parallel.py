"""A Qwen3-MoE-style model (a dense first layer, three MoE layers with shared experts, the
switch loss and the z-loss in the loss, the auxiliary-loss-free bias moving every step) trains
the same at tp 2, pp 2 (1F1B, ZB-H1, interleaved 1F1B and ZB-V: the penalties made on every stage and chunk), dp 2 with ZeRO-1 and
ZeRO-3, pp 2 with full recomputation (the router statistics counted once), tp 2 with sequence
parallelism and cp 2 (each rank routes its tokens; the switch loss takes the micro-batch's
load from the group), tp 2 with each expert split over tp (expert tensor parallelism) as one
process: losses, grad norms, first-step gradients, final weights, the routing
biases and the router statistics, fp32, 1e-5 relative.

The serial reference is a plain PyTorch loop (torch.optim.AdamW, clip_grad_norm_) over the same
micro-batches, each micro-batch's penalty weighted 1 / m as its loss (`set_penalty_grad`, the
mechanism test_models_moe.py holds against transformers' loss).
"""

import contextlib
import re

import pytest
import torch
from test_zero3 import gathered_grads
from tp_utils import assert_close, gather_grads

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import Qwen3MoeConfig
from megapar.models.moe import finish_step, set_penalty_grad
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import gather_full, tp_parts, unpad
from megapar.training.step import BatchPlan

SEED, STEPS, G, MBS, SEQ, VOCAB, E = 11, 3, 8, 2, 8, 100, 4
LR, WD, MAX_NORM, EPS = 3e-3, 0.1, 0.3, 1e-4


def config(layers: int = 4) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=16, make_vocab_size_divisible_by=16, num_local_experts=E,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        router_aux_loss_coef=0.05, moe_z_loss_coef=0.01, moe_bias_update_rate=0.01,
        shared_expert_intermediate_size=16)


def three_layers() -> Qwen3MoeConfig:
    """`config`'s first three layers, the dense one and two MoE ones: at pp 2 the stages hold
    layers [0, 1] and [2], each an MoE layer. For the layouts whose schedule has one chunk a
    rank (interleaved 1F1B and ZB-V need 4 layers for their 4 chunks at pp 2)."""
    return config(3)


def global_batches() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, VOCAB, (G, SEQ), generator=gen) for _ in range(STEPS)]
    return [{"input_ids": x, "labels": (x + 1) % VOCAB} for x in ids]


def scheduler():
    from megapar.optim import LRScheduler

    return LRScheduler(LR, LR / 10, 1, STEPS, "cosine")


def biases(model) -> dict:
    return {re.sub(r"^chunks\.\d+\.", "", n): m.router.bias.clone()  # model chunks' names
            for n, m in model.named_modules() if hasattr(m, "router")}


def serial_reference(batches: list[dict] | None = None, make=None) -> dict:
    """One process trained with torch's AdamW on `batches` (default `global_batches()`), the
    model of `make()` (default `config()`)."""
    mesh = Mesh(Layout())
    model = build_stage((make or config)(), mesh, SEED)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    sched, plan = scheduler(), BatchPlan(G, MBS, 1)
    losses, norms, grads, routers = [], [], None, []
    for step, batch in enumerate(global_batches() if batches is None else batches):
        for g in opt.param_groups:
            g["lr"] = sched.lr(step)
        opt.zero_grad()
        micro = plan.split(batch, 0)
        set_penalty_grad(model, 1 / len(micro))
        total = 0.0
        for mb in micro:
            loss = model(None, mb)
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        if grads is None:
            grads = {n: unpad(p.grad.clone(), p.tp_dim, p.full_shape)
                     for n, p in model.named_parameters()}
        opt.step()
        routers.append(finish_step(model, mesh, E, True))
        losses.append(total)
    weights = {n: unpad(p.detach().clone(), p.tp_dim, p.full_shape)
               for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "grads": grads,
            "routers": routers, "biases": biases(model)}


def _train(tp, pp, dp, zero, schedule, recompute="none", sp=False, cp=1, etp=1, make=None,
           comm="auto", regather=False):
    """`comm`: --cp-comm-type (auto: the model's own cp attention); `regather`: --sp-regather."""
    import torch.distributed as dist

    from megapar.data_parallel import build_grad_sync
    from megapar.models import set_cp_comm, set_sp_regather
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.schedules import chunks_per_rank, placement_of
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(tp, pp, dp, "tp-pp-dp", cp), dist.get_rank(), sequence_parallel=sp,
                expert_tp=etp)
    virtual = 2 if schedule == "interleaved" else 1
    model = build_stage((make or config)(), mesh, SEED, recompute,
                        virtual_stages=chunks_per_rank(schedule, virtual),
                        placement=placement_of(schedule))
    set_cp_comm(model, comm)
    set_sp_regather(model, regather)
    seq = SEQ // cp // (tp if sp else 1)
    executor = PipelineExecutor(model, mesh, schedule, (MBS, seq, 32), virtual_stages=virtual)
    if zero == 3:
        from megapar.data_parallel.sharded_params import ShardedParams
        from megapar.optim.zero3 import Zero3Optimizer

        optimizer = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR, WD, eps=EPS,
                                   tp_group=mesh.tp_group)
        grad_sync = ShardedParams(model, mesh.dp_cp_group, average_over=mesh.dp)
    else:
        optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS, zero=zero)
        grad_sync = build_grad_sync(model, mesh, zero, bucket_mb=0.02) if dp * cp > 1 else None
    step = TrainStep(model, mesh, executor, optimizer, scheduler(), Precision("fp32", mesh.device),
                     MAX_NORM, grad_sync)
    grads, optimizer_step = {}, optimizer.step

    def record_first_grads_then_step():
        if not grads:
            if zero == 1:  # ZeRO-1 reduced only this rank's slices
                gather_grads(optimizer)
            full = gathered_grads(grad_sync) if zero == 3 else {}
            for name, p in model.named_parameters():
                g = full[id(p)] if zero == 3 else p.grad
                grads[name] = gather_full(g, p.tp_dim, p.full_shape, mesh.tp_group,
                                          tp_parts(p)).clone()
        optimizer_step()

    optimizer.step = record_first_grads_then_step
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(plan.split(b, mesh.dp_rank), i) for i, b in enumerate(global_batches())]
    with grad_sync.whole() if zero == 3 else contextlib.nullcontext():
        weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group,
                                  tp_parts(p)).clone() for n, p in model.named_parameters()}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0 and mesh.cp_rank == 0
    return {"run": (tp, pp, dp, zero, schedule, etp), "results": results,
            "weights": weights if keep else {}, "grads": grads if keep else {},
            "biases": biases(model),
            "cp_methods": {m.context_parallel.method for m in model.modules()
                           if getattr(m, "context_parallel", None) is not None}}


RUNS = [(2, 1, 1, 0, "1f1b"), (1, 2, 1, 0, "1f1b"), (1, 2, 1, 0, "zb-h1"),
        (1, 2, 1, 0, "interleaved"), (1, 2, 1, 0, "zb-v"),
        (1, 1, 2, 1, "1f1b"), (1, 1, 2, 3, "1f1b"), (1, 2, 1, 0, "1f1b", "full"),
        (2, 1, 1, 0, "1f1b", "none", True), (1, 1, 1, 0, "1f1b", "none", False, 2),
        (2, 1, 1, 0, "1f1b", "none", False, 1, 2)]


def _make(run: tuple):
    """The model of a run: `three_layers` but under interleaved 1F1B and ZB-V (4 chunks)."""
    return None if run[4] in ("interleaved", "zb-v") else three_layers


def _worker():
    return [_train(*run, make=_make(run)) for run in RUNS]


@pytest.fixture(scope="module")
def reference():
    return serial_reference()


@pytest.fixture(scope="module")
def small_reference():
    """The serial run of `three_layers`."""
    return serial_reference(make=three_layers)


def check_rank(out, what: str, reference, merged) -> None:
    """One rank's steps against the serial reference (losses, norms, router statistics, the
    balancing biases); its weights and gradients added to `merged`."""
    for s, r in enumerate(out["results"]):
        step = f"{what} step {s}"
        assert_close(torch.tensor(r.loss), torch.tensor(reference["losses"][s]),
                     what=f"{step} loss")
        assert_close(torch.tensor(r.grad_norm), torch.tensor(reference["norms"][s]),
                     what=f"{step} grad norm")
        ref = reference["routers"][s]
        for key in ("aux_loss", "z_loss", "imbalance"):
            assert_close(torch.tensor(r.router[key]), torch.tensor(ref[key]),
                         what=f"{step} {key}")
        assert r.router["tokens_per_expert"] == ref["tokens_per_expert"], step
    for name, b in out["biases"].items():
        assert_close(b, reference["biases"][name], what=f"{what} bias {name}")
    for key in merged:
        merged[key].update(out[key])


def test_reference_routes_unevenly_and_learns(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    assert all(r["imbalance"] > 1.05 for r in reference["routers"])
    assert all(b.abs().sum() > 0 for b in reference["biases"].values())  # the bias moved


def test_moe_layouts_match_serial_training(reference, small_reference):
    """Every run of `RUNS` (on `three_layers` but under interleaved 1F1B and ZB-V) equals the
    serial run of its model."""
    outs = run_local(_worker, 2)
    for i, run in enumerate(RUNS):
        ref = small_reference if _make(run) else reference
        merged = {"weights": {}, "grads": {}}
        for rank, out in enumerate(o[i] for o in outs):
            check_rank(out, f"{run} rank {rank}", ref, merged)
        for key in merged:
            assert set(merged[key]) == set(ref[key]), f"{run}: parameter names differ"
            for name, t in merged[key].items():
                assert_close(t, ref[key][name], what=f"{run} {key} {name}")
