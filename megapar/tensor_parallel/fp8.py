"""FP8 linears: torchao's float8 training inside megapar's column- and row-parallel layers.

torchao's `convert_to_float8_training` swaps `nn.Linear` for its `Float8Linear`, whose matmul
(`torchao.float8.float8_linear.matmul_with_hp_or_float8_args`) casts X, W and dY to float8
with dynamic scales (tensorwise: one scale per tensor; rowwise: one per row / column, powers of
two) and runs the three products of a linear layer (Y, dX, dW) in float8 (`torch._scaled_mm`,
or fp32 products of the dequantised values in its emulate mode). megapar's tensor-parallel
layers are not `nn.Linear` and their weights are plain shards, not DTensors, so torchao's
DTensor-based tp composition (torchtitan's) does not apply. Instead each converted layer runs
`_Float8Matmul` below: torchao's matmul operation by operation, built from torchao's own
primitives (`tensor_to_amax`, `amax_to_scale`, `hp_tensor_and_scale_to_float8`, its float8
tensor's `mm`), with one change: where an operand is split over the tp group along the
dimension its scale covers, the amax is reduced (MAX) over the tp group first, as torchtitan's
DTensor casts do. Every element is then cast with the scale it gets in one process, so tp = k
equals tp = 1 up to fp32 summation order.

Which operands are split (in the 2-D views ``X [M, K]``, ``W^T [K, N]``, ``dY [M, N]``):

| layer | X | W^T | dY |
| --- | --- | --- | --- |
| column-parallel (N split) | whole | columns (dim 1) | columns (dim 1) |
| row-parallel (K split) | columns (dim 1) | rows (dim 0) | whole |

A tensorwise scale covers every dimension (reduced when the operand is split at all); a rowwise
scale is the amax along one dimension (reduced when that is the split one).

Under context parallelism the tokens are split over the cp group: M, the rows of X and dY, in
every layer. Their amaxes are then reduced over cp as well where the scale covers M (tensorwise
always; rowwise for dW = dY^T X, whose operands are scaled along M), so cp = k equals cp = 1
too. W is whole on every cp rank.

The layers' weights stay fp32 (the master copy the optimizer steps and checkpoints hold), and
their float8 casts are never saved. Within one optimizer step the weights do not change, so a
step's micro-batches share one cast of each weight (`Fp8WeightCache`, as Transformer Engine's
`is_first_microbatch` in Megatron-LM): the first micro-batch casts it (its amax reduced over tp
once), the others reuse it, and the casts are dropped when the step's forward and backward end.
The activations' and gradients' casts are made per use. torchao is imported when a model is
converted (it is an optional dependency: `megapar[fp8]`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megapar.comm_wait import blocked

FP8_RECIPES = ("off", "tensorwise", "rowwise")
"""`--fp8`'s choices: off, or one of torchao's float8 recipes."""
FP8_LAYERS = ("auto", "all")
"""`--fp8-layers`: which block linears run in float8 (`wanted`)."""


@dataclass(frozen=True)
class Fp8Spec:
    """How one parallel linear runs its matmul in float8: torchao's recipe config and matmul
    config, the tp group (None at tp = 1) and which dimension of X / W^T / dY is split over
    it (`None`: whole on every rank), and the cp group."""

    config: Any  # torchao.float8.Float8LinearConfig
    mm_config: Any  # torchao.float8.float8_training_tensor.LinearMMConfig
    group: Any
    x_split: int | None
    w_t_split: int | None
    dy_split: int | None
    cp_group: Any = None
    """The cp group, over which the rows (M: tokens) of X and dY are split; None at cp = 1."""
    ao: Any = None
    """torchao's float8 config, tensor and utils modules (`_torchao`), looked up once here: the
    lookup sets log levels, which --compile cannot trace (a graph break per layer)."""
    cache: Fp8WeightCache | None = None
    """Where the weight's float8 casts are kept for the rest of an optimizer step; None: cast
    per use."""


@dataclass(eq=False)
class Fp8WeightCache:
    """The float8 casts of a stage's converted weights, kept while `per_step` is active: one
    optimizer step's forwards and backwards, over which the weights do not change. Every
    layer of a stage holds the same cache (`convert_to_fp8`); a tp group's ranks cast and
    reuse in the same order, so their amax all-reduces stay paired. Tensorwise casts once per
    weight (the forward's cast serves dX's product too), rowwise twice (one scale per axis):
    1 or 2 bytes per converted weight element held until the step's backward ends."""

    casts: dict = field(default_factory=dict)
    active: bool = False

    def cast(self, slot: tuple, make: Callable[[], Any]) -> Any:
        """The cast kept under `slot`, made by `make()` the first time (its amax all-reduce,
        if any, then)."""
        if slot not in self.casts:
            self.casts[slot] = make()
        return self.casts[slot]

    @contextlib.contextmanager
    def per_step(self) -> Iterator[None]:
        """Keep the casts made inside; drop them all on leaving (also on an error)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.casts.clear()


def weight_cast_cache(model: torch.nn.Module) -> Fp8WeightCache | None:
    """The `Fp8WeightCache` of `model`'s converted linears; None without float8 layers."""
    for module in model.modules():
        spec = getattr(module, "fp8", None)
        if isinstance(spec, Fp8Spec) and spec.cache is not None:
            return spec.cache
    return None


