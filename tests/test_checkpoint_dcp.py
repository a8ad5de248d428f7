"""torchtitan's checkpoints (torch.distributed.checkpoint, DCP): a Llama in torchtitan's names,
written by torch's own DCP save in one process, imported by megapar-convert --from-dcp and
exported to transformers (logits equal to the same weights loaded directly, and to torchtitan's
own forward, Meta's complex rotary); --to-dcp read back by DCP's load bitwise; --load and --info
of a DCP directory refused in one line naming the import; megapar's shard files refused by
DCP's HuggingFaceStorageReader."""

import json
import math
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dist_cp
import torch.nn.functional as F
import transformers

from megapar.checkpoint.dcp import (
    FLAVORS,
    TITAN_ROPE_SCALING,
    intermediate_size,
    to_interleaved,
    to_rotate_half,
)
from megapar.cli.convert import main as convert
from megapar.cli.train import main as train
from megapar.data.assets import asset_path
from megapar.faults.processes import owner_tag

SMALL = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 80,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


def titan_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in torchtitan's Llama 3 names and shapes (seeded)."""
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    sd = {"tok_embeddings.weight": r(v, d), "norm.weight": 1 + r(d), "output.weight": r(v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sd |= {p + "attention.wq.weight": r(d, d), p + "attention.wk.weight": r(kv, d),
               p + "attention.wv.weight": r(kv, d), p + "attention.wo.weight": r(d, d),
               p + "attention_norm.weight": 1 + r(d), p + "ffn_norm.weight": 1 + r(d),
               p + "feed_forward.w1.weight": r(f, d), p + "feed_forward.w2.weight": r(d, f),
               p + "feed_forward.w3.weight": r(f, d)}
    return sd


def dcp_save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dist_cp.save(state, checkpoint_id=str(path), no_dist=True)


def dcp_load(like: dict, path) -> dict:
    out = {k: torch.empty_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dist_cp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def hf_permute(w, n_heads, dim1=None, dim2=None):
    """transformers' conversion-script permutation, as torchtitan's adapter copies it."""
    dim1, dim2 = dim1 or w.shape[0], dim2 or w.shape[1]
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_model_direct(state: dict, cfg: dict):
    """The torchtitan weights loaded straight into LlamaForCausalLM (torchtitan's to_hf)."""
    kv_heads, hd = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"],
          "model.norm.weight": state["norm.weight"], "lm_head.weight": state["output.weight"]}
    names = {"attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(cfg["num_hidden_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        hf[q + "self_attn.q_proj.weight"] = hf_permute(state[p + "attention.wq.weight"],
                                                       cfg["num_attention_heads"])
        hf[q + "self_attn.k_proj.weight"] = hf_permute(state[p + "attention.wk.weight"],
                                                       kv_heads, kv_heads * hd,
                                                       cfg["hidden_size"])
        for ours, theirs in names.items():
            hf[q + theirs + ".weight"] = state[p + ours + ".weight"]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in cfg.items() if k != "model_type"}, tie_word_embeddings=False))
    model.load_state_dict(hf, strict=True)
    return model.eval()


def llama31_scaled(freqs: torch.Tensor, factor=8.0, low=1.0, high=4.0, original=8192):
    """Llama 3.1's RoPE frequency scaling (Meta's reference ``apply_scaling``): wavelengths
    beyond original / low divided by `factor`, below original / high kept, blended between."""
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > original / low, freqs / factor, freqs)
    return torch.where((wavelen >= original / high) & (wavelen <= original / low), mid, out)


