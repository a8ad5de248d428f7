"""How long a checkpoint save stops training: synchronous against --async-save, side by side.

Each configuration is a fresh `megapar-train` run of GPT-2 124M (short sequences, one sample
per step, so that a step is short next to writing the 1.4 GB checkpoint) saving every
`--save-interval` steps; the figures come from its --log-json records alone: each record
carries the Unix time it was written (after the step) and the step's own time, so the pause
between two steps is ``time[s+1] - step_time_s[s+1] - time[s]``. A save's *blocked* time is
the pause after the step it saved minus the median pause after the steps that saved nothing
(logging, the data, the stop check). With --async-save the background writer shares the CPU
with training, so the script also reports the *slowdown*: how much longer than the median step
the steps that ran while a write was in flight took, summed per save. And the OS peak of each
run (`ru_maxrss` of the largest process, from `wait4`): the host copy's memory.

    python benchmarks/faults/async_save.py                 # about 4 minutes on 2 cores
    python benchmarks/faults/async_save.py --repeats 2     # each configuration twice, interleaved

The final save (after the last step) is not counted: nothing trains after it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import interleave, read_jsonl, run_peak, train_argv, positive  # noqa: E402

COMMON = ["--model", "gpt2-124m", "--seq-len", "32", "--micro-batch-size", "1",
          "--global-batch-size", "1", "--warmup-steps", "0", "--eval-interval", "0",
          "--log-interval", "1", "--no-progress", "--lr-decay", "constant"]


def run(flags: list[str], workdir: str, env: dict) -> tuple[list[dict], int, str]:
    """(the --log-json records, the largest process's peak resident bytes, stdout) of one run."""
    log = os.path.join(workdir, "log.jsonl")
    save = os.path.join(workdir, "ckpt")
    done = run_peak(train_argv(*COMMON, *flags, "--save", save, "--log-json", log), env=env)
    records = read_jsonl(log)
    shutil.rmtree(save, ignore_errors=True)
    return records, done.peak_bytes, done.output


def blocked(records: list[dict], interval: int) -> dict:
    """Per save during training: the pause it caused and the slowdown of the steps after it."""
    by_step = {r["step"]: r for r in records}
    steps = sorted(by_step)
    pauses = {s: by_step[s + 1]["time"] - by_step[s + 1]["step_time_s"] - by_step[s]["time"]
              for s in steps[:-1]}
    saved = [s for s in steps[:-1] if s % interval == 0]
    quiet = [p for s, p in pauses.items() if s not in saved and s > 1]
    times = [by_step[s]["step_time_s"] for s in steps if s > 1]
    base_pause, base_step = statistics.median(quiet), statistics.median(times)
    out = []
    for s in saved:
        after = [t for t in steps if s < t <= s + interval]
        slow = sum(max(0.0, by_step[t]["step_time_s"] - base_step) for t in after)
        out.append({"step": s, "blocked_s": pauses[s] - base_pause, "slowdown_s": slow})
    return {"saves": out, "step_s": base_step, "pause_s": base_pause}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=positive, default=13)
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument("--repeats", type=positive, default=1)
    args = parser.parse_args()
    if args.save_interval < 2 or args.max_steps < args.save_interval + 2:
        parser.error(f"--max-steps {args.max_steps} / --save-interval {args.save_interval}: the "
                     f"pauses are measured against steps that saved nothing, so give an interval "
                     f">= 2 and --max-steps >= it + 2")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    flags = ["--max-steps", str(args.max_steps), "--save-interval", str(args.save_interval)]

    def measure(extra: list[str]) -> dict:
        with tempfile.TemporaryDirectory(prefix="megapar-async-save-") as workdir:
            records, peak, _ = run([*flags, *extra], workdir, env)
        stats = blocked(records, args.save_interval)
        stats["peak_gib"] = peak / 2**30
        return stats

    results = interleave({"synchronous": lambda: measure([]),
                          "--async-save": lambda: measure(["--async-save"])}, args.repeats)
    print(f"GPT-2 124M, seq 32, 1 sample per step, a save every {args.save_interval} steps "
          f"({args.max_steps} steps; the final save not counted)")
    print(f"{'save':<13} {'step s':>7} {'blocked s per save':>28} {'mean':>6} "
          f"{'slowdown s':>22} {'OS peak GiB':>12}")
    for name, runs in results.items():
        for stats in runs:
            b = [x["blocked_s"] for x in stats["saves"]]
            slow = [x["slowdown_s"] for x in stats["saves"]]
            print(f"{name:<13} {stats['step_s']:>7.3f} {' '.join(f'{x:6.3f}' for x in b):>28} "
                  f"{statistics.mean(b):>6.3f} {' '.join(f'{x:6.3f}' for x in slow):>22} "
                  f"{stats['peak_gib']:>12.2f}")
    sync = statistics.mean(x["blocked_s"] for r in results["synchronous"] for x in r["saves"])
    bg = statistics.mean(x["blocked_s"] for r in results["--async-save"] for x in r["saves"])
    total = statistics.mean(x["blocked_s"] + x["slowdown_s"]
                            for r in results["--async-save"] for x in r["saves"])
    print(f"blocked by a save: --async-save {bg:.3f} s, synchronous {sync:.3f} s: "
          f"ratio {bg / sync:.3f}; --async-save blocked + slowdown {total:.3f} s "
          f"({total / sync:.3f} of the synchronous pause)")


if __name__ == "__main__":
    main()
