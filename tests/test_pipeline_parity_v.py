"""ZB-V and DualPipeV (two chunks per rank in a V) compute exactly what one process computes.

GPT-2, BERT and grouped-query Llama (2 pp tiny blocks, so each of the 2 pp virtual stages has
one block: 8 at pp 4, 4 at pp 2) at (tp, pp) in (1, 2), (1, 4), (2, 2): the loss and every parameter's gradient (the tied embedding's after
`sync_tied_embeddings`, which in the V sums both copies on rank 0) equal the single-process
model's (fp32, relative error < 1e-5). ZB-V at m in {1, 3, 4, 8} (fewer micro-batches than
stages, not a multiple of pp, ...), DualPipeV at every m >= 2 pp of those; at tp 2 (which
changes what each stage computes, not the order) ZB-V at m 3 and DualPipeV at m 4 only
(tests/test_parity_3d.py runs the V at tp 2 with dp, cp and ZeRO-1 too). The V's turn (virtual
stage pp - 1 to pp on rank pp - 1) is handed over in memory: no message for it is issued.
Each reference is computed once, before the ranks are forked (`reference_of`).
"""


import pytest
import torch
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
from test_pipeline_parity_chunks import LAYERS, blocks, reference_of
from test_pipeline_parity_chunks import make_config as make_gpt2_or_bert
from tp_utils import make_mesh, rel_err, to_device

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import LlamaConfig
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.partition import build_stage
from megapar.pipeline.tied import sync_tied_embeddings
from megapar.tensor_parallel.partition import shared_embedding_params

MS = (1, 3, 4, 8)
RUNS = ("zb-v", "dualpipev")
KINDS = (*CONFIGS, "llama")


def make_config(kind, layers=LAYERS):
    if kind != "llama":
        return make_gpt2_or_bert(kind, layers)
    return LlamaConfig(vocab_size=101, hidden_size=HIDDEN, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=16, tie_word_embeddings=False)


def runs(tp, pp):
    if tp > 1:
        return [("zb-v", 3), ("dualpipev", 2 * pp)]
    return [(s, m) for s in RUNS for m in MS if s == "zb-v" or m >= 2 * pp]


def parity_worker(tp, pp):
    mesh = make_mesh(tp, pp)
    checked, steps = set(), 0
    for kind in KINDS:
        model = build_stage(make_config(kind, blocks(pp)), mesh, SEED, virtual_stages=2,
                            placement="v")
        for schedule, m in runs(tp, pp):
            batches = to_device(micro_batches(kind, m, seed=m), mesh.device)
            ref_loss, ref_grads = reference_of(kind, m, blocks(pp), mesh.device, make_config)
            what = f"{kind} tp={tp} pp={pp} {schedule} m={m} stage {mesh.pp_rank}"
            model.zero_grad(set_to_none=True)
            executor = PipelineExecutor(model, mesh, schedule, (MB, SEQ, HIDDEN))
            executor.p2p.issued = []  # record the groups issued
            assert executor.virtual_stages == 2, what
            loss = executor.run(batches)
            assert loss.dtype == torch.float32 and loss.dim() == 0, what
            tied = shared_embedding_params(model)
            # the embedding and its tied copy both live on rank 0 (chunks 0 and 1), none
            # elsewhere; before the sync each holds only its half
            assert len(tied) == (2 if mesh.pp_rank == 0 and kind != "llama" else 0), what
            for p in tied:
                assert rel_err(full_grad(p, mesh), ref_grads["embed.word.weight"]) > 1e-3, \
                    f"{what}: tied gradient complete before sync_tied_embeddings"
            assert sync_tied_embeddings(model, mesh) == len(tied), what
            checked |= {f"{kind}:{n}" for n in
                        check_against(model, mesh, loss, ref_loss, ref_grads, what)}
            # the turn is local: rank pp-1 exchanges messages with rank pp-2 only
            peers = {op.peer for group in executor.p2p.issued for op in group}
            assert mesh.rank not in peers and peers, what
            assert executor.p2p.pending_sends == 0, what
            steps += 1
    return {"checked": checked, "steps": steps}


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 4), (2, 2)])
def test_v_schedules_match_single_process(tp, pp):
    for kind in KINDS:  # before the fork: the ranks inherit them
        for _, m in runs(tp, pp):
            reference_of(kind, m, blocks(pp), Mesh(Layout()).device, make_config)
    results = run_local(parity_worker, tp * pp, tp, pp)
    assert all(r["steps"] == len(KINDS) * len(runs(tp, pp)) for r in results)
    names = set()
    for kind in KINDS:
        model = build_stage(make_config(kind, blocks(pp)), Mesh(Layout()), SEED)
        names |= {f"{kind}:{n}" for n, _ in model.named_parameters()}
    assert set().union(*(r["checked"] for r in results)) == names
