"""Peak memory of a data-parallel step: gradients as views into one bucketed buffer reduced in
place (megapar's GradBuckets) vs packing each bucket with torch.cat and copying it back (what
megapar did before, and what a naive bucketed all-reduce does).

Two dp ranks (fresh processes per variant) run warm-up steps, then one measured step of a
GPT-2 whose gradients are large next to its activations; the peak resident memory of the step
is read from the kernel (VmHWM after resetting it through /proc/self/clear_refs; large blocks
are mmapped, mallopt(M_MMAP_THRESHOLD), so freed tensors leave the resident set). The packed
variant keeps a second copy of each in-flight bucket, and allocates fresh gradients every step.

    python benchmarks/memory/grad_buffer_memory.py [--hidden 512 --layers 6 --vocab 8192 --bucket-mb 25]
"""

from __future__ import annotations

import argparse

import torch
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


class PackedBuckets:
    """The reference: cat each bucket's grads, all-reduce the packed copy, copy back (a
    `megapar.data_parallel.grad_sync.GradSync` of stage 0 that reduces only in `finish`)."""

    stage = 0
    sharded = sharded_grads = reduces_every_micro_batch = False

    def __init__(self, params, group, bucket_mb):
        from megapar.data_parallel import make_buckets
        from megapar.mesh import group_size

        self.buckets, self.group, self.dp = make_buckets(params, bucket_mb), group, \
            group_size(group)
        self.in_step = False

    def begin_step(self):
        self.in_step = True

    def arm(self, params):
        pass

    def before_last_backward(self):
        pass

    def grads_ready(self, params):
        pass

    def defer(self, last, before_reduce):
        raise NotImplementedError("PackedBuckets reduces one stage: no tied embedding to defer")

    def finish(self):
        import torch.distributed as dist

        self.in_step = False

        pending = []
        for b in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in b.params]).div_(self.dp)
            pending.append((b, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        for b, flat, work in pending:
            work.wait()
            offset = 0
            for p in b.params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()


def _peak_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _worker(args, variant: str):
    import torch.distributed as dist

    from megapar.data_parallel import GradBuckets
    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage

    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)   # M_MMAP_THRESHOLD: 64 KiB, fixed
    torch.set_num_threads(1)
    mesh = Mesh(Layout(1, 1, 2), dist.get_rank())
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=8)
    model = build_stage(config, mesh, seed=0)
    params = list(model.parameters())
    sync = (GradBuckets if variant == "buffer" else PackedBuckets)(params, mesh.dp_group,
                                                                   args.bucket_mb)
    executor = PipelineExecutor(model, mesh, "1f1b", (args.mb, args.seq, args.hidden))
    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, args.vocab, (args.m, args.mb, args.seq + 1), generator=gen)
    micro = [{"input_ids": x[:, :-1], "labels": x[:, 1:]} for x in ids]
    for step in range(3):
        for p in params:
            p.grad = None   # the optimizer's zero_grad
        if step == 2:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")   # reset the peak resident set size
            before = _peak_mb()
        executor.run(micro, grad_sync=sync)
    grads_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
    return _peak_mb(), before, grads_mb


def main() -> None:
    from megapar.launcher import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=positive, default=512,
        help="hidden size (default %(default)s)")
    parser.add_argument("--layers", type=positive, default=6, help="blocks (default %(default)s)")
    parser.add_argument("--vocab", type=positive, default=8192,
        help="vocabulary size (default %(default)s)")
    parser.add_argument("--seq", type=positive, default=32,
        help="sequence length (default %(default)s)")
    parser.add_argument("--mb", type=positive, default=1,
        help="micro-batch size (default %(default)s)")
    parser.add_argument("--m", type=positive, default=2,
        help="micro-batches per step (default %(default)s)")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
        help="gradient bucket size, MB (default %(default)s)")
    args = parser.parse_args()
    results = {v: run_local(_worker, 2, args, v) for v in ("packed", "buffer")}
    grads = results["buffer"][0][2]
    print(f"GPT-2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: gradients "
          f"{grads:.1f} MB per rank; dp=2, {args.m} micro-batches of {args.mb} x {args.seq}, "
          f"buckets of {args.bucket_mb} MB")
    for variant, per_rank in results.items():
        peaks = [peak for peak, _, _ in per_rank]
        growth = [peak - before for peak, before, _ in per_rank]
        print(f"{variant:>7}: peak RSS during the step {', '.join(f'{p:.0f}' for p in peaks)} MB;"
              f" above the RSS before it {', '.join(f'{g:.0f}' for g in growth)} MB")
    drop = [a[0] - b[0] for a, b in zip(results["packed"], results["buffer"])]
    print(f"peak drop with the buffer: {', '.join(f'{d:.0f}' for d in drop)} MB per rank "
          f"(= {sum(drop) / len(drop) / grads:.2f} x the gradients)")


if __name__ == "__main__":
    main()
