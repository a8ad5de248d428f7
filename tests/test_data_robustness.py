"""Bad or unusual data inputs: one clear line (exit code 2) before any work, and the same text
gives the same tokens whatever its form (CRLF / CR / LF line endings, .txt or .jsonl)."""

import json
import re
import string
from pathlib import Path

import numpy as np
import pytest

from megapar.cli.data import main as data_main
from megapar.data import IndexedDataset, asset_path, load_tokenizer
from megapar.data.preprocess import ensure_dataset, iter_documents, normalize_newlines

TEXT = Path(asset_path("shakespeare_sample.txt")).read_text()[:20000]


def _files(prefix):
    return [Path(str(prefix) + ext).read_bytes() for ext in (".bin", ".idx")]


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    line = err.splitlines()[-1]
    assert line.startswith("megapar-data: error: "), err
    for needle in needles:
        assert needle in line, line
    return line


# --- 1. line endings ---------------------------------------------------------------------------

def test_normalize_newlines():
    assert normalize_newlines("a\r\nb\rc\n\r\nd") == "a\nb\nc\n\nd"
    assert normalize_newlines("plain\n") == "plain\n"


@pytest.mark.parametrize("split", [True, False])
def test_crlf_and_cr_files_give_the_lf_dataset_byte_for_byte(tmp_path, split):
    lf = tmp_path / "lf.txt"
    lf.write_bytes(TEXT.encode())
    (tmp_path / "crlf.txt").write_bytes(TEXT.replace("\n", "\r\n").encode())
    (tmp_path / "cr.txt").write_bytes(TEXT.replace("\n", "\r").encode())
    outs = {}
    for name in ("lf", "crlf", "cr"):
        prefix = tmp_path / "data" / name
        args = ["--input", str(tmp_path / f"{name}.txt"), "--output-prefix", str(prefix),
                "--no-progress"] + (["--split-lines"] if split else [])
        assert data_main(args) == 0
        outs[name] = _files(prefix)
    assert outs["crlf"] == outs["lf"] and outs["cr"] == outs["lf"]
    ds = IndexedDataset(tmp_path / "data" / "crlf")
    if split:  # blank-line document splitting works on CRLF text too
        assert ds.num_docs == len([p for p in TEXT.split("\n\n") if p.strip()]) > 10
    tok = load_tokenizer("gpt2")
    assert tok.encode("\r")[0] not in ds.tokens


