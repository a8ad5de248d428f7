"""Record a step's per-module values (`--record-step`), replay the step in another layout
(`--replay`) and name the first module, and the rank, whose values differ.

A record holds, for every named module (transformers' names) of every rank, per micro-batch:
the squared norm (float64) of the output that rank computed, with what it covers (the global
samples, and which part of the full output: all of it, its tp slice of the features
(column-parallel layers), its tp slice of the sequence (sequence parallelism), its cp tokens),
the rank and its coordinates, and the order key of the event (`module_trace`). Plus each
module's weight-gradient norm after the step, combined over tp. Written by rank 0 as
`records/step_XXXXXXXX.json` (entries) and `.safetensors` (the squared norms) under --save.

The replay runs the step at tp 1 and cp 1 (any pp, dp; one process is enough), where every
module's output is whole, and computes for each recorded entry the squared norm of the same
part of the same samples. megapar's numbers are the same in every layout up to the order of
floating-point sums, so the norms agree to `RTOL`; the entry of smallest key that does not
names the first module, micro-batch and rank whose values differ.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megapar.checkpoint.distributed import _gather_payloads
from megapar.context_parallel.split import split as cp_split
from megapar.tensor_parallel.layers import ColumnParallelLinear
from megapar.training.module_trace import ModuleTrace

RTOL = 1e-5
"""How far a norm may differ between layouts (relative): the parity tests' tolerance."""

RECORDS = "records"
"""The directory of records under --save."""


def record_paths(root: str | Path, step: int) -> tuple[Path, Path]:
    """(JSON, safetensors) of step `step`'s record under a --save directory."""
    base = Path(root).expanduser() / RECORDS / f"step_{step:08d}"
    return base.with_suffix(".json"), base.with_suffix(".safetensors")


def find_record(load: str, step: int) -> Path | None:
    """The record of `step` next to a --load checkpoint (its --save directory), if any."""
    path = Path(load).expanduser().resolve()
    for root in (path, *path.parents[:2]):
        json_path, _ = record_paths(root, step)
        if json_path.exists():
            return json_path
    return None


def _part(module, mesh) -> str | None:
    """Which part of the full output this rank's output of `module` is (None: not recorded)."""
    if type(module).__name__ == "ReplicatedHeads":  # Llama's k / v heads shared by tp ranks
        return None
    if isinstance(module, ColumnParallelLinear) and not module.gather_output:
        return "features"
    return "sequence" if getattr(mesh, "sequence_parallel", False) and mesh.tp > 1 else "whole"


def _samples(mesh, mb: int, micro_batch_size: int, global_batch: int) -> int:
    """The global index of the first sample of this dp rank's micro-batch `mb`."""
    return mesh.dp_rank * (global_batch // mesh.dp) + mb * micro_batch_size


class StepRecorder:
    """Observes one step through a `ModuleTrace` and writes the record (`--record-step`)."""

    def __init__(self, engine, global_batch: int, trace: ModuleTrace | None = None,
                 grads: bool = True):
        self.engine, self.mesh = engine, engine.mesh
        self.trace = trace or ModuleTrace(engine.model, engine.config, engine.mesh,
                                          weight_grads=False)
        self.trace.observers.append(self._observe)
        self.global_batch = global_batch
        self.grads = grads
        """Record the weight-gradient norms (not of a re-run without the dp reduction)."""
        self.entries: list[dict] = []
        self.sq: list[torch.Tensor] = []
        self.parts = {id(m): _part(m, self.mesh) for _, m, _ in self.trace.modules}

    def _observe(self, key: int, name: str, mb: int, module, out: torch.Tensor) -> None:
        part = self.parts.get(id(module))
        if part is None or out.dim() < 3:  # [batch, sequence, features] (not wpe: [s, h])
            return
        mesh, mbs = self.mesh, out.shape[0]
        first = _samples(mesh, mb, mbs, self.global_batch)
        self.entries.append({
            "module": name, "mb": mb, "key": key, "samples": [first, first + mbs],
            "part": part, "rank": mesh.rank, "tp": mesh.tp_rank, "cp": mesh.cp_rank,
            "pp": mesh.pp_rank, "dp": mesh.dp_rank, "tp_size": mesh.tp, "cp_size": mesh.cp})
        self.sq.append(out.detach().double().square().sum())

    def grad_norms(self) -> dict[str, float]:
        """Each module's weight-gradient squared norm over this rank's parameters, as this rank
        adds it to the combined one (tp slices summed; replicated ones from tp rank 0 only;
        dp and cp replicas from their rank 0 only)."""
        mesh, out = self.mesh, {}
        if not self.grads or mesh.dp_rank or mesh.cp_rank or \
                getattr(self.engine.step_fn, "sharded", False):
            return out
        for _, module, name in self.trace.modules:
            total = 0.0
            for p in module.parameters(recurse=False):
                if p.grad is None or (getattr(p, "tp_dim", None) is None and mesh.tp_rank):
                    continue
                total += float(p.grad.detach().double().square().sum())
            if any(True for _ in module.parameters(recurse=False)):
                out[name] = out.get(name, 0.0) + total
        return out

    def payload(self) -> bytes:
        sq = torch.stack(self.sq).tolist() if self.sq else []
        return json.dumps({"entries": self.entries, "sq": sq,
                           "grads": self.grad_norms()}).encode()

    def write(self, root: str, step: int) -> Path | None:
        """Gather every rank's entries on rank 0 and write the record (collective)."""
        parts = _gather_payloads(self.payload(), self.mesh)
        if parts is None:
            return None
        entries, sq, grads = _merge(parts)
        json_path, st_path = record_paths(root, step)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"sq_norms": torch.tensor(sq, dtype=torch.float64)}, str(st_path))
        json_path.write_text(json.dumps({
            "step": step, "layout": self.mesh.layout.to_dict(), "rtol": RTOL,
            "entries": entries, "grad_sq_norms": grads,
            "values": st_path.name}, indent=1))
        return json_path


