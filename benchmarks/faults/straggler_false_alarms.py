"""Straggler detection on this machine: false alarms over healthy runs, and a slowed rank found.

Runs megapar-train (forked gloo ranks, the shipped Shakespeare sample, a tiny GPT-2) `--runs`
times without a fault and counts the runs in which any rank was named slow (`stragglers` in
--log-json) and the log intervals in which a rank was above the thresholds once
(`straggler_suspects`: named only after 2 intervals in a row); then, with `--fault-runs`, runs it with one rank slowed by `--slow-ms` per step
(`--inject-slow`) and reports the log interval at which that rank was named. Also prints, over
all healthy intervals, the largest ratio and excess of the slowest rank's compute time per step
to the world's median (the margin below the thresholds). Usage:

    python benchmarks/faults/straggler_false_alarms.py [--runs 20] [--tp 2 --pp 2 --dp 1]
        [--steps 12] [--log-interval 2] [--fault-runs 2] [--slow-ms 300] [--slow-rank 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _train(args, log: Path, cache: Path, text: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "megapar.cli.train", "--model", "gpt2-tiny", "--tokenizer",
           "sentencepiece", "--seq-len", "32", "--micro-batch-size", "2",
           "--global-batch-size", str(4 * args.dp * 2), "--max-steps", str(args.steps),
           "--log-interval", str(args.log_interval), "--eval-interval", "0", "--no-progress",
           "--tp", str(args.tp), "--pp", str(args.pp), "--dp", str(args.dp),
           "--data", str(text), "--data-cache", str(cache), "--log-json", str(log), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEGAPAR_CPU": "1"}
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"megapar-train failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return [r for r in map(json.loads, log.read_text().splitlines()) if "compute_s_max" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=positive, default=20)
    p.add_argument("--fault-runs", type=positive, default=2)
    p.add_argument("--tp", type=positive, default=2)
    p.add_argument("--pp", type=positive, default=2)
    p.add_argument("--dp", type=positive, default=1)
    p.add_argument("--steps", type=positive, default=12)
    p.add_argument("--log-interval", type=positive, default=2)
    p.add_argument("--slow-ms", type=float, default=300.0)
    p.add_argument("--slow-rank", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from megapar.data import asset_path

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        text = d / "sample.txt"
        text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
        layout = f"tp {args.tp} x pp {args.pp} x dp {args.dp}"
        print(f"{layout}, gpt2-tiny, {args.steps} steps, --log-interval {args.log_interval}, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
        alarms, ratio, excess, intervals, suspect = 0, 0.0, 0.0, 0, 0
        start = time.perf_counter()
        for i in range(args.runs):
            records = _train(args, d / f"ok{i}.jsonl", d / "cache", text, [])
            named = [(r["step"], s["rank"]) for r in records for s in r.get("stragglers", ())]
            alarms += bool(named)
            intervals += len(records)
            suspect += sum(bool(r.get("straggler_suspects")) for r in records)
            for r in records:
                ratio = max(ratio, r["compute_s_max"] / r["compute_s_median"])
                excess = max(excess, r["compute_s_max"] - r["compute_s_median"])
            print(f"healthy run {i + 1:2d}: {'named ' + str(named) if named else 'none named'}"
                  f" (load {os.getloadavg()[0]:.1f})", flush=True)
        print(f"healthy: {alarms} of {args.runs} runs named a rank; {suspect} of {intervals} "
              f"log intervals had a rank above the thresholds (named only after 2 in a row) "
              f"({time.perf_counter() - start:.0f} s); largest slowest/median compute ratio "
              f"{ratio:.2f}, largest excess {1e3 * excess:.1f} ms/step")
        for i in range(args.fault_runs):
            spec = f"rank={args.slow_rank},ms={args.slow_ms:g}"
            records = _train(args, d / f"slow{i}.jsonl", d / "cache", text,
                             ["--inject-slow", spec])
            first = next((k + 1 for k, r in enumerate(records)
                          if any(s["rank"] == args.slow_rank for s in r.get("stragglers", ()))),
                         None)
            others = {s["rank"] for r in records for s in r.get("stragglers", ())} - \
                {args.slow_rank}
            print(f"--inject-slow {spec} run {i + 1}: rank {args.slow_rank} named at log "
                  f"interval {first} of {len(records)}; other ranks named: "
                  f"{sorted(others) or 'none'}")


if __name__ == "__main__":
    main()
