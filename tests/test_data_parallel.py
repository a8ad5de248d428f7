"""Bucketed data-parallel gradient averaging: bucket layout, one all-reduce per bucket per step
(not per micro-batch), launched during the last backward, equal to the plain per-param average."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from tp_utils import assert_close, make_mesh

from megapar.data_parallel import GradBuckets, make_buckets
from megapar.launcher import run_local
from megapar.models import GPT2Config
from megapar.pipeline.partition import build_stage

M, MBS, SEQ, VOCAB = 3, 2, 8, 100
CONFIG = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    make_vocab_size_divisible_by=16)


def test_make_buckets_reverse_order_and_size_limit():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 200, 300, 50, 1000)]
    kib = 4 * 400 / 2**20  # 400 fp32 elements per bucket
    buckets = make_buckets(params, kib)
    layout = [[p.numel() for p in b.params] for b in buckets]
    # Reverse registration order; a bucket closes before it would pass 400 elements, and a
    # parameter larger than the limit gets a bucket of its own.
    assert layout == [[1000], [50, 300], [200, 100]]
    assert sum(b.numel for b in buckets) == sum(p.numel() for p in params)


def test_make_buckets_never_mix_dtypes():
    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64)),
              nn.Parameter(torch.zeros(4))]
    buckets = make_buckets(params, 25.0)
    assert [[p.dtype for p in b.params] for b in buckets] == \
        [[torch.float32], [torch.float64], [torch.float32]]


def grad_view(sync, param: nn.Parameter) -> torch.Tensor:
    """The buffer view that is `param`'s gradient: its range of its bucket."""
    for b in sync.buckets:
        offset = 0
        for p in b.params:
            if p is param:
                return b.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    raise KeyError("not a parameter of this GradBuckets")


def test_dp1_grads_live_in_the_buffer_and_nothing_is_communicated():
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))
    sync = GradBuckets([p, q], None)
    for _ in range(2):   # the second step reuses the buffer, zeroed
        p.grad = q.grad = None        # what the optimizer's zero_grad does
        sync.begin_step()
        (2 * p.sum() + 3 * q.sum()).backward()
        sync.before_last_backward()
        (p.sum()).backward()
        sync.finish()
        assert torch.equal(p.grad, torch.full((3,), 3.0))
        assert torch.equal(q.grad, torch.full((2, 2), 3.0))
        buffer = sync.buffers[torch.float32]
        assert p.grad.data_ptr() == grad_view(sync, p).data_ptr()
        assert torch.equal(buffer, torch.cat([q.grad.reshape(-1), p.grad]))   # reverse order


def test_a_replaced_grad_is_adopted_into_the_buffer():
    """Code that assigns .grad instead of accumulating in place still gets the right result."""
    p = nn.Parameter(torch.ones(4))
    sync = GradBuckets([p], None)
    sync.begin_step()
    p.grad = torch.full((4,), 5.0)
    sync.finish()
    assert torch.equal(sync.buffers[torch.float32], torch.full((4,), 5.0))
    assert p.grad.data_ptr() == grad_view(sync, p).data_ptr()


def _micro_batches(rank: int) -> list[dict]:
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each dp rank
    out = []
    for _ in range(M):
        ids = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": torch.roll(ids, -1, 1)})
    return out


def _dp_worker(bucket_mb: float) -> dict:
    mesh = make_mesh(dp=2)
    model = build_stage(CONFIG, mesh, seed=3)
    params = list(model.parameters())
    # Registered first, so it lands in the LAST bucket; it never gets a gradient.
    unused = nn.Parameter(torch.zeros(5))
    sync = GradBuckets([unused] + params, mesh.dp_group, bucket_mb)
    micro = _micro_batches(dist.get_rank())

    phase = ["idle"]
    calls: list[tuple] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append((phase[0], kwargs.get("group") is mesh.dp_group, kwargs.get("async_op")))
        return real_all_reduce(tensor, *args, **kwargs)

    def step(grad_sync):
        for p in params:
            p.grad = None
        if grad_sync:
            grad_sync.begin_step()
        for i, mb in enumerate(micro):
            phase[0] = "backward"
            if grad_sync and i == M - 1:
                grad_sync.before_last_backward()
                phase[0] = "last backward"
            (model(None, mb) / M).backward()
        phase[0] = "finish"
        if grad_sync:
            grad_sync.finish()
        phase[0] = "idle"

    step(None)  # reference: accumulate locally, then average each parameter on its own
    expected = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        real_all_reduce(g, group=mesh.dp_group)
        expected[n] = g / 2
    # The ranks saw different data, so averaging is not a no-op.
    assert not torch.allclose(model.embed.position.weight.grad, expected["embed.position.weight"])

    dist.all_reduce = counting_all_reduce
    try:
        per_step = []
        for _ in range(2):  # twice: the protocol resets between steps
            calls.clear()
            step(sync)
            per_step.append(list(calls))
    finally:
        dist.all_reduce = real_all_reduce
    for n, p in model.named_parameters():
        assert_close(p.grad, expected[n], what=f"averaged grad of {n}")
        view = grad_view(sync, p)   # averaged in place: .grad is still the buffer view
        assert p.grad.data_ptr() == view.data_ptr() and p.grad.shape == view.shape
    assert torch.equal(unused.grad, torch.zeros(5))   # unused on this stage: zero, and reduced
    return {"buckets": len(sync.buckets), "calls": per_step}


