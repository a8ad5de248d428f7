"""Where the holes in a CPU rank's heap come from: every host allocation of 64 KiB or more, with
its address, thread and lifetime, traced in spawned ranks (issue 47; docs/guides/planner.md,
"Sequence parallelism's heap").

`heap_trace.c` is compiled (gcc) and preloaded into two spawned tp-2 ranks of 8 blocks of hidden
256 (the layout of `peak_memory.py`'s `sp` group), which train `--steps` steps; marks go into the
trace at each block's forward, the backward and the step. Per block of the first forward it
prints how far the heap's top rose, the bytes its kept tensors hold and the holes it left; then
per allocation of the block (in order; blocks 1-6 summed), its size, thread (M: the training
thread, g: gloo's), how far it raised the top and how much of it is a hole at the forward's end
(freed, and no tensor alive there since); and glibc's arena, in-use bytes and the peak resident
set at each mark (`mallinfo2`).

    python benchmarks/memory/heap_trace.py --sp            # tp 2 + SP, 4 x 1,024 tokens
    python benchmarks/memory/heap_trace.py                 # tp 2
    python benchmarks/memory/heap_trace.py --sp --mbs 1 --seq 4096
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

MIB = 2**20
HERE = Path(__file__).resolve().parent


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def worker(shim_path, sp, steps, out, mbs, seq):
    import torch
    import torch._dynamo  # noqa: F401  torch's optimizer imports it: before the trace
    import torch.distributed as dist
    from transformers import GPT2Config

    import megapar

    sys.path.insert(0, str(HERE))
    from process_terms import MallInfo2

    shim = ctypes.CDLL(shim_path)
    shim.shim_mark.argtypes = [ctypes.c_uint64]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    rank, marks = dist.get_rank(), []

    def mark(k):
        m = libc.mallinfo2()
        marks.append((k, m.uordblks, m.arena, _status("VmHWM")))
        shim.shim_mark(k)

    shim.shim_enable(f"{out}/r{rank}.bin".encode())
    mark(0)
    cfg = GPT2Config(n_embd=256, n_layer=8, n_head=8, vocab_size=1004, n_positions=max(seq, 64),
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    engine = megapar.prepare(cfg, micro_batch_size=mbs, seq_len=seq, tp=2, sequence_parallel=sp)
    mark(1)
    blocks = [m for m in engine.model.modules() if type(m).__name__.endswith("Block")]
    for j, blk in enumerate(blocks):
        blk.register_forward_pre_hook(lambda m, a, j=j: mark(100 + j))
        blk.register_forward_hook(lambda m, a, o, j=j: mark(200 + j))
    import megapar.pipeline.backward as ex

    backward = ex.backward

    def traced(*a, **k):
        mark(2)
        r = backward(*a, **k)
        mark(3)
        return r

    ex.backward = traced
    ids = torch.randint(0, 1004, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    for i in range(steps):
        mark(10 + i)
        engine.train_step(batch)
    mark(99)
    shim.shim_disable()
    return marks


def _records(path):
    import numpy as np

    a = np.fromfile(path, dtype=np.uint64).reshape(-1, 4)
    return [tuple(int(x) for x in r) for r in a]


def first_forward(recs):
    """The first forward's allocations of the main heap (as dicts: size, address, block,
    position in the block, thread, freed, grow) and the blocks' (top rise, kept) bytes."""
    main = collections.Counter(r[3] for r in recs if r[0] == 1).most_common(1)[0][0]
    alive, ev, seen, blocks = {}, [], collections.Counter(), {}
    block, pos, top, fwd, inuse = None, 0, 0, False, 0
    for op, ad, s, t in recs:
        if op == 3:
            seen[s] += 1
            if seen[s] > 1 and s != 99:
                continue
            if s == 10:
                fwd = True
            elif 100 <= s < 200:
                block, pos, blocks[s - 100] = s - 100, 0, [top, inuse]
            elif 200 <= s < 300:
                blocks[s - 200] = (top - blocks[s - 200][0], inuse - blocks[s - 200][1])
            elif s == 2:
                break
            continue
        if ad >= 0x7F0000000000 or not fwd:  # mapped apart, or before the step
            continue
        if op == 1:
            e = dict(s=s, ad=ad, block=block, pos=pos, th="M" if t == main else "g",
                     freed=False, grow=max(0, ad + s - top))
            top, pos, inuse = max(top, ad + s), pos + 1, inuse + s
            alive[ad] = e
            ev.append(e)
        elif op == 2 and ad in alive:
            e = alive.pop(ad)
            e["freed"], inuse = True, inuse - e["s"]
    return ev, blocks


