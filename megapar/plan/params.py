"""Parameter counts per pipeline stage, read off the real models built on the meta device.

Nothing here is a formula that could drift from the model code: a block, the embedding and the
head are each built once per tp (and ep) size on `Mesh.virtual(..., device="meta")` (no memory,
no processes) and their parameters counted. A stage holds `its blocks + embedding (first stage)
+ head (last stage: final norm and, unless it is also the first stage, a tied copy of the word
embedding)`; `tests/test_plan.py` checks this against whole stages built the same way.

A mixture-of-experts model has two kinds of block, dense and MoE (Qwen3-MoE's `mlp_only_layers`,
a DeepSeek-V3-like recipe's first dense layers): one of each is built and every layer counted
as its kind (`layer_kinds`). Under expert parallelism (ep > 1) a MoE block holds E / ep routed
experts, as megapar-train's ep rank builds them (replicated over tp, or with expert tensor
parallelism, etp = tp, each split over tp); their tensors are marked `TensorSpec.expert`, the
buffers' separate buckets.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import nn

from megapar.mesh import Layout, Mesh
from megapar.models import build_model
from megapar.models.config import config_from_dict
from megapar.models.moe import Router
from megapar.pipeline.partition import (
    EVEN,
    PipelineSplit,
    chunk_specs,
    partition_layers,
    stage_spec,
)
from megapar.tensor_parallel.fp8_convert import wanted
from megapar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megapar.tensor_parallel.partition import full_shape, is_shared_embedding


@dataclass(frozen=True)
class PieceCounts:
    """Elements one tp rank holds of each piece of the model (vocabulary padding included)."""

    block: int
    """One transformer block (of a mixture of experts: its first layer's kind; `blocks`)."""
    embedding: int
    """What the first stage adds: word (tp shard), position (and token-type, norm) embeddings."""
    head: int
    """What the last stage adds: final norm (GPT-2) or MLM transform + bias (BERT)."""
    tied_copy: int
    """The last stage's copy of the word-embedding shard (only when it is not the first stage)."""
    blocks: tuple[int, ...] = ()
    """Each layer's block, by layer index (a dense and a MoE block differ)."""


def layer_kinds(config) -> tuple[bool, ...]:
    """Per layer, whether it is a mixture-of-experts layer (all False for a dense model)."""
    moe = getattr(config, "is_moe_layer", None)
    return tuple(bool(moe and moe(i)) for i in range(config.num_layers))


def _kind_builds(config) -> dict[bool, int]:
    """{kind: the first layer of that kind}: the layer built to count each kind's block."""
    firsts: dict[bool, int] = {}
    for i, kind in enumerate(layer_kinds(config)):
        firsts.setdefault(kind, i)
    return firsts


def kind_blocks(config, tp: int, ep: int = 1, etp: int = 1) -> dict:
    """{block kind (True: mixture of experts): the first block of that kind, built on the meta
    device as tp rank 0 (and ep rank 0) holds it, its routed experts split over `etp` (1 or
    tp: expert tensor parallelism)}: what the planner reads a block's parameters and linears
    off."""
    return {
        kind: _build(config, tp, range(i, i + 1), False, False, ep, etp)
        for kind, i in _kind_builds(config).items()
    }


def _build(config, tp: int, layers, pre: bool, post: bool, ep: int = 1, etp: int = 1):
    mesh = Mesh.virtual(Layout(tp, 1, ep, ep=ep), rank=0, device="meta", expert_tp=etp)
    return build_model(config, mesh, layers, pre_process=pre, post_process=post)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@lru_cache(maxsize=64)
def _pieces(config_json: str, tp: int, ep: int = 1, etp: int = 1) -> PieceCounts:
    config = config_from_dict(json.loads(config_json))
    kinds = {kind: _numel(block) for kind, block in kind_blocks(config, tp, ep, etp).items()}
    first = _numel(_build(config, tp, range(0), True, False))
    last_only = _build(config, tp, range(0), False, True)
    tied = sum(p.numel() for p in last_only.parameters() if getattr(p, "tied_to", None))
    head = _numel(last_only) - tied
    blocks = tuple(kinds[k] for k in layer_kinds(config))
    return PieceCounts(blocks[0], first, head, tied, blocks)


def piece_counts(
    config, tp: int, config_json: str | None = None, ep: int = 1, etp: int = 1
) -> PieceCounts:
    """Per-tp-rank element counts of a block, the embedding and the head of `config` (its
    routed experts split over `ep`, each over `etp`); `config_json`: its canonical JSON
    (`Problem.config_json`) when the caller has it."""

    return _pieces(config_json or _config_json(config), tp, ep, etp)


@dataclass(frozen=True)
class WholeCasts:
    """Elements of one tp rank's parameters, other than its column- and row-parallel linears'
    and the LM head's weight, that a 16-bit autocast casts whole: each is handed as it is to
    an op autocast runs in 16 bits, so autocast caches its cast for the step (a plain
    ``nn.Linear``'s weight and bias, a router's weight). The parallel linears' weights and
    biases (a column-parallel linear's bias goes into its ``F.linear``, a row-parallel one's is
    added after the reduction, uncast) and the LM head's are `plan.process`'s to count."""

    blocks: tuple[tuple[bool, int], ...]
    """(block kind, elements) of each kind's block (`kind_blocks`)."""
    head: int
    """Of the head piece (BERT's MLM transform)."""
    head_bias: int
    """The LM head's bias (BERT's), cast with its weight by the head's matmul."""


def _cast_whole(module) -> int:
    """Elements of `module`'s parameters that autocast casts whole (see `WholeCasts`)."""
    n = 0
    for m in module.modules():
        if isinstance(m, nn.Linear):
            n += sum(p.numel() for p in m.parameters(recurse=False))
        elif isinstance(m, Router):
            n += m.weight.numel()
    return n


@lru_cache(maxsize=64)
def whole_casts(config_json: str, tp: int, ep: int = 1, etp: int = 1) -> WholeCasts:
    """`WholeCasts` of `config_json`'s blocks and head on one tp rank (routed experts over
    `ep`, each over `etp`)."""
    config = config_from_dict(json.loads(config_json))
    blocks = tuple((kind, _cast_whole(b)) for kind, b in kind_blocks(config, tp, ep, etp).items())
    last = _build(config, tp, range(0), False, True)
    bias = dict(last.named_parameters()).get("head.bias")
    return WholeCasts(blocks, _cast_whole(last), 0 if bias is None else bias.numel())


def _config_json(config) -> str:
    """`config` as canonical JSON: the key of the cached functions here."""
    return json.dumps(config.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of a stage as the buffers see it."""

    numel: int
    dtype: torch.dtype
    shared: bool = False
    """The word embedding or its tied copy (`shared_embedding`): last in ZeRO-1's buckets."""
    tied: bool = False
    """A tied copy (held only by a last stage that is not also the first)."""
    expert: bool = False
    """A routed expert's stacked weights (`megapar.expert_parallel.is_expert`): under ep > 1
    in gradient buckets of their own, reduced and sharded over the expert-data-parallel group."""
    linear: tuple[int, int] | None = None
    """The weight of a column- or row-parallel linear: its whole (N, K), which says whether
    --fp8 converts it (`fp8_convert.wanted`); None: any other parameter."""
    block: bool = False
    """A transformer block's parameter (not the embedding's nor the head's): its linear
    weights are those ZeRO-1 / 2 may gather in 16 bits (`zero3_half.half_weights`)."""
    replicated: bool = False
    """Whole on every tp rank (no tp partition): under sequence parallelism its gradient is
    each rank's tokens' share, summed over tp once a step (`mark_sequence_parallel`)."""
    partial: bool = False
    """Its gradient is partial over tp even without sequence parallelism (Qwen3's q / k norms,
    replicated k / v heads: tagged `sequence_parallel` when built), summed once a step."""
    matrix: bool = False
    """2-D: with `block`, a matrix --optimizer muon steps (`optim.muon.is_muon_matrix`)."""


def _specs(module, block: bool = False) -> tuple[TensorSpec, ...]:
    linears: dict[int, tuple[int, int]] = {
        id(m.weight): (full_shape(m.weight)[0], full_shape(m.weight)[1])
        for m in module.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    }
    return tuple(
        TensorSpec(
            p.numel(),
            p.dtype,
            is_shared_embedding(p),
            getattr(p, "tied_to", None) is not None,
            bool(getattr(p, "expert", False)),
            linears.get(id(p)),
            block,
            getattr(p, "tp_dim", None) is None,
            bool(getattr(p, "sequence_parallel", False)),
            p.dim() == 2,
        )
        for p in module.parameters()
    )


@lru_cache(maxsize=64)
def _piece_tensors(config_json: str, tp: int, ep: int = 1, etp: int = 1):
    """({kind: block}, embedding, head) parameters of one tp rank, in registration order (the
    block of each layer kind, `layer_kinds`)."""

    config = config_from_dict(json.loads(config_json))
    blocks = {kind: _specs(block, True) for kind, block in kind_blocks(config, tp, ep, etp).items()}
    return (
        blocks,
        _specs(_build(config, tp, range(0), True, False)),
        _specs(_build(config, tp, range(0), False, True)),
    )


def stage_tensors(layout: StageLayout) -> list[TensorSpec]:
    """The parameters one tp rank of pipeline rank `layout.stage` holds (its routed experts split
    over `layout.ep`), in the order `model.parameters()` gives them (each chunk's embedding,
    blocks, then norm and head; the tied copy only on a last chunk without the embedding).
    `tests/test_plan.py` checks it against stages built on the meta device. Reads the model,
    tp, pp, v, stage, placement and ep of `layout`."""

    blocks, embedding, head = _piece_tensors(layout.config_json, layout.tp, layout.ep, layout.etp)
    kinds, specs = layer_kinds(layout.config), _chunk_specs(layout)
    out: list[TensorSpec] = []
    for spec in specs:
        if spec.pre_process:
            out += embedding
        for layer in spec.layers:
            out += blocks[kinds[layer]]
        if spec.post_process:
            out += [t for t in head if not (t.tied and spec.pre_process)]
    return out


@lru_cache(maxsize=4096)
def alike_stages(
    config_json: str, pp: int, v: int, placement: str = "loop", split: PipelineSplit = EVEN
) -> tuple[int, ...]:
    """Per pipeline rank, the lowest rank that holds the same parameters: chunk by chunk the
    same kinds of layer in the same order and the same embedding and head, so the same
    `stage_tensors` and `stage_units` (and the same state under any ZeRO stage), which the
    lower rank's stands for."""
    config = config_from_dict(json.loads(config_json))
    kinds = layer_kinds(config)
    first: dict[tuple, int] = {}
    out = []
    for stage in range(pp):
        specs = (
            chunk_specs(config.num_layers, pp, stage, v, placement, split)
            if v > 1
            else [stage_spec(config.num_layers, pp, stage, split)]
        )
        held = tuple(
            (spec.pre_process, spec.post_process, tuple(kinds[i] for i in spec.layers))
            for spec in specs
        )
        out.append(first.setdefault(held, stage))
    return tuple(out)


@dataclass(frozen=True)
class UnitSpec:
    """One ZeRO-3 unit of a stage as `ShardedParams` makes it."""

    kind: str
    """"block", "root" (a chunk's final norm and head, with a tied word embedding it reads; or
    the whole rest of a chunk that is not split), "embedding" (a split chunk's own embedding
    parameters) or "persistent" (the stage's parameters under the persistence threshold); a
    led unit's, one of `LED_KINDS`."""
    chunk: int
    """The model chunk (-1: the persistent unit, over the whole stage)."""
    tensors: tuple[int, ...]
    """Indices into `stage_tensors`, in the unit's (the model's) order."""
    embedding_grads: bool = False
    """The persistent unit holds some of an embedding module's parameters (their gradients
    are complete only after the embedding's backward, past the first block's)."""
    cast: str | None = None
    """Its parameters are linear weights ZeRO-3 gathers in their matmuls' precision during a
    step (`GatherCasts.of`): "half" (2 bytes an element) or "float8" (1); its gradient buffer
    stays fp32. Kind "half" / "float8", or the unit itself where its block has no other
    parameters. None: gathered in fp32."""

    @property
    def led(self) -> bool:
        """Led by the nearest unit before it that is not (its lead): under expert parallelism
        the expert parameters (kind "experts"), sharded over the expert-data-parallel group;
        under ZeRO-3's 16-bit and float8 all-gathers the weights gathered so (kinds "half",
        "float8"); a tied embedding held by two stages or chunks (kind "tied"). Gathered,
        freed and given gradient buffers with the lead, reduced just before it (a tied one
        deferred to the end of the step, after its sum over the stages)."""
        return self.kind in LED_KINDS


LED_KINDS = ("half", "float8", "tied", "experts")
"""The kinds of unit led by another, in the order they follow their lead (`UnitMaker.unit`)."""


@dataclass(frozen=True)
class GatherCasts:
    """Which of the blocks' linear weights ZeRO-3 gathers in their matmuls' precision during a
    step (megapar-train's 16-bit and float8 all-gathers: `data_parallel/zero3_half.py`,
    `zero3_float8.py`), and ZeRO-1 / 2 in 16 bits after a step (`half`: `optim/zero.py`,
    `zero12_half`); the default: none (every unit and bucket in fp32)."""

    fp8: str = "off"
    """--fp8's recipe: the linears it converts (`wanted`) are never 16-bit weights."""
    fp8_layers: str = "auto"
    """--fp8-layers."""
    float8: bool = False
    """The converted weights gather as float8 bytes (--fp8 tensorwise)."""
    half: bool = False
    """The other linears' weights gather in 16 bits (bf16 / fp16 autocast)."""

    def zero12_half(self, tensors: list[TensorSpec]) -> list[int]:
        """Indices of `tensors` (a stage's) ZeRO-1 / 2 lays out in buckets of their own and
        all-gathers in 16 bits (`Zero1Buckets.half_params`: the blocks' linear weights that
        are not float8 nor routed experts'); [] without `half`."""
        if not self.half:
            return []
        return [
            i for i, t in enumerate(tensors) if t.block and not t.expert and self.of(t) == "half"
        ]

    def of(self, t: TensorSpec) -> str | None:
        """How ZeRO-3 gathers `t` in a step: "float8", "half" or None (fp32)."""
        if t.linear is None:
            return None
        if self.fp8 != "off" and wanted(self.fp8, *t.linear, self.fp8_layers) is None:
            return "float8" if self.float8 else None
        return "half" if self.half else None


NO_CASTS = GatherCasts()
"""No weight gathered in its matmuls' precision: every ZeRO-3 unit in fp32."""


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """What identifies one pipeline stage's parameters (on one tp rank) and its ZeRO layout:
    what `stage_tensors`, `stage_units`, `plan.state.rank_state`, `plan.state.zero_traffic` and
    `plan.slices.most_loaded` read of a layout, and the key of the slices' caches (hashable,
    equal by value). Every field is given by keyword; `StageLayout.of` makes one from a model
    config."""

    config_json: str
    """The model config as canonical JSON (`StageLayout.of`; `Problem.config_json`)."""
    tp: int = 1
    """Tensor-parallel ranks (the stage's parameters are one tp rank's shards)."""
    pp: int = 1
    """Pipeline-parallel ranks."""
    v: int = 1
    """Model chunks per pipeline rank."""
    stage: int = 0
    """The pipeline rank whose parameters and state these are."""
    placement: str = "loop"
    """How chunks map to virtual stages (`megapar.pipeline.placement.PLACEMENTS`)."""
    split: PipelineSplit = EVEN
    """How the blocks are cut into stages or chunks (`Problem.pipeline_split`)."""
    ep: int = 1
    """Expert-parallel ranks: a MoE block holds E / ep routed experts."""
    etp: int = 1
    """Expert tensor-parallel ranks (1 or tp): each routed expert split over them."""
    dp: int = 1
    """The ranks ZeRO shards over: cp x dp (the gradients' group)."""
    zero: int = 0
    """The ZeRO stage (0: none; without ZeRO, or at dp 1, every parameter is whole)."""
    bucket_mb: float = 25.0
    """ZeRO-1 / 2: the gradient buckets' size in MB (--grad-bucket-mb)."""
    persist_below: int = 0
    """ZeRO-3: parameters of fewer elements form the stage's persistent unit
    (--zero3-persistence-threshold; `stage_units`); 0, megapar-train's default: none."""
    casts: GatherCasts = NO_CASTS
    """The linear weights ZeRO-3 gathers in 16 bits or float8 during a step, and ZeRO-1 / 2 in
    16 bits after it (`GatherCasts`); the default: none."""
    optimizer: str = "adamw"
    """The optimizer whose state `plan.state.rank_state` counts (`Problem.optimizer`)."""

    @classmethod
    def of(cls, config, **fields) -> StageLayout:
        """The layout of model config `config` (any megapar config) with `fields`."""
        return cls(config_json=_config_json(config), **fields)

    @property
    def config(self):
        """The model config `config_json` holds (decoded once per JSON and shared: read it,
        never change it)."""
        return _config_of(self.config_json)

    def trimmed(self) -> StageLayout:
        """This layout with what its ZeRO stage does not read at the defaults: below ZeRO-3 no
        persistence threshold, and `casts` only where ZeRO-1 / 2 gathers in 16 bits (they lay
        the 16-bit buckets out apart), so that layouts differing in the rest share one cached
        state (`plan.slices.most_loaded`)."""
        if self.zero >= 3:
            return self
        half = self.zero in (1, 2) and self.casts.half
        casts = self.casts if half else NO_CASTS
        if self.persist_below == 0 and self.casts == casts:
            return self
        return replace(self, persist_below=0, casts=casts)


@lru_cache(maxsize=16)
def _config_of(config_json: str):
    """The model config of canonical JSON `config_json`."""
    return config_from_dict(json.loads(config_json))


def _chunk_specs(layout: StageLayout) -> list:
    """The `StageSpec` of each model chunk `layout.stage` holds, in order."""
    num_layers = layout.config.num_layers
    pp, stage, split = layout.pp, layout.stage, layout.split
    if layout.v > 1:
        return chunk_specs(num_layers, pp, stage, layout.v, layout.placement, split)
    return [stage_spec(num_layers, pp, stage, split)]


def stage_units(layout: StageLayout) -> list[UnitSpec]:
    """ZeRO-3's units of the stage, as `megapar.data_parallel.sharded_params.ShardedParams`
    makes them with `layout.persist_below` (--zero3-persistence-threshold): per chunk each block
    (its parameters of at least `persist_below` elements), then the rest of the chunk: where the
    chunk has blocks and the embedding, split in an embedding unit (the embedding's parameters
    but, when there is a head, a tied word embedding the head reads) and a root unit (the rest),
    else one root unit; then the parameters under `persist_below` in one persistent unit.
    Under expert parallelism (`layout.ep` > 1) the routed experts' parameters of each of these
    form a unit of their own right after it (kind "experts", `UnitSpec.led`; `UnitMaker.unit`),
    or the unit itself where it has no other parameters; so do, before them, the linear weights
    ZeRO-3 gathers in 16 bits and those it gathers in float8 (`layout.casts`; kinds "half",
    "float8"), and a tied word embedding or its copy held by two stages or chunks (kind
    "tied": `sharded_params.split_tied`). Reads what `stage_tensors` reads, and
    `persist_below` and `casts`."""
    blocks_of, embedding, head = _piece_tensors(
        layout.config_json, layout.tp, layout.ep, layout.etp
    )
    kinds, specs = layer_kinds(layout.config), _chunk_specs(layout)
    persist_below, ep, casts = layout.persist_below, layout.ep, layout.casts
    units, small, at, small_embedding = [], [], 0, False

    def take(pieces, embedding: bool = False) -> list[int]:
        nonlocal at, small_embedding
        idx = list(range(at, at + len(pieces)))
        at += len(pieces)
        below = [i for i, t in zip(idx, pieces) if t.numel < persist_below]
        small.extend(below)
        small_embedding |= embedding and bool(below)
        return [i for i, t in zip(idx, pieces) if t.numel >= persist_below]

    tensors = stage_tensors(layout)
    # a tied embedding held by two stages or chunks is a unit of its own (`split_tied`)
    split_tied = any(t.shared for t in tensors) and any(
        not (s.pre_process and s.post_process) for s in specs
    )

    def made(kind: str, ci: int, idx, embedding_grads: bool = False) -> list[UnitSpec]:
        """The unit of `idx` and the units it leads: its 16-bit and float8 weights' and,
        under ep > 1, its experts' (`UnitMaker.unit`)."""
        moe = [i for i in idx if ep > 1 and tensors[i].expert]
        cast = {i: casts.of(tensors[i]) for i in idx if i not in moe}
        half = [i for i in idx if cast.get(i) == "half"]
        f8 = [i for i in idx if cast.get(i) == "float8"]
        tied = [i for i in idx if split_tied and tensors[i].shared and cast.get(i) is None]
        rest = [i for i in idx if i not in moe and cast.get(i) is None and i not in tied]
        kinds = (kind, "half", "float8", *["tied"] * len(tied), "experts")
        groups = (rest, half, f8, *[[i] for i in tied], moe)
        parts = [(p, part) for p, part in zip(kinds, groups) if part]
        return [
            UnitSpec(
                kind if j == 0 else p,
                ci,
                tuple(part),
                embedding_grads and j == 0,
                p if p in ("half", "float8") else None,
            )
            for j, (p, part) in enumerate(parts)
        ]

    for ci, spec in enumerate(specs):
        emb = take(embedding, True) if spec.pre_process else []
        blocks = [b for layer in spec.layers if (b := take(blocks_of[kinds[layer]]))]
        head_here = [t for t in head if not (t.tied and spec.pre_process)]
        tail = take(head_here) if spec.post_process else []
        own = emb if blocks else []
        # a tied word embedding goes with the head that reads it (in its backward too), even
        # where the head's own parameters all persist
        if own and spec.post_process and head_here:
            own = [i for i in own if not tensors[i].shared]
        root = [i for i in emb + tail if i not in own]
        units += [u for b in blocks for u in made("block", ci, b)]
        for kind, idx in (("embedding", own), ("root", root)):
            units += made(kind, ci, idx) if idx else []
    return units + (made("persistent", -1, small, small_embedding) if small else [])


def stage_layer_counts(
    num_layers: int, pp: int, v: int = 1, placement: str = "loop", split: PipelineSplit = EVEN
) -> list[int]:
    """Blocks per pipeline rank as megapar-train cuts them (the first num_layers % pp stages +1,
    or as `split` says; with v > 1 model chunks per rank, the blocks of its chunks, cut into
    pp * v slices)."""
    return list(_stage_layer_counts(num_layers, pp, v, placement, split))


@lru_cache(maxsize=4096)
def _stage_layer_counts(
    num_layers: int, pp: int, v: int, placement: str, split: PipelineSplit = EVEN
) -> tuple[int, ...]:
    """`stage_layer_counts`, cached (the planner asks for each of thousands of layouts)."""
    if v > 1:
        return tuple(
            sum(
                len(spec.layers) for spec in chunk_specs(num_layers, pp, stage, v, placement, split)
            )
            for stage in range(pp)
        )
    return tuple(len(r) for r in partition_layers(num_layers, pp, split))


def stage_params(
    config,
    tp: int,
    pp: int,
    v: int = 1,
    placement: str = "loop",
    config_json: str | None = None,
    ep: int = 1,
    etp: int = 1,
    split: PipelineSplit = EVEN,
) -> list[int]:
    """Elements of parameters one tp rank of each pipeline stage holds (the embedding is on the
    first virtual stage, rank 0, and the head on the last, rank pp - 1, with v chunks too;
    in the "v" placement both are on rank 0; routed experts split over `ep`, each over `etp`;
    the blocks cut as `split` says). `config_json` as for `piece_counts`."""
    json_ = config_json or _config_json(config)
    return list(_stage_params(json_, tp, pp, v, placement, ep, etp, split))


@lru_cache(maxsize=4096)
def _stage_params(
    config_json: str,
    tp: int,
    pp: int,
    v: int,
    placement: str,
    ep: int = 1,
    etp: int = 1,
    split: PipelineSplit = EVEN,
) -> tuple[int, ...]:
    """`stage_params`, cached (the planner asks twice for each of thousands of layouts)."""
    pieces = _pieces(config_json, tp, ep, etp)
    num_layers = len(pieces.blocks)
    counts = []
    head_rank = 0 if placement == "v" else pp - 1
    for stage in range(pp):
        specs = (
            chunk_specs(num_layers, pp, stage, v, placement, split)
            if v > 1
            else [stage_spec(num_layers, pp, stage, split)]
        )
        n = sum(pieces.blocks[i] for spec in specs for i in spec.layers)
        if stage == 0:
            n += pieces.embedding
        if stage == head_rank:
            n += pieces.head + (pieces.tied_copy if pp > 1 else 0)
        counts.append(n)
    return tuple(counts)


def stage_expert_params(
    config,
    tp: int,
    pp: int,
    v: int = 1,
    placement: str = "loop",
    config_json: str | None = None,
    ep: int = 1,
    etp: int = 1,
    split: PipelineSplit = EVEN,
) -> list[int]:
    """Of `stage_params`, the elements of routed experts' parameters (split over `ep`, each
    over `etp`) one tp rank of each pipeline stage holds."""
    json_ = config_json or _config_json(config)
    return list(_stage_expert_params(json_, tp, pp, v, placement, ep, etp, split))


@lru_cache(maxsize=4096)
def _stage_expert_params(
    config_json: str,
    tp: int,
    pp: int,
    v: int,
    placement: str,
    ep: int,
    etp: int = 1,
    split: PipelineSplit = EVEN,
) -> tuple[int, ...]:
    layout = StageLayout(
        config_json=config_json,
        tp=tp,
        pp=pp,
        v=v,
        placement=placement,
        split=split,
        ep=ep,
        etp=etp,
    )
    return tuple(
        sum(t.numel for t in stage_tensors(replace(layout, stage=stage)) if t.expert)
        for stage in range(pp)
    )


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
