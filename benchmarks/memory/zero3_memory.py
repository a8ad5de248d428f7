"""--zero 3 at the peak the OS sees, and its step time, side by side with --zero 0 and --zero 1.

Every configuration is a fresh `megapar-train` run (GPT-2 124M, seq 64, micro-batch 1, 3 steps,
no data: the model's own synthetic batches); the figure is the largest process's peak resident
set (`ru_maxrss` from `wait4`: every worker is a child of the launcher), with megapar's host
allocator policy (the default) and with glibc's own (`MEGAPAR_HOST_MALLOC=system`). Beside it,
the bytes of parameters, gradients and Adam state a rank holds between steps, counted: 16 P
at --zero 0, (4 + 4 + 8 / dp) P at --zero 1, 16 P / dp at --zero 3 (P the rank's parameters),
and the median step time of steps 2-3 from the run's --log-json.

    python benchmarks/memory/zero3_memory.py               # dp 2 (the issue's command), ~3 minutes
    python benchmarks/memory/zero3_memory.py --groups pp   # pp 2 x dp 2, m 4: freed per micro-batch vs
                                                    # --zero3-keep-params
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import read_jsonl, run_peak, scratch_dir, train_argv  # noqa: E402

PARAMS = 124_475_904  # GPT-2 124M as megapar allocates it (vocabulary padded to 50,304)
BASE = ["--model", "gpt2-124m", "--seq-len", "64", "--micro-batch-size", "1", "--max-steps", "3",
        "--warmup-steps", "0", "--eval-interval", "0", "--no-progress", "--log-interval", "1"]
GROUPS = {
    "dp": [(f"zero {z}", ["--dp", "2", "--global-batch-size", "2", "--zero", str(z)], z, 2, 1)
           for z in (0, 1, 3)],
    "pp": [("zero 0", ["--pp", "2", "--dp", "2", "--global-batch-size", "8"], 0, 2, 2),
           ("zero 3", ["--pp", "2", "--dp", "2", "--global-batch-size", "8", "--zero", "3"],
            3, 2, 2),
           ("zero 3 kept", ["--pp", "2", "--dp", "2", "--global-batch-size", "8", "--zero", "3",
                            "--zero3-keep-params"], 3, 2, 2)],
}


def held(zero: int, dp: int, pp: int) -> float:
    """Bytes held between steps by one rank (the parameters split evenly over pp)."""
    p = PARAMS / pp
    return {0: 16 * p, 1: (8 + 8 / dp) * p, 3: 16 * p / dp}[zero]


def run(flags: list[str], env: dict, log: str) -> tuple[int, float]:
    """(the largest process's peak resident bytes, median step seconds after the first)."""
    done = run_peak(train_argv(*BASE, *flags, "--log-json", log), env=env, capture="stderr")
    records = read_jsonl(log)
    times = [r["step_time_s"] for r in records[1:] if "step_time_s" in r]
    return done.peak_bytes, statistics.median(times) if times else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", nargs="+", default=["dp"], choices=list(GROUPS))
    args = parser.parse_args(argv)
    work = scratch_dir("megapar-zero3-")
    env = {**os.environ, "MEGAPAR_CPU": "1"}
    g = 2**30
    for group in args.groups:
        print(f"\n{group}: {'configuration':12} {'held':>7} {'OS peak':>8} {'glibc':>7} "
              f"{'x zero 0':>9} {'step s':>7}  (GiB)")
        first = None
        for label, flags, zero, dp, pp in GROUPS[group]:
            peak, step = run(flags, env, os.path.join(work, "log.jsonl"))
            glibc, _ = run(flags, {**env, "MEGAPAR_HOST_MALLOC": "system"},
                           os.path.join(work, "log2.jsonl"))
            first = first or peak
            print(f"    {label:14} {held(zero, dp, pp) / g:7.3f} {peak / g:8.3f} {glibc / g:7.3f} "
                  f"{peak / first:9.2f} {step:7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
