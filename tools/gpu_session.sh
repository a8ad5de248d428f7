#!/usr/bin/env bash
# One GPU session, start to finish, on a bare machine that holds torch, transformers and the
# other dependencies but reaches no package registry: install megapar without dependencies,
# run the one-GPU tier (tools/gpu_check.sh), the shared-GPU tier (tests/test_cuda_shared.py:
# several ranks as processes on the one GPU over gloo), the main job's loss curve in bf16 and
# with --fp8 (benchmarks/vs/fp8_curve.py), --fp8 against bf16 on Llama 1.2B
# (benchmarks/vs/fp8_bench.py) and the GPU benchmarks with megapar's memory against the
# planner (benchmarks/vs/gpu_bench.py), and write one report: the machine, the versions, each
# part's exit status and time, pass / fail per test, what the tests measured and every table.
# Under 10 minutes on an H100: the parts run in that order, each under its own limit, and no
# part runs past GPU_SESSION_BUDGET seconds from the start (a later part's minimum is kept
# back for it; the benchmark, last, takes its compiled runs last and is cut first).
#
#   tools/gpu_session.sh [OUT_DIR]          # default: $OUT, else ./gpu-session (OUT_DIR and
#                                           # ./ relative to where it is run from)
#
# OUT_DIR/report.md is the report (docs/testing.md shows its format); beside it
# session.tar.gz, the session's files: the logs (install.log, gpu_check.log, shared.log,
# fp8_curve.log, fp8.log, bench.log), junit.xml, shared.xml, measurements.jsonl, parts.tsv,
# versions.txt, fp8_curve.json, fp8.json (fp8_eager.log / .json where the compiled fp8 runs
# failed), bench.json and report.md. The parts write them to a
# folder of their own (GPU_SESSION_WORK, else a new one under /tmp; its name is printed first),
# and both files in OUT_DIR are rewritten after each part, so a session cut short leaves them
# as far as it got: two files, as the device tool brings back at most 8 from its $OUT.
# Settings (environment):
#   GPU_SESSION_BUDGET  seconds the whole session may take (570; a rehearsal: 14400, and each
#                       part an hour)
#   GPU_SESSION_BENCH   arguments for gpu_bench.py (default: both models, eager and compiled)
#   GPU_SESSION_TIER    extra pytest arguments for the one-GPU tier (e.g. "-k not main_job")
#   GPU_SESSION_SKIP    words naming parts to leave out: tier, shared, curve, fp8, bench
#   GPU_SESSION_TIER_TIMEOUT (150), GPU_SESSION_SHARED_TIMEOUT (150),
#   GPU_SESSION_CURVE_TIMEOUT (150), GPU_SESSION_FP8_TIMEOUT (240),
#   GPU_SESSION_BENCH_TIMEOUT (300)  the most seconds each part may take
#   GPU_SESSION_FP8     arguments for benchmarks/vs/fp8_bench.py (default: --compile --rounds 2
#                       --steps 8 --warmup 3; if the compiled runs fail outright, the same
#                       runs eagerly follow, as the part fp8-eager)
#   GPU_SESSION_CURVE   arguments for benchmarks/vs/fp8_curve.py (default: none: 300 steps)
#   GPU_SESSION_INSTALL=0  run from the source tree (PYTHONPATH) instead of installing it
#   GPU_SESSION_WORK    the folder the parts write their files to (default: a new mktemp -d)
#   GPU_SESSION_REHEARSE=1  rehearse the script on a CPU machine: both tiers' logic on the CPU
#                       (MEGAPAR_CUDA_TIER_ON_CPU=1) and every benchmark at tiny sizes, from
#                       the source tree (the machine's install untouched); the report says
#                       REHEARSAL and the exit status is the script's own
# --fp8 needs torchao, which the GPU machines lack and cannot download: keep its wheel in
# wheels/ (ignored by git; about 3.3 MB), e.g. `python3 -m pip download torchao==0.18.0
# --no-deps -d wheels` on a machine with the registry, and carry it with the checkout (the
# device tool's carry: ["wheels"]). The script installs it with --no-deps --no-index when
# torchao is not importable; without it the two fp8 parts say so and are skipped.
# Exit status 0 when the one-GPU tier passed (at least one GPU test ran, none failed), the
# shared-GPU tier passed (likewise: every test skipped is a failure), and every other part that
# ran finished.
set -uo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_session: unknown option $1: it takes one OUT_DIR (--help says more)" >&2
        exit 2 ;;
