"""Inputs users have: .jsonl, .json (JSON lines, an array, or one pretty-printed object), .parquet
and directories of them (less a tokenized dataset's own .json), streamed through megapar-data
(any number of workers gives the same bytes)."""

import json
import os
import signal
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megapar.cli.data import main as data_main
from megapar.data import IndexedDataset, asset_path, load_tokenizer
from megapar.data.preprocess import expand_inputs, iter_documents

PARAS = [p.strip("\n") for p in Path(asset_path("shakespeare_sample.txt")).read_text()
         .split("\n\n") if p.strip()][:120]


@pytest.fixture
def inputs(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    a, b, c, d = PARAS[:30], PARAS[30:60], PARAS[60:90], PARAS[90:]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                          for i, t in enumerate(a)))
    (root / "b.json").write_text(json.dumps([{"text": t} for t in b]))
    (root / "sub" / "c.json").write_text("\n".join(json.dumps({"text": t}) for t in c))
    pq.write_table(pa.table({"text": d, "n": list(range(len(d)))}), root / "sub" / "d.parquet",
                   row_group_size=7)
    # one object over several lines (it was read as JSON Lines: "expected a JSON object")
    e = "One object,\n\npretty-printed."
    (root / "sub" / "e.json").write_text(json.dumps({"id": 7, "text": e}, indent=2))
    # megapar-data's output written into the corpus: its .json is no input
    for ext in (".bin", ".idx", ".json"):
        (root / "sub" / f"tok{ext}").write_text("{}")
    (root / "sub" / "table.csv").write_text("a,b\n")  # not read: named in a note
    return root, a + b + c + d + [e]


def test_every_input_kind_gives_its_documents_in_order(inputs):
    root, expected = inputs
    from megapar.data.inputs import unread_inputs
    from megapar.data.preprocess import expand_inputs

    files = expand_inputs([str(root)])
    assert [Path(f).name for f in files] == ["a.jsonl", "b.json", "c.json", "d.parquet", "e.json"]
    assert [t for t, _ in iter_documents(files)] == expected
    assert unread_inputs([str(root)]) == ([str(root / "sub" / "table.csv")], [])


@pytest.mark.parametrize("fmt", ["megapar", "megatron"])
def test_directory_to_dataset_is_the_same_for_1_and_2_workers(inputs, tmp_path, fmt, capsys):
    root, expected = inputs
    outs = []
    for workers in (1, 2):
        prefix = str(tmp_path / f"out{workers}")
        assert data_main(["--input", str(root), "--output-prefix", prefix, "--tokenizer",
                          "sentencepiece", "--workers", str(workers), "--no-progress",
                          "--format", fmt]) == 0
        outs.append(prefix)
        assert "1 file in the input directories is not .txt" in capsys.readouterr().err
    for ext in (".bin", ".idx"):
        assert Path(outs[0] + ext).read_bytes() == Path(outs[1] + ext).read_bytes()
    ds, tok = IndexedDataset(outs[0]), load_tokenizer("sentencepiece")
    assert ds.num_docs == len(expected)
    for i in (0, 45, len(expected) - 1):
        assert ds.doc(i, include_eod=False).tolist() == tok.encode(expected[i])


def test_pool_workers_start_fresh_not_as_forks_of_this_process(inputs, tmp_path, monkeypatch):
    """A fork of a process with other threads (tqdm's monitor, pyarrow's pool, pytest-xdist's)
    inherits the locks they held; such a worker hung at start and the pool's exit waited on it
    forever (CI). A worker that sees this process's patched module state was forked from it."""
    import megapar.data.preprocess as pre

    marker, parent, real = tmp_path / "forked", os.getpid(), pre.load_tokenizer

    def load_tokenizer(spec):
        if os.getpid() != parent:
            marker.write_text("a worker ran this process's patched code")
        return real(spec)

    monkeypatch.setattr(pre, "load_tokenizer", load_tokenizer)
    root, expected = inputs
    before = _children()
    out = pre.preprocess_files([str(root)], str(tmp_path / "out"), "sentencepiece", workers=2,
                               progress=False)
    assert IndexedDataset(out).num_docs == len(expected)
    assert not marker.exists(), marker.read_text()
    # and no forkserver is left behind: it is one per process, its preloads shared with every
    # other user of it (test_peak_memory's ranks forked from it, without their preloads)
    started = {pid: cmd for pid, cmd in _children().items() if pid not in before}
    assert not [cmd for cmd in started.values() if "forkserver" in cmd], started


