"""Expert parameters' gradients reduce over the expert-data-parallel group, dense ones over dp.

A toy model (a dense layer, the toy MoE layer of test_expert_parallel with its experts marked,
a dense output layer) trained 3 steps at dp 4 x ep 2 (2 micro-batches per rank, gradient
clipping on, tiny buckets so dense and expert buckets interleave) with the all-reduce grad sync,
ZeRO-1 and ZeRO-2 equals the same model trained on one process on all the data (fp32, 1e-5
relative); the step's collectives are counted per group against the parameter counts, and
every rank issues the same collectives in the same order; the optimizer state and weights a
checkpoint gathers (every expert whole) are the serial run's, under ZeRO-3 too (the units
gathered into host copies as a save does: the experts on the ranks of the writer's ep group).
The same at cp 2 x dp 2 x ep 2 (each cp rank's loss its tokens' share, as under context
parallelism; ep folds into dp x cp, so the two cp ranks of a dp rank hold different experts
and exchange tokens, and the expert-data-parallel group spans the dp ranks). ZeRO-3 too in each layout: the model is
one unit, its experts a unit of their own over the expert-data-parallel group.

LAMB and LARS under ZeRO-0/1/2/3 too: each parameter's trust ratio needs the norm of the
whole parameter as one process holds it (an expert parameter: the stacked experts of all ep
ranks), the squared sums of its slices reduced over the ranks holding its parts; the step's
norm all-reduces are counted per group. And PowerSGD (all-reduce kind) against a serial reference written here from
the algorithm: every dp rank's gradient computed on one process, each dense matrix compressed
over all dp ranks and each ep rank's experts over the ranks holding them (the ep group's tokens
summed first, as the all-to-all does), with per-rank error feedback and a warm-started Q per
group; at dp == ep the experts' group is one rank and their gradient stays exact.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from test_expert_parallel import E, H, toy_moe, toy_weights
from torch import nn
from tp_utils import assert_close, rel_err

from megapar.checkpoint.stage_tensors import expert_blocks, gathers_experts
from megapar.comm_count import count_collectives
from megapar.data_parallel.compression import make_compressor
from megapar.data_parallel.grad_sync import build_grad_sync
from megapar.data_parallel.sharded_params import HostStage
from megapar.expert_parallel import is_expert, local_experts, mark_expert
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.optim.clip import clip_grad_norm
from megapar.optim import build_optimizer
from megapar.optim.zero3 import Zero3Optimizer

EP, M, STEPS, T = 2, 2, 3, 6
LR, CLIP = {"adamw": 0.05, "lamb": 0.05, "lars": 5.0}, 0.5
RANK = 2
"""PowerSGD's rank: every matrix of the toy model is compressed ((n + m) r < n m)."""


class ToyMoEModel(nn.Module):
    """Dense in, a residual toy MoE layer (this ep rank's experts), dense out."""

    config = None  # what a checkpoint records of a model (ZeRO-3's `HostStage` reads it)

    def __init__(self, group, ep, ep_rank):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        router, bias, gate, up, down = toy_weights()
        mine = local_experts(E, ep, ep_rank)
        self.inp = nn.Parameter(0.5 * torch.randn(H, H, generator=g))
        self.router, self.bias = nn.Parameter(router), nn.Parameter(bias)
        self.gate, self.up, self.down = (nn.Parameter(w[mine.start:mine.stop].clone())
                                         for w in (gate, up, down))
        mark_expert(self.gate, self.up, self.down, ep=ep, ep_rank=ep_rank)
        self.out = nn.Parameter(0.5 * torch.randn(H, H, generator=g))
        self.group = group

    def forward(self, x):
        h = torch.tanh(x @ self.inp)
        h = h + toy_moe(h, self.router, self.bias, self.gate, self.up, self.down, self.group)
        return h @ self.out


def micro_batch(step, dp_rank, i):
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + i)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def loss_of(model, step, dp_rank, i):
    x, target = micro_batch(step, dp_rank, i)
    return ((model(x) - target) ** 2).mean() / M


