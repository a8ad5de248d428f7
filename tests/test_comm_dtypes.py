"""--p2p-dtype and --grad-reduce-dtype: pipeline messages and the data-parallel gradient
reduction in a narrower dtype, counted in bytes and bounded in effect.

Defaults follow Megatron-LM (`comm_dtypes`): messages in the compute dtype, gradients reduced in
fp32 under bf16 and in fp16 under fp16. Only the wire narrows: activations and gradients are
cast back on receipt, gradients accumulate and step in fp32, so the effect on the losses is one
rounding to the wire dtype per message / reduction (unit roundoff 2^-8 = 3.9e-3 for bf16).
"""

import pytest
import torch
import torch.distributed as dist

import megapar
from megapar.data_parallel import GradBuckets
from megapar.data_parallel.zero_buckets import Zero1Buckets
from megapar.launcher import run_local
from megapar.optim.precision import comm_dtypes

VOCAB, SEQ, G, MBS, H, STEPS = 96, 8, 8, 2, 32, 4


def test_defaults_follow_megatron():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert comm_dtypes("fp32") == (f32, f32)
    assert comm_dtypes("bf16") == (bf16, f32)  # bf16 gradients are reduced in fp32
    assert comm_dtypes("fp16") == (f16, f16)
    assert comm_dtypes("fp32", "bf16", "fp16") == (bf16, f16)
    assert comm_dtypes("bf16", "fp32", "bf16") == (f32, bf16)
    with pytest.raises(ValueError, match="--p2p-dtype 'int8' is invalid"):
        comm_dtypes("fp32", "int8")


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=H, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=None, eos_token_id=None))


def _batches():
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (G, SEQ), generator=gen)
        out.append({"input_ids": x, "labels": (x * 3 + 1) % VOCAB})
    return out


RUNS = {  # name: (precision, p2p dtype, grad-reduce dtype, zero)
    "fp32": ("fp32", "auto", "auto", 0),
    "fp32_narrow": ("fp32", "bf16", "bf16", 0),
    "fp32_reduce_bf16": ("fp32", "auto", "bf16", 0),  # the tied embedding's test's
    "fp32_narrow_zero1": ("fp32", "bf16", "bf16", 1),
    "fp32_narrow_zero2": ("fp32", "bf16", "bf16", 2),
    "bf16": ("bf16", "auto", "auto", 0),
    "bf16_wide": ("bf16", "fp32", "auto", 0),
}


def _tied_grads(engine):
    """This rank's copies of the tied embedding's gradient as the last step left it (the first
    stage's embedding, the last stage's head; both at pp 1): the reduced one at --zero 0."""
    return [p.grad.clone() for name, p in engine.model.named_parameters()
            if "embed.word.weight" in (name, getattr(p, "tied_to", None))]


def _train_all():
    out = {}
    for name, (precision, p2p, reduce, zero) in RUNS.items():
        engine = megapar.prepare(_model(), pp=2, micro_batch_size=MBS, lr=3e-3,
                                 precision=precision, zero=zero, p2p_dtype=p2p,
                                 grad_reduce_dtype=reduce)
        losses, tied = [], None
        for b in _batches():
            losses.append(engine.train_step(b))
            if name == "fp32_reduce_bf16" and tied is None:  # the first step's
                tied = _tied_grads(engine)
        buckets = engine.grad_sync.buckets
        out[name] = {"losses": losses, "p2p_bytes": engine.executor.p2p.bytes_sent,
                     "dp_bytes": engine.grad_sync.bytes_sent,
                     "buffer": sum(b.padded for b in buckets),
                     "deferred": sum(b.padded for b in buckets if b.deferred),
                     "tied_grads": tied}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_local(_train_all, 4)  # pp 2 x dp 2


