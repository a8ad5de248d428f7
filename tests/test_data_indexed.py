"""Indexed dataset files, preprocessing (incl. workers determinism), the CLI and the cache."""

import json
import os

import numpy as np
import pytest
from conftest import shared_data

import megapar.data.preprocess as pp
from megapar.cli.data import main as data_main
from megapar.data.indexed import IDX_MAGIC, IndexedDataset, IndexedDatasetBuilder
from megapar.data.preprocess import ensure_dataset, preprocess_files
from megapar.data.tokenizers import asset_path, load_tokenizer


def test_builder_file_layout(tmp_path):
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix, vocab_size=1000, eod_id=2, tokenizer_spec={"kind": "x"}) as b:
        b.add_document([5, 6, 7])
        b.add_document([])
        b.add_document([999])
        b.finalize()
    raw = open(prefix + ".bin", "rb").read()
    assert raw == np.array([5, 6, 7, 2, 2, 999, 2], dtype="<u2").tobytes()
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:8] == IDX_MAGIC
    assert np.frombuffer(idx[8:16], "<u8")[0] == 3
    assert np.frombuffer(idx[16:], "<i8").tolist() == [0, 4, 5, 7]
    meta = json.load(open(prefix + ".json"))
    assert meta["dtype"] == "uint16" and meta["num_docs"] == 3 and meta["num_tokens"] == 7
    ds = IndexedDataset(prefix)
    assert isinstance(ds.tokens, np.memmap)
    assert ds.num_docs == 3 and ds.vocab_size == 1000 and ds.tokenizer_spec == {"kind": "x"}
    assert ds.doc(0, include_eod=False).tolist() == [5, 6, 7]
    assert ds.get(3, 3).tolist() == [2, 2, 999]
    assert [p for p in os.listdir(tmp_path) if ".tmp" in p] == []


def test_uint32_for_large_vocab_and_bad_ids(tmp_path):
    prefix = str(tmp_path / "big")
    with IndexedDatasetBuilder(prefix, vocab_size=70000, eod_id=69999, tokenizer_spec={}) as b:
        b.add_document([65536, 1])
        b.finalize()
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype("<u4") and ds.get(0, 3).tolist() == [65536, 1, 69999]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        with IndexedDatasetBuilder(str(tmp_path / "new" / "sub" / "bad"), 100, 0, {}) as b:
            b.add_document([100])
    # aborted: nothing left, not even the directories made for it (megapar-data failing on a
    # later input left --output-prefix's new directories behind, empty)
    assert not (tmp_path / "new").exists()


def test_a_full_disk_leaves_no_temporary_and_names_the_dataset(tmp_path):
    """A --data-cache on a full disk kept the partial PREFIX.bin.tmp-* (the disk still full):
    the abort's close flushed its buffer again, raised ENOSPC, and removed nothing; the error
    named no file."""
    import errno

    prefix = str(tmp_path / "new" / "ds")
    with pytest.raises(OSError) as e:
        with IndexedDatasetBuilder(prefix, 100, 0, {}) as b:
            b.add_document([1, 2, 3])

            def full(*args):
                raise OSError(errno.ENOSPC, "No space left on device")

            b._bin.close = full  # the buffered file's flush at close, on a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.filename == prefix
    assert not (tmp_path / "new").exists()


def test_missing_files_name_the_fix(tmp_path):
    prefix = str(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match=r"nothing\.json not found; create it with .*megapar-data"):
        IndexedDataset(prefix)


def test_preprocess_inputs_and_document_modes(tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "b" / "2.txt").write_text("Second file.\n\nIts second paragraph.\n")
    (src / "1.txt").write_text("First file.\n")
    (src / "skip.bin").write_text("not text")
    (src / "c.jsonl").write_text('{"text": "json doc one"}\n\n{"text": "json doc two", "id": 3}\n')
    tok = load_tokenizer("gpt2")
    ds = IndexedDataset(preprocess_files([str(src)], str(tmp_path / "whole"), "gpt2", progress=False))
    # sorted recursive walk: 1.txt, b/2.txt, c.jsonl ; one document per .txt file
    docs = [tok.decode(ds.doc(i, include_eod=False)) for i in range(ds.num_docs)]
    assert docs == ["First file.\n", "Second file.\n\nIts second paragraph.\n", "json doc one", "json doc two"]
    assert all(ds.doc(i)[-1] == 50256 for i in range(ds.num_docs))
    ds = IndexedDataset(preprocess_files([str(src)], str(tmp_path / "para"), "gpt2", split_paragraphs=True,
                                   progress=False))
    docs = [tok.decode(ds.doc(i, include_eod=False)) for i in range(ds.num_docs)]
    assert docs == ["First file.", "Second file.", "Its second paragraph.", "json doc one", "json doc two"]
    with pytest.raises(ValueError, match="c.jsonl:1.*--jsonl-key"):
        preprocess_files([str(src / "c.jsonl")], str(tmp_path / "k"), "gpt2", jsonl_key="body", progress=False)


