"""Optimizer groups and checkpoint state, ZeRO-1 equivalence, LR schedule, clipping, batch plan."""

import json
import math

import pytest
import torch
import torch.distributed as dist
from tp_utils import assert_close, make_mesh

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import GPT2Config
from megapar.optim import LRScheduler, build_optimizer, clip_grad_norm
from megapar.optim.clip import sum_of_squares
from megapar.pipeline.partition import build_stage
from megapar.training.step import BatchPlan

CONFIG = GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    make_vocab_size_divisible_by=16)


def serial_model(seed=3):
    return build_stage(CONFIG, Mesh(Layout()), seed)


# --- LR schedule --------------------------------------------------------------------------------
def test_warmup_then_cosine_to_min_lr():
    s = LRScheduler(1.0, 0.1, 4, 14, "cosine")
    assert [s.lr(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr(4) == pytest.approx(1.0)
    assert s.lr(9) == pytest.approx(0.55)  # halfway through the decay: (max + min) / 2
    assert s.lr(14) == pytest.approx(0.1) and s.lr(100) == pytest.approx(0.1)
    lrs = [s.lr(i) for i in range(4, 15)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))


def test_a_saved_schedule_with_a_field_of_a_newer_megapar_is_named():
    """A megapar of 11-28 reading a schedule saved after --lr-decay wsd came failed with
    "TypeError: LRScheduler.__init__() got an unexpected keyword argument 'decay_steps'"; a field
    this one does not know is named as a newer megapar's, and a known state still loads."""
    s = LRScheduler(1.0, 0.1, 4, 14, "cosine")
    t = LRScheduler(2.0, 0.0, 0, 5, "linear")
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="has future_field, which this megapar does not know: "
                                         "it was written by a newer megapar"):
        t.load_state_dict({**s.state_dict(), "future_field": 1})


