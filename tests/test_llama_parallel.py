"""Llama in 3D: the same training steps as one process, and checkpoints that move across layouts.

- 3D parity: tp x pp x dp = 2x2x2 (with ZeRO-1, and with selective / full recompute) gives the
  losses, grad norms, first-step gradients and final weights of a plain serial PyTorch loop
  (torch.optim.AdamW, clip_grad_norm_), tied and untied head, fp32, relative error < 1e-5.
- Reshard on load: a checkpoint saved at tp 2 (kv heads split) loads at tp 4 (kv heads whole on
  every rank) and back, weights and optimizer moments bitwise (a Qwen2's k / v biases too).
"""

import pytest
import torch
from test_checkpoint_helpers import KEYS, moment, optim_for
from tp_utils import assert_close, gather_grads, make_mesh

from megapar.checkpoint.distributed import load_checkpoint, save_checkpoint
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import LlamaConfig, Qwen2Config
from megapar.optim import LRScheduler
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import gather_full, unpad
from megapar.training.step import BatchPlan

SEED, STEPS, G, MBS, SEQ, VOCAB = 11, 4, 8, 2, 8, 100
LR, WD, MAX_NORM, EPS = 3e-3, 0.1, 0.3, 1e-4  # eps 1e-4: see test_parity_3d.py
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            make_vocab_size_divisible_by=16)


def config(tied: bool, family: str = "llama") -> LlamaConfig:
    """The Llama, or a Qwen2 of its sizes (q / k / v biases)."""
    cls = Qwen2Config if family == "qwen2" else LlamaConfig
    return cls(**BASE, tie_word_embeddings=tied)


def global_batches() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, VOCAB, (G, SEQ), generator=gen) for _ in range(STEPS)]
    return [{"input_ids": x, "labels": (x + 1) % VOCAB} for x in ids]


def scheduler() -> LRScheduler:
    return LRScheduler(LR, LR / 10, 1, STEPS, "cosine")


def serial_reference(tied: bool) -> dict:
    model = build_stage(config(tied), Mesh(Layout()), SEED)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    sched, plan = scheduler(), BatchPlan(G, MBS, 1)
    losses, norms, grads = [], [], None
    for step, batch in enumerate(global_batches()):
        for g in opt.param_groups:
            g["lr"] = sched.lr(step)
        opt.zero_grad()
        micro = plan.split(batch, 0)
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
        losses.append(total)
    weights = {n: unpad(p.detach().clone(), p.tp_dim, p.full_shape)
               for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "grads": grads}


def _train(tp, pp, dp, zero, tied, recompute):
    import torch.distributed as dist

    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(tp, pp, dp), dist.get_rank())
    model = build_stage(config(tied), mesh, SEED, recompute)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, SEQ, BASE["hidden_size"]))
    optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS, zero=zero)
    grad_sync = build_grad_sync(model, mesh, zero, bucket_mb=0.02)
    step = TrainStep(model, mesh, executor, optimizer, scheduler(), Precision("fp32", mesh.device),
                     MAX_NORM, grad_sync)
    grads, optimizer_step = {}, optimizer.step

    def record_first_grads_then_step():
        if not grads:
            if getattr(optimizer, "sharded", False):  # ZeRO-1 reduced only this rank's slices
                gather_grads(optimizer)
            for name, p in model.named_parameters():
                grads[name] = gather_full(p.grad, p.tp_dim, p.full_shape, mesh.tp_group).clone()
        optimizer_step()

    optimizer.step = record_first_grads_then_step
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(plan.split(b, mesh.dp_rank), i) for i, b in enumerate(global_batches())]
    weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group)
               for n, p in model.named_parameters()}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return {"run": (tp, pp, dp, zero, tied, recompute), "losses": [r.loss for r in results],
            "norms": [r.grad_norm for r in results], "weights": weights if keep else {},
            "grads": grads if keep else {}, "tied_names": [n for n, p in model.named_parameters()
                                                          if hasattr(p, "tied_to")]}


RUNS = [(2, 2, 2, 0, False, "none"), (2, 2, 2, 1, True, "none"),
        (2, 2, 2, 0, False, "selective"), (2, 2, 2, 1, True, "full")]


def _worker():
    return [_train(*run) for run in RUNS]


@pytest.fixture(scope="module")
def references():
    return {tied: serial_reference(tied) for tied in (False, True)}


