"""Asynchronous checkpoint saves: the state is copied to host memory, a background thread writes
and publishes it while training goes on.

`AsyncSaver.host_copy` replaces the live tensors of a rank's `SavedState` (see distributed.py)
by host copies, in buffers kept for the next save (allocating, and on a GPU pinning, 12 bytes a
parameter at every save would cost more than the copy): page-locked on a GPU
(`megapar.device.host_buffer`: the copies run on the current stream, ordered before the next
step's updates, and the host does not wait for them), plain host memory on the CPU. A
background thread then runs `write_checkpoint`, the same protocol as a synchronous save, over a
gloo group of its own, created with the saver (collectively, at start-up): NCCL runs a
communicator's operations in issue order, so collectives issued from a second thread on the
training's groups would interleave with the training's own and deadlock; a separate gloo group
on host tensors touches neither the GPU nor the training's communicators. The checkpoint is
published (and ``latest`` moved) by rank 0 once every rank's shard file is written, fsynced
and there with its size: a crash or SIGKILL before that leaves the previous ``latest``.

At most one write is in flight: `start` waits for the previous one. Every rank learns the
outcome of a write at the same step: `poll` (called at every step boundary) all-reduces one
"my writer is done" flag over the world while a write is pending, and `wait` joins the writer
(which cannot finish before every rank's has: the outcome is broadcast), so all ranks return or
raise together.

A write still in flight when the process's work ends is waited for before it exits
(`megapar.faults.processes.before_exit`): `megapar.launch`'s workers, torchrun's ranks and a
single process finish the write (or raise its failure) rather than lose it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megapar.checkpoint.distributed import SavedState, write_checkpoint
from megapar.checkpoint.format import CheckpointError, step_dir_name
from megapar.device import backend, connect_bound, host_buffer
from megapar.faults.blame import consequential
from megapar.faults.processes import before_exit
from megapar.faults.status import set_action
from megapar.mesh import Mesh, group_join_timeout

GROUP = "async_save"
"""The name of the writer's gloo group (its creation's errors say it)."""


class AsyncSaver:
    """One rank's background checkpoint writer (collective: every rank builds one, in the same
    order, and calls `start`, `poll` and `wait` together). `timeout_s`: how long the writer's
    collectives wait for the other ranks' writers (the run's save timeout); `join_timeout_s`
    (default `timeout_s`): how long the creation of its gloo group waits for every rank
    (--timeout-s; bounded at `megapar.device.CONNECT_BOUND` times that, and a rank that never
    comes named, as the mesh's groups are)."""

    def __init__(self, mesh: Mesh, timeout_s: float, join_timeout_s: float | None = None):
        self.mesh = mesh
        self.timeout_s = timeout_s
        self._step = 0  # the step of the write in flight (`start`)
        self.group = None
        if mesh.layout.world_size > 1 and dist.is_initialized():
            self.group = _writers_group(
                mesh.rank, mesh.layout.world_size, join_timeout_s or timeout_s
            )
            if timeout_s != (join_timeout_s or timeout_s):
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), self.group)
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._outcome: Path | BaseException | None = None
        self.pending: Path | None = None
        """The step directory the write in flight will publish (None: none in flight)."""
        self.published: int | None = None
        """The step of the last checkpoint this saver published."""
        before_exit(_finisher(weakref.ref(self)))

    # -- the host copy ------------------------------------------------------------------------
    def host_copy(self, state: SavedState, private: frozenset[str] = frozenset()) -> SavedState:
        """`state` with its shard's tensors replaced by host copies, in buffers this saver
        keeps for the next save (`megapar.device.host_buffer`: pinned for GPU tensors, whose
        copies run asynchronously on the current stream; `state.ready` is then the event the
        writer waits on). Keys in `private` are host tensors of the caller's that nothing else
        changes (the optimizer state a ZeRO-1 gather made): kept as they are."""
        if state.shard is None:
            return state
        fname, tensors, entries = state.shard
        out, on_gpu = {}, False
        for key, t in tensors.items():
            if key in private and t.device.type == "cpu":
                out[key] = t
                continue
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._buffers[key] = host_buffer(t)
            buf.copy_(t, non_blocking=t.device.type == "cuda")
            out[key], on_gpu = buf, on_gpu or t.device.type == "cuda"
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        return SavedState(
            state.step, state.model_config, state.meta, state.rng, (fname, out, entries), ready
        )

    # -- the writer ---------------------------------------------------------------------------
    def start(self, root, state: SavedState | CheckpointError, step: int) -> Path:
        """Write `state` (already host copies: `host_copy`) into ``root/step_N`` in the
        background, after waiting for the write in flight, if any; returns the step directory
        it will publish. Collective."""
        self.wait()
        self.pending = Path(root) / step_dir_name(step)
        self._step = step
        self._outcome = None
        self._thread = threading.Thread(
            target=self._write, args=(root, step, state), name=f"megapar-save-{step}", daemon=True
        )
        self._thread.start()
        return self.pending

    def _write(self, root, step: int, state) -> None:
        try:
            self._outcome = write_checkpoint(root, step, state, self.mesh, self.group)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self._outcome = exc

    def _done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def poll(self) -> Path | None:
        """The step directory published since the last call, once every rank's writer is done
        (None: none pending, or still writing). One all-reduce of a flag over the world while
        a write is pending; raises CheckpointError on every rank when the write failed.
        Collective."""
        if self.pending is None:
            return None
        done = torch.tensor([1.0 if self._done() else 0.0], device=self.mesh.device)
        if self.mesh.layout.world_size > 1 and dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if float(done.item()) < 1.0:
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Wait for the write in flight (if any) and return the step directory it published;
        raises CheckpointError (on every rank) when it failed. The main thread keeps running
        Python while it waits, so a SIGTERM's clean stop (`megapar.faults.stop`) sees it
        working rather than blocked. Collective."""
        if self._thread is None:
            return None
        set_action(f"waiting for the background save of {self.pending}")
        while self._thread.is_alive():
            self._thread.join(0.2)
        outcome, pending, step = self._outcome, self.pending, self._step
        self._thread, self._outcome, self.pending = None, None, None
        what = f"async checkpoint save at step {step} (to {pending})"
        if isinstance(outcome, CheckpointError):  # the same on every rank, naming the rank
            failed = CheckpointError(f"{what} failed: {outcome}")
            failed.no_traceback = getattr(outcome, "no_traceback", False)  # type: ignore[attr-defined]
            raise failed from outcome
        if isinstance(outcome, BaseException):
            error = f"{type(outcome).__name__}: {str(outcome).strip()}"
            waited = (
                f"; the writers of the other ranks did not answer in {self.timeout_s:g} s (one "
                f"died, stopped or writes slower: {_wait_flag()} sets the wait)"
                if consequential(error)
                else ""
            )
            raise CheckpointError(
                f"{what} failed on rank {self.mesh.rank}: {error}{waited}"
            ) from outcome
        assert outcome is not None  # the thread set it before it ended
        self.published = int(outcome.name.split("_")[1])
        return outcome

    def in_flight(self) -> bool:
        """Whether a write was started and not yet waited for."""
        return self._thread is not None

    def wait_quietly(self, limit_s: float) -> str:
        """After a failure elsewhere: give the write in flight up to `limit_s` to finish (a
        checkpoint from before the failure is still good); returns a note of what happened."""
        if self._thread is None:
            return ""
        end = time.monotonic() + limit_s
        while self._thread.is_alive() and time.monotonic() < end:
            self._thread.join(0.2)
        if self._thread.is_alive():
            return f"the background save of {self.pending} did not finish"
        try:
            return f"saved {self.wait()}"
        except CheckpointError as exc:
            return str(exc)


def _writers_group(rank: int, world_size: int, wait_s: float):
    """The writers' gloo group over the world (collective), its creation bounded by `wait_s`
    (`megapar.device.connect_bound`) and a rank that never comes named
    (`megapar.mesh.group_join_timeout`)."""
    what = f"creating process group {GROUP} (the background checkpoint writer's)"
    try:
        with connect_bound(what, wait_s, rank):
            return dist.new_group(
                backend="gloo", timeout=timedelta(seconds=wait_s), group_desc=GROUP
            )
    except dist.DistStoreError as exc:  # its words name only store keys
        raise TimeoutError(
            group_join_timeout(rank, list(range(world_size)), GROUP, wait_s, str(exc))
        ) from None


def _wait_flag() -> str:
    """The flag that sets how long the writers wait for each other: the world group's timeout,
    --nccl-timeout-s on NCCL, else --timeout-s."""
    return "--nccl-timeout-s" if backend() == "nccl" else "--timeout-s"


def _finisher(ref):
    """Waits for the write in flight of the saver `ref` refers to, if it is still alive and
    this process made it (a forked child inherits the list, not the writer thread)."""
    pid = os.getpid()

    def finish():
        saver = ref()
        if saver is not None and os.getpid() == pid and saver.in_flight():
            saver.wait()

    return finish