esac
if [ "$#" -gt 1 ]; then
    echo "gpu_session: one OUT_DIR, not $#: $*" >&2
    exit 2
fi
out="${1:-${OUT:-gpu-session}}"
mkdir -p "$out" || { echo "gpu_session: cannot make OUT_DIR $out" >&2; exit 2; }
out="$(cd "$out" && pwd)"   # where it was run from, before the move to the repository
cd "$(dirname "$0")/.."
work="${GPU_SESSION_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-session.XXXXXX")}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
if [[ "$work" == "$out" ]]; then
    echo "gpu_session: GPU_SESSION_WORK is OUT_DIR ($out): give another folder" >&2
    exit 2
fi
echo "gpu_session: the parts' files in $work; report.md and session.tar.gz in $out"
start=$(date +%s)
stage() { echo "== gpu_session: $1 ($(( $(date +%s) - start )) s)"; }
rehearse="${GPU_SESSION_REHEARSE:-0}"
skip="${GPU_SESSION_SKIP:-}"
budget="${GPU_SESSION_BUDGET:-570}"
if [[ "$rehearse" == 1 ]]; then budget="${GPU_SESSION_BUDGET:-14400}"; fi
deadline=$(( start + budget ))
: > "$work/measurements.jsonl"
: > "$work/parts.tsv"
rc_tier=0 rc_shared=0 rc_curve=0 rc_fp8=0 rc_bench=0

write_report() {  # report.md from what is there so far, and session.tar.gz (after each part)
    python3 tools/gpu_session_report.py "$work" "$rehearse" "$(( $(date +%s) - start ))" \
        && cp "$work/report.md" "$out/report.md"
    tar -czf "$out/session.tar.gz.part" -C "$work" . \
        && mv -f "$out/session.tar.gz.part" "$out/session.tar.gz"
}

# limit CAP KEEP: seconds the next part may take: CAP, less if the budget left after keeping
# KEEP seconds back for the parts after it is smaller (a rehearsal: an hour, its sizes are
# tiny but a CPU is slow)
limit() {
    local cap=$1 left=$(( deadline - $(date +%s) - $2 ))
    if [[ "$rehearse" == 1 ]]; then cap=3600; fi
    echo $(( left < cap ? left : cap ))
}

# run_part NAME LIMIT COMMAND...: the command under `timeout LIMIT`, its exit status (124: cut
# at the limit; 137: killed 10 s after) and seconds appended to parts.tsv; returns the exit
# status (a part given under 20 s is skipped)
run_part() {
    local name=$1 seconds=$2 began rc
    shift 2
    began=$(date +%s)
    if (( seconds < 20 )); then
        echo "$name: skipped, ${seconds} s of the budget left" | tee -a "$work/$name.log"
        printf '%s\tskipped\t0\t%s\n' "$name" "$seconds" >> "$work/parts.tsv"
        return 0
    fi
    timeout -k 10 "$seconds" "$@"  # SIGTERM at the limit, SIGKILL 10 s later
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - began ))" "$seconds" \
        >> "$work/parts.tsv"
    return $rc
}

stage "install megapar without dependencies"
install="${GPU_SESSION_INSTALL:-1}"
if [[ "$rehearse" == 1 ]]; then install="${GPU_SESSION_INSTALL:-0}"; fi
if [[ "$install" == 1 ]] && python3 -m pip install --no-deps --no-build-isolation --no-index \
    -e . >"$work/install.log" 2>&1
then
    echo "installed: $(python3 -m pip show megapar 2>/dev/null | grep -i ^version)"
else  # no pip / setuptools there, or not asked to: run from the source tree
    echo "not installed (GPU_SESSION_INSTALL=$install; install.log): running from the source tree"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

stage "torchao (--fp8) from wheels/"
if python3 -c "import torchao" >/dev/null 2>&1; then
    echo "torchao already installed"
elif compgen -G "wheels/torchao-*.whl" >/dev/null; then
    python3 -m pip install --no-deps --no-index wheels/torchao-*.whl >>"$work/install.log" 2>&1 \
        && echo "installed $(ls wheels/torchao-*.whl)" || echo "torchao: install failed (install.log)"
