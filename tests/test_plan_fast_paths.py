"""The planner's fast paths against the slow definitions they replace: each must give the same
result exactly, over a grid (megapar-plan's output is byte-identical with and without them)."""

import json

import pytest

from megapar.models.recipes import resolve_model
from megapar.pipeline import messages
from megapar.pipeline.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    placement_of,
    schedule_actions,
    stage_actions,
)
from megapar.pipeline.simulate import Costs, action_times, simulate
from megapar.plan import pipeline
from megapar.plan.params import GatherCasts, StageLayout
from megapar.plan.slices import most_loaded
from megapar.plan.state import Offload, rank_state, w_reported


def _sizes(name):
    """(pp, m, v) of a grid over every schedule, small and uneven sizes included."""
    vs = (2, 3) if name == "interleaved" else (2,) if placement_of(name) == "v" else (1,)
    for pp in (1, 2, 3, 4):
        for m in (1, 2, 3, 5, 8, 9, 12):
            for v in vs:
                try:
                    schedule_actions(name, pp, m, 0, v)
                except ValueError:
                    continue
                yield pp, m, v


GRID = [(name, *size) for name in SCHEDULES for size in _sizes(name)]


def test_the_grid_covers_every_schedule():
    assert {name for name, *_ in GRID} == set(SCHEDULES) and len(GRID) > 150


def test_split_backward_is_exactly_the_schedules_with_w_actions():
    """`w_reported` answers from `SPLIT_BACKWARD` without building the schedule: the same
    answer as reading every stage's actions."""
    for name, pp, m, v in GRID:
        for stage in range(pp):
            has_w = any(a.kind == "backward_weight"
                        for a in schedule_actions(name, pp, m, stage, v))
            assert has_w == (name in SPLIT_BACKWARD) == w_reported(name, pp, m, v), \
                (name, pp, m, v, stage)


def test_stage_actions_are_every_stage_s_schedule():
    for name, pp, m, v in GRID:
        assert stage_actions(name, pp, m, v) == tuple(
            tuple(schedule_actions(name, pp, m, s, v)) for s in range(pp))


def test_action_times_are_the_timeline_s_times():
    """`action_times` (no `Event`s) gives each stage's event times in program order, for equal
    and per-stage costs with latency."""
    for name, pp, m, v in GRID:
        schedules = [schedule_actions(name, pp, m, s, v) for s in range(pp)]
        for costs in (Costs(), [Costs(fwd_ms=1 + 0.1 * s, bwd_ms=2.3, p2p_ms=0.07 * s,
                                      send_ms=0.01, bwd_input_ms=1.1) for s in range(pp)]):
            timeline = simulate(schedules, costs, placement_of(name))
            times = action_times(schedules, costs, placement_of(name))
            for stage in range(pp):
                events = [(e.start, e.end) for e in timeline.events if e.rank == stage]
                assert times[stage] == events and len(events) == len(schedules[stage])


def test_held_stages_is_held_of_each_stage():
    for name, pp, m, v in GRID:
        programs = messages.programs(name, pp, m, v)
        together = messages.held_stages(programs, placement_of(name))
        assert together == [messages.held(programs, s, placement_of(name)) for s in range(pp)]
        assert [pipeline.stage_held(name, pp, m, v, s) for s in range(pp)] == together


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_most_loaded_is_the_worst_of_every_dp_rank(model):
    """The vectorised `most_loaded` (candidate ranks, all units at once) against every dp
    rank's `rank_state` one by one: the most optimizer bytes (with offload, plus the host
    copies), equal in every field."""
    config = resolve_model(model)
    config_json = json.dumps(config.to_dict(), sort_keys=True)
    with pytest.raises(TypeError):  # every field by keyword: none passed by position
        StageLayout(config_json, 1)  # type: ignore[misc]
    for tp, pp, v in ((1, 1, 1), (1, 2, 1), (2, 2, 2)):
        for dp in (2, 3, 7, 16):
            for zero in (1, 2, 3):
                for offload, persist_below, casts in (
                        (Offload(), 0, GatherCasts()), (Offload(optimizer=True), 0, GatherCasts()),
                        (Offload(True, True, whole_grads=False, micro_batches=4), 300,
                         GatherCasts()),
                        (Offload(), 0, GatherCasts(half=True))):  # 16-bit units
                    if offload.params and zero < 3:
                        continue
                    for stage in range(pp):
                        layout = StageLayout(config_json=config_json, tp=tp, pp=pp, v=v,
                                             stage=stage, dp=dp, zero=zero, bucket_mb=0.01,
                                             persist_below=persist_below, casts=casts)
                        states = [rank_state(layout, r, offload) for r in range(dp)]
                        # what a ZeRO stage does not read, trimmed (the planner's cache key)
                        assert rank_state(layout.trimmed(), 0, offload) == states[0]
                        worst = max(states, key=lambda x: x.optimizer + x.master)
                        got = most_loaded(layout, offload)
                        assert got == worst, (model, tp, pp, v, dp, zero, offload, stage)


