"""GlobalBatchSampler: layout independence, resume, no repeats; collate."""

import json

import numpy as np
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
    with pytest.raises(ValueError, match="seed=9"):
        GlobalBatchSampler(40, 6, 1, 3, 1, seed=8).load_state_dict(state)


def _stream(n, seed, position, sizes):
    """The reference: global batches of `sizes` taken from (epoch, sample) `position` of the
    seeded epoch permutations, an epoch ending when fewer than the batch's size are left."""
    (epoch, at), out = position, []
    for g in sizes:
        if at + g > n:
            epoch, at = epoch + 1, 0
        out.append(np.random.default_rng(seed + epoch).permutation(n)[at:at + g].tolist())
        at += g
    return out


def _take(samplers, batches):
    """`batches` global batches from the dp ranks' samplers, each the union over the ranks."""
    its, out = [iter(s) for s in samplers], []
    while len(out) < batches:
        try:
            per_rank = [next(it) for it in its]
        except StopIteration:  # the epoch ended: iterate again for the next
            its = [iter(s) for s in samplers]
            continue
        out.append([i for mbs in per_rank for mb in mbs for i in mb])
    return out


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("g, cut, g2", [(8, 3, 12), (8, 3, 4), (16, 2, 8), (4, 9, 16)])
def test_a_stream_cut_at_one_global_batch_continues_at_another(dp, g, cut, g2):
    """Cut after `cut` batches of G, resumed (JSON state) at G': the next batches are exactly
    the epoch orders' next G' samples, across epoch boundaries (an epoch's rest smaller than
    G' dropped; at (16, 2, 8) the 8 samples G = 16 left at the end of epoch 0 are taken)."""
    n, seed = 40, 3
    first = [GlobalBatchSampler(n, g, 2, dp, r, seed=seed) for r in range(dp)]
    assert _take(first, cut) == _stream(n, seed, (0, 0), [g] * cut)
    state = json.loads(json.dumps(first[0].state_dict()))
    assert all(s.state_dict() == state for s in first)
    resumed = [GlobalBatchSampler(n, g2, 2, dp, r, seed=seed) for r in range(dp)]
    for s in resumed:
        s.load_state_dict(state)
    got = _take(resumed, 8)  # 8 x G' >= 32 samples: at least one epoch boundary
    assert got == _stream(n, seed, (0, cut * g), [g2] * 8)
    assert resumed[0].consumed_samples == cut * g + 8 * g2


def test_an_old_format_state_resumes_as_before():
    """A state without epoch_samples (checkpoints written before it was recorded): its
    position is found from consumed_samples at its own global batch, so it resumes as it did,
    at that global batch or another; at an epoch's end it starts the next epoch."""
    old = {"consumed_samples": 14 * 6, "epoch": 2, "global_batch_size": 6, "seed": 9,
           "dataset_len": 40, "shuffle": True}  # 6 batches of 6 per epoch: epoch 2, sample 12
    same = GlobalBatchSampler(40, 6, 1, 1, 0, seed=9)
    same.load_state_dict(old)
    assert _epoch(same) == _epoch(GlobalBatchSampler(40, 6, 1, 1, 0, seed=9,
                                                     consumed_samples=14 * 6))
    assert same.epoch == 3 and same.consumed_samples == 18 * 6
    other = GlobalBatchSampler(40, 4, 1, 1, 0, seed=9)
    other.load_state_dict(old)
    assert _take([other], 8) == _stream(40, 9, (2, 12), [4] * 8)
    at_end = GlobalBatchSampler(40, 8, 1, 1, 0, seed=9)
    at_end.load_state_dict({**old, "consumed_samples": 36, "epoch": 1})
    assert at_end.position == (1, 0)
    with pytest.raises(ValueError, match="the state is corrupt"):
        at_end.load_state_dict({**old, "epoch": 3})


def test_a_blend_state_of_an_older_megapar_in_epoch_1_is_named_on_resume():
    """A blend's epochs past the first changed order (each continues its parts' draws); a
    checkpoint saved in epoch >= 1 before the sampler recorded its order resumed onto the new
    one without a word. Its state has no epoch_offset: one note; a state that has it, or one in
    epoch 0 (the same in both orders), none."""
    from megapar.training.config import TrainConfig
    from megapar.training.data import continue_order

    def resume(state):
        sampler = GlobalBatchSampler(40, 8, 2, 1, 0, seed=3, shuffle=False, epoch_offset=True)
        return continue_order(TrainConfig(), sampler, state)

    new = GlobalBatchSampler(40, 8, 2, 1, 0, seed=3, shuffle=False, epoch_offset=True,
                             consumed_samples=6 * 8)  # epoch 1, sample 8
    state = json.loads(json.dumps(new.state_dict()))
    assert state["epoch_offset"] is True and resume(state) == []
    older = {k: v for k, v in state.items() if k != "epoch_offset"}
    notes = resume(older)
    assert len(notes) == 1 and notes[0].startswith(
        "the checkpoint resumes a blend in epoch 1 and does not record its epoch order"), notes
    first = {**older, "consumed_samples": 16, "epoch": 0, "epoch_samples": 16}
    assert resume(first) == []


def test_a_trained_checkpoint_without_a_data_order_says_the_order_starts_anew():
    """engine.save records no sampler (the caller fed the batches): megapar-train --load of it
    at step 3 trained the samples of steps 1-3 again without a word."""
    from megapar.training.config import TrainConfig
    from megapar.training.data import continue_order

    sampler = GlobalBatchSampler(40, 8, 2, 1, 0, seed=3)
    (note,) = continue_order(TrainConfig(), sampler, None, step=3)
    assert note.startswith("the checkpoint of step 3 records no data order") and (
        "starts at its first sample" in note)
    assert sampler.position == (0, 0)
    assert continue_order(TrainConfig(), sampler, None, step=0) == []  # an import of step 0


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
