"""Parameter counts per pipeline stage, read off the real models built on the meta device.

Nothing here is a formula that could drift from the model code: a block, the embedding and the
head are each built once per tp size on `Mesh.virtual(..., device="meta")` (no memory, no
processes) and their parameters counted. A stage holds `layers x block + embedding (first stage)
+ head (last stage: final norm and, unless it is also the first stage, a tied copy of the word
embedding)`; `tests/test_plan.py` checks this against whole stages built the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

from megapar.mesh import Layout, Mesh
from megapar.models import build_model
from megapar.models.config import config_from_dict
from megapar.pipeline.partition import chunk_specs, partition_layers, stage_spec


@dataclass(frozen=True)
class PieceCounts:
    """Elements one tp rank holds of each piece of the model (vocabulary padding included)."""

    block: int
    """One transformer block."""
    embedding: int
    """What the first stage adds: word (tp shard), position (and token-type, norm) embeddings."""
    head: int
    """What the last stage adds: final norm (GPT-2) or MLM transform + bias (BERT)."""
    tied_copy: int
    """The last stage's copy of the word-embedding shard (only when it is not the first stage)."""


def _build(config, tp: int, layers, pre: bool, post: bool):
    mesh = Mesh.virtual(Layout(tp, 1, 1), rank=0, device="meta")
    return build_model(config, mesh, layers, pre_process=pre, post_process=post)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@lru_cache(maxsize=64)
def _pieces(config_json: str, tp: int) -> PieceCounts:
    config = config_from_dict(json.loads(config_json))
    block = _numel(_build(config, tp, range(1), False, False))
    first = _numel(_build(config, tp, range(0), True, False))
    last_only = _build(config, tp, range(0), False, True)
    tied = sum(p.numel() for p in last_only.parameters() if getattr(p, "tied_to", None))
    head = _numel(last_only) - tied
    return PieceCounts(block, first, head, tied)


def piece_counts(config, tp: int, config_json: str | None = None) -> PieceCounts:
    """Per-tp-rank element counts of a block, the embedding and the head of `config`;
    `config_json`: its canonical JSON (`Problem.config_json`) when the caller has it."""

    return _pieces(config_json or _config_json(config), tp)


def _config_json(config) -> str:
    """`config` as canonical JSON: the key of the cached functions here."""
    return json.dumps(config.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of a stage as the buffers see it."""

    numel: int
    dtype: object
    """torch dtype."""
    shared: bool = False
    """The word embedding or its tied copy (`shared_embedding`): last in ZeRO-1's buckets."""
    tied: bool = False
    """A tied copy (held only by a last stage that is not also the first)."""


def _specs(module) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(
            p.numel(),
            p.dtype,
            bool(getattr(p, "shared_embedding", False)),
            getattr(p, "tied_to", None) is not None,
        )
        for p in module.parameters()
    )


@lru_cache(maxsize=64)
def _piece_tensors(config_json: str, tp: int) -> tuple[tuple[TensorSpec, ...], ...]:
    """(block, embedding, head) parameters of one tp rank, in registration order."""

    config = config_from_dict(json.loads(config_json))
    return (
        _specs(_build(config, tp, range(1), False, False)),
        _specs(_build(config, tp, range(0), True, False)),
        _specs(_build(config, tp, range(0), False, True)),
    )


def stage_tensors(
    config, tp: int, pp: int, v: int, stage: int, placement: str = "loop"
) -> list[TensorSpec]:
    """The parameters one tp rank of pipeline rank `stage` holds, in the order
    `model.parameters()` gives them (each chunk's embedding, blocks, then norm and head; the
    tied copy only on a last chunk without the embedding). `tests/test_plan.py` checks it
    against stages built on the meta device."""

    block, embedding, head = _piece_tensors(_config_json(config), tp)
    specs = (
        chunk_specs(config.num_layers, pp, stage, v, placement)
        if v > 1
        else [stage_spec(config.num_layers, pp, stage)]
    )
    out: list[TensorSpec] = []
    for spec in specs:
        if spec.pre_process:
            out += embedding
        out += block * len(spec.layers)
        if spec.post_process:
            out += [t for t in head if not (t.tied and spec.pre_process)]
    return out


@dataclass(frozen=True)
class UnitSpec:
    """One ZeRO-3 unit of a stage as `ShardedParams` makes it."""

    kind: str
    """"block", "root" (a chunk's final norm and head, with a tied word embedding it reads; or
    the whole rest of a chunk that is not split), "embedding" (a split chunk's own embedding
    parameters) or "persistent" (the stage's parameters under the persistence threshold)."""
    chunk: int
    """The model chunk (-1: the persistent unit, over the whole stage)."""
    tensors: tuple[int, ...]
    """Indices into `stage_tensors`, in the unit's (the model's) order."""
    embedding_grads: bool = False
    """The persistent unit holds some of an embedding module's parameters (their gradients
    are complete only after the embedding's backward, past the first block's)."""


