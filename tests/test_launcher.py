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
