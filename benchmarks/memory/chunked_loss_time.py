"""The chunked loss's time at tp 1: forward + backward of one micro-batch's LM head and loss
(512 tokens, hidden 128, GPT-2's vocabulary 50,257, fp32: the micro-batch of issue 46's
`zero3_vs_fsdp2_hf.py`), the per-token path (its backward recomputes the logits, what the
models ran before the gradients moved into the forward) against the "sum" (the gradients made
in the forward, what they run now), in turns, round by round; ratios pair by pair."""

import argparse
import statistics
import time

import torch

from megapar.tensor_parallel import linear_cross_entropy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


def _once(x, w, target, reduction: str) -> float:
    start = time.perf_counter()
    loss = linear_cross_entropy(x, w, target, reduction=reduction)
    (loss if reduction == "sum" else loss.sum()).div(x.shape[0]).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=positive, default=10, help="rounds (one run of each path)")
    parser.add_argument("--tokens", type=positive, default=512)
    parser.add_argument("--hidden", type=positive, default=128)
    parser.add_argument("--vocab", type=positive, default=50257)
    args = parser.parse_args()
    sizes = {"--rounds": args.rounds, "--tokens": args.tokens, "--hidden": args.hidden,
             "--vocab": args.vocab}
    for flag, value in sizes.items():
        if value < 1:
            parser.error(f"{flag} {value}: give 1 or more")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, requires_grad=True)
    w = (0.02 * torch.randn(args.vocab, args.hidden)).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,))
    times: dict[str, list[float]] = {"none": [], "sum": []}
    for reduction in times:  # warm-up
        _once(x, w, target, reduction)
    for r in range(args.rounds):
        for reduction in ("none", "sum") if r % 2 == 0 else ("sum", "none"):
            times[reduction].append(_once(x, w, target, reduction))
    ratios = [s / n for s, n in zip(times["sum"], times["none"])]
    print(f"per-token (logits recomputed) ms: {[round(1e3 * t) for t in times['none']]}")
    print(f"sum (gradients in the forward) ms: {[round(1e3 * t) for t in times['sum']]}")
    print(
        f"median {1e3 * statistics.median(times['none']):.0f} ms against "
        f"{1e3 * statistics.median(times['sum']):.0f} ms; sum / per-token pair by pair: "
        f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
    )


if __name__ == "__main__":
    main()
