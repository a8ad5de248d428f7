"""The pipeline executor's host work per step: its planning, and its walk of the program.

Planning: every step used to work out, from this rank's program, the acknowledgements (which
received message proves which send complete: O(m^2) Python), the receives to post ahead on
gloo and the indices of the last backward and W; `PipelineExecutor.step_plan` does that once
per (m, forward_only). The first table prints, per layout, the slowest stage's first step (the
old per-step cost) and its later steps (a dictionary lookup), median of `--repeat` runs.

The walk: everything else the executor does on the host in a step, but the model's compute,
autograd's and the waits. Each stage runs real steps (`PipelineExecutor.run`, its real
compute handlers) with a message layer that completes at once (`InstantP2P`: `StageP2P`'s own
work and torch.distributed's calls are not included) and, by default, a model that computes
nothing (`NoModel`: a forward returns a tensor made beforehand, so the call of a chunk is
counted, not the model) and the executor's autograd calls made no-ops (`no_autograd`); the
whole step is timed. So what is counted is the program walk, the compute handlers' own
bookkeeping (and their tensor operations outside the model, e.g. the detached loss per
micro-batch), the message bookkeeping and the freeing of sent outputs, the status line (as
under the launcher: a shared array, the "step S, " prefix set) and, traced, the trace; the loss
broadcast at the end is a collective and left out. `--subtract-handlers` is the earlier
measure instead: a stub model that computes (one add per forward, autograd's
backward), each compute handler timed and its time subtracted with what the timer costs
outside its interval (`timer_cost`); the handlers' own bookkeeping is then left out too, and
the result carries the error of that per-call correction, times the computes of a step.
Times are the thread's CPU time (`time.thread_time`), so other processes on a shared machine
do not count (they still slow it down through shared caches and cores: take the minimum of
many steps). The stages take turns, one step each per round. The second table prints the
slowest stage's host work per step, traced and not, as on NCCL (receives where the program has
them), minimum of `--steps` steps. `--baseline FILE` measures an earlier executor module in
the same rounds, taking turns with this tree's (the ratio is of the same run):

`--stage S` measures stage S alone (its data then stay in the caches between its steps);
`--each-stage-alone` measures every stage so, one after the other, and prints the slowest (a
rank runs one stage in a process of its own, as in a real run); `--schedules` picks layouts. `executor_instructions.py` counts the same steps in instructions.

    python benchmarks/pipeline/executor_plan.py
    git show REV:megapar/pipeline/executor.py > /tmp/executor_before.py
    python benchmarks/pipeline/executor_plan.py --host-only --baseline /tmp/executor_before.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from megapar.faults import status
from megapar.mesh import Layout, Mesh
from megapar.pipeline import executor as executor_module
from megapar.pipeline import messages
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.schedules import placement_of, virtual_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

LAYOUTS = [("1f1b", 16, 256, 1), ("zb-h1", 16, 256, 1), ("zb-v", 16, 256, 2),
           ("dualpipev", 16, 256, 2), ("interleaved", 16, 256, 2), ("interleaved", 8, 128, 4)]
"""(schedule, pp, m, V): every schedule at pp 16, m 256 (interleaved with the fewest chunks it
takes, 2; the V schedules hold 2 by definition), and interleaved at pp 8, m 128, V 4 as the
earlier tables had it."""


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


class InstantP2P:
    """A stage's messages that complete at once: nothing moves, a receive returns a buffer
    (with a gradient, as a received activation has after the backward the stub skips)."""

    failed, pending_recvs, pending_sends = False, 0, 0

    def __init__(self, shape: tuple):
        self.buffer = torch.zeros(shape)
        self.buffer.grad = torch.zeros(shape)
        self.issued: list = []

    def begin_step(self) -> None:
        pass

    def issue(self, group: list) -> None:
        pass

    def wait_recv(self, *key) -> torch.Tensor:  # (key) now, (kind, mb, chunk) before
        return self.buffer

    def release(self, *key) -> None:
        pass

    def wait_sends(self) -> None:
        pass


class StubChunk(nn.Module):
    """One add per forward; the model's last chunk returns a scalar loss."""

    def __init__(self, shape: tuple, last: bool):
        super().__init__()
        self.p, self.last = nn.Parameter(torch.zeros(shape)), last

    def forward(self, hidden, batch):
        out = self.p * 1.0 if hidden is None else hidden + self.p
        return out.sum() if self.last else out


