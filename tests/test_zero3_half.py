"""ZeRO-3's 16-bit all-gather (`data_parallel/zero3_half.py`): under bf16 / fp16 autocast the
blocks' linear weights gather in the autocast dtype, each rank rounding its slice, and the
linears read the gathered copy in place of autocast's cast of the fp32 weight.

The rounding is elementwise, so the copy is the cast bit for bit: the losses, the evaluation
after the steps (fp32 gathers again) and everything after are bitwise those of the same units
gathered in fp32 (the control: `HalfGather.units` emptied), in layouts that read the weight in
each way a linear can (tp with sequence parallelism and --sp-regather's own autograd function,
a zero-bubble pipeline's deferred weight gradients with full recomputation, fp16, Llama's grouped
k / v, a mixture of experts under ep). The bytes are counted: each micro-batch's forward and
backward gather every 16-bit unit, 2 bytes an element instead of 4. (ZeRO-3 in bf16 against one
process: tests/test_zero3.py.)
"""

import pytest
import torch
import transformers

import megapar
from megapar.launcher import run_local
from megapar.tensor_parallel.weight_copy import WeightCopy
from megapar.training.config import TrainConfig

VOCAB, SEQ, GBS, STEPS = 96, 16, 8, 3
GPT = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
           embd_pdrop=0.0, attn_pdrop=0.0)
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
             tie_word_embeddings=False)


