"""Saving and loading sharded checkpoints from a running job (every rank calls, collectively).

Save: dp rank 0 (and cp rank 0) of every (tp, pp) coordinate writes its shard file into a
staging directory;
every rank sends its RNG state and its write outcome to rank 0 as a safetensors byte buffer
(tensor collectives only, nothing pickled); rank 0 writes ``rng.safetensors`` and the manifest,
publishes the directory and tells every rank the outcome, so all ranks return (or raise) together.

Load: each rank reads what its own parameters need. In the checkpoint's own layout that is its
own file; in any other layout (tp, pp, padding) the shards are reassembled through the canonical
index space (`ShardReader`), weights and optimizer moments alike; of the routed experts' stacks
only the rows (and columns) of the experts the rank keeps. dp and cp never matter.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save

from megapar.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    RNG_FILE,
    CheckpointError,
    ShardReader,
    dtype_name,
    open_safetensors,
    safetensors_size,
    shard_file_name,
    staging_dir,
    step_dir_name,
    write_tensors,
)
from megapar.checkpoint.lock import SaveLockError, check_unlocked
from megapar.checkpoint.manifest import read_manifest, verify_file, write_manifest
from megapar.checkpoint.publish import (
    clean_stale,
    mark_owner,
    publish_step,
    resolve_checkpoint,
)
from megapar.checkpoint.stage_tensors import (
    ep_shard,
    expert_blocks,
    is_routed_expert,
    own_experts,
    saved_expert,
    saved_tp_dim,
    split_expert,
    stage_tensors,
    whole_expert_shape,
)
from megapar.disk import DISK_ERRORS
from megapar.made_dirs import missing_dirs, remove_empty
from megapar.mesh import Layout, Mesh, broadcast_text, gather_payloads
from megapar.models.config import config_from_dict
from megapar.tensor_parallel.partition import tp_dim, tp_parts

# Config fields that do not change any parameter (dropouts, init std, vocab padding multiple):
# a checkpoint loads into a model that differs only in these.
NON_STRUCTURAL = {
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "initializer_range",
    "make_vocab_size_divisible_by",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "router_aux_loss_coef",  # a mixture of experts' balancing settings: the loss, not the model
    "output_router_logits",
    "moe_z_loss_coef",
    "moe_capacity_factor",
    "moe_bias_update_rate",
    # a Qwen / Mistral sliding window: megapar's attention has none (it limits --seq-len only,
    # checked against the run's config), and transformers drops a window use_sliding_window
    # leaves off, so an export read back differs in them
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
}


def differing_fields(ours: dict, theirs: dict, ignore: Iterable[str] = NON_STRUCTURAL) -> list[str]:
    """The fields (sorted) in which two model configs (`to_dict` form; a field one lacks counts
    as None) differ, but those in `ignore` (by default the ones no parameter depends on). A
    Llama-layout head_dim of None is hidden_size / num_attention_heads (what transformers writes
    in its place)."""
    skip = set(ignore)

    def value(config: dict, k: str):
        if k == "head_dim" and config.get(k) is None and config.get("num_attention_heads"):
            return config.get("hidden_size", 0) // config["num_attention_heads"]
        return config.get(k)

    return sorted(
        k for k in set(ours) | set(theirs) if k not in skip and value(ours, k) != value(theirs, k)
    )


@dataclass
class LoadedState:
    """What `load_checkpoint` returns besides filling the model's parameters."""

    optim_tensors: dict[str, dict[str, torch.Tensor]]
    """Optimizer moments as local shards for this rank (`optimizer.load_state_tensors` format);
    empty when the checkpoint has none (e.g. imported from Hugging Face)."""
    meta: dict
    """The trainer's free dict, as saved."""
    rng: dict[str, torch.Tensor] | None
    """This rank's RNG states; None unless the checkpoint's layout equals the mesh's."""
    resharded: bool
    """True when shards were reassembled for a different tp / pp / padding."""
    step: int = 0
    layout: Layout | None = None
    """The checkpoint's layout."""
    path: Path | None = None
    notes: list[str] = field(default_factory=list)
    """Human-readable remarks (RNG not restored, non-structural config differences)."""
    files: dict = field(default_factory=dict)
    """The manifest's record of each file (bytes, sha256): what identifies the checkpoint read."""


