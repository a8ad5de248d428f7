"""Record a step's per-module values (`--record-step`), replay the step in another layout
(`--replay`) and name the first module, and the rank, whose values differ.

A record holds, for every named module (transformers' names) of every rank, per micro-batch:
the squared norm (float64) of the output that rank computed, with what it covers (the global
samples, and which part of the full output: all of it, its tp slice of the features
(column-parallel layers), its tp slice of the sequence (sequence parallelism), its cp tokens),
the rank and its coordinates, and the order key of the event (`module_trace`). Plus each
module's weight-gradient norm after the step, combined over tp. Written by rank 0 as
`records/step_XXXXXXXX.json` (entries) and `.safetensors` (the squared norms) under --save,
with the model's config, the run's --loss-mean and a sha256 of both (`check_record` verifies
them, and the step, before any worker starts; a record written before the checksum is read
with a note).

The replay runs the step in any layout (one process is enough), records its own ranks' parts
the same way, and computes for each recorded entry the squared norm of the same part of the
same samples: each replay rank adds what its part has in common with the recorded one
(`StepReplay`). megapar's numbers are the same in every layout up to the order of
floating-point sums, so the norms agree to `RTOL`; the entry of smallest key that does not
names the first module, micro-batch and rank (of the recorded run) whose values differ.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megapar.checkpoint.distributed import differing_fields
from megapar.context_parallel.split import chunk_ids as cp_chunks
from megapar.diagnostics.module_trace import ModuleTrace
from megapar.expert_parallel import is_expert
from megapar.mesh import gather_payloads
from megapar.tensor_parallel.layers import ColumnParallelLinear

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
    return "sequence" if mesh.sequence_parallel and mesh.tp > 1 else "whole"


def _samples(mesh, mb: int, micro_batch_size: int, global_batch: int) -> int:
    """The global index of the first sample of this dp rank's micro-batch `mb`."""
    return mesh.dp_rank * (global_batch // mesh.dp) + mb * micro_batch_size


class StepRecorder:
    """Observes one step through a `ModuleTrace` and writes the record (`--record-step`)."""

    def __init__(
        self, engine, global_batch: int, trace: ModuleTrace | None = None, grads: bool = True
    ):
        self.engine, self.mesh = engine, engine.mesh
        self.trace = trace or ModuleTrace(
            engine.model, engine.config, engine.mesh, weight_grads=False
        )
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
        self.entries.append(
            {
                "module": name,
                "mb": mb,
                "key": key,
                "samples": [first, first + mbs],
                "part": part,
                "rank": mesh.rank,
                "tp": mesh.tp_rank,
                "cp": mesh.cp_rank,
                "pp": mesh.pp_rank,
                "dp": mesh.dp_rank,
                "tp_size": mesh.tp,
                "cp_size": mesh.cp,
            }
        )
        self.sq.append(out.detach().double().square().sum())

    def grad_norms(self) -> dict[str, float]:
        """Each module's weight-gradient squared norm over this rank's parameters, as this rank
        adds it to the combined one (tp slices summed; replicated ones from tp rank 0 only;
        dp and cp replicas from their rank 0 only; routed experts, which the ep ranks of a
        block split, from every ep rank of the first block: `edp_rank` 0)."""
        mesh = self.mesh
        out: dict[str, float] = {}
        if not self.grads or getattr(self.engine.step_fn, "sharded", False):
            return out
        dense = mesh.dp_rank == 0 and mesh.cp_rank == 0  # this rank counts the dense replicas
        for _, module, name in self.trace.modules:
            params = list(module.parameters(recurse=False))
            counted = [p for p in params if (mesh.edp_rank == 0 if is_expert(p) else dense)]
            if not counted:
                continue
            total = 0.0
            for p in counted:
                if p.grad is None or (getattr(p, "tp_dim", None) is None and mesh.tp_rank):
                    continue
                total += float(p.grad.detach().double().square().sum())
            out[name] = out.get(name, 0.0) + total
        return out

    def payload(self) -> bytes:
        sq = torch.stack(self.sq).tolist() if self.sq else []
        return json.dumps({"entries": self.entries, "sq": sq, "grads": self.grad_norms()}).encode()

    def write(self, root: str, step: int) -> Path | None:
        """Gather every rank's entries on rank 0 and write the record (collective)."""
        parts = gather_payloads(self.payload(), self.mesh)
        if parts is None:
            return None
        entries, sq, grads = _merge(parts)
        json_path, st_path = record_paths(root, step)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"sq_norms": torch.tensor(sq, dtype=torch.float64)}, str(st_path))
        record = {
            "step": step,
            "model": self.engine.config.to_dict(),
            "layout": self.mesh.layout.to_dict(),
            "rtol": RTOL,
            "entries": entries,
            "grad_sq_norms": grads,
            "loss_mean": self.engine.cfg.loss_mean,
            **loss_terms(self.engine.cfg),
            "values": st_path.name,
        }
        record["sha256"] = _digest(record, st_path.read_bytes())
        json_path.write_text(json.dumps(record, indent=1))
        return json_path