@pytest.mark.parametrize("name", list(RUNS))
def test_bytes_per_step_are_the_wire_dtype_s(runs, name):
    precision, p2p, reduce, _ = RUNS[name]
    wire, reduced = comm_dtypes(precision, p2p, reduce)
    m = G // (MBS * 2)  # micro-batches per dp rank
    for rank, out in enumerate(runs):
        r = out[name]
        # each stage sends one message per micro-batch: activations down, gradients up
        assert r["p2p_bytes"] == STEPS * m * MBS * SEQ * H * wire.itemsize, (rank, r)
        # the whole padded gradient buffer is reduced (all-reduced, or reduce-scattered) once;
        # ZeRO-2 every micro-batch, but the tied embedding's deferred bucket once
        reductions = m * (r["buffer"] - r["deferred"]) + r["deferred"] if RUNS[name][3] == 2 \
            else r["buffer"]
        assert r["dp_bytes"] == STEPS * reductions * reduced.itemsize, (rank, r)


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_narrow_wire_stays_within_its_rounding(runs):
    out = runs[0]
    fp32, narrow, bf16, wide = (out[k]["losses"] for k in ("fp32", "fp32_narrow", "bf16",
                                                            "bf16_wide"))
    # bf16 on the wire is really used (the losses move) ...
    assert narrow != fp32 and bf16 != wide
    # ... and moves them by about its rounding, far less than an error in the path would (a
    # gradient dropped or not cast back gives O(1) differences). Measured over these 4 steps:
    # 5.4e-5 (fp32 compute, bf16 wire and reduction) and 2.0e-5 (bf16 compute, bf16 vs fp32
    # wire); 1e-3 (a quarter of one bf16 roundoff) leaves room for other machines' kernels.
    assert _rel(narrow, fp32) < 1e-3, (narrow, fp32)
    assert _rel(bf16, wide) < 1e-3, (bf16, wide)
    # the distributed optimizer reduce-scatters the same bf16 wire: the same numbers as the
    # all-reduce up to that rounding
    assert _rel(out["fp32_narrow_zero1"]["losses"], narrow) < 1e-3  # measured 1.6e-6
    assert _rel(out["fp32_narrow_zero2"]["losses"], narrow) < 1e-3
    for rank_out in runs:  # every rank reports the same losses
        assert rank_out["bf16"]["losses"] == bf16 and rank_out["fp32_narrow"]["losses"] == narrow


def _reduce_in(dtype, sharded):
    torch.manual_seed(10 + dist.get_rank())
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    kind = Zero1Buckets if sharded else GradBuckets
    sync = kind(params, dist.group.WORLD, reduce_dtype=dtype)
    sync.begin_step()
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    sync.finish()
    lo, hi = sync.shard_range(sync.buckets[0])
    return [g for g in grads], sync.buckets[0].flat[lo:hi].clone(), (lo, hi)


@pytest.mark.parametrize("sharded", [False, True])
def test_bucket_reduced_in_bf16_is_the_rounded_average(sharded):
    outs = run_local(_reduce_in, 2, torch.bfloat16, sharded)
    # the bucket holds the parameters in reverse order
    flat = [torch.cat([g.reshape(-1) for g in reversed(o[0])]) for o in outs]
    halves = [(f / 2).to(torch.bfloat16).float() for f in flat]
    expected = (halves[0] + halves[1]).to(torch.bfloat16).float()
    exact = (flat[0] + flat[1]) / 2
    for rank, (_, got, (lo, hi)) in enumerate(outs):
        n = min(hi, expected.numel()) - lo
        assert torch.equal(got[:n], expected[lo:lo + n]), rank  # two roundings, nothing else
        assert not torch.equal(got[:n], exact[lo:lo + n])  # and really in bf16
        # error bound of two bf16 roundings (unit roundoff 2^-8): the halves', then the sum's
        scale = (flat[0].abs() + flat[1].abs())[lo:lo + n] / 2
        assert ((got[:n] - exact[lo:lo + n]).abs() <= 2 ** -7 * scale).all(), rank


def _tied_grad_at_pp_1():
    """`runs`' fp32_reduce_bf16 first step at pp 1 x dp 2: the tied embedding's gradient reduced
    in bf16."""
    engine = megapar.prepare(_model(), micro_batch_size=MBS, lr=3e-3, grad_reduce_dtype="bf16")
    engine.train_step(_batches()[0])
    return _tied_grads(engine)


def test_a_bf16_reduction_of_a_tied_embedding_rounds_the_stages_sum_as_pp_1_does(runs):
    # at pp 2 the first and last stage each hold a share of the tied embedding's gradient;
    # each share was cast and reduced apart and the two summed afterwards, so 1,216 of its
    # 4,096 elements differed from pp 1's (which rounds their sum), 373 by more than one
    # rounding (2^-8 of the value), up to half of it. Now the stages sum first and the sum is
    # rounded: measured equal to pp 1's, bit for bit (m = 2 micro-batches per dp rank)
    [want] = run_local(_tied_grad_at_pp_1, 2)[0]
    got = [out["fp32_reduce_bf16"]["tied_grads"] for out in runs]  # pp 2 x dp 2
    assert [len(g) for g in got] == [1, 1, 1, 1]  # the embedding and its copy, on both dp ranks
    for [g] in got:
        assert ((g - want).abs() <= 2**-8 * want.abs()).all(), (g - want).abs().max()
