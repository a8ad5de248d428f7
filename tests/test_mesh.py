import pytest
import torch
import torch.distributed as dist

from megapar.launcher import run_local
from megapar.mesh import Layout, LayoutError, Mesh


def test_rank_order_tp_fastest_then_pp_then_dp():
    layout = Layout(tp=2, pp=2, dp=2)
    expected = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (1, 1, 0),
                4: (0, 0, 1), 5: (1, 0, 1), 6: (0, 1, 1), 7: (1, 1, 1)}
    for rank, coords in expected.items():
        assert layout.coords(rank) == coords
        assert layout.rank(*coords) == rank


def test_rank_order_megatron_pp_outermost():
    # tp-dp-pp: tp fastest, then dp, pp outermost (Megatron's default order).
    layout = Layout(tp=2, pp=2, dp=2, order="tp-dp-pp")
    expected = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 0, 1), 3: (1, 0, 1),
                4: (0, 1, 0), 5: (1, 1, 0), 6: (0, 1, 1), 7: (1, 1, 1)}
    for rank, coords in expected.items():
        assert layout.coords(rank) == coords
        assert layout.rank(*coords) == rank
    assert layout.to_dict() == {"tp": 2, "pp": 2, "dp": 2, "order": "tp-dp-pp"}
    assert Layout(2, 2, 2).to_dict() == {"tp": 2, "pp": 2, "dp": 2}
    assert str(layout) == "tp=2 pp=2 dp=2 order=tp-dp-pp"
    with pytest.raises(LayoutError, match="--rank-order must be one of tp-pp-dp, tp-dp-pp"):
        Layout(1, 1, 1, "dp-pp-tp")


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=3), "world size 8 is not divisible by tp\\*pp = 3\\*1"),
    (dict(world_size=8, tp=2, pp=2, dp=1), "world size 8 != tp\\*pp\\*dp = 2\\*2\\*1 = 4"),
    (dict(world_size=8, tp=0), "--tp and --pp must be >= 1"),
])
def test_bad_sizes_are_named(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        Layout.infer(**kwargs)


def test_layout_rejects_zero_dp():
    with pytest.raises(LayoutError, match="--dp must be an integer >= 1"):
        Layout(1, 1, 0)


def _members(group):
    # Learn a group's members by all-gathering global ranks over it.
    size = dist.get_world_size(group)
    out = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(out, torch.tensor([float(dist.get_rank())]), group=group)
    return sorted(int(t.item()) for t in out)


def _describe(order="tp-pp-dp"):
    mesh = Mesh(Layout(2, 2, 2, order), dist.get_rank())
    return dict(coords=(mesh.tp_rank, mesh.pp_rank, mesh.dp_rank),
                tp=_members(mesh.tp_group), pp=_members(mesh.pp_group), dp=_members(mesh.dp_group),
                mp=_members(mesh.mp_group), emb=_members(mesh.embedding_group),
                prev=mesh.prev_stage_rank, next=mesh.next_stage_rank)


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
def test_groups_of_every_rank_on_2x2x2(order):
    got = run_local(_describe, 8, order)
    layout = Layout(2, 2, 2, order)
    for rank, info in enumerate(got):
        t, p, d = layout.coords(rank)
        assert info["coords"] == (t, p, d)
        assert info["tp"] == [layout.rank(x, p, d) for x in range(2)]
        assert info["pp"] == [layout.rank(t, x, d) for x in range(2)]
        assert info["dp"] == [layout.rank(t, p, x) for x in range(2)]
        assert info["mp"] == [r for r in range(8) if layout.coords(r)[2] == d]
        assert info["emb"] == [layout.rank(t, 0, d), layout.rank(t, 1, d)]
        assert info["prev"] == (None if p == 0 else layout.rank(t, 0, d))
        assert info["next"] == (None if p == 1 else layout.rank(t, 1, d))


def _wrong_world():
    Mesh(Layout(2, 2, 1), dist.get_rank())


def test_mesh_rejects_wrong_world_size():
    from megapar.launcher import WorkerError
    with pytest.raises(WorkerError, match="world size 2 != tp\\*pp\\*dp = 2\\*2\\*1 = 4"):
        run_local(_wrong_world, 2)


@pytest.mark.parametrize("order,expected", [
    # (tp, cp, pp, dp) of ranks 0..7 at tp 2 x cp 2 x pp 2: cp right after tp, as Megatron
    ("tp-pp-dp", [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0),
                  (0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0), (1, 1, 1, 0)]),
    ("tp-dp-pp", [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0),
                  (0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0), (1, 1, 1, 0)]),
])
def test_rank_order_with_cp_next_to_tp(order, expected):
    layout = Layout(2, 2, 1, order, cp=2)
    for rank, (t, c, p, d) in enumerate(expected):
        assert layout.coords4(rank) == (t, c, p, d)
        assert layout.rank(t, p, d, c) == rank
    four = Layout(1, 2, 2, order, cp=2)  # dp and pp both > 1: the orders differ
    assert [four.coords4(r)[1:] for r in range(8)] == (
        [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
        if order == "tp-pp-dp" else
        [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)])
    assert Layout.infer(8, 2, 2, order=order, cp=2).dp == 1
    assert str(layout).startswith("tp=2 cp=2 pp=2 dp=1")
    assert layout.to_dict()["cp"] == 2 and "cp" not in Layout(2, 2, 2).to_dict()
    assert Layout(**layout.to_dict()) == layout


