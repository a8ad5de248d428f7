"""How a CPU rank's heap grows step after step: glibc's arena and in-use bytes (`mallinfo2`)
and the peak resident set's rise (VmHWM) at the end of every step of a long run.

Spawned ranks build GPT-2 124M (or `--layers` blocks of it) with `megapar.prepare` and train
`--steps` steps of 64 tokens; the baseline is read as tests/test_peak_memory.py reads it (torch,
torch._dynamo, transformers and megapar imported). Per rank it prints the rise at each step's
end, the arena at each step's end and the steps at which the arena grew by more than 8 MiB, and
the planner's CPU figure for the rank (`plan.process`: its first step and its total). At ZeRO
0-2 and dp > 1 the arena grows by about one embedding-sized gradient at steps that vary from
run to run until it holds two (docs/guides/planner.md, "The heap after the first steps").

    python benchmarks/memory/heap_growth.py --zero 2 --steps 30        # dp 2, 4 MB buckets
    python benchmarks/memory/heap_growth.py --zero 0 --world 1 --layers 6 --steps 10
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # process_terms: MallInfo2
from process_terms import MallInfo2  # noqa: E402

M = 2**20


def worker(
    zero: int, steps: int, bucket_mb: float, world: int, layers: int, map_above_mb: float
) -> dict:
    import time

    import torch
    import torch._dynamo  # noqa: F401  torch's optimizer imports it: in the baseline
    from transformers import GPT2Config

    import megapar

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def heap() -> tuple[int, int]:
        m = libc.mallinfo2()
        return m.arena + m.hblkhd, m.uordblks + m.hblkhd

    cfg = GPT2Config(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    start, (arena0, inuse0) = status("VmRSS"), heap()
    engine = megapar.prepare(cfg, micro_batch_size=1, zero=zero, seq_len=64,
                             grad_bucket_mb=bucket_mb)
    if map_above_mb:  # allocations above it get their own mapping, unmapped when freed
        m_mmap_threshold, m_mmap_max = -3, -4  # <malloc.h>
        libc.mallopt(m_mmap_max, 65536)
        libc.mallopt(m_mmap_threshold, int(map_above_mb * M))
    ids = torch.randint(0, cfg.vocab_size, (world, 65), generator=torch.Generator().manual_seed(0))
    rows, seconds = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        seconds.append(time.perf_counter() - t0)
        arena, inuse = heap()
        rows.append((status("VmHWM") - start, arena - arena0, inuse - inuse0))
    return {"rows": rows, "seconds": seconds}


def planned(zero: int, bucket_mb: float, world: int, layers: int) -> tuple[float, float]:
    """(the planner's CPU figure for the first step, its total) of rank 0."""
    from transformers import GPT2Config

    from megapar.models.config import config_from_dict
    from megapar.plan import Candidate, Problem, stage_memory
    from megapar.plan.estimate import activation_sizes, stage_roles
    from megapar.plan.process import process_peak

    config = config_from_dict(GPT2Config(n_layer=layers).to_dict())
    p = Problem(config, gpus=world, global_batch=world, seq_len=64, precision="fp32",
                grad_bucket_mb=bucket_mb, target="cpu")
    c = Candidate(mbs=1, dp=world, zero=zero)
    peak = process_peak(p, c, stage_memory(p, c)[0], *stage_roles(p, c, 0),
                        activation_sizes(p, c).full)
    return peak.total, peak.settled


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--steps", type=positive, default=10)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--world", type=positive, default=2, help="dp ranks")
    parser.add_argument("--layers", type=positive, default=12)
    parser.add_argument("--map-above-mb", type=float, default=0,
                        help="serve allocations above this size from their own mappings once "
                             "built (glibc's mmap threshold, at most 32): instead of the heap")
    args = parser.parse_args(argv)
    from megapar.launcher import run_local

    spec = (args.zero, args.steps, args.bucket_mb, args.world, args.layers, args.map_above_mb)
    results = run_local(worker, args.world, *spec, start_method="spawn", timeout_s=3600)
    first, total = planned(args.zero, args.bucket_mb, args.world, args.layers)
    print(f"planned (MiB): first step {first / M:.0f}, total {total / M:.0f}")
    for rank, out in enumerate(results):
        hwm = [round(r[0] / M) for r in out["rows"]]
        arena = [round(r[1] / M) for r in out["rows"]]
        grew = [(i, b - a) for i, (a, b) in enumerate(zip(arena, arena[1:]), 1) if b - a > 8]
        print(f"rank {rank}: rise per step {hwm}")
        print(f"  arena per step {arena}; grew at (step, MiB) {grew}; "
              f"in-use after the last {out['rows'][-1][2] / M:.0f}")
        print(f"  planned / rise: first step {first / M / hwm[0]:.3f}, "
              f"last step {total / M / hwm[-1]:.3f}; step time after the first: median "
              f"{sorted(out['seconds'][1:])[len(out['seconds'][1:]) // 2]:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
