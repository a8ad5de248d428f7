"""Distributed save (4 gloo ranks at 2x2) and load in the same or another layout."""

import pytest
import torch
from canonical import gather_canonical
from test_checkpoint_helpers import KEYS, file_tensors, moment, optim_for, tiny_config
from tp_utils import make_mesh

from megapar.checkpoint.distributed import load_checkpoint, save_checkpoint
from megapar.checkpoint.format import LATEST, RNG_FILE, CheckpointError, ShardReader
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import EVEN, PipelineSplit, build_stage
from megapar.tensor_parallel.partition import gather_full

STEP = 11


def _save(root, tp, pp, dp, split=EVEN):
    mesh = make_mesh(tp, pp, dp)
    model = build_stage(tiny_config("gpt2"), mesh, seed=7, split=split)
    rng = {"cpu": torch.get_rng_state(), "marker": torch.tensor([mesh.rank, 1000 + mesh.rank])}
    meta = {"consumed_samples": 352, "args": {"lr": 3e-4}}
    return str(save_checkpoint(root, STEP, model, mesh, optim_for(model, mesh), meta, rng))


def _load(path, tp, pp, dp, split=EVEN):
    """Load into a differently seeded model (its blocks cut into stages as `split` says);
    gather weights and moments to canonical tensors."""
    mesh = make_mesh(tp, pp, dp)
    model = build_stage(tiny_config("gpt2"), mesh, seed=99, split=split)
    opened, real_file = set(), ShardReader._file
    ShardReader._file = lambda self, name: opened.add(name) or real_file(self, name)
    state = load_checkpoint(path, model, mesh)
    params = dict(model.named_parameters())
    # moments are keyed by canonical name: the last stage's tied head.weight gets
    # embed.word.weight's
    by_source = {getattr(p, "tied_to", n): p for n, p in params.items()}
    moments = {n: {k: gather_full(v, by_source[n].tp_dim, by_source[n].full_shape, mesh.tp_group)
                   for k, v in m.items()} for n, m in state.optim_tensors.items()}
    tied = {n: gather_full(p.detach(), 0, p.full_shape, mesh.tp_group)
            for n, p in params.items() if hasattr(p, "tied_to")}
    marker = None if state.rng is None else state.rng["marker"].tolist()
    if (tp, pp) == (2, 2):   # in its own layout a rank reads its own file, and the last
        name = "model_tp{:02d}_pp{:02d}.safetensors".format   # stage may read the tied
        tied_source = {name(mesh.tp_rank, 0)} if mesh.is_last_stage else set()   # embedding
        assert name(mesh.tp_rank, mesh.pp_rank) in opened
        assert opened <= {name(mesh.tp_rank, mesh.pp_rank)} | tied_source
    return gather_canonical(model), moments, tied, state.resharded, marker, state.notes, state.meta


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist") / "ckpt"
    paths = run_local(_save, 4, str(root), 2, 2, 1)
    return root, paths


def _reference():
    model = build_stage(tiny_config("gpt2"), Mesh(Layout()), seed=7)
    weights = gather_canonical(model)
    return weights, {n: {k: moment(n, k, w.shape) for k in KEYS} for n, w in weights.items()}


def test_save_at_2x2_writes_one_file_per_shard_and_publishes_atomically(saved):
    root, paths = saved
    step_dir = root / f"step_{STEP:08d}"
    assert paths == [str(step_dir)] * 4
    assert (root / LATEST).read_text().strip() == step_dir.name
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []   # no staging left
    manifest = read_manifest(root)
    assert manifest["layout"] == {"tp": 2, "pp": 2, "dp": 1} and manifest["step"] == STEP
    assert manifest["meta"] == {"consumed_samples": 352, "args": {"lr": 3e-4}}
    assert sorted(manifest["files"]) == sorted(
        [RNG_FILE] + [f"model_tp{t:02d}_pp{p:02d}.safetensors" for t in (0, 1) for p in (0, 1)])
    rng = file_tensors(step_dir / RNG_FILE)
    assert [rng[f"rank{r}/marker"].tolist() for r in range(4)] == [[r, 1000 + r] for r in range(4)]
    assert "head.weight" not in manifest["tensors"]            # the tied copy is not stored
    assert manifest["tensors"]["embed.word.weight"]["optim"] == {k: "float32" for k in KEYS}