def _torchao():
    """torchao's float8 pieces (an optional dependency, imported on this one path). Its import
    logs two kinds of warnings on every rank that are torchao's to act on, not the user's, so
    they are held back here: it registers an Enum with torch's pytree in a way torch
    deprecates, and it tries to load every kernel library it ships ("Failed to load
    _C_cutlass_90a.so" on a machine without that GPU), none of which float8 training uses (its
    matmul is torch's `_scaled_mm`)."""
    logs = [logging.getLogger(name) for name in ("torch.utils._pytree", "torchao")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8.config as config
        import torchao.float8.float8_training_tensor as tensor
        import torchao.float8.float8_utils as utils
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)
    return config, tensor, utils


def make_spec(recipe: str, emulate: bool, group, split: str, cp_group=None, cache=None) -> Fp8Spec:
    """The `Fp8Spec` of a layer: `recipe` tensorwise / rowwise, `emulate` (fp32 products of the
    dequantised float8 values: no FP8 hardware), `split` "out" (column-parallel) or "in"
    (row-parallel) over the tp `group`, `cp_group` the cp ranks sharing its sequences, `cache`
    the stage's `Fp8WeightCache` (None: weights cast per use); as `Float8Linear` builds its
    configs."""
    ao = _torchao()
    config_mod, tensor_mod, _ = ao
    config = config_mod.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate)
    mm = [
        tensor_mod.ScaledMMConfig(emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
        for gemm in (
            config.gemm_config_output,
            config.gemm_config_grad_input,
            config.gemm_config_grad_weight,
        )
    ]
    tp = group is not None and dist.get_world_size(group) > 1
    cp = cp_group is not None and dist.get_world_size(cp_group) > 1
    col = split == "out"
    return Fp8Spec(
        config,
        tensor_mod.LinearMMConfig(*mm),
        group if tp else None,
        x_split=None if col or not tp else 1,
        w_t_split=(1 if col else 0) if tp else None,
        dy_split=1 if col and tp else None,
        cp_group=cp_group if cp else None,
        ao=ao,
        cache=cache,
    )


def _reduce_max(amax: torch.Tensor, group) -> None:
    """`amax` replaced by its MAX over `group` (traced as a functional all-reduce under
    --compile; bounded by the group's timeout eagerly)."""
    if torch.compiler.is_compiling():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    else:
        with blocked(amax.device):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def _cast(
    t: torch.Tensor, cast, role, axis: int, spec: Fp8Spec, split: int | None, rows_cp: bool = True
):
    """`t` as torchao's float8 tensor under `cast` (a CastConfig), its rowwise scale along
    `axis`; the amax reduced over tp where `split` is the dimension the scale covers, and over
    cp where the scale covers the rows (`rows_cp`: t's rows are tokens, X and dY)."""
    config_mod, _, utils = spec.ao
    if cast.scaling_type is config_mod.ScalingType.DISABLED:
        return t
    granularity = cast.scaling_granularity
    tensorwise = granularity is config_mod.ScalingGranularity.TENSORWISE
    dim = None if tensorwise else axis
    amax = utils.tensor_to_amax(t, False, None, granularity, dim)
    if split is not None and (tensorwise or axis % t.dim() == split % t.dim()):
        _reduce_max(amax, spec.group)
    if spec.cp_group is not None and rows_cp and (tensorwise or axis % t.dim() == 0):
        _reduce_max(amax, spec.cp_group)
    return to_float8(t, scale_of(amax, cast, spec), cast, role, dim, spec)


def scale_of(amax: torch.Tensor, cast, spec: Fp8Spec) -> torch.Tensor:
    """The float8 scale of an operand whose amax is `amax`, under `cast` (torchao's
    `amax_to_scale`)."""
    round_down = spec.config.round_scales_to_power_of_2
    return spec.ao[2].amax_to_scale(amax, cast.target_dtype, round_down)


def to_float8(t: torch.Tensor, scale: torch.Tensor, cast, role, dim: int | None, spec: Fp8Spec):
    """`t` scaled by `scale` as torchao's float8 tensor in `role` (its rowwise scale along
    `dim`; None: tensorwise): torchao's `hp_tensor_and_scale_to_float8`, elementwise."""
    return spec.ao[1].hp_tensor_and_scale_to_float8(
        t, scale, cast.target_dtype, spec.mm_config, role, dim
    )


def weight_slot(key: int, cast, axis: int, spec: Fp8Spec) -> tuple:
    """The `Fp8WeightCache` slot of the weight `key`'s cast under `cast` along `axis` of W^T:
    one per weight under tensorwise (the forward's cast serves dX's product), one per axis
    under rowwise."""
    tensorwise = cast.scaling_granularity is spec.ao[0].ScalingGranularity.TENSORWISE
    return (key, cast, None if tensorwise else axis % 2)


def _weight_cast(weight: torch.Tensor, key: int | None, cast, axis: int, spec: Fp8Spec):
    """`_cast` of the weight's W^T (never split over cp; `axis` of W^T), from the step's cache
    when it holds one (`key`: the weight's identity; a saved tensor unpacked under
    recomputation is another object): the same tensor a fresh cast makes, since the weight
    has not changed since (under ZeRO-3's float8 all-gather, put there from the gathered
    float8 bytes, and the fp32 weight is not gathered: read only here, only when there is no
    cast to take). Not under --compile (a traced block casts per use), nor with no `key`."""
    role = spec.ao[1].GemmInputRole.WEIGHT
    cache = spec.cache
    if key is None or cache is None or not cache.active or torch.compiler.is_compiling():
        return _cast(weight.t(), cast, role, axis, spec, spec.w_t_split, False)
    return cache.cast(
        weight_slot(key, cast, axis, spec),
        lambda: _cast(weight.t(), cast, role, axis, spec, spec.w_t_split, False),
    )


class _Float8Matmul(torch.autograd.Function):
    """X [M, K] @ W^T [K, N] in float8 (torchao's `matmul_with_hp_or_float8_args`, with
    tp- and cp-reduced amaxes; torchao takes X [..., K] and reshapes inside: the same numbers).
    Takes the weight W [N, K] itself, not W^T (read only if its cast is not kept)."""

    @staticmethod
    def forward(ctx, x, weight, spec: Fp8Spec, key: int | None):
        ctx.save_for_backward(x, weight)
        ctx.spec, ctx.key = spec, key
        c, role = spec.config, spec.ao[1].GemmInputRole
        x8 = _cast(x, c.cast_config_input, role.INPUT, -1, spec, spec.x_split)
        w8 = _weight_cast(weight, key, c.cast_config_weight, 0, spec)
        return torch.mm(x8, w8)  # not a view: a row-parallel layer reduces it in place

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        spec: Fp8Spec = ctx.spec
        c, role = spec.config, spec.ao[1].GemmInputRole
        dy8 = _cast(dy, c.cast_config_grad_output, role.GRAD_OUTPUT, -1, spec, spec.dy_split)
        w8 = _weight_cast(weight, ctx.key, c.cast_config_weight_for_grad_input, -1, spec)
        dx = torch.mm(dy8, w8.t())
        go = c.cast_config_grad_output_for_grad_weight
        dy8 = _cast(dy, go, role.GRAD_OUTPUT, 0, spec, spec.dy_split)
        x8 = _cast(x, c.cast_config_input_for_grad_weight, role.INPUT, 0, spec, spec.x_split)
        return dx, torch.mm(dy8.t(), x8), None, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Fp8Spec
) -> torch.Tensor:
    """F.linear(x, weight, bias) with its three products in float8. Under autocast X enters in
    the autocast dtype (as `Float8Linear`: the weight is cast from its master dtype straight to
    float8) and the output has X's dtype."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        x = x.to(torch.get_autocast_dtype(kind))
    # the weight's identity keys the step's cast cache, which a traced block does not read:
    # traced, id() would make the graph one block's (a guard on which parameter it is), so the
    # blocks would no longer share it; None: cast afresh, also where the call runs eagerly
    key = None if torch.compiler.is_compiling() else id(weight)
    with torch.autocast(kind, enabled=False):
        y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, spec, key)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias.to(y.dtype)
