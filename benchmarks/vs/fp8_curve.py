"""The main job's loss curve under --fp8 against bf16, beside bf16's own run-to-run noise.

The main job (`megapar-train` with no flags: GPT-2 of 4 layers, hidden 64, the GPT-2 BPE, 300
steps on the shipped Shakespeare sample, validation every 100 steps) runs three times, one
after the other, with `--precision bf16`: with the default seed, with another seed (other
initial weights and data order: bf16's run-to-run noise), and with `--fp8 tensorwise
--fp8-layers all` and the default seed (every block linear in float8: the main job's layers are
far below torchao's size rule, so `auto` would convert none). Printed: the training loss of
every `--every`-th step of the three runs, the validation losses, and the final difference
fp8 - bf16 against the difference of the two bf16 runs, for the validation loss and for the mean
training loss of the last `--every` steps (a single step's loss moves with its batch). The
per-step losses of the second bf16 run come from other batches: only the means and the
validation losses compare across seeds.

    python benchmarks/vs/fp8_curve.py                      # on a GPU with FP8 (sm 8.9+)
    python benchmarks/vs/fp8_curve.py --device cpu --tiny  # a rehearsal (float8 emulated)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import output_file, read_jsonl, write_json, positive  # noqa: E402

SEED, OTHER_SEED = 1234, 4321
TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "4"]
"""--tiny: the main job's model at a size 2 CPU cores run in seconds a step."""


def runs(fp8: str) -> dict[str, list[str]]:
    """Each run's flags beside the main job's own."""
    return {"bf16": ["--seed", str(SEED)],
            f"bf16 seed {OTHER_SEED}": ["--seed", str(OTHER_SEED)],
            f"fp8 {fp8}": ["--seed", str(SEED), "--fp8", fp8, "--fp8-layers", "all"]}


def train(flags: list[str], args, where: str) -> dict:
    """One run of the main job with `flags`: its per-step records and its wall time."""
    log = os.path.join(where, f"log{len(os.listdir(where))}.jsonl")
    cmd = [sys.executable, "-m", "megapar.cli.train", "--precision", "bf16", "--no-progress",
           "--log-json", log, *flags]
    if args.steps is not None:
        cmd += ["--max-steps", str(args.steps)]
    if args.tiny:
        cmd += TINY + ["--eval-interval", str(max(1, (args.steps or 300) // 2))]
    if args.device == "cpu":
        cmd += ["--fp8-emulate"] if "--fp8" in flags else []
    env = {**os.environ, "MEGAPAR_CPU": "1" if args.device == "cpu" else "0"}
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True,
                         timeout=args.timeout)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"fp8_curve: {' '.join(cmd[2:])} failed ({run.returncode}):\n"
                         f"{(run.stdout + run.stderr)[-3000:]}")
    records = read_jsonl(log)
    fp8_line = [line for line in (run.stdout + run.stderr).splitlines() if "fp8 " in line]
    return {"flags": flags, "wall_s": wall, "records": records,
            "fp8_layers": fp8_line[0].strip() if fp8_line else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive, default=None,
                        help="--max-steps of every run (default: the main job's 300)")
    parser.add_argument("--every", type=int, default=25, help="print every N-th step")
    parser.add_argument("--fp8", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny batches (a rehearsal)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--json", type=output_file, help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda":  # else megapar-train would run the bf16 runs on the CPU
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device visible (--device cpu --tiny rehearses "
                         "this script on the CPU)")
    with tempfile.TemporaryDirectory(prefix="fp8-curve-") as where:
        results = {}
        for name, flags in runs(args.fp8).items():
            results[name] = train(flags, args, where)
            print(f"  {name}: {results[name]['wall_s']:.1f} s", flush=True)
    names = list(results)
    losses = {n: {r["step"]: r["loss"] for r in results[n]["records"]} for n in names}
    vals = {n: {r["step"]: r["val_loss"] for r in results[n]["records"] if "val_loss" in r}
            for n in names}
    last = max(losses[names[0]])
    print(f"fp8_curve: the main job in bf16 and with --fp8 {args.fp8} --fp8-layers all, "
          f"{last} steps{' (tiny batches)' if args.tiny else ''}, on "
          f"{'the CPU (float8 emulated)' if args.device == 'cpu' else args.device}")
    if results[names[2]]["fp8_layers"]:
        print(f"  {results[names[2]]['fp8_layers']}")
    print(f"  {'step':>5} " + " ".join(f"{n:>16}" for n in names) + f" {'fp8 - bf16':>11}")
    steps = sorted({s for s in losses[names[0]] if s % args.every == 0} | {1, last})
    for s in steps:
        row = [losses[n].get(s) for n in names]
        diff = row[2] - row[0] if None not in (row[0], row[2]) else None
        print(f"  {s:>5} " + " ".join(f"{x:16.4f}" if x is not None else f"{'-':>16}"
                                     for x in row) + (f" {diff:+11.4f}" if diff is not None
                                                       else ""))
    window = range(last - args.every + 1, last + 1)
    mean = {n: statistics.fmean(losses[n][s] for s in window if s in losses[n]) for n in names}
    final_val = {n: vals[n][max(vals[n])] if vals[n] else None for n in names}
    summary = {"mean_loss_last_steps": mean, "final_val_loss": final_val}
    for what, figure in (("mean training loss of the last steps", mean),
                         ("final validation loss", final_val)):
        if None in figure.values():
            continue
        fp8_gap = figure[names[2]] - figure[names[0]]
        noise = figure[names[1]] - figure[names[0]]
        summary[what] = {"fp8_minus_bf16": fp8_gap, "bf16_noise": noise}
        print(f"  {what}: bf16 {figure[names[0]]:.4f}, bf16 seed {OTHER_SEED} "
              f"{figure[names[1]]:.4f}, fp8 {figure[names[2]]:.4f}: fp8 - bf16 {fp8_gap:+.4f} "
              f"against bf16's run-to-run {noise:+.4f}"
              + (f" ({abs(fp8_gap) / abs(noise):.2f} x)" if noise else ""))
    for n in names:
        rates = [r["tokens_per_s"] for r in results[n]["records"][-args.every:]]
        print(f"  {n}: {results[n]['wall_s']:.1f} s the whole command, "
              f"{statistics.median(rates):,.0f} tokens/s (median of the last steps)")
    if args.json:
        write_json(args.json, {"steps": last, "fp8": args.fp8, "tiny": args.tiny,
                               "device": args.device, "runs": {
                                   n: {"flags": results[n]["flags"], "wall_s": results[n]["wall_s"],
                                       "losses": [losses[n][s] for s in sorted(losses[n])],
                                       "val_losses": vals[n], "fp8_layers":
                                       results[n]["fp8_layers"]} for n in names},
                               "summary": summary, "every": args.every})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
