"""ZeRO-3 (`--zero 3`, `ShardedParams` + `Zero3Optimizer`) against one process, and what it
holds and sends.

Parity: the serial reference of test_parity_3d (plain torch AdamW, clipping on every step, 3
steps, 4 micro-batches of 2 per global batch): losses, grad norms, first-step gradients and
final weights within 1e-5 relative, at dp 2, tp 2 x dp 2 and pp 2 x dp 2 (1F1B and GPipe,
parameters freed per micro-batch or kept).
"""

import pytest
import torch
from test_parity_3d import (
    CONFIG,
    EPS,
    LR,
    MAX_NORM,
    SEED,
    SEQ,
    WD,
    G,
    check_against,
    config,
    global_batches,
    scheduler,
    serial_reference,
)
from tp_utils import assert_close, record_first_grads, to_device
from tp_utils import full_grads as gathered_grads

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import GPT2Config
from megapar.pipeline.partition import build_stage
from megapar.training.step import BatchPlan


def build(mesh: Mesh, schedule: str = "1f1b", keep: bool = False, mbs: int = 2,
          precision: str = "fp32", recompute: str = "none", virtual_stages: int = 1,
          model_config=None, kind: str = "adamw", persist: int = 0, offload: bool = False,
          offload_params: bool = False, reduce: str = "step"):
    """(model, TrainStep, ShardedParams) for --zero 3 on `mesh`; `offload`: the optimizer
    steps host copies of the shards (--offload-optimizer); `offload_params`: the shards are
    held on the host (--offload-params)."""
    from megapar.data_parallel.sharded_params import ShardedParams
    from megapar.optim import Precision
    from megapar.optim.zero3 import Zero3Optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.schedules import chunks_per_rank, placement_of
    from megapar.training.step import TrainStep

    cfg = model_config or config()
    model = build_stage(cfg, mesh, SEED, recompute,
                        virtual_stages=chunks_per_rank(schedule, virtual_stages),
                        placement=placement_of(schedule))
    seq = SEQ // mesh.cp // (mesh.tp if mesh.sequence_parallel else 1)
    executor = PipelineExecutor(model, mesh, schedule, (mbs, seq, cfg.hidden_size),
                                virtual_stages=virtual_stages)
    optimizer = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR, WD, eps=EPS,
                               kind=kind, tp_group=mesh.tp_group, offload=offload)
    sharded = ShardedParams(model, mesh.dp_cp_group, average_over=mesh.dp, keep=keep,
                            persist_below=persist, offload=offload_params, reduce=reduce)
    step = TrainStep(model, mesh, executor, optimizer, scheduler(),
                     Precision(precision, mesh.device), MAX_NORM, sharded)
    return model, step, sharded


def _train(tp: int, pp: int, dp: int, schedule: str = "1f1b", keep: bool = False,
           sequence_parallel: bool = False, cp: int = 1, recompute: str = "none",
           order: str = "tp-pp-dp", virtual_stages: int = 1, mbs: int = 2,
           persist: int = 0, offload: bool = False, offload_params: bool = False,
           reduce: str = "step") -> dict:
    import torch.distributed as dist

    from megapar.tensor_parallel.partition import gather_full

    mesh = Mesh(Layout(tp, pp, dp, order, cp), dist.get_rank(), sequence_parallel=sequence_parallel)
    model, step, sharded = build(mesh, schedule, keep, recompute=recompute,
                                 virtual_stages=virtual_stages, mbs=mbs, persist=persist,
                                 offload=offload, offload_params=offload_params, reduce=reduce)
    optimizer = step.optimizer
    full_grads = record_first_grads(optimizer, model, mesh, sharded)
    plan = BatchPlan(G, mbs, dp)
    results = [step.step(to_device(plan.split(batch, mesh.dp_rank), mesh.device), i)
               for i, batch in enumerate(global_batches())]
    with sharded.whole():
        weights = {n: gather_full(p.detach(), p.tp_dim, p.full_shape, mesh.tp_group).clone()
                   for n, p in model.named_parameters()}
    freed = all(u.full.untyped_storage().nbytes() == 0 for u in sharded.units)
    keep_rank = mesh.dp_rank == 0 and mesh.tp_rank == 0 and mesh.cp_rank == 0
    host = optimizer.host
    return {"layout": (tp, pp, dp, 3, schedule, order, cp), "results": results,
            "host_copies": host is not None and host.copies and all(
                m.data_ptr() != t.data_ptr() for m, t in zip(host.masters, host.stepped)),
            "refreshed": host.refreshed if host is not None else 0,
            "held": _held(model, sharded, host),
            "weights": weights if keep_rank else {}, "grads": full_grads if keep_rank else {},
            "freed": freed}


