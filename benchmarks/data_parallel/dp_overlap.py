"""Data-parallel gradient sync: bucketed + overlapped (GradBuckets) vs naive all-reduces.

Runs a GPT-2 stage on dp local ranks (gloo, CPU by default) and times one step of m micro-batches
three ways: GradBuckets (async, launched during the last backward), one blocking all-reduce per
parameter after the backward, and one flat blocking all-reduce after the backward (its result
copied back into the gradients, as a real flat reduction must). The variants and the compute
alone take turns, round after round (odd rounds in reverse order, `common.interleave`), so a
changing load hits them alike; each round times --steps steps of each. Prints each variant's
all-reduces per step (counted, `megapar.comm_count`) and its sync cost over the compute alone of
the same round: median [min, max] over the rounds. Usage:

    python benchmarks/data_parallel/dp_overlap.py [--dp 2] [--hidden 256] [--layers 4]
        [--bucket-mb 1] [--steps 5] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import interleave, positive  # noqa: E402


def _bench(args) -> dict:
    from megapar.comm_count import count_collectives
    from megapar.data_parallel import GradBuckets
    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config
    from megapar.pipeline.partition import build_stage

    mesh = Mesh(Layout(1, 1, args.dp), dist.get_rank())
    cfg = GPT2Config(vocab_size=1000, n_positions=64, n_embd=args.hidden, n_layer=args.layers,
                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = build_stage(cfg, mesh, seed=1)
    params = list(model.parameters())
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(mesh.rank))
    micro = [{"input_ids": ids, "labels": ids.roll(-1, 1)}] * args.micro_batches
    buckets = GradBuckets(params, mesh.dp_group, args.bucket_mb)

    def backward(sync=None):
        for p in params:
            p.grad = None
        if sync:
            sync.begin_step()
        for i, mb in enumerate(micro):
            if sync and i == len(micro) - 1:
                sync.before_last_backward()
            (model(None, mb) / len(micro)).backward()

    def bucketed():
        backward(buckets)
        buckets.finish()

    def per_param():
        backward()
        for p in params:
            dist.all_reduce(p.grad, group=mesh.dp_group)
            p.grad.div_(args.dp)

    def flat():
        backward()
        g = torch.cat([p.grad.reshape(-1) for p in params]).div_(args.dp)
        dist.all_reduce(g, group=mesh.dp_group)
        for p, part in zip(params, g.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p.grad))

    variants = {"compute only": backward, "flat after": flat, "per-param after": per_param,
                "bucketed+overlap": bucketed}
    out: dict = {"buckets": len(buckets.buckets), "params": len(params), "all-reduces": {}}
    for name, fn in variants.items():
        with count_collectives() as calls:
            fn()  # warm-up, counted
        out["all-reduces"][name] = sum(c.op == "all_reduce" for c in calls)

    def timed(fn):
        def run():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            dist.barrier()
            return (time.perf_counter() - start) / args.steps
        return run

    out["rounds"] = interleave({k: timed(f) for k, f in variants.items()}, args.rounds,
                               alternate=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=positive, default=2)
    parser.add_argument("--hidden", type=positive, default=256)
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--micro-batches", type=positive, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=positive, default=5, help="timed steps per variant a round")
    parser.add_argument("--rounds", type=positive, default=5, help="rounds of the variants in turn")
    args = parser.parse_args(argv)
    from megapar.launcher import run_local

    res = run_local(_bench, args.dp, args)[0]
    print(f"dp={args.dp} hidden={args.hidden} layers={args.layers} m={args.micro_batches}: "
          f"{res['params']} params, {res['buckets']} buckets of <= {args.bucket_mb} MB; "
          f"{args.rounds} rounds of {args.steps} steps each, the variants in turn")
    rounds = res["rounds"]
    base = rounds["compute only"]
    print(f"  {'compute only':18s} {statistics.median(base) * 1e3:8.1f} ms/step (median)")
    for name in ("bucketed+overlap", "per-param after", "flat after"):
        cost = [(t - b) * 1e3 for t, b in zip(rounds[name], base)]
        print(f"  {name:18s} {statistics.median(rounds[name]) * 1e3:8.1f} ms/step, sync cost "
              f"{statistics.median(cost):+7.1f} ms [{min(cost):+.1f}, {max(cost):+.1f}] over the "
              f"same round's compute; {res['all-reduces'][name]} all-reduce(s) a step")


if __name__ == "__main__":
    main()
