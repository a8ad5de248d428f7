"""The CUDA paths a first GPU run takes, modelled on the CPU: NCCL decided by the device, a GPU
per rank, `srun` without torchrun, the NCCL watchdog's own timeout.

On a GPU megapar waits for communication by ordering the stream (NCCL) and issues receives in
program order; on the CPU the host waits with a timeout and receives are posted ahead (gloo).
Which path runs is decided by the tensors' device: a process group the user made reads
"undefined" or "cpu:gloo,cuda:nccl" as its backend name, which used to send NCCL down gloo's
path (where 1F1B hangs).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_launcher import _run_as_torchrun
from torch import nn

from megapar import device as _device
from megapar.mesh import Layout, Mesh
from megapar.pipeline.executor import PipelineExecutor


class _Work:
    """A communication handle that records how it was waited for."""

    def __init__(self):
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True


@pytest.mark.parametrize("name", ["nccl", "cpu:gloo,cuda:nccl", "undefined", "gloo"])
def test_the_nccl_path_is_chosen_by_the_device_not_the_backend_name(monkeypatch, name):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not _device.polls_host(cuda) and _device.polls_host(cpu)

    work = _Work()  # CUDA: the wait orders the stream; NCCL's watchdog ends a hang
    _device.wait(work, cuda, 5.0, "a receive")
    assert work.waits == [None]
    work = _Work()  # CPU: the host waits at most the timeout
    _device.wait(work, cpu, 5.0, "a receive")
    assert work.waits == [timedelta(seconds=5.0)]

    # a pipeline stage on a CUDA mesh issues its receives where the program has them (NCCL's
    # issue order); on the CPU it posts each peer's next receive ahead (gloo)
    stage = nn.Linear(4, 4, device="meta")
    on_gpu = PipelineExecutor(stage, Mesh.virtual(Layout(1, 2, 1), 0, device="cuda"), "1f1b",
                              (1, 2, 4))
    on_cpu = PipelineExecutor(stage, Mesh.virtual(Layout(1, 2, 1), 0, device="cpu"), "1f1b",
                              (1, 2, 4))
    assert not on_gpu.post_ahead and on_cpu.post_ahead


def test_more_ranks_than_gpus_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setenv("MEGAPAR_CPU", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    assert _device.device(0) == torch.device("cuda", 0)
    with pytest.raises(_device.DeviceError) as err:
        _device.device(1)  # was cuda:(1 % 1): NCCL's "Duplicate GPU detected"
    message = str(err.value)
    assert "\n" not in message and "2 ranks on this node but 1 GPU visible" in message
    assert "--nproc-per-node 1" in message and "MEGAPAR_CPU=1" in message
    assert "NPROC_PER_NODE=1 or slurm.sbatch's GPUS_PER_NODE=1" in message  # the scripts' names
    with pytest.raises(_device.DeviceError):
        _device.check_gpus(2)
    _device.check_gpus(1)
    # Slurm's per-task binding: each task sees its own GPU as its only device
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _device.device() == torch.device("cuda", 0)


def test_megapar_train_refuses_more_ranks_than_gpus_before_any_worker(monkeypatch, capsys):
    import megapar.cli.train as cli
    import megapar.training.run_plan as run_plan

    monkeypatch.setenv("MEGAPAR_CPU", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(cli, "run_workers", no_workers)
    monkeypatch.setattr(run_plan, "prepare_data", no_workers)  # refused before the data, too
    assert cli.main(["--model", "gpt2-tiny", "--tp", "2", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "megapar-train: error: 2 ranks on this node but 1 GPU visible" in err


def test_the_nccl_watchdog_has_its_own_timeout_and_megapar_train_passes_it(monkeypatch):
    assert _device.group_timeout_s("gloo", 300) == 300
    assert _device.group_timeout_s("nccl", 300) == _device.DEFAULT_NCCL_TIMEOUT_S == 1800
    assert _device.group_timeout_s("nccl", 300, 3600) == 3600
    assert _device.group_timeout_s("nccl", 600, 60) == 600  # never shorter than the wait

    import megapar.cli.train as cli

    seen = {}

    def record(fn, world, *args, **kwargs):
        seen.update(kwargs)
        return [None]

    monkeypatch.setattr(cli, "run_workers", record)
    assert cli.main(["--model", "gpt2-tiny", "--max-steps", "1", "--seq-len", "32",
                     "--timeout-s", "20", "--nccl-timeout-s", "2400", "--no-progress"]) == 0
    assert seen["collective_timeout_s"] == 20 and seen["nccl_timeout_s"] == 2400


@pytest.mark.parametrize("nodes,first", [("gpu[003-004,9],cpu1", "gpu003"), ("node7", "node7"),
                                         ("a1,a2", "a1"), ("r[12]x", "r12x"),
                                         ("n[0001-0010]", "n0001")])
def test_the_first_host_of_a_slurm_node_list(nodes, first):
    assert _device.first_host(nodes) == first


def test_srun_without_torchrun_gets_torchruns_variables(monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what it sets goes with the test
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        os.environ.pop(name, None)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[003-004]")
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    assert _device.adopt_slurm_environment()
    env = os.environ
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == \
        ("5", "8", "1", "4")
    assert env["MASTER_ADDR"] == "gpu003" and env["MASTER_PORT"] == str(15000 + 12345 % 20000)
    assert not _device.adopt_slurm_environment()  # RANK set: torchrun's (or done already)


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=96,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _srun_task():
    """A user's script under `srun -n 2` (no torchrun, no megapar.launch): prepare() forms the
    process group from Slurm's variables."""
    from test_host_syncs import batch

    import megapar
    from megapar.launcher import release_process_groups

    engine = megapar.prepare(_gpt2(), tp=2, micro_batch_size=2)
    loss = engine.train_step(batch("gpt2", 4))
    world = engine.mesh.layout.world_size
    del engine
    release_process_groups()
    return world, loss


