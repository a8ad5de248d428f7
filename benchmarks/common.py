"""What the benchmark scripts share: A/B runs taken in turns, the OS peak of a child process, and
the JSON record.

- `interleave` runs the variants of a comparison in turns, one run of each per round, so that
  what else the machine does falls on all of them alike; `pair_ratios` then compares them round
  by round (the ratio of each pair, not of two medians taken minutes apart).
- `run_peak` runs a command as a child process and returns, with its output, its peak resident
  set as the operating system counts it: `ru_maxrss` from `wait4`, which for a launcher is the
  largest of it and every worker it started and waited for.
- `output_file` and `positive` are argparse types: a file the script writes at its end is
  checked when the flags are read (its directory exists and is writable, it is not a directory),
  so a mistyped path is one line at the start rather than a traceback after the run.
- `write_json` is the one writer of a script's JSON record: strict JSON (a NaN or an infinity
  is an error, not a token other parsers reject), indented, ending in a newline; `json_number`
  turns a figure that was not measured (NaN) into null; `read_jsonl` reads megapar-train's
  `--log-json` records back.

The scripts live in topic folders below this one and put it on `sys.path` with
`sys.path.insert(0, str(Path(__file__).resolve().parents[1]))` before `import common`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def interleave(variants: dict[str, Callable[[], T]], rounds: int, *,
               alternate: bool = False) -> dict[str, list[T]]:
    """Run every variant once per round, in turn, for `rounds` rounds: {name: [result of round 0,
    round 1, ...]}. With `alternate`, odd rounds take the variants in reverse order, so that no
    variant always runs first (the run after another often finds warmer caches or a quieter
    machine)."""
    results: dict[str, list[T]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in (names[::-1] if alternate and r % 2 else names):
            results[name].append(variants[name]())
    return results


def add_ab_arguments(parser, configs: Sequence[str], *, repeats: int = 3, steps: int = 4) -> None:
    """The flags of an A/B comparison over named configurations: --configs (all by default),
    --repeats (rounds, one run of each side per round) and --steps (timed steps per run)."""
    parser.add_argument("--configs", nargs="+", default=list(configs), choices=list(configs))
    parser.add_argument("--repeats", type=int, default=repeats, help="A/B pairs per config")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per run")


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """A callable that runs `fn` and returns the seconds it took (`time.perf_counter`), for
    `interleave`."""
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def pair_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a[i] / b[i] for each round i: the runs of one round are a pair."""
    if len(a) != len(b):
        raise ValueError(f"pair_ratios needs as many runs of each side: {len(a)} and {len(b)}")
    return [x / y for x, y in zip(a, b)]


def ratio_summary(ratios: Sequence[float]) -> str:
    """'median [min, max]' of pairwise ratios, or 'nan' when there are none."""
    if not ratios:
        return "nan"
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"


@dataclass
class PeakRun:
    """One finished child process: its exit code, its output (stdout, or what `run_peak` was told
    to capture) and the OS peak of its resident set in bytes."""

    returncode: int
    output: str
    peak_bytes: int


def run_peak(argv: Sequence[str], *, env: dict | None = None, capture: str = "stdout",
             check: bool = True) -> PeakRun:
    """Run `argv` (a list, no shell) and wait for it with `os.wait4`: its peak resident set is
    `ru_maxrss` (kilobytes on Linux) of it and its waited-for children. `capture` is what comes
    back as output: "stdout" (stderr merged into it), "stderr" (stdout discarded) or "none".
    With `check`, a non-zero exit raises with the command and the output's last 3,000
    characters."""
    if capture not in ("stdout", "stderr", "none"):
        raise ValueError(f"capture must be 'stdout', 'stderr' or 'none', not {capture!r}")
    out = subprocess.PIPE if capture == "stdout" else subprocess.DEVNULL
    err = {"stdout": subprocess.STDOUT, "stderr": subprocess.PIPE, "none": subprocess.DEVNULL}
    proc = subprocess.Popen(list(argv), stdout=out, stderr=err[capture], text=True, env=env)
    stream = proc.stdout if capture == "stdout" else proc.stderr
    text = stream.read() if stream is not None else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{text[-3000:]}")
    return PeakRun(proc.returncode, text, usage.ru_maxrss * 1024)


def train_argv(*flags: str) -> list[str]:
    """The command line of `megapar-train FLAGS` in this interpreter (the checkout's megapar when
    PYTHONPATH points at it)."""
    return [sys.executable, "-m", "megapar.cli.train", *flags]


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file (megapar-train's `--log-json`), one per line."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def json_number(x: float | int | None) -> float | int | None:
    """`x`, or None where it is NaN or infinite (a figure not measured): strict JSON has no NaN."""
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def output_file(text: str) -> str:
    """An argparse type: a file this script will write, refused now if it cannot be ('' stands
    for none and passes)."""
    if not text:
        return text
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory: name a file in it")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: no directory {parent} (make it first)")
    try:  # a file made and removed there: os.access says yes to root on a read-only mount
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {parent} ({err.strerror})")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} exists and is not writable")
    return text


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def recipe(text: str) -> str:
    """An argparse type: a megapar recipe or model config file that resolves (an unknown one was
    a ConfigError traceback after the parse)."""
    from megapar.models.config import ConfigError
    from megapar.models.recipes import resolve_model

    try:
        resolve_model(text)
    except (ConfigError, OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def scratch_dir(prefix: str) -> str:
    """A new temporary directory for a benchmark's models and dataset caches, removed when
    the process exits (they were left in /tmp, one per run: the tests run some of these)."""
    work = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, work, True)
    return work


def write_json(path: str, record: Any) -> None:
    """Write `record` to `path` as strict JSON (no NaN or infinity), indented by one space:
    whole or not at all (a temporary file beside it, renamed over it)."""
    text = json.dumps(record, indent=1, allow_nan=False) + "\n"
    part = f"{path}.part"
    try:
        with open(part, "w") as f:
            f.write(text)
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.unlink(part)