def test_linear_and_constant_decay():
    lin = LRScheduler(1.0, 0.0, 0, 10, "linear")
    assert [lin.lr(i) for i in (0, 5, 10, 20)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    const = LRScheduler(2.0, 0.0, 2, 10, "constant")
    assert [const.lr(i) for i in (0, 1, 2, 50)] == pytest.approx([1.0, 2.0, 2.0, 2.0])


def _transformers_lrs(schedule, steps, **kwargs):
    """transformers' learning rates at steps 0..steps-1 of `schedule` (a get_*_schedule
    function) on an optimizer whose lr is 1.0: the LambdaLR's factors."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = schedule(opt, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("style, theirs", [("linear", "linear"), ("cosine", "cosine"),
                                           ("sqrt", "1-sqrt")])
@pytest.mark.parametrize("ratio", [0.0, 0.1])
def test_wsd_is_transformers_get_wsd_schedule(style, theirs, ratio):
    """megapar's WSD (warmup 3, a decay of 4 ending at step 12) is transformers'
    get_wsd_schedule at every step after warmup, to the end and past it (at min_lr). In warmup
    megapar's step s takes their step s + 1 (megapar's first step trains at lr / warmup, theirs
    at 0; their warmup also starts from min_lr_ratio, so it is compared at ratio 0)."""
    from transformers import get_wsd_schedule

    ours = LRScheduler(1.0, ratio, 3, 12, "wsd", decay_steps=4, wsd_style=style)
    theirs_lrs = _transformers_lrs(get_wsd_schedule, 17, num_warmup_steps=3, num_decay_steps=4,
                                   num_training_steps=12, decay_type=theirs, min_lr_ratio=ratio)
    assert [ours.lr(s) for s in range(3, 17)] == pytest.approx(theirs_lrs[3:], rel=1e-12)
    assert [ours.lr(s) for s in range(3, 8)] == [1.0] * 5  # the stable phase
    if ratio == 0.0:
        assert [ours.lr(s) for s in range(3)] == pytest.approx(theirs_lrs[1:4], rel=1e-12)


def test_wsd_exponential_is_megatrons():
    """Megatron-LM's exponential WSD decay: min + (max - min) x (2 x 0.5^p - 1), p the decay's
    progress; halfway (p = 0.5): 2 / sqrt(2) - 1 = sqrt(2) - 1."""
    s = LRScheduler(1.0, 0.1, 0, 10, "wsd", decay_steps=4, wsd_style="exponential")
    assert [s.lr(i) for i in range(7)] == [1.0] * 7
    assert s.lr(8) == pytest.approx(0.1 + 0.9 * (math.sqrt(2) - 1), rel=1e-12)
    assert s.lr(10) == pytest.approx(0.1, rel=1e-12) and s.lr(99) == pytest.approx(0.1)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_cosine_and_linear_are_transformers(decay):
    """The existing decays checked against transformers' (warmup 4, 14 steps, cosine to a tenth
    of the peak, linear to 0): equal from the end of warmup to step 14, and in warmup megapar's step s
    is their step s + 1 (their step 0 trains at lr 0)."""
    import transformers

    if decay == "cosine":
        schedule, extra, low = (transformers.get_cosine_with_min_lr_schedule_with_warmup,
                                {"min_lr_rate": 0.1}, 0.1)
    else:
        schedule, extra, low = transformers.get_linear_schedule_with_warmup, {}, 0.0
    theirs = _transformers_lrs(schedule, 15, num_warmup_steps=4, num_training_steps=14, **extra)
    ours = LRScheduler(1.0, low, 4, 14, decay)  # (their cosine rises again after step 14)
    assert [ours.lr(s) for s in range(4, 15)] == pytest.approx(theirs[4:], rel=1e-12, abs=1e-15)
    assert [ours.lr(s) for s in range(4)] == pytest.approx(theirs[1:5], rel=1e-12)


@pytest.mark.parametrize("decay", ["linear", "wsd"])
def test_the_decay_ends_at_lr_decay_steps_before_max_steps(decay):
    """Megatron-LM's --lr-decay-iters 6 with --train-iters 10 (--lr-decay-steps 6 --max-steps
    10): the decay reaches --min-lr at step 6 and stays; linear it is transformers' linear
    schedule over 6 steps (min lr 0), and WSD's decay fraction is of those 6 steps. It was
    answered with --max-steps, which stretched the decay over all 10."""
    from transformers import get_linear_schedule_with_warmup

    from megapar.training.config import TrainConfig
    from megapar.training.engine import Engine

    cfg = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=2, max_steps=10, lr_decay=decay,
                      lr_decay_steps=6, lr_wsd_decay_fraction=0.5)
    s = Engine.flags_schedule(cfg)
    lrs = [s.lr(i) for i in range(10)]
    assert lrs[6:] == [0.0] * 4
    if decay == "linear":
        theirs = _transformers_lrs(get_linear_schedule_with_warmup, 7, num_warmup_steps=2,
                                   num_training_steps=6)
        assert lrs[2:7] == pytest.approx(theirs[2:7], rel=1e-12)
    else:
        assert s.decay_steps == 3 and lrs[2:5] == pytest.approx([1.0, 1.0, 2 / 3], rel=1e-12)


def test_a_resume_note_names_the_lr_a_changed_schedule_jumps_to():
    """--load with a larger --max-steps: from WSD's stable phase the next lr is unchanged (no
    more said); from a checkpoint whose WSD decay had begun the lr jumps back to the peak, and
    the note says so and which checkpoint would extend the stable phase; a stretched cosine
    names its new lr. The note only said 'max_steps 8 -> 12'."""
    from megapar.optim.scheduler import resume_change

    saved = LRScheduler(1.0, 0.1, 2, 8, "wsd", decay_steps=3)
    longer = LRScheduler(1.0, 0.1, 2, 12, "wsd", decay_steps=3)
    assert resume_change(saved, longer, 4) == ""
    assert resume_change(saved, longer, 8) == (
        "; step 9 trains at lr 1, not the checkpoint schedule's 0.1 (its WSD decay began at "
        "step 7: to extend the stable phase, --load a checkpoint saved before it)")
    # one skipped step before the checkpoint: the schedule is at position 8 at step 9
    assert resume_change(saved, longer, 9, 8) == (
        "; step 10 trains at lr 1, not the checkpoint schedule's 0.1 (its WSD decay began at "
        "step 8: to extend the stable phase, --load a checkpoint saved before it)")
    cosine = LRScheduler(1.0, 0.1, 2, 8, "cosine")
    assert resume_change(cosine, LRScheduler(1.0, 0.1, 2, 12, "cosine"), 8) == (
        "; step 9 trains at lr 0.4109, not the checkpoint schedule's 0.1")


def test_a_resume_note_leaves_out_wsd_fields_a_run_leaving_wsd_no_longer_uses():
    """--load of a WSD checkpoint with --lr-decay cosine: the note names the decay's change,
    not WSD's decay_steps and wsd_style (unused by cosine; it listed 'decay_steps 3 -> 0')."""
    from megapar.optim.scheduler import changed_fields

    wsd = LRScheduler(1.0, 0.1, 2, 8, "wsd", decay_steps=3, wsd_style="sqrt")
    cosine = LRScheduler(1.0, 0.1, 2, 12, "cosine")
    assert changed_fields(wsd.state_dict(), cosine.state_dict()) == (
        "max_steps 8 -> 12, decay wsd -> cosine")
    assert changed_fields(cosine.state_dict(), wsd.state_dict()) == (
        "max_steps 12 -> 8, decay cosine -> wsd, decay_steps 0 -> 3, wsd_style linear -> sqrt")


