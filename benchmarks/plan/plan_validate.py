"""megapar-plan's predictions against real runs of a small GPT-2 on CPU.

For each layout, forked gloo ranks (megapar.launcher.run_local) run real optimizer steps of the
real trainer pieces (build_stage, PipelineExecutor, AdamW / ZeRO-1, bucketed dp all-reduce) and
measure on every rank:

- parameters, gradients and optimizer state: the bytes of the tensors themselves after a step;
- activations: the peak, over the step, of the distinct tensor storages held for backward
  (`megapar.dryrun.measure.HeldStorages`: everything autograd saved, each storage counted once
  while any saved reference to it is alive, and the inputs of checkpointed regions) plus the
  executor's in-flight inputs and outputs, sampled after every schedule action;
- the step time (median of the measured steps).

Predicted = `megapar.plan.stage_memory` for the same layout (fp32, fused attention: PyTorch's
CPU scaled_dot_product_attention keeps no a*s^2 scores; no dropout). Printed per pipeline stage
(the max over its tp / dp ranks), with the error, and the step-time ratio of each layout to
1x1x1 measured vs predicted.

    python benchmarks/plan/plan_validate.py [--steps 3] [--hidden 128 --layers 4 --seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megapar.dryrun.measure import HeldStorages, peak_held
from megapar.dryrun.world import held_bytes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

LAYOUTS = [  # (tp, pp, dp, schedule, zero)
    (1, 1, 1, "1f1b", 0),
    (2, 1, 1, "1f1b", 0),
    (1, 2, 1, "1f1b", 0),
    (1, 2, 1, "gpipe", 0),
    (1, 1, 2, "1f1b", 1),
    (2, 2, 1, "1f1b", 0),
    (1, 2, 2, "1f1b", 1),
]


def _worker(config_dict, layout, schedule, zero, mbs, seq, global_batch, steps):
    from megapar.data_parallel import build_grad_sync
    from megapar.mesh import Mesh
    from megapar.models.config import config_from_dict
    from megapar.optim import LRScheduler, Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage
    from megapar.training.step import BatchPlan, TrainStep

    tp, pp, dp = layout
    config = config_from_dict(config_dict)
    mesh = Mesh.from_env(tp, pp, dp)
    model = build_stage(config, mesh, seed=0)
    executor = PipelineExecutor(model, mesh, schedule, (mbs, seq, config.hidden_size),
                                trace=False)
    executor.post_ahead = False  # the program as NCCL runs it: what the planner models
    optimizer = build_optimizer(model, mesh, 1e-3, 0.1, zero=zero)
    grad_sync = build_grad_sync(model, mesh, zero) if dp > 1 else None
    step = TrainStep(model, mesh, executor, optimizer, LRScheduler(1e-3, 1e-4, 0, 100, "constant"),
                     Precision("fp32", mesh.device), 1.0, grad_sync)
    plan = BatchPlan(global_batch, mbs, dp)
    gen = torch.Generator().manual_seed(0)
    held = HeldStorages(model.parameters())
    times = []
    with peak_held(executor, held) as peak:
        for i in range(steps + 1):  # step 0 creates the optimizer state and warms up
            ids = torch.randint(0, config.vocab_size, (global_batch, seq + 1), generator=gen)
            micro = plan.split({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, mesh.dp_rank)
            peak[0] = 0
            start = time.perf_counter()
            with held.counting():
                step.step(micro, i)
            if i:
                times.append(time.perf_counter() - start)
    state = held_bytes(model, optimizer)  # Adam's step counters too: the plan counts them
    return {"stage": mesh.pp_rank, "params": state["weights"], "grads": state["grads"],
            "optimizer": state["optimizer"], "activations": peak[0],
            "step_s": statistics.median(times)}


def _comm_probe(sizes):
    """Median seconds of a gloo all-reduce between two ranks for each float32 size."""
    import torch.distributed as dist

    out = []
    for n in sizes:
        t = torch.zeros(n)
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def calibrate():
    """This machine as the planner sees it: message latency and bandwidth from a 2-rank gloo
    all-reduce (small and 4 MiB), compute rate from the 1x1x1 step."""
    from megapar.launcher import run_local

    small, big = run_local(_comm_probe, 2, [1, 2**20])[0]
    # a 2-rank ring all-reduce is 2 messages of n/2 elements each
    latency_us = small / 2 * 1e6
    gbps = 2**20 * 4 * 8 / ((big - small) * 1e9)
    return latency_us, gbps


def main() -> None:
    from megapar.launcher import run_local
    from megapar.models import GPT2Config
    from megapar.plan import Candidate, Problem, stage_memory
    from megapar.plan.estimate import estimate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive, default=4, help="blocks (default %(default)s)")
    parser.add_argument("--hidden", type=positive, default=128,
        help="hidden size (default %(default)s)")
    parser.add_argument("--heads", type=positive, default=4,
        help="attention heads (default %(default)s)")
    parser.add_argument("--seq", type=positive, default=64,
        help="sequence length (default %(default)s)")
    parser.add_argument("--vocab", type=positive, default=1000,
        help="vocabulary size (default %(default)s)")
    parser.add_argument("--mbs", type=positive, default=4, help="micro-batch size")
    parser.add_argument("--global-batch", type=positive, default=16,
        help="sequences per step (default %(default)s)")
    parser.add_argument("--steps", type=positive, default=5, help="measured steps (median)")
    args = parser.parse_args()
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}, seq {args.seq}, micro-batch {args.mbs}, global batch "
          f"{args.global_batch}, fp32, AdamW; memory in MiB (params + grads + optimizer + "
          f"peak activations), most loaded rank of each stage")
    print(f"{'layout':<28} {'stage':>5} {'pred MiB':>9} {'meas MiB':>9} {'err':>7}   "
          f"{'pred act':>8} {'meas act':>8} {'err':>7}")
    import os

    latency_us, gbps = calibrate()
    cores = len(os.sched_getaffinity(0))
    rate = None   # TFLOP/s one rank reaches alone, from the 1x1x1 step
    worst, ref = 0.0, None
    rows = []
    for tp, pp, dp, schedule, zero in LAYOUTS:
        world = tp * pp * dp

        def problem_at(tflops):
            return Problem(config, world, world, 1e6, args.global_batch, args.seq, "fp32",
                           "fp32", True, tflops, 1.0, gbps, gbps, latency_us)

        problem = problem_at(rate * min(1.0, cores / world) if rate else 1.0)
        cand = Candidate(tp, pp, dp, args.mbs, schedule, 1, "none", False, zero)
        predicted = stage_memory(problem, cand)
        results = run_local(_worker, tp * pp * dp, config.to_dict(), (tp, pp, dp), schedule,
                            zero, args.mbs, args.seq, args.global_batch, args.steps,
                            timeout_s=600)
        label = f"tp{tp} pp{pp} dp{dp} {schedule}" + (" zero1" if zero else "")
        for stage in range(pp):
            ranks = [r for r in results if r["stage"] == stage]
            meas = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"] +
                       r["activations"])
            total = meas["params"] + meas["grads"] + meas["optimizer"] + meas["activations"]
            pred = predicted[stage]
            pred_total = pred.params + pred.grads + pred.optimizer + pred.activations
            err = pred_total / total - 1
            act_err = pred.activations / meas["activations"] - 1
            worst = max(worst, abs(err))
            print(f"{label:<28} {stage:>5} {pred_total / 2**20:>9.2f} {total / 2**20:>9.2f} "
                  f"{100 * err:>+6.1f}%   {pred.activations / 2**20:>8.2f} "
                  f"{meas['activations'] / 2**20:>8.2f} {100 * act_err:>+6.1f}%")
        step = max(r["step_s"] for r in results)
        if rate is None:  # calibrate on 1x1x1: its predicted compute at 1 TFLOP/s / measured
            rate = estimate(problem, cand).compute_s / step
            problem = problem_at(rate)
        pred_step = estimate(problem, cand).step_s
        ref = ref or (step, pred_step)
        rows.append((label, step, pred_step))
    print(f"\nlargest memory error: {100 * worst:.1f} %")
    print(f"\n{'layout':<28} {'measured s':>10} {'predicted s':>11} {'meas / 1x1x1':>12} "
          f"{'pred / 1x1x1':>12}")
    for label, meas, pred in rows:
        print(f"{label:<28} {meas:>10.3f} {pred:>11.3f} {meas / ref[0]:>12.2f} "
              f"{pred / ref[1]:>12.2f}")
    print(f"(calibration: gloo latency {latency_us:.0f} us per message, {gbps:.1f} Gbit/s, "
          f"{1e3 * rate:.2f} GFLOP/s per rank alone, divided by ranks / {cores} cores when "
          f"ranks outnumber cores)")


if __name__ == "__main__":
    main()
