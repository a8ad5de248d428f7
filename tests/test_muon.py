"""--optimizer muon against torch.optim.Muon + torch.optim.AdamW, and equal across layouts.

Reference (`muon_reference`): the 1x1x1 model, torch.optim.Muon (torch's own Newton-Schulz,
momentum and lr adjustment) over the blocks' 2-D weights, a fused qkv weight as its three
projections q, k and v (leaf tensors of their own, copied in and out around each step),
torch.optim.AdamW over the rest with megapar's weight-decay groups; no megapar optimizer code.

Newton-Schulz in bfloat16 (torch's) turns a 1e-7 difference of its input into ~1e-3 of its
output wherever a bf16 rounding flips, so agreement to 1e-5 needs inputs equal to the bit:
the reference clips as megapar does (the fp64 sum of squares, its root rounded to fp32, the
coefficient a Python float; torch's clip_grad_norm_ rounds its fp32 coefficient otherwise) and
runs torch's fused AdamW kernel (megapar's on CPU and CUDA), and
the layouts, whose gradients differ by reduction order, are compared with Newton-Schulz in fp32
(`ns_dtype=torch.float32`, megapar's choice under --precision fp32; the reference then runs
torch's iteration with the bf16 cast left out, `_ns_fp32`). The parallel runs use
`test_parity_3d`'s batches, schedule and checks (losses, grad norms, first-step gradients and
final weights, fp32, relative error < 1e-5).
"""

from contextlib import nullcontext

import pytest
import torch
import torch.optim._muon as torch_muon
from test_parity_3d import (EPS, G, LR, MAX_NORM, MBS, SEED, WD, check_against, config,
                            global_batches, scheduler)
from test_layout_change import _assert_continues, _train_and_checkpoint, common  # noqa: F401
from tp_utils import assert_close, record_first_grads, to_device

from megapar.checkpoint.manifest import read_manifest
from megapar.cli.train import main as train

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import unpad
from megapar.training.step import BatchPlan

MOMENTUM = 0.95


def _parts(name: str, p: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """The matrices Muon orthogonalises in `p` (views): q, k, v of a fused qkv weight (rows
    head-major, [heads, 3, head_dim]), else the weight itself."""
    if not name.endswith("attn.qkv.weight"):
        return [p]
    grid = p.view(heads, 3, p.shape[0] // (3 * heads), p.shape[1])
    return [grid[:, j] for j in range(3)]


def _ns_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch 2.13's `_zeropower_via_newtonschulz` without its cast to bfloat16."""
    a, b, c = ns_coefficients
    ortho_grad = grad.clone()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def _clip(params: list, max_norm: float) -> float:
    """clip_grad_norm_ as megapar computes it: fp64 sum of squares, root rounded to fp32."""
    norm = torch.stack([p.grad.double().pow(2).sum() for p in params]).sum().sqrt().float().item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_([p.grad for p in params], coef)
    return norm


def muon_reference(kind: str, adjust: str = "match_rms_adamw", ns: str = "bf16") -> dict:
    """The reference run (module docstring) of model `kind` (test_parity_3d's, or "moe":
    test_moe_parallel's Qwen3-MoE model with its penalties, moving biases and schedule)."""
    if ns == "fp32":
        saved = torch_muon._zeropower_via_newtonschulz
        torch_muon._zeropower_via_newtonschulz = _ns_fp32
        try:
            return muon_reference(kind, adjust)
        finally:
            torch_muon._zeropower_via_newtonschulz = saved
    from megapar.models.moe import finish_step, set_penalty_grad

    moe = kind == "moe"  # test_moe_parallel's Qwen3-MoE model, its schedule
    if moe:
        from test_moe_parallel import E
        from test_moe_parallel import config as moe_config
        from test_moe_parallel import scheduler as moe_scheduler
    mesh = Mesh(Layout())
    model = build_stage(moe_config() if moe else config(kind), mesh, SEED)
    heads = 4
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.dim() == 2 and n.startswith("layers.")]
    leaves = {n: [t.detach().reshape(-1, t.shape[-1]).clone().requires_grad_()
                  for t in _parts(n, p, heads)] for n, p in matrices}
    rest = [p for n, p in named if not (p.dim() == 2 and n.startswith("layers."))]
    muon = torch.optim.Muon([t for ts in leaves.values() for t in ts], lr=LR, weight_decay=WD,
                            momentum=MOMENTUM, nesterov=True, adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": WD},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=LR, betas=(0.9, 0.95), eps=EPS, fused=True)
    sched, plan = moe_scheduler() if moe else scheduler(), BatchPlan(G, MBS, 1)
    params = [p for _, p in named]
    losses, norms = [], []
    for step, batch in enumerate(global_batches()):
        for opt in (muon, adamw):
            for g in opt.param_groups:
                g["lr"] = sched.lr(step)
        model.zero_grad()
        total = 0.0
        micro = plan.split(batch, 0)
        if moe:  # each micro-batch's switch and z-loss weighted as its loss
            set_penalty_grad(model, 1 / len(micro))
        for mb in micro:
            loss = model(None, mb)
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        norms.append(_clip(params, MAX_NORM))
        if step == 0:
            first_grads = {n: unpad(p.grad.clone(), p.tp_dim, p.full_shape) for n, p in named}
        with torch.no_grad():
            for n, p in matrices:
                for leaf, w, g in zip(leaves[n], _parts(n, p, heads), _parts(n, p.grad, heads)):
                    leaf.copy_(w.reshape(leaf.shape))
                    leaf.grad = g.reshape(leaf.shape).clone()
            muon.step()
            adamw.step()
            for n, p in matrices:
                for leaf, w in zip(leaves[n], _parts(n, p, heads)):
                    w.copy_(leaf.view(w.shape))
        if moe:  # the routing biases move
            finish_step(model, mesh, E, True)
        losses.append(total)
    weights = {n: unpad(p.detach().clone(), p.tp_dim, p.full_shape) for n, p in named}
    return {"losses": losses, "norms": norms, "weights": weights, "grads": first_grads,
            "buffers": {n: [muon.state[t]["momentum_buffer"].clone() for t in ts]
                        for n, ts in leaves.items()}}


def _train(tp: int, pp: int, dp: int, zero: int, kind: str = "gpt2",
           adjust: str = "match_rms_adamw", ns: str = "fp32", sp: bool = False,
           cp: int = 1, distributed: bool = False) -> dict:
    """megapar's TrainStep with --optimizer muon in one layout (`test_parity_3d._train`'s
    parts); full weights and first-step gradients from dp rank 0 / tp rank 0 of each stage."""
    import torch.distributed as dist

    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.tensor_parallel.partition import gather_full
    from megapar.training.step import TrainStep

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh(Layout(tp, pp, dp, "tp-pp-dp", cp), rank, sequence_parallel=sp)
    model = build_stage(config(kind), mesh, SEED)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, 8 // cp // (tp if sp else 1), 32))
    muon = dict(kind="muon", momentum=MOMENTUM, muon_adjust_lr=adjust,
                muon_ns_dtype=torch.float32 if ns == "fp32" else torch.bfloat16,
                **({"muon_distributed": True} if distributed else {}))
    if zero == 3:
        from megapar.data_parallel.sharded_params import ShardedParams
        from megapar.optim.zero3 import Zero3Optimizer

        optimizer = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR, WD, eps=EPS,
                                   tp_group=mesh.tp_group, **muon)
        grad_sync = ShardedParams(model, mesh.dp_cp_group, average_over=mesh.dp)
    else:
        optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS, zero=zero, **muon)
        grad_sync = build_grad_sync(model, mesh, zero, bucket_mb=0.02) if dp * cp > 1 else None
    step = TrainStep(model, mesh, executor, optimizer, scheduler(), Precision("fp32", mesh.device),
                     MAX_NORM, grad_sync)
    full_grads = record_first_grads(optimizer, model, mesh, grad_sync if zero == 3 else None)
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i)
               for i, b in enumerate(global_batches())]
    with grad_sync.whole() if zero == 3 else nullcontext():
        weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group).clone()
                   for n, p in model.named_parameters()}
    state = optimizer.state_tensors()
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0 and mesh.cp_rank == 0
    buffers = {n: gather_full(s["momentum_buffer"], p.tp_dim, p.full_shape, mesh.tp_group)
               for n, p in model.named_parameters() for s in [state.get(n, {})]
               if "momentum_buffer" in s}
    return {"layout": (tp, pp, dp, zero, kind, sp, cp, distributed), "results": results,
            "weights": weights if keep else {}, "grads": full_grads if keep else {},
            "buffers": buffers if keep else {},
            "keys": {n: sorted(s) for n, s in state.items()}}