def test_most_loaded_under_expert_parallelism(monkeypatch):
    """mixtral-tiny (4 experts) with ep 2 and 4 over cp x dp ranks: `most_loaded` equals the
    worst `rank_state` of every rank (each rank's dense slice over cp x dp, its experts' over
    the expert-data-parallel group); above `EXACT_EP_RANKS` ranks, where the two groups' worst
    slices are added (an upper bound), the same in these layouts."""
    from megapar.plan import slices

    config = resolve_model("mixtral-tiny")
    config_json = json.dumps(config.to_dict(), sort_keys=True)
    for pp, dp, cp, ep, zero in ((1, 4, 1, 2, 1), (2, 8, 1, 4, 2), (1, 4, 2, 2, 1),
                                 (1, 8, 2, 4, 2)):
        for stage in range(pp):
            layout = StageLayout(config_json=config_json, pp=pp, stage=stage, dp=dp * cp,
                                 zero=zero, bucket_mb=0.01, ep=ep)
            states = [rank_state(layout, r) for r in range(dp * cp)]
            worst = max(states, key=lambda x: x.optimizer)
            assert most_loaded(layout) == worst, (pp, dp, cp, ep, zero, stage)
            monkeypatch.setattr(slices, "EXACT_EP_RANKS", 0)
            slices._slice_loads.cache_clear()
            bound = most_loaded.__wrapped__(layout)
            summed = slices._slice_loads(layout)[3]  # the two groups' worst
            slices._slice_loads.cache_clear()
            monkeypatch.undo()
            assert len(summed) == 1 and len(slices._slice_loads(layout)[3]) > 1
            assert bound == worst  # here one rank holds both groups' worst slices


@pytest.mark.parametrize("model, ep", [("llama-1b", 1), ("deepseek-v3-gqa", 2)])
def test_alike_stages_hold_the_same_parameters(model, ep):
    """`params.alike_stages`, which the planner asks for a rank's state instead of the rank
    itself: every pipeline rank holds the same parameters and ZeRO-3 units as the rank that
    stands for it, so the same state (`most_loaded`) under every ZeRO stage; the ranks with
    the embedding or the head, and (DeepSeek's first three layers dense) those whose layer
    kinds differ, stand for themselves."""
    from megapar.plan.params import (StageLayout, alike_stages, layer_kinds, stage_tensors,
                                     stage_units)

    config = resolve_model(model)
    config_json = json.dumps(config.to_dict(), sort_keys=True)
    kinds = layer_kinds(config)
    for pp, v, placement in ((4, 1, "loop"), (8, 1, "loop"), (4, 2, "loop"), (4, 2, "v")):
        alike = alike_stages(config_json, pp, v, placement)
        head = 0 if placement == "v" else pp - 1  # the V places the head on rank 0
        assert alike[0] == 0 and alike[head] == head and len(set(alike)) < pp
        for stage, rep in enumerate(alike):
            assert rep <= stage
            same = [f(StageLayout(config_json=config_json, pp=pp, v=v, stage=s, placement=placement,
                                  ep=ep)) for f in (stage_tensors, stage_units) for s in (stage, rep)]
            assert same[0] == same[1] and same[2] == same[3], (pp, v, placement, stage, rep)
            for zero in (0, 1, 3):
                states = [most_loaded(StageLayout(config_json=config_json, pp=pp, v=v, stage=s,
                                                  placement=placement, ep=ep, dp=4, zero=zero))
                          for s in (stage, rep)]
                assert states[0] == states[1], (pp, v, placement, stage, zero)
    if any(kinds) and not all(kinds):  # DeepSeek at pp 32: rank 1 holds dense layer 2 and MoE layer 3
        alike = alike_stages(config_json, 32, 1, "loop")
        assert alike[1] == 1 and alike[2] == 2 and alike[3] == 2
        for stage in (1, 2):
            tensors = stage_tensors(StageLayout(config_json=config_json, pp=32, stage=stage, ep=ep))
            assert (tensors == stage_tensors(StageLayout(config_json=config_json, pp=32, stage=2,
                                                         ep=ep))) == (stage == 2)


