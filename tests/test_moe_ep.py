"""The Qwen3-MoE-style model of test_moe_parallel.py (a dense first layer, three MoE layers with
shared experts, the switch loss, the z-loss and the moving bias) trains with expert parallelism
as one process: dp 2 x ep 2 (ZeRO-0 and ZeRO-3), cp 2 x ep 2 (dp 1: the two cp ranks of a
sequence hold different experts and exchange their chunks' tokens), dp 4 x ep 2 (ZeRO-0, ZeRO-1
and ZeRO-3), pp 2 x dp 2 x ep 2 (full recomputation under 1F1B and ZB-H1: each recompute reuses
its forward's route), tp 2 x dp 2 x ep 2, dp 2 x cp 2 x ep 4 and dp 2 x cp 2 x ep 2 with ZeRO-1
(ep folds into dp x cp): losses, grad norms, router statistics, biases, first-step gradients
(ZeRO-0 and ZeRO-3) and final weights (the experts gathered over ep), fp32, 1e-5 relative,
and the same with each expert split over tp (`--expert-tensor-parallel-size 2`: tp 2 x dp 2 x
ep 2 with ZeRO-1 and sequence parallelism, tp 2 x pp 2 with sequence parallelism and full
recomputation, tp 2 x dp 2 with ZeRO-3, tp 2 x cp 2 x ep 2),
over three steps. And each micro-batch makes exactly one
host sync per MoE layer, at expert_parallel/dispatch.py, with or without full recomputation.
"""

import contextlib

import pytest
import torch
from sync_count import count_syncs
from test_moe_parallel import G, LR, MAX_NORM, MBS, SEED, SEQ, config, global_batches
from test_moe_parallel import biases, check_rank, scheduler, serial_reference, three_layers
from tp_utils import assert_close
from tp_utils import full_grads as gathered_grads

from megapar.comm_count import count_collectives
from megapar.expert_parallel import is_expert
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import gather_full, tp_parts
from megapar.training.step import BatchPlan

EPS, WD = 1e-4, 0.1


def _whole(t, p, mesh):
    """`t` (p's tensor, or its gradient) whole: gathered over tp, the experts over ep."""
    import torch.distributed as dist

    t = gather_full(t, p.tp_dim, p.full_shape, mesh.tp_group, tp_parts(p))
    if is_expert(p) and mesh.ep > 1:
        parts = [torch.empty_like(t) for _ in range(mesh.ep)]
        dist.all_gather(parts, t.contiguous(), group=mesh.ep_group)
        t = torch.cat(parts)
    return t.clone()


def _engine(tp, pp, dp, ep, zero, recompute, schedule="1f1b", cp=1, offload=False,
            precision="fp32", sp=False, etp=1, make=None):
    import torch.distributed as dist

    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(tp, pp, dp, "tp-pp-dp", cp, ep), dist.get_rank(), sequence_parallel=sp,
                expert_tp=etp)
    model = build_stage((make or config)(), mesh, SEED, recompute)
    seq = SEQ // cp // (tp if sp else 1)
    executor = PipelineExecutor(model, mesh, schedule, (MBS, seq, 32))
    if zero == 3:
        from megapar.optim.zero3 import Zero3Optimizer

        optimizer = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR, WD, eps=EPS,
                                   tp_group=mesh.tp_group, offload=offload)
    else:
        optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS, zero=zero)
    grad_sync = build_grad_sync(model, mesh, zero, bucket_mb=0.02, offload_params=offload)
    step = TrainStep(model, mesh, executor, optimizer, scheduler(),
                     Precision(precision, mesh.device), MAX_NORM, grad_sync)
    return mesh, model, optimizer, step


def _train(tp, pp, dp, ep, zero, recompute="none", schedule="1f1b", cp=1, offload=False,
           sp=False, etp=1, make=None):
    mesh, model, optimizer, step = _engine(tp, pp, dp, ep, zero, recompute, schedule, cp, offload,
                                           sp=sp, etp=etp, make=make)
    grads, optimizer_step = {}, optimizer.step

    def record_first_grads_then_step():
        if not grads and zero in (0, 3):  # ZeRO-3: each unit's over its group (experts' too)
            full = gathered_grads(step.grad_sync) if zero == 3 else {}
            grads.update({n: _whole(full[id(p)] if zero == 3 else p.grad, p, mesh)
                          for n, p in model.named_parameters()})
        optimizer_step()

    optimizer.step = record_first_grads_then_step
    plan = BatchPlan(G, MBS, dp)
    results, alone = [], _alone_units(step.grad_sync) if zero == 3 else None
    for i, b in enumerate(global_batches()):
        with count_collectives() as calls:
            results.append(step.step(plan.split(b, mesh.dp_rank), i))
        if i == 0:  # the first step's all-to-alls, as megapar-plan counts them
            a2a = [(c.bytes, c.dtype, c.group_size) for c in calls if c.op == "all_to_all_single"]
        if alone is not None:  # collectives over a group of one rank: none may be issued
            alone["one_rank_calls"] += sum(c.group_size == 1 for c in calls)
    if alone is not None:
        alone["after"] = _alone_units(step.grad_sync)["storages"]
    with step.grad_sync.whole() if zero == 3 else contextlib.nullcontext():
        weights = {n: _whole(p.detach(), p, mesh) for n, p in model.named_parameters()}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return {"results": results, "weights": weights if keep else {},
            "grads": grads if keep else {}, "biases": biases(model), "a2a": a2a, "alone": alone}


