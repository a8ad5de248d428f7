"""transformers tokenizers (``tokenizer.json``) loaded offline, training a byte-level BPE, and
writing any megapar tokenizer in transformers' format (`save_for_transformers`, for exports).

A transformers tokenizer directory holds ``tokenizer.json`` (the whole pipeline: normalizer,
pre-tokenizer, model, post-processor) and usually ``tokenizer_config.json`` /
``special_tokens_map.json`` naming its BOS / EOS / PAD tokens. megapar reads ``tokenizer.json``
with the ``tokenizers`` library (what ``AutoTokenizer`` runs underneath, so the ids are the
same) and the special tokens from the JSON files; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable

from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

from megapar.data.assets import asset_path
from megapar.data.tokenizer import PROBE_TEXT, Tokenizer
from megapar.faults.processes import owner_tag, remove_stale_temporaries
from megapar.made_dirs import give_usual_mode

#: End-of-sequence tokens recognised when the directory names none.
COMMON_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
COMMON_BOS = ("<|begin_of_text|>", "<s>", "<bos>")


def _token(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_names(directory: str) -> dict[str, str | None]:
    """Each special-token role the directory's configs name, by key (``eos_token``, ...); a
    role set to null there (``"bos_token": null``: the tokenizer has none) maps to None."""
    names: dict[str, str | None] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # config wins
        path = os.path.join(directory, fname)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
                raise ValueError(
                    f"tokenizer file {path} is not valid JSON ({exc}); save the tokenizer again"
                ) from None
            if not isinstance(data, dict):
                raise ValueError(
                    f"tokenizer file {path} holds a JSON "
                    f"{type(data).__name__}, not an object of settings; save the "
                    f"tokenizer again"
                )
            for key in (
                "bos_token",
                "eos_token",
                "unk_token",
                "pad_token",
                "cls_token",
                "sep_token",
                "mask_token",
            ):
                token = _token(data.get(key))
                if token:
                    names[key] = token
                elif key in data and data[key] is None:
                    names[key] = None
    return names


def load_hf_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer of a transformers directory with ``tokenizer.json``."""

    path = os.path.join(directory, "tokenizer.json")
    try:
        backend = HFTokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception
        raise ValueError(
            f"tokenizer file {path} is damaged or not a tokenizers file "
            f"(tokenizers: {' '.join(str(exc).split())[:200]}); save the tokenizer "
            f"again (AutoTokenizer.from_pretrained(...).save_pretrained(DIR))"
        ) from None
    size = backend.get_vocab_size(with_added_tokens=True)
    names = _special_names(directory)
    _split_on_named_specials(backend, names)

    def find(key: str, fallbacks: Iterable[str] = ()) -> int | None:
        named = names.get(key)
        if key == "bos_token" and key in names and named is None:
            return None  # no BOS, said explicitly: a "<s>" in the vocabulary is not one
        for name in ([named] if named else []) + list(fallbacks):
            tid = backend.token_to_id(name)
            if tid is not None:
                return tid
        return None

    eos = find("eos_token", COMMON_EOS)
    if eos is None:  # BERT's tokenizers name no EOS: their [SEP] ends a segment
        eos = find("sep_token", ("[SEP]",))
    if eos is None:
        raise ValueError(
            f"tokenizer {directory}: no end-of-sequence token found (set eos_token "
            f"in tokenizer_config.json); it ends every document"
        )
    present = {"[EOD]": eos}
    for role, key in (
        ("[PAD]", "pad_token"),
        ("[CLS]", "cls_token"),
        ("[SEP]", "sep_token"),
        ("[MASK]", "mask_token"),
    ):
        tid = find(key)
        if tid is not None:
            present[role] = tid
    special = [
        t.id if hasattr(t, "id") else i
        for i, t in backend.get_added_tokens_decoder().items()
        if t.special
    ]
    tok = Tokenizer("hf", directory, backend, size, present, special + list(present.values()))
    # an EOS found by its usual name where tokenizer_config.json names none (transformers then
    # has no eos_token): megapar-data says which token ends the documents
    eos_name = backend.id_to_token(eos)
    guessed = names.get("eos_token") is None and eos_name in COMMON_EOS
    tok.eod_guessed = eos_name if guessed else None
    tok.unk_id = _unk_id(backend)
    _check_encodes_text(directory, backend, set(special) | set(present.values()), tok.unk_id)
    named = find("bos_token", COMMON_BOS)
    tok.named_bos_id = named if named is not None and named != eos else None
    before = _added_before(directory, backend)
    bos = before[0] if before else None
    if bos is not None and bos == present.get("[CLS]") and bos != named:
        bos = None  # BERT's [CLS]: its masked-LM samples put their own
    tok.bos_id = bos if bos is not None and bos != eos else None
    return tok


