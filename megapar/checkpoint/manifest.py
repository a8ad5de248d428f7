"""A checkpoint's manifest: reading it (`read_manifest`), its integrity (its own checksum, its
schema, its layout against its shards) and every file's against it (`verify`).

``manifest.sha256`` (next to ``manifest.json``, written just before it) holds the sha256 of the
manifest's bytes: an edited manifest (a changed layout or ``n_layer``) is refused instead of
silently reading half of every tensor. `check_manifest` names a missing or malformed key and
checks every tensor's recorded shard shape against what the layout implies (a shard file's own
header is compared with it when the file is opened: `format.ShardReader`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megapar.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointFileError,
    file_record,
    shard_file_name,
)
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.wording import counted

DIGEST = "manifest.sha256"


def write_manifest(step_dir: str | Path, manifest: dict) -> None:
    """Write ``manifest.sha256`` then ``manifest.json`` (the file that marks a step complete)."""
    step_dir = Path(step_dir)
    text = json.dumps(manifest, indent=1)
    with open(step_dir / DIGEST, "w") as f:
        f.write(hashlib.sha256(text.encode()).hexdigest() + "\n")
        f.flush()
        os.fsync(f.fileno())
    with open(step_dir / MANIFEST, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_digest(step_dir: Path, raw: bytes) -> None:
    """Raise if ``manifest.json`` is not the file that was saved (no digest: older checkpoint)."""
    path = step_dir / DIGEST
    if not path.exists():
        return
    recorded = path.read_text().strip()
    if hashlib.sha256(raw).hexdigest() != recorded:
        raise CheckpointError(
            f"{step_dir / MANIFEST} was changed after it was saved (its sha256 "
            f"does not match {DIGEST}); restore the original manifest or use "
            f"another checkpoint"
        )


_TOP = {"step": int, "layout": dict, "model": dict, "meta": dict, "tensors": dict, "files": dict}
_ENTRY = {"full_shape": list, "local_shape": list, "dtype": str, "stage": int, "optim": dict}


def check_manifest(manifest: dict, where) -> None:
    """Every key present with the right type; shard shapes consistent with the layout."""
    for key, kind in _TOP.items():
        if not isinstance(manifest.get(key), kind):
            what = "is missing" if key not in manifest else f"is no {kind.__name__}"
            raise CheckpointError(
                f"{where}: the manifest's {key!r} {what}; the manifest is "
                f"damaged, restore it or use another checkpoint"
            )
    layout = manifest["layout"]
    if not all(isinstance(layout.get(k), int) and layout[k] >= 1 for k in ("tp", "pp", "dp")):
        raise CheckpointError(
            f"{where}: the manifest's layout {layout} needs positive integers tp, pp and dp"
        )
    tp, pp = layout["tp"], layout["pp"]
    for name, e in manifest["tensors"].items():
        for key, kind in _ENTRY.items():
            if not isinstance(e.get(key) if isinstance(e, dict) else None, kind):
                raise CheckpointError(
                    f"{where}: tensor {name!r} lacks a valid {key!r} in the manifest"
                )
        full, local, dim = e["full_shape"], e["local_shape"], e.get("tp_dim")
        bad = (
            len(full) != len(local)
            or not 0 <= e["stage"] < pp
            or (dim is not None and not (isinstance(dim, int) and 0 <= dim < len(full)))
        )
        if not bad:
            bad = any(loc != f for d, (loc, f) in enumerate(zip(local, full)) if d != dim) or (
                dim is not None and local[dim] * tp < full[dim]
            )
        if bad:
            raise CheckpointError(
                f"{where}: tensor {name!r} (full shape {full}, shard {local}, tp_dim {dim}, "
                f"stage {e['stage']}) does not fit the manifest's layout tp={tp} pp={pp}; the "
                f"manifest does not describe its shards (edited?)"
            )
    missing = [
        shard_file_name(t, p)
        for t in range(tp)
        for p in range(pp)
        if shard_file_name(t, p) not in manifest["files"]
    ]
    if missing:
        raise CheckpointError(
            f"{where}: the layout tp={tp} pp={pp} needs shard files "
            f"{missing[:4]} that the manifest does not list"
        )


def read_manifest(path: str | Path) -> dict:
    """The manifest of a checkpoint (ROOT or step directory), with its version checked."""
    step_dir = resolve_checkpoint(path)
    raw = (step_dir / MANIFEST).read_bytes()
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{step_dir / MANIFEST}: not valid JSON ({exc}); the file is corrupted"
        ) from exc
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{step_dir / MANIFEST}: format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}, this megapar reads {FORMAT_NAME!r} "
            f"version {FORMAT_VERSION}"
        )
    check_digest(step_dir, raw)
    check_manifest(manifest, step_dir)
    _upgrade_separate_qkv(manifest)
    return manifest


def _upgrade_separate_qkv(manifest: dict) -> None:
    """Present a checkpoint written before attention's q, k, v were fused (separate
    ``attn.q/k/v`` tensors) as one with the fused ``attn.qkv`` tensors of today's models: each
    ``attn.qkv`` entry records its sources under ``fused_from`` and `ShardReader` fuses them
    (`fuse_heads`) when read, so such checkpoints still load, convert and export."""
    tensors, model = manifest["tensors"], manifest.get("model", {})
    if model.get("model_type") not in ("gpt2", "bert"):  # Llama keeps q, k, v separate (GQA)
        return
    heads = model.get("n_head", model.get("num_attention_heads"))
    for name in [n for n in tensors if n.endswith((".attn.q.weight", ".attn.q.bias"))]:
        prefix, kind = name.rsplit(".attn.q.", 1)
        sources = [f"{prefix}.attn.{x}.{kind}" for x in "qkv"]
        if not all(src in tensors for src in sources):
            continue
        first = tensors[sources[0]]
        grow = lambda shape: [3 * shape[0], *shape[1:]]  # noqa: E731
        tensors[f"{prefix}.attn.qkv.{kind}"] = dict(
            first,
            full_shape=grow(first["full_shape"]),
            local_shape=grow(first["local_shape"]),
            fused_from={src: tensors.pop(src) for src in sources},
            heads=heads,
        )


def verify_file(step_dir: Path, name: str, record: dict, checksum: bool = True) -> None:
    """Check one file against its manifest record (existence, size, and sha256 if `checksum`)."""
    path = step_dir / name
    if not path.exists():
        kind = "shard" if name.startswith("model_") else "file"
        raise CheckpointFileError(
            f"missing {kind} {name} in {step_dir} (checkpoint incomplete or "
            f"files deleted); restore it or use another checkpoint"
        )
    size = path.stat().st_size
    if size != record["bytes"]:
        raise CheckpointFileError(
            f"{name}: {counted(size, 'byte')}, the manifest records {record['bytes']:,} "
            f"(file truncated or altered); restore it or use another checkpoint",
            path,
        )
    if checksum and file_record(path)["sha256"] != record["sha256"]:
        raise CheckpointFileError(
            f"{name}: checksum mismatch (file altered or truncated); restore "
            f"it or use another checkpoint",
            path,
        )


def verify(path: str | Path, checksums: bool = True) -> dict:
    """Check every file of a checkpoint (size and sha256); returns the manifest."""
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    for name, record in manifest["files"].items():
        verify_file(step_dir, name, record, checksums)
    return manifest