def _alone_units(sharded):
    """ZeRO-3's units whose group is this rank alone (the experts' at ep = cp x dp): their
    names, and where their parameters and gradients live (each one's storage, which must be
    its unit's shard and gradient shard: kept whole, no gathered copy, no gradient buffer)."""
    units = [u for u in sharded.units if u.group_size == 1]
    storages = [(u.shard.untyped_storage().data_ptr(), u.grad_shard.untyped_storage().data_ptr(),
                 {p.untyped_storage().data_ptr() for p in u.params},
                 {p.grad.untyped_storage().data_ptr() for p in u.params if p.grad is not None})
                for u in units]
    return {"names": [u.name for u in units], "storages": storages, "one_rank_calls": 0,
            "resident": all(getattr(u, "resident", False) for u in units),
            "on_host": bool(units) and all(u.host_shard is not None for u in units)}


@pytest.fixture(scope="module")
def reference():
    return serial_reference()


def _check(outs, run, reference):
    merged = {"weights": {}, "grads": {}}
    for rank, out in enumerate(outs):
        check_rank(out, f"{run} rank {rank}", reference, merged)
    assert set(merged["weights"]) == set(reference["weights"]), f"{run}: parameter names differ"
    if run[4] in (0, 3):
        assert set(merged["grads"]) == set(reference["grads"]), f"{run}: gradient names differ"
    for key in merged:
        for name, t in merged[key].items():
            assert_close(t, reference[key][name], what=f"{run} {key} {name}")


def _runs(runs, bf16=False, make=None):
    """Each run's `_train` (on the model of `make()`, default `config()`); with `bf16`,
    `_bf16_steps` last."""
    return [_train(*run, make=make) for run in runs] + ([_bf16_steps()] if bf16 else [])


RUNS_4 = [(1, 1, 4, 2, 0), (1, 1, 4, 2, 1), (1, 1, 4, 2, 3), (1, 2, 2, 2, 0, "full"),
          (1, 1, 2, 4, 0, "none", "1f1b", 2), (1, 1, 2, 2, 1, "none", "1f1b", 2),
          (1, 2, 2, 2, 0, "full", "zb-h1"), (2, 1, 2, 2, 0),
          # expert tensor parallelism (each expert's weights split over tp): with ep and
          # ZeRO-1 under sequence parallelism, with pp and full recomputation, under ZeRO-3,
          # with cp x ep
          (2, 1, 2, 2, 1, "none", "1f1b", 1, False, True, 2),
          (2, 2, 1, 1, 0, "full", "1f1b", 1, False, True, 2),
          (2, 1, 2, 1, 3, "none", "1f1b", 1, False, False, 2),
          (2, 1, 1, 2, 0, "none", "1f1b", 2, False, False, 2)]


