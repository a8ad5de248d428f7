"""What `--fp8` changes in a plan: which block linears run in float8 at a layout, their share of
the matmul FLOPs, the amax all-reduces they add, and their memory terms.

The linears are read off the real blocks built on the meta device at the candidate's tp (as
`plan.params` counts parameters), so their local N x K is the matmul each rank runs, and the
rule deciding which convert is training's own (`tensor_parallel.fp8_convert.wanted`, on the
whole N x K: the same layers at every tp). A tp at which a chosen layer's shard is not a
multiple of 16, or at which it is a replicated projection, is refused as megapar-train refuses
it (`fp8_refusal`). Only the column- and row-parallel linears are candidates, as in
`convert_to_fp8`: the embedding, the LM head, a mixture of experts' router and routed experts
never convert.

Per converted linear (`_Float8Matmul`, `_cast`, `Fp8WeightCache` in `tensor_parallel/fp8.py`):

- FLOPs: its three products (Y, dX, dW) run at `Problem.fp8_speedup` x the high-precision
  rate. The casts (an amax, a scale, a scaled copy per operand, eager kernels without
  `--compile`) read and write memory that is not modelled, so the speed-up is an upper bound;
- amax all-reduces (latency, a scalar or a row of scales each): per micro-batch the forward
  casts X, the backward dY twice and X; the weight is cast once a step (the step's
  micro-batches share its casts: one under tensorwise, one per axis under rowwise; under
  ZeRO-3, which holds no gathered weight through the step, per use: W in the forward and for
  dX). Under tp a cast is reduced over the tp group where the operand is split along the
  dimension its scale covers (`amax_reductions`), under cp X and dY where the scale covers the
  tokens; full recomputation casts the forward's X again;
- memory: its weight is cast from the fp32 master straight to float8 with autocast off, so
  autocast keeps no 16-bit copy of it (`converted_params` leave `process._autocast_copies`);
  the step's float8 casts of the weights are held through its forward and backward passes
  (`weight_cache_bytes`: 1 byte a weight element under tensorwise, 2 under rowwise; none under
  ZeRO-3); while a linear's backward runs, its casts' fp32 scaled copies and float8 operands
  exist transiently (`backward_peak_bytes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from megapar.models.config import config_from_dict
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.placement import placement_of
from megapar.plan.params import GatherCasts, kind_blocks
from megapar.tensor_parallel.fp8 import FP8_LAYERS, FP8_RECIPES
from megapar.tensor_parallel.fp8_convert import (
    all_layers_hint,
    fp8_linears,
    layout_problem,
    none_kept_by_size,
)


@dataclass(frozen=True)
class Linear:
    """One column- or row-parallel linear of a block, as one tp rank holds it."""

    name: str
    """Its module path without layer indices (`convert_to_fp8`'s: "layers.mlp.down")."""
    n: int
    """Local output features (this rank's rows of the weight)."""
    k: int
    """Local input features."""
    column: bool
    """Column-parallel (N split over tp); else row-parallel (K split)."""
    params: int
    """Elements of its parameters (the weight and any bias) on this rank."""
    why_kept: str | None
    """None when it runs in float8, else `wanted`'s reason (read off its whole N x K)."""
    key: str = ""
    """How the fp8 line names it: its kind and whole N x K (`Fp8Linear.key`)."""

    @property
    def converted(self) -> bool:
        return self.why_kept is None


@lru_cache(maxsize=256)
def block_linears(config_json: str, tp: int, recipe: str, layers: str) -> dict[bool, tuple]:
    """{block kind (True: mixture of experts): its column- and row-parallel `Linear`s} on one
    tp rank, with `wanted`'s verdict under `recipe` / `layers` (`fp8_convert.fp8_linears`: by
    the whole N x K, the same at every tp)."""
    config = config_from_dict(json.loads(config_json))
    out = {}
    for kind, block in kind_blocks(config, tp).items():
        out[kind] = tuple(
            Linear(
                x.name,
                x.n,
                x.k,
                x.split == "out",
                sum(p.numel() for p in module.parameters()),
                x.why_kept,
                x.key,
            )
            for module, x in fp8_linears(block, recipe, layers)
            if x.split is not None  # a replicated projection: never converted
        )
    return out


@lru_cache(maxsize=256)
def _layout_problem(config_json: str, tp: int, recipe: str, layers: str) -> str | None:
    config = config_from_dict(json.loads(config_json))
    for block in kind_blocks(config, tp).values():
        problem = layout_problem(block, recipe, layers)
        if problem:
            return problem
    return None


def fp8_refusal(p, tp: int) -> str | None:
    """Why tp `tp` cannot run the linears `p`'s model runs in float8 under its --fp8, as
    megapar-train refuses it (`check_fp8_layout`), or None (and None without --fp8)."""
    if p.fp8 == "off" or p.fp8 not in FP8_RECIPES or p.fp8_layers not in FP8_LAYERS:
        return None  # an unknown recipe is `converted`'s refusal
    problem = _layout_problem(p.config_json, tp, p.fp8, p.fp8_layers)
    if problem is None:
        return None
    return f"fp8 {p.fp8} with fp8_layers {p.fp8_layers} at tp {tp}: {problem}"


def converted(p, tp: int) -> dict[bool, tuple]:
    """{block kind: its linears that run in float8} at `tp` under `p`'s --fp8 (none when off)."""
    if p.fp8 == "off":
        return {}
    if p.fp8 not in FP8_RECIPES or p.fp8_layers not in FP8_LAYERS:
        raise ValueError(
            f"fp8 {p.fp8!r} / fp8_layers {p.fp8_layers!r} unknown: use one of "
            f"{', '.join(FP8_RECIPES)} / {', '.join(FP8_LAYERS)}"
        )
    every = block_linears(p.config_json, tp, p.fp8, p.fp8_layers)
    return {kind: tuple(x for x in linears if x.converted) for kind, linears in every.items()}


def converted_flops(p, tp: int) -> dict[bool, float]:
    """{block kind: forward matmul FLOPs per token of its float8 linears} on one tp rank (the
    backward's dX and dW each as many again)."""
    return {kind: sum(2.0 * x.n * x.k for x in lins) for kind, lins in converted(p, tp).items()}


def stage_kinds(p, c, stage: int) -> list[bool]:
    """The block kind (True: mixture of experts) of each layer pipeline rank `stage` of
    candidate `c` holds, all its chunks (`Problem.layer_kinds`: worked out once per plan)."""
    placement = placement_of(c.schedule)
    specs = chunk_specs(p.config.num_layers, c.pp, stage, c.v, placement, p.pipeline_split)
    return [bool(p.layer_kinds[i]) for spec in specs for i in spec.layers]


def _converted_total(p, c, stage: int, of) -> int:
    """`of(linear)` summed over the float8 linears pipeline rank `stage` holds (one tp rank)."""
    per = {kind: sum(of(x) for x in xs) for kind, xs in converted(p, c.tp).items()}
    return sum(per[kind] for kind in stage_kinds(p, c, stage)) if per else 0


def converted_params(p, c, stage: int) -> int:
    """Elements of the parameters (weights and biases) of the float8 linears pipeline rank
    `stage` holds on one tp rank: autocast caches no 16-bit copy of them."""
    return _converted_total(p, c, stage, lambda x: x.params)


def float8_gathered(p, c) -> bool:
    """Whether ZeRO-3 gathers the converted weights as float8 bytes (megapar-train's float8
    all-gather, `data_parallel/zero3_float8.py`: --fp8 tensorwise, ZeRO-3 over more than one
    rank, without --offload-params): each weight's cast is then the gathered float8 weight,
    none made or held besides, and the scales come from one amax all-reduce over dp (x cp) and
    one over tp a step for the whole stage. Not under --compile (`Problem.compile`: the traced
    blocks cast from the fp32 weight; `TrainConfig.zero3_float8`)."""
    on = p.fp8 == "tensorwise" and c.zero == 3 and c.dp * c.cp > 1
    return on and not (c.offload_params or p.compile)


def half_gathered(p, c) -> bool:
    """Whether ZeRO gathers the blocks' other linear weights in 16 bits (bf16 / fp16 autocast
    on fp32 weights, over more than one rank): ZeRO-3 in each step's gathers (megapar-train's
    16-bit all-gather, `data_parallel/zero3_half.py`; under --offload-params each host master
    copied up in fp32 and rounded on the device), the gathered weight then autocast's
    cast, none made besides; ZeRO-1 / 2 in the all-gather after the step (`optim/zero.py`,
    their own buckets)."""
    return p.sixteen_bit and c.zero in (1, 2, 3) and c.dp * c.cp > 1


def zero3_casts(p, c) -> GatherCasts:
    """`plan.params.StageLayout.casts`: the linear weights ZeRO-3 gathers in 16 bits or float8 at
    candidate `c`, or ZeRO-1 / 2 in 16 bits (`half_gathered`, `float8_gathered`)."""
    return GatherCasts(p.fp8, p.fp8_layers, float8_gathered(p, c), half_gathered(p, c))


def half_weights(p, c, stage: int) -> int:
    """Elements of the weights of pipeline rank `stage`'s block linears ZeRO gathers in 16
    bits at candidate `c` (one tp rank; 0 where it does not: `half_gathered`)."""
    if not half_gathered(p, c):
        return 0
    every = block_linears(
        p.config_json, c.tp, p.fp8 if p.fp8 != "off" else "tensorwise", p.fp8_layers
    )
    per = {
        kind: sum(x.n * x.k for x in xs if p.fp8 == "off" or not x.converted)
        for kind, xs in every.items()
    }
    return sum(per[kind] for kind in stage_kinds(p, c, stage))


def weight_cached(p, c) -> bool:
    """Whether the step's micro-batches share each weight's float8 cast (`Fp8WeightCache`):
    everywhere but ZeRO-3, whose gathered weights are not held through the step, unless it
    gathers them in float8 (`float8_gathered`: the gathered weight is the cast)."""
    return c.zero != 3 or float8_gathered(p, c)


def amax_reductions(
    recipe: str, column: bool, tp: bool, cp: bool, cached: bool = True
) -> tuple[int, int, int, int, int]:
    """(tp forward, tp backward, cp forward, cp backward per micro-batch, tp per step): the
    amax all-reduces one float8 linear makes (`_cast` in tensor_parallel/fp8.py). Per
    micro-batch the forward casts X (scale along K), the backward dY (along N) for dX, then dY
    and X along M for dW. The weight W^T is cast along K for the forward and along N for dX:
    with `cached` (`weight_cached`) once a step, the two sharing one cast under tensorwise (the
    last count); else in every micro-batch's forward and backward. A tensorwise scale covers
    every dimension, a rowwise one the axis it is taken along. tp: reduced where the operand
    is split along that axis (column-parallel: W^T and dY split along N; row-parallel: X and
    W^T along K); cp: X and dY, where the scale covers M (the tokens cp splits; W is whole on
    every cp rank). `tp` / `cp`: the group has more than one rank."""
    tensorwise = recipe == "tensorwise"
    # (operand, axis its scale covers) of each cast, forward then backward
    forward = (("x", "k"),)
    backward = (("dy", "n"), ("dy", "m"), ("x", "m"))
    weight = (("w", "k"),) if tensorwise else (("w", "k"), ("w", "n"))
    split = {"w": "n", "dy": "n"} if column else {"x": "k", "w": "k"}

    def tp_reduced(op: str, axis: str) -> bool:
        return tp and op in split and (tensorwise or split[op] == axis)

    def cp_reduced(op: str, axis: str) -> bool:
        return cp and op in ("x", "dy") and (tensorwise or axis == "m")

    w_fwd, w_bwd = tp_reduced("w", "k"), tp_reduced("w", "n")
    return (
        sum(tp_reduced(*a) for a in forward) + (0 if cached else w_fwd),
        sum(tp_reduced(*a) for a in backward) + (0 if cached else w_bwd),
        sum(cp_reduced(*a) for a in forward),
        sum(cp_reduced(*a) for a in backward),
        sum(tp_reduced(*a) for a in weight) if cached else 0,
    )


def block_reductions(p, c) -> dict[bool, tuple[int, ...]]:
    """{block kind: `amax_reductions` summed over its float8 linears} at candidate `c`."""
    out = {}
    cached = weight_cached(p, c)
    gathered = float8_gathered(p, c)  # the weights' amaxes in one all-reduce for the stage
    for kind, lins in converted(p, c.tp).items():
        counts = [amax_reductions(p.fp8, x.column, c.tp > 1, c.cp > 1, cached) for x in lins]
        total = tuple(sum(col) for col in zip(*counts)) if counts else (0,) * 5
        out[kind] = total[:4] + (0,) if gathered else total
    return out


def converted_weights(p, c, stage: int) -> int:
    """Elements of the weights of pipeline rank `stage`'s float8 linears (one tp rank)."""
    return _converted_total(p, c, stage, lambda x: x.n * x.k)


def weight_cache_bytes(p, c, stage: int) -> int:
    """The step's float8 casts of the weights of pipeline rank `stage`'s float8 linears (one
    tp rank), held from their first use to the end of the step's backward: 1 byte a weight
    element under tensorwise, 2 under rowwise (one cast per axis); 0 under ZeRO-3 (cast per
    use, or gathered in float8: the gathered units hold them) or without --fp8."""
    if not weight_cached(p, c) or float8_gathered(p, c):
        return 0
    casts = 1 if p.fp8 == "tensorwise" else 2
    return casts * converted_weights(p, c, stage)


CAST_BYTES = 8
"""Bytes per element a cast holds at once (torchao's `hp_tensor_and_scale_to_float8`): the
operand scaled in fp32 and its clamped copy, before the float8 result (1 byte) replaces them."""


def backward_peak_bytes(
    m: int, n: int, k: int, act_bytes: int, emulate: bool, weight: str = "per use"
) -> int:
    """The most bytes a float8 linear's backward ([M, K] input, [N, K] weight) allocates at
    once beyond what the high-precision linear's backward does (dX, the 16-bit dW and its fp32
    copy), walking `_Float8Matmul.backward` and torchao's float8 mm: dY cast (`CAST_BYTES`,
    then 1 byte an element kept), W cast for dX (`weight`: "per use", kept to the end of the
    backward; "cached", the step's cast, which `weight_cache_bytes` counts: none made here;
    "made once", rowwise's cast along N, made in the step's first backward and kept in the
    cache: its transient only), dX's product (the transposed float8 weight copied row-major;
    `emulate`: each operand dequantised to fp32, the product in fp32 then cast), dY cast
    again, X cast, dW's product (dY^T and X copied into the layouts the product wants).
    `act_bytes`: dY's and the products' element size (2 under bf16 / fp16)."""
    mk, mn, nk = m * k, m * n, n * k
    live = peak = 0

    def hold(nbytes: int) -> None:
        nonlocal live, peak
        live += nbytes
        peak = max(peak, live)

    def cast(elements: int) -> None:  # transient fp32 copies, then the float8 result kept
        hold(CAST_BYTES * elements)
        hold(elements - CAST_BYTES * elements)

    def product(a: int, b: int, out: int) -> None:
        if emulate:  # each operand: .float() then / scale, the first freed
            hold(8 * a)
            hold(-4 * a)
            hold(8 * b)
            hold(-4 * b)
            hold(4 * out)
            hold(-4 * a - 4 * b)
            if act_bytes != 4:
                hold(act_bytes * out)
                hold(-4 * out)
        else:
            hold(act_bytes * out)

    cast(mn)  # dY along N
    if weight == "per use":
        cast(nk)  # W along N, kept to the end of the backward
    elif weight == "made once":
        hold(CAST_BYTES * nk)  # W along N, into the step's cache (counted there)
        hold(-CAST_BYTES * nk)
    hold(nk)  # W^T's float8 copied row-major for dX = dY W
    product(mn, nk, mk)
    hold(-nk)
    cast(mn)  # dY along M, then the first dY's float8 freed
    hold(-mn)
    cast(mk)  # X along M
    hold(mn + mk)  # dY^T and X copied into the layouts dW's product wants
    product(mn, mk, nk)
    high = act_bytes * (mk + nk) + (4 * nk if act_bytes != 4 else 0)
    return max(peak - high, 0)


def largest_transient(p, c, emulate: bool) -> tuple[int, Linear | None]:
    """(`backward_peak_bytes` of the float8 linear of candidate `c` that allocates the most,
    that linear; the first converted one with 0 where none allocates more than its 16-bit
    backward; None without converted linears): M = mbs x seq / cp tokens (sequence
    parallelism gathers them before the column-parallel products and reduce-scatters after
    the row-parallel ones); the weight's cast from the step's cache (rowwise's along N made
    in the backward: the top of the backward is the step's first), per use under ZeRO-3
    (gathered in float8 under tensorwise: as cached)."""
    m = c.mbs * p.seq_len // c.cp
    weight = (
        "per use"
        if not weight_cached(p, c)
        else ("cached" if p.fp8 == "tensorwise" else "made once")
    )
    best: tuple[int, Linear | None] = (0, None)
    for lins in converted(p, c.tp).values():
        for x in lins:
            size = backward_peak_bytes(m, x.n, x.k, p.act_bytes, emulate, weight)
            if best[1] is None or size > best[0]:  # 0 for all: none allocates more
                best = (size, x)
    return best


def summary(p, c, stage: int) -> str:
    """The line `megapar-train` logs for its conversion (`convert_to_fp8`), for pipeline rank
    `stage` of candidate `c`: how many linears run in float8, per kind with its whole N x K,
    and which are kept in high precision and why; where the size rule of --fp8-layers auto
    kept every one (a small model), the flag that converts them anyway, as megapar-train's
    line says (`fp8_note`)."""
    every = block_linears(p.config_json, c.tp, p.fp8, p.fp8_layers)
    converted_n: dict[str, int] = {}
    kept: dict[str, str] = {}
    for kind in stage_kinds(p, c, stage):
        for x in every[kind]:
            key = x.key
            if x.converted:
                converted_n[key] = converted_n.get(key, 0) + 1
            else:
                kept[key] = x.why_kept or ""
    line = f"fp8 {p.fp8}: {sum(converted_n.values())} linears in float8"
    if converted_n:
        line += f" ({', '.join(converted_n)})"
    if kept:
        line += "; kept in high precision: " + ", ".join(f"{k} ({w})" for k, w in kept.items())
    if none_kept_by_size(line, p.fp8_layers):
        all_problem = _layout_problem(p.config_json, c.tp, p.fp8, "all")
        line += f"; {all_layers_hint(all_problem, c.tp)}"
    return line


def stage_reductions(p, c, stage: int, micro_batches: int) -> tuple[int, int]:
    """(over tp, over cp): the amax all-reduces pipeline rank `stage` of candidate `c` makes in
    a step of `micro_batches` per model chunk (full recomputation casts the forward's X again;
    the weights' casts once a step, `amax_reductions`)."""
    per = block_reductions(p, c)
    if not per:
        return 0, 0
    again = 1 if c.recompute == "full" else 0
    tp = cp = step = 0
    kinds = stage_kinds(p, c, stage)
    for kind in kinds:
        f_tp, b_tp, f_cp, b_cp, w_tp = per[kind]
        tp += f_tp * (1 + again) + b_tp
        cp += f_cp * (1 + again) + b_cp
        step += w_tp
    if float8_gathered(p, c) and c.tp > 1 and any(converted(p, c.tp)[k] for k in kinds):
        step += 1  # ZeRO-3's float8 all-gather: the stage's weights' amaxes, one all-reduce
    return tp * micro_batches + step, cp * micro_batches
