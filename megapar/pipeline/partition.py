"""Cutting a model into pipeline stages, and building this rank's stage.

Stage 0 holds the embedding, the last stage the final norm and the head, and the blocks are
spread evenly by count (the first `num_layers % pp` stages take one extra), or as a
`PipelineSplit` says (the first and last slices' blocks given, or the embedding and the loss
counted as a block each): `stage_spec`, `chunk_specs`, pure functions. `build_stage` builds the
stage (or the model chunks) of a rank from them, initialised the same in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megapar.mesh import LayoutError, Mesh
from megapar.models import build_model, set_recompute
from megapar.models.config import too_few_layers
from megapar.models.stage import ModelChunks
from megapar.pipeline.placement import virtual_stage
from megapar.tensor_parallel import RNGTracker
from megapar.wording import counted


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage holds."""

    stage: int
    """Pipeline rank of the stage."""
    layers: range
    """Global indices of the blocks on this stage."""
    pre_process: bool
    """Holds the embedding (first stage)."""
    post_process: bool
    """Holds the final norm and the head (last stage)."""


FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"


@dataclass(frozen=True)
class PipelineSplit:
    """How the blocks are cut into the model's slices (the pp stages, or the pp x V model chunks
    of a virtual-stage schedule, in model order: the first slice holds the embedding, the last
    the head). The default cuts them evenly by count; `first` / `last` give the first / last
    slice's blocks and cut the rest evenly over the other slices (Megatron-LM's
    --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers); `embedding` /
    `loss` count the embedding / the head and loss as one more block in an even cut, which
    the first / last slice then holds in place of one of its blocks (Megatron-LM's
    --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split). Counts
    that do not divide evenly give the first of the evenly cut slices one block more each, as
    the even cut does. Every slice keeps at least one block."""

    first: int | None = None
    """Blocks of the first slice (the one with the embedding); None: cut with the others."""
    last: int | None = None
    """Blocks of the last slice (the one with the head); None: cut with the others."""
    embedding: bool = False
    """Count the embedding as one block of the first slice."""
    loss: bool = False
    """Count the head and the loss as one block of the last slice."""

    @property
    def even(self) -> bool:
        """Whether this is the even cut by count (no setting given)."""
        return self == EVEN

    def given(self) -> dict[str, int]:
        """{flag: blocks} of the first and last counts given."""
        pairs = ((FIRST_FLAG, self.first), (LAST_FLAG, self.last))
        return {name: n for name, n in pairs if n is not None}

    def check(self, pp: int) -> None:
        """LayoutError in one line naming the fix where this split cannot apply whatever the
        model: at `pp` 1, with counts below 1, or with both counts and the embedding / loss
        counted as blocks (Megatron-LM refuses both too)."""
        if self.even:
            return
        flags = self.flags()
        it = "them" if " --" in flags else "it"
        if self.given() and (self.embedding or self.loss):
            raise LayoutError(
                f"{flags}: give the first / last stage's layers or count the embedding / "
                f"loss as a layer, not both; drop one kind"
            )
        if pp < 2:
            raise LayoutError(
                f"{flags} cuts the layers over pipeline stages, but --pp is {pp} (one stage "
                f"holds every layer); raise --pp or drop {it}"
            )
        for name, n in self.given().items():
            if n < 1:
                raise LayoutError(
                    f"{name} {n}: the stage or chunk needs at least one layer; give 1 or more, "
                    f"or drop it"
                )

    def flags(self) -> str:
        """The megapar-train flags that give this split ("" for the even cut)."""
        out = [f"{FIRST_FLAG} {self.first}"] if self.first is not None else []
        out += [f"{LAST_FLAG} {self.last}"] if self.last is not None else []
        out += [EMBEDDING_FLAG] if self.embedding else []
        out += [LOSS_FLAG] if self.loss else []
        return " ".join(out)


EVEN = PipelineSplit()
"""The even cut by count (the first `num_layers % slices` slices one block more)."""


def _even_counts(units: int, slices: int) -> list[int]:
    base, extra = divmod(units, slices)
    return [base + (1 if s < extra else 0) for s in range(slices)]


def _counted_fit(num_layers: int, slices: int, split: PipelineSplit) -> bool:
    """Whether every one of `slices` slices keeps a block with the embedding / loss counted."""
    counts = _even_counts(num_layers + split.embedding + split.loss, slices)
    return counts[0] - split.embedding >= 1 and counts[-1] - split.loss >= 1


