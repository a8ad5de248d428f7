"""The pipeline executor's per-step planning work, before and after it was kept per step size.

Every step used to work out, from this rank's program, the acknowledgements (which received
message proves which send complete: O(m^2) Python), the receives to post ahead on gloo and the
indices of the last backward and W; `PipelineExecutor.step_plan` now does that once per
(m, forward_only). This script builds each stage's executor on a process-free mesh (no
messages move) and prints, per layout, the slowest stage's first step (the old per-step cost)
and its later steps (a dictionary lookup), median of `--repeat` runs.

    python benchmarks/executor_plan.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from megapar.mesh import Layout, Mesh
from megapar.pipeline import messages
from megapar.pipeline.executor import PipelineExecutor

LAYOUTS = [("1f1b", 16, 256, 1), ("zb-h1", 16, 256, 1), ("interleaved", 8, 128, 4)]


class Chunk(nn.Module):
    def forward(self, hidden, batch):  # never run: only the plan is timed
        return hidden


class Chunks(nn.Module):
    """A rank's `v` model chunks, as `models.stage.ModelChunks` holds them."""

    def __init__(self, v: int):
        super().__init__()
        self.chunks = nn.ModuleList(Chunk() for _ in range(v))


def stage_times(schedule: str, pp: int, m: int, v: int, repeat: int) -> tuple[float, float]:
    """(slowest stage's first step_plan, slowest stage's later step_plan), seconds."""
    first, later = [], []
    for stage in range(pp):
        mesh = Mesh.virtual(Layout(1, pp, 1), rank=stage, device="cpu")
        mesh.timeout_s = 60.0
        chunks = Chunks(v) if v > 1 else Chunk()
        cold, warm = [], []
        for _ in range(repeat):
            messages.programs.cache_clear()
            messages.programs(schedule, pp, m, v, False)  # the programs were cached before too
            executor = PipelineExecutor(chunks, mesh, schedule, (1, 4, 8), timeout_s=60,
                                        virtual_stages=v)
            t0 = time.perf_counter()
            executor.step_plan(m)
            t1 = time.perf_counter()
            executor.step_plan(m)
            cold.append(t1 - t0)
            warm.append(time.perf_counter() - t1)
        first.append(statistics.median(cold))
        later.append(statistics.median(warm))
    return max(first), max(later)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'schedule':12} {'pp':>3} {'m':>4} {'V':>2} | {'every step before':>18} | "
          f"{'each later step':>16}")
    for schedule, pp, m, v in LAYOUTS:
        cold, warm = stage_times(schedule, pp, m, v, args.repeat)
        print(f"{schedule:12} {pp:3d} {m:4d} {v:2d} | {cold * 1e3:15.2f} ms | "
              f"{warm * 1e6:13.2f} us")


if __name__ == "__main__":
    main()
