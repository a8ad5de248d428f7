"""Sequence parallelism gives tensor parallelism's numbers: losses and every gradient.

tp=2 x pp=2 (1F1B, 3 micro-batches, the pipeline exchanging sequence slices), GPT-2 and BERT
(with a padding mask): the run without sequence parallelism against runs with it under no,
selective and full recomputation, and with --sp-regather under selective recomputation, two
optimizer steps each (clipping on). Every parameter's
first-step gradient (gathered over tp; the LayerNorms' and biases' partial gradients summed by
the step) and both losses agree to 1e-5 relative. The primitives are checked against plain
tensor ops on their own.
"""

import pytest
import torch
from test_comm_counts import H, MBS, SEQ, make_step, micro_batches
from tp_utils import assert_close

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.tensor_parallel.partition import gather_full

RUNS = [(False, "none"), (True, "none"), (True, "selective"), (True, "full"),
        (True, "selective", True)]
"""(SP, recompute[, --sp-regather])"""


def _batches(kind):
    out = micro_batches(kind) + micro_batches(kind)[:1]
    if kind == "bert":
        out[1]["attention_mask"][1, -3:] = 0
    return out


DROPOUT = {"gpt2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.2),
           "bert": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2)}


def _train(kind, sequence_parallel, recompute, regather=False, dropout=False):
    import torch.distributed as dist

    from megapar.models import set_sp_regather

    mesh = Mesh(Layout(2, 2, 1), dist.get_rank(), sequence_parallel=sequence_parallel)
    step = make_step(kind, mesh, recompute, DROPOUT[kind] if dropout else None)
    set_sp_regather(step.model, regather)
    grads, optimizer_step = {}, step.optimizer.step

    def record_then_step():
        for name, p in step.model.named_parameters():
            grads[name] = gather_full(p.grad, p.tp_dim, p.full_shape, mesh.tp_group).clone()
        optimizer_step()

    step.optimizer.step = record_then_step
    results = [step.step(_batches(kind), i) for i in range(2)]
    return [r.loss for r in results], [r.grad_norm for r in results], grads


def _worker(kind):
    return [_train(kind, *run) for run in RUNS]


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_sequence_parallel_matches_tp_with_pipeline_and_recompute(kind):
    """Llama as configured in test_comm_counts: untied head, 2 kv heads split over tp 2."""
    for rank, runs in enumerate(run_local(_worker, 4, kind)):
        (ref_losses, ref_norms, ref_grads), others = runs[0], runs[1:]
        for run, (losses, norms, grads) in zip(RUNS[1:], others):
            what = f"rank {rank} SP recompute={run[1]} regather={run[2:]}"
            for s in range(2):
                assert_close(torch.tensor(losses[s]), torch.tensor(ref_losses[s]),
                             what=f"{what} loss {s}")
                assert_close(torch.tensor(norms[s]), torch.tensor(ref_norms[s]),
                             what=f"{what} grad norm {s}")
            assert grads.keys() == ref_grads.keys() and grads
            for name in grads:
                assert_close(grads[name], ref_grads[name], what=f"{what} grad of {name}")


def _dropout_worker(kind):
    return [_train(kind, True, mode, dropout=True) for mode in ("none", "selective", "full")]


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_sequence_parallel_dropout_replays_under_recompute(kind):
    """With dropout everywhere (residual masks from the per-tp-rank stream under SP),
    recomputation gives exactly the run without it."""
    for rank, ((ref_losses, _, ref_grads), *others) in enumerate(run_local(_dropout_worker, 4,
                                                                           kind)):
        for losses, _, grads in others:
            assert losses == ref_losses, f"rank {rank}: {losses} != {ref_losses}"
            for name in grads:
                assert_close(grads[name], ref_grads[name], what=f"rank {rank} grad of {name}")