def _merge(parts: list[bytes]) -> tuple[list[dict], list[float], dict[str, float]]:
    entries, sq, grads = [], [], {}
    for raw in parts:
        data = json.loads(raw)
        entries += data["entries"]
        sq += data["sq"]
        for name, value in data["grads"].items():
            grads[name] = grads.get(name, 0.0) + value
    return entries, sq, grads


def load_record(path: str | Path) -> dict:
    """A record: its JSON with each entry's squared norm ("sq") from the safetensors file."""
    path = Path(path).expanduser()
    record = json.loads(path.read_text())
    sq = load_file(str(path.parent / record["values"]))["sq_norms"].tolist()
    for entry, value in zip(record["entries"], sq):
        entry["sq"] = value
    return record


class StepReplay:
    """Observes the replayed step (tp 1, cp 1) and compares it with a record."""

    def __init__(self, engine, global_batch: int, record: dict | None):
        self.engine, self.mesh = engine, engine.mesh
        self.trace = ModuleTrace(engine.model, engine.config, engine.mesh, weight_grads=False)
        self.trace.observers.append(self._observe)
        self.global_batch = global_batch
        self.record = record
        self.by_module: dict[str, list[int]] = {}
        for i, e in enumerate(record["entries"] if record else ()):
            self.by_module.setdefault(e["module"], []).append(i)
        self.ours: dict[int, torch.Tensor] = {}  # entry index -> our squared norm
        self.full: dict[str, list] = {}  # module -> [order key, squared norm of its outputs]
        self.recorder = StepRecorder(engine, global_batch)  # for the weight gradients

    def _observe(self, key: int, name: str, mb: int, module, out: torch.Tensor) -> None:
        if out.dim() < 3:
            return
        sq = out.detach().double().square().sum()
        slot = self.full.setdefault(name, [key, 0.0])
        slot[1] = slot[1] + sq
        first = _samples(self.mesh, mb, out.shape[0], self.global_batch)
        for i in self.by_module.get(name, ()):
            e = self.record["entries"][i]
            lo, hi = e["samples"]
            if not (first <= lo and hi <= first + out.shape[0]):
                continue
            piece = cp_split(out.detach()[lo - first:hi - first], e["cp_size"], e["cp"])
            if e["part"] == "features":
                piece = piece.chunk(e["tp_size"], dim=-1)[e["tp"]]
            elif e["part"] == "sequence":
                piece = piece.chunk(e["tp_size"], dim=1)[e["tp"]]
            self.ours[i] = piece.double().square().sum()

    def report(self) -> str | None:
        """Rank 0: the per-module norms and the comparison, as text (collective)."""
        payload = json.dumps({
            "ours": {str(i): float(v) for i, v in self.ours.items()},
            "full": {n: [k, float(v)] for n, (k, v) in self.full.items()},
            "grads": self.recorder.grad_norms()}).encode()
        parts = _gather_payloads(payload, self.mesh)
        if parts is None:
            return None
        ours, full, grads = {}, {}, {}
        for raw in parts:
            data = json.loads(raw)
            ours.update({int(i): v for i, v in data["ours"].items()})
            full.update(data["full"])
            for n, v in data["grads"].items():
                grads[n] = grads.get(n, 0.0) + v
        recorded = combined(self.record) if self.record is not None else {}
        header = (f"{'module':48s} {'output norm':>14s} {'recorded':>14s} "
                  f"{'weight-grad norm':>17s} {'recorded':>14s}")
        lines = [header]
        old_grads = self.record.get("grad_sq_norms", {}) if self.record is not None else {}
        for name, (_, sq) in sorted(full.items(), key=lambda kv: kv[1][0]):
            lines.append(f"{name:48s} {math.sqrt(sq):14.6e} {_norm(recorded.get(name), 14)} "
                         f"{_norm(grads.get(name), 17)} {_norm(old_grads.get(name), 14)}")
        if self.record is not None:
            lines.append(compare(self.record, ours, grads))
        else:
            lines.append("no record of this step found next to the --load checkpoint (write "
                         "one with --record-step, or give --replay-against): nothing compared")
        return "\n".join(lines)