LOSS_TERMS = ("label_smoothing", "z_loss")
"""The training loss's settings a record holds where they are not 0 (`loss_terms`)."""


def loss_terms(cfg) -> dict[str, float]:
    """`cfg`'s --label-smoothing and --z-loss, those that are not 0 (a record of a run without
    them reads as before they existed)."""
    return {k: getattr(cfg, k) for k in LOSS_TERMS if getattr(cfg, k, 0.0)}


def _digest(record: dict, values: bytes) -> str:
    """The sha256 of a record: its values file's bytes, then its JSON's content (step, model,
    layout, entries, weight-gradient norms, and the loss mean where it records one) written
    canonically."""
    keys: tuple[str, ...] = ("step", "model", "layout", "entries", "grad_sq_norms")
    if "loss_mean" in record:  # records from before it was recorded keep their digest
        keys += ("loss_mean",)
    keys += tuple(k for k in LOSS_TERMS if k in record)  # recorded where not 0
    digest = hashlib.sha256(values)
    digest.update(json.dumps({k: record.get(k) for k in keys}, sort_keys=True).encode())
    return digest.hexdigest()


def check_record(
    path: str | Path,
    step: int,
    model: dict,
    flag: str,
    loss_mean: str = "microbatch",
    terms: dict[str, float] | None = None,
) -> list[str]:
    """Raise ValueError (one line naming `path` and the fix) unless `path` is a readable
    record of step `step` of the model whose config (`to_dict`) is `model`, whose sha256
    matches, made under the --loss-mean `loss_mean` (where the record says: the gradients
    of the two means differ by design) and the loss terms `terms` (`loss_terms`; a record
    without one was made without it); `flag` is how the user gave it. Returns notes (a
    record from before checksums)."""
    path = Path(path).expanduser()
    fix = (
        f"give the records/step_{step:08d}.json that --record-step {step} wrote (or record "
        f"the step again)"
    )
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory, not a record; {fix}")
    if path.suffix == ".safetensors":
        raise ValueError(
            f"{flag} {path} is a record's values file; give its "
            f"{path.with_suffix('.json').name} instead"
        )
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(
            f"{flag} {path} is not a readable record ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'empty'}); {fix}"
        ) from None
    if not isinstance(record, dict) or not {"step", "entries", "values"} <= set(record):
        raise ValueError(
            f"{flag} {path} is JSON but not a record (no step / entries / values); {fix}"
        )
    if record["step"] != step:
        raise ValueError(
            f"{flag} {path} records step {record['step']}, not step {step} that "
            f"--replay {step} runs; {fix}"
        )
    values = path.parent / str(record["values"])
    try:
        raw = values.read_bytes()
        sq = load_file(str(values))["sq_norms"]
    except (OSError, SafetensorError, KeyError, ValueError) as exc:
        raise ValueError(
            f"{flag} {path}: its values file {values} is unreadable "
            f"({type(exc).__name__}: {exc}); {fix}"
        ) from None
    if sq.numel() != len(record["entries"]):
        raise ValueError(
            f"{flag} {path}: its values file {values} holds {sq.numel()} values "
            f"for {len(record['entries'])} entries (damaged); {fix}"
        )
    notes = []
    if "sha256" not in record:
        notes.append(
            f"the record {path} was written before records carried a checksum: not verified"
        )
    elif _digest(record, raw) != record["sha256"]:
        raise ValueError(
            f"{flag} {path}: its checksum does not match (the record or {values} "
            f"changed after it was written); {fix}"
        )
    recorded = record.get("model")
    if recorded is not None and recorded != model:
        keys = differing_fields(recorded, model, ignore=())
        what = ", ".join(
            f"{k} {recorded.get(k)!r} recorded, {model.get(k)!r} here" for k in keys[:3]
        )
        raise ValueError(
            f"{flag} {path} is the record of another model ({what}); replay from "
            f"a checkpoint of the run that recorded it, or record this model's step "
            f"{step} with --record-step {step}"
        )
    recorded_mean = record.get("loss_mean", loss_mean)
    if recorded_mean != loss_mean:
        raise ValueError(
            f"{flag} {path} recorded step {step} under --loss-mean {recorded_mean}, and this "
            f"replay runs --loss-mean {loss_mean}: the two means give other gradients by "
            f"design; replay with --loss-mean {recorded_mean}"
        )
    for name in LOSS_TERMS:
        made, here = record.get(name, 0.0), (terms or {}).get(name, 0.0)
        if made != here:
            shown = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} {path} recorded step {step} under {shown} {made:g}, and this replay "
                f"runs {shown} {here:g}: another loss gives other gradients by design; "
                f"replay with {shown} {made:g}"
            )
    return notes