def _held(model, sharded, host) -> dict:
    """Bytes of the distinct storages (as the dry run counts them) of what the rank holds of
    the weights between steps: on the device (parameters, shards) and in host memory (the
    host shards of --offload-params); the shards' bytes; and the host step's masters."""
    from megapar.dryrun.world import storage_bytes

    return {"device": storage_bytes([*model.parameters(), *(u.shard for u in sharded.units)]),
            "host": storage_bytes([u.host_shard for u in sharded.units
                                   if u.host_shard is not None]),
            "shards": sum(u.shard_nbytes for u in sharded.units),
            "masters": storage_bytes(host.masters) if host is not None else 0}


def _worker(runs: list[tuple]) -> list[dict]:
    return [_train(*run) for run in runs]


@pytest.fixture(scope="module")
def reference():
    return serial_reference()


def test_zero3_parity_dp2_and_tp2_dp2(reference):
    """dp 2 (m 2 per rank) and tp 2 x dp 2: same losses, norms, gradients and weights as one
    process; between steps no unit is gathered."""
    for runs, world in (([(1, 1, 2)], 2), ([(2, 1, 2)], 4)):
        outs = run_local(_worker, world, runs)
        for i in range(len(runs)):
            check_against(reference, [o[i] for o in outs])
            assert all(o[i]["freed"] for o in outs)


def test_zero3_pipeline_cp_sp_recompute(reference):
    """pp 2 x dp 2 under 1F1B (parameters freed per micro-batch, and kept over the step with
    --zero3-keep-params), GPipe, ZB-H1 (weight gradients after the input gradients), interleaved
    1F1B, ZB-V and DualPipeV (micro-batches of 1: m 4) with two chunks per rank, interleaved
    with a persistence threshold of 100 elements (biases and norms gathered once per step);
    cp 2 x dp 2 (sharded over cp x dp); tp 2 x dp 2 with
    sequence parallelism (the replicated parameters' tp sum on the pieces); full and selective
    recomputation (the recomputed forward inside backward)."""
    four = [(1, 2, 2, "1f1b"), (1, 2, 2, "1f1b", True), (1, 2, 2, "gpipe"), (1, 2, 2, "zb-h1"),
            (1, 2, 2, "interleaved", False, False, 1, "none", "tp-pp-dp", 2), (1, 2, 2, "zb-v"),
            (1, 2, 2, "dualpipev", False, False, 1, "none", "tp-pp-dp", 1, 1),
            (1, 2, 2, "interleaved", False, False, 1, "none", "tp-pp-dp", 2, 2, 100),
            (1, 1, 2, "1f1b", False, False, 2), (2, 1, 2, "1f1b", False, True)]
    two = [(1, 1, 2, "1f1b", False, False, 1, "full"),
           (1, 1, 2, "1f1b", False, False, 1, "selective")]
    for world, runs in ((4, four), (2, two)):
        outs = run_local(_worker, world, runs)
        for i in range(len(runs)):
            check_against(reference, [o[i] for o in outs])
            assert all(o[i]["freed"] for o in outs)


def test_zero3_reduce_per_micro_batch_parity(reference):
    """--zero3-reduce micro-batch (a reduce-scatter per micro-batch, added into the shard): the
    same losses, norms, gradients and weights as one process at dp 2 (m 2), pp 2 x dp 2 with
    1F1B, ZB-H1 (the W-reported units held to the step's last W) and 1F1B with micro-batches
    of 1 (m 4, the tied embedding over stages reduced once, in finish())."""
    mb = (False, False, 1, "none", "tp-pp-dp", 1, 2, 0, False, False, "micro-batch")
    four = [(1, 2, 2, "1f1b", *mb), (1, 2, 2, "zb-h1", *mb),
            (1, 2, 2, "1f1b", *mb[:6], 1, *mb[7:])]
    for world, runs in ((2, [(1, 1, 2, "1f1b", *mb)]), (4, four)):
        outs = run_local(_worker, world, runs)
        for i in range(len(runs)):
            check_against(reference, [o[i] for o in outs])
            assert all(o[i]["freed"] for o in outs)


