"""The CUDA tier: the parity and communication tests again, on GPUs with NCCL.

Every test here is marked `cuda(gpus=N)` and skipped on a machine with fewer than N GPUs (the
CPU suite runs everything else on gloo, where a send is buffered and messages pair by tag; NCCL
is stricter). One process per GPU, started with spawn (CUDA cannot be forked). Run them with
`tools/gpu_check.sh`, which prints a summary to paste into an issue and fails if no GPU test
ran. What runs here:

- pipeline parity on NCCL for every schedule (GPipe, 1F1B, interleaved, ZB-H1) against one
  process, and the same schedules with 16 MiB activations (a send larger than NCCL's buffers
  finishes only while its receive runs: the grouping of `pipeline/messages.py` is what keeps
  this from deadlocking);
- tensor, data (with ZeRO-1) and sequence parallelism, ZB-H1 with dp: the 3D parity test's
  layouts against the serial reference; bf16 against fp32;
- context parallelism on NCCL (ring exchanges as group calls, the all-gather, the written-out
  fp32 block kernel GPUs run): cp 2 for GPT-2, grouped-query Llama and BERT against one process,
  and tp x cp x pp = 2 x 2 x 2 over 5 steps;
- the collective counts of a tensor-parallel step on NCCL;
- no host-device synchronisation inside a pipeline step (`torch.cuda.set_sync_debug_mode`);
- the ZeRO-1 save's device memory: at most one bucket above training;
- ZeRO-3 with `--offload-params`: the same losses, and the parameter shards off the GPUs
  (device memory measured between steps);
- a short `megapar-train` on the GPUs.

`MEGAPAR_CUDA_TIER_ON_CPU=1` runs the tier's own logic on gloo on a machine without GPUs (the
CUDA-only checks are then skipped inside the tests), with a GPU's placement rule modelled
(`device_model.py`: a worker that hands a model a host tensor fails as it would on a GPU); it
is how the tier is developed, never a GPU check (`tools/gpu_check.sh` refuses it). Workers
put their batches on the mesh's device and return host tensors (`_tier_worker`), which the
parent compares with references computed on the CPU. tests/test_cuda_single.py is the tier of
one GPU.
"""

import os
import subprocess
import sys

import pytest
import torch
from device_model import HostTensorError, call_with_device_model

from megapar.launcher import run_local

ON_CPU = os.environ.get("MEGAPAR_CUDA_TIER_ON_CPU") == "1"


def run_gpus(fn, n, *args, **kwargs):
    """`fn` on n ranks, one per GPU, NCCL (gloo on the CPU in a rehearsal, under the device
    model); each rank's result with its tensors on the host."""
    env = {"MEGAPAR_CPU": "1" if ON_CPU else "0"}
    return run_local(_tier_worker, n, fn, ON_CPU, *args,
                     start_method="fork" if ON_CPU else "spawn", env=env, timeout_s=900,
                     collective_timeout_s=120, **kwargs)


def _tier_worker(fn, rehearsal, *args):
    """A tier worker: `fn(*args)` (under the device model in a rehearsal), its tensors moved
    to the host (the parent compares them with references computed on the CPU)."""
    if rehearsal:
        return _on_host(call_with_device_model(fn, *args))
    return _on_host(fn(*args))


def _on_host(out):
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, dict):
        return {k: _on_host(v) for k, v in out.items()}
    if type(out) in (list, tuple):
        return type(out)(_on_host(v) for v in out)
    return out


def on_cuda() -> bool:
    return not ON_CPU and torch.cuda.is_available()


# pipeline ---------------------------------------------------------------------------------------
def _pipeline_parity(tp, pp):
    import test_pipeline_parity
    import test_pipeline_parity_chunks

    from megapar import device

    assert not on_cuda() or device.backend() == "nccl"
    return test_pipeline_parity.parity_worker(tp, pp), \
        test_pipeline_parity_chunks.parity_worker(tp, pp)


@pytest.mark.cuda(gpus=2)
def test_every_schedule_matches_one_process_on_nccl():
    for plain, chunked in run_gpus(_pipeline_parity, 2, 1, 2):
        assert plain["steps"] > 0 and chunked["steps"] > 0


@pytest.mark.cuda(gpus=4)
def test_every_schedule_matches_one_process_on_nccl_tp2_pp2():
    for plain, chunked in run_gpus(_pipeline_parity, 4, 2, 2):
        assert plain["steps"] > 0 and chunked["steps"] > 0