@pytest.mark.parametrize("fp8", ["off", "tensorwise"])
def test_shared_work_gives_every_estimate_unchanged(fp8):
    """`estimate.Shared`: a search's candidates share their activations, chunk times and states
    by the fields each reads. Every estimate of a search (ZeRO stages, offload, ep, schedules,
    under --fp8 too, whose amax all-reduces read the ZeRO options) made with one `Shared` for
    all equals the estimate made alone, field by field."""
    from megapar.plan import Problem, enumerate_candidates, estimate
    from megapar.plan.estimate import Shared

    p = Problem(resolve_model("mixtral-tiny"), 8, global_batch=16, seq_len=64, fp8=fp8,
                fp8_layers="all")
    valid, _ = enumerate_candidates(p, micro_batch_sizes=(1, 2),
                                    offloads=("none", "optimizer", "both"))
    assert len({c.zero for c in valid}) == 4 and len({c.ep for c in valid}) > 1
    shared = Shared()
    for simulate in (False, True):
        for c in valid[:: 13 if simulate else 3]:
            assert estimate(p, c, simulate, shared) == estimate(p, c, simulate), c.spec()


def test_schedules_share_one_action_per_value():
    """The schedules build their actions with `actions.action`: one instance per (kind, mb,
    chunk), equal to the Action made afresh, so a large pipeline's millions of actions are
    looked up, not made; a bad kind or index is still refused."""
    from megapar.pipeline.actions import Action, action

    a = schedule_actions("interleaved", 4, 8, 1, 2)
    b = schedule_actions("interleaved", 4, 8, 1, 2)
    assert all(x is y for x, y in zip(a, b, strict=True))
    assert a == [Action(x.kind, x.mb, x.chunk) for x in a]
    assert action("forward", 3, 1) is action("forward", 3, 1) == Action("forward", 3, 1)
    for bad in (("fwd", 0, 0), ("forward", -1, 0)):
        with pytest.raises(ValueError):
            action(*bad)


def test_order_held_counts_the_sent_outputs_as_it_goes():
    """`pipeline.order_held` keeps the in-flight outputs that are sent as a running sum: the
    same points as summing the sending chunks' counts after every compute."""
    from megapar.pipeline.schedules import virtual_stage

    for name, pp, m, v in GRID:
        for stage in range(pp):
            sends = [virtual_stage(stage, c, pp, placement_of(name)) < pp * v - 1
                     for c in range(v)]
            counts, seen = [0] * v, set()
            for a in schedule_actions(name, pp, m, stage, v):
                if a.kind in ("forward", "backward", "backward_input"):
                    counts[a.chunk] += 1 if a.kind == "forward" else -1
                    seen.add((tuple(counts), sum(k for k, out in zip(counts, sends) if out)))
            assert pipeline.order_held(name, pp, m, v, stage) == frozenset(seen), (name, pp, m, v)


@pytest.mark.parametrize("memory", [0.77, 0.775])
def test_search_drops_only_layouts_that_cannot_fit(memory):
    """`plan.search` with the rows shown drops the layouts some stage of which cannot fit
    (`estimate.cannot_fit`) before their estimate, and only those: its ranking is `plan`'s
    without them, estimate by estimate, and its valid count `plan`'s. mixtral-tiny on 8 GPUs,
    one sequence a micro-batch: at 0.775 GiB 114 of 1,464 layouts fit and 384 are dropped; at
    0.77 GiB 52 fit, fewer than the simulated leaders, and none is dropped."""
    from megapar.plan import Problem, plan, search

    p = Problem(resolve_model("mixtral-tiny"), 8, gpu_memory_gb=memory, global_batch=16,
                seq_len=64)
    every, rejected = plan(p, micro_batch_sizes=(1,))
    found = search(p, shown=5, micro_batch_sizes=(1,))
    assert found.valid == len(every) == 1464 and found.rejected == rejected
    kept = {e.candidate for e in found.estimates}
    dropped = [e for e in every if e.candidate not in kept]
    assert len(dropped) == {0.77: 0, 0.775: 384}[memory]
    assert not any(e.fits for e in dropped)
    assert found.estimates == [e for e in every if e.candidate in kept]
