"""`--compile` against eager in every layout megapar runs: parity and no recompiles, per layout.

Each case forks its own gloo world (`megapar.launcher.run_local`, so dynamo's counters and
caches start empty) and trains a tiny transformers model (GPT-2, a grouped-query Llama or BERT;
4 layers, hidden 32, or 64 where float8 needs it) through `megapar.prepare` twice, eager and
then with `compile=True`, `--steps` optimizer steps each on the same batches. Per case it
checks, on every rank:

- parity: each step's loss and the final weights of the compiled run equal the eager run's
  (relative error max |a - b| / max |b|) in fp32 within 1e-5. In bf16 / fp16 and float8 the
  compiled blocks round elsewhere than eager ops do (Inductor rounds a fused kernel's result
  once, where eager rounds each op's output), and float8 turns an fp32 rounding difference
  (~1e-7) into a whole float8 step where an operand sits on a rounding boundary
  (docs/guides/fp8.md), so there the yardstick is fp32: the same layout is also trained eagerly
  in fp32, and the compiled run's distance from it (losses, weights) must be at most
  `LOW_PRECISION_FACTOR` times the eager run's: compiled bf16 / fp16 / float8 trains as close
  to fp32 as eager does;
- no recompiles: dynamo's frame, graph and aot_autograd counters unchanged from step 2 to the
  last step (and something was compiled at all);
- the graph breaks dynamo recorded (printed; test_compile.py holds them per layout).

The cases: the layouts tests/test_compile.py runs, here for both GPT-2 and Llama (tp 2 x pp 2
under 1F1B and ZB-H1, dp 2 under ZeRO-3, cp 2, one process with full recomputation), and what
no test compiles (GPipe, interleaved, ZB-V, DualPipeV, ZeRO offload of the optimizer and of the
parameters, BERT, bf16 and fp16, `--fp8` in torchao's emulation), and mixture-of-experts models
(Mixtral, Qwen3-MoE: one process, ep 2, tp 2 x pp 2, cp 2 x dp 2 x ep 2 under ZeRO-3, capacity
drops and the balancing bias). `dry-run` runs `megapar-train
--dry-run --json` with and without `--compile` (the rehearsal runs the eager blocks: its
per-rank figures must be the same).

    python benchmarks/vs/compile_layouts.py               # every case (~20 min on 2 cores)
    python benchmarks/vs/compile_layouts.py --only zb-v   # the cases whose name contains it
    python benchmarks/vs/compile_layouts.py --list

Exit code 0 when every case passes, 1 otherwise. Too slow for the test suite (each case
compiles its blocks afresh: tens of seconds on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import output_file, write_json, positive  # noqa: E402

VOCAB, SEQ, G = 96, 8, 8
FP32_TOL = 1e-5
LOW_PRECISION_FACTOR = 2.0
"""bf16 and float8: the compiled run's distance from the fp32 run at most this times the eager
run's (see the module docstring)."""
ZERO_FLOOR = 1e-7  # below this a reference is zero (tests/tp_utils.py's rule)
ADAM_EPS = 1e-4  # tests/test_compile.py's reason: gradients that are fp32 noise take no lr steps
EAGER_ON_PURPOSE = ("_apply_eagerly", "_deferred_linear", "LayerAttention._eager",
                    "MoE._routed_eagerly")
"""The functions the compiled blocks leave eager (tp regions, zero-bubble linears, cp attention,
a MoE layer's routed experts)."""


@dataclass
class Case:
    """One comparison: a model, its world size and `megapar.prepare`'s layout keywords."""

    name: str
    model: str
    """gpt2, llama, bert, llama64 (hidden 64: float8's size rule converts its linears),
    mixtral or qwen3moe (its first layer dense, the others MoE)."""
    ranks: int
    layout: dict = field(default_factory=dict)


