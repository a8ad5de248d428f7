"""The gradient norm on the CPU: torch's foreach norm of whole tensors (megapar's norm before
`clip.sum_of_squares`) against `sum_of_squares` (fp64 sums of 16,384-element pieces), side by
side: the relative error of each against the float64 norm, and the time of one call.

The gradients are random (normal, 1e-3) in the shapes of one process's parameters of gpt2-tiny
and GPT-2 124M (the real GPT-2 vocabulary padded to 50,304), and of tp rank 0's shards at tp 2
(the vocabulary and the column-parallel matrices halved), so that the difference between the
two layouts' errors shows too.

    python benchmarks/data_parallel/grad_norm_accuracy.py              # about 10 seconds on 2 cores
"""

from __future__ import annotations

import argparse
import time

import torch

from megapar.optim.clip import sum_of_squares
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


def gpt2_shapes(hidden: int, layers: int, positions: int, tp: int = 1) -> list[tuple]:
    """One stage's parameter shapes (tp rank 0's shard at tp > 1; replicated ones whole)."""
    shapes = [(50304 // tp, hidden), (positions, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden,), (3 * hidden // tp, hidden), (3 * hidden // tp,),
                   (hidden, hidden // tp), (hidden,), (hidden,), (hidden,),
                   (4 * hidden // tp, hidden), (4 * hidden // tp,), (hidden, 4 * hidden // tp),
                   (hidden,)]
    return shapes + [(hidden,), (hidden,)]


def whole_tensors(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm before: one foreach norm of whole tensors."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).pow(2)


def timed(fn, grads, repeats: int) -> tuple[float, float]:
    fn(grads)
    start = time.perf_counter()
    for _ in range(repeats):
        value = fn(grads)
    return value.sqrt().item(), (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    gen = torch.Generator().manual_seed(0)
    print(f"{'gradients':28s} {'elements':>11s} {'error before':>13s} {'error now':>10s} "
          f"{'ms before':>10s} {'ms now':>8s} {'now / before':>13s}")
    for name, (hidden, layers, positions) in {"gpt2-tiny": (64, 4, 128),
                                              "GPT-2 124M": (768, 12, 1024)}.items():
        for tp in (1, 2):
            grads = [torch.randn(s, generator=gen) * 1e-3
                     for s in gpt2_shapes(hidden, layers, positions, tp)]
            exact = sum(g.double().pow(2).sum() for g in grads).sqrt().item()
            before, t_before = timed(whole_tensors, grads, args.repeats)
            now, t_now = timed(sum_of_squares, grads, args.repeats)
            print(f"{name + f' (tp {tp}, rank 0)':28s} {sum(g.numel() for g in grads):11,d} "
                  f"{(before - exact) / exact:+13.1e} {(now - exact) / exact:+10.1e} "
                  f"{t_before:10.1f} {t_now:8.1f} {t_now / t_before:12.2f}x")


if __name__ == "__main__":
    main()
