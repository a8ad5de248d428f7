"""The pipeline executor computes exactly what one process computes.

For tiny GPT-2 and BERT models, at pp in {2, 4} (and tp=2 x pp=2), with GPipe and 1F1B and
m in {1, 3, 8} micro-batches: the step's loss and every parameter's gradient (gathered over tp,
the tied embedding's after `sync_tied_embeddings`) equal a single-process model that runs the
same micro-batches one after another with loss/m backward. fp32, relative error < 1e-5.

One `run_local` per (tp, pp) layout; the workers loop over models, schedules and m.
"""

import pytest
import torch
from tp_utils import assert_close, make_mesh, rel_err, to_device

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import BertConfig, GPT2Config
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.partition import build_stage
from megapar.pipeline.tied import sync_tied_embeddings
from megapar.tensor_parallel.partition import shared_embedding_params
from megapar.tensor_parallel.partition import gather_full

SEED, MB, SEQ, HIDDEN = 1234, 2, 8, 32
SCHEDULES, MS = ("gpipe", "1f1b"), (1, 3, 8)
CONFIGS = {
    "gpt2": dict(vocab_size=101, n_positions=16, n_embd=HIDDEN, n_layer=4, n_head=4,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(vocab_size=101, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
}


def make_config(kind):
    return GPT2Config(**CONFIGS[kind]) if kind == "gpt2" else BertConfig(**CONFIGS[kind])


def gpt2_batch(gen):
    ids = torch.randint(0, 101, (MB, SEQ + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :3] = -100  # some ignored positions
    return {"input_ids": ids[:, :-1], "labels": labels}


def bert_batch(gen):
    ids = torch.randint(5, 101, (MB, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 3:] = 0  # padding
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[:, SEQ // 2:] = 1
    types[mask == 0] = 0
    labels = torch.full_like(ids, -100)
    pick = torch.rand(ids.shape, generator=gen) < 0.3
    pick[:, 1] = True  # at least one labelled token per sequence
    pick &= mask == 1
    labels[pick] = ids[pick]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}


def micro_batches(kind, m, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = gpt2_batch if kind == "gpt2" else bert_batch
    return [make(gen) for _ in range(m)]


def reference(kind, batches, recompute="none"):
    """Loss and full gradients of the whole model, micro-batches one after another."""
    model = build_stage(make_config(kind), Mesh(Layout()), SEED, recompute)
    losses = []
    for batch in batches:
        loss = model(None, batch)
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return sum(losses) / len(batches), {n: full_grad(p) for n, p in model.named_parameters()}


def full_grad(param, mesh=None):
    """The full gradient (vocab padding dropped), gathered over tp when `mesh` has a tp group."""
    group = None if mesh is None else mesh.tp_group
    return gather_full(param.grad, getattr(param, "tp_dim", None), param.full_shape, group)


def check_against(model, mesh, loss, ref_loss, ref_grads, what):
    """Compare loss and every gradient of this stage with the reference; the names checked."""
    assert_close(loss, ref_loss, what=f"{what}: loss")
    checked = set()
    for name, p in model.named_parameters():
        source = getattr(p, "tied_to", name)
        assert p.grad is not None, f"{what}: {name} got no gradient"
        assert_close(full_grad(p, mesh), ref_grads[source], what=f"{what}: grad of {name}")
        checked.add(source)
    return checked


def parity_worker(tp, pp):
    mesh = make_mesh(tp, pp)
    checked, steps = set(), 0
    for kind in CONFIGS:
        config = make_config(kind)
        model = build_stage(config, mesh, SEED)
        for m in MS:
            batches = to_device(micro_batches(kind, m, seed=m), mesh.device)
            ref_loss, ref_grads = reference(kind, batches)
            for schedule in SCHEDULES:
                what = f"{kind} tp={tp} pp={pp} {schedule} m={m} stage {mesh.pp_rank}"
                model.zero_grad(set_to_none=True)
                executor = PipelineExecutor(model, mesh, schedule, (MB, SEQ, HIDDEN))
                loss = executor.run(batches)
                assert loss.dtype == torch.float32 and loss.dim() == 0, what
                # Before the sync each tied copy holds only its half: the test must see that.
                for p in shared_embedding_params(model):
                    source = getattr(p, "tied_to", "embed.word.weight")
                    assert rel_err(full_grad(p, mesh), ref_grads[source]) > 1e-3, \
                        f"{what}: tied gradient already complete before sync_tied_embeddings"
                synced = sync_tied_embeddings(model, mesh)
                assert synced == (1 if mesh.is_first_stage or mesh.is_last_stage else 0), what
                checked |= {f"{kind}:{n}" for n in
                            check_against(model, mesh, loss, ref_loss, ref_grads, what)}
                steps += 1
    return {"checked": checked, "steps": steps}


def all_reference_names():
    names = set()
    for kind in CONFIGS:
        model = build_stage(make_config(kind), Mesh(Layout()), SEED)
        names |= {f"{kind}:{n}" for n, _ in model.named_parameters()}
    return names


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 4), (2, 2)])
def test_pipeline_matches_single_process(tp, pp):
    results = run_local(parity_worker, tp * pp, tp, pp)
    assert all(r["steps"] == len(CONFIGS) * len(SCHEDULES) * len(MS) for r in results)
    # Every parameter of both models was compared on some stage.
    assert set().union(*(r["checked"] for r in results)) == all_reference_names()