CASES = [
    # tests/test_compile.py's layouts, here for both models
    Case("gpt2 tp2 x pp2 1f1b sp selective", "gpt2", 4,
         dict(tp=2, pp=2, sequence_parallel=True, recompute="selective")),
    Case("llama tp2 x pp2 1f1b", "llama", 4, dict(tp=2, pp=2)),
    Case("gpt2 tp2 x pp2 zb-h1", "gpt2", 4, dict(tp=2, pp=2, schedule="zb-h1")),
    Case("llama tp2 x pp2 zb-h1 sp", "llama", 4,
         dict(tp=2, pp=2, schedule="zb-h1", sequence_parallel=True)),
    Case("gpt2 dp2 zero3", "gpt2", 2, dict(zero=3)),
    Case("llama dp2 zero3", "llama", 2, dict(zero=3)),
    Case("gpt2 cp2", "gpt2", 2, dict(cp=2)),
    Case("llama cp2 x dp2 zero3 full", "llama", 4, dict(cp=2, zero=3, recompute="full")),
    Case("gpt2 one process full", "gpt2", 1, dict(recompute="full")),
    Case("llama one process full", "llama", 1, dict(recompute="full")),
    # the schedules no test compiles
    Case("gpt2 pp2 gpipe", "gpt2", 2, dict(pp=2, schedule="gpipe")),
    Case("llama pp2 interleaved v2", "llama", 2,
         dict(pp=2, schedule="interleaved", virtual_stages=2)),
    Case("gpt2 pp2 zb-v", "gpt2", 2, dict(pp=2, schedule="zb-v")),
    Case("llama pp2 dualpipev", "llama", 2, dict(pp=2, schedule="dualpipev")),
    # ZeRO offload
    Case("gpt2 dp2 zero1 offload-optimizer", "gpt2", 2, dict(zero=1, offload_optimizer=True)),
    Case("llama dp2 zero3 offload-params", "llama", 2,
         dict(zero=3, offload_optimizer=True, offload_params=True)),
    # BERT
    Case("bert one process", "bert", 1, {}),
    Case("bert tp2 x pp2", "bert", 4, dict(tp=2, pp=2)),
    # bf16
    Case("gpt2 dp2 zero2 bf16", "gpt2", 2, dict(zero=2, precision="bf16")),
    Case("llama tp2 x pp2 bf16", "llama", 4, dict(tp=2, pp=2, precision="bf16")),
    Case("gpt2 dp2 zero1 fp16", "gpt2", 2, dict(zero=1, precision="fp16")),
    # float8 (torchao's emulation on the CPU)
    Case("llama64 one process fp8 tensorwise", "llama64", 1,
         dict(fp8="tensorwise", fp8_emulate=True, fp8_layers="all")),
    Case("llama64 tp2 fp8 tensorwise", "llama64", 2,
         dict(tp=2, fp8="tensorwise", fp8_emulate=True, fp8_layers="all")),
    Case("llama64 tp2 sp fp8 rowwise", "llama64", 2,
         dict(tp=2, sequence_parallel=True, fp8="rowwise", fp8_emulate=True, fp8_layers="all")),
    Case("llama64 cp2 fp8 tensorwise", "llama64", 2,
         dict(cp=2, fp8="tensorwise", fp8_emulate=True, fp8_layers="all")),
    # mixture of experts: the routed experts run eagerly (their rows per expert are
    # data-dependent shapes), the router, attention and norms compiled
    Case("mixtral one process", "mixtral", 1, {}),
    Case("mixtral dp2 ep2", "mixtral", 2, dict(ep=2)),
    Case("mixtral tp2 x pp2 zb-h1 sp", "mixtral", 4,
         dict(tp=2, pp=2, schedule="zb-h1", sequence_parallel=True)),
    Case("mixtral cp2 x dp2 ep2 zero3 full", "mixtral", 4,
         dict(cp=2, ep=2, zero=3, recompute="full")),
    Case("qwen3moe one process full", "qwen3moe", 1, dict(recompute="full")),
    Case("qwen3moe dp2 ep2 zero1 capacity bias", "qwen3moe", 2,
         dict(ep=2, zero=1, moe_capacity_factor=1.0, moe_bias_update_rate=1e-3)),
]
DRY_RUN = "dry-run gpt2-tiny tp2 x pp2 x dp2 zero1"
DRY_RUN_ARGS = ["--model", "gpt2-tiny", "--tp", "2", "--pp", "2", "--world-size", "8",
                "--zero", "1", "--dry-run", "--json", "--dry-run-ranks", "all"]


def build_model(kind: str):
    """A tiny transformers model, the same weights on every rank (seeded)."""
    import transformers as tf

    torch.manual_seed(3)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))
    if kind in ("llama", "llama64"):
        hidden = 64 if kind == "llama64" else 32
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=16, tie_word_embeddings=kind == "llama"))
    if kind == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02))
    if kind == "qwen3moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=16, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[0], router_aux_loss_coef=0.01))
    raise ValueError(kind)


def batches(kind: str, n: int) -> list[dict[str, torch.Tensor]]:
    """n global batches of G x SEQ (BERT's with token types and padding)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (G, SEQ), generator=gen)
        batch = {"input_ids": x, "labels": (x * 3 + 1) % VOCAB}
        if kind == "bert":
            mask = torch.ones(G, SEQ, dtype=torch.long)
            mask[::3, -2:] = 0
            batch["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(G, SEQ).clone()
            batch["attention_mask"] = mask
        out.append(batch)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; below ZERO_FLOOR the reference counts as zero (absolute error)."""
    a, b = a.detach().double(), b.detach().double()
    scale, diff = b.abs().max().item(), (a - b).abs().max().item()
    if scale < ZERO_FLOOR:
        return 0.0 if diff < ZERO_FLOOR else float("inf")
    return diff / scale