def test_3d_2x2x2_matches_serial_training(references):
    outs = run_local(_worker, 8)
    for i, run in enumerate(RUNS):
        ref = references[run[4]]
        assert ref["losses"][-1] < ref["losses"][0]
        merged = {"weights": {}, "grads": {}}
        for rank, out in enumerate(o[i] for o in outs):
            for s in range(STEPS):
                assert_close(torch.tensor(out["losses"][s]), torch.tensor(ref["losses"][s]),
                             what=f"{run} rank {rank} loss at step {s}")
                assert_close(torch.tensor(out["norms"][s]), torch.tensor(ref["norms"][s]),
                             what=f"{run} rank {rank} grad norm at step {s}")
            assert all(n > MAX_NORM for n in out["norms"]), f"{run}: clipping did not bite"
            for key in merged:
                merged[key].update({n: t for n, t in out[key].items()
                                    if n not in out["tied_names"]})
        for key in merged:
            assert set(merged[key]) == set(ref[key]), f"{run}: parameter names differ"
            for name, t in merged[key].items():
                assert_close(t, ref[key][name], what=f"{run} {key} {name}")


def _save(root, tp, family="llama"):
    mesh = make_mesh(tp)
    model = build_stage(config(False, family), mesh, seed=7)
    return str(save_checkpoint(root, 1, model, mesh, optim_for(model, mesh), {}, {}))


def _load(path, tp, family="llama"):
    mesh = make_mesh(tp)
    model = build_stage(config(False, family), mesh, seed=99)
    state = load_checkpoint(path, model, mesh)
    params = dict(model.named_parameters())
    weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group)
               for n, p in params.items()}
    moments = {n: {k: gather_full(v, params[n].tp_dim, params[n].full_shape, mesh.tp_group)
                   for k, v in m.items()} for n, m in state.optim_tensors.items()}
    kv = {params[f"layers.0.attn.k.{kind}"].tp_dim for kind in ("weight", "bias")
          if f"layers.0.attn.k.{kind}" in params}
    return weights, moments, state.resharded, kv


@pytest.mark.parametrize("save_tp, load_tp, family", [(2, 4, "llama"), (4, 2, "llama"),
                                                      (2, 4, "qwen2"), (4, 2, "qwen2")])
def test_kv_heads_reshard_between_split_and_replicated(tmp_path, save_tp, load_tp, family):
    """Qwen2's k / v biases move with their weights: split rows at tp 2, whole at tp 4."""
    path = run_local(_save, save_tp, str(tmp_path / "ckpt"), save_tp, family)[0]
    ref = build_stage(config(False, family), Mesh(Layout()), seed=7)
    assert ("layers.0.attn.k.bias" in dict(ref.named_parameters())) == (family == "qwen2")
    for weights, moments, resharded, kv_dims in run_local(_load, load_tp, path, load_tp, family):
        assert resharded and kv_dims == {0 if load_tp == 2 else None}
        for name, p in ref.named_parameters():
            full = unpad(p.detach(), p.tp_dim, p.full_shape)
            assert torch.equal(weights[name], full), name
            for k in KEYS:
                assert torch.equal(moments[name][k], moment(name, k, p.full_shape)), (name, k)


def test_checkpoint_from_before_a_config_field_existed_still_loads(tmp_path):
    """A manifest without a field added later (attention_bias, mlp_bias) compares with the
    field's default; a real difference is still refused."""
    import json

    from megapar.checkpoint.format import MANIFEST, CheckpointError
    from megapar.checkpoint.manifest import DIGEST
    from megapar.checkpoint.publish import resolve_checkpoint

    path = resolve_checkpoint(_save(str(tmp_path / "ckpt"), 1))
    (path / DIGEST).unlink()  # an old checkpoint (and this edited manifest) has no digest
    manifest = json.loads((path / MANIFEST).read_text())
    for key in ("attention_bias", "mlp_bias"):
        del manifest["model"][key]
    (path / MANIFEST).write_text(json.dumps(manifest))
    weights, _, _, _ = _load(str(path), 1)
    assert torch.equal(weights["layers.0.attn.q.weight"],
                       build_stage(config(False), Mesh(Layout()), seed=7)
                       .layers["0"].attn.q.weight.detach())
    manifest["model"]["rope_theta"] = 500000.0
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="rope_theta=500000.0 \\(checkpoint\\)"):
        _load(str(path), 1)