def _pack(header: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    return save(
        {"__json__": raw, **{f"t/{k}": v.detach().cpu().contiguous() for k, v in tensors.items()}}
    )


def _unpack(payload: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    data = load(payload)
    header = json.loads(data.pop("__json__").numpy().tobytes())
    return header, {k[2:]: v for k, v in data.items()}


def planned_shard(model, mesh: Mesh, optim_tensors) -> tuple[str, int]:
    """(file name, bytes) of the shard file `save_checkpoint` would write for this (tp, pp)
    coordinate, without writing it (the tensors may be fake: only shapes and dtypes are read);
    every routed expert's tensors as this tp rank's block of their experts (`saved_expert`),
    as `expert_blocks` makes them."""
    fname, tensors, entries = shard_contents(model, mesh, optim_tensors, blocks={})
    return fname, safetensors_size(
        {k: (v.dtype, tuple(entries[k.split("/")[1]]["local_shape"])) for k, v in tensors.items()}
    )


def shard_contents(model, mesh: Mesh, optim_tensors, blocks=None) -> tuple[str, dict, dict]:
    """(file name, {key: tensor}, manifest entries) of this (tp, pp) coordinate's shard file;
    the stage's buffers are kept as replicated tensors without optimizer state
    (`stage_tensors`). Every routed expert's stack is written as this tp rank's block of its
    experts (`saved_expert`): `blocks` holds them (`expert_blocks`), or None when the stage's
    own tensors are that block (tp 1, without ep or expert tensor parallelism); `blocks` {}
    (the dry run, `planned_shard`) leaves the stage's tensors in place but records the blocks'
    entries, whose shapes then differ from the tensors'."""
    tensors, entries = {}, {}
    for name, param, buffer in stage_tensors(model):
        if hasattr(param, "tied_to"):
            continue
        moments = (optim_tensors or {}).get(name, {})
        full, dim = list(getattr(param, "full_shape", param.shape)), getattr(param, "tp_dim", None)
        local = list(param.shape)
        if is_routed_expert(param):
            full = whole_expert_shape(param)
            dim, local = saved_expert(full, mesh.tp)
            if blocks:
                param, moments = blocks[name]
            elif blocks is None and list(param.shape) != local:
                raise CheckpointError(
                    f"{name}: a routed expert's stack {tuple(param.shape)} is not the shard "
                    f"file's block {tuple(local)}; pass its blocks (`expert_blocks`)"
                )
        tensors[f"model/{name}"] = param.detach()
        for key, value in moments.items():
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"optimizer state {name}/{key} has shape "
                    f"{tuple(value.shape)}, its parameter's shard is "
                    f"{tuple(param.shape)}; pass local shards"
                )
            tensors[f"optim/{name}/{key}"] = value.detach()
        entries[name] = {
            "full_shape": full,
            "tp_dim": dim,
            "local_shape": local,
            "dtype": dtype_name(param.dtype),
            "stage": mesh.pp_rank,
            "optim": {k: dtype_name(v.dtype) for k, v in moments.items()},
            **({"buffer": True} if buffer else {}),
        }
    return shard_file_name(mesh.tp_rank, mesh.pp_rank), tensors, entries


@dataclass
class SavedState:
    """One rank's part of a checkpoint, taken at one step: what `write_checkpoint` writes."""

    step: int
    model_config: dict
    meta: dict
    """The trainer's free dict (rank 0's is written), a JSON copy taken when captured."""
    rng: dict[str, torch.Tensor]
    """This rank's RNG state tensors."""
    shard: tuple[str, dict[str, torch.Tensor], dict] | None = None
    """(file name, {key: tensor}, manifest entries) of this rank's shard file on the ranks that
    write one (dp rank 0 and cp rank 0 of every (tp, pp) coordinate); None elsewhere."""
    ready: torch.cuda.Event | None = None
    """Something with `synchronize()` (a CUDA event) to wait on before the tensors are read,
    when they are still being copied to the host."""


def capture(
    step: int, model, mesh: Mesh, optim_tensors, meta: dict, rng: dict[str, torch.Tensor]
) -> SavedState:
    """This rank's part of a checkpoint of `step`, referring to the live tensors (see
    `save_checkpoint` for the arguments). Raises CheckpointError when `meta` is not JSON."""
    try:
        meta = json.loads(json.dumps(meta))
    except TypeError as exc:
        raise CheckpointError(
            f"meta must be JSON-serialisable (tensors go elsewhere): {exc}"
        ) from exc
    shard = None
    writes = mesh.dp_rank == 0 and mesh.cp_rank == 0  # cp holds no shards: replicas
    experts = expert_blocks(model, mesh, optim_tensors, writes)  # collective over ep and tp
    if writes:
        shard = shard_contents(model, mesh, optim_tensors, experts or None)
    return SavedState(
        int(step),
        model.config.to_dict(),
        meta,
        {k: v.detach().cpu().clone() for k, v in (rng or {}).items()},
        shard,
    )


def save_checkpoint(
    root, step: int, model, mesh: Mesh, optim_tensors, meta: dict, rng: dict[str, torch.Tensor]
) -> Path:
    """Save a checkpoint of every rank's stage to ``root/step_{step:08d}`` (collective).

    `optim_tensors`: {canonical name: {key: local shard}} as `optimizer.state_tensors()` gives
    (only dp rank 0's is written); `meta`: JSON-able dict (rank 0's is written); `rng`: this
    rank's RNG state tensors. Returns the step directory once it and ``root/latest`` are
    published on every rank; raises CheckpointError on every rank if any rank failed.
    """
    state: SavedState | CheckpointError
    try:
        state = capture(step, model, mesh, optim_tensors, meta, rng)
    except CheckpointError as exc:
        state = exc  # raised below on every rank together
    return write_checkpoint(root, step, state, mesh)


def write_checkpoint(
    root, step: int, state: SavedState | CheckpointError, mesh: Mesh, group=None
) -> Path:
    """Write every rank's `SavedState` of `step` as ``root/step_N`` and publish it (collective
    over the world, or over `group`: a gloo group spanning the world, used from a background
    thread).

    Rank 0 checks the ``--save`` lock and makes the staging directory; each writing rank writes
    its shard file there; every rank sends its RNG state and its write outcome to rank 0
    (tensor collectives only, nothing pickled), which checks that every shard file is there
    with its recorded size, writes ``rng.safetensors`` and the manifest, publishes the
    directory and tells every rank the outcome, so all ranks return (or raise) together.
    `state` may be a CheckpointError of this rank (raised on every rank)."""
    root = Path(root)
    tmp_name, error = "", ""
    made = missing_dirs(root) if mesh.rank == 0 else []  # removed again if nothing is published
    if mesh.rank == 0:
        try:
            check_unlocked(root, (os.getpid(), os.getppid()))  # another run writes root
            clean_stale(root)
            staging = staging_dir(root, f".tmp-step_{step}-")
            mark_owner(staging)
            tmp_name = staging.name
        except SaveLockError as exc:
            error = f"checkpoint of step {step} not saved: {exc}"
        except OSError as exc:
            error = f"cannot create a staging directory in {root}: {exc}"
    tmp_name = broadcast_text(tmp_name, mesh, group=group)
    if not tmp_name:
        remove_empty(made)
        raise CheckpointError(broadcast_text(error, mesh, group=group))
    tmp = root / tmp_name
    header: dict[str, Any] = {"rank": mesh.rank, "error": None}
    rng = {}
    cause: Exception | None = None  # this rank's own failure, chained to the error it raises
    try:
        if isinstance(state, CheckpointError):
            raise state
        rng = state.rng
        if state.ready is not None:  # the copy to the host still runs on the device
            state.ready.synchronize()
        if state.shard is not None:
            fname, tensors, entries = state.shard
            header.update(file=fname, record=write_tensors(tmp / fname, tensors), tensors=entries)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 and raised on every rank
        header["error"] = failed_write(mesh.rank, exc, root)
        cause = exc
    payloads = gather_payloads(_pack(header, rng), mesh, group)
    outcome = ""
    if mesh.rank == 0:
        try:
            outcome = str(_finish(tmp, root, state, mesh, payloads))
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            remove_empty(made)
            why = (  # the ranks' own errors name themselves; rank 0's RNG, manifest or publish
                str(exc) if isinstance(exc, CheckpointError) else failed_write(0, exc, root)
            )
            outcome = f"ERROR checkpoint of step {step} not saved: {why}"
    outcome = broadcast_text(outcome, mesh, group=group)
    if outcome.startswith("ERROR "):
        failed = CheckpointError(outcome[6:])
        failed.no_traceback = DISK_FIX in outcome  # type: ignore[attr-defined]  # a full disk
        raise failed from cause  # its traceback in this rank's log (none for a disk's)
    return Path(outcome)


DISK_FIX = "free space there, or give --save another directory"
"""What a save that a disk refused says to do."""


def failed_write(rank: int, exc: Exception, root: Path) -> str:
    """Rank `rank`'s failure to write its part of a checkpoint under `root`, as the save's
    error names it: a full or read-only disk with its fix (it was "OSError: [Errno 28] No space
    left on device" and a pointer to a traceback; a new user's finding), else the exception."""
    if isinstance(exc, OSError) and exc.errno in DISK_ERRORS:
        return f"rank {rank}: {exc.strerror} writing it in {root}; {DISK_FIX}"
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def _finish(
    tmp: Path, root: Path, state: SavedState | CheckpointError, mesh: Mesh, payloads
) -> Path:
    """Rank 0: check every rank's files, write the RNG file and the manifest, publish."""
    errors, files, tensors, rng = [], {}, {}, {}
    for payload in payloads:
        header, states = _unpack(payload)
        if header["error"]:
            errors.append(header["error"])
        if header.get("file"):
            files[header["file"]] = header["record"]
            tensors.update(header["tensors"])
        rng.update({f"rank{header['rank']}/{k}": v for k, v in states.items()})
    if errors:
        raise CheckpointError("; ".join(errors))
    assert isinstance(state, SavedState)  # else this rank's header has the error
    for fname, record in files.items():  # every rank's file is there, complete
        verify_file(tmp, fname, record, checksum=False)
    if rng:
        files[RNG_FILE] = write_tensors(tmp / RNG_FILE, dict(sorted(rng.items())))
    layout = mesh.layout
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": state.step,
        "layout": layout.to_dict(),
        "model": state.model_config,
        "meta": state.meta,
        "tensors": tensors,
        "files": dict(sorted(files.items())),
    }
    write_manifest(tmp, manifest)
    return publish_step(tmp, root, step_dir_name(state.step))


