"""The peak of one rank's context-parallel attention (forward and backward) against the
planner's term (`plan.context_parallel.cp_attention_peak`), in one process.

One rank's `RingAttention` / `AllGatherAttention` runs as megapar-train's CPU ranks run it (one
thread, the fused CPU flash kernel, q / k / v / out / dout laid out [b, s, heads, d] as the
models' projections make them), its communication replaced by stand-ins that allocate what the
real calls do: `Ring.start`'s contiguous send and empty receive (gloo sends in place), the
all-gather's output and the reduce-scatter's input each copied once, as gloo holds them
(`plan.process.CPU_RUNTIME`'s note; benchmarks/memory/gloo_terms.py). The received blocks are
copies of this rank's own (the values do not change what is allocated). The peak is the most
bytes the CPU allocator had handed out at once (torch's profiler), over what was live at the
call's start (the saved tensors and the incoming gradient, for backward), on the cp rank whose
backward holds the most. With real gloo collectives (2 / 4 spawned ranks, 2026-12-01) every
rank's backward peak was the stand-ins' but one rank's at cp 2 of the all-gather, one K/V
block (activation dtype) higher (6.76 against 6.26 MiB fp32, 4.82 against 4.57 bf16).

    python benchmarks/memory/cp_attention_memory.py [--seq 2048 --heads 4 --head-size 32]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from megapar.plan.context_parallel import cp_attention_peak
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

attention_module = importlib.import_module("megapar.context_parallel.attention")


class _Ring(attention_module.Ring):
    """A ring of one process: `start` allocates what `Ring.start` does and 'receives' a copy of
    what it sends."""

    def __init__(self, cp: int, rank: int):  # no process group
        self.size, self.rank, self.issued = cp, rank, None

    def start(self, send, label):
        send = send.contiguous()
        recv = torch.empty_like(send)
        recv.copy_(send)
        return None, send, recv, label

    def finish(self, handle):
        return handle[2]


def _all_gather(out, x, group, async_op=False):
    cp, _ = group
    staged = torch.empty_like(out)  # gloo's copy of the output
    staged.view(cp, -1).copy_(x.reshape(1, -1))
    out.copy_(staged)


def _reduce_scatter(out, x, group):
    cp, rank = group
    staged = x.clone()  # gloo's copy of the input
    out.view(-1).copy_(staged.view(cp, -1)[rank])


def _peak(fn) -> tuple[int, object]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, result


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure(method, cp, rank, b, seq, heads, kv_heads, d, dtype, causal=True, dropout=0.0):
    """(forward peak, backward peak) bytes of cp rank `rank`'s attention of `b` sequences of
    `seq` tokens (this rank's seq / cp of them); `dropout`: attention dropout (the unfused
    kernel)."""
    torch.manual_seed(0)
    rows = seq // cp

    def projected(h):
        return torch.randn(b, rows, h, d, dtype=dtype).transpose(1, 2).requires_grad_()

    q, k, v = projected(heads), projected(kv_heads), projected(kv_heads)
    index = None if kv_heads == heads else torch.arange(heads) // (heads // kv_heads)
    comm = _Ring(cp, rank) if method == "ring" else (cp, rank)
    spec = attention_module.Spec(cp, rank, causal, comm, dropout)
    with (
        _one_thread(),
        mock.patch.object(attention_module, "all_gather_flat", _all_gather),
        mock.patch.object(attention_module, "reduce_scatter_flat", _reduce_scatter),
    ):
        forward, out = _peak(lambda: attention_module.attention(q, k, v, spec, None, index, method))
        dout = torch.randn(b, rows, heads, d, dtype=dtype).transpose(1, 2)
        backward, _ = _peak(lambda: out.backward(dout))
    return forward, backward


def busiest(method, cp, b, seq, heads, kv_heads, d, dtype, causal=True, dropout=0.0):
    """(forward, backward) peaks of the cp rank whose backward holds the most."""
    return max((measure(method, cp, rank, b, seq, heads, kv_heads, d, dtype, causal, dropout)
                for rank in range(cp)), key=lambda peaks: peaks[1])


def planned(method, cp, b, seq, heads, kv_heads, d, dtype, causal=True, dropout=0.0) -> float:
    """The planner's term (`cp_attention_peak`: the busiest rank, a CPU rank)."""
    rows = seq // cp
    return cp_attention_peak(method, cp, b * heads * rows * d, 2 * b * kv_heads * rows * d,
                             torch.empty((), dtype=dtype).element_size(), rows, causal, True,
                             b * heads if dropout else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=positive, default=2048)
    parser.add_argument("--batch", type=positive, default=1)
    parser.add_argument("--heads", type=positive, default=4)
    parser.add_argument("--head-size", type=positive, default=32)
    parser.add_argument("--cps", default="2,4")
    args = parser.parse_args()
    mib = 2**20
    print(f"{'method':>10} {'kv heads':>8} {'cp':>3} {'dtype':>9} {'fwd MiB':>8} "
          f"{'bwd MiB':>8} {'planned':>8} {'plan/bwd':>8}")
    for method, kv_heads in (("all-gather", args.heads // 2), ("ring", args.heads)):
        for cp in (int(c) for c in args.cps.split(",")):
            for dtype in (torch.float32, torch.bfloat16):
                shape = (args.batch, args.seq, args.heads, kv_heads, args.head_size, dtype)
                forward, backward = busiest(method, cp, *shape)
                plan = planned(method, cp, *shape)
                print(f"{method:>10} {kv_heads:>8} {cp:>3} {str(dtype)[6:]:>9} "
                      f"{forward / mib:>8.2f} {backward / mib:>8.2f} {plan / mib:>8.2f} "
                      f"{plan / backward:>8.3f}")


if __name__ == "__main__":
    main()