def _primitives_worker():
    import torch.distributed as dist

    from megapar.tensor_parallel.sequence_parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    rank, group = dist.get_rank(), dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(3, 8, 5, generator=gen) for _ in range(2)]   # one per rank
    mine = full[rank].chunk(2, dim=1)[rank].requires_grad_()
    gathered = gather_from_sequence_parallel_region(mine, group)
    parts = [full[r].chunk(2, dim=1)[r] for r in range(2)]
    assert torch.equal(gathered, torch.cat(parts, dim=1))
    (gathered * full[rank]).sum().backward()       # d/d(mine) = sum over ranks of my slice
    assert torch.allclose(mine.grad, (full[0] + full[1]).chunk(2, dim=1)[rank])
    x = full[rank].clone().requires_grad_()
    reduced = reduce_scatter_to_sequence_parallel_region(x, group)
    assert torch.allclose(reduced, (full[0] + full[1]).chunk(2, dim=1)[rank])
    upstream = torch.full_like(reduced, float(rank + 1))
    reduced.backward(upstream)
    assert torch.equal(x.grad, torch.cat([torch.full_like(reduced, 1.0),
                                          torch.full_like(reduced, 2.0)], dim=1))
    y = full[0].clone().requires_grad_()
    kept = scatter_to_sequence_parallel_region(y, group)
    assert torch.equal(kept, full[0].chunk(2, dim=1)[rank])
    kept.backward(torch.ones_like(kept))
    assert torch.equal(y.grad, torch.ones_like(y))
    return True


def test_sequence_parallel_primitives():
    assert all(run_local(_primitives_worker, 2))


def _no_copy_worker():
    import torch.distributed as dist

    from megapar.tensor_parallel import sequence_parallel as sp

    group, rank = dist.group.WORLD, dist.get_rank()
    seen, gather, scatter = [], sp.all_gather_flat, sp.reduce_scatter_flat
    sp.all_gather_flat = lambda out, x, g: (seen.append((out, x)), gather(out, x, g))[1]
    sp.reduce_scatter_flat = lambda out, x, g: (seen.append((out, x)), scatter(out, x, g))[1]
    try:
        copies = []
        for b in (1, 3):
            full = torch.arange(2 * b * 4 * 3, dtype=torch.float32).view(2, b, 4, 3)
            mine = full[rank].chunk(2, dim=1)[rank].contiguous()
            seen.clear()
            gathered = sp.gather_sequence(mine, group)
            assert torch.equal(gathered, torch.cat([full[r].chunk(2, dim=1)[r] for r in range(2)],
                                                   dim=1))
            (out, x), = seen
            in_place = [x.data_ptr() == mine.data_ptr(), gathered.data_ptr() == out.data_ptr()]
            seen.clear()
            whole = full[rank].clone()
            reduced = sp.reduce_scatter_sequence(whole, group)
            assert torch.equal(reduced, (full[0] + full[1]).chunk(2, dim=1)[rank])
            (out, x), = seen
            in_place += [x.data_ptr() == whole.data_ptr(), reduced.data_ptr() == out.data_ptr()]
            copies.append(in_place)
        return copies
    finally:
        sp.all_gather_flat, sp.reduce_scatter_flat = gather, scatter


def test_sequence_parallel_collectives_copy_nothing_at_one_sequence_per_micro_batch():
    """[1, s/tp, h] slices go to the all-gather as they are and come back as the [1, s, h]
    result; the reduce-scatter likewise. With b > 1 one copy regroups the sequences."""
    for copies in run_local(_no_copy_worker, 2):
        assert copies[0] == [True, True, True, True]  # b = 1
        assert copies[1] == [True, False, False, True]  # b = 3: the output, the input regrouped


LLAMA_RUNS = [(False, "none", False), (True, "none", False), (True, "full", False),
              (True, "none", True), (True, "full", True)]
"""(SP, recompute, --sp-regather): tp alone, SP, SP under full recompute, and both with
--sp-regather (under full recompute it keeps the gathered input: the fallback)."""