def check_model(manifest: dict, config, where) -> list[str]:
    """Raise if the checkpoint holds another model; returns notes on harmless differences."""

    ours, theirs = config.to_dict(), dict(manifest["model"])
    if theirs.get("model_type") != ours.get("model_type"):  # not a field list: another kind
        raise CheckpointError(
            f"{where} holds a {theirs.get('model_type')} model, not a "
            f"{ours.get('model_type')}; build the model from the "
            f'checkpoint\'s config (manifest.json "model")'
        )
    theirs = {**config_from_dict(theirs).to_dict(), **theirs}  # fields added since it was
    # saved take their defaults
    diff = differing_fields(ours, theirs, ignore=())
    structural = [k for k in diff if k not in NON_STRUCTURAL]
    if structural:
        shown = ", ".join(
            f"{k}={theirs.get(k)!r} (checkpoint) vs {ours.get(k)!r} (model)" for k in structural
        )
        raise CheckpointError(
            f"{where} holds a different model: {shown}; build the model from "
            f'the checkpoint\'s config (manifest.json "model")'
        )
    return [f"config differs in non-structural fields: {diff}"] if diff else []


def _wanted(reader: ShardReader, model, step_dir, notes: list[str]) -> tuple[list, bool]:
    """([(name, canonical source, tensor, local tp size)] of every tensor `model` reads from
    the checkpoint, whether any is split otherwise than there); a buffer the checkpoint lacks
    (one saved before buffers were kept) keeps its value, noted in `notes`."""
    wanted, resharded, missing = [], False, []
    for name, param, buffer in stage_tensors(model):
        source = getattr(param, "tied_to", name)
        if buffer and source not in reader.tensors:
            missing.append(name)
            continue
        entry = reader.entry(source)
        dim = entry["tp_dim"]
        want = list(getattr(param, "full_shape", param.shape))
        if ep_shard(param)[1] > 1:  # the whole [E, ...] of an expert's block under ep
            want[0] *= ep_shard(param)[1]
        if want != entry["full_shape"]:
            raise CheckpointError(
                f"{step_dir}: {source} has shape {entry['full_shape']}, the model expects {want}"
            )
        pdim = saved_tp_dim(param)  # a routed expert's own rows are read (`_read`)
        if not is_routed_expert(param):  # its split follows the tp size, compared below
            resharded |= dim is not None and entry["local_shape"] != list(param.shape)
            resharded |= dim != pdim  # split in one layout, whole in another (Llama's kv heads)
        wanted.append((name, source, param, None if pdim is None else param.shape[pdim]))
    if missing:
        notes.append(f"not in the checkpoint, kept at their initial values: {', '.join(missing)}")
    return wanted, resharded


