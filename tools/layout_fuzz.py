"""Layout fuzzer: random parallel layouts and features, each run against one process.

megapar promises the same numbers in any layout (fp32: losses and gradient norms within 1e-5
relative of one process). This tool draws random combinations of a tiny model, a layout (tp, pp
and its schedule, dp, cp and its communication, ep and expert tensor parallelism: each axis 1
or 2 with at most 8 ranks, or one axis 4 and the rest 1) and features (ZeRO stage and its
options, sequence parallelism, recomputation, micro-batch size and count, sequence length,
sliding windows, gradient clipping, label smoothing, z-loss, MoE router losses, bias updates
and capacity factor, optimizer and offload, --muon-distributed, loss mean, SFT padding, packed
documents (block-causal masks, reset positions, no loss on end-of-document), fp16 with loss
scaling, --fp8 in torchao's emulation, compressed dp reduction (PowerSGD, fp16, bf16), rarely
--compile, evaluation, and steps 1-2 in another layout resumed from their checkpoint), runs
each through `megapar-train` as a user does (it starts its own forked gloo workers on the CPU),
and compares every step's logged numbers (loss, grad_norm, val_loss, z_loss, loss_scale, the
MoE terms: `--log-json`) and the final weights with the reference run: the same run on one
process (tp = pp = dp = cp = ep = 1, ZeRO 0, no recomputation, the same global and micro-
batch size), or, where one process is another computation (PowerSGD, a capacity factor on a
rank's slice of the tokens), the smallest layout that is the same one (`special_reference`).
The final weights are compared twice: the `--save`d checkpoint read whole (dp rank 0's and cp
rank 0's copy), and every rank's own parameters (`dump_ranks`: each rank writes what it holds
after the final save), each cut from the whole tensors by the shard rule a load uses, against
the reference's and against the run's own checkpoint (a replica that drifted from the copy the
checkpoint keeps). The tolerance follows the case's mode (`tolerance`): FP32_TOL for fp32,
fp8 emulation, PowerSGD and capacity drops; BF16_TOL / FP16_TOL on the logged numbers for
bf16 / fp16 autocast and cast compression, whose weights are compared with the reference not
at all and with their own replicas at FP32_TOL.
Adam's eps is 1e-4 (tests/test_parity_3d.py says why: with 1e-8, entries whose gradient is
rounding noise take +-lr steps, and weights differ ~3e-5 per tensor after 3 steps even at dp 2
alone; the losses agree either way, the grad norms of some models only to ~3e-5 from the third
step: docs/testing.md). Even at 1e-4 a zero-initialised bias can
differ ~1.5e-5 after 3 steps, 4e-5 where few tokens carry the loss (SFT padding, tp 2 Muon's
AdamW part) (its update is ~lr per entry whatever the gradient, so its
rounding noise is all the tensor holds), so a case whose logged numbers and replicas agree but
whose weights do not, under an optimizer with Adam moments, is rerun with SGD (an update linear
in the gradient): if that passes, the case is adam-noise, else a mismatch. So is a bf16 / fp16
case whose logged numbers differ beyond its tolerance under an Adam-type optimizer: its
rounding noise takes such steps in every entry, moving the logged numbers by about its tolerance
within three steps even in one process (docs/testing.md has the cases measured). An fp16 case whose
gradients are reduced in fp16 (`fp16_wire`) and whose loss scale differs from the reference's
(a step skipped on one side: the wire's range, which one process does not have) is rerun with
--grad-reduce-dtype fp32: if that passes, the case is fp16-range, else a mismatch. A refused
combination must be refused in one line on stderr with exit code 2; the line is recorded, and
flagged (clear: false) when the refusal is not one line or comes with a traceback.

It is a tool, not part of the test suite (a run is minutes to hours of CPU)::

    PYTHONPATH=$PWD python3 tools/layout_fuzz.py --cases 20 --seed 1 --out /tmp/fuzz
    PYTHONPATH=$PWD python3 tools/layout_fuzz.py --replay /tmp/fuzz/results.jsonl --case 7
    PYTHONPATH=$PWD python3 tools/layout_fuzz.py --args "--model gpt2-tiny --tp 2 --zero 1"

Each case appends one JSON line to OUT/results.jsonl (its arguments, its outcome: pass,
mismatch, refused, crash, timeout, adam-noise or fp16-range, and the largest relative
difference seen);
one-process references are cached in OUT/ref by their arguments. `--args` runs one given case
(layout flags and features; the rest as the fuzzer sets them). `--edges` puts one of EDGES (a
setting at the edge of what a layout allows) on 30 % of the cases, to collect refusals.
`--bf16` also draws bf16 runs, compared with a one-process bf16 run to BF16_TOL (autocast's
bf16 products round to 8 bits of mantissa, and the layouts sum them in other orders: a bound on
the losses only, not weights).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shlex
import sys
import time
import traceback
from pathlib import Path

FP32_TOL = 1e-5
BF16_TOL = 2e-2
FP16_TOL = 2.5e-3  # BF16_TOL x 2^-11 / 2^-8: fp16's unit roundoff is 8x smaller than bf16's
STEPS = 3
SEQ = 16
TIMEOUT_S = 420
TOKENIZER = "megapar/assets/botchan_en_unigram_1000.model"  # a 1,004-token vocabulary
# the log's numbers that are timings or memory, not results
NOT_COMPARED = {
    "step",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "tflops",
    "tflops_per_rank",
    "mfu",
    "peak_mem_mb",
    "time",
    "compute_s_median",
    "compute_s_max",
    "compute_s_max_rank",
    "wait_s_median",
    "grad_reduce_wait",
    "bubble",
    "skipped",
    "straggler_suspects",  # which ranks were slow: the machine's load, not a result
    "stragglers",
}
LAYOUT_FLAGS = {
    "--tp",
    "--pp",
    "--dp",
    "--cp",
    "--ep",
    "--expert-tensor-parallel-size",
    "--schedule",
    "--virtual-stages",
    "--cp-comm-type",
    "--zero",
    "--recompute",
    "--rank-order",
    "--zero3-reduce",
    "--zero3-persistence-threshold",
    "--grad-bucket-mb",
    "--p2p-dtype",
}
LAYOUT_SWITCHES = {
    "--sequence-parallel",
    "--sp-regather",
    "--zero3-keep-params",
    "--offload-optimizer",
    "--offload-params",
    "--muon-distributed",
}
WINDOWED = {  # the windowed dense families, as llama-tiny plus a window shorter than SEQ
    "mistral-win": {"model_type": "mistral", "sliding_window": 8},
    "qwen3-win": {
        "model_type": "qwen3",
        "head_dim": 16,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
    },
}
LLAMA_TINY = {
    "vocab_size": 1004,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
MODELS = [
    "gpt2-tiny",
    "llama-tiny",
    "mixtral-tiny",
    "bert-tiny",
    "qwen3-moe-tiny",
    "mistral-win",
    "qwen3-win",
]
MOE = {"mixtral-tiny", "qwen3-moe-tiny"}
TIED = {"gpt2-tiny", "bert-tiny", "qwen3-win"}  # the models whose head is the word embedding
FP8_KEEP = (  # the flags an --fp8 reference keeps (`special_reference`)
    "--tp",
    "--sequence-parallel",
    "--sp-regather",
    "--expert-tensor-parallel-size",
    "--cp",
    "--cp-comm-type",
)
DISCRETE = ("moe_tokens_per_expert", "moe_imbalance", "moe_dropped")
"""Routing statistics (counts): compared in fp32 modes; in an inexact one a token whose top-k
choice flips moves whole counts, which no relative tolerance on the losses bounds."""
ADAM = {"adamw", "lamb", "muon"}  # the optimizers with Adam moments (and --adam-eps)


def model_arg(name: str, work: Path, window: int | None = None) -> str:
    """The --model value: a recipe name, or a config file written under `work` (a windowed
    family with its sliding window `window`, WINDOWED's by default)."""
    if name not in WINDOWED:
        return name
    extra = dict(WINDOWED[name])
    if window is not None:
        extra["sliding_window"] = window
    path = work / f"{name}-{extra['sliding_window']}.json"
    if not path.exists():
        path.write_text(json.dumps({**LLAMA_TINY, **extra}))
    return str(path)


def sft_data(work: Path) -> str:
    """A JSON Lines file of prompt / response records of uneven lengths (right padding)."""
    path = work / "sft.jsonl"
    if not path.exists():
        rng = random.Random(3)
        words = Path("megapar/assets/shakespeare_sample.txt").read_text().split()
        with path.open("w") as f:
            for _ in range(64):
                a, b = rng.randrange(len(words) - 20), rng.randrange(len(words) - 20)
                f.write(
                    json.dumps(
                        {
                            "prompt": " ".join(words[a : a + rng.randint(1, 8)]),
                            "response": " ".join(words[b : b + rng.randint(1, 9)]),
                        }
                    )
                    + "\n"
                )
    return str(path)


EDGES = [  # one setting at the edge of what a layout allows, put on a drawn case
    {"--ep": 2},  # on a dense model, or where ep does not divide dp x cp
    {"--expert-tensor-parallel-size": 2},  # without --tp 2, or on a dense model
    {"--virtual-stages": 3},
    {"--schedule": "dualpipev", "--pp": 2},  # micro-batches maybe fewer than 2 x pp
    {"--schedule": "interleaved", "--pp": 2, "--virtual-stages": 4},  # 8 chunks of 4 layers
    {"--sequence-parallel": True},  # maybe at tp 1
    {"--cp": 2, "--cp-comm-type": "a2a", "--tp": 2},  # heads per rank vs cp
    {"seq": 18},  # not a multiple of 2 x cp, or of tp with sp
    {"--zero": 3, "--dp": 1},
    {"--micro-batch-size": 5},  # the global batch not a multiple of it
    {"--pp": 2, "--schedule": "zb-v", "--virtual-stages": 2},
    {"--offload-optimizer": True, "--optimizer": "muon"},
    {"--loss-chunk-tokens": 7},
    {"--eval-interval": 1, "--eval-steps": 1, "--pp": 2},
]


def draw(rng: random.Random, bf16: bool, edges: bool = False) -> dict:
    """One random case: the layout and the features, as a dict of flag -> value."""
    model = rng.choice(MODELS)
    moe = model in MOE
    if rng.random() < 0.15:  # 4 on one axis, the world 4
        tp, pp, dp, cp = rng.choice([(4, 1, 1, 1), (1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 1, 4)])
    else:
        while True:
            tp, pp, dp, cp = (rng.choice([1, 2]) for _ in range(4))
            if 1 < tp * pp * dp * cp <= 8:
                break
    c: dict = {"model": model, "--tp": tp, "--pp": pp, "--dp": dp, "--cp": cp}
    if model in WINDOWED:
        c["window"] = rng.choice([3, 5, 8])
    c["seq"] = rng.choice([16, 16, 24, 32])
    mbs = rng.choice([1, 2, 3])
    m = rng.choice([1, 2, 4])
    if pp > 1:
        sched = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"])
        c["--schedule"] = sched
        if sched in ("interleaved", "zb-v", "dualpipev") and pp == 4:  # 4 layers: no chunks
            sched = c["--schedule"] = rng.choice(["gpipe", "1f1b", "zb-h1"])
        if sched == "interleaved":
            c["--virtual-stages"] = 2
        m = rng.choice([pp, 2 * pp] if sched != "dualpipev" else [2 * pp])
    c["--micro-batch-size"] = mbs
    c["--global-batch-size"] = mbs * m * dp
    if cp > 1:
        c["--cp-comm-type"] = rng.choice(["auto", "p2p", "all_gather", "a2a"])
    if moe:
        if (dp * cp) % 2 == 0 and rng.random() < 0.6:
            c["--ep"] = 4 if dp * cp == 4 and rng.random() < 0.4 else 2
        if tp > 1 and rng.random() < 0.5:
            c["--expert-tensor-parallel-size"] = tp
    if dp * cp > 1 or rng.random() < 0.2:
        c["--zero"] = rng.choice([0, 1, 2, 3])
    if dp * cp > 1 and rng.random() < 0.2:  # compressed dp reduction: ZeRO 0 only
        c["--zero"] = 0
        c["--grad-compression"] = rng.choice(["powersgd", "powersgd", "fp16", "bf16"])
        if c["--grad-compression"] == "powersgd":
            if rng.random() < 0.5:
                c["--powersgd-rank"] = 2
            if (c["--global-batch-size"] // (mbs * dp)) % cp:  # the reference runs dp x cp
                c["--global-batch-size"] *= cp
    if tp > 1 and rng.random() < 0.5:
        c["--sequence-parallel"] = True
        if rng.random() < 0.3:
            c["--sp-regather"] = True
    if c.get("--zero") == 3:
        if rng.random() < 0.4:
            c["--zero3-reduce"] = "micro-batch"
        if rng.random() < 0.3:
            c["--zero3-keep-params"] = True
        if rng.random() < 0.3:
            c["--zero3-persistence-threshold"] = 1000
    if dp * cp > 1 and rng.random() < 0.3:
        c["--grad-bucket-mb"] = 0.01
    if pp > 1 and dp > 1 and rng.random() < 0.3:
        c["--rank-order"] = "tp-dp-pp"
    if pp > 1 and rng.random() < 0.2:
        c["--p2p-dtype"] = "fp32"
    c["--recompute"] = rng.choice(["none", "none", "selective", "full"])
    c["--clip-grad"] = rng.choice([1.0, 0.05, 0.0])
    if model != "bert-tiny":
        if rng.random() < 0.3:
            c["--label-smoothing"] = 0.1
        if rng.random() < 0.3:
            c["--z-loss"] = 1e-3
        if rng.random() < 0.25:
            c["sft"] = True
    c["--optimizer"] = rng.choice(["adamw", "adamw", "muon", "lamb", "lars", "sgd"])
    if c["--optimizer"] in ("adamw", "sgd") and rng.random() < 0.2:
        c["--offload-optimizer"] = True
    if moe and rng.random() < 0.3:
        c["--moe-z-loss-coef"] = 1e-3
    if moe and rng.random() < 0.2:
        c["--moe-bias-update-rate"] = 1e-3
    if rng.random() < 0.2:
        c["--eval-interval"] = 2
        c["--eval-steps"] = 2
    c["--loss-mean"] = rng.choice(["microbatch", "token"])
    if rng.random() < 0.3:
        c["--loss-chunk-tokens"] = rng.choice([0, 8])
    c["--precision"] = "bf16" if bf16 and rng.random() < 0.2 else "fp32"
    if c["--optimizer"] == "muon" and c.get("--zero", 0) > 0 and rng.random() < 0.6:
        c["--muon-distributed"] = True
    if rng.random() < 0.12:  # fp16 with dynamic loss scaling (or a small initial scale)
        c["--precision"] = "fp16"
        if rng.random() < 0.4:
            c["--initial-loss-scale"] = 1024.0
    elif rng.random() < 0.1:  # torchao's float8 in emulation: casts and scales, fp32 products
        c["--fp8"] = rng.choice(["tensorwise", "rowwise"])
        c["--fp8-emulate"] = True
        c["--fp8-layers"] = "all"
    if moe and rng.random() < 0.3:
        c["--moe-capacity-factor"] = rng.choice([1.0, 1.25])
    if model != "bert-tiny" and not c.get("sft") and rng.random() < 0.15:  # packed documents
        c["--attention-mask-type"] = "block_causal"
        c["--reset-position-ids"] = True
        c["--eod-mask-loss"] = True
    if rng.random() < 0.04:  # rarely: the first step pays tens of seconds of compiling
        c["--compile"] = True
    if edges and rng.random() < 0.3:  # an edge megapar may refuse: its line is recorded
        edge = rng.choice(EDGES)
        c.update(edge)
        c["edge"] = next(iter(edge))
    if rng.random() < 0.25 and not special_reference(c):  # steps 1-2 in another layout
        samples = c["--global-batch-size"] // mbs
        first: dict = {"--tp": rng.choice([1, 2]), "--pp": rng.choice([1, 2])}
        if samples % 2 == 0 and rng.random() < 0.5:
            first["--dp"] = 2
            first["--zero"] = 0 if "--grad-compression" in c else rng.choice([0, 1, 2, 3])
            if moe and rng.random() < 0.5:
                first["--ep"] = 2
        c["resume"] = first
    return c


def timeout_of(case: dict) -> float:
    """Seconds a run of `case` may take: TIMEOUT_S, three times that with --compile (its
    first step compiles every block: tens of seconds alone, minutes on a shared CPU)."""
    return TIMEOUT_S * (3 if case.get("--compile") else 1)


def argv_of(case: dict, work: Path, save: Path | None, log: Path) -> list[str]:
    """megapar-train's arguments for `case`."""
    argv = [
        "--model",
        model_arg(case["model"], work, case.get("window")),
        "--tokenizer",
        TOKENIZER,
        "--seq-len",
        str(case.get("seq", SEQ)),
        "--max-steps",
        str(STEPS),
        "--warmup-steps",
        "1",
        "--lr",
        "3e-3",
        "--seed",
        "7",
        "--log-interval",
        "1",
        "--log-json",
        str(log),
        "--data-cache",
        str(work / "cache"),
        "--timeout-s",
        "600" if case.get("--compile") else "120",  # a first step that compiles: minutes
        "--no-progress",
        "--lr-decay-steps",
        str(STEPS),
    ]
    if case.get("--optimizer", "adamw") in ADAM:
        argv += ["--adam-eps", "1e-4"]
    if case.get("sft"):
        argv += ["--data", sft_data(work), "--sft-keys", "prompt,response"]
    for k, v in case.items():
        if not k.startswith("--"):
            continue
        if v is True:
            argv.append(k)
        else:
            argv += [k, str(v)]
    if save is not None:
        argv += ["--save", str(save)]
    return argv


def one_process(case: dict) -> dict:
    """The same case on one process: no layout flag, no recomputation."""
    return {
        k: v
        for k, v in case.items()
        if k not in LAYOUT_FLAGS and k not in LAYOUT_SWITCHES and k != "resume"
    }


def splits_tokens(case: dict) -> bool:
    """Whether a rank routes fewer tokens of a micro-batch than one process does: cp, or
    sequence parallelism without expert tensor parallelism (each tp rank routes its slice)."""
    sp_split = case.get("--sequence-parallel") and case.get("--expert-tensor-parallel-size", 1) == 1
    return case.get("--cp", 1) > 1 or bool(sp_split and case.get("--tp", 1) > 1)


def special_reference(case: dict) -> dict:
    """The layout flags the reference keeps where one process is not the same computation:

    - PowerSGD compresses each gradient matrix as this rank holds it (a tp shard, an ep
      block) and only where the dp x cp group has more than one rank; its result is linear in
      the group's sum of gradients and residuals, so any dp x cp split of the same batch gives
      the same result to fp32 rounding. The reference keeps tp, ep and expert tp, and runs
      dp x cp as dp (cp 1, pp 1, ZeRO 0, no sequence parallelism, no recomputation).
    - a capacity factor caps each expert at ceil(factor x T x k / E) of the T tokens a rank
      routes: under cp, or sequence parallelism at expert tp 1, T is a slice of the micro-
      batch and other assignments are dropped than at one process (a different model of the
      same run, not a rounding). The reference keeps the flags that slice the tokens (cp and
      its communication; tp, sequence parallelism and expert tp) and drops the rest.
    - --fp8: the casts take the same scales in every layout (the amaxes are reduced over tp
      and cp), but a cast turns an fp32 rounding difference at a float8 rounding boundary
      into a float8 step (2^-3 relative in e4m3, 2^-2 in e5m2), so the layouts that sum the
      activations or their gradients in another fp32 order (tp's reductions and sequence
      parallelism, cp's attention) are not fp32-equal under float8 (mixtral-tiny cp 2 alone:
      3e-5 in the logs, equal to 1e-7 without --fp8). (The float8 linears are chosen by
      their whole dims, the same at every tp; a tp splitting one into shards that are not
      multiples of 16 is refused: llama-tiny's 176-wide MLP at tp 2 under --fp8-layers all.)
      The reference keeps tp, sequence parallelism, expert tp, cp and its communication.
      Tensorwise's scale (448 / a tensor's amax) is no power of two, so one ulp on a weight's
      largest entry moves every element's cast: an fp32 difference in the weights from any
      other order of the gradients' sum then shows (llama-tiny dp 2 with ZeRO-2, which
      reduces each micro-batch, 1.8e-3 in step 2's grad norm, ZeRO-2's fp32 run 7e-8;
      gpt2-tiny dp 2 or pp 2, the micro-batches' sum or the tied embedding's halves, 6e-5).
      Rowwise's scales are powers of two and absorb the scale's move (0.0 in all those), but
      not an element of its own at a float8 rounding boundary (bert-tiny tp 2 x cp 2 x dp 2
      under ZeRO-2 or ZeRO-3: 3.1e-4 in a bias under Adam by step 3, 0.0 with ZeRO-3 kept),
      nor, on a mixture of experts, a float8 step that sends a token to other experts
      (qwen3-moe-tiny pp 2 under gpipe at micro-batch 2, whose fp32 weights differ from one
      process by 8e-9, and by 0.0 under 1f1b, the backwards in the same order: rowwise 6.6e-2
      after two steps). So an --fp8 reference keeps dp
      (and --grad-bucket-mb: at dp 4 the buckets order the all-reduce's sums, bert-tiny
      4.6e-5 in step 3's grad norm; and --grad-compression / --grad-reduce-dtype, whose
      rounding of the sum float8 magnifies: qwen3-moe-tiny tp 2 x dp 2 x cp 2 x ep 2 with
      fp16 compression under tensorwise, 4.1e-3 in step 3's grad norm, seed 8007; with ep
      too, which reduces the experts' gradients over other groups: 3e-6 in step 1's), ZeRO-2 and ZeRO-3 (and --zero3-reduce micro-batch:
      qwen3-moe-tiny dp 2 x cp 2 ZeRO-3 under LAMB and a capacity factor, fp32 weights 3e-8
      from ZeRO-0's, two tokens to other experts in step 3), and on a tied or MoE model pp
      with its schedule too. Under GPipe the chunked loss makes its gradients in the
      backward, from the per-token losses (several are in flight), where every other schedule
      makes them in the forward and scales them after the head's matmuls (`Stage.
      loss_grads_in_forward`): fp32's rounding differs (llama-tiny pp 2, SFT: 1.8e-7 in step
      1's grad norm, 0.0 under 1f1b), and float8 of any recipe magnifies it (rowwise 8.4e-3
      by step 3): an --fp8 reference of a GPipe case keeps pp and the schedule. What stays
      checked is that pp, ZeRO, ep, recomputation and a resume change nothing under float8
      (`run_case` checks both runs name the same float8 linears).
      Every run is on one thread (`run_cli`), as each forked rank is: two threads split the
      emulated products' sums otherwise (llama-tiny dp 2 differed by 2.3e-5 from a two-
      thread reference, by 0.0 from a one-thread one).
    {} where the one-process reference is the same computation."""
    keep: dict = {}
    if case.get("--fp8", "off") != "off":
        for k in FP8_KEEP:
            if k in case:
                keep[k] = case[k]
        moe = case["model"] in MOE  # a float8 step moves a token to other experts
        # see above: what sums the gradients in another order shows under every recipe
        if case.get("--dp", 1) > 1:
            keep["--dp"] = case["--dp"]
            for k in ("--grad-bucket-mb", "--grad-compression", "--grad-reduce-dtype"):
                if k in case:  # the buckets order the all-reduce's sums; a compressed one
                    keep[k] = case[k]  # rounds them, the experts' over ep's groups
            if "--ep" in case and ("--grad-compression" in keep or "--grad-reduce-dtype" in keep):
                keep["--ep"] = case["--ep"]
        if case.get("--zero") in (2, 3) or case.get("--zero3-reduce") == "micro-batch":
            keep["--zero"] = case["--zero"]
            if "--zero3-reduce" in case:
                keep["--zero3-reduce"] = case["--zero3-reduce"]
        if (case["model"] in TIED or moe) and case.get("--pp", 1) > 1:
            for k in ("--pp", "--schedule", "--virtual-stages"):  # its order with them
                if k in case:
                    keep[k] = case[k]
        gpipe = case.get("--schedule") == "gpipe" and case.get("--pp", 1) > 1
        if gpipe and case.get("--loss-chunk-tokens", 1):  # see above: its loss's other path
            for k in ("--pp", "--schedule"):
                keep[k] = case[k]
    if case.get("--moe-capacity-factor") and splits_tokens(case):
        for k in ("--cp", "--cp-comm-type"):
            if k in case:
                keep[k] = case[k]
        if case.get("--sequence-parallel") and case.get("--tp", 1) > 1:
            for k in ("--tp", "--sequence-parallel", "--expert-tensor-parallel-size"):
                if k in case:
                    keep[k] = case[k]
    if case.get("--grad-compression") == "powersgd":
        for k in ("--tp", "--ep", "--expert-tensor-parallel-size"):
            if k in case:
                keep[k] = case[k]
        dp_cp = case.get("--dp", 1) * case.get("--cp", 1)
        keep["--dp"] = dp_cp // keep.get("--cp", 1)
    return keep


def reference_case(case: dict) -> dict:
    """The run `case` is compared with: one process (`one_process`), or where that is another
    computation the smallest layout that is the same one (`special_reference`)."""
    return {**one_process(case), **special_reference(case)}


def fp16_wire(case: dict) -> bool:
    """Whether the case reduces its loss-scaled gradients over a wire of fp16's range: fp16
    autocast at dp x cp > 1 with the default (fp16) or an fp16 --grad-reduce-dtype, without
    ZeRO-3 (which reduces in fp32) or --grad-compression. Such a reduction overflows where a
    scaled gradient or its sum passes 65,504, and skips a step that one process, whose fp32
    gradients cross no wire, applies (docs/guides/precision-zero.md)."""
    return (
        case.get("--precision") == "fp16"
        and case.get("--grad-reduce-dtype", "auto") in ("auto", "fp16")
        and case.get("--dp", 1) * case.get("--cp", 1) > 1
        and case.get("--zero", 0) != 3
        and "--grad-compression" not in case
    )


def tolerance(case: dict) -> float:
    """The relative bound on the logged numbers, from the case's inexact mode:

    - bf16 autocast: BF16_TOL (its products round to 8 bits, summed in other orders);
    - fp16 autocast (loss scaling exact: powers of two): FP16_TOL, the same bound at fp16's
      11 bits (unit roundoff 2^-11 against bf16's 2^-8);
    - --grad-compression fp16 / bf16, and --grad-reduce-dtype fp16 / bf16 (the same cast of
      the reduction, in place): each element of the dp average is within
      (dp + 1) u sum_r |g_r| of the exact one (data_parallel/compression.py), <= 5u at
      dp x cp <= 4, so one gradient's relative error is ~5u: 2.4e-3 (fp16), 2e-2 (bf16) on
      the gradient norm, the same tolerances;
    - fp8 emulation, PowerSGD, capacity drops: FP32_TOL against `reference_case`, which is
      the same computation (float8: the same scales and the same fp32 sums upstream of each
      cast, the products fp32).
    In the inexact modes the MoE routing counts (DISCRETE) are not compared.
    The final weights are compared with the reference only at FP32_TOL (Adam's per-element
    amplification of a gradient's rounding is unbounded in the inexact modes)."""
    tol = FP32_TOL
    for mode in (
        case.get("--precision"),
        case.get("--grad-compression"),
        case.get("--grad-reduce-dtype"),
    ):
        tol = max(tol, {"bf16": BF16_TOL, "fp16": FP16_TOL}.get(mode or "", FP32_TOL))
    return tol


def dump_ranks(directory: Path) -> None:
    """Make every rank of the runs this process starts write, after each `Engine.save`, the
    parameters and buffers it holds (whole under ZeRO-3: `params_whole`; exact under ZeRO-1 /
    2: `exact_params`) to DIRECTORY/rank{R}.safetensors, with what places each in the whole
    tensor (tp dim and parts, ep block, tied copy). The workers are forked from this process,
    so they inherit the wrapper; the checkpoint itself is untouched (it keeps dp rank 0's and
    cp rank 0's copy only: the other replicas are what this adds)."""
    from megapar.training.engine import Engine

    save = Engine.save

    def save_and_dump(self, path, extra=None):
        out = save(self, path, extra)
        import torch
        from safetensors.torch import save_file

        from megapar.checkpoint.stage_tensors import ep_shard, is_routed_expert, stage_tensors
        from megapar.tensor_parallel.partition import full_shape, tp_dim, tp_parts

        tensors, params = {}, {}
        with self.params_whole(), torch.no_grad():
            for name, t, buffer in stage_tensors(self.model):
                tensors[name] = t.detach().float().cpu().clone().contiguous()
                params[name] = {
                    "tp_dim": tp_dim(t),
                    "parts": tp_parts(t),
                    "full": list(full_shape(t)),
                    "expert": is_routed_expert(t),
                    "ep": list(ep_shard(t)),
                    "tied_to": getattr(t, "tied_to", None),
                    "buffer": buffer,
                }
        m = self.mesh
        where = {k: getattr(m, k, 0) for k in ("rank", "tp_rank", "pp_rank", "dp_rank", "cp_rank")}
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            tensors,
            str(directory / f"rank{m.rank}.safetensors"),
            metadata={"fuzz": json.dumps({**where, "params": params})},
        )
        return out

    Engine.save = save_and_dump


def rank_diff(dump: Path, whole: dict) -> tuple[float, str]:
    """Largest per-tensor relative difference between what each rank holds (`dump_ranks`) and
    its part of the whole tensors `whole` (a checkpoint read whole, `read_weights`): the part
    cut by the shard rule a load uses (`shard_of`: the tp shard of each of `parts`, zero
    padded; a routed expert's ep block, then its tp slice under expert tp), compared on the
    entries that are the whole tensor's (not tp's or the reference's vocabulary padding)."""
    import torch
    from safetensors import safe_open

    from megapar.tensor_parallel.partition import shard_of

    files = sorted(dump.glob("rank*.safetensors"))
    if not files:
        return math.inf, f"no rank's weights in {dump}"
    worst, name_of = 0.0, ""
    for f in files:
        with safe_open(str(f), "pt") as h:
            info = json.loads(h.metadata()["fuzz"])
            for name, m in info["params"].items():
                got = h.get_tensor(name)
                key = m["tied_to"] or name
                if key not in whole:
                    return math.inf, f"{f.stem} {name}: not in the whole tensors"
                want = whole[key].float()
                valid = torch.ones_like(want)
                dim = m["tp_dim"]
                if m["expert"]:
                    ep_rank, ep = m["ep"]
                    n = want.shape[0] // ep
                    want, valid = (t.narrow(0, ep_rank * n, n) for t in (want, valid))
                if dim is not None:
                    if not m["expert"]:  # the reference's own vocabulary padding cut off
                        n = min(want.shape[dim], m["full"][dim])
                        want, valid = (t.narrow(dim, 0, n) for t in (want, valid))
                    want, valid = (
                        shard_of(t, dim, got.shape[dim], info["tp_rank"], m["parts"])
                        for t in (want, valid)
                    )
                if want.dim() != got.dim():
                    return (
                        math.inf,
                        f"{f.stem} {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}",
                    )
                idx = tuple(slice(0, min(a, b)) for a, b in zip(got.shape, want.shape, strict=True))
                g, w, v = got[idx], want[idx], valid[idx]
                denom = float((w * v).norm())
                num = float(((g - w) * v).norm())
                e = num / denom if denom > 0 else num
                if e > worst:
                    worst, name_of = e, f"{f.stem} {name}"
    return worst, name_of


def run_cli(
    argv: list[str], directory: Path, timeout_s: float, dump: Path | None = None
) -> tuple[int | str, str, str]:
    """megapar-train ARGV in a forked child of this process (which has imported megapar's
    command): (exit code or 'timeout', stdout, stderr); with `dump`, every rank's weights
    are written there after the final save (`dump_ranks`)."""
    directory.mkdir(parents=True, exist_ok=True)
    out, err = directory / "stdout.txt", directory / "stderr.txt"
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            for target, path in ((1, out), (2, err)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, target)
                os.close(fd)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.setpgid(0, 0)  # its own group: a timeout ends its workers too
            import torch

            # one thread, as every forked worker (`launcher`): a one-process reference's
            # matmuls then split their sums as the layout's ranks do (two threads moved
            # --fp8's emulated products by an fp32 rounding, which float8 casts amplify)
            torch.set_num_threads(1)
            from megapar.cli.train import main

            if dump is not None:
                dump_ranks(dump)

            code = main(argv) or 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code & 0xFF)
    deadline = time.monotonic() + timeout_s
    rc: int | str
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            rc = "timeout"
            break
        time.sleep(0.05)
    else:
        rc = os.waitstatus_to_exitcode(done[1])
    return rc, out.read_text(errors="replace"), err.read_text(errors="replace")


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_weights(root: Path) -> dict:
    """Every parameter of the checkpoint under `root`, whole (tp shards joined)."""
    from megapar.checkpoint.format import LATEST, MANIFEST, ShardReader

    step_dir = root / (root / LATEST).read_text().strip()
    manifest = json.loads((step_dir / MANIFEST).read_text())
    reader = ShardReader(step_dir, manifest)
    return {name: reader.shard(name, None, 1, 0, None).float() for name in manifest["tensors"]}


