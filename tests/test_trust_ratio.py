"""LAMB and LARS under tp x dp with ZeRO-1 (and tp x pp) against a single-process reference.

The reference is written here from the papers' formulas on the serial model's full tensors
(LAMB: You et al. 2019, Algorithm 2 with bias correction; LARS: You et al. 2017), with torch's
clip_grad_norm_ and gradient accumulation over micro-batches; it shares no code with
megapar/optim/trust_ratio.py. The parallel runs go through megapar.prepare / train_step, so
the per-layer norms must be reduced over the tp shards (and the vocab padding must not count)
for the runs to agree.

LAMB's eps is 1e-4 for the reason test_parity_3d.py gives for Adam's: its per-element
m / sqrt(v) turns the ~1e-7-relative rounding noise of tp's reordered sums into lr-sized
updates for entries whose gradient is (nearly) zero, such as the attention key bias, whose
exact gradient is 0; with eps = 1e-4 they get updates proportional to their gradient. The
losses agree < 2e-7 with eps = 1e-8 as well.
"""

import pytest
import torch
from tp_utils import assert_close

import megapar
from megapar.mesh import Layout, Mesh
from megapar.models.config import config_from_hf
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import unpad
from megapar.training.step import BatchPlan

SEED, STEPS, G, MBS, SEQ, VOCAB = 5, 4, 8, 2, 8, 96
WD, CLIP, BETAS, EPS, MOMENTUM, ETA = 0.1, 1.0, (0.9, 0.95), 1e-4, 0.9, 1e-3
LR = {"lamb": 1e-2, "lars": 5.0}


def hf_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                      eos_token_id=None)


def batches():
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (G, SEQ), generator=gen)
        out.append({"input_ids": x, "labels": (x + 5) % VOCAB})
    return out


@torch.no_grad()
def reference_step(kind, params, state, t):
    lr = LR[kind]
    for p in params:
        wd = WD if p.dim() >= 2 else 0.0
        g, s = p.grad, state.setdefault(p, {})
        if kind == "lamb":
            s["m"] = BETAS[0] * s.get("m", torch.zeros_like(p)) + (1 - BETAS[0]) * g
            s["v"] = BETAS[1] * s.get("v", torch.zeros_like(p)) + (1 - BETAS[1]) * g * g
            u = (s["m"] / (1 - BETAS[0] ** t)) / ((s["v"] / (1 - BETAS[1] ** t)).sqrt() + EPS)
            u = u + wd * p
            w_norm, u_norm = p.norm().item(), u.norm().item()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            p -= lr * ratio * u
        else:
            w_norm, g_norm = p.norm().item(), g.norm().item()
            local = ETA * w_norm / (g_norm + wd * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
            s["buf"] = MOMENTUM * s.get("buf", torch.zeros_like(p)) + lr * local * (g + wd * p)
            p -= s["buf"]


def reference(kind):
    model = build_stage(config_from_hf(hf_config()), Mesh(Layout()), SEED)
    params, state, losses = list(model.parameters()), {}, []
    plan = BatchPlan(G, MBS, 1)
    for t, batch in enumerate(batches(), start=1):
        model.zero_grad()
        micro = plan.split(batch, 0)
        total = 0.0
        for mb in micro:
            loss = model(None, mb)
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        reference_step(kind, params, state, t)
        losses.append(total)
    weights = {n: unpad(p.detach(), p.tp_dim, p.full_shape) for n, p in model.named_parameters()}
    return losses, weights


def parallel(kind, tp, pp, zero):
    from canonical import gather_canonical

    engine = megapar.prepare(hf_config(), tp=tp, pp=pp, micro_batch_size=MBS, zero=zero,
                             optimizer=kind, lr=LR[kind], weight_decay=WD, clip_grad=CLIP,
                             seed=SEED, adam_eps=EPS)
    losses = [engine.train_step(b) for b in batches()]
    weights = gather_canonical(engine.model)
    return losses, weights, engine.mesh.tp_rank, engine.optimizer.zero


@pytest.mark.parametrize("kind,tp,pp,zero", [("lamb", 2, 1, 1), ("lars", 2, 1, 1),
                                             ("lamb", 2, 2, 0), ("lamb", 2, 1, 2),
                                             ("lars", 2, 1, 2)])
def test_trust_ratio_optimizer_equals_single_process_reference(run, kind, tp, pp, zero):
    ref_losses, ref_weights = reference(kind)
    results = run(parallel, 4, kind, tp, pp, zero)
    losses = results[0][0]
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), 1e-5, f"{kind} losses")
    assert losses[-1] < losses[0]
    weights = {}
    for _, w, _, z in results:
        assert z == zero
        weights.update(w)
    assert set(weights) == {n for n in ref_weights if n != "head.weight"}
    for name, w in weights.items():
        assert_close(w, ref_weights[name], 1e-5, f"{kind} {name}")


def test_megapar_train_lamb_with_linear_lr_scaling(tmp_path, capsys):
    """--optimizer lamb at tp 2 x dp 2 with ZeRO-1; --lr-scale-with-batch 4 at global batch 16
    multiplies the peak LR (reached after warmup) by 4, and the min LR with it."""
    import json

    from megapar.cli.train import main
    from megapar.data import asset_path

    text = tmp_path / "sample.txt"
    text.write_text(open(asset_path("shakespeare_sample.txt")).read()[:30_000])
    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                 "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                 "attn_pdrop": 0.0}))
    log = tmp_path / "log.jsonl"
    rc = main(["--tp", "2", "--dp", "2", "--zero", "1", "--optimizer", "lamb", "--model",
               str(model), "--data", str(text), "--data-cache", str(tmp_path / "cache"),
               "--seq-len", "16", "--micro-batch-size", "2", "--global-batch-size", "16",
               "--lr", "2e-3", "--min-lr", "2e-4", "--lr-scale-with-batch", "4",
               "--warmup-steps", "2", "--max-steps", "6", "--lr-decay", "linear",
               "--eval-interval", "0", "--log-interval", "1", "--no-progress",
               "--log-json", str(log)])
    assert rc == 0
    records = [json.loads(x) for x in log.read_text().splitlines()]
    lrs = [r["lr"] for r in records]
    assert lrs[:3] == pytest.approx([4e-3, 8e-3, 8e-3])  # warmup to 2e-3 x 16 / 4
    assert lrs[-1] == pytest.approx(8e-4 + (8e-3 - 8e-4) * 0.25)  # linear decay towards 8e-4
    assert records[-1]["loss"] < records[0]["loss"]
    # said at the start: the logged lr was one the user never typed (a user's tryout)
    assert ("--lr-scale-with-batch 4: the run trains at --lr 0.002 x global batch 16 / 4 = "
            "0.008 (and --min-lr 0.0002 x the same, 0.0008), which the logged lr shows") \
        in capsys.readouterr().err
