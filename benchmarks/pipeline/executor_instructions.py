"""The pipeline executor's host work per step counted in machine instructions, not seconds.

`executor_plan.py` times whole steps in thread CPU time; on a machine shared with other jobs that
time moves by a third between minutes. This script counts instead the instructions one stage's
step executes (valgrind's callgrind, `Ir`), the same measure under any load: each (layout,
stage, executor module, traced or not) runs in its own `python` under callgrind, with the
instrumentation off until the executor has run two steps (its plan built, its caches warm), then
on for `--steps` steps (`callgrind_control -i on`, so the count also holds the few thousand
instructions of that control call's return and of the call that turns it off: the same for
every run). The stage is `executor_plan`'s: a model that computes nothing, autograd's calls made
no-ops, messages that complete at once, the status line shared as under the launcher; python's
string hashing fixed (PYTHONHASHSEED=0: dictionary probes depend on it). Needs valgrind.

    python benchmarks/pipeline/executor_instructions.py
    git show main:megapar/pipeline/executor.py > /tmp/executor_main.py
    python benchmarks/pipeline/executor_instructions.py --baseline /tmp/executor_main.py --schedules zb-v

Seconds follow from instructions only roughly (about 7-8 instructions a nanosecond for this
interpreter-bound code on the machine of docs/performance.md); compare counts, not clocks.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

import executor_plan
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


def child(schedule: str, pp: int, m: int, v: int, stage: int, steps: int, trace: bool,
          baseline: str | None) -> None:
    """Under callgrind: `steps` steps of `stage` counted, after two that are not."""
    import torch

    from megapar.faults import status
    from megapar.pipeline import executor as executor_module
    torch.set_num_threads(1)
    module = executor_plan.load_baseline(baseline) if baseline else executor_module
    status.begin(ctypes.create_string_buffer(256))  # a worker's run over the launcher's line
    status.set_step(1000)
    executor = executor_plan._stage_executor(module, schedule, pp, m, v, stage, trace, False)
    batches = [{} for _ in range(m)]
    with executor_plan.no_autograd([module]):
        executor.run(batches)
        executor.run(batches)
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True,
                       capture_output=True)
        for _ in range(steps):
            executor.run(batches)
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True,
                       capture_output=True)


def count(schedule: str, pp: int, m: int, v: int, stage: int, steps: int, trace: bool,
          baseline: str | None) -> float:
    """Instructions per step of one run under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={os.path.join(tmp, 'out')}", sys.executable,
               os.path.abspath(__file__), "--child", schedule, str(pp), str(m), str(v),
               str(stage), str(steps), str(int(trace)), baseline or ""]
        env = dict(os.environ, PYTHONHASHSEED="0")
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        found = re.search(r"Collected : (\d+)", run.stderr)
        if run.returncode != 0 or found is None:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        return int(found.group(1)) / steps


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        schedule, pp, m, v, stage, steps, trace, baseline = argv[1:9]
        child(schedule, int(pp), int(m), int(v), int(stage), int(steps), trace == "1",
              baseline or None)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", metavar="NAME",
                        help="only the layouts of these schedules (default: all of "
                             "executor_plan.LAYOUTS)")
    parser.add_argument("--stages", nargs="+", type=int, metavar="S",
                        help="the stages counted (default: the middle one, pp // 2, which has "
                             "the most events)")
    parser.add_argument("--steps", type=positive, default=5, help="steps counted per run")
    parser.add_argument("--baseline", metavar="FILE",
                        help="an earlier executor.py, counted beside this tree's")
    args = parser.parse_args(argv)
    if args.baseline and not os.path.isfile(args.baseline):
        parser.error(f"--baseline {args.baseline}: no such file (make it: git show "
                     f"REV:megapar/pipeline/executor.py > FILE)")
    baseline = os.path.abspath(args.baseline) if args.baseline else None
    print("instructions per step (millions), traced / untraced"
          + (f"; before = {args.baseline}" if baseline else ""))
    print(f"{'schedule':12} {'pp':>3} {'m':>4} {'V':>2} {'stage':>5} | {'now':>13}"
          + (f" | {'before':>13} | now / before" if baseline else ""))
    for schedule, pp, m, v in executor_plan.LAYOUTS:
        if args.schedules is not None and schedule not in args.schedules:
            continue
        for stage in args.stages or [pp // 2]:
            cells = [[count(schedule, pp, m, v, stage, args.steps, trace, module)
                      for trace in (True, False)]
                     for module in [None] + ([baseline] if baseline else [])]
            line = " | ".join(f"{t / 1e6:5.2f} / {u / 1e6:5.2f}" for t, u in cells)
            if baseline:
                line += (f" | {cells[0][0] / cells[1][0]:.2f} / "
                         f"{cells[0][1] / cells[1][1]:.2f}")
            print(f"{schedule:12} {pp:3d} {m:4d} {v:2d} {stage:5d} | {line}", flush=True)


if __name__ == "__main__":
    main()