def _split_on_named_specials(backend, names: dict[str, str | None]) -> None:
    """Make the special tokens the directory's configs name (`_special_names`) that its
    tokenizer.json has in its vocabulary but not among its added tokens special ones, as
    ``AutoTokenizer.from_pretrained`` does when it loads them: a text that writes one out
    (``<|endoftext|>``) is then that token, not its spelling, in megapar as in transformers
    (a ``megapar-convert --to-hf`` export of the GPT-2 BPE names it in tokenizer_config.json
    only)."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = sorted(
        {n for n in names.values() if n and n not in added and backend.token_to_id(n) is not None}
    )
    if missing:
        backend.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in missing])


def _added_before(directory: str, backend) -> list[int]:
    """The ids the tokenizer.json's post-processor puts before a text's own (none without a
    post-processor), as ``AutoTokenizer.from_pretrained(directory)(text)`` starts with them:
    transformers 5 takes them from the post-processor alone, ignoring ``add_bos_token`` /
    ``add_eos_token`` in tokenizer_config.json beside a tokenizer.json. ValueError when they
    are more than one token (megapar starts a document with one, its BOS)."""
    plain = backend.encode(PROBE_TEXT, add_special_tokens=False).ids
    framed = backend.encode(PROBE_TEXT, add_special_tokens=True).ids
    before = _prefix_of(framed, plain)
    if len(before) > 1:
        names = [backend.id_to_token(i) for i in before]
        raise ValueError(
            f"tokenizer {directory}: its tokenizer.json's post-processor puts {len(before)} "
            f"tokens {' '.join(map(str, names))} before every text, and megapar starts a "
            f"document with at most one (its BOS); save it with a post-processor that puts "
            f"its BOS alone there: tok = AutoTokenizer.from_pretrained(DIR); "
            f"tok.add_bos_token = True; tok.save_pretrained(DIR)"
        )
    return before


def _prefix_of(framed: list[int], plain: list[int]) -> list[int]:
    """The ids before `plain` in `framed` (a text's ids with and without the special tokens
    added around them); none when `plain` is not in it."""
    for i in range(len(framed) - len(plain) + 1):
        if framed[i : i + len(plain)] == plain:
            return framed[:i]
    return []


def _unk_id(backend) -> int | None:
    """The id of the token a tokenizer.json's model gives text its vocabulary cannot spell
    (WordPiece's ``[UNK]``, a Unigram's ``unk_id``); None where it has none."""
    name = getattr(backend.model, "unk_token", None)
    if name:
        return backend.token_to_id(name)
    if type(backend.model).__name__ == "Unigram":
        unk = json.loads(backend.to_str())["model"].get("unk_id")
        return unk if isinstance(unk, int) else None
    return None


def _check_encodes_text(directory: str, backend, special: set[int], unk: int | None) -> None:
    """Refuse a tokenizer.json that cannot encode ordinary text: `PROBE_TEXT` gives no ids, or
    only special ones (e.g. a vocabulary of nothing but ``<|endoftext|>``, which some
    transformers versions write when a slow-style tokenizer is built from vocab/merges files and
    saved). Training on its output would train on end-of-document tokens alone. A probe that is
    all unknown tokens where the vocabulary has ordinary ones is a tokenizer of another script
    (one trained on Chinese spells no "Hello"): not refused."""
    ids = backend.encode(PROBE_TEXT, add_special_tokens=False).ids
    if ids and not all(i in special for i in ids):
        return
    total = backend.get_vocab_size(with_added_tokens=True)
    ordinary = total - len(special)
    if ids and unk is not None and ordinary > 0 and all(i == unk for i in ids):
        return
    what = (
        f"its tokenizer.json has {total:,} tokens, only special ones"
        if ordinary <= 0
        else f"{PROBE_TEXT!r} gives {list(ids) if ids else 'no ids'}, though its tokenizer.json "
        f"has {total:,} tokens"
    )
    raise ValueError(
        f"tokenizer {directory} encodes text to nothing: {what}; save it with "
        f"AutoTokenizer.from_pretrained(<original name or directory>).save_pretrained(...) "
        f"(or pass the vocab.json + merges.txt directory it came from, if any)"
    )


def train_bpe(
    texts: Iterable[str],
    out_dir: str,
    vocab_size: int,
    eos_token: str = "<|endoftext|>",
    info: dict | None = None,
) -> str:
    """Train a byte-level BPE (GPT-2 style) on `texts` with the tokenizers library; write a
    transformers directory (tokenizer.json + tokenizer_config.json) to `out_dir` (atomic).

    The vocabulary is smaller than `vocab_size` when the corpus runs out of pairs to merge;
    ``info["vocab_size"]`` (when `info` is given) receives the size it got."""

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for a byte-level BPE: it "
            f"needs at least {len(alphabet) + 1} (256 bytes + end of text)"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if info is not None:
        info["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "bos_token": eos_token,
        "unk_token": eos_token,
        "model_max_length": 1 << 30,
    }
    return _save_trained(tok, out_dir, config)


WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""A trained WordPiece's special tokens, ids 0-4 (bert-base-uncased's order, less its unused)."""


