"""The one place where the device and the distributed backend are chosen.

Everything else asks here: no `.cuda()` calls scattered around. On a machine with CUDA the
backend is NCCL and each rank uses the GPU of its local rank; otherwise gloo on the CPU.
"""

from __future__ import annotations

import ctypes
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Before any group exists: imported later (torch imports it lazily), torch.distributed.nn's
# functions would keep the world group in their `group=group.WORLD` defaults for good, so
# `megapar.launcher.release_process_groups` could never free it.
import torch.distributed.nn  # noqa: F401

#: Default timeout for every collective and point-to-point operation (seconds). A rank that
#: waits longer raises instead of hanging. Override with MEGAPAR_TIMEOUT_S.
DEFAULT_TIMEOUT_S = float(os.environ.get("MEGAPAR_TIMEOUT_S", "300"))


def use_cuda() -> bool:
    """True when this process should run on CUDA (available and not disabled by MEGAPAR_CPU=1)."""
    return torch.cuda.is_available() and os.environ.get("MEGAPAR_CPU", "0") != "1"


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def backend() -> str:
    """The torch.distributed backend: "nccl" with CUDA, "gloo" otherwise."""
    return "nccl" if use_cuda() else "gloo"


def device(local_rank: int | None = None) -> torch.device:
    """The device of this rank: cuda:<local_rank> with CUDA, cpu otherwise."""
    if use_cuda():
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def keep_freed_host_memory() -> bool:
    """Let glibc keep freed host memory for reuse instead of returning it to the kernel.

    glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mmap and
    unmaps it on free, so each large CPU tensor (the logits: tokens x vocab x 4 bytes) costs
    page faults that zero it again, step after step. Served from the heap and never trimmed,
    the memory is reused, at the price of a larger resident set (docs/performance.md has the
    figures). Does nothing off glibc or with MEGAPAR_HOST_MALLOC=system; settings are inherited
    by forked workers. Returns whether it applied."""
    if os.environ.get("MEGAPAR_HOST_MALLOC", "") == "system" or not sys.platform.startswith(
            "linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(
            libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl, ...): its allocator stays as it is
        return False


def polls_host(group) -> bool:
    """Whether waiting on `group`'s work blocks the host (gloo) rather than the stream (NCCL)."""

    return dist.get_backend(group) != "nccl"


def wait(work, group, timeout_s: float, what: str, error: type = TimeoutError,
         hint: str = "") -> None:
    """Wait for the asynchronous collective or point-to-point `work` of process group `group`.

    gloo: the host waits at most `timeout_s`, then raises `error` naming `what`. NCCL: the wait
    only orders the current CUDA stream after the work (no host blocking, no polling); a hang is
    ended by the process group's own timeout (NCCL's watchdog, set by `init_distributed` from
    the same default), and the launcher names the rank and what it was doing. `hint` ends the
    error message (what probably went wrong, what to do)."""
    if not polls_host(group):
        work.wait()
        return
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo raises on timeout or when the peer's connection closes
        raise error(f"{what} did not complete within {timeout_s:g} s ({exc}){hint}") from exc
    if ok is False:
        raise error(f"{what} did not complete within {timeout_s:g} s (wait() returned False)"
                    f"{hint}")


def init_distributed(rank: int | None = None, world_size: int | None = None,
                     timeout_s: float | None = None, store=None) -> None:
    """Initialise the default process group from the environment (torchrun / Slurm / our launcher).

    `store`: a rendezvous store to use instead of MASTER_ADDR / MASTER_PORT (the launcher's
    loopback-only store). Does nothing when the default group is already initialised. Every later collective inherits
    the timeout, so a rank that never arrives makes the others fail instead of hanging forever.
    Raises TimeoutError naming this rank when not every rank has joined within the timeout.
    """

    if dist.is_initialized():
        return
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    wait = timeout_s or DEFAULT_TIMEOUT_S
    try:
        dist.init_process_group(backend=backend(), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=wait), store=store)
    except dist.DistStoreError as exc:  # the store's own words name only keys
        raise TimeoutError(
            f"rank {rank} waited {wait:.0f} s for all {world_size} ranks to join the process "
            f"group; some never did (a process that was refused, crashed or never started). "
            f"Under torchrun / Slurm give every node the same command and let each reach "
            f"MASTER_ADDR:MASTER_PORT; --timeout-s sets the wait ({exc})") from None
