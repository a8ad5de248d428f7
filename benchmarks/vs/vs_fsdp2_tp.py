"""megapar `--zero 3` vs torch's FSDP2 (`fully_shard`) with and without DTensor tensor parallelism.

`vs_fsdp2.py` compares the two at dp 2 on one megapar model inside the same processes; this
script adds dp 2 x tp 2, where torch's side needs its own tensor-parallel model (DTensor), so
each system runs in its own processes, alternating.

The model, data and optimizer are `vs_torch.py`'s (GPT-2, 8 layers, hidden 256, 4 heads, vocab
1024, seq 128, global batch 16, fp32, AdamW lr 1e-3, no clipping, one seed). torch's side:
the plain PyTorch GPT-2 of `vs_torch.py` with every block and then the whole model wrapped in
`fully_shard` over the dp dimension of a DeviceMesh (torchtitan's recipe: reshard after
forward, the root unit holding the embedding, final norm and the tied head); at `dp2-tp2` the
blocks are first tensor-parallel with DTensor (`parallelize_module`, Colwise / Rowwise as in
`vs_torch.py`) over the tp dimension, then sharded over dp (FSDP2 + TP, torchtitan's 2D).
megapar's side: `megapar.prepare(..., zero=3)` on the same Hugging Face model.

The systems alternate (megapar, torch, megapar, ...), `--repeats` runs each, one warm-up step
and `--steps` timed steps per run, each rank on one torch thread (a rank stands for a device).
Printed per configuration: median s/step of each, megapar / torch, and the largest relative
loss difference (same model, same steps: it must be below 1e-5).

    python benchmarks/vs/vs_fsdp2_tp.py               # dp2 and dp2-tp2, ~3 minutes on 2 cores
    python benchmarks/vs/vs_fsdp2_tp.py --configs dp2-tp2 --repeats 1 --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

try:  # run as a script (benchmarks/vs/ on sys.path) or imported as benchmarks.vs.vs_fsdp2_tp
    import vs_torch as ref
except ImportError:  # pragma: no cover
    from benchmarks.vs import vs_torch as ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_ab_arguments, pair_ratios, ratio_summary  # noqa: E402

CONFIGS = {"dp2": (1, 2), "dp2-tp2": (2, 2)}  # name: (tp, dp)
SIZE = "small"


def torch_run(name: str, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tp, dp = CONFIGS[name]
    hf = ref.hf_model(SIZE)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = ref.Part(hf, 0, hf.config.n_layer, True, True)
    if tp > 1:
        ref.parallelize_tp(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=ref.LR, betas=(0.9, 0.95),
                                  weight_decay=0.0, eps=1e-8)
    dp_rank, local = mesh["dp"].get_local_rank(), ref.BATCH // dp
    group = mesh["dp"].get_group()

    def step(batch) -> float:
        ids = batch["input_ids"][dp_rank * local:(dp_rank + 1) * local]
        labels = batch["labels"][dp_rank * local:(dp_rank + 1) * local]
        optimizer.zero_grad()
        loss = ref.loss_fn(model(ids), labels)
        loss.backward()
        optimizer.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=group)
        return float(loss) / dp

    return ref._timed(step, SIZE, steps)


def megapar_run(name: str, steps: int) -> dict:
    import megapar

    tp, dp = CONFIGS[name]
    engine = megapar.prepare(ref.hf_model(SIZE), tp=tp, micro_batch_size=ref.BATCH // dp,
                             zero=3, lr=ref.LR, weight_decay=0.0, clip_grad=0.0,
                             global_batch_size=ref.BATCH, seq_len=ref.SIZES[SIZE]["seq"])
    return ref._timed(engine.train_step, SIZE, steps)


def _worker(system: str, name: str, steps: int) -> dict:
    torch.set_num_threads(1)  # one core per rank, as one GPU per rank
    return (megapar_run if system == "megapar" else torch_run)(name, steps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_arguments(parser, CONFIGS)
    parser.add_argument("--systems", nargs="+", default=["megapar", "torch"],
                        choices=["megapar", "torch"], help="run only one side (debugging)")
    args = parser.parse_args(argv)
    results = {name: ref.ab_runs(_worker, name, CONFIGS[name][0] * CONFIGS[name][1],
                                 args.systems, args.repeats, args.steps)
               for name in args.configs}
    print("s: median seconds a step; ratio: megapar s / torch s (below 1: megapar faster); "
          "pair by pair: megapar / torch per repeat, median [min, max]")
    print(f"{'config':>8} " + " ".join(f"{s + ' s':>10}" for s in args.systems)
          + f" {'ratio':>6} {'max loss diff':>13} {'pair by pair':>18}  "
          f"losses ({args.systems[0]})")
    for name, runs in results.items():
        med = {k: statistics.median(r["s_per_step"] for r in v) for k, v in runs.items()}
        first = runs[args.systems[0]][0]["losses"]
        ratio, diff, pairs = float("nan"), float("nan"), "nan"
        if len(runs) == 2:
            ratio = med["megapar"] / med["torch"]
            diff = max(abs(x - y) / abs(y) for x, y in
                       zip(runs["megapar"][0]["losses"], runs["torch"][0]["losses"]))
            pairs = ratio_summary(pair_ratios(*([r["s_per_step"] for r in runs[k]]
                                                for k in ("megapar", "torch"))))
        print(f"{name:>8} " + " ".join(f"{med[s]:>10.3f}" for s in args.systems)
              + f" {ratio:>6.2f} {diff:>13.1e} {pairs:>18}  "
              f"{', '.join(f'{x:.5f}' for x in first)}")


if __name__ == "__main__":
    main()