def train_wordpiece(
    texts: Iterable[str], out_dir: str, vocab_size: int, info: dict | None = None
) -> str:
    """Train a BERT WordPiece (uncased: BERT's normalizer lowercases and strips accents) on
    `texts` with the tokenizers library; write a transformers directory (tokenizer.json +
    tokenizer_config.json) to `out_dir` (atomic), as `BertTokenizerFast` saves one: `[PAD]
    [UNK] [CLS] [SEP] [MASK]` are ids 0-4, a text encodes as `[CLS] A [SEP]` (a pair `[CLS] A
    [SEP] B [SEP]`, B of token type 1), and megapar appends nothing to it.

    The vocabulary is smaller than `vocab_size` when the corpus runs out of pieces;
    ``info["vocab_size"]`` (when `info` is given) receives the size it got."""
    if vocab_size <= len(WORDPIECE_SPECIALS):
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for a WordPiece: its "
            f"{len(WORDPIECE_SPECIALS)} special tokens {' '.join(WORDPIECE_SPECIALS)} leave no "
            f"room for text"
        )
    tok = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(WORDPIECE_SPECIALS), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    if info is not None:
        info["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "tokenizer_class": "BertTokenizerFast",
        "do_lower_case": True,
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
        "model_max_length": 1 << 30,
    }
    return _save_trained(tok, out_dir, config)


