"""What locating the first non-finite value costs: a good step with the kept state (what runs
always) vs without it, a step with per-module finiteness flags on the device (the design not
chosen: hooks on every step), and one localization (the failed step re-run with the checks).

One process, a tiny GPT-2 through `megapar.prepare`; the variants alternate step by step and the
median of each is printed with its ratio to the plain step, all from the same run.

    python benchmarks/faults/nonfinite_cost.py [--layers 4] [--hidden 128] [--seq 64] [--mbs 4]
                                        [--m 4] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import interleave, pair_ratios, ratio_summary, timed, positive  # noqa: E402


def main() -> None:
    import torch
    from transformers import GPT2Config

    import megapar
    from megapar.diagnostics.module_trace import ModuleTrace
    from megapar.diagnostics.nonfinite import locate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=positive, default=4)
    ap.add_argument("--hidden", type=positive, default=128)
    ap.add_argument("--seq", type=positive, default=64)
    ap.add_argument("--mbs", type=positive, default=4)
    ap.add_argument("--m", type=positive, default=4)
    ap.add_argument("--steps", type=positive, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPT2Config(vocab_size=512, n_positions=args.seq, n_embd=args.hidden,
                     n_layer=args.layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    engine = megapar.prepare(cfg, micro_batch_size=args.mbs, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (args.mbs * args.m, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    micro = engine.split(batch)
    keep = engine.rng_state

    def plain():
        engine.rng_state = dict  # {}: the only work the kept state adds to a good step
        try:
            engine.run_step(micro)
        finally:
            engine.rng_state = keep

    def kept():
        engine.run_step(micro)

    trace = ModuleTrace(engine.model, engine.config, engine.mesh)

    def flags():  # per-module flags on the device, every step (read once, at the end)
        trace.events.clear()
        with trace.attached(engine.executor):
            engine.run_step(micro)
        int(trace.first.item())

    def localize():
        locate(engine, engine.kept)

    variants = {"plain step": plain, "step + kept state (on)": kept,
                "step + device flags": flags, "localization (re-run)": localize}
    for _ in range(2):  # warm-up
        for fn in variants.values():
            fn()
    times = interleave({name: timed(fn) for name, fn in variants.items()}, args.steps)
    base = statistics.median(times["plain step"])
    print(f"GPT-2 {args.layers} layers x {args.hidden}, seq {args.seq}, {args.m} micro-batches "
          f"of {args.mbs}, one process, median of {args.steps} (x: of the medians; pair by "
          f"pair: each step against the plain step of its round, median [min, max]):")
    for name, t in times.items():
        med = statistics.median(t)
        pairs = ratio_summary(pair_ratios(t, times["plain step"]))
        print(f"  {name:26s} {med * 1e3:8.2f} ms   x{med / base:.3f}   pair by pair {pairs}")


if __name__ == "__main__":
    main()
