"""Your own training loop on a Hugging Face transformers GPT-2, sharded tp 2 x pp 2 by megapar.

    python examples/own_loop_gpt2.py                          # 4 local processes, Shakespeare
    python examples/own_loop_gpt2.py --tp 1 --pp 1            # the same losses on one process
    torchrun --nproc-per-node 8 examples/own_loop_gpt2.py     # dp = 8 / (2 x 2) = 2

megapar.launch starts the ranks (or, under torchrun / Slurm, just runs `train`);
megapar.prepare converts the transformers model (its weights kept) into this rank's shard. The
loop is yours: each step hands the engine the *global* batch; every dp rank takes its share.
Without --data it tokenizes the shipped Shakespeare sample once into ~/.cache/megapar.
"""

import argparse
import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import megapar
from megapar.data import (
    GlobalBatchSampler, GPTDataset, IndexedDataset, asset_path, collate, ensure_dataset,
)
from megapar.launcher import launched_world_size, under_launcher


def make_model() -> GPT2LMHeadModel:
    """A small GPT-2 with the real 50257-token vocabulary, the same on every rank (seeded)."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=4, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def global_batches(prefix: str, seq_len: int, batch_size: int, seed: int):
    """Global batches of GPT-2-tokenized text: input_ids and labels (the next tokens)."""
    dataset = GPTDataset(IndexedDataset(prefix), seq_len)
    order = GlobalBatchSampler(len(dataset), batch_size, batch_size, 1, 0, seed)
    epoch = 0
    while True:
        for k in range(order.batches_per_epoch):
            yield collate([dataset[i] for i in order.global_batch(epoch, k)])
        epoch += 1


def train(args) -> list[float]:
    engine = megapar.prepare(make_model(), tp=args.tp, pp=args.pp, micro_batch_size=2,
                             lr=3e-3, weight_decay=0.1, clip_grad=1.0,
                             lr_schedule={"warmup_steps": min(2, args.steps),
                                          "max_steps": args.steps,
                                          "min_lr": 3e-4})
    losses = []
    for batch in global_batches(args.data, args.seq_len, args.batch_size, args.seed):
        if engine.step == args.steps:
            break
        losses.append(engine.train_step(batch))
        if engine.mesh.rank == 0:
            print(f"step {engine.step}: loss {losses[-1]:.4f}", flush=True)
    if args.save:
        engine.save(args.save)
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1, help="local runs only")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", help="a megapar-data prefix (default: the shipped Shakespeare)")
    parser.add_argument("--save", help="checkpoint directory")
    parser.add_argument("--json", help="write the losses to this file")
    args = parser.parse_args(argv)
    for flag in ("tp", "pp", "dp", "steps", "seq_len", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: it must be >= 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: no such directory (the losses go there at the end)")
    split = args.tp * args.pp
    if under_launcher() and launched_world_size() % split:  # torchrun / srun chose the count
        print(f"own_loop_gpt2.py: error: {launched_world_size()} processes started, not a "
              f"multiple of --tp {args.tp} x --pp {args.pp} = {split}; start a multiple of "
              f"{split} (torchrun --nproc-per-node) or change --tp / --pp", file=sys.stderr)
        sys.exit(2)
    if args.data is None:
        args.data = ensure_dataset(asset_path("shakespeare_sample.txt"), "gpt2",
                                   os.path.expanduser("~/.cache/megapar"))
    losses = megapar.launch(train, args.tp * args.pp * args.dp, args)
    if args.json and losses is not None:
        with open(args.json, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