# --- BERT and grouped-query Llama, LAMB, bf16 -------------------------------------------------
def other_config(kind: str, layers: int = 4):
    """BERT or grouped-query Llama of `layers` blocks."""
    from megapar.models import BertConfig, LlamaConfig

    if kind == "bert":
        return BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers,
                          num_attention_heads=4, intermediate_size=64,
                          max_position_embeddings=16, make_vocab_size_divisible_by=16,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                       make_vocab_size_divisible_by=16, tie_word_embeddings=False)


def other_batches(kind: str) -> list[dict]:
    out = []
    for b in global_batches():
        if kind == "bert":
            b = {**b, "attention_mask": torch.ones_like(b["input_ids"]),
                 "token_type_ids": torch.zeros_like(b["input_ids"])}
        out.append(b)
    return out


def serial_other(kind: str, layers: int = 4) -> dict:
    """Plain torch (AdamW, clip_grad_norm_) on the whole model, 4 micro-batches of 2."""
    model = build_stage(other_config(kind, layers), Mesh(Layout()), SEED)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    sched, plan, losses, norms = scheduler(), BatchPlan(G, 2, 1), [], []
    for step, batch in enumerate(other_batches(kind)):
        for g in opt.param_groups:
            g["lr"] = sched.lr(step)
        opt.zero_grad()
        micro, total = plan.split(batch, 0), 0.0
        for mb in micro:
            loss = model(None, mb)
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms}


def _other_worker(kind: str, layouts: list[tuple], optimizer: str = "adamw",
                  precision: str = "fp32") -> list[dict]:
    import torch.distributed as dist

    out = []
    for tp, pp, dp, *rest in layouts:
        cp, schedule, v = (*rest, *(1, "1f1b", 1)[len(rest):])  # (tp, pp, dp[, cp, schedule, v])
        mesh = Mesh(Layout(tp, pp, dp, "tp-pp-dp", cp), dist.get_rank())
        _, step, _ = build(mesh, schedule, model_config=other_config(kind, blocks(v)),
                           kind=optimizer,
                           precision=precision, virtual_stages=v)
        plan = BatchPlan(G, 2, dp)
        out.append([step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i)
                    for i, b in enumerate(other_batches(kind))])
    return out


def blocks(v: int) -> int:
    """The blocks of `test_zero3_parity_bert_and_grouped_query_llama`'s models at v chunks a
    rank: one a stage at pp 2 (2), and 4 for interleaved's 4 chunks."""
    return 2 * v


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_zero3_parity_bert_and_grouped_query_llama(kind):
    """dp 2, tp 2 x dp 2, pp 2 x dp 2 (1F1B, ZB-H1, interleaved), cp 2 x dp 2 and the full
    2 x 2 x 2: the losses and grad norms of one process (of the same model: 2 blocks, 4 under
    interleaved, `blocks`)."""
    refs = {v: serial_other(kind, blocks(v)) for v in (1, 2)}
    launches = {2: [(1, 1, 2)],
                4: [(2, 1, 2), (1, 2, 2), (1, 2, 2, 1, "zb-h1"), (1, 2, 2, 1, "interleaved", 2),
                    (1, 1, 2, 2)],
                8: [(2, 2, 2)]}
    for world, layouts in launches.items():
        for results in run_local(_other_worker, world, kind, layouts):  # per rank
            for layout, steps in zip(layouts, results, strict=True):
                ref = refs[layout[5] if len(layout) > 5 else 1]  # v
                assert not any(r.skipped for r in steps)
                for s, r in enumerate(steps):
                    assert_close(torch.tensor(r.loss), torch.tensor(ref["losses"][s]),
                                 what=f"{kind} {layout} loss at step {s}")
                    assert_close(torch.tensor(r.grad_norm), torch.tensor(ref["norms"][s]),
                                 what=f"{kind} {layout} grad norm at step {s}")


def _zero0_worker(optimizer: str, precision: str) -> list:
    """The same GPT-2 steps at dp 2 without sharding (the megapar optimizer and GradBuckets)."""
    import torch.distributed as dist

    from megapar.data_parallel import GradBuckets
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(1, 1, 2), dist.get_rank())
    model = build_stage(config(), mesh, SEED)
    step = TrainStep(model, mesh, PipelineExecutor(model, mesh, "1f1b", (2, SEQ, CONFIG["n_embd"])),
                     build_optimizer(model, mesh, LR, WD, eps=EPS, kind=optimizer), scheduler(),
                     Precision(precision, mesh.device), MAX_NORM,
                     GradBuckets(list(model.parameters()), mesh.dp_group, 0.02))
    plan = BatchPlan(G, 2, 2)
    return [step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i)
            for i, b in enumerate(global_batches())]


