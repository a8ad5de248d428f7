"""--offload-optimizer: the optimizer steps host copies of its stepped tensors (issue 30).

With `MEGAPAR_HOST_COPIES=1` the CPU ranks keep separate host masters, as a CUDA run does, so
the copying path (gradients to the host, the step there, parameters back) is what runs. It must
train as one process does (fp32, 1e-5, 3 steps with clipping): at dp 1 without ZeRO, at dp 2 and
tp 2 x dp 2 with ZeRO-1 (where the stepped tensors are the pieces); and its checkpoints are
canonical: an offloaded optimizer's state loads into one without offload and the reverse.
"""

import pytest
import torch
from test_layout_change import common  # noqa: F401 - the fixture
from test_parity_3d import _worker, check_against, serial_reference

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import GPT2Config
from megapar.optim import build_optimizer
from megapar.optim.offload import HOST_COPIES_ENV, HostKeyed
from megapar.pipeline.partition import build_stage
from megapar.training.config import TrainConfig
from megapar.training.validate import UsageError, check_settings


@pytest.fixture(scope="module")
def reference():
    return serial_reference()


@pytest.fixture
def host_copies(monkeypatch):
    monkeypatch.setenv(HOST_COPIES_ENV, "1")


def _one_rank(runs):
    """`_worker` as the one rank of a gloo group (the launcher makes none for one rank)."""
    import torch.distributed as dist

    from megapar.launcher import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        return _worker(runs)
    finally:
        dist.destroy_process_group()


def _offloaded(tp, dp, zero):
    return (tp, 1, dp, zero, "fp32", "1f1b", 1, "tp-pp-dp", False, 1, 2, True)


def test_offload_parity_dp1_zero0_and_dp2_zero1(reference, host_copies):
    outs = run_local(_one_rank, 1, [_offloaded(1, 1, 0)])
    check_against(reference, [o[0] for o in outs])
    assert outs[0][0]["host_copies"] and outs[0][0]["refreshed"] == 0
    outs = run_local(_worker, 2, [_offloaded(1, 2, 1)])
    check_against(reference, [o[0] for o in outs])
    assert all(o[0]["host_copies"] and o[0]["refreshed"] == 0 for o in outs)


def test_offload_parity_tp2_dp2_zero1(reference, host_copies):
    outs = run_local(_worker, 4, [_offloaded(2, 2, 1)])
    check_against(reference, [o[0] for o in outs])
    assert all(o[0]["host_copies"] and o[0]["refreshed"] == 0 for o in outs)


