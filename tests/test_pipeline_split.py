"""Uneven pipeline splits (`PipelineSplit`): the blocks of each stage or model chunk, and the
one-line refusals of splits that cannot apply. Parity and checkpoints: tests/test_parity_3d.py
`test_uneven_pipeline_splits_equal_one_process`, tests/test_checkpoint_distributed.py
`test_a_checkpoint_of_an_uneven_split_loads_with_any_split_and_pp`."""

import pytest

from megapar.mesh import LayoutError
from megapar.models.recipes import resolve_model
from megapar.pipeline.partition import EVEN, PipelineSplit, chunk_specs, split_counts, stage_spec
from megapar.plan.layouts import Candidate, check
from megapar.plan.problem import Problem


@pytest.mark.parametrize("layers, slices, split, counts", [
    (30, 4, EVEN, [8, 8, 7, 7]),
    # Megatron's first / last counts, the rest evenly (the first of the others one more)
    (32, 4, PipelineSplit(first=6, last=6), [6, 10, 10, 6]),
    (30, 4, PipelineSplit(first=6, last=5), [6, 10, 9, 5]),
    (30, 4, PipelineSplit(first=3), [3, 9, 9, 9]),
    (30, 4, PipelineSplit(last=6), [8, 8, 8, 6]),
    (5, 2, PipelineSplit(first=2, last=3), [2, 3]),
    # the embedding and the loss as a block each: 32 units cut evenly, one less at each end
    (30, 4, PipelineSplit(embedding=True, loss=True), [7, 8, 8, 7]),
    (30, 4, PipelineSplit(embedding=True), [7, 8, 8, 7]),
])
def test_split_counts(layers, slices, split, counts):
    assert split_counts(layers, slices, split, "slices") == counts


def test_the_counts_go_to_the_models_first_and_last_chunks():
    """Under chunks the first and last counts are the model's first and last chunks': rank 0's
    chunk 0 and rank pp - 1's last chunk in the loop, both on rank 0 in the V."""
    split = PipelineSplit(first=1, last=2)  # 8 blocks in 4 chunks: 1, 3, 2, 2
    loop = [[list(s.layers) for s in chunk_specs(8, 2, r, 2, "loop", split)] for r in (0, 1)]
    assert loop == [[[0], [4, 5]], [[1, 2, 3], [6, 7]]]
    v0 = chunk_specs(8, 2, 0, 2, "v", split)
    assert [list(s.layers) for s in v0] == [[0], [6, 7]]
    assert (v0[0].pre_process, v0[1].post_process) == (True, True)
    assert list(stage_spec(8, 2, 1, PipelineSplit(first=1)).layers) == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("layers, pp, v, split, message", [
    (4, 2, 1, PipelineSplit(first=4), "--decoder-first-pipeline-num-layers 4 leaves 0 of the "
     "model's 4 layers for the other 1 of --pp 2 stages (each needs at least one); give at most "
     "3"),
    (4, 2, 1, PipelineSplit(first=5), "--decoder-first-pipeline-num-layers 5 is more than the "
     "model's 4 layers, and the other 1 of --pp 2 stages need at least one each; give at most 3"),
    (6, 4, 1, PipelineSplit(first=4, last=3), "= 7 layers are more than the model's 6 layers, "
     "and the other 2 of --pp 4 stages need at least one each; give at most 4 in all"),
    (4, 2, 1, PipelineSplit(first=1, last=2), "with --pp 2 stages they are the whole model, so "
     "they must add up to its 4 layers"),
    (8, 2, 2, PipelineSplit(first=4, last=3), "= 7 layers leave 1 of the model's 8 layers for the "
     "other 2 of --pp 2 x 2 = 4 model chunks (each needs at least one); give at most 6 in all"),
    (4, 1, 1, PipelineSplit(last=2), "--decoder-last-pipeline-num-layers 2 cuts the layers over "
     "pipeline stages, but --pp is 1 (one stage holds every layer); raise --pp or drop it"),
    (4, 2, 1, PipelineSplit(first=1, embedding=True), "not both"),
    (4, 2, 2, PipelineSplit(embedding=True, loss=True), "leave one without a layer"),
])
def test_a_split_that_cannot_apply_is_one_line_naming_the_fix(layers, pp, v, split, message):
    with pytest.raises(LayoutError) as exc:
        split.check(pp)
        if v > 1:
            chunk_specs(layers, pp, 0, v, "loop", split)
        else:
            stage_spec(layers, pp, 0, split)
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("layers, pp, v, placement, split, fix", [
    (4, 4, 1, "loop", PipelineSplit(embedding=True, loss=True),
     "; lower --pp to 3, or drop the flags"),
    # zb-v / dualpipev take no --virtual-stages, and --pp 1 refuses the flag
    (4, 2, 2, "v", PipelineSplit(loss=True),
     "; use a schedule with one model chunk per rank (--schedule 1f1b or zb-h1), or drop the "
     "flag"),
    (8, 4, 2, "v", PipelineSplit(embedding=True, loss=True),
     "; lower --pp to 2, use a schedule with one model chunk per rank (--schedule 1f1b "
     "or zb-h1), or drop the flags"),
    (8, 4, 2, "loop", PipelineSplit(embedding=True, loss=True),
     "; lower --pp or --virtual-stages (pp x V at most 5), use a schedule with one model chunk "
     "per rank (--schedule 1f1b or zb-h1), or drop the flags"),
    (2, 2, 1, "loop", PipelineSplit(loss=True), "; drop the flag"),
])
def test_the_embedding_or_loss_counted_as_a_layer_names_fewer_slices_that_fit(
    layers, pp, v, placement, split, fix
):
    """Refused with 'lower --pp or --virtual-stages, or drop the flag' whatever the schedule:
    zb-v / dualpipev refuse --virtual-stages, 1f1b has none, and --pp 1 refuses the flags."""
    with pytest.raises(LayoutError) as exc:
        chunk_specs(layers, pp, 0, v, placement, split)
    assert str(exc.value).endswith(fix)


