"""Memory claims at the peak the OS sees, next to what they count.

megapar's memory claims (ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, recomputation drops activations,
sequence and context parallelism split them) are counted: the dry run and the planner add up
the tensors a rank holds. This script measures each at the peak the operating system sees:
every configuration is a fresh `megapar-train` run (`--steps`, 2 by default; its data tokenized
beforehand), and the figure is the largest process's peak resident set, `ru_maxrss` from `wait4` (every worker is
a child of the launcher, so it is the largest rank's, whatever rank that is). Beside it, the
dry run's count for the most loaded rank (weights + gradients + optimizer state + modelled
activations). A claim holds at the OS peak when the peaks differ as the counts do.

Each run is measured twice: with megapar's host allocator policy (the default: once the
training state is built, glibc keeps freed blocks in its heap for reuse, which makes CPU steps
2.3x faster; `megapar.host_memory.keep_freed_host_memory`), and with glibc's own
(`MEGAPAR_HOST_MALLOC=system`: a freed large block goes back to the OS). A transient that does
not fit the heap's free room stays resident under the first, so its peak can be higher.

    python benchmarks/memory/peak_memory.py                  # every group, about 6 minutes on 2 cores
    python benchmarks/memory/peak_memory.py --groups zero    # one group: --zero 0 / 1 / 2 / 3
    python benchmarks/memory/peak_memory.py --groups zero --steps 16 --policies keep  # a run's peak
    python benchmarks/memory/peak_memory.py --groups offload --policies keep  # offload, one heap policy
    python benchmarks/memory/peak_memory.py --groups schedules  # 1F1B, ZB-H1, ZB-V, DualPipeV
    python benchmarks/memory/peak_memory.py --groups fp8 --policies keep  # bf16 against --fp8

Each group compares configurations with one flag changed; `--repeats` runs each again (the
peak of a run is deterministic to a few MB on an idle machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (  # noqa: E402
    positive,
    json_number,
    output_file,
    run_peak,
    scratch_dir,
    train_argv,
    write_json,
)

from megapar.models.recipes import resolve_model  # noqa: E402
from megapar.plan.process import cpu_baseline  # noqa: E402

MODEL = {"model_type": "gpt2", "vocab_size": 1004, "n_positions": 4096, "n_embd": 256,
         "n_layer": 8, "n_head": 8, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
"""8 blocks of hidden 256 with a SentencePiece vocabulary (1,000 + megapar's 4): activations,
not the logits, dominate a long sequence's memory."""

MIXTRAL_VOCAB = 50261
"""The vocabulary a `--model mixtral-tiny` run without `--tokenizer` takes (GPT-2's BPE, 50,257,
and megapar's 4 special tokens), which the dry run, skipping the data, does not: the `moe`
group gives both the recipe with it as a config file (`{mixtral}`), so that the counted and
predicted figures are of the model that runs."""

SMALL = ["--model", "{model}", "--tokenizer", "sentencepiece"]
ZERO_STAGES = (0, 1, 2, 3)
"""The `zero` group's stages (a row per stage)."""
GROUPS = {  # name: (the claim, [(label, flags)])
    "zero": (("each ZeRO stage lowers the peak (GPT-2 124M, dp 2): zero 1 <= 0.85x zero 0, "
              "zero 2 < zero 1, zero 3 <= 0.7x zero 0"), [
                 (f"zero {z}", ["--model", "gpt2-124m", "--dp", "2", "--seq-len", "64",
                                "--micro-batch-size", "1", "--global-batch-size", "2",
                                "--zero", str(z)]) for z in ZERO_STAGES]),
    "offload": (("offload moves state to the host: on the CPU the host is the device, so the "
                 "OS sees the host copies added (MEGAPAR_HOST_COPIES=1: made as on a GPU), "
                 "GPT-2 124M, dp 2"), [
        (label, ["--model", "gpt2-124m", "--dp", "2", "--seq-len", "64", "--micro-batch-size",
                 "1", "--global-batch-size", "2", *extra])
        for label, extra in (("zero 1", ["--zero", "1"]),
                             ("zero 1 + opt", ["--zero", "1", "--offload-optimizer"]),
                             ("zero 3", ["--zero", "3"]),
                             ("zero 3 + both", ["--zero", "3", "--offload-optimizer",
                                                "--offload-params"]))]),
    "recompute": ("recomputation keeps fewer activations (seq 1024, micro-batch 4)", [
        (mode, [*SMALL, "--seq-len", "1024", "--micro-batch-size", "4",
                "--global-batch-size", "4", "--recompute", mode])
        for mode in ("none", "selective", "full")]),
    "sp": ("sequence parallelism splits the activations outside the tp regions (tp 2)", [
        (label, [*SMALL, "--tp", "2", "--seq-len", "1024", "--micro-batch-size", "4",
                 "--global-batch-size", "4", *extra])
        for label, extra in (("tp 2", []), ("tp 2 + SP", ["--sequence-parallel"]))]),
    "cp": ("context parallelism keeps 1/cp of a sequence's activations per rank (seq 4096)", [
        (f"cp {cp}", [*SMALL, "--cp", str(cp), "--seq-len", "4096", "--micro-batch-size", "1",
                      "--global-batch-size", "1"]) for cp in (1, 2, 4)]),
    "schedules": ("ZB-V and DualPipeV hold no more activations than 1F1B (pp 2, m 8, seq 1024)", [
        (schedule, [*SMALL, "--pp", "2", "--seq-len", "1024", "--micro-batch-size", "1",
                    "--global-batch-size", "8", "--schedule", schedule])
        for schedule in ("1f1b", "gpipe", "zb-h1", "zb-v", "dualpipev")]),
    "moe": ("ZeRO-3 shards a mixture of experts' experts over expert dp (mixtral-tiny)", [
        (label, ["--model", "{mixtral}", "--seq-len", "64", "--micro-batch-size", "1",
                 "--zero", "3", *extra])
        for label, extra in (("dp 2", ["--dp", "2", "--global-batch-size", "2"]),
                             ("dp 2 ep 2", ["--dp", "2", "--ep", "2", "--global-batch-size", "2"]),
                             ("dp 4 ep 2", ["--dp", "4", "--ep", "2", "--global-batch-size", "4"]))]),
    "fp8": (("--fp8 (emulated on the CPU) holds no 16-bit copies of its float8 linears' weights "
             "but the step's float8 casts of them, and adds its casts' transients: the peak "
             "changes as the planner's figure does "
             "(GPT-2 124M, bf16, one process, 2 x 512 tokens)"), [
        (label, ["--model", "gpt2-124m", "--seq-len", "512", "--micro-batch-size", "2",
                 "--global-batch-size", "2", "--precision", "bf16", *extra])
        for label, extra in (("bf16", []),
                             ("bf16 + fp8", ["--fp8", "tensorwise", "--fp8-emulate"]))]),
}

CHECKS = {  # name: [(what the claim says of the OS peaks, by row label, whether it holds)]
    "zero": [("zero 1 <= 0.85x zero 0", lambda p: p["zero 1"] <= 0.85 * p["zero 0"]),
             ("zero 2 < zero 1", lambda p: p["zero 2"] < p["zero 1"]),
             ("zero 3 <= 0.7x zero 0", lambda p: p["zero 3"] <= 0.7 * p["zero 0"])],
    "recompute": [("full < none", lambda p: p["full"] < p["none"])],
    "sp": [("tp 2 + SP < tp 2", lambda p: p["tp 2 + SP"] < p["tp 2"])],
    "cp": [("cp 4 < cp 2 < cp 1", lambda p: p["cp 4"] < p["cp 2"] < p["cp 1"])],
    "schedules": [(f"{s} <= 1f1b", lambda p, s=s: p[s] <= p["1f1b"])
                  for s in ("zb-v", "dualpipev")],
}
"""The parts of a group's claim read off its OS peaks (glibc's heap kept, the "keep" policy),
each printed as held or not under its table."""
COMMON = ["--warmup-steps", "0", "--eval-interval", "0", "--no-progress",
          "--log-interval", "1"]


def os_peak(argv: list[str], env: dict) -> tuple[int, str]:
    """(the largest process's peak resident bytes, stderr) of one megapar-train run."""
    run = run_peak(train_argv(*argv), env=env, capture="stderr")
    return run.peak_bytes, run.output


def counted(argv: list[str], env: dict) -> tuple[int, int]:
    """(the dry run's bytes for the most loaded rank: weights, gradients, optimizer state and
    modelled activations; its predicted OS peak: the largest rank's `peak_cpu`, the process
    figure of `megapar.plan.process`, plus the baseline of a rank megapar-train starts, forked
    where there are several: `cpu_baseline`)."""
    run = subprocess.run([sys.executable, "-m", "megapar.cli.train", *argv, "--dry-run",
                          "--json", "--dry-run-ranks", "all"], capture_output=True, text=True,
                         env=env, check=True)
    ranks = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    count = max(r["weights"] + r["grads"] + r["optimizer"] + r.get("master", 0)
                + r.get("gathered", 0) + r.get("grad_buffers", 0) + r["activations"]
                for r in ranks)
    return count, max(r["peak_cpu"] for r in ranks) + int(cpu_baseline(len(ranks)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--repeats", type=positive, default=1)
    parser.add_argument("--steps", type=positive, default=2,
                        help="steps per run (at dp > 1 under ZeRO 0-2 the heap grows for some "
                             "steps: 10-20 measure the run's peak, docs/guides/planner.md)")
    parser.add_argument("--json", type=output_file, help="write every figure to this file")
    parser.add_argument("--policies", nargs="+", default=["keep", "system"],
                        choices=["keep", "system"], help="heap policies to measure")
    args = parser.parse_args(argv)
    work = scratch_dir("megapar-peak-")
    model = os.path.join(work, "model.json")
    write_json(model, MODEL)
    mixtral = os.path.join(work, "mixtral-tiny.json")
    write_json(mixtral, {**resolve_model("mixtral-tiny").to_dict(), "vocab_size": MIXTRAL_VOCAB})
    env = {**os.environ, "MEGAPAR_CPU": "1"}
    results = {}
    for group in args.groups:
        claim, configs = GROUPS[group]
        print(f"\n{group}: {claim}")
        print(f"  {'configuration':14} {'counted':>9} {'OS peak':>9} {'glibc':>9}   "
              f"change from the first: {'counted':>8} {'OS peak':>8} {'glibc':>8}  (GiB)   "
              f"{'predicted':>9} {'/ OS peak':>9}")
        rows = []
        for label, flags in configs:
            flags = [{"{model}": model, "{mixtral}": mixtral}.get(a, a) for a in flags] + COMMON + \
                ["--max-steps", str(args.steps), "--data-cache", os.path.join(work, "cache")]
            run_env = {**env, "MEGAPAR_HOST_COPIES": "1"} if group == "offload" else env
            count, predicted = counted(flags, run_env)
            peaks = {policy: min(os_peak(flags, {**run_env, "MEGAPAR_HOST_MALLOC": policy})[0]
                                 for _ in range(args.repeats)) if policy in args.policies
                     else float("nan") for policy in ("keep", "system")}
            rows.append((label, count, peaks, predicted))
            first = rows[0]
            g = 2**30

            def shown(x: float, width: int, sign: str = "") -> str:  # "-": a policy not run
                return f"{x / g:{sign}{width}.3f}" if math.isfinite(x) else f"{'-':>{width}}"

            print(f"  {label:14} {count / g:9.3f} {shown(peaks['keep'], 9)} "
                  f"{shown(peaks['system'], 9)}   {'':22} {(count - first[1]) / g:+8.3f} "
                  f"{shown(peaks['keep'] - first[2]['keep'], 8, '+')} "
                  f"{shown(peaks['system'] - first[2]['system'], 8, '+')}        "
                  f"{predicted / g:9.3f} "
                  f"{shown(predicted / peaks['keep'] * g, 9)}", flush=True)
        peak_of = {label: peaks["keep"] for label, _, peaks, _ in rows}
        held = [(what, bool(check(peak_of))) for what, check in CHECKS.get(group, [])
                if "keep" in args.policies]
        for what, ok in held:
            print(f"  claim at the OS peak: {what}: {'held' if ok else 'NOT HELD'}")
        results[group] = {"claim": claim, "held": dict(held), "rows": [
            {"config": label, "counted_bytes": count, "os_peak_bytes": json_number(peaks["keep"]),
             "os_peak_glibc_bytes": json_number(peaks["system"]), "predicted_bytes": predicted}
            for label, count, peaks, predicted in rows]}
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
