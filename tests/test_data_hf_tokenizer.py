"""transformers tokenizer directories (tokenizer.json) and byte-level BPE training.

The tokenizer.json files are built here, offline: one from the shipped GPT-2 vocab / merges
(saved by transformers), one trained with the tokenizers library by `megapar-data
--train-tokenizer bpe`, one Llama-style (distinct BOS / EOS). Each must give transformers'
AutoTokenizer's ids on the Shakespeare sample.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers

from megapar.cli.data import main as data_main
from megapar.data import IndexedDataset, asset_path, load_tokenizer

TEXT = Path(asset_path("shakespeare_sample.txt")).read_text()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("gpt2_src"), tmp_path_factory.mktemp("gpt2_hf")
    shutil.copy(asset_path("gpt2_vocab.json"), src / "vocab.json")
    shutil.copy(asset_path("gpt2_merges.txt"), src / "merges.txt")
    transformers.GPT2TokenizerFast.from_pretrained(str(src)).save_pretrained(str(out))
    assert (out / "tokenizer.json").is_file()
    return str(out)


def _same_as_auto(directory):
    ours = load_tokenizer(directory)
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    ids = ours.encode(TEXT)
    assert len(ids) > 1000 and ids == auto(TEXT, add_special_tokens=False)["input_ids"]
    paragraphs = [p for p in TEXT.split("\n\n") if p.strip()][:50]
    assert ours.encode_batch(paragraphs) == [auto.encode(p, add_special_tokens=False)
                                             for p in paragraphs]
    assert ours.decode(ids[:200]) == auto.decode(ids[:200])
    return ours, auto


def test_gpt2_tokenizer_json_equals_auto_tokenizer_and_the_bpe_files(gpt2_dir):
    ours, _ = _same_as_auto(gpt2_dir)
    assert ours.kind == "hf" and ours.eod_id == 50256 and ours.bos_id is None
    assert ours.encode(TEXT) == load_tokenizer("gpt2").encode(TEXT)
    assert load_tokenizer(os.path.join(gpt2_dir, "tokenizer.json")).path == ours.path


def test_train_bpe_then_preprocess_and_auto_tokenizer_agree(tmp_path):
    text = tmp_path / "sample.txt"
    text.write_text(TEXT)
    prefix = str(tmp_path / "bpe")
    assert data_main(["--train-tokenizer", "bpe", "--vocab-size", "600", "--input", str(text),
                      "--output-prefix", prefix, "--split-lines", "--no-progress"]) == 0
    directory = prefix + "-tokenizer"
    ours, auto = _same_as_auto(directory)
    assert ours.base_vocab_size == 600 == len(auto)
    ds = IndexedDataset(prefix)
    assert ds.tokenizer_spec["kind"] == "hf" and ds.vocab_size == ours.vocab_size
    first = [p for p in TEXT.split("\n\n") if p.strip()][0].strip("\n")
    assert ds.doc(0).tolist() == auto.encode(first, add_special_tokens=False) + [ours.eod_id]


def test_llama_style_bos_starts_every_document(tmp_path, gpt2_dir):
    directory = tmp_path / "llama-style"
    shutil.copytree(gpt2_dir, directory)
    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    tok["added_tokens"] += [{"id": vocab + i, "content": name, "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False,
                             "special": True} for i, name in enumerate(["<s>", "</s>"])]
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(bos_token="<s>", eos_token="</s>")
    config.pop("added_tokens_decoder", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(str(directory))
    assert (ours.bos_id, ours.eod_id) == (vocab, vocab + 1)
    text = tmp_path / "two.txt"
    text.write_text("First document.\n\nSecond one here.\n")
    prefix = str(tmp_path / "ds")
    assert data_main(["--input", str(text), "--output-prefix", prefix, "--tokenizer",
                      str(directory), "--split-lines", "--no-progress"]) == 0
    ds = IndexedDataset(prefix)
    auto = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert auto.bos_token_id == vocab and auto.eos_token_id == vocab + 1
    for i, doc in enumerate(["First document.", "Second one here."]):
        expected = [vocab] + auto.encode(doc, add_special_tokens=False) + [vocab + 1]
        assert ds.doc(i).tolist() == expected


def test_train_tokenizer_usage_errors(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert data_main(["--train-tokenizer", "bpe", "--input", str(text), "--output-prefix",
                      str(tmp_path / "x")]) == 2
    assert "--train-tokenizer bpe needs --vocab-size" in capsys.readouterr().err
    assert data_main(["--train-tokenizer", "bpe", "--vocab-size", "100", "--input", str(text),
                      "--output-prefix", str(tmp_path / "x")]) == 2
    assert "too small for a byte-level BPE" in capsys.readouterr().err
    assert not np.any([p.name.startswith("x") for p in tmp_path.iterdir()])
