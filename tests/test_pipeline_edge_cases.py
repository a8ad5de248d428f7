"""The pipeline's edge cases as first-class parity tests: m = 1, m < pp, m not a multiple of pp,
pp 2 and pp 4, for GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV, with tp 2, dp 2
(ZeRO-1), cp 2, recomputation and bf16; invalid combinations refused in one line; process
groups created in the same order on every rank.

DualPipeV needs m >= 2 pp, so its edge cases are the least m it takes (2 pp) and the next (2 pp
+ 1, not a multiple of pp); every other schedule runs at m = 1 and m < pp and m not a multiple
of pp. At pp 2 the V of ZB-V and DualPipeV turns on rank 1, which holds virtual stages 1 and 2,
and rank 0 holds both ends (the embedding and the loss).

Each run is one optimizer step's loss and reduced gradients against one process on the same
global batch (the harness of test_cp_parity.py: m = global batch / (2 x dp)), fp32 within
1e-5; bf16 against one process in bf16.
"""

import pytest
import torch
import torch.distributed as dist
from test_cp_parity import _worker, check, reference
from tp_utils import assert_close, rel_err, to_device

from megapar.cli.train import main as train
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.pipeline import certify
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.schedules import check_schedule, loss_in_flight

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2),
             ("dualpipev", 2)]
V_SCHEDULES = [("zb-v", 2), ("dualpipev", 2)]


def edge_ms(schedule, pp, ms):
    """The edge-case m of `schedule` at `pp`: `ms` (m = 1, m < pp, m not a multiple of pp), or
    for DualPipeV, which needs m >= 2 pp, the least m it takes and one more."""
    return (2 * pp, 2 * pp + 1) if schedule == "dualpipev" else ms


def run(kind, tp=1, cp=1, pp=2, dp=1, m=1, schedule="1f1b", v=1, **options):
    """One parity run of the harness: m micro-batches of 2 samples per dp rank; in fp32 a
    block per virtual stage (pp x V blocks: 2 for one chunk a rank at pp 2, not the config's
    4; bf16's bounds were measured on the config's)."""
    if pp * v != 4 and (pp * v > 4 or options.get("precision", "fp32") == "fp32"):
        options["layers"] = pp * v  # a block per virtual stage
    check_schedule(schedule, pp, m, v)  # only valid combinations here (refusals below)
    return kind, tp, cp, pp, dp, dict(schedule=schedule, v=v, g=2 * m * dp, **options)


def launch(runs, world):
    check(runs, run_local(_worker, world, runs, timeout_s=600))


def test_pp2_m1_and_m3_every_schedule_and_model():
    """pp 2 (the V of interleaved turns on the same two ranks; ZB-V's and DualPipeV's turns on
    rank 1): m = 1 and m = 3 (not a multiple of pp), DualPipeV m = 4 and 5, GPT-2, grouped-query
    Llama and BERT; recomputation on three of them."""
    runs = [run(kind, m=m, schedule=s, v=v) for kind in ("gpt2", "llama", "bert")
            for s, v in SCHEDULES for m in edge_ms(s, 2, (1, 3))]
    runs += [run("gpt2", m=3, schedule="zb-h1", recompute="full"),
             run("llama", m=1, schedule="interleaved", v=2, recompute="selective"),
             run("bert", m=3, schedule="gpipe", recompute="full"),
             run("llama", m=1, schedule="zb-v", v=2, recompute="full")]
    launch(runs, 2)


def test_dualpipev_with_recomputation_full_and_selective():
    """DualPipeV at pp 2, every model, m = 4 and 5 (not a multiple of pp), full and selective
    recomputation: one process's loss and gradients (fp32, 1e-5). Its overlapped forward and
    backward pairs run one micro-batch's recomputed forward beside another's forward."""
    runs = [run(kind, m=m, schedule="dualpipev", v=2, recompute=recompute)
            for kind in ("gpt2", "llama", "bert") for m in (4, 5)
            for recompute in ("full", "selective")]
    launch(runs, 2)