def test_output_identical_whatever_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(pp, "BATCH_DOCS", 7)  # many small work items, so ordering matters
    sample = asset_path("shakespeare_sample.txt")
    outs = []
    for workers in (1, 3):
        prefix = preprocess_files([sample], str(tmp_path / f"w{workers}"), "gpt2", workers=workers,
                            split_paragraphs=True, progress=False)
        outs.append([open(prefix + ext, "rb").read() for ext in (".bin", ".idx", ".json")])
    assert outs[0] == outs[1]
    ds = IndexedDataset(str(tmp_path / "w3"))
    assert ds.num_docs > 1000 and ds.num_tokens > 80000
    # the tokens of the whole stream decode back to the paragraphs of the source text
    tok = load_tokenizer("gpt2")
    assert tok.decode(ds.doc(0, include_eod=False)) == "MACBETH"


def test_cli_tokenize_and_train_sentencepiece(tmp_path, capsys):
    sample = asset_path("shakespeare_sample.txt")
    rc = data_main(["--input", sample, "--output-prefix", str(tmp_path / "gpt"), "--tokenizer", "gpt2",
                    "--split-lines", "--workers", "2", "--no-progress"])
    assert rc == 0 and "documents" in capsys.readouterr().out
    assert IndexedDataset(str(tmp_path / "gpt")).vocab_size == 50261
    rc = data_main(["--train-sentencepiece", "--vocab-size", "400", "--input", sample,
                    "--output-prefix", str(tmp_path / "sp"), "--split-lines", "--no-progress"])
    assert rc == 0
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    # the special tokens are user-defined symbols of the trained model: nothing appended
    assert tok.vocab_size == 400 and tok.mask_id < 400 and tok.pad_id < 400
    ds = IndexedDataset(str(tmp_path / "sp"))
    assert ds.tokenizer_spec["kind"] == "sentencepiece" and ds.eod_id == tok.eod_id
    assert tok.decode(ds.doc(0, include_eod=False)) == "MACBETH"
    assert tok.decode(ds.doc(1, include_eod=False)) == "by William Shakespeare"
    assert data_main(["--input", sample, "--output-prefix", str(tmp_path / "x"), "--vocab-size", "5"]) == 2
    assert "--train-sentencepiece" in capsys.readouterr().err


def test_ensure_dataset_caches_by_content_and_tokenizer(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be.\n\nThat is the question.\n")
    cache = tmp_path / "cache"
    p1 = ensure_dataset(str(text), "gpt2", str(cache))
    mtime = os.path.getmtime(p1 + ".bin")
    assert ensure_dataset(str(text), "gpt2", str(cache)) == p1
    assert os.path.getmtime(p1 + ".bin") == mtime  # cached, not rewritten
    assert IndexedDataset(p1).num_docs == 2  # paragraphs are documents by default
    p2 = ensure_dataset(str(text), "sentencepiece", str(cache))
    assert p2 != p1 and IndexedDataset(p2).tokenizer_spec["kind"] == "sentencepiece"
    text.write_text("Something else entirely.\n")
    p3 = ensure_dataset(str(text), "gpt2", str(cache))
    assert p3 not in (p1, p2)
    assert not [f for f in os.listdir(cache) if ".tmp" in f]


def test_shared_corpus_directory(tmp_path):
    corpus = shared_data("corpus", "shakespeare")
    sub = tmp_path / "plays"
    sub.mkdir()
    for name in ("sonnets_gut.txt", "phoenix_and_the_turtle_gut.txt"):
        (sub / name).write_bytes(open(os.path.join(corpus, name), "rb").read())
    ds = IndexedDataset(preprocess_files([str(sub)], str(tmp_path / "p"), "gpt2", progress=False))
    tok = load_tokenizer("gpt2")
    first = open(sub / "phoenix_and_the_turtle_gut.txt").read()  # sorted: phoenix < sonnets
    assert ds.num_docs == 2 and tok.decode(ds.doc(0, include_eod=False)) == first
