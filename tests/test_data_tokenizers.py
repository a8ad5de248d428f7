"""Tokenizers: the shipped GPT-2 BPE and SentencePiece models, special tokens, specs."""

import json
import os
import shutil

import pytest
from conftest import shared_data

from megapar.data.tokenizers import APPENDED_ORDER, asset_path, load_tokenizer


def test_gpt2_hello_world_and_specials():
    tok = load_tokenizer("gpt2")
    assert tok.kind == "gpt2-bpe"
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eod_id == 50256 and tok.base_vocab_size == 50257
    # GPT-2 lacks [PAD] [CLS] [SEP] [MASK]: appended in that fixed order.
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id) == (50257, 50258, 50259, 50260)
    assert tok.vocab_size == 50261
    assert tok.decode([15496, tok.mask_id, 995]) == "Hello[MASK] world"


def test_gpt2_roundtrip_is_lossless():
    tok = load_tokenizer("gpt2")
    text = "  Tis   nobler in the mind\n\nto suffer — 'slings' & arrows 🤗\t!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, "Hello world"]) == [tok.encode(text), [15496, 995]]


def test_gpt2_directory_spec_matches_transformers():
    src = shared_data("gpt2-tokenizer")
    from transformers import GPT2TokenizerFast

    ours = load_tokenizer(src)
    hf = GPT2TokenizerFast.from_pretrained(src)
    with open(asset_path("shakespeare_sample.txt")) as f:
        text = f.read()[:40000]
    assert ours.encode(text) == hf.encode(text)
    assert ours.path == os.path.abspath(src)
    assert ours.spec()["vocab_size"] == 50261


def test_sentencepiece_shipped_model():
    import sentencepiece as spm

    tok = load_tokenizer("sentencepiece")
    proc = spm.SentencePieceProcessor(model_file=asset_path("botchan_en_unigram_1000.model"))
    text = "I was a reckless boy, and my father never liked me."
    assert tok.kind == "sentencepiece"
    assert tok.encode(text) == proc.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.eod_id == proc.eos_id() == 2
    # botchan has no pad / [CLS] / [SEP] / [MASK]: appended after its 1000 pieces.
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id) == (1000, 1001, 1002, 1003)
    assert tok.vocab_size == 1004
    special = tok.special_tokens()
    assert {0, 1, 2, 1000, 1001, 1002, 1003} <= set(special.reserved_ids)


def test_sentencepiece_path_spec_and_spec_dict_reload(monkeypatch):
    path = shared_data("sentencepiece", "botchan_en_bpe_1000.model")
    tok = load_tokenizer(path)
    spec = json.loads(json.dumps(tok.spec()))
    assert spec["kind"] == "sentencepiece" and spec["vocab_size"] == tok.vocab_size
    again = load_tokenizer(spec)
    assert again.encode("the school master") == tok.encode("the school master")
    # a leading ~ (--tokenizer '~/x.model' quoted, or from a --config file) is the home
    # directory, as a checkpoint's is; it was 'unknown tokenizer'
    monkeypatch.setenv("HOME", os.path.dirname(path))
    home = load_tokenizer("~/" + os.path.basename(path))
    assert home.encode("the school master") == tok.encode("the school master")


