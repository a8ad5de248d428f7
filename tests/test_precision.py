"""Mixed precision: autocast modes, the dynamic loss scaler, and fp16 overflow handling agreed
over the whole world (an inf on one rank makes every rank skip the step and back off)."""

import json
import math

import pytest
import torch
import torch.distributed as dist

from megapar.launcher import run_local
from megapar.optim import DynamicLossScaler, Precision

SCALE = 2.0**8


def test_scaler_backs_off_and_grows():
    s = DynamicLossScaler(init_scale=64.0, growth_interval=3)
    s.update(found_inf=True)
    assert s.scale == 32.0 and s.clean_steps == 0
    for _ in range(2):
        s.update(False)
    assert s.scale == 32.0
    s.update(False)
    assert s.scale == 64.0 and s.clean_steps == 0
    restored = DynamicLossScaler(init_scale=64.0, growth_interval=3)
    restored.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert restored == s


def _overflow_pattern(steps: int = 600) -> list[bool]:
    """Overflow flags: runs of clean steps (long enough to grow the scale) and bursts of
    overflows (long enough to reach a floor of 2^4 from 2^7), seeded."""
    import random

    rng, flags = random.Random(0), []
    while len(flags) < steps:
        flags += [False] * rng.choice([0, 3, 4, 9, 14, 25]) + [True] * rng.choice([1, 1, 2, 3, 8])
    return flags[:steps]


class _MegatronReference:
    """Megatron-LM's DynamicGradScaler.update (megatron/core/optimizer/grad_scaler.py), in
    fp32 tensors as there."""

    def __init__(self, initial, minimum, interval, hysteresis):
        self.scale = torch.tensor([initial], dtype=torch.float)
        self.min_scale = torch.tensor([minimum], dtype=torch.float)
        self.interval, self.hysteresis = interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = torch.max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * 2.0


class _DeepSpeedReference:
    """DeepSpeed's DynamicLossScaler.update_scale (runtime/fp16/loss_scaler.py) with
    consecutive_hysteresis False (its default) and raise_error_at_min_scale off."""

    def __init__(self, initial, minimum, window, hysteresis):
        self.cur_scale, self.min_scale, self.window = initial, minimum, window
        self.delayed_shift = self.cur_hysteresis = hysteresis
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= 2.0
        self.cur_iter += 1


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_the_scale_sequence_is_megatrons_and_deepspeeds(hysteresis):
    """Against transcriptions of Megatron-LM's and DeepSpeed's dynamic scalers: the same scale
    after every step of a pattern that grows the scale, backs off through the hysteresis and
    sits at the floor; at hysteresis 1 also torch.amp.GradScaler's update kernel (no floor)."""
    flags = _overflow_pattern()
    ours = DynamicLossScaler(init_scale=2.0**7, growth_interval=4, min_scale=2.0**4,
                             hysteresis=hysteresis)
    megatron = _MegatronReference(2.0**7, 2.0**4, 4, hysteresis)
    deepspeed = _DeepSpeedReference(2.0**7, 2.0**4, 4, hysteresis)
    scales = []
    for found_inf in flags:
        for scaler in (ours, megatron, deepspeed):
            scaler.update(found_inf)
        assert ours.scale == megatron.scale.item() == deepspeed.cur_scale, len(scales)
        scales.append(ours.scale)
    assert min(scales) == 2.0**4 and max(scales) >= 2.0**9  # the floor and growth both reached
    assert scales.count(2.0**4) >= 5  # several steps at the floor
    if hysteresis == 1:  # torch's GradScaler has no floor: a pattern that never reaches one
        torch_scale, tracker = torch.tensor([2.0**20]), torch.zeros(1, dtype=torch.int32)
        ours = DynamicLossScaler(init_scale=2.0**20, growth_interval=4, min_scale=2.0**-100)
        for found_inf in flags:
            torch._amp_update_scale_(torch_scale, tracker, torch.tensor([float(found_inf)]),
                                     2.0, 0.5, 4)
            ours.update(found_inf)
            assert ours.scale == torch_scale.item() and ours.clean_steps == tracker.item()
        assert ours.scale > 2.0**-100


