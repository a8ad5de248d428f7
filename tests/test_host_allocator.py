"""Once the training state is built, large CPU tensors come from glibc's heap, which keeps freed
memory for reuse, instead of a fresh mmap per tensor that is unmapped on free and faulted in
(zeroed) again next time (megapar.host_memory.keep_freed_host_memory, applied at the end of the
Engine's construction). Before that, while the weights, gradient buffer and optimizer state are
made (and ZeRO-1 moves the weights into its buffer), glibc's own policy holds: a freed
large block goes back to the OS instead of staying in the resident set."""

import ctypes
import sys

import pytest
import torch

from megapar.launcher import run_local

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _where_a_large_tensor_lives() -> tuple[int, int]:
    """How many more bytes glibc holds (in mmapped blocks, in its heap) while a 64 MB tensor is
    alive than before it."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    before = libc.mallinfo2()
    t = torch.empty(16 * 2**20)  # 64 MB of float32: above glibc's largest mmap threshold
    during = libc.mallinfo2()
    del t
    return during.hblkhd - before.hblkhd, during.uordblks - before.uordblks


def _one_spawned_worker() -> dict:
    """What the tests below read, from one spawned worker (a fresh process: nothing of this
    one's arenas or mallopt settings inherited), in this order: the arenas in use once a thread
    has allocated (before anything else allocates in a thread); where a large tensor lives
    before any engine; after an engine built with MEGAPAR_HOST_MALLOC=system (the opt-out);
    after an engine built with the default (the opt-out leaves glibc's policy as it was, so the
    default engine starts from the same state as a fresh worker's)."""
    import os

    import megapar

    arenas = _arenas_after_a_thread_allocates()
    before = _where_a_large_tensor_lives()
    os.environ["MEGAPAR_HOST_MALLOC"] = "system"
    megapar.prepare("gpt2-tiny", micro_batch_size=1, seq_len=16)
    opted_out = _where_a_large_tensor_lives()
    del os.environ["MEGAPAR_HOST_MALLOC"]
    megapar.prepare("gpt2-tiny", micro_batch_size=1, seq_len=16)
    return {"arenas": arenas, "before": before, "opted_out": opted_out,
            "after": _where_a_large_tensor_lives()}


@pytest.fixture(scope="module")
def spawned() -> dict:
    """`_one_spawned_worker`'s figures: one spawned worker (torch, transformers and megapar
    imported once) instead of one per test."""
    return run_local(_one_spawned_worker, 1, start_method="spawn")[0]


def test_a_worker_serves_large_tensors_from_the_heap_once_its_engine_is_built(spawned):
    mmapped, _ = spawned["before"]
    mmapped_after, heap = spawned["after"]
    assert mmapped >= 64 * 2**20  # building the state: glibc's default, one mmap each
    assert mmapped_after == 0 and heap >= 64 * 2**20, (mmapped_after, heap)


def test_opt_out_keeps_the_system_allocator(spawned):
    mmapped, _ = spawned["opted_out"]
    assert mmapped >= 64 * 2**20  # glibc's default: one mmap per large tensor


def _arenas_after_a_thread_allocates() -> int:
    """glibc arenas in use once a thread (as gloo's do) has taken and freed a 1 MB block."""
    import os
    import tempfile
    import threading

    worker = threading.Thread(target=lambda: torch.ones(2**18))
    worker.start()
    worker.join()
    with tempfile.TemporaryFile("w+") as out:  # malloc_stats writes to stderr
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            ctypes.CDLL("libc.so.6").malloc_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        return sum(line.startswith("Arena ") for line in out)


def test_worker_threads_allocate_from_one_arena(spawned):
    """Workers allocate from glibc's one main arena (megapar.host_memory.share_host_arena): in an
    arena of its own, what gloo's threads free (the bucket copies of its reduce-scatters and
    all-gathers) the main thread could not reuse, and under the kept heap both high-water marks
    added up at the OS peak (GPT-2 124M, dp 2: half of ZeRO-1's saving gone). Spawned: nothing
    of this process's arenas is inherited."""
    assert spawned["arenas"] == 1
