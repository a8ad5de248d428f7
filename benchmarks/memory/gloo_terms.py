"""Two terms of a CPU rank's peak resident set the planner's CPU figure names, measured apart
(issue 47): a rank's baseline (its resident set after `import torch, megapar`, and after
megapar's training modules and transformers' config: `megapar.plan.process.CPU_BASELINE`), what
those imports add, and what gloo's collectives add over their input and output tensors.

Two spawned gloo ranks (`megapar.launcher.run_local`). Each first reads how far its resident
set and its peak rise over importing `megapar.training.prepare` (and transformers' GPT-2
config), after `import torch, megapar`. Then, per collective and size, it makes the input and
output tensors, resets its peak (`/proc/self/clear_refs`), runs the collective `repeats` times
and reports the peak's rise over the resident set before it: memory the collective takes
beyond the tensors it is given (gloo's staging copies). Allocations over 128 KiB are mapped
and unmapped one by one here (a fixed glibc mmap threshold), so each peak is what was alive at
once: the copies a collective holds in flight.

    python benchmarks/memory/gloo_terms.py                 # 4 and 25 MiB
    python benchmarks/memory/gloo_terms.py --mib 4 25 64
"""

from __future__ import annotations

import argparse
import ctypes
import sys

from megapar.launcher import run_local
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

MIB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def worker(sizes_mib: list[int], repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import megapar  # noqa: F401

    out: dict = {}
    start = _reset()
    out["baseline"] = start
    import importlib

    importlib.import_module("megapar.training.prepare")
    importlib.import_module("torch._dynamo")  # building torch's optimizers imports it (70 MiB)
    from transformers import GPT2Config  # noqa: F401

    out["import"] = (_status("VmRSS") - start, _status("VmHWM") - start)
    out["baseline after imports"] = _status("VmRSS")
    # every allocation over 128 KiB its own mapping, unmapped when freed (a fixed threshold:
    # glibc's own rises after the first large free), so that a peak is what was alive at once
    # and not holes an earlier collective left
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    world = dist.get_world_size()
    for mib in sizes_mib:
        n = mib * MIB // 4
        n -= n % world
        for name in ("all_reduce", "reduce_scatter", "all_gather"):
            x = torch.ones(n)
            y = torch.empty(n // world) if name == "reduce_scatter" else torch.empty(n)
            part = torch.ones(n // world)
            x.add_(0)
            y.fill_(0)
            part.add_(0)
            start = _reset()
            for _ in range(repeats):
                if name == "all_reduce":
                    dist.all_reduce(x)
                elif name == "reduce_scatter":
                    dist.reduce_scatter_tensor(y, x)
                else:
                    dist.all_gather_into_tensor(y, part)
            out[f"{name} {mib}"] = _status("VmHWM") - start
            del x, y, part
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="*", default=[4, 25])
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--runs", type=positive, default=2, help="the lower of the runs counts")
    args = parser.parse_args(argv)
    runs = [
        run_local(worker, 2, args.mib, args.repeats, start_method="spawn", timeout_s=600)
        for _ in range(args.runs)
    ]
    keys = runs[0][0].keys()
    for k in keys:
        if k.startswith("baseline"):
            low = min(r[i][k] for r in runs for i in range(2))
            print(f"resident set, {k}: {low / MIB:.0f} MiB")
        elif k == "import":
            rss = min(r[i][k][0] for r in runs for i in range(2))
            hwm = [min(r[i][k][1] for r in runs) for i in range(2)]
            print(f"import megapar.training: resident +{rss / MIB:.1f} MiB, peak rise per rank "
                  f"{', '.join(f'{v / MIB:.1f}' for v in hwm)} MiB")
        else:
            v = [min(r[i][k] for r in runs) for i in range(2)]
            print(f"{k:>22} MiB: peak rise per rank {', '.join(f'{x / MIB:.1f}' for x in v)} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