@pytest.mark.parametrize("tp, pp", [(4, 1), (1, 1), (2, 2)])
def test_load_gives_the_canonical_tensors_in_any_layout(saved, tp, pp):
    root, _ = saved
    world = tp * pp
    results = run_local(_load, world, str(root), tp, pp, 1) if world > 1 else [_load(root, 1, 1, 1)]
    ref_weights, ref_moments = _reference()
    weights, moments = {}, {}
    for w, m, tied, resharded, marker, notes, meta in results:
        weights.update(w)
        moments.update(m)
        for name, value in tied.items():   # the last stage's copy is the canonical embedding
            assert torch.equal(value, ref_weights["embed.word.weight"]), name
        assert resharded == ((tp, pp) != (2, 2))
        assert meta["consumed_samples"] == 352
        if (tp, pp) == (2, 2):
            assert marker is not None and notes == []
        else:
            assert marker is None and "RNG states not restored" in notes[0]
    assert [r[4] for r in results if r[4]] == ([[r, 1000 + r] for r in range(4)]
                                               if (tp, pp) == (2, 2) else [])
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        assert torch.equal(weights[name], value), name
        for key in KEYS:
            assert torch.equal(moments[name][key], ref_moments[name][key]), (name, key)


def test_dp_replicas_write_once(tmp_path):
    paths = run_local(_save, 4, str(tmp_path / "ckpt"), 2, 1, 2)
    manifest = read_manifest(paths[0])
    assert sorted(manifest["files"]) == [
        "model_tp00_pp00.safetensors", "model_tp01_pp00.safetensors", RNG_FILE]
    assert len([k for k in file_tensors(resolve_checkpoint(paths[0]) / RNG_FILE)
                if k.endswith("/marker")]) == 4


def _save_and_load_splits(root):
    """Save at pp 2 with the first stage holding 1 of the 4 blocks, then load it at pp 2 with
    the first stage holding 3, and with the even cut (2 each)."""
    path = _save(root, 1, 2, 1, PipelineSplit(first=1))
    return path, [_load(path, 1, 2, 1, split)[:2] for split in (PipelineSplit(first=3), EVEN)]


def test_a_checkpoint_of_an_uneven_split_loads_with_any_split_and_pp(tmp_path):
    """Tensors are saved under their global block index (each in the file of the stage that held
    it), so a checkpoint saved with one split loads with another, the even one and at pp 1: the
    canonical weights and moments each time."""
    outs = run_local(_save_and_load_splits, 2, str(tmp_path / "ckpt"))
    stages = {name: e["stage"] for name, e in read_manifest(outs[0][0])["tensors"].items()}
    assert {stages[n] for n in stages if n.startswith("layers.0.")} == {0}
    assert {stages[n] for n in stages if n.startswith(("layers.1.", "layers.3."))} == {1}
    ref_weights, ref_moments = _reference()
    loads = [[out[1][i] for out in outs] for i in range(2)] + [[_load(outs[0][0], 1, 1, 1)[:2]]]
    for per_rank in loads:
        weights, moments = {}, {}
        for w, m in per_rank:
            weights.update(w)
            moments.update(m)
        assert weights.keys() == ref_weights.keys()
        for name, value in ref_weights.items():
            assert torch.equal(weights[name], value), name
            for key in KEYS:
                assert torch.equal(moments[name][key], ref_moments[name][key]), (name, key)


def _save_with_bad_rank(root):
    mesh = make_mesh(2)
    model = build_stage(tiny_config("gpt2"), mesh, seed=7)
    optim = optim_for(model, mesh)
    if mesh.rank == 1:
        optim["layers.0.mlp.fc.weight"]["exp_avg"] = torch.zeros(3)
    try:
        save_checkpoint(root, 1, model, mesh, optim, {}, {})
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def test_a_failing_rank_fails_the_save_on_every_rank_and_leaves_nothing(tmp_path):
    root = tmp_path / "ckpt"
    errors = run_local(_save_with_bad_rank, 2, str(root))
    assert errors[0] == errors[1]
    assert "rank 1" in errors[0] and "layers.0.mlp.fc.weight/exp_avg" in errors[0]
    assert not root.exists()  # the failed first save removed the directory it made (95862c4)


def test_loading_another_model_is_refused(saved):
    root, _ = saved
    model = build_stage(tiny_config("gpt2", n_layer=2), Mesh(Layout()), seed=1)
    with pytest.raises(CheckpointError, match=r"different model: n_layer=4 \(checkpoint\) vs 2"):
        load_checkpoint(root, model, Mesh(Layout()))
    bert = build_stage(tiny_config("bert"), Mesh(Layout()), seed=1)
    # another kind of model: the kinds named, not every field the two configs do not share
    with pytest.raises(CheckpointError, match="holds a gpt2 model, not a bert; build") as err:
        load_checkpoint(root, bert, Mesh(Layout()))
    assert "(checkpoint) vs" not in str(err.value)


def test_dropout_differences_load_with_a_note(saved):
    root, _ = saved
    model = build_stage(tiny_config("gpt2", resid_pdrop=0.0), Mesh(Layout()), seed=1)
    state = load_checkpoint(root, model, Mesh(Layout()), verify="size")
    assert any("resid_pdrop" in n for n in state.notes)
