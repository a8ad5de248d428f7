"""The dry run against real runs: bytes, activations and communication of every rank.

For each layout (schedule x recompute, ZeRO-1 on and off), forked gloo ranks
(megapar.launcher.run_local) run real optimizer steps of megapar-train's `Engine` and measure on
every rank what `megapar.dryrun.measure` measures (the tensors' storages, the peak of what is
held for backward, every collective of the last step); the dry run of the same job rehearses
every rank in this process. Printed per rank: weights / gradients / optimizer bytes (dry run
minus real: 0 when equal), the activation peak (dry run = modelled, real = measured) with the
error, and whether each group's communication per step equals the real step's (the scalar
all-reduces the dry run does not run left out of both; on the host a ZeRO bucket over 4 MiB is
reduced and gathered in pieces: more calls of the same bytes). Also: the shard files of a real save
against the dry run's planned sizes.

    python benchmarks/plan/dry_run_validate.py [--model gpt2-small-cpu] [--tp 2 --pp 2 --dp 2]
        [--seq 64 --mbs 2 --global-batch 16] [--schedules 1f1b ...] [--recompute none ...]
        [--zero 0 1] [--sequence-parallel]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive, recipe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")


def compare(cfg, config, steps: int = 2, check_files: bool = True) -> list[dict]:
    """Per rank: the dry run's figures, the real run's and their differences."""
    from megapar.dryrun import dry_run
    from megapar.dryrun.measure import measured_rank
    from megapar.launcher import run_local
    from megapar.mesh import Layout
    from megapar.checkpoint.publish import resolve_checkpoint

    layout = Layout(cfg.tp, cfg.pp, cfg.dp)
    with tempfile.TemporaryDirectory() as tmp:
        save = os.path.join(tmp, "ckpt") if check_files else None
        real = run_local(measured_rank, layout.world_size, cfg.to_dict(), config.to_dict(),
                         steps, save, timeout_s=600)
        files = {}
        if save:
            step_dir = resolve_checkpoint(save)
            files = {f: os.path.getsize(step_dir / f) for f in os.listdir(step_dir)}
    dry = {r.rank: r for r in dry_run(cfg, config, layout, list(range(layout.world_size)))}
    rows = []
    for meas in sorted(real, key=lambda r: r["rank"]):
        d = dry[meas["rank"]]
        rows.append({"rank": meas["rank"], "stage": meas["pp_rank"],
                     "diff": {k: getattr(d, k) - meas[k]
                              for k in ("params", "weights", "grads", "optimizer")},
                     "act_dry": d.activations, "act_real": meas["activations"],
                     "act_err": d.activations / meas["activations"] - 1,
                     "comm_equal": same_comm(d.comm, meas["comm"]), "comm_dry": d.comm,
                     "comm_real": meas["comm"],
                     "file": (d.checkpoint_bytes == files.get(d.checkpoint_file))
                     if files else None})
    return rows


def same_comm(dry: dict, real: dict) -> bool:
    """Whether the dry run's communication per step is the real step's: every group and call
    the same, except that on the host gloo reduces and gathers a ZeRO bucket above
    `shard_comm.HOST_PIECE_BYTES` in pieces, so a CPU run makes more reduce-scatters and
    all-gathers than the one call NCCL makes (and the dry run counts), of the same bytes."""
    if dry.keys() != real.keys():
        return False
    for name, group in dry.items():
        other = real[name]
        if group.keys() != other.keys():
            return False
        for op, value in group.items():
            pieces = (op in ("reduce_scatter", "all_gather") and isinstance(value, dict)
                      and value["bytes"] == other[op]["bytes"]
                      and value["count"] <= other[op]["count"])
            if value != other[op] and not pieces:
                return False
    return True


def main() -> None:
    from megapar.models.recipes import resolve_model
    from megapar.training.config import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=recipe, default="gpt2-small-cpu")
    parser.add_argument("--tp", type=positive, default=2)
    parser.add_argument("--pp", type=positive, default=2)
    parser.add_argument("--dp", type=positive, default=2)
    parser.add_argument("--seq", type=positive, default=64)
    parser.add_argument("--mbs", type=positive, default=2)
    parser.add_argument("--global-batch", type=positive, default=16)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--recompute", nargs="+", default=list(RECOMPUTE))
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    config = resolve_model(args.model)
    print(f"{args.model}: tp {args.tp} x pp {args.pp} x dp {args.dp}"
          f"{' with sequence parallelism' if args.sequence_parallel else ''}, seq {args.seq}, "
          f"micro-batch {args.mbs}, global batch {args.global_batch}, fp32, AdamW; dry run vs "
          f"real (forked gloo ranks), every rank")
    print(f"{'layout':<34} {'bytes dry-real':>14} {'act dry MiB':>11} {'act real MiB':>12} "
          f"{'act err':>8} {'comm':>5} {'files':>5}")
    worst, start = 0.0, time.perf_counter()
    for schedule in args.schedules:
        for recompute in args.recompute:
            for zero in args.zero:
                cfg = TrainConfig(tp=args.tp, pp=args.pp, dp=args.dp, seq_len=args.seq,
                                  micro_batch_size=args.mbs, global_batch_size=args.global_batch,
                                  schedule=schedule, recompute=recompute, zero=zero,
                                  virtual_stages=2 if schedule == "interleaved" else 1,
                                  sequence_parallel=args.sequence_parallel, grad_bucket_mb=1.0)
                rows = compare(cfg, config)
                label = f"{schedule} rc={recompute}" + (" zero1" if zero else "")
                by_stage: dict[int, dict] = {}
                for r in rows:  # the rank of each stage with the largest error
                    kept = by_stage.get(r["stage"])
                    if kept is None or abs(r["act_err"]) > abs(kept["act_err"]):
                        by_stage[r["stage"]] = r
                bytes_off = max(abs(v) for r in rows for v in r["diff"].values())
                comm = all(r["comm_equal"] for r in rows)
                files = all(r["file"] for r in rows)
                for stage, r in sorted(by_stage.items()):
                    worst = max(worst, abs(r["act_err"]))
                    print(f"{label + f' stage {stage}':<34} {bytes_off:>14} "
                          f"{r['act_dry'] / 2**20:>11.3f} {r['act_real'] / 2**20:>12.3f} "
                          f"{100 * r['act_err']:>+7.1f}% {'same' if comm else 'DIFF':>5} "
                          f"{'same' if files else 'DIFF':>5}")
                for r in rows:
                    if not r["comm_equal"]:
                        print(f"  rank {r['rank']}: dry {r['comm_dry']}\n"
                              f"           real {r['comm_real']}")
    print(f"largest activation error {100 * worst:.1f} % ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
