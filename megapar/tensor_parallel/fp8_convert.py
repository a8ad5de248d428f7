"""`--fp8`: which of a model's parallel linears run in float8, and their conversion.

Which linears run in float8 is a property of the model and the flags, not of the layout: the
rule (`wanted`) reads a layer's **whole** (unsplit) N x K (N = output features, K = input
features), as torchtitan, which converts the model before tensor parallelism splits it. It is
torchao's own auto filter for its recipes
(`torchao.float8.float8_linear_utils._auto_filter_for_recipe`, from H100 measurements): a layer
stays in high precision when N or K is not a multiple of 16 or when float8 would be slower at
that size: tensorwise when K <= 4096 and N <= 1024; rowwise when N <= 2048, K <= 1024, or
N <= 4096 and K <= 2048. `--fp8-layers all` keeps only the multiple-of-16 rule (the tests' tiny
models). So every tp runs the same layers in float8, and tp k computes what tp 1 does.

A tp at which a chosen layer cannot run in float8 is refused before any worker starts
(`layout_problem`; training's `check_fp8_layout`): FP8 matmuls need the N and K of each rank's
shard to be multiples of 16 too, and a projection held whole on every tp rank (Llama's k / v
when tp does not divide the kv heads, `replicated_projection`) is not converted.

Only `ColumnParallelLinear` and `RowParallelLinear` (the blocks' projections and MLPs) are
candidates (and a replicated projection, to be kept or refused): the embedding, the LM head
(tied or not, fused with the loss) and BERT's MLM transform always stay in high precision, as
in torchtitan, and so do a mixture of experts' router and routed experts (their grouped
matmuls: torchao's float8 grouped matmul is a prototype of Triton kernels, CUDA only); its
shared experts are column- and
row-parallel linears like the rest. The line `convert_to_fp8` returns names every such module.
torchao's rule in this module is copied rather than called: torchao's filter takes `nn.Linear`
modules and megapar's layers are not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from torch import nn

from megapar.tensor_parallel.fp8 import FP8_LAYERS, FP8_RECIPES, Fp8WeightCache, make_spec
from megapar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megapar.tensor_parallel.partition import full_shape
from megapar.wording import and_list


def wanted(recipe: str, n: int, k: int, layers: str = "auto") -> str | None:
    """None when a linear whose whole weight is N x K runs in float8 under `recipe`, else why
    it does not."""
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


REPLICATED = "replicated_projection"
"""The attribute (True) of a module holding whole on every tp rank a projection that is a
column-parallel linear at a tp dividing its heads (Llama's `ReplicatedHeads`): never converted,
so where `wanted` chooses its whole N x K the tp is refused (`layout_problem`)."""


@dataclass(frozen=True)
class Fp8Linear:
    """One candidate linear of a model as one tp rank holds it, and the rule's verdict."""

    name: str
    """Its module path without layer indices or virtual chunk ("layers.mlp.down")."""
    n: int
    """This rank's output features."""
    k: int
    """This rank's input features."""
    full: tuple[int, int]
    """The whole weight's (N, K), the same at every tp: what `wanted` reads."""
    split: str | None
    """What tp splits: "out" (column-parallel), "in" (row-parallel), None (held whole)."""
    why_kept: str | None
    """None when the model runs it in float8 (`wanted` on `full`), else why not."""
    heads: int | None = None
    """An attention projection's heads (its module's `heads`), which a tp must divide to split
    it by heads (k / v: held whole, `REPLICATED`, at a tp that does not); None for others."""

    @property
    def converted(self) -> bool:
        return self.why_kept is None

    @property
    def problem(self) -> str | None:
        """Why this rank cannot run a layer the model runs in float8, or None."""
        if not self.converted:
            return None
        if self.split is None:
            return "held whole on every tp rank (tp does not divide the kv heads)"
        if self.n % 16 or self.k % 16:
            return f"{self.n}x{self.k} on each tp rank: FP8 matmuls need N and K multiples of 16"
        return None

    @property
    def key(self) -> str:
        """How the fp8 line names it: its kind and whole N x K."""
        return f"{self.name} {self.full[0]}x{self.full[1]}"


def fp8_linears(model: nn.Module, recipe: str, layers: str = "auto"):
    """(module, `Fp8Linear`) of every candidate linear of `model` (this rank's), in order."""
    for name, module in model.named_modules():
        canonical = re.sub(r"^chunks\.\d+\.", "", name)  # a virtual stage's chunk: its own name
        short = ".".join(p for p in canonical.split(".") if not p.isdigit())  # per kind, not layer
        column = isinstance(module, ColumnParallelLinear)
        replicated = getattr(module, REPLICATED, False)
        if not (column or isinstance(module, RowParallelLinear) or replicated):
            continue
        n, k = module.weight.shape
        full_n, full_k = full_shape(module.weight)
        split = "out" if column else "in" if isinstance(module, RowParallelLinear) else None
        why = wanted(recipe, full_n, full_k, layers)
        heads = getattr(module, "heads", None)
        yield module, Fp8Linear(short, n, k, (full_n, full_k), split, why, heads)


def layout_problem(model: nn.Module, recipe: str, layers: str = "auto") -> str | None:
    """Why this tp cannot run `model`'s float8 linears (one of its blocks suffices: every block
    of a kind is alike), naming the first such layer and what the tps that can share; None when
    it can."""
    found = [x for _, x in fp8_linears(model, recipe, layers) if x.converted]
    bad = next((x for x in found if x.problem), None)
    if bad is None:
        return None
    common = 0  # a tp dividing every chosen split dim / 16 keeps them multiples of 16
    for x in found:
        # its split dim: the input's of a row-parallel linear, else the output rows (k / v
        # held whole here are split by them at a tp dividing their heads)
        common = math.gcd(common, (x.full[1] if x.split == "in" else x.full[0]) // 16)
        if x.heads is not None or x.split is None:  # split by heads: a tp dividing them
            common = math.gcd(common, x.heads or 1)
    tps = [str(t) for t in range(1, common + 1) if common % t == 0]
    which = "only tp 1 splits" if common == 1 else f"tp {and_list(tps, 'or')} split"
    verb = "divides" if common == 1 else "divide"  # "only tp 1 splits ...", "tp 1 or 2 split"
    also = f" and {verb} the kv heads" if bad.split is None else ""
    return (
        f"{bad.key} runs in float8 and is {bad.problem}; {which} every float8 linear into "
        f"multiples of 16{also}"
    )


def all_layers_hint(all_problem: str | None, tp: int, api: bool = False) -> str:
    """What the line of a model whose linears the size rule all kept adds (`none_kept_by_size`):
    that layers "all" converts those whose dims are multiples of 16, or, where `all_problem`
    (`layout_problem` under layers "all" at `tp`) says this tp cannot run them, at which tp it
    does (the flag alone was offered at --tp 2, which then refused it); `api`: prepare's
    keywords."""
    flag, tp_is = ("fp8_layers='all'", "tp=") if api else ("--fp8-layers all", "--tp ")
    said = f"{flag} converts those whose dims are multiples of 16"
    if all_problem is None:
        return said
    m = re.search(r"; (?:only tp 1 splits|tp ([\d, or]+) split)", all_problem)
    tps = (m.group(1) if m and m.group(1) else "1").replace(", ", f", {tp_is}")
    tps = tps.replace(" or ", f" or {tp_is}")
    return f"{said} at {tp_is}{tps}, not at {tp_is}{tp} ({all_problem.split(';')[0]})"


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
    layers run in float8 and which stay in high precision, with their whole N x K (the same
    line at every tp); `where` (e.g. " on pipeline rank 0 of 2") follows the recipe, for a
    model that is one stage of several. ValueError where this tp cannot run a chosen layer in
    float8 (`layout_problem`, refused before the workers start)."""
    if recipe not in FP8_RECIPES[1:] or layers not in FP8_LAYERS:
        raise ValueError(f"fp8 recipe {recipe!r} / layers {layers!r} unknown")
    converted: dict[str, int] = {}
    kept: dict[str, str] = {}
    always: dict[str, None] = {}  # ordered set of the other modules holding matrices
    cache = Fp8WeightCache()
    candidates = dict(fp8_linears(model, recipe, layers))
    for name, module in model.named_modules():
        if module not in candidates:
            if any(p.ndim >= 2 for p in module.parameters(recurse=False)):
                canonical = re.sub(r"^chunks\.\d+\.", "", name)
                always[".".join(p for p in canonical.split(".") if not p.isdigit())] = None
            continue
        x = candidates[module]
        if x.why_kept is not None:
            kept[x.key] = x.why_kept
            continue
        if x.problem is not None:  # refused before the workers start (`layout_problem`)
            raise ValueError(f"--fp8: {x.key} runs in float8 and is {x.problem}")
        module.fp8 = make_spec(recipe, emulate, module.group, x.split, cp_group, cache)
        converted[x.key] = converted.get(x.key, 0) + 1
    mode = " (emulated: fp32 products)" if emulate else ""
    line = f"fp8 {recipe}{mode}{where}: {sum(converted.values())} linears in float8"
    if converted:
        line += f" ({', '.join(converted)})"
    if kept:
        line += "; kept in high precision: " + ", ".join(f"{k} ({w})" for k, w in kept.items())
    return line + ("; always in high precision: " + ", ".join(always) if always else "")
