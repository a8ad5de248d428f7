"""What always-on tracing costs: the same pipeline step with the executor's tracing on and off.

    python benchmarks/pipeline/tracing_overhead.py [--pp 2] [--m 8] [--schedule 1f1b] [--reps 40]
                                          [--hidden 512] [--seq-len 64] [--micro-batch-size 4]

Runs the bubble benchmark model (`bubble.bench_config`, --hidden overrides its width; a small
width makes actions short and the relative overhead larger) on pp local processes. Steps are
interleaved in ABBA blocks (on, off, off, on), with a barrier and a garbage collection before
each step. Prints the median step time of each, the overhead as the median over blocks of the
block's on/off time ratio (adjacent steps share the machine's load, so this pairs away drift and
other jobs' bursts better than the ratio of medians), and a noise-free estimate: the cost of the
tracing work itself (about one clock read stored in a list per action, timed in a loop) times the
actions per step, over the step time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


def _worker(pp, m, schedule, reps, hidden, seq_len, mbs):
    import torch.distributed as dist

    from megapar.mesh import Mesh
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.bubble import bench_config
    from megapar.pipeline.partition import build_stage

    config = bench_config(None, pp)
    if hidden:
        config.n_embd = hidden
    mesh = Mesh.from_env(1, pp, 1)
    model = build_stage(config, mesh, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, config.vocab_size, (mbs, seq_len + 1), generator=gen)
           for _ in range(m)]
    micro = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in ids]
    executor = PipelineExecutor(model, mesh, schedule, (mbs, seq_len, config.hidden_size))
    times = {True: [], False: []}
    actions = 0
    for rep in range(4 * reps + 4):  # the first ABBA block warms up
        executor.trace = rep % 4 in (0, 3)
        model.zero_grad(set_to_none=True)
        gc.collect()
        if mesh.pp_group is not None:
            dist.barrier(group=mesh.pp_group)
        start = time.perf_counter()
        executor.run(micro)
        elapsed = time.perf_counter() - start
        if rep >= 4:
            times[executor.trace].append(elapsed)
        if executor.trace:
            actions = max(actions, len(executor.last_timeline.events))
    on, off = times[True], times[False]
    blocks = [(on[i] + on[i + 1]) / (off[i] + off[i + 1]) for i in range(0, len(on), 2)]
    return {"on": statistics.median(on), "off": statistics.median(off),
            "ratio": statistics.median(blocks), "actions": actions}


def per_action_cost_s(n: int = 200_000) -> float:
    """Seconds the tracer adds per action: about one stamp (a perf_counter read stored at its
    index in a list sized beforehand: one where an event ends and the next starts,
    `executor.trace_events`), and the check of whether the step is traced."""
    clock, stamps, record = time.perf_counter, [None] * n, True
    start = clock()
    for i in range(n):
        if record:
            stamps[i] = clock()
    return (clock() - start) / n


def main(argv=None) -> int:
    from megapar.launcher import run_local

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=positive, default=2)
    p.add_argument("--m", type=positive, default=8)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--reps", type=positive, default=40, help="ABBA blocks (2 steps on, 2 off each)")
    p.add_argument("--hidden", type=positive, help="model width (default: the bubble bench model's)")
    p.add_argument("--seq-len", type=positive, default=64)
    p.add_argument("--micro-batch-size", type=positive, default=4)
    args = p.parse_args(argv)
    results = run_local(_worker, args.pp, args.pp, args.m, args.schedule, args.reps, args.hidden,
                        args.seq_len, args.micro_batch_size, timeout_s=3600)
    on, off, ratio = (statistics.median(r[k] for r in results) for k in ("on", "off", "ratio"))
    actions = max(r["actions"] for r in results)  # per stage, incl. wait and loss broadcast
    cost = per_action_cost_s()
    print(f"pp={args.pp} m={args.m} {args.schedule}, median over ranks of the median of "
          f"{2 * args.reps} steps each")
    print(f"tracing on : {1e3 * on:9.3f} ms/step")
    print(f"tracing off: {1e3 * off:9.3f} ms/step")
    print(f"overhead   : on/off = {ratio:.4f} ({100 * (ratio - 1):+.2f}%, median of per-block "
          f"ratios; ratio of medians {on / off:.4f}; a negative value means below the noise)")
    print(f"estimate   : {actions} traced actions/stage x {1e9 * cost:.0f} ns = "
          f"{1e6 * actions * cost:.1f} us/step = {100 * actions * cost / off:.4f}% of the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
