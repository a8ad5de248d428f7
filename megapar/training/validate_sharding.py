"""The checks of ZeRO-3's options (`check_zero3`) and of expert parallelism's combinations
(`check_ep`), before any worker starts; each raises a `UsageError` naming the problem and
the fix."""

from __future__ import annotations

from megapar.training.usage import UsageError


def check_zero3(cfg) -> None:
    """What --zero 3 cannot serve yet: one line naming the combination and what to use."""
    if cfg.zero3_keep_params and cfg.zero != 3:
        raise UsageError(
            "--zero3-keep-params only applies to --zero 3 (it keeps a unit's "
            "gathered parameters over the step); add --zero 3 or drop it"
        )
    if cfg.zero3_reduce != "step" and cfg.zero != 3:
        already = " (--zero 2 reduces every micro-batch already)" if cfg.zero == 2 else ""
        raise UsageError(
            f"--zero3-reduce {cfg.zero3_reduce} only applies to --zero 3{already}; "
            f"add --zero 3 or drop it"
        )
    if cfg.zero3_persistence_threshold and cfg.zero != 3:
        raise UsageError(
            "--zero3-persistence-threshold only applies to --zero 3; add --zero 3 or drop it"
        )
    if cfg.zero3_persistence_threshold < 0:
        raise UsageError(
            f"--zero3-persistence-threshold {cfg.zero3_persistence_threshold} is "
            f"invalid: give a number of elements >= 0 (0: none persist)"
        )
    if cfg.zero != 3:
        return
    if cfg.grad_compression != "none":
        raise UsageError(
            f"--grad-compression {cfg.grad_compression} cannot be combined with "
            f"--zero 3 (gradients are reduce-scattered per unit, the compressors "
            f"compress an all-reduce); use --zero 0, or --grad-compression none"
        )
    if cfg.grad_reduce_dtype not in ("auto", "fp32"):
        raise UsageError(
            f"--grad-reduce-dtype {cfg.grad_reduce_dtype} is not served with "
            f"--zero 3 (its reduce-scatters run in fp32); use --zero 1 for a "
            f"{cfg.grad_reduce_dtype} reduction, or drop --grad-reduce-dtype"
        )
    if cfg.offload_params and not cfg.offload_optimizer:
        raise UsageError(
            "--offload-params needs --offload-optimizer (the host-held parameter "
            "shards are the weights the optimizer steps, so it steps on the host "
            "too, as DeepSpeed's offload_param with offload_optimizer): add "
            "--offload-optimizer"
        )


def check_ep(cfg) -> None:
    """--ep: it divides dp x cp (when dp is given; an inferred dp is checked by the layout)."""
    if cfg.ep == 1:
        return
    if cfg.dp is not None and cfg.dp * cfg.cp % cfg.ep:
        raise UsageError(
            f"--ep {cfg.ep} does not divide dp x cp = --dp {cfg.dp} x --cp {cfg.cp}: experts are "
            f"sharded over data- and context-parallel ranks; choose an --ep that divides it"
        )