def rel(a: float, b: float) -> float:
    """|a - b| / |b|; inf where either is not finite (two diverged runs are no match)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(b), 1e-12)


def compare(got: list[dict], ref: list[dict], exact: bool = True) -> tuple[float, list[str]]:
    """(largest relative difference, one description per compared number) over every step's
    logged results: loss, grad_norm, val_loss, z_loss, the MoE terms (a list, as the tokens
    each expert received, entry by entry)."""
    worst, where = 0.0, []
    if len(got) != len(ref):
        return math.inf, [f"{len(got)} logged steps, one process {len(ref)}"]
    if not ref:  # nothing to compare is no pass
        return math.inf, ["no logged steps to compare"]

    def numbers(rec: dict) -> dict:
        out = {}
        for k, v in rec.items():
            if k in NOT_COMPARED or isinstance(v, bool) or (not exact and k in DISCRETE):
                continue
            if isinstance(v, int | float):
                out[k] = float(v)
            elif isinstance(v, list) and all(isinstance(x, int | float) for x in v):
                out.update({f"{k}[{i}]": float(x) for i, x in enumerate(v)})
        return out

    for g, r in zip(got, ref, strict=True):
        gn, rn = numbers(g), numbers(r)
        for k in sorted(rn):
            if k not in gn:
                where.append(f"step {r['step']}: {k} not logged (rel inf)")
                worst = math.inf
                continue
            e = rel(gn[k], rn[k])
            where.append(f"step {r['step']} {k}: {gn[k]!r} vs {rn[k]!r} (rel {e:.2e})")
            worst = max(worst, e)
        if not rn:
            where.append(f"step {r.get('step')}: no number logged to compare (rel inf)")
            worst = math.inf
    return worst, where


def skipped_on_one_side(where: list[str]) -> bool:
    """Whether `compare`'s lines show a step skipped on one side only: a logged loss scale that
    differs, or a number one side did not log (every compared line is in `where`, the equal
    loss scales too)."""
    for line in where:
        if "not logged" in line:
            return True
        found = re.search(r"\(rel ([^)]+)\)", line) if "loss_scale" in line else None
        if found and float(found.group(1)) > 0:
            return True
    return False


def weight_diff(got: dict, ref: dict) -> tuple[float, str]:
    """Largest per-tensor relative difference (norm of the difference / norm of the reference,
    on the shapes' common part: tp pads the vocabulary to another multiple)."""
    worst, name = 0.0, ""
    for n, r in ref.items():
        if n not in got:
            return math.inf, f"{n} missing"
        g = got[n]
        idx = tuple(slice(0, min(a, b)) for a, b in zip(g.shape, r.shape, strict=True))
        g, r = g[idx], r[idx]
        denom = float(r.norm())
        e = float((g - r).norm()) / denom if denom > 0 else float((g - r).norm())
        if e > worst:
            worst, name = e, n
    return worst, name


def in_child(fn) -> tuple[float, str]:
    """`fn()` (a (difference, where) pair) computed in a forked child: this process must never
    run a torch kernel itself, or its OpenMP pool would hang the one-process runs it forks."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            res = list(fn())
        except Exception as exc:  # noqa: BLE001 - recorded as the case's failure
            res = [math.inf, f"reading the checkpoints: {exc!r}"]
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    diff, where = json.loads(text) if text else (math.inf, "the comparing child died")
    return float(diff), where


def fp8_linears(stdout: Path) -> set[str]:
    """The block linears a run's --fp8 line says run in float8 (their names, not their
    local dims)."""
    import re

    text = stdout.read_text(errors="replace") if stdout.exists() else ""
    m = re.search(r"linears in float8 \(([^)]*)\)", text)
    return {part.split()[0] for part in m.group(1).split(", ")} if m else set()


def key_of(case: dict) -> str:
    return hashlib.sha1(json.dumps(case, sort_keys=True).encode()).hexdigest()[:16]


def one_line(stderr: str) -> tuple[str, bool]:
    """The refusal's line, and whether it is one clear line (no traceback, one line)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    clear = len(lines) == 1 and "Traceback" not in stderr
    return (lines[-1] if lines else "(empty stderr)"), clear


