"""A sliding window's KV cache: the rolling buffer of the window's last keys against a cache that
keeps every position, in cache bytes and decode-step time.

    PYTHONPATH=$PWD python3 benchmarks/generate/windowed_cache.py --window 16 --new-tokens 256 \
        --prompts 4 --rounds 5

A tiny Mistral (llama-tiny's shape: hidden 64, 4 layers, 4 heads, 2 kv heads; vocabulary
--vocab, default 32,000; every layer windowed) with megapar's init (seed 0), --prompts prompts
of random ids of lengths spread over [8, 40] (seed 0) grown by `generate_batch` in one
left-padded batch, greedy, no end-of-sequence token: every row adds --new-tokens tokens. Each
round runs both caches in turns (`common.interleave`, the order alternating): "trimmed"
(megapar's cache: each windowed layer's rolling buffer) and "every position" (the same code
with `KVCache.trims` off: each layer's buffer of the generation's whole length, the window
applied by the mask over every cached key). Printed per side: the caches' bytes once the batch
ended (keys and values of every layer: the most they held), the median decode-step time (one
`last_logits` call: the forward of one position per row) over all steps and over the last 32
(the longest caches), each round's ratio every-position / trimmed (median [min, max]), and
whether the tokens are the same both ways. The time is the process's CPU time
(`time.process_time`, --threads 1 by default): on a shared machine it counts the work, not the
waits for a core. One process (tp 1 x pp 1), fp32, on the CPU unless CUDA is there.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

from megapar.mesh import Mesh  # noqa: E402
from megapar.models import kv_cache as kv  # noqa: E402
from megapar.models.config import config_from_dict  # noqa: E402
from megapar.pipeline.partition import build_stage  # noqa: E402
from megapar.training import generate as gen  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=common.positive, default=16)
    p.add_argument("--new-tokens", type=common.positive, default=256)
    p.add_argument("--prompts", type=common.positive, default=4)
    p.add_argument("--vocab", type=common.positive, default=32000)
    p.add_argument("--rounds", type=common.positive, default=5)
    p.add_argument("--last", type=common.positive, default=32, help="the late decode steps timed apart")
    p.add_argument("--threads", type=common.positive, default=1, help="torch's intra-op threads")
    args = p.parse_args()
    small = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v < 1]
    if small:
        p.error(f"{', '.join(small)}: give 1 or more")
    args.last = min(args.last, args.new_tokens)  # (it said "last 32 steps" of 16)
    torch.set_num_threads(args.threads)
    config = config_from_dict({
        "model_type": "mistral", "vocab_size": args.vocab, "hidden_size": 64,
        "intermediate_size": 176, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 40 + args.new_tokens,
        "sliding_window": args.window, "tie_word_embeddings": False,
    })
    mesh = Mesh.from_env(1, 1, 1)
    model = build_stage(config, mesh, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 41, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def grow(trim: bool):
        """(new ids per row, cache bytes at the end, seconds of each decode step)."""
        caches: list = []
        steps: list[float] = []
        real_cache, real_logits, real_trims = gen.kv_cache, gen.last_logits, kv.KVCache.trims

        @contextlib.contextmanager
        def kept(*a):
            with real_cache(*a) as made:
                caches.extend(made)
                yield made

        def timed_logits(*a):
            start = time.process_time()
            out = real_logits(*a)
            steps.append(time.process_time() - start)
            return out

        gen.kv_cache, gen.last_logits = kept, timed_logits
        if not trim:
            kv.KVCache.trims = property(lambda self: False)  # type: ignore[method-assign]
        try:
            out = gen.generate_batch(model, mesh, prompts, args.new_tokens,
                                     gen.Sampling(temperature=0),
                                     [torch.Generator() for _ in prompts], config.hidden_size,
                                     config.vocab_size, config.max_positions, None)
        finally:
            gen.kv_cache, gen.last_logits, kv.KVCache.trims = real_cache, real_logits, real_trims
        size = sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v))
        shapes = sorted({tuple(c.k.shape) for c in caches})
        return [r.new_ids for r in out], size, steps[1:], shapes  # steps[0]: the prefill

    grow(True)  # warm-up
    runs = common.interleave({"trimmed": lambda: grow(True),
                              "every position": lambda: grow(False)},
                             args.rounds, alternate=True)
    same = all(a[0] == b[0] for a, b in zip(runs["trimmed"], runs["every position"],
                                            strict=True))
    print(f"tiny Mistral (vocabulary {args.vocab:,}), window {args.window}, {args.prompts} "
          f"prompts of {lengths} tokens + {args.new_tokens} new, fp32 on {mesh.device.type}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    medians: dict[str, list[float]] = {}
    lates: dict[str, list[float]] = {}
    for name, rounds in runs.items():
        _, size, _, shapes = rounds[0]
        medians[name] = [statistics.median(r[2]) for r in rounds]
        lates[name] = [statistics.median(r[2][-args.last:]) for r in rounds]
        print(f"{name}: caches {size:,} bytes (keys of each layer {shapes}); decode step "
              f"median {statistics.median(medians[name]) * 1e3:.3f} ms, last {args.last} steps "
              f"{statistics.median(lates[name]) * 1e3:.3f} ms")
    bytes_ratio = runs["every position"][0][1] / runs["trimmed"][0][1]
    step = common.pair_ratios(medians["every position"], medians["trimmed"])
    late = common.pair_ratios(lates["every position"], lates["trimmed"])
    print(f"every position / trimmed: bytes {bytes_ratio:.2f}x; decode step "
          f"{common.ratio_summary(step)}x, last {args.last} steps {common.ratio_summary(late)}x; "
          f"the same tokens both ways: {same}")

if __name__ == "__main__":
    main()