def titan_forward(state: dict, cfg: dict, ids: torch.Tensor, scaled: bool = False) -> torch.Tensor:
    """torchtitan's Llama 3 forward (its model.py: Meta's complex rotary on interleaved pairs,
    repeat_kv, nn.RMSNorm, SwiGLU), on its own names: the reference the permutation answers
    to; `scaled`: with the RoPE scaling its flavors have had since 2025-10 (Llama 3.1's). In
    float64, but for the rotary angles, which torchtitan (and transformers) compute in float32
    (complex64)."""
    state = {k: v.double() for k, v in state.items()}
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, n = d // heads, cfg["rms_norm_eps"], ids.shape[1]
    freqs = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    freqs = llama31_scaled(freqs) if scaled else freqs
    freqs = torch.outer(torch.arange(n), freqs).float()
    cis = torch.polar(torch.ones_like(freqs), freqs).to(torch.complex128).view(1, n, 1, hd // 2)

    def rope(x):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * cis).flatten(3)

    def norm(x, w):
        return F.rms_norm(x, (d,), w, eps)

    h = state["tok_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = norm(h, state[p + "attention_norm.weight"])
        q = (x @ state[p + "attention.wq.weight"].T).view(1, n, heads, hd)
        k = (x @ state[p + "attention.wk.weight"].T).view(1, n, kv, hd)
        v = (x @ state[p + "attention.wv.weight"].T).view(1, n, kv, hd)
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // kv, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        h = h + o.transpose(1, 2).reshape(1, n, d) @ state[p + "attention.wo.weight"].T
        x = norm(h, state[p + "ffn_norm.weight"])
        w1, w2, w3 = (state[p + f"feed_forward.{w}.weight"] for w in ("w1", "w2", "w3"))
        h = h + (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    return norm(h, state["norm.weight"]) @ state["output.weight"].T


@pytest.fixture
def small(tmp_path):
    state = titan_state(SMALL)
    dcp_save(state, tmp_path / "step-10")
    model = tmp_path / "llama.json"
    model.write_text(json.dumps(SMALL))
    return state, tmp_path / "step-10", str(model)


def test_the_permutation_is_torchtitans_and_inverts():
    w = torch.randn(8 * 6, 5)
    assert torch.equal(to_interleaved(to_rotate_half(w, 6), 6), w)
    assert torch.equal(to_rotate_half(w, 6), hf_permute(w, 6))
    assert intermediate_size(4096, 1024, 1.3) == 14336  # Llama 3 8B
    assert intermediate_size(256) == 768 and FLAVORS["debugmodel"]["dim"] == 256


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_from_dcp_then_to_hf_gives_the_logits_of_the_weights_loaded_directly(
        tmp_path, small, tp, pp, capsys):
    state, step, model = small
    assert convert(["--from-dcp", str(step), str(tmp_path / "ck"), "--model", model,
                    "--tp", str(tp), "--pp", str(pp), "--no-progress"]) == 0
    assert "weights only" in capsys.readouterr().out
    assert convert([str(tmp_path / "ck"), "--to-hf", str(tmp_path / "hf")]) == 0
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = exported(ids).logits
        direct = hf_model_direct(state, SMALL)(ids).logits
        titan = titan_forward(state, SMALL, ids)
        ours64 = exported.double()(ids).logits
    assert (ours - direct).abs().max() <= 1e-6
    # transformers keeps its RMSNorm and rotary in float32 even in a float64 model: about 1e-6
    # apart; a wrong rotary layout is apart by the logits' own size
    assert (ours64 - titan).abs().max() <= 1e-5, (ours64 - titan).abs().max()


def test_a_job_config_names_the_flavor_and_the_checkpoint_the_vocabulary(tmp_path, capsys):
    cfg = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 300,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 128}
    state = titan_state(cfg, seed=3)
    state["optimizer"] = {"state": {"tok_embeddings.weight": {
        "exp_avg": torch.zeros(3), "step": torch.tensor(4.0)}}}
    dcp_save(state, tmp_path / "step-5")
    job = tmp_path / "llama3_debug.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n\n[training]\nseq_len = 128\n')
    assert convert(["--from-dcp", str(tmp_path / "step-5"), str(tmp_path / "ck"),
                    "--job-config", str(job), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "holds optimizer state too; it is not imported" in out
    assert "note: RoPE scaled as torchtitan's Llama 3 flavors scale it (llama3: factor 8" in out
    assert convert([str(tmp_path / "ck"), "--to-hf", str(tmp_path / "hf")]) == 0
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["vocab_size"], hf_cfg["intermediate_size"], hf_cfg["num_attention_heads"],
            hf_cfg["max_position_embeddings"]) == (300, 768, 16, 128)
    # every flavor's RoPE is scaled (Llama 3.1's) since torchtitan's 2025-10-08 version: the
    # import took the flavor's sizes without it, logits 1e-2 apart from torchtitan's own
    assert hf_cfg["rope_parameters"] == {**TITAN_ROPE_SCALING, "rope_theta": 500000.0}
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.arange(40).view(1, 40) * 7 % 300
    del state["optimizer"]
    with torch.no_grad():
        titan = titan_forward(state, cfg, ids, scaled=True)
        diff = (exported.double()(ids).logits - titan).abs().max()
        unscaled = (titan_forward(state, cfg, ids) - titan).abs().max()
    assert diff <= 1e-5 * titan.abs().max(), (diff, titan.abs().max())  # as above, 6 layers
    assert unscaled > 1e3 * diff, (unscaled, diff)
    # a flavor whose sizes are not the weights': one line naming the tensor and the fix
    job.write_text('[model]\nname = "llama3"\nflavor = "8B"\n')
    capsys.readouterr()
    assert convert(["--from-dcp", str(tmp_path / "step-5"), str(tmp_path / "ck2"),
                    "--job-config", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tok_embeddings.weight" in err and "--job-config" in err, err
    assert not (tmp_path / "ck2").exists()


def test_a_recipe_s_sizes_take_the_checkpoint_s_vocabulary(tmp_path, capsys):
    """--from-dcp --model llama-tiny of a checkpoint whose tokenizer has 300 tokens was refused
    ("tok_embeddings.weight is [300, 64], the config implies [32000, 64]; give the --model it
    was trained with"), though no recipe has that vocabulary: torchtitan's follows the
    tokenizer, so the import takes the checkpoint's (as --job-config does), with a note."""
    from megapar.checkpoint.format import ShardReader
    from megapar.checkpoint.manifest import verify
    from megapar.models.recipes import resolve_model

    cfg = {**resolve_model("llama-tiny").to_dict(), "vocab_size": 300}
    state = titan_state(cfg, seed=2)
    dcp_save(state, tmp_path / "step-3")
    assert convert(["--from-dcp", str(tmp_path / "step-3"), str(tmp_path / "ck"), "--model",
                    "llama-tiny", "--no-progress"]) == 0
    assert ("note: the vocabulary is the checkpoint's 300 tokens (its embedding's rows), not "
            "--model llama-tiny's 32,000: torchtitan's follows the tokenizer the job trained "
            "with") in capsys.readouterr().out
    manifest = verify(tmp_path / "ck" / "step_00000000")
    assert manifest["model"]["vocab_size"] == 300
    reader = ShardReader(tmp_path / "ck" / "step_00000000", manifest)
    embedding = reader.shard("embed.word.weight", None, 1, 0, 300)
    reader.release()
    assert torch.equal(embedding, state["tok_embeddings.weight"])


def test_to_dcp_reads_back_bitwise_in_torchtitans_names(tmp_path, small, capsys):
    state, step, model = small
    assert convert(["--from-dcp", str(step), str(tmp_path / "ck"), "--model", model,
                    "--tp", "2", "--no-progress"]) == 0
    # an export killed -9 left its staging directory: the next export to that destination
    # removes it (its owner pid is dead), never a live writer's or another destination's
    child = subprocess.Popen(["true"])
    child.wait()
    host = owner_tag().split("-", 1)[1]
    dead = tmp_path / f".back.tmp-{child.pid}-{host}-0123"
    live = tmp_path / f".back.tmp-{owner_tag()}-4567"
    other = tmp_path / f".ck2.tmp-{child.pid}-{host}-89ab"
    for d in (dead, live, other):
        d.mkdir()
        (d / ".metadata").write_bytes(b"half")
    assert convert([str(tmp_path / "ck"), "--to-dcp", str(tmp_path / "back")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(
        [live.name, other.name])
    shutil.rmtree(live)
    shutil.rmtree(other)
    out = capsys.readouterr().out
    assert "n_kv_heads=2" in out
    # the FFN size as torchtitan's model args give it (they have no hidden_dim, which was
    # printed: a checkpoint review's finding), by its FeedForward's formula
    args = dict(kv.split("=") for kv in out.split("torchtitan model args: ")[1]
                .splitlines()[0].split(", "))
    assert "hidden_dim" not in args, args
    dim, multiple = int(args["dim"]), int(args["multiple_of"])
    hidden = int(2 * 4 * dim / 3)
    if "ffn_dim_multiplier" in args:
        hidden = int(float(args["ffn_dim_multiplier"]) * hidden)
    assert multiple * -(-hidden // multiple) == state["layers.0.feed_forward.w1.weight"].shape[0]
    # torchtitan's flavors scale RoPE since 2025-10: weights trained without run otherwise there
    assert "note: the model's RoPE scaling is none, not that of torchtitan's Llama 3 flavors" in out
    back = dcp_load(state, tmp_path / "back")
    assert sorted(back) == sorted(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    assert convert([str(tmp_path / "ck"), "--to-dcp", str(tmp_path / "back")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_a_torchtitan_checkpoint_folder_is_answered_with_its_newest_step(tmp_path, small,
                                                                         capsys):
    """--from-dcp of the folder that holds step-9 and step-10 said only 'not a DCP checkpoint
    (no .metadata)'; --load of it named a step, the lexically last (step-9)."""
    import shutil

    state, step, model = small
    shutil.copytree(step, tmp_path / "step-9")
    assert convert(["--from-dcp", str(tmp_path), str(tmp_path / "ck"), "--model", model]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"megapar-convert: error: {tmp_path} is torchtitan's checkpoint folder "
                   f"(step-9, step-10), not one step; give a torchtitan step directory "
                   f"({tmp_path / 'step-10'})"), err
    from megapar.checkpoint.publish import foreign_checkpoint

    assert f"--from-dcp {tmp_path / 'step-10'} CKPT_DIR" in foreign_checkpoint(tmp_path)


def test_a_tied_llama_moves_with_output_weight_as_torchtitans_tied_model_saves_it(
        tmp_path, capsys):
    """torchtitan's Llama loads ``output.weight`` tied or not (its enable_weight_tying saves
    the shared tensor under both names): --to-dcp of a tied Llama wrote no output.weight, and
    --from-dcp with a tied --model silently untied a checkpoint that has one."""
    tied = {**SMALL, "tie_word_embeddings": True}
    (tmp_path / "tied.json").write_text(json.dumps(tied))
    state = titan_state(SMALL)
    state["output.weight"] = state["tok_embeddings.weight"]
    dcp_save(state, tmp_path / "titan")
    model = str(tmp_path / "tied.json")
    assert convert(["--from-dcp", str(tmp_path / "titan"), str(tmp_path / "ck"), "--model",
                    model, "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "ck" / "step_00000000" / "manifest.json").read_text())
    assert manifest["model"]["tie_word_embeddings"] and "head.weight" not in manifest["tensors"]
    capsys.readouterr()
    assert convert([str(tmp_path / "ck"), "--to-dcp", str(tmp_path / "back")]) == 0
    assert "enable_weight_tying=True" in capsys.readouterr().out
    back = dcp_load(state, tmp_path / "back")
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    # untied weights under a tied config: refused, not untied
    dcp_save(titan_state(SMALL), tmp_path / "untied")
    assert convert(["--from-dcp", str(tmp_path / "untied"), str(tmp_path / "ck2"), "--model",
                    model, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "output.weight is not its tok_embeddings.weight" in err and "\n" not in err, err
    assert not (tmp_path / "ck2").exists()


def test_load_of_another_format_is_refused_naming_the_import(tmp_path, small, capsys,
                                                             monkeypatch):
    import megapar.cli.train as train_cli

    def refuse(*a, **k):
        raise AssertionError("a worker was started for a bad input")

    monkeypatch.setattr(train_cli, "run_workers", refuse)
    step = small[1]
    hf_dir = tmp_path / "hf_weights"
    hf_dir.mkdir()
    from safetensors.torch import save_file
    save_file({"model.norm.weight": torch.ones(4)}, hf_dir / "model.safetensors")
    (hf_dir / "t.txt").write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    base = ["--model", "llama-tiny", "--seq-len", "32", "--no-progress", "--max-steps", "1"]
    for path, words in ((step, ["DCP", "megapar-convert --from-dcp", str(step)]),
                        (tmp_path, ["torchtitan's DCP checkpoints", "step-10"]),
                        (hf_dir, ["safetensors", "config.json", "--from-hf"])):
        assert train([*base, "--load", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and all(w in err for w in words), err
    empty = tmp_path / "empty"
    empty.mkdir()  # nothing there yet: a requeued job's first start, which starts fresh
    from megapar.cli.train import parse_args, plan_run

    plan_run(parse_args([*base, "--tokenizer", "gpt2", "--data", str(hf_dir / "t.txt"),
                         "--data-cache", str(tmp_path / "cache"), "--load", str(empty)]), [])
    assert convert(["--info", str(step)]) == 2
    err = capsys.readouterr().err.strip()
    assert "DCP" in err and "--from-dcp" in err and "interrupted" not in err, err


def test_megapar_shards_are_refused_by_dcps_huggingface_reader(tmp_path, small):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException

    step, model = small[1:]
    assert convert(["--from-dcp", str(step), str(tmp_path / "ck"), "--model", model,
                    "--tp", "2", "--pp", "2", "--no-progress"]) == 0
    step_dir = tmp_path / "ck" / "step_00000000"
    entry = json.loads((step_dir / "manifest.json").read_text())["tensors"]["embed.word.weight"]
    padded = [entry["local_shape"][0] * 2, entry["local_shape"][1]]  # the tensor tp 2 holds
    want = {"model/embed.word.weight": torch.empty(padded)}
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as refused:
        warnings.simplefilter("ignore", UserWarning)
        dist_cp.load(want, storage_reader=HuggingFaceStorageReader(str(step_dir)), no_dist=True)
    # torch 2.13: the KeyError of a key it does not hold; torch 2.11 (pyproject's floor): no
    # metadata read at all
    said = str(refused.value)
    assert "metadata read failed: 'model/" in said or "metadata is None" in said, said
    with pytest.raises(OSError):  # transformers refuses a file that is not a whole model
        transformers.LlamaForCausalLM.from_pretrained(step_dir)


def test_an_import_unpickles_the_index_once(tmp_path, small, monkeypatch):
    from megapar.checkpoint import dcp

    loads = []
    unpickle = dcp._MetadataUnpickler.load

    def counted(self):
        loads.append(1)
        return unpickle(self)

    monkeypatch.setattr(dcp._MetadataUnpickler, "load", counted)
    state, step, model = small
    path, reader = dcp.import_dcp(step, tmp_path / "ck", 1, 1, config=model, progress=False)
    assert len(loads) == 1  # one tensor at a time, each given the index read at the start
    assert torch.equal(reader.titan("output.weight"), state["output.weight"])
    assert len(loads) == 1


def test_a_missing_or_cut_data_file_is_one_line(small, tmp_path, capsys):
    """A DCP checkpoint whose .distcp file is missing or cut short was a Python traceback
    (torch's CheckpointException, a BaseException, with the worker's traceback as its text), a
    new user's finding; now one line naming the checkpoint and the cause, nothing written."""
    _, step, model = small
    data = next(step.glob("*.distcp"))
    whole = data.read_bytes()
    for damage, cause in ((lambda: data.write_bytes(whole[:1000]), "RuntimeError"),
                          (data.unlink, "FileNotFoundError")):
        damage()
        assert convert(["--from-dcp", str(step), str(tmp_path / "out"), "--model", model,
                        "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"megapar-convert: error: {step}: its data files cannot be read "
                              f"({cause}") and "\n" not in err, err
        assert err.endswith("the checkpoint is incomplete or damaged; copy it again from where "
                            "it was written"), err
        assert not (tmp_path / "out").exists()


def _dotted_call(marker: Path) -> bytes:
    """A .metadata pickle (protocol 4) that looks up `os.system` as a dotted name in DCP's
    metadata module, which imports os, and calls it: what a hostile checkpoint could hold."""
    module, name, command = (b"torch.distributed.checkpoint.metadata", b"os.system",
                             f"touch {marker}".encode())
    return (b"\x80\x04" + b"\x8c" + bytes([len(module)]) + module + b"\x94"
            + b"\x8c" + bytes([len(name)]) + name + b"\x94\x93"
            + b"\x8c" + bytes([len(command)]) + command + b"\x94\x85R.")


def test_an_index_that_calls_code_is_refused_without_running_it(small, tmp_path, capsys):
    """DCP's .metadata is a pickle: its reader took any name in DCP's metadata module, and
    protocol 4 looks dotted names up, so `os.system` ran (a helper's find; a traceback
    followed). Only that module's own classes are taken, never a dotted name; an index that
    is not DCP's Metadata is one line. The Megatron import reads its .metadata so too."""
    from test_checkpoint_megatron import megatron_llama_state, save_megatron

    _, step, model = small
    marker = tmp_path / "ran"
    (step / ".metadata").write_bytes(_dotted_call(marker))
    assert convert(["--from-dcp", str(step), str(tmp_path / "out"), "--model", model]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"megapar-convert: error: {step / '.metadata'}: not a DCP index megapar "
                   f"reads (torch.distributed.checkpoint.metadata.os.system is not part of "
                   f"DCP's metadata); refused without running it"), err
    assert not marker.exists() and not (tmp_path / "out").exists()
    root = save_megatron(megatron_llama_state(True), tmp_path / "m")
    (root / "iter_0000003" / ".metadata").write_bytes(_dotted_call(marker))
    assert convert(["--from-megatron", str(root), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not part of DCP's metadata); refused without running it" in err, err
    assert not marker.exists() and "\n" not in err
    (step / ".metadata").write_bytes(b"\x80\x04K\x07.")  # the int 7
    assert convert(["--from-dcp", str(step), str(tmp_path / "out"), "--model", model]) == 2
    assert capsys.readouterr().err.strip() == (
        f"megapar-convert: error: {step / '.metadata'}: not a DCP index megapar reads (it "
        f"holds a value of type int, not DCP's Metadata)")


def test_a_tensor_the_import_has_no_place_for_is_refused_not_dropped(small, tmp_path, capsys):
    """A torchtitan checkpoint holding a weight megapar's Llama lacks (a bias) was imported
    without it, silently (a helper's find), where the Megatron import refuses it; it is
    refused in one line now. An older torchtitan's saved rotary table (freqs_cis) and the
    optimizer's state are not weights, and still import."""
    state, _, model = small
    odd = {**state, "layers.0.attention.bias": torch.zeros(4)}
    dcp_save(odd, tmp_path / "odd")
    assert convert(["--from-dcp", str(tmp_path / "odd"), str(tmp_path / "out"), "--model",
                    model, "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"megapar-convert: error: {tmp_path / 'odd'}: tensors megapar's llama has no place "
        f"for: layers.0.attention.bias; refused rather than dropped (give the --job-config / "
        f"--model it was trained with, if megapar's Llama has them)")
    assert not (tmp_path / "out").exists()
    kept = {**state, "freqs_cis": torch.zeros(8, 2),
            "optimizer.state.tok_embeddings.weight.exp_avg": torch.zeros(2)}
    dcp_save(kept, tmp_path / "kept")
    assert convert(["--from-dcp", str(tmp_path / "kept"), str(tmp_path / "out"), "--model",
                    model, "--no-progress"]) == 0
