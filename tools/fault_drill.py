"""Fault drill: inject faults into real `megapar-train` runs (tp 2 x pp 2, a tiny GPT-2) and
print, for each, how long the run took to exit, what it left behind and what it lost.

    python tools/fault_drill.py                 # every drill, ~5 minutes on 2 CPU cores
    python tools/fault_drill.py --only sigterm sigkill-launcher

Columns: fault; exit code; time from the fault to the last process gone; leftovers (live
processes, staging directories, a `latest` that does not load, a lock file); data lost (trained
steps not in the newest checkpoint); the first line the launcher printed (under torchrun, the
time each rank's process ended, then the first line naming the stopped rank). The `*-torchrun*`
drills run the ranks under torchrun instead of megapar-train's launcher. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model_type": "gpt2", "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(k) for k in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [json.loads(x)["step"] for x in log.read_text().splitlines() if x.strip()]


class Run:
    def __init__(self, work: Path, name: str, extra: list[str], save: Path | None = None,
                 torchrun: bool = False):
        self.dir = work / name
        self.dir.mkdir()
        self.ckpt, self.log, self.out = save or self.dir / "ckpt", self.dir / "log.jsonl", \
            self.dir / "out"
        start = [sys.executable, "-m", "megapar.cli.train"]
        if torchrun:  # torchrun's agent starts the 4 ranks (one process each)
            start = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "4", "-m", "megapar.cli.train"]
        argv = [*start, "--tp", "2", "--pp", "2",
                "--model", str(work / "model.json"), "--data", str(work / "text.txt"),
                "--tokenizer", "sentencepiece", "--data-cache", str(work / "cache"),
                "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                "--log-interval", "1", "--eval-interval", "0", "--no-progress",
                "--warmup-steps", "2", "--save", str(self.ckpt), "--log-json", str(self.log),
                *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdout=open(self.out, "w"), stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self.workers: list[int] = []
        self.torchrun = torchrun

    def wait_steps(self, n: int, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while len(_steps(self.log)) < n and time.monotonic() < end and self.proc.poll() is None:
            time.sleep(0.05)
        self.workers = [w for w in _children(self.proc.pid) if _alive(w)]

    def rank_pid(self, rank: int) -> int:
        """The pid of worker `rank`: its RANK (torchrun), else the rank-th worker started."""
        for w in self.workers:
            try:
                env = Path(f"/proc/{w}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return w
        return sorted(self.workers)[rank]

    def finish(self, t0: float, timeout: float = 120.0) -> dict:
        """Wait for the launcher and its workers; measure from `t0` (each worker's exit too)."""
        end = time.monotonic() + timeout
        self.exits: dict[int, float] = {}
        while (self.proc.poll() is None or any(_alive(w) for w in self.workers)) \
                and time.monotonic() < end:
            for w in self.workers:
                if w not in self.exits and not _alive(w):
                    self.exits[w] = time.monotonic() - t0
            time.sleep(0.02)
        took = time.monotonic() - t0
        live = [w for w in self.workers if _alive(w)]
        for w in live:
            os.kill(w, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        return self.report(took, live)

    def report(self, took: float, live: list[int]) -> dict:
        leftovers = [f"{len(live)} live processes"] if live else []
        if self.ckpt.exists():
            stale = [p.name for p in self.ckpt.iterdir() if p.name.startswith(".")]
            if stale:
                leftovers.append(f"{len(stale)} staging")
        saved = 0
        if (self.ckpt / "latest").exists():
            sys.path.insert(0, str(ROOT))
            from megapar.checkpoint.format import CheckpointError
            from megapar.checkpoint.manifest import read_manifest

            try:
                saved = read_manifest(self.ckpt)["step"]
            except CheckpointError:
                leftovers.append("latest does not load")
        trained = max(_steps(self.log), default=0)
        lines = [x for x in self.out.read_text().splitlines()
                 if x.startswith(("megapar-train:", "SIG", "interrupted", "--exit"))]
        # the start-up notes (megapar-train: data: ...) come first: the fault's line is the
        # error, the abort, the stop or the lock taken over; none (a launcher killed with -9
        # says nothing): "(nothing)", not a start-up note
        lines = [x for x in lines if re.search(r"error:|aborted|took over|received|interrupted|"
                                               r"--exit", x)]
        if self.torchrun:  # every rank prints its own error line: the first one naming a rank
            named = [x for x in lines if "stopped" in x or "did not answer" in x]
            lines = named or lines
        return {"rc": self.proc.returncode, "exit_s": took,
                "leftovers": ", ".join(leftovers) or "none",
                "lost": f"{trained - saved} steps (trained {trained}, saved {saved})",
                "said": re.sub(r"rank \d+ failed: TrainingError: rank \d+ \([^)]*\) ", "",
                               lines[0] if lines else "(nothing)")[:120]}


def drill(name: str, work: Path) -> dict:
    if name == "sigkill-launcher":
        run = Run(work, name, ["--max-steps", "400", "--save-interval", "3"])
        run.wait_steps(4)
        t0 = time.monotonic()
        os.kill(run.proc.pid, signal.SIGKILL)
        return run.finish(t0)
    if name in ("sigterm", "sigusr1", "sigint"):
        run = Run(work, name, ["--max-steps", "400"])
        run.wait_steps(3)
        t0 = time.monotonic()
        os.kill(run.proc.pid, getattr(signal, name.upper()))
        return run.finish(t0)
    if name == "sigkill-worker":
        run = Run(work, name, ["--max-steps", "400", "--save-interval", "3"])
        run.wait_steps(4)
        t0 = time.monotonic()
        os.kill(run.workers[1], signal.SIGKILL)
        return run.finish(t0)
    if name == "sigstop-worker":
        run = Run(work, name, ["--max-steps", "400", "--save-interval", "3", "--timeout-s", "10"])
        run.wait_steps(4)
        t0 = time.monotonic()
        os.kill(run.workers[2], signal.SIGSTOP)
        return run.finish(t0)
    if name in ("sigstop-rank1", "sigstop-rank1-torchrun"):
        torchrun = name.endswith("torchrun")
        run = Run(work, name, ["--max-steps", "400", "--save-interval", "3", "--timeout-s", "10"],
                  torchrun=torchrun)
        run.wait_steps(4)
        ranks = {run.rank_pid(r): r for r in range(4)}
        t0 = time.monotonic()
        os.kill(run.rank_pid(1), signal.SIGSTOP)
        result = run.finish(t0)
        if torchrun:  # when each rank's process ended (the stopped one: torchrun's SIGKILL)
            result["said"] = " ".join(f"r{ranks.get(w, '?')}:{s:.1f}s" for w, s in
                                      sorted(run.exits.items(), key=lambda x: x[1])) \
                + " | " + result["said"]
        if (run.ckpt / "megapar.lock").exists():
            result["leftovers"] = "lock file left"
        return result
    if name == "sigterm-torchrun-hung":  # torchrun cancelled while its ranks wait for a stopped
        run = Run(work, name, ["--max-steps", "400", "--save-interval", "3"], torchrun=True)
        run.wait_steps(4)
        ranks = {run.rank_pid(r): r for r in range(4)}
        os.kill(run.rank_pid(1), signal.SIGSTOP)
        time.sleep(3.0)  # the others are blocked waiting for rank 1 (--timeout-s 300)
        t0 = time.monotonic()
        os.kill(run.proc.pid, signal.SIGTERM)  # torchrun passes it on, SIGKILL 30 s later
        result = run.finish(t0)
        result["said"] = " ".join(f"r{ranks.get(w, '?')}:{s:.1f}s" for w, s in
                                  sorted(run.exits.items(), key=lambda x: x[1]))
        said = [x for x in run.out.read_text().splitlines() if "SIGTERM" in x and "blocked" in x]
        result["said"] += " | " + (said[0][:80] if said else "")
        if (run.ckpt / "megapar.lock").exists():
            result["leftovers"] = "lock file left"
        return result
    if name == "nan":
        run = Run(work, name, ["--max-steps", "400", "--lr", "1e6"])
        t0 = time.monotonic()
        return run.finish(t0)
    if name == "exit-duration":
        run = Run(work, name, ["--max-steps", "4000", "--exit-duration-mins", "0.1"])
        t0 = time.monotonic()
        return run.finish(t0)
    if name == "second-writer":
        return _second_writer(work)
    if name == "stale-lock":
        return _stale_lock(work)
    raise ValueError(name)


def _second_writer(work: Path) -> dict:
    """A run saving into a --save directory another live run is writing (a requeued job that
    started while the old one still runs): refused before any worker starts, and the first run's
    checkpoints are all its own when it stops."""
    first = Run(work, "second-writer-first", ["--max-steps", "400", "--save-interval", "2",
                                              "--seed", "1"])
    first.wait_steps(3)
    t0 = time.monotonic()
    second = Run(work, "second-writer", ["--max-steps", "400", "--save-interval", "1",
                                         "--seed", "2"], save=first.ckpt)
    result = second.finish(t0)
    os.kill(first.proc.pid, signal.SIGTERM)
    first_result = first.finish(time.monotonic())
    seeds = {json.loads((p / "manifest.json").read_text())["meta"]["train_config"]["seed"]
             for p in first.ckpt.glob("step_*")}
    result["lost"] = (f"none: the first run's checkpoints are all its own (seeds {sorted(seeds)},"
                      f" first run: {first_result['lost']})")
    if (first.ckpt / "megapar.lock").exists():
        result["leftovers"] = "lock file left"
    return result


def _stale_lock(work: Path) -> dict:
    """The launcher is killed with kill -9 (its lock file stays, its pid is gone); the requeued
    run (same --save and --load) takes the stale lock over and resumes."""
    dead = Run(work, "stale-lock-killed", ["--max-steps", "400", "--save-interval", "2"])
    dead.wait_steps(3)
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.finish(time.monotonic())
    assert (dead.ckpt / "megapar.lock").exists(), "kill -9 should leave the lock file"
    t0 = time.monotonic()
    again = Run(work, "stale-lock", ["--max-steps", "6", "--load", str(dead.ckpt)],
                save=dead.ckpt)
    result = again.finish(t0)
    took = [x for x in again.out.read_text().splitlines() if "took over the stale lock" in x]
    result["said"] = (took[0] if took else result["said"])[:120]
    if (dead.ckpt / "megapar.lock").exists():
        result["leftovers"] = "lock file left"
    return result


DRILLS = ["sigkill-launcher", "sigterm", "sigusr1", "sigint", "sigkill-worker", "sigstop-worker",
          "sigstop-rank1", "sigstop-rank1-torchrun", "sigterm-torchrun-hung", "nan", "exit-duration", "second-writer", "stale-lock"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=DRILLS, default=DRILLS, metavar="DRILL",
                        help=f"run only these drills: {' '.join(DRILLS)}")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="megapar-drill-"))
    (work / "model.json").write_text(json.dumps(MODEL))
    sample = (ROOT / "megapar" / "assets" / "shakespeare_sample.txt").read_text()[:40_000]
    (work / "text.txt").write_text(sample)
    rows = []
    for name in args.only:
        r = drill(name, work)
        rows.append(r)
        print(f"{name:17s} rc {r['rc']!s:>4}  exit {r['exit_s']:6.2f} s  leftovers: "
              f"{r['leftovers']:12s}  lost: {r['lost']:34s}  {r['said']}", flush=True)
    print(f"(runs in {work}; exit time counts from the fault, for nan / exit-duration / "
          f"second-writer / stale-lock from the start of that run)")


if __name__ == "__main__":
    main()
