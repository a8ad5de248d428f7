"""`megapar-train --from-hf DIR --zero 3 --dp 2` against torch's FSDP2 on the same transformers
GPT-2, as a user would compare them: whole processes, taken in turns.

The model: a transformers GPT2LMHeadModel built from a seeded config (vocabulary 50,257, 4
layers, hidden 128, 2 heads, 128 positions, no dropout) and saved to a temporary directory
(nothing is downloaded). The work: seq 128, global batch 16, micro-batch 4, dp 2, so each dp
rank runs m = 16 / (4 x 2) = 2 micro-batches of 4 sequences per step, fp32, on the shipped
Shakespeare sample.

- megapar: `megapar-train --from-hf DIR --zero 3 --dp 2 --seq-len 128 --global-batch-size 16
  --micro-batch-size 4 --max-steps N --eval-interval 0 --log-json F` with its defaults
  otherwise (AdamW, clipping at 1.0, warmup and cosine decay); its per-step time is the
  `step_time_s` megapar-train logs (the batch fetched and the step run, on rank 0).
- FSDP2: the same transformers model loaded from DIR on 2 forked gloo ranks (one torch thread
  each, as megapar-train's workers), `fully_shard` on every block and then on the model
  (defaults: reshard after forward, a reduce-scatter each micro-batch), torch's AdamW (megapar's
  betas, eps and weight decay on matrices and embeddings only) and `clip_grad_norm_` at 1.0;
  per step: the same two micro-batches megapar-train reads (its sampler and dataset, the same
  learning rate schedule), each backward of loss / 2, clip, step, the loss all-reduced and read.
  Timed over the same span (batch fetched to loss read).

The two commands alternate, `--repeats` rounds of one run each (odd rounds in reverse order);
each run's figure is its median step time after `--warmup` steps, and the ratio is taken
pair by pair (the runs of one round). The losses of every step are compared (the same model,
data and updates: they agree to fp32 rounding).

    python benchmarks/vs/zero3_vs_fsdp2_hf.py                      # 3 rounds of 12 steps
    python benchmarks/vs/zero3_vs_fsdp2_hf.py --repeats 5 --baseline /path/to/earlier/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (  # noqa: E402
    positive,
    interleave, output_file, pair_ratios, ratio_summary, read_jsonl, run_peak, train_argv,
    write_json,
)

MODEL = dict(vocab_size=50257, n_positions=128, n_embd=128, n_layer=4, n_head=2)


def save_model(path: str) -> None:
    """The seeded transformers GPT-2 (`MODEL`, no dropout) saved to `path`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**MODEL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(cfg).save_pretrained(path)


def train_flags(model_dir: str, steps: int, log_json: str) -> list[str]:
    """megapar-train's flags for the comparison (the FSDP2 side reads its data and schedule
    from the same flags)."""
    return ["--from-hf", model_dir, "--zero", "3", "--dp", "2", "--seq-len", "128",
            "--global-batch-size", "16", "--micro-batch-size", "4", "--max-steps", str(steps),
            "--eval-interval", "0", "--log-json", log_json, "--no-progress"]


# the FSDP2 side ------------------------------------------------------------------------------
def _fsdp2_worker(flags: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2LMHeadModel

    from megapar.cli.train import plan_run
    from megapar.training.config import parse_args
    from megapar.training.data import batches, build_datasets, make_sampler
    from megapar.training.engine import Engine

    cfg = parse_args(flags)
    _, plan = plan_run(cfg)
    rank = dist.get_rank()
    train_ds, _ = build_datasets(cfg, plan.prefix, "gpt2")
    data = batches(train_ds, make_sampler(cfg, train_ds, 2, rank), torch.device("cpu"))
    schedule = Engine.flags_schedule(cfg)

    model = GPT2LMHeadModel.from_pretrained(cfg.from_hf)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    records = []
    for step in range(cfg.max_steps):
        start = time.perf_counter()
        micro_batches = next(data)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr(step)
        optimizer.zero_grad()
        total = torch.zeros(())
        for mb in micro_batches:
            logits = model(input_ids=mb["input_ids"]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1))
            (loss / len(micro_batches)).backward()
            total += loss.detach() / len(micro_batches)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        dist.all_reduce(total)
        loss_value = total.item() / 2
        records.append({"step": step + 1, "loss": loss_value, "grad_norm": float(norm.full_tensor())
                        if hasattr(norm, "full_tensor") else float(norm),
                        "step_time_s": time.perf_counter() - start})
    if rank == 0:
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def fsdp2_main(flags: list[str], out: str) -> None:
    from megapar.launcher import run_local

    run_local(_fsdp2_worker, 2, flags, out, timeout_s=1800)


