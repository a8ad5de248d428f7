"""Tokens/s of megapar-generate's loop: N prompts grown in one batch against one at a time.

    PYTHONPATH=$PWD python3 benchmarks/generate/batched_generation.py --model gpt2-small-cpu \
        --prompts 8 --new-tokens 64 --rounds 5 [--precision fp32|bf16|fp16]

A model of a recipe with megapar's init (seed 0; the weights do not change the work), N prompts
of random ids of lengths spread over [8, 40] (seed 0), greedy, no end-of-sequence token: every
row adds --new-tokens tokens either way. Each round times the batch (`generate_batch` of all N)
and the N prompts alone (`generate_batch` of each), in turns (`common.interleave`, the order
alternating); printed: each side's median tokens/s over the rounds, the batch's speed-up round
by round (median [min, max]), and whether every row's tokens are the same both ways. One
process (tp 1 x pp 1), on the CPU unless CUDA is there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

from megapar.mesh import Mesh  # noqa: E402
from megapar.models.recipes import resolve_model  # noqa: E402
from megapar.pipeline.partition import build_stage  # noqa: E402
from megapar.training.generate import Sampling, generate_batch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=common.recipe, default="gpt2-small-cpu",
        help="a recipe (default %(default)s)")
    p.add_argument("--prompts", type=common.positive, default=8,
        help="prompts generated together (default %(default)s)")
    p.add_argument("--new-tokens", type=common.positive, default=64,
        help="tokens generated per prompt (default %(default)s)")
    p.add_argument("--rounds", type=common.positive, default=5,
        help="timed rounds, each way in turn (default %(default)s)")
    p.add_argument("--precision", choices=list(DTYPES), default="fp32",
        help="the weights' dtype (default %(default)s)")
    p.add_argument("--threads", type=common.positive, default=None,
        help="torch's CPU threads (default torch's; 1 steadies the figures on a shared machine)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = resolve_model(args.model)
    mesh = Mesh.from_env(1, 1, 1)
    model = build_stage(config, mesh, seed=0).eval().to(DTYPES[args.precision])
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 41, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    def grow(rows: list[list[int]]) -> list[list[int]]:
        out = generate_batch(model, mesh, rows, args.new_tokens, Sampling(temperature=0),
                             [torch.Generator() for _ in rows], config.hidden_size,
                             config.vocab_size, config.max_positions, None)
        return [g.new_ids for g in out]

    def timed(fn):
        def run():
            start = time.perf_counter()
            ids = fn()
            return args.prompts * args.new_tokens / (time.perf_counter() - start), ids
        return run

    grow(prompts[:2])  # warm-up
    runs = common.interleave({
        "batched": timed(lambda: grow(prompts)),
        "alone": timed(lambda: [grow([prompt])[0] for prompt in prompts]),
    }, args.rounds, alternate=True)
    batched = [r[0] for r in runs["batched"]]
    alone = [r[0] for r in runs["alone"]]
    same = all(b[1] == a[1] for b, a in zip(runs["batched"], runs["alone"], strict=True))
    print(f"{args.model} {args.precision} on {mesh.device.type}, {torch.get_num_threads()} "
          f"threads: {args.prompts} prompts x {args.new_tokens} new tokens, {args.rounds} rounds")
    print(f"batched: {statistics.median(batched):,.0f} tokens/s "
          f"(rounds: {', '.join(f'{x:,.0f}' for x in batched)})")
    print(f"one at a time: {statistics.median(alone):,.0f} tokens/s "
          f"(rounds: {', '.join(f'{x:,.0f}' for x in alone)})")
    print(f"speed-up {common.ratio_summary(common.pair_ratios(batched, alone))}x; "
          f"the same tokens both ways: {same}")


if __name__ == "__main__":
    main()
