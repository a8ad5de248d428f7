import time

import pytest
import torch
import torch.distributed as dist

from megapar.launcher import WorkerError, run_local


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank2_raises():
    if dist.get_rank() == 2:
        raise ValueError("boom on purpose")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the others block here until the parent brings them down
    return 0


def test_collective_on_8_ranks():
    assert run_local(_sum_ranks, 8) == [28.0] * 8


def test_failing_rank_is_named_and_nobody_hangs():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 2 failed: ValueError: boom on purpose"):
        run_local(_rank2_raises, 4, timeout_s=60)
    assert time.monotonic() - start < 30


def _as_torchrun_rank(preinit, port, out):
    """One rank of a torchrun job of one (RANK / WORLD_SIZE set), in a forked process."""
    import os

    from megapar.launcher import run_workers

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    if preinit:
        dist.init_process_group("gloo", rank=0, world_size=1)
    [inside] = run_workers(dist.is_initialized, 1)
    out.put((inside, dist.is_initialized()))


@pytest.mark.parametrize("preinit", [False, True])
def test_torchrun_rank_destroys_only_the_group_it_made(preinit):
    """Under torchrun a rank that exits with its gloo group alive can abort in the interpreter's
    teardown ("terminate called without an active exception", SIGABRT): the group made for
    the run is destroyed when it returns; a group the caller made is left to the caller."""
    import multiprocessing as mp

    from megapar.launcher import free_port

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_as_torchrun_rank, args=(preinit, free_port(), out))
    p.start()
    inside, after = out.get(timeout=60)
    p.join(timeout=30)
    assert p.exitcode == 0
    assert inside is True
    assert after is preinit