def test_a_script_under_srun_without_torchrun_trains_as_one_job():
    from test_host_syncs import batch

    import megapar

    (w0, l0), (w1, l1) = _run_as_torchrun(_srun_task, 2, launcher="srun")
    assert w0 == w1 == 2, "each task trained alone"
    serial = megapar.prepare(_gpt2(), micro_batch_size=2).train_step(batch("gpt2", 4))
    assert l0 == l1 and math.isclose(l0, serial, rel_tol=1e-5)


@pytest.mark.parametrize("env, name", [
    ({"SLURM_PROCID": "abc", "SLURM_NTASKS": "2"}, "SLURM_PROCID='abc' is not a rank"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc"}, "SLURM_NTASKS='abc' is not a task count"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "abc"},
     "SLURM_LOCALID='abc' is not a rank"),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2"}, "SLURM_PROCID=5 is not below SLURM_NTASKS=2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-"},
     "SLURM_JOB_NODELIST='node[1-' is not a Slurm host list"),
    # torchrun's: RANK=x was a traceback, WORLD_SIZE=two 'rank 0 failed ... invalid literal'
    # (exit 1), and RANK=1 WORLD_SIZE=1 waited out --timeout-s and blamed the rendezvous (new
    # users' findings)
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a rank (0, 1, ...); run under torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a process count (>= 1)"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not a rank"),
    ({"RANK": "1", "WORLD_SIZE": "1"},
     "RANK=1 is not below WORLD_SIZE=1 (the ranks are only 0); run under torchrun"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is not below WORLD_SIZE=2 (the ranks are 0-1)"),
    # a stray WORLD_SIZE alone: rank 0's LayoutError 'world size 3 != tp*pp*dp' after starting
    ({"WORLD_SIZE": "3"}, "WORLD_SIZE=3 is set but RANK is not: each process of a torchrun "
                          "job has both; run under torchrun"),
])
def test_malformed_slurm_variables_are_one_line_naming_the_variable(env, name, monkeypatch,
                                                                    capsys):
    """Each malformed Slurm or torchrun variable: megapar-train exits 2 with one line naming it
    (no traceback, no 'invalid literal'), before any worker starts or any rendezvous is
    tried."""
    import megapar.cli.train as train_cli

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    started = []
    monkeypatch.setattr(train_cli, "run_workers", lambda *a, **k: started.append(a))
    rc = train_cli.main(["--model", "gpt2-tiny", "--seq-len", "16", "--global-batch-size", "2",
                         "--micro-batch-size", "2", "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and not started, err
    assert len(err.strip().splitlines()) == 1 and name in err, err


class _LostWork:
    """A gloo handle whose wait fails at once, as when the peer's process died."""

    def wait(self, timeout=None):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")


class _TimedOutWork:
    """A gloo handle whose wait times out."""

    def wait(self, timeout=None):
        raise RuntimeError("[pair.cc:446] Timed out waiting 5000ms for recv operation to complete")


def test_a_wait_that_fails_before_its_timeout_does_not_blame_the_timeout():
    """A kill -9 of rank 1 at pp 2 read 'receiving the gradient of micro-batch 0 from rank 1
    did not complete within 300 s (Connection closed by peer) ... raise the pipeline timeout if
    a step is legitimately this slow' 0.1 s after the kill."""
    cpu = torch.device("cpu")
    slow = "; raise the pipeline timeout if a step is legitimately this slow"
    with pytest.raises(TimeoutError) as lost:
        _device.wait(_LostWork(), cpu, 300.0, "receiving the gradient from rank 2", hint=slow)
    message = str(lost.value)
    assert "within 300 s" not in message and slow not in message, message
    assert message == (
        "receiving the gradient from rank 2 did not complete: it failed after 0.0 s, before its "
        "300 s timeout ([pair.cc:553] Connection closed by peer [127.0.0.1]:1234); a peer's "
        "connection closed: that rank probably died (look for its error)"
    ), message
    with pytest.raises(TimeoutError) as timed_out:  # gloo's own timeout: named as such
        _device.wait(_TimedOutWork(), cpu, 5.0, "a receive", hint=slow)
    assert str(timed_out.value).startswith("a receive did not complete within 5 s (")
    assert str(timed_out.value).endswith(slow)