def _save_trained(tok: HFTokenizer, out_dir: str, config: dict) -> str:
    """Write a trained tokenizer and its tokenizer_config.json as the transformers directory
    `out_dir`, atomically (replacing one there)."""
    out_dir = os.fspath(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = f".{os.path.basename(out_dir)}.tmp-"
    remove_stale_temporaries(parent, staging)  # a run killed with -9 while writing it
    tmp = tempfile.mkdtemp(prefix=f"{staging}{owner_tag()}-", dir=parent)
    give_usual_mode(tmp)  # mkdtemp's 0700 would keep the tokenizer from other users
    try:
        tok.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


SAMPLE_TEXTS = (
    "Hello world",
    "  two  spaces,\ta tab\nand a new line ",
    "Héllo wörld: ünïcödé, — ✓ 你好",
)
"""Texts an exported tokenizer must encode as megapar does, besides a piece of the shipped
Shakespeare sample (literal special tokens are left out: transformers gives their ids, megapar
the pieces of their text)."""


def encoding_difference(tok: Tokenizer, hf) -> str | None:
    """Where the transformers tokenizer `hf` encodes text otherwise than megapar's `tok`
    (without special tokens added): ``"encodes 'TEXT' differently (ids [...] vs [...] at token
    N)"`` for the first of `SAMPLE_TEXTS` and a piece of the shipped Shakespeare sample whose
    ids differ; None when every one encodes alike. The check an export makes of the tokenizer
    it writes (`save_for_transformers`), and megapar-train --from-hf of the directory's
    (`transformers_difference`)."""
    with open(asset_path("shakespeare_sample.txt"), encoding="utf-8") as f:
        texts = [*SAMPLE_TEXTS, f.read(4000)]
    hf.model_max_length = int(1e30)  # whole texts are encoded: no length warning
    for text in texts:
        ours, theirs = tok.encode(text), hf(text, add_special_tokens=False)["input_ids"]
        if ours != theirs:
            at = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)),
            )
            return (
                f"encodes {text[:40]!r} differently (ids {ours[at : at + 3]} vs "
                f"{theirs[at : at + 3]} at token {at})"
            )
    return None


def transformers_difference(directory: str, tok: Tokenizer) -> str | None:
    """Whether ``AutoTokenizer.from_pretrained(directory)`` (a transformers model directory:
    the tokenizer class comes from its config.json's model type and tokenizer_config.json, and
    for some model types, e.g. qwen2, that type's own splitting whatever the files say) encodes
    text as `tok`, megapar's reading of the directory's tokenizer files, does: None when it
    does, when transformers cannot load it (nothing to compare) and for a SentencePiece
    `tok` (its tokenizer.model is the model's original, which megapar encodes with the
    sentencepiece library: transformers' conversion of it is not what the ids are checked by),
    else what differs (the class it built and `encoding_difference`)."""
    from transformers import AutoTokenizer

    if tok.kind == "sentencepiece":
        return None
    try:
        hf = AutoTokenizer.from_pretrained(directory)
    except Exception:  # noqa: BLE001 - transformers raises many kinds; then no comparison
        return None
    differs = encoding_difference(tok, hf)
    return None if differs is None else f"AutoTokenizer builds a {type(hf).__name__} that {differs}"


def _trailing_space_is_a_token(tok: Tokenizer) -> bool:
    """Whether a space at the end of a text becomes a token of its own ("a " -> "a", "Ġ" in a
    byte-level BPE), i.e. the tokenizer keeps a word's leading space in the word's tokens
    ("Ġqueen"). WordPiece drops spaces, SentencePiece's normalizer strips a trailing one."""
    return tok.encode("a ") != tok.encode("a")