def test_crlf_inside_jsonl_records_is_normalised(tmp_path):
    """Records ended by CR alone (old Mac) too: they were one line, 'not valid JSON (Extra
    data)'; the --help says every input kind reads CR as LF."""
    paras = [p for p in TEXT.split("\n\n") if p.strip()][:20]
    (tmp_path / "lf.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    for name, end in (("crlf", "\r\n"), ("cr", "\r")):
        (tmp_path / f"{name}.jsonl").write_bytes("".join(
            json.dumps({"text": p.replace("\n", end)}) + end for p in paras).encode())
        docs = [t for t, _ in iter_documents([str(tmp_path / f"{name}.jsonl")])]
        assert docs == paras
    for name in ("lf", "crlf", "cr"):
        assert data_main(["--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix",
                          str(tmp_path / name), "--no-progress"]) == 0
    assert _files(tmp_path / "crlf") == _files(tmp_path / "lf") == _files(tmp_path / "cr")


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json array", "json object"])
def test_a_utf8_byte_order_mark_gives_the_same_tokens_as_without(tmp_path, kind):
    """Windows tools start UTF-8 files with a byte-order mark (EF BB BF): a .txt tokenized it
    into three tokens of its own, a .json array or object was refused as not JSON ('list
    indices must be integers or slices, not str', 'Expecting property name ...')."""
    paras = [p for p in TEXT.split("\n\n") if p.strip()][:5]
    body = {"txt": TEXT, "jsonl": "".join(json.dumps({"text": p}) + "\n" for p in paras),
            "json array": json.dumps([{"text": p} for p in paras], indent=1),
            "json object": json.dumps({"text": TEXT}, indent=1)}[kind]
    suffix = kind.split()[0]
    outs = []
    for name, bom in (("plain", b""), ("bom", b"\xef\xbb\xbf")):
        (tmp_path / f"{name}.{suffix}").write_bytes(bom + body.encode())
        assert data_main(["--input", str(tmp_path / f"{name}.{suffix}"), "--output-prefix",
                          str(tmp_path / "out" / name), "--no-progress"]) == 0
        outs.append(_files(tmp_path / "out" / name))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_utf16_text_is_refused_not_tokenized_as_nul_bytes(tmp_path, capsys, encoding):
    """A text saved as UTF-16 (Windows Notepad's "Unicode", PowerShell's `>`) is mostly valid
    UTF-8 bytes, every other one NUL: it was tokenized into that with a warning of "2 bytes of
    invalid UTF-8 replaced". Its byte-order mark says what it is: one line naming the fix."""
    bom = {"utf-16": b"", "utf-16-be": b"\xfe\xff", "utf-32": b""}[encoding]
    (tmp_path / "wide.txt").write_bytes(bom + TEXT[:5000].encode(encoding))
    out = str(tmp_path / "out" / "wide")
    assert data_main(["--input", str(tmp_path / "wide.txt"), "--output-prefix", out,
                      "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    name = encoding.upper()[:6]
    assert f"wide.txt is {name} (it starts with {name}'s byte-order mark), not UTF-8" in err, err
    assert f"iconv -f {name} -t UTF-8" in err and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="not UTF-8"):
        ensure_dataset(str(tmp_path / "wide.txt"), "gpt2", str(tmp_path / "cache"))


def test_a_utf16_text_is_refused_even_where_a_cache_made_before_the_refusal_exists(
        tmp_path, monkeypatch):
    """megapar-train's cache is keyed by the text's bytes, which the refusal did not change: a
    UTF-16 text tokenized before it was refused kept being reused. The byte-order mark is
    checked before the cache is looked at (here the old copy is made from the text's UTF-8
    form at the UTF-16 file's key)."""
    import megapar.data.inputs as inputs
    import megapar.data.preprocess as preprocess

    (tmp_path / "utf8.txt").write_bytes(TEXT[:5000].encode())
    (tmp_path / "wide.txt").write_bytes(TEXT[:5000].encode("utf-16"))
    real = preprocess.preprocess_files
    with monkeypatch.context() as old:  # the cache a run before the refusal left
        old.setattr(preprocess, "check_not_wide", lambda *a, **k: None, raising=False)
        old.setattr(inputs, "check_not_wide", lambda *a, **k: None)  # expand_inputs' check
        old.setattr(inputs, "check_not_binary", lambda *a, **k: None)  # and its NUL bytes
        old.setattr(preprocess, "preprocess_files",
                    lambda files, prefix, *a, **k: real([str(tmp_path / "utf8.txt")], prefix,
                                                        *a, **k))
        cached = ensure_dataset(str(tmp_path / "wide.txt"), "gpt2", str(tmp_path / "cache"))
    assert Path(cached + ".bin").is_file()
    with pytest.raises(ValueError, match=r"wide.txt is UTF-16 \(it starts with UTF-16's "
                                         r"byte-order mark\), not UTF-8; convert it"):
        ensure_dataset(str(tmp_path / "wide.txt"), "gpt2", str(tmp_path / "cache"))


def test_a_binary_input_is_refused_before_any_work_and_text_of_any_name_is_read(
        tmp_path, capsys, monkeypatch):
    """A compressed, archived, NumPy or other binary file given as an input was tokenized as
    text (its bytes decoded, invalid UTF-8 refused only past 0.1 % and after the tokenizer
    loaded; NUL bytes, valid UTF-8, silently): refused in one line before the tokenizer loads,
    naming what it is, what is read and the fix. Text without a known suffix is still read."""
    import bz2
    import gzip
    import zipfile

    import megapar.cli.data as data_cli

    raw = TEXT[:3000].encode()
    binaries = {
        # gunzip -k refused a name without its suffix: to standard output, named by it
        "t.txt.gz": (gzip.compress(raw), "is gzip-compressed",
                     f"gunzip -c {tmp_path / 't.txt.gz'} > {tmp_path / 't.txt'}"),
        "t.bz2": (bz2.compress(raw), "is bzip2-compressed",
                  f"bunzip2 -c {tmp_path / 't.bz2'} > {tmp_path / 't.txt'}"),
        "plays.txt": (gzip.compress(raw), "is gzip-compressed",
                      f"gunzip -c {tmp_path / 'plays.txt'} > {tmp_path / 'plays-text.txt'}"),
        "ids.npy": (None, "is a NumPy array (.npy)", "save the text it holds"),
        "zeros.bin": (bytes(2000), "is binary (NUL bytes in its first KiB)", "iconv"),
        "t.zip": (None, "is a zip archive", "unzip "),
    }
    np.save(tmp_path / "ids.npy", np.arange(300, dtype=np.int64))
    with zipfile.ZipFile(tmp_path / "t.zip", "w") as z:
        z.writestr("a.txt", raw)
    monkeypatch.setattr(data_cli, "train_tokenizer",
                        lambda *a, **k: pytest.fail("the tokenizer loaded for a binary input"))
    for name, (content, kind, fix) in binaries.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        assert data_main(["--input", str(tmp_path / name), "--output-prefix",
                          str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            f"megapar-data: error: input {tmp_path / name} {kind}, not text; the inputs read "
            "are UTF-8 text (.txt or any other name), .jsonl / .json and .parquet: "), err
        assert fix in err and err.endswith(", and pass that\n"), err
    monkeypatch.undo()
    for name in ("hamlet", "notes.md", "BZh.txt"):  # text, whatever its name (or first bytes)
        (tmp_path / name).write_text("BZh: " + TEXT[:2000])
        assert data_main(["--input", str(tmp_path / name), "--output-prefix",
                          str(tmp_path / name) + "-out", "--tokenizer", "sentencepiece",
                          "--no-progress"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name, text", [
    ("docs.jsonl", '{"text": "one"}\n{"text": "two"}\n'),
    ("docs.json", '[{"text": "one"}, {"text": "two"}]'),
])
def test_a_utf16_json_input_is_refused_as_a_utf16_text_is(tmp_path, capsys, name, text):
    """A UTF-16 .jsonl's first line parsed (json detects UTF-16) and its second was named as
    a bad line; a UTF-16 .json array was read as JSON Lines whose line is an array. Both are
    refused by their byte-order mark as a .txt is."""
    path = tmp_path / name
    path.write_bytes(text.encode("utf-16"))
    assert data_main(["--input", str(path), "--output-prefix", str(tmp_path / "out"),
                      "--no-progress"]) == 2
    converted = path.name.replace(".", "-utf8.")
    _one_line_error(capsys, f"{path} is UTF-16 (it starts with UTF-16's byte-order mark), not "
                            f"UTF-8; convert it to UTF-8 (e.g. iconv -f UTF-16 -t UTF-8 {path} "
                            f"> {tmp_path / converted}) and pass that")


def test_megapar_train_raw_text_with_a_byte_order_mark_is_cached_anew(tmp_path, monkeypatch):
    """megapar-train's cache (keyed by the text's bytes) held such a file with the mark as
    three tokens: its key now says the mark is dropped, so that copy is not reused."""
    import megapar.data.preprocess as preprocess

    (tmp_path / "plain.txt").write_bytes(TEXT.encode())
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + TEXT.encode())
    a = ensure_dataset(str(tmp_path / "plain.txt"), "gpt2", str(tmp_path / "cache"))
    b = ensure_dataset(str(tmp_path / "bom.txt"), "gpt2", str(tmp_path / "cache"))
    assert _files(a) == _files(b)
    monkeypatch.setattr(preprocess, "_starts_with_bom", lambda path: False)  # the old key
    old = ensure_dataset(str(tmp_path / "bom.txt"), "gpt2", str(tmp_path / "old"))
    assert Path(old).name != Path(b).name  # another key


def test_megapar_train_raw_text_cache_normalises_crlf(tmp_path):
    """megapar-train --data FILE.txt tokenizes through ensure_dataset: the same code."""
    (tmp_path / "lf.txt").write_bytes(TEXT.encode())
    (tmp_path / "crlf.txt").write_bytes(TEXT.replace("\n", "\r\n").encode())
    a = ensure_dataset(str(tmp_path / "lf.txt"), "gpt2", str(tmp_path / "cache"))
    b = ensure_dataset(str(tmp_path / "crlf.txt"), "gpt2", str(tmp_path / "cache"))
    assert a != b and _files(a) == _files(b)


# --- 2. damaged dataset files ------------------------------------------------------------------

@pytest.fixture
def dataset(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    prefix = tmp_path / "d"
    assert data_main(["--input", str(tmp_path / "t.txt"), "--output-prefix", str(prefix),
                      "--split-lines", "--no-progress"]) == 0
    return str(prefix)


def truncated_index_error(prefix: str, size: int) -> str:
    """The error of opening `prefix` after cutting its .idx to `size` bytes."""
    data = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(data[:size])
    with pytest.raises(ValueError) as e:
        IndexedDataset(prefix)
    return str(e.value)


@pytest.mark.parametrize("size", [0, 5, 12, 50])
def test_truncated_idx_names_the_file_and_the_fix(dataset, size):
    msg = truncated_index_error(dataset, size)
    assert dataset + ".idx" in msg and "megapar-data" in msg and "\n" not in msg
    assert ("truncated" in msg or "not a megapar index" in msg) and f"{size} bytes" in msg


@pytest.mark.parametrize("size", [0, 5])
def test_an_idx_too_short_for_any_magic_is_named_not_a_missing_json(tmp_path, size):
    """A Megatron-LM dataset has no megapar .json: its .idx cut to nothing is what is wrong."""
    (tmp_path / "t.txt").write_text(TEXT)
    prefix = str(tmp_path / "mt")
    assert data_main(["--input", str(tmp_path / "t.txt"), "--output-prefix", prefix,
                      "--split-lines", "--format", "megatron", "--no-progress"]) == 0
    Path(prefix + ".json").unlink()
    Path(prefix + ".idx").write_bytes(Path(prefix + ".idx").read_bytes()[:size])
    with pytest.raises(ValueError) as e:
        IndexedDataset(prefix, "gpt2")
    msg = str(e.value)
    assert f"{prefix}.idx is " in msg and f"({size} bytes)" in msg and ".json" not in msg, msg


@pytest.mark.parametrize("line, message", [
    ('{"text": "a broken\n', ":2: the line is not valid JSON (Unterminated string starting "
     "at column 10); repair or delete the line (each line of a JSON Lines file is one JSON "
     "object)"),
    ('{"text": "half"\n', ":2: the line is not valid JSON (Expecting ',' delimiter at "
     "column 16); repair or delete the line"),
    ('["a list"]\n', ":2: the line is an array, not a JSON object with a string field 'text'; "
     'make it an object such as {"text": "..."}'),
    ('{"body": "x", "id": 3}\n', ":2: the object has no field 'text' (its fields: 'body', "
     "'id'); pass --jsonl-key naming the text field, or add 'text' to the line"),
])
def test_a_bad_jsonl_line_is_named_with_its_own_fix(tmp_path, capsys, line, message):
    """A line that is not JSON was reported as "expected a JSON object with a string field
    'text' (JSONDecodeError(...)); fix the line or pass --jsonl-key", though no --jsonl-key
    mends broken JSON: each kind of bad line is named with the fix that fits it, --jsonl-key
    only for a missing field."""
    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"text": "a good line"}\n' + line)
    assert data_main(["--input", str(bad), "--output-prefix", str(tmp_path / "out"),
                      "--no-progress"]) == 2
    _one_line_error(capsys, f"{bad}{message}")
    assert ("--jsonl-key" in message) == ("no field" in message)


def test_a_missing_field_named_by_jsonl_key_and_a_prefix_ending_bin(tmp_path, capsys):
    """A line without the field --jsonl-key names said "pass --jsonl-key naming the text
    field", which the user had done; --output-prefix data/zz.bin wrote zz.bin.bin (a new user's
    tryout): each is one line with the fix that fits."""
    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"body": "a good line"}\n{"text": "x"}\n')
    assert data_main(["--input", str(bad), "--jsonl-key", "body", "--output-prefix",
                      str(tmp_path / "out"), "--no-progress"]) == 2
    _one_line_error(capsys, f"{bad}:2: the object has no field 'body' (its fields: 'text'); add "
                            f"'body' (--jsonl-key's) to the line, or give --jsonl-key the field "
                            f"every line has")
    prefix = tmp_path / "zz.bin"
    assert data_main(["--input", str(bad), "--output-prefix", str(prefix), "--no-progress"]) == 2
    _one_line_error(capsys, f"--output-prefix {prefix} names a file megapar-data writes: it "
                            f"would write {prefix}.bin, {prefix}.idx and .json; give the prefix, "
                            f"--output-prefix {tmp_path / 'zz'}")
    for name in ("zz.json", "zz.BIN"):  # any case, and the .json (a re-test)
        assert data_main(["--input", str(bad), "--output-prefix", str(tmp_path / name),
                          "--no-progress"]) == 2
        _one_line_error(capsys, f"--output-prefix {tmp_path / name} names a file megapar-data")
    bad.write_text('{"body": null}\n')  # a field of no string, --jsonl-key given already
    assert data_main(["--input", str(bad), "--jsonl-key", "body", "--output-prefix",
                      str(tmp_path / "out"), "--no-progress"]) == 2
    _one_line_error(capsys, f"{bad}:1: field 'body' is null, not a string; fix the line "
                            f"(--jsonl-key's field holds the text)")
    assert not list(tmp_path.glob("zz*")) and not list(tmp_path.glob("out*"))


def test_a_broken_json_array_names_the_file_and_line(tmp_path, capsys):
    """A .json array that is not valid JSON said only "Expecting ',' delimiter: line 3 column 1
    (char 29)", without the file."""
    bad = tmp_path / "docs.json"
    bad.write_text('[{"text": "a"},\n{"text": "b"}\n{"text": "c"}]\n')
    assert data_main(["--input", str(bad), "--output-prefix", str(tmp_path / "out"),
                      "--no-progress"]) == 2
    _one_line_error(capsys, f"{bad}:3: the file is not valid JSON (Expecting ',' delimiter at "
                            "column 1); repair it there")


def test_a_garbage_parquet_file_is_named(tmp_path, capsys):
    bad = tmp_path / "rows.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file at all " * 20)
    assert data_main(["--input", str(bad), "--output-prefix", str(tmp_path / "out"),
                      "--no-progress"]) == 2
    _one_line_error(capsys, f"{bad} is not a readable parquet file")
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("size", [5, 20, 40, 100])
def test_truncated_megatron_idx_names_the_file_and_the_fix(tmp_path, size):
    (tmp_path / "t.txt").write_text(TEXT)
    prefix = str(tmp_path / "mt")
    assert data_main(["--input", str(tmp_path / "t.txt"), "--output-prefix", prefix,
                      "--split-lines", "--format", "megatron", "--no-progress"]) == 0
    msg = truncated_index_error(prefix, size)
    assert prefix + ".idx" in msg and "megapar-data" in msg and "\n" not in msg