def test_a_wsd_fraction_given_on_load_replaces_the_checkpoints_decay_steps():
    """--load of a run saved with --lr-wsd-decay-steps 3, given --lr-wsd-decay-fraction 0.5:
    the fraction sets the decay (was refused: '--lr-wsd-decay-fraction 0.5 would be ignored:
    --lr-wsd-decay-steps 3 sets the final decay's length', the 3 taken from the checkpoint)."""
    from megapar.training.config import TrainConfig
    from megapar.training.engine import Engine
    from megapar.training.validate_resume import settings_from_checkpoint

    cfg = TrainConfig(lr_wsd_decay_fraction=0.5, max_steps=12)
    cfg.explicit = frozenset({"lr_wsd_decay_fraction", "max_steps"})
    saved = {"lr_decay": "wsd", "lr_wsd_decay_steps": 3, "lr_wsd_decay_fraction": 0.2,
             "max_steps": 8, "warmup_steps": 2, "tokenizer": "gpt2"}
    assert settings_from_checkpoint(cfg, {"meta": {"train_config": saved}}) == [
        "from the checkpoint (not given): --lr-decay wsd, --warmup-steps 2"]
    assert Engine.flags_schedule(cfg).decay_steps == 6


def test_the_default_warmup_fits_before_lr_decay_steps():
    """--max-steps 100 --lr-decay-steps 5 without --warmup-steps: the default warmup is 10 % of
    where the decay ends (was of --max-steps: 10 steps, then refused as longer than
    --lr-decay-steps 5, a flag the user had not given)."""
    from megapar.training.config import TrainConfig
    from megapar.training.engine import Engine
    from megapar.training.validate import adapt_defaults

    cfg = TrainConfig(max_steps=100, lr_decay_steps=5, global_batch_size=8)
    cfg.explicit = frozenset({"max_steps", "lr_decay_steps", "global_batch_size"})
    notes = adapt_defaults(cfg, 1)
    assert "--warmup-steps not given: using 0 (10 % of --lr-decay-steps 5) instead of the " \
           "default 20" in notes
    assert Engine.flags_schedule(cfg).lr(5) == cfg.min_lr


def test_a_constant_decay_gets_no_min_lr_note():
    """--lr 3e-5 --lr-decay constant: --min-lr is not read (given, it is refused), so no note
    says 'using 3e-06' for it (one did); it still follows --lr below the default, so the
    schedule is valid."""
    from megapar.training.config import TrainConfig
    from megapar.training.engine import Engine
    from megapar.training.validate import adapt_defaults

    cfg = TrainConfig(lr=3e-5, lr_decay="constant", max_steps=10, warmup_steps=2)
    cfg.explicit = frozenset({"lr", "lr_decay", "max_steps", "warmup_steps"})
    assert not [n for n in adapt_defaults(cfg, 1) if "--min-lr" in n]
    assert [Engine.flags_schedule(cfg).lr(s) for s in (0, 1, 9)] == [1.5e-5, 3e-5, 3e-5]
    cfg = TrainConfig(lr=3e-5, max_steps=10, warmup_steps=2)
    cfg.explicit = frozenset({"lr", "max_steps", "warmup_steps"})
    assert any(n.startswith("--min-lr not given: using 3e-06") for n in adapt_defaults(cfg, 1))


def test_scheduler_state_round_trips_through_json():
    s = LRScheduler(3e-4, 3e-5, 10, 100, "linear")
    restored = LRScheduler(1.0, 0.0, 0, 1)
    restored.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert restored == s and restored.lr(37) == s.lr(37)


