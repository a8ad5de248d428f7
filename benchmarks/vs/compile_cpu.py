"""`--compile` on the CPU: megapar eager and compiled against transformers eager and compiled.

One tiny GPT-2 (default: 4 layers, hidden 128, 4 heads, vocabulary 1024, seq 128, batch 8;
fp32, no dropout), built once by transformers from a seed, is trained in one process by four
systems on the same weights and the same batches:

- megapar eager: `megapar.prepare(model)` (one optimizer step per `train_step`, the whole
  batch as one micro-batch, clipping at 1.0);
- megapar compile: the same with `compile=True` (each transformer block torch.compile'd);
- transformers eager: `GPT2LMHeadModel` (SDPA attention), torch's AdamW with megapar's
  defaults (betas 0.9 / 0.95, eps 1e-8, no weight decay), `clip_grad_norm_(1.0)`, the
  loss read every step (as `train_step` returns it);
- transformers compile: the same model wrapped in `torch.compile` (the whole model).

Each system is built and takes `--warmup` steps first (the compiled ones compile there: its
seconds are printed as the compile cost), then the systems run `--rounds` rounds in turns
(`common.interleave`, alternating the order), `--steps` timed steps each, so that what else the
machine does falls on all of them alike; the ratios are taken round by round
(`common.pair_ratios`): median [min, max]. Every system runs with `--threads` torch threads
(default 1: a shared machine's cores are not all ours). The first losses of all four are
printed: the same model, optimizer and targets (megapar's last position is ignored, as
transformers' shifted loss has no target there), so they agree to fp32 rounding.

    python benchmarks/vs/compile_cpu.py --rounds 15 --steps 2   # about 5 minutes on 2 cores
    python benchmarks/vs/compile_cpu.py --layers 2 --hidden 64 --rounds 2 --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import megapar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import interleave, output_file, pair_ratios, ratio_summary, write_json, positive  # noqa: E402

LR, CLIP = 1e-3, 1.0


def hf_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def batches(args, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
            for _ in range(n)]


def megapar_step(args, compile_: bool):
    engine = megapar.prepare(hf_model(args), micro_batch_size=args.batch, seq_len=args.seq,
                             global_batch_size=args.batch, lr=LR, clip_grad=CLIP,
                             compile=compile_)

    def step(ids):
        labels = ids[:, 1:].clone()
        labels[:, -1] = -100  # transformers' shifted loss has no target for the last position
        return engine.train_step({"input_ids": ids[:, :-1], "labels": labels})

    return step


def torch_step(args, compile_: bool):
    model = hf_model(args)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    forward = torch.compile(model) if compile_ else model

    def step(ids):
        loss = forward(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


SYSTEMS = {
    "megapar eager": lambda a: megapar_step(a, False),
    "megapar compile": lambda a: megapar_step(a, True),
    "transformers eager": lambda a: torch_step(a, False),
    "transformers compile": lambda a: torch_step(a, True),
}
RATIOS = [  # (a, b): a's s/step over b's, round by round
    ("megapar compile", "megapar eager"),
    ("transformers compile", "transformers eager"),
    ("megapar eager", "transformers eager"),
    ("megapar compile", "transformers compile"),
    ("megapar compile", "transformers eager"),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--hidden", type=positive, default=128)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--vocab", type=positive, default=1024)
    p.add_argument("--seq", type=positive, default=128)
    p.add_argument("--batch", type=positive, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compiles)")
    p.add_argument("--rounds", type=positive, default=5, help="rounds of the four systems in turn")
    p.add_argument("--steps", type=positive, default=5, help="timed steps per system per round")
    p.add_argument("--threads", type=positive, default=1, help="torch threads")
    p.add_argument("--json", type=output_file, help="write every figure to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = batches(args, args.warmup + args.rounds * args.steps)
    steps, first, warm = {}, {}, {}
    for name, make in SYSTEMS.items():
        start = time.perf_counter()
        steps[name] = make(args)
        first[name] = [steps[name](ids) for ids in data[: args.warmup]]
        warm[name] = time.perf_counter() - start
        print(f"{name:21} built + {args.warmup} warm-up steps: {warm[name]:6.1f} s; first "
              f"losses {', '.join(f'{x:.6f}' for x in first[name])}", flush=True)
    cursor = {name: args.warmup for name in SYSTEMS}

    def timed_run(name):
        def run():
            ids = data[cursor[name] % len(data): cursor[name] % len(data) + args.steps]
            start = time.perf_counter()
            for x in ids:
                steps[name](x)
            cursor[name] += args.steps
            return (time.perf_counter() - start) / len(ids)
        return run

    times = interleave({n: timed_run(n) for n in SYSTEMS}, args.rounds, alternate=True)
    print(f"\nGPT-2 {args.layers} x {args.hidden}, vocab {args.vocab}, batch {args.batch} x "
          f"{args.seq}, fp32, {args.threads} thread(s), torch {torch.__version__}; "
          f"{args.rounds} rounds x {args.steps} steps")
    for name, t in times.items():
        print(f"  {name:21} {1e3 * statistics.median(t):8.1f} ms/step (median of rounds)")
    print("  ratios of s/step, round by round: median [min, max] (< 1: the first is faster)")
    ratios = {}
    for a, b in RATIOS:
        r = pair_ratios(times[a], times[b])
        ratios[f"{a} / {b}"] = r
        print(f"    {a} / {b}: {ratio_summary(r)}")
    if args.json:
        write_json(args.json, {"args": vars(args), "warmup_s": warm, "first_losses": first,
                               "s_per_step": times, "ratios": ratios,
                               "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