@pytest.mark.parametrize("fmt", ["megapar", "megatron"])
def test_a_bin_cut_short_or_too_long_says_which_and_the_fix(tmp_path, fmt):
    # it said "the files are from different runs -- regenerate them" for a .bin cut short, named
    # a .json a Megatron-LM dataset does not have, and not the tool that re-creates the files
    (tmp_path / "t.txt").write_text(TEXT)
    prefix = str(tmp_path / "d")
    assert data_main(["--input", str(tmp_path / "t.txt"), "--output-prefix", prefix,
                      "--split-lines", "--format", fmt, "--no-progress"]) == 0
    if fmt == "megatron":
        Path(prefix + ".json").unlink()
    whole = Path(prefix + ".bin").read_bytes()
    tokens = len(whole) // 2
    for cut, what in ((whole[:1000], "cut short (an interrupted copy?)"), (whole + b"\0\0", "too long")):
        Path(prefix + ".bin").write_bytes(cut)
        with pytest.raises(ValueError) as e:
            IndexedDataset(prefix, "gpt2")
        describer = prefix + (".json" if fmt == "megapar" else ".idx")
        assert str(e.value) == (
            f"{prefix}.bin holds {len(cut):,} bytes but {describer} describes {tokens:,} uint16 "
            f"tokens ({len(whole):,} bytes): it is {what} or from another run; re-create the "
            f"dataset with megapar-data")