def test_the_scaler_state_resumes_mid_hysteresis():
    """A scaler restored from a JSON round trip of its state (as checkpoints hold it) between
    two overflows of its hysteresis continues as the one that never stopped; its settings are
    the new run's (Megatron-LM restores the scale and trackers only)."""
    flags = _overflow_pattern(200)
    whole = DynamicLossScaler(init_scale=2.0**7, growth_interval=4, min_scale=2.0**4,
                              hysteresis=3)
    for found_inf in flags[:41]:
        whole.update(found_inf)
    assert 0 < whole.hysteresis_left < 3  # mid-hysteresis
    resumed = DynamicLossScaler(init_scale=2.0**7, growth_interval=4, min_scale=2.0**4,
                                hysteresis=3)
    resumed.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    for found_inf in flags[41:]:
        whole.update(found_inf)
        resumed.update(found_inf)
        assert resumed == whole
    other = DynamicLossScaler(init_scale=2.0**10, growth_interval=9, hysteresis=2)
    other.load_state_dict(whole.state_dict())
    assert (other.scale, other.growth_interval, other.hysteresis) == (whole.scale, 9, 2)
    # a checkpoint from before the hysteresis (its settings saved beside the scale): the
    # scale and clean steps resume, the hysteresis counts as used up (it was 1)
    older = {"init_scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": 3, "min_scale": 1.0, "scale": 32.0, "clean_steps": 2}
    other.load_state_dict(older)
    assert (other.scale, other.clean_steps, other.hysteresis_left) == (32.0, 2, 0)
    assert (other.init_scale, other.growth_interval) == (2.0**10, 9)


def test_a_restored_scale_below_the_floor_starts_at_it():
    """A resume given a higher --min-loss-scale restored the scale below it: an overflow there
    then raised it (max(min, scale / 2)) and was reported as "its floor" (a precision tryout)."""
    scaler = DynamicLossScaler(init_scale=2.0**26, min_scale=2.0**24, hysteresis=1)
    scaler.load_state_dict({"scale": 2.0**23, "clean_steps": 0, "hysteresis_left": 1})
    assert scaler.scale == 2.0**24
    scaler.update(True)
    assert scaler.scale == 2.0**24


def test_a_resumed_mixture_of_experts_at_another_micro_batch_size_says_so():
    """moe.md: a MoE's balancing loss and capacity are per micro-batch, so another
    --micro-batch-size on resuming changes the objective; it was said nowhere at the resume (a
    new user's tryout of moe.md). A dense model's, or the same size, says nothing."""
    from megapar.models.recipes import resolve_model
    from megapar.training.config import parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    def notes(model: str, *flags: str) -> list[str]:
        cfg = parse_args(["--load", "ck", *flags])
        meta = {"train_config": {"micro_batch_size": 2, "tokenizer": "gpt2"}}
        manifest = {"meta": meta, "model": resolve_model(model).to_dict()}
        return [n for n in settings_from_checkpoint(cfg, manifest) if "differs" in n]

    assert notes("mixtral-tiny", "--micro-batch-size", "4") == [
        "--micro-batch-size 4 differs from the checkpoint's 2: a mixture of experts computes "
        "its balancing loss and capacity per micro-batch, so from here the objective differs, "
        "not only the rounding"]
    assert notes("llama-tiny", "--micro-batch-size", "4") == []
    assert notes("mixtral-tiny", "--micro-batch-size", "2") == notes("mixtral-tiny") == []


