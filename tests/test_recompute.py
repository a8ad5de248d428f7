"""Activation recomputation changes memory, never results.

With dropout > 0 everywhere (embedding, attention probabilities, residual branches) and tp=2, so
both RNG streams are used (the default one and the tracker's per-tp-rank stream for attention
dropout), "selective" and "full" recompute give the same losses and gradients as "none": the
recomputed forward must replay exactly the dropout masks of the original one. Checked on a whole
model (pp=1) and through the pipeline executor at pp=2 with 1F1B, where other micro-batches'
forwards run between a micro-batch's forward and its recomputation. Two steps each, so the RNG
state left behind by a step is checked too.
"""

import pytest
import torch
from test_pipeline_parity import CONFIGS, HIDDEN, MB, SEED, SEQ, micro_batches
from tp_utils import assert_close, make_mesh, rel_err

from megapar.launcher import run_local
from megapar.models import BertConfig, GPT2Config
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.partition import build_stage

MODES = ("none", "selective", "full")
STEPS, M = 2, 3
DROPOUT = {"gpt2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.2),
           "bert": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2)}


def dropout_config(kind):
    args = {**CONFIGS[kind], **DROPOUT[kind]}
    return GPT2Config(**args) if kind == "gpt2" else BertConfig(**args)


def train_steps(kind, mesh, mode, schedule, dropout=True):
    """Per-step losses and this rank's final gradients (local shards) of STEPS steps."""
    model = build_stage(dropout_config(kind), mesh, SEED, recompute=mode)  # reseeds the RNGs
    model.train(dropout)
    tp_state = model.tracker.tp_state.clone()
    executor = PipelineExecutor(model, mesh, schedule, (MB, SEQ, HIDDEN))
    losses = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        losses.append(executor.run(micro_batches(kind, M, seed=step)))
    if dropout:
        assert not torch.equal(tp_state, model.tracker.tp_state), "tp dropout stream not used"
    return losses, {name: p.grad.clone() for name, p in model.named_parameters()}


def recompute_worker(tp, pp, schedule):
    mesh = make_mesh(tp, pp)
    compared = 0
    for kind in CONFIGS:
        ref_losses, ref_grads = train_steps(kind, mesh, "none", schedule)
        # Without dropout the gradients are clearly different, so the comparisons below see
        # whether the recomputed forward replayed the masks.
        _, plain = train_steps(kind, mesh, "none", schedule, dropout=False)
        assert max(rel_err(plain[n], g) for n, g in ref_grads.items()) > 1e-2, \
            f"{kind}: dropout had no effect on the gradients"
        for mode in MODES[1:]:
            what = f"{kind} tp={tp} pp={pp} recompute={mode} stage {mesh.pp_rank}"
            losses, grads = train_steps(kind, mesh, mode, schedule)
            for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
                assert_close(loss, ref, what=f"{what}: loss of step {step}")
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                assert_close(grad, ref_grads[name], what=f"{what}: grad of {name}")
                compared += 1
    return compared


@pytest.mark.parametrize("tp,pp,schedule", [(2, 1, "1f1b"), (2, 2, "1f1b"), (1, 2, "gpipe")])
def test_recompute_gives_same_loss_and_gradients_as_none(tp, pp, schedule):
    results = run_local(recompute_worker, tp * pp, tp, pp, schedule)
    assert all(n > 0 for n in results)