def _fewer_slices(
    num_layers: int, slices: int, split: PipelineSplit, per_rank: int, placement: str
) -> str:
    """How to cut the model into few enough slices for the embedding / loss counted as blocks:
    the layouts that fit named for the schedule's kind (`per_rank` model chunks per rank,
    placed as `placement` says), or dropping the flag."""
    most = max((s for s in range(1, slices) if _counted_fit(num_layers, s, split)), default=1)
    # with a block per chunk, at least pp + 1 slices fit: one chunk per rank at this pp does
    one_chunk = "use a schedule with one model chunk per rank (--schedule 1f1b or zb-h1)"
    fixes = []
    if per_rank == 1 and most >= 2:
        fixes.append(f"lower --pp to {most}")
    elif per_rank > 1 and placement == "v":  # two chunks per rank, whatever --virtual-stages
        fixes += [f"lower --pp to {most // 2}"] if most >= 4 else []
        fixes += [one_chunk] if most >= 2 else []
    elif per_rank > 1:
        fixes += [f"lower --pp or --virtual-stages (pp x V at most {most})"] if most >= 4 else []
        fixes += [one_chunk] if most >= 2 else []
    drop = "drop the flags" if split.embedding and split.loss else "drop the flag"
    return ", ".join(fixes) + f", or {drop}" if fixes else drop


def _no_cut(
    split: PipelineSplit, of: str, num_layers: int, pp: int, per_rank: int, placement: str
) -> str:
    """That `split`'s flags leave no cut `of` the `num_layers` layers ("no V", "no interleaved
    cut") into `pp` stages of `per_rank` chunks, and the fixes that cut them: a schedule of one
    chunk per rank, dropping the flags ("it" for one), each at a lower --pp where this one
    does not cut (each was offered at this --pp alone, and refused next), or both."""
    several = " --" in split.flags()
    drop = f"drop {'them' if several else 'it'}"
    one_chunk = "use a schedule with one chunk per rank (1f1b, zb-h1)"
    fixes = []
    for fix, most in (
        (one_chunk, _most_stages(num_layers, split, 1, "loop")),
        (drop, _most_stages(num_layers, EVEN, per_rank, placement)),
    ):
        if most >= pp:
            fixes.append(fix)
        elif most >= 2:
            fixes.append(f"{fix} at --pp {most}{' or less' if most > 2 else ''}")
    if not fixes:  # (a block per stage: one chunk per rank, without the flags, cuts 2 stages)
        fixes.append(f"{one_chunk} and {drop}")
    return f"{split.flags()} {'leave' if several else 'leaves'} {of} of them: " + ", or ".join(
        fixes
    )


def _cuts(
    num_layers: int, pp: int, per_rank: int, split: PipelineSplit, placement: str = "loop"
) -> bool:
    """Whether `split` cuts `num_layers` blocks into `pp` stages of `per_rank` chunks each,
    placed as `placement` says."""
    try:
        split.check(pp)
        split_counts(num_layers, pp * per_rank, split, "", per_rank, placement)
    except LayoutError:
        return False
    return True


