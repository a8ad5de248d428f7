"""The checks of ZeRO-3's options (`check_zero3`) and of what the sharded and offloaded
optimizers cannot serve (`check_optimizer_sharding`), before any worker starts; each raises a
`UsageError` naming the problem and the fix. (Expert parallelism's sizes are checked with the
model's experts: `training.model_config`.)"""

from __future__ import annotations

from megapar.mesh import Layout, Mesh
from megapar.optim.optimizer import NOT_OFFLOADED
from megapar.pipeline.partition import build_stage
from megapar.training.usage import UsageError, flag_of

_NO_VALUE = object()


def _terms(keyword: str | None):
    """`term(name, value)`: a setting as the caller gave it, megapar-train's flag
    (`--zero 3`, `--offload-optimizer`) or, with `keyword`, a keyword argument (`zero=3`)."""

    def term(name: str, value=_NO_VALUE) -> str:
        if keyword:
            return name if value is _NO_VALUE else f"{name}={value!r}"
        return flag_of(name) if value is _NO_VALUE or value is True else f"{flag_of(name)} {value}"

    return term


def check_optimizer_sharding(cfg, keyword: str | None = None) -> None:
    """What ZeRO 1/2 and the offloaded optimizer cannot serve: gradient compression with
    --zero 1/2, --offload-optimizer with LAMB / LARS / Muon. One line naming the combination
    and what to use; `keyword` as `check_zero3`'s."""
    term, where = _terms(keyword), f"{keyword}: " if keyword else ""
    if cfg.zero in (1, 2) and cfg.grad_compression != "none":
        raise UsageError(
            f"{where}{term('grad_compression', cfg.grad_compression)} cannot be combined with "
            f"{term('zero', cfg.zero)}: the distributed optimizer reduce-scatters the gradient "
            f"buffer, the compressors compress an all-reduce; drop one of them "
            f"({term('zero', 0)} or {term('grad_compression', 'none')})"
        )
    if cfg.offload_optimizer and cfg.optimizer in NOT_OFFLOADED:
        offload = term("offload_optimizer", True)
        why = (
            "its Newton-Schulz iteration needs whole matrices"
            if cfg.optimizer == "muon"
            else "its trust ratios need whole-parameter norms"
        )
        raise UsageError(
            f"{where}{offload} steps AdamW or SGD on the host, not "
            f"{term('optimizer', cfg.optimizer)} ({why} "
            f"on the devices): drop {offload} or use {term('optimizer', 'adamw')}"
        )


def check_grad_wire(cfg, keyword: str | None = None) -> None:
    """--grad-compression beside --grad-reduce-dtype: both choose how the dp reduction's
    gradients travel. One line; `keyword` as `check_zero3`'s (`megapar.prepare` trained with
    the compression and ignored the dtype where megapar-train refused the two)."""
    if cfg.grad_compression == "none" or cfg.grad_reduce_dtype == "auto":
        return
    term, where = _terms(keyword), f"{keyword}: " if keyword else ""
    casts = term("grad_compression", "bf16") + (" / 'fp16'" if keyword else " / fp16")
    raise UsageError(
        f"{where}{term('grad_reduce_dtype', cfg.grad_reduce_dtype)} and "
        f"{term('grad_compression', cfg.grad_compression)} both choose how gradients travel; "
        f"give one ({casts} is a reduction in that dtype)"
    )


