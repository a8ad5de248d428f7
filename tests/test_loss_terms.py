"""--label-smoothing and --z-loss against plain torch, in one process and across layouts.

Reference: the one-process model's logits (the padded vocabulary cut off), torch's
F.cross_entropy(..., label_smoothing=LS, ignore_index=-100) per micro-batch plus a hand-written
z-loss (Z x the mean over the labelled tokens of logsumexp(logits)^2), backpropagated together;
torch's AdamW and clip_grad_norm_. Every run must give the same cross-entropy, z-loss term,
gradient norms, first-step gradients and final weights (fp32, 1e-5 relative): one process
(torch's own cross-entropy path, and the fused chunked head whose gradients are made in the
forward), tp 2 (vocab-parallel, its second rank's slice ending in padding columns), pp 2, tp 2 x
dp 2, tp 2 x cp 2 with sequence parallelism, through both the fused head and the whole logits;
and under --loss-mean token at cp 2 x dp 2 against the same sums over the global batch's
labelled tokens.
"""

import pytest
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


def reference(kind: str, token: bool = False) -> dict:
    """`token`: --loss-mean token's loss, each micro-batch's sums over the global batch's
    labelled tokens."""
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
        share = (batch["labels"] != -100).sum().item() if token else len(micro)
        for mb in micro:
            logits = model(None, {"input_ids": mb["input_ids"]})[..., :VOCAB].reshape(-1, VOCAB)
            labels = mb["labels"].reshape(-1)
            how = "sum" if token else "mean"
            ce = F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=LS,
                                 reduction=how)
            lse2 = torch.logsumexp(logits, dim=-1)[labels != -100].square()
            z = Z * (lse2.sum() if token else lse2.mean())
            ((ce + z) / share).backward()
            total += ce.item() / share
            z_total += z.item() / share
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
           chunk: int | None = None, loss_mean: str = "microbatch") -> dict:
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
                     Precision("fp32", mesh.device), MAX_NORM, grad_sync, loss_mean)
    grads = record_first_grads(optimizer, model, mesh)
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i)
               for i, b in enumerate(batches())]
    weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group)
               for n, p in model.named_parameters()}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return {"layout": (tp, pp, dp, cp, sp, kind, chunk, loss_mean), "results": results,
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
        (2, 1, 1, 2, True, "gpt2"),  # cp 2 x tp 2 with sequence parallelism
        (1, 1, 2, 2, False, "gpt2", None, "token")]  # --loss-mean token, cp 2 x dp 2


def test_label_smoothing_and_z_loss_match_torch():
    refs = {kind: reference(kind) for kind in ("gpt2", "llama")}
    refs["token"] = reference("gpt2", token=True)
    assert abs(refs["token"]["losses"][-1] - refs["gpt2"]["losses"][-1]) > 1e-4  # another mean
    assert refs["gpt2"]["losses"][-1] < refs["gpt2"]["losses"][0]
    assert all(z > 0 for z in refs["gpt2"]["z"])
    for chunk in (0, None):  # one process: torch's own cross-entropy, the fused head
        check(refs["gpt2"], [_train(1, 1, 1, chunk=chunk)])
    outs = run_local(_worker, 4, RUNS)
    for i, run in enumerate(RUNS):
        check(refs[run[7] if len(run) > 7 else run[5]], [o[i] for o in outs])


HOOK_VOCAB, HOOK_SEQ, HOOK_G, HOOK_STEPS = 96, 8, 8, 3


def _weighted_mean(per_token: torch.Tensor, batch: dict) -> torch.Tensor:
    """A loss hook: the labelled tokens' losses weighted by the batch's own "weights"."""
    w = batch["weights"] * (batch["labels"] != -100)
    return (per_token * w).sum() / w.sum().clamp(min=1e-6)


def _hook_batches() -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(HOOK_STEPS):
        x = torch.randint(0, HOOK_VOCAB, (HOOK_G, HOOK_SEQ), generator=gen)
        labels = (x * 3 + 1) % HOOK_VOCAB
        labels[:, 0] = -100
        weights = torch.rand(HOOK_G, HOOK_SEQ, generator=gen)
        out.append({"input_ids": x, "labels": labels, "weights": weights})
    return out


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    return GPT2LMHeadModel(GPT2Config(vocab_size=HOOK_VOCAB, n_positions=16, n_embd=32,
                                      n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))


def _hooked_engine() -> tuple[list[float], float]:
    import megapar

    engine = megapar.prepare(_hf_gpt2(), tp=2, pp=2, micro_batch_size=2, optimizer="sgd", lr=0.5, label_smoothing=LS,
                             loss_fn=_weighted_mean)
    losses = [engine.train_step(b) for b in _hook_batches()]
    return losses, engine.eval_step(_hook_batches()[0])