def _zero3_gpt2_worker(optimizer: str, precision: str) -> list:
    import torch.distributed as dist

    mesh = Mesh(Layout(1, 1, 2), dist.get_rank())
    _, step, _ = build(mesh, kind=optimizer, precision=precision)
    plan = BatchPlan(G, 2, 2)
    return [step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i)
            for i, b in enumerate(global_batches())]


TRUST_AND_PRECISION = [("lamb", "fp32"), ("lars", "fp32"), ("adamw", "bf16"), ("adamw", "fp16")]


def test_zero3_trust_ratio_and_mixed_precision_match_unsharded():
    """LAMB / LARS (whole-parameter norms over the pieces), bf16 autocast and fp16 (loss
    scaling, the inf check on the pieces) at dp 2: the steps of the unsharded optimizer, to
    1e-5. In bf16 / fp16 only the first step is held to 1e-5 (the same weights, so the same
    casts): the norm is summed over the pieces in another order, a ~1e-7 change of the clipped
    update that flips half-precision roundings of the next steps' cast weights, so later steps
    agree to that precision (1e-3)."""
    plain = run_local(_many, 2, _zero0_worker)
    sharded = run_local(_many, 2, _zero3_gpt2_worker)
    for a_runs, b_runs in zip(plain, sharded):
        for (optimizer, precision), a, b in zip(TRUST_AND_PRECISION, a_runs, b_runs):
            assert not any(r.skipped for r in a + b)
            for s, (x, y) in enumerate(zip(a, b)):
                tol = 1e-5 if precision == "fp32" or s == 0 else 1e-3
                assert_close(torch.tensor(y.loss), torch.tensor(x.loss), tol,
                             what=f"{optimizer} {precision} loss at step {s}")
                assert_close(torch.tensor(y.grad_norm), torch.tensor(x.grad_norm), tol,
                             what=f"{optimizer} {precision} grad norm at step {s}")


def _many(worker) -> list:
    return [worker(optimizer, precision) for optimizer, precision in TRUST_AND_PRECISION]


# --- memory held, traffic, collective order -----------------------------------------------------
def _count_worker(pp: int, keep: bool, global_batch: int, persist: int,
                  reduce: str = "step", schedule: str = "1f1b") -> dict:
    import torch.distributed as dist

    from megapar.comm_count import count_collectives

    mesh = Mesh(Layout(1, pp, 2), dist.get_rank())
    model, step, sharded = build(mesh, schedule, keep=keep, persist=persist, reduce=reduce)
    plan = BatchPlan(global_batch, 2, 2)
    batches = [to_device(plan.split(b, mesh.dp_rank), mesh.device) for b in global_batches()]
    step.step(batches[0], 0)  # warm-up
    with count_collectives(mesh.device) as calls:
        step.step(batches[1], 1)
    dp_ranks = tuple(dist.get_process_group_ranks(mesh.dp_cp_group))
    state = sum(t.numel() * t.element_size() for st in step.optimizer.inner.state.values()
                for k, t in st.items() if k != "step")
    return {"dp_calls": [(c.op, c.numel, c.bytes) for c in calls if c.ranks == dp_ranks],
            "dp_ranks": dp_ranks, "m": plan.micro_batches, "stage": mesh.pp_rank,
            "padded": sum(u.padded for u in sharded.units),
            "numel": sum(p.numel() for p in model.parameters()),
            "units": len(sharded.units), "held": sharded.held_bytes() + state,
            "persistent": sharded.persistent.padded if sharded.persistent else 0,
            "tails": [v.padded for t, _ in sharded.roots.values() if t is not None
                      for v in t.members()],
            "deferred": [u.padded for u in sharded.units if u.deferred],
            "gathered_between_steps": [u.name for u in sharded.units
                                       if u.full.untyped_storage().nbytes()],
            "grads_between_steps": [n for n, p in model.named_parameters() if p.grad is not None]}


@pytest.mark.parametrize("pp,keep,global_batch,persist,reduce,schedule", [
    (1, False, 4, 0, "step", "1f1b"), (1, True, 8, 0, "step", "1f1b"),
    (2, False, 8, 0, "step", "1f1b"), (2, True, 8, 0, "step", "1f1b"),
    (2, False, 8, 100, "step", "1f1b"), (1, False, 8, 0, "micro-batch", "1f1b"),
    (2, False, 8, 100, "micro-batch", "1f1b"), (2, True, 8, 0, "micro-batch", "1f1b")])