def _train_moe(tp: int, dp: int, ep: int, zero: int) -> dict:
    """test_moe_parallel's Qwen3-MoE model (router and shared experts Muon's, the routed
    experts AdamW's, split over ep) under --optimizer muon (fp32 NS) at tp x dp x ep for its 3
    steps; whole weights (the experts gathered over ep) and Muon's whole momentum buffers from
    dp rank 0 / tp rank 0."""
    import torch.distributed as dist
    from test_moe_ep import _whole
    from test_moe_parallel import SEQ, biases
    from test_moe_parallel import config as moe_config
    from test_moe_parallel import global_batches as moe_batches
    from test_moe_parallel import scheduler as moe_scheduler

    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh(Layout(tp, 1, dp, "tp-pp-dp", 1, ep), rank)
    model = build_stage(moe_config(), mesh, SEED)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, SEQ, 32))
    optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS, zero=zero, kind="muon",
                                momentum=MOMENTUM, muon_ns_dtype=torch.float32)
    grad_sync = build_grad_sync(model, mesh, zero, bucket_mb=0.02) if dp > 1 else None
    step = TrainStep(model, mesh, executor, optimizer, moe_scheduler(),
                     Precision("fp32", mesh.device), MAX_NORM, grad_sync)
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(plan.split(b, mesh.dp_rank), i) for i, b in enumerate(moe_batches())]
    weights = {n: _whole(p.detach(), p, mesh) for n, p in model.named_parameters()}
    state = optimizer.state_tensors()
    buffers = {n: _whole(s["momentum_buffer"], p, mesh) for n, p in model.named_parameters()
               for s in [state.get(n, {})] if "momentum_buffer" in s}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return {"layout": ("moe", tp, dp, ep, zero), "results": results, "biases": biases(model),
            "weights": weights if keep else {}, "buffers": buffers if keep else {}}


