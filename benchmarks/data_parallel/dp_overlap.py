"""Data-parallel gradient sync: bucketed + overlapped (GradBuckets) vs naive all-reduces.

Runs a GPT-2 stage on dp local ranks (gloo, CPU by default) and times one step of m micro-batches
three ways: GradBuckets (async, launched during the last backward), one blocking all-reduce per
parameter after the backward, and one flat blocking all-reduce after the backward. Also counts
the all-reduces of each. Usage:

    python benchmarks/data_parallel/dp_overlap.py [--dp 2] [--hidden 256] [--layers 4] [--bucket-mb 1] [--steps 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


def _bench(args) -> dict:
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

    out = {"buckets": len(buckets.buckets), "params": len(params)}
    for name, fn in (("compute only", backward), ("flat after", flat),
                     ("per-param after", per_param), ("bucketed+overlap", bucketed)):
        fn()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            fn()
        dist.barrier()
        out[name] = (time.perf_counter() - start) / args.steps
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    from megapar.launcher import run_local

    res = run_local(_bench, args.dp, args)[0]
    print(f"dp={args.dp} hidden={args.hidden} layers={args.layers} m={args.micro_batches}: "
          f"{res['params']} params, {res['buckets']} buckets of <= {args.bucket_mb} MB")
    for name in ("compute only", "bucketed+overlap", "per-param after", "flat after"):
        extra = res[name] - res["compute only"]
        print(f"  {name:18s} {res[name] * 1e3:8.1f} ms/step  (sync cost {extra * 1e3:+7.1f} ms)")


if __name__ == "__main__":
    main()
