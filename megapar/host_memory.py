"""The host memory a process may use and how glibc's allocator gives it back: what the machine
can still give (`host_memory_available`), and megapar's host allocation policy (one arena for
every thread, freed memory kept for reuse, or returned at once for ZeRO-3). The planner's CPU
memory model (`plan/process.py`) counts what this policy leaves in the heap.
"""

from __future__ import annotations

import ctypes
import os
import sys


def host_memory_available() -> int | None:
    """Bytes of memory this machine can still give its processes without swapping: the
    kernel's MemAvailable (/proc/meminfo), or less where a cgroup v2 limit of this container
    leaves less (memory.max less memory.current). None where neither can be read (not
    Linux)."""
    try:
        with open("/proc/meminfo") as f:
            line = next((x for x in f if x.startswith("MemAvailable:")), None)
    except OSError:
        return None
    if line is None:
        return None
    available = int(line.split()[1]) * 1024  # kB
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, max(0, int(limit) - used))


def share_host_arena() -> bool:
    """Make every thread allocate host memory from glibc's one main arena.

    glibc gives threads their own arenas, whose freed blocks only that arena reuses: gloo's
    worker threads make bucket-sized copies for its reduce-scatters and all-gathers, which the
    main thread's freed room (the backward's transients) could not hold, and under
    `keep_freed_host_memory` neither arena returns memory, so their high-water marks add up at
    the OS peak (docs/performance.md, "ZeRO stages at the peak the OS sees"). Call it before any
    other thread allocates (megapar-train's main, the launcher's worker, `Engine`): glibc
    settles its arena limit, and threads their arenas, at their first allocations. Does nothing off
    glibc or with MEGAPAR_HOST_MALLOC=system. Returns whether it applied."""
    if os.environ.get("MEGAPAR_HOST_MALLOC", "") == "system" or not sys.platform.startswith(
        "linux"
    ):
        return False
    try:
        m_arena_max = -8  # <malloc.h>
        return bool(ctypes.CDLL("libc.so.6").mallopt(m_arena_max, 1))
    except (OSError, AttributeError):
        return False


def keep_freed_host_memory() -> bool:
    """Let glibc keep freed host memory for reuse instead of returning it to the kernel.

    glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mmap and
    unmaps it on free, so each large CPU tensor (the logits: tokens x vocab x 4 bytes) costs
    page faults that zero it again, step after step. Served from the heap and never trimmed,
    the memory is reused, at the price of a larger resident set (docs/performance.md, "At the
    peak the OS sees", has the figures). Called once the long-lived state is built (the end of
    `Engine`'s construction; the eval and bubble tools after loading their models), so that
    what setup frees goes back to the OS instead of staying as holes in the heap. Does nothing
    off glibc or with MEGAPAR_HOST_MALLOC=system; settings are inherited by forked workers.
    Returns whether it applied."""
    if os.environ.get("MEGAPAR_HOST_MALLOC", "") == "system" or not sys.platform.startswith(
        "linux"
    ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl, ...): its allocator stays as it is
        return False


def return_freed_host_memory(threshold_mb: float = 4.0) -> bool:
    """Serve every host allocation above `threshold_mb` with its own mmap, returned to the
    kernel when freed (a fixed threshold: glibc's own rises to 32 MB after the first large
    free, after which freed blocks stay as holes in the heap). For ZeRO-3, whose gathered
    units and gradients are made and freed at every use: kept in the heap
    (`keep_freed_host_memory`), their holes would outweigh what the sharding saves. Does
    nothing off glibc or with MEGAPAR_HOST_MALLOC=system; returns whether it applied."""
    if os.environ.get("MEGAPAR_HOST_MALLOC", "") == "system" or not sys.platform.startswith(
        "linux"
    ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3  # <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, int(threshold_mb * 2**20)))
    except (OSError, AttributeError):
        return False