def test_zero3_memory_and_traffic_counted(pp, keep, global_batch, persist, reduce, schedule):
    """Per rank between steps: fp32 parameter and gradient shards and Adam's two moments, 16
    bytes per element of the padded units over dp (16 / dp per parameter up to < dp elements
    of padding per unit); nothing gathered, no full gradient. Per step over dp: every unit
    all-gathered twice per micro-batch (forward, backward; once per step when kept) and its
    gradient reduce-scattered once; only scalars all-reduced (the loss and the squared norm).
    The persistent unit (parameters under the threshold) is gathered once per step.
    Without pp at one micro-batch that is 2 P + P = 1.5x the 2 N of an all-reduce's ring.
    --zero3-reduce micro-batch: every unit reduce-scattered once per micro-batch (m x), but
    those holding the tied embedding over stages (once, in finish()). Every
    rank of a dp group issues the same collectives in the same order (NCCL's rule: the
    prefetches do not reorder them)."""
    dp = 2
    outs = run_local(_count_worker, pp * dp, pp, keep, global_batch, persist, reduce, schedule)
    by_group = {}
    for out in outs:
        by_group.setdefault(out["dp_ranks"], []).append(out["dp_calls"])
        P, N, m = out["padded"], out["numel"], out["m"]
        assert out["held"] == 16 * P // dp
        assert 0 <= P - N < dp * out["units"]
        assert out["gathered_between_steps"] == out["grads_between_steps"] == []
        calls = out["dp_calls"]
        gathers = [c for c in calls if c[0] == "all_gather_into_tensor"]
        scatters = [c for c in calls if c[0] == "reduce_scatter_tensor"]
        gathered = 1 if keep else 2 * m  # gathers per unit and step
        tail_gathered = 1 if keep else m  # the tails: kept from the forward to the backward
        Q, persistent = out["persistent"], int(out["persistent"] > 0)
        T, tails = sum(out["tails"]), len(out["tails"])
        assert persistent == int(persist > 0)
        # the head's (the last stage's); at pp 2 its tied copy's unit, led by and gathered
        # with the final norm's (whose parameters persist under the threshold: then alone)
        assert tails == (1 if pp == 1 else out["stage"] * (1 + (persist == 0)))
        # payload: this rank's slice
        assert sum(c[1] for c in gathers) == (gathered * (P - Q - T) + tail_gathered * T
                                              + Q) // dp
        assert len(gathers) == (gathered * (out["units"] - persistent - tails)
                                + tail_gathered * tails + persistent)
        times = m if reduce == "micro-batch" else 1  # reduce-scatters per unit and step
        D, deferred = sum(out["deferred"]), len(out["deferred"])
        assert deferred == (pp > 1)  # the tied embedding's unit, on both stages
        assert sum(c[1] for c in scatters) == times * (P - D) + D
        assert len(scatters) == times * (out["units"] - deferred) + deferred
        others = [c for c in calls if c[0] not in ("all_gather_into_tensor",
                                                    "reduce_scatter_tensor")]
        # the loss (fp32), the norm's sum of squares (fp64)
        assert sorted(others) == [("all_reduce", 1, 4), ("all_reduce", 1, 8)], others
        if pp == 1 and m == 1 and not keep:  # full buffers moved vs an all-reduce's 2 N
            assert (dp * sum(c[1] for c in gathers) + P) / (2 * N) == pytest.approx(
                1.5 - T / (2 * N), 1e-3)
    for streams in by_group.values():
        assert len(streams) == dp and all(s == streams[0] for s in streams)


DEEP = GPT2Config(**{**CONFIG, "n_layer": 8})
"""The parity model with 8 blocks (4 per stage at pp 2)."""


