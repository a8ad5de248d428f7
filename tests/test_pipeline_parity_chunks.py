"""Interleaved 1F1B and ZB-H1 compute exactly what one process computes.

GPT-2 and BERT (pp x V tiny blocks, so every chunk has one block: 8 at pp 4, 4 at pp 2) at
(tp, pp) in
(1, 2), (1, 4), (2, 2), m in {4, 8}: interleaved 1F1B with V=2 chunks per rank and ZB-H1 (split
backward: the linear layers' weight products deferred to W, counted) give the loss and every parameter's gradient of the single-process model
(fp32, relative error < 1e-5). One `run_local` per layout; each reference computed once, before
the ranks are forked (`reference_of`).
"""

import functools

import pytest
from test_pipeline_parity import (
    CONFIGS,
    HIDDEN,
    MB,
    SEED,
    SEQ,
    check_against,
    full_grad,
    micro_batches,
)
from tp_utils import make_mesh, to_device

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import BertConfig, GPT2Config
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.partition import build_stage
from megapar.pipeline.tied import sync_tied_embeddings

LAYERS, V, MS = 8, 2, (4, 8)
RUNS = (("interleaved", V), ("zb-h1", 1))


def blocks(pp: int) -> int:
    """One block a model chunk at pp x V chunks (LAYERS at pp 4)."""
    return pp * V


def make_config(kind, layers=LAYERS):
    if kind == "gpt2":
        return GPT2Config(**{**CONFIGS[kind], "n_layer": layers})
    return BertConfig(**{**CONFIGS[kind], "num_hidden_layers": layers})


def reference(kind, batches, layers=LAYERS, make=make_config):
    """One process's loss and full gradients for `batches` of the `make(kind, layers)` model."""
    model = build_stage(make(kind, layers), Mesh(Layout()), SEED)
    losses = []
    for batch in batches:
        loss = model(None, batch)
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return sum(losses) / len(batches), {n: full_grad(p) for n, p in model.named_parameters()}


@functools.cache
def reference_of(kind, m, layers, device, make=make_config):
    """`reference` of `micro_batches(kind, m, seed=m)` on `device`, once per process (forked
    ranks inherit what their launcher computed)."""
    return reference(kind, to_device(micro_batches(kind, m, seed=m), device), layers, make)


def parity_worker(tp, pp):
    mesh = make_mesh(tp, pp)
    checked, steps = set(), 0
    for kind in CONFIGS:
        models = {v: build_stage(make_config(kind, blocks(pp)), mesh, SEED, virtual_stages=v)
                  for v in (1, V)}
        for m in MS:
            batches = to_device(micro_batches(kind, m, seed=m), mesh.device)
            ref_loss, ref_grads = reference_of(kind, m, blocks(pp), mesh.device)
            for schedule, v in RUNS:
                what = f"{kind} tp={tp} pp={pp} {schedule} V={v} m={m} stage {mesh.pp_rank}"
                model = models[v]
                model.zero_grad(set_to_none=True)
                executor = PipelineExecutor(model, mesh, schedule, (MB, SEQ, HIDDEN),
                                            virtual_stages=v)
                deferred_before = executor.weight_grads.deferred  # one store per stage
                loss = executor.run(batches)
                sync_tied_embeddings(model, mesh)
                checked |= {f"{kind}:{n}" for n in
                            check_against(model, mesh, loss, ref_loss, ref_grads, what)}
                assert executor.p2p.pending_sends == 0, what
                # ZB-H1's W is the linear layers' deferred dW products (one per linear per
                # micro-batch); the other schedules defer nothing
                linears = sum(hasattr(mod, "weight_grad_store") for mod in model.modules())
                deferred = m * linears if schedule == "zb-h1" else 0
                assert executor.weight_grads.deferred - deferred_before == deferred, what
                steps += 1
    return {"checked": checked, "steps": steps}


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 4), (2, 2)])
def test_new_schedules_match_single_process(tp, pp):
    for kind in CONFIGS:  # before the fork: the ranks inherit them
        for m in MS:
            reference_of(kind, m, blocks(pp), Mesh(Layout()).device)
    results = run_local(parity_worker, tp * pp, tp, pp)
    assert all(r["steps"] == len(CONFIGS) * len(MS) * len(RUNS) for r in results)
    names = set()
    for kind in CONFIGS:
        model = build_stage(make_config(kind, blocks(pp)), Mesh(Layout()), SEED)
        names |= {f"{kind}:{n}" for n, _ in model.named_parameters()}
    assert set().union(*(r["checked"] for r in results)) == names