def _children() -> dict[int, str]:
    """This process's live children (from /proc) and their command lines."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out[int(pid)] = cmd
    return out


def test_bad_inputs_name_the_problem(tmp_path, capsys):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    assert data_main(["--input", str(tmp_path / "t.parquet"), "--output-prefix",
                      str(tmp_path / "o"), "--no-progress"]) == 2
    assert "no column 'text'" in capsys.readouterr().err
    (tmp_path / "arr.json").write_text(json.dumps([{"text": "a"}, {"body": "b"}]))
    assert data_main(["--input", str(tmp_path / "arr.json"), "--output-prefix",
                      str(tmp_path / "o"), "--no-progress"]) == 2
    assert "item 1 (counting from 0) is not an object with a string field 'text'" in \
        capsys.readouterr().err
    # a field that is there but is not text is an error, never a silently dropped document
    for name, lines, message in [("num.jsonl", ['{"text": 5}', '{"text": "hello"}'],
                                  "num.jsonl:1: field 'text' is an int, not a string"),
                                 ("nul.jsonl", ['{"text": "a"}', '{"text": null}'],
                                  "nul.jsonl:2: field 'text' is null, not a string")]:
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        assert data_main(["--input", str(tmp_path / name), "--output-prefix",
                          str(tmp_path / "o"), "--no-progress"]) == 2
        assert message in capsys.readouterr().err
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    assert data_main(["--input", str(tmp_path / "n.parquet"), "--output-prefix",
                      str(tmp_path / "o"), "--no-progress"]) == 2
    assert "column 'text' holds int64, not text" in capsys.readouterr().err
    # a null row was dropped silently (a .jsonl line's null is refused, above)
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "null.parquet")
    assert data_main(["--input", str(tmp_path / "null.parquet"), "--output-prefix",
                      str(tmp_path / "o"), "--no-progress"]) == 2
    assert "null.parquet: row 1 (counting from 0): column 'text' is null, not a string" in \
        capsys.readouterr().err
    # one object spread over lines is not mistaken for JSON Lines: its missing key is named
    (tmp_path / "single.json").write_text(json.dumps({"body": "x"}, indent=2))
    assert data_main(["--input", str(tmp_path / "single.json"), "--output-prefix",
                      str(tmp_path / "o"), "--no-progress"]) == 2
    assert "single.json: the object has no string field 'text'" in capsys.readouterr().err
    # records nested in an object, or a struct column: where the text is and how to get it out
    (tmp_path / "nested.json").write_text(json.dumps({"data": [{"text": "a"}, {"text": "b"}]}))
    assert data_main(["--input", str(tmp_path / "nested.json"), "--output-prefix",
                      str(tmp_path / "o"), "--no-progress"]) == 2
    assert "its field 'data' holds the records" in capsys.readouterr().err
    pq.write_table(pa.table({"meta": [{"text": "a b"}]}), tmp_path / "struct.parquet")
    assert data_main(["--input", str(tmp_path / "struct.parquet"), "--output-prefix",
                      str(tmp_path / "o"), "--no-progress"]) == 2
    assert "'meta' is a struct column holding 'text'" in capsys.readouterr().err
    # a lone surrogate escape parses as JSON; the tokenizers library raised a TypeError on it
    for name, text, args in [
            ("lone.jsonl", '{"text": "ok"}\n{"text": "a \\ud83d b"}\n', []),
            ("lone.json", '[{"text": "bad \\ud800"}]', []),
            ("sft.jsonl", '{"prompt": "a \\udc00", "response": "b"}\n',
             ["--sft-keys", "prompt,response"]),
            # trained on: sentencepiece wrapped it as its own failure ("a smaller --vocab-size")
            ("sp.jsonl", '{"text": "ok text"}\n{"text": "a \\ud83d b"}\n',
             ["--train-tokenizer", "sentencepiece", "--vocab-size", "50"])]:
        (tmp_path / name).write_text(text)
        assert data_main(["--input", str(tmp_path / name), "--output-prefix",
                          str(tmp_path / "o"), "--no-progress", *args]) == 2
        err = capsys.readouterr().err
        assert "holds an unpaired surrogate escape" in err and err.count("\n") == 1, err
    (tmp_path / "pair.jsonl").write_text('{"text": "\\ud83d\\ude00"}\n')  # a pair is fine
    assert data_main(["--input", str(tmp_path / "pair.jsonl"), "--output-prefix",
                      str(tmp_path / "ok"), "--no-progress"]) == 0
    for ext in (".bin", ".idx", ".json"):
        os.remove(tmp_path / f"ok{ext}")
    # a tokenized dataset's own file is not text (its .json was read as one missing 'text')
    for ext in (".bin", ".idx", ".json"):
        (tmp_path / f"ds{ext}").write_text("{}")
    for ext in (".bin", ".idx", ".json"):
        assert data_main(["--input", str(tmp_path / f"ds{ext}"), "--output-prefix",
                          str(tmp_path / "o"), "--no-progress"]) == 2
        assert f"ds{ext} is a file of the tokenized dataset " in capsys.readouterr().err
    assert not list(tmp_path.glob("o*"))


def test_worker_pool_reads_the_input_only_a_bounded_window_ahead():
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from megapar.data.preprocess import _ordered_bounded
    from megapar.faults.processes import start_pool_worker

    read = []

    def batches():
        for i in range(2_000):
            read.append(i)
            yield [f"document {i}"], 10

    with ProcessPoolExecutor(2, mp_context=mp.get_context("fork"), initializer=start_pool_worker,
                             initargs=(os.getpid(), "megapar.data.preprocess:_worker_init",
                                       "sentencepiece")) as pool:
        results = _ordered_bounded(pool, batches(), window=4)
        first = next(results)
        assert len(read) <= 5, len(read)  # not the whole input, as pool.map would
        ids = load_tokenizer("sentencepiece").encode_batch(["document 0"])
        assert first == (ids, 10, {"tokens": len(ids[0]), "unk": 0, "chars": 10,
                         "unk_chars": 0})  # with its counts
        rest = list(results)
    assert len(rest) == 1_999 and rest[-1][0] == load_tokenizer("sentencepiece").encode_batch(
        ["document 1999"])


def _parent_death_signal(path):
    """Write this process's parent-death signal (Linux's PR_GET_PDEATHSIG) into `path`."""
    import ctypes

    sig = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)
    Path(path).write_text(str(sig.value))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_pool_worker_dies_with_its_parent_before_it_imports_its_work(tmp_path):
    """megapar-data's workers set SIGKILL as their parent-death signal first, then import the
    tokenizer's modules (`start_pool_worker`): a worker still importing torch when its parent
    was killed -9 went on for seconds (0.8 s idle, over 3.5 s on a loaded machine: the
    interruption tryout's finding)."""
    from megapar.faults.processes import start_pool_worker

    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            start_pool_worker(os.getppid(), f"{__name__}:_parent_death_signal", str(tmp_path / "s"))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "s").read_text() == str(int(signal.SIGKILL))


