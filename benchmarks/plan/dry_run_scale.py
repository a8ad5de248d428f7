"""How long `megapar-train --dry-run` takes at the scale users plan for, and what it prints.

Each job below runs as a user would run it (`megapar-train ... --dry-run --json`, a fresh
process), timed on the wall clock and in CPU seconds (what the job costs whatever else the
machine runs); its per-rank bytes are then compared with the planner's
(`megapar.plan.state.rank_state`: weights, gradients, optimizer, parameters; equal or not).
Printed per job: the command's flags, the ranks rehearsed, the seconds, the most loaded
rehearsed rank's weights / gradients / optimizer / modelled activations in GiB, its
communication per step, and whether the planner's bytes equal the dry run's on every rank.

    python benchmarks/plan/dry_run_scale.py [--only gpt3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

JOBS = {  # name: (world size, megapar-train flags)
    "gpt3-175b 1024 interleaved": (1024, "--model gpt3-175b --tp 8 --pp 16 --schedule "
                                   "interleaved --virtual-stages 2 --seq-len 2048 "
                                   "--micro-batch-size 1 --global-batch-size 1536 "
                                   "--precision bf16 --recompute full --zero 1"),
    "gpt3-175b 1024 1f1b": (1024, "--model gpt3-175b --tp 8 --pp 16 --schedule 1f1b "
                            "--seq-len 2048 --micro-batch-size 1 --global-batch-size 1536 "
                            "--precision bf16 --recompute full --zero 1"),
    "llama-70b 64": (64, "--model llama-70b --tp 8 --pp 8 --seq-len 8192 --micro-batch-size 1 "
                     "--global-batch-size 128 --precision bf16 --recompute full"),
    "llama-70b 256": (256, "--model llama-70b --tp 8 --pp 4 --seq-len 8192 "
                      "--micro-batch-size 1 --global-batch-size 512 --precision bf16 "
                      "--recompute selective --sequence-parallel --zero 1"),
    "llama-8b 8": (8, "--model llama-8b --tp 2 --pp 2 --schedule zb-h1 --seq-len 8192 "
                   "--micro-batch-size 1 --global-batch-size 32 --precision bf16 --zero 1"),
    "gpt2-1.5b 16": (16, "--model gpt2-1.5b --tp 1 --pp 4 --seq-len 1024 --micro-batch-size 4 "
                     "--global-batch-size 512 --precision bf16 --zero 1"),
    "bert-large 8": (8, "--model bert-large --tp 2 --pp 2 --seq-len 512 --micro-batch-size 8 "
                     "--global-batch-size 256 --precision bf16"),
}


def run_job(world: int, flags: str) -> tuple[float, float, list[dict]]:
    """(wall seconds, CPU seconds, the JSON rows) of one dry run in a fresh process."""
    import resource

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "megapar.cli.train", *flags.split(), "--world-size",
           str(world), "--dry-run", "--json"]
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, cpu, [json.loads(line) for line in done.stdout.splitlines()]


def planner_equal(flags: str, world: int, rows: list[dict]) -> bool:
    from megapar.dryrun.rank import zero3_casts
    from megapar.models.recipes import resolve_model
    from megapar.plan.params import StageLayout
    from megapar.plan.state import rank_state
    from megapar.training.config import parse_args

    cfg = parse_args(flags.split())
    config = resolve_model(cfg.model)
    dp = world // (cfg.tp * cfg.pp)
    for r in rows:
        layout = StageLayout.of(config, tp=cfg.tp, pp=cfg.pp, v=cfg.virtual_stages,
                                stage=r["pp_rank"], dp=dp, zero=cfg.zero,
                                bucket_mb=cfg.grad_bucket_mb, casts=zero3_casts(cfg))
        held = rank_state(layout, r["dp_rank"])
        if (held.params, held.weights, held.grads, held.optimizer) != (
                r["params"], r["weights"], r["grads"], r["optimizer"]):
            return False
    return True


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the jobs whose name contains this")
    args = parser.parse_args()
    if args.only and not any(args.only in name for name in JOBS):
        parser.error(f"--only {args.only}: no job's name contains it; the jobs: "
                     f"{', '.join(JOBS)}")
    print(f"{'job':<28} {'ranks':>5} {'wall s':>7} {'CPU s':>6}  most loaded rehearsed rank: "
          f"weights / grads / optimizer / activations (modelled) GiB; planner")
    for name, (world, flags) in JOBS.items():
        if args.only and args.only not in name:
            continue
        seconds, cpu, rows = run_job(world, flags)
        worst = max(rows, key=lambda r: r["weights"] + r["grads"] + r["optimizer"] +
                    r["activations"])
        same = planner_equal(flags, world, rows)
        print(f"{name:<28} {len(rows):>5} {seconds:>7.1f} {cpu:>6.1f}  rank {worst['rank']}: "
              f"{_gib(worst['weights'])} / {_gib(worst['grads'])} / {_gib(worst['optimizer'])}"
              f" / {_gib(worst['activations'])}; {'equal' if same else 'DIFFERENT'}")
        comm = "; ".join(f"{g} " + ", ".join(f"{v['count']} {op} {_gib(v['bytes'])} GiB"
                                            for op, v in e.items() if isinstance(v, dict))
                         for g, e in worst["comm"].items())
        print(f"{'':<28} per step: {comm}")


if __name__ == "__main__":
    main()
