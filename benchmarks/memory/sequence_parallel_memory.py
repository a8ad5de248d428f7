"""Activation memory a pipeline stage keeps for backward at tp=2, with and without
--sequence-parallel.

Two local ranks (tp=2) run the forward of m micro-batches through a middle stage (blocks only)
and count, per rank, the distinct storages autograd saves for backward (parameters excluded;
`recompute_memory.SavedBytes`). Under sequence parallelism LayerNorm, dropout and the residual
stream hold s / tp positions; the attention core and the MLP's hidden layer were already split
by heads / columns, so the saving is on the part of the layer outside the tp regions.

For reference it prints the ratio of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2), per layer in bytes with 16-bit
activations and 1-byte dropout masks: tp alone sbh(10 + 24/t + 5as/(ht)), tp + SP
sbh(34/t + 5as/(ht)). This run is fp32 with torch's SDPA, so the absolute bytes differ; the
ratio is what to compare.

    python benchmarks/memory/sequence_parallel_memory.py [--layers 4 --hidden 256 --heads 8 --seq 256]
"""

from __future__ import annotations

import argparse

import torch

from recompute_memory import SavedBytes, add_stage_arguments


def _worker(args, sequence_parallel: bool) -> int:
    import torch.distributed as dist

    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config, build_model
    from megapar.tensor_parallel import RNGTracker

    torch.set_num_threads(1)
    p = args.dropout
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=p, embd_pdrop=p,
                        attn_pdrop=p)
    mesh = Mesh(Layout(2, 1, 1), dist.get_rank(), sequence_parallel=sequence_parallel)
    model = build_model(config, mesh, range(args.layers), pre_process=False, post_process=False,
                        tracker=RNGTracker(0, mesh))
    model.init_weights(0)
    seq = args.seq // 2 if sequence_parallel else args.seq
    gen = torch.Generator().manual_seed(0)
    counter = SavedBytes(model)
    outputs = []
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        for _ in range(args.m):
            hidden = torch.randn(args.mb, seq, args.hidden, generator=gen, requires_grad=True)
            counter.add(hidden)  # the received activation a stage keeps
            outputs.append(model(hidden, {}))
    saved = counter.total
    sum(o.sum() for o in outputs).backward()
    return saved


def main() -> None:
    from megapar.launcher import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_stage_arguments(parser, m=2)
    args = parser.parse_args()
    t, s, h, a = 2, args.seq, args.hidden, args.heads
    print(f"GPT-2 middle stage: {args.layers} layers, hidden {h}, {a} heads, seq {s}, "
          f"{args.m} micro-batches of {args.mb} in flight, tp=2, fp32, dropout {args.dropout}")
    results = {sp: run_local(_worker, 2, args, sp) for sp in (False, True)}
    for sp, per_rank in results.items():
        label = "tp + SP" if sp else "tp"
        print(f"{label:>8}: saved for backward per rank "
              + ", ".join(f"{b / 2**20:.2f} MiB" for b in per_rank))
    measured = results[True][0] / results[False][0]
    formula = (34 / t + 5 * a * s / (h * t)) / (10 + 24 / t + 5 * a * s / (h * t))
    print(f"ratio SP / no SP: measured {measured:.3f}; Korthikanti et al. formula {formula:.3f}")


if __name__ == "__main__":
    main()