def to_transformers(
    tok: Tokenizer,
    vocab_size: int | None = None,
    sentence_pairs: bool = False,
    model_max_length: int | None = None,
):
    """A transformers fast tokenizer that encodes text to `tok`'s ids, carrying `tok`'s special
    tokens as megapar trains with them: its end of document as ``eos_token``, a beginning of
    sequence only when megapar-data starts documents with it (GPT-2's is its end of text, as
    in transformers), the ones megapar appends, such as [MASK], added at the same ids, but
    none at an id the model (of `vocab_size` ids, when given) does not have: a transformers
    GPT-2 of 50,257 ids gets no [PAD] at 50,257 that batch padding would look up. An appended
    [MASK] takes the space before it (``lstrip``, as RoBERTa's ``<mask>``) where the tokenizer
    keeps a word's space in the word's tokens (byte-level BPE): megapar masks whole tokens, so
    "The king is [MASK]" must not leave a stray space token before the mask. A SentencePiece
    model is converted by transformers from the model's own settings; a transformers directory
    is loaded as it is. With `sentence_pairs` (a BERT export) encoding adds [CLS] A [SEP] (and
    B [SEP], token type 1) as megapar's masked-LM samples have them (a transformers directory's
    own post-processor is kept where it adds them already). `model_max_length`: the
    model's positions, where ``truncation=True`` cuts (transformers' default is unbounded)."""

    hf = _base_tokenizer(tok)
    if not sentence_pairs:
        hf = _as_causal(hf, tok)
    limit = vocab_size if vocab_size is not None else tok.vocab_size
    appended: list[str | AddedToken] = [
        name for i, name in enumerate(tok.appended) if tok.base_vocab_size + i < limit
    ]
    if "[MASK]" in appended and _trailing_space_is_a_token(tok):
        appended[appended.index("[MASK]")] = AddedToken(
            "[MASK]", lstrip=True, special=True, normalized=False
        )
    if appended:
        hf.add_special_tokens(
            {"additional_special_tokens": appended}, replace_extra_special_tokens=False
        )
    roles = {
        role: tid
        for role, tid in (
            ("eos_token", tok.eod_id),
            ("pad_token", tok.pad_id),
            ("cls_token", tok.cls_id),
            ("sep_token", tok.sep_id),
            ("mask_token", tok.mask_id),
        )
        if tid < limit
    }
    if tok.bos_id is not None:
        roles["bos_token"] = tok.bos_id
    elif tok.kind == "gpt2-bpe":  # GPT-2's own: <|endoftext|> begins, ends and is unknown
        roles.update(bos_token=tok.eod_id, unk_token=tok.eod_id)
    for role, tid in roles.items():
        if getattr(hf, role, None) is None:
            setattr(hf, role, hf.convert_ids_to_tokens(tid))
    if sentence_pairs and {"cls_token", "sep_token"} <= set(roles) and not _adds_cls_sep(hf, tok):
        _add_pair_template(hf, tok)
    if model_max_length is not None:
        hf.model_max_length = model_max_length
    return hf


def _base_tokenizer(tok: Tokenizer):
    """`tok` as a transformers fast tokenizer before megapar's special tokens are added: a
    transformers directory loaded as it is, a SentencePiece model converted by transformers
    (without a BOS), a GPT-2 style BPE from megapar's own tokenizers pipeline."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tok.kind == "hf":
        hf = AutoTokenizer.from_pretrained(tok.path)
    elif tok.kind == "sentencepiece":
        with tempfile.TemporaryDirectory() as d:
            shutil.copy(tok.path, os.path.join(d, "tokenizer.model"))
            hf = PreTrainedTokenizerFast.from_pretrained(d)
        # megapar's documents never begin with the model's <s>: no BOS, so clients such as
        # lm-eval put the end of document before a text, as in training
        hf.bos_token = None
    else:  # GPT-2 style vocab.json + merges.txt: megapar's own tokenizers pipeline
        hf = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok._backend.to_str()))
    return hf


def _as_causal(hf, tok: Tokenizer):
    """`hf`, or where it adds other special tokens to a text than megapar-data adds to a
    document's start (a WordPiece's [CLS] A [SEP]: a causal LM's prompt would then end in its
    end of document), a plain fast tokenizer of the same pipeline adding only the BOS megapar
    starts documents with, if any (BertTokenizer's class would put [CLS] A [SEP] back on
    load). Its inputs are ``input_ids`` and ``attention_mask`` (a causal LM takes no
    ``token_type_ids``)."""
    from transformers import PreTrainedTokenizerFast

    start = [] if tok.bos_id is None else [tok.bos_id]
    if hf("a", add_special_tokens=True)["input_ids"] == start + tok.encode("a"):
        return hf
    backend = hf._tokenizer  # a fast tokenizer's, always there
    assert backend is not None
    if tok.bos_id is None:
        template = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    else:
        bos = hf.convert_ids_to_tokens(tok.bos_id)
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, tok.bos_id)]
        )
    before = backend.post_processor  # byte-level BPE's offset trimming is kept
    backend.post_processor = (
        processors.Sequence([before, template])
        if isinstance(before, processors.ByteLevel)
        else template
    )
    plain = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=hf.unk_token)
    plain.model_input_names = ["input_ids", "attention_mask"]
    return plain


def _adds_cls_sep(hf, tok: Tokenizer) -> bool:
    """Whether `hf` already encodes a text as [CLS] A [SEP] with `tok`'s ids, as megapar's
    masked-LM samples have it (a transformers BERT directory's own post-processor; a
    tokenizer.json saved without one, or with transformers' empty template, does not)."""
    if tok.kind != "hf":  # converted or built here: no post-processor of its own
        return False
    ids = hf("a", add_special_tokens=True)["input_ids"]
    return len(ids) >= 2 and ids[0] == tok.cls_id and ids[-1] == tok.sep_id


def _add_pair_template(hf, tok: Tokenizer) -> None:
    """Make `hf` encode [CLS] A [SEP] (and B [SEP], token type 1) as megapar's masked-LM
    samples have them, keeping a byte-level BPE's post-processor before it."""
    cls, sep = hf.convert_ids_to_tokens(tok.cls_id), hf.convert_ids_to_tokens(tok.sep_id)
    template = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.cls_id), (sep, tok.sep_id)],
    )
    backend = hf._tokenizer  # a fast tokenizer's, always there
    assert backend is not None
    before = backend.post_processor  # byte-level BPE's offset trimming is kept
    backend.post_processor = (
        processors.Sequence([before, template])
        if isinstance(before, processors.ByteLevel)
        else template
    )
    hf.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    hf.init_kwargs["model_input_names"] = hf.model_input_names  # saved in its config