CONFIG = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _steps(model, opt, seed, n):
    """n AdamW steps on gradients drawn from `seed` (the same for every optimizer)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("first,second", [(True, False), (False, True)])
def test_offload_checkpoint_is_canonical_both_ways(host_copies, first, second):
    """3 steps with one setting, its state saved and loaded into the other, 2 more steps: the
    weights and moments of a run that kept the first setting throughout, exactly."""
    mesh = Mesh(Layout())
    models = [build_stage(CONFIG, mesh, seed=3) for _ in range(3)]
    through, before, after = (build_optimizer(m, mesh, 1e-2, 0.1, offload=o)
                              for m, o in zip(models, (first, first, second)))
    assert (through.host is not None) == first and (after.host is not None) == second
    _steps(models[0], through, 7, 3)
    _steps(models[1], before, 7, 3)
    models[2].load_state_dict(models[1].state_dict())
    after.load_state_tensors(before.state_tensors())
    after.load_state_json(before.state_json())
    for model, opt in ((models[0], through), (models[2], after)):
        _steps(model, opt, 9, 2)
    for (n, a), b in zip(models[0].named_parameters(), models[2].parameters()):
        assert torch.equal(a, b), n
    saved, resumed = through.state_tensors(), after.state_tensors()
    assert saved.keys() == resumed.keys()
    for n in saved:
        for k in saved[n]:
            assert torch.equal(saved[n][k], resumed[n][k]), (n, k)
    if first:  # its own steps never changed the weights behind the masters' back
        assert through.host.refreshed == 0
    if second:  # the loaded weights reached the masters, once each, at the first step
        assert after.host.refreshed == len(after.params)
    if second:  # the loaded state lives with the host masters, not the parameters
        for p in after.params:
            master = after.host.master_of[id(p)]
            assert after.inner.state[p] is after.inner.state[master]
            assert master.data_ptr() != p.data_ptr()


def test_host_keyed_state_finds_masters_by_their_tensors():
    t, master = torch.zeros(3), torch.ones(3)
    state = HostKeyed({id(t): master})
    state[t] = {"exp_avg": torch.full((3,), 2.0)}
    assert t in state and master in state and state.get(t) is state[master]


@pytest.mark.parametrize("flags,message", [
    ({"offload_params": True}, "--offload-params needs --zero 3"),
    ({"offload_params": True, "zero": 1}, "--offload-params needs --zero 3"),
    ({"offload_optimizer": True, "optimizer": "lamb"}, "--offload-optimizer steps AdamW or SGD"),
    ({"offload_params": True, "zero": 3}, "--offload-params needs --offload-optimizer"),
])
def test_offload_combinations_it_cannot_serve_are_one_line(flags, message):
    with pytest.raises(UsageError, match=message) as err:
        check_settings(TrainConfig(**flags))
    assert "\n" not in str(err.value)


_HOST = "it keeps the parameter shards in host memory; {zero} keeps whole parameters on the device"
_STEPS = ("the host-held parameter shards are the weights the optimizer steps, so it steps on "
          "the host too, as DeepSpeed's offload_param with offload_optimizer")


@pytest.mark.parametrize("flags, cli, api", [
    ({"offload_params": True, "zero": 1},
     f"--offload-params needs --zero 3 ({_HOST.format(zero='--zero 1')}): add --zero 3 and "
     f"--offload-optimizer, or use --offload-optimizer alone",
     f"offload_params=True needs zero=3 ({_HOST.format(zero='zero=1')}): add zero=3 and "
     f"offload_optimizer=True, or use offload_optimizer=True alone"),
    ({"offload_params": True, "offload_optimizer": True},
     f"--offload-params needs --zero 3 ({_HOST.format(zero='--zero 0')}): add --zero 3, or drop "
     f"--offload-params",
     f"offload_params=True needs zero=3 ({_HOST.format(zero='zero=0')}): add zero=3, or drop "
     f"offload_params=True"),
    # an optimizer the host does not step: the fix is not to add --offload-optimizer
    ({"offload_params": True, "zero": 2, "optimizer": "lars"},
     f"--offload-params needs --zero 3 ({_HOST.format(zero='--zero 2')}): drop --offload-params "
     f"(--optimizer lars does not step on the host), or use --optimizer adamw with --zero 3 and "
     f"--offload-optimizer",
     f"offload_params=True needs zero=3 ({_HOST.format(zero='zero=2')}): drop offload_params=True "
     f"(optimizer='lars' does not step on the host), or use optimizer='adamw' with zero=3 and "
     f"offload_optimizer=True"),
    ({"offload_params": True, "offload_optimizer": True, "optimizer": "muon"},
     f"--offload-params needs --zero 3 ({_HOST.format(zero='--zero 0')}): drop --offload-params "
     f"and --offload-optimizer (--optimizer muon does not step on the host), or use --optimizer "
     f"adamw with --zero 3",
     f"offload_params=True needs zero=3 ({_HOST.format(zero='zero=0')}): drop offload_params=True "
     f"and offload_optimizer=True (optimizer='muon' does not step on the host), or use "
     f"optimizer='adamw' with zero=3"),
    ({"offload_params": True, "zero": 3},
     f"--offload-params needs --offload-optimizer ({_STEPS}): add --offload-optimizer",
     f"offload_params=True needs offload_optimizer=True ({_STEPS}): add offload_optimizer=True"),
])
def test_offload_params_is_checked_in_one_place_for_megapar_train_and_prepare(flags, cli, api):
    """check_zero3 owns --offload-params' checks, megapar-train's in its flags and
    megapar.prepare's in its keywords: the same sentence (they were written twice, in
    validate.py and prepare.py, and told different fixes: '--zero 3, or use
    --offload-optimizer' where prepare said 'zero=3 and offload_optimizer=True')."""
    from megapar.training.validate_sharding import check_zero3

    with pytest.raises(UsageError) as err:
        check_settings(TrainConfig(**flags))
    assert str(err.value) == cli
    with pytest.raises(UsageError) as err:
        check_zero3(TrainConfig(**flags), keyword="megapar.prepare")
    assert str(err.value) == f"megapar.prepare: {api}"


def test_cli_offload_checkpoint_resumes_without_offload(tmp_path, common, host_copies):  # noqa: F811
    """megapar-train --dp 2 --zero 1 --offload-optimizer (host copies, as on CUDA) saves at step
    3 of 6; resumed without offload and without ZeRO it logs the losses of the run that went
    on (fp32, 1e-5)."""
    from test_layout_change import _assert_continues, _train_and_checkpoint

    from megapar.cli.train import main as train

    reference, step3 = _train_and_checkpoint(
        tmp_path, common, ["--dp", "2", "--zero", "1", "--offload-optimizer"])
    log = tmp_path / "resumed.jsonl"
    assert train([*common, "--dp", "2", "--zero", "0", "--load", str(step3),
                  "--log-json", str(log)]) == 0
    _assert_continues(reference, log, "offload zero=1 dp=2 -> no offload zero=0 dp=2")