def dynamo_counts() -> tuple[int, ...]:
    from torch._dynamo.utils import counters

    return (counters["frames"]["total"], counters["frames"]["ok"],
            counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"])


def train(case: Case, compile_: bool, steps: int, **override):
    """(losses, final weights, dynamo counts after each step, --fp8's summary) of one run."""
    import megapar

    engine = megapar.prepare(build_model(case.model), micro_batch_size=2, lr=3e-3,
                             weight_decay=0.1, clip_grad=0.5, adam_eps=ADAM_EPS,
                             compile=compile_, **{**case.layout, **override})
    losses, counts = [], []
    for batch in batches(case.model, steps):
        losses.append(engine.train_step(batch))
        counts.append(dynamo_counts())
    with engine.params_whole():
        weights = {n: p.detach().float().clone() for n, p in engine.model.named_parameters()}
    return losses, weights, counts, engine.fp8_summary


def low_precision(case: Case) -> bool:
    """bf16, fp16 or float8: compiled and eager differ by more than fp32 rounding (module
    docstring)."""
    return case.layout.get("precision", "fp32") != "fp32" or bool(case.layout.get("fp8"))


def errors(run, ref) -> tuple[float, float, str]:
    """(worst loss error over the steps, worst weight error, that weight's name)."""
    loss = max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(run[0], ref[0]))
    worst = max(run[1], key=lambda n: rel_err(run[1][n], ref[1][n]))
    return loss, rel_err(run[1][worst], ref[1][worst]), worst


def worker(case: Case, steps: int) -> dict:
    """One rank: eager, then compiled (in bf16 / float8 also eager fp32, the yardstick); the
    errors, the counts and the graph breaks."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._inductor.config.compile_threads = 1  # several ranks on few cores
    eager = train(case, False, steps)
    compiled = train(case, True, steps)
    out = dict(zip(("loss_err", "weight_err", "worst"), errors(compiled, eager)))
    if low_precision(case):  # the yardstick: how far eager bf16 / float8 is from fp32
        fp32 = train(case, False, steps, precision="fp32", fp8="off", fp8_emulate=False,
                     fp8_layers="auto")
        out.update(zip(("eager_fp32_loss_err", "eager_fp32_weight_err", "eager_fp32_worst"),
                       errors(eager, fp32)))
        out.update(zip(("compiled_fp32_loss_err", "compiled_fp32_weight_err",
                        "compiled_fp32_worst"), errors(compiled, fp32)))
    return {**out, "eager_compiled": eager[2][-1] != (0, 0, 0, 0), "counts": compiled[2],
            "breaks": dict(counters["graph_break"]), "losses": compiled[0],
            "eager_losses": eager[0], "fp8": compiled[3]}


def check(case: Case, rank: int, r: dict) -> list[str]:
    """What is wrong with one rank's result (nothing: [])."""
    problems = []
    if r["eager_compiled"]:
        problems.append("the eager run compiled something")
    if r["counts"][0][1] == 0:
        problems.append("nothing was compiled")
    if r["counts"][1] != r["counts"][-1]:
        problems.append(f"recompiled after step 2: {r['counts']}")
    if case.layout.get("fp8") and not re.search(r"[1-9]\d* linears? in float8", r["fp8"] or ""):
        problems.append(f"no linear in float8: {r['fp8']}")
    if low_precision(case):  # compiled bf16 / float8 no farther from fp32 than eager's
        for what in ("loss", "weight"):
            got, eager = r[f"compiled_fp32_{what}_err"], r[f"eager_fp32_{what}_err"]
            if got > LOW_PRECISION_FACTOR * eager:
                problems.append(f"compiled {what} {got:.2g} from fp32 > "
                                f"{LOW_PRECISION_FACTOR:g} x eager's {eager:.2g}")
    elif r["loss_err"] >= FP32_TOL or r["weight_err"] >= FP32_TOL:
        problems.append(f"loss {r['loss_err']:.2g}, weight {r['worst']} {r['weight_err']:.2g} "
                        f">= {FP32_TOL:g}")
    return [f"rank {rank}: {p}" for p in problems]


