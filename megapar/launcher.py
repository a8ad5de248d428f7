"""Start N local worker processes, one per rank, and bring them all down if one fails.

Used by the tests (fork: cheap, because the parent has already imported torch), by
`megapar-train`, `megapar-eval` and `megapar-generate` when they are not run under torchrun, by
`megapar-bubble`, `megapar.launch` and the schedule certificate's real steps
(`pipeline/certify_real.py`). Under CUDA the start method is spawn (CUDA cannot be forked).

A worker that raises sends its traceback to the parent, which kills the other workers at once
(they may be blocked in a collective) and raises `WorkerError` naming the rank that caused it:
a rank that died (with its exit code or signal) before the ranks that failed because of it, and
on a timeout the rank that did not answer.

Workers die with the launcher (`die_with_parent`), run in their own process group (a terminal's
Ctrl-C reaches the launcher only, which forwards it once), and receive the launcher's SIGTERM /
SIGUSR1 / SIGINT. Rank 0 serves the rendezvous store on 127.0.0.1 only, and gloo's sockets
listen on the loopback interface only (GLOO_SOCKET_IFNAME=lo, whatever the environment says).
"""

from __future__ import annotations

import functools
import gc
import glob
import json
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megapar import device as _device
from megapar.faults import progress, stop
from megapar.faults import status as diagnostics
from megapar.faults.blame import (
    begin_marks,
    blame,
    consequential,
    forget_stale_marks,
    state,
    stopped_siblings,
)
from megapar.faults.processes import (  # noqa: F401
    die_with_parent,
    finish_before_exit,
    launcher_alive,
    pid_alive,
)
from megapar.faults.report import run_log_name, use_run_log_name
from megapar.faults.status import diagnose
from megapar.host_memory import share_host_arena
from megapar.shared_gpu import SHARED_GPU_ENV
from megapar.wording import counted


class WorkerError(RuntimeError):
    """A worker process failed; the message names the rank and carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket() -> socket.socket:
    """A socket listening on a free port of 127.0.0.1, for a forked rank 0 to serve the store
    on (`loopback_store`): bound before any worker starts, so no other process can take the
    port in between, as one can between `free_port` and a later bind."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def loopback_store(
    rank: int, world_size: int, port: int, timeout_s: float | None, listen_fd: int | None = None
):
    """The rendezvous store of a local run: rank 0 serves it on 127.0.0.1 only, on the
    listening socket it inherited (`listen_fd`, forked workers: `listening_socket`) or on one
    it binds to `port`."""

    timeout = timedelta(seconds=timeout_s or _device.DEFAULT_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    if listen_fd is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        listen_fd = sock.detach()
    store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout, master_listen_fd=listen_fd)
    return store


