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


def linear(kind: str, recipe: str, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a linear's output under bf16 autocast, its gradient): kind "bf16" (F.linear), "real"
    or "emulated" (the float8 matmul)."""
    torch.manual_seed(0)
    w = torch.randn(n, k, requires_grad=True)
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if kind == "bf16":
            y = F.linear(x, w)
        else:
            y = fp8.fp8_linear(x, w, None, fp8.make_spec(recipe, kind == "emulated", None, "out"))
    return y, torch.randn(m, n, dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxNxK")
    args = parser.parse_args()
    print("shape (M x N x K)  recipe      bf16 peak  emulated / walk  _scaled_mm (CPU) / walk")
    for shape in args.shapes:
        m, n, k = map(int, shape.split("x"))
        outputs = 2 * m * k + 6 * n * k
        for recipe in ("tensorwise", "rowwise"):
            hp = backward_peak(*linear("bf16", recipe, m, n, k))
            ratios = []
            for kind in ("emulated", "real"):
                measured = backward_peak(*linear(kind, recipe, m, n, k)) - outputs
                ratios.append(measured / backward_peak_bytes(m, n, k, 2, kind == "emulated"))
            print(
                f"{shape:<18} {recipe:<10} {hp / 2**20:8.2f} MiB  {ratios[0]:15.4f}  "
                f"{ratios[1]:22.3f}"
            )


if __name__ == "__main__":
    main()
