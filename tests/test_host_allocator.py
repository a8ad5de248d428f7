"""Large CPU tensors come from glibc's heap, which keeps freed memory for reuse, instead of a
fresh mmap per tensor that is unmapped on free and faulted in (zeroed) again next time
(megapar.device.keep_freed_host_memory, applied in every worker)."""

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


def test_a_worker_serves_large_tensors_from_the_heap():
    mmapped, heap = run_local(_where_a_large_tensor_lives, 1)[0]
    assert mmapped == 0 and heap >= 64 * 2**20, (mmapped, heap)


def test_opt_out_keeps_the_system_allocator():
    mmapped, _ = run_local(_where_a_large_tensor_lives, 1, env={"MEGAPAR_HOST_MALLOC": "system"},
                           start_method="spawn")[0]
    assert mmapped >= 64 * 2**20  # glibc's default: one mmap per large tensor
