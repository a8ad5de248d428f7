"""tools/gpu_session.sh's report: OUT/report.md from what the session's parts left in OUT.

    python3 tools/gpu_session_report.py OUT REHEARSE SECONDS

Reads versions.txt, parts.tsv (part, exit status, seconds, limit), junit.xml (the one-GPU
tier), shared.xml (the shared-GPU tier), measurements.jsonl, bench.log / bench.json,
fp8.log and fp8_curve.log; a part that has not run (yet) reads "not run". Called after each
part, so a session cut short still has a report. docs/testing.md shows the format.
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET

NOISE = ("[transformers]", "Failed to load", "register_constant", "W1", "W0")
"""Lines of library chatter left out of the logs' excerpts."""


def _read(out: str, name: str) -> list[str] | None:
    try:
        with open(os.path.join(out, name)) as f:
            return [line for line in f.read().strip().splitlines()
                    if not line.lstrip().startswith(NOISE)]
    except OSError:
        return None


def parts(out: str) -> list[str]:
    rows = _read(out, "parts.tsv") or []
    lines = ["| part | exit status | seconds | limit (s) |", "| --- | ---: | ---: | ---: |"]
    for row in rows:
        name, rc, seconds, limit = (row.split("\t") + ["", "", "", ""])[:4]
        status = {"124": "124 (cut at its limit)", "137": "137 (killed after it)"}.get(rc, rc)
        lines.append(f"| {name} | {status} | {seconds} | {limit} |")
    return lines + [""]


def tests(out: str, name: str) -> list[str]:
    """The table of one JUnit file: a row per test, its outcome (the failure's message) and
    its seconds, then the counts."""
    try:
        cases = list(ET.parse(os.path.join(out, name)).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        return [f"no test report ({exc})", ""]
    lines, counts = ["| test | outcome | seconds |", "| --- | --- | ---: |"], {}
    for case in cases:
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[kind] = counts.get(kind, 0) + 1
        note = ""
        if kind != "passed":
            text = next(c for c in case if c.tag == kind).get("message", "")
            note = ": " + " ".join(text.split())[:300 if kind != "skipped" else 120]
        test = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome = kind.upper() if kind != "passed" else kind
        lines.append(f"| {test} | {outcome}{note.replace('|', '/')} | "
                     f"{float(case.get('time', 0)):.1f} |")
    return lines + ["", "Summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())),
                    ""]


def measured(out: str) -> list[str]:
    lines = []
    for row in _read(out, "measurements.jsonl") or []:
        entry = json.loads(row)
        test = entry.pop("test")
        lines.append(f"- {test}: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()))
    return lines + [""]


def memory(out: str) -> list[str]:
    """megapar's runs of gpu_bench: what the device held against the planner's figure."""
    try:
        with open(os.path.join(out, "bench.json")) as f:
            bench = json.load(f)
    except (OSError, ValueError):
        return ["not run", ""]
    lines = ["| model, micro-batch | system | held: reserved peak + context (GiB) | "
             "megapar-plan --target gpu (GiB) | held / planned |",
             "| --- | --- | ---: | ---: | ---: |"]
    for model, entry in bench.get("models", {}).items():
        for system, run in entry.get("systems", {}).items():
            if "planner_gib" not in run:
                continue
            held, planned = run["held_gib"], run["planner_gib"]
            ratio = f"{held / planned:.3f}" if held else "not measured (CPU)"
            lines.append(f"| {model}, {run['micro_batch']} x {run['seq']} | {system} | "
                         f"{held:.2f} | {planned:.2f} | {ratio} |")
    return lines + ["", f"CUDA context {bench.get('context_bytes', 0) / 2**30:.2f} GiB "
                    "(measured once, added to each run's reserved peak); the planner does not "
                    "model compilation.", ""]


def excerpt(out: str, name: str, first: str, tail: int = 12) -> list[str]:
    """A log from the line starting with `first` (the script's table), else its end."""
    text = _read(out, name)
    if text is None:
        return ["```", "not run", "```", ""]
    at = [i for i, line in enumerate(text) if line.startswith(first)]
    return ["```", *(text[at[0]:] if at else text[-tail:]), "```", ""]


REHEARSED_SPEEDS = ("*Rehearsal: tiny models timed for a step or two on the CPU; the speeds "
                    "and ratios below test the script, not megapar.*")
"""Above each timed part's excerpt in a rehearsal's report."""


def main(out: str, rehearse: str, seconds: str) -> None:
    def said(log: str) -> list[str]:  # above a rehearsed part that ran (not "skipped: ...")
        text = _read(out, log) if rehearse == "1" else None
        ran = bool(text) and not re.match(r"([\w-]+: )?skipped", text[0])
        return [REHEARSED_SPEEDS, ""] if ran else []

    lines = ["# megapar GPU session", ""]
    if rehearse == "1":
        lines += ["**REHEARSAL ON THE CPU: not a GPU check.** Both tiers' logic ran on the CPU "
                  "(MEGAPAR_CUDA_TIER_ON_CPU=1) and each benchmark run at its tiny sizes.", ""]
    lines += [f"Wall time {int(seconds) / 60:.1f} min.", "", "## Parts", ""] + parts(out)
    lines += ["## Machine and versions", "", "```", *(_read(out, "versions.txt") or []), "```",
              ""]
    lines += ["## Tests", ""] + tests(out, "junit.xml")
    lines += ["## Shared-GPU tier (tests/test_cuda_shared.py)", ""] + tests(out, "shared.xml")
    lines += ["## Measured by the tests", ""] + measured(out)
    lines += ["## Benchmarks (benchmarks/vs/gpu_bench.py)", ""] + said("bench.log")
    lines += excerpt(out, "bench.log", "gpu_bench on", 40)
    lines += ["## Memory against the planner (gpu_bench.py's megapar runs)", ""] + memory(out)
    lines += ["## FP8 against bf16 (benchmarks/vs/fp8_bench.py)", ""] + said("fp8.log")
    lines += excerpt(out, "fp8.log", "fp8_bench on")
    if os.path.exists(os.path.join(out, "fp8_eager.log")):  # the compiled runs failed
        lines += ["The same runs eagerly, after the compiled runs failed:", ""]
        lines += excerpt(out, "fp8_eager.log", "fp8_bench on")
    lines += ["## The main job's loss curve, bf16 and fp8 (benchmarks/vs/fp8_curve.py)", ""]
    lines += said("fp8_curve.log")
    lines += excerpt(out, "fp8_curve.log", "fp8_curve:", 20)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"report: {os.path.join(out, 'report.md')}")


USAGE = (
    "usage: gpu_session_report.py WORK_DIR REHEARSE SECONDS: writes WORK_DIR/report.md from a "
    "session's files (tools/gpu_session.sh calls it; REHEARSE 0 or 1, SECONDS the wall time)"
)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        sys.exit(0)
    problem = (
        f"needs 3 arguments, got {len(args)}"
        if len(args) != 3
        else f"{args[0]} is not a directory"
        if not os.path.isdir(args[0])
        else f"REHEARSE {args[1]!r} is not 0 or 1"
        if args[1] not in ("0", "1")
        else f"SECONDS {args[2]!r} is not a whole number"
        if not args[2].isdigit()
        else ""
    )
    if problem:
        print(f"gpu_session_report.py: error: {problem}; {USAGE}", file=sys.stderr)
        sys.exit(2)
    main(*args)
