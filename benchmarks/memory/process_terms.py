"""Where a CPU rank's peak resident set goes: the terms of `megapar.plan.process`, measured.

Spawned ranks build their engine and train a few steps while a thread samples, every
millisecond, glibc's in-use bytes and arena (`mallinfo2`) and the resident set; the phases
(each backward, optimizer step and step) are timed. Per rank it prints the peak resident set's
rise (VmHWM), and per phase the in-use peak, the arena and resident set with it, and the in-use
bytes over the last backward: in-use less the planner's tensors is what the heap holds besides
them, arena less in-use the heap's freed room, resident set less arena what lives outside the
heap (docs/guides/planner.md, "The process at its peak"). The sampler's own objects add 25-65
MiB to the peaks: compare predictions with runs without it (tests/test_process_peak.py,
tests/test_peak_memory.py, peak_memory.py).

    python benchmarks/memory/process_terms.py '{"kwargs": {"n_embd": 768, "n_layer": 6,
        "n_head": 12, "vocab_size": 50257}, "steps": 2}'          # one process, GPT-2's width
    python benchmarks/memory/process_terms.py '{"world": 2, "kwargs": {}, "zero": 1}'  # GPT-2 124M
    python benchmarks/memory/process_terms.py '{"world": 2, "model": "mixtral-tiny", "kwargs": {},
        "zero": 3, "extra": {"ep": 2}, "imports_first": true}'   # a recipe; planner's baseline

"model" names a recipe (models/) instead of GPT-2 `kwargs`; "imports_first" imports megapar's
training modules before the baseline is read, as planner_layouts.py and `CPU_BASELINE` do (else
their import adds about 84 MiB to the rise, 25 of it in the heap).
"""

import ctypes
import json
import sys
import threading
import time


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def worker(kwargs, zero, mbs, seq, batch, bucket_mb, steps, extra=None, model=None,
           imports_first=False):
    import torch
    import torch._dynamo  # noqa: F401  torch's optimizer imports it: in the baseline
    from transformers import GPT2Config

    import megapar

    if imports_first:  # the planner's baseline (`CPU_BASELINE`), as planner_layouts.py reads it
        import megapar.training.prepare  # noqa: F401

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def inuse():
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd, m.arena + m.hblkhd

    samples = []
    stop = [False]

    def sampler():
        while not stop[0]:
            u, a = inuse()
            samples.append((time.perf_counter(), u, a, status("VmRSS")))
            time.sleep(0.001)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS")
    u0, a0 = inuse()
    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    cfg = model or GPT2Config(
        n_positions=max(seq, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kwargs
    )
    opts = dict(micro_batch_size=mbs, zero=zero, seq_len=seq)
    if bucket_mb:
        opts["grad_bucket_mb"] = bucket_mb
    opts.update(extra or {})
    engine = megapar.prepare(cfg, **opts)
    marks = [("built", time.perf_counter(), status("VmHWM") - start)]
    phases = []
    import megapar.pipeline.backward as ex

    def timed(name, fn):
        """fn, recording each call's (name, start, end) in `phases`."""

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            phases.append((name, t0, time.perf_counter()))
            return r

        return wrapped

    ex.backward = timed("backward", ex.backward)
    engine.run_step = timed("run_step", engine.run_step)
    opt = engine.optimizer
    opt.step = timed("opt.step", opt.step)
    vocab = kwargs.get("vocab_size", 1000 if model else 50257)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    for i in range(steps):
        engine.train_step(b)
        marks.append((f"step{i}", time.perf_counter(), status("VmHWM") - start))
    stop[0] = True
    th.join()

    # summarise: in-use peak and its time, rss at peak
    def seg(t0, t1):
        s = [x for x in samples if t0 <= x[0] <= t1]
        if not s:
            return None
        mu = max(s, key=lambda x: x[1])
        mr = max(s, key=lambda x: x[3])
        return dict(
            inuse_peak=mu[1] - u0,
            arena_at_inuse_peak=mu[2] - a0,
            rss_at_inuse_peak=mu[3] - start,
            rss_peak=mr[3] - start,
            inuse_at_rss_peak=mr[1] - u0,
            arena_at_rss_peak=mr[2] - a0,
        )

    t = [samples[0][0]] + [m[1] for m in marks]

    def at(t0, t1):
        s = [x for x in samples if t0 <= x[0] <= t1]
        return max(x[1] for x in s) - u0 if s else None

    bws = [(a, b) for n, a, b in phases if n == "backward"]
    a, b2 = bws[-1]
    ser = [x for x in samples if a - 0.3 <= x[0] <= b2 + 0.05]
    step_ = max(1, len(ser) // 60)
    series = [(round(x[0] - a, 3), round((x[1] - u0) / 2**20)) for x in ser[::step_]]
    def most(t0, t1, k):
        s = [x[k] for x in samples if t0 <= x[0] <= t1]
        return max(s) if s else 0

    # per phase: in-use peak, arena peak (over the rank's start) and the resident set's peak
    ph = [
        (n, round((at(a, b) or 0) / 2**20), round((most(a, b, 2) - a0) / 2**20),
         round((most(a, b, 3) - start) / 2**20))
        for n, a, b in phases
    ]
    mu = max(samples, key=lambda x: x[1])
    where = [n for n, a, b in phases if a <= mu[0] <= b]
    out = {
        "series": series,
        "phases": ph,
        "inuse_peak_in": where,
        "start_rss": start,
        "hwm_rise": status("VmHWM") - start,
        "marks": [(m[0], m[2]) for m in marks],
        "segments": {marks[i][0]: seg(t[i], t[i + 1]) for i in range(len(marks))},
        "inuse_after": inuse()[0] - u0,
        "arena_after": inuse()[1] - a0,
        "rss_after": status("VmRSS") - start,
    }
    return out


def main():
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from megapar.launcher import run_local

    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.split("\n\n\"model\"")[0])
        return 0 if sys.argv[1:] in (["-h"], ["--help"]) else 2
    try:
        spec = json.loads(sys.argv[1])
    except ValueError as exc:
        print(f"process_terms.py: error: the run's spec is not JSON ({exc}); --help shows "
              f"three", file=sys.stderr)
        return 2
    world = spec.pop("world", 1)
    res = run_local(
        worker,
        world,
        spec["kwargs"],
        spec.get("zero", 0),
        spec.get("mbs", 1),
        spec.get("seq", 64),
        spec.get("batch", world),
        spec.get("bucket_mb"),
        spec.get("steps", 2),
        spec.get("extra"),
        spec.get("model"),
        spec.get("imports_first", False),
        start_method="spawn",
        timeout_s=900,
    )
    M = 2**20
    for r, o in enumerate(res):
        print(
            f"rank {r}: hwm_rise {o['hwm_rise'] / M:.0f} MiB marks "
            + " ".join(f"{n}:{v / M:.0f}" for n, v in o["marks"])
        )
        for n, s in o["segments"].items():
            if s:
                print("   ", n, {k: round(v / M) for k, v in s.items()})
        print("    series", o["series"])
        print("    phases (in-use / arena / rss peaks)", o["phases"], "peak in",
              o["inuse_peak_in"])
        print(
            f"    after: inuse {o['inuse_after'] / M:.0f} arena {o['arena_after'] / M:.0f} "
            f"rss {o['rss_after'] / M:.0f}"
        )


if __name__ == "__main__":
    sys.exit(main())