def test_pp4_fewer_micro_batches_than_stages():
    """pp 4 with m = 1, 2, 3 (fewer than the stages) and 6 (not a multiple of 4); DualPipeV at
    m = 8 and 9 (not a multiple of 4)."""
    runs = [run("gpt2", pp=4, m=m, schedule=s, v=v) for s, v in SCHEDULES
            for m in edge_ms(s, 4, (1, 2, 3, 6))]
    runs += [run("bert", pp=4, m=2, schedule="zb-h1"), run("llama", pp=4, m=3),
             run("bert", pp=4, m=3, schedule="zb-v", v=2),
             run("llama", pp=4, m=9, schedule="dualpipev", v=2)]
    launch(runs, 4)


@pytest.mark.parametrize("layout", ["tp2", "dp2-zero1", "cp2"])
def test_pp2_with_tp_dp_zero1_cp_at_m1_and_m3(layout):
    """pp 2 x (tp 2 | dp 2 with ZeRO-1 | cp 2), every schedule, m = 1 and 3 (DualPipeV 4 and
    5); sequence parallelism with full recomputation once under tp for ZB-H1, with selective
    for DualPipeV."""
    size = {"tp2": {"tp": 2}, "dp2-zero1": {"dp": 2, "zero": 1}, "cp2": {"cp": 2}}[layout]
    kind = "gpt2" if layout == "dp2-zero1" else "llama"
    runs = [run(kind, m=m, schedule=s, v=v, **size) for s, v in SCHEDULES
            for m in edge_ms(s, 2, (1, 3))]
    if layout == "tp2":
        runs.append(run("gpt2", m=3, schedule="zb-h1", sp=True, recompute="full", **size))
        runs.append(run("gpt2", m=5, schedule="dualpipev", v=2, sp=True, recompute="selective",
                        **size))
    launch(runs, 4)


# bf16's unit roundoff is 2^-8 = 3.9e-3. A pipelined bf16 step runs the same autocast ops on
# each micro-batch as one process in bf16, and this harness's messages travel in fp32 (its
# executor has no wire dtype; a bf16 wire is test_bf16_wire_v_schedules' case), so only fp32
# accumulation order differs (measured at pp 2, GPT-2 and Llama, every schedule: losses
# <= 8e-8, gradients <= 2.3e-7 relative). The loss is held to a few bf16 roundoffs as in
# test_cp_parity.py; it cannot tell bf16 from fp32 (a fresh model's loss, ~ln(vocab), moves by
# <= 2e-5 between them), so the gradients carry the check: within a quarter of one bf16
# roundoff (1e-3, test_comm_dtypes.py's bound between runs of the same compute precision) of
# one process in bf16, and farther than that from fp32's (measured 6e-3 .. 1e-2; a V chunk
# run outside autocast was measured 2.6e-3 from bf16's and fails).
BF16_LOSS_TOL, BF16_GRAD_TOL = 1e-2, 2 ** -8 / 4


def check_bf16(runs, outs):
    for i, (kind, *_, options) in enumerate(runs):
        # with several losses in flight (GPipe, m > 1) the chunked loss recomputes its logits
        # instead of making its gradients in the forward: bf16 rounds the two paths at other
        # points (one process's two paths 3.4e-3 apart), so the reference takes the run's path
        m = options["g"] // (2 * runs[i][4])
        one = loss_in_flight(options["schedule"], runs[i][3], m, options["v"]) <= 1
        ref = reference(kind, "bf16", options["g"], loss_grads_in_forward=one)
        fp32 = reference(kind, "fp32", options["g"])
        for out in (o[i] for o in outs):
            what = f"{kind} {options} rank at {out['where']}"
            assert abs(out["loss"] - ref["loss"]) / ref["loss"] < BF16_LOSS_TOL, \
                (what, out["loss"], ref["loss"])
            assert out["loss"] != fp32["loss"], what  # bf16 really ran
            for name, grad in out["grads"].items():
                source = "embed.word.weight" if name == "head.weight" and kind != "llama" \
                    else name
                assert_close(grad, ref["grads"][source], BF16_GRAD_TOL, f"{what} {name}")
            if out["grads"]:  # this stage's gradients are bf16's, not fp32's
                assert max(rel_err(grad, fp32["grads"]["embed.word.weight"
                                                     if n == "head.weight" and kind != "llama"
                                                     else n])
                           for n, grad in out["grads"].items()) > BF16_GRAD_TOL, what


