"""`--fp8`: which of a model's parallel linears run in float8, and their conversion.

The rule (`wanted`) is torchao's own auto filter for its recipes
(`torchao.float8.float8_linear_utils._auto_filter_for_recipe`, from H100 measurements), applied
to the matmul each rank runs, i.e. the layer's *local* shard: N = output features, K = input
features of this rank's weight. A layer stays in high precision when N or K is not a multiple
of 16 (FP8 matmuls need it) or when float8 would be slower at that size: tensorwise when
K <= 4096 and N <= 1024; rowwise when N <= 2048, K <= 1024, or N <= 4096 and K <= 2048.
`--fp8-layers all` keeps only the multiple-of-16 rule (the tests' tiny models).

Only `ColumnParallelLinear` and `RowParallelLinear` (the blocks' projections and MLPs) are
candidates: the embedding, the LM head (tied or not, fused with the loss), Llama's replicated
k / v heads (`ReplicatedHeads`, when tp does not divide the kv heads) and BERT's MLM transform
always stay in high precision, as in torchtitan, and so do a mixture of experts' router and routed
experts (their grouped matmuls: torchao's float8 grouped matmul is a prototype of Triton
kernels, CUDA only); its shared experts are column- and row-parallel linears like the rest.
The line `convert_to_fp8` returns names every such module. torchao's rule in this module is
copied rather than called: torchao's filter takes `nn.Linear` modules and megapar's layers are
not.
"""

from __future__ import annotations

import re

from torch import nn

from megapar.tensor_parallel.fp8 import FP8_LAYERS, FP8_RECIPES, Fp8WeightCache, make_spec
from megapar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def wanted(recipe: str, n: int, k: int, layers: str = "auto") -> str | None:
    """None when a local [N, K] matmul runs in float8 under `recipe`, else why it does not."""
    if n % 16 or k % 16:
        return "N or K not a multiple of 16"
    if layers == "all":
        return None
    if recipe == "tensorwise" and k <= 4096 and n <= 1024:
        return "K <= 4096 and N <= 1024"
    if recipe == "rowwise":
        if n <= 2048:
            return "N <= 2048"
        if k <= 1024:
            return "K <= 1024"
        if n <= 4096 and k <= 2048:
            return "N <= 4096 and K <= 2048"
    return None


def none_kept_by_size(summary: str, layers: str) -> bool:
    """Whether `convert_to_fp8`'s line `summary` says that no linear runs in float8 and the
    size rule of layers "auto" kept some (a model too small for it), so that layers "all"
    would convert those whose dims are multiples of 16."""
    return layers == "auto" and ": 0 linears in float8" in summary and "<=" in summary


def convert_to_fp8(
    model: nn.Module,
    recipe: str,
    emulate: bool,
    layers: str = "auto",
    cp_group=None,
    where: str = "",
) -> str:
    """Point every wanted parallel linear of `model` at its float8 matmul (an `Fp8Spec` in its
    `fp8` attribute, all sharing one `Fp8WeightCache`; the weights are untouched; `cp_group`:
    the ranks its sequences are split over, None at cp 1) and return one line saying which
    layers of this rank run in float8 and which stay in high precision, with their local
    N x K; `where` (e.g. " on pipeline rank 0 of 2") follows the recipe, for a model that is
    one stage of several."""
    if recipe not in FP8_RECIPES[1:] or layers not in FP8_LAYERS:
        raise ValueError(f"fp8 recipe {recipe!r} / layers {layers!r} unknown")
    converted: dict[str, int] = {}
    kept: dict[str, str] = {}
    always: dict[str, None] = {}  # ordered set of the other modules holding matrices
    cache = Fp8WeightCache()
    for name, module in model.named_modules():
        canonical = re.sub(r"^chunks\.\d+\.", "", name)  # a virtual stage's chunk: its own name
        short = ".".join(p for p in canonical.split(".") if not p.isdigit())  # per kind, not layer
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            if any(p.ndim >= 2 for p in module.parameters(recurse=False)):
                always[short] = None
            continue
        n, k = module.weight.shape
        why = wanted(recipe, n, k, layers)
        if why is not None:
            kept[f"{short} {n}x{k}"] = why
            continue
        split = "out" if isinstance(module, ColumnParallelLinear) else "in"
        module.fp8 = make_spec(recipe, emulate, module.group, split, cp_group, cache)
        converted[f"{short} {n}x{k}"] = converted.get(f"{short} {n}x{k}", 0) + 1
    mode = " (emulated: fp32 products)" if emulate else ""
    line = f"fp8 {recipe}{mode}{where}: {sum(converted.values())} linears in float8"
    if converted:
        line += f" ({', '.join(converted)})"
    if kept:
        line += "; kept in high precision: " + ", ".join(f"{k} ({w})" for k, w in kept.items())
    return line + ("; always in high precision: " + ", ".join(always) if always else "")