def _large_messages(schedule, v):
    import torch.distributed as dist
    from test_nccl_rules import ToyChunks

    from megapar.mesh import Layout, Mesh
    from megapar.pipeline.executor import PipelineExecutor

    mesh = Mesh(Layout(1, 2, 1), dist.get_rank())
    rows = 4096  # (4096, 1024) fp32 activations: 16 MiB per message
    stage = ToyChunks(mesh, v, hidden=1024).to(mesh.device)
    executor = PipelineExecutor(stage, mesh, schedule, (rows, 1024), virtual_stages=v,
                                timeout_s=120)
    gen = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(rows, 1024, generator=gen).to(mesh.device),
                "y": torch.randn(rows, 1024, generator=gen).to(mesh.device)} for _ in range(4)]
    return float(executor.run(batches))


@pytest.mark.cuda(gpus=2)
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                        ("interleaved", 2)])
def test_16_mib_messages_do_not_deadlock_on_nccl(schedule, v):
    losses = run_gpus(_large_messages, 2, schedule, v)
    assert losses[0] == losses[1] and losses[0] > 0


# 3D: tensor, data, sequence parallelism, ZeRO-1, bf16 --------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """The serial reference, computed on the CPU in this process: the tier runs with
    MEGAPAR_CPU=0, under which it would build its model on the GPU and feed it host batches."""
    from test_parity_3d import serial_reference

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGAPAR_CPU", "1")
        return serial_reference()


@pytest.mark.cuda(gpus=2)
def test_tp_dp_zero1_and_sequence_parallel_match_serial_on_nccl(reference):
    from test_parity_3d import _worker, check_against

    runs = [(2, 1, 1, 0), (1, 1, 2, 1), (1, 2, 1, 0, "fp32", "zb-h1"),
            (2, 1, 1, 0, "fp32", "1f1b", 1, "tp-pp-dp", True)]
    outs = run_gpus(_worker, 2, runs)
    for i in range(len(runs)):
        check_against(reference, [o[i] for o in outs])


@pytest.mark.cuda(gpus=8)
def test_3d_parity_on_eight_gpus(reference):
    from test_parity_3d import _worker, check_against

    runs = [(2, 2, 2, 0), (2, 2, 2, 1), (2, 2, 2, 0, "fp32", "zb-h1"),
            (2, 2, 2, 1, "fp32", "interleaved", 2, "tp-dp-pp"),
            (2, 2, 2, 1, "fp32", "1f1b", 1, "tp-pp-dp", True)]
    outs = run_gpus(_worker, 8, runs)
    for i in range(len(runs)):
        check_against(reference, [o[i] for o in outs])


@pytest.mark.cuda(gpus=2)
def test_context_parallel_matches_one_process_on_nccl():
    from test_cp_parity import _worker, check

    runs = [(kind, 1, 2, 1, 1, options) for kind in ("gpt2", "llama", "bert")
            for options in ({}, {"recompute": "full"})]
    check(runs, run_gpus(_worker, 2, runs))


@pytest.mark.cuda(gpus=8)
def test_4d_parity_on_eight_gpus(reference):
    from test_parity_3d import _worker, check_against

    runs = [(2, 2, 1, 0, "fp32", "1f1b", 1, "tp-pp-dp", False, 2),
            (2, 2, 1, 0, "fp32", "interleaved", 2, "tp-dp-pp", True, 2)]
    outs = run_gpus(_worker, 8, runs)
    for i in range(len(runs)):
        check_against(reference, [o[i] for o in outs])


def _bf16_and_fp32():
    from test_parity_3d import _train

    return [r.loss for r in _train(2, 1, 1, 0, "bf16")["results"]], \
        [r.loss for r in _train(2, 1, 1, 0, "fp32")["results"]]


@pytest.mark.cuda(gpus=2)
def test_bf16_tracks_fp32_on_nccl():
    for bf16, fp32 in run_gpus(_bf16_and_fp32, 2):
        assert bf16 != fp32, "bf16 gave fp32's losses: autocast is not active"
        for a, b in zip(bf16, fp32):  # the CPU suite's bound (test_precision)
            assert abs(a - b) / b < 2e-2


# communication, syncs, memory ---------------------------------------------------------------------
def _counted(kind):
    from test_comm_counts import _worker

    return [(c.op, c.numel, c.group_size, c.device.type) for c in _worker(kind, 2)]


@pytest.mark.cuda(gpus=2)
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_tp_collectives_are_megatrons_minimum_on_nccl(kind):
    from collections import Counter

    from test_comm_counts import expected_tp_step

    for calls in run_gpus(_counted, 2, kind):
        assert Counter(c[:3] for c in calls) == expected_tp_step(2, kind)
        assert {c[3] for c in calls} == {"cpu" if ON_CPU else "cuda"}


def strict_syncs(executor) -> list[int]:
    """Make `executor.run` raise on any host-device synchronisation (CUDA's own check,
    `torch.cuda.set_sync_debug_mode("error")`); returns the list its calls are counted in, so
    a test can tell that the step it checked is the step that ran."""
    run, calls = executor.run, []

    def strict_run(*args, **kwargs):
        calls.append(1)
        if on_cuda():
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            return run(*args, **kwargs)
        finally:
            if on_cuda():
                torch.cuda.set_sync_debug_mode(before)

    executor.run = strict_run
    return calls


def _syncs_in_a_step(kind):
    from test_host_syncs import batch, config

    import megapar

    engine = megapar.prepare(config(kind), tp=1, pp=2, micro_batch_size=1)
    engine.train_step(batch(kind, 4))  # warm-up: builds the executor of this sequence length
    calls = strict_syncs(engine.executor)
    losses = [engine.train_step(batch(kind, m)) for m in (4, 8, 4)]
    return losses, len(calls)


@pytest.mark.cuda(gpus=2)
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_a_pipeline_step_never_waits_for_the_device(kind):
    for losses, checked in run_gpus(_syncs_in_a_step, 2, kind):
        assert checked == 3, "the strict executor is not the one the steps ran"
        assert all(loss == loss for loss in losses)


def _zero1_save_memory():
    import torch.distributed as dist
    from test_optim import CONFIG

    from megapar.data_parallel import build_grad_sync
    from megapar.mesh import Layout, Mesh
    from megapar.optim import build_optimizer
    from megapar.pipeline.partition import build_stage

    mesh = Mesh(Layout(1, 1, 2), dist.get_rank())
    model = build_stage(CONFIG, mesh, seed=3)
    optimizer = build_optimizer(model, mesh, 1e-2, 0.1, zero=1)
    grads = build_grad_sync(model, mesh, 1, bucket_mb=0.01)
    optimizer.attach(grads)
    grads.begin_step()
    for p in model.parameters():
        p.grad.normal_()
    grads.before_last_backward()
    grads.finish()
    optimizer.step()
    if on_cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    state = optimizer.state_tensors()
    peak = torch.cuda.max_memory_allocated() - before if on_cuda() else 0
    bucket = max(b.padded * 4 for b in grads.buckets)
    return peak, bucket, sum(t.numel() for e in state.values() for t in e.values())


@pytest.mark.cuda(gpus=2)
def test_a_zero1_save_needs_one_bucket_of_device_memory():
    for rank, (peak, bucket, saved) in enumerate(run_gpus(_zero1_save_memory, 2)):
        assert peak <= bucket + 4096, (rank, peak, bucket)  # allocator rounding: 512 B blocks
        assert (saved > 0) == (rank == 0)


def _zero3_offload_memory(offload_params: bool):
    """dp 2, --zero 3 --offload-optimizer (and `offload_params`): the losses of 3 steps and the
    device memory held between steps (parameters, shards, gradient shards: what the model and
    the optimizer keep allocated), with this rank's parameter shard bytes."""
    import torch.distributed as dist
    from test_parity_3d import G, global_batches
    from test_zero3 import build
    from tp_utils import to_device

    from megapar.mesh import Layout, Mesh
    from megapar.training.step import BatchPlan

    mesh = Mesh(Layout(1, 1, 2), dist.get_rank())
    before = torch.cuda.memory_allocated() if on_cuda() else 0
    _, step, sharded = build(mesh, offload=True, offload_params=offload_params)
    plan = BatchPlan(G, 2, 2)
    losses = [step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i).loss
              for i, b in enumerate(global_batches()[:3])]
    held = torch.cuda.memory_allocated() - before if on_cuda() else 0
    return losses, held, sum(u.shard_nbytes for u in sharded.units)


