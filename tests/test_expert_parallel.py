"""Expert parallelism's mesh groups, validation, and dispatch / combine against one process.

A toy MoE layer (top-k router, rows sorted by expert, SwiGLU experts stacked [E, ...], a loop
over the local experts) sharded over ep 2 and ep 4 gives the same outputs and the same
gradients (inputs, router, expert weights) as the whole layer on one process, also when some
experts, or all of one rank's experts, receive no token. The dispatch makes one host sync per
layer call and the collectives counted below.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sync_count import count_syncs

from megapar.comm_count import count_collectives
from megapar.expert_parallel import combine, dispatch, local_experts, plan_route
from megapar.launcher import run_local
from megapar.mesh import Layout, LayoutError, Mesh
from megapar.models.moe import expert_counts
from megapar.training.config import TrainConfig
from megapar.training.validate import UsageError, check_settings

E, H, FF, K = 8, 6, 5, 2


def toy_weights(blocked=()):
    """The whole layer's weights: router [H, E], a router bias (blocked experts: -1e4, never
    chosen), SwiGLU experts gate / up [E, H, FF], down [E, FF, H]."""
    g = torch.Generator().manual_seed(0)
    bias = torch.zeros(E)
    bias[list(blocked)] = -1e4
    return [torch.randn(H, E, generator=g), bias,
            0.4 * torch.randn(E, H, FF, generator=g), 0.4 * torch.randn(E, H, FF, generator=g),
            0.4 * torch.randn(E, FF, H, generator=g)]


def toy_tokens(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5 + 2 * rank, H, generator=g), torch.randn(5 + 2 * rank, H, generator=g)


def toy_moe(x, router, bias, gate, up, down, group):
    """A toy MoE layer: gate/up/down hold this rank's experts (all of them when group is
    None)."""
    scores = (x @ router + bias).softmax(-1)
    weight, ids = scores.topk(K, dim=-1)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // K)
    route = plan_route(expert_counts(flat, E), group)  # bincount would sync
    local = dispatch(rows, route)
    outs = [(F.silu(c @ gate[e]) * (c @ up[e])) @ down[e]
            for e, c in enumerate(local.split(route.counts))]
    y = combine(torch.cat(outs), route)
    y = torch.zeros_like(y).index_copy(0, order, y)
    return (y.view(-1, K, H) * weight.unsqueeze(-1)).sum(1)


def serial_reference(ranks, blocked):
    """Outputs, input and router gradients per rank (each rank's loss alone), and the expert
    weights' gradients of the sum of every rank's loss, all on this one process."""
    whole = [w.requires_grad_() for w in toy_weights(blocked)]
    outs, grads, total = [], [], 0
    for r in ranks:
        x, probe = toy_tokens(r)
        x.requires_grad_()
        y = toy_moe(x, *whole, None)
        loss = (y * probe).sum()
        outs.append(y.detach())
        grads.append(torch.autograd.grad(loss, [x, whole[0], whole[1]], retain_graph=True))
        total = total + loss
    total.backward()
    return outs, grads, [w.grad for w in whole[2:]]


def ep_worker(ep, blocked_sets):
    """Each blocked set in turn on ep ranks: the checks above, then what was counted."""
    mesh = Mesh(Layout(dp=ep, ep=ep), dist.get_rank())
    return [ep_layer_check(mesh, blocked) for blocked in blocked_sets]


def ep_layer_check(mesh, blocked):
    group_ranks = dist.get_process_group_ranks(mesh.ep_group)
    outs, grads, expert_grads = serial_reference(group_ranks, blocked)
    mine = local_experts(E, mesh.ep, mesh.ep_rank)
    weights = toy_weights(blocked)
    params = weights[:2] + [w[mine.start:mine.stop].clone() for w in weights[2:]]
    params = [p.requires_grad_() for p in params]
    x, probe = toy_tokens(mesh.rank)
    x.requires_grad_()
    with count_syncs() as syncs, count_collectives() as calls:
        y = toy_moe(x, *params, mesh.ep_group)
        forward_calls = len(calls)
        (y * probe).sum().backward()
    at = group_ranks.index(mesh.rank)
    close = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, outs[at], **close)
    for got, want in zip([x.grad, params[0].grad, params[1].grad], grads[at]):
        torch.testing.assert_close(got, want, **close)
    for got, want in zip([p.grad for p in params[2:]], expert_grads):
        torch.testing.assert_close(got, want[mine.start:mine.stop], **close)
    return {"syncs": dict(syncs), "calls": [(c.op, c.numel, c.group_size) for c in calls],
            "forward_calls": forward_calls, "rows": x.shape[0] * K}


@pytest.mark.parametrize("ep,blocked_sets", [(2, [(), (3,), (4, 5, 6, 7)]), (4, [(2, 3, 7)])])
def test_ep_layer_equals_one_process(ep, blocked_sets):
    """Outputs and the gradients of inputs, router and experts equal the whole layer on one
    process (fp32, 1e-6); blocked experts receive no token ((4, 5, 6, 7): rank 1 of ep 2
    receives nothing at all, its experts' gradients are zero). One host sync per layer call
    (the counts), five all-to-alls (counts, rows out, rows back; the two in backward)."""
    for rank, checks in enumerate(run_local(ep_worker, ep, ep, blocked_sets)):
        for res in checks:
            where = {w for (_, w) in res["syncs"]}
            assert len(where) == 1 and next(iter(where)).startswith(
                "expert_parallel/dispatch.py"), (rank, res["syncs"])
            assert sum(res["syncs"].values()) == 1, (rank, res["syncs"])
            ops = [op for op, _, _ in res["calls"]]
            assert ops == ["all_to_all_single"] * 5 and res["forward_calls"] == 3, (rank, ops)
            counts, sent, returned, grad_back, grad_sent = res["calls"]
            assert counts == ("all_to_all_single", E, ep)
            assert sent[1] == grad_back[1] == res["rows"] * H  # rows out, their grads back
            assert returned[1] == grad_sent[1]  # the received rows returned; their grads out


def test_ep_groups_fold_into_dp_x_cp():
    """On 4 ranks, ep blocks are ep consecutive places of the flattened dp x cp index
    (dp_rank * cp + cp_rank): dp 4 ep 2, ep groups of consecutive dp ranks; cp 2 dp 2 ep 2,
    the two cp ranks of a dp rank (expert dp over the dp ranks); cp 2 dp 2 ep 4, all four (an
    expert dp group of one); pp 2 cp 2 ep 2 (dp 1), the cp ranks of a stage. A rank's place
    in its groups is its ep / edp rank."""
    layouts = [Layout(dp=4, ep=2), Layout(dp=2, cp=2, ep=2), Layout(dp=2, cp=2, ep=4),
               Layout(pp=2, cp=2, ep=2), Layout(pp=2, dp=2, cp=1, ep=2, order="tp-dp-pp")]

    def worker():
        out = []
        for layout in layouts:
            m = Mesh(layout, dist.get_rank())
            ep, edp = (dist.get_process_group_ranks(g) for g in (m.ep_group, m.expert_dp_group))
            assert (ep.index(m.rank), edp.index(m.rank)) == (m.ep_rank, m.edp_rank)
            out.append([ep, edp])
        return out
    expected = {0: [[[0, 1], [0, 2]], [[0, 1], [0, 2]], [[0, 1, 2, 3], [0]], [[0, 1], [0]],
                    [[0, 1], [0]]],
                1: [[[0, 1], [1, 3]], [[0, 1], [1, 3]], [[0, 1, 2, 3], [1]], [[0, 1], [1]],
                    [[0, 1], [1]]],
                2: [[[2, 3], [0, 2]], [[2, 3], [0, 2]], [[0, 1, 2, 3], [2]], [[2, 3], [2]],
                    [[2, 3], [2]]],
                3: [[[2, 3], [1, 3]], [[2, 3], [1, 3]], [[0, 1, 2, 3], [3]], [[2, 3], [3]],
                    [[2, 3], [3]]]}
    assert dict(enumerate(run_local(worker, 4))) == expected


def test_ep_must_divide_dp_x_cp_one_clear_line():
    """`Layout` refuses an --ep that does not divide dp x cp in one wording: the product, and
    the --ep values that would work; megapar-train, which knows the model, offers only those
    that divide its experts too (it offered 3 and 6 for 4 experts at dp 6, then refused them)."""
    from megapar.cli.train import plan_run
    from megapar.training.config import parse_args

    four = (r"--ep 3 does not divide dp x cp = --dp 4 x --cp 1 = 4: experts are sharded over the "
            r"data- and context-parallel ranks; use --ep 1, 2 or 4 \(each divides dp x cp = 4; "
            r"it must divide the model's experts too\), or change --dp / --cp$")
    two = (r"--ep 4 does not divide dp x cp = --dp 1 x --cp 2 = 2: .*; use --ep 1 or 2 "
           r"\(each divides dp x cp = 2; .*\), or change --dp / --cp$")
    with pytest.raises(LayoutError, match=four):
        Layout(dp=4, ep=3)
    with pytest.raises(LayoutError, match=two):
        Layout(cp=2, ep=4)
    with pytest.raises(LayoutError, match=r"--ep 2 does not divide dp x cp = --dp 1 x --cp 1 = 1"
                                          r": .*; use --ep 1 \(the only value dividing dp x "
                                          r"cp = 1\), or"):
        Layout.infer(2, tp=2, ep=2)
    assert Layout.infer(2, cp=2, ep=2).dp == 1  # ep over the cp ranks
    with pytest.raises(UsageError, match=r"--ep 4 does not divide dp x cp = --dp 6 x --cp 1 = 6"
                                         r": .*; use --ep 1 or 2 \(each divides dp x cp = 6 "
                                         r"and the 4 experts\), or change --dp / --cp$"):
        plan_run(parse_args(["--model", "mixtral-tiny", "--dp", "6", "--ep", "4", "--dry-run"]))
    with pytest.raises(UsageError, match=r"--ep 3 shards a mixture-of-experts model's experts"):
        plan_run(parse_args(["--model", "gpt2-tiny", "--dp", "4", "--ep", "3", "--dry-run"]))
    check_settings(TrainConfig(dp=1, cp=2, ep=2))  # served
    check_settings(TrainConfig(dp=4, ep=2, zero=3))  # served
    for zero in (1, 2, 3):  # LAMB / LARS's norms reduce each slice over its own group
        for kind in ("lamb", "lars"):
            check_settings(TrainConfig(dp=4, ep=2, zero=zero, optimizer=kind))
    check_settings(TrainConfig(dp=4, ep=2, grad_compression="powersgd"))  # per group
    for zero in (0, 1, 2, 3):  # checkpoints are served at every ZeRO stage
        check_settings(TrainConfig(dp=4, ep=2, zero=zero, save="ckpt", load="ckpt"))
    check_settings(TrainConfig(dp=4, ep=2, zero=2))  # served
    assert Layout(dp=4, ep=2).to_dict() == {"tp": 1, "pp": 1, "dp": 4, "ep": 2}
    assert Layout(dp=4).to_dict() == {"tp": 1, "pp": 1, "dp": 4}
    with pytest.raises(ValueError, match="8 experts cannot be split over --ep 3"):
        local_experts(8, 3, 0)


def test_an_ep_not_dividing_the_experts_offers_values_dividing_dp_x_cp_too():
    """--ep 3 on 4 experts at dp 6: the refusal offers only the --ep values the next check
    (dp x cp) lets through too; it offered 1, 2, 3 or 6 from dp x cp alone, and 3 and 6 were
    then refused for the experts."""
    from megapar.models.recipes import resolve_model
    from megapar.training.model_config import ep_model_error

    config = resolve_model("mixtral-tiny")
    assert config.num_local_experts == 4
    assert ep_model_error(config, 3, ranks=6) == (
        "--ep 3 does not divide the model's 4 experts: use --ep 1 or 2 (each divides the 4 "
        "experts and dp x cp = 6)")
    assert ep_model_error(config, 3).endswith(": choose an --ep that divides 4")
    assert ep_model_error(config, 2, ranks=6) is None


def test_a_resumed_runs_ep_refusal_offers_values_its_checkpoints_experts_take(tmp_path):
    """`--load CKPT --dp 6 --ep 4` of a 4-expert checkpoint offered 1, 2, 3 or 6 (no --model
    to read the experts from); the checkpoint's model is read now (a re-test)."""
    from megapar.cli.train import main, plan_run
    from megapar.training.config import parse_args

    ckpt = str(tmp_path / "ck")
    assert main(["--model", "mixtral-tiny", "--seq-len", "16", "--max-steps", "1",
                 "--save", ckpt, "--no-progress"]) == 0
    with pytest.raises(UsageError, match=r"use --ep 1 or 2 \(each divides dp x cp = 6 and the "
                                         r"4 experts\)"):
        plan_run(parse_args(["--load", ckpt, "--dp", "6", "--ep", "4", "--dry-run"]))