def serial_run(dp, cp, kind="adamw", reduce=None):
    """The whole model on one process: every dp x cp rank's micro-batches, the loss their sum
    over cp and mean over dp. `reduce(model, per_rank)`: set each .grad from every rank's
    gradients (divided by dp) instead of their sum (PowerSGD's reference)."""
    model = ToyMoEModel(None, 1, 0)
    mesh = Mesh(Layout())
    opt = build_optimizer(model, mesh, LR[kind], 0.1, kind=kind)
    norms = []
    for step in range(STEPS):
        per_rank = []
        opt.zero_grad()
        for r in range(dp * cp):
            if reduce is not None:
                opt.zero_grad()
            for i in range(M):
                (loss_of(model, step, r, i) / dp).backward()
            if reduce is not None:
                per_rank.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if reduce is not None:
            reduce(model, per_rank)
        norms.append(clip_grad_norm(model, mesh, CLIP))
        opt.step()
    return model, norms, opt.state_tensors()


class PowerSGDReference:
    """PowerSGD (compression.py's docstring: P = M Q summed, orthonormalised, Q = M^T P
    summed, result P Q^T, residual M - P P^T M kept per rank, Q warm-started) of every dp
    rank's gradients on one process: dense parameters over the dp ranks, each ep rank's experts
    over the dp ranks holding them, each rank's experts' gradient the sum over its ep group
    (the tokens the all-to-all brings). The first Q of a parameter is seeded by its name, as the
    compressor seeds it."""

    def __init__(self, dp, index_of):
        self.dp, self.index_of = dp, index_of
        self.seeds = make_compressor("powersgd", RANK)
        self.errors, self.qs = {}, {}

    def __call__(self, model, per_rank):
        for name, p in model.named_parameters():
            if not is_expert(p):
                p.grad = self.compress([g[name] for g in per_rank], name, ())
                continue
            p.grad = torch.zeros_like(p)
            for r in range(EP):  # ep rank r's experts, compressed over expert dp
                mine = slice(local_experts(E, EP, r).start, local_experts(E, EP, r).stop)
                members = [sum(per_rank[e * EP + j][name][mine] for j in range(EP))
                           for e in range(self.dp // EP)]  # dp rank = edp rank * ep + ep rank
                p.grad[mine] = self.compress(members, name, (r,))

    def compress(self, members, name, group):
        if len(members) == 1:  # a one-rank group: nothing to reduce
            return members[0]
        shape = self.seeds._matrix_shape(members[0])
        if shape is None:  # vectors go uncompressed
            return sum(members)
        n, m = shape
        key = (name, group)
        mats = [g.reshape(n, m) + self.errors.get((key, k), 0) for k, g in enumerate(members)]
        q = self.qs.get(key)
        if q is None:
            q = self.seeds.initial_q(name, n, m)
        p = torch.linalg.qr(sum(mat @ q for mat in mats)).Q
        q = sum(mat.t() @ p for mat in mats)
        for k, mat in enumerate(mats):
            self.errors[key, k] = mat - p @ (p.t() @ mat)
        self.qs[key] = q
        return (p @ q.t()).reshape(members[0].shape)


def wire_elements(params):
    """Elements PowerSGD all-reduces for these parameters: (n + m) r per compressed matrix."""
    shapes = [make_compressor("powersgd", RANK)._matrix_shape(p) for p in params]
    return sum((s[0] + s[1]) * RANK if s else p.numel() for p, s in zip(params, shapes))


def parallel_run(mesh, zero, kind="adamw", compression="none"):
    model = ToyMoEModel(mesh.ep_group, mesh.ep, mesh.ep_rank)
    sync = build_grad_sync(model, mesh, zero=zero, bucket_mb=300 / 2**20,  # ~2 params each
                           compressor=make_compressor(compression, RANK))
    if zero == 3:  # the model is one root unit: its dense part leads its experts' unit
        opt = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR[kind], 0.1,
                             kind=kind)
    else:
        opt = build_optimizer(model, mesh, LR[kind], 0.1, zero=zero, kind=kind)
    if zero:
        opt.attach(sync)
    norms, counted = [], []
    for step in range(STEPS):
        with count_collectives() as calls:
            opt.zero_grad()
            sync.begin_step()
            for i in range(M):
                if i == M - 1:
                    sync.before_last_backward()
                loss_of(model, step, mesh.dp_rank * mesh.cp + mesh.cp_rank, i).backward()
            sync.finish()
            if zero:
                norms.append(opt.clip_grad_norm(mesh, CLIP))
            else:
                norms.append(clip_grad_norm(model, mesh, CLIP))
            opt.step()
        counted.append(calls)
    with sync.whole() if zero == 3 else contextlib.nullcontext():  # ZeRO-3: gathered
        weights = [p.detach().clone() for p in model.parameters()]
    return model, weights, norms, counted[-1], sync, opt


def traffic(calls):
    """{(op, group ranks): (calls, elements)} of the step's collectives."""
    out = {}
    for c in calls:
        n, numel = out.get((c.op, c.ranks), (0, 0))
        out[c.op, c.ranks] = (n + 1, numel + c.numel)
    return out


def assert_moments_close(value, want, what):
    """An optimizer moment equals the serial run's to 1e-5 of its largest entry (the parity
    measure of tp_utils.rel_err, without assert_close's floor: a second moment is gradient
    squared, all of it below that floor). Entry by entry it would not be a fixed measure: an
    entry near zero is a sum over ranks that cancels, and carries the rounding of its terms
    (one of 36 first-moment entries 4.6e-5 of itself apart where ATen's AVX512 kernels sum)."""
    assert value.shape == want.shape, f"{what}: shape {tuple(value.shape)} != {tuple(want.shape)}"
    err = rel_err(value, want)
    assert err < 1e-5, f"{what}: relative error {err:.3g} >= 1e-5"


def check_checkpoint_state(model, mesh, opt, serial, serial_state, sync):
    """The checkpoint's view of a ZeRO-1 / 2 / 3 run: `state_tensors` gives the dense moments
    on dp rank 0 (cp rank 0) and each expert's on its expert-data-parallel rank 0, the ranks of
    the writer's ep group (at cp 2 x dp 2 x ep 2 both cp ranks of dp rank 0), nothing
    elsewhere; `expert_blocks` gathers every expert whole there (weights and moments; at tp 1
    the one shard file's block is every expert): the serial run's (1e-5). ZeRO-3: the weights are read from the
    host copies a save takes (`HostStage`: every parameter on the writer, the experts on its
    ep group's ranks, nothing elsewhere)."""
    state = opt.state_tensors()  # collective over every bucket's (unit's) group
    writer = mesh.dp_rank == 0 and mesh.cp_rank == 0
    dense = {n for n, p in model.named_parameters() if not is_expert(p)}
    experts = {n for n, p in model.named_parameters() if is_expert(p)}
    first = mesh.edp_rank == 0
    if sync.stage == 3:  # as `Engine.saved_model`: collective over the units' groups
        model = HostStage(model, sync.host_params(writer, writer or gathers_experts(mesh)))
        held = {n for n, _ in model.named_parameters()}
        assert held == (dense if writer else set()) | (experts if first else set()), held
    assert set(state) == (dense if writer else set()) | (experts if first else set()), state
    mine = local_experts(E, EP, mesh.ep_rank)
    for name, p in model.named_parameters():
        for key, value in state.get(name, {}).items():
            want = serial_state[name][key]
            want_key = want[mine.start:mine.stop] if is_expert(p) else want
            assert_moments_close(value, want_key, name + key)
    whole = expert_blocks(model, mesh, state, writer)  # collective over the writer's ep group
    assert set(whole) == (experts if first else set())
    serial_params = dict(serial.named_parameters())
    for name, (weights, moments) in whole.items():
        torch.testing.assert_close(weights, serial_params[name].detach(), rtol=1e-5, atol=1e-7)
        for key, value in moments.items():
            assert_moments_close(value, serial_state[name][key], name + key)


def reference_for(dp, cp, case, sync, model, plain_runs):
    """The serial run `case` = (zero, optimizer, compression) must equal: PowerSGD's reference
    (the first Qs seeded by the parameters' places in `sync`'s buckets), else the plain one
    (kept in `plain_runs` per optimizer)."""
    _, kind, compression = case
    if kind not in plain_runs:
        plain_runs[kind] = serial_run(dp, cp, kind)
    if compression != "powersgd":
        return plain_runs[kind]
    names = {id(p): n for n, p in model.named_parameters()}
    index_of = {names[id(p)]: i for b in sync.buckets for i, p in enumerate(b.params)}
    plain = plain_runs[kind][0]
    ref = serial_run(dp, cp, kind, PowerSGDReference(dp, index_of))
    lossy = max(float((a - b).abs().max()) for a, b in
                zip(plain.parameters(), ref[0].parameters()))
    assert lossy > 1e-3, lossy  # PowerSGD changed the training: the parity below can fail
    return ref


def worker(dp, cp, cases):
    mesh = Mesh(Layout(dp=dp, cp=cp, ep=EP), dist.get_rank())
    mine = local_experts(E, EP, mesh.ep_rank)
    dp_ranks = tuple(dist.get_process_group_ranks(mesh.dp_cp_group))
    ep_ranks = tuple(dist.get_process_group_ranks(mesh.ep_group))
    edp_ranks = tuple(dist.get_process_group_ranks(mesh.expert_dp_group))
    out, plain_runs = {}, {}
    for case in map(_case, cases):
        zero, kind, compression = case
        model, weights, norms, calls, sync, opt = parallel_run(mesh, *case)
        serial, serial_norms, serial_state = reference_for(dp, cp, case, sync, model, plain_runs)
        if zero:
            check_checkpoint_state(model, mesh, opt, serial, serial_state, sync)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(serial_norms),
                                   rtol=1e-5, atol=0, msg=f"{case} grad norms")
        for (name, p), w, want in zip(model.named_parameters(), weights, serial.parameters()):
            want = want[mine.start:mine.stop] if is_expert(p) else want
            if compression == "powersgd":  # 1e-5 of the tensor's largest entry (tp_utils's
                # parity measure): the QR of P turns the ~1e-7 reordering of its sums over
                # ranks into ~5e-7 absolute in the small entries of the result
                assert_close(w, want, 1e-5, f"{case} {name}")
                continue
            torch.testing.assert_close(w, want.detach(), rtol=1e-5, atol=1e-7,
                                       msg=f"{case} {name}")
        t = traffic(calls)
        dense = sum(p.numel() for p in model.parameters() if not is_expert(p))
        experts = sum(p.numel() for p in model.parameters() if is_expert(p))
        kinds = {(b.group_size, tuple(dist.get_process_group_ranks(b.group)))
                 for b in sync.buckets}
        padded = [sum(b.padded for b in sync.buckets if is_expert(b.params[0]) == expert)
                  for expert in (False, True)]
        role = {dp_ranks: "dp", ep_ranks: "ep", edp_ranks: "expert dp"}
        order = [(c.op, role.get(c.ranks, c.ranks), c.numel if c.op != "all_to_all_single"
                  else "rows routed") for c in calls]
        dense_wire, expert_wire = (wire_elements([p for p in model.parameters()
                                                  if is_expert(p) == expert])
                                   for expert in (False, True))
        counts = [sum(is_expert(p) == expert for p in model.parameters())
                  for expert in (False, True)]
        out[case] = {"traffic": t, "dense": dense, "experts": experts, "kinds": kinds,
                     "order": order, "wire": (dense_wire, expert_wire), "counts": counts,
                     "dense_padded": padded[0], "expert_padded": padded[1],
                     "groups": (dp_ranks, ep_ranks, edp_ranks)}
    return out