def test_dp2_ep2_matches_serial_training(reference, monkeypatch):
    """With all-reduce and with ZeRO-3 (the experts' units over a one-rank expert group, kept
    whole: no collective over that group, the expert parameters and gradients in their shards,
    unmoved over the steps; with --offload-params and --offload-optimizer, host copies as on
    CUDA: the shard in host memory, each gather a copy of it, no collective either).
    And its all-to-all bytes per step (`comm_count`) are megapar-plan's analytic count
    (`plan.experts.step_alltoall`): per rank exactly for the count exchange and the rows it
    routes, over the ep group exactly in all (each rank's received rows depend on the
    routing; they sum to the rows sent). The same at cp 2 x ep 2 (dp 1): ep over the two cp
    ranks of each sequence, each routing its chunk's tokens. And under bf16 the rows travel
    in bf16, bit for bit as in fp32 (`_check_bf16_rows`)."""
    from megapar.device import HOST_COPIES_ENV

    monkeypatch.setenv(HOST_COPIES_ENV, "1")  # (only offloading runs look)
    runs = [(1, 1, 2, 2, 0), (1, 1, 2, 2, 3), (1, 1, 1, 2, 0, "none", "1f1b", 2),
            (1, 1, 2, 2, 3, "none", "1f1b", 1, True)]
    outs = run_local(_runs, 2, runs, True)
    for i, run in enumerate(runs):
        _check([o[i] for o in outs], run, reference)
    _check_bf16_rows([o[-1] for o in outs])
    for o in outs:  # ZeRO-3: expert dp = cp x dp / ep = 1, each MoE block's experts kept whole
        alone = o[1]["alone"]
        assert alone["names"] == [f"chunk 0 layer {i} experts" for i in (3, 2, 1)], alone
        assert alone["one_rank_calls"] == 0 and alone["resident"], alone
        for shard, grad, params, grads in alone["after"]:  # the parameters are the shard,
            assert params == {shard} and grads == {grad}  # their gradients the gradient shard
        # and neither moved over the steps (no gathered copy)
        assert [s[:3] for s in alone["after"]] == [s[:3] for s in alone["storages"]]
        offloaded = o[3]["alone"]  # gathered by a host copy, no collective
        assert offloaded["names"] == alone["names"] and offloaded["one_rank_calls"] == 0
        assert offloaded["on_host"] and not offloaded["resident"] and not alone["on_host"]
    _check_alltoall_bytes([o[0] for o in outs], dp=2, cp=1)
    _check_alltoall_bytes([o[2] for o in outs], dp=1, cp=2)


def _check_alltoall_bytes(outs, dp, cp):
    from megapar.plan import Candidate, Problem
    from megapar.plan.experts import COUNT_BYTES, alltoall_bytes, moe_layers, step_alltoall

    cfg, m, tokens = config(), G // (MBS * dp), MBS * SEQ // cp
    layers = moe_layers(cfg, range(cfg.num_layers))
    problem = Problem(cfg, 2, global_batch=G, seq_len=SEQ, precision="fp32")
    planned = step_alltoall(problem, Candidate(dp=dp, ep=2, mbs=MBS, cp=cp), layers)
    one = alltoall_bytes(cfg, tokens, 2, 4)
    assert layers == 3 and planned == layers * m * one.total > 0
    counted = [sum(n for n, _, size in o["a2a"] if size == 2) for o in outs]
    assert all(len(o["a2a"]) == layers * m * 5 for o in outs)  # counts, 2 forward, 2 backward
    assert sum(counted) == 2 * planned, (counted, planned)
    for o in outs:  # per rank: the count exchange and the routed rows out (dispatch, and the
        # combine's gradient) are exact; the rows it received back vary with the routing
        counts = [n for n, dtype, _ in o["a2a"] if dtype == torch.int64]
        assert counts == [cfg.num_local_experts * COUNT_BYTES] * layers * m
    sent_rows = tokens * cfg.num_experts_per_tok * cfg.hidden_size * 4
    received = [c - layers * m * (one.counts + 2 * sent_rows) for c in counted]
    assert sum(received) == 2 * layers * m * 2 * sent_rows


def _bf16_steps():
    """dp 2 x ep 2 under bf16, one step (two micro-batches a rank) as megapar sends its rows
    and one with the rows sent as they come (fp32, the residual stream's dtype): each one's
    result, gradients, weights, all-to-alls and host syncs."""
    from unittest import mock

    from megapar.models import moe
    from megapar.tensor_parallel.mappings import to_wire_dtype

    out = []
    for wire in (to_wire_dtype, lambda x, group: x):
        with mock.patch.object(moe, "to_wire_dtype", wire):
            mesh, model, _, step = _engine(1, 1, 2, 2, 0, "none", precision="bf16")
            split = BatchPlan(G, MBS, 2).split(global_batches()[0], mesh.dp_rank)
            with count_collectives() as calls, count_syncs() as syncs:
                result = step.step(split, 0)
        out.append({"result": result, "syncs": syncs,
                    "grads": [p.grad.clone() for p in model.parameters()],
                    "weights": [p.detach().clone() for p in model.parameters()],
                    "a2a": [(c.bytes, c.dtype) for c in calls if c.op == "all_to_all_single"]})
    return out


