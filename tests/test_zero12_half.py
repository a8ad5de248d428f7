"""ZeRO-1 / 2's 16-bit all-gather (`optim/zero.py`, `ZeroOptimizer._gather_half`): under bf16 /
fp16 autocast the blocks' linear weights are laid out in buckets of their own, and after each
step each rank rounds its own slice of those to the autocast dtype, the ranks all-gather the
16-bit values, and each keeps the others' slices rounded (its own stays the exact fp32 master).

Autocast casts a linear's fp32 weight before every product; the cast of a rounded value is the
cast of the exact one, so the steps and an evaluation are bitwise those of the same run gathering
fp32 (the control: `optimizer.half` set to None, same buckets), and after `exact_params` (what
checkpoints and exports call) the parameters are too. Checked in layouts that read the weights in
each way a linear can (tp with sequence parallelism, a pipeline, fp16, Llama's grouped k / v),
with the bytes counted: every step's all-gathers move 2 bytes an element of the 16-bit buckets
instead of 4. A wrong cast (fp16 under bf16 autocast) or a rank rounding its own master is seen.
"""

import pytest
import torch
import transformers

import megapar
from megapar.launcher import run_local
from megapar.optim.offload import HOST_COPIES_ENV
from megapar.training.config import TrainConfig
from test_zero3_half import (  # the same models and batches
    GBS,
    GPT,
    LLAMA,
    SEQ,
    STEPS,
    _batches,
    compiled_aot_eager,
)


def _config(kind: str):
    if kind == "gpt2":
        return transformers.GPT2Config(**GPT)
    return transformers.LlamaConfig(**LLAMA)  # grouped k / v: 2 heads, split at tp 2


def _engine(kind: str, settings: dict):
    return megapar.prepare(_config(kind), micro_batch_size=2, lr=3e-3, clip_grad=1.0,
                           global_batch_size=GBS, seq_len=SEQ, seed=5,
                           **{"precision": "bf16", **settings})


def _exact(engine) -> tuple[list[torch.Tensor], int, list[int]]:
    """The parameters made exact (`exact_params`), how many of their elements it changed (the
    other ranks' slices of the 16-bit buckets, held rounded until then), and the fp32 bytes
    this rank put into all-gathers at a first and a second call."""
    from megapar.comm_count import count_collectives

    held = [p.detach().clone() for p in engine.model.parameters()]
    moved = []
    for _ in range(2):
        with count_collectives() as calls:
            engine.exact_params()
        moved.append(_gathered(calls)[1])
    exact = [p.detach().clone() for p in engine.model.parameters()]
    return exact, sum(int((a != b).sum()) for a, b in zip(held, exact)), moved


def _gathered(calls) -> tuple[int, int]:
    gathers = [c for c in calls if c.op.startswith("all_gather")]
    return (sum(c.bytes for c in gathers if c.dtype.itemsize == 2),
            sum(c.bytes for c in gathers if c.dtype == torch.float32))


def _run(kind: str, settings: dict, half, mutate: str = ""):
    """`STEPS` steps and an evaluation with the 16-bit all-gather in `half` (None: the
    control's fp32 gathers, same buckets): per step (loss, grad norm), the evaluation's loss,
    the exact parameters after, per step the bytes put into 16-bit and fp32 all-gathers, and
    each 16-bit bucket's (padded elements, shards), and the elements `exact_params` changed."""
    from megapar.comm_count import count_collectives

    engine = _engine(kind, settings)
    opt = engine.optimizer
    assert opt.half == {"bf16": torch.bfloat16, "fp16": torch.float16}[
        settings.get("precision", "bf16")]
    opt.half = half
    if mutate == "own":  # a rank rounding its own slice too: its master is no longer exact
        cls = type(opt)

        def keep_none(self, b, flat, dtype, host):
            out = cls._gather_half(self, b, flat, dtype, host)
            out.lo = out.hi = 0
            return out

        opt._gather_half = keep_none.__get__(opt)
    steps, moved = [], []
    for batch in _batches()[:STEPS]:
        with count_collectives() as calls:
            r = engine.run_step(engine.split(batch))
        steps.append((r.loss, r.grad_norm))
        moved.append(_gathered(calls))
    evaluated = engine.eval_step(_batches()[STEPS])
    buckets = [(b.padded, b.group_size) for b in engine.grad_sync.buckets if b.half]
    exact, changed, exact_moved = _exact(engine)
    return steps, evaluated, exact, moved, buckets, changed, exact_moved


def _compare(kind: str, settings: dict, mutate: str = "", piece_bytes: int = 0):
    """`_run` with the 16-bit gather (`mutate`d) and the control; `piece_bytes`: gloo's
    collectives cut into pieces of that many bytes (`shard_comm.HOST_PIECE_BYTES`)."""
    if piece_bytes:
        from megapar.data_parallel import shard_comm

        shard_comm.HOST_PIECE_BYTES = piece_bytes  # a forked worker: the patch ends with it
    wrong = torch.float16 if mutate == "dtype" else torch.bfloat16
    half = {"bf16": wrong, "fp16": torch.float16}[settings.get("precision", "bf16")]
    return _run(kind, settings, half, mutate), _run(kind, settings, None)


