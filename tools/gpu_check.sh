#!/usr/bin/env bash
# megapar's CUDA test tier on this machine's GPUs, with a summary to paste into an issue.
#
#   tools/gpu_check.sh            # every test marked `cuda`: the one-GPU tier
#                                 # (tests/test_cuda_single.py, tests/test_cuda_fp8.py), the
#                                 # shared-GPU tier (tests/test_cuda_shared.py: ranks as
#                                 # processes on one GPU over gloo) and, with 2 GPUs or more,
#                                 # the multi-GPU tier on NCCL (tests/test_cuda.py)
#   tools/gpu_check.sh -k parity  # extra arguments go to pytest
#
# Exit status 0 only if at least one GPU test ran and none failed: on a machine without CUDA,
# or where every test was skipped (too few GPUs), it fails instead of passing vacuously.
# GPU_CHECK_JUNIT=FILE keeps pytest's JUnit report there (tools/gpu_session.sh reads it);
# GPU_CHECK_SHARED=0 leaves the shared-GPU tier out (tools/gpu_session.sh runs it apart).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${MEGAPAR_CUDA_TIER_ON_CPU:-}" == "1" ]]; then
    echo "gpu_check: MEGAPAR_CUDA_TIER_ON_CPU=1 rehearses the tier on the CPU; unset it for a GPU check" >&2
    exit 2
fi
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
python3 - <<'PY' | tee "$report/machine.txt"
import platform, subprocess, torch
print(f"megapar gpu_check on {platform.node()} ({platform.platform()})")
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    try:
        print("driver", subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                        "--format=csv,noheader"], capture_output=True,
                                       text=True, timeout=30).stdout.split()[0])
    except (OSError, IndexError, subprocess.TimeoutExpired):
        print("driver: nvidia-smi not found")
else:
    print("no CUDA device visible to torch")
PY
shared=tests/test_cuda_shared.py
if [[ "${GPU_CHECK_SHARED:-1}" == "0" ]]; then shared=""; fi
# shellcheck disable=SC2086 # $shared: one path or none
MEGAPAR_CPU=0 python3 -m pytest -m cuda -rA -p no:cacheprovider tests/test_cuda_single.py \
    tests/test_cuda_fp8.py $shared \
    tests/test_cuda.py --junitxml="$report/junit.xml" "$@"
if [[ -n "${GPU_CHECK_JUNIT:-}" ]]; then
    cp "$report/junit.xml" "$GPU_CHECK_JUNIT" 2>/dev/null || true
fi
python3 - "$report/junit.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError) as exc:
    print(f"gpu_check: FAILED: pytest wrote no report ({exc})")
    sys.exit(1)
outcome = {}
for case in cases:
    name = case.get("name")
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    outcome.setdefault(kind, []).append(name)
passed, failed = outcome.get("passed", []), outcome.get("failure", []) + outcome.get("error", [])
skipped = outcome.get("skipped", [])
print(f"\ngpu_check summary: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
for kind, names in (("passed", passed), ("FAILED", failed), ("skipped", skipped)):
    for name in names:
        print(f"  {kind}: {name}")
if not passed:
    print("gpu_check: FAILED: no GPU test ran (no CUDA, or fewer GPUs than every test needs)")
    sys.exit(1)
sys.exit(1 if failed else 0)
PY
