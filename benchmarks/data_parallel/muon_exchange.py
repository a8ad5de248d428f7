"""Muon's traffic over dp per step, counted (no processes, no tensors): the every-rank scheme's
all-gather of the buckets (ZeRO-3: units) holding Muon matrices against `--muon-distributed`'s
two all-to-alls, with each matrix's owner placed by Newton-Schulz cost alone
(`optim.muon.assign_owners`, the placement before `place_owners`) and by where its slices lie
(`optim.muon.place_owners`, megapar's).

Each model is built on the meta device as one tp rank holds it; its buckets are laid out by
`data_parallel.buckets.make_buckets` (ZeRO-1 / 2, --grad-bucket-mb 25, fp32: no 16-bit
buckets) or its ZeRO-3 units by `plan.params.stage_units`, each padded to a multiple of dp and
cut into dp slices (`optim.muon.slices_held`). Per dp rank: MiB received (the same number
sent) in fp32; "most" / "least" over the dp ranks. The all-to-alls' figure leaves out what a
rank holds of its own matrices (it does not cross the wire); the all-gather's is (dp - 1) / dp
of the buckets holding Muon matrices. "NS" is the heaviest slot's Newton-Schulz cost against
`assign_owners`' heaviest (1.00: no slot does more than before).

    python benchmarks/data_parallel/muon_exchange.py                    # a few seconds
    python benchmarks/data_parallel/muon_exchange.py --models llama-1b --tp 2
"""

from __future__ import annotations

import argparse
import json
import os

from megapar.data_parallel.buckets import make_buckets
from megapar.mesh import Layout, Mesh
from megapar.models import build_model
from megapar.models.config import config_from_dict
from megapar.optim.muon import (
    assign_owners,
    exchange_elements,
    is_muon_matrix,
    ns_cost,
    place_owners,
    slices_held,
)
from megapar.plan.params import StageLayout, stage_units
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def muon_layout(config, named, n: int, zero: int, tp: int = 1):
    """(Muon matrices, elements of each on each dp rank, elements of the buckets / units
    holding them) of one tp rank's parameters `named` (the model's order) at dp `n`."""
    params = [p for _, p in named]
    muon = {id(p) for name, p in named if is_muon_matrix(name, p)}
    if zero == 3:
        units = stage_units(StageLayout.of(config, tp=tp, dp=n, zero=3))
        groups = [[params[i] for i in u.tensors] for u in units]
        padded = [-(-sum(p.numel() for p in g) // n) * n for g in groups]
    else:
        buckets = make_buckets(params, 25.0, n)
        groups, padded = [b.params for b in buckets], [b.padded for b in buckets]
    matrices, held, total = [], [], 0
    for group, size in zip(groups, padded):
        if not any(id(p) in muon for p in group):
            continue
        total += size
        for p, parts in zip(group, slices_held([p.numel() for p in group], size, n)):
            if id(p) in muon:
                matrices.append(p)
                held.append(parts)
    return matrices, held, total


def counts(config, named, n: int, zero: int, tp: int = 1) -> dict:
    """Per dp rank, elements received by the all-gather and by the all-to-alls under either
    placement, and the heaviest slot's Newton-Schulz cost under either."""
    matrices, held, total = muon_layout(config, named, n, zero, tp)
    costs = [ns_cost(p) for p in matrices]
    before, after = assign_owners(costs, n * tp), place_owners(costs, held, tp)

    def heaviest(slots):
        return max(sum(c for c, s in zip(costs, slots) if s == r) for r in range(n * tp))

    return {
        "gather": [(n - 1) * total // n] * n,
        "before": exchange_elements(held, [s // tp for s in before]),
        "after": exchange_elements(held, [s // tp for s in after]),
        "ns": heaviest(after) / heaviest(before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-124m", "llama-160m"])
    parser.add_argument("--dp", type=positive, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tp", type=positive, default=1)
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 3], choices=[1, 2, 3])
    args = parser.parse_args()
    for name in args.models:
        if not os.path.exists(os.path.join(ROOT, "models", f"{name}.json")):
            shipped = sorted(n[:-5] for n in os.listdir(os.path.join(ROOT, "models"))
                             if n.endswith(".json"))
            parser.error(f"--models {name}: no such recipe; shipped: {', '.join(shipped)}")
    print(
        "model | ZeRO | dp | all-gather (default) | all-to-alls, by cost (before) | "
        "all-to-alls, placed (after) | NS heaviest"
    )
    print("(MiB received per dp rank a step, fp32, least-most over the ranks where they "
          "differ; NS heaviest: the heaviest slot's Newton-Schulz cost placed against "
          "assign_owners' heaviest, 1.00: no slot does more)")
    for name in args.models:
        with open(os.path.join(ROOT, "models", f"{name}.json")) as f:
            config = config_from_dict(json.load(f))
        mesh = Mesh.virtual(Layout(args.tp, 1, 1), rank=0, device="meta")
        named = list(build_model(config, mesh).named_parameters())
        for zero in args.zero:
            for n in args.dp:
                c = counts(config, named, n, zero, args.tp)

                def mib(xs):
                    lo, hi = min(xs) * 4 / 2**20, max(xs) * 4 / 2**20
                    return f"{hi:.1f}" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f}"

                print(
                    f"{name} | {'1 / 2' if zero < 3 else 3} | {n} | {mib(c['gather'])} | "
                    f"{mib(c['before'])} | {mib(c['after'])} | {c['ns']:.2f}"
                )


if __name__ == "__main__":
    main()