def _worker(
    fn,
    rank,
    world_size,
    port,
    args,
    kwargs,
    results,
    timeout_s,
    env,
    parent,
    status,
    stacks,
    nccl_timeout_s=None,
    listen_fd=None,
):
    # What the worker inherited (its launcher's or forkserver's heap: torch's modules, a test
    # runner's) is frozen: its collections (the full ones, and release_process_groups') skip
    # it instead of walking it while holding the GIL, which the result's queue thread needs
    gc.freeze()
    share_host_arena()  # before any thread of this worker allocates
    # a forkserver's worker is the forkserver's child, which ends with the launcher
    die_with_parent(parent if parent is not None else os.getppid())
    # its launcher's exits on SIGHUP, SIGQUIT, SIGUSR2 undone before faulthandler's dump on
    # SIGUSR2 is installed: after it, the launcher's handler still read as installed (signal.
    # getsignal does not see faulthandler's) and SIG_DFL replaced the dump, killing the rank
    # whose stack was asked for (a new user's finding)
    stop.default_on_signals(stop.ABORT_SIGNALS)
    diagnostics.install(rank, status, os.path.join(stacks, f"rank{rank}.txt"))  # its own
    begin_marks()  # records, not those of its launcher's process (a run before, in a test)
    stop.terminate_on_sigterm(replace=True)  # not the launcher's handler (its --save lock's)
    stop.watch_sigterm()  # a forwarded SIGTERM is obeyed while waiting
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher, which forwards it once
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    if sys.platform.startswith("linux"):  # gloo's own sockets: loopback too, whatever the
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # environment said (a cluster's interface)
    if listen_fd is not None and rank != 0:  # rank 0's to serve the store on
        os.close(listen_fd)
        listen_fd = None
    _device.LaunchStore.keep(None)  # a forked worker's parent's is not its own
    try:
        torch.set_num_threads(1)
        if world_size > 1:
            store = loopback_store(rank, world_size, port, timeout_s, listen_fd)
            _device.LaunchStore.keep(store)  # to join again after a destroy_process_group
            _device.init_distributed(
                rank, world_size, timeout_s=timeout_s, store=store, nccl_timeout_s=nccl_timeout_s
            )
        out = fn(*args, **kwargs)
        finish_before_exit()  # a background checkpoint write still in flight (no atexit here)
        # By value: torch's queue reducers would share tensors through file descriptors that
        # vanish when this process exits.
        results.put((rank, "ok", _returned(out, rank)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        tb = "" if getattr(exc, "no_traceback", False) else "\n" + traceback.format_exc()
        results.put((rank, "error", error_line(exc) + tb))
    finally:
        try:
            if dist.is_initialized():
                release_process_groups()  # a spawned worker exits through the interpreter
        except Exception:  # noqa: BLE001
            pass
        _device.LaunchStore.keep(None)  # the store lives as long as this call, as before


class UnsendableResult(TypeError):
    """A worker's return value that cannot be pickled back to the launcher (an engine, a
    process group): one line naming the value and what to return instead."""

    no_traceback = True  # the worker's stack says nothing the line does not


def _returned(out: Any, rank: int) -> bytes:
    """`out` pickled for the launcher; `UnsendableResult` naming its type when it holds what
    cannot leave the worker (process groups, open files, locks)."""
    try:
        return pickle.dumps(out)
    except Exception as exc:  # noqa: BLE001 - pickling raises many kinds
        raise UnsendableResult(
            f"rank {rank}'s fn returned a value of type {type(out).__name__}, which cannot be "
            f"sent back from its worker process ({type(exc).__name__}: {exc}); return plain "
            f"values (numbers, strings, lists, dicts, CPU tensors, a model's state_dict()), not "
            f"the engine or anything holding its process groups, which live only inside fn"
        ) from None


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout_s: float | None = 240.0,
    collective_timeout_s: float | None = None,
    start_method: str | None = None,
    env: dict[str, str] | None = None,
    forward: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT"),
    nccl_timeout_s: float | None = None,
    optimizers: bool = True,
    rank_place: Callable[[int], str] | None = None,
    **kwargs,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` local ranks and return each rank's result.

    timeout_s=None waits as long as the workers run (training); collectives still time out
    after `collective_timeout_s` (default: megapar.device.DEFAULT_TIMEOUT_S; on NCCL after
    `nccl_timeout_s`, default megapar.device.DEFAULT_NCCL_TIMEOUT_S). With CUDA (unless `env`
    or the environment sets MEGAPAR_CPU=1) each rank takes its own GPU: more ranks than GPUs
    is a `megapar.device.DeviceError` before any worker starts, unless MEGAPAR_SHARED_GPU=1
    (in `env` or the environment) shares them over gloo (`megapar.shared_gpu`).

    The process group is initialised before `fn` runs (RANK / WORLD_SIZE are in the
    environment). Raises `WorkerError` naming the rank that caused the failure
    (`megapar.faults.blame`), or a `TimeoutError` naming the ranks that had not finished after
    `timeout_s`. The signals named in `forward` are passed on to the workers; a second SIGINT
    (after `megapar.faults.stop.SAME_INTERRUPT_S`) aborts. start_method: "fork" (default on
    CPU), "spawn" (default on CUDA) or "forkserver" (workers forked from Python's forkserver,
    with whose end they die: it ends with this process). optimizers=False: the workers build no
    torch optimizer (an evaluation, a pipeline of toy stages), so torch._dynamo, which building
    one imports, is not imported for them before forking. rank_place: where a rank sits in
    the job's mesh (`megapar.mesh.Layout.place`), for the report of a rank that died or never
    answered.
    """
    on_cpu = (env or {}).get("MEGAPAR_CPU", os.environ.get("MEGAPAR_CPU", "0")) == "1"
    shared = (env or {}).get(SHARED_GPU_ENV, os.environ.get(SHARED_GPU_ENV, "")) == "1"
    if not on_cpu and not shared:  # several ranks per GPU: megapar.shared_gpu
        _device.check_gpus(world_size)
    if start_method is None:
        start_method = "spawn" if _device.use_cuda() else "fork"
    if start_method == "fork" and optimizers:
        # torch's optimizers import torch._dynamo when built (torch marks add_param_group with
        # its lazy form of torch.compiler.disable, as megapar.graph_break): imported here once,
        # the forked workers share it instead of each importing it (its cost: docs/testing.md)
        import torch._dynamo  # noqa: F401
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    # forked workers inherit the store's listening socket (no window for another process to
    # take its port); spawned ones get a port that was free a moment ago
    listener = listening_socket() if start_method == "fork" and world_size > 1 else None
    port = listener.getsockname()[1] if listener is not None else free_port()
    coll_timeout = collective_timeout_s or (max(10.0, timeout_s - 5.0) if timeout_s else None)
    _remove_dead_stacks()
    stacks = tempfile.mkdtemp(prefix=f"{STACKS_PREFIX}{os.getpid()}-")
    statuses = [ctx.RawArray("c", 256) for _ in range(world_size)]
    procs = [
        ctx.Process(  # type: ignore[attr-defined]  # typeshed's BaseContext lacks Process
            target=_worker,
            daemon=True,
            args=(
                fn,
                r,
                world_size,
                port,
                args,
                kwargs,
                results,
                coll_timeout,
                env or {},
                None if start_method == "forkserver" else os.getpid(),
                statuses[r],
                stacks,
                nccl_timeout_s,
                None if listener is None else listener.fileno(),
            ),
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        if listener is not None:  # rank 0 holds it now
            listener.close()
    deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
    restore = _forward_signals(procs, forward)
    try:
        outputs = _await_results(procs, results, statuses, stacks, deadline, timeout_s, rank_place)
    finally:
        try:  # the workers end under the forwarding handlers: a second SIGINT is one still
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
        finally:
            restore()
            shutil.rmtree(stacks, ignore_errors=True)
    return [outputs[r] for r in range(world_size)]


def _await_results(
    procs,
    results,
    statuses,
    stacks: str,
    deadline: float,
    timeout_s: float | None,
    rank_place: Callable[[int], str] | None = None,
) -> dict[int, Any]:
    """Every rank's result from the `results` queue, by rank; `WorkerError` naming the rank
    that caused a failure (a moment after the first error or death, for the others' reports;
    with its place in the mesh, `rank_place`, where given), `TimeoutError` naming the
    unfinished ranks past `deadline`."""
    world_size = len(procs)
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at = None
    while len(outputs) < world_size:
        _drain(results, outputs, errors, block=0.05)
        dead = [
            r
            for r, p in enumerate(procs)
            if r not in outputs and r not in errors and p.exitcode not in (None, 0)
        ]
        if (errors or dead) and failed_at is None:
            failed_at = time.monotonic()  # give the others' reports a moment to arrive
        if failed_at is not None and time.monotonic() - failed_at > 0.5:
            _drain(results, outputs, errors, block=0.0)
            last = [s.value.decode(errors="replace") for s in statuses]
            raise WorkerError(
                f"{blame(procs, outputs, errors, last, rank_place)}\n"
                f"{diagnose(procs, statuses, stacks)}"
            )
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in outputs]
            raise TimeoutError(
                f"ranks {missing} did not finish within {timeout_s:.0f} s"
                + "".join(f"; rank {r} {state(procs[r])}" for r in missing if state(procs[r]))
                + f"\n{diagnose(procs, statuses, stacks)}"
            )
    return outputs


STACKS_PREFIX = "megapar-stacks-"
"""Workers write their stacks to TMPDIR/megapar-stacks-<launcher pid>-<random>/ (diagnostics)."""


def _remove_dead_stacks() -> None:
    """Delete the stack directories of launchers that are gone (a kill -9 leaves its own)."""

    for path in glob.glob(os.path.join(tempfile.gettempdir(), STACKS_PREFIX + "*-*")):
        pid = os.path.basename(path)[len(STACKS_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        if not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _drain(results, outputs: dict, errors: dict, block: float) -> None:
    while True:
        try:
            rank, status, payload = results.get(timeout=block) if block else results.get_nowait()
        except queue_mod.Empty:
            return
        block = 0.0
        if status == "error":
            errors[rank] = payload
        else:
            outputs[rank] = pickle.loads(payload)


def _forward_signals(procs, names) -> Callable[[], None]:
    """Forward the signals `names` to the workers (a second SIGINT aborts the launcher; one
    within `stop.SAME_INTERRUPT_S` of the first is that one delivered twice, not forwarded);
    one ignored when the launcher started stays ignored. Returns a function that restores the
    previous handlers. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    interrupts = stop.Interrupts()

    def forward(signum, frame):
        if signum == signal.SIGINT:
            which = interrupts.arrive()
            if which == 0:  # the first again (`timeout -s INT`, a terminal): forwarded once
                return
            if which == 2:
                raise KeyboardInterrupt("second SIGINT: aborting")
        for p in procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    # a signal this process was started ignoring (SIGINT in a non-interactive shell's
    # background job) stays ignored, as Python itself leaves it: the workers inherit the
    # disposition, so forwarding it would stop nothing while the launcher believed it had
    old = {
        sig: signal.signal(sig, forward)
        for sig in (getattr(signal, n) for n in names if hasattr(signal, n))
        if signal.getsignal(sig) is not signal.SIG_IGN
    }

    def restore():
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore


def local_worker_limit() -> int:
    """How many worker processes megapar starts on this machine unless told to oversubscribe:
    4 per CPU core this process may use, at least 8 (tp 2 x pp 2 x dp 2 on 2 cores)."""
    return max(8, 4 * _device.cpu_cores())


def check_local_workers(n: int, what: str, flag: str = "--oversubscribe") -> None:
    """ValueError (one line naming the fix) when `what` would start more local workers than
    `local_worker_limit`; dozens of processes on a few cores only thrash."""
    limit = local_worker_limit()
    if n > limit:
        raise ValueError(
            f"{what} starts {n} local worker processes, more than this machine "
            f"runs well ({limit}: 4 per CPU core, at least 8); use fewer, run under "
            f"torchrun / Slurm across machines, or pass {flag} to start them anyway"
        )


def under_launcher() -> bool:
    """True under torchrun, or under `srun` with several tasks (one process per rank, started
    by them; `megapar.device.adopt_slurm_environment` gives torch.distributed torchrun's
    variables then). Raises ValueError (one line naming the variable) when Slurm's variables
    are malformed (`megapar.device.check_slurm_environment`), and so are torchrun's
    (`check_torchrun_environment`)."""
    _device.check_torchrun_environment()
    _device.check_slurm_environment()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


SETTINGS_KEY = "megapar/settings"
"""The store keys of `check_same_settings`: rank 0's settings, the count of ranks that compared
theirs, the first difference found, the count of ranks that read it."""


def check_same_settings(settings: dict, timeout_s: float, what: str = "command") -> None:
    """Under torchrun / srun, raise ValueError on every rank when any rank's `settings` (a
    {flag: value} of what the ranks must agree on, JSON-serialisable) differ from rank 0's,
    naming the first rank found, the flags and both values. Nodes started with other flags
    made the ranks build different groups: rank 0 failed with 'DistStoreError: wait timeout
    ... keys: /default_pg/0//7//cpu//0/1', the other with gloo's 'Connection closed by peer'.
    Every rank waits (at most `timeout_s`) until all have compared, and rank 0 (which may host
    the store) until all have read the difference; a few store operations per rank."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    settings = {**settings, _PER_NODE: launched_local_size()}
    mine = json.loads(json.dumps(settings, sort_keys=True, default=str))
    if rank == 0:
        store.set(SETTINGS_KEY, json.dumps(mine, sort_keys=True))
    else:
        store.wait([SETTINGS_KEY], timedelta(seconds=timeout_s))
        theirs = json.loads(store.get(SETTINGS_KEY))
        differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if _PER_NODE in differ:  # another count on this node: the job is not the one planned
            store.compare_set(
                SETTINGS_KEY + "/differ",
                "",
                f"rank {rank}'s node started {counted(mine[_PER_NODE], 'process', 'processes')}"
                f" where rank 0's started {theirs[_PER_NODE]}, so the job has "
                f"{counted(world, 'rank')} on nodes of unequal size; start every node with "
                f"the same count (torchrun --nproc-per-node, launch/torchrun_multinode.sh's "
                f"NPROC_PER_NODE, srun's tasks per node)",
            )
        elif differ:
            shown = ", ".join(
                f"{k} {theirs.get(k)!r} on rank 0 but {mine.get(k)!r} on rank {rank}"
                for k in differ[:4]
            )
            more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
            store.compare_set(
                SETTINGS_KEY + "/differ",
                "",
                f"rank {rank} was started with other {what} than rank 0: {shown}{more}; "
                f"give every node the same {what}",
            )
    if store.add(SETTINGS_KEY + "/compared", 1) == world:
        store.set(SETTINGS_KEY + "/all", "1")
    try:
        store.wait([SETTINGS_KEY + "/all"], timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        raise TimeoutError(
            f"rank {rank} waited {timeout_s:g} s for all {world} ranks to compare their "
            f"settings with rank 0's; some never did (a process that failed or was started "
            f"with another command?); --timeout-s sets the wait"
        ) from None
    found = (
        store.get(SETTINGS_KEY + "/differ").decode()
        if store.check([SETTINGS_KEY + "/differ"])
        else None
    )
    # rank 0 may host the store (srun, forked ranks): it leaves once every rank has read it (a
    # rank that read late got 'Connection reset by peer' instead of the line)
    if store.add(SETTINGS_KEY + "/read", 1) == world:
        store.set(SETTINGS_KEY + "/done", "1")
    if rank == 0 and found is not None:
        try:
            store.wait([SETTINGS_KEY + "/done"], timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            pass  # one that never reads: the line is raised all the same
    if found is not None:
        mismatch = ValueError(found)
        mismatch.no_traceback = True  # type: ignore[attr-defined]  # the line says it all
        raise mismatch


_PER_NODE = "processes on its node"
"""`check_same_settings`' entry for the processes torchrun / srun started on a rank's node."""


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def launched_local_size() -> int:
    """Processes torchrun / srun started on this node (LOCAL_WORLD_SIZE, Slurm's tasks per
    node), at least this one's local rank + 1."""
    per_node = (
        os.environ.get("LOCAL_WORLD_SIZE")
        or os.environ.get("SLURM_NTASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", ""))
        .split("(")[0]
        .split(",")[0]
    )
    return max(int(per_node) if per_node.isdigit() else 1, _device.env_local_rank() + 1)


def release_process_groups() -> None:
    """Destroy the default process group and every group made from it, and free them now.

    A gloo group frees its worker threads only when its last reference goes. One still alive
    when the interpreter exits can abort the process after a clean run ("terminate called
    without an active exception", SIGABRT): a worker thread that drops the last reference to
    a finished collective's tensor needs the GIL, which the exiting interpreter no longer
    gives. `destroy_process_group` forgets the groups; the collection frees the objects that
    still held them (an engine, its mesh, their cycles), so every group's threads are joined
    here. Call it on every rank once no collective is left, as torchtitan does on success."""
    dist.destroy_process_group()
    gc.collect()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    collective_timeout_s: float | None = None,
    forward: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT"),
    nccl_timeout_s: float | None = None,
    optimizers: bool = True,
    rank_place: Callable[[int], str] | None = None,
) -> list[Any]:
    """Run `fn(*args)` as this process's rank under torchrun / Slurm, or else start
    `world_size` local workers (in this process when world_size is 1; `optimizers` and
    `rank_place` as `run_local` takes them). Returns the results of the ranks this process
    ran. Under torchrun / Slurm the default process group is set up before `fn` and, if it was
    set up here, released (`release_process_groups`) once `fn` returns."""
    if under_launcher():
        if "OMP_NUM_THREADS" not in os.environ and launched_local_size() > 1:
            torch.set_num_threads(1)  # torchrun's default; srun's tasks had every core each
        _device.adopt_slurm_environment()  # srun without torchrun: torchrun's variables
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun: die with its agent
            die_with_parent(os.getppid())
        forget_stale_marks()  # what ranks of finished jobs found stopped
        # this run's own records: its status, and (once its ranks agree on a token) the ranks
        # found stopped; never a run's before in this process
        diagnostics.install(int(os.environ["RANK"]))
        token = begin_marks().run
        stop.terminate_on_sigterm()  # torchrun's SIGTERM: obeyed while waiting; a rank
        stop.watch_sigterm()  # blocked in a wait writes its stacks as one block
        ours = not dist.is_initialized()
        _device.init_distributed(timeout_s=collective_timeout_s, nccl_timeout_s=nccl_timeout_s)
        # one directory of rank logs for the job, also without --save's lock record to read,
        # and one token for its records of stopped ranks: rank 0's
        agreed = progress.rank0_value(dist.get_rank(), "run_log", f"{run_log_name()} {token}")
        name, _, token = agreed.partition(" ")
        use_run_log_name(name)
        begin_marks(token)
        progress.start(dist.get_rank(), dist.get_world_size())  # in the store: who is behind
        try:
            out = fn(*args)
            progress.mark_returned()  # for the ranks a call made here only leaves waiting
        except BaseException as exc:  # a KeyboardInterrupt or SystemExit leaves its peers too
            _name_the_cause(exc)
            raise
        finally:
            progress.stop()
        finish_before_exit()  # a background write in flight, before its group goes
        if ours and dist.is_initialized():  # after a failure the others may be in a collective
            release_process_groups()
        return [out]
    if world_size == 1:  # a run of its own in this process: its own records
        diagnostics.begin()
        begin_marks()
        return [fn(*args)]
    return run_local(
        fn,
        world_size,
        *args,
        timeout_s=None,
        collective_timeout_s=collective_timeout_s,
        forward=forward,
        nccl_timeout_s=nccl_timeout_s,
        optimizers=optimizers,
        rank_place=rank_place,
    )


def error_line(exc: BaseException) -> str:
    """What `fn` raised on a rank, as its report names it (under either launcher): `KeyError:
    'x'`, a bare `KeyboardInterrupt` where it says nothing more, and an exit as one that left
    the other ranks waiting (`SystemExit(0)` too), or, with the code a SIGTERM's becomes
    (`stop.sigterm_as_exit`), as that stop; a `RunStopped` as its message alone."""
    if isinstance(exc, SystemExit):
        if exc.code == stop.SIGTERM_EXIT_CODE:
            return f"SystemExit({exc.code}): terminated (SIGTERM)"
        return f"SystemExit({exc.code!r}): it exited while the other ranks still waited for it"
    if type(exc) is stop.RunStopped:  # a clear stop's message says it all (a forked eval's
        return str(exc)  # full disk said "RunStopped: --save-logits ..."; a re-test)
    return type(exc).__name__ + (f": {exc}" if str(exc) else "")


def _name_the_cause(exc: BaseException) -> None:
    """Under torchrun / srun, where no launcher of ours sees every rank, what `fn` raised on
    this rank: an error of its own is recorded in the job's store, for the ranks that lose it
    (`progress.mark_failed`); a lost peer or a timed-out wait gets a note naming the rank it
    follows from (a stopped rank of this node, else the store's records: `rank 1 failed at
    step 2, ...: KeyError: 'x'`), as megapar-train's error begins with it."""
    error = error_line(exc).split("\n", 1)[0]  # whole: what makes it consequential may be late
    if not consequential(error):
        progress.mark_failed(error)
        return
    stopped = stopped_siblings()
    if stopped:
        progress.mark_failed(found=stopped)  # for the ranks of other nodes
    cause = stopped or progress.holding_up()
    if cause:
        exc.add_note(f"{cause}{progress.gave_up(cause, dist.get_rank())}")


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args,
    timeout_s: float | None = None,
    oversubscribe: bool = False,
) -> Any:
    """Run `fn(*args)` on `nprocs` local ranks and return rank 0's return value.

    The notebook launcher: works in a script and in Jupyter / IPython (workers are forked, so
    `fn` may be defined in the notebook; with CUDA they are spawned, except in a notebook
    before CUDA is initialised, where they are forked as well). The process group is set up
    before `fn` runs (use `megapar.prepare` inside it). A failing rank brings all down and
    raises `WorkerError` naming it. Under torchrun / Slurm (RANK / WORLD_SIZE set) `fn` runs
    once as this process's rank and its value is returned; `nprocs` is then ignored (an error
    `fn` raises is recorded in the job's store, and the ranks that lose this one add a note
    naming it, its step and its error: `_name_the_cause`).
    One rank is a worker process too, as every rank is. `timeout_s`: give up (naming the
    unfinished ranks) after this long; None waits. More
    processes than `local_worker_limit` (4 per CPU core, at least 8) is a ValueError before any
    starts, unless `oversubscribe=True`; an `fn` that is not callable or an `nprocs` that is not
    an int is a TypeError before any starts.
    """
    if not callable(fn):
        raise TypeError(
            f"megapar.launch(fn, nprocs, *args): fn must be a function to run on every rank, "
            f"got {type(fn).__name__} {fn!r:.60}; pass the function itself, e.g. "
            f"megapar.launch(train, 4, steps)"
        )
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise TypeError(
            f"megapar.launch(fn, nprocs, *args): nprocs must be an int, got "
            f"{type(nprocs).__name__} {nprocs!r:.60}"
        )
    if under_launcher():
        return run_workers(_callers_function, launched_world_size(), fn, *args)[0]
    if nprocs < 1:
        raise ValueError(f"megapar.launch needs nprocs >= 1, got {nprocs}")
    if not oversubscribe:
        check_local_workers(nprocs, f"megapar.launch(fn, {nprocs})", flag="oversubscribe=True")
    method = None
    if _device.use_cuda():
        method = "fork" if _in_notebook() and not torch.cuda.is_initialized() else "spawn"
    fn, args = _callers_function, (fn, *args)
    if nprocs == 1:  # run_local makes no group for one rank; launch's fn finds one
        fn, args = _in_group_of_one, (fn, *args)
    return run_local(fn, nprocs, *args, timeout_s=timeout_s, start_method=method)[0]


def _callers_function(fn: Callable[..., Any], *args) -> Any:
    """`fn(*args)`, the rank's status naming `fn` as the caller's code until a megapar call
    (`megapar.prepare`) says more, so a rank stalled or failed there is reported as such."""
    inner = fn
    while isinstance(inner, functools.partial):  # the user's function, not "partial"
        inner = inner.func
    name = getattr(inner, "__qualname__", type(inner).__qualname__)
    calling = f"calling {name} (the caller's code, which megapar.launch runs)"
    diagnostics.set_action(calling)
    out = fn(*args)
    if diagnostics.current().action_text() == calling:  # a megapar call's status says more
        diagnostics.set_action(f"{name} returned")  # what its peers see while they still work
    return out


def _in_group_of_one(fn: Callable[..., Any], *args) -> Any:
    """`fn(*args)` in a worker of `megapar.launch(fn, 1)`, as the one rank of a process group
    on an in-process store (kept, so that `fn` can destroy the group and join again)."""
    store = dist.HashStore()
    _device.LaunchStore.keep(store)
    _device.init_distributed(0, 1, store=store)
    return fn(*args)
