"""GPT-2 and BERT built from tp layers equal transformers' own models: logits, loss, gradients."""

import pytest
import torch
import transformers
from canonical import gather_canonical
from tp_utils import assert_close, make_mesh

from megapar.checkpoint.hf import HFReader, load_hf_weights, save_hf
from megapar.launcher import run_local
from megapar.models import GPT2, Bert
from megapar.tensor_parallel.partition import gather_full

GPT2_TINY = dict(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
BERT_TINY = dict(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)


def _save(model, path):
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    return _save(transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_TINY)),
                 tmp_path_factory.mktemp("hf_gpt2"))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**BERT_TINY))
    with torch.no_grad():  # non-trivial biases and norms, so a mapping mistake shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return _save(model, tmp_path_factory.mktemp("hf_bert"))


def _hf_grads(hf_model, reader):
    """HF gradients, keyed and shaped like megapar's canonical tensors."""
    grads = {k: p.grad for k, p in hf_model.named_parameters() if p.grad is not None}
    getter = lambda key: grads[reader.prefix + key] if reader.prefix + key in grads else grads[key]
    from megapar.checkpoint import hf_names
    fn = hf_names.gpt2_canonical if reader.config.model_type == "gpt2" else hf_names.bert_canonical
    return lambda name: fn(name, getter, reader.config)


def _check_model(path, batch, hf_cls, tp):
    mesh = make_mesh(tp)
    batch = dict(batch)
    hf_labels = batch.pop("hf_labels", batch["labels"])
    reader = HFReader(path)
    cls = GPT2 if reader.config.model_type == "gpt2" else Bert
    model = cls(reader.config, mesh)
    assert load_hf_weights(model, reader) == []
    hf = hf_cls.from_pretrained(path).eval()
    model.eval()

    logits_local = model(None, {k: v for k, v in batch.items() if k != "labels"})
    logits = gather_full(logits_local, 2, logits_local.shape[:2] + (reader.config.vocab_size,),
                         mesh.tp_group)
    hf_kwargs = {k: v for k, v in batch.items() if k != "labels"}
    hf_logits = hf(**hf_kwargs).logits
    assert_close(logits, hf_logits, what="logits")

    loss = model(None, batch)
    hf_out = hf(**hf_kwargs, labels=hf_labels)
    assert_close(loss, hf_out.loss, what="loss")
    loss.backward()
    hf_out.loss.backward()
    ref_grad = _hf_grads(hf, reader)
    checked = 0
    for name, p in model.named_parameters():
        grad = gather_full(p.grad, getattr(p, "tp_dim", None), p.full_shape, mesh.tp_group)
        assert_close(grad, ref_grad(name), what=f"grad of {name}")
        checked += 1
    assert checked == len(list(model.parameters()))
    return checked


def _gpt2_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT2_TINY["vocab_size"], (3, 16), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)  # HF shifts inside
    return {"input_ids": ids, "labels": labels, "hf_labels": ids}


def _gpt2_worker(path, tp):
    return _check_model(path, _gpt2_batch(), transformers.GPT2LMHeadModel, tp)


def _bert_batch():
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(5, BERT_TINY["vocab_size"], (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    types[mask == 0] = 0
    labels = torch.full_like(ids, -100)
    pick = torch.rand(ids.shape, generator=gen) < 0.3
    pick[:, 0] = True
    labels[pick & (mask == 1)] = ids[pick & (mask == 1)]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}


def _bert_worker(path, tp):
    return _check_model(path, _bert_batch(), transformers.BertForMaskedLM, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt2_equals_transformers(gpt2_dir, tp):
    results = [_gpt2_worker(gpt2_dir, 1)] if tp == 1 else run_local(_gpt2_worker, tp, gpt2_dir, tp)
    assert all(r > 0 for r in results)


@pytest.mark.parametrize("tp", [1, 2])
def test_bert_equals_transformers(bert_dir, tp):
    results = [_bert_worker(bert_dir, 1)] if tp == 1 else run_local(_bert_worker, tp, bert_dir, tp)
    assert all(r > 0 for r in results)


def _init_and_gather(kind, tp):
    from megapar.models import BertConfig, GPT2Config
    mesh = make_mesh(tp)
    config = GPT2Config(**GPT2_TINY) if kind == "gpt2" else BertConfig(**BERT_TINY)
    model = (GPT2 if kind == "gpt2" else Bert)(config, mesh)
    model.init_weights(seed=1234)
    return {k: v for k, v in gather_canonical(model).items()}


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_same_seed_gives_bitwise_same_weights_at_any_tp(kind):
    ref = _init_and_gather(kind, 1)
    for tp in (2, 4):
        for rank_state in run_local(_init_and_gather, tp, kind, tp):
            assert rank_state.keys() == ref.keys()
            for name, tensor in ref.items():
                assert torch.equal(rank_state[name], tensor), f"{name} differs at tp={tp}"


def _export(path, out, tp):
    mesh = make_mesh(tp)
    reader = HFReader(path)
    model = (GPT2 if reader.config.model_type == "gpt2" else Bert)(reader.config, mesh)
    load_hf_weights(model, reader)
    state = gather_canonical(model)
    if mesh.tp_rank == 0:
        save_hf(state, reader.config, out)
    return True


@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_hf_export_at_tp2_reproduces_original_tensors(which, gpt2_dir, bert_dir, tmp_path):
    path = gpt2_dir if which == "gpt2" else bert_dir
    out = tmp_path / "exported"
    run_local(_export, 2, path, str(out), 2)
    hf_cls = transformers.GPT2LMHeadModel if which == "gpt2" else transformers.BertForMaskedLM
    original = hf_cls.from_pretrained(path).state_dict()
    exported = hf_cls.from_pretrained(str(out)).state_dict()
    assert original.keys() == exported.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


def test_plain_bert_model_without_head_reports_missing_head(tmp_path):
    torch.manual_seed(0)
    path = _save(transformers.BertModel(transformers.BertConfig(**BERT_TINY)), tmp_path / "base")
    reader = HFReader(path)
    model = Bert(reader.config, make_mesh(1))
    model.init_weights(seed=3)
    missing = load_hf_weights(model, reader)
    assert sorted(missing) == ["head.bias", "head.norm.bias", "head.norm.weight",
                               "head.transform.bias", "head.transform.weight"]
    hf = transformers.BertModel.from_pretrained(path)
    vocab = BERT_TINY["vocab_size"]  # the local tensor is padded to a multiple of 128
    assert torch.equal(model.embed.word.weight.detach()[:vocab],
                       hf.embeddings.word_embeddings.weight.detach())