@pytest.mark.cuda(gpus=2)
def test_offload_params_moves_the_shards_off_the_gpus():
    """--zero 3 --offload-optimizer with and without --offload-params on NCCL: the same
    losses, and with it the device holds at least this rank's parameter shards less between
    steps (they live in pinned host memory, copied to a staging shard per gather)."""
    kept = run_gpus(_zero3_offload_memory, 2, False)
    offloaded = run_gpus(_zero3_offload_memory, 2, True)
    for (losses_k, held_k, shards), (losses_o, held_o, _) in zip(kept, offloaded):
        assert torch.allclose(torch.tensor(losses_o), torch.tensor(losses_k), rtol=1e-5)
        if on_cuda():
            assert held_k - held_o >= shards > 0, (held_k, held_o, shards)


@pytest.mark.cuda(gpus=2)
def test_megapar_train_runs_on_the_gpus(tmp_path):
    env = {**os.environ, "MEGAPAR_CPU": "1" if ON_CPU else "0"}
    run = subprocess.run(
        [sys.executable, "-m", "megapar.cli.train", "--model", "gpt2-tiny", "--pp", "2",
         "--max-steps", "3", "--log-interval", "1", "--eval-interval", "0", "--no-progress",
         "--log-json", str(tmp_path / "log.jsonl")],
        capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "log.jsonl").read_text().count("\n") >= 3