def _merge(parts: list[bytes]) -> tuple[list[dict], list[float], dict[str, float]]:
    entries: list[dict] = []
    sq: list[float] = []
    grads: dict[str, float] = {}
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


def _positions(part: str, seq: int, cp: int, cp_rank: int, tp: int, tp_rank: int) -> list[int]:
    """Global sequence positions (of `seq`) of a part's tokens, in the order the rank holds
    them: its cp tokens, and under sequence parallelism its tp slice of those."""
    if cp > 1:
        c = seq // (2 * cp)
        first, second = cp_chunks(cp, cp_rank)
        held = [*range(first * c, (first + 1) * c), *range(second * c, (second + 1) * c)]
    else:
        held = list(range(seq))
    if part == "sequence":
        n = len(held) // tp
        held = held[tp_rank * n : (tp_rank + 1) * n]
    return held


def _features(part: str, width: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """[first, end) of the whole output's features (of `width`) that a part covers."""
    if part != "features":
        return 0, width
    n = width // tp
    return tp_rank * n, (tp_rank + 1) * n


class StepReplay:
    """Observes the replayed step, in any layout, and compares it with a record.

    The replay records its own step as `--record-step` does (a `StepRecorder`: each rank's
    part of each output), and for every recorded value computes its share of that value's part
    of the whole output: the samples, sequence positions and features its own part has in
    common with the recorded one (a whole output that every tp rank of the replay holds counted
    once, tp rank 0's, as `combined` counts it). Summed over the replay's ranks, the shares are
    the recorded part's squared norm in the replay, whatever the two layouts are."""

    def __init__(self, engine, global_batch: int, record: dict | None):
        self.engine, self.mesh = engine, engine.mesh
        self.recorder = StepRecorder(engine, global_batch)  # own parts; weight gradients
        self.trace = self.recorder.trace
        self.trace.observers.append(self._observe)
        self.global_batch = global_batch
        self.record = record
        self.by_module: dict[str, list[int]] = {}
        for i, e in enumerate(record["entries"] if record else ()):
            self.by_module.setdefault(e["module"], []).append(i)
        self.ours: dict[int, torch.Tensor] = {}  # entry index -> our share of its squared norm
        self._index: dict[tuple, torch.Tensor | None] = {}

    def _common(self, mine: tuple, e: dict, seq: int, device) -> torch.Tensor | None:
        """Indices into this rank's tokens of those the recorded entry's part also has."""
        key = (mine, e["part"], seq, e["cp_size"], e["cp"], e["tp_size"], e["tp"])
        if key not in self._index:
            theirs = set(_positions(e["part"], seq, e["cp_size"], e["cp"], e["tp_size"], e["tp"]))
            idx = [i for i, pos in enumerate(_positions(*mine)) if pos in theirs]
            self._index[key] = torch.tensor(idx, dtype=torch.long, device=device) if idx else None
        return self._index[key]

    def _observe(self, key: int, name: str, mb: int, module, out: torch.Tensor) -> None:
        part = self.recorder.parts.get(id(module))
        mesh = self.mesh
        if part is None or out.dim() < 3 or (part == "whole" and mesh.tp_rank):
            return
        first = _samples(mesh, mb, out.shape[0], self.global_batch)
        shards = mesh.tp if part == "sequence" else 1
        seq = out.shape[1] * shards * mesh.cp
        mine = (part, seq, mesh.cp, mesh.cp_rank, mesh.tp, mesh.tp_rank)
        width = out.shape[-1] * (mesh.tp if part == "features" else 1)
        lo_f, hi_f = _features(part, width, mesh.tp, mesh.tp_rank)
        for i in self.by_module.get(name, ()):
            assert self.record is not None  # by_module indexes its entries
            e = self.record["entries"][i]
            lo, hi = max(e["samples"][0], first), min(e["samples"][1], first + out.shape[0])
            f0, f1 = _features(e["part"], width, e["tp_size"], e["tp"])
            f0, f1 = max(f0, lo_f), min(f1, hi_f)
            if lo >= hi or f0 >= f1:
                continue
            idx = self._common(mine, e, seq, out.device)
            if idx is None:
                continue
            piece = out.detach()[lo - first : hi - first].index_select(1, idx)
            sq = piece.narrow(-1, f0 - lo_f, f1 - f0).double().square().sum()
            self.ours[i] = self.ours[i] + sq if i in self.ours else sq

    def report(self) -> str | None:
        """Rank 0: the per-module norms and the comparison, as text (collective)."""
        payload = json.dumps(
            {
                "ours": {str(i): float(v) for i, v in self.ours.items()},
                "own": self.recorder.payload().decode(),
            }
        ).encode()
        parts = gather_payloads(payload, self.mesh)
        if parts is None:
            return None
        ours: dict[int, float] = {}
        for raw in parts:
            data = json.loads(raw)
            for i, v in data["ours"].items():
                ours[int(i)] = ours.get(int(i), 0.0) + v
        entries, sq, grads = _merge([json.loads(raw)["own"].encode() for raw in parts])
        for entry, value in zip(entries, sq):
            entry["sq"] = value
        full = combined({"entries": entries})
        first_key: dict[str, int] = {}
        for entry in entries:
            first_key[entry["module"]] = min(
                first_key.get(entry["module"], entry["key"]), entry["key"]
            )
        recorded = combined(self.record) if self.record is not None else {}
        header = (
            f"{'module':48s} {'output norm':>14s} {'recorded':>14s} "
            f"{'weight-grad norm':>17s} {'recorded':>14s}"
        )
        lines = [header]
        old_grads = self.record.get("grad_sq_norms", {}) if self.record is not None else {}
        # the modules with outputs in forward order, then those with weight gradients only (a
        # MoE layer's stacked experts, whose output is no [batch, sequence, features] tensor)
        names = sorted(full, key=lambda n: first_key[n])
        names += [n for n in dict.fromkeys([*grads, *old_grads]) if n not in full]
        for name in names:
            lines.append(
                f"{name:48s} {_norm(full.get(name), 14)} {_norm(recorded.get(name), 14)} "
                f"{_norm(grads.get(name), 17)} {_norm(old_grads.get(name), 14)}"
            )
        if self.record is not None:
            lines.append(
                compare(self.record, ours, grads, getattr(self.engine.step_fn, "sharded", False))
            )
        else:
            lines.append(
                "no record of this step found next to the --load checkpoint (write "
                "one with --record-step, or give --replay-against): nothing compared"
            )
        return "\n".join(lines)


def _norm(sq: float | None, width: int) -> str:
    return f"{'-':>{width}s}" if sq is None else f"{math.sqrt(max(sq, 0.0)):{width}.6e}"


def combined(record: dict) -> dict[str, float]:
    """Each module's squared output norm over the whole step from a record: the parts of the
    ranks summed (tp slices, cp tokens, sequence-parallel slices, dp ranks, micro-batches), a
    whole output that every tp rank holds counted once: tp rank 0's, or, where another tp
    rank's copy differs from it (beyond `RTOL`: a fault on that rank), the copy differing
    most, so that the column shows the fault where `compare` names it."""
    out: dict[str, float] = {}
    copies: dict[tuple, dict[int, float]] = {}
    for e in record["entries"]:
        if e["part"] != "whole":
            out[e["module"]] = out.get(e["module"], 0.0) + e["sq"]
        else:
            where = (e["module"], e["mb"], e["pp"], e["dp"], e["cp"], tuple(e["samples"]))
            copies.setdefault(where, {})[e["tp"]] = e["sq"]
    for (module, *_), by_tp in copies.items():
        base = by_tp[min(by_tp)]
        worst = max(by_tp.values(), key=lambda sq: _relative(base, sq))
        out[module] = out.get(module, 0.0) + (worst if _differs(base, worst) else base)
    return out


def _relative(a: float, b: float) -> float:
    """How far two squared norms' norms differ, relative (0 for equal non-finite ones)."""
    a, b = math.sqrt(max(a, 0.0)), math.sqrt(max(b, 0.0))
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _differs(a: float, b: float) -> bool:
    return _relative(a, b) > RTOL


def compare(
    record: dict, ours: dict[int, float], grads: dict[str, float], sharded: bool = False
) -> str:
    """One line: the first recorded value (smallest key) that differs from the replay's, and
    whose rank computed it; or that every value agrees. `sharded`: the replay's gradients were
    sharded over dp (ZeRO at dp > 1), so it has no weight-gradient norms of its own."""
    entries = record["entries"]
    missing = [i for i in range(len(entries)) if i not in ours]
    if not ours:
        return (
            f"replay of step {record['step']}: nothing compared: none of the record's "
            f"{len(entries)} output values is of a module this replay ran (a record of "
            f"another model?); replay with the model and checkpoint the record was made from"
        )
    bad = [i for i in ours if _differs(entries[i]["sq"], ours[i])]
    if bad:
        i = min(bad, key=lambda j: entries[j]["key"])
        e = entries[i]
        was, now = math.sqrt(max(e["sq"], 0.0)), math.sqrt(max(ours[i], 0.0))
        return (
            f"replay of step {record['step']}: first difference: forward output of "
            f"{e['module']}, micro-batch {e['mb']} (samples {e['samples'][0]}-"
            f"{e['samples'][1] - 1}), computed by rank {e['rank']} (tp={e['tp']} "
            f"cp={e['cp']} pp={e['pp']} dp={e['dp']}): norm {was:.9g} recorded, {now:.9g} "
            f"replayed (tolerance {RTOL:g} relative)"
        )
    wrong = sorted(
        n
        for n, v in record.get("grad_sq_norms", {}).items()
        if n in grads and _differs(v, grads[n])
    )
    if wrong:
        return (
            f"replay of step {record['step']}: every forward value agrees; the weight "
            f"gradients of {', '.join(wrong)} differ (beyond {RTOL:g} relative)"
        )
    note = f" ({len(missing)} recorded values not compared)" if missing else ""
    worst = max(
        [_relative(entries[i]["sq"], v) for i, v in ours.items()]
        + [
            _relative(v, grads[n]) for n, v in record.get("grad_sq_norms", {}).items() if n in grads
        ],
        default=0.0,
    )
    compared = sum(n in grads for n in record.get("grad_sq_norms", {}))
    weights = f" and {compared} weight-gradient norms" if compared else ""
    recorded = len(record.get("grad_sq_norms", {}))
    if not compared and recorded and sharded:
        note += (
            f"; the record's {recorded} weight-gradient norms are not compared: the "
            f"replay's gradients are sharded over dp (ZeRO); replay at dp 1 to compare them"
        )
    elif not compared:  # the recording run sharded its gradients over dp (ZeRO)
        note += "; no weight-gradient norms were recorded to compare"
    return (
        f"replay of step {record['step']}: no difference: all {len(ours)} recorded output "
        f"norms{weights} agree within {RTOL:g} relative "
        f"(largest difference {worst:.1e}){note}"
    )
