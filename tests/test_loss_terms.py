"""--label-smoothing and --z-loss against plain torch, in one process and across layouts.

Reference: the one-process model's logits (the padded vocabulary cut off), torch's
F.cross_entropy(..., label_smoothing=LS, ignore_index=-100) per micro-batch plus a hand-written
z-loss (Z x the mean over the labelled tokens of logsumexp(logits)^2), backpropagated together;
torch's AdamW and clip_grad_norm_. Every run must give the same cross-entropy, z-loss term,
gradient norms, first-step gradients and final weights (fp32, 1e-5 relative): one process
(torch's own cross-entropy path, and the fused chunked head whose gradients are made in the
forward), tp 2 (vocab-parallel, its second rank's slice ending in padding columns), pp 2, tp 2 x
dp 2, tp 2 x cp 2 with sequence parallelism, through both the fused head and the whole logits.
"""

import torch
import torch.nn.functional as F
from test_parity_3d import (EPS, LR, MAX_NORM, MBS, SEED, VOCAB, WD, check_against, config,
                            global_batches, scheduler)
from tp_utils import assert_close, record_first_grads, to_device

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import set_loss_chunk_tokens, set_loss_terms
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import unpad
from megapar.training.step import BatchPlan

LS, Z, STEPS, G = 0.1, 1e-3, 2, 8


def batches() -> list[dict]:
    """`global_batches` with some labels ignored (-100): each row's first (row % 3) tokens."""
    out = []
    for batch in global_batches(STEPS):
        labels = batch["labels"].clone()
        for row in range(G):
            labels[row, : row % 3] = -100
        out.append({"input_ids": batch["input_ids"], "labels": labels})
    return out


def reference(kind: str) -> dict:
    model = build_stage(config(kind), Mesh(Layout()), SEED)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    sched, plan = scheduler(STEPS), BatchPlan(G, MBS, 1)
    losses, z_losses, norms = [], [], []
    for step, batch in enumerate(batches()):
        for g in opt.param_groups:
            g["lr"] = sched.lr(step)
        opt.zero_grad()
        micro = plan.split(batch, 0)
        total = z_total = 0.0
        for mb in micro:
            logits = model(None, {"input_ids": mb["input_ids"]})[..., :VOCAB].reshape(-1, VOCAB)
            labels = mb["labels"].reshape(-1)
            ce = F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=LS)
            z = Z * torch.logsumexp(logits, dim=-1)[labels != -100].square().mean()
            ((ce + z) / len(micro)).backward()
            total += ce.item() / len(micro)
            z_total += z.item() / len(micro)
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        if step == 0:
            grads = {n: unpad(p.grad.clone(), p.tp_dim, p.full_shape)
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(total)
        z_losses.append(z_total)
    weights = {n: unpad(p.detach().clone(), p.tp_dim, p.full_shape)
               for n, p in model.named_parameters()}
    return {"losses": losses, "z": z_losses, "norms": norms, "weights": weights, "grads": grads}


def _train(tp: int, pp: int, dp: int, cp: int = 1, sp: bool = False, kind: str = "gpt2",
           chunk: int | None = None) -> dict:
    """STEPS steps of `kind` with LS and Z in one layout (`chunk`: the head's chunk tokens,
    0: the whole logits; None: the default, fused)."""
    import torch.distributed as dist

    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.tensor_parallel.partition import gather_full
    from megapar.training.step import TrainStep

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh(Layout(tp, pp, dp, "tp-pp-dp", cp), rank, sequence_parallel=sp)
    model = build_stage(config(kind), mesh, SEED)
    set_loss_terms(model, LS, Z)
    if chunk is not None:
        set_loss_chunk_tokens(model, chunk)
    seq = batches()[0]["input_ids"].shape[1] // cp // (tp if sp else 1)
    hidden = model.config.hidden_size
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, seq, hidden))
    optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS)
    grad_sync = build_grad_sync(model, mesh, 0, bucket_mb=0.02) if dp * cp > 1 else None
    step = TrainStep(model, mesh, executor, optimizer, scheduler(STEPS),
                     Precision("fp32", mesh.device), MAX_NORM, grad_sync)
    grads = record_first_grads(optimizer, model, mesh)
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i)
               for i, b in enumerate(batches())]
    weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group)
               for n, p in model.named_parameters()}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return {"layout": (tp, pp, dp, cp, sp, kind, chunk), "results": results,
            "weights": weights if keep else {}, "grads": grads if keep else {}}


def _worker(runs: list[tuple]) -> list[dict]:
    return [_train(*run) for run in runs]


def check(ref: dict, per_rank: list[dict]) -> None:
    check_against(ref, per_rank)
    for out in per_rank:
        for s, r in enumerate(out["results"]):
            assert_close(torch.tensor(r.z_loss), torch.tensor(ref["z"][s]),
                         what=f"{out['layout']} z-loss at step {s}")


RUNS = [(2, 1, 2, 1, False, "gpt2", 0),  # vocab-parallel logits, x dp 2
        (2, 2, 1, 1, False, "llama"),  # the fused head at tp 2, untied; pp 2
        (1, 2, 2, 1, False, "gpt2"),  # the fused head at tp 1 (gradients in the forward)
        (2, 1, 1, 2, True, "gpt2")]  # cp 2 x tp 2 with sequence parallelism


def test_label_smoothing_and_z_loss_match_torch():
    refs = {kind: reference(kind) for kind in ("gpt2", "llama")}
    assert refs["gpt2"]["losses"][-1] < refs["gpt2"]["losses"][0]
    assert all(z > 0 for z in refs["gpt2"]["z"])
    for chunk in (0, None):  # one process: torch's own cross-entropy, the fused head
        check(refs["gpt2"], [_train(1, 1, 1, chunk=chunk)])
    outs = run_local(_worker, 4, RUNS)
    for i, run in enumerate(RUNS):
        check(refs[run[5]], [o[i] for o in outs])
