"""`--fp8`'s checks, before any worker starts: torchao installed, a GPU with FP8 (or
--fp8-emulate), and the layouts the float8 linears serve (`check_fp8`)."""

from __future__ import annotations

import importlib.util

import torch

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 matmuls (Ada; Hopper is 9.0, Blackwell 10.0)."""


class Fp8Error(ValueError):
    """A --fp8 setting that cannot run (megapar-train reports it as a usage error)."""


def check_fp8(cfg, hardware: bool = True) -> None:
    """Raise Fp8Error naming the problem and the fix. `hardware`: check this machine's GPU
    (False for the dry run, which rehearses the job's GPUs on the CPU)."""
    if cfg.fp8 == "off":
        if cfg.fp8_emulate or cfg.fp8_layers != "auto":
            which = "--fp8-emulate" if cfg.fp8_emulate else "--fp8-layers"
            raise Fp8Error(
                f"{which} applies to --fp8: add --fp8 tensorwise (or rowwise) or drop it"
            )
        return
    if importlib.util.find_spec("torchao") is None:
        raise Fp8Error(
            f"--fp8 {cfg.fp8} needs torchao's float8 training, which is not installed: "
            f"pip install 'megapar[fp8]' (or torchao==0.18.0), or drop --fp8"
        )
    if cfg.cp > 1:
        raise Fp8Error(
            f"--fp8 with --cp {cfg.cp} is not supported (a sequence split over cp ranks would "
            f"give each its own float8 scales): drop --cp or --fp8"
        )
    if hardware and not cfg.fp8_emulate:
        _check_gpu(cfg.fp8)


def _check_gpu(recipe: str) -> None:
    if not torch.cuda.is_available():
        raise Fp8Error(
            f"--fp8 {recipe} needs a GPU with FP8 matmuls (compute capability >= 8.9) and "
            f"this machine has no GPU: drop --fp8, or add --fp8-emulate (the float8 casts "
            f"with fp32 products: for tests, slower than bf16)"
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise Fp8Error(
            f"--fp8 {recipe} needs a GPU with FP8 matmuls (compute capability >= 8.9: "
            f"L4 / L40, H100, H200, B200); this {name} is {capability[0]}.{capability[1]}: "
            f"drop --fp8 (or add --fp8-emulate, slower than bf16)"
        )
