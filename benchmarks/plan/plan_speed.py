"""megapar-plan's CPU time against another checkout's, command by command, and whether their
outputs are byte-identical.

    python benchmarks/plan/plan_speed.py --baseline /path/to/other/checkout [--repeats 3]
    python benchmarks/plan/plan_speed.py --baseline ... --set search --repeats 1

`--set search` runs the searches that try ep, etp and cp's attentions (mixtral-8x7b, qwen3-30b-a3b,
llama-8b at 8,192 and 32,768 tokens), with and without fixed choices (--zero-stages,
--expert-tensor-parallel-size, --cp-comm-type, --today, --json), and the small presets on 8 GPUs
(GPT-2, fp8, CPU figures, mixtral-tiny, qwen3-moe-tiny), for a change that must print the same.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

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
MIXTRAL = "--model mixtral-8x7b --gpus 64 --global-batch-size 256 --seq-len 4096"
LLAMA = "--model llama-8b --gpus 64 --global-batch-size 256"
SEARCH = [  # `--set search`: the searches with ep, etp and cp's attentions, and fixed choices
    MIXTRAL,
    f"{MIXTRAL} --json --top 3000",
    f"{MIXTRAL} --zero-stages 3",
    f"{MIXTRAL} --expert-tensor-parallel-size 1 --target cpu",
    f"{MIXTRAL} --today --top 40",
    "--model mixtral-8x7b --gpus 16 --global-batch-size 64 --seq-len 8192 --cp-sizes 1 2 "
    "--cp-comm-type a2a",
    "--model qwen3-30b-a3b --gpus 32 --global-batch-size 256 --seq-len 4096 --zero-stages 1 3 "
    "--offload none optimizer both",
    f"{LLAMA} --seq-len 8192",
    "--model llama-8b --gpus 64 --global-batch-size 64 --seq-len 32768 --json --top 1000",
    f"{LLAMA} --seq-len 8192 --cp-comm-type a2a --zero-stages 1 --master-weights separate",
    "--model llama-8b --gpus 8 --gpu-memory-gb 24 --global-batch-size 64 --seq-len 4096",
    "--model gpt2-124m --gpus 8 --global-batch-size 64 --seq-len 1024",
    "--model gpt2-1.5b --gpus 8 --gpu-memory-gb 16 --global-batch-size 64 --seq-len 1024 --json "
    "--top 2000",
    "--model gpt2-1.5b --gpus 8 --global-batch-size 64 --seq-len 1024 --fp8 tensorwise "
    "--zero-stages 3",
    "--model gpt2-350m --gpus 8 --global-batch-size 32 --seq-len 1024 --target cpu "
    "--sp-regather --no-fused-attention",
    "--model gpt2-774m --gpus 8 --global-batch-size 32 --seq-len 1024 --precision fp32 "
    "--loss-chunk-tokens 0 --fp8 rowwise",
    "--model mixtral-tiny --gpus 8 --global-batch-size 16 --seq-len 256 --target cpu --json "
    "--top 5000",
    "--model qwen3-moe-tiny --gpus 8 --global-batch-size 16 --seq-len 256 --offload none "
    "optimizer both",
    f"{MIXTRAL} --explain tp=4,pp=4,dp=4,etp=4,mbs=2,schedule=zb-v,v=2,recompute=none,sp=1,"
    "zero=3,keep_params=1",
]
SETS = {"speed": COMMANDS, "search": SEARCH}


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another megapar checkout")
    parser.add_argument("--tree", type=Path, default=HERE, help="the checkout to time (this one)")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--set", choices=SETS, default="speed",
                        help="speed: the commands timed in docs/performance.md; search: the "
                             "searches with ep, etp and cp attentions and fixed choices")
    parser.add_argument("--commands", type=int, nargs="+", help="indices into the set")
    args = parser.parse_args()
    for flag, tree in (("--baseline", args.baseline), ("--tree", args.tree)):
        if not (tree / "megapar").is_dir():
            parser.error(f"{flag} {tree}: not a megapar checkout (no megapar/ in it); make one "
                         f"with git worktree add /tmp/base <commit>")
    commands = SETS[args.set]
    chosen = [commands[i] for i in args.commands] if args.commands else commands
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