def _check_moe(reference: dict, per_rank: list[dict]) -> None:
    """Every rank's losses, grad norms, router statistics and biases (test_moe_parallel's
    `check_rank`), and the merged whole weights and momentum buffers, against the one-process
    run's."""
    from test_moe_parallel import check_rank

    results = reference["results"]
    serial = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
              "routers": [r.router for r in results], "biases": reference["biases"]}
    merged: dict = {"weights": {}, "buffers": {}}
    for out in per_rank:
        assert len(out["results"]) == len(results), out["layout"]
        check_rank(out, f"{out['layout']}", serial, merged)
    for key in merged:
        assert set(merged[key]) == set(reference[key]), f"{key} names differ"
        for name, t in merged[key].items():
            assert_close(t, reference[key][name], what=f"{key} {name}")
    assert any("router" in n for n in merged["buffers"])
    assert any(".shared." in n for n in merged["buffers"])


def _worker(runs: list[tuple]) -> list[dict]:
    return [_train_moe(*run[1:]) if run[0] == "moe" else _train(*run) for run in runs]


def _buffers_match(reference: dict, per_rank: list[dict], heads: int = 4) -> None:
    merged = {}
    for out in per_rank:
        merged.update(out["buffers"])
    assert set(merged) == set(reference["buffers"])
    for name, buf in merged.items():
        for ref, mine in zip(reference["buffers"][name], _parts(name, buf, heads)):
            assert_close(mine.reshape(ref.shape), ref, what=f"momentum buffer of {name}")


@pytest.mark.parametrize("kind,adjust,ns", [("gpt2", "match_rms_adamw", "bf16"),
                                             ("llama", "original", "bf16"),
                                             ("gpt2", "match_rms_adamw", "fp32"),
                                             ("bert", "match_rms_adamw", "fp32")])
def test_muon_one_process_equals_torch_muon_and_adamw(kind, adjust, ns):
    """One process: megapar's Muon + AdamW equals torch.optim.Muon + torch.optim.AdamW over
    3 steps (losses, grad norms, weights, Muon's momentum buffers), Newton-Schulz in bf16
    (torch's) and fp32 (BERT too: its fused qkv, its head transform AdamW's); the state keys are
    momentum_buffer for the blocks' matrices, Adam's moments for the rest."""
    reference = muon_reference(kind, adjust, ns)
    out = _train(1, 1, 1, 0, kind, adjust, ns)
    check_against(reference, [out])
    _buffers_match(reference, [out])
    assert reference["losses"][-1] < reference["losses"][0]
    for name, keys in out["keys"].items():
        matrix = name.startswith("layers.") and reference["weights"][name].dim() == 2
        assert keys == (["momentum_buffer"] if matrix else ["exp_avg", "exp_avg_sq"]), name


def test_muon_layouts_equal_one_process():
    """Newton-Schulz of whole matrices in every layout (fp32 NS): tp 2 (column- and
    row-parallel matrices, GPT-2's fused qkv split by heads, the shards all-gathered), pp 2,
    dp 2, ZeRO-1 / 2 / 3 (the pieces' updates all-gathered over dp first: ZeRO-1 at tp 2 x dp 2
    and pp 2 x dp 2, ZeRO-2 at dp 4, ZeRO-3 at tp 2 x dp 2 and dp 4), sequence parallelism at
    tp 2 x dp 2 with ZeRO-1 (the norms' and biases' partial gradients summed over tp on the
    pieces), context parallelism at cp 2 x dp 2 with ZeRO-1 (the state sharded over cp x dp),
    GPT-2 and grouped-query Llama, equal the one process's torch.optim.Muon + AdamW; and
    test_moe_parallel's Qwen3-MoE model (router and shared experts Muon's, routed experts
    AdamW's) at tp 2 x dp 2 x ep 2 and at dp 4 x ep 2 with ZeRO-1 equals megapar's one process
    (losses, grad norms, router statistics, biases, weights, momentum buffers), which equals
    torch.optim.Muon + AdamW on it (the switch and z-loss, the moving routing biases); and
    distributed Muon (each matrix orthogonalised by one dp rank, `--muon-distributed`) at
    tp 2 x dp 2 with ZeRO-1 and ZeRO-3, dp 4 with ZeRO-2 and pp 2 x dp 2 with ZeRO-1 equals
    the one process, and has the every-rank scheme's losses and weights to the bit in the
    layouts both run; one launch of 4 ranks. GPT-2 and Llama with 2 blocks (one a stage at
    pp 2: test_parity_3d's "_2" kinds), against the one process of the same model."""
    gpt2, llama = "gpt2_2", "llama_2"
    runs = [(2, 2, 1, 0, gpt2), (1, 2, 2, 0, gpt2), (2, 1, 2, 1, gpt2), (1, 1, 4, 2, gpt2),
            (2, 1, 2, 0, llama), (1, 2, 2, 1, llama), (2, 1, 2, 3, gpt2), (1, 1, 4, 3, llama),
            (2, 1, 2, 1, gpt2, "match_rms_adamw", "fp32", True),
            (1, 1, 2, 1, llama, "match_rms_adamw", "fp32", False, 2),
            ("moe", 2, 2, 2, 0), ("moe", 1, 4, 2, 1)]
    split = (gpt2, "match_rms_adamw", "fp32", False, 1, True)  # --muon-distributed
    distributed = [(2, 1, 2, 1, *split), (1, 1, 4, 2, *split), (2, 1, 2, 3, *split),
                   (1, 2, 2, 1, *split)]
    outs = run_local(_worker, 4, distributed + runs)
    references = {k: muon_reference(k, ns="fp32") for k in (gpt2, llama)}
    for i, run in enumerate(distributed):  # the same weights and losses as every rank's NS
        same = runs.index(run[:5]) + len(distributed) if run[:5] in runs else None
        per_rank = [o[i] for o in outs]
        check_against(references[gpt2], per_rank)
        _buffers_match(references[gpt2], per_rank)
        for out in outs if same is not None else ():
            assert [r.loss for r in out[i]["results"]] == [r.loss for r in out[same]["results"]]
            assert out[i]["weights"].keys() == out[same]["weights"].keys()
            for name, w in out[i]["weights"].items():
                assert torch.equal(w, out[same]["weights"][name]), (run, name)
    outs = [o[len(distributed):] for o in outs]
    moe_reference = _train_moe(1, 1, 1, 0)
    torch_moe = muon_reference("moe", ns="fp32")  # the one process is torch's Muon + AdamW
    assert [r.loss for r in moe_reference["results"]] == pytest.approx(torch_moe["losses"],
                                                                     rel=1e-5)
    assert [r.grad_norm for r in moe_reference["results"]] == pytest.approx(torch_moe["norms"],
                                                                          rel=1e-5)
    assert torch_moe["losses"][-1] < torch_moe["losses"][0]
    for key in ("weights", "buffers"):
        assert set(moe_reference[key]) == set(torch_moe[key]), key
    for name, w in moe_reference["weights"].items():
        assert_close(w, torch_moe["weights"][name], what=f"one process's {name}")
    for name, (buf,) in torch_moe["buffers"].items():
        assert_close(moe_reference["buffers"][name], buf, what=f"one process's buffer {name}")
    for i in range(len(runs) - 2, len(runs)):
        _check_moe(moe_reference, [o[i] for o in outs])
    runs = runs[:-2]
    for i, run in enumerate(runs):
        per_rank = [o[i] for o in outs]
        reference = references[run[4]]
        check_against(reference, per_rank)
        _buffers_match(reference, per_rank)


