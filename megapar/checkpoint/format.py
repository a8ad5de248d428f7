"""The sharded checkpoint format: files, manifest, atomic publishing, verifying, resharded reads.

A checkpoint is a directory ``ROOT/step_{N:08d}/`` holding

- ``model_tp{t:02d}_pp{p:02d}.safetensors`` for every (tp, pp) shard: keys ``model/{name}`` (the
  local shard of parameter ``name``, zero padding included) and ``optim/{name}/{key}`` (optimizer
  moments, partitioned exactly like their parameter). Tied copies are never stored. A routed
  expert's stack [E, ...] is split along the experts over the tp files whatever the run's split
  (``tp_dim`` 0: `stage_tensors.saved_expert`); an entry with ``tp_dim`` None (an older
  megapar's) has it whole in every tp file, and is read so.
- ``rng.safetensors``: every rank's RNG state tensors, keys ``rank{r}/{what}`` (optional).
- ``manifest.json``: format version, layout, model config, step, the trainer's free ``meta``,
  one entry per canonical tensor ``{full_shape, tp_dim, local_shape, dtype, stage, optim}``
  (``optim`` maps moment key -> dtype) and one per file ``{bytes, sha256}``.

Everything is written into ``ROOT/.tmp-step_{N}-<random>/``, fsynced and renamed; ``ROOT/latest``
(the step directory's name) is replaced last, so a reader never sees half a checkpoint.
Pure file handling: no process groups here (see distributed.py and convert.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megapar.tensor_parallel.partition import fuse_heads, shard_of, shard_range

FORMAT_NAME = "megapar-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
RNG_FILE = "rng.safetensors"

SHARD_METADATA = {
    "format": "megapar",
    "megapar": "a file of a megapar checkpoint (tp / pp shards, padded): not a whole model; "
    "read it with megapar, or export one with megapar-convert CKPT --to-hf DIR",
    "DCP_SHARDING_INFO": "{}",
}
"""The safetensors metadata of every file megapar's checkpoints write. Readers of whole
models refuse such a file instead of taking one shard for the whole tensor: transformers
loads only ``format`` "pt" (and friends), and torch.distributed.checkpoint's
HuggingFaceStorageReader finds no sharding entry for the tensors it asks for (KeyError).
megapar reads files with or without it (checkpoints written before it carry {"format": "pt"})."""

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or of another model."""


class CheckpointFileError(CheckpointError):
    """A file of a checkpoint's step missing, or not the size or checksum its manifest
    records (`manifest.verify_file`): another step of the same checkpoint may do instead.
    `path`: the file (None where not known)."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


def step_dir_name(step: int) -> str:
    return f"step_{int(step):08d}"


def shard_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in manifest")
    return dtype


# --- writing -------------------------------------------------------------------------------
def safetensors_layout(specs: dict[str, tuple[torch.dtype, tuple]]) -> tuple[bytes, dict, int]:
    """How a safetensors file of these tensors ({key: (dtype, shape)}) is laid out: (its header,
    {key: (offset, bytes, dtype, shape)} of each tensor's data, the data's total bytes). The
    file is 8 + len(header) + data bytes long: what `ShardWriter` writes, and what the dry run
    (`megapar.dryrun`) reports a checkpoint's files will take without writing them."""
    header: dict[str, Any] = {}
    offset, slots = 0, {}
    for key, (dtype, shape) in specs.items():
        size = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        slots[key] = (offset, size, dtype, tuple(shape))
        offset += size
    header["__metadata__"] = SHARD_METADATA
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8), slots, offset


def safetensors_size(specs: dict[str, tuple[torch.dtype, tuple]]) -> int:
    """Bytes of the safetensors file `ShardWriter` writes for these tensors."""
    header, _, data = safetensors_layout(specs)
    return 8 + len(header) + data