def _own_rows(reader: ShardReader, source: str, param) -> tuple[int, int] | None:
    """[start, stop) of the whole [E, ...] stack's experts that `param` (a routed expert's
    stack, this ep rank's block of it) holds, when the checkpoint keeps the stack so that
    they can be read alone (split along the experts over the tp files, or whole in each);
    None for any other tensor (read through `ShardReader.pieces`)."""
    entry = reader.entry(source)
    if not is_routed_expert(param) or entry["tp_dim"] not in (0, None) or "fused_from" in entry:
        return None
    ep_rank, _ = ep_shard(param)
    n = param.shape[0]  # the experts this ep rank holds
    return ep_rank * n, (ep_rank + 1) * n


def _files(reader: ShardReader, source: str, param, mesh: Mesh, local) -> list[str]:
    """The files `_read` reads `param`'s tensors from."""
    rows = _own_rows(reader, source, param)
    if rows is None:
        return [f for f, *_ in reader.pieces(source, mesh.tp, mesh.tp_rank, local)]
    return [f for f, *_ in reader.row_pieces(source, *rows, mesh.tp_rank)]


def _read(reader: ShardReader, source: str, key, param, mesh: Mesh, local) -> torch.Tensor:
    """This rank's shard of `param`'s weights (`key` None) or moment `key` from the checkpoint:
    of a routed expert's stack only its ep block's rows, and under expert tensor parallelism
    only its tp slice of them, read alone (`ShardReader.rows`: no other rank's experts are
    read); of any other tensor the overlapping slices of the source shards."""
    rows = _own_rows(reader, source, param)
    if rows is None:
        whole = reader.shard(source, key, mesh.tp, mesh.tp_rank, local, saved_tp_dim(param))
        return own_experts(whole, param, mesh.tp_rank)
    dim = tp_dim(param) if split_expert(param) else None
    width = None if dim is None else param.shape[dim]
    return reader.rows(source, key, *rows, mesh.tp_rank, dim, width, tp_parts(param))