def _grad_buffers_worker(pp: int, device_path: bool, reduce: str = "step",
                         global_batch: int = 4) -> dict:
    """One step of m = 1 at dp 2 on gloo, `device_path`: as on NCCL (collectives whole and
    async, `host_waits` off); the most bytes of full gradient buffers alive at once (weak
    references to every buffer made: alive while anything, a work included, holds it),
    sampled at each buffer made, before each reduce-scatter launched and before finish()."""
    import weakref

    import torch.distributed as dist

    mesh = Mesh(Layout(1, pp, 2), dist.get_rank())
    model, step, sharded = build(mesh, model_config=DEEP, reduce=reduce)
    if device_path:
        sharded.host_waits, sharded.piece = False, None
    made, peak = [], [0]

    def sample() -> None:
        peak[0] = max(peak[0], sum(n for ref, n in made if ref() is not None))

    for u in sharded.units:
        def grads(u=u, fn=u.grads):
            new = u.grad_full is None
            out = fn()
            if new:
                made.append((weakref.ref(out), out.untyped_storage().nbytes()))
                sample()
            return out
        u.grads = grads
    launch, finish = sharded._launch, sharded.finish

    def launched(u) -> None:
        sample()
        launch(u)

    def finished() -> None:
        sample()
        finish()
    sharded._launch, sharded.finish = launched, finished
    plan = BatchPlan(global_batch, 2, 2)
    batch = to_device(plan.split(global_batches()[0], mesh.dp_rank), mesh.device)
    step.step(batch, 0)
    grads = gathered_grads(sharded)
    return {"peak": peak[0], "all": sum(n for _, n in made), "m": plan.micro_batches,
            "units": len(sharded.units), "stage": mesh.pp_rank, "dp_rank": mesh.dp_rank,
            "deferred": [u.padded * 4 for u in sharded.units if u.deferred],
            "grads": {n: grads[id(p)] for n, p in model.named_parameters()},
            "alive_after": sum(ref() is not None for ref, _ in made)}


@pytest.mark.parametrize("pp,reduce,global_batch", [(1, "step", 4), (2, "step", 4),
                                                    (1, "micro-batch", 8),
                                                    (2, "micro-batch", 8)])
def test_zero3_full_gradient_buffers_freed_as_the_backward_goes_on_the_device_path(
        pp, reduce, global_batch):
    """NCCL's path (forced on gloo): each unit's full gradient buffer is freed when the next
    unit's reduce-scatter is launched (one reduction in flight), not held to finish(): at one
    micro-batch the most bytes alive at once are the planner's `grad_buffers` (the root units,
    two neighbouring blocks), under 0.7x the stage's whole gradient (8 layers), and the same
    as on gloo's
    path; the reduced gradients are the same on both paths. Reduced per micro-batch (m 2), the
    same peak: the previous micro-batch's reductions are waited for before the next one's
    buffers are made."""
    from megapar.plan.params import StageLayout
    from megapar.plan.state import Offload, rank_state

    outs = {path: run_local(_grad_buffers_worker, 2 * pp, pp, path, reduce, global_batch)
            for path in (True, False)}
    for device, host in zip(outs[True], outs[False]):
        assert device["m"] == global_batch // 4 and device["alive_after"] == 0
        at = StageLayout.of(DEEP, pp=pp, stage=device["stage"], dp=2, zero=3)
        planned = rank_state(at, device["dp_rank"],
                             Offload(whole_grads=False, micro_batches=device["m"]))
        whole = rank_state(at, device["dp_rank"])
        assert device["all"] == device["m"] * whole.grad_buffers - (device["m"] - 1) * sum(
            device["deferred"])  # every buffer made: m per unit, the deferred ones once
        assert device["peak"] == host["peak"] == planned.grad_buffers, (device, planned)
        assert device["peak"] < 0.7 * whole.grad_buffers, device
        for name, g in device["grads"].items():
            assert torch.equal(g, host["grads"][name]), name


# --- checkpoints --------------------------------------------------------------------------------
def _resume_run(ckpt: str, stop_at: int, load: bool, zero: int, hf_out: str | None = None):
    from test_api import _batches, _hf_model

    import megapar

    engine = megapar.prepare(_hf_model(), micro_batch_size=2, lr=3e-3, weight_decay=0.1,
                             clip_grad=0.5, zero=zero,
                             lr_schedule={"warmup_steps": 2, "max_steps": 6})
    if load:
        engine.load(ckpt)
    losses = [engine.train_step(b) for b in _batches(6)[engine.step:stop_at]]
    most = []  # units gathered at once during the save (--zero 3)
    sharded = engine.sharded_params
    if sharded is not None:
        gather = sharded.gather

        def counted(u):
            gather(u)
            most.append(sum(v.full.untyped_storage().nbytes() > 0 for v in sharded.units))
        sharded.gather = counted
    if not load:
        engine.save(ckpt)
        assert most == [] if sharded is None else max(most) == 1  # one unit at a time
    if sharded is not None:
        sharded.gather = gather
    if hf_out:
        import warnings

        with warnings.catch_warnings():  # the test model has no tokenizer to export
            warnings.simplefilter("ignore")
            engine.export_hf(hf_out)
    return losses, engine.step


