"""Start N local worker processes, one per rank, and bring them all down if one fails.

Used by the tests (fork: 8 gloo ranks start in well under a second, because the parent has
already imported torch), by `megapar-train` when it is not run under torchrun, and by
`megapar-bubble`. Under CUDA the start method is spawn (CUDA cannot be forked).

A worker that raises sends its traceback to the parent, which terminates the other workers at
once (they may be blocked in a collective) and raises `WorkerError` naming the rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

from megapar import device as _device


class WorkerError(RuntimeError):
    """A worker process failed; the message names the rank and carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, kwargs, results, timeout_s, env, status, stacks):
    from megapar import diagnostics

    diagnostics.install(rank, status, os.path.join(stacks, f"rank{rank}.txt"))
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        import torch

        torch.set_num_threads(1)
        if world_size > 1:
            _device.init_distributed(rank, world_size, timeout_s=timeout_s)
        out = fn(*args, **kwargs)
        # By value: torch's queue reducers would share tensors through file descriptors that
        # vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_local(fn: Callable[..., Any], world_size: int, *args, timeout_s: float | None = 240.0,
              collective_timeout_s: float | None = None, start_method: str | None = None,
              env: dict[str, str] | None = None, **kwargs) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` local ranks and return each rank's result.

    timeout_s=None waits as long as the workers run (training); collectives still time out
    after `collective_timeout_s` (default: megapar.device.DEFAULT_TIMEOUT_S).

    The process group is initialised before `fn` runs (RANK / WORLD_SIZE are in the
    environment). Raises `WorkerError` naming the first rank that failed, or a `TimeoutError`
    naming the ranks that had not finished after `timeout_s`.
    """
    if start_method is None:
        start_method = "spawn" if _device.use_cuda() else "fork"
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    coll_timeout = collective_timeout_s or (max(10.0, timeout_s - 5.0) if timeout_s else None)
    stacks = tempfile.mkdtemp(prefix="megapar-stacks-")
    statuses = [ctx.RawArray("c", 256) for _ in range(world_size)]
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, port, args, kwargs, results, coll_timeout,
                               env or {}, statuses[r], stacks))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
    try:
        _collect(procs, results, outputs, deadline, timeout_s)
    except (WorkerError, TimeoutError) as exc:
        raise type(exc)(f"{exc}\n{_diagnose(procs, statuses, stacks)}") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(stacks, ignore_errors=True)
    return [outputs[r] for r in range(world_size)]


def _diagnose(procs, statuses, stacks: str, settle_s: float = 0.5) -> str:
    """Every rank's status and (for ranks still running) Python stack, dumped on SIGUSR1."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except (OSError, AttributeError):
            pass
    time.sleep(settle_s if alive else 0.0)  # faulthandler writes at once; let the files settle
    lines = ["what every rank was doing when the run failed (status; stack of running ranks):"]
    for r, p in enumerate(procs):
        state = statuses[r].value.decode(errors="replace") or "not started"
        lines.append(f"--- rank {r}: {state}" + ("" if r in alive else " [exited]"))
        path = os.path.join(stacks, f"rank{r}.txt")
        if r in alive and os.path.exists(path):
            with open(path) as f:
                lines.append(f.read().rstrip())
    return "\n".join(lines)


def _collect(procs, results, outputs, deadline, timeout_s) -> None:
    """Gather each rank's result; raise at the first failure or at the deadline."""
    world_size = len(procs)
    while len(outputs) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.05)
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if r not in outputs and p.exitcode not in (None, 0):
                    time.sleep(0.2)  # its traceback may still be in flight
                    _drain(results, outputs)
                    if r not in outputs:
                        raise WorkerError(f"rank {r} died with exit code {p.exitcode}")
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in outputs]
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            continue
        if status == "error":
            raise WorkerError(f"rank {rank} failed: {payload}")
        outputs[rank] = pickle.loads(payload)


def _drain(results, outputs):
    while True:
        try:
            rank, status, payload = results.get_nowait()
        except queue_mod.Empty:
            return
        if status == "error":
            raise WorkerError(f"rank {rank} failed: {payload}")
        outputs[rank] = pickle.loads(payload)


def under_launcher() -> bool:
    """True under torchrun / Slurm (they set the rank environment for us)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def run_workers(fn: Callable[..., Any], world_size: int, *args,
                collective_timeout_s: float | None = None) -> list[Any]:
    """Run `fn(*args)` as this process's rank under torchrun / Slurm, or else start
    `world_size` local workers (in this process when world_size is 1). Returns the results of
    the ranks this process ran."""
    if under_launcher():
        if os.environ.get("SLURM_PROCID") and "RANK" not in os.environ:
            os.environ.update(RANK=os.environ["SLURM_PROCID"],
                              WORLD_SIZE=os.environ["SLURM_NTASKS"],
                              LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        from megapar import diagnostics

        diagnostics.install(int(os.environ["RANK"]), on_sigterm=True)
        _device.init_distributed(timeout_s=collective_timeout_s)
        return [fn(*args)]
    if world_size == 1:
        return [fn(*args)]
    return run_local(fn, world_size, *args, timeout_s=None,
                     collective_timeout_s=collective_timeout_s)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def launch(fn: Callable[..., Any], nprocs: int, *args, timeout_s: float | None = None) -> Any:
    """Run `fn(*args)` on `nprocs` local ranks and return rank 0's return value.

    The notebook launcher: works in a script and in Jupyter / IPython (workers are forked, so
    `fn` may be defined in the notebook; with CUDA they are spawned, except in a notebook
    before CUDA is initialised, where they are forked as well). The process group is set up
    before `fn` runs (use `megapar.prepare` inside it). A failing rank brings all down and
    raises `WorkerError` naming it. Under torchrun / Slurm (RANK / WORLD_SIZE set) `fn` runs
    once as this process's rank and its value is returned; `nprocs` is then ignored.
    `timeout_s`: give up (naming the unfinished ranks) after this long; None waits.
    """
    if under_launcher():
        return run_workers(fn, launched_world_size(), *args)[0]
    if nprocs < 1:
        raise ValueError(f"megapar.launch needs nprocs >= 1, got {nprocs}")
    method = None
    if _device.use_cuda():
        import torch

        method = "fork" if _in_notebook() and not torch.cuda.is_initialized() else "spawn"
    if nprocs == 1 and method is None:
        return fn(*args)
    return run_local(fn, nprocs, *args, timeout_s=timeout_s, start_method=method)[0]