def test_a_tensor_without_gradient_is_not_stepped_on_the_host(host_copies):
    """As torch's optimizer skips a parameter whose .grad is None, so does the host step (a
    stale host gradient from an earlier step must not move it)."""
    mesh = Mesh(Layout())
    model = build_stage(CONFIG, mesh, seed=3)
    opt = build_optimizer(model, mesh, 1e-2, 0.0, offload=True)
    _steps(model, opt, 7, 1)
    frozen, moved = opt.params[0], opt.params[1]
    before, other = frozen.detach().clone(), moved.detach().clone()
    opt.zero_grad()
    for p in opt.params[1:]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(frozen, before) and not torch.equal(moved, other)


def test_offload_parity_zero2_dp2_and_tp2_dp2(reference, host_copies):
    """--zero 2 (the reduced gradients sharded too): the host step's gradients are the
    shard's slices; dp 2, and tp 2 x dp 2, train as one process."""
    for world, tp in ((2, 1), (4, 2)):
        outs = run_local(_worker, world, [_offloaded(tp, 2, 2)])
        check_against(reference, [o[0] for o in outs])
        assert all(o[0]["host_copies"] and o[0]["refreshed"] == 0 for o in outs)


def test_offload_parity_zero3_dp2_and_pp2_dp2(reference, host_copies):
    """--zero 3: the optimizer steps host copies of this rank's parameter shards; dp 2 and
    pp 2 x dp 2 (1F1B) train as one process."""
    from test_zero3 import _worker as zero3_worker

    for world, pp in ((2, 1), (4, 2)):
        run = (1, pp, 2, "1f1b", False, False, 1, "none", "tp-pp-dp", 1, 2, 0, True)
        outs = run_local(zero3_worker, world, [run])
        check_against(reference, [o[0] for o in outs])
        assert all(o[0]["host_copies"] and o[0]["refreshed"] == 0 and o[0]["freed"]
                   for o in outs)


@pytest.mark.parametrize("saved,resumed", [
    (["--zero", "3", "--offload-optimizer"], ["--zero", "0"]),
    (["--zero", "0"], ["--zero", "3", "--offload-optimizer"]),
    (["--zero", "3", "--offload-optimizer", "--offload-params"], ["--zero", "0"]),
    (["--zero", "0"], ["--zero", "3", "--offload-optimizer", "--offload-params"]),
])
def test_cli_zero3_offload_checkpoint_both_ways(tmp_path, common, host_copies,  # noqa: F811
                                                saved, resumed):
    """megapar-train --dp 2: a checkpoint of an offloaded --zero 3 run (optimizer, and
    parameter shards too) resumes at --zero 0, and the reverse, with the losses of the run
    that went on (fp32, 1e-5)."""
    from test_layout_change import _assert_continues, _train_and_checkpoint

    from megapar.cli.train import main as train

    reference, step3 = _train_and_checkpoint(tmp_path, common, ["--dp", "2", *saved])
    log = tmp_path / "resumed.jsonl"
    assert train([*common, "--dp", "2", *resumed, "--load", str(step3),
                  "--log-json", str(log)]) == 0
    _assert_continues(reference, log, f"{saved} -> {resumed}")


def test_offload_params_parity_and_bytes_dp2_tp2_pp2(reference, host_copies):
    """--zero 3 --offload-params --offload-optimizer with separate host copies (as on CUDA):
    the parameter shards live in host memory, each unit's shard is copied to a device staging
    shard for its gather and freed after it, and the host step updates the host shards in
    place. dp 2, tp 2 x dp 2 and pp 2 x dp 2 train as one process; between steps the device
    holds the shards' bytes less than without --offload-params, and the host holds them, once
    (the host step's masters are the host shards, not copies of them)."""
    from test_zero3 import _worker as zero3_worker

    for world, tp, pp in ((2, 1, 1), (4, 2, 1), (4, 1, 2)):
        runs = [(tp, pp, 2, "1f1b", False, False, 1, "none", "tp-pp-dp", 1, 2, 0, True, p)
                for p in (False, True)]
        outs = run_local(zero3_worker, world, runs)
        for i in range(2):
            check_against(reference, [o[i] for o in outs])
        for o in outs:
            kept, offloaded = o[0]["held"], o[1]["held"]
            assert kept["shards"] == offloaded["shards"] > 0
            assert kept["host"] == 0 and kept["device"] == kept["shards"]
            assert offloaded["device"] == kept["device"] - kept["shards"] == 0
            assert offloaded["host"] == offloaded["masters"] == kept["shards"]
            assert o[1]["refreshed"] == 0 and o[1]["freed"]


