"""Builders shared by the checkpoint tests, and unit tests of the format primitives.

Synthetic optimizer moments are drawn as *full* canonical tensors from a generator seeded by
(name, key), then sharded with the partition rule, so every layout holds the same canonical
moments (zero in padding rows, like a real optimizer) and comparisons can be bitwise.
"""

import zlib

import pytest
import torch
from safetensors import safe_open

from megapar.checkpoint.distributed import save_checkpoint
from megapar.checkpoint.format import (
    CheckpointError,
    ShardReader,
    ShardWriter,
    write_tensors,
)
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.mesh import Layout, Mesh
from megapar.models import BertConfig, GPT2Config, LlamaConfig
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import shard_of

GPT2_TINY = dict(vocab_size=101, n_positions=32, n_embd=32, n_layer=4, n_head=4)
BERT_TINY = dict(vocab_size=103, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=32)
# 2 kv heads: split at tp 2, whole (replicated) at tp 4, so conversion crosses partitions
LLAMA_TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
KEYS = ("exp_avg", "exp_avg_sq")


def tiny_config(kind: str, **overrides):
    if kind == "gpt2":
        return GPT2Config(**{**GPT2_TINY, **overrides})
    if kind == "llama":
        return LlamaConfig(**{**LLAMA_TINY, **overrides})
    return BertConfig(**{**BERT_TINY, **overrides})


def moment(name: str, key: str, full_shape) -> torch.Tensor:
    """The canonical synthetic moment `key` of parameter `name` (layout-independent)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{key}".encode()))
    values = torch.randn(tuple(full_shape), generator=gen)
    return values.abs() if key == "exp_avg_sq" else values


def optim_for(model, mesh) -> dict:
    """`optimizer.state_tensors()`-shaped synthetic moments for this rank's stage."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "tied_to"):
            continue
        local = None if p.tp_dim is None else p.shape[p.tp_dim]
        out[name] = {k: shard_of(moment(name, k, p.full_shape), p.tp_dim, local, mesh.tp_rank)
                     for k in KEYS}
    return out


def save_serial(root, kind="gpt2", seed=7, step=3, meta=None, **overrides):
    """A 1x1 checkpoint (no process group) of a seeded tiny model (`overrides`: of its config)
    with synthetic moments."""
    mesh = Mesh(Layout(1, 1, 1))
    model = build_stage(tiny_config(kind, **overrides), mesh, seed)
    rng = {"cpu": torch.get_rng_state()}
    return save_checkpoint(root, step, model, mesh, optim_for(model, mesh),
                           meta or {"consumed_samples": 96}, rng)


def canonical_state(path):
    """({name: full weight}, {name: {key: full moment}}) of any checkpoint, read at tp=1."""
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    reader = ShardReader(step_dir, manifest)
    weights, moments = {}, {}
    for name, e in manifest["tensors"].items():
        full = None if e["tp_dim"] is None else e["full_shape"][e["tp_dim"]]
        weights[name] = reader.shard(name, None, 1, 0, full)
        moments[name] = {k: reader.shard(name, k, 1, 0, full) for k in e["optim"]}
    return weights, moments


def file_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k], f"{what}/{k}")
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


# --- unit tests of the primitives ------------------------------------------------------------
def test_shard_writer_output_reads_back_with_safetensors_in_any_write_order(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4).to(torch.bfloat16), "empty": torch.zeros(0, 3)}
    writer = ShardWriter(tmp_path / "x.safetensors",
                         {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
    for key in ["c", "empty", "a", "b"]:
        writer.write(key, tensors[key])
    writer.close()
    assert_same(file_tensors(tmp_path / "x.safetensors"), tensors, "read back")


def test_shard_writer_refuses_wrong_shape_and_unwritten_keys(tmp_path):
    writer = ShardWriter(tmp_path / "x.safetensors", {"a": (torch.float32, (2, 2)),
                                                      "b": (torch.float32, (1,))})
    with pytest.raises(CheckpointError, match=r"a is float32 \(3,\), expected float32 \(2, 2\)"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="never written"):
        writer.close()


def test_reader_reassembles_padded_shards_for_any_tp(tmp_path):
    """A vocab-style tensor (101 rows, shards padded to 128) stored at tp=2 read at tp 1/3/4."""
    full = torch.randn(101, 3)
    step = tmp_path / "step"
    step.mkdir()
    for t in range(2):
        write_tensors(step / f"model_tp{t:02d}_pp00.safetensors",
                      {"model/w": shard_of(full, 0, 128, t)})
    manifest = {"layout": {"tp": 2, "pp": 1, "dp": 1}, "tensors": {"w": {
        "full_shape": [101, 3], "tp_dim": 0, "local_shape": [128, 3], "dtype": "float32",
        "stage": 0, "optim": {}}}}
    reader = ShardReader(step, manifest)
    for tp, local in [(1, 101), (1, 128), (3, 34), (4, 26)]:
        for r in range(tp):
            assert torch.equal(reader.shard("w", None, tp, r, local), shard_of(full, 0, local, r))


def test_probe_writable_leaves_nothing_and_removes_only_its_own_probe(tmp_path, monkeypatch):
    """Every rank of a torchrun job probes --save / --data-cache at once: a probe that made the
    missing directory and removed it again pulled it from under another rank's probe or
    write (ENOENT). The probe of a missing directory must never create or remove a directory
    another process could be using."""
    import os

    from megapar.checkpoint.format import probe_writable

    removed, made = [], []
    real_rmdir, real_makedirs = os.rmdir, os.makedirs
    monkeypatch.setattr(os, "rmdir", lambda p, *a, **k: (removed.append(str(p)),
                                                         real_rmdir(p, *a, **k))[1])
    monkeypatch.setattr(os, "makedirs", lambda p, *a, **k: (made.append(str(p)),
                                                            real_makedirs(p, *a, **k))[1])
    probe_writable(tmp_path / "a" / "b" / "c")
    probe_writable(tmp_path)
    assert made == []
    assert len(removed) == 1 and os.path.basename(removed[0]).startswith(".megapar-probe-")
    assert os.path.dirname(removed[0]) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file" / "sub", "/proc/megapar-test/x"):
        with pytest.raises(OSError):
            probe_writable(bad)