def _most_stages(num_layers: int, split: PipelineSplit, per_rank: int, placement: str) -> int:
    """The most pipeline stages, of `per_rank` chunks each, that `split` cuts `num_layers`
    blocks into (0: none, the split's flags refused at any): what a refusal of too many offers
    (with --decoder-last-pipeline-num-layers 2, 4 layers take 3 stages, not 4)."""
    stages = range(num_layers // per_rank, 0, -1)
    return next((pp for pp in stages if _cuts(num_layers, pp, per_rank, split, placement)), 0)


def split_counts(
    num_layers: int,
    slices: int,
    split: PipelineSplit,
    what: str,
    per_rank: int = 1,
    placement: str = "loop",
) -> list[int]:
    """Blocks of each of `slices` slices as `split` cuts `num_layers` blocks, or a LayoutError in
    one line naming the fix; `what` names the slices in it (e.g. "--pp 4 stages"), which are
    `per_rank` model chunks on each pipeline rank, placed as `placement` says ("loop", "v")."""
    if num_layers < slices:  # whatever the split flags say (they drew 'give at most -3')
        pp_most = _most_stages(num_layers, split, per_rank, placement)
        raise LayoutError(
            f"{counted(num_layers, 'layer')} cannot be cut into {what} (each needs at least one "
            f"layer); lower --pp"
            + (f" to {pp_most}" if pp_most >= 1 else "")
            + (" or less" if pp_most > 1 else "")
        )
    if split.even:
        return _even_counts(num_layers, slices)
    split.check(slices)
    given = split.given()
    if split.embedding or split.loss:
        counts = _even_counts(num_layers + split.embedding + split.loss, slices)
        counts[0] -= split.embedding
        counts[-1] -= split.loss
        if min(counts) < 1:
            fix = _fewer_slices(num_layers, slices, split, per_rank, placement)
            raise LayoutError(
                f"{split.flags()}: {num_layers} layers cut into {what} with the embedding or "
                f"loss counted as a layer leave one without a layer; {fix}"
            )
        return counts
    rest = num_layers - sum(given.values())
    middle = slices - len(given)
    named = " + ".join(f"{name} {n}" for name, n in given.items())
    if middle == 0 and rest != 0:
        raise LayoutError(
            f"{named} = {num_layers - rest} layers: with {what} they are the whole model, so "
            f"they must add up to its {num_layers} layers; give counts that do"
        )
    if rest < middle:
        taken = (
            f"{named} leaves" if len(given) == 1 else f"{named} = {num_layers - rest} layers leave"
        )
        most = f"at most {num_layers - middle}" + (" in all" if len(given) > 1 else "")
        if rest < 0:  # more than the model has: "leaves 0" would hide by how much
            over = named if len(given) == 1 else f"{named} = {num_layers - rest} layers"
            raise LayoutError(
                f"{over} {'is' if len(given) == 1 else 'are'} more than the model's "
                f"{num_layers} layers, and the other {middle} of {what} need at least one "
                f"each; give {most}"
            )
        raise LayoutError(
            f"{taken} {rest} of the model's {num_layers} layers for the other "
            f"{middle} of {what} (each needs at least one); give {most}"
        )
    counts = _even_counts(rest, middle) if middle else []
    if split.first is not None:
        counts.insert(0, split.first)
    if split.last is not None:
        counts.append(split.last)
    return counts


@lru_cache(maxsize=4096)
def split_layers(
    num_layers: int,
    slices: int,
    split: PipelineSplit = EVEN,
    what: str = "",
    per_rank: int = 1,
    placement: str = "loop",
) -> tuple[range, ...]:
    """The block indices of each of `slices` slices as `split` cuts them (`split_counts`),
    cached (the planner asks for each stage's chunks of thousands of layouts)."""
    ranges, start = [], 0
    what = what or f"{slices} slices"
    for count in split_counts(num_layers, slices, split, what, per_rank, placement):
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def split_phrase(
    num_layers: int, pp: int, split: PipelineSplit, per_rank: int = 1, placement: str = "loop"
) -> str:
    """The blocks of each stage (or of each of the pp x `per_rank` model chunks, in model
    order) where `split` is not the even cut, as the start-up and dry-run lines name them:
    "stages of 1 + 3 blocks (--decoder-first-pipeline-num-layers 1)"; "" for the even cut."""
    if split.even:
        return ""
    slices = pp * per_rank
    what = f"--pp {pp} stages" if per_rank == 1 else f"--pp {pp} x {per_rank} model chunks"
    counts = split_counts(num_layers, slices, split, what, per_rank, placement)
    kind = "stages" if per_rank == 1 else "model chunks (in model order)"
    chunked = split.given() and per_rank > 1  # not Megatron-LM's meaning: said where it differs
    whose = ", the first / last chunk's, not rank's as in Megatron-LM" if chunked else ""
    return f"{kind} of {' + '.join(map(str, counts))} blocks ({split.flags()}{whose})"


def partition_layers(num_layers: int, pp: int, split: PipelineSplit = EVEN) -> list[range]:
    """The block indices of each of `pp` stages."""
    if pp < 1:
        raise LayoutError(f"--pp must be >= 1, got {pp}")
    if split.even and num_layers < pp:
        raise LayoutError(too_few_layers(num_layers, pp))
    return list(split_layers(num_layers, pp, split, f"--pp {pp} stages"))


def stage_spec(num_layers: int, pp: int, stage: int, split: PipelineSplit = EVEN) -> StageSpec:
    """The StageSpec of pipeline rank `stage`."""
    ranges = partition_layers(num_layers, pp, split)
    return StageSpec(stage, ranges[stage], stage == 0, stage == pp - 1)


def chunk_specs(
    num_layers: int,
    pp: int,
    stage: int,
    virtual_stages: int,
    placement: str = "loop",
    split: PipelineSplit = EVEN,
) -> list[StageSpec]:
    """The StageSpecs of the `virtual_stages` model chunks pipeline rank `stage` holds: the
    blocks are cut into pp * V slices as `split` says (evenly, as `partition_layers` cuts them
    into stages, by default; its first and last counts are the model's first and last chunks'),
    and chunk c of rank r holds slice `virtual_stage(r, c, pp, placement)` (c * pp + r for
    Megatron's round-robin "loop" placement). Only the model's first slice holds the embedding
    and only its last the head."""

    total = pp * virtual_stages
    one_chunk = "use a schedule with one chunk per rank (1f1b, zb-h1)"
    if num_layers < total and placement == "v":  # two chunks per rank, whatever V says
        most = _most_stages(num_layers, split, 2, "v")  # (the split's flags too)
        fix = (
            f"lower --pp to {most}{' or less' if most >= 3 else ''}, or {one_chunk}"
            if most >= 2  # (zb-v and dualpipev take 2 stages or more)
            else f"they need 4 layers or more (2 stages of two chunks): {one_chunk}"
            if split.even
            else _no_cut(split, "no V", num_layers, pp, 2, "v")
        )
        raise LayoutError(
            f"{counted(num_layers, 'layer')} cannot be cut into 2 x --pp {pp} = {total} model "
            f"chunks (zb-v and dualpipev place two per rank in a V; each needs at least one "
            f"layer); {fix}"
        )
    if num_layers < total:
        fixes = [f"--pp to {num_layers} or less"] if virtual_stages == 1 else []
        chunks = max(  # the most chunks a rank holds at this --pp, the split's flags too
            (v for v in range(2, num_layers // pp + 1) if _cuts(num_layers, pp, v, split)),
            default=0,
        )
        stages = _most_stages(num_layers, split, virtual_stages, "loop")
        if virtual_stages > 1 and chunks >= 2:  # (an interleaved schedule's V >= 2)
            fixes.append(f"--virtual-stages to {chunks}")
        if virtual_stages > 1 and stages >= 2:
            fixes.append(f"--pp to {stages}")
        if virtual_stages > 1 and not fixes and _cuts(num_layers, 2, 2, split):  # both down
            fixes.append(
                f"both, to a --pp x --virtual-stages of {num_layers} or less (--pp 2 "
                f"--virtual-stages 2)"
            )
        fix = (
            "lower " + " or ".join(fixes)
            if fixes
            else f"an interleaved schedule needs 4 layers or more (2 stages of two chunks): "
            f"{one_chunk}"
            if split.even
            else _no_cut(split, "no interleaved cut", num_layers, pp, virtual_stages, "loop")
        )
        raise LayoutError(
            f"{counted(num_layers, 'layer')} cannot be cut into --pp {pp} x --virtual-stages "
            f"{virtual_stages} = {total} model chunks (each needs at least one "
            f"layer); {fix}"
        )
    what = f"--pp {pp} x {virtual_stages} = {total} model chunks"
    ranges = split_layers(num_layers, total, split, what, virtual_stages, placement)
    specs = []
    for chunk in range(virtual_stages):
        vs = virtual_stage(stage, chunk, pp, placement)
        specs.append(StageSpec(stage, ranges[vs], vs == 0, vs == total - 1))
    return specs


def build_stage(
    config,
    mesh: Mesh,
    seed: int,
    recompute: str = "none",
    init: bool = True,
    virtual_stages: int = 1,
    placement: str = "loop",
    split: PipelineSplit = EVEN,
):
    """This rank's stage of `config` (validated against the mesh first), seeded the same in
    every layout: the full model's weights do not depend on tp or pp, nor on `split` (how the
    blocks are cut into stages or chunks).

    With `virtual_stages` V > 1 (interleaved schedules) the rank holds V model chunks, returned
    as a `ModelChunks` whose parameter names are the canonical ones."""
    config.validate(mesh.layout)
    if virtual_stages > 1:
        return _build_chunks(config, mesh, seed, recompute, init, virtual_stages, placement, split)
    spec = stage_spec(config.num_layers, mesh.pp, mesh.pp_rank, split)
    tracker = RNGTracker(seed, mesh) if mesh.device.type != "meta" else None
    model = build_model(config, mesh, spec.layers, spec.pre_process, spec.post_process, tracker)
    set_recompute(model, recompute)
    if init:
        model.init_weights(seed)
    return model


def _build_chunks(config, mesh, seed, recompute, init, virtual_stages, placement, split):
    tracker = RNGTracker(seed, mesh) if mesh.device.type != "meta" else None
    chunks = []
    pp, rank = mesh.pp, mesh.pp_rank
    for spec in chunk_specs(config.num_layers, pp, rank, virtual_stages, placement, split):
        chunk = build_model(config, mesh, spec.layers, spec.pre_process, spec.post_process, tracker)
        set_recompute(chunk, recompute)
        if init:
            chunk.init_weights(seed)
        chunks.append(chunk)
    return ModelChunks(chunks)