def reference(case: dict, out: Path, weights: bool) -> dict:
    """The one-process run of `case` (cached under OUT/ref)."""
    rcase = reference_case(case)
    d = out / "ref" / key_of(rcase)
    done = d / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    if d.exists():
        import shutil

        shutil.rmtree(d)
    d.mkdir(parents=True)
    argv = argv_of(rcase, out, d / "ckpt" if weights else None, d / "log.jsonl")
    rc, _, err = run_cli(argv, d, timeout_of(rcase))
    res = {"rc": rc, "stderr_tail": err[-2000:], "argv": argv}
    done.write_text(json.dumps(res))
    return res


def run_case(case: dict, out: Path, index: int, weights: bool) -> dict:
    """Run `case` and its reference; the record of its outcome. With `weights` the final
    weights are compared: every rank's (`dump_ranks`) with its own run's checkpoint (a
    replica that drifted from the one the checkpoint keeps; any mode, FP32_TOL), and, where
    the tolerance is FP32_TOL, the checkpoint and every rank's with the reference's."""
    tol = tolerance(case)
    saves = weights
    weights = weights and tol == FP32_TOL
    rec: dict = {"index": index, "case": case, "tol": tol}
    t0 = time.monotonic()
    d = out / "cases" / f"{index:04d}"
    if d.exists():
        import shutil

        shutil.rmtree(d)
    argv = argv_of(case, out, d / "ckpt" if saves else None, d / "log.jsonl")
    rc, err = 0, ""
    if "resume" in case:  # steps 1-2 in the layout case["resume"], saved, resumed in this one
        first = {**one_process(case), **case["resume"]}
        argv1 = argv_of(first, out, d / "ckpt1", d / "log1.jsonl") + ["--max-steps", "2"]
        rec["argv_first"] = "megapar-train " + shlex.join(argv1)
        rc, _, err = run_cli(argv1, d / "first", timeout_of(case))
        argv += ["--load", str(d / "ckpt1")]
    rec["argv"] = "megapar-train " + shlex.join(argv)
    if rc == 0:
        rc, _, err = run_cli(argv, d, timeout_of(case), d / "ranks" if saves else None)
    rec["rc"] = rc
    if rc == 2:
        line, clear = one_line(err)
        rec.update(outcome="refused", line=line, clear=clear)
    elif rc != 0:
        rec.update(outcome="timeout" if rc == "timeout" else "crash", stderr_tail=err[-3000:])
    else:
        ref = reference(case, out, saves)
        rd = out / "ref" / key_of(reference_case(case))
        if ref["rc"] != 0:
            rec.update(outcome="reference-failed", stderr_tail=ref["stderr_tail"])
        else:
            got = read_log(d / "log1.jsonl") + read_log(d / "log.jsonl")
            worst, where = compare(got, read_log(rd / "log.jsonl"), tol == FP32_TOL)
            if case.get("--fp8", "off") != "off":  # the same linears in float8 in both
                ours, theirs = fp8_linears(d / "stdout.txt"), fp8_linears(rd / "stdout.txt")
                if ours != theirs:
                    worst = math.inf
                    where.insert(0, f"float8 linears {sorted(ours)} vs {sorted(theirs)} (rel inf)")
            rec["max_rel"] = worst
            rec["details"] = [
                w
                for w in where
                if "rel" not in w or float(w.rsplit("rel ", 1)[1].rstrip(")")) > tol
            ][:12]
            if saves:
                rec["replica_rel"], rec["replica_worst"] = in_child(
                    lambda: rank_diff(d / "ranks", read_weights(d / "ckpt"))
                )
            if weights:
                rec["weights_rel"], rec["weights_worst"] = in_child(
                    lambda: weight_diff(read_weights(d / "ckpt"), read_weights(rd / "ckpt"))
                )
                rec["ranks_rel"], rec["ranks_worst"] = in_child(
                    lambda: rank_diff(d / "ranks", read_weights(rd / "ckpt"))
                )
            weights_bad = weights and max(rec["weights_rel"], rec["ranks_rel"]) > tol
            bad = worst > tol or weights_bad or (saves and rec["replica_rel"] > FP32_TOL)
            rec["outcome"] = "mismatch" if bad else "pass"
            replicas_ok = not saves or rec["replica_rel"] <= FP32_TOL
            half = case.get("--precision") in ("fp16", "bf16")  # its logged numbers too
            fp8 = case.get("--fp8", "off") != "off"  # (float8 casts of the weights too)
            adam = case.get("--optimizer", "adamw") in ADAM
            if bad and (worst <= tol or half or fp8) and replicas_ok and adam:
                # weights alone (or a 16-bit or float8 run's logged numbers, which Adam's and
                # Muon's bf16 rounding noise moves as it moves weights: llama-tiny pp 2 zb-v
                # --compile Muon float8, 5.7e-3, passing with AdamW): the same case with SGD,
                # whose update is linear in the gradient, at the same tolerance
                sgd = {
                    k: v for k, v in case.items() if k not in ("--optimizer", "--muon-distributed")
                }
                sub = run_case({**sgd, "--optimizer": "sgd"}, out, index + 10000, True)
                rec["sgd_check"] = {k: sub.get(k) for k in ("outcome", "max_rel", "weights_rel")}
                if sub["outcome"] == "pass":
                    rec["outcome"] = "adam-noise"
            if bad and fp16_wire(case) and skipped_on_one_side(where):
                # a step skipped on one side: the same case reduced in fp32, which has no range
                sub = run_case({**case, "--grad-reduce-dtype": "fp32"}, out, index + 20000, True)
                rec["fp32_reduce_check"] = {k: sub.get(k) for k in ("outcome", "max_rel")}
                if sub["outcome"] == "pass":
                    rec["outcome"] = "fp16-range"
            import shutil

            if rec["outcome"] != "mismatch":  # kept for the triage of a mismatch
                shutil.rmtree(d / "ckpt", ignore_errors=True)
                shutil.rmtree(d / "ranks", ignore_errors=True)
            shutil.rmtree(d / "ckpt1", ignore_errors=True)
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


