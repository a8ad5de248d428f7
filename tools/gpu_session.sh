#!/usr/bin/env bash
# One GPU session, start to finish, on a bare machine that holds torch, transformers and the
# other dependencies but reaches no package registry: install megapar without dependencies,
# run the one-GPU tier (tools/gpu_check.sh) and the GPU benchmarks (benchmarks/vs/gpu_bench.py),
# and write one report: the machine, the versions, pass / fail per test, what the tests
# measured and the benchmark table. About 6 minutes on an H100.
#
#   tools/gpu_session.sh [OUT_DIR]          # default: $OUT, else ./gpu-session
#
# OUT_DIR/report.md is the report (docs/testing.md shows its format); beside it the logs
# (install.log, gpu_check.log, bench.log), junit.xml, measurements.jsonl and bench.json.
# Settings (environment):
#   GPU_SESSION_BENCH   arguments for gpu_bench.py (default: both models, eager and compiled)
#   GPU_SESSION_TIER    extra pytest arguments for the tier (e.g. "-k not main_job")
#   GPU_SESSION_SKIP    "bench" or "tier" to leave one part out
#   GPU_SESSION_TIER_TIMEOUT, GPU_SESSION_BENCH_TIMEOUT  seconds each part may take (420)
#   GPU_SESSION_REHEARSE=1  rehearse the script on a CPU machine: the one-GPU tier's logic on
#                       the CPU (MEGAPAR_CUDA_TIER_ON_CPU=1) and the benchmark's tiny sizes;
#                       the report says REHEARSAL and the exit status is the script's own
#   GPU_SESSION_FP8     arguments for benchmarks/vs/fp8_bench.py (default: --rounds 2 --steps 8
#                       --warmup 2); GPU_SESSION_FP8_TIMEOUT its seconds (300); "fp8" in
#                       GPU_SESSION_SKIP leaves it out
# --fp8 needs torchao, which the GPU machines lack and cannot download: keep its wheel in
# wheels/ (ignored by git; about 3.3 MB), e.g. `python3 -m pip download torchao==0.18.0
# --no-deps -d wheels` on a machine with the registry, and carry it with the checkout (the
# device tool's carry: ["wheels"]). The script installs it with --no-deps --no-index when
# torchao is not importable; without it the fp8 step says so and is skipped.
# Exit status 0 when the tier passed (at least one GPU test ran, none failed), the benchmark
# finished, and the fp8 step (when it ran) finished.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-session}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
start=$(date +%s)
stage() { echo "== gpu_session: $1 ($(( $(date +%s) - start )) s)"; }
rehearse="${GPU_SESSION_REHEARSE:-0}"
skip="${GPU_SESSION_SKIP:-}"
: > "$out/measurements.jsonl"
rc_tier=0 rc_bench=0 rc_fp8=0

write_report() {  # report.md from what is there so far (again after each part)
    python3 - "$out" "$rehearse" "$rc_tier" "$rc_bench" "$(( $(date +%s) - start ))" <<'PY'
import json
import os
import sys
import xml.etree.ElementTree as ET

out, rehearse, rc_tier, rc_bench, seconds = sys.argv[1:]
lines = ["# megapar GPU session", ""]
if rehearse == "1":
    lines += ["**REHEARSAL ON THE CPU: not a GPU check.** The one-GPU tier's logic ran on the "
              "CPU (MEGAPAR_CUDA_TIER_ON_CPU=1) and the benchmark at its tiny sizes.", ""]
lines += [f"Wall time {int(seconds) / 60:.1f} min; tier exit status {rc_tier}, benchmark exit "
          f"status {rc_bench}.", "", "## Machine and versions", "", "```"]
lines += open(os.path.join(out, "versions.txt")).read().strip().splitlines() + ["```", ""]
lines += ["## Tests", ""]
try:
    cases = list(ET.parse(os.path.join(out, "junit.xml")).getroot().iter("testcase"))
except (OSError, ET.ParseError) as exc:
    cases = []
    lines += [f"no test report ({exc})", ""]
counts = {}
if cases:
    lines += ["| test | outcome | seconds |", "| --- | --- | ---: |"]
for case in cases:
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    counts[kind] = counts.get(kind, 0) + 1
    note = ""
    if kind in ("failure", "error"):
        text = next(c for c in case if c.tag == kind).get("message", "")
        note = ": " + " ".join(text.split())[:300].replace("|", "/")
    elif kind == "skipped":
        note = ": " + " ".join(next(c for c in case if c.tag == "skipped")
                               .get("message", "").split())[:120].replace("|", "/")
    name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
    lines.append(f"| {name} | {kind.upper() if kind != 'passed' else kind}{note} | "
                 f"{float(case.get('time', 0)):.1f} |")
lines += ["", "Summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), ""]
lines += ["## Measured by the tests", ""]
for row in open(os.path.join(out, "measurements.jsonl")).read().splitlines():
    entry = json.loads(row)
    test = entry.pop("test")
    lines.append(f"- {test}: " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()))
lines += ["", "## Benchmarks (benchmarks/vs/gpu_bench.py)", "", "```"]
try:
    bench = [line for line in open(os.path.join(out, "bench.log")).read().splitlines()
             if not line.startswith("[transformers]")]
except OSError:
    bench = ["not run"]
lines += bench + ["```", ""]
lines += ["## FP8 against bf16 (benchmarks/vs/fp8_bench.py)", "", "```"]
try:
    fp8 = open(os.path.join(out, "fp8.log")).read().strip().splitlines()
    first = [i for i, line in enumerate(fp8) if line.startswith("fp8_bench on")]
    lines += fp8[first[0]:] if first else fp8[-12:]  # the table, else the end of the error
except OSError:
    lines += ["not run"]
lines += ["```", ""]
open(os.path.join(out, "report.md"), "w").write("\n".join(lines))
print(f"report: {os.path.join(out, 'report.md')}")
PY

}