VERIFY_MODES = ("sha256", "size", "none")
"""How `load_checkpoint` checks the files it reads (its `verify`; `Engine.load` refuses any
other word, which would check sizes only without a word)."""


@torch.no_grad()
def load_checkpoint(path, model, mesh: Mesh, verify: str = "sha256") -> LoadedState:
    """Fill `model` (this rank's stage) from a checkpoint saved in any layout.

    `path`: a checkpoint ROOT (follows ``latest``) or step directory. `verify`: "sha256" (default:
    every file this rank reads from is hashed whole against the manifest), "size" (their sizes
    only, and every tensor's shape from the file's header: where every file was hashed before,
    as megapar-train's launcher does before its workers start) or "none".
    Not collective: each rank reads only the slices it needs; of a routed expert's stack only
    its own experts' rows (its ep block), and under expert tensor parallelism only its tp slice
    of them (`ShardReader.rows`), never another rank's experts.
    """
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    notes = check_model(manifest, model.config, step_dir)
    src = Layout(**manifest["layout"])
    reader = ShardReader(step_dir, manifest)
    wanted, resharded = _wanted(reader, model, step_dir, notes)
    resharded |= (src.tp, src.pp) != (mesh.tp, mesh.pp)
    same_layout = src == mesh.layout and not resharded
    rng_record = manifest["files"].get(RNG_FILE)
    needed = {
        f for _, source, param, local in wanted for f in _files(reader, source, param, mesh, local)
    }
    if same_layout and rng_record:
        needed.add(RNG_FILE)
    if verify != "none":
        for fname in sorted(needed):
            if fname not in manifest["files"]:
                raise CheckpointError(f"{step_dir}: {fname} is not in the manifest")
            verify_file(step_dir, fname, manifest["files"][fname], verify == "sha256")
    optim = {}
    for _name, source, param, local in wanted:
        param.copy_(_read(reader, source, None, param, mesh, local))
        # A tied copy (the last stage's head.weight) gets the moments of the tensor it is tied
        # to, keyed by that canonical name, which the optimizer accepts for the copy.
        keys = reader.entry(source)["optim"]
        moments = {k: _read(reader, source, k, param, mesh, local) for k in keys}
        if moments:
            optim[source] = moments
    rng = None
    if not rng_record:  # none to restore, in any layout: say why there are none
        notes.append(missing_rng_note(manifest["meta"]))
    elif same_layout:
        rng = _read_rng(step_dir / RNG_FILE, mesh.rank)
    else:
        notes.append(other_layout_rng_note(src, mesh.layout))
    reader.release()
    return LoadedState(
        optim,
        manifest["meta"],
        rng,
        resharded,
        manifest["step"],
        src,
        step_dir,
        notes,
        files=manifest["files"],
    )