def _saved_by_block(block, x):
    """The distinct storages one block's forward saves for its backward: [(shape, bytes)]."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage()._cdata] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    params = {p.untyped_storage()._cdata for p in block.parameters()}
    return [v for k, v in seen.items() if k not in params]


def _llama_worker(tied: bool, kv_heads: int):
    import torch.distributed as dist

    from megapar.models import set_sp_regather

    overrides = {"tie_word_embeddings": tied, "num_key_value_heads": kv_heads}
    out, saved = [], {}
    for sp, mode, regather in LLAMA_RUNS:
        mesh = Mesh(Layout(2, 2, 1), dist.get_rank(), sequence_parallel=sp)
        step = make_step("llama", mesh, mode, overrides)
        set_sp_regather(step.model, regather)
        grads, optimizer_step = {}, step.optimizer.step

        def record_then_step(step=step, grads=grads, optimizer_step=optimizer_step, mesh=mesh):
            for name, p in step.model.named_parameters():
                grads[name] = gather_full(p.grad, p.tp_dim, p.full_shape, mesh.tp_group).clone()
            optimizer_step()

        step.optimizer.step = record_then_step
        results = [step.step(_batches("llama"), i) for i in range(2)]
        out.append(([r.loss for r in results], grads))
        if sp and mode == "none":  # what one block keeps for its backward
            block = next(iter(step.model.layers.values()))
            x = torch.randn(MBS, SEQ // 2, H, requires_grad=True)
            saved[regather] = _saved_by_block(block, x)
            if regather:  # deferred weight gradients (zero-bubble W) keep the gathered X
                from megapar.tensor_parallel.weight_grad import WeightGradStore, attach

                store = WeightGradStore()
                store.enabled = True
                attach(block, store)
                saved["deferred"] = _saved_by_block(block, x)
                attach(block, None)
    return out, saved


@pytest.mark.parametrize("tied,kv_heads", [(True, 2), (False, 1)])
def test_llama_sequence_parallel_tied_and_replicated_kv_heads(tied, kv_heads):
    """Tied head; one kv head replicated over tp 2 (each rank its rows, summed once a step);
    with --sp-regather too (`LLAMA_RUNS`). And what one block saves for its backward under SP:
    the gathered [b, s, h] inputs of q / k / v and of gate / up, two whole-sequence tensors,
    which --sp-regather keeps as this rank's [b, s / 2, h] slices; with the weight gradients
    deferred (zero-bubble) the flag keeps what SP keeps without it."""
    for rank, (runs, saved) in enumerate(run_local(_llama_worker, 4, tied, kv_heads)):
        (ref_losses, ref_grads), others = runs[0], runs[1:]
        for i, (losses, grads) in enumerate(others):
            what = f"rank {rank} tied={tied} kv={kv_heads} run {LLAMA_RUNS[i + 1]}"
            for s in range(2):
                assert_close(torch.tensor(losses[s]), torch.tensor(ref_losses[s]),
                             what=f"{what} loss {s}")
            assert grads.keys() == ref_grads.keys() and grads
            for name in grads:
                assert_close(grads[name], ref_grads[name], what=f"{what} grad of {name}")
        # whole-sequence [b, s, h] storages: X of q/k/v, of gate/up (saved as [b s, h] views)
        # and the SwiGLU's gate, act(gate), up and product ([b, s, f / t], f / t = h here)
        whole = {k: [v for v in kept if v[1] == MBS * SEQ * H * 4] for k, kept in saved.items()}
        assert len(whole[False]) == len(whole[True]) + 2, (rank, saved[False], saved[True])
        freed = sum(n for _, n in saved[False]) - sum(n for _, n in saved[True])
        assert freed == 2 * MBS * SEQ * H * 4 // 2, (saved[False], saved[True])  # 2 x (1 - 1/t)
        assert sorted(n for _, n in saved["deferred"]) == sorted(n for _, n in saved[False]), \
            (saved["deferred"], saved[False])  # the same storages (some saved in other shapes)


def test_sp_regather_where_the_blocks_keep_the_gathered_input_anyway_is_a_note():
    """--sp-regather under --recompute full, --compile or a zero-bubble schedule (deferred W,
    at pp 1 too) re-gathers nothing (the blocks keep the gathered input, as its help says); megapar-train
    accepted it without a word, where megapar-plan refuses the same. A start-up note says so,
    and with --fp8 that the float8 linears keep theirs; none where it applies."""
    from megapar.mesh import Layout
    from megapar.training.config import TrainConfig
    from megapar.training.run_plan import regather_notes

    def notes(layout=Layout(2), **kw):
        return regather_notes(TrainConfig(sequence_parallel=True, sp_regather=True, **kw), layout)

    assert notes() == [] and notes(schedule="zb-h1")[0].startswith(
        "--sp-regather with --schedule zb-h1: the blocks keep")  # W deferred at pp 1 too
    assert notes(recompute="selective") == [] and notes(Layout(2, 2), schedule="1f1b") == []
    assert notes(recompute="full") == [
        "--sp-regather with --recompute full: the blocks keep the gathered input for the "
        "backward anyway, so nothing is re-gathered (drop --sp-regather)"]
    assert notes(Layout(2, 2), schedule="dualpipev", compile=True)[0].startswith(
        "--sp-regather with --compile and --schedule dualpipev: the blocks keep")
    assert notes(fp8="rowwise") == [
        "--sp-regather with --fp8 rowwise: the float8 linears keep the gathered input for the "
        "backward anyway; only the linears left in fp32 re-gather theirs"]
    assert regather_notes(TrainConfig(sp_regather=True, recompute="full"), Layout(2)) == []