def _check(ours, theirs):
    assert ours[0] == theirs[0], (ours[0], theirs[0])  # losses, grad norms: == on floats
    assert ours[1] == theirs[1], (ours[1], theirs[1])
    assert len(ours[2]) == len(theirs[2])
    assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))
    buckets = ours[4]
    assert buckets, "no 16-bit bucket"
    slices = sum(n // shards for n, shards in buckets)  # what this rank puts in
    moved16 = [a[0] - b[0] for a, b in zip(ours[3], theirs[3])]  # (SP gathers bf16 too)
    saved32 = [b[1] - a[1] for a, b in zip(ours[3], theirs[3])]
    assert moved16 == [2 * slices] * STEPS and saved32 == [4 * slices] * STEPS, (
        ours[3], theirs[3], buckets)
    assert ours[5] > 0 and theirs[5] == 0, (ours[5], theirs[5])  # rounded until made exact
    # made exact by one fp32 gather of the 16-bit buckets alone; nothing to do after that
    assert ours[6] == [4 * slices, 0] and theirs[6] == [0, 0], (ours[6], theirs[6], slices)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("kind,world,settings", [
    ("gpt2", 2, {}),
    ("gpt2", 4, dict(tp=2, sequence_parallel=True)),
    ("gpt2", 4, dict(pp=2)),
    ("gpt2", 2, dict(precision="fp16")),
    ("llama", 4, dict(tp=2)),
])
def test_zero12_gathers_the_blocks_linear_weights_in_16_bits(zero, kind, world, settings):
    """Bitwise the fp32 gathers' losses, grad norms, evaluation and (made exact) weights; the
    16-bit buckets' all-gathers move 2 bytes an element instead of 4."""
    for ours, theirs in run_local(_compare, world, kind, {**settings, "zero": zero}):
        _check(ours, theirs)


def test_gloo_gathers_large_16_bit_buckets_in_pieces_bitwise():
    """A 16-bit bucket above `shard_comm.HOST_PIECE_BYTES` (here 16 KiB) is gathered in pieces
    on gloo, each staged and copied back: the same numbers and bytes."""
    for ours, theirs in run_local(_compare, 2, "gpt2", {"zero": 2}, "", 16384):
        _check(ours, theirs)
        assert max(n for n, _ in ours[4]) * 2 > 16384  # a 16-bit bucket goes in pieces


@pytest.mark.parametrize("mutate", ["dtype", "own"])
def test_a_wrong_16_bit_gather_is_seen(mutate):
    """The comparison above fails, on the numbers, for a cast to another dtype than
    autocast's (fp16 under bf16) and for a rank that rounds its own slice (its fp32 master)."""
    for ours, theirs in run_local(_compare, 2, "gpt2", {"zero": 1}, mutate):
        with pytest.raises(AssertionError):
            _check(ours, theirs)
        weights = all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))
        assert (ours[0], ours[1], weights) != (theirs[0], theirs[1], True)


def test_zero12_gathers_16_bits_only_under_16_bit_autocast():
    """On under bf16 / fp16 ZeRO-1 / 2 (--offload-optimizer too: its masters are this rank's
    slices); off in fp32 and at other ZeRO stages."""
    assert TrainConfig(zero=1, precision="bf16").zero12_half is torch.bfloat16
    assert TrainConfig(zero=2, precision="fp16").zero12_half is torch.float16
    assert TrainConfig(zero=1, precision="bf16", offload_optimizer=True).zero12_half
    for off in (dict(zero=1), dict(zero=2), dict(zero=0, precision="bf16"),
                dict(zero=3, precision="bf16")):
        assert TrainConfig(**off).zero12_half is None, off


def _save_resume(kind: str, settings: dict, root: str):
    """With the 16-bit gather: steps 1-2, a save, step 3 (straight), and a fresh engine loading
    the save and running step 3; the control (fp32 gathers) saving at step 2 too. Returns the
    straight run's step 3 and weights, the resumed run's, and (on rank 0) every saved tensor of
    both saves, by file."""
    from pathlib import Path

    from safetensors.torch import load_file

    batches = _batches()
    saved = {}
    for name, half in (("ours", True), ("control", False)):
        engine = _engine(kind, settings)
        if not half:
            engine.optimizer.half = None
        for batch in batches[:2]:
            engine.run_step(engine.split(batch))
        saved[name] = engine.save(f"{root}/{name}")
        engine.wait_save()
        if half:
            straight = engine.run_step(engine.split(batches[2])), _exact(engine)[0]
            host = engine.optimizer.host  # --offload-optimizer's host masters: none re-read
            assert host is None or (host.copies and host.refreshed == 0)
    resumed = _engine(kind, settings)
    resumed.load(f"{root}/ours")
    again = resumed.run_step(resumed.split(batches[2])), _exact(resumed)[0]
    files = {}
    if torch.distributed.get_rank() == 0:
        for name, path in saved.items():
            files[name] = {f.name: load_file(f) for f in sorted(Path(path).glob("*.safetensors"))}
    return straight, again, files


