"""megapar-plan's CPU time against another checkout's, command by command, and whether their
outputs are byte-identical.

    python benchmarks/plan/plan_speed.py --baseline /path/to/other/checkout [--repeats 3]

Each command runs as `python -m megapar.cli.plan ARGS` in a fresh process of each tree in turn
(baseline, this tree, baseline, ...), its CPU seconds (user + sys, the OS's accounting of the
finished child) recorded; the table shows each tree's median and their ratio, and whether every
run of both printed the same bytes (stdout, stderr and exit code). Make the baseline with
`git worktree add /tmp/base <commit>`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
GPT3 = "--model gpt3-175b --global-batch-size 1536 --seq-len 2048"
COMMANDS = [
    f"{GPT3} --gpus 8 --gpu-memory-gb 80",                          # m up to 1536
    f"{GPT3} --gpus 64 --top 30",
    f"{GPT3} --gpus 1024 --gpu-memory-gb 80 --master-weights separate --top 10",
    (f"{GPT3} --gpus 1024 --master-weights separate "
     "--explain tp=8,pp=16,mbs=1,schedule=1f1b,recompute=full"),
    "--model llama-1b --gpus 16 --global-batch-size 256 --seq-len 4096 --top 5",
    "--model gpt2-1.5b --gpus 8 --gpu-memory-gb 16 --global-batch-size 64 --seq-len 1024",
]


def run(tree: Path, args: str) -> tuple[float, bytes]:
    """(CPU seconds of the child, what it printed and its exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "megapar.cli.plan", *args.split()],
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, timeout=900, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, done.stdout + b"\n--stderr--\n" + done.stderr + f"\nrc={done.returncode}".encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another megapar checkout")
    parser.add_argument("--tree", type=Path, default=HERE, help="the checkout to time (this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--commands", type=int, nargs="+", help="indices into COMMANDS")
    args = parser.parse_args()
    chosen = [COMMANDS[i] for i in args.commands] if args.commands else COMMANDS
    print(f"{'baseline s':>10} {'this s':>8} {'ratio':>6} {'same output':>11}  command")
    same_all = True
    for command in chosen:
        times: dict[str, list[float]] = {"base": [], "this": []}
        outputs = set()
        for _ in range(args.repeats):
            for name, tree in (("base", args.baseline.resolve()), ("this", args.tree.resolve())):
                cpu, out = run(tree, command)
                times[name].append(cpu)
                outputs.add(out)
        base, this = (statistics.median(times[k]) for k in ("base", "this"))
        same = len(outputs) == 1
        same_all &= same
        print(f"{base:>10.2f} {this:>8.2f} {this / base:>6.3f} {'yes' if same else 'NO':>11}  "
              f"megapar-plan {command}", flush=True)
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
