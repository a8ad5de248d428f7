"""Compressed data-parallel gradient reduction: bytes per step and the loss-curve gap.

Trains the same GPT-2 (gpt2-tiny: 4 layers, hidden 64, the real GPT-2 BPE) on the shipped
Shakespeare sample at dp ranks for each --grad-compression mode, from the same seed on the same
batches, and prints per mode: the bytes each rank puts into dp reductions per step (counted by
GradBuckets: the payloads of its collectives), their ratio to uncompressed fp32, and the loss
gap to the uncompressed run (mean |loss - loss_none| over all steps and over the last quarter,
relative). Usage:

    python benchmarks/data_parallel/grad_compression.py [--dp 2] [--steps 60] [--powersgd-rank 4]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

MODES = ("none", "fp16", "bf16", "powersgd")


def _batches(prefix, seq_len, batch_size, seed):
    from megapar.data import GlobalBatchSampler, GPTDataset, IndexedDataset, collate

    dataset = GPTDataset(IndexedDataset(prefix), seq_len)
    order = GlobalBatchSampler(len(dataset), batch_size, batch_size, 1, 0, seed)
    epoch = 0
    while True:
        for k in range(order.batches_per_epoch):
            yield collate([dataset[i] for i in order.global_batch(epoch, k)])
        epoch += 1


def _train(args, prefix, mode):
    import megapar

    engine = megapar.prepare("gpt2-tiny", micro_batch_size=args.micro_batch_size, lr=3e-3,
                             weight_decay=0.1, clip_grad=1.0, grad_compression=mode,
                             powersgd_rank=args.powersgd_rank,
                             lr_schedule={"warmup_steps": 5, "max_steps": args.steps,
                                          "min_lr": 3e-4})
    losses = []
    for batch in _batches(prefix, args.seq_len, args.batch_size, 1234):
        if engine.step == args.steps:
            break
        losses.append(engine.train_step(batch))
    return losses, engine.grad_sync.bytes_sent / args.steps


def main(argv=None):
    import megapar
    from megapar.data import asset_path, ensure_dataset

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=positive, default=2)
    parser.add_argument("--steps", type=positive, default=60)
    parser.add_argument("--seq-len", type=positive, default=64)
    parser.add_argument("--batch-size", type=positive, default=8)
    parser.add_argument("--micro-batch-size", type=positive, default=2)
    parser.add_argument("--powersgd-rank", type=positive, default=4)
    args = parser.parse_args(argv)
    if args.steps <= 5:  # the learning rate warms up over 5 steps
        parser.error(f"--steps {args.steps}: the schedule warms up over 5 steps; give 6 or more")
    prefix = ensure_dataset(asset_path("shakespeare_sample.txt"), "gpt2",
                            os.path.expanduser("~/.cache/megapar"))
    runs = {mode: megapar.launch(_train, args.dp, args, prefix, mode) for mode in MODES}
    ref_losses, ref_bytes = runs["none"]
    tail = max(1, args.steps // 4)
    print(f"dp={args.dp}, {args.steps} steps, gpt2-tiny, Shakespeare sample, global batch "
          f"{args.batch_size} x {args.seq_len}")
    print(f"{'mode':10s} {'MB/step':>9s} {'vs fp32':>8s} {'final loss':>10s} "
          f"{'mean gap':>9s} {'last-quarter gap':>17s}")
    for mode, (losses, sent) in runs.items():
        gap = sum(abs(a - b) / b for a, b in zip(losses, ref_losses)) / len(losses)
        late = sum(abs(a - b) / b for a, b in zip(losses[-tail:], ref_losses[-tail:])) / tail
        print(f"{mode:10s} {sent / 2**20:9.3f} {sent / ref_bytes:8.3f} {losses[-1]:10.4f} "
              f"{gap:9.2e} {late:17.2e}")


if __name__ == "__main__":
    main()
