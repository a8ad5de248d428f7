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
from tokenizers import processors

from megapar.cli.data import main as data_main
from megapar.data import IndexedDataset, asset_path, load_tokenizer
from megapar.data.tokenizers import encodes_alike

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
    umask = os.umask(0)
    os.umask(umask)  # the folder's mode is the umask's, as the data files' are (it was 0700)
    assert os.stat(directory).st_mode & 0o777 == 0o777 & ~umask
    ds = IndexedDataset(prefix)
    assert ds.tokenizer_spec["kind"] == "hf" and ds.vocab_size == ours.vocab_size
    first = [p for p in TEXT.split("\n\n") if p.strip()][0].strip("\n")
    assert ds.doc(0).tolist() == auto.encode(first, add_special_tokens=False) + [ours.eod_id]


def test_train_wordpiece_gives_a_bert_tokenizer(tmp_path, capsys):
    """--train-tokenizer wordpiece (was "invalid choice"): an uncased BERT WordPiece that
    transformers loads as its (fast) BertTokenizer, encodes as megapar does, brings [PAD] [UNK] [CLS]
    [SEP] [MASK] (nothing appended; [SEP] ends each document) and encodes a pair as BERT."""
    text = tmp_path / "sample.txt"
    text.write_text(TEXT)
    prefix = str(tmp_path / "wp")
    assert data_main(["--train-tokenizer", "wordpiece", "--vocab-size", "600", "--input",
                      str(text), "--output-prefix", prefix, "--split-lines",
                      "--no-progress"]) == 0
    # the tokenizers library's WordPiece training differs run to run (its issue 1794)
    assert "WordPiece training is not deterministic" in capsys.readouterr().err
    ours, auto = _same_as_auto(prefix + "-tokenizer")
    assert type(auto).__name__.startswith("BertTokenizer") and auto.is_fast and len(auto) == 600
    assert ours.appended == [] and ours.base_vocab_size == ours.vocab_size == 600
    assert [ours.pad_id, ours.cls_id, ours.sep_id, ours.mask_id, ours.eod_id] == [0, 2, 3, 4, 3]
    assert (auto.mask_token_id, auto.unk_token_id, auto.pad_token_id) == (4, 1, 0)
    pair = auto("To be", "or not")
    a, b = ours.encode("To be"), ours.encode("or not")
    assert pair["input_ids"] == [2, *a, 3, *b, 3]
    assert pair["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert auto.decode(auto("HeLLo World")["input_ids"], skip_special_tokens=True) == "hello world"
    ds = IndexedDataset(prefix)
    first = [p for p in TEXT.split("\n\n") if p.strip()][0].strip("\n")
    assert ds.doc(0).tolist() == auto.encode(first, add_special_tokens=False) + [3]


def test_train_bpe_into_the_input_directory_does_not_read_its_own_tokenizer(tmp_path):
    # --output-prefix inside the input directory: the tokenizer.json the run trains (and, with
    # --overwrite, the one an earlier run trained) is not read back as a .json input
    (tmp_path / "sample.txt").write_text(TEXT)
    prefix = str(tmp_path / "bpe")
    for again in ([], ["--overwrite"]):
        assert data_main(["--train-tokenizer", "bpe", "--vocab-size", "600", "--input",
                          str(tmp_path), "--output-prefix", prefix, "--no-progress",
                          *again]) == 0
        ds = IndexedDataset(prefix)
        assert ds.num_docs == 1 and ds.tokenizer_spec["kind"] == "hf"
    assert os.path.isfile(prefix + "-tokenizer/tokenizer.json")
    # another run on that directory: the dataset and the tokenizer it records are not text
    other = str(tmp_path / "out" / "gpt2")
    assert data_main(["--input", str(tmp_path), "--output-prefix", other, "--no-progress"]) == 0
    assert IndexedDataset(other).num_docs == 1


def _with_s_tokens(gpt2_dir, directory, bos, template=False):
    """A copy of the GPT-2 tokenizer in `directory` with <s> and </s> added after its
    vocabulary as special tokens, </s> its EOS and `bos` its tokenizer_config's bos_token, and
    with `template` a post-processor putting <s> before every text as Llama's does: (the
    directory, the vocabulary size before them, the config written)."""
    shutil.copytree(gpt2_dir, directory)
    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    tok["added_tokens"] += [{"id": vocab + i, "content": name, "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False,
                             "special": True} for i, name in enumerate(["<s>", "</s>"])]
    if template:
        tok["post_processor"] = json.loads(processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", vocab)]).__getstate__())
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(bos_token=bos, eos_token="</s>")
    config.pop("added_tokens_decoder", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory, vocab, config


def test_llama_style_bos_starts_every_document(tmp_path, gpt2_dir):
    directory, vocab, _ = _with_s_tokens(gpt2_dir, tmp_path / "llama-style", "<s>", True)
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
        assert ds.doc(i).tolist() == expected == auto(doc)["input_ids"] + [vocab + 1]


def test_an_explicit_null_bos_token_means_no_bos(tmp_path, gpt2_dir):
    # megapar's export of a SentencePiece-trained model writes "bos_token": null (its documents
    # never began with <s>), though "<s>" is in the vocabulary: read back (megapar-convert
    # --from-hf, megapar-data --tokenizer EXPORT) it must not start every document with <s>,
    # as AutoTokenizer does not either
    directory, vocab, config = _with_s_tokens(gpt2_dir, tmp_path / "null-bos", None)
    (directory / "special_tokens_map.json").unlink(missing_ok=True)
    auto = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert auto.bos_token_id is None
    ours = load_tokenizer(str(directory))
    assert ours.eod_id == vocab + 1 and ours.bos_id is None
    # the key left out altogether: a conventional <s> is its BOS, but transformers, whose
    # post-processor adds none, starts no text with it, and megapar no document
    config.pop("bos_token")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    named = load_tokenizer(str(directory))
    assert named.named_bos_id == vocab and named.bos_id is None
    assert transformers.AutoTokenizer.from_pretrained(str(directory))("Hi")["input_ids"] == \
        named.encode("Hi")
    # a post-processor that puts <s> before a text: transformers and megapar start with it,
    # whether or not a bos_token is named (null included)
    for bos in (None, "<s>"):
        directory, *_ = _with_s_tokens(gpt2_dir, tmp_path / f"template-{bos}", bos, True)
        with_bos = load_tokenizer(str(directory))
        assert with_bos.bos_id == vocab
        assert transformers.AutoTokenizer.from_pretrained(str(directory))("Hi")["input_ids"] \
            == [vocab, *with_bos.encode("Hi")]
        # documents that begin with <s> are other data: not the same tokenizer in another format
        assert not encodes_alike(ours, with_bos)


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


def _wordpiece_dir(root: Path, with_mask: bool, eos: bool = True, template: bool = True) -> str:
    """A BERT-style WordPiece tokenizer directory (lower case, spaces dropped, [CLS] A [SEP],
    or, `template` False, saved without a post-processor: no [CLS] / [SEP] added), with [SEP]
    as its end of sequence, or (`eos` False) no end of sequence, as BERT's hub tokenizers have
    it; with or without its own [MASK]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + (["[MASK]"] if with_mask else [])
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([TEXT], trainers.WordPieceTrainer(
        vocab_size=800, special_tokens=specials, show_progress=False))
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    roles = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                 **({"eos_token": "[SEP]"} if eos else {}),
                 **({"mask_token": "[MASK]"} if with_mask else {}))
    out = root / (f"wordpiece{'-mask' if with_mask else ''}{'' if eos else '-no-eos'}"
                  f"{'' if template else '-no-template'}")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **roles).save_pretrained(out)
    return str(out)


MASK_SPECS = {  # name: (spec, whether the exported [MASK] takes the space before it)
    "gpt2": (lambda root, gpt2_dir: "gpt2", True),
    "gpt2 transformers directory": (lambda root, gpt2_dir: gpt2_dir, True),
    "sentencepiece": (lambda root, gpt2_dir: "sentencepiece", False),
    "wordpiece with its [MASK]": (lambda root, gpt2_dir: _wordpiece_dir(root, True), False),
    "wordpiece, [MASK] appended": (lambda root, gpt2_dir: _wordpiece_dir(root, False), False),
    "wordpiece without a post-processor": (
        lambda root, gpt2_dir: _wordpiece_dir(root, True, template=False), False),
}


@pytest.mark.parametrize("name", sorted(MASK_SPECS))
def test_an_exported_mask_follows_the_text_as_megapar_masks_it(tmp_path, gpt2_dir, name):
    """megapar masks whole tokens, so "The king is [MASK]" must encode as the text before the
    mask, then the mask: a byte-level BPE keeps a word's space in the word ("Ġqueen"), so its
    appended [MASK] takes the space before it (lstrip, as RoBERTa's <mask>); WordPiece drops
    spaces and SentencePiece's normalizer strips a trailing one, so theirs keep lstrip off (as
    BERT's hub tokenizers have it). The export also truncates at the model's positions."""
    from conftest import skip_unless_transformers_converts

    from megapar.data.hf_tokenizer import save_for_transformers

    make, lstrip = MASK_SPECS[name]
    spec = make(tmp_path, gpt2_dir)
    if spec == "sentencepiece":
        skip_unless_transformers_converts()
    ours, out = load_tokenizer(spec), tmp_path / "exported"
    save_for_transformers(ours, str(out), sentence_pairs=True, model_max_length=48)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    before = ours.encode("The king is")
    assert hf("The king is [MASK]", add_special_tokens=False)["input_ids"] == \
        [*before, ours.mask_id]
    # [CLS] A [SEP] as megapar's masked-LM samples have it, whatever the tokenizer's own
    # post-processor (a transformers directory's, GPT-2's or a WordPiece one's, added none)
    assert hf("The king is [MASK]")["input_ids"] == [ours.cls_id, *before, ours.mask_id,
                                                     ours.sep_id]
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert next(t for t in added if t["content"] == "[MASK]")["lstrip"] is lstrip
    assert hf.model_max_length == 48
    assert len(hf(TEXT, truncation=True)["input_ids"]) == 48


def test_a_wordpiece_tokenizer_saved_without_a_post_processor_exports_as_megapar_trains(
        tmp_path):
    """A WordPiece tokenizer.json with no post-processor: megapar's masked-LM samples are
    [CLS] A [SEP] B [SEP] (B's token type 1) with it, and the BERT export's tokenizer,
    loaded by AutoTokenizer, now encodes a pair so too (it was exported as it was, adding
    neither [CLS] nor [SEP])."""
    from megapar.data.hf_tokenizer import save_for_transformers

    directory = _wordpiece_dir(tmp_path, with_mask=True, template=False)
    source = transformers.AutoTokenizer.from_pretrained(directory)
    assert source("the king")["input_ids"] == source("the king", add_special_tokens=False)[
        "input_ids"]  # the tokenizer itself adds nothing
    ours, out = load_tokenizer(directory), tmp_path / "exported"
    save_for_transformers(ours, str(out), sentence_pairs=True)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    a, b = ours.encode("the king is"), ours.encode("a queen")
    pair = hf("the king is", "a queen")
    assert pair["input_ids"] == [ours.cls_id, *a, ours.sep_id, *b, ours.sep_id]
    assert pair["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)


def test_a_bert_tokenizer_without_an_eos_ends_documents_with_its_sep(tmp_path):
    """A BERT tokenizer directory names no eos_token (bert-base-uncased's has [CLS] [SEP] [PAD]
    [MASK] only): megapar-data refused it ("no end-of-sequence token found"), so no BERT
    tokenizer could prepare BERT data as it was saved. Its [SEP] now ends each document, the
    dataset records it, and a directory that names neither is still refused."""
    directory = _wordpiece_dir(tmp_path, with_mask=True, eos=False)
    config = json.loads((Path(directory) / "tokenizer_config.json").read_text())
    assert "eos_token" not in config and config["sep_token"] == "[SEP]"
    tok = load_tokenizer(directory)
    sep = transformers.AutoTokenizer.from_pretrained(directory).sep_token_id
    assert tok.eod_id == tok.sep_id == sep == 3 and tok.mask_id == 4 and tok.appended == []
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert data_main(["--input", str(text), "--output-prefix", str(tmp_path / "d"),
                      "--tokenizer", directory, "--no-progress"]) == 0
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.eod_id == 3
    assert list(ds.get(0, ds.doc_offsets[1])) == tok.encode(TEXT) + [3]
    config.pop("sep_token")
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))
    (Path(directory) / "special_tokens_map.json").unlink(missing_ok=True)
    tokenizer_json = json.loads((Path(directory) / "tokenizer.json").read_text())
    for added in tokenizer_json["added_tokens"]:
        if added["content"] == "[SEP]":
            added["content"] = "[SEGMENT]"
    tokenizer_json["model"]["vocab"]["[SEGMENT]"] = tokenizer_json["model"]["vocab"].pop("[SEP]")
    (Path(directory) / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(ValueError, match="no end-of-sequence token found"):
        load_tokenizer(directory)


# A tokenizer.json built here with the tokenizers library: a word-level vocabulary with the
# special tokens of each family, the post-processor and tokenizer_config.json varied below.
WORDS = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<|endoftext|>": 5,
         "[CLS]": 6, "[SEP]": 7}
POST = {
    "none": None,
    "bytelevel": "bytelevel",  # GPT-2's and Qwen's: adds no token
    "<s> $A": ["<s>"],  # Llama 2's / Llama 3's (<|begin_of_text|>) / Gemma's
    "<s> $A </s>": ["<s>", "</s>"],
    "<|endoftext|> $A": ["<|endoftext|>"],
    "[CLS] $A [SEP]": ["[CLS]", "[SEP]"],  # BERT's
    "<s> <s> $A": ["<s>"],
}


def _word_tokenizer(directory: Path, post: str, config: dict) -> str:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(WORDS, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in WORDS if not t.isalpha()])
    if POST[post] == "bytelevel":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif POST[post] is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=post, pair=f"{post} $B:1",
            special_tokens=[(t, WORDS[t]) for t in POST[post]])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def _document_ids(tmp_path, directory: str, text: str) -> list[int]:
    """The ids megapar-data writes for `text` as one document (its end-of-document token
    included)."""
    from megapar.data.preprocess import preprocess_files

    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    preprocess_files([str(tmp_path / "doc.jsonl")], str(tmp_path / "ds"), directory,
                     workers=1, progress=False)
    return IndexedDataset(str(tmp_path / "ds")).doc(0).tolist()


S, EOS = {"bos_token": "<s>"}, {"eos_token": "</s>"}
ADD_BOS, NO_BOS = {"add_bos_token": True}, {"add_bos_token": False}
ADD_EOS, NO_EOS = {"add_eos_token": True}, {"add_eos_token": False}
QWEN = {"bos_token": None, "eos_token": "<|endoftext|>"}


@pytest.mark.parametrize("post,config", [
    ("none", {**S, **EOS, **ADD_BOS}),
    ("none", {**S, **EOS, **NO_BOS}),
    ("none", {**S, **EOS}),
    ("none", {**EOS}),  # no bos_token named: a <s> in the vocabulary is not added either
    ("none", {**S, **EOS, **ADD_BOS, **ADD_EOS}),
    ("bytelevel", {**S, **EOS, **ADD_BOS}),
    ("bytelevel", {**S, **EOS}),
    ("bytelevel", QWEN),
    ("bytelevel", {**QWEN, **ADD_BOS, **ADD_EOS}),
    ("<s> $A", {**S, **EOS}),
    ("<s> $A", {**S, **EOS, **NO_BOS}),
    ("<s> $A", {**S, **EOS, **ADD_BOS, **NO_EOS}),
    ("<s> $A", {**S, **EOS, **ADD_EOS}),
    ("<s> $A", {"bos_token": None, **EOS}),  # null in the config, added by the post-processor
    ("<s> $A", {**EOS}),
    ("<s> $A", QWEN),
    ("<s> $A </s>", {**S, **EOS}),
    ("<s> $A </s>", {**S, **EOS, **NO_BOS, **NO_EOS}),
])
def test_a_document_starts_and_ends_as_transformers_frames_its_text(tmp_path, post, config):
    """A document of a tokenizer.json directory is transformers' ids for its text
    (``AutoTokenizer.from_pretrained(DIR)(text)``: the BOS where the tokenizer.json's
    post-processor adds one, none where it adds none, whatever the tokenizer's bos_token is and
    whatever tokenizer_config.json's add_bos_token / add_eos_token say, which transformers 5
    ignores beside a tokenizer.json), then the end-of-document token unless they end with it.
    megapar started every document with any BOS it found, the post-processor unread."""
    directory = _word_tokenizer(tmp_path / "tok", post, config)
    text = "hello world hello"
    theirs = transformers.AutoTokenizer.from_pretrained(directory)(text)["input_ids"]
    eod = load_tokenizer(directory).eod_id
    assert theirs[theirs.index(3):][:3] == [3, 4, 3]  # the text's own ids are there
    expected = theirs if theirs[-1:] == [eod] else [*theirs, eod]
    assert _document_ids(tmp_path, directory, text) == expected


@pytest.mark.parametrize("post,config,theirs,ours", [
    # the EOS begins a text: the end of the document before stands there already (and the
    # first document starts without it)
    ("<|endoftext|> $A", {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
     [5, 3, 4, 3], [3, 4, 3, 5]),
    # BERT's [CLS] begins no document: its masked-LM samples put [CLS] and [SEP] themselves
    ("[CLS] $A [SEP]", {"cls_token": "[CLS]", "sep_token": "[SEP]", "eos_token": "[SEP]"},
     [6, 3, 4, 3, 7], [3, 4, 3, 7]),
    # a token the post-processor puts after a text other than the EOS is not added
    ("<s> $A </s>", {**S, "eos_token": "<|endoftext|>"}, [1, 3, 4, 3, 2], [1, 3, 4, 3, 5]),
])
def test_where_a_document_differs_from_transformers_framing(tmp_path, post, config, theirs,
                                                            ours):
    """The three framings megapar does not repeat (docs/guides/data.md says so)."""
    directory = _word_tokenizer(tmp_path / "tok", post, config)
    text = "hello world hello"
    assert transformers.AutoTokenizer.from_pretrained(directory)(text)["input_ids"] == theirs
    assert _document_ids(tmp_path, directory, text) == ours


def test_a_post_processor_adding_two_tokens_before_a_text_is_refused(tmp_path, capsys):
    """A document starts with one BOS at most: a post-processor putting more before a text
    is refused in one line naming the fix, which gives transformers' ids and megapar's alike."""
    directory = _word_tokenizer(tmp_path / "tok", "<s> <s> $A", {**S, **EOS})
    (tmp_path / "doc.txt").write_text("hello world\n")
    assert data_main(["--input", str(tmp_path / "doc.txt"), "--output-prefix",
                      str(tmp_path / "ds"), "--tokenizer", directory, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        "post-processor puts 2 tokens <s> <s> before every text, and megapar starts a document "
        "with at most one (its BOS); save it with a post-processor that puts its BOS alone "
        "there: tok = AutoTokenizer.from_pretrained(DIR); tok.add_bos_token = True; "
        "tok.save_pretrained(DIR)") in err, err
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    tok.add_bos_token = True
    tok.save_pretrained(directory)
    assert _document_ids(tmp_path, directory, "hello world") == [1, 3, 4, 2] == \
        [*transformers.AutoTokenizer.from_pretrained(directory)("hello world")["input_ids"], 2]


@pytest.mark.parametrize("post,config,before", [
    ("none", {**S, **EOS, **NO_BOS}, 1),  # documents began with <s>, now none
    ("<s> $A", {"bos_token": None, **EOS}, None),  # began with none, now <s>
    ("<s> $A", {"bos_token": "</s>", "eos_token": "<|endoftext|>"}, 2),  # </s>, now <s>
])
def test_a_text_cached_with_another_bos_is_tokenized_again(tmp_path, monkeypatch, post, config,
                                                           before):
    """megapar-train's cache of a raw text is keyed by the tokenizer's files, which did not
    change: a copy tokenized when documents began with `before` must not be reused now."""
    import megapar.data.hf_tokenizer as hf_tokenizer
    from megapar.data.preprocess import ensure_dataset
    from megapar.data.tokenizers import forget_loaded

    directory = _word_tokenizer(tmp_path / "tok", post, config)
    (tmp_path / "t.txt").write_text("hello world\n\nworld hello\n")
    forget_loaded()
    with monkeypatch.context() as m:  # the BOS megapar took before
        m.setattr(hf_tokenizer, "_added_before",
                  lambda *_: [] if before is None else [before])
        old = ensure_dataset(str(tmp_path / "t.txt"), directory, str(tmp_path / "cache"))
    forget_loaded()
    new = ensure_dataset(str(tmp_path / "t.txt"), directory, str(tmp_path / "cache"))
    forget_loaded()
    assert new != old
    theirs = transformers.AutoTokenizer.from_pretrained(directory)("hello world")["input_ids"]
    assert IndexedDataset(old).doc(0).tolist()[0] == (3 if before is None else before)
    assert IndexedDataset(new).doc(0).tolist()[: len(theirs)] == theirs


def test_an_exports_tokenizer_reads_a_written_out_special_token_as_transformers_does(tmp_path):
    """`megapar-convert --to-hf` of a GPT-2 BPE model writes a tokenizer.json whose added
    tokens hold the appended [PAD] [CLS] [SEP] [MASK] only, and names <|endoftext|> as its
    bos / eos / unk in tokenizer_config.json; AutoTokenizer makes that a special token when it
    loads it, megapar spelled it out (7 ids), so megapar-data on that directory gave other ids
    than transformers for the same text. The configs' named tokens are special in both now."""
    from megapar.data.hf_tokenizer import save_for_transformers

    out = tmp_path / "exported"
    save_for_transformers(load_tokenizer("gpt2"), str(out))
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert "<|endoftext|>" not in {t["content"] for t in added}
    ours, hf = load_tokenizer(str(out)), transformers.AutoTokenizer.from_pretrained(out)
    for text in ("Hello there<|endoftext|>after", " <|endoftext|> x<|endoftext|><|endoftext|>",
                 "a [PAD] b [MASK]c"):
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
    assert ours.encode("there<|endoftext|>after") == [8117, 50256, 8499]
    assert load_tokenizer("gpt2").encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]


def test_a_text_ending_in_the_eos_ends_with_it_once(tmp_path):
    """A text (or an SFT record's response) whose last token is the EOS written out, which a
    tokenizer.json encodes as the EOS: the document got a second EOS after it (data.md: the
    EOS follows "unless that ends with it"), so an SFT model learned EOS after EOS."""
    directory = _wordpiece_dir(tmp_path, with_mask=True)  # [SEP] (3) ends documents
    tok = load_tokenizer(directory)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "the king [SEP]"}) + "\n"
                                      + json.dumps({"text": "the king"}) + "\n")
    (tmp_path / "r.jsonl").write_text(json.dumps({"prompt": "the", "response": "king [SEP]"})
                                      + "\n")
    for name, args in (("t", []), ("r", ["--sft-keys", "prompt,response"])):
        assert data_main(["--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix",
                          str(tmp_path / name), "--tokenizer", directory, "--no-progress",
                          *args]) == 0
    king = tok.encode("the king")
    ds = IndexedDataset(str(tmp_path / "t"))
    assert ds.doc(0).tolist() == ds.doc(1).tolist() == king + [tok.eod_id]
    assert IndexedDataset(str(tmp_path / "r")).doc(0).tolist() == king + [tok.eod_id]


def test_an_eos_found_by_its_usual_name_is_named_in_a_note(tmp_path, capsys):
    """A tokenizer_config.json naming no eos_token: megapar takes an <|endoftext|> (or </s>,
    ...) of the vocabulary as the end of document, where transformers has none; it did so
    without a word."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT[:5000])
    assert data_main(["--train-tokenizer", "bpe", "--vocab-size", "300", "--input", str(text),
                      "--output-prefix", str(tmp_path / "bpe"), "--no-progress"]) == 0
    # the size trained and the dataset's (it said "vocab size 304" alone, for 300 asked)
    assert ("tokenizer.json (300 ids; the dataset's vocabulary adds [PAD] [CLS] [SEP] [MASK], "
            "which megapar appends") in capsys.readouterr().err
    directory = tmp_path / "bpe-tokenizer"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for key in ("eos_token", "bos_token", "unk_token"):
        config.pop(key, None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert data_main(["--input", str(text), "--output-prefix", str(tmp_path / "again"),
                      "--tokenizer", str(directory), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert (f"tokenizer {directory} names no eos_token in its tokenizer_config.json; its "
            "'<|endoftext|>' (id 0) ends each document") in err, err