@pytest.mark.skipif(torch.cuda.is_available() or ON_CPU, reason="runs the tier where no GPU is")
def test_gpu_check_fails_where_no_gpu_test_ran():
    """tools/gpu_check.sh cannot pass vacuously: without GPUs every test is skipped, and it
    says so and fails; a CPU rehearsal is refused."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "gpu_check.sh")
    run = subprocess.run(["bash", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "gpu_check summary: 0 passed, 0 failed" in run.stdout
    assert "no GPU test ran" in run.stdout
    rehearsal = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "MEGAPAR_CUDA_TIER_ON_CPU": "1"})
    assert rehearsal.returncode == 2 and "unset it for a GPU check" in rehearsal.stderr


# the tier's own checks, on the CPU ------------------------------------------------------------
def _cp_runs():
    from test_cp_parity import _worker

    return _worker([("llama", 1, 2, 1, 1, {}), ("bert", 1, 2, 1, 1, {})])


def _host_batch_worker():
    """A tier worker as they all were: the batch made on the host, handed to the model."""
    from test_pipeline_parity import make_config, micro_batches

    from megapar.mesh import Layout, Mesh
    from megapar.pipeline.partition import build_stage

    model = build_stage(make_config("gpt2"), Mesh(Layout()), 0)
    return model(None, micro_batches("gpt2", 1)[0])


TIER_WORKERS = [(_pipeline_parity, 2, (1, 2)), (_bf16_and_fp32, 2, ()),
                (_counted, 2, ("llama",)), (_syncs_in_a_step, 2, ("bert",)), (_cp_runs, 2, ())]


@pytest.mark.skipif(ON_CPU, reason="the rehearsal runs every worker under the device model")
@pytest.mark.parametrize("fn,n,args", TIER_WORKERS, ids=[w[0].__name__ for w in TIER_WORKERS])
def test_tier_workers_hand_their_models_device_tensors(fn, n, args):
    """The tier's workers on gloo with a GPU's placement rule modelled (`device_model.py`):
    every batch a model gets is on the mesh's device. Before, each handed its model the host
    batch, which a GPU refuses before NCCL is reached."""
    run_local(_tier_worker, n, fn, True, *args, env={"MEGAPAR_CPU": "1"})


def test_the_device_model_refuses_a_host_batch():
    with pytest.raises(HostTensorError, match="host tensor 'input_ids'"):
        call_with_device_model(_host_batch_worker)
    assert _host_batch_worker() > 0  # the same worker passes on the CPU without the model


def test_the_sync_check_wraps_the_executor_the_step_runs():
    """`strict_syncs` counts the calls of what it wraps: the old test wrapped the executor
    built for the default --seq-len 128, and its 16-token steps ran another one (0 calls)."""
    from test_host_syncs import batch, config

    import megapar

    engine = megapar.prepare(config("gpt2"), micro_batch_size=1)
    unused = strict_syncs(engine.executor)
    engine.train_step(batch("gpt2", 2))
    assert unused == []  # the blind spot: strict mode was never on
    checked = strict_syncs(engine.executor)  # the executor of the step that just ran
    engine.train_step(batch("gpt2", 2))
    assert checked == [1]