def test_bf16_edge_cases_follow_one_process_in_bf16():
    """bf16 autocast at m = 1 and 3 on pp 2 (GPipe, 1F1B, interleaved, ZB-H1): within bf16's
    rounding of one process in bf16 (BF16_LOSS_TOL, BF16_GRAD_TOL)."""
    runs = [run("gpt2", m=m, schedule=s, v=v, precision="bf16") for s, v in SCHEDULES
            if (s, v) not in V_SCHEDULES for m in (1, 3)]
    check_bf16(runs, run_local(_worker, 2, runs, timeout_s=600))


def test_bf16_v_schedules_follow_one_process_in_bf16():
    """bf16 autocast with ZB-V (m = 1, 3) and DualPipeV (m = 4, 5) on pp 2, GPT-2 (its tied
    embedding's halves both on rank 0) and grouped-query Llama: within bf16's rounding of one
    process in bf16 (BF16_LOSS_TOL, BF16_GRAD_TOL)."""
    runs = [run(kind, m=m, schedule=s, v=v, precision="bf16") for kind in ("gpt2", "llama")
            for s, v in V_SCHEDULES for m in edge_ms(s, 2, (1, 3))]
    check_bf16(runs, run_local(_worker, 2, runs, timeout_s=600))


# With the messages in bf16 as well, measured at pp 2, m = 4 and 5, GPT-2 and Llama: DualPipeV
# and ZB-V bitwise equal; the loss <= 4e-6 from one process in bf16; the gradients 7e-3 .. 1e-2
# from the fp32-wire run's (one bf16 rounding per message of the residual stream and of its
# gradient, so one process's bf16 gradients are no closer).
def test_bf16_wire_v_schedules():
    """bf16 with messages in bf16 too (the engine's default wire under bf16), pp 2, m = 4 and 5,
    GPT-2 and Llama: DualPipeV gives ZB-V's loss and gradients (the same placement, so the same
    messages rounded at the same places; fp32 parity, 1e-5), the loss within BF16_LOSS_TOL of
    one process in bf16, and the wire really narrowed: the gradients move from the fp32-wire
    run's by more than BF16_GRAD_TOL."""
    points = [(kind, s, m, wire) for kind in ("gpt2", "llama") for m in (4, 5)
              for s, wire in (("zb-v", "bf16"), ("dualpipev", "bf16"), ("dualpipev", None))]
    runs = [run(kind, m=m, schedule=s, v=2, precision="bf16", wire=wire)
            for kind, s, m, wire in points]
    outs = run_local(_worker, 2, runs, timeout_s=600)
    for rank_outs in outs:
        got = dict(zip(points, rank_outs))
        for kind, _, m, _ in points[::3]:
            dual, zb_v, wide = (got[kind, s, m, w] for s, w in (("dualpipev", "bf16"),
                                                                 ("zb-v", "bf16"),
                                                                 ("dualpipev", None)))
            what = f"{kind} m={m} bf16 wire rank at {dual['where']}"
            ref = reference(kind, "bf16", 2 * m)["loss"]
            assert abs(dual["loss"] - ref) / ref < BF16_LOSS_TOL, (what, dual["loss"], ref)
            assert_close(torch.tensor(dual["loss"]), torch.tensor(zb_v["loss"]), what=what)
            assert dual["grads"].keys() == zb_v["grads"].keys() == wide["grads"].keys(), what
            for name, grad in dual["grads"].items():
                assert_close(grad, zb_v["grads"][name], what=f"{what} {name} against ZB-V")
            if dual["grads"]:
                assert max(rel_err(grad, wide["grads"][name])
                           for name, grad in dual["grads"].items()) > BF16_GRAD_TOL, what