def test_muon_checkpoint_continues_in_another_layout(tmp_path, common):
    """megapar-train --optimizer muon at tp 2 x dp 2 with ZeRO-1 saves at step 3 of 6 (Muon's
    momentum buffers sharded over dp, gathered to the writer); resumed at pp 2 x dp 2 with
    ZeRO-3 and --muon-distributed (resharded on load, each rank taking its slices; the same
    checkpoint either way), steps 4-6 have the uninterrupted run's losses and grad norms."""
    muon = ["--optimizer", "muon", "--muon-momentum", "0.9"]
    reference, step3 = _train_and_checkpoint(
        tmp_path, [*common, *muon], ["--tp", "2", "--dp", "2", "--zero", "1"])
    entries = read_manifest(step3)["tensors"]
    assert sorted(entries["layers.0.attn.qkv.weight"]["optim"]) == ["momentum_buffer"]
    assert sorted(entries["layers.0.attn.qkv.bias"]["optim"]) == ["exp_avg", "exp_avg_sq"]
    log = tmp_path / "resumed.jsonl"
    assert train([*common, *muon, "--pp", "2", "--dp", "2", "--zero", "3", "--muon-distributed",
                  "--load", str(step3),
                  "--log-json", str(log)]) == 0
    print(_assert_continues(reference, log, "muon tp 2 x dp 2 zero 1 -> pp 2 x dp 2 zero 3"))