SPECIAL_ROLES = ("pad", "bos", "eos", "cls", "sep", "mask")
"""The special tokens whose ids a model config may name too (``pad_token_id`` ...)."""


TOKENIZER_TMP = ".tokenizer.tmp-"
"""The prefix of the directory `save_for_transformers` writes and checks a tokenizer in, beside
its destination, named with `owner_tag` so that the next export there removes a killed one's
(`checkpoint.hf`'s sweep)."""


def save_for_transformers(
    tok: Tokenizer,
    out_dir: str,
    vocab_size: int | None = None,
    sentence_pairs: bool = False,
    model_max_length: int | None = None,
    info: dict | None = None,
) -> list[str]:
    """Write `tok` into `out_dir` as transformers' ``save_pretrained`` does (tokenizer.json,
    tokenizer_config.json, and a SentencePiece model's ``tokenizer.model``), so that
    ``AutoTokenizer.from_pretrained(out_dir)`` is the training tokenizer (`to_transformers`;
    `model_max_length`: the model's positions). Checked before anything is written: the saved
    tokenizer, loaded back, encodes `SAMPLE_TEXTS` and a piece of the shipped Shakespeare
    sample to `tok`'s ids (ValueError otherwise). Returns the names of the files written (each
    replaced whole); ``info`` (when given) receives the written tokenizer's special ids
    (``pad_token_id``, ... ``mask_token_id``, None where it has no such token), which the
    model's config must repeat."""

    from transformers import AutoTokenizer

    hf = to_transformers(tok, vocab_size, sentence_pairs, model_max_length)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{TOKENIZER_TMP}{owner_tag()}-", dir=parent)
    try:
        hf.save_pretrained(tmp)
        if tok.kind == "sentencepiece":
            shutil.copy(tok.path, os.path.join(tmp, "tokenizer.model"))
        config_path = os.path.join(tmp, "tokenizer_config.json")
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        if config.get("tokenizer_class") == "TokenizersBackend":  # older transformers' name
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        back = AutoTokenizer.from_pretrained(tmp)
        differs = encoding_difference(tok, back)
        if differs:
            raise ValueError(
                f"tokenizer {tok.path}: transformers' version of it {differs}; not exported"
            )
        if info is not None:
            info.update(
                {f"{role}_token_id": getattr(back, f"{role}_token_id") for role in SPECIAL_ROLES}
            )
        names = sorted(os.listdir(tmp))
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names