def test_a_resume_in_another_precision_says_so():
    """--load of an fp16 run given --precision bf16 (or a bf16 run given fp16) changed the
    step's rounding and dropped (or started) the loss scale without a word, where another --fp8
    is noted (a re-test); the same precision, or none given, says nothing."""
    from megapar.training.config import parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    def notes(saved: str, *flags: str) -> list[str]:
        cfg = parse_args(["--load", "ck", *flags])
        meta = {"train_config": {"precision": saved, "tokenizer": "gpt2"}}
        return [n for n in settings_from_checkpoint(cfg, {"meta": meta}) if "differs" in n]

    assert notes("fp16", "--precision", "bf16") == [
        "--precision bf16 differs from the checkpoint's --precision fp16: from here the step "
        "runs in bf16; the checkpoint's loss scale is dropped (only fp16 scales the loss), so "
        "the loss may move by the change of rounding"]
    assert notes("bf16", "--precision", "fp16", "--initial-loss-scale", "1024") == [
        "--precision fp16 differs from the checkpoint's --precision bf16: from here the step "
        "runs in fp16; its loss scale starts at --initial-loss-scale 1024, so the loss may "
        "move by the change of rounding"]
    assert notes("bf16", "--precision", "fp32")[0].endswith("runs in fp32, so the loss may "
                                                            "move by the change of rounding")
    assert notes("fp16", "--precision", "fp16") == notes("fp16") == []
    # a --min-loss-scale above the checkpoint's scale raised it unsaid (a re-test)
    cfg = parse_args(["--load", "ck", "--min-loss-scale", "8388608"])
    meta = {"train_config": {"precision": "fp16", "tokenizer": "gpt2"},
            "scaler": {"mode": "fp16", "scaler": {"scale": 4194304.0, "min_scale": 1.0}}}
    assert ("--min-loss-scale 8388608 is above the checkpoint's loss scale 4194304: the "
            "scale starts at 8388608") in settings_from_checkpoint(cfg, {"meta": meta})
    # a loss scale a message names is whole, as given (was 4294967296.0, 4.0; a re-test)
    from megapar.training.usage import flag_with_value
    assert flag_with_value("initial_loss_scale", 4294967296.0) == "--initial-loss-scale 4294967296"
    assert flag_with_value("min_loss_scale", 0.5) == "--min-loss-scale 0.5"
    assert flag_with_value("clip_grad", 1.0) == "--clip-grad 1.0"  # other values as they were
    # with --initial-loss-scale given the scale restarts there (its own note): not this one
    cfg = parse_args(["--load", "ck", "--min-loss-scale", "8388608", "--initial-loss-scale",
                      "16777216"])
    assert not any("is above the checkpoint's" in n
                   for n in settings_from_checkpoint(cfg, {"meta": meta}))
    # an fp32 checkpoint resumed in fp16 saved no loss scale: its recorded (default) scale
    # settings are not taken, so a refusal names no "value --load recorded" and no resumed
    # scale restarting (a re-test); an fp16 one's are
    from megapar.training.validate import UsageError, check_settings
    for saved, taken in (("fp32", False), ("fp16", True)):
        cfg = parse_args(["--load", "ck", "--precision", "fp16", "--min-loss-scale", "1e6"])
        meta = {"train_config": {"precision": saved, "tokenizer": "gpt2",
                                 "initial_loss_scale": 65536.0}}
        settings_from_checkpoint(cfg, {"meta": meta})
        assert ("initial_loss_scale" in cfg.from_checkpoint) is taken, saved
        with pytest.raises(UsageError) as info:
            check_settings(cfg)
        assert str(info.value).startswith("--min-loss-scale 1000000 is above ")
        assert ("restarts there" in str(info.value)) is taken, (saved, info.value)


def test_a_static_scale_never_changes():
    """--loss-scale (Megatron-LM's ConstantGradScaler): overflows and clean runs leave it, and
    a checkpoint's (dynamic) scale does not replace it."""
    static = DynamicLossScaler(init_scale=128.0, min_scale=128.0, growth_interval=2,
                               dynamic=False)
    for found_inf in _overflow_pattern(50):
        static.update(found_inf)
        assert static.scale == 128.0
    static.load_state_dict(DynamicLossScaler(init_scale=2.0**20).state_dict())
    assert static.scale == 128.0


def test_autocast_modes():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with Precision("fp32", "cpu").autocast():
        assert (a @ b).dtype == torch.float32
    with Precision("bf16", "cpu").autocast():
        assert (a @ b).dtype == torch.bfloat16
    assert Precision("bf16", "cpu").loss_scale == 1.0 and Precision("bf16", "cpu").scaler is None
    assert Precision("fp16", "cpu").loss_scale == 2.0**16
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        Precision("fp8", "cpu")


def test_unscale_and_check_single_process():
    prec = Precision("fp16", "cpu", DynamicLossScaler(init_scale=4.0))
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([4.0, 8.0, -2.0])
    assert prec.backward_scale(1) == 4.0 and prec.backward_scale(2) == 2.0
    assert prec.unscale_and_check([p], prec.backward_scale(1)) is False
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, -0.5]))
    p.grad = torch.tensor([2.0, 4.0, -1.0])  # backpropagated with the scale over dp 2
    assert prec.unscale_and_check([p], prec.backward_scale(2)) is False
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, -0.5]))
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert prec.unscale_and_check([p], 4.0) is True
    # Modes other than fp16 never scale and never skip.
    q = torch.nn.Parameter(torch.zeros(1))
    q.grad = torch.tensor([float("inf")])
    assert Precision("bf16", "cpu").backward_scale(4) == 1.0
    assert Precision("bf16", "cpu").unscale_and_check([q], 1.0) is False


INJECT_STEP, INJECT_RANK = 2, 3
STEPS = 5
"""Steps of each run: the skipped one (INJECT_STEP) with steps before and after it (test_parity_3d's
batches and schedule, which its parity runs take 3 of)."""