def _hole(ev, k):
    """Bytes of allocation k's place that no later allocation of the forward took."""
    e = ev[k]
    a0, a1 = e["ad"], e["ad"] + e["s"]
    taken = sorted((max(a0, x["ad"]), min(a1, x["ad"] + x["s"])) for x in ev[k + 1:]
                   if x["ad"] < a1 and x["ad"] + x["s"] > a0)
    cover, cur = 0, a0
    for x0, x1 in taken:
        if x1 > max(x0, cur):
            cover, cur = cover + x1 - max(x0, cur), x1
    return e["s"] - cover if e["freed"] else 0


def report(recs, marks):
    ev, blocks = first_forward(recs)
    for b, (grow, kept) in sorted(blocks.items()):
        print(f"  block {b}: top +{grow / MIB:5.1f} MiB, kept {kept / MIB:5.1f}, "
              f"holes {(grow - kept) / MIB:5.1f}")
    rows = collections.defaultdict(lambda: [0, 0, 0, ""])
    mid = [k for k, e in enumerate(ev) if e["block"] is not None and 1 <= e["block"] <= 6]
    for k in mid:
        r = rows[ev[k]["pos"]]
        r[0] += ev[k]["grow"]
        r[1] += _hole(ev, k)
        r[3] = f"{ev[k]['s'] / MIB:5.2f} MiB {ev[k]['th']} {'freed' if ev[k]['freed'] else 'kept'}"
    print("  per allocation of a block (blocks 1-6, per block): raised the top / hole at the "
          "forward's end")
    for pos, (grow, hole, _, what) in sorted(rows.items()):
        print(f"    {pos:2d} {what:22s} {grow / 6 / MIB:5.2f} {hole / 6 / MIB:5.2f}")
    print(f"  holes: {sum(r[1] for r in rows.values()) / 6 / MIB:.1f} MiB per block")
    names = {0: "start", 1: "built", 2: "backward", 3: "backward end", 99: "end"}
    for k, inuse, arena, hwm in marks:
        if k in names or 10 <= k < 99:
            print(f"  {names.get(k, f'step {k - 10}'):12s} in-use {inuse / MIB:5.0f} arena "
                  f"{arena / MIB:5.0f} peak resident set {hwm / MIB:5.0f} MiB")


def aligned_hole_reused() -> bool:
    """Whether glibc, under megapar's host policy (no mmap, no trim), puts a 64-byte-aligned
    4 MiB allocation (torch's) into the place of a freed one between two live ones (as a
    row-parallel layer's output is freed below the tensors kept after it). Changes this
    process's malloc settings."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-4, 0)  # M_MMAP_MAX
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD

    def aligned(n):
        p = ctypes.c_void_p()
        libc.posix_memalign(ctypes.byref(p), 64, ctypes.c_size_t(n))
        return p.value

    size = 4 * MIB
    live = [aligned(size)]  # below
    y = aligned(size)
    live.append(aligned(size))  # above
    libc.free(y)
    return aligned(size) == y and len(live) == 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", action="store_true", help="--sequence-parallel")
    parser.add_argument("--mbs", type=positive, default=4)
    parser.add_argument("--seq", type=positive, default=1024)
    parser.add_argument("--steps", type=positive, default=2)
    args = parser.parse_args(argv)
    if os.environ.get("HEAP_TRACE_SHIM") is None:  # compile the tracer, run again preloaded
        work = tempfile.mkdtemp(prefix="megapar-heap-")
        shim = os.path.join(work, "heap_trace.so")
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(HERE / "heap_trace.c"), "-o",
                        shim, "-ldl"], check=True)
        env = {**os.environ, "LD_PRELOAD": shim, "HEAP_TRACE_SHIM": shim,
               "HEAP_TRACE_OUT": work}
        return subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    from megapar.launcher import run_local

    print(f"glibc: a freed 64-byte-aligned 4 MiB place between live ones "
          f"{'takes' if aligned_hole_reused() else 'does not take'} such an allocation again")
    out = os.environ["HEAP_TRACE_OUT"]
    marks = run_local(worker, 2, os.environ["HEAP_TRACE_SHIM"], args.sp, args.steps, out,
                      args.mbs, args.seq, start_method="spawn", timeout_s=1500)
    for rank, m in enumerate(marks):
        print(f"rank {rank} ({'tp 2 + SP' if args.sp else 'tp 2'}, {args.mbs} x {args.seq}):")
        report(_records(f"{out}/r{rank}.bin"), m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
