"""Host work of one pipeline message group: megapar's `StageP2P` against torch's own calls.

`executor_plan.py` leaves the message layer out (its messages complete at once). This script
measures that layer on two forked gloo ranks of a pp 2 mesh: the host CPU time (the thread's,
`time.thread_time`) of issuing a group and waiting for it, per group, as

- torch: ``dist.P2POp`` + ``dist.batch_isend_irecv`` + ``work.wait()``, the least any executor
  on torch.distributed does per group (torch.distributed.pipelining issues its messages so);
- megapar: `StageP2P.issue` of the same group, then `wait_recv` / `release` (what the executor
  calls: the shape check, the payload cast to the wire dtype, the receive buffer, the
  bookkeeping of held messages);
- recording: the same with the step's record of issued groups on (`StageP2P.issued`, one
  `nccl_rules.Op` per message kept to the next step: what `certify` and the tests turn on).

Two kinds of group: `one` (rank 0 sends one activation, rank 1 receives it) and `pair` (each
rank sends one message to the other and receives one from it in the same group, as 1F1B's
``send_forward_recv_backward``). The two implementations take turns, `--groups` groups each
per round, and the minimum over `--rounds` rounds is kept (a shared machine's noise only adds
time). It then prints what that costs a step at pp 16, m 256: a middle stage's message groups
of each schedule times the per-group cost (gloo on this CPU; NCCL's own per-call costs differ
and are not measured here), beside nothing else: compare it with the executor's own host work
(`executor_plan.py`, about 1.3-3.5 ms a step at these layouts).

    python benchmarks/pipeline/p2p_host_cost.py [--groups 500] [--rounds 7] [--hidden 64]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402


def _worker(groups: int, rounds: int, shape: tuple):
    import torch.distributed as dist

    from megapar.mesh import Mesh
    from megapar.pipeline.p2p import StageP2P

    torch.set_num_threads(1)
    mesh = Mesh.from_env(1, 2, 1)
    me, peer = mesh.pp_rank, mesh.stage_rank(1 - mesh.pp_rank)
    p2p = StageP2P(mesh, shape, torch.float32, timeout_s=120)
    recording = StageP2P(mesh, shape, torch.float32, timeout_s=120)
    recording.issued = []  # what a checker (certify, the tests) turns on
    tensor = torch.randn(shape)

    def torch_group(kind: str, i: int) -> None:
        ops = []
        if kind == "pair" or me == 0:
            ops.append(dist.P2POp(dist.isend, tensor.detach(), peer, mesh.pp_group))
        if kind == "pair" or me == 1:
            ops.append(dist.P2POp(dist.irecv, torch.empty(shape), peer, mesh.pp_group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def megapar_group(kind: str, i: int, p2p=p2p) -> None:
        group, send, recv = [], ("send_act", i, 0), ("recv_act", i, 0)
        if kind == "pair" or me == 0:
            group.append((send, tensor, peer, ("act", i, 0), f"SA{i}"))
        if kind == "pair" or me == 1:
            group.append((recv, None, peer, ("act", i, 0), f"RA{i}"))
        p2p.issue(group)
        if kind == "pair" or me == 1:
            p2p.wait_recv(recv)
        if kind == "pair" or me == 0:
            p2p.release(send)

    best = {}
    for kind in ("one", "pair"):
        for round_ in range(rounds + 1):
            for name, run in (("torch", torch_group), ("megapar", megapar_group),
                              ("recording", functools.partial(megapar_group, p2p=recording))):
                dist.barrier(group=mesh.pp_group)
                p2p.begin_step()
                recording.begin_step()
                start = time.thread_time()
                for i in range(groups):
                    run(kind, i)
                spent = (time.thread_time() - start) / groups
                if round_ > 0:  # the first round warms up
                    best[kind, name] = min(best.get((kind, name), float("inf")), spent)
    return best


def main(argv=None) -> int:
    from megapar.launcher import run_local
    from megapar.pipeline import messages
    from megapar.pipeline.schedules import MessageGroup

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=positive, default=500, help="groups per round and implementation")
    p.add_argument("--rounds", type=positive, default=7, help="rounds (the minimum is kept)")
    p.add_argument("--hidden", type=positive, default=64,
                   help="the message is (1, 16, hidden) fp32 (small: the host work, not the copy)")
    args = p.parse_args(argv)
    shape = (1, 16, args.hidden)
    results = run_local(_worker, 2, args.groups, args.rounds, shape, timeout_s=3600)
    print(f"host CPU time per group, gloo, 2 ranks, message {shape} fp32, minimum of "
          f"{args.rounds} rounds of {args.groups} groups (us; rank 0 / rank 1)")
    print(f"{'group':6} | {'torch':>13} | {'megapar':>13} | {'recording':>13} | "
          f"megapar / torch | recording / megapar")
    cost = {}
    for kind in ("one", "pair"):
        t, m, r = ([res[kind, name] for res in results]
                   for name in ("torch", "megapar", "recording"))
        cost[kind] = statistics.mean(m)
        print(f"{kind:6} | {t[0] * 1e6:5.1f} / {t[1] * 1e6:5.1f} | {m[0] * 1e6:5.1f} / "
              f"{m[1] * 1e6:5.1f} | {r[0] * 1e6:5.1f} / {r[1] * 1e6:5.1f} | "
              f"{statistics.mean(m) / statistics.mean(t):15.2f} | "
              f"{statistics.mean(r) / statistics.mean(m):.2f}")
    per_group = statistics.mean(cost.values())
    print(f"\na step at pp 16, m 256, middle stage (8), at megapar's {per_group * 1e6:.1f} us a "
          f"group (the mean of the two kinds)")
    print(f"{'schedule':12} {'V':>2} | {'groups':>6} | {'messages':>8} | {'ms a step':>9}")
    for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2),
                        ("interleaved", 2)):
        program = messages.programs(schedule, 16, 256, v, False)[8]
        found = [s for s in program if isinstance(s, MessageGroup)]
        count = sum(len(g.messages) for g in found)
        print(f"{schedule:12} {v:2d} | {len(found):6d} | {count:8d} | "
              f"{len(found) * per_group * 1e3:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
