"""ZeRO-3's full gradient buffers on NCCL's path, at the peak the OS sees.

On a GPU (NCCL) each ZeRO-3 unit's full gradient is reduce-scattered asynchronously; a unit's
buffer can only be freed once its reduction is waited for. `ShardedParams` waits for the oldest
before the next launches (`MAX_REDUCES_IN_FLIGHT`, 1), so the backward holds one or two units'
full gradients; before, it waited only in `finish()`, and the end of the backward held the
stage's whole gradient. On the CPU, gloo is not run this way by default (its collectives go in
synchronous pieces); here every rank forces NCCL's path (`host_waits` off: each collective
whole and asynchronous) and the run is measured twice: as the code is (bounded), and with the
bound lifted (`MAX_REDUCES_IN_FLIGHT` unbounded: what the code did before). Each rank is a
fresh spawned process; the figure is its peak resident set (VmHWM) over two training steps of
GPT-2 124M at dp 2 (seq 64, one sequence per rank), and beside it the most bytes of full
gradient buffers alive at once (counted on the real tensors).

gloo copies a collective's buffer while it is in flight (NCCL does not), so on the CPU the
unbounded run also holds those copies: the OS-peak difference here is an upper bound of a
GPU's, whose device saving is the counted one.

    python benchmarks/memory/zero3_grad_buffers.py [--repeats 2]
"""

from __future__ import annotations

import argparse

from megapar.launcher import run_local
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


def _rank(bounded: bool) -> tuple[int, int]:
    """(peak resident set in bytes, most full-gradient-buffer bytes alive at once)."""
    import torch
    from transformers import GPT2Config

    import megapar

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    config = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=64, vocab_size=50257,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    engine = megapar.prepare(config, micro_batch_size=1, zero=3, seq_len=64)
    sharded = engine.sharded_params
    sharded.host_waits, sharded.piece = False, None  # NCCL's path: whole, async collectives
    if not bounded:
        sharded.MAX_REDUCES_IN_FLIGHT = 10**9
    most = [0]
    launch = sharded._launch

    def launched(u) -> None:
        alive = sum(v.grad_full.untyped_storage().nbytes() for v in sharded.units
                    if v.grad_full is not None)
        flight = sum(v.reduce_handle.flat.untyped_storage().nbytes() for v in sharded.units
                     if v.reduce_handle is not None and v.reduce_handle.flat is not None)
        most[0] = max(most[0], alive + flight)
        launch(u)

    sharded._launch = launched
    ids = torch.randint(0, 50257, (2, 65), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return status("VmHWM"), most[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive, default=1)
    args = parser.parse_args(argv)
    print("| ZeRO-3 reductions in flight | peak RSS, largest rank (GiB) | full gradient buffers "
          "alive at once (GiB) |\n| --- | ---: | ---: |")
    rows = {}
    for r in range(args.repeats):
        for bounded in (False, True):
            outs = run_local(_rank, 2, bounded, start_method="spawn")
            peak, buffers = max(o[0] for o in outs), max(o[1] for o in outs)
            rows.setdefault(bounded, []).append(peak)
            label = "bounded (1, as now)" if bounded else "unbounded (as before)"
            print(f"| {label}, run {r + 1} | {peak / 2**30:.3f} | {buffers / 2**30:.3f} |")
    ratio = min(rows[True]) / min(rows[False])
    print(f"bounded / unbounded peak RSS (lowest of each): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
