"""Checkpoints do not depend on context parallelism (cp ranks hold no parameter shards).

A run at cp 2 (tp 2, ZeRO-1 over cp x dp) saves at step 3 and goes on to step 6; the
checkpoint, resumed at cp 1, continues with the losses of the run that stayed at cp 2, and a
checkpoint saved at cp 1 resumes at cp 2 the same way (weights, Adam moments, schedule).
`megapar.prepare(cp=...)` is the user's entry point, and a sequence the split cannot cut is
refused before anything is communicated.
"""

import json

import pytest
import torch
import transformers  # noqa: F401  imported once, before the ranks fork
from test_api import (  # its GPT-2 (16 positions), 8 x 8 batches
    VOCAB,
    G,
    _batches,
    _hf_model,
)
from tp_utils import assert_close, refusal

import megapar


def _run(ckpt, stop_at, load, tp, cp, zero):
    engine = megapar.prepare(_hf_model(), tp=tp, cp=cp, micro_batch_size=2, lr=3e-3,
                             weight_decay=0.1, clip_grad=0.5, zero=zero,
                             lr_schedule={"warmup_steps": 2, "max_steps": 6})
    if load:
        engine.load(ckpt)
    losses = [engine.train_step(batch) for batch in _batches(6)[engine.step:stop_at]]
    if not load:
        engine.save(ckpt)
    return losses, engine.step, engine.mesh.layout.cp


@pytest.mark.parametrize("saved,resumed", [((2, 2, 1), (1, 1, 0)), ((1, 1, 0), (2, 2, 1))])
def test_a_checkpoint_moves_between_cp_sizes_with_the_same_losses(run, tmp_path, saved,
                                                                  resumed):
    """(tp, cp, zero) of the saving run and of the resuming one."""
    world = lambda layout: layout[0] * layout[1]  # noqa: E731
    ckpt = str(tmp_path / "ckpt")
    full, _, _ = run(_run, world(saved), str(tmp_path / "full"), 6, False, *saved)[0]
    first, step, cp = run(_run, world(saved), ckpt, 3, False, *saved)[0]
    rest, end, cp_after = run(_run, world(resumed), ckpt, 6, True, *resumed)[0]
    assert (step, end, cp, cp_after) == (3, 6, saved[1], resumed[1])
    assert first == full[:3]
    for got, want in zip(rest, full[3:]):
        assert_close(torch.tensor(got), torch.tensor(want), what="resumed loss")
    assert full[-1] < full[0]
    manifest = json.loads(next((tmp_path / "ckpt").glob("step_*/manifest.json")).read_text())
    assert manifest["layout"] == {"tp": saved[0], "pp": 1, "dp": 1,
                                  **({"cp": 2} if saved[1] == 2 else {})}
    # one shard file per tp rank: cp rank 1 wrote nothing of its own
    shards = [f for f in manifest["files"] if f.startswith("model")]
    assert len(shards) == saved[0], shards


def _bad_length():
    engine = megapar.prepare(_hf_model(), cp=2, micro_batch_size=2)
    x = torch.randint(0, VOCAB, (G, 14))
    return refusal(engine, {"input_ids": x, "labels": x})


def test_a_sequence_the_cp_split_cannot_cut_is_refused(run):
    for message in run(_bad_length, 2):
        assert message.startswith("sequence length 14 is not divisible by 2 x cp = 4")