# the comparison ------------------------------------------------------------------------------
def one_run(side: str, model_dir: str, steps: int, extra: list[str], work: str,
            baseline: str | None = None) -> list[dict]:
    """One whole run of `side` (a process: "megapar", "fsdp2", or "baseline": megapar-train
    from the checkout `baseline`); its per-step records."""
    log = os.path.join(work, f"{side}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    flags = train_flags(model_dir, steps, log)
    env = None
    if side == "fsdp2":
        argv = [sys.executable, __file__, "--fsdp2-side", log, "--", *flags]
    else:
        argv = train_argv(*flags, *extra)
    if side == "baseline":
        env = {**os.environ, "PYTHONPATH": str(baseline)}
    run_peak(argv, capture="stdout", env=env)
    return read_jsonl(log)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive, default=3, help="rounds (one run of each side)")
    parser.add_argument("--steps", type=positive, default=12, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--megapar-flags", nargs=argparse.REMAINDER, default=[],
                        help="more megapar-train flags (last on the line)")
    parser.add_argument("--baseline", help="also run megapar-train from this checkout (e.g. "
                        "a worktree of an earlier commit), a third side in each round")
    parser.add_argument("--fsdp2-side", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=output_file, help="write the figures here as JSON")
    args, rest = parser.parse_known_args(argv)
    if args.warmup < 0 or args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} / --warmup {args.warmup}: the median is of the steps "
                     f"after the warm-up; give --steps above --warmup")
    if args.baseline and not (Path(args.baseline) / "megapar").is_dir():
        parser.error(f"--baseline {args.baseline}: not a megapar checkout (no megapar/ in it); "
                     f"make one with git worktree add /tmp/base <commit>")
    if args.fsdp2_side:  # one FSDP2 run (a child of the comparison)
        fsdp2_main([a for a in rest if a != "--"], args.fsdp2_side)
        return 0
    with tempfile.TemporaryDirectory() as work:
        model_dir = os.path.join(work, "gpt2")
        save_model(model_dir)
        sides = ("megapar", "fsdp2") + (("baseline",) if args.baseline else ())
        runs = interleave({side: (lambda side=side: one_run(
            side, model_dir, args.steps, args.megapar_flags, work, args.baseline))
            for side in sides}, args.repeats, alternate=True)
    med = {side: [statistics.median(r["step_time_s"] for r in run[args.warmup:]) * 1e3
                  for run in rs] for side, rs in runs.items()}
    ratios = pair_ratios(med["megapar"], med["fsdp2"])
    diff = max(abs(a["loss"] - b["loss"]) for ra, rb in zip(runs["megapar"], runs["fsdp2"])
               for a, b in zip(ra, rb))
    extra = " " + " ".join(args.megapar_flags) if args.megapar_flags else ""
    print(f"GPT-2 (transformers) vocab 50257, 4 x 128, seq 128, global batch 16, micro-batch 4,"
          f" dp 2 (m 2 per rank); {args.steps} steps a run, median after {args.warmup}")
    base = "baseline" in med
    print(f"{'round':>5} {'megapar ms':>11} {'FSDP2 ms':>9} {'ratio':>6}"
          + (f" {'baseline ms':>12} {'ratio':>6}" if base else ""))
    for i, (a, b) in enumerate(zip(med["megapar"], med["fsdp2"])):
        print(f"{i:>5} {a:>11.1f} {b:>9.1f} {a / b:>6.3f}"
              + (f" {med['baseline'][i]:>12.1f} {med['baseline'][i] / b:>6.3f}" if base else ""))
    print(f"megapar --zero 3{extra} / FSDP2, pair by pair: {ratio_summary(ratios)} "
          f"(median [min, max]); largest loss difference {diff:.1e}")
    if base:
        print(f"baseline ({args.baseline}) / FSDP2: "
              f"{ratio_summary(pair_ratios(med['baseline'], med['fsdp2']))}; megapar / baseline: "
              f"{ratio_summary(pair_ratios(med['megapar'], med['baseline']))}")
    first = ", ".join(f"{r['loss']:.5f}" for r in runs["megapar"][0])
    print(f"losses (megapar, round 0): {first}")
    if args.json:
        write_json(args.json, {"ms": med, "ratios": ratios, "max_loss_diff": diff,
                               "losses": {k: [[r["loss"] for r in run] for run in v]
                                          for k, v in runs.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
