"""The certificate's "real step" check: each certified (schedule, pp, m, V) run for one step on
real processes (gloo, a toy stage, receives issued where the program has them, as on NCCL),
every group the stage hands to ``batch_isend_irecv`` recorded and compared group by group with
the certified programs (peers, directions, message sizes, labels), then held to NCCL's rules
with their real sizes (`check_real_steps`, `compare_issued`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.pipeline import nccl_rules
from megapar.pipeline.certify import Certificate, Check, program_actions
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.placement import placement_of, virtual_stage

REAL_MAX_PP, REAL_MAX_M = 4, 8
"""`megapar-bubble --certify` runs real steps for the grid's points up to these sizes."""

HIDDEN = 4


class _ToyChunk(nn.Module):
    """tanh(linear(x)); virtual stage 0 reads batch["x"], the last returns the loss."""

    def __init__(self, vs: int, last: int):
        super().__init__()
        torch.manual_seed(vs)
        self.lin, self.vs, self.last = nn.Linear(HIDDEN, HIDDEN), vs, last

    def forward(self, hidden, batch):
        out = torch.tanh(self.lin(batch["x"] if self.vs == 0 else hidden))
        return ((out - batch["y"]) ** 2).mean() if self.vs == self.last else out


class _ToyStage(nn.Module):
    """A rank's model chunks of the toy model, placed as `schedule` places them."""

    def __init__(self, mesh: Mesh, schedule: str, chunks: int):
        super().__init__()
        vs = [
            virtual_stage(mesh.pp_rank, c, mesh.pp, placement_of(schedule)) for c in range(chunks)
        ]
        self.chunks = nn.ModuleList(_ToyChunk(v, mesh.pp * chunks - 1) for v in vs)


def _real_worker(cases: list[tuple], timeout_s: float) -> list[tuple]:
    """Run each (schedule, V, chunks, m, forward_only) for one step on this rank; per case,
    the groups `StageP2P` recorded (labelled Ops) and those handed to batch_isend_irecv."""
    pp = dist.get_world_size()
    mesh = Mesh(Layout(1, pp, 1), dist.get_rank(), timeout_s)
    out, executors = [], {}
    for name, v, chunks, m, forward_only in cases:
        if (name, v) not in executors:
            executor = PipelineExecutor(
                _ToyStage(mesh, name, chunks),
                mesh,
                name,
                (2, HIDDEN),
                timeout_s=timeout_s,
                virtual_stages=v,
            )
            executor.post_ahead = False  # receives where the program has them, as on NCCL
            p2p = executor.p2p
            assert p2p is not None  # pp > 1
            p2p.issued = []  # record the groups issued
            raw: list = []
            real = p2p.batch_isend_irecv

            def record(ops, raw=raw, real=real):
                raw.append(
                    [
                        (op.op is dist.isend, op.peer, op.tensor.numel() * op.tensor.element_size())
                        for op in ops
                    ]
                )
                return real(ops)

            p2p.batch_isend_irecv = record
            executors[name, v] = (executor, p2p, raw)
        executor, p2p, raw = executors[name, v]
        gen = torch.Generator().manual_seed(m)
        batches = [
            {"x": torch.randn(2, HIDDEN, generator=gen), "y": torch.randn(2, HIDDEN, generator=gen)}
            for _ in range(m)
        ]
        raw.clear()
        executor.run(batches, forward_only=forward_only)
        assert p2p.issued is not None  # recording since the executor was made
        labelled = [
            [(op.send, op.peer, op.message, op.label, op.nbytes) for op in group]
            for group in p2p.issued
        ]
        out.append((labelled, list(raw)))
    return out


def compare_issued(cert: Certificate, issued: dict[int, tuple]) -> Check:
    """Whether the groups a real step issued (`issued[rank]` = (labelled groups, raw groups),
    as `_real_worker` records them; pipeline rank = global rank) are the certified programs'
    groups, and pair and progress under NCCL's rules with their real sizes."""
    placement = placement_of(cert.schedule)
    expected = nccl_rules.program_streams(cert.programs, placement)
    nbytes = 2 * HIDDEN * 4
    streams = {}
    for rank in range(cert.pp):
        labelled, raw = issued[rank]
        want = [[(op.send, op.peer, op.message, op.label) for op in g] for g in expected[rank]]
        got = [[op[:4] for op in g] for g in labelled]
        if got != want:
            at = next(
                (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
            )

            return Check(
                False,
                f"rank {rank} issued {len(got)} groups, the program has "
                f"{len(want)}; first difference at group {at}: issued "
                f"{_show(got, at)}, certified {_show(want, at)}",
            )
        if [[(s, p) for s, p, _ in g] for g in raw] != [[op[:2] for op in g] for g in want]:
            return Check(
                False,
                f"rank {rank}: the operations handed to batch_isend_irecv are "
                f"not the groups StageP2P recorded",
            )
        if any(size != nbytes for g in raw for _, _, size in g):
            return Check(False, f"rank {rank} issued a message of another size than {nbytes} bytes")
        streams[rank] = [[nccl_rules.Op(*op) for op in g] for g in labelled]
    try:
        nccl_rules.check(streams)
    except nccl_rules.ScheduleError as exc:
        return Check(False, f"the issued groups fail NCCL's rules: {exc}")
    groups = sum(len(g) for g in streams.values())
    return Check(True, f"{groups} issued groups = the certified ones")


def _show(groups: list, at: int) -> str:
    """Group `at` of `groups` as "[SA2->1 RG1<-1]" (label, direction, peer)."""
    if at >= len(groups):
        return "nothing"
    return (
        "["
        + " ".join(f"{op[3]}->{op[1]}" if op[0] else f"{op[3]}<-{op[1]}" for op in groups[at])
        + "]"
    )


def check_real_steps(certs: list[Certificate], timeout_s: float = 120.0) -> None:
    """Run every certificate's step on real processes (one launch per pp) and record the
    "real step" check in each (see `compare_issued`)."""
    by_pp: dict[int, list[Certificate]] = {}
    for c in certs:
        by_pp.setdefault(c.pp, []).append(c)
    for pp, group in sorted(by_pp.items()):
        cases = []
        for c in group:
            chunks = 1 + max((a.chunk for p in c.programs for a in program_actions(p)), default=0)
            cases.append((c.schedule, c.virtual_stages, chunks, c.m, c.forward_only))
        results = run_local(
            _real_worker,
            pp,
            cases,
            timeout_s,
            timeout_s=timeout_s + 30,
            env={"MEGAPAR_CPU": "1"},
            optimizers=False,
        )
        for i, c in enumerate(group):
            c.checks["real step"] = compare_issued(c, {r: results[r][i] for r in range(pp)})