@pytest.mark.parametrize("args, message", [
    ((1.0, 0.0, 0, 10, "exp"), "unknown lr decay 'exp'"),
    ((1.0, 2.0, 0, 10), "min_lr 2.0 is larger than max_lr 1.0"),
    ((1.0, 0.0, 20, 10), "warmup of 20 steps is longer than the 10 training steps"),
    ((1.0, 0.0, 4, 10, "wsd", 7), "warmup of 4 steps and WSD decay of 7 steps are longer "
                                  "than the 10 training steps"),
    ((1.0, 0.0, 0, 10, "wsd", 0), "WSD needs a final decay of at least 1 step"),
    ((1.0, 0.0, 0, 10, "wsd", 2, "minus_sqrt"), "unknown WSD decay style 'minus_sqrt'"),
])
def test_scheduler_errors(args, message):
    with pytest.raises(ValueError, match=message):
        LRScheduler(*args)


# --- batch plan -----------------------------------------------------------------------------------
def test_batch_plan():
    plan = BatchPlan(16, 2, 4)
    assert plan.micro_batches == 2
    batch = {"input_ids": torch.arange(16).unsqueeze(1)}
    micro = plan.split(batch, dp_rank=1)  # contiguous slice [4, 8) in micro-batches of 2
    assert [mb["input_ids"].flatten().tolist() for mb in micro] == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"global batch size 10 is not divisible by micro-batch "
                                         r"size 2 x dp 4 = 8"):
        BatchPlan(10, 2, 4)


# --- optimizer ------------------------------------------------------------------------------------
def test_weight_decay_groups_follow_megatron():
    model = serial_model()
    opt = build_optimizer(model, Mesh(Layout()), lr=1e-3, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert "embed.word.weight" in decay and "embed.position.weight" in decay
    assert "layers.0.attn.qkv.weight" in decay
    assert all(n.endswith("bias") or ".ln_" in n or "norm" in n for n in no_decay)
    assert "layers.0.ln_1.weight" in no_decay and "layers.1.mlp.fc.bias" in no_decay
    assert len(decay) + len(no_decay) == len(names)
    opt.set_lr(5e-4)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]
    assert [g["lr"] for g in opt.inner.param_groups] == [5e-4, 5e-4]


def test_adamw_is_torch_fused_kernel_and_a_loaded_state_steps_like_a_fresh_one():
    """AdamW runs torch's fused kernel on the CPU (and CUDA); a state loaded from a checkpoint
    keeps `step` where that kernel needs it, and the next steps equal an uninterrupted run."""
    def make():
        model = serial_model()
        return model, build_optimizer(model, make_mesh(), 1e-2, 0.1)

    def train(model, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    model, opt = make()
    assert opt.inner.defaults["fused"] is True
    train(model, opt, 2, 0)
    resumed, opt2 = make()
    resumed.load_state_dict(model.state_dict())
    opt2.load_state_json(json.loads(json.dumps(opt.state_json())))
    opt2.load_state_tensors(opt.state_tensors())
    step = next(iter(opt2.inner.state.values()))["step"]
    assert step.dtype == torch.float32 and step.device == next(resumed.parameters()).device
    train(model, opt, 2, 1)
    train(resumed, opt2, 2, 1)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["adamw", "lamb", "lars", "sgd", "muon"])
def test_a_loaded_state_holds_what_a_fresh_run_holds(kind):
    """After one step, and after loading that state (`state_tensors`, `state_json`) into a new
    optimizer, every parameter's state has the same keys (torch's state_dict: the step count
    only where the optimizer keeps one: AdamW, LAMB, Muon's AdamW half), dtypes and shapes."""
    def held(opt):
        return {i: {k: (t.dtype, tuple(t.shape)) for k, t in s.items()}
                for i, s in opt.state_dict()["state"].items()}

    model = build_stage(CONFIG, make_mesh(), seed=3)
    opt = build_optimizer(model, make_mesh(), 1e-2, 0.1, kind=kind)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    resumed = build_optimizer(build_stage(CONFIG, make_mesh(), seed=3), make_mesh(), 1e-2, 0.1,
                              kind=kind)
    resumed.load_state_json(json.loads(json.dumps(opt.state_json())))
    resumed.load_state_tensors(opt.state_tensors())
    fresh = held(opt)
    assert held(resumed) == fresh and len(fresh) == len(list(model.parameters()))
    steps = sum("step" in s for s in fresh.values())
    assert (steps == 0) == (kind in ("sgd", "lars")), (kind, steps)


def test_unsupported_zero_stage():
    with pytest.raises(ValueError, match=r"zero=4: use 0 .* or 3 \(parameters too\)"):
        build_optimizer(serial_model(), Mesh(Layout()), 1e-3, 0.0, zero=4)