else
    echo "no wheels/torchao-*.whl: the fp8 step will be skipped (see this script's header)"
fi

stage "versions"
python3 - >"$work/versions.txt" 2>&1 <<'PY'
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
cat "$work/versions.txt"
write_report >/dev/null

if [[ "$skip" != *tier* ]]; then
    stage "the one-GPU tier"
    export MEGAPAR_GPU_REPORT="$work/measurements.jsonl"
    # shellcheck disable=SC2086 # GPU_SESSION_TIER is a list of pytest arguments
    if [[ "$rehearse" == 1 ]]; then
        MEGAPAR_CUDA_TIER_ON_CPU=1 run_part tier "$(limit 0 300)" python3 -m pytest -m cuda -rA \
            -p no:cacheprovider tests/test_cuda_single.py tests/test_cuda_fp8.py \
            --junitxml="$work/junit.xml" \
            ${GPU_SESSION_TIER:-} >"$work/gpu_check.log" 2>&1
        rc_tier=$?
        echo "(rehearsal on the CPU: tools/gpu_check.sh itself refuses it; see below)" \
            >>"$work/gpu_check.log"
        tools/gpu_check.sh >>"$work/gpu_check.log" 2>&1
    else
        GPU_CHECK_SHARED=0 GPU_CHECK_JUNIT="$work/junit.xml" run_part tier \
            "$(limit "${GPU_SESSION_TIER_TIMEOUT:-150}" 300)" \
            tools/gpu_check.sh ${GPU_SESSION_TIER:-} >"$work/gpu_check.log" 2>&1
        rc_tier=$?
    fi
    unset MEGAPAR_GPU_REPORT
    if [[ "$rehearse" == 1 ]]; then  # gpu_check.sh's own summary is its refusal on a CPU
        grep -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" "$work/gpu_check.log" \
            | head -1 | sed "s/^/rehearsed tier (pytest on the CPU): /"
        echo "(gpu_check.sh itself refuses a CPU machine: its summary is in gpu_check.log)"
    else
        grep -A 200 "gpu_check summary" "$work/gpu_check.log" | head -60
    fi
    echo "tier: exit status $rc_tier"
    write_report >/dev/null
fi

if [[ "$skip" != *shared* ]]; then
    stage "the shared-GPU tier (ranks as processes on one GPU, gloo)"
    export MEGAPAR_GPU_REPORT="$work/measurements.jsonl"
    on_cpu=0
    if [[ "$rehearse" == 1 ]]; then on_cpu=1; fi
    MEGAPAR_CUDA_TIER_ON_CPU=$on_cpu MEGAPAR_CPU=$on_cpu run_part shared \
        "$(limit "${GPU_SESSION_SHARED_TIMEOUT:-150}" 240)" \
        python3 -m pytest -m cuda -rA -p no:cacheprovider tests/test_cuda_shared.py \
        --junitxml="$work/shared.xml" >"$work/shared.log" 2>&1
    rc_shared=$?
    if [[ "$rc_shared" == 0 && -f "$work/shared.xml" ]] && ! python3 - "$work/shared.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

cases = ET.parse(sys.argv[1]).getroot().iter("testcase")  # a test passed: no such child
sys.exit(0 if any(not [c for c in case if c.tag in ("skipped", "failure", "error")]
                  for case in cases) else 1)
PY
    then  # pytest's 0 with every test skipped (no CUDA seen): not a pass
        echo "shared tier: no test ran (every one skipped): counted as failed" \
            | tee -a "$work/shared.log"
        rc_shared=1
    fi
    unset MEGAPAR_GPU_REPORT
    tail -5 "$work/shared.log"
    echo "shared tier: exit status $rc_shared"
    write_report >/dev/null
fi

has_torchao=0
if python3 -c "import torchao" >/dev/null 2>&1; then has_torchao=1; fi