class InjectInf:
    """Executor wrapper: after the backward of step INJECT_STEP, rank INJECT_RANK (only) puts an
    inf in one gradient of a parameter no other rank holds a copy of."""

    def __init__(self, executor, model, rank, optimizer=None):
        self.executor, self.model, self.rank, self.calls = executor, model, rank, 0
        self.optimizer = optimizer
        """ZeRO-1 / 2: the inf goes into a gradient slice this rank reduced (the rest is unused
        or gone)."""

    def run(self, *args, **kwargs):
        loss = self.executor.run(*args, **kwargs)
        if self.calls == INJECT_STEP and self.rank == INJECT_RANK:
            if self.optimizer is not None:  # not the tied copy's: the first stage's replaces it
                from megapar.tensor_parallel.partition import is_shared_embedding

                opt = self.optimizer
                own = [t for t, (p, _, _) in zip(opt.pieces, opt._piece_of)
                       if not is_shared_embedding(p)]
                own[-1].grad[0] = float("inf")
            else:
                self.model.final_norm.weight.grad[0] = float("inf")
        self.calls += 1
        return loss


def _run(mode: str, inject: bool, zero: int = 0, offload: bool = False) -> dict:
    from test_parity_3d import (
        CONFIG,
        MBS,
        SEED,
        SEQ,
        G,
        config,
        global_batches,
        scheduler,
    )

    from megapar.mesh import Layout, Mesh
    from megapar.optim import build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage
    from megapar.training.step import BatchPlan, TrainStep

    mesh = Mesh(Layout(2, 2, 2), dist.get_rank())
    model = build_stage(config(), mesh, SEED)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, SEQ, CONFIG["n_embd"]))
    if zero == 3:  # the shards' optimizer (megapar-train's optimizer_for); offload: on the host
        from megapar.optim.zero3 import Zero3Optimizer

        optimizer = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, 3e-3, 0.1,
                                   tp_group=mesh.tp_group, offload=offload)
    else:
        optimizer = build_optimizer(model, mesh, 3e-3, 0.1, zero=zero)
    if inject:
        executor = InjectInf(executor, model, mesh.rank, optimizer if zero else None)
    precision = Precision(mode, mesh.device, DynamicLossScaler(init_scale=SCALE))
    from megapar.data_parallel import build_grad_sync

    step = TrainStep(model, mesh, executor, optimizer, scheduler(STEPS),
                     precision, 1.0, build_grad_sync(model, mesh, zero))
    plan = BatchPlan(G, MBS, mesh.dp)
    results, unchanged = [], []
    for i, batch in enumerate(global_batches(STEPS)):
        held = optimizer.pieces if zero == 3 else list(model.parameters())  # ZeRO-3: shards
        before = [p.detach().clone() for p in held]
        results.append(step.step(plan.split(batch, mesh.dp_rank), i))
        unchanged.append(all(torch.equal(a, p) for a, p in zip(before, held)))
    return {"results": results, "unchanged": unchanged, "scale": precision.loss_scale}


def _worker() -> dict:
    return {"fp32": _run("fp32", False), "bf16": _run("bf16", False), "fp16": _run("fp16", True),
            "fp16_zero1": _run("fp16", True, zero=1), "fp16_zero2": _run("fp16", True, zero=2),
            "fp16_zero3": _run("fp16", True, zero=3),
            "fp16_zero3_offload": _run("fp16", True, zero=3, offload=True)}


@pytest.fixture(scope="module")
def runs():
    return run_local(_worker, 8)


def test_bf16_tracks_fp32(runs):
    fp32 = [r.loss for r in runs[0]["fp32"]["results"]]
    bf16 = [r.loss for r in runs[0]["bf16"]["results"]]
    assert all(math.isfinite(x) for x in bf16)
    # bf16 keeps 8 mantissa bits (unit roundoff 2^-8 = 3.9e-3); matmul inputs are rounded to
    # it while weights, gradients and optimizer state stay fp32, so losses agree to a small
    # multiple of that roundoff, not to fp32 precision. 2e-2 relative is ~5 roundoffs; an error
    # in the bf16 path (e.g. weights updated in bf16, or a wrong cast) is far larger. Measured:
    # 5e-6 .. 4e-5 (the loss of a freshly initialised model, ~ln(vocab), is insensitive to
    # rounding of its small logits), so the bound has room for longer runs.
    for step, (a, b) in enumerate(zip(bf16, fp32)):
        assert abs(a - b) / b < 2e-2, f"step {step}: bf16 loss {a} vs fp32 {b}"
    assert fp32 != bf16, "bf16 run gave bitwise fp32 losses: autocast is not active"
    for out in runs:  # every rank reports the same bf16 losses and no skipped step
        assert [r.loss for r in out["bf16"]["results"]] == bf16
        assert not any(r.skipped for r in out["bf16"]["results"])