RNG_NOT_RESTORED = "RNG states not restored"
"""How every note on a load that restores no RNG states begins."""


def other_layout_rng_note(saved: Layout, layout: Layout) -> str:
    """The note on a load into another layout than the checkpoint's (`saved`), or resharded:
    its RNG states are not restored."""
    return (
        f"{RNG_NOT_RESTORED}: they are the ranks' of the checkpoint's layout {saved}, not of "
        f"{layout}; dropout masks differ from an uninterrupted run"
    )


def missing_rng_note(meta: dict) -> str:
    """One sentence on why a checkpoint has no RNG states to restore, in any layout (built from
    meta's keys, not from its free-text rng_note)."""
    if meta.get("converted_from"):
        return (
            f"{RNG_NOT_RESTORED}: megapar-convert dropped them (they belong to the "
            "ranks of the old layout); dropout masks differ from an uninterrupted run"
        )
    if meta.get("imported_from_hf"):
        return (
            f"{RNG_NOT_RESTORED}: the checkpoint was imported from Hugging Face, which "
            "saves none; dropout is seeded from --seed"
        )
    return (
        f"{RNG_NOT_RESTORED}: the checkpoint has none; dropout masks differ from an "
        "uninterrupted run"
    )


def _read_rng(path: Path, rank: int) -> dict[str, torch.Tensor]:
    prefix = f"rank{rank}/"
    with open_safetensors(path, "RNG file") as f:
        return {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