def test_tied_copy_is_stepped_but_not_checkpointed():
    last = build_stage(CONFIG, Mesh.virtual(Layout(1, 2, 1), rank=1, device="cpu"), seed=3)
    opt = build_optimizer(last, Mesh.virtual(Layout(1, 2, 1), 1, "cpu"), 1e-3, 0.1)
    assert any(p is last.head.weight for g in opt.param_groups for p in g["params"])
    state = opt.state_tensors()
    assert "head.weight" not in state and "final_norm.weight" in state
    # A checkpoint of this stage gives the tied copy the state of the embedding it copies.
    emb = {"exp_avg": torch.full_like(last.head.weight, 0.5),
           "exp_avg_sq": torch.full_like(last.head.weight, 0.25)}
    opt.load_state_tensors({**state, "embed.word.weight": emb})
    assert torch.equal(opt.inner.state[last.head.weight]["exp_avg"], emb["exp_avg"])
    with pytest.raises(KeyError, match="no entry for parameter 'head.weight'"):
        opt.load_state_tensors(state)


def _zero_worker(dp: int) -> dict:
    from megapar.data_parallel import build_grad_sync

    mesh = make_mesh(dp=dp)
    plain_model, zero_model, resumed_model = (build_stage(CONFIG, mesh, seed=3) for _ in range(3))
    plain = build_optimizer(plain_model, mesh, 1e-2, 0.1)

    def sharded(model):
        opt = build_optimizer(model, mesh, 1e-2, 0.1, zero=1)
        grads = build_grad_sync(model, mesh, 1, bucket_mb=100)
        opt.attach(grads)
        return opt, grads

    zero, zero_grads = sharded(zero_model)

    def step(model, opt, grads, seed):  # the same gradient on every dp rank: its average
        gen = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        if grads is not None:
            grads.begin_step()
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            if grads is None:
                p.grad = g
            else:
                p.grad.copy_(g)
        if grads is not None:
            grads.before_last_backward()
            grads.finish()
        opt.step()

    for s in range(3):
        step(plain_model, plain, None, s)
        step(zero_model, zero, zero_grads, s)
    for (n, a), b in zip(plain_model.named_parameters(), zero_model.parameters()):
        assert_close(b, a, what=f"ZeRO-1 weight {n}")
    plain_state, zero_state = plain.state_tensors(), zero.state_tensors()  # collective
    if mesh.dp_rank == 0:
        assert set(zero_state) == set(plain_state) == {n for n, _ in plain_model.named_parameters()}
        for n in plain_state:
            for k in ("exp_avg", "exp_avg_sq"):
                assert_close(zero_state[n][k], plain_state[n][k], what=f"ZeRO-1 {k} of {n}")
    else:
        assert zero_state == {}  # only dp rank 0 (the writer) gets the full state
    # Resume a ZeRO-1 run from the (layout-free) state and take one more step: same as plain.
    resumed, resumed_grads = sharded(resumed_model)
    resumed_model.load_state_dict(zero_model.state_dict())
    resumed.load_state_tensors(plain_state)
    resumed.load_state_json(json.loads(json.dumps(zero.state_json())))
    step(plain_model, plain, None, 3)
    step(resumed_model, resumed, resumed_grads, 3)
    for (n, a), b in zip(plain_model.named_parameters(), resumed_model.parameters()):
        assert_close(b, a, what=f"resumed ZeRO-1 weight {n}")
    numel = sum(p.numel() for p in plain_model.parameters())
    cut = [n for n, p in resumed_model.named_parameters()
           if 0 < sum(e - s for q, s, e in resumed._piece_of if q is p) < p.numel()]
    return {"state_numel": sum(t.numel() for st in resumed.inner.state.values()
                               for k, t in st.items() if k != "step"),
            "plain_numel": 2 * numel, "cut": cut, "step": resumed.state_json()["step"],
            "buffer": sum(b.numel() for b in resumed_grads.buffers.values())}