@pytest.mark.parametrize("zero,settings", [(1, {}), (2, dict(async_save=True)),
                                           (1, dict(offload_optimizer=True))])
def test_a_save_at_step_2_is_the_fp32_gathers_save_and_resumes_bitwise(zero, settings,
                                                                         tmp_path):
    """The checkpoint is made exact first (`Engine.saved_model`; --async-save's host copy
    too): its tensors are those the control saves, and resuming from it gives the straight
    run's step 3 and weights bit for bit. With --offload-optimizer (separate host masters, as
    on a GPU) the masters are this rank's slices, never rounded, and making the weights exact
    does not make the next step re-read them."""
    env = {HOST_COPIES_ENV: "1"} if settings.get("offload_optimizer") else None
    out = run_local(_save_resume, 2, "gpt2", {**settings, "zero": zero}, str(tmp_path),
                    env=env)
    for (step, weights), (step2, weights2), _ in out:
        assert (step.loss, step.grad_norm) == (step2.loss, step2.grad_norm)
        assert all(torch.equal(a, b) for a, b in zip(weights, weights2, strict=True))
    files = out[0][2]
    assert files["ours"].keys() == files["control"].keys() and files["ours"]
    for name, tensors in files["ours"].items():
        theirs = files["control"][name]
        assert tensors.keys() == theirs.keys(), name
        assert all(torch.equal(tensors[k], theirs[k]) for k in tensors), name


@pytest.mark.parametrize("spec,world", [("tp=1,pp=1,dp=2,mbs=2,zero=1", 2),
                                        ("tp=1,pp=1,dp=2,mbs=2,zero=2", 2),
                                        ("tp=2,pp=2,dp=2,mbs=1,zero=1", 8)])
def test_the_plan_counts_the_16_bit_buckets_as_the_dry_run_does(spec, world):
    """megapar-plan lays the 16-bit buckets out apart (`GatherCasts.zero12_half`) and counts 2
    bytes an element for their all-gather: in bf16 the plan's state and dp traffic equal the
    dry run's to the byte (--verify), and the step gathers fewer bytes than in fp32 by half
    the 16-bit buckets' fp32 bytes."""
    from verified import verified

    from megapar.models.recipes import resolve_model
    from megapar.plan import Problem, parse_candidate
    from megapar.plan.estimate import estimate, layout_of
    from megapar.plan.fp8 import zero3_casts
    from megapar.plan.state import groups_traffic, zero_traffic

    config, c = resolve_model("gpt2-tiny"), parse_candidate(spec, world)
    gathered, traffic = {}, {}
    for precision in ("bf16", "fp32"):
        p = Problem(config, world, global_batch=8, seq_len=16, precision=precision)
        # (rank order tp-pp-dp) stage 0 and the last, as the plan compares them (--verify)
        result, reports = verified(p, c, sorted({0, c.tp * (c.pp - 1)}))
        assert result.error == "" and result.differences == [], result
        assert zero3_casts(p, c).half == (precision == "bf16")
        r = reports[0]
        memory = estimate(p, c).memory  # the search's own figures (`StageLayout.trimmed`)
        loaded = next(x for x in reports if x.pp_rank == memory.stage)  # its most loaded
        assert (memory.params, memory.grads, memory.optimizer) == (
            loaded.weights, loaded.grads, loaded.optimizer), spec
        traffic[precision] = zero_traffic(layout_of(p, c))["dp"]
        planned = groups_traffic({"dp": traffic[precision]}, c.zero, 8 // (c.mbs * c.dp),
                                 c.pp)["dp"]
        for op, n, nbytes in planned:
            assert r.comm["dp"][op] == {"count": n, "bytes": int(nbytes)}, (op, r.comm["dp"])
        gathered[precision] = r.comm["dp"]["all_gather"]["bytes"]
    half, full = traffic["bf16"], traffic["fp32"]
    assert half.pieces > full.pieces and half.nbytes >= full.nbytes  # more buckets, padded
    assert 0 < gathered["bf16"] < gathered["fp32"], gathered


def _compiled_compare(kind: str, settings: dict):
    """`_compare` with `--compile`'s blocks compiled (`test_zero3_half.compiled_aot_eager`)."""
    return compiled_aot_eager(_compare, kind, settings)


def test_compiled_blocks_read_the_16_bit_gathered_weights_bitwise():
    """Under --compile the traced linears cast the rounded weights as autocast does eagerly:
    ZeRO-2 at dp 2 bitwise its fp32 gathers, the 16-bit buckets gathered at 2 bytes."""
    for ours, theirs in run_local(_compiled_compare, 2, "gpt2", {"zero": 2}):
        _check(ours, theirs)