def _batches():
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS + 1):
        ids = torch.randint(0, VOCAB, (GBS, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _config(kind: str):
    if kind == "gpt2":
        return transformers.GPT2Config(**GPT)
    if kind == "llama-mqa":  # one k / v head: at tp 2 replicated (`ReplicatedHeads`)
        return transformers.LlamaConfig(**{**LLAMA, "num_key_value_heads": 1})
    return transformers.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2)


def _steps(kind: str, settings: dict):
    """`STEPS` ZeRO-3 steps and an evaluation, with the 16-bit all-gather and without (the
    same units gathered in fp32). Per run: the losses, the evaluation's loss, per step the
    bytes put into 16-bit and into fp32 all-gathers, the 16-bit units' 16-bit and fp32
    buffer bytes, and whether any gathered buffer was left after the steps."""
    from megapar.comm_count import count_collectives

    runs = []
    for half in (True, False):
        engine = megapar.prepare(_config(kind), micro_batch_size=2, lr=3e-3, clip_grad=1.0,
                                 global_batch_size=GBS, seq_len=SEQ, seed=5, zero=3,
                                 **{"precision": "bf16", **settings})
        sharded = engine.sharded_params
        units = list(sharded.half.units)
        if not half:
            sharded.half.units = []
        losses, gathered16, gathered32 = [], [], []
        for batch in _batches()[:STEPS]:
            with count_collectives() as calls:
                losses.append(engine.train_step(batch))
            gathers = [c for c in calls if c.op.startswith("all_gather")]
            gathered16.append(sum(c.bytes for c in gathers if c.dtype.itemsize == 2))
            gathered32.append(sum(c.bytes for c in gathers if c.dtype == torch.float32))
        left = sharded.gathered_bytes()
        runs.append((losses, engine.eval_step(_batches()[STEPS]), gathered16, gathered32,
                     [u.cast.nbytes for u in units], [u.nbytes for u in units], left))
    return runs


@pytest.mark.parametrize("kind,world,settings,m", [
    ("gpt2", 4, dict(tp=2, sequence_parallel=True, sp_regather=True), 2),
    ("gpt2", 4, dict(pp=2, schedule="zb-h1", recompute="full"), None),
    ("gpt2", 2, dict(precision="fp16"), 2),
    ("llama-mqa", 4, dict(tp=2), 2),  # k / v kept whole on each tp rank: read in fp32
    ("mixtral", 4, dict(ep=2), 1),
])
def test_zero3_gathers_the_blocks_linear_weights_in_16_bits(kind, world, settings, m):
    """Bitwise the fp32 gathers' numbers; every 16-bit unit gathered in each micro-batch's
    forward and backward at 2 bytes an element (each rank puts in its slice, 1 / dp), its fp32
    buffer never: the fp32 gathers shrink by twice that; nothing left gathered after a step."""
    for ours, theirs in run_local(_steps, world, kind, settings):
        assert (ours[0], ours[1]) == (theirs[0], theirs[1]), (ours[:2], theirs[:2])
        held16, held32 = ours[4], ours[5]
        assert held16 and [2 * n for n in held16] == held32  # a 16-bit unit per block
        assert theirs[2] == [0] * STEPS or "sequence_parallel" in settings
        moved16 = [a - b for a, b in zip(ours[2], theirs[2], strict=True)]
        saved32 = [b - a for a, b in zip(ours[3], theirs[3], strict=True)]
        if m is not None:  # (under pp the stages' micro-batches differ: the ratio below)
            dp = world // settings.get("tp", 1) // settings.get("pp", 1)
            assert moved16 == [2 * m * sum(held16) // dp] * STEPS, (moved16, held16)
        assert moved16[0] > 0 and saved32 == [2 * n for n in moved16], (moved16, saved32)
        assert ours[6] == theirs[6] == 0


def _offloaded_steps(settings: dict, ckpt: str | None):
    """`_steps` under --offload-params (and --offload-optimizer) with separate host masters, as
    on CUDA; per run also: per step the bytes of 16-bit shards rounded (on the device, from the
    fp32 staging shard the host master was copied to: never from a host master), the host
    masters after the steps (fp32), and with `ckpt` the loss of the last step and the masters
    after it once more from a checkpoint saved before it."""
    import os

    from megapar.data_parallel.zero3_half import HalfShard
    from megapar.device import HOST_COPIES_ENV

    os.environ[HOST_COPIES_ENV] = "1"
    cast = HalfShard.cast
    staged, masters_at = [], set()

    def counted(self, shard):
        assert shard.dtype == torch.float32 and self.shard.dtype == torch.bfloat16
        assert shard.data_ptr() not in masters_at  # the staging shard, not the host master
        staged[-1] += self.shard_nbytes
        return cast(self, shard)

    HalfShard.cast = counted
    settings = {**settings, "offload_params": True, "offload_optimizer": True}
    runs = []
    for half in (True, False):
        engine = megapar.prepare(_config("gpt2"), micro_batch_size=2, lr=3e-3, clip_grad=1.0,
                                 global_batch_size=GBS, seq_len=SEQ, seed=5, zero=3,
                                 precision="bf16", **settings)
        sharded = engine.sharded_params
        assert all(u.host_shard is not None for u in sharded.units)
        masters_at.update(u.host_shard.data_ptr() for u in sharded.units)
        units = list(sharded.half.units)
        if not half:
            sharded.half.units = []
        from megapar.comm_count import count_collectives

        losses, gathered16, gathered32, moved = [], [], [], []
        for i, batch in enumerate(_batches()[:STEPS]):
            if ckpt and half and i == STEPS - 1:
                engine.save(ckpt)
            staged.append(0)
            with count_collectives() as calls:
                losses.append(engine.train_step(batch))
            moved.append(staged[-1])
            gathers = [c for c in calls if c.op.startswith("all_gather")]
            gathered16.append(sum(c.bytes for c in gathers if c.dtype.itemsize == 2))
            gathered32.append(sum(c.bytes for c in gathers if c.dtype == torch.float32))
        masters = [u.host_shard.clone() for u in sharded.units]
        assert {m.dtype for m in masters} == {torch.float32}
        runs.append((losses, engine.eval_step(_batches()[STEPS]), gathered16, gathered32,
                     [u.cast.nbytes for u in units], moved, masters,
                     sharded.gathered_bytes()))
    if ckpt:
        engine = megapar.prepare(_config("gpt2"), micro_batch_size=2, lr=3e-3, clip_grad=1.0,
                                 global_batch_size=GBS, seq_len=SEQ, seed=5, zero=3,
                                 precision="bf16", **settings)
        import glob

        engine.load(sorted(glob.glob(f"{ckpt}/step_*"))[-1])
        loss = engine.train_step(_batches()[STEPS - 1])
        runs.append((loss, [u.host_shard.clone() for u in engine.sharded_params.units]))
    return runs


@pytest.mark.parametrize("world,settings", [(2, {}), (4, dict(tp=2))])
def test_offloaded_shards_gather_in_16_bits(tmp_path, world, settings):
    """--offload-params (host masters, the optimizer offloaded too): each gather of a 16-bit
    unit copies this rank's fp32 host master to the device staging shard and rounds it there
    (the master is only read), then gathers the 16 bits as without offload. Bitwise the fp32
    gathers' losses, evaluation and masters; 2 bytes an element rounded and gathered per use
    (twice per micro-batch), the fp32 gathers shrinking by twice that, no gathered buffer or
    staging shard left after the steps; at dp 2 a resume from a checkpoint saved before the
    last step repeats that step bit for bit."""
    ckpt = str(tmp_path / "ckpt") if world == 2 else None
    m = GBS // 2 // (world // settings.get("tp", 1))
    for out in run_local(_offloaded_steps, world, settings, ckpt):
        ours, theirs = out[0], out[1]
        assert (ours[0], ours[1]) == (theirs[0], theirs[1]), (ours[:2], theirs[:2])
        assert all(torch.equal(a, b) for a, b in zip(ours[6], theirs[6], strict=True))
        held16, dp = ours[4], world // settings.get("tp", 1)
        assert held16 and theirs[2] == [0] * STEPS and theirs[5] == [0] * STEPS
        moved16 = [a - b for a, b in zip(ours[2], theirs[2], strict=True)]
        saved32 = [b - a for a, b in zip(ours[3], theirs[3], strict=True)]
        assert moved16 == ours[5] == [2 * m * sum(held16) // dp] * STEPS, (moved16, ours[5])
        assert saved32 == [2 * n for n in moved16] and ours[7] == theirs[7] == 0
        if ckpt:
            loss, masters = out[2]
            assert loss == ours[0][-1]
            assert all(torch.equal(a, b) for a, b in zip(masters, ours[6], strict=True))


def test_zero3_gathers_16_bits_only_where_autocast_casts_the_weights():
    """On under bf16 / fp16 ZeRO-3 (--compile'd blocks and --offload-params too); off in fp32
    and at other ZeRO stages."""
    on = TrainConfig(zero=3, precision="bf16")
    assert on.zero3_half is torch.bfloat16
    assert TrainConfig(zero=3, precision="fp16", compile=True).zero3_half is torch.float16
    offloaded = TrainConfig(zero=3, precision="bf16", offload_params=True, offload_optimizer=True)
    assert offloaded.zero3_half is torch.bfloat16
    for off in (dict(zero=3), dict(zero=2, precision="bf16")):
        assert TrainConfig(**off).zero3_half is None, off


def test_a_live_weight_copy_is_read_only_under_its_autocast():
    """A copy stands for autocast's cast: read without autocast (or under another dtype) it
    would change the numbers, so it refuses, naming the fix; its gradient is the cast's (fp32,
    to the weight)."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    copy = WeightCopy(weight.detach().to(torch.bfloat16))
    copy.live = True
    with pytest.raises(RuntimeError, match="without it: run a step's forwards under"):
        copy.read(weight)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError):
        copy.read(weight)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(x, copy.read(weight)).float().sum().backward()
        ours = weight.grad.clone()
        weight.grad = None
        torch.nn.functional.linear(x, weight).float().sum().backward()
    assert ours.dtype == torch.float32 and torch.equal(ours, weight.grad)


@pytest.mark.parametrize("spec,world", [("tp=1,pp=1,dp=2,mbs=2,zero=3", 2),
                                        ("tp=2,pp=2,dp=2,mbs=1,zero=3", 8),
                                        ("tp=1,pp=1,dp=2,mbs=2,zero=3,offload=both", 2)])
def test_the_plan_counts_the_16_bit_gathers_as_the_dry_run_does(spec, world):
    """megapar-plan models the 16-bit units (`plan.params.GatherCasts`): in bf16 the plan's
    units, state, gathered peak and dp traffic equal the dry run's to the byte (--verify), and
    it gathers fewer bytes than in fp32, where every unit gathers fp32."""
    from verified import verified

    from megapar.models.recipes import resolve_model
    from megapar.plan import Problem, parse_candidate, stage_memory
    from megapar.plan.estimate import layout_of
    from megapar.plan.fp8 import zero3_casts
    from megapar.plan.state import groups_traffic, zero_traffic

    config, c = resolve_model("gpt2-tiny"), parse_candidate(spec, world)
    gathered = {}
    for precision in ("bf16", "fp32"):
        p = Problem(config, world, global_batch=8, seq_len=16, precision=precision)
        result, [r] = verified(p, c, [0])  # rank 0's dry run, compared with the plan
        assert result.error == "" and result.differences == [], result
        gathered[precision] = stage_memory(p, c)[0].gathered
        assert zero3_casts(p, c).half == (precision == "bf16")
        planned = groups_traffic(
            zero_traffic(layout_of(p, c)),
            3, 8 // (c.mbs * c.dp), c.pp)["dp"]
        for op, n, nbytes in planned:
            assert r.comm["dp"][op] == {"count": n, "bytes": int(nbytes)}, (op, r.comm["dp"])
    assert 0 < gathered["bf16"] < gathered["fp32"], gathered


def compiled_aot_eager(run, kind: str, settings: dict):
    """`run(kind, settings)` with `--compile`'s blocks compiled by torch's "aot_eager" backend
    (dynamo and AOTAutograd as with Inductor, the graphs run as eager ATen calls:
    tests/test_compile.py says why); in a forked worker, where the patch ends with it."""
    import torch._dynamo

    torch._dynamo.reset()

    def aot_eager(fn, *, _compile=torch.compile, **kwargs):
        return _compile(fn, backend="aot_eager", **kwargs)

    torch.compile = aot_eager
    return run(kind, {**settings, "compile": True})


def _compiled_steps(kind: str, settings: dict):
    """`_steps` with `--compile`'s blocks compiled (`compiled_aot_eager`)."""
    return compiled_aot_eager(_steps, kind, settings)


def test_compiled_blocks_read_the_16_bit_copies():
    """Under --compile the traced linears read the gathered 16-bit copies too (the copy's
    live flag and autograd function are traced): bitwise the compiled blocks' fp32 gathers,
    the fp32 buffers never gathered in a step."""
    for ours, theirs in run_local(_compiled_steps, 2, "gpt2", {}):
        assert (ours[0], ours[1]) == (theirs[0], theirs[1]), (ours[:2], theirs[:2])
        assert ours[2] == [2 * 2 * sum(ours[4]) // 2] * STEPS and theirs[2] == [0] * STEPS


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_gathered_peak_holds_the_cast_shard_of_the_gather_in_flight(run, monkeypatch,
                                                                        precision):
    """A 16-bit unit's gather sends this rank's slice rounded to 16 bits, made at the launch
    and freed when the gather is waited for: while a block runs its forward with the next one
    prefetched, the next one's 16-bit shard is held beside the gathered units. A real run
    (forked gloo ranks, the gathers whole and async as NCCL runs them), the dry run and the
    plan count it alike: gpt2-tiny at dp 2, bf16, the units' buffers plus a block's 16-bit
    half-buffer / dp (fp32: no shard). The three left it out: 13,114,368 bytes each, 49,152
    (a block's 49,152 16-bit linear weight elements over 2 ranks) under the peak."""
    from megapar.data_parallel import shard_comm
    from megapar.data_parallel.sharded_params import ShardedParams
    from megapar.dryrun import dry_run
    from megapar.dryrun.measure import measured_rank
    from megapar.mesh import Layout
    from megapar.models.recipes import resolve_model
    from megapar.plan.params import GatherCasts, StageLayout, stage_tensors, stage_units
    from megapar.plan.state import rank_state
    from megapar.plan.zero3_peaks import gathered_peak
    from megapar.training.config import TrainConfig

    config = resolve_model("gpt2-tiny")
    cfg = TrainConfig(dp=2, seq_len=16, micro_batch_size=2, global_batch_size=8, zero=3,
                      precision=precision)
    monkeypatch.setattr(shard_comm, "HOST_PIECE_BYTES", 2**40)  # whole, async gathers
    monkeypatch.setattr(ShardedParams, "HOST_PIECE_MB", 2.0**40)
    real = run(measured_rank, 2, cfg.to_dict(), config.to_dict(), 1)
    dry = dry_run(cfg, config, Layout(1, 1, 2), [0, 1])
    half = precision == "bf16"
    at = StageLayout.of(config, dp=2, zero=3, casts=GatherCasts(half=half))
    planned = rank_state(at, 0).gathered
    assert [r.gathered for r in dry] == [m["gathered"] for m in real] == [planned] * 2
    # without the shard: the units' buffers alone, as the plan counted them before
    specs = stage_units(at)
    tensors = stage_tensors(at)
    full = [-(-sum(tensors[i].numel for i in u.tensors) // 2) * 2 * (2 if u.cast else 4)
            for u in specs]
    shard = max(n // 2 for u, n in zip(specs, full) if u.cast) if half else 0
    assert planned == gathered_peak(specs, full, False) + shard
    assert (shard > 0) == half