def _zero_save_worker(dp: int) -> dict:
    """A ZeRO-1 save with several buckets: every gather to dp rank 0 is one bucket."""
    from megapar.data_parallel import build_grad_sync

    mesh = make_mesh(dp=dp)
    plain_model, zero_model = build_stage(CONFIG, mesh, seed=3), build_stage(CONFIG, mesh, seed=3)
    plain = build_optimizer(plain_model, mesh, 1e-2, 0.1)
    zero = build_optimizer(zero_model, mesh, 1e-2, 0.1, zero=1)
    grads = build_grad_sync(zero_model, mesh, 1, bucket_mb=0.01)
    zero.attach(grads)
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        plain.zero_grad()
        zero.zero_grad()
        grads.begin_step()
        for a, b in zip(plain_model.parameters(), zero_model.parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad.copy_(a.grad)
        grads.before_last_backward()
        grads.finish()
        plain.step()
        zero.step()
    gathered, gather = [], dist.gather

    def spy(tensor, gather_list=None, **kwargs):
        gathered.append(sum(t.numel() * t.element_size() for t in gather_list or [tensor]))
        return gather(tensor, gather_list, **kwargs)

    dist.gather = spy
    try:
        state = zero.state_tensors()
    finally:
        dist.gather = gather
    expected = plain.state_tensors()
    if mesh.dp_rank == 0:
        for n, entry in expected.items():
            for k, t in entry.items():
                assert state[n][k].device.type == "cpu"  # in host memory
                assert_close(state[n][k], t, what=f"ZeRO-1 {k} of {n}")
    # torch's state_dict holds the moments this rank updates, and loads back
    sd = zero.state_dict()
    moments = sum(v.numel() for st in sd["state"].values() for k, v in st.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    assert moments == sum(t.numel() for st in zero.inner.state.values()
                          for k, t in st.items() if k != "step") > 0
    before = {id(t): st["exp_avg"].clone() for t, st in zero.inner.state.items()}
    sd = {"state": {i: {k: v.clone() for k, v in st.items() if k != "elements"}
                    | {"elements": st["elements"]} for i, st in sd["state"].items()},
          "param_groups": sd["param_groups"]}  # like torch's, it holds references: copy
    for st in zero.inner.state.values():
        st["exp_avg"].zero_()
    zero.load_state_dict(sd)
    assert all(torch.equal(st["exp_avg"], before[id(t)]) for t, st in zero.inner.state.items())
    bucket_bytes = [b.padded * 4 for b in grads.buckets]
    return {"gathered": gathered, "buckets": bucket_bytes}


def test_zero1_save_gathers_one_bucket_at_a_time_into_host_memory():
    for rank, out in enumerate(run_local(_zero_save_worker, 2, 2)):
        assert len(out["buckets"]) >= 4, out["buckets"]  # the test needs several buckets
        assert len(out["gathered"]) == 2 * len(out["buckets"])  # per bucket, per moment
        if rank == 0:  # what arrives at once on the writer's device: one padded bucket
            assert sorted(out["gathered"]) == sorted(2 * out["buckets"])
            assert max(out["gathered"]) == max(out["buckets"]) < sum(out["buckets"]) / 2


def test_state_dict_holds_the_adam_moments():
    model = serial_model()
    opt = build_optimizer(model, Mesh(Layout()), 1e-2, 0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(sd["state"]) == len(params)
    for i, p in enumerate(params):
        assert torch.equal(sd["state"][i]["exp_avg"], opt.inner.state[p]["exp_avg"])
    fresh = build_optimizer(serial_model(), Mesh(Layout()), 1.0, 0.0)
    fresh.load_state_dict(sd)
    assert fresh.lr == pytest.approx(1e-2)
    for p, q in zip(params, (q for g in fresh.param_groups for q in g["params"])):
        assert torch.equal(fresh.inner.state[q]["exp_avg_sq"], opt.inner.state[p]["exp_avg_sq"])


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_equals_unsharded_adamw_and_resumes(dp):
    outs = run_local(_zero_worker, dp, dp)
    # One bucket: each rank's slice is 1/dp of the buffer, padded to a multiple of dp, and
    # state (exp_avg, exp_avg_sq) exists only for the real elements of its slice.
    plain = outs[0]["plain_numel"]  # exp_avg + exp_avg_sq of every parameter, unsharded
    n = plain // 2
    assert outs[0]["buffer"] == -(-n // dp) * dp
    assert sum(o["state_numel"] for o in outs) == plain
    for o in outs:
        assert 2 * (n // dp - dp) <= o["state_numel"] <= 2 * -(-n // dp)
        assert o["cut"], "no parameter was cut between two dp ranks' slices"
        assert o["step"] == 4


# --- clipping -------------------------------------------------------------------------------------
def _with_grads(seed=5):
    model = serial_model()
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    return model


def test_clip_matches_torch_on_the_serial_model():
    ours, ref = _with_grads(), _with_grads()
    total = clip_grad_norm(ours, Mesh(Layout()), 1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    assert total == pytest.approx(expected, rel=1e-6) and total > 1.0
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert_close(a.grad, b.grad, what=f"clipped grad of {n}")
    clipped = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in ours.parameters()))
    assert clipped == pytest.approx(1.0, rel=1e-5)


def test_clip_with_nonpositive_max_norm_only_reports():
    model = _with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    total = clip_grad_norm(model, Mesh(Layout()), 0.0)
    assert total > 1.0
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def test_norm_of_a_long_cpu_gradient_is_exact_to_fp32_rounding():
    """A gradient of gpt2-tiny's embedding size (the real GPT-2 vocabulary x 64, 3.2 M elements),
    whole and cut in two as tp or ZeRO cuts it: the norm equals the float64 one to 1e-6 either
    way (torch's CPU norm of the whole tensor is ~6e-5 off, and the halves' ~2e-5)."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(50304, 64, generator=gen) * 1e-3
    exact = grad.double().pow(2).sum().sqrt().item()
    model = torch.nn.Linear(64, 50304, bias=False)
    model.weight.grad = grad.clone()
    assert clip_grad_norm(model, Mesh(Layout()), 0.0) == pytest.approx(exact, rel=1e-6)
    halves = sum_of_squares(list(grad.chunk(2)) + [torch.zeros(0)]).sqrt().item()
    assert halves == pytest.approx(exact, rel=1e-6)


def test_the_norm_does_not_depend_on_how_the_gradient_is_cut_or_ordered():
    """The same gradients cut into other pieces (buckets, ZeRO slices, units) and summed in
    another order give the same fp32 norm, bit for bit: the squares are summed in fp64 and the
    norm rounded to fp32 (in fp32 these cuts gave norms up to a few ulps apart)."""
    from megapar.optim.clip import norm_of

    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen) * 10.0 ** (k % 5 - 2)
             for k, n in enumerate((50304 * 3, 4097, 129, 70000, 33))]
    flat = torch.cat(grads)
    norms = set()
    for cuts in (1, 2, 3, 7, 64, 1000):
        pieces = list(flat.tensor_split(cuts))
        for order in (pieces, pieces[::-1], pieces[1::2] + pieces[::2]):
            parts = [sum_of_squares(order[i::2]) for i in range(2) if order[i::2]]
            norms.add(norm_of(sum(parts)))  # as ranks' sums all-reduced
    assert len(norms) == 1, sorted(norms)
    exact = flat.double().square().sum().sqrt().float().item()
    assert norms == {exact}


def test_a_cpu_norm_allocates_as_many_tensors_for_thousands_of_pieces_as_for_two():
    """`squares_each` on the CPU casts a tensor's pieces to fp64 through one staging buffer
    into one preallocated vector of norms: the tensors it allocates do not grow with the
    pieces. A foreach norm with an fp64 dtype allocated a copy and a norm for each piece, and
    in about one process in four glibc's heap grew by GPT-2's embedding gradient twice over
    (1,891 MiB at the OS peak of tests/test_process_peak.py's layout instead of 1,598). The
    sums equal each piece's fp64 norm squared, added in order."""
    from torch.profiler import ProfilerActivity, profile

    from megapar.optim.clip import CPU_NORM_PIECE, squares_each

    gen = torch.Generator().manual_seed(2)
    long = torch.randn(2358 * CPU_NORM_PIECE - 5, generator=gen)  # GPT-2's embedding's pieces
    tensors = [long, torch.randn(7, generator=gen), torch.zeros(0)]
    allocating = ("aten::empty", "aten::empty_strided", "aten::zeros")
    made = {}
    for name, given in (("many", tensors), ("two", [t[:CPU_NORM_PIECE + 1] for t in tensors])):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sums = squares_each(given)
        made[name] = sum(e.count for e in prof.key_averages() if e.key in allocating)
        expected = [sum(p.double().norm().square() for p in t.split(CPU_NORM_PIECE))
                    if t.numel() else 0.0 for t in given]
        assert sums.dtype == torch.float64
        assert sums.tolist() == pytest.approx([float(x) for x in expected], rel=1e-14)
    assert made["many"] == made["two"] <= 10, made


def _bucketed_runs(zero: int) -> list:
    """For 25 MB buckets (one a kind) and 0.01 MB ones (a few parameters each): 3 bf16 steps
    of gpt2-tiny (the real GPT-2 vocabulary) at dp 2, per step (loss, grad norm), and the
    weights."""
    import megapar

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 50257, (3, 8, 16), generator=gen)  # every part of the vocabulary
    runs = []
    for mb in (25, 0.01):
        engine = megapar.prepare(
            "gpt2-tiny", micro_batch_size=2,
            lr=3e-3, clip_grad=0.5, global_batch_size=8, seq_len=16, seed=5,
            precision="bf16", zero=zero, grad_bucket_mb=mb)
        steps = []
        for batch in ids:
            r = engine.run_step(engine.split({"input_ids": batch, "labels": batch}))
            assert r.grad_norm > 0.5  # clipped: the norm scales every gradient
            steps.append((r.loss, r.grad_norm))
        engine.exact_params()
        runs.append((steps, [p.detach().clone() for p in engine.model.parameters()]))
    return runs


def test_a_bf16_run_is_bitwise_the_same_whatever_the_bucket_size():
    """ZeRO-1 at dp 2 under bf16: the same gradients, cut into other buckets and slices, give
    the same losses, norms and weights bit for bit (with fp32 sums of squares the norms
    differed in the 7th digit from the second step, and the weights after). ZeRO-2 and 3 take
    the norm of their slices in the same code (`ZeroOptimizer.clip_grad_norm`)."""
    for (steps, weights), (steps2, weights2) in run_local(_bucketed_runs, 2, 1):
        assert steps == steps2, (steps, steps2)
        assert all(torch.equal(a, b) for a, b in zip(weights, weights2))


def _tp_norm_worker():
    mesh = make_mesh(tp=2)
    model = build_stage(CONFIG, mesh, seed=3)
    ids = torch.arange(16).reshape(2, 8)
    model(None, {"input_ids": ids, "labels": (ids * 7) % 100}).backward()
    return clip_grad_norm(model, mesh, 0.0), dist.get_rank()


def test_tp_norm_counts_replicated_params_once():
    model = serial_model()
    ids = torch.arange(16).reshape(2, 8)
    model(None, {"input_ids": ids, "labels": (ids * 7) % 100}).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0).item()
    for norm, _ in run_local(_tp_norm_worker, 2):
        assert norm == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kind, key", [("adamw", "betas"), ("lamb", "betas"), ("sgd", "momentum"),
                                       ("lars", "momentum")])
def test_one_cycle_lr_cycles_the_momentum_of_the_inner_optimizer(kind, key):
    """torch's OneCycleLR / CyclicLR need betas or momentum in param_groups (cycle_momentum);
    what they set reaches the optimizer that steps."""
    from megapar.optim.optimizer import AdamWOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = AdamWOptimizer(list(model.named_parameters()), 1e-3, 0.1, kind=kind)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=6)
    seen = []
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        outer = opt.param_groups[0][key]
        opt.step()
        inner = opt.inner.param_groups[0][key]
        assert inner == outer and opt.inner.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        seen.append(inner[0] if key == "betas" else inner)
        sched.step()
    assert len(set(seen)) == 4   # the momentum really cycles (0.95 down towards 0.85)