if [[ "$skip" != *curve* ]]; then
    stage "the main job's loss curve, bf16 and fp8"
    if [[ "$has_torchao" == 1 ]]; then
        curve_args="${GPU_SESSION_CURVE:-}"
        if [[ "$rehearse" == 1 ]]; then
            curve_args="--device cpu --tiny --steps 4 --every 2"
        fi
        # shellcheck disable=SC2086 # a list of arguments
        run_part curve "$(limit "${GPU_SESSION_CURVE_TIMEOUT:-150}" 150)" \
            python3 benchmarks/vs/fp8_curve.py $curve_args --json "$work/fp8_curve.json" \
            >"$work/fp8_curve.log" 2>&1
        rc_curve=$?
        grep -A 30 "^fp8_curve:" "$work/fp8_curve.log" || tail -12 "$work/fp8_curve.log"
        echo "curve: exit status $rc_curve"
    else
        echo "skipped: torchao is not installed (no wheels/torchao-*.whl)" | tee "$work/fp8_curve.log"
    fi
    write_report >/dev/null
fi

if [[ "$skip" != *fp8* ]]; then
    stage "fp8 against bf16 (Llama 1.2B, compiled blocks)"
    if [[ "$has_torchao" == 1 ]]; then
        # compiled: torchao's float8 speed-ups are measured with torch.compile fusing the casts
        # (eagerly each cast is kernels of its own); each variant's compilation falls inside
        # its warm-up steps
        fp8_args="${GPU_SESSION_FP8:---compile --rounds 2 --steps 8 --warmup 3}"
        if [[ "$rehearse" == 1 ]]; then
            fp8_args="--device cpu --tiny --compile --rounds 1 --steps 2 --warmup 1"
        fi
        # shellcheck disable=SC2086 # a list of arguments
        run_part fp8 "$(limit "${GPU_SESSION_FP8_TIMEOUT:-240}" 100)" \
            python3 benchmarks/vs/fp8_bench.py $fp8_args --json "$work/fp8.json" \
            >"$work/fp8.log" 2>&1
        rc_fp8=$?
        grep -v "Failed to load\|register_constant\|triton" "$work/fp8.log" | tail -12
        echo "fp8: exit status $rc_fp8"
        # the compiled runs failed outright (not cut at their limit): the same runs eagerly,
        # so the session still brings back float8's kernels against bf16 (rc_fp8 stays the
        # compiled runs' status)
        if [[ "$rc_fp8" != 0 && "$rc_fp8" != 124 && "$rc_fp8" != 137 \
              && " $fp8_args " == *" --compile "* ]]; then
            echo "fp8: the compiled runs failed (exit $rc_fp8): the same runs eagerly" \
                | tee -a "$work/fp8.log"
            eager_args=" $fp8_args "
            eager_args="${eager_args// --compile / }"
            # shellcheck disable=SC2086 # a list of arguments
            run_part fp8-eager "$(limit 120 100)" \
                python3 benchmarks/vs/fp8_bench.py $eager_args --json "$work/fp8_eager.json" \
                >"$work/fp8_eager.log" 2>&1
            echo "fp8 eagerly: exit status $?"
            grep -v "Failed to load\|register_constant\|triton" "$work/fp8_eager.log" | tail -12
        fi
    else
        echo "skipped: torchao is not installed (no wheels/torchao-*.whl)" | tee "$work/fp8.log"
    fi
    write_report >/dev/null
fi

if [[ "$skip" != *bench* ]]; then
    stage "the GPU benchmarks, megapar's memory against the planner"
    bench_args="${GPU_SESSION_BENCH:-}"
    if [[ "$rehearse" == 1 ]]; then
        bench_args="--device cpu --tiny --steps 2 --warmup 1 --no-compile $bench_args"
    fi
    # shellcheck disable=SC2086 # a list of arguments
    run_part bench "$(limit "${GPU_SESSION_BENCH_TIMEOUT:-300}" 5)" \
        python3 benchmarks/vs/gpu_bench.py $bench_args --json "$work/bench.json" \
        >"$work/bench.log" 2>&1
    rc_bench=$?
    grep -v "^\[transformers\]" "$work/bench.log" | tail -40
    echo "bench: exit status $rc_bench"
fi

stage "report"
write_report
echo "report: $out/report.md, every file: $out/session.tar.gz (and $work)"
stage "done"
others=$(( rc_shared != 0 || rc_curve != 0 || rc_fp8 != 0 || rc_bench != 0 ))
if [[ "$rehearse" == 1 ]]; then
    exit $others
fi
exit $(( rc_tier != 0 || others ))