def test_the_planner_rejects_the_layouts_a_split_does_not_fit():
    config = resolve_model("gpt2-tiny")  # 4 blocks
    p = Problem(config, 4, pipeline_split=PipelineSplit(first=3))
    assert check(Candidate(pp=2, dp=2), p) is None
    assert "--pp is 1" in check(Candidate(pp=1, dp=4), p)
    assert "leaves 1 of the model's 4 layers for the other 3 of --pp 4 stages" in check(
        Candidate(pp=4, dp=1), p)


def test_the_dry_runs_first_line_names_an_uneven_splits_blocks_per_stage(capsys):
    """megapar-train --dry-run with --decoder-first-pipeline-num-layers (or the embedding /
    loss counted as a block) said "schedule 1f1b, global batch ..." as for the even cut; now
    the stages' (or model chunks') blocks and the flags that gave them follow the schedule,
    and the even cut says nothing more. The start-up line of a run says the same
    (`loop.stages_phrase`). Its bubble line said "(equal stages)" of the formula's estimate,
    which prices the busiest stage and averages the others' idle time: now it says so."""
    from megapar.cli.train import main as train

    common = ["--model", "llama-tiny", "--pp", "2", "--dry-run", "--dry-run-ranks", "0"]
    for flags, says in [
        (["--decoder-first-pipeline-num-layers", "1"],
         "schedule 1f1b, stages of 1 + 3 blocks (--decoder-first-pipeline-num-layers 1), "
         "global batch"),
        (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
         "stages of 2 + 2 blocks (--account-for-embedding-in-pipeline-split "
         "--account-for-loss-in-pipeline-split), global batch"),
        (["--schedule", "interleaved", "--virtual-stages", "2",
          "--decoder-last-pipeline-num-layers", "1"],
         "schedule interleaved V 2, model chunks (in model order) of 1 + 1 + 1 + 1 blocks "
         "(--decoder-last-pipeline-num-layers 1, the first / last chunk's, not rank's as in "
         "Megatron-LM), global batch"),
        ([], "schedule 1f1b, global batch"),
    ]:
        assert train([*common, *flags]) == 0
        out = capsys.readouterr().out
        assert says in out, out
    # the fewest micro-batches the planner prices with the formula rather than the simulator
    # (pp x m above MAX_SIMULATED_ACTIONS); the dry run walks each one, so no more than that
    from megapar.plan.pipeline import MAX_SIMULATED_ACTIONS

    m = MAX_SIMULATED_ACTIONS // 2 + 1
    assert train([*common, "--decoder-first-pipeline-num-layers", "1", "--micro-batch-size",
                  "1", "--global-batch-size", str(m)]) == 0
    out = capsys.readouterr().out
    assert ("1f1b leaves the pp ranks idle 48.6 % of the step on average (the schedule's "
            "formula on the busiest stage's times; a stage holding more, such as the LM head's, "
            "adds to the others' wait)") in out, out
    assert "equal stages" not in out


@pytest.mark.parametrize("layers, pp, v, placement, fix", [
    # zb-v on 3 layers said "lower --pp to 1 or less", which zb-v refuses (a bubble tryout)
    (3, 2, 2, "v", "they need 4 layers or more (2 stages of two chunks): use a schedule with "
                   "one chunk per rank (1f1b, zb-h1)"),
    (6, 4, 2, "v", "lower --pp to 3 or less, or use a schedule with one chunk per rank (1f1b, "
                   "zb-h1)"),
    # interleaved on 3 layers: "lower --virtual-stages or --pp", both refused there
    (3, 2, 2, "loop", "an interleaved schedule needs 4 layers or more (2 stages of two chunks): "
                      "use a schedule with one chunk per rank (1f1b, zb-h1)"),
    (6, 4, 2, "loop", "lower --pp to 3"),
    (6, 2, 4, "loop", "lower --virtual-stages to 3"),
    (8, 4, 4, "loop", "lower --virtual-stages to 2 or --pp to 2"),
    # 4 layers at pp 4 x V 3 said "an interleaved schedule needs 4 layers or more" (a fuzz run)
    (4, 4, 3, "loop", "lower both, to a --pp x --virtual-stages of 4 or less (--pp 2 "
                      "--virtual-stages 2)"),
    (3, 4, 1, "loop", "lower --pp to 3 or less"),
])
def test_too_few_layers_for_the_chunks_names_a_fix_that_is_taken(layers, pp, v, placement, fix):
    from megapar.mesh import LayoutError
    from megapar.pipeline.partition import chunk_specs

    with pytest.raises(LayoutError) as info:
        chunk_specs(layers, pp, 0, v, placement)
    assert str(info.value).endswith(fix), str(info.value)
