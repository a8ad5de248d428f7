"""Megatron-LM's indexed dataset (MMIDIDX, version 1): read and written, checked against the
published layout with an independent numpy implementation written here from the spec."""

import json
from pathlib import Path

import numpy as np
import pytest

from megapar.cli.data import main as data_main
from megapar.cli.train import main as train
from megapar.data import IndexedDataset, asset_path

MAGIC = b"MMIDIDX\x00\x00"
CODES = {8: np.uint16, 4: np.int32}  # the two codes Megatron's preprocessing writes


def spec_write(prefix, docs, dtype=np.uint16):
    """Megatron's layout from the spec: each document cut into sentence-like sequences."""
    seqs, doc_idx = [], [0]
    for doc in docs:
        cut = [doc[i:i + 7] for i in range(0, len(doc), 7)]  # several sequences per document
        seqs += cut
        doc_idx.append(len(seqs))
    lengths = np.array([len(s) for s in seqs], dtype="<i4")
    item = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * item
    np.concatenate(seqs).astype(dtype).tofile(prefix + ".bin")
    code = {np.uint16: 8, np.int32: 4}[dtype]
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + np.uint64(1).tobytes() + np.uint8(code).tobytes())
        f.write(np.array([len(seqs), len(doc_idx)], dtype="<u8").tobytes())
        f.write(lengths.tobytes() + pointers.tobytes() + np.array(doc_idx, "<i8").tobytes())


def spec_read(prefix):
    """Documents of a Megatron dataset, read from the spec."""
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == MAGIC and np.frombuffer(raw, "<u8", 1, 9)[0] == 1
    dtype = CODES[raw[17]]
    n_seq, n_doc = np.frombuffer(raw, "<u8", 2, 18)
    pos = 34
    lengths = np.frombuffer(raw, "<i4", n_seq, pos)
    pointers = np.frombuffer(raw, "<i8", n_seq, pos + 4 * n_seq)
    doc_idx = np.frombuffer(raw, "<i8", n_doc, pos + 12 * n_seq)
    assert pos + 12 * n_seq + 8 * n_doc == len(raw)
    tokens = np.fromfile(prefix + ".bin", dtype=dtype)
    item = np.dtype(dtype).itemsize
    seqs = [tokens[p // item:p // item + n] for p, n in zip(pointers, lengths)]
    return [np.concatenate(seqs[a:b]) for a, b in zip(doc_idx[:-1], doc_idx[1:])]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    text = root / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:30_000])
    ours = str(root / "ours")
    assert data_main(["--input", str(text), "--output-prefix", ours, "--tokenizer",
                      "sentencepiece", "--split-lines", "--no-progress"]) == 0
    return root, text, ours


def test_megapar_writes_what_the_spec_reads(corpus):
    root, text, ours = corpus
    mt = str(root / "written")
    assert data_main(["--input", str(text), "--output-prefix", mt, "--tokenizer", "sentencepiece",
                      "--split-lines", "--no-progress", "--format", "megatron"]) == 0
    reference = IndexedDataset(ours)
    docs = spec_read(mt)
    assert len(docs) == reference.num_docs > 10
    for i, doc in enumerate(docs):
        assert doc.tolist() == reference.doc(i).tolist(), i  # eod included, as --append-eod
    loaded = IndexedDataset(mt)
    assert loaded.index_format == "megatron" and loaded.eod_id == reference.eod_id
    assert np.array_equal(loaded.doc_offsets, reference.doc_offsets)


