"""Hugging Face import (--from-hf) at 2x2 and export (--to-hf) give the original tensors back."""

import pytest
import torch
import transformers
from test_checkpoint_helpers import assert_same, canonical_state

from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.hf import gather_canonical
from megapar.checkpoint.manifest import read_manifest
from megapar.cli.convert import main
from megapar.mesh import Layout, Mesh
from megapar.models import config_from_hf
from megapar.pipeline.partition import build_stage

GPT2_HF = dict(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4)
BERT_HF = dict(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=32)
LLAMA_HF = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
HEAD = ["head.bias", "head.norm.bias", "head.norm.weight", "head.transform.bias",
        "head.transform.weight"]


def _hf_dir(path, model):
    with torch.no_grad():   # non-trivial biases and norms, so a mapping mistake shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "ln_" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama", "llama-tied"])
def test_import_at_2x2_then_export_reproduces_hf_tensors(tmp_path, kind, capsys):
    torch.manual_seed(0)
    if kind == "gpt2":
        cls, hf = transformers.GPT2LMHeadModel, transformers.GPT2Config(**GPT2_HF)
    elif kind.startswith("llama"):
        cls, hf = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **LLAMA_HF, tie_word_embeddings=kind == "llama-tied")
    else:
        cls, hf = transformers.BertForMaskedLM, transformers.BertConfig(**BERT_HF)
    src = _hf_dir(tmp_path / "hf", cls(hf))
    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    assert main(["--from-hf", src, str(ckpt), "--tp", "2", "--pp", "2", "--no-progress"]) == 0
    assert "initialised" not in capsys.readouterr().out
    manifest = read_manifest(ckpt)
    assert manifest["layout"] == {"tp": 2, "pp": 2, "dp": 1} and manifest["step"] == 0
    assert all(e["optim"] == {} for e in manifest["tensors"].values())
    assert manifest["meta"]["initialised_from_seed"] == []
    assert main([str(ckpt), "--to-hf", str(out)]) == 0
    original = cls.from_pretrained(src).state_dict()
    exported = cls.from_pretrained(str(out)).state_dict()
    assert original.keys() == exported.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


def test_plain_bert_model_import_initialises_the_head_from_the_seed(tmp_path, capsys):
    torch.manual_seed(0)
    src = _hf_dir(tmp_path / "base", transformers.BertModel(transformers.BertConfig(**BERT_HF)))
    ckpt = tmp_path / "ckpt"
    assert main(["--from-hf", src, str(ckpt), "--tp", "2", "--pp", "2", "--seed", "5",
                 "--no-progress"]) == 0
    report = capsys.readouterr().out
    line = next(x for x in report.splitlines() if "initialised from --seed 5" in x)
    assert sorted(line.split(": ", 1)[1].split(", ")) == HEAD
    assert sorted(read_manifest(ckpt)["meta"]["initialised_from_seed"]) == HEAD
    weights, _ = canonical_state(ckpt)
    # The head is what training from seed 5 would start with; the rest is the HF model.
    config = config_from_hf(transformers.BertConfig(**BERT_HF))
    seeded = gather_canonical(build_stage(config, Mesh(Layout()), seed=5))
    assert_same({n: weights[n] for n in HEAD}, {n: seeded[n] for n in HEAD}, "head")
    hf = transformers.BertModel.from_pretrained(src)
    assert torch.equal(weights["embed.word.weight"], hf.embeddings.word_embeddings.weight)
    assert torch.equal(weights["layers.1.mlp.proj.bias"], hf.encoder.layer[1].output.dense.bias)


def test_a_checkpoint_without_optimizer_state_loads(tmp_path):
    torch.manual_seed(0)
    src = _hf_dir(tmp_path / "hf", transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_HF)))
    assert main(["--from-hf", src, str(tmp_path / "ckpt"), "--tp", "2", "--pp", "1",
                 "--no-progress"]) == 0
    config = config_from_hf(transformers.GPT2Config(**GPT2_HF))
    model = build_stage(config, Mesh(Layout()), seed=1)
    state = load_checkpoint(tmp_path / "ckpt", model, Mesh(Layout()))
    assert state.optim_tensors == {} and not state.has_optimizer_state
    assert state.resharded and state.rng is None and state.step == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(src)
    assert torch.equal(model.embed.word.weight.detach()[:101], hf.transformer.wte.weight)
    ids = torch.randint(0, 101, (2, 8))
    model.eval()
    logits = model(None, {"input_ids": ids})[..., :101]
    assert torch.allclose(logits, hf.eval()(ids).logits, atol=1e-5)
