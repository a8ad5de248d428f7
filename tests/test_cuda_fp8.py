"""--fp8 on one GPU with FP8 (compute capability >= 8.9): torchao's real float8 matmuls.

The CPU suite (tests/test_fp8.py) checks the float8 casts and their composition with every
layout in torchao's emulate mode; only here do `torch._scaled_mm`'s kernels run. A tiny Llama
(every dimension a multiple of 16) in bf16 autocast trains three steps with --fp8 tensorwise and
rowwise (all block linears converted) and again emulated on the same GPU: the same casts and
scales, so the losses differ only by the kernels' accumulation and bf16 output rounding, and
must agree within the 2e-2 the suite allows bf16 against fp32; each also tracks bf16 without
fp8 within 2e-2. Skipped without torchao or without such a GPU; `MEGAPAR_CUDA_TIER_ON_CPU=1`
(the rehearsal) runs the same code with the emulation and bf16 on the CPU (the emulation must
track bf16 there too), so only the real kernels are left for the GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_cuda_single import ON_CPU, batch, engine_on, record

pytestmark = pytest.mark.cuda(gpus=1)


def _why_not() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (tools/gpu_session.sh installs it from wheels/)"
    if ON_CPU:
        return None  # the rehearsal: the emulation and bf16 on the CPU, no real kernels
    if not torch.cuda.is_available():
        return "needs a GPU"
    if torch.cuda.get_device_capability(0) < (8, 9):
        return f"{torch.cuda.get_device_name(0)} has no FP8 matmuls (compute capability < 8.9)"
    return None


def _losses(**options) -> list[float]:
    engine = engine_on("gpu", "llama", precision="bf16", **options)
    return [engine.train_step(batch("llama", step)) for step in range(3)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_kernels_equal_the_emulation_and_track_bf16(recipe):
    why = _why_not()
    if why:
        pytest.skip(why)
    fp8 = dict(fp8=recipe, fp8_layers="all")
    emulated, bf16 = _losses(fp8_emulate=True, **fp8), _losses()
    for b, c in zip(emulated, bf16):
        assert abs(b - c) / c < 2e-2, (recipe, emulated, bf16)
    if ON_CPU:  # the rehearsal: not the GPU's kernels (test_fp8.py runs torch's CPU ones)
        record(f"fp8 {recipe} emulated (rehearsal)", emulated=emulated, bf16=bf16)
        return
    real = _losses(**fp8)
    record(f"fp8 {recipe} on the gpu", real=real, emulated=emulated, bf16=bf16)
    for a, b, c in zip(real, emulated, bf16):
        assert abs(a - b) / b < 2e-2, (recipe, real, emulated)
        assert abs(a - c) / c < 2e-2, (recipe, real, bf16)
