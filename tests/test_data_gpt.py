"""GPTDataset windows (Megatron convention) and the document train/val split."""

import os

import numpy as np
import pytest
import torch

from megapar.data.gpt_dataset import GPTDataset, TokenStream, split_documents
from megapar.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megapar.data.preprocess import ensure_dataset
from megapar.data.tokenizers import asset_path, load_tokenizer


@pytest.fixture
def toy(tmp_path):
    """Documents of lengths 3, 1, 5, 2 (+eod 0) holding distinct ids 1.."""
    prefix = str(tmp_path / "toy")
    docs, nxt = [], 1
    for n in (3, 1, 5, 2):
        docs.append(list(range(nxt, nxt + n)))
        nxt += n
    with IndexedDatasetBuilder(prefix, vocab_size=100, eod_id=0, tokenizer_spec={}) as b:
        b.add_documents(docs)
        b.finalize()
    return IndexedDataset(prefix), docs


def test_windows_share_one_boundary_token(toy):
    ds, _ = toy
    stream = ds.tokens.astype(np.int64)  # 15 tokens: [1 2 3 0 4 0 5 6 7 8 9 0 10 11 0]
    gpt = GPTDataset(ds, seq_len=4)
    assert len(gpt) == (15 - 1) // 4 == 3
    for i in range(len(gpt)):
        s = gpt[i]
        window = stream[i * 4:i * 4 + 5]
        assert s["input_ids"].dtype == torch.long and s["input_ids"].shape == (4,)
        assert s["input_ids"].tolist() == window[:-1].tolist()
        assert s["labels"].tolist() == window[1:].tolist()
    assert gpt[1]["input_ids"][0] == gpt[0]["labels"][-1]  # the shared boundary token
    with pytest.raises(IndexError):
        gpt[3]


def test_doc_range_selects_and_concatenates_documents(toy):
    ds, docs = toy
    # docs 0 and 2 (non-contiguous) -> stream = doc0+eod, doc2+eod
    expected = docs[0] + [0] + docs[2] + [0]
    stream = TokenStream(ds, np.array([0, 2]))
    assert len(stream) == len(expected)
    assert stream.slice(0, len(expected)).tolist() == expected
    assert stream.slice(2, 4).tolist() == expected[2:6]
    gpt = GPTDataset(ds, seq_len=3, doc_range=np.array([0, 2]))
    assert [gpt[i]["input_ids"].tolist() for i in range(len(gpt))] == [expected[0:3], expected[3:6], expected[6:9]]
    assert GPTDataset(ds, 2, doc_range=(2, 4))[0]["input_ids"].tolist() == [5, 6]
    with pytest.raises(ValueError, match="fewer than one window"):
        GPTDataset(ds, seq_len=50)


def test_split_documents_is_deterministic_and_disjoint():
    train, val = split_documents(100, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(100))
    again = split_documents(100, 0.1, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
    assert not np.array_equal(val, split_documents(100, 0.1, seed=4)[1])
    assert len(split_documents(7, 0.01, seed=0)[1]) == 1  # at least one val document
    assert len(split_documents(7, 0.0, seed=0)[1]) == 0
    with pytest.raises(ValueError, match="cannot split 1 document"):
        split_documents(1, 0.1, seed=0)


def test_real_sample_train_val(tmp_path):
    prefix = ensure_dataset(asset_path("shakespeare_sample.txt"), "gpt2", str(tmp_path))
    ds = IndexedDataset(prefix)
    train_docs, val_docs = split_documents(ds.num_docs, 0.05, seed=0)
    train, val = GPTDataset(ds, 128, train_docs), GPTDataset(ds, 128, val_docs)
    total = (len(train) + len(val)) * 128
    assert ds.num_tokens - 2 * 129 < total <= ds.num_tokens
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.1
    tok = load_tokenizer("gpt2")
    source = open(asset_path("shakespeare_sample.txt")).read()
    for i in (0, len(train) // 2, len(train) - 1):
        pieces = tok.decode(train[i]["input_ids"].tolist()).split("<|endoftext|>")
        assert len(pieces) >= 2 and all(p in source for p in pieces)  # paragraphs, eod-separated


def test_a_directory_given_with_a_trailing_slash_caches_under_its_name(tmp_path, monkeypatch):
    """`--data corpus/` tokenized into the cache as "-HASH.bin" (the basename of "corpus/" is
    empty), a file named after nothing; it is "corpus-HASH", the cache of `--data corpus`."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("To be, or not to be.\n\nThat is the question.\n")
    cache = str(tmp_path / "cache")
    slash = ensure_dataset(str(corpus) + "/", "gpt2", cache)
    assert os.path.basename(slash).startswith("corpus-"), slash
    assert ensure_dataset(str(corpus), "gpt2", cache) == slash
    monkeypatch.chdir(corpus)  # "--data ." inside it: ".-HASH", a hidden file, before
    assert ensure_dataset(".", "gpt2", cache) == ensure_dataset("./", "gpt2", cache) == slash