def _hooked_reference() -> tuple[list[float], float]:
    """transformers' GPT-2, torch's SGD (momentum 0.9), the hook on torch's per-token cross-entropy of each
    micro-batch of 2, averaged; then the hook on the plain cross-entropy (evaluation)."""
    model = _hf_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # megapar's sgd

    def loss_of(mb: dict, smoothing: float) -> torch.Tensor:
        logits = model(mb["input_ids"]).logits
        per_token = F.cross_entropy(logits.reshape(-1, HOOK_VOCAB), mb["labels"].reshape(-1),
                                    reduction="none", label_smoothing=smoothing)
        return _weighted_mean(per_token.view(mb["labels"].shape), mb)

    def micro(batch: dict) -> list[dict]:
        return [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, HOOK_G, 2)]

    losses = []
    for batch in _hook_batches():
        opt.zero_grad()
        loss = sum(loss_of(mb, LS) for mb in micro(batch)) / (HOOK_G // 2)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        evaluated = sum(loss_of(mb, 0.0) for mb in micro(_hook_batches()[0])) / (HOOK_G // 2)
    return losses, evaluated.item()


def test_loss_fn_hook_matches_torch_at_tp2_pp2():
    """prepare(loss_fn=) at tp 2 x pp 2 with label smoothing: the hook's weighted mean of the
    per-token losses, weights carried in the batch, trains as torch does with the same hook
    (SGD: each step's loss follows the gradients before it); eval_step hooks the plain
    cross-entropy. A combination it cannot serve is refused in one line."""
    import megapar

    theirs, ref_eval = _hooked_reference()  # first: the forked ranks find transformers loaded
    ours, evaluated = run_local(lambda: _hooked_engine(), 4)[0]
    assert theirs[-1] < theirs[0]
    for s, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(torch.tensor(a), torch.tensor(b), what=f"hooked loss at step {s}")
    assert_close(torch.tensor(evaluated), torch.tensor(ref_eval), what="hooked eval loss")
    try:
        megapar.prepare("gpt2-tiny", loss_fn=_weighted_mean, z_loss=1e-4)
    except ValueError as exc:
        refused = str(exc)
    assert refused == ("megapar.prepare: loss_fn cannot be combined with z_loss=0.0001: its "
                       "gradient rides on the per-token losses loss_fn may reweigh; drop one "
                       "of them")


def test_a_loss_fn_of_another_signature_is_refused_in_prepare():
    """A hook that cannot take (per_token, batch) is one line from prepare, not a failure on
    the last pipeline stage in the first micro-batch."""
    import megapar

    with pytest.raises(TypeError, match=r"^megapar.prepare: loss_fn must take two arguments "
                       r"\(per_token, batch\), but <lambda>\(t\) does not$"):
        megapar.prepare("gpt2-tiny", loss_fn=lambda t: t.mean())


def test_a_resume_takes_the_loss_terms_unless_given():
    """A checkpoint's train_config records both; `--load` alone trains on with them (named in
    the note), given values win, as for --loss-mean."""
    from megapar.training.config import TrainConfig, parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    saved = TrainConfig(label_smoothing=0.1, z_loss=1e-4).to_dict()
    manifest = {"meta": {"train_config": {k: saved[k] for k in ("label_smoothing", "z_loss",
                                                                 "tokenizer")}}}
    cfg = parse_args(["--load", "ck"])
    note = settings_from_checkpoint(cfg, manifest)
    assert (cfg.label_smoothing, cfg.z_loss) == (0.1, 1e-4)
    assert note == ["from the checkpoint (not given): --label-smoothing 0.1, --z-loss 0.0001"]
    cfg = parse_args(["--load", "ck", "--label-smoothing", "0", "--z-loss", "1e-3"])
    settings_from_checkpoint(cfg, manifest)
    assert (cfg.label_smoothing, cfg.z_loss) == (0.0, 1e-3)


def _vector_loss():
    import megapar

    engine = megapar.prepare("gpt2-tiny", micro_batch_size=2,
                             loss_fn=lambda per_token, batch: per_token.sum(-1))
    ids = torch.randint(0, 100, (4, 8))
    try:
        engine.train_step({"input_ids": ids, "labels": ids})
    except TypeError as exc:
        return str(exc)
    return None


def test_a_loss_fn_returning_a_vector_names_its_shape():
    """A hook returning a vector said "loss_fn returned (2,)", which reads as a tuple (a Python
    API tryout): the tensor is named with its dtype and shape."""
    from megapar.launcher import run_local

    said = run_local(_vector_loss, 1)[0]
    assert said == ("megapar.prepare's loss_fn returned a float32 tensor of shape (2,), not a "
                    "0-dim floating tensor: return the micro-batch's loss, e.g. (per_token * "
                    "w).sum() / w.sum()"), said