def test_one_all_reduce_per_bucket_per_step_overlapped_with_last_backward():
    outs = run_local(_dp_worker, 2, 0.01)  # ~10 KB buckets: several per step
    for rank, out in enumerate(outs):
        n = out["buckets"]
        assert n >= 4, f"test needs several buckets, got {n}"
        for calls in out["calls"]:
            # Exactly one all-reduce per bucket per step, none per micro-batch.
            assert len(calls) == n, f"rank {rank}: {len(calls)} all-reduces for {n} buckets"
            assert all(on_dp and async_op for _, on_dp, async_op in calls)
            phases = [phase for phase, _, _ in calls]
            assert "backward" not in phases, "gradient accumulation must not communicate"
            # Every bucket but the last (it holds the unused parameter) is launched while the
            # last micro-batch's backward is still running; finish() launches the rest.
            assert phases == ["last backward"] * (n - 1) + ["finish"], phases


def test_averaged_grads_match_single_bucket():
    # One bucket for everything gives the same result (and one all-reduce per step).
    outs = run_local(_dp_worker, 2, 1000.0)
    for out in outs:
        assert out["buckets"] == 1
        assert [len(c) for c in out["calls"]] == [1, 1]


def _grads_ready_worker():
    rank = dist.get_rank()
    mesh = make_mesh(dp=2)
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    sync = GradBuckets([a, b], mesh.dp_group, bucket_mb=4 * 3 / 2**20)   # one bucket each
    a.grad = b.grad = None
    sync.begin_step()
    sync.before_last_backward()
    loss = (rank + 1) * (a.sum() + 2 * b.sum())
    ga, gb = torch.autograd.grad(loss, [a, b])   # weight grads outside AccumulateGrad
    b.grad.add_(gb)                              # accumulated in place, as zero-bubble does
    sync.grads_ready([b])
    launched_early = sync.next_launch            # b's bucket (registered last) goes first
    a.grad.add_(ga)
    sync.grads_ready([a])
    sync.finish()
    return launched_early, a.grad.tolist(), b.grad.tolist()


def test_grads_ready_launches_buckets_for_weight_grads_made_outside_autograd_accumulation():
    for launched, a, b in run_local(_grads_ready_worker, 2):
        assert launched == 1
        assert a == [1.5] * 3 and b == [3.0] * 2   # mean of (1, 2) and of (2, 4)


def _zb_overlap_worker():
    from megapar.models import GPT2Config
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage

    mesh = make_mesh(pp=2, dp=2)
    config = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=4, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = build_stage(config, mesh, seed=0)
    sync = GradBuckets(list(model.parameters()), mesh.dp_group, bucket_mb=0.002)
    executor = PipelineExecutor(model, mesh, "zb-h1", (2, 8, 16))
    phase, launched, launch, finish = ["program"], [], sync._launch, sync.finish
    sync._launch = lambda b: (launched.append(phase[0]), launch(b))[1]
    sync.finish = lambda: (phase.__setitem__(0, "finish"), finish())[1]
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    batches = [{"input_ids": (ids := torch.randint(0, 64, (2, 8), generator=gen)),
                "labels": ids} for _ in range(4)]
    executor.run(batches, grad_sync=sync)
    return launched, len(sync.buckets)


def test_zero_bubble_dp_reduction_overlaps_the_last_weight_gradient_pass():
    """ZB-H1 defers weight gradients to W: the buckets launch as the last W finishes each
    layer's weights (and the last B the other parameters'), not all at the end of the step."""
    for launched, buckets in run_local(_zb_overlap_worker, 4):
        assert buckets >= 4 and len(launched) == buckets
        assert launched.count("program") == buckets, launched  # every one before finish()


def _overlap_count_worker(schedule: str, virtual_stages: int):
    from megapar.models import GPT2Config
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage
    from megapar.pipeline.schedules import placement_of

    mesh = make_mesh(pp=2, dp=2)
    config = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=4, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = build_stage(config, mesh, seed=0, virtual_stages=virtual_stages,
                        placement=placement_of(schedule))
    sync = GradBuckets(list(model.parameters()), mesh.dp_group, bucket_mb=0.002)
    executor = PipelineExecutor(model, mesh, schedule, (2, 8, 16), virtual_stages=virtual_stages)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    batches = [{"input_ids": (ids := torch.randint(0, 64, (2, 8), generator=gen)),
                "labels": ids} for _ in range(4)]
    counts = []
    for _ in range(2):
        executor.run(batches, grad_sync=sync)
        counts.append((sync.launched_in_step, sync.launched_in_finish))
    return counts, len(sync.buckets)


