"""Layout fuzzer: random parallel layouts and features, each run against one process.

megapar promises the same numbers in any layout (fp32: losses and gradient norms within 1e-5
relative of one process). This tool draws random combinations of a tiny model, a layout (tp, pp
and its schedule, dp, cp and its communication, ep and expert tensor parallelism, at most 8
ranks) and features (ZeRO stage and its options, sequence parallelism, recomputation, micro-
batch size and count, sequence length, sliding windows, gradient clipping, label smoothing,
z-loss, MoE router losses and bias updates, optimizer and offload, loss mean, SFT padding,
evaluation, and steps 1-2 in another layout resumed from their checkpoint), runs each through
`megapar-train` as a user does (it starts its own forked gloo workers on the CPU), and compares
every step's logged numbers (loss, grad_norm, val_loss, z_loss, the MoE terms: `--log-json`)
and the final weights (the `--save`d checkpoint, read whole) with the same run on one process
(tp = pp = dp = cp = ep = 1, ZeRO 0, no recomputation, the same global and micro-batch size).
Adam's eps is 1e-4 (tests/test_parity_3d.py says why: with 1e-8, entries whose gradient is
rounding noise take +-lr steps, and weights differ ~3e-5 per tensor after 3 steps even at dp 2
alone; the losses and grad norms agree either way). Even at 1e-4 a zero-initialised bias can
differ ~1.5e-5 after 3 steps (its update is ~lr per entry whatever the gradient, so its
rounding noise is all the tensor holds), so a case whose logged numbers agree but whose weights
do not, under an optimizer with Adam moments, is rerun with SGD (an update linear in the
gradient): if that passes, the case is adam-noise, else a mismatch. A refused combination must
be refused in one line on stderr with exit code 2; the line is recorded, and flagged (clear:
false) when the refusal is not one line or comes with a traceback.

It is a tool, not part of the test suite (a run is minutes to hours of CPU)::

    PYTHONPATH=$PWD python3 tools/layout_fuzz.py --cases 20 --seed 1 --out /tmp/fuzz
    PYTHONPATH=$PWD python3 tools/layout_fuzz.py --replay /tmp/fuzz/results.jsonl --case 7
    PYTHONPATH=$PWD python3 tools/layout_fuzz.py --args "--model gpt2-tiny --tp 2 --zero 1"

Each case appends one JSON line to OUT/results.jsonl (its arguments, its outcome: pass,
mismatch, refused, crash, timeout or adam-noise, and the largest relative difference seen);
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
import shlex
import sys
import time
import traceback
from pathlib import Path

FP32_TOL = 1e-5
BF16_TOL = 2e-2
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
    "skipped",
    "loss_scale",
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
        if sched == "interleaved":
            c["--virtual-stages"] = 2
        m = rng.choice([pp, 2 * pp] if sched != "dualpipev" else [2 * pp])
    c["--micro-batch-size"] = mbs
    c["--global-batch-size"] = mbs * m * dp
    if cp > 1:
        c["--cp-comm-type"] = rng.choice(["auto", "p2p", "all_gather", "a2a"])
    if moe:
        if (dp * cp) % 2 == 0 and rng.random() < 0.6:
            c["--ep"] = 2
        if tp > 1 and rng.random() < 0.5:
            c["--expert-tensor-parallel-size"] = tp
    if dp * cp > 1 or rng.random() < 0.2:
        c["--zero"] = rng.choice([0, 1, 2, 3])
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
    if edges and rng.random() < 0.3:  # an edge megapar may refuse: its line is recorded
        edge = rng.choice(EDGES)
        c.update(edge)
        c["edge"] = next(iter(edge))
    if rng.random() < 0.25:  # steps 1-2 in another layout, resumed from its checkpoint
        samples = c["--global-batch-size"] // mbs
        first: dict = {"--tp": rng.choice([1, 2]), "--pp": rng.choice([1, 2])}
        if samples % 2 == 0 and rng.random() < 0.5:
            first["--dp"] = 2
            first["--zero"] = rng.choice([0, 1, 2, 3])
            if moe and rng.random() < 0.5:
                first["--ep"] = 2
        c["resume"] = first
    return c


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
        "120",
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


def reference_case(case: dict) -> dict:
    """The same case on one process: no layout flag, no recomputation."""
    return {
        k: v
        for k, v in case.items()
        if k not in LAYOUT_FLAGS and k not in LAYOUT_SWITCHES and k != "resume"
    }


def run_cli(argv: list[str], directory: Path, timeout_s: float) -> tuple[int | str, str, str]:
    """megapar-train ARGV in a forked child of this process (which has imported megapar's
    command): (exit code or 'timeout', stdout, stderr)."""
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
            from megapar.cli.train import main

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
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def compare(got: list[dict], ref: list[dict]) -> tuple[float, list[str]]:
    """(largest relative difference, one description per compared number) over every step's
    logged results: loss, grad_norm, val_loss, z_loss, the MoE terms (a list, as the tokens
    each expert received, entry by entry)."""
    worst, where = 0.0, []
    if len(got) != len(ref):
        return math.inf, [f"{len(got)} logged steps, one process {len(ref)}"]

    def numbers(rec: dict) -> dict:
        out = {}
        for k, v in rec.items():
            if k in NOT_COMPARED or isinstance(v, bool):
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
    return worst, where


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
    rc, _, err = run_cli(argv, d, TIMEOUT_S)
    res = {"rc": rc, "stderr_tail": err[-2000:], "argv": argv}
    done.write_text(json.dumps(res))
    return res


def run_case(case: dict, out: Path, index: int, weights: bool) -> dict:
    tol = BF16_TOL if case.get("--precision") == "bf16" else FP32_TOL
    weights = weights and case.get("--precision") != "bf16"
    rec: dict = {"index": index, "case": case, "tol": tol}
    t0 = time.monotonic()
    d = out / "cases" / f"{index:04d}"
    if d.exists():
        import shutil

        shutil.rmtree(d)
    argv = argv_of(case, out, d / "ckpt" if weights else None, d / "log.jsonl")
    rc, err = 0, ""
    if "resume" in case:  # steps 1-2 in the layout case["resume"], saved, resumed in this one
        first = {**reference_case(case), **case["resume"]}
        argv1 = argv_of(first, out, d / "ckpt1", d / "log1.jsonl") + ["--max-steps", "2"]
        rec["argv_first"] = "megapar-train " + shlex.join(argv1)
        rc, _, err = run_cli(argv1, d / "first", TIMEOUT_S)
        argv += ["--load", str(d / "ckpt1")]
    rec["argv"] = "megapar-train " + shlex.join(argv)
    if rc == 0:
        rc, _, err = run_cli(argv, d, TIMEOUT_S)
    rec["rc"] = rc
    if rc == 2:
        line, clear = one_line(err)
        rec.update(outcome="refused", line=line, clear=clear)
    elif rc != 0:
        rec.update(outcome="timeout" if rc == "timeout" else "crash", stderr_tail=err[-3000:])
    else:
        ref = reference(case, out, weights)
        rd = out / "ref" / key_of(reference_case(case))
        if ref["rc"] != 0:
            rec.update(outcome="reference-failed", stderr_tail=ref["stderr_tail"])
        else:
            got = read_log(d / "log1.jsonl") + read_log(d / "log.jsonl")
            worst, where = compare(got, read_log(rd / "log.jsonl"))
            rec["max_rel"] = worst
            rec["details"] = [
                w
                for w in where
                if "rel" not in w or float(w.rsplit("rel ", 1)[1].rstrip(")")) > tol
            ][:12]
            if weights:
                rec["weights_rel"], rec["weights_worst"] = in_child(
                    lambda: weight_diff(read_weights(d / "ckpt"), read_weights(rd / "ckpt"))
                )
            bad = worst > tol or (weights and rec["weights_rel"] > tol)
            rec["outcome"] = "mismatch" if bad else "pass"
            if bad and worst <= tol and case.get("--optimizer", "adamw") in ADAM:
                # weights alone: the same case with SGD, whose update is linear in the gradient
                sgd = {k: v for k, v in case.items() if k != "--optimizer"}
                sub = run_case({**sgd, "--optimizer": "sgd"}, out, index + 10000, True)
                rec["sgd_check"] = {k: sub.get(k) for k in ("outcome", "max_rel", "weights_rel")}
                if sub["outcome"] == "pass":
                    rec["outcome"] = "adam-noise"
            import shutil

            shutil.rmtree(d / "ckpt", ignore_errors=True)
            shutil.rmtree(d / "ckpt1", ignore_errors=True)
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


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
    if not Path(TOKENIZER).exists():
        print(
            f"layout_fuzz: run it from the repository root ({TOKENIZER} not found)", file=sys.stderr
        )
        return 2
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    import megapar.cli.train  # noqa: F401 - imported once, inherited by every forked run

    if a.args:
        cases = [parse_case(a.args)]
    elif a.replay:
        recs = [json.loads(ln) for ln in Path(a.replay).read_text().splitlines()]
        cases = [r["case"] for r in recs if a.case is None or r["index"] == a.case]
    else:
        rng = random.Random(a.seed)
        cases = [draw(rng, a.bf16, a.edges) for _ in range(a.cases)]
    results = out / "results.jsonl"
    start = len(results.read_text().splitlines()) if results.exists() else 0
    t0 = time.monotonic()
    counts: dict[str, int] = {}
    for i, case in enumerate(cases):
        if a.minutes and time.monotonic() - t0 > a.minutes * 60:
            break
        rec = run_case(case, out, start + i, not a.no_weights)
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        extra = rec.get("line") or (
            f"max_rel {rec['max_rel']:.2e} weights {rec.get('weights_rel', 0):.2e}"
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
        " in the runs)",
    )
    return 1 if any(k in counts for k in ("mismatch", "crash", "timeout")) else 0


if __name__ == "__main__":
    sys.exit(main())
