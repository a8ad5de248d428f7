"""MLMDataset: sample layout, determinism and masking statistics."""

import pytest
import torch

from megapar.data.indexed import IndexedDataset
from megapar.data.mlm_dataset import IGNORE_INDEX, MLMDataset
from megapar.data.preprocess import ensure_dataset
from megapar.data.tokenizers import asset_path, load_tokenizer


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory):
    cache = tmp_path_factory.mktemp("mlm")
    tok = load_tokenizer("sentencepiece")
    prefix = ensure_dataset(asset_path("shakespeare_sample.txt"), "sentencepiece", str(cache))
    return IndexedDataset(prefix), tok


def _segments(s, sp):
    ids, tt, am = s["input_ids"], s["token_type_ids"], s["attention_mask"]
    n_real = int(am.sum())
    seps = (ids[:n_real] == sp.sep_id).nonzero().flatten().tolist()
    return ids, tt, am, n_real, seps


def test_layout_cls_a_sep_b_sep_pad(sample_data):
    ds, tok = sample_data
    sp = tok.special_tokens()
    mlm = MLMDataset(ds, 64, sp, seed=1)
    assert len(mlm) > 1000
    for i in range(0, len(mlm), 97):
        s = mlm[i]
        assert all(v.dtype == torch.long and v.shape == (64,) for v in s.values())
        ids, tt, am, n, seps = _segments(s, sp)
        assert ids[0] == sp.cls_id and len(seps) == 2 and seps[1] == n - 1
        assert am[:n].eq(1).all() and am[n:].eq(0).all() and ids[n:].eq(sp.pad_id).all()
        a_end = seps[0]
        assert a_end >= 2 and n - 1 - a_end >= 2  # A and B both non-empty
        assert tt[:a_end + 1].eq(0).all() and tt[a_end + 1:n].eq(1).all() and tt[n:].eq(0).all()
        # unmasked real tokens of A and B are the chunk read straight from the dataset
        orig = torch.where(s["labels"] != IGNORE_INDEX, s["labels"], ids)
        chunk = ds.get(int(mlm.chunk_start[i]), int(mlm.chunk_len[i])).tolist()
        assert orig[1:a_end].tolist() + orig[a_end + 1:n - 1].tolist() == chunk


def test_deterministic_in_seed_and_index(sample_data):
    ds, tok = sample_data
    a = MLMDataset(ds, 48, tok, seed=7)
    b = MLMDataset(ds, 48, tok.special_tokens(), seed=7)
    c = MLMDataset(ds, 48, tok, seed=8)
    for i in (0, 5, 123):
        x, y = a[i], b[i]
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert any(not torch.equal(a[i]["labels"], c[i]["labels"]) for i in range(5))
    fresh = MLMDataset(ds, 48, tok, seed=7)  # access order does not matter: 123 first here
    late, early = fresh[123], fresh[5]
    assert all(torch.equal(late[k], a[123][k]) and torch.equal(early[k], a[5][k]) for k in late)


def test_masking_proportions(sample_data):
    ds, tok = sample_data
    sp = tok.special_tokens()
    reserved = set(sp.reserved_ids)
    mlm = MLMDataset(ds, 128, sp, seed=0)
    chosen = candidates = masked = random = kept = 0
    for i in range(min(len(mlm), 1500)):
        s = mlm[i]
        ids, labels, am = s["input_ids"], s["labels"], s["attention_mask"]
        sel = labels != IGNORE_INDEX
        assert sel.sum() >= 1
        assert not (sel & (am == 0)).any()
        assert not any(int(t) in reserved for t in labels[sel])  # never a special token
        n_real = int(am.sum())
        orig = torch.where(sel, labels, ids)[:n_real]
        candidates += sum(1 for t in orig.tolist() if t not in reserved)
        chosen += int(sel.sum())
        m = sel & (ids == sp.mask_id)
        k = sel & (ids == labels)
        r = sel & ~m & ~k
        masked, kept, random = masked + int(m.sum()), kept + int(k.sum()), random + int(r.sum())
        assert all(0 <= int(t) < sp.base_vocab_size and int(t) not in reserved for t in ids[r])
    assert 0.14 < chosen / candidates < 0.17
    assert 0.77 < masked / chosen < 0.83
    # random replacements equal to the original count as "kept": ~10% + ~0.1%
    assert 0.08 < random / chosen < 0.12
    assert 0.08 < kept / chosen < 0.12


def test_gpt2_specials_and_tiny_chunks(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("One two three four five six seven.\n\nHi\n\nA much longer paragraph " + "word " * 40)
    ds = IndexedDataset(ensure_dataset(str(text), "gpt2", str(tmp_path)))
    tok = load_tokenizer("gpt2")
    mlm = MLMDataset(ds, 16, {"pad_id": tok.pad_id, "cls_id": tok.cls_id, "sep_id": tok.sep_id,
                              "mask_id": tok.mask_id}, seed=0)
    # "Hi" is 1 token -> dropped; the long paragraph is cut into chunks of <= 13 tokens
    assert int(mlm.chunk_len.max()) == 13 and int(mlm.chunk_len.min()) >= 2
    s = mlm[0]
    assert s["input_ids"][0] == 50258 and s["input_ids"][int(s["attention_mask"].sum()) - 1] == 50259
    assert mlm.special.base_vocab_size == 50257 and 50256 in mlm.special.reserved_ids
    with pytest.raises(ValueError, match="lacks"):
        MLMDataset(ds, 16, {"pad_id": 0}, seed=0)


def test_a_document_without_an_eod_keeps_its_last_token(sample_data, tmp_path):
    """A Megatron-LM dataset written without --append-eod (its BERT preprocessing's usual
    form) ends its documents with a real token: the samples cover every token of every
    document (the last one of each was dropped as if it were the eod); with the eod, all but
    it."""
    import numpy as np

    from megapar.data.megatron import write_index

    ds, tok = sample_data
    docs = [ds.doc(i, include_eod=False) for i in range(40)]
    assert all(len(d) and d[-1] != ds.eod_id for d in docs)
    prefix = str(tmp_path / "noeod")
    np.concatenate(docs).astype(ds.dtype).tofile(prefix + ".bin")
    write_index(prefix + ".idx", ds.dtype, np.array([len(d) for d in docs]))
    for indexed, body in ((IndexedDataset(prefix, "sentencepiece"), docs),
                          (ds, [ds.doc(i, include_eod=False) for i in range(len(ds))])):
        mlm = MLMDataset(indexed, 32, tok, seed=0)
        got = np.concatenate([indexed.get(int(s), int(n))
                              for s, n in zip(mlm.chunk_start, mlm.chunk_len)])
        # every chunk of 2 or more tokens: each document's tokens, its eod (if any) left out
        most = 32 - 3
        want = np.concatenate([d[k:k + most] for d in body for k in range(0, len(d), most)
                               if len(d[k:k + most]) >= 2])
        assert got.tolist() == want.tolist()