def _check_bf16_rows(outs):
    """Under bf16 the dispatched rows and their gradients travel in bf16, as the combined
    ones do (the experts' linears cast their input to bf16 anyway): every row exchange moves
    the T k rows' 2 bytes an element, `plan.experts.alltoall_bytes` at 2 bytes. Losses,
    gradients and updated weights are bitwise those of the rows sent in fp32, with the same
    all-to-alls in the same order and the same host syncs."""
    from megapar.plan.experts import COUNT_BYTES, alltoall_bytes

    cfg, m, layers = config(), G // (MBS * 2), 3
    rows = MBS * SEQ * cfg.num_experts_per_tok * cfg.hidden_size
    one = alltoall_bytes(cfg, MBS * SEQ, 2, 2)
    assert one.forward == one.backward == 2 * rows * 2
    for wired, fp32_rows in outs:
        assert wired["result"] == fp32_rows["result"]
        for key in ("grads", "weights"):
            assert all(torch.equal(a, b) for a, b in zip(wired[key], fp32_rows[key])), key
        assert wired["syncs"] == fp32_rows["syncs"]
        elements = [[n // d.itemsize for n, d in o["a2a"]] for o in (wired, fp32_rows)]
        assert elements[0] == elements[1]  # the same all-to-alls, in the same order
        # per layer and micro-batch the counts, rows out and back, their gradients back and
        # out: every row exchange in bf16 (the dispatch and its gradient were fp32 before)
        dtypes = [d for _, d in wired["a2a"]]
        assert len(dtypes) == 5 * layers * m and dtypes.count(torch.int64) == layers * m
        assert set(dtypes) == {torch.int64, torch.bfloat16}
        assert [d for _, d in fp32_rows["a2a"]].count(torch.float32) == 2 * layers * m
        # each count exchange is followed by the dispatch of the rows this rank routes
        counts = [i for i, d in enumerate(dtypes) if d == torch.int64]
        assert {wired["a2a"][i][0] for i in counts} == {cfg.num_local_experts * COUNT_BYTES}
        assert {wired["a2a"][i + 1][0] for i in counts} == {rows * 2}
    total = sum(n for o in outs for n, _ in o[0]["a2a"])
    assert total == 2 * layers * m * one.total  # over the ep group: every row


def test_dp4_ep2_pp2_ep2_tp2_ep2_match_serial_training():
    """ep folds into dp x cp: every run here is four ranks (at dp 2 x cp 2 x ep 4 every rank
    holds one of the four experts; at ep 2 ZeRO-1 slices the experts' state over the dp ranks
    holding them). With expert tensor parallelism (the last four runs) each expert's
    gate_up / down are split over tp and its gradients still reduced over expert dp. On the
    model's first three layers (`three_layers`: the dense one and two MoE ones; at pp 2 one
    MoE layer a stage), against the serial run of the same model."""
    reference = serial_reference(make=three_layers)
    outs = run_local(_runs, 4, RUNS_4, False, three_layers)
    for i, run in enumerate(RUNS_4):
        _check([o[i] for o in outs], run, reference)
    for i, run in enumerate(RUNS_4):  # ep's all-to-alls over its own group
        a2a_groups = {size for o in outs for _, _, size in o[i]["a2a"]}
        assert a2a_groups == ({run[3]} if run[3] > 1 else set()), (run, a2a_groups)


def _syncs(recompute):
    """Per call site, the host syncs of a step at 2 and at 4 micro-batches per rank."""
    mesh, model, _, step = _engine(1, 1, 2, 2, 0, recompute)
    first, second, _ = global_batches()
    both = {k: torch.cat([first[k], second[k]]) for k in first}
    counts = {}
    for m, batch in ((2, first), (4, both)):
        split = BatchPlan(len(batch["input_ids"]), MBS, 2).split(batch, mesh.dp_rank)
        step.step(split, 0)  # the first step of a shape builds its executor
        with count_syncs() as syncs:
            step.step(split, 1)
        counts[m] = syncs
    return counts


def _syncs_both():
    return [_syncs("none"), _syncs("full")]


def test_one_host_sync_per_moe_layer_and_micro_batch():
    """dp 2 x ep 2: the count exchange's read at dispatch.py is the only sync that grows with
    the micro-batches (one per MoE layer and micro-batch, none more in a recompute); the others
    are the step's (the loss, the norm, the router statistics). Without recomputation and with
full recomputation (its recompute reuses the forward's route)."""
    moe_layers = 3  # of config()'s four, the first is dense
    for counts in (c for both in run_local(_syncs_both, 2) for c in both):
        for m in (2, 4):
            route = {k: n for k, n in counts[m].items() if k[1].startswith("expert_parallel/")}
            assert len(route) == 1, counts[m]  # one call site
            (call, where), n = next(iter(route.items()))
            assert call == "tolist" and where.startswith("expert_parallel/dispatch.py"), route
            assert n == moe_layers * m, (m, route)
        rest = [{k: n for k, n in counts[m].items() if k[1] != where} for m in (2, 4)]
        assert rest[0] == rest[1], counts  # nothing else per micro-batch