def stage_units(
    config, tp: int, pp: int, v: int, stage: int, placement: str = "loop", persist_below: int = 0
) -> list[UnitSpec]:
    """ZeRO-3's units of the stage, as `megapar.data_parallel.sharded_params.ShardedParams`
    makes them with `persist_below` (--zero3-persistence-threshold): per chunk each block (its
    parameters of at least `persist_below` elements), then the rest of the chunk: where the
    chunk has blocks and the embedding, split in an embedding unit (the embedding's parameters
    but, when there is a head, a tied word embedding the head reads) and a root unit (the rest),
    else one root unit; then the parameters under `persist_below` in one persistent unit."""
    block, embedding, head = _piece_tensors(_config_json(config), tp)
    specs = (
        chunk_specs(config.num_layers, pp, stage, v, placement)
        if v > 1
        else [stage_spec(config.num_layers, pp, stage)]
    )
    units, small, at, small_embedding = [], [], 0, False

    def take(pieces, embedding: bool = False) -> list[int]:
        nonlocal at, small_embedding
        idx = list(range(at, at + len(pieces)))
        at += len(pieces)
        below = [i for i, t in zip(idx, pieces) if t.numel < persist_below]
        small.extend(below)
        small_embedding |= embedding and bool(below)
        return [i for i, t in zip(idx, pieces) if t.numel >= persist_below]

    tensors = stage_tensors(config, tp, pp, v, stage, placement)
    for ci, spec in enumerate(specs):
        emb = take(embedding, True) if spec.pre_process else []
        blocks = [b for _ in spec.layers if (b := take(block))]
        tail = (
            take([t for t in head if not (t.tied and spec.pre_process)])
            if spec.post_process
            else []
        )
        own = emb if blocks else []
        if own and tail:  # a tied word embedding goes with the head that reads it
            own = [i for i in own if not tensors[i].shared]
        root = [i for i in emb + tail if i not in own]
        units += [UnitSpec("block", ci, tuple(b)) for b in blocks]
        units += [
            UnitSpec(kind, ci, tuple(idx))
            for kind, idx in (("embedding", own), ("root", root))
            if idx
        ]
    return units + ([UnitSpec("persistent", -1, tuple(small), small_embedding)] if small else [])


def stage_layer_counts(num_layers: int, pp: int, v: int = 1, placement: str = "loop") -> list[int]:
    """Blocks per pipeline rank as megapar-train cuts them (the first num_layers % pp stages +1;
    with v > 1 model chunks per rank, the blocks of its chunks, cut into pp * v slices)."""
    if v > 1:
        return [
            sum(len(spec.layers) for spec in chunk_specs(num_layers, pp, stage, v, placement))
            for stage in range(pp)
        ]
    return [len(r) for r in partition_layers(num_layers, pp)]


def stage_params(
    config, tp: int, pp: int, v: int = 1, placement: str = "loop", config_json: str | None = None
) -> list[int]:
    """Elements of parameters one tp rank of each pipeline stage holds (the embedding is on the
    first virtual stage, rank 0, and the head on the last, rank pp - 1, with v chunks too;
    in the "v" placement both are on rank 0). `config_json` as for `piece_counts`."""
    return list(_stage_params(config_json or _config_json(config), tp, pp, v, placement))


@lru_cache(maxsize=4096)
def _stage_params(config_json: str, tp: int, pp: int, v: int, placement: str) -> tuple[int, ...]:
    """`stage_params`, cached (the planner asks twice for each of thousands of layouts)."""
    pieces = _pieces(config_json, tp)
    num_layers = config_from_dict(json.loads(config_json)).num_layers
    counts = []
    head_rank = 0 if placement == "v" else pp - 1
    for stage, layers in enumerate(stage_layer_counts(num_layers, pp, v, placement)):
        n = layers * pieces.block
        if stage == 0:
            n += pieces.embedding
        if stage == head_rank:
            n += pieces.head + (pieces.tied_copy if pp > 1 else 0)
        counts.append(n)
    return tuple(counts)


def model_params(config, config_json: str | None = None) -> int:
    """Parameters of the whole model, unpadded, the tied embedding counted once (what Hugging
    Face's `num_parameters()` reports: 124,439,808 for GPT-2 small). `config_json` as for
    `piece_counts`."""

    return _model_params(config_json or _config_json(config))


@lru_cache(maxsize=16)
def _model_params(config_json: str) -> int:
    config = config_from_dict(json.loads(config_json))
    model = _build(config, 1, range(config.num_layers), True, True)
    return sum(
        math.prod(getattr(p, "full_shape", p.shape))
        for p in model.parameters()
        if not getattr(p, "tied_to", None)
    )