def test_megapar_train_names_the_files_a_text_directory_leaves_unread(inputs, tmp_path):
    """--data DIR: the files not read for their type are named in a start-up note (a .csv in
    the corpus was skipped without a word)."""
    import megapar.cli.train as train_cli
    from megapar.training.config import parse_args

    root, _ = inputs
    notes: list[str] = []
    cfg = parse_args(["--data", str(root), "--data-cache", str(tmp_path / "cache"), "--tokenizer",
                      "sentencepiece", "--model", "gpt2-tiny", "--seq-len", "16", "--no-progress"])
    train_cli.plan_run(cfg, notes)
    assert [n for n in notes if "not read for its type" in n] == [
        f"--data {root}: 1 file not read for its type (not .txt / .jsonl / .json / "
        f".parquet; e.g. {root / 'sub' / 'table.csv'})"], notes


def test_a_tokenizer_kept_in_a_text_directory_is_not_read_as_text(tmp_path):
    """A corpus directory that also holds its tokenizer (GPT-2's vocab.json and merges.txt, a
    tokenizer.json with BERT's vocab.txt): vocab.json failed as JSON records ("field 'text' is
    an int": GPT-2's vocabulary has the token "text") and merges.txt would be trained on; now
    left out and named. A corpus's own vocab.txt without a tokenizer beside it is text."""
    from megapar.data.inputs import unread_inputs
    from megapar.data.preprocess import expand_inputs

    root = tmp_path / "corpus"
    (root / "gpt2").mkdir(parents=True)
    (root / "bert").mkdir()
    (root / "words").mkdir()
    (root / "a.txt").write_text("some text\n")
    (root / "gpt2" / "vocab.json").write_text('{"text": 5239, "!": 0}')
    (root / "gpt2" / "merges.txt").write_text("#version: 0.2\nĠ t\n")
    (root / "bert" / "tokenizer.json").write_text("{}")
    (root / "bert" / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    (root / "words" / "vocab.txt").write_text("a word list kept as text\n")
    assert expand_inputs([str(root)]) == [str(root / "a.txt"), str(root / "words" / "vocab.txt")]
    assert unread_inputs([str(root)]) == ([], [
        str(root / "bert" / "tokenizer.json"), str(root / "bert" / "vocab.txt"),
        str(root / "gpt2" / "merges.txt"), str(root / "gpt2" / "vocab.json")])
    with pytest.raises(FileNotFoundError, match=(
            r"holds only a tokenizer's files \(merges.txt, vocab.json\), no text: give it as "
            r"--tokenizer .*gpt2 and the text to tokenize as the input")):
        expand_inputs([str(root / "gpt2")])


def test_a_directory_of_datasets_is_named_by_megapar_data_and_megapar_convert(tmp_path):
    """megapar-data's output given back as its input was "holds no .txt / .jsonl / .json /
    .parquet files" (it holds the datasets' .json), and megapar-convert said "neither a
    checkpoint step directory ... was the save interrupted?": both name the datasets."""
    from megapar.checkpoint.format import CheckpointError
    from megapar.checkpoint.publish import resolve_checkpoint
    from megapar.data.preprocess import expand_inputs

    for name in ("a", "b", "c", "d"):
        for ext in (".bin", ".idx"):
            (tmp_path / (name + ext)).write_bytes(b"")
        (tmp_path / (name + ".json")).write_text("{}")
    with pytest.raises(FileNotFoundError, match=(
            r"holds tokenized datasets \(.*/a, .*/b, .*/c and 1 more: megapar-data's output\), "
            r"no text: train on one with megapar-train --data .*/a, or give the text")):
        expand_inputs([str(tmp_path)])
    with pytest.raises(CheckpointError, match=(
            r"holds tokenized datasets \(.*/a, .*/b, .*/c and 1 more: megapar-data's .bin / "
            r"\.idx\), not a megapar checkpoint; pass a dataset's prefix to --data \(--data "
            r".*/a: megapar-train's, megapar-eval's\) and a checkpoint to --load")):
        resolve_checkpoint(tmp_path)


def test_a_sentencepiece_model_as_input_is_named_a_tokenizer(tmp_path):
    """A directory holding only SentencePiece models, or one given as the input, was 'binary
    (NUL bytes in its first KiB), not text; ... convert it to one of them ... and pass that':
    it is the tokenizer, named with the --tokenizer that uses it. A text named .model is text."""
    import shutil

    from megapar.data.preprocess import expand_inputs

    root = tmp_path / "sp"
    root.mkdir()
    for name in ("a.model", "b.model"):
        shutil.copy(asset_path("botchan_en_unigram_1000.model"), root / name)
    with pytest.raises(FileNotFoundError, match=(
            rf"^input directory {root} holds only SentencePiece models \(a.model, b.model\): "
            rf"tokenizers, not text; give one as --tokenizer {root}/a.model and the text to "
            rf"tokenize as the input$")):
        expand_inputs([str(root)])
    with pytest.raises(ValueError, match=(
            rf"^input {root}/a.model is a SentencePiece model: a tokenizer, not text; give it "
            rf"as --tokenizer {root}/a.model and")):
        expand_inputs([str(root / "a.model")])
    (tmp_path / "notes.model").write_text("a text that happens to end in .model\n")
    assert expand_inputs([str(tmp_path / "notes.model")]) == [str(tmp_path / "notes.model")]


def test_a_file_given_twice_is_refused_and_repeated_inputs_all_read(tmp_path, capsys):
    """The same file given twice, or a file beside a directory that holds it, would be
    tokenized twice: one line naming it, exit 2, nothing written. `--input A --input B` reads
    both (argparse kept only B, silently)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one\n")
    (tmp_path / "b.txt").write_text("two\n")
    a, b, out = str(corpus / "a.txt"), str(tmp_path / "b.txt"), str(tmp_path / "o")
    for argv, message in [
        (["--input", a, "--input", a], f"input {a} would be tokenized twice (--input {a} is "
                                       f"given twice); pass each file once"),
        (["--input", a, a], f"--input {a} is given twice"),
        (["--input", str(corpus), "--input", a],
         f"input {a} would be tokenized twice (from --input {corpus} and from --input {a})"),
    ]:
        assert data_main([*argv, "--output-prefix", out, "--tokenizer", "sentencepiece",
                          "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("o*"))
    assert data_main(["--input", a, "--input", b, "--output-prefix", out, "--tokenizer",
                      "sentencepiece", "--no-progress"]) == 0
    assert len(IndexedDataset(out)) == 2


def test_hidden_directories_of_an_input_directory_are_not_walked(tmp_path, capsys):
    """A corpus that is a git repository: its .git (and any hidden directory) is not walked:
    a .txt there is not read, and no note lists .git's internals as files not read."""
    corpus = tmp_path / "corpus"
    (corpus / ".git" / "objects").mkdir(parents=True)
    (corpus / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (corpus / ".git" / "objects" / "3c45f0").write_bytes(b"\x78\x01")
    (corpus / ".cache").mkdir()
    (corpus / ".cache" / "stale.txt").write_text("not part of the corpus\n")
    (corpus / "sub").mkdir()
    (corpus / "a.txt").write_text("one\n")
    (corpus / "sub" / "b.txt").write_text("two\n")
    out = str(tmp_path / "o")
    assert data_main(["--input", str(corpus), "--output-prefix", out, "--tokenizer",
                      "sentencepiece", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "not read" not in err and ".git" not in err, err
    assert len(IndexedDataset(out)) == 2


def test_a_checkpoint_inside_an_input_directory_is_not_read(tmp_path, capsys):
    """megapar-train --data corpus --save corpus/ckpt: the next run's --data corpus read the
    step directory's manifest.json as JSON records ("the object has no string field 'text'")
    and its logs as text. A checkpoint's root and step directories are not walked."""
    corpus = tmp_path / "corpus"
    step = corpus / "ckpt" / "step_00000001"
    step.mkdir(parents=True)
    (corpus / "ckpt" / "latest").write_text("step_00000001\n")
    (step / "manifest.json").write_text("{}")
    (step / "model_tp00_pp00.safetensors").write_bytes(b"\0" * 8)
    (corpus / "ckpt" / "logs").mkdir()
    (corpus / "ckpt" / "logs" / "rank0.txt").write_text("Traceback\n")
    alone = corpus / "copied_step"  # a step directory without its root
    alone.mkdir()
    (alone / "manifest.json").write_text("{}")
    (alone / "model_tp00_pp00.safetensors").write_bytes(b"\0" * 8)
    (corpus / "a.txt").write_text("one\n")
    (corpus / "notes").mkdir()  # a directory that merely holds a manifest.json is walked
    (corpus / "notes" / "manifest.json").write_text('{"text": "two"}\n')
    assert expand_inputs([str(corpus)]) == [str(corpus / "a.txt"),
                                            str(corpus / "notes" / "manifest.json")]


def test_hidden_files_of_an_input_directory_are_not_read(tmp_path, capsys):
    """macOS writes `._a.txt` (a file's attributes, binary) beside `a.txt` on a copy to a
    foreign disk or into a zip, and an editor's `.#a.txt` lock is a dangling link: a hidden
    file is not read (either failed the run: invalid UTF-8, a missing file), and a
    one-document dataset says "1 document"."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one\n")
    (corpus / "._a.txt").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        \xff\xfe")
    (corpus / ".#a.txt").symlink_to(tmp_path / "user@host.1234")
    out = str(tmp_path / "o")
    assert data_main(["--input", str(corpus), "--output-prefix", out, "--tokenizer",
                      "sentencepiece", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "._a.txt" not in captured.err and ".#a.txt" not in captured.err, captured.err
    assert len(IndexedDataset(out)) == 1
    assert ": 1 document, " in captured.out, captured.out


def test_data_help_gives_the_format_default(capsys):
    # --format defaulted to megapar's index without --help saying so
    from megapar.cli.data import main as data_main

    with pytest.raises(SystemExit):
        data_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "megapar reads both) (default: megapar)" in out
    # --vocab-size had no default and did not say that training a tokenizer needs it
    assert "(needed with --train-tokenizer / --train-sentencepiece)" in out


@pytest.mark.parametrize("kind", ["large_string", "dictionary", "string_view"])
def test_a_parquet_text_column_of_any_arrow_string_type_is_read(tmp_path, kind):
    """A text column stored as a dictionary (pandas' categorical) or string_view (Polars'
    strings) was refused: "column 'text' holds dictionary<values=string, ...>, not text".
    Every arrow string type gives the tokens a plain string column gives."""
    texts = PARAS[:5]
    column = {"large_string": lambda: pa.array(texts, pa.large_string()),
              "dictionary": lambda: pa.array(texts).dictionary_encode(),
              "string_view": lambda: pa.array(texts, pa.string_view())}[kind]()
    pq.write_table(pa.table({"text": column}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": texts}), tmp_path / "plain.parquet")
    for name in ("t", "plain"):
        assert data_main(["--input", str(tmp_path / f"{name}.parquet"), "--output-prefix",
                          str(tmp_path / name), "--no-progress"]) == 0
    assert [t for t, _ in iter_documents([str(tmp_path / "t.parquet")])] == texts
    tokens = [Path(f"{tmp_path / name}.bin").read_bytes() for name in ("t", "plain")]
    assert tokens[0] == tokens[1]


def test_a_symbolic_link_to_a_directory_in_the_corpus_is_walked_once(tmp_path):
    """A corpus directory whose shards are symbolic links to directories elsewhere (a big
    disk, the Hugging Face cache) was read without them: os.walk did not follow the links,
    silently ("holds no .txt ... files" where all were linked). A link is walked as its
    directory, and a link back up (a loop) or a second link to one directory reads it once."""
    shard = tmp_path / "elsewhere" / "shard"
    shard.mkdir(parents=True)
    (shard / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in PARAS[:3]))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text(PARAS[3])
    (corpus / "web").symlink_to(shard, target_is_directory=True)
    (corpus / "web2").symlink_to(shard, target_is_directory=True)
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)
    docs = [t for t, _ in iter_documents(expand_inputs([str(corpus)]))]
    assert docs == [PARAS[3], *PARAS[:3]]


def test_an_empty_sft_record_is_named_as_one(tmp_path, capsys):
    """A record of an empty prompt and response: the warning blamed the tokenizer's coverage
    ("tokenizer gpt2 may not cover their text"); it names the records' empty fields."""
    records = [{"prompt": "", "response": ""}] + [
        {"prompt": f"Question {i}?", "response": f"Answer {i}."} for i in range(3)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert data_main(["--input", str(tmp_path / "sft.jsonl"), "--output-prefix",
                      str(tmp_path / "o"), "--sft-keys", "prompt,response", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert ("1 of 4 records tokenized to no ids in either field (only their end-of-document "
            "token was written): fill or drop the records whose prompt and response are "
            "empty") in err, err
    assert "may not cover" not in err


def test_a_tokenizer_other_than_a_prepared_datasets_is_answered_by_what_can_use_it():
    """--tokenizer X with a dataset made with gpt2: megapar-train (a fresh run) may prepare
    the data again with X; megapar-eval, whose checkpoint keeps its tokenizer, may not (that
    advice led to the next refusal: a user's tryout of evaluation.md)."""
    from megapar.data.assets import asset_path
    from megapar.data.tokenizers import load_tokenizer
    from megapar.training.tokenizer_checks import check_given_tokenizer

    other = asset_path("botchan_en_unigram_1000.model")
    gpt2 = load_tokenizer("gpt2")
    with pytest.raises(ValueError, match=r"leave --tokenizer out .*, or prepare the data again "
                                         r"with megapar-data --tokenizer .*botchan") as fresh:
        check_given_tokenizer(other, "data/val", gpt2)
    assert fresh.value is not None
    with pytest.raises(ValueError) as held:
        check_given_tokenizer(other, "data/val", gpt2, checkpoint=True)
    assert str(held.value).endswith("without megapar's .json)"), held.value