def _case(case):
    """(zero, optimizer, compression) of a case given as a ZeRO stage or a partial tuple."""
    case = (case,) if isinstance(case, int) else tuple(case)
    return case + ("adamw", "none")[len(case) - 1:]


TRUST = [(zero, kind) for zero in (1, 2, 3) for kind in ("lamb", "lars")]


@pytest.mark.parametrize("dp,cp,cases", [
    (4, 1, (0, 1, 2, 3, *TRUST, (0, "lamb"), (0, "adamw", "powersgd"))),
    (2, 2, (0, 2, 3, (0, "lars"), (2, "lars"), (3, "lamb"))),
    (2, 1, (1, 3, (0, "lars"), (1, "lamb"), (2, "lars"), (3, "lars"),
            (0, "adamw", "powersgd")))])
def test_ep2_training_equals_one_process_and_counts_its_traffic(dp, cp, cases):
    """dp 4 x ep 2 (every grad sync kind, LAMB and LARS under each ZeRO stage, PowerSGD),
    cp 2 x dp 2 x ep 2 (all-reduce, ZeRO-2 and ZeRO-3, with LARS / LAMB), dp 2 x ep 2 (ZeRO-1
    and ZeRO-3 with an expert group of one rank: each rank holds its experts' whole state, and
    no ZeRO stage (ZeRO-0's all-reduce included) issues a collective over that group;
    LAMB / LARS, PowerSGD with the experts uncompressed); every rank issues the same
    collectives in the same order. LAMB / LARS's ratio of an expert parameter is the one
    process's, of the whole stacked [E, ...] tensor: its norm sums over ep (ZeRO-0), or over
    expert dp and ep (ZeRO-1/2/3: both together are the dp group)."""
    edp = dp * cp // EP
    outs = run_local(worker, dp * cp, dp, cp, cases)
    for rank, res in enumerate(outs):
        for (zero, kind, compression), r in res.items():
            dp_ranks, ep_ranks, edp_ranks = r["groups"]
            assert len(edp_ranks) == edp and len(ep_ranks) == EP
            assert r["kinds"] == {(dp * cp, dp_ranks), (edp, edp_ranks)}, (rank, zero, r["kinds"])
            t = dict(r["traffic"])
            a2a = t.pop(("all_to_all_single", ep_ranks))
            assert a2a[0] == 5 * M, (rank, zero, a2a)  # counts, rows out / back, 2 in backward
            trust = kind in ("lamb", "lars")
            rows = 2 * sum(r["counts"]) if trust else 0  # each parameter's two squared sums
            if zero == 0:
                # the experts' squared norm over ep; LAMB / LARS: the experts' rows of the
                # parameters' norms over ep too (at dp == ep, ep's group is dp's)
                over_ep = (1 + trust, 1 + rows)
                norm = over_ep[1] if ep_ranks == dp_ranks else 0
                if ep_ranks != dp_ranks:
                    assert t.pop(("all_reduce", ep_ranks)) == over_ep, (rank, kind)
                dense, experts = r["dense"], r["experts"]
                if compression == "powersgd":  # the factors; one rank's experts: none
                    dense, experts = r["wire"][0], (r["wire"][1] if edp > 1 else 0)
                assert t.pop(("all_reduce", dp_ranks))[1] == dense + norm
                # over a one-rank expert dp no collective (nor its cast): a bucket is its sum
                assert t.pop(("all_reduce", edp_ranks), (0, 0))[1] == (experts if edp > 1 else 0)
            else:
                # the norm of the slices; LAMB / LARS: each parameter's two squared sums of
                # its slices over dp (an expert's: its slices over expert dp, its experts
                # over ep, together dp's group)
                assert t.pop(("all_reduce", dp_ranks)) == (1 + trust, 1 + rows), (rank, kind)
                rounds = M if zero == 2 else 1  # ZeRO-2 reduces every micro-batch
                # ZeRO-3: the model is one unit (its experts a unit led by it), gathered in
                # each micro-batch's forward (kept for its backward), reduced once a step
                gathers = M if zero == 3 else 1
                # counted: a reduce-scatter's whole input, an all-gather's slice
                scatter, gather = "reduce_scatter_tensor", "all_gather_into_tensor"
                dense, experts = r["dense_padded"], r["expert_padded"]
                # over a one-rank expert dp no collective: ZeRO-3 keeps the experts' unit
                # whole, ZeRO-1 / 2's buckets are their own sum and gather
                kept = 0 if edp == 1 else 1
                assert t.pop((scatter, dp_ranks))[1] == rounds * dense
                assert t.pop((scatter, edp_ranks), (0, 0))[1] == kept * rounds * experts
                calls = [t.pop((gather, dp_ranks)), t.pop((gather, edp_ranks), (0, 0))]
                assert [n for _, n in calls] == [gathers * dense // (dp * cp),
                                                 kept * gathers * experts // edp], (rank, calls)
                if zero == 3:  # a call per gather of each unit
                    assert [c for c, _ in calls] == [M, kept * M], (rank, calls)
                assert r["dense"] <= dense < r["dense"] + 32 * dp * cp
                assert r["experts"] <= experts < r["experts"] + 32 * edp
            assert not t, (rank, zero, t)
    for case in map(_case, cases):  # one launch order of every group's collectives per rank
        orders = {tuple(res[case]["order"]) for res in outs}
        assert len(orders) == 1, (case, orders)