def _resumed_into_zero(root: str, zero: int):
    """Steps 1-2, a save, step 3; then a fresh ZeRO-`zero` engine with --offload-optimizer
    loading the save and running step 3: both runs' weights, and the masters the load
    refreshed."""
    from transformers import GPT2Config

    import megapar

    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    gen = torch.Generator().manual_seed(7)
    batches = [{"input_ids": (ids := torch.randint(0, 96, (8, 16), generator=gen)),
                "labels": ids.clone()} for _ in range(3)]

    def engine():
        return megapar.prepare(config, micro_batch_size=2, lr=3e-3, global_batch_size=8,
                               seq_len=16, seed=5, zero=zero, offload_optimizer=True)

    straight = engine()
    for batch in batches[:2]:
        straight.train_step(batch)
    straight.save(root)
    straight.train_step(batches[2])
    resumed = engine()  # its masters: copies of its own initial weights
    resumed.load(root)
    resumed.train_step(batches[2])
    return ([p.detach().clone() for p in straight.model.parameters()],
            [p.detach().clone() for p in resumed.model.parameters()],
            resumed.optimizer.host.refreshed, len(resumed.optimizer.pieces))


@pytest.mark.parametrize("zero", [1, 2])
def test_a_checkpoint_loaded_into_zero_pieces_reaches_the_host_masters(zero, tmp_path,
                                                                       host_copies):
    """With host copies (as on CUDA), ZeRO-1 / 2 steps masters of its pieces, views into the
    flat parameter buffer; a load writes through the parameters, whose version counters are
    their own. The masters watch the parameters, so the first step after `engine.load` copies
    every piece's loaded weights to its master and resumes bit for bit (it stepped the fresh
    engine's initial weights before)."""
    from megapar.launcher import run_local

    for straight, resumed, refreshed, pieces in run_local(_resumed_into_zero, 2,
                                                          str(tmp_path), zero):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
        assert refreshed == pieces > 0


def test_the_gathered_peak_holds_the_staging_shard_of_an_offloaded_gather_in_flight(
        host_copies, monkeypatch):
    """--offload-params: a unit's gather copies its host shard into a device staging shard at
    the launch and frees it when the gather is waited for, so while a block runs its forward
    with the next one prefetched, the next one's staging shard (1 / dp of its fp32 buffer) is
    held beside the gathered units. A real run (forked gloo ranks with separate host copies,
    the gathers whole and async as NCCL runs them), the dry run and the plan count it alike:
    gpt2-tiny at dp 2, fp32, the units' buffers plus a block's 99,968-byte shard. The three
    left it out: 13,310,976 bytes each."""
    from megapar.data_parallel import shard_comm
    from megapar.data_parallel.sharded_params import ShardedParams
    from megapar.dryrun import dry_run
    from megapar.dryrun.measure import measured_rank
    from megapar.models.recipes import resolve_model
    from megapar.plan.params import StageLayout, stage_tensors, stage_units
    from megapar.plan.state import Offload, rank_state
    from megapar.plan.zero3_peaks import gathered_peak

    config = resolve_model("gpt2-tiny")
    cfg = TrainConfig(dp=2, seq_len=16, micro_batch_size=2, global_batch_size=8, zero=3,
                      offload_optimizer=True, offload_params=True)
    monkeypatch.setattr(shard_comm, "HOST_PIECE_BYTES", 2**40)  # whole, async gathers
    monkeypatch.setattr(ShardedParams, "HOST_PIECE_MB", 2.0**40)
    real = run_local(measured_rank, 2, cfg.to_dict(), config.to_dict(), 1)
    dry = dry_run(cfg, config, Layout(1, 1, 2), [0, 1])
    planned = rank_state(StageLayout.of(config, dp=2, zero=3), 0, Offload(True, True)).gathered
    assert [r.gathered for r in dry] == [m["gathered"] for m in real] == [planned] * 2
    # without the staging shard: the units' fp32 buffers alone, as all three counted them
    specs = stage_units(StageLayout.of(config))
    tensors = stage_tensors(StageLayout.of(config))
    full = [-(-sum(tensors[i].numel for i in u.tensors) // 2) * 2 * 4 for u in specs]
    shard = max(n // 2 for u, n in zip(specs, full) if u.kind == "block")
    assert shard == 99_968 and planned == gathered_peak(specs, full, False) + shard
