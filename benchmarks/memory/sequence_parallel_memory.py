"""Activation memory a pipeline stage keeps for backward at tp=2, with and without
--sequence-parallel, and with --sp-regather; and each mode's forward + backward time.

Two local ranks (tp=2) run the forward of m micro-batches through a middle stage (blocks only)
and count, per rank, the distinct storages autograd saves for backward (parameters excluded;
`recompute_memory.SavedBytes`). Under sequence parallelism LayerNorm, dropout and the residual
stream hold s / tp positions; the attention core and the MLP's hidden layer were already split
by heads / columns, so the saving is on the part of the layer outside the tp regions.

For reference it prints the ratio of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2), per layer in bytes with 16-bit
activations and 1-byte dropout masks: tp alone sbh(10 + 24/t + 5as/(ht)), tp + SP
sbh(34/t + 5as/(ht)). This run is fp32 with torch's SDPA, so the absolute bytes differ; the
ratio is what to compare. megapar's SP keeps the column-parallel projections' gathered inputs
whole (2 s b h more than the paper); --sp-regather keeps their slices and re-gathers them in
the backward, the paper's count.

Time: the m forwards and their backward, the best of --repeats, the modes taken in turns
(the same process group), tokens per second over both ranks' shared tokens.

    python benchmarks/memory/sequence_parallel_memory.py [--layers 4 --hidden 256 --heads 8 --seq 256]
"""

from __future__ import annotations

import argparse

import torch

from recompute_memory import SavedBytes, add_stage_arguments
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


MODES = {"tp": (False, False), "tp + SP": (True, False), "SP regather": (True, True)}


def _worker(args) -> dict:
    """{mode: (saved bytes, best seconds of the m forwards and the backward)} on this rank."""
    import time

    import torch.distributed as dist

    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config, build_model, set_sp_regather
    from megapar.tensor_parallel import RNGTracker

    torch.set_num_threads(1)
    p = args.dropout
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=p, embd_pdrop=p,
                        attn_pdrop=p)
    models = {}
    for mode, (sequence_parallel, regather) in MODES.items():
        mesh = Mesh(Layout(2, 1, 1), dist.get_rank(), sequence_parallel=sequence_parallel)
        model = build_model(config, mesh, range(args.layers), pre_process=False,
                            post_process=False, tracker=RNGTracker(0, mesh))
        model.init_weights(0)
        set_sp_regather(model, regather)
        models[mode] = (model, args.seq // 2 if sequence_parallel else args.seq)
    saved, best = {}, {mode: float("inf") for mode in MODES}
    for turn in range(args.repeats + 1):
        for mode, (model, seq) in models.items():
            gen = torch.Generator().manual_seed(0)
            counter = SavedBytes(model)
            outputs = []
            dist.barrier()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                for _ in range(args.m):
                    hidden = torch.randn(args.mb, seq, args.hidden, generator=gen,
                                         requires_grad=True)
                    counter.add(hidden)  # the received activation a stage keeps
                    outputs.append(model(hidden, {}))
            saved[mode] = counter.total
            sum(o.sum() for o in outputs).backward()
            if turn:  # the first turn warms up
                best[mode] = min(best[mode], time.perf_counter() - start)
    return {mode: (saved[mode], best[mode]) for mode in MODES}


def main() -> None:
    from megapar.launcher import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stage_arguments(parser, m=2)
    parser.add_argument("--repeats", type=positive, default=5, help="timing: best of this many")
    args = parser.parse_args()
    t, s, h, a = 2, args.seq, args.hidden, args.heads
    print(f"GPT-2 middle stage: {args.layers} layers, hidden {h}, {a} heads, seq {s}, "
          f"{args.m} micro-batches of {args.mb} in flight, tp=2, fp32, dropout {args.dropout}")
    per_rank = run_local(_worker, 2, args)
    tokens = args.m * args.mb * s
    for mode in MODES:
        print(f"{mode:>12}: saved for backward per rank "
              + ", ".join(f"{r[mode][0] / 2**20:.2f} MiB" for r in per_rank)
              + f"; {tokens / max(r[mode][1] for r in per_rank):,.0f} tokens/s")
    base = per_rank[0]["tp"][0]
    formula = (34 / t + 5 * a * s / (h * t)) / (10 + 24 / t + 5 * a * s / (h * t))
    print(f"ratio to tp: SP {per_rank[0]['tp + SP'][0] / base:.3f}, SP regather "
          f"{per_rank[0]['SP regather'][0] / base:.3f}; Korthikanti et al. formula {formula:.3f}")
    speed = max(r["tp + SP"][1] for r in per_rank) / max(r["SP regather"][1] for r in per_rank)
    print(f"tokens/s SP regather / SP: {speed:.3f}")


if __name__ == "__main__":
    main()
