"""megapar --zero 3 side by side with torch's FSDP2 (`fully_shard`) on the same GPT-2 at dp 2.

Both shard the same megapar GPT-2 model (one process per dp rank, forked gloo ranks on the CPU,
or one GPU each with MEGAPAR_CPU unset on a GPU machine): FSDP2 with `fully_shard` on each block
and on the model (its default `reshard_after_forward=True`: gathered before forward and
backward, freed after), stepped by torch's AdamW with `clip_grad_norm_`; megapar with its
ZeRO-3 units (`ShardedParams`), `Zero3Optimizer` and the pipeline executor's step. The runs
alternate step by step in the same processes (so a busy machine slows both alike), each side
first every other step; the figure is the median step time of each and their ratio, the
median and range of the step-by-step ratios, and the losses of the first steps (the same
model, data and initialisation: they agree).

    python benchmarks/vs/vs_fsdp2.py                     # 10 steps each, about a minute on 2 cores
    python benchmarks/vs/vs_fsdp2.py --steps 20 --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


def _worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megapar.data_parallel.sharded_params import ShardedParams
    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config
    from megapar.optim import LRScheduler, Precision
    from megapar.optim.zero3 import Zero3Optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(1, 1, 2), dist.get_rank())
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                     n_layer=args.layers, n_head=args.hidden // 64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen)
        batches.append({"input_ids": ids.to(mesh.device),
                        "labels": ((ids + 1) % args.vocab).to(mesh.device)})
    lr, clip = 1e-3, 1.0

    fsdp_model = build_stage(cfg, mesh, seed=1)
    device_mesh = init_device_mesh(mesh.device.type, (2,))
    for block in fsdp_model.layers.values():
        fully_shard(block, mesh=device_mesh)
    fully_shard(fsdp_model, mesh=device_mesh)
    fsdp_opt = torch.optim.AdamW(fsdp_model.parameters(), lr=lr, betas=(0.9, 0.95),
                                 weight_decay=0.0)

    ours = build_stage(cfg, mesh, seed=1)
    executor = PipelineExecutor(ours, mesh, "1f1b", (args.mbs, args.seq, args.hidden),
                                trace=False)
    optimizer = Zero3Optimizer(ours.named_parameters(), mesh.dp_group, lr, 0.0)
    sharded = ShardedParams(ours, mesh.dp_group)
    step = TrainStep(ours, mesh, executor, optimizer, LRScheduler(lr, lr, 0, 10**6, "constant"),
                     Precision("fp32", mesh.device), clip, sharded)

    def sync():
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()

    def fsdp_step(batch) -> float:
        fsdp_opt.zero_grad()
        loss = fsdp_model(None, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(fsdp_model.parameters(), clip)
        fsdp_opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        return reduced.item() / 2

    sides = {"fsdp2": fsdp_step, "megapar": lambda batch: step.step([batch], 0).loss}
    times: dict[str, list[float]] = {"fsdp2": [], "megapar": []}
    losses: dict[str, list[float]] = {"fsdp2": [], "megapar": []}
    for i, batch in enumerate(batches):
        for name in list(sides)[:: -1 if i % 2 else 1]:  # neither side always first
            sync()
            start = time.perf_counter()
            losses[name].append(sides[name](batch))
            sync()
            times[name].append(time.perf_counter() - start)
    return {"times": times, "losses": losses}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive, default=10,
        help="timed steps (default %(default)s)")
    parser.add_argument("--hidden", type=positive, default=256,
        help="hidden size (default %(default)s)")
    parser.add_argument("--layers", type=positive, default=4, help="blocks (default %(default)s)")
    parser.add_argument("--seq", type=positive, default=128,
        help="sequence length (default %(default)s)")
    parser.add_argument("--mbs", type=positive, default=4,
        help="micro-batch size (default %(default)s)")
    parser.add_argument("--vocab", type=positive, default=8192,
        help="vocabulary size (default %(default)s)")
    args = parser.parse_args(argv)
    from megapar.launcher import run_local

    out = run_local(_worker, 2, args)[0]
    fsdp = statistics.median(out["times"]["fsdp2"][1:])
    ours = statistics.median(out["times"]["megapar"][1:])
    pairs = [m / f for m, f in zip(out["times"]["megapar"][1:], out["times"]["fsdp2"][1:])]
    print(f"GPT-2 h {args.hidden}, {args.layers} layers, vocab {args.vocab}, micro-batch "
          f"{args.mbs} x {args.seq}, dp 2, {args.steps} steps each (median after the first)")
    print(f"  FSDP2 fully_shard  {fsdp * 1e3:8.1f} ms/step")
    print(f"  megapar --zero 3   {ours * 1e3:8.1f} ms/step   ({ours / fsdp:.2f}x FSDP2's; step "
          f"by step {statistics.median(pairs):.2f}x [{min(pairs):.2f}, {max(pairs):.2f}])")
    print(f"  first losses: FSDP2 {out['losses']['fsdp2'][:3]}, megapar "
          f"{out['losses']['megapar'][:3]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