def read_records(path: Path):
    """The records of a results.jsonl, a line that is no record (cut short by a run stopped while
    writing it or a full disk, another JSON value, one without its index and case) left out with
    a note; a file that is not UTF-8 text, or not there, refused in one line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"layout_fuzz: --replay {path}: not a results file ({exc})") from None
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            print(f"layout_fuzz: {path}:{number} is no whole record (cut short?); left out")
            continue
        if not (isinstance(record, dict) and {"index", "case"} <= set(record)):
            print(f"layout_fuzz: {path}:{number} is no record (no index and case); left out")
            continue
        yield record


def parse_case(text: str) -> dict:
    """A case from `--args` text: megapar-train's flags and their values, and --model NAME,
    --sft (the SFT data), --window N (mistral-win's / qwen3-win's window), --seq N."""
    toks = shlex.split(text)
    case: dict = {}
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == "--model":
            case["model"] = toks[i + 1]
            i += 2
        elif t == "--sft":
            case["sft"] = True
            i += 1
        elif t in ("--window", "--seq"):  # a windowed model's window, the sequence length
            case[t[2:]] = int(toks[i + 1])
            i += 2
        elif t in LAYOUT_SWITCHES or i + 1 == len(toks) or toks[i + 1].startswith("--"):
            case[t] = True
            i += 1
        else:
            v = toks[i + 1]
            case[t] = (
                int(v)
                if v.lstrip("-").isdigit()
                else (float(v) if v.replace(".", "", 1).replace("e-", "", 1).isdigit() else v)
            )
            i += 2
    case.setdefault("model", "gpt2-tiny")
    if "--global-batch-size" not in case:  # one the layout divides, the reference's too
        # (megapar-train's default adapts to the layout: 12 at dp 3, while one process took 16)
        mbs, dp, cp = (case.get(k, 1) for k in ("--micro-batch-size", "--dp", "--cp"))
        case["--global-batch-size"] = mbs * dp * cp * 4
    return case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10, help="cases to draw")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed")
    ap.add_argument("--out", default="/tmp/layout_fuzz", help="results and references")
    ap.add_argument("--minutes", type=float, default=0, help="stop drawing after (0: no limit)")
    ap.add_argument("--no-weights", action="store_true", help="compare the logs only")
    ap.add_argument("--bf16", action="store_true", help="also draw bf16 cases (BF16_TOL)")
    ap.add_argument("--edges", action="store_true", help="put EDGES on some cases")
    ap.add_argument("--args", help="run this one case instead of drawing")
    ap.add_argument("--replay", help="a results.jsonl to take --case from")
    ap.add_argument("--case", type=int, help="with --replay: the case's index")
    a = ap.parse_args()
    if a.cases < 1:
        ap.error(f"--cases {a.cases}: draw at least 1")
    if a.case is not None and not a.replay:
        ap.error("--case needs --replay RESULTS.jsonl (the case's index there)")
    if a.replay and not Path(a.replay).is_file():
        ap.error(f"--replay {a.replay}: no such file (a results.jsonl a run wrote into --out)")
    if not Path(TOKENIZER).exists():
        print(
            f"layout_fuzz: run it from the repository root ({TOKENIZER} not found)", file=sys.stderr
        )
        return 2
    out = Path(a.out).absolute()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {a.out}: cannot make it ({exc.strerror})")
    import megapar.cli.train  # noqa: F401 - imported once, inherited by every forked run

    if a.args:
        cases = [parse_case(a.args)]
    elif a.replay:
        recs = list(read_records(Path(a.replay)))
        cases = [r["case"] for r in recs if a.case is None or r["index"] == a.case]
        if not cases:
            known = ", ".join(str(r["index"]) for r in recs[:10]) or "none"
            ap.error(f"--replay {a.replay} holds no case {a.case} (its cases: {known})")
    else:
        rng = random.Random(a.seed)
        cases = [draw(rng, a.bf16, a.edges) for _ in range(a.cases)]
    results = out / "results.jsonl"
    start = len(results.read_text().splitlines()) if results.exists() else 0
    t0 = time.monotonic()
    counts: dict[str, int] = {}
    ran = 0
    for i, case in enumerate(cases):
        if a.minutes and time.monotonic() - t0 > a.minutes * 60:
            break
        ran += 1
        rec = run_case(case, out, start + i, not a.no_weights)
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        extra = rec.get("line") or (
            f"max_rel {rec['max_rel']:.2e} weights {rec.get('weights_rel', 0):.2e}"
            f" ranks {rec.get('ranks_rel', 0):.2e} replicas {rec.get('replica_rel', 0):.2e}"
            if "max_rel" in rec
            else (rec.get("stderr_tail") or "")[-300:]
        )
        print(
            f"[{start + i}] {rec['outcome']:9s} {rec['seconds']:6.1f}s "
            f"{json.dumps(case)}\n      {extra}",
            flush=True,
        )
    cpu = os.times()
    print(
        "layout_fuzz:",
        ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        f"({time.monotonic() - t0:.0f} s, CPU {cpu.children_user + cpu.children_system:.0f} s"
        " in the runs)"
        + (
            f"; {ran} of {len(cases)} drawn cases run, --minutes {a.minutes:g} ended the rest"
            if ran < len(cases)
            else ""
        ),
    )
    failed = ("mismatch", "crash", "timeout", "reference-failed")  # a failed reference: unchecked
    return 1 if any(k in counts for k in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