def test_spec_built_dataset_trains_with_the_same_losses(corpus, tmp_path):
    root, _, ours = corpus
    reference = IndexedDataset(ours)
    theirs = str(tmp_path / "theirs")
    spec_write(theirs, [reference.doc(i) for i in range(reference.num_docs)])
    assert not Path(theirs + ".json").exists()
    with pytest.raises(ValueError, match="Megatron-LM index without megapar's .*--tokenizer"):
        IndexedDataset(theirs)
    loaded = IndexedDataset(theirs, "sentencepiece")
    assert np.array_equal(loaded.doc_offsets, reference.doc_offsets)
    assert np.array_equal(np.asarray(loaded.tokens), np.asarray(reference.tokens))

    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                 "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                 "attn_pdrop": 0.0}))
    losses = {}
    for name, prefix in (("megapar", ours), ("megatron", theirs)):
        log = tmp_path / f"{name}.jsonl"
        assert train(["--data", prefix, "--tokenizer", "sentencepiece", "--model", str(model),
                      "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
                      "--max-steps", "4", "--warmup-steps", "1", "--eval-interval", "0",
                      "--no-progress",
                      "--log-json", str(log)]) == 0
        losses[name] = [json.loads(x)["loss"] for x in log.read_text().splitlines()]
    assert len(losses["megapar"]) == 4 and losses["megapar"] == losses["megatron"]


def test_truncated_or_foreign_index_is_refused(corpus, tmp_path):
    _, _, ours = corpus
    bad = str(tmp_path / "bad")
    spec_write(bad, [np.arange(20), np.arange(5)])
    raw = Path(bad + ".idx").read_bytes()
    Path(bad + ".idx").write_bytes(raw[:-8])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        IndexedDataset(bad, "sentencepiece")
    Path(bad + ".idx").write_bytes(raw[:9] + np.uint64(2).tobytes() + raw[17:])
    with pytest.raises(ValueError, match="version 2; megapar reads version 1"):
        IndexedDataset(bad, "sentencepiece")


def test_a_multimodal_index_of_text_is_read_one_with_images_is_refused(tmp_path):
    docs = [np.arange(1, 20), np.arange(30, 45)]
    prefix = str(tmp_path / "mm")
    spec_write(prefix, docs)
    sequences = np.frombuffer(Path(prefix + ".idx").read_bytes(), "<u8", 1, 18)[0]
    with open(prefix + ".idx", "ab") as f:  # megatron-core's multimodal=True: int8 modes
        f.write(np.zeros(sequences, dtype=np.int8).tobytes())
    ds = IndexedDataset(prefix, "sentencepiece")
    assert [ds.doc(i).tolist() for i in range(ds.num_docs)] == [d.tolist() for d in docs]
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    raw[-1] = 1  # the last sequence is an image
    Path(prefix + ".idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"multimodal Megatron index: 1 of its {sequences} "
                                         f"sequences are not text"):
        IndexedDataset(prefix, "sentencepiece")


def test_doc_without_its_eod_drops_only_an_eod(corpus, tmp_path):
    _, _, ours = corpus
    with_eod = IndexedDataset(ours)
    assert with_eod.doc(0)[-1] == with_eod.eod_id
    assert with_eod.doc(0, include_eod=False).tolist() == with_eod.doc(0)[:-1].tolist()
    prefix = str(tmp_path / "no_eod")  # Megatron-LM data made without --append-eod
    docs = [np.arange(10, 20), np.arange(40, 43)]
    spec_write(prefix, docs)
    plain = IndexedDataset(prefix, "sentencepiece")
    assert plain.doc(1, include_eod=False).tolist() == [40, 41, 42]


def test_megapar_train_names_the_missing_tokenizer_of_a_megatron_dataset(tmp_path, capsys):
    # A Megatron-LM dataset (no megapar .json) of SentencePiece ids (end of document 2) trained
    # under the default gpt2 without a word: a 50,261-row model, end of document 50256, and
    # checkpoints recording (and --to-hf exporting) the GPT-2 BPE as its tokenizer
    prefix = str(tmp_path / "theirs")
    spec_write(prefix, [np.append(np.arange(3, 300), 2) for _ in range(8)])
    args = ["--model", "gpt2-tiny", "--seq-len", "32", "--max-steps", "1", "--no-progress"]
    for data in ([prefix], ["0.5", prefix, "0.5", prefix]):
        assert train(["--data", *data, *args]) == 2
        err = capsys.readouterr().err
        assert (f"--data {prefix} is a Megatron-LM dataset without megapar's {prefix}.json, so "
                f"nothing says which tokenizer made it; name it with --tokenizer") in err
        assert err.count("\n") == 1
