"""An MoE model's training step against the dense model of the same active parameters, on the
CPU, as ratios.

A Mixtral (default: 4 layers, hidden 256, 4 heads, 8 experts of intermediate I = 512, top 2)
and a Llama that differs only in its MLP: one dense SwiGLU of intermediate 2 x I, so a token
meets the same MLP weights, and the same MLP FLOPs, in both (the MoE's router adds H x E per
layer). Vocabulary 1,024, batch 4 x 256, fp32, one process, both built by `megapar.prepare`
from transformers configs (weights from the same seed), trained by `engine.train_step` (forward,
backward, the gradient-norm clip at 1.0, AdamW; the Mixtral's step includes its load-balancing
loss at transformers' default coefficient 0.001) on the same batches.

Each model takes `--warmup` steps, then the two run `--rounds` rounds in turns
(`common.interleave`, the order reversed every other round), `--steps` steps each, and the ratio
of their seconds per step is taken round by round: median [min, max], of the wall-clock time
and of the CPU time the process got (`time.process_time`: with one thread on a machine shared
with other jobs, the time a step computed rather than the time it waited for a core); tokens
per second are the batch's tokens over each model's median seconds per step. torch runs
`--threads` threads (default 1: the machine's cores are shared). With `--profile`, one more
step of each runs under `torch.profiler` and the operators taking the most of its time (self
CPU time) are printed, grouped into matmuls, the MoE's routing (top-k, sort, gathers and
scatters, counts), fills and copies, and the optimizer: where the MoE's extra time goes.

    python benchmarks/moe/moe_vs_dense.py --profile         # about 2 minutes on 2 cores
    python benchmarks/moe/moe_vs_dense.py --layers 1 --seq 32 --rounds 2 --steps 1   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers

import megapar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import interleave, output_file, pair_ratios, ratio_summary, write_json, positive  # noqa: E402

LR, CLIP = 1e-3, 1.0
GROUPS = {  # profiler operator -> group, for the breakdown (the rest: "other")
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm"),
    "routing": ("aten::topk", "aten::sort", "aten::argsort", "aten::index", "aten::index_select",
                "aten::index_copy", "aten::index_copy_", "aten::index_add_", "aten::scatter_add_",
                "aten::gather", "aten::cumsum", "aten::_local_scalar_dense",
                "aten::index_put_", "aten::_index_put_impl_", "aten::nonzero", "aten::where"),
    "copies": ("aten::copy_", "aten::cat", "aten::zeros", "aten::zero_", "aten::fill_",
               "aten::new_zeros", "aten::empty", "aten::clone", "aten::contiguous"),
    "optimizer": ("aten::_foreach_", "Optimizer.step", "aten::_fused_adam"),
}


def configs(args):
    """(the Mixtral's transformers config, the dense Llama's): the same but the MLP."""
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                  rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)
    moe = transformers.MixtralConfig(intermediate_size=args.expert_size,
                                     num_local_experts=args.experts,
                                     num_experts_per_tok=args.top_k, **common)
    dense = transformers.LlamaConfig(intermediate_size=args.top_k * args.expert_size, **common)
    return moe, dense


def parameters(engine, experts: int, top_k: int) -> tuple[int, int]:
    """(all parameters, those a token uses: the routed experts' counted k / E)."""
    total = active = 0
    for name, p in engine.model.named_parameters():
        total += p.numel()
        active += p.numel() * (top_k / experts if ".experts." in name else 1)
    return total, round(active)


def batches(args, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def build(args, config):
    torch.manual_seed(0)
    return megapar.prepare(config, micro_batch_size=args.batch, seq_len=args.seq,
                           global_batch_size=args.batch, lr=LR, clip_grad=CLIP, seed=0)


def profile_step(engine, batch) -> dict[str, float]:
    """Self CPU milliseconds of one step, per operator."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.train_step(batch)
    out: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        out[event.key] += event.self_cpu_time_total / 1e3
    return dict(out)


def group_of(op: str) -> str:
    for group, names in GROUPS.items():
        if any(op.startswith(n) for n in names):
            return group
    return "other"


def print_profile(name: str, ops: dict[str, float]) -> dict[str, float]:
    total = sum(ops.values())
    groups: dict[str, float] = defaultdict(float)
    for op, ms in ops.items():
        groups[group_of(op)] += ms
    print(f"  {name}: {total:.0f} ms of operators' self CPU time in one profiled step; "
          + ", ".join(f"{g} {ms:.0f} ms ({100 * ms / total:.0f} %)"
                      for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])))
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
    print("    top operators: " + ", ".join(f"{op} {ms:.0f}" for op, ms in top))
    return dict(groups)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--hidden", type=positive, default=256)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--experts", type=positive, default=8)
    p.add_argument("--top-k", type=positive, default=2)
    p.add_argument("--expert-size", type=positive, default=512,
                   help="each expert's intermediate I (the dense MLP's: top-k x I)")
    p.add_argument("--vocab", type=positive, default=1024)
    p.add_argument("--seq", type=positive, default=256)
    p.add_argument("--batch", type=positive, default=4)
    p.add_argument("--warmup", type=int, default=2, help="steps of each before timing")
    p.add_argument("--rounds", type=positive, default=10, help="rounds of the two in turn")
    p.add_argument("--steps", type=positive, default=2, help="timed steps per model per round")
    p.add_argument("--threads", type=positive, default=1, help="torch threads")
    p.add_argument("--profile", action="store_true", help="print one profiled step of each")
    p.add_argument("--json", type=output_file, help="write every figure to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    moe_config, dense_config = configs(args)
    data = batches(args, args.warmup + args.rounds * args.steps + 1)
    engines = {"moe": build(args, moe_config), "dense": build(args, dense_config)}
    counts, first = {}, {}
    for name, engine in engines.items():
        counts[name] = parameters(engine, args.experts if name == "moe" else 1,
                                  args.top_k if name == "moe" else 1)
        first[name] = [engine.train_step(b) for b in data[: args.warmup]]
        print(f"{name:5}: {counts[name][0]:,} parameters, {counts[name][1]:,} active per "
              f"token; first losses {', '.join(f'{x:.4f}' for x in first[name])}", flush=True)
    cursor = {name: args.warmup for name in engines}

    def timed_run(name):
        def run():
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                engines[name].train_step(data[cursor[name]])
                cursor[name] += 1
            return ((time.perf_counter() - wall) / args.steps,
                    (time.process_time() - cpu) / args.steps)
        return run

    runs = interleave({n: timed_run(n) for n in engines}, args.rounds, alternate=True)
    times = {clock: {n: [r[i] for r in rs] for n, rs in runs.items()}
             for i, clock in enumerate(("wall", "cpu"))}
    tokens = args.batch * args.seq
    print(f"\n{args.layers} layers x hidden {args.hidden}; MoE {args.experts} experts of "
          f"{args.expert_size}, top {args.top_k}; dense MLP {args.top_k * args.expert_size}; "
          f"batch {args.batch} x {args.seq}, fp32, {args.threads} thread(s), torch "
          f"{torch.__version__}; {args.rounds} rounds x {args.steps} steps")
    ratios = {}
    for clock, label in (("cpu", "CPU time"), ("wall", "wall")):
        print(f"  {label}:")
        for name, t in times[clock].items():
            med = statistics.median(t)
            print(f"    {name:5} {1e3 * med:8.1f} ms/step, {tokens / med:8.0f} tokens/s "
                  f"(medians of rounds)")
        ratios[clock] = pair_ratios(times[clock]["moe"], times[clock]["dense"])
        print(f"    moe / dense s/step, round by round: {ratio_summary(ratios[clock])}")
    profile = {}
    if args.profile:
        print("\none profiled step each (self CPU time by operator group):")
        for name, engine in engines.items():
            profile[name] = print_profile(name, profile_step(engine, data[-1]))
    if args.json:
        write_json(args.json, {"args": vars(args), "parameters": counts,
                               "first_losses": first, "s_per_step": times,
                               "moe_over_dense": ratios, "profile_ms": profile,
                               "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