class NoModel:
    """A model chunk that computes nothing: its forward returns a tensor made beforehand (the
    scalar loss on the model's last chunk), with no autograd graph."""

    def __init__(self, shape: tuple, last: bool):
        self.out = torch.zeros(()) if last else torch.zeros(shape)

    def __call__(self, hidden, batch):
        return self.out

    def parameters(self):
        return iter(())


@contextlib.contextmanager
def no_autograd(modules):
    """The autograd calls of each executor module in `modules` (`backward`, `backward_input`,
    `backward_weight`: the compute of a backward) do nothing in the block; a B returns the
    input's `.grad` (a stand-in where the input was handed over from the other chunk of a V
    and has none: no backward ran)."""
    # the module whose functions the backward handlers call (this tree's: pipeline/backward.py)
    modules = [sys.modules.get(mod.PipelineExecutor._backward.__module__, mod) for mod in modules]
    saved = [(mod, mod.backward, mod.backward_input, mod.backward_weight) for mod in modules]
    filler = torch.zeros(())  # the input gradient of an input handed over in memory (a V)
    for mod in modules:
        pending = mod.PendingWeightGrad([])
        mod.backward = lambda output, grad: None
        mod.backward_input = lambda output, grad, inp, store, pending=pending: (
            None if inp is None else filler if inp.grad is None else inp.grad, pending)
        mod.backward_weight = lambda pending, ready=None: None
    try:
        yield
    finally:
        for mod, *calls in saved:
            mod.backward, mod.backward_input, mod.backward_weight = calls


def host_work(schedule: str, pp: int, m: int, v: int, trace: bool, steps: int,
              subtract: bool = False, modules: tuple = (executor_module,),
              stages: list | None = None) -> list[list[float]]:
    """Seconds of host work of one step, per executor module in `modules` (this tree's, and
    a `--baseline`), per stage: the minimum of `steps` steps of each, after one that builds
    the plan. The stages (and modules) take turns, one step each per round, so that a noisy
    moment of a shared machine falls on all alike instead of on the few measured then.

    Default: the model and autograd compute nothing (`NoModel`, `no_autograd`); the whole
    step is timed, the compute handlers' own work included. `subtract` (the measure of the
    earlier tables): a stub model that computes, the compute handlers timed one by one and
    their time subtracted, with what the timer costs outside its interval (`TIMER_COST`).
    `stages`: only these (default: all), the others' entries left infinite."""
    stages = list(range(pp)) if stages is None else stages
    executors = [{stage: _stage_executor(mod, schedule, pp, m, v, stage, trace, subtract)
                  for stage in stages} for mod in modules]
    batches = [{} for _ in range(m)]
    best = [[float("inf")] * pp for _ in modules]
    with contextlib.nullcontext() if subtract else no_autograd(modules):
        for of_module in executors:
            for executor in of_module.values():
                executor.run(batches)
        for _ in range(steps):
            for stage in stages:
                for mod, of_module in enumerate(executors):
                    executor = of_module[stage]
                    inside = executor.inside
                    inside[:] = [0.0, 0]
                    start = time.thread_time()
                    executor.run(batches)
                    spent = time.thread_time() - start - inside[0] - inside[1] * TIMER_COST
                    best[mod][stage] = min(best[mod][stage], spent)
    return best