def test_place_names_a_rank_where_a_failure_names_it():
    """A failure names a rank with its place in the mesh (the training loop, the rehearsal and
    the launcher's report of a rank that died or never answered); its cp rank where cp > 1."""
    assert Layout(1, 2, 2).place(1) == "tp rank 0, pp rank 1, dp rank 0 of tp=1 pp=2 dp=2"
    assert Layout(2, 2, 1, cp=2).place(6) == (
        "tp rank 0, cp rank 1, pp rank 1, dp rank 0 of tp=2 cp=2 pp=2 dp=1")
    assert Layout(1, 2, 2, "tp-dp-pp").place(1) == (
        "tp rank 0, pp rank 0, dp rank 1 of tp=1 pp=2 dp=2 order=tp-dp-pp")
    with pytest.raises(LayoutError, match="not divisible by tp\\*cp\\*pp = 2\\*3\\*1"):
        Layout.infer(8, 2, cp=3)


def _describe_cp():
    mesh = Mesh(Layout(1, 2, 2, cp=2), dist.get_rank())
    return dict(cp=_members(mesh.cp_group), dp=_members(mesh.dp_group),
                dp_cp=_members(mesh.dp_cp_group), mp=_members(mesh.mp_group),
                emb=_members(mesh.embedding_group), next=mesh.next_stage_rank,
                prev=mesh.prev_stage_rank)


def test_cp_groups_of_every_rank():
    """tp 1 x cp 2 x pp 2 x dp 2: the cp group splits sequences, gradients are reduced over cp
    x dp, the pipeline and the tied embedding stay within one cp rank."""
    layout = Layout(1, 2, 2, cp=2)
    for rank, info in enumerate(run_local(_describe_cp, 8)):
        t, c, p, d = layout.coords4(rank)
        assert info["cp"] == [layout.rank(t, p, d, x) for x in range(2)]
        assert info["dp"] == [layout.rank(t, p, x, c) for x in range(2)]
        assert info["dp_cp"] == sorted(layout.rank(t, p, x, y) for x in range(2)
                                       for y in range(2))
        assert info["mp"] == [layout.rank(t, x, d, c) for x in range(2)]
        assert info["emb"] == info["mp"]
        assert (info["prev"], info["next"]) == ((None, layout.rank(t, 1, d, c)) if p == 0
                                                else (layout.rank(t, 0, d, c), None))


# --- every group waits the run's timeout --------------------------------------------------
def _group_timeouts():
    mesh = Mesh(Layout(2, 2, 1, cp=2), dist.get_rank())
    names = ("tp_group", "cp_group", "pp_group", "dp_group", "dp_cp_group", "mp_group",
             "embedding_group")
    return mesh.timeout_s, {  # as gloo holds it
        n: getattr(mesh, n)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for n in names}


def test_every_group_of_the_mesh_has_the_runs_timeout():
    """The DeviceMesh's groups and the ones made on top (torch's default: 30 min on gloo)."""
    for timeout, groups in run_local(_group_timeouts, 8, collective_timeout_s=7):
        assert timeout == 7
        assert groups == dict.fromkeys(groups, 7.0), groups


def _rank1_stops_in(wait: str):
    """tp 2 x pp 2; rank 1 stops (SIGSTOP) instead of joining `wait`, which the others enter:
    the grad-norm's synchronous all-reduce over mp_group (ranks 0, 2, 3), or the tied
    embedding's all-reduce (rank 3, the other end of rank 1's embedding group)."""
    import os
    import signal

    from torch import nn

    from megapar.faults.status import set_action
    from megapar.optim.clip import grad_norm
    from megapar.pipeline.tied import sync_tied_embeddings

    mesh = Mesh(Layout(2, 2, 1), dist.get_rank())
    model = nn.Linear(2, 2)
    model.weight.shared_embedding = True
    model.weight.grad = torch.ones(2, 2)
    dist.barrier()
    if mesh.rank == 1:
        set_action(f"about to stop before the {wait}")
        os.kill(os.getpid(), signal.SIGSTOP)
    if wait == "grad-norm all-reduce":
        grad_norm(model, mesh)
    elif mesh.rank == 3:
        sync_tied_embeddings(model, mesh)
    return mesh.rank


@pytest.mark.parametrize("wait", ["grad-norm all-reduce", "tied-embedding all-reduce"])
def test_a_wait_on_a_subgroup_ends_after_the_runs_timeout(wait):
    """A rank that stops answering makes the others fail after the run's timeout (3 s here), not
    torch's 30 minutes (subgroups) or megapar's default 300 s (the tied embedding), and the
    launcher names it."""
    import time

    from megapar.launcher import WorkerError

    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_local(_rank1_stops_in, 4, wait, timeout_s=90, collective_timeout_s=3)
    took = time.monotonic() - start
    assert took < 45, took
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 did not answer (it is stopped"), str(info.value)
    if wait == "tied-embedding all-reduce":
        assert "tied embedding gradient" in str(info.value) and "within 3 s" in str(info.value)