@pytest.mark.parametrize("run_name", ["fp16", "fp16_zero1", "fp16_zero2", "fp16_zero3",
                                      "fp16_zero3_offload"])
def test_fp16_inf_on_one_rank_skips_the_step_everywhere(runs, run_name):
    for rank, out in enumerate(runs):
        fp16 = out[run_name]
        skipped = [r.skipped for r in fp16["results"]]
        assert skipped == [i == INJECT_STEP for i in range(STEPS)], f"rank {rank}: {skipped}"
        # Weights untouched on every rank for that step, updated on the others.
        assert fp16["unchanged"] == skipped, f"rank {rank}: {fp16['unchanged']}"
        scales = [r.loss_scale for r in fp16["results"]]
        assert scales == [SCALE] * 3 + [SCALE / 2] * 2, f"rank {rank}: {scales}"
        assert fp16["scale"] == SCALE / 2
        assert math.isinf(fp16["results"][INJECT_STEP].grad_norm)
        fp32 = [r.loss for r in out["fp32"]["results"]]
        for i, r in enumerate(fp16["results"][:INJECT_STEP + 1]):  # same weights until the skip
            assert abs(r.loss - fp32[i]) / fp32[i] < 2e-2


@pytest.mark.parametrize("sharded", ["fp16_zero1", "fp16_zero2"])
def test_fp16_zero1_equals_fp16_without_zero(runs, sharded):
    """The distributed optimizer under fp16 (unscale and inf check on this rank's slices, norm
    from the slices) gives the plain fp16 run's losses and grad norms. The first step agrees to
    fp32 rounding (measured: loss bitwise, norm 3e-8); after it the weights differ by fp32
    rounding of the norm (a sum over slices instead of parameters), which fp16 autocast
    amplifies (measured by step 5: losses 2e-6, norms 5e-5 relative; fp32 runs stay ~1e-7
    apart), so later steps are held to fp16's unit roundoff (4.9e-4)."""
    for out in runs:
        for i, (a, b) in enumerate(zip(out["fp16"]["results"], out[sharded]["results"])):
            assert a.skipped == b.skipped and a.loss_scale == b.loss_scale
            tol = 1e-6 if i == 0 else 4.9e-4
            assert abs(a.loss - b.loss) <= tol * abs(a.loss), (i, a.loss, b.loss)
            if not a.skipped:
                assert abs(a.grad_norm - b.grad_norm) <= tol * a.grad_norm, (i, a, b)


def _fp16_skips(zero: int, reduce_dtype: str | None) -> list[tuple[bool, float]]:
    """(skipped, loss scale) of 6 fp16 steps of a seeded 2-layer GPT-2 from 2^24 (a window of
    2), 8 x 16 tokens a step in micro-batches of 2, at this rank's dp."""
    import megapar
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    options = {} if reduce_dtype is None else {"grad_reduce_dtype": reduce_dtype}
    engine = megapar.prepare(model, micro_batch_size=2, precision="fp16", zero=zero,
                             initial_loss_scale=2.0**24, loss_scale_window=2,
                             on_nonfinite="skip", **options)
    g = torch.Generator().manual_seed(1)
    pattern = []
    for _ in range(6):
        ids = torch.randint(0, 128, (8, 17), generator=g)
        engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        pattern.append((engine.last_skipped, engine.precision.loss_scale))
    return pattern


@pytest.mark.parametrize("zero, reduce_dtype", [(0, "fp32"), (1, "fp32"), (3, None)])
def test_fp16_reduced_in_fp32_skips_what_one_process_skips(zero, reduce_dtype):
    """Each dp rank backpropagated its losses with the loss scale, its m micro-batches weighed
    as m, not m x dp: its fp16 backward held dp times one process's values and overflowed at
    half its scale, so dp 2 skipped steps one process applied, with an fp32 reduction and at
    ZeRO-3 too (a reviewer's finding; precision-zero.md said it skips only what one process
    does). The losses are now backpropagated with the scale over dp."""
    one = run_local(_fp16_skips, 1, zero, reduce_dtype)[0]
    assert any(s for s, _ in one) and not all(s for s, _ in one), one  # overflows and steps
    two = run_local(_fp16_skips, 2, zero, reduce_dtype)
    assert two[0] == two[1] == one, (one, two)