stage "install megapar without dependencies"
if python3 -m pip install --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1
then
    echo "installed: $(python3 -m pip show megapar 2>/dev/null | grep -i ^version)"
else  # no pip / setuptools there: run from the source tree
    echo "pip install failed (see install.log): running from the source tree"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

stage "torchao (--fp8) from wheels/"
if python3 -c "import torchao" >/dev/null 2>&1; then
    echo "torchao already installed"
elif compgen -G "wheels/torchao-*.whl" >/dev/null; then
    python3 -m pip install --no-deps --no-index wheels/torchao-*.whl >>"$out/install.log" 2>&1 \
        && echo "installed $(ls wheels/torchao-*.whl)" || echo "torchao: install failed (install.log)"
else
    echo "no wheels/torchao-*.whl: the fp8 step will be skipped (see this script's header)"
fi

stage "versions"
python3 - >"$out/versions.txt" 2>&1 <<'PY'
import importlib.metadata as md
import platform
import subprocess

import torch

print(f"host: {platform.node()} ({platform.platform()}), {platform.machine()}")
print(f"python {platform.python_version()}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version() if torch.cuda.is_available() else '-'}")
if torch.cuda.is_available():
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, "
              f"{p.multi_processor_count} SMs")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,power.limit,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        print(f"driver, power limit, max SM clock: {smi.stdout.strip()}")
    except (OSError, subprocess.TimeoutExpired):
        print("nvidia-smi: not found")
else:
    print("no CUDA device visible to torch")
for name in ("megapar", "transformers", "tokenizers", "safetensors", "sentencepiece", "numpy",
             "einops", "tqdm", "pyyaml", "pyarrow", "tensorboard", "matplotlib", "pytest",
             "pytest-timeout", "triton", "torchao"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
PY
cat "$out/versions.txt"

if [[ "$skip" != *tier* ]]; then
    stage "the one-GPU tier"
    export MEGAPAR_GPU_REPORT="$out/measurements.jsonl"
    # shellcheck disable=SC2086 # GPU_SESSION_TIER is a list of pytest arguments
    if [[ "$rehearse" == 1 ]]; then
        MEGAPAR_CUDA_TIER_ON_CPU=1 timeout 900 python3 -m pytest -m cuda -rA \
            -p no:cacheprovider tests/test_cuda_single.py --junitxml="$out/junit.xml" \
            ${GPU_SESSION_TIER:-} >"$out/gpu_check.log" 2>&1
        rc_tier=$?
        echo "(rehearsal on the CPU: tools/gpu_check.sh itself refuses it; see below)" \
            >>"$out/gpu_check.log"
        tools/gpu_check.sh >>"$out/gpu_check.log" 2>&1
    else
        GPU_CHECK_JUNIT="$out/junit.xml" timeout "${GPU_SESSION_TIER_TIMEOUT:-420}" \
            tools/gpu_check.sh ${GPU_SESSION_TIER:-} \
            >"$out/gpu_check.log" 2>&1
        rc_tier=$?
    fi
    unset MEGAPAR_GPU_REPORT
    grep -A 200 "gpu_check summary" "$out/gpu_check.log" | head -60
    echo "tier: exit status $rc_tier"
    write_report >/dev/null
fi

if [[ "$skip" != *bench* ]]; then
    stage "the GPU benchmarks"
    bench_args="${GPU_SESSION_BENCH:-}"
    if [[ "$rehearse" == 1 ]]; then
        bench_args="--device cpu --tiny --steps 2 --warmup 1 $bench_args"
    fi
    # shellcheck disable=SC2086 # a list of arguments
    timeout "${GPU_SESSION_BENCH_TIMEOUT:-420}" python3 benchmarks/vs/gpu_bench.py $bench_args \
        --json "$out/bench.json" \
        >"$out/bench.log" 2>&1
    rc_bench=$?
    grep -v "^\[transformers\]" "$out/bench.log" | tail -40
    echo "bench: exit status $rc_bench"
fi

if [[ "$skip" != *fp8* ]]; then
    stage "fp8 against bf16"
    if python3 -c "import torchao" >/dev/null 2>&1; then
        fp8_args="${GPU_SESSION_FP8:---rounds 2 --steps 8 --warmup 2}"
        if [[ "$rehearse" == 1 ]]; then
            fp8_args="--device cpu --tiny --rounds 1 --steps 2 --warmup 1"
        fi
        # shellcheck disable=SC2086 # a list of arguments
        timeout "${GPU_SESSION_FP8_TIMEOUT:-300}" python3 benchmarks/vs/fp8_bench.py $fp8_args \
            --json "$out/fp8.json" >"$out/fp8.log" 2>&1
        rc_fp8=$?
        grep -v "Failed to load\|register_constant\|triton" "$out/fp8.log" | tail -12
        echo "fp8: exit status $rc_fp8"
    else
        echo "skipped: torchao is not installed (no wheels/torchao-*.whl)" | tee "$out/fp8.log"
    fi
fi

stage "report"
write_report
stage "done"
if [[ "$rehearse" == 1 ]]; then
    exit $(( rc_bench != 0 || rc_fp8 != 0 ))
fi
exit $(( rc_tier != 0 || rc_bench != 0 || rc_fp8 != 0 ))