def _resumes(root: str) -> dict:
    """The uninterrupted --zero 3 run (exported), and runs stopped at step 3 and resumed at
    the other --zero, in one launch."""
    out = {"full": _resume_run(f"{root}/a3", 6, False, 3, f"{root}/hf3")[0]}
    for saved, loaded in ((3, 0), (0, 3)):
        first, _ = _resume_run(f"{root}/b{saved}", 3, False, saved)
        rest, end = _resume_run(f"{root}/b{saved}", 6, True, loaded)
        out[saved, loaded] = (first + rest, end)
    return out


def test_zero3_checkpoint_resumes_at_zero0_and_back(tmp_path):
    """dp 2 (transformers GPT-2 weights loaded into the shards): a --zero 3 checkpoint of step 3
    resumes at --zero 0 with the losses of the --zero 3 run that did not stop, and a --zero 0
    one at --zero 3; the files are the canonical ones (the same keys and shapes as --zero 0's)
    and the Hugging Face export writes the gathered weights (the checkpoint's); a save gathers
    one unit at a time.
    (Final weights of a --zero 3 and a --zero 0 run are not compared: with Adam's eps 1e-8 the
    summation order's 1e-7 noise grows to 1e-4 in zero-initialised biases; see
    test_parity_3d.)"""
    from safetensors.torch import load_file

    out = run_local(_resumes, 2, str(tmp_path))[0]
    full = out["full"]
    for saved, loaded in ((3, 0), (0, 3)):
        losses, end = out[saved, loaded]
        assert end == 6 and len(losses) == len(full)
        for s, (a, b) in enumerate(zip(losses, full)):
            assert_close(torch.tensor(a), torch.tensor(b), what=f"--zero {saved} -> {loaded} "
                                                                f"loss at step {s}")
    shard = "model_tp00_pp00.safetensors"
    b3, b0 = (load_file(tmp_path / f"b{z}" / "step_00000003" / shard) for z in (3, 0))
    assert {k: v.shape for k, v in b3.items()} == {k: v.shape for k, v in b0.items()}
    assert any(k.startswith("optim/") for k in b3)
    h3 = load_file(tmp_path / "hf3" / "model.safetensors")
    wte = h3["transformer.wte.weight"]
    saved = load_file(tmp_path / "a3" / "step_00000006" / shard)["model/embed.word.weight"]
    assert torch.equal(wte, saved[:wte.shape[0]].to(wte.dtype))  # the gathered weights
    assert not torch.equal(h3["transformer.h.0.attn.c_attn.bias"],
                           torch.zeros_like(h3["transformer.h.0.attn.c_attn.bias"]))


def test_zero3_parity_2x2x2(reference):
    """tp 2 x pp 2 x dp 2: ZB-H1 with sequence parallelism (the W actions and the replicated
    parameters' tp sum on the pieces), and 1F1B with the parameters kept over the step."""
    runs = [(2, 2, 2, "zb-h1", False, True), (2, 2, 2, "1f1b", True)]
    outs = run_local(_worker, 8, runs)
    for i in range(len(runs)):
        check_against(reference, [o[i] for o in outs])
        assert all(o[i]["freed"] for o in outs)


def test_zero3_optimizer_says_it_is_stage_3():
    """The step picks the tp sum of sequence parallelism's gradients by the stage, and the
    checkpoint's JSON records it: ZeroOptimizer's constructor must not reset it to 1."""
    from megapar.optim.zero3 import Zero3Optimizer

    mesh = Mesh(Layout())
    model = build_stage(config(), mesh, SEED)
    opt = Zero3Optimizer(model.named_parameters(), mesh.dp_cp_group, LR, WD)
    assert opt.zero == 3 and opt.state_json()["zero"] == 3