class ShardWriter:
    """A safetensors file written one tensor at a time: the header (every key's dtype and shape)
    is laid out up front, then each `write` puts one tensor's bytes at its offset, so only the
    tensor being written is ever in memory. `close` checks every key was written and fsyncs."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.dtype, tuple]]):
        self.path = Path(path)
        raw, self._slots, offset = safetensors_layout(specs)
        self._base = 8 + len(raw)
        self._file = open(self.path, "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._file.truncate(self._base + offset)
        self._pending = set(specs)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        offset, size, dtype, shape = self._slots[key]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{self.path.name}: {key} is {dtype_name(tensor.dtype)} "
                f"{tuple(tensor.shape)}, expected {dtype_name(dtype)} {shape}"
            )
        self._file.seek(self._base + offset)
        if size:
            self._file.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        self._pending.discard(key)

    def abort(self) -> None:
        """Close without checks (the caller deletes the half-written file)."""
        self._file.close()

    def close(self) -> None:
        if self._pending:
            self._file.close()
            raise CheckpointError(
                f"{self.path.name}: tensors never written: {sorted(self._pending)[:5]}"
            )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write a whole dict as one safetensors file; returns its file record."""
    writer = ShardWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
    for key, tensor in tensors.items():
        writer.write(key, tensor)
    writer.close()
    return file_record(path)


def file_record(path: str | Path) -> dict:
    """{bytes, sha256} of a file, hashed in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_writable(directory: str | Path) -> None:
    """OSError unless `directory` can be written now (a read-only mount, an immutable
    directory, a path under /proc or under a file). Callers turn the error into their own
    message.

    Writes and removes a probe file in `directory` when it exists; otherwise creates and
    removes a probe directory in its nearest existing ancestor, where the writer's
    `makedirs` would start. Nothing is left behind, and nothing is created that another
    process could depend on: every rank of a torchrun job probes the same paths at once, and
    one rank removing a directory it had made for the probe broke the others' probe or their
    writes into it."""

    directory = os.path.abspath(directory)
    existing = directory
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"{existing} is a file, not a directory")
    if existing == directory:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".megapar-probe-"):
            pass
    else:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".megapar-probe-"))


def open_safetensors(path: str | Path, what: str = "checkpoint file"):
    """`safetensors.safe_open` of `path`, or a CheckpointError naming the file when it is not
    a safetensors file (its manifest may still vouch for it: a forged or replaced file)."""

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...: one line
        raise CheckpointError(
            f"{path}: not a readable safetensors {what} ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:120]}); restore it or use another "
            f"checkpoint"
        ) from None


def staging_dir(parent: str | Path, prefix: str) -> Path:
    """A fresh hidden directory ``parent/{prefix}<random>`` to build a checkpoint in."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"{prefix}{secrets.token_hex(6)}"
    path.mkdir()
    return path


# --- reading -------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
"""safetensors' dtype names, as the manifest records a tensor's dtype (torch's name)."""


def check_file_shapes(handle, fname: str, manifest: dict, step_dir) -> None:
    """The tensors in shard file `fname` (an open safetensors handle) have the shapes the
    manifest records, and its weights the dtype it records; checked from the file's header,
    before any data is read (a manifest edited to another dtype converted the weights to it)."""
    tensors = manifest["tensors"]
    for key in handle.keys():
        parts = key.split("/")
        if parts[0] not in ("model", "optim") or len(parts) < 2:
            continue
        name = "/".join(parts[1:]) if parts[0] == "model" else "/".join(parts[1:-1])
        if name not in tensors:
            continue
        shape = list(handle.get_slice(key).get_shape())
        if shape != tensors[name]["local_shape"]:
            raise CheckpointError(
                f"{step_dir}/{fname}: {key} has shape {shape}, the manifest "
                f"records {tensors[name]['local_shape']}; the manifest does "
                f"not match its shards"
            )
        stored = handle.get_slice(key).get_dtype()
        recorded = tensors[name].get("dtype")
        if (
            parts[0] == "model"
            and recorded
            and SAFETENSORS_DTYPES.get(stored, recorded) != recorded
        ):
            raise CheckpointError(
                f"{step_dir}/{fname}: {key} is {SAFETENSORS_DTYPES[stored]}, the manifest "
                f"records {recorded}; the manifest does not match its shards"
            )