def check_powersgd_rank(cfg, config, tp: int, pp: int, keyword: str | None = None) -> None:
    """A --powersgd-rank at which PowerSGD compresses none of the model's gradient matrices as
    the ranks hold them at `tp` x `pp` (and --ep): each n x m sends (n + m) x rank numbers,
    and goes uncompressed in fp32 where that is no fewer than n x m, so every gradient went in
    fp32 without a word (a new user's tryout; rank 60 of a 64-wide model at tp 2, a re-test).
    One line naming the largest rank that compresses one; `keyword` as `check_zero3`'s."""
    if cfg.grad_compression != "powersgd":
        return
    shapes = _gradient_matrices(config, tp, pp, cfg.ep)
    useful = max(((n * m - 1) // (n + m) for n, m in shapes if n and m), default=0)
    if cfg.powersgd_rank <= useful:
        return
    term, where = _terms(keyword), f"{keyword}: " if keyword else ""
    at = f" at {term('tp', tp)}" if tp > 1 else ""
    fix = (
        f"give a rank of at most {useful} (the default is 4)"
        if useful
        else f"no matrix is large enough for it: use {term('grad_compression', 'bf16')} or none"
    )
    raise UsageError(
        f"{where}{term('powersgd_rank', cfg.powersgd_rank)} compresses nothing: every gradient "
        f"matrix of this model{at} would send at least as many numbers as it holds ((n + m) x "
        f"rank >= n x m), so each would go uncompressed in fp32; {fix}"
    )


def _gradient_matrices(config, tp: int, pp: int, ep: int) -> list[tuple[int, int]]:
    """(n, m) of every gradient PowerSGD takes as a matrix (2-D or more: its first dim by the
    rest), as the ranks of `tp` x `pp` hold them (a routed expert stack split over `ep`), from
    meta-device stages."""
    grid, shapes = Layout(tp, pp, 1), []
    for p in range(pp):
        stage = build_stage(config, Mesh.virtual(grid, grid.rank(0, p, 0)), seed=0, init=False)
        for param in stage.parameters():
            if param.dim() >= 2:
                n = param.shape[0] // (ep if getattr(param, "expert", False) else 1)
                shapes.append((n, param.numel() // param.shape[0]))
    return shapes


def offload_params_problem(cfg, keyword: str | None = None) -> str | None:
    """--offload-params without --zero 3, said with its fix (`check_zero3`'s; megapar-train's
    unused flags name it beside theirs, `check_unused`), or None."""
    term, zero3 = _terms(keyword), _terms(keyword)("zero", 3)
    params, optimizer = term("offload_params", True), term("offload_optimizer", True)
    if not cfg.offload_params or cfg.zero == 3:
        return None
    both = f"{zero3}" if cfg.offload_optimizer else f"{zero3} and {optimizer}"
    if cfg.optimizer in NOT_OFFLOADED:  # the offloaded optimizer would be refused next
        dropped = f"{params} and {optimizer}" if cfg.offload_optimizer else params
        fix = (
            f"drop {dropped} ({term('optimizer', cfg.optimizer)} does not step on the "
            f"host), or use {term('optimizer', 'adamw')} with {both}"
        )
    elif cfg.offload_optimizer:
        fix = f"add {zero3}, or drop {params}"
    else:
        fix = f"add {both}, or use {optimizer} alone"
    return (
        f"{params} needs {zero3} (it keeps the parameter shards in host memory; "
        f"{term('zero', cfg.zero)} keeps whole parameters on the device): {fix}"
    )


def check_zero3(cfg, keyword: str | None = None) -> None:
    """What --zero 3 cannot serve yet, and the options only it serves (--offload-params, which
    also needs --offload-optimizer; the --zero3-* options): one line naming the combination and
    what to use; the one place these are checked, for megapar-train and `megapar.prepare`.
    `keyword`: the function whose keywords the settings are (e.g. "megapar.prepare"): the
    line then names them as `name=value` instead of by their flags."""
    term = _terms(keyword)
    where = f"{keyword}: " if keyword else ""
    zero3 = term("zero", 3)
    if cfg.zero3_keep_params and cfg.zero != 3:
        raise UsageError(
            f"{where}{term('zero3_keep_params', True)} only applies to {zero3} (it keeps a "
            f"unit's gathered parameters over the step); add {zero3} or drop it"
        )
    if cfg.zero3_reduce != "step" and cfg.zero != 3:
        already = f" ({term('zero', 2)} reduces every micro-batch already)" if cfg.zero == 2 else ""
        raise UsageError(
            f"{where}{term('zero3_reduce', cfg.zero3_reduce)} only applies to {zero3}"
            f"{already}; add {zero3} or drop it"
        )
    if cfg.zero3_persistence_threshold and cfg.zero != 3:
        raise UsageError(
            f"{where}{term('zero3_persistence_threshold')} only applies to {zero3}; add "
            f"{zero3} or drop it"
        )
    params, optimizer = term("offload_params", True), term("offload_optimizer", True)
    if problem := offload_params_problem(cfg, keyword):
        raise UsageError(f"{where}{problem}")
    if cfg.zero3_persistence_threshold < 0:
        raise UsageError(
            f"{where}{term('zero3_persistence_threshold', cfg.zero3_persistence_threshold)} is "
            f"invalid: give a number of elements >= 0 (0: none persist)"
        )
    if cfg.zero != 3:
        return
    if cfg.grad_compression != "none":
        raise UsageError(
            f"{where}{term('grad_compression', cfg.grad_compression)} cannot be combined with "
            f"{zero3} (gradients are reduce-scattered per unit, the compressors "
            f"compress an all-reduce); use {term('zero', 0)}, or "
            f"{term('grad_compression', 'none')}"
        )
    if cfg.grad_reduce_dtype not in ("auto", "fp32"):
        raise UsageError(
            f"{where}{term('grad_reduce_dtype', cfg.grad_reduce_dtype)} is not served with "
            f"{zero3} (its reduce-scatters run in fp32); use {term('zero', 0)}, "
            f"{term('zero', 1)} or {term('zero', 2)} for a {cfg.grad_reduce_dtype} reduction, "
            f"or drop {term('grad_reduce_dtype')}"
        )
    if cfg.offload_params and not cfg.offload_optimizer and cfg.optimizer in NOT_OFFLOADED:
        raise UsageError(  # adding the offloaded optimizer would be refused next
            f"{where}{params} needs {optimizer} (the host-held parameter shards are the weights "
            f"the optimizer steps), which steps AdamW or SGD on the host, not "
            f"{term('optimizer', cfg.optimizer)}: drop {params} or use {term('optimizer', 'adamw')}"
        )
    if cfg.offload_params and not cfg.offload_optimizer:
        raise UsageError(
            f"{where}{params} needs {optimizer} (the host-held parameter shards are the weights "
            f"the optimizer steps, so it steps on the host too, as DeepSpeed's offload_param "
            f"with offload_optimizer): add {optimizer}"
        )
