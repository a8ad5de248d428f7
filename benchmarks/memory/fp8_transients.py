"""What a float8 linear's backward allocates beyond a 16-bit linear's, measured against the
planner's walk (`megapar.plan.fp8.backward_peak_bytes`, the term "float8 casts in a linear's
backward").

One process, bf16 autocast, no tp: for each shape (M tokens, N outputs, K inputs) a linear's
forward runs as megapar's float8 matmul (`tensor_parallel.fp8.fp8_linear`) and, as the
reference, as `F.linear`; then its backward runs under torch's profiler with memory recording,
and the CPU allocator's live bytes are summed over its allocations and frees in order: the
peak is what the backward held at once. The float8 backward's peak less the 16-bit one's
outputs (dX in bf16, dW in bf16 and fp32: 2 MK + 6 NK bytes, what a GPU's 16-bit backward
allocates at its peak) is compared with the walk, emulated (fp32 products of the dequantised
operands: what `--target cpu` counts) and not (torch's `_scaled_mm`; on a CPU it allocates
copies of its own, which a GPU's does not, so that ratio says nothing of a GPU). The 16-bit
backward's own peak on the CPU is printed for reference (oneDNN's bf16 matmul allocates
workspace a GPU's cuBLAS does not).

    python benchmarks/memory/fp8_transients.py
    python benchmarks/memory/fp8_transients.py --shapes 600x224x144 2048x512x256
"""

from __future__ import annotations

import argparse
import contextlib
import re

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megapar.plan.fp8 import backward_peak_bytes
from megapar.tensor_parallel import fp8

SHAPES = ("600x224x144", "2048x512x256", "512x1024x256", "256x512x1024", "1024x256x512")


def backward_peak(y: torch.Tensor, dy: torch.Tensor) -> int:
    """The most bytes the CPU allocator had handed out at once during `y.backward(dy)`, over
    what was allocated before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y.backward(dy)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measure(kind: str, recipe: str, m: int, n: int, k: int, cached: bool = False) -> int:
    """`backward_peak` of a linear under bf16 autocast: kind "bf16" (F.linear), "real" or
    "emulated" (the float8 matmul); `cached`: its weight's casts from a step's
    `Fp8WeightCache`, filled by the forward (as in a training step outside ZeRO-3)."""
    torch.manual_seed(0)
    w = torch.randn(n, k, requires_grad=True)
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    cache = fp8.Fp8WeightCache() if cached else None
    with cache.per_step() if cache else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if kind == "bf16":
                y = F.linear(x, w)
            else:
                spec = fp8.make_spec(recipe, kind == "emulated", None, "out", cache=cache)
                y = fp8.fp8_linear(x, w, None, spec)
        return backward_peak(y, dy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxNxK")
    args = parser.parse_args()
    for shape in args.shapes:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*x[1-9]\d*", shape):
            parser.error(f"--shapes {shape}: give each shape as MxNxK, e.g. 600x224x144")
    print("shape (M x N x K)  recipe      bf16 peak  emulated / walk  cached / walk  "
          "_scaled_mm (CPU) / walk")
    for shape in args.shapes:
        m, n, k = map(int, shape.split("x"))
        outputs = 2 * m * k + 6 * n * k
        for recipe in ("tensorwise", "rowwise"):
            hp = measure("bf16", recipe, m, n, k)
            emulated = measure("emulated", recipe, m, n, k) - outputs
            # rowwise's cast along N is made in the first backward and kept (the cache's term)
            kept = n * k if recipe == "rowwise" else 0
            cached = measure("emulated", recipe, m, n, k, cached=True) - outputs - kept
            real = measure("real", recipe, m, n, k) - outputs
            weight = "cached" if recipe == "tensorwise" else "made once"
            print(
                f"{shape:<18} {recipe:<10} {hp / 2**20:8.2f} MiB  "
                f"{emulated / backward_peak_bytes(m, n, k, 2, True):15.4f}  "
                f"{cached / backward_peak_bytes(m, n, k, 2, True, weight):13.4f}  "
                f"{real / backward_peak_bytes(m, n, k, 2, False):22.3f}"
            )


if __name__ == "__main__":
    main()