def test_zero_settings_that_change_nothing_are_said():
    """Accepted, with one note each: ZeRO with nothing to shard over (and --muon-distributed
    with it), --zero3-reduce
    micro-batch where the units reduce once a step anyway (one micro-batch; a W schedule), and
    --p2p-dtype / --grad-reduce-dtype / --grad-compression where nothing travels that way."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate import adapt_defaults

    def notes(**kw):
        return " | ".join(adapt_defaults(TrainConfig(max_steps=10, warmup_steps=1, **kw),
                                         kw.get("dp", 1)))

    assert "--zero 3 with dp x cp = 1: there is no rank to shard over" in notes(zero=3)
    assert "shard over" not in notes(zero=3, dp=2, global_batch_size=8, micro_batch_size=4)
    # --muon-distributed at dp 1 (tp 2) splits nothing: said, not silently ignored
    assert ("--zero 1 with dp x cp = 1: there is no rank to shard over, so every rank keeps "
            "whole state; --muon-distributed has no data-parallel rank "
            "to split the orthogonalisation over") in notes(zero=1, tp=2, optimizer="muon",
                                                          muon_distributed=True)
    # the optimizer's offload applies, the parameters' (ZeRO-3's shards) does not: it said
    # "offloads still apply" of both (a new user's tryout of precision-zero.md)
    assert ("every rank keeps whole state (--offload-optimizer still applies); "
            "--offload-params changes nothing here: it keeps ZeRO-3's parameter shards on the "
            "host, and there are none") in notes(zero=3, offload_optimizer=True,
                                                 offload_params=True)
    assert "--muon-distributed" not in notes(zero=1, tp=2, optimizer="muon")
    one = notes(zero=3, dp=2, zero3_reduce="micro-batch", global_batch_size=4,
                micro_batch_size=2)
    assert "with one micro-batch per step: the same as step" in one
    w = notes(zero=3, dp=2, pp=2, schedule="zb-h1", zero3_reduce="micro-batch",
              global_batch_size=8, micro_batch_size=1)
    assert "under --schedule zb-h1: its W passes report the weight gradients once a step" in w
    assert "--zero3-reduce" not in notes(zero=3, dp=2, pp=2, zero3_reduce="micro-batch",
                                         global_batch_size=8, micro_batch_size=1)
    # the wire dtypes of messages a layout does not send were accepted without a word
    assert "--p2p-dtype bf16 at --pp 1: no pipeline messages" in notes(p2p_dtype="bf16")
    assert "--p2p-dtype" not in notes(p2p_dtype="bf16", pp=2)
    assert "--grad-reduce-dtype fp16 at dp x cp = 1: no data-parallel reduction" in notes(
        grad_reduce_dtype="fp16")
    assert "--grad-compression powersgd at dp x cp = 1" in notes(grad_compression="powersgd")
    assert "--grad-reduce-dtype" not in notes(grad_reduce_dtype="fp16", dp=2,
                                               global_batch_size=8, micro_batch_size=4)


def _tied_steps() -> tuple[list[float], list]:
    """gpt2-tiny (tied head) at dp 2, ZeRO-3, the whole logits, without and with a
    persistence threshold of 100: each one step's loss, and the second's units (name, names
    of its parameters)."""
    import torch.distributed as dist

    import megapar

    losses = []
    for persist in (0, 100):
        engine = megapar.prepare("gpt2-tiny", micro_batch_size=1, zero=3, seq_len=16,
                                 global_batch_size=2 * dist.get_world_size(),
                                 loss_chunk_tokens=0, zero3_persistence_threshold=persist)
        ids = torch.randint(0, 1000, (4, 17), generator=torch.Generator().manual_seed(0))
        losses.append(float(engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})))
    names = {id(p): n for n, p in engine.model.named_parameters()}
    units = [(u.name, sorted(names[id(p)] for p in u.params)) for u in engine.sharded_params.units]
    return losses, units


def test_a_tied_head_whose_own_parameters_all_persist_keeps_the_word_embedding_to_its_backward():
    """With a persistence threshold above the final norm's size, a tied model's chunk has no
    tail of its own parameters; the word embedding the head reads stayed in the embedding
    unit, freed after the forward, and the head's backward (--loss-chunk-tokens 0, or tp > 1)
    read a freed weight ("setStorage: ... out of bounds for storage of size 0"). It now goes
    in the root unit as without the threshold: the step runs, its loss the threshold 0's, and
    the plan lays out the same units (`plan.params.stage_units`)."""
    from megapar.models.recipes import resolve_model
    from megapar.plan.params import StageLayout, stage_tensors, stage_units

    (loss0, loss), units = run_local(_tied_steps, 2)[0]
    assert loss == loss0
    roots = dict(units)
    assert roots["chunk 0 root"] == ["embed.word.weight"]
    assert roots["chunk 0 embedding"] == ["embed.position.weight"]
    config = resolve_model("gpt2-tiny")
    tensors = stage_tensors(StageLayout.of(config))
    planned = {u.kind: [tensors[i].numel for i in u.tensors]
               for u in stage_units(StageLayout.of(config, persist_below=100))}
    h = config.hidden_size
    assert planned["root"] == [50304 * h] and planned["embedding"] == [config.n_positions * h]