@pytest.mark.parametrize("content, needle", [
    ("{\n", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list"),
    ('{"format": "megapar-indexed", "version": 1}', "lacks dtype"),
    ('{"format": "megapar-indexed", "version": 1, "dtype": "float99", "vocab_size": 5, '
     '"eod_id": 1, "tokenizer": {}, "num_tokens": 3}', "invalid dtype"),
])
def test_broken_json_names_the_file_and_the_fix(dataset, content, needle):
    Path(dataset + ".json").write_text(content)
    with pytest.raises(ValueError) as e:
        IndexedDataset(dataset)
    msg = str(e.value)
    assert msg.startswith(dataset + ".json") and needle in msg and "megapar-data" in msg
    assert "\n" not in msg


def test_megapar_train_reports_a_damaged_dataset_with_exit_code_2(dataset, capsys):
    from megapar.cli.train import main as train_main

    Path(dataset + ".idx").write_bytes(Path(dataset + ".idx").read_bytes()[:50])
    assert train_main(["--data", dataset, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megapar-train: error: " + dataset + ".idx is truncated"), err


# --- 3. tokenizers that encode text to nothing -------------------------------------------------

def _hf_dir(path, vocab):
    from tokenizers import Tokenizer, models

    path.mkdir()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(path)


def test_tokenizer_json_with_only_special_tokens_is_refused(tmp_path, capsys):
    directory = _hf_dir(tmp_path / "hftok", {})
    with pytest.raises(ValueError, match="encodes text to nothing: its tokenizer.json has 1 "
                                         "tokens, only special ones; save it with AutoTokenizer"):
        load_tokenizer(directory)
    (tmp_path / "t.txt").write_text(TEXT)
    assert data_main(["--input", str(tmp_path / "t.txt"), "--output-prefix",
                      str(tmp_path / "out"), "--tokenizer", directory]) == 2
    _one_line_error(capsys, "hftok encodes text to nothing")
    assert not list(tmp_path.glob("out*"))


def test_transformers_saved_tokenizer_is_loaded_or_refused(tmp_path):
    """The repro: GPT2TokenizerFast(vocab_file, merges_file).save_pretrained writes a
    tokenizer.json with an empty vocabulary under some transformers versions."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hftok"
    transformers.GPT2TokenizerFast(vocab_file=asset_path("gpt2_vocab.json"),
                                   merges_file=asset_path("gpt2_merges.txt")).save_pretrained(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    if vocab:
        assert load_tokenizer(str(out)).encode("Hello world") == [15496, 995]
    else:
        with pytest.raises(ValueError, match="encodes text to nothing"):
            load_tokenizer(str(out))


def test_a_special_tokens_text_inside_a_document_is_noted_where_it_becomes_the_token(
        tmp_path, capsys):
    """A tokenizer.json encodes '<|endoftext|>' written out as the token (as transformers
    does), a document boundary inside the document; the GPT-2 BPE spells it out. The
    difference was silent."""
    import transformers

    from megapar.data.hf_tokenizer import save_for_transformers

    hf = tmp_path / "hf"  # the GPT-2 BPE as its export writes it, saved by transformers again
    save_for_transformers(load_tokenizer("gpt2"), str(tmp_path / "export"))
    transformers.AutoTokenizer.from_pretrained(tmp_path / "export").save_pretrained(hf)
    text = tmp_path / "t.txt"
    text.write_text("before <|endoftext|> after\n\nplain text\n\nand more\n")
    ids = {}
    for name, spec in (("hf", str(hf)), ("bpe", "gpt2")):
        assert data_main(["--input", str(text), "--output-prefix", str(tmp_path / "out" / name),
                          "--tokenizer", spec, "--split-lines", "--no-progress"]) == 0
        err = capsys.readouterr().err
        noted = "note: 1 of 3 documents holds the end-of-document token before their end"
        assert (noted in err) == (name == "hf"), err
        ids[name] = IndexedDataset(str(tmp_path / "out" / name)).doc(0).tolist()
    assert ids["hf"] == [19052, 220, 50256, 706, 50256]
    assert ids["bpe"][:3] == [19052, 1279, 91] and ids["bpe"].count(50256) == 1


def test_documents_that_tokenize_to_nothing_warn_or_fail(tmp_path, capsys):
    vocab = {c: i for i, c in enumerate(string.ascii_letters + ".,")}
    vocab["<|endoftext|>"] = len(vocab)
    directory = _hf_dir(tmp_path / "ascii", vocab)
    (tmp_path / "mixed.txt").write_text("Hello world.\n\nПриветмир\n\nДобрыйдень\n")
    assert data_main(["--input", str(tmp_path / "mixed.txt"), "--output-prefix",
                      str(tmp_path / "mixed"), "--tokenizer", directory, "--split-lines",
                      "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "warning: 2 of 3 documents tokenized to no ids" in err
    (tmp_path / "cyr.txt").write_text("Приветмир\n\nДобрыйдень\n")
    assert data_main(["--input", str(tmp_path / "cyr.txt"), "--output-prefix",
                      str(tmp_path / "cyr"), "--tokenizer", directory, "--split-lines",
                      "--no-progress"]) == 2
    _one_line_error(capsys, "encodes the text of", "all 2 documents gave no token ids",
                    "covers this text (e.g. --tokenizer gpt2)")
    assert not list(tmp_path.glob("cyr.*[bnx]"))
    # records whose fields are all empty: 'use --tokenizer gpt2' was the advice under gpt2 itself
    # (a new user's finding); the line names the fields
    (tmp_path / "empty.jsonl").write_text('{"prompt": "", "response": ""}\n' * 4)
    assert data_main(["--input", str(tmp_path / "empty.jsonl"), "--output-prefix",
                      str(tmp_path / "empty"), "--tokenizer", "gpt2", "--sft-keys",
                      "prompt,response", "--no-progress"]) == 2
    line = _one_line_error(capsys, "all 4 records gave no token ids", "fill the records' prompt "
                           "and response fields, or use a tokenizer whose vocabulary covers")
    assert "e.g. --tokenizer gpt2" not in line, line


ZH = "床前明月光，疑是地上霜。举头望明月，低头思故乡。\n\nHello world, and good night.\n"


def test_a_tokenizer_that_cannot_spell_the_text_names_its_unknown_tokens(tmp_path, capsys):
    """SentencePiece's English model (the shipped `sentencepiece`) makes Chinese its <unk>: the
    text is lost from the dataset, which was silent (a new user's finding). megapar-data and
    megapar-train's own tokenizing name the share; English text gives no line. That model
    makes a line break its <unk> too, and merges one into a run of unknown characters beside
    it: its unknown tokens are counted with line breaks as spaces (a reviewer's finding: lines
    of Chinese were one <unk> a document and no warning, where line breaks were subtracted)."""
    import sentencepiece as spm

    from megapar.training.config import TrainConfig
    from megapar.training.data import resolve_data_prefix

    model = spm.SentencePieceProcessor(model_file=asset_path("botchan_en_unigram_1000.model"))
    lines = "床前明月光疑是地上霜举头望明月低头思故乡\n" * 30  # one document
    (tmp_path / "zh.txt").write_text(ZH)
    (tmp_path / "lines.txt").write_text(lines)
    # (this model spells no Q, Z, V or X either: 0.2 % of the Shakespeare sample)
    (tmp_path / "en.txt").write_text("Hello world, and good night to all of you.\n\n" * 50)
    for name, text in (("zh", ZH), ("lines", lines), ("en", None)):
        prefix = tmp_path / name
        assert data_main(["--input", str(tmp_path / f"{name}.txt"), "--output-prefix",
                          str(prefix), "--tokenizer", "sentencepiece", "--no-progress"]) == 0
        err = capsys.readouterr().err
        if text is None:
            assert "unknown token" not in err, err
            continue
        spaced = model.encode(text.replace("\n", " "))
        unk = spaced.count(model.unk_id())
        assert unk >= 0.1 * len(spaced)
        assert (f"megapar-data: warning: {unk} of the text's {len(spaced)} tokens "
                f"({100 * unk / len(spaced):.1f} %) are tokenizer sentencepiece's unknown "
                f"token, standing for ") in err, err
        assert (", counted with its line breaks and tabs as spaces (its model spells those so "
                "too)") in err, err
    ds = IndexedDataset(str(tmp_path / "lines"))
    assert ds.num_tokens <= 4  # the whole document was one <unk> (and its BOS / eod)
    said = "counted with its line breaks and tabs as spaces"
    for _ in range(2):  # tokenized, then read from the cache: the dataset records its counts
        notes: list[str] = []
        cfg = TrainConfig(data=str(tmp_path / "zh.txt"), tokenizer="sentencepiece",
                          data_cache=str(tmp_path / "cache"))
        resolve_data_prefix(cfg, notes)  # its paragraphs are documents
        assert [n for n in notes if n.startswith(f"warning: --data {tmp_path / 'zh.txt'}: ")
                and said in n], notes
    notes = []  # megapar-data's dataset, every run that trains on it
    resolve_data_prefix(TrainConfig(data=str(tmp_path / "lines")), notes)
    assert [n for n in notes if n.startswith(f"warning: --data {tmp_path / 'lines'}: ") and
            "of the text's " in n and "unknown token" in n], notes
    notes = []
    resolve_data_prefix(TrainConfig(data=str(tmp_path / "en")), notes)
    assert not [n for n in notes if "unknown token" in n], notes
    # megapar-eval on a prepared dataset says it too (it did on raw text only)
    from megapar.training.validate_tools import _say_unknown_tokens

    for name, warned in (("lines", True), ("en", False)):
        _say_unknown_tokens(str(tmp_path / name))
        err = capsys.readouterr().err
        assert err.startswith(f"megapar-eval: warning: --data {tmp_path / name}: ") == warned, err
        assert ("unknown token" in err) == warned, err
    # records: English prompts, Chinese responses, 0.45 % of all tokens unknown and every
    # response lost (a reviewer's finding): the responses, which fine-tuning trains on, are
    # counted apart
    records = tmp_path / "records.jsonl"
    records.write_text("".join(
        json.dumps({"prompt": "Hello world, and good night to all of you. " * 20,
                    "response": "床前明月光疑是地上霜"}) + "\n" for _ in range(20)))
    assert data_main(["--input", str(records), "--output-prefix", str(tmp_path / "records"),
                      "--tokenizer", "sentencepiece", "--sft-keys", "prompt,response",
                      "--no-progress"]) == 0
    err = capsys.readouterr().err
    responses = [model.encode("床前明月光疑是地上霜")] * 20
    unk, tokens = sum(r.count(model.unk_id()) for r in responses), sum(map(len, responses))
    assert (f"megapar-data: warning: {unk} of the responses' {tokens} tokens "
            f"({100 * unk / tokens:.1f} %) are tokenizer sentencepiece's unknown token") in err, err


def test_unknown_tokens_of_a_tokenizer_that_drops_line_breaks_are_all_counted(tmp_path, capsys):
    """A WordPiece trained on Chinese drops line breaks (its pre-tokenizer) and spells no
    "Paris": every such word is its [UNK]. The old probe ("a\\nb" held an unknown token)
    took it for a model that spells no line break and subtracted one per line: no warning at
    7.7 % (a reviewer's finding)."""
    (tmp_path / "zh.txt").write_text(ZH.split("\n\n")[0] * 20)
    assert data_main(["--input", str(tmp_path / "zh.txt"), "--train-tokenizer", "wordpiece",
                      "--vocab-size", "200", "--output-prefix", str(tmp_path / "wp"),
                      "--no-progress"]) == 0
    capsys.readouterr()
    (tmp_path / "mixed.txt").write_text("床前明月光疑是地上霜 Paris\n" * 40)
    assert data_main(["--input", str(tmp_path / "mixed.txt"), "--output-prefix",
                      str(tmp_path / "mixed"), "--tokenizer", str(tmp_path / "wp-tokenizer"),
                      "--no-progress"]) == 0
    err = capsys.readouterr().err
    tok = load_tokenizer(str(tmp_path / "wp-tokenizer"))
    ds = IndexedDataset(str(tmp_path / "mixed"))
    ids = ds.get(0, ds.num_tokens)
    unk, text_tokens = int((ids == tok.unk_id).sum()), ds.num_tokens - len(ds)
    assert unk == 40
    assert (f"megapar-data: warning: {unk} of the text's {text_tokens} tokens "
            f"({100 * unk / text_tokens:.1f} %) are tokenizer") in err, err
    chars = len((tmp_path / "mixed.txt").read_text())  # each [UNK] is a whole "Paris"
    assert (f"unknown token, standing for 200 of its {chars:,} characters "
            f"({100 * 200 / chars:.1f} %): its vocabulary") in err, err


def test_unknown_characters_are_counted_where_one_token_stands_for_many(tmp_path, capsys):
    """SentencePiece merges a run of characters its vocabulary does not spell into one <unk>:
    a paragraph of Chinese in every page of English was 0.2 % of the tokens and lost 1.1 % of
    the text without a word (left alone at stop 85 with 4.4 % of a play's bytes). The
    characters the unknown tokens stand for are counted too, and either share is said."""
    zh = "床前明月光疑是地上霜举头望明月低头思故乡"  # 20 characters, none of them spelled
    page = "Hello world, and good night to all of you. " * 40 + zh
    text = "\n\n".join([page] * 10)
    (tmp_path / "pages.txt").write_text(text)
    assert data_main(["--input", str(tmp_path / "pages.txt"), "--output-prefix",
                      str(tmp_path / "pages"), "--tokenizer", "sentencepiece",
                      "--no-progress"]) == 0
    err = capsys.readouterr().err
    meta = json.loads((tmp_path / "pages.json").read_text())["unknown_tokens"]
    assert meta["unk_spaced"] < 0.01 * meta["tokens_spaced"]  # the tokens alone say nothing
    lost = sum("\u4e00" <= c <= "\u9fff" for c in text)
    # the characters as the model reads them: its normalized text (runs of spaces as one)
    import sentencepiece as spm

    model = spm.SentencePieceProcessor(model_file=asset_path("botchan_en_unigram_1000.model"))
    chars = len(model.normalize(text.replace("\n", " ")))
    assert (lost, chars) == (200, meta["chars_spaced"]) and chars < len(text)
    assert (f"are tokenizer sentencepiece's unknown token, standing for {lost} of its "
            f"{chars:,} characters ({100 * lost / chars:.1f} %), counted with") in err, err
    notes: list[str] = []  # megapar-train reads the counts the dataset records
    from megapar.training.config import TrainConfig
    from megapar.training.data import resolve_data_prefix

    resolve_data_prefix(TrainConfig(data=str(tmp_path / "pages")), notes)
    assert [n for n in notes if f"standing for {lost} of its" in n], notes
    # counts recorded before characters were counted (2026-12-04) still name the tokens
    from megapar.data.preprocess import recorded_unknown_note

    old = {k: v for k, v in meta.items() if "chars" not in k}
    assert recorded_unknown_note({"unknown_tokens": old}) is None
    old["unk_spaced"] = old["tokens_spaced"] // 50
    assert "unknown token, counted with" in recorded_unknown_note({"unknown_tokens": old})


def test_the_share_of_unknown_characters_is_of_the_text_as_the_model_reads_it(tmp_path, capsys):
    """NFKC makes one character many (ﷺ, an Arabic ligature, is 18): the characters the
    unknown pieces stood for were counted on the normalized text and divided by the raw text's,
    "31 of its 6 characters (516.7 %)" (a re-test's finding); both are the normalized text's."""
    (tmp_path / "lig.txt").write_text("\ufdfa \ufdfd \ufdfa\n")
    assert data_main(["--input", str(tmp_path / "lig.txt"), "--output-prefix",
                      str(tmp_path / "lig"), "--tokenizer", "sentencepiece",
                      "--no-progress"]) == 0
    meta = json.loads((tmp_path / "lig.json").read_text())["unknown_tokens"]
    assert 0 < meta["unk_chars_spaced"] <= meta["chars_spaced"], meta
    said = re.search(r"standing for ([\d,]+) of its ([\d,]+) characters \(([\d.]+) %\)",
                     capsys.readouterr().err)
    assert said and float(said.group(3)) <= 100, said


def test_unknown_characters_of_one_character_made_several_words_are_counted_once(tmp_path,
                                                                                   capsys):
    """A transformers tokenizer whose NFKC makes ㈱ three words, "(", "株", ")", each an
    [UNK] with ㈱'s offsets: their spans were summed, "9 of its 3 characters (300.0 %)" (a
    re-test's finding); the characters they cover are counted once."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "a": 5, "plain": 6}
    backend = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    (tmp_path / "nfkc").mkdir()
    backend.save(str(tmp_path / "nfkc" / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("\u3231\u3231\u3231 plain\n")
    assert data_main(["--input", str(tmp_path / "t.txt"), "--output-prefix",
                      str(tmp_path / "o"), "--tokenizer", str(tmp_path / "nfkc"),
                      "--no-progress"]) == 0
    meta = json.loads((tmp_path / "o.json").read_text())["unknown_tokens"]
    assert (meta["unk_chars"], meta["chars"]) == (3, 10), meta
    assert "standing for 3 of its 10 characters (30.0 %)" in capsys.readouterr().err


def test_a_wordpiece_trained_on_another_script_is_not_refused_for_spelling_no_english(
        tmp_path, capsys):
    """The check that a tokenizer.json encodes text probes it with "Hello world": a WordPiece
    trained on Chinese alone gives [UNK] [UNK], and was refused as one encoding nothing, with
    advice about transformers that did not apply (a new user's finding)."""
    (tmp_path / "zh.txt").write_text(ZH.split("\n\n")[0] * 20)
    prefix = tmp_path / "wp"
    assert data_main(["--input", str(tmp_path / "zh.txt"), "--train-tokenizer", "wordpiece",
                      "--vocab-size", "200", "--output-prefix", str(prefix),
                      "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "unknown token" not in err, err
    tok = load_tokenizer(str(tmp_path / "wp-tokenizer"))
    assert tok.encode("Hello") == [tok.unk_id]
    assert tok.unk_id not in tok.encode("床前明月光")


def test_empty_gpt2_bpe_directory_is_refused(tmp_path):
    (tmp_path / "bpe").mkdir()
    (tmp_path / "bpe" / "vocab.json").write_text("{}")
    (tmp_path / "bpe" / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="encodes text to nothing: its vocab.json has 0 tokens"):
        load_tokenizer(str(tmp_path / "bpe"))


# --- 4. a trained vocabulary smaller than asked ------------------------------------------------

def test_bpe_vocab_smaller_than_asked_is_noted(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT[:3000])
    assert data_main(["--train-tokenizer", "bpe", "--vocab-size", "70000", "--input",
                      str(tmp_path / "t.txt"), "--output-prefix", str(tmp_path / "b"),
                      "--no-progress"]) == 0
    err = capsys.readouterr().err
    got = load_tokenizer(str(tmp_path / "b-tokenizer")).base_vocab_size
    assert got < 70000
    assert f"note: --vocab-size 70000: the corpus supported only {got:,} tokens" in err


def test_sentencepiece_learns_the_characters_of_a_line_longer_than_its_sentence_limit(
        tmp_path, capsys):
    """SentencePiece's trainer skips a sentence over 4,192 bytes without a word: a corpus of
    one long line (Greek and Japanese here) was tokenized almost all to <unk> (a new user's
    finding: 28 % of a dataset). The line is given to it in pieces."""
    from megapar.data.preprocess import SENTENCE_BYTES, within_sentence_limit

    line = "γάμμα δέλτα エプシロン ζήτα " * 400  # 15 KB, one line
    (tmp_path / "long.txt").write_text(line + "\n\nshort line alpha beta\n")
    assert data_main(["--train-sentencepiece", "--vocab-size", "37", "--input",
                      str(tmp_path / "long.txt"), "--output-prefix", str(tmp_path / "s"),
                      "--no-progress"]) == 0
    assert "unknown token" not in capsys.readouterr().err
    tok = load_tokenizer(str(tmp_path / "s.model"))
    assert tok.unk_id not in tok.encode("γάμμα エプシロン")
    pieces = list(within_sentence_limit(line))
    assert "".join(pieces) == line and len(pieces) > 3
    assert all(len(p.encode()) <= SENTENCE_BYTES and p.endswith(" ") for p in pieces[:-1])
    chinese = "床前明月光" * 1000  # no spaces: cut between characters
    pieces = list(within_sentence_limit(chinese))
    assert "".join(pieces) == chinese
    assert [len(p.encode()) for p in pieces[:-1]] == [SENTENCE_BYTES - SENTENCE_BYTES % 3] * 3


def test_sentencepiece_vocab_size_out_of_reach_names_the_flag(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT)
    base = ["--train-sentencepiece", "--input", str(tmp_path / "t.txt"), "--output-prefix",
            str(tmp_path / "s"), "--no-progress", "--vocab-size"]
    assert data_main(base + ["20"]) == 2
    _one_line_error(capsys, "--vocab-size 20 is too small for this corpus", "or more")
    assert data_main(base + ["70000"]) == 2
    _one_line_error(capsys, "--vocab-size 70000 is too large for this corpus", "or less")


# --- 5. numeric flags ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--workers", "0"], "--workers 0 is invalid: it must be >= 1"),
    (["--workers", "-3"], "--workers -3 is invalid: it must be >= 1"),
    (["--train-tokenizer", "bpe", "--vocab-size", "0"], "--vocab-size 0 is invalid: it must be >= 1"),
    (["--train-sentencepiece", "--vocab-size", "-1"], "--vocab-size -1 is invalid: it must be >= 1"),
    (["--train-tokenizer", "bpe", "--vocab-size", "8000", "--workers", "0"],
     "--workers 0 is invalid"),
    (["--train-tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size 100 is too small"),
    # the tokenizers library's BPE trainer aborted (exit 134, a Rust stack) reserving 70 GB
    (["--train-tokenizer", "bpe", "--vocab-size", "1000000000"],
     "--vocab-size 1000000000 is more than megapar-data trains: pass 2097152 or less"),
    (["--train-tokenizer", "wordpiece", "--vocab-size", "2097153"], "pass 2097152 or less"),
    # it said "drop --tokenizer", a flag not given
    (["--train-tokenizer", "bpe", "--train-sentencepiece", "--vocab-size", "8000"],
     "--train-tokenizer bpe and --train-sentencepiece each train a tokenizer; keep one"),
    (["--vocab-size", "8000"], "--vocab-size only applies with --train-tokenizer / "
     "--train-sentencepiece (the size of the tokenizer they train); add --train-tokenizer bpe "
     "(or --train-sentencepiece) to train one of 8000 tokens, or drop --vocab-size (the "
     "vocabulary is then --tokenizer's)"),
])
def test_numeric_flags_name_the_flag_before_any_work(tmp_path, capsys, flags, needle):
    (tmp_path / "t.txt").write_text(TEXT)
    assert data_main(["--input", str(tmp_path / "t.txt"), "--output-prefix",
                      str(tmp_path / "out"), "--no-progress"] + flags) == 2
    _one_line_error(capsys, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]  # nothing trained or written


def test_preprocess_files_workers_message_names_the_flag(tmp_path):
    from megapar.data.preprocess import preprocess_files

    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ValueError, match="--workers 0 is invalid: it must be >= 1"):
        preprocess_files([str(tmp_path / "t.txt")], str(tmp_path / "o"), "gpt2", workers=0)
    assert np.array_equal(sorted(p.name for p in tmp_path.iterdir()), ["t.txt"])


JSON_KINDS = {  # (file name, its bytes given the bytes of one record's text)
    "jsonl": ("docs.jsonl", lambda t: b'{"text": "' + t + b'"}\n{"text": "two"}\n'),
    "json array": ("docs.json", lambda t: b'[{"text": "' + t + b'"},\n {"text": "two"}]'),
    "json object": ("docs.json", lambda t: b'{\n  "text": "' + t + b'"\n}\n'),
}


@pytest.mark.parametrize("kind", list(JSON_KINDS))
def test_invalid_utf8_in_json_inputs_is_handled_as_in_a_txt(tmp_path, capsys, kind):
    """A latin-1 byte in a .jsonl was refused even with --allow-invalid-utf8 (naming no flag),
    in a .json array it was Python's "'utf-8' codec can't decode byte 0xe9" naming no file, in
    a pretty-printed .json object "not valid JSON ... each line of a JSON Lines file is one
    JSON object". As for a .txt: refused above 0.1 % of the file's bytes naming the flag,
    replaced with U+FFFD (and counted) with it, or below that share."""
    name, make = JSON_KINDS[kind]
    path = tmp_path / name
    path.write_bytes(make(b"caf\xe9 au lait"))
    out = ["--output-prefix", str(tmp_path / "out"), "--no-progress"]
    assert data_main(["--input", str(path), *out]) == 2
    _one_line_error(capsys, f"{path}: 1 of {path.stat().st_size} bytes", "is not valid UTF-8",
                    "pass --allow-invalid-utf8")
    assert data_main(["--input", str(path), *out, "--allow-invalid-utf8"]) == 0
    assert ": 1 byte of invalid UTF-8 replaced with U+FFFD" in capsys.readouterr().err
    report: dict = {}
    docs = [t for t, _ in iter_documents([str(path)], allow_invalid_utf8=True, report=report)]
    assert docs[0] == "caf\ufffd au lait" and report == {str(path): 1}
    # below 0.1 % of the file: replaced with a warning, no flag needed
    path.write_bytes(make(b"caf\xe9 " + b"x" * 2000))
    report = {}
    docs = [t for t, _ in iter_documents([str(path)], report=report)]
    assert docs[0] == "caf\ufffd " + "x" * 2000 and report == {str(path): 1}


@pytest.mark.parametrize("train", [["--train-tokenizer", "bpe", "--vocab-size", "300"],
                                   ["--train-sentencepiece", "--vocab-size", "200"]])
def test_allow_invalid_utf8_also_reaches_the_tokenizer_trained_on_the_text(
        tmp_path, capsys, train):
    """--allow-invalid-utf8 with --train-tokenizer / --train-sentencepiece: the pass that trains
    the tokenizer read the inputs without the flag, so the text it allows was refused
    ("... pass --allow-invalid-utf8") before a token was written."""
    path = tmp_path / "latin.txt"
    path.write_bytes(TEXT[:6000].encode().replace(b"e", b"\xe9", 20))  # 0.3 % of its bytes
    assert data_main(["--input", str(path), "--output-prefix", str(tmp_path / "out"),
                      "--no-progress", "--allow-invalid-utf8", *train]) == 0, \
        capsys.readouterr().err
    assert "20 bytes of invalid UTF-8 replaced with U+FFFD" in capsys.readouterr().err
    assert IndexedDataset(tmp_path / "out").num_tokens > 1000


def test_a_directory_of_only_unread_files_names_them_and_the_fix(tmp_path, capsys):
    """A corpus directory of .jsonl.gz files (or of .md notes) was refused as "holds no .txt /
    .jsonl / .json / .parquet files", naming neither what it holds nor what to do: the line
    says what the files are and the fix (decompress; give a text by its own path)."""
    gz = tmp_path / "gz"
    gz.mkdir()
    (gz / "a.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(20))
    (gz / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(20))
    out = ["--output-prefix", str(tmp_path / "out"), "--no-progress"]
    assert data_main(["--input", str(gz), *out]) == 2
    _one_line_error(capsys, f"input directory {gz} holds no .txt / .jsonl / .json / .parquet "
                            f"files, only 2 other files (.gz, .zst), not read: input "
                            f"{gz / 'a.jsonl.gz'} is gzip-compressed",
                    f"decompress it (gunzip -c {gz / 'a.jsonl.gz'} > {gz / 'a.jsonl'})")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.md").write_text("# A title\n\nSome text.\n")
    assert data_main(["--input", str(notes), *out]) == 2
    _one_line_error(capsys, "only 1 other file (.md), not read: give such a file by its own "
                            f"path ({notes / 'a.md'}: a file named as input is read as text")
    assert data_main(["--input", str(notes / "a.md"), *out]) == 0  # as the line says
    # beside one that is not text, the text ones are renamed, and the other named (it said
    # "rename them .txt" of a .jsonl.gz too; a new user's tryout)
    (notes / "b.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(20))
    assert data_main(["--input", str(notes), *out, "--overwrite"]) == 2
    _one_line_error(capsys, "or rename the text ones .txt; and input "
                            f"{notes / 'b.jsonl.gz'} is gzip-compressed")
    (notes / "b.jsonl.gz").rename(notes / "0.jsonl.gz")  # sorted first: the same line
    assert data_main(["--input", str(notes), *out, "--overwrite"]) == 2
    _one_line_error(capsys, f"own path ({notes / 'a.md'}: a file", "or rename the text ones "
                            f".txt; and input {notes / '0.jsonl.gz'} is gzip-compressed")
    (notes / "0.jsonl.gz").unlink()
    # a read suffix in upper case is told to be lower-cased: "rename them .txt" would read a
    # JSON Lines file's syntax as text (a re-test), as its own path would
    (notes / "x.JSONL").write_text('{"text": "Some text."}\n')
    assert data_main(["--input", str(notes), *out, "--overwrite"]) == 2
    _one_line_error(capsys, "only 2 other files (.JSONL, .md), not read: megapar knows a file's "
                            f"kind by its lower-case suffix; rename {notes / 'x.JSONL'} to "
                            "x.jsonl")
    assert data_main(["--input", str(notes / "x.JSONL"), *out, "--overwrite"]) == 2
    _one_line_error(capsys, f"input {notes / 'x.JSONL'}: megapar knows a file's kind by its "
                            "lower-case suffix, and .JSONL would be read as plain text; rename "
                            "it x.jsonl")
    (notes / "y.txt").write_text("Some more text, to read.\n")
    assert data_main(["--input", str(notes), *out, "--overwrite"]) == 0
    assert (f"(.JSONL, .md; e.g. {notes / 'a.md'}); rename {notes / 'x.JSONL'} to x.jsonl to "
            "read it") in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert data_main(["--input", str(tmp_path / "empty"), *out, "--overwrite"]) == 2
    assert _one_line_error(capsys).endswith(
        f"input directory {tmp_path / 'empty'} holds no .txt / .jsonl / .json / .parquet files")


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.json", "docs.parquet"])
def test_a_missing_json_or_parquet_data_file_is_named_missing_not_a_prefix(tmp_path, capsys,
                                                                             name):
    """megapar-train --data docs.jsonl with no such file said "docs.jsonl.bin, docs.jsonl.idx,
    docs.jsonl.json not found; pass the prefix written by megapar-data ... or a raw .txt file"
    (megapar-eval: ".bin, .idx, .json not found"), as if a prefix were meant: a missing .txt
    was "no such text file", and so is any name of a text kind. A prefix with such a suffix
    (megapar-data --output-prefix data/c.jsonl) is still a prefix."""
    from megapar.cli.train import main as train_main
    from megapar.data.inputs import is_raw_text

    missing = tmp_path / name
    assert train_main(["--data", str(missing), "--model", "gpt2-tiny", "--max-steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"megapar-train: error: --data {missing}: no " \
                                              f"such text file"
    assert is_raw_text(str(missing))
    for ext in (".bin", ".idx", ".json"):
        (tmp_path / (name + ext)).write_bytes(b"")
    assert not is_raw_text(str(missing))


def test_a_saved_hugging_face_dataset_directory_is_refused_naming_its_export(tmp_path, capsys):
    """A directory `datasets.Dataset.save_to_disk` wrote (Arrow data beside dataset_info.json
    and state.json) was read as a corpus: "dataset_info.json: the object has no string field
    'text'; fix it or pass --jsonl-key". It is named, with the parquet export megapar reads;
    a DatasetDict's (dataset_dict.json over split directories) exports its train split."""
    saved = tmp_path / "wiki"
    saved.mkdir()
    (saved / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff" + bytes(60))
    (saved / "dataset_info.json").write_text(json.dumps({"features": {}}, indent=2))
    (saved / "state.json").write_text(json.dumps({"_fingerprint": "abc"}, indent=2))
    out = ["--output-prefix", str(tmp_path / "out"), "--no-progress"]
    assert data_main(["--input", str(saved), *out]) == 2
    _one_line_error(capsys, f"input {saved} is a Hugging Face datasets directory (save_to_disk",
                    f'datasets.load_from_disk("{saved}").to_parquet("wiki.parquet")')
    splits = tmp_path / "dd"
    (splits / "test").mkdir(parents=True)
    for name in ("test", "train"):
        if name == "train":
            (splits / name).mkdir()
        for f in saved.iterdir():
            (splits / name / f.name).write_bytes(f.read_bytes())
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    assert data_main(["--input", str(splits), *out]) == 2
    _one_line_error(capsys, f'datasets.load_from_disk("{splits}")["train"].to_parquet("dd.parquet")')


def test_a_damaged_gpt2_tokenizer_names_the_file_at_fault(tmp_path):
    """A vocab.json missing a token that merges.txt names was called a damaged merges.txt (a
    data tryout): it names both files as not matching; a broken merges.txt or vocab.json is
    named alone."""
    vocab = json.loads(Path(asset_path("gpt2_vocab.json")).read_text())
    merges = Path(asset_path("gpt2_merges.txt")).read_text()
    renamed = dict(vocab)
    renamed["XXine"] = renamed.pop("ine")
    cases = {
        "renamed": (json.dumps(renamed), merges, "tokenizer files {d}/vocab.json and "
                    "{d}/merges.txt do not match (or one is damaged)"),
        "merges": (json.dumps(vocab), merges.replace("\n", "\nbroken line with three\n", 1),
                   "tokenizer file {d}/merges.txt is damaged or not a GPT-2 merges.txt"),
        "vocab": ("{not json", merges,
                  "tokenizer file {d}/vocab.json is damaged or not a GPT-2 vocab.json"),
    }
    for name, (vocab_text, merges_text, said) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "vocab.json").write_text(vocab_text)
        (d / "merges.txt").write_text(merges_text)
        with pytest.raises(ValueError) as info:
            load_tokenizer(str(d))
        message = str(info.value)
        assert message.startswith(said.format(d=d)), message
        assert message.endswith("copy the complete vocab.json and merges.txt there"), message


def test_a_decompression_hint_never_names_a_file_that_exists(tmp_path):
    """gunzip -c b.txt.gz > b.txt would empty a b.txt beside it (a re-test): the hint names a
    file that is not there."""
    from megapar.data.inputs import _text_name

    assert _text_name(str(tmp_path / "b.txt.gz")) == str(tmp_path / "b.txt")
    (tmp_path / "b.txt").write_text("kept")
    assert _text_name(str(tmp_path / "b.txt.gz")) == str(tmp_path / "b-text.txt")
    assert _text_name(str(tmp_path / "a.jsonl.gz")) == str(tmp_path / "a.jsonl")
    assert _text_name(str(tmp_path / "plays.txt")) == str(tmp_path / "plays-text.txt")
    # nor the name beside it (it was not checked: a re-test)
    (tmp_path / "plays-text.txt").write_text("kept")
    (tmp_path / "b-text.txt").write_text("kept")
    assert _text_name(str(tmp_path / "plays.txt")) == str(tmp_path / "plays-text-2.txt")
    assert _text_name(str(tmp_path / "b.txt.gz")) == str(tmp_path / "b-text-2.txt")