class ShardReader:
    """Reads target shards of any tp layout from a checkpoint, through the canonical index space.

    `shard(name, key, tp, tp_rank, local)` returns tp rank `tp_rank`'s shard (padded to `local`
    along tp_dim) of canonical tensor `name` (its weights if `key` is None, else optimizer
    moment `key`), reading only the overlapping slices of the source shards
    (``safe_open(...).get_slice``): at most one target shard plus its pieces is in memory.
    """

    def __init__(self, step_dir: str | Path, manifest: dict):
        self.step_dir, self.manifest = Path(step_dir), manifest
        self.tensors = manifest["tensors"]
        self.src_tp = manifest["layout"]["tp"]
        self._open: dict[str, object] = {}

    def _file(self, name: str):
        if name not in self._open:
            path = self.step_dir / name
            if not path.exists():
                raise CheckpointError(f"missing shard {name} in {self.step_dir}")
            self._open[name] = open_safetensors(path, "shard")
            check_file_shapes(self._open[name], name, self.manifest, self.step_dir)
        return self._open[name]

    def release(self) -> None:
        """Close (unmap) the source files opened so far."""
        self._open.clear()

    def entry(self, name: str) -> dict:
        if name not in self.tensors:
            raise CheckpointError(f"{self.step_dir}: no tensor {name!r} in the checkpoint")
        return self.tensors[name]

    def pieces(self, name: str, tp: int, tp_rank: int, local: int | None, entry=None):
        """[(file, source local range, target local offset)] that make up the target shard."""
        entry = entry or self.entry(name)
        if "fused_from" in entry:  # an old checkpoint's separate q, k, v: read whole
            return [
                piece
                for src, e in entry["fused_from"].items()
                for piece in self.pieces(src, 1, 0, e["full_shape"][0], e)
            ]
        dim, stage = entry["tp_dim"], entry["stage"]
        if dim is None:  # replicated: the same tp rank's file if the source has one
            return [(shard_file_name(tp_rank if tp_rank < self.src_tp else 0, stage), None, 0)]
        full, src_local = entry["full_shape"][dim], entry["local_shape"][dim]
        if local is None:  # split in the source, whole in the target (Llama's k / v at tp 4)
            local, tp_rank = full, 0
        start, stop = shard_range(full, local, tp_rank)
        out = []
        for t in range(self.src_tp):
            s0, s1 = shard_range(full, src_local, t)
            lo, hi = max(start, s0), min(stop, s1)
            if lo < hi:
                out.append(
                    (
                        shard_file_name(t, stage),
                        (lo - t * src_local, hi - t * src_local),
                        lo - start,
                    )
                )
        return out

    def row_pieces(self, name: str, start: int, stop: int, tp_rank: int = 0, entry=None):
        """[(file, source rows [a, b), target row offset)] of rows [start, stop) of dim 0 of
        canonical tensor `name`, split along dim 0 over the tp files (a routed expert's stack,
        ``tp_dim`` 0) or whole in each (``tp_dim`` None: an older checkpoint's expert, read
        from tp rank `tp_rank`'s own file where the source has one, as `pieces` does)."""
        entry = entry or self.entry(name)
        dim, stage = entry["tp_dim"], entry["stage"]
        if dim is None:
            own = tp_rank if tp_rank < self.src_tp else 0
            return [(shard_file_name(own, stage), (start, stop), 0)] if start < stop else []
        if dim != 0 or "fused_from" in entry:
            raise CheckpointError(f"{self.step_dir}: {name} is not split along dim 0")
        full, src_local = entry["full_shape"][0], entry["local_shape"][0]
        out = []
        for t in range(self.src_tp):
            s0, s1 = shard_range(full, src_local, t)
            lo, hi = max(start, s0), min(stop, s1)
            if lo < hi:
                out.append((shard_file_name(t, stage), (lo - s0, hi - s0), lo - start))
        return out

    def rows(
        self,
        name: str,
        key: str | None,
        start: int,
        stop: int,
        tp_rank: int = 0,
        dim: int | None = None,
        local: int | None = None,
        parts: int = 1,
    ) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of canonical tensor `name` (weights, or optimizer
        moment `key`) laid out as `row_pieces` says (a routed expert's stack: an ep rank's
        experts); with `dim`, of those rows only tp rank `tp_rank`'s shard along `dim`, `local`
        wide (zero padded) and of `parts` parts (`shard_of`'s rule: an expert split over tp).
        Reads only those elements (``get_slice`` of each file's rows and columns)."""
        entry = self.entry(name)
        tkey = f"model/{name}" if key is None else f"optim/{name}/{key}"
        if key is not None and key not in entry["optim"]:
            raise CheckpointError(f"{self.step_dir}: no optimizer state {key!r} for {name}")
        dtype = dtype_from_name(entry["dtype"] if key is None else entry["optim"][key])
        shape = [stop - start, *entry["full_shape"][1:]]
        cols: list[tuple[int, int, int]] = []  # (source [lo, hi) along dim, target offset)
        if dim is not None:
            assert local is not None  # a split dim has a local size
            part, width = shape[dim] // parts, local // parts
            for p in range(parts):
                lo, hi = shard_range(part, width, tp_rank)
                if lo < hi:
                    cols.append((p * part + lo, p * part + hi, p * width))
            shape[dim] = local
        out = torch.zeros(shape, dtype=dtype)
        for fname, (a, b), at in self.row_pieces(name, start, stop, tp_rank, entry):
            rows = out.narrow(0, at, b - a)
            handle = self._file(fname).get_slice(tkey)
            if dim is None:
                rows.copy_(handle[a:b])
                continue
            for lo, hi, to in cols:
                index = (slice(a, b),) + (slice(None),) * (dim - 1) + (slice(lo, hi),)
                rows.narrow(dim, to, hi - lo).copy_(handle[index])
        return out

    def shard(
        self,
        name: str,
        key: str | None,
        tp: int,
        tp_rank: int,
        local: int | None,
        target_dim: int | None = None,
        entry=None,
    ) -> torch.Tensor:
        """`local` None: the target holds the tensor whole. `target_dim`: the target's tp_dim
        when the source keeps the tensor whole but the target splits it (a partition that
        depends on the layout, like Llama's kv heads: split when tp divides them)."""
        entry = entry or self.entry(name)
        if "fused_from" in entry:
            full = fuse_heads(
                [
                    self.shard(src, key, 1, 0, e["full_shape"][0], entry=e)
                    for src, e in entry["fused_from"].items()
                ],
                entry["heads"],
            )
            return full if local is None else shard_of(full, 0, local, tp_rank)
        dim = entry["tp_dim"]
        tkey = f"model/{name}" if key is None else f"optim/{name}/{key}"
        if key is not None and key not in entry["optim"]:
            raise CheckpointError(f"{self.step_dir}: no optimizer state {key!r} for {name}")
        dtype = dtype_from_name(entry["dtype"] if key is None else entry["optim"][key])
        if dim is None:
            whole = self._file(self.pieces(name, tp, tp_rank, local, entry)[0][0]).get_tensor(tkey)
            if local is None or target_dim is None:
                return whole
            return shard_of(whole, target_dim, local, tp_rank)
        shape = list(entry["full_shape"])
        shape[dim] = entry["full_shape"][dim] if local is None else local
        out = torch.zeros(shape, dtype=dtype)
        for fname, (a, b), at in self.pieces(name, tp, tp_rank, local, entry):
            index = (slice(None),) * dim + (slice(a, b),)
            out.narrow(dim, at, b - a).copy_(self._file(fname).get_slice(tkey)[index])
        return out