def _norm(sq: float | None, width: int) -> str:
    return f"{'-':>{width}s}" if sq is None else f"{math.sqrt(max(sq, 0.0)):{width}.6e}"


def combined(record: dict) -> dict[str, float]:
    """Each module's squared output norm over the whole step from a record: the parts of the
    ranks summed (tp slices, cp tokens, sequence-parallel slices, dp ranks, micro-batches), a
    whole output that every tp rank holds counted once (tp rank 0's)."""
    out: dict[str, float] = {}
    for e in record["entries"]:
        if e["part"] != "whole" or e["tp"] == 0:
            out[e["module"]] = out.get(e["module"], 0.0) + e["sq"]
    return out


def _relative(a: float, b: float) -> float:
    """How far two squared norms' norms differ, relative (0 for equal non-finite ones)."""
    a, b = math.sqrt(max(a, 0.0)), math.sqrt(max(b, 0.0))
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _differs(a: float, b: float) -> bool:
    return _relative(a, b) > RTOL


def compare(record: dict, ours: dict[int, float], grads: dict[str, float]) -> str:
    """One line: the first recorded value (smallest key) that differs from the replay's, and
    whose rank computed it; or that every value agrees."""
    entries = record["entries"]
    missing = [i for i in range(len(entries)) if i not in ours]
    bad = [i for i in ours if _differs(entries[i]["sq"], ours[i])]
    if bad:
        i = min(bad, key=lambda j: entries[j]["key"])
        e = entries[i]
        was, now = math.sqrt(max(e["sq"], 0.0)), math.sqrt(max(ours[i], 0.0))
        return (f"replay of step {record['step']}: first difference: forward output of "
                f"{e['module']}, micro-batch {e['mb']} (samples {e['samples'][0]}-"
                f"{e['samples'][1] - 1}), computed by rank {e['rank']} (tp={e['tp']} "
                f"cp={e['cp']} pp={e['pp']} dp={e['dp']}): norm {was:.9g} recorded, {now:.9g} "
                f"replayed (tolerance {RTOL:g} relative)")
    wrong = sorted(n for n, v in record.get("grad_sq_norms", {}).items()
                   if n in grads and _differs(v, grads[n]))
    if wrong:
        return (f"replay of step {record['step']}: every forward value agrees; the weight "
                f"gradients of {', '.join(wrong)} differ (beyond {RTOL:g} relative)")
    note = f" ({len(missing)} recorded values not compared)" if missing else ""
    worst = max([_relative(entries[i]["sq"], v) for i, v in ours.items()] +
                [_relative(v, grads[n]) for n, v in record.get("grad_sq_norms", {}).items()
                 if n in grads], default=0.0)
    return (f"replay of step {record['step']}: no difference: all {len(ours)} recorded output "
            f"norms and {len(grads)} weight-gradient norms agree within {RTOL:g} relative "
            f"(largest difference {worst:.1e}){note}")