def test_resume_restores_momentum_a_torch_scheduler_moved():
    """OneCycleLR cycles beta1: a resume must continue with the moved betas, not the initial
    ones (the losses of a resumed run equal the uninterrupted run's exactly)."""
    import copy

    from megapar.optim.optimizer import AdamWOptimizer

    def build(weights=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        if weights is not None:
            model.load_state_dict(weights)
        opt = AdamWOptimizer(list(model.named_parameters()), 1e-2, 0.1)
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=8)

    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def train(model, opt, sched, batches):
        losses = []
        for x in batches:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        return losses

    model, opt, sched = build()
    train(model, opt, sched, data[:3])
    snap = (copy.deepcopy(model.state_dict()), json.loads(json.dumps(opt.state_json())),
            {k: {s: t.clone() for s, t in v.items()} for k, v in opt.state_tensors().items()},
            sched.state_dict())
    full = train(model, opt, sched, data[3:])

    model2, opt2, sched2 = build(snap[0])
    opt2.load_state_tensors(snap[2])
    opt2.load_state_json(snap[1])
    sched2.load_state_dict(snap[3])
    assert opt2.param_groups[0]["betas"] == tuple(snap[1]["groups"][0]["betas"]) != (0.9, 0.95)
    assert train(model2, opt2, sched2, data[3:]) == full