@pytest.mark.parametrize("schedule, virtual_stages",
                         [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                          ("zb-v", 2), ("dualpipev", 2)])
def test_every_schedule_launches_its_buckets_during_the_step(schedule, virtual_stages):
    """The dp reduction overlaps the backward under every schedule: each bucket launches as its
    gradients become final, none waits for finish(). Interleaved stages hold two chunks whose
    last backwards come apart; the later chunk's parameters fill the first buckets, so when the
    hooks were armed only before the stage's last backward every bucket launched in finish()."""
    for counts, buckets in run_local(_overlap_count_worker, 4, schedule, virtual_stages):
        assert buckets >= 4
        assert counts == [(buckets, 0)] * 2, (schedule, counts, buckets)


def _tied_copies_worker(schedule: str, zero: int, reduce_dtype):
    """Three steps of gpt2 at pp 2 x dp 4 (each dp rank its own data); returns this rank's
    coordinates and its tied embedding's weights (the first stage's and / or the copy)."""
    from test_comm_counts import CONFIGS, MBS, SEQ

    from megapar.data_parallel import build_grad_sync
    from megapar.mesh import Layout, Mesh
    from megapar.optim import LRScheduler, Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.tensor_parallel.partition import shared_embedding_params
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(1, 2, 4), dist.get_rank())
    v = schedule == "zb-v"
    vocab, hidden = 1000, 64  # gloo sums a small buffer in one order on every rank
    config = GPT2Config(**{**CONFIGS["gpt2"], "n_layer": 4, "vocab_size": vocab, "n_embd": hidden})
    model = build_stage(config, mesh, seed=0,
                        virtual_stages=2 if v else 1, placement="v" if v else "loop")
    executor = PipelineExecutor(model, mesh, schedule, (MBS, SEQ, hidden))
    optimizer = build_optimizer(model, mesh, 1e-2, 0.1, zero=zero)
    sync = build_grad_sync(model, mesh, zero, 25.0, reduce_dtype=reduce_dtype)  # one bucket
    step = TrainStep(model, mesh, executor, optimizer,
                     LRScheduler(1e-2, 1e-3, 0, 10, "constant"), Precision("fp32", mesh.device),
                     1.0, grad_sync=sync)
    gen = torch.Generator().manual_seed(100 + mesh.dp_rank)
    for i in range(3):
        batches = []
        for _ in range(4):
            ids = torch.randint(0, vocab, (MBS, SEQ), generator=gen)
            batches.append({"input_ids": ids, "labels": (ids + 1) % vocab})
        step.step(batches, i)
    if zero == 3:  # the whole parameters, gathered (their storage is freed between steps)
        with sync.whole():
            return (mesh.pp_rank, mesh.dp_rank,
                    [p.detach().clone() for p in shared_embedding_params(model)])
    return mesh.pp_rank, mesh.dp_rank, [p.detach().clone() for p in shared_embedding_params(model)]


@pytest.mark.parametrize("schedule,zero,reduce_dtype", [
    ("1f1b", 0, torch.float16), ("1f1b", 1, None), ("1f1b", 2, None), ("1f1b", 3, None),
    ("zb-v", 1, None), ("zb-v", 3, None), ("zb-v", 0, torch.bfloat16)])
def test_the_tied_embeddings_copies_stay_bitwise_equal(schedule, zero, reduce_dtype):
    """Where the tied embedding's sum over the first and last stage precedes the dp reduction
    (ZeRO; the all-reduce in 16 bits), each end reduced its copy in its own order of summation
    over dp 4 (a ring's depends on where the copy lies in its bucket or unit), and the copies
    drifted apart (docs/testing.md). The first stage's reduced gradient replaces the last's
    (`pipeline.tied.equal_tied_grads`); in the V placement (ZB-V) both are on pp rank 0."""
    out = run_local(_tied_copies_worker, 8, schedule, zero, reduce_dtype)
    held: dict[int, list] = {}
    for _, dp_rank, weights in out:
        held.setdefault(dp_rank, []).extend(weights)
    assert sorted(held) == [0, 1, 2, 3]
    for dp_rank, weights in held.items():
        assert len(weights) == 2, (dp_rank, len(weights))  # the embedding and its copy
        assert torch.equal(weights[0], weights[1]), (
            f"dp rank {dp_rank}: copies differ by {(weights[0] - weights[1]).abs().max():.3g}")
    assert not torch.equal(held[0][0], out[0][2][0] * 0)  # trained, not zeros