@pytest.mark.parametrize("args, message", [
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
      "--global-batch-size", "5", "--micro-batch-size", "1"],
     ("interleaved 1F1B runs the 5 micro-batches in max(1, m // pp) = 2 rounds of equal size, "
      "so m must be divisible by 2; the nearest valid m are 4 and 6")),
    (["--pp", "2", "--schedule", "1f1b", "--virtual-stages", "2"],
     ("--virtual-stages 2 with --schedule 1f1b needs --schedule interleaved, zb-v or "
      "dualpipev: 1f1b runs one model chunk per rank; give one of them, or leave "
      "--virtual-stages out")),
    # the default schedule was named as if given, with its Python spelling (a re-test)
    (["--pp", "2", "--virtual-stages", "2"],
     ("--virtual-stages 2 with --schedule 1f1b (the default) needs --schedule interleaved, "
      "zb-v or dualpipev")),
    # at pp 1 that advice led to "interleaved 1F1B needs --pp >= 2" (a fuzz run's finding)
    # and its bracket offered pp 2 x V 3, which a 4-layer model refuses in turn (a fuzz run's)
    (["--virtual-stages", "3"], ("--virtual-stages 3 cuts each pipeline stage into model "
                                 "chunks, and --pp 1 runs no pipeline: drop --virtual-stages "
                                 "(or give --pp 2 --schedule interleaved --virtual-stages 2: "
                                 "--pp x --virtual-stages at most the model's 4 layers)")),
    (["--schedule", "gpipe", "--virtual-stages", "2"], "--pp 1 runs no pipeline: drop"),
    # a one-chunk schedule's line offered --virtual-stages 3 under interleaved, which the
    # 4-layer model refuses in turn at --pp 2 (a session's finding)
    (["--pp", "2", "--schedule", "zb-h1", "--virtual-stages", "3"],
     ("--virtual-stages 3 with --schedule zb-h1: zb-h1 runs one model chunk per rank, and the "
      "model's 4 layers at --pp 2 hold 2 per rank at most; give --schedule interleaved, zb-v "
      "or dualpipev with --virtual-stages 2, or leave --virtual-stages out")),
    # a split flag beside more stages than layers said 'give at most -3', then 'lower --pp to
    # 4 or less', refused at 4 for the split (two re-tests): the most it cuts the layers into
    (["--pp", "8", "--decoder-first-pipeline-num-layers", "2"],
     "4 layers cannot be cut into --pp 8 stages (each needs at least one layer); lower --pp to "
     "3 or less"),
    (["--pp", "6", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split"], "lower --pp to 3 or less"),
    # and under a schedule of several chunks, whose offers ignored the split (a re-test)
    (["--pp", "4", "--schedule", "interleaved", "--virtual-stages", "2",
      "--decoder-last-pipeline-num-layers", "2"],
     "--decoder-last-pipeline-num-layers 2 leaves no interleaved cut of them: use a schedule "
     "with one chunk per rank (1f1b, zb-h1) at --pp 3 or less, or drop it at --pp 2"),
    # each fix at a --pp that takes it (at --pp 8 alone each was refused next; a re-test)
    (["--pp", "8", "--schedule", "zb-v", "--account-for-loss-in-pipeline-split"],
     "--account-for-loss-in-pipeline-split leaves no V of them: use a schedule with one chunk "
     "per rank (1f1b, zb-h1) at --pp 2, or drop it at --pp 2"),
    (["--pp", "2", "--schedule", "1f1b", "--account-for-loss-in-pipeline-split"], None),
    (["--pp", "2", "--schedule", "zb-v"], None),
    (["--pp", "3", "--schedule", "1f1b", "--decoder-last-pipeline-num-layers", "2"], None),
    (["--pp", "4", "--virtual-stages", "2"],
     ("the model's 4 layers at --pp 4 hold no more than one per rank; leave --virtual-stages "
      "out")),
    (["--pp", "2", "--schedule", "zb-v", "--virtual-stages", "3"],
     ("--virtual-stages 3 does not apply to --schedule zb-v: it places exactly two model "
      "chunks per rank in a V (rank r holds virtual stages r and 2 pp - 1 - r); leave "
      "--virtual-stages out, or give 2")),
    (["--pp", "2", "--schedule", "interleaved"],
     "interleaved 1F1B needs --virtual-stages >= 2 model chunks per rank, got 1 (its default is 1)"),
    (["--pp", "2", "--schedule", "dualpipev", "--global-batch-size", "3",
      "--micro-batch-size", "1"],
     ("DualPipeV needs at least 2 x pp = 4 micro-batches (one per virtual stage), got m = 3; "
      "use more micro-batches, or the zb-v schedule, which takes any m; m is "
      "--global-batch-size / (--micro-batch-size x dp) = 3 / 1: raise the first or lower the "
      "second")),  # megapar-train's flags only (was: megapar-bubble's -m too)
])
def test_invalid_combinations_are_refused_in_one_line(capsys, monkeypatch, tmp_path, args,
                                                     message):
    import megapar.cli.train as train_cli
    from megapar.data.assets import asset_path

    def refuse(*a, **k):
        raise AssertionError("a worker was started for a bad input")

    monkeypatch.setattr(train_cli, "run_workers", refuse)
    data = tmp_path / "sample.txt"  # the package's text: a clone without ../shared runs this
    with open(asset_path("shakespeare_sample.txt")) as f:
        data.write_text(f.read()[:20_000])
    common = ["--data", str(data), "--data-cache", str(tmp_path / "cache"), "--model",
              "gpt2-tiny", "--seq-len", "32", "--no-progress"]
    if message is None:  # an offer of a line above, taken (rehearsed: no worker)
        assert train([*common, *args, "--dry-run", "--max-steps", "1"]) == 0, args
        return
    assert train([*common, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_interleaved_without_virtual_stages_on_one_layer_names_the_schedules_need(
        capsys, tmp_path):
    """--schedule interleaved at --pp 2 on a 1-layer model said 'lower --pp to 1', which
    interleaved refuses in turn; its own line comes first ('1 layers' was said too; a re-test)."""
    import megapar.cli.train as train_cli

    model = tmp_path / "g1.json"
    model.write_text('{"model_type": "gpt2", "n_positions": 64, "n_embd": 32, "n_layer": 1, '
                     '"n_head": 2}')
    argv = ["--model", str(model), "--pp", "2", "--dry-run", "--max-steps", "1", "--schedule",
            "interleaved"]
    assert train_cli.main(argv) == 2
    assert capsys.readouterr().err.strip().endswith(
        "interleaved 1F1B needs --virtual-stages >= 2 model chunks per rank, got 1 (its default "
        "is 1) (with one chunk per rank use --schedule 1f1b)")
    assert train_cli.main([*argv, "--virtual-stages", "2"]) == 2
    assert "error: 1 layer cannot be cut into --pp 2 x --virtual-stages 2" in \
        capsys.readouterr().err


@pytest.mark.parametrize("args, note", [
    # the default micro-batch size 4 gave m = 16 / 4 = 4 < 2 pp: refused, naming only "a
    # larger --global-batch-size" though --micro-batch-size was not given either
    (["--pp", "2", "--schedule", "dualpipev", "--global-batch-size", "8"],
     "--micro-batch-size not given: using 2 (--schedule dualpipev at --pp 2 does not take 2 "
     "micro-batches a step; 4 it does) instead of 4"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--global-batch-size",
      "20"],
     "--micro-batch-size not given: using 2 (--schedule interleaved at --pp 2 does not take 5 "
     "micro-batches a step; 10 it does) instead of 4"),  # "takes 10" read as its only m
])
def test_a_micro_batch_size_not_given_adapts_to_the_schedule(capsys, monkeypatch, tmp_path, args,
                                                              note):
    import megapar.cli.train as train_cli
    from megapar.data.assets import asset_path

    started = []
    monkeypatch.setattr(train_cli, "run_workers", lambda *a, **k: started.append(a) or 0)
    data = tmp_path / "sample.txt"
    with open(asset_path("shakespeare_sample.txt")) as f:
        data.write_text(f.read()[:20_000])
    common = ["--data", str(data), "--data-cache", str(tmp_path / "cache"), "--model",
              "gpt2-tiny", "--seq-len", "32", "--no-progress"]
    assert train([*common, *args]) == 0 and started
    assert note in capsys.readouterr().err
    # given, it is the user's: refused, the fix naming both flags
    assert train([*common, *args, "--micro-batch-size", "4"]) == 2
    gbs = args[args.index("--global-batch-size") + 1]
    assert capsys.readouterr().err.strip().endswith(
        f"= {gbs} / 4: raise the first or lower the second")


def test_the_grid_certifies_these_edge_cases():
    """Every (schedule, pp, m) run above is also in the certificate (order-matched pairs,
    zero-buffer progress, bounded messages and activations), as training and evaluation."""
    for pp, ms in ((2, (1, 3)), (4, (1, 2, 3, 6))):
        for schedule, v in SCHEDULES:
            for m in edge_ms(schedule, pp, ms):
                for forward_only in (False, True):
                    cert = certify.certify(schedule, pp, m, v, forward_only)
                    assert cert.ok, cert.failures


# --- process groups and communicators ---------------------------------------------------------
LAYOUTS = [Layout(1, 2, 2), Layout(2, 2, 1), Layout(1, 2, 1, cp=2),
           Layout(1, 2, 2, "tp-dp-pp"), Layout(1, 1, 4), Layout(2, 1, 2)]


def _groups_worker():
    created = []
    real = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        created.append(list(ranks) if ranks is not None else None)
        return real(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        for layout in LAYOUTS:
            Mesh(layout, dist.get_rank())
    finally:
        dist.new_group = real
    return created


def test_every_rank_creates_the_same_groups_in_the_same_order():
    """NCCL creates a communicator for a group collectively (ncclCommInitRank blocks until
    every member joins), and torch.distributed.new_group is collective over the whole world:
    a rank that creates its groups in another order waits in one creation while its peer waits
    in another, and both hang. Mesh creates every group on every rank (also those it is not
    in), in one fixed order that does not depend on the rank."""
    created = run_local(_groups_worker, 4)
    assert created[0] and all(c == created[0] for c in created), created
    # the pipeline's messages ride the pp group's communicator (batched p2p uses the group's,
    # not a pair's), which the group creates in a collective of all its ranks first:
    assert any(sorted(ranks) == [0, 2] for ranks in created[0])  # pp group of Layout(1, 2, 2)


class _Toy(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.lin, self.last = torch.nn.Linear(4, 4), mesh.is_last_stage

    def forward(self, hidden, batch):
        out = self.lin(batch["x"] if hidden is None else hidden)
        return out.pow(2).mean() if self.last else out


def _first_call_worker():
    """The pp group's first operation, on the NCCL path (`polls_host` false)."""
    from megapar.pipeline import p2p

    mesh = Mesh(Layout(1, 2, 1), dist.get_rank())
    calls = []
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, group=None, **kwargs):
        calls.append("all_reduce over pp" if group is mesh.pp_group else "all_reduce")
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    p2p.dist.all_reduce = all_reduce
    p2p._device.polls_host = lambda device: False  # take NCCL's path on gloo
    try:
        executor = PipelineExecutor(_Toy(mesh), mesh, "1f1b", (2, 4), timeout_s=60)
        executor.post_ahead = False
        real_batch = executor.p2p.batch_isend_irecv
        executor.p2p.batch_isend_irecv = lambda ops: (calls.append("batch_isend_irecv"),
                                                       real_batch(ops))[1]
        gen = torch.Generator().manual_seed(0)
        executor.run(to_device([{"x": torch.randn(2, 4, generator=gen)} for _ in range(3)],
                               mesh.device))
    finally:
        p2p.dist.all_reduce = real_all_reduce
    return calls


def test_the_pp_group_is_joined_by_a_collective_before_its_first_message(monkeypatch):
    """torch: the first batch_isend_irecv of a group must involve every rank of the group (it
    creates the NCCL communicator); StageP2P.begin_step runs an all-reduce over the pp group
    before any message, on every rank."""
    for calls in run_local(_first_call_worker, 2):
        assert calls[0] == "all_reduce over pp" and calls.count("all_reduce over pp") == 1
        assert calls[1:] and set(calls[1:]) == {"batch_isend_irecv"}