def test_a_tokenizer_loads_once_until_its_file_changes(tmp_path, monkeypatch):
    """load_tokenizer keeps what it loaded: the same tokenizer, however it is named, is the
    same object (a run's checks, data and forked ranks share one load); a file changed since
    is loaded again."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(shared_data("sentencepiece", "botchan_en_bpe_1000.model"), "tok.model")
    first = load_tokenizer("tok.model")
    assert load_tokenizer(first.spec()) is first  # its absolute path, as a dataset records it
    shipped = load_tokenizer("sentencepiece")
    assert load_tokenizer(shipped.spec()) is shipped
    shutil.copy(asset_path("botchan_en_unigram_1000.model"), "tok.model")  # another model
    again = load_tokenizer("tok.model")
    text = "the school master"
    assert again is not first and again.encode(text) == shipped.encode(text) != first.encode(text)


def test_appended_order_is_documented_and_errors_are_clear(tmp_path):
    assert APPENDED_ORDER[:4] == ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
    with pytest.raises(ValueError, match="unknown tokenizer 'bert'.*'gpt2'"):
        load_tokenizer("bert")
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="lacks merges.txt"):
        load_tokenizer(str(tmp_path))


def test_a_misspelt_tokenizer_is_answered_with_the_closest(tmp_path, monkeypatch):
    """A name close to 'gpt2' / 'sentencepiece' (any case), or a path whose directory holds a
    close tokenizer directory or .model file, is answered with it in the one line; a data
    file beside it is not offered, nor is a word close to nothing."""
    for given, meant in [("GPT2", "gpt2"), ("gpt2-bpe", "gpt2"), ("sentencepeice",
                                                                    "sentencepiece")]:
        with pytest.raises(ValueError, match=rf"^unknown tokenizer '{given}' \(did you mean "
                                             rf"'{meant}'\?\): use 'gpt2'"):
            load_tokenizer(given)
    (tmp_path / "llama_tok").mkdir()
    shutil.copy(asset_path("botchan_en_unigram_1000.model"), tmp_path / "spm.model")
    (tmp_path / "corpus.txt").write_text("text")
    for given, meant in [("llama_tokk", "llama_tok"), ("spn.model", "spm.model")]:
        with pytest.raises(ValueError, match=rf"no such file or directory \(did you mean "
                                             rf"'{tmp_path / meant}'\?\); pass"):
            load_tokenizer(str(tmp_path / given))
    with pytest.raises(ValueError, match=r"no such file or directory; pass"):
        load_tokenizer(str(tmp_path / "corpus.txtx"))
    monkeypatch.chdir(tmp_path)  # a bare word: the working directory's entries
    with pytest.raises(ValueError, match=r"^unknown tokenizer 'lama_tok' \(did you mean "
                                         r"'\./llama_tok'\?\)"):
        load_tokenizer("lama_tok")
    with pytest.raises(ValueError, match=r"^unknown tokenizer 'xyz': use"):
        load_tokenizer("xyz")


def test_megatron_tokenizer_types_are_answered_with_megapars_tokenizer():
    """Megatron-LM's --tokenizer-type values given to --tokenizer name the --tokenizer that
    loads the same tokenizer (GPT2BPETokenizer was told only the generic list)."""
    for given, ours in [("GPT2BPETokenizer", "gpt2"), ("Llama2Tokenizer", "FILE.model"),
                        ("HuggingFaceTokenizer", "DIR")]:
        with pytest.raises(ValueError, match=rf"^tokenizer '{given}' is Megatron-LM's "
                                             rf"--tokenizer-type; .*: --tokenizer {ours}"):
            load_tokenizer(given)


def test_a_tokenizer_path_a_user_gets_wrong_is_named_with_the_fix(tmp_path):
    """What a user passes as --tokenizer by mistake: each was 'unknown tokenizer: use gpt2,
    ...' (or, for BERT's vocab.txt, 'lacks vocab.json, merges.txt; a GPT-2 BPE directory
    needs them'), which named neither what was wrong nor the fix."""
    with pytest.raises(ValueError, match=r"tok/x.model': no such file or directory"):
        load_tokenizer(str(tmp_path / "tok" / "x.model"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    for name in ("gpt2_vocab.json", "gpt2_merges.txt"):
        shutil.copy(asset_path(name), gpt2 / name.removeprefix("gpt2_"))
    assert load_tokenizer(str(gpt2)).encode("Hello world") == [15496, 995]
    with pytest.raises(ValueError, match=f"is one file of a tokenizer; pass the directory "
                                         f"holding it: {gpt2}$"):
        load_tokenizer(str(gpt2 / "vocab.json"))
    wordpiece = tmp_path / "bert"
    wordpiece.mkdir()
    (wordpiece / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n")
    with pytest.raises(FileNotFoundError, match="holds a WordPiece vocab.txt .* but no "
                                                "tokenizer.json.*BertTokenizerFast"):
        load_tokenizer(str(wordpiece))
    with pytest.raises(ValueError, match="nothing is downloaded"):
        load_tokenizer("bert-base-uncased")
    # a Llama's directory with its tokenizer_config.json alone: it lacked GPT-2's vocab.json
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    with pytest.raises(FileNotFoundError, match="holds a tokenizer_config.json but no tokenizer "
                                                "files: none of tokenizer.json, tokenizer.model"):
        load_tokenizer(str(llama))


def test_a_model_without_its_suffix_or_a_datasets_prefix_as_tokenizer_names_the_path(tmp_path):
    """--tokenizer DIR/botchan_en_bpe_1000 (the .model left off) and --tokenizer data/corpus
    (megapar-data's prefix, whose .json records the tokenizer) were each 'no such file or
    directory; pass an existing SentencePiece .model file ...', naming neither the file there
    nor the dataset's tokenizer."""
    from megapar.data.preprocess import preprocess_files

    shutil.copy(asset_path("botchan_en_unigram_1000.model"), tmp_path / "sp.model")
    with pytest.raises(ValueError, match=f"'{tmp_path}/sp': no such file or directory; "
                                         f"{tmp_path}/sp.model is there: for that SentencePiece "
                                         f"model pass --tokenizer {tmp_path}/sp.model$"):
        load_tokenizer(str(tmp_path / "sp"))
    (tmp_path / "a.txt").write_text("Some text to tokenize.\n")
    preprocess_files([str(tmp_path / "a.txt")], str(tmp_path / "corpus"),
                     str(tmp_path / "sp.model"), progress=False)
    with pytest.raises(ValueError, match=f"'{tmp_path}/corpus' is the prefix of a tokenized "
                                         f"dataset .*it was made with --tokenizer "
                                         f"{tmp_path}/sp.model: pass that"):
        load_tokenizer(str(tmp_path / "corpus"))


def test_a_datasets_file_or_an_unsuffixed_model_as_tokenizer_names_the_fix(tmp_path):
    """--tokenizer data/corpus.bin (.idx, .json: a file of megapar-data's dataset) and
    --tokenizer tok (a SentencePiece model saved without .model) were each 'unknown tokenizer
    ...: use 'gpt2', 'sentencepiece', ... or the path of an existing SentencePiece .model file',
    though the file is there; the line names what it is and the fix."""
    from megapar.data.preprocess import preprocess_files

    shutil.copy(asset_path("botchan_en_unigram_1000.model"), tmp_path / "tok")
    with pytest.raises(ValueError, match=f"^tokenizer '{tmp_path}/tok' is a SentencePiece model, "
                                         f"but megapar takes one by its .model suffix; rename it "
                                         f"\\(mv {tmp_path}/tok {tmp_path}/tok.model\\) and pass "
                                         f"--tokenizer {tmp_path}/tok.model$"):
        load_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "a.txt").write_text("Some text to tokenize.\n")
    preprocess_files([str(tmp_path / "a.txt")], str(tmp_path / "corpus"), "gpt2",
                     progress=False)
    for ext in (".bin", ".idx", ".json"):
        with pytest.raises(ValueError, match=f"^tokenizer '{tmp_path}/corpus{ext}' is a file of "
                                             f"a tokenized dataset .*it was made with "
                                             f"--tokenizer gpt2: pass that"):
            load_tokenizer(str(tmp_path / f"corpus{ext}"))
    (tmp_path / "corpus.json").unlink()  # a Megatron-LM index: no tokenizer recorded
    with pytest.raises(ValueError, match=r"\(.*corpus.bin / .idx\), not a tokenizer; pass the "
                                         r"tokenizer it was made with$"):
        load_tokenizer(str(tmp_path / "corpus.bin"))
    with pytest.raises(ValueError, match="^unknown tokenizer"):  # any other file: as before
        load_tokenizer(str(tmp_path / "a.txt"))


def test_megapar_datas_output_directory_as_tokenizer_names_the_datasets_tokenizer(tmp_path):
    """--tokenizer data (the directory of megapar-data's --output-prefix data/corpus) said
    "tokenizer directory 'data' lacks vocab.json, merges.txt; a GPT-2 BPE directory needs
    vocab.json and merges.txt"; the line names the datasets there and their tokenizer."""
    from megapar.data.preprocess import preprocess_files

    (tmp_path / "a.txt").write_text("Some text to tokenize.\n")
    (tmp_path / "data").mkdir()
    preprocess_files([str(tmp_path / "a.txt")], str(tmp_path / "data" / "corpus"), "gpt2",
                     progress=False)
    with pytest.raises(FileNotFoundError, match=f"^tokenizer directory '{tmp_path}/data' holds "
                                                f"tokenized datasets \\(corpus\\), not a "
                                                f"tokenizer; {tmp_path}/data/corpus: it was made "
                                                f"with --tokenizer gpt2: pass that"):
        load_tokenizer(str(tmp_path / "data"))


def test_a_hugging_face_hub_id_as_tokenizer_names_the_download(tmp_path, monkeypatch):
    """--tokenizer meta-llama/Llama-3.2-1B (the id transformers users pass) was "no such file
    or directory; pass an existing SentencePiece .model file or tokenizer directory", the
    "nothing is downloaded" of a bare name not said: the line names the download and the
    directory to pass. A path whose directory is here (data/tok) stays a missing path."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^tokenizer 'meta-llama/Llama-3.2-1B': no such file "
                                         r"or directory, and nothing is downloaded; .*"
                                         r"huggingface-cli download meta-llama/Llama-3.2-1B "
                                         r"--local-dir DIR\) and pass --tokenizer DIR$"):
        load_tokenizer("meta-llama/Llama-3.2-1B")
    (tmp_path / "data").mkdir()
    for path in ("data/tok", "org/tok.model", "./org/tok"):
        with pytest.raises(ValueError, match=f"^tokenizer '{path}': no such file or directory; "
                                             f"pass an existing"):
            load_tokenizer(path)


def test_a_shipped_tokenizer_recorded_by_another_install_loads_from_this_one(tmp_path):
    """A dataset index, data cache entry or checkpoint records the shipped SentencePiece model
    by its absolute path; from a megapar since moved or reinstalled (another checkout, another
    virtual environment) that path is gone, and the tokenizer is this install's copy."""
    from megapar.data.assets import asset_path
    from megapar.data.tokenizers import load_tokenizer

    here = load_tokenizer("sentencepiece")
    gone = str(tmp_path / "old-venv" / "megapar" / "assets" / "botchan_en_unigram_1000.model")
    spec = {**here.spec(), "path": gone}
    again = load_tokenizer(spec)
    assert again.path == asset_path("botchan_en_unigram_1000.model")
    assert again.encode("To be, or not to be") == here.encode("To be, or not to be")
    # any other missing file is still refused, naming it (and that it is missing)
    with pytest.raises(ValueError, match="no_such.model': no such file or directory"):
        load_tokenizer(str(tmp_path / "old-venv" / "megapar" / "assets" / "no_such.model"))


def test_raw_text_whose_cached_dataset_names_a_tokenizer_since_moved_is_the_runs_own(tmp_path):
    """The cached dataset's .json names the first run's tokenizer files; moved or deleted
    since, a later run on the same text with the same files elsewhere (here the first copy
    gone) failed in its workers: 'rank 0 failed before training started: ValueError: unknown
    tokenizer FIRST', also with the default --tokenizer and on --load."""
    from megapar.data import IndexedDataset
    from megapar.data.preprocess import ensure_dataset
    from megapar.training.tokenizer_checks import data_tokenizer_spec

    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n\nWhether 'tis nobler.\n")
    first, mine = tmp_path / "first.model", tmp_path / "mine.model"
    for copy in (first, mine):
        shutil.copy(asset_path("botchan_en_unigram_1000.model"), copy)
    prefix = ensure_dataset(str(text), str(first), str(tmp_path / "cache"))
    cached = IndexedDataset(prefix).tokenizer_spec
    os.remove(first)
    assert data_tokenizer_spec(str(text), str(mine), cached)["path"] == str(mine)


def test_megapar_eval_of_raw_text_cached_under_a_moved_tokenizer_takes_the_given_one(tmp_path):
    """megapar-eval --data TEXT --tokenizer MOVED, the text tokenized into the cache by the
    training run before the tokenizer moved: eval loaded the cache's recorded path and failed
    ("tokenizer '.../tokA': no such file or directory"), ignoring --tokenizer."""
    from types import SimpleNamespace

    from megapar.data import IndexedDataset
    from megapar.data.preprocess import ensure_dataset
    from megapar.training.eval_text import data_tokenizer

    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n\nWhether 'tis nobler.\n")
    first, moved = tmp_path / "first.model", tmp_path / "moved.model"
    shutil.copy(asset_path("botchan_en_unigram_1000.model"), first)
    prefix = ensure_dataset(str(text), str(first), str(tmp_path / "cache"))
    os.rename(first, moved)
    args = SimpleNamespace(data=prefix, data_shown=str(text), text_tokenizer=str(moved))
    assert data_tokenizer(args, IndexedDataset(prefix)).path == str(moved)
    prepared = SimpleNamespace(data=prefix)  # a prepared --data keeps its own (recorded) one
    with pytest.raises(ValueError, match="first.model, which is not there now \\(moved or "
                                         "deleted\\?\\); give a copy of its file"):
        data_tokenizer(prepared, IndexedDataset(prefix))


def test_raw_text_records_the_runs_own_tokenizer_not_the_cached_datasets(tmp_path):
    """Raw text is tokenized into a cache keyed by the text's and the tokenizer files' content,
    so a second run with the same text and a copy of the tokenizer elsewhere reuses the first
    run's dataset, whose .json names the first run's copy: checkpoints recorded that path (one
    the run never gave; moved or deleted, its export and resume then failed on it)."""
    from megapar.data import IndexedDataset
    from megapar.data.preprocess import ensure_dataset
    from megapar.training.tokenizer_checks import data_tokenizer_spec

    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n\nWhether 'tis nobler.\n")
    first, mine = tmp_path / "first.model", tmp_path / "mine.model"
    for copy in (first, mine):
        shutil.copy(asset_path("botchan_en_unigram_1000.model"), copy)
    cache = tmp_path / "cache"
    assert ensure_dataset(str(text), str(first), str(cache)) == \
        (prefix := ensure_dataset(str(text), str(mine), str(cache)))  # one cached dataset
    cached = IndexedDataset(prefix).tokenizer_spec
    assert cached["path"] == str(first)
    assert data_tokenizer_spec(str(text), str(mine), cached)["path"] == str(mine)
    assert data_tokenizer_spec(prefix, str(mine), cached) == cached  # a prepared dataset's own


def test_a_llama2_style_tokenizer_model_directory_says_how_its_bos_differs(tmp_path, capsys):
    """A directory holding only a SentencePiece tokenizer.model (Llama 2's layout, Meta's
    files): megapar reads the model file without a BOS. transformers' LlamaTokenizer (5.x,
    which megapar requires) adds none either, unless the directory's tokenizer_config.json sets
    add_bos_token (Llama 2's does; transformers 4.46 added <s> even without). The refusal of
    the directory said only "pass the model file itself"; now it says what differs, and where
    the config asks for the BOS, how to match: the tokenizer.json transformers writes, which
    megapar reads with its BOS starting every document, giving LlamaTokenizer's ids."""
    from transformers import LlamaTokenizer

    from megapar.cli.data import main as data_main
    from megapar.data import IndexedDataset
    from megapar.training.config import parse_args
    from megapar.training.tokenizer_checks import default_to_hf_tokenizer

    model = shared_data("sentencepiece/botchan_en_bpe_1000.model")
    text = "Hello world. It is a test."
    (tmp_path / "doc.txt").write_text(text + "\n")
    bare, llama2 = tmp_path / "bare", tmp_path / "llama2"
    for d in (bare, llama2):
        d.mkdir()
        shutil.copy(model, d / "tokenizer.model")
    (llama2 / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer", "legacy": False}))
    ours = load_tokenizer(str(bare / "tokenizer.model"))
    assert (ours.bos_id, ours.eod_id) == (None, 2)
    assert LlamaTokenizer.from_pretrained(str(bare))(text)["input_ids"] == ours.encode(text)
    assert LlamaTokenizer.from_pretrained(str(llama2))(text)["input_ids"] == [1, *ours.encode(text)]

    out = ["--input", str(tmp_path / "doc.txt"), "--no-progress", "--output-prefix"]
    assert data_main([*out, str(tmp_path / "a"), "--tokenizer", str(bare)]) == 2
    err = capsys.readouterr().err
    assert (f"pass the model file itself, e.g. {bare / 'tokenizer.model'} (read as SentencePiece "
            f"reads it: no BOS starts a document, as transformers' LlamaTokenizer reads a "
            f"tokenizer.model whose directory's tokenizer_config.json does not set "
            f"add_bos_token)") in err, err
    assert data_main([*out, str(tmp_path / "b"), "--tokenizer", str(llama2)]) == 2
    err = capsys.readouterr().err
    assert ("its tokenizer_config.json sets add_bos_token, so transformers' LlamaTokenizer starts "
            "every text with <s>, and megapar, reading ") in err and err.count("\n") == 1, err
    cfg = parse_args(["--from-hf", str(llama2)])  # its tokenizer.model the default, noted
    [note] = default_to_hf_tokenizer(cfg)
    assert cfg.tokenizer == str(llama2 / "tokenizer.model")
    assert note.startswith(f"--tokenizer not given: using --from-hf {llama2}'s own tokenizer "
                           f"({llama2 / 'tokenizer.model'}); its tokenizer_config.json sets "
                           f"add_bos_token"), note
    assert default_to_hf_tokenizer(parse_args(["--from-hf", str(bare)]))[0].endswith(
        f"({bare / 'tokenizer.model'})")
    # megapar-convert --from-hf records the tokenizer.model: it says so, and how to keep the BOS
    # (it had recorded it without a word: generate's prompts and eval's documents lacked <s>)
    import transformers

    from megapar.cli.convert import main as convert_main

    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )).save_pretrained(str(llama2))
    assert convert_main(["--from-hf", str(llama2), str(tmp_path / "ck"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert (f"note: recorded {llama2}'s tokenizer.model as its tokenizer, but its "
            f"tokenizer_config.json sets add_bos_token") in printed, printed
    assert printed.rstrip().endswith(f"and import it again (add --overwrite to replace "
                                     f"{tmp_path / 'ck'})"), printed
    # the fix named: transformers writes tokenizer.json; megapar's documents start with <s>
    LlamaTokenizer.from_pretrained(str(llama2)).save_pretrained(str(llama2))
    assert data_main([*out, str(tmp_path / "c"), "--tokenizer", str(llama2)]) == 0
    ds = IndexedDataset(str(tmp_path / "c"))
    assert ds.tokens[:].tolist() == [1, *ours.encode(text), 2]


def test_a_runs_start_up_reads_a_prepared_datasets_tokenizer_files_once(tmp_path, monkeypatch):
    """megapar-train's start-up checked a prepared dataset's tokenizer files against their
    recorded sha256 in `data_tokenizer` and again in `resolve_data_prefix` (each file read
    twice), and a blend's parts were hashed again by `check_blend_tokenizers` (five times for
    two parts). The digests are kept while a file is unchanged: each file is read once, and a
    file changed since is hashed again (and refused: its dataset's sha256 differ)."""
    import builtins

    import megapar.data.tokenizers as tokenizers
    from megapar.cli.data import main as data_main
    from megapar.cli.train import plan_run
    from megapar.training.config import parse_args

    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(asset_path(f"gpt2_{name}"), tok / name)
    (tmp_path / "a.txt").write_text(open(asset_path("shakespeare_sample.txt")).read()[:20000])
    prefix = str(tmp_path / "a")
    assert data_main(["--input", str(tmp_path / "a.txt"), "--output-prefix", prefix,
                      "--tokenizer", str(tok), "--no-progress"]) == 0
    reads: list[str] = []
    real_open = builtins.open

    def counting_open(file, mode="r", *args, **kwargs):
        if "b" in mode and os.path.dirname(os.path.abspath(file)) == str(tok):
            reads.append(os.path.basename(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--max-steps", "1"]
    for data in (prefix, f"1 {prefix} 1 {prefix}"):  # one dataset, a blend of two parts
        monkeypatch.setattr(tokenizers, "_DIGESTS", {}, raising=False)  # megapar-data's gone
        reads.clear()
        plan_run(parse_args([*common, "--data", data]), [])
        assert sorted(reads) == ["merges.txt", "vocab.json"], (data, reads)
    vocab = json.loads((tok / "vocab.json").read_text())  # the same tokens, other bytes
    (tok / "vocab.json").write_text(json.dumps(vocab, indent=1))
    reads.clear()  # changed since: read again, and refused
    with pytest.raises(Exception, match="whose files changed since the dataset was made"):
        plan_run(parse_args([*common, "--data", prefix]), [])
    assert reads.count("vocab.json") == 1, reads


def test_a_moved_recorded_tokenizer_is_not_matched_by_one_that_starts_documents_otherwise():
    """A checkpoint trained with a tokenizer.json that adds a BOS, its directory moved since:
    the SentencePiece model it was made from has the same vocabulary and end-of-document id,
    so megapar-eval and megapar-generate took it (the prompts without <s>, the loss 6.10 for
    6.05). A record that names the BOS id tells them apart; one from before does not."""
    from megapar.checkpoint.convert import recorded_tokenizer
    from megapar.training.tokenizer_checks import matches_recorded

    sp = load_tokenizer("sentencepiece")
    assert sp.bos_id is None and recorded_tokenizer("sentencepiece")["bos_id"] is None
    gone = {"kind": "hf", "path": "/gone/tokdir", "vocab_size": sp.vocab_size,
            "base_vocab_size": sp.base_vocab_size, "eod_id": sp.eod_id, "sha256": ["0" * 64]}
    assert not matches_recorded({**gone, "bos_id": 1}, sp)
    assert matches_recorded({**gone, "bos_id": None}, sp)
    assert matches_recorded(gone, sp)  # recorded before the BOS was: cannot tell
    assert matches_recorded(recorded_tokenizer("sentencepiece"), sp)  # its own files
