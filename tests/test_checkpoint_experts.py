"""What each rank reads of a checkpoint's routed experts on load: only the rows (and, under
expert tensor parallelism, the columns) of the experts it keeps. A mixtral-tiny checkpoint of
random tensors and moments at tp 2 (each stack split along the experts over the two tp files,
and the older form with every stack whole in both) is loaded by every rank of tp 2 x dp 2 x
ep 2 and of tp 2 alone, each at --expert-tensor-parallel-size 1 and 2, counting the bytes each
asks safetensors for: a rank's expert bytes are exactly those of its own shards (weights and
moments), and what it loads equals its part of the whole stack as read before (the whole
stack read, then `own_experts`)."""

import dataclasses
from collections import Counter

import pytest
import torch

import megapar.checkpoint.format as fmt
from megapar.checkpoint.convert import plan, write_checkpoint
from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.format import ShardReader
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.stage_tensors import is_routed_expert, own_experts
from megapar.mesh import Layout, Mesh
from megapar.models.config import config_from_dict
from megapar.models.recipes import resolve_model
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import shard_of

LAYOUTS = {  # name: (layout, --expert-tensor-parallel-size)
    "tp2 dp2 ep2 etp1": (Layout(2, 1, 2, ep=2), 1),
    "tp2 dp2 ep2 etp2": (Layout(2, 1, 2, ep=2), 2),
    "tp2": (Layout(2, 1, 1), 1),
    "tp2 etp2": (Layout(2, 1, 1), 2),
}


class Counted:
    """A safetensors handle that counts the bytes of every tensor asked of it."""

    def __init__(self, handle, name, reads):
        self.handle, self.name, self.reads = handle, name, reads

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        t = self.handle.get_tensor(key)
        self.reads[self.name, key] += t.numel() * t.itemsize
        return t

    def get_slice(self, key):
        outer, piece = self, self.handle.get_slice(key)

        class Slice:
            def get_shape(self):
                return piece.get_shape()

            def get_dtype(self):
                return piece.get_dtype()

            def __getitem__(self, index):
                t = piece[index]
                outer.reads[outer.name, key] += t.numel() * t.itemsize
                return t

        return Slice()


def checkpoint(root, old_form=False):
    """A mixtral-tiny checkpoint at tp 2 of random weights and AdamW moments; with `old_form`
    every routed expert's stack whole in both tp files (tp_dim None)."""
    config = dataclasses.replace(resolve_model("mixtral-tiny"), vocab_size=256)  # its experts
    entries = plan(config, Layout(2, 1, 1))
    gen = torch.Generator().manual_seed(0)
    whole = {}
    for name, e in entries.items():
        if ".experts." in name and old_form:
            e.update(tp_dim=None, local_shape=e["full_shape"])
        e["optim"] = {} if e.get("buffer") else {"exp_avg": "float32", "exp_avg_sq": "float32"}
        for key in (None, *e["optim"]):
            whole[name, key] = torch.randn(e["full_shape"], generator=gen)

    def fill(name, key, t, local):
        return shard_of(whole[name, key], entries[name]["tp_dim"], local, t)

    return write_checkpoint(root, 1, Layout(2, 1, 1), config, {}, entries, fill, progress=False)


def loaded_by_every_rank(step_dir, layout, etp, monkeypatch, verify="size"):
    """{rank: ({(file, key): bytes read}, {key: bytes each of its expert shards}, {key:
    (loaded, wanted)})} of loading `step_dir` at `layout`; wanted: the rank's part of the
    whole tensor read whole (`ShardReader.shard` at tp 1), as the loader took it before."""
    config = config_from_dict(read_manifest(step_dir)["model"])
    full = ShardReader(step_dir, read_manifest(step_dir))
    out, opened = {}, fmt.open_safetensors
    for rank in range(layout.world_size):
        reads: Counter = Counter()
        monkeypatch.setattr(fmt, "open_safetensors",
                            lambda path, what="", r=reads: Counted(opened(path), path.name, r))
        mesh = Mesh.virtual(layout, rank=rank, device="cpu", expert_tp=etp)
        model = build_stage(config, mesh, seed=0, init=False)
        state = load_checkpoint(step_dir, model, mesh, verify=verify)
        monkeypatch.undo()
        own, pairs = {}, {}
        for name, p in model.named_parameters():
            if not is_routed_expert(p):  # read as before
                continue
            e = full.entry(name)
            for key in (None, *e["optim"]):
                got = p.detach() if key is None else state.optim_tensors[name][key]
                whole = full.shard(name, key, 1, 0, None if e["tp_dim"] is None
                                   else e["full_shape"][e["tp_dim"]])
                saved = f"model/{name}" if key is None else f"optim/{name}/{key}"
                own[saved] = p.numel() * p.element_size()
                pairs[name, key] = (got, own_experts(whole, p, mesh.tp_rank))
        out[rank] = (reads, own, pairs)
    return out


@pytest.mark.parametrize("old_form", [False, True], ids=["split", "old-form"])
def test_each_rank_reads_only_its_own_experts(tmp_path, monkeypatch, old_form):
    step_dir = checkpoint(tmp_path / "ck", old_form)
    for name, (layout, etp) in LAYOUTS.items():
        for rank, (reads, own, pairs) in loaded_by_every_rank(step_dir, layout, etp,
                                                               monkeypatch).items():
            for (tensor, key), (got, want) in pairs.items():
                assert torch.equal(got, want), (name, rank, tensor, key)
            per_key = Counter()
            for (_, key), n in reads.items():
                if ".experts." in key:
                    per_key[key] += n
            assert dict(per_key) == own, (name, rank)  # its own experts' bytes, no more