def _stage_executor(module, schedule: str, pp: int, m: int, v: int, stage: int, trace: bool,
                    subtract: bool):
    """`stage`'s executor (`module.PipelineExecutor`), its messages completing at once;
    `subtract`: of a stub model, its compute handlers timed into the list `executor.inside`
    ([seconds, calls] since it was reset), else of `NoModel` chunks."""
    shape = (1, 4)
    mesh = Mesh.virtual(Layout(1, pp, 1), rank=stage, device="cpu")
    mesh.timeout_s = 60.0
    placement = placement_of(schedule)
    last = [virtual_stage(stage, c, pp, placement) == pp * v - 1 for c in range(v)]
    chunks = [StubChunk(shape, last[c]) for c in range(v)]
    model = Chunks(v) if v > 1 else chunks[0]
    if v > 1:
        model.chunks = nn.ModuleList(chunks)
    executor = module.PipelineExecutor(model, mesh, schedule, shape, timeout_s=60, trace=trace,
                                       virtual_stages=v)
    executor.p2p, executor.post_ahead = InstantP2P(shape), False  # NCCL's issue order
    executor._mean_loss = lambda m: torch.zeros(())  # a collective: a wait, not host work
    executor.inside = [0.0, 0]
    if subtract:
        for kind, handler in list(executor.handlers.items()):
            executor.handlers[kind] = _timed(handler, executor.inside)
    else:
        executor.chunks = [NoModel(shape, last[c]) for c in range(v)]
        # a whole backward (DualPipeV's) leaves no gradient on an input handed over in memory,
        # as no backward ran: not the error it is in a real step
        executor._no_input_grad = lambda action: None
    return executor