@pytest.mark.parametrize("flags,says", [
    (["--optimizer", "muon", "--offload-optimizer"],
     "steps AdamW or SGD on the host, not --optimizer muon (its Newton-Schulz iteration needs "
     "whole matrices on the devices): drop --offload-optimizer or use --optimizer adamw"),
    (["--optimizer", "muon", "--muon-momentum", "1.2"],
     "--muon-momentum 1.2 is invalid: it must be in [0, 1) (the default is 0.95)"),
    (["--muon-adjust-lr", "original"],
     "--muon-adjust-lr original would be ignored: it is Muon's, and --optimizer is adamw: "
     "add --optimizer muon, or drop --muon-adjust-lr"),
    # was "add --offload-optimizer", which the next run refused with Muon
    (["--optimizer", "muon", "--zero", "3", "--dp", "2", "--offload-params"],
     "--offload-params needs --offload-optimizer (the host-held parameter shards are the weights "
     "the optimizer steps), which steps AdamW or SGD on the host, not --optimizer muon: drop "
     "--offload-params or use --optimizer adamw"),
    (["--optimizer", "muon", "--muon-distributed"],
     "--muon-distributed would be ignored: it splits the orthogonalisation of ZeRO's sharded "
     "updates over the data-parallel ranks, and at --zero 0 every data-parallel rank holds "
     "whole matrices (nothing to exchange over dp; under --tp each tp-split matrix is "
     "all-gathered over tp either way): use --zero 1, 2 or 3, or drop --muon-distributed"),
], ids=["offloaded", "momentum", "without-muon", "offloaded-params", "distributed-zero-0"])
def test_muon_bad_settings_are_refused_before_workers_start(common, capfd, flags, says):
    """--optimizer muon with --offload-optimizer, a momentum outside [0, 1), and Muon's flags
    without it: one line naming the problem and the fix, exit 2, no worker started."""
    assert train([*common, *flags]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def _count_step(tp: int, dp: int, zero: int, pp: int = 1, distributed: bool = False) -> dict:
    """The collectives of one --optimizer muon optimizer step (GPT-2, tp x pp x dp) by group,
    and in issue order (op, elements, the group's ranks); with `distributed` (distributed
    Muon), the Newton-Schulz calls and what the plan says each rank sends and owns."""
    import torch.distributed as dist

    import megapar.optim.muon as muon_module

    from megapar.comm_count import count_collectives
    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(tp, pp, dp), dist.get_rank())
    model = build_stage(config("gpt2"), mesh, SEED)
    if zero == 3:  # megapar-train's optimizer_for
        from megapar.data_parallel.sharded_params import ShardedParams
        from megapar.optim.zero3 import Zero3Optimizer

        optimizer = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR, WD, eps=EPS,
                                   tp_group=mesh.tp_group, kind="muon",
                                   muon_distributed=distributed)
        grad_sync = ShardedParams(model, mesh.dp_cp_group, average_over=mesh.dp)
    else:
        optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS, zero=zero, kind="muon",
                                    muon_distributed=distributed)
        grad_sync = build_grad_sync(model, mesh, zero, bucket_mb=0.02)
    step = TrainStep(model, mesh, PipelineExecutor(model, mesh, "1f1b", (MBS, 8, 32)),
                     optimizer, scheduler(), Precision("fp32", mesh.device), 0.0, grad_sync)
    counted, optimizer_step, ns_calls = [], optimizer.step, []
    newton_schulz = muon_module.newton_schulz

    def counted_ns(g, *args):
        ns_calls.append(tuple(g.shape))
        return newton_schulz(g, *args)

    def counted_step():
        muon_module.newton_schulz = counted_ns
        try:
            with count_collectives() as calls:
                optimizer_step()
        finally:
            muon_module.newton_schulz = newton_schulz
        counted.extend(calls)

    optimizer.step = counted_step
    step.step(to_device(BatchPlan(G, MBS, dp).split(global_batches()[0], mesh.dp_rank),
                        mesh.device), 0)
    tp_ranks = tuple(dist.get_process_group_ranks(mesh.tp_group))
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")]
    buckets = optimizer.grad_sync.buckets
    muon_buckets = [b for b in buckets if any(id(p) in optimizer.muon_ids for p in b.params)]
    return {"tp": sorted((c.op, c.numel) for c in counted if c.ranks == tp_ranks),
            "dp": sorted((c.op, c.numel) for c in counted if c.ranks != tp_ranks),
            "expected_tp": sorted(("all_gather", p.numel()) for p in matrices),
            "expected_dp": sorted([("all_gather_into_tensor", b.padded // dp)
                                   for b in [*muon_buckets, *buckets]]),
            "muon_gathers": [b.padded // dp for b in muon_buckets],
            "param_gathers": [("all_gather_into_tensor", b.padded // dp) for b in buckets],
            "rank": mesh.rank, "issued": [(c.op, c.numel, c.ranks) for c in counted],
            "muon": sorted((c.op, c.numel) for c in counted if c.purpose == "muon"),
            "others": sorted((c.op, c.numel) for c in counted if c.purpose != "muon"),
            "ns_calls": ns_calls, "dp_rank": mesh.dp_rank, "tp_rank": mesh.tp_rank,
            "pp_rank": mesh.pp_rank, **(_plan_facts(optimizer, model) if distributed else {})}


def _plan_facts(optimizer, model) -> dict:
    """What distributed Muon's plan implies for one step on this rank: the all-to-alls'
    elements (first: the Muon elements of this rank's slices, to their owners; second: the
    elements of the (tp shards of the) matrices it owns, back), the tp all-gathers (one per
    owned tp-split matrix), the Newton-Schulz calls (one per owned matrix, q / k / v apart),
    and each matrix's owner by name with its cost; the elements its all-to-alls carry to and
    from the other dp ranks, by the plan's splits and as `muon.exchange_elements` counts them
    from the buckets' layout."""
    from megapar.optim.muon import exchange_elements, matrices_of, ns_cost, slices_held

    import torch.distributed as dist

    plan = optimizer.muon_plan
    names = {id(p): n for n, p in model.named_parameters()}
    owned = [p for p, _ in plan.owned]
    split = [getattr(p, "tp_dim", None) is not None for p in owned]
    tp_rank = dist.get_rank(optimizer.tp_group) if split and any(split) else 0
    mine = sum(e - s for p, s, e in optimizer._piece_of if id(p) in optimizer.muon_ids)
    return {"expected_a2a": [("all_to_all_single", mine),
                             ("all_to_all_single", sum(p.numel() for p in owned))],
            "expected_owned_tp": sorted((op, p.numel()) for p, tp in zip(owned, split) if tp
                                        for op in ("gather", "scatter")),
            "expected_ns": sorted(m for p, tp, r in zip(owned, split, plan.tp_owners)
                                  if not tp or r == tp_rank for m in matrices_of(p)),
            "owners": {names[i]: r for i, r in plan.owner.items()},
            "wire": _wire(plan, dist.get_rank(plan.group)),
            "counted": _counted(optimizer, plan, exchange_elements, slices_held),
            "costs": {names[i]: ns_cost(p) for i, p in
                      ((id(p), p) for p in optimizer.params) if i in plan.owner}}


def _wire(plan, me: int) -> int:
    """Elements the plan's two all-to-alls carry into this rank from the others: the first's
    received split, and what it sent in the first coming back in the second."""
    return sum(n for r, n in enumerate(plan.recv_splits) if r != me) + sum(
        n for r, n in enumerate(plan.send_splits) if r != me)


def _counted(optimizer, plan, exchange_elements, slices_held) -> int:
    """`exchange_elements` of this rank from the Muon buckets' layout and the plan's owners."""
    import torch.distributed as dist

    held, owners = [], []
    for b in optimizer.grad_sync.buckets:
        parts = slices_held([p.numel() for p in b.params], b.padded, b.group_size)
        for p, h in zip(b.params, parts):
            if id(p) in plan.owner:
                held.append(h)
                owners.append(plan.owner[id(p)])
    return exchange_elements(held, owners)[dist.get_rank(plan.group)]


def _count_steps(layouts: list[tuple]) -> list[dict]:
    return [_count_step(*layout) for layout in layouts]


def _same_order_in_every_group(outs: list[dict]) -> None:
    """Every rank of each group issued the same collectives over it in the same order (NCCL
    pairs a group's collectives by issue order), of the same sizes but the all-to-all(-v)s'
    (each rank's input its own)."""
    by_group: dict = {}
    for out in outs:
        for op, numel, ranks in out["issued"]:
            size = None if op == "all_to_all_single" else numel
            by_group.setdefault(ranks, {}).setdefault(out["rank"], []).append((op, size))
    assert by_group
    for ranks, issued in by_group.items():
        assert sorted(issued) == sorted(ranks), ranks
        assert all(seq == issued[ranks[0]] for seq in issued.values()), (ranks, issued)


def test_muon_step_gathers_each_tp_matrix_once_and_the_muon_buckets_over_dp():
    """One optimizer step at tp 2 x dp 2 with ZeRO-1: over tp, one all-gather of each Muon
    matrix's shard (GPT-2's 4 matrices per block, 16); over dp, the parameter buckets'
    all-gather after the step (ZeRO-1's own) and one more all-gather of each bucket holding
    Muon matrices (their pieces' updates); nothing else. Every rank of each group issues them
    in the same order, there and at pp 2 x dp 2 with ZeRO-3 (each stage's own matrices and
    units). The tp all-gathers and the Muon buckets' all-gathers are recorded as Muon's
    (`Call.purpose`, what the dry run names them by), the parameter buckets' not."""
    outs = run_local(_count_steps, 4, [(2, 2, 1), (1, 2, 3, 2)])
    for out in (o[0] for o in outs):
        assert len(out["expected_tp"]) == 16
        assert out["tp"] == out["expected_tp"]
        assert out["dp"] == out["expected_dp"]
        assert out["muon"] == sorted(out["expected_tp"] + [("all_gather_into_tensor", n)
                                                           for n in out["muon_gathers"]])
        assert out["others"] == sorted(out["param_gathers"])
    for layout in range(2):
        _same_order_in_every_group([o[layout] for o in outs])
    assert {len(o[1]["issued"]) > 0 for o in outs} == {True}  # the ZeRO-3 units' gathers


def test_distributed_muon_orthogonalises_each_matrix_once_per_dp_group():
    """--muon-distributed (one optimizer step of GPT-2): at tp 2 x dp 2 with ZeRO-1, dp 4 with
    ZeRO-2 and pp 2 x dp 2 with ZeRO-3 each rank issues two all-to-alls over dp (the Muon
    elements of its slices to their owners; its owned matrices' elements back) and one tp
    all-gather per tp-split matrix it owns, nothing else for Muon; it runs Newton-Schulz on
    its owned matrices only, so each matrix (q / k / v apart) once per dp group, the same
    matrices as one rank of the every-rank scheme (tp 2 x dp 2 ZeRO-1 without the flag: every
    rank all of them); the assignment is the same on every rank, covers every matrix, and is
    balanced to within one matrix's cost; every rank of each group issues its collectives in
    the same order; the elements its all-to-alls carry to and from the other dp ranks are what
    `muon.exchange_elements` counts from the buckets' layout (the count
    test_owner_placement_moves_fewer_bytes_at_the_same_balance compares); the all-to-alls and
    the tp gathers and scatters are recorded as Muon's (`Call.purpose`), the parameter
    buckets' all-gathers not."""
    layouts = [(2, 2, 1, 1, True), (1, 4, 2, 1, True), (1, 2, 3, 2, True), (2, 2, 1)]
    outs = run_local(_count_steps, 4, layouts)
    every_rank = {o[3]["rank"]: sorted(o[3]["ns_calls"]) for o in outs}
    for layout in range(3):
        per = [o[layout] for o in outs]
        _same_order_in_every_group(per)
        for out in per:
            a2a = [(op, n) for op, n, _ in out["issued"] if op == "all_to_all_single"]
            assert a2a == out["expected_a2a"], (layouts[layout], out["rank"])
            if layout == 0:
                assert sorted(out["tp"]) == out["expected_owned_tp"], out["rank"]
            if layout < 2:  # ZeRO-1 / 2: and the parameter buckets' all-gather after the step
                assert out["dp"] == sorted(out["param_gathers"] + out["expected_a2a"])
                assert out["others"] == sorted(out["param_gathers"])
            assert out["muon"] == sorted(out["expected_a2a"] + out["tp"]), out["rank"]
            assert sorted(out["ns_calls"]) == out["expected_ns"], (layouts[layout], out["rank"])
            assert out["wire"] == out["counted"], (layouts[layout], out["rank"])
        groups: dict = {}
        for out in per:  # the dp group: same tp and pp ranks
            groups.setdefault((out["tp_rank"], out["pp_rank"]), []).append(out)
        for members in groups.values():
            assert all(m["owners"] == members[0]["owners"] for m in members)
            owners, costs = members[0]["owners"], members[0]["costs"]
            assert set(owners) == set(costs) and owners
            load = [sum(c for n, c in costs.items() if owners[n] == r)
                    for r in range(len(members))]
            assert max(load) - min(load) <= max(costs.values()), load
    assert {len(calls) for calls in every_rank.values()} == {4 * 6}  # 4 blocks, q k v apart
    for layout in range(3):  # each matrix once in the job: one rank's calls in the old scheme
        assert sorted(c for o in outs for c in o[layout]["ns_calls"]) == every_rank[0]
    for out in (o[1] for o in outs):  # dp 4: fewer elements than every rank's gathers receive
        assert sum(n for _, n in out["expected_a2a"]) < 3 * sum(out["muon_gathers"])


def _muon_layouts(name: str, dps) -> dict:
    """{(zero, dp): (each Muon matrix's cost, its elements on each dp rank, elements of the
    buckets / units holding Muon matrices)} of model `name` built on the meta device (one
    process): ZeRO-1 / 2's 25 MB fp32 buckets (`make_buckets`) and ZeRO-3's units
    (`plan.params.stage_units`), each padded to a multiple of dp."""
    import json
    import os

    from megapar.data_parallel.buckets import make_buckets
    from megapar.models import build_model
    from megapar.models.config import config_from_dict
    from megapar.optim.muon import is_muon_matrix, ns_cost, slices_held
    from megapar.plan.params import StageLayout, stage_units

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "models", f"{name}.json")) as f:
        cfg = config_from_dict(json.load(f))
    named = list(build_model(cfg, Mesh.virtual(Layout(1, 1, 1))).named_parameters())
    params = [p for _, p in named]
    muon = {id(p) for n, p in named if is_muon_matrix(n, p)}
    out = {}
    for n in dps:
        units = [[params[i] for i in u.tensors]
                 for u in stage_units(StageLayout.of(cfg, dp=n, zero=3))]
        for zero, groups in ((1, [(b.params, b.padded) for b in make_buckets(params, 25.0, n)]),
                             (3, [(u, -(-sum(p.numel() for p in u) // n) * n) for u in units])):
            costs, held, total = [], [], 0
            for group, padded in groups:
                if any(id(p) in muon for p in group):
                    total += padded
                for p, parts in zip(group, slices_held([p.numel() for p in group], padded, n)):
                    if id(p) in muon:
                        costs.append(ns_cost(p))
                        held.append(parts)
            out[zero, n] = costs, held, total
    return out


@pytest.mark.parametrize("name", ["gpt2-124m", "llama-160m"])
def test_owner_placement_moves_fewer_bytes_at_the_same_balance(name):
    """--muon-distributed's all-to-alls counted without processes, for GPT-2 124M and a
    Llama of 160M (full shapes on the meta device) in ZeRO-1 / 2's buckets and ZeRO-3's units
    at dp 2, 4 and 8: with each matrix placed where its slices lie (`place_owners`), the most
    any dp rank receives (the same as it sends) is less than with owners by Newton-Schulz cost
    alone (`assign_owners`, the placement before) and less than the every-rank scheme's
    all-gather of the Muon buckets receives on every rank; the job moves no more in total; and
    no slot's Newton-Schulz cost exceeds `assign_owners`' heaviest. (The figures:
    benchmarks/data_parallel/muon_exchange.py, docs/guides/training.md#muon.)"""
    from megapar.optim.muon import assign_owners, exchange_elements, place_owners

    for (zero, n), (costs, held, total) in _muon_layouts(name, (2, 4, 8)).items():
        before = exchange_elements(held, assign_owners(costs, n))
        slots = place_owners(costs, held)
        after = exchange_elements(held, slots)
        assert max(after) < max(before), (zero, n, before, after)
        assert sum(after) <= sum(before), (zero, n)
        assert max(after) < (n - 1) * total // n, (zero, n, after, total)
        heaviest = max(sum(c for c, s in zip(costs, assign_owners(costs, n)) if s == r)
                       for r in range(n))
        assert max(sum(c for c, s in zip(costs, slots) if s == r) for r in range(n)) <= heaviest


def test_place_owners_keeps_matrices_where_they_lie_within_the_cap():
    """`place_owners` by hand and at random: at dp 2 two matrices of one cost each wholly on
    the other rank than `assign_owners` gives them stay where they lie (nothing crosses the
    wire); three on rank 0 leave one to rank 1 (the cap: longest-first's heaviest slot holds
    two); under tp 2 a slot is dp rank x 2 + tp rank; `slices_held` agrees with ZeRO's pieces
    (`slice_pieces`); and for random costs and layouts no slot ends above the cap, every
    matrix has a slot, and the same input gives the same placement."""
    import random

    from megapar.data_parallel.buckets import slice_pieces
    from megapar.optim.muon import assign_owners, exchange_elements, place_owners, slices_held

    assert assign_owners([5, 5], 2) == [0, 1]
    assert exchange_elements([[0, 4], [4, 0]], [0, 1]) == [8, 8]
    assert place_owners([5, 5], [[0, 4], [4, 0]]) == [1, 0]
    assert exchange_elements([[0, 4], [4, 0]], [1, 0]) == [0, 0]
    three = [[4, 0]] * 3
    slots = place_owners([5, 5, 5], three)
    assert sorted(slots) == [0, 0, 1]
    assert exchange_elements(three, slots) == [4, 4]
    assert place_owners([5, 5], [[0, 4], [4, 0]], tp=2) == [2, 0]
    rng = random.Random(0)
    for _ in range(200):
        n, tp, m = rng.choice([2, 3, 4]), rng.choice([1, 2]), rng.randrange(1, 12)
        numels = [rng.randrange(1, 50) for _ in range(m)]
        padded = -(-sum(numels) // n) * n
        held = slices_held(numels, padded, n)
        size = padded // n
        for r in range(n):
            pieces = slice_pieces(numels, r * size, (r + 1) * size)
            assert [h[r] for h in held] == [
                sum(e - s for i, s, e in pieces if i == j) for j in range(m)]
        costs = [rng.randrange(1, 30) for _ in range(m)]
        slots = place_owners(costs, held, tp)
        assert slots == place_owners(costs, held, tp)
        assert all(0 <= s < n * tp for s in slots)
        cap = max(sum(c for c, s in zip(costs, assign_owners(costs, n * tp)) if s == r)
                  for r in range(n * tp))
        assert max(sum(c for c, s in zip(costs, slots) if s == r) for r in range(n * tp)) <= cap


def test_planner_counts_one_momentum_buffer_per_muon_matrix():
    """plan.state counts --optimizer muon's state: 4 bytes per element of the blocks' 2-D
    weights (one momentum buffer, no step count), AdamW's 8 bytes per element and a 4-byte
    step count for every other parameter (GPT-2, one rank, no ZeRO; --optimizer lamb AdamW's
    count, sgd and lars 4 bytes per element); under ZeRO the planner's most loaded rank is the
    largest of every rank's count."""
    from megapar.optim.muon import is_muon_matrix
    from megapar.plan.params import StageLayout
    from megapar.plan.state import rank_state

    model = build_stage(config("gpt2"), Mesh(Layout()), SEED)
    expected = sum(4 * p.numel() if is_muon_matrix(n, p) else 8 * p.numel() + 4
                   for n, p in model.named_parameters())
    adam = sum(8 * p.numel() + 4 for p in model.parameters())
    layout = StageLayout.of(config("gpt2"), optimizer="muon")
    assert rank_state(layout, 0).optimizer == expected < adam
    assert rank_state(StageLayout.of(config("gpt2")), 0).optimizer == adam
    # megapar-train's other optimizers: LAMB AdamW's state, SGD and LARS a momentum buffer
    momentum = sum(4 * p.numel() for p in model.parameters())
    for kind, held in (("lamb", adam), ("sgd", momentum), ("lars", momentum)):
        assert rank_state(StageLayout.of(config("gpt2"), optimizer=kind), 0).optimizer == held
    # the most loaded ZeRO rank (`plan.slices`, vectorised over every rank) is the largest
    # of the ranks' own counts
    from megapar.plan.slices import most_loaded

    for kind, dp, zero, tp in (("gpt2", 3, 1, 1), ("gpt2", 4, 3, 2), ("llama", 5, 2, 1)):
        layout = StageLayout.of(config(kind), optimizer="muon", dp=dp, zero=zero, tp=tp,
                                bucket_mb=0.01)
        each = [rank_state(layout, r).optimizer for r in range(dp)]
        assert most_loaded(layout).optimizer == max(each), (kind, dp, zero, each)
        assert len(set(each)) > 1  # the ranks differ: the choice is not a tie


@pytest.mark.parametrize("optimizer", ["muon", "sgd", "lars", "lamb"])
def test_plan_verify_with_muon_equals_the_dry_runs_bytes(capsys, optimizer):
    """megapar-plan --optimizer muon --verify 1: the best layout's (dp 2, ZeRO-1: Muon's
    momentum in the ranks' pieces) dry run holds the planned optimizer bytes to the byte, and
    the command it prints trains with --optimizer muon. The same for megapar-train's other
    optimizers: SGD's and LARS's one momentum buffer (no step count), LAMB's moments and step
    count."""
    from megapar.cli.plan import main as plan

    assert plan(["--model", "gpt2-tiny", "--gpus", "2", "--global-batch-size", "8",
                 "--seq-len", "32", "--top", "1", "--schedules", "1f1b",
                 "--micro-batch-sizes", "2", "--zero-stages", "1", "--optimizer", optimizer,
                 "--verify", "1"]) == 0
    out = capsys.readouterr().out
    assert "command: " in out, out
    assert f"--zero 1 --optimizer {optimizer}" in out.split("command: ")[1].splitlines()[0]
    verified = out.split("verifying the 1 best layouts")[1].strip().splitlines()[1:]
    assert len(verified) == 1 and "equal, 0 bytes apart" in verified[0], verified


def test_muon_leaves_the_routed_experts_to_adamw():
    """A Qwen3-MoE stage under --optimizer muon: the router and the shared experts (2-D block
    weights) take Muon's momentum buffer, the routed experts' stacked [E, ...] tensors (split
    over ep, which Muon does not gather) AdamW's moments; one step moves every parameter."""
    from test_moe_parallel import config as moe_config

    from megapar.optim import build_optimizer

    mesh = Mesh(Layout())
    model = build_stage(moe_config(), mesh, SEED)
    optimizer = build_optimizer(model, mesh, LR, WD, kind="muon")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = global_batches()[0]
    model(None, {k: v[:2] for k, v in batch.items()}).backward()
    optimizer.step()
    keys = {n: sorted(s) for n, s in optimizer.state_tensors().items()}
    assert keys["layers.1.mlp.router.weight"] == ["momentum_buffer"]
    assert keys["layers.1.mlp.shared.up.weight"] == ["momentum_buffer"]
    assert keys["layers.1.mlp.experts.gate_up"] == ["exp_avg", "exp_avg_sq"]
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
