"""GlobalBatchSampler: layout independence, resume, no repeats; collate."""

import json

import pytest
import torch

from megapar.data.sampler import GlobalBatchSampler, collate


def _epoch(sampler):
    return [mbs for mbs in sampler]


@pytest.mark.parametrize("dp,micro", [(2, 1), (2, 3), (4, 3), (3, 4), (12, 1)])
def test_union_over_ranks_equals_single_rank_batch(dp, micro):
    ref = GlobalBatchSampler(100, 12, 12, 1, 0, seed=5)
    ref_batches = [mbs[0] for mbs in _epoch(ref)]
    assert len(ref_batches) == 100 // 12
    per_rank = [_epoch(GlobalBatchSampler(100, 12, micro, dp, r, seed=5)) for r in range(dp)]
    for k, batch in enumerate(ref_batches):
        union = [i for r in range(dp) for mb in per_rank[r][k] for i in mb]
        assert union == batch  # same samples, same order
        assert all(len(mb) == micro for r in range(dp) for mb in per_rank[r][k])
        assert len(per_rank[0][k]) == 12 // (micro * dp)


def test_no_repeats_within_epoch_and_epochs_differ():
    seen = []
    s = [GlobalBatchSampler(50, 8, 2, 2, r, seed=0) for r in range(2)]
    for b0, b1 in zip(_epoch(s[0]), _epoch(s[1])):
        seen += [i for mb in b0 + b1 for i in mb]
    assert len(seen) == 48 and len(set(seen)) == 48  # last incomplete batch dropped
    assert s[0].epoch == 1
    second = [i for mbs in _epoch(s[0]) for mb in mbs for i in mb]
    assert second != seen[:len(second)]
    plain = GlobalBatchSampler(10, 4, 2, 1, 0, seed=0, shuffle=False)
    assert _epoch(plain) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_resume_from_state_dict_continues_identically():
    full = GlobalBatchSampler(40, 6, 1, 3, 1, seed=9)
    stream = _epoch(full) + _epoch(full) + _epoch(full)
    s = GlobalBatchSampler(40, 6, 1, 3, 1, seed=9)
    got = []
    for _ in range(2):  # stop mid-epoch 1 after 2 + 6 + 2 batches
        got += _epoch(s)
    it = iter(s)
    got += [next(it), next(it)]
    state = json.loads(json.dumps(s.state_dict()))
    assert state["consumed_samples"] == 14 * 6 and state["epoch"] == 2
    resumed = GlobalBatchSampler(40, 6, 1, 3, 1, seed=9)
    resumed.load_state_dict(state)
    rest = _epoch(resumed)
    assert got + rest == stream
    by_arg = GlobalBatchSampler(40, 6, 1, 3, 1, seed=9, consumed_samples=14 * 6)
    assert _epoch(by_arg) == rest
    with pytest.raises(ValueError, match="global_batch_size=6"):
        GlobalBatchSampler(40, 12, 1, 3, 1, seed=9).load_state_dict(state)


def test_clear_errors():
    with pytest.raises(ValueError, match=r"global batch size 10 is not divisible by micro-batch size 2 x dp 4 = 8"):
        GlobalBatchSampler(100, 10, 2, 4, 0, seed=0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(5, 8, 1, 1, 0, seed=0)
    with pytest.raises(ValueError, match="dp_rank 4"):
        GlobalBatchSampler(100, 8, 1, 4, 4, seed=0)


def test_collate_stacks_tensors():
    samples = [{"input_ids": torch.arange(4) + i, "labels": torch.arange(4) - i} for i in range(3)]
    batch = collate(samples)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (3, 4) and batch["labels"][2].tolist() == [-2, -1, 0, 1]