def load_baseline(path: str):
    """The executor module in file `path` (an earlier `megapar/pipeline/executor.py`, e.g. from
    `git show REV:megapar/pipeline/executor.py`), imported under its own name. It gets the
    status line in the form it was written for, whichever this tree's `status.action_line`
    gives: a byte memoryview where it writes ``line[:len(said)] = said`` (before
    `status.action_line` gave a ctypes char array), a char array where ``line.value = said``."""
    spec = importlib.util.spec_from_file_location("baseline_executor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(path) as f:
        source = f.read()
    if "line[:len(" in source:
        module.action_line = _view_line
    elif "line.value =" in source:
        module.action_line = _char_line
    return module


def _view_line(longest: int):
    """`status.action_line` as a byte memoryview of the shared line."""
    line = status.action_line(longest)
    return line if line is None or isinstance(line, memoryview) else memoryview(line).cast("B")


def _char_line(longest: int):
    """`status.action_line` as a ctypes char array over the shared line."""
    line = status.action_line(longest)
    return (line if line is None or isinstance(line, ctypes.Array)
            else (ctypes.c_char * len(line)).from_buffer(line))


def _timed(handler, inside: list):
    """`handler` with its thread CPU time added to inside[0] and its calls counted in inside[1]."""
    def timed(action):
        start = time.thread_time()
        handler(action)
        inside[0] += time.thread_time() - start
        inside[1] += 1
    return timed


def timer_cost(calls: int = 5000, repeat: int = 7) -> float:
    """Seconds a `_timed` handler adds outside its measured interval per call, over calling the
    handler itself (the wrapper, and the part of each clock reading that falls outside): the
    executor did not spend them, so `host_work` subtracts them per compute. Measured with a
    handler that does nothing, minimum of `repeat` runs."""
    def noop(action):
        pass

    inside, best = [0.0, 0], float("inf")
    timed = _timed(noop, inside)
    for _ in range(repeat):
        inside[:] = [0.0, 0]
        start = time.thread_time()
        for _ in range(calls):
            timed(None)
        wrapped = time.thread_time() - start - inside[0]
        start = time.thread_time()
        for _ in range(calls):
            noop(None)
        best = min(best, (wrapped - (time.thread_time() - start)) / calls)
    return max(best, 0.0)


TIMER_COST = 0.0
"""`timer_cost()`, measured by `main` before the host-work table."""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=positive, default=3, help="planning runs per stage")
    parser.add_argument("--steps", type=positive, default=20,
                        help="host work: steps per stage (the minimum is kept)")
    parser.add_argument("--subtract-handlers", action="store_true",
                        help="host work as measured before: a stub model that computes, the "
                             "compute handlers' time subtracted")
    parser.add_argument("--baseline", metavar="FILE",
                        help="an earlier executor.py (git show REV:megapar/pipeline/executor.py "
                             "> FILE), measured taking turns with this tree's")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host work (not the planning table)")
    parser.add_argument("--stage", type=int, metavar="S",
                        help="host work: only stage S (e.g. 8, a middle stage), alone: its data "
                             "stay in the caches between its steps, as they do not when the "
                             "other stages run in between")
    parser.add_argument("--each-stage-alone", action="store_true",
                        help="host work: every stage measured alone in turn (as `--stage`, "
                             "one after the other), the slowest printed: each rank runs one "
                             "stage in a process of its own, its data warm between its steps")
    parser.add_argument("--schedules", nargs="+", metavar="NAME",
                        help="only the layouts of these schedules (default: all of LAYOUTS)")
    args = parser.parse_args(argv)
    if args.baseline and not Path(args.baseline).is_file():
        parser.error(f"--baseline {args.baseline}: no such file (make it: git show "
                     f"REV:megapar/pipeline/executor.py > FILE)")
    if args.stage is not None and args.each_stage_alone:
        parser.error("--stage and --each-stage-alone exclude each other: pick one")
    layouts = [layout for layout in LAYOUTS
               if args.schedules is None or layout[0] in args.schedules]
    unknown = sorted(set(args.schedules or ()) - {layout[0] for layout in LAYOUTS})
    if unknown:
        parser.error(f"--schedules {' '.join(unknown)}: no layout of that schedule; those "
                     f"measured: {', '.join(dict.fromkeys(layout[0] for layout in LAYOUTS))}")
    torch.set_num_threads(1)
    if not args.host_only:
        print(f"{'schedule':12} {'pp':>3} {'m':>4} {'V':>2} | {'every step before':>18} | "
              f"{'each later step':>16}")
    for schedule, pp, m, v in [] if args.host_only else layouts:
        cold, warm = stage_times(schedule, pp, m, v, args.repeat)
        print(f"{schedule:12} {pp:3d} {m:4d} {v:2d} | {cold * 1e3:15.2f} ms | "
              f"{warm * 1e6:13.2f} us")
    shared = ctypes.create_string_buffer(256)  # the launcher's status line, as in a worker
    status.begin(shared)  # a worker's run record over it (setting a module field, as this did
    status.set_step(1000)  # before faults.status kept a record per run, measured no line)
    global TIMER_COST
    if args.subtract_handlers:
        TIMER_COST = timer_cost()
        print(f"\nthe compute handlers' timer: {TIMER_COST * 1e6:.2f} us a compute outside its "
              f"measured time, subtracted")
    modules = (executor_module,) + ((load_baseline(args.baseline),) if args.baseline else ())
    print("\nhost work per step, " + (f"stage {args.stage} alone" if args.stage is not None
                                       else "slowest stage, each measured alone"
                                       if args.each_stage_alone else "slowest stage")
          + ", traced / untraced (ms)"
          + (f"; before = {args.baseline}, taking turns with this tree's" if args.baseline
             else ""))
    print(f"{'schedule':12} {'pp':>3} {'m':>4} {'V':>2} | {'now':>13}"
          + (f" | {'before':>13} | now / before" if args.baseline else ""))
    for schedule, pp, m, v in layouts:
        groups = ([[args.stage % pp]] if args.stage is not None
                  else [[stage] for stage in range(pp)] if args.each_stage_alone else [None])
        runs = []
        for trace in (True, False):
            best = [[float("inf")] * pp for _ in modules]  # per module, per stage
            for stages in groups:  # alone: one stage's steps, then the next stage's
                measured = host_work(schedule, pp, m, v, trace, args.steps,
                                     args.subtract_handlers, modules, stages)
                best = [[min(a, b) for a, b in zip(old, new)]
                        for old, new in zip(best, measured)]
            runs.append([max(t for t in per_stage if t != float("inf")) for per_stage in best])
        cells = [f"{runs[0][i] * 1e3:5.2f} / {runs[1][i] * 1e3:5.2f}"
                 for i in range(len(modules))]
        ratio = (f" | {runs[0][0] / runs[0][1]:.2f} / {runs[1][0] / runs[1][1]:.2f}"
                 if args.baseline else "")
        print(f"{schedule:12} {pp:3d} {m:4d} {v:2d} | " + " | ".join(cells) + ratio)


if __name__ == "__main__":
    main()
