"""Bucketed data-parallel gradient averaging: bucket layout, one all-reduce per bucket per step
(not per micro-batch), launched during the last backward, equal to the plain per-param average."""

import torch
import torch.distributed as dist
from torch import nn

from megapar.data_parallel import GradBuckets, make_buckets
from megapar.launcher import run_local
from megapar.models import GPT2Config
from megapar.training.build import build_stage
from tp_utils import assert_close, make_mesh

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


def test_dp1_is_a_no_op():
    p = nn.Parameter(torch.ones(3))
    sync = GradBuckets([p], None)
    assert sync.buckets == []
    p.grad = torch.full((3,), 2.0)
    sync.begin_step()
    sync.before_last_backward()
    sync.finish()
    assert torch.equal(p.grad, torch.full((3,), 2.0))


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
    assert unused.grad is None
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
