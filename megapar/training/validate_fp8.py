"""`--fp8`'s checks, before any worker starts: torchao installed and a GPU with FP8 (or
--fp8-emulate) (`check_fp8`), and a tp at which every linear the model runs in float8 can
(`check_fp8_layout`)."""

from __future__ import annotations

import importlib.util

import torch

from megapar.device import use_cuda
from megapar.mesh import Layout, Mesh
from megapar.models import build_model
from megapar.tensor_parallel.fp8_convert import layout_problem
from megapar.training.validate_sharding import _terms
from megapar.wording import and_list

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 matmuls (Ada; Hopper is 9.0, Blackwell 10.0)."""


class Fp8Error(ValueError):
    """A --fp8 setting that cannot run (megapar-train reports it as a usage error)."""


def check_fp8(
    cfg, hardware: bool = True, given: set[str] | None = None, keyword: str | None = None
) -> None:
    """Raise Fp8Error naming the problem and the fix. `hardware`: check this machine's GPU
    (False for the dry run, which rehearses the job's GPUs on the CPU). `given`: the settings
    the user gave; --fp8-emulate / --fp8-layers without --fp8 are refused only when given (a
    resumed --fp8 run's recorded ones are inert under --fp8 off). `keyword`: the function whose
    keywords the settings are (e.g. "megapar.prepare"): the line then names them as
    `name=value` instead of by their flags."""
    term = _terms(keyword)
    where = f"{keyword}: " if keyword else ""
    if cfg.fp8 == "off":
        inert = [n for n in ("fp8_emulate", "fp8_layers") if given is None or n in given]
        if (
            "fp8_emulate" in inert
            and cfg.fp8_emulate
            or "fp8_layers" in inert
            and (cfg.fp8_layers != "auto")
        ):
            which = (
                term("fp8_emulate", True)
                if cfg.fp8_emulate and "fp8_emulate" in inert
                else term("fp8_layers", cfg.fp8_layers)
            )
            raise Fp8Error(
                f"{where}{which} applies to {term('fp8')}: add {term('fp8', 'tensorwise')} "
                f"(or {term('fp8', 'rowwise')}) or drop it"
            )
        return
    fp8, drop = term("fp8", cfg.fp8), f"drop {term('fp8')}"
    if keyword is None and "fp8" in getattr(cfg, "from_checkpoint", ()):  # --load's, not given
        fp8 += f" (not given: the value --load {cfg.load} recorded)"
        drop = "give --fp8 off"
    if importlib.util.find_spec("torchao") is None:
        raise Fp8Error(
            f"{where}{fp8} needs torchao's float8 training, which is not installed: "
            f"pip install 'megapar[fp8]' (or torchao==0.18.0), or {drop}"
        )
    if hardware and not cfg.fp8_emulate:
        _check_gpu(fp8, drop, term("fp8_emulate", True), where)


def _check_gpu(fp8: str, drop: str, emulate: str, where: str) -> None:
    if not use_cuda():
        raise Fp8Error(
            f"{where}{fp8} needs a GPU with FP8 matmuls (compute capability >= 8.9) and "
            f"this run has none (no GPU visible, or MEGAPAR_CPU=1): {drop}, or add "
            f"{emulate} (the float8 casts with fp32 products: for tests, slower than bf16)"
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise Fp8Error(
            f"{where}{fp8} needs a GPU with FP8 matmuls (compute capability >= 8.9: "
            f"L4 / L40, H100, H200, B200); this {name} is {capability[0]}.{capability[1]}: "
            f"{drop} (or add {emulate}, slower than bf16)"
        )


def fp8_layout_problem(config, tp: int, recipe: str, layers: str) -> str | None:
    """Why tp `tp` cannot run the linears model `config` runs in float8 under `recipe` /
    `layers` (`fp8_convert.layout_problem`, read off one block of each kind built on the meta
    device as tp rank 0 holds it), or None. "off": None."""
    if recipe == "off":
        return None
    firsts: dict[bool, int] = {}
    moe = getattr(config, "is_moe_layer", None)
    for i in range(config.num_layers):
        firsts.setdefault(bool(moe and moe(i)), i)
    mesh = Mesh.virtual(Layout(tp, 1, 1), rank=0, device="meta")
    for i in firsts.values():
        block = build_model(config, mesh, range(i, i + 1), pre_process=False, post_process=False)
        problem = layout_problem(block, recipe, layers)
        if problem:
            return problem
    return None


def check_fp8_layout(cfg, config, tp: int, keyword: str | None = None) -> None:
    """Fp8Error where tp `tp` cannot run a linear that model `config` runs in float8 (the
    layers are chosen by their whole N x K, the same at every tp: `fp8_convert`), naming the
    layer and the fix; `keyword` as `check_fp8`'s."""
    problem = fp8_layout_problem(config, tp, cfg.fp8, cfg.fp8_layers)
    if problem is None:
        return
    term = _terms(keyword)
    where = f"{keyword}: " if keyword else ""
    # without --fp8 its companions would be refused next (they apply to it alone)
    off = [
        term("fp8", cfg.fp8),
        *([term("fp8_emulate", True)] if cfg.fp8_emulate else []),
        *([term("fp8_layers", cfg.fp8_layers)] if cfg.fp8_layers != "auto" else []),
    ]
    one = "only tp 1 " in problem
    regather = one and getattr(cfg, "sp_regather", False)  # refused at tp 1 in turn
    fix = term("tp", 1) if one else "such a tp"
    if regather:
        fix += f" (dropping {term('sp_regather', True)}, which needs tp > 1)"
    raise Fp8Error(
        f"{where}{term('fp8', cfg.fp8)} {term('fp8_layers', cfg.fp8_layers)} at "
        f"{term('tp', tp)}: {problem}; use {fix}, or drop {and_list(off)}"
    )