def run_case(case: Case, steps: int) -> dict:
    from megapar.launcher import run_local

    start = time.perf_counter()
    try:
        ranks = run_local(worker, case.ranks, case, steps, timeout_s=1800,
                          env={"MEGAPAR_CPU": "1"})
    except Exception as exc:  # noqa: BLE001 - a failing case is a row of the table
        return {"case": case.name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - start}
    problems = [p for rank, r in enumerate(ranks) for p in check(case, rank, r)]
    reasons = sorted({k for r in ranks for k in r["breaks"]})
    worst = {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_err")}
    return {"case": case.name, "ranks": case.ranks, "ok": not problems, "problems": problems,
            **worst, "frames_ok": [r["counts"][-1][1] for r in ranks],
            "step1_to_2": any(r["counts"][0] != r["counts"][1] for r in ranks),
            "breaks": break_names(reasons), "break_reasons": reasons,
            "losses": ranks[0]["losses"], "eager_losses": ranks[0]["eager_losses"],
            "fp8": ranks[0]["fp8"], "seconds": time.perf_counter() - start}


def dry_run_case() -> dict:
    """`megapar-train --dry-run --json` with and without --compile: the same per-rank figures."""
    start, rows = time.perf_counter(), {}
    for flags in ([], ["--compile"]):
        proc = subprocess.run([sys.executable, "-m", "megapar.cli.train", *DRY_RUN_ARGS, *flags],
                              capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode:
            return {"case": DRY_RUN, "ok": False, "seconds": time.perf_counter() - start,
                    "error": f"exit {proc.returncode} with {flags}: {proc.stderr[-500:]}"}
        rows[bool(flags)] = [json.loads(line) for line in proc.stdout.splitlines()]
    same = rows[False] == rows[True] and len(rows[False]) == 8
    return {"case": DRY_RUN, "ranks": 8, "ok": same, "seconds": time.perf_counter() - start,
            "problems": [] if same else ["the rehearsals' per-rank figures differ"]}


def break_names(reasons) -> list[str]:
    """Dynamo's graph-break reasons, named by the function megapar runs eagerly on purpose
    (docs/guides/training.md lists them), else by the reason's first line."""
    names = set()
    for reason in reasons:
        known = [n for n in EAGER_ON_PURPOSE if n in reason]
        names.update(known or [reason.splitlines()[0][:80]])
    return sorted(names)


def describe(r: dict) -> str:
    if "error" in r:
        return f"| {r['case']} | FAIL: {r['error'][:300]} | | | | {r['seconds']:.0f} |"
    if r["case"] == DRY_RUN:
        return (f"| {r['case']} | {'ok' if r['ok'] else 'FAIL'}: the 8 ranks' JSON "
                f"{'identical' if r['ok'] else 'differs'} | | | | {r['seconds']:.0f} |")
    status = "ok" if r["ok"] else "FAIL: " + "; ".join(r["problems"])[:300]
    changed = "no" if not r["step1_to_2"] else "yes (not after 2)"
    if "eager_fp32_loss_err" in r:
        errs = (f"{r['loss_err']:.1e} / {r['weight_err']:.1e}; from fp32: compiled "
                f"{r['compiled_fp32_loss_err']:.1e} / {r['compiled_fp32_weight_err']:.1e}, "
                f"eager {r['eager_fp32_loss_err']:.1e} / {r['eager_fp32_weight_err']:.1e} "
                f"(<= {LOW_PRECISION_FACTOR:g} x)")
    else:
        errs = f"{r['loss_err']:.1e} / {r['weight_err']:.1e} (< {FP32_TOL:g})"
    return (f"| {r['case']} | {status} | {errs} | {changed} | {', '.join(r['breaks']) or 'none'} | "
            f"{r['seconds']:.0f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive, default=5, help="optimizer steps per run")
    p.add_argument("--only", action="append", default=[],
                   help="run the cases whose name contains this (repeatable)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--json", type=output_file, help="write every figure to this file")
    args = p.parse_args(argv)
    names = [c.name for c in CASES] + [DRY_RUN]
    if args.list:
        print("\n".join(names))
        return 0
    chosen = [n for n in names if not args.only or any(s in n for s in args.only)]
    if not chosen:
        p.error(f"--only {' '.join(args.only)}: no case's name contains it (--list names them)")
    os.environ["MEGAPAR_CPU"] = "1"
    print(f"torch {torch.__version__}; {args.steps} steps per run; {len(chosen)} cases\n")
    print("| case | result | rel. error loss / weights | recompiled step 1 -> 2 | graph breaks "
          "| s |\n| --- | --- | --- | --- | --- | --- |", flush=True)
    results = []
    for case in CASES:
        if case.name in chosen:
            results.append(run_case(case, args.steps))
            print(describe(results[-1]), flush=True)
    if DRY_RUN in chosen:
        results.append(dry_run_case())
        print(describe(results[-1]), flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "torch": torch.__version__,
                               "results": results})
    failed = [r["case"] for r in results if not r["ok"]]
    print(f"\n{len(results) - len(failed)} of {len(results)} cases passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
