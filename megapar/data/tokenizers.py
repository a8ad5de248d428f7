"""Tokenizers: the GPT-2 byte-level BPE and SentencePiece, behind one small interface.

``load_tokenizer(spec)`` accepts:

* ``"gpt2"`` -- the GPT-2 BPE shipped in ``megapar/assets`` (50,257 tokens);
* a directory holding ``vocab.json`` + ``merges.txt`` -- any GPT-2 style byte-level BPE;
* a path to a SentencePiece ``.model`` file;
* ``"sentencepiece"`` -- the small SentencePiece model shipped in ``megapar/assets``;
* a transformers tokenizer directory holding ``tokenizer.json`` (or that file's path): loaded
  offline with the ``tokenizers`` library, exactly as ``AutoTokenizer`` tokenizes text. Its own
  end-of-sequence token (``eos_token`` of ``tokenizer_config.json`` /
  ``special_tokens_map.json``) is the end-of-document token, and its own beginning-of-sequence
  token (``bos_id``), when it has a different one, starts every document in megapar-data.

Special tokens.  Every tokenizer exposes ``eod_id``, ``pad_id``, ``cls_id``, ``sep_id``
and ``mask_id``.  Those found in the base vocabulary are used as they are (GPT-2's
``<|endoftext|>`` = 50256 is the end-of-document token; a SentencePiece model's ``</s>``
is its end-of-document token and pieces named ``[PAD]``, ``[CLS]``, ``[SEP]``,
``[MASK]`` are used when present).  The ones the base vocabulary lacks are appended
after it in the fixed order of ``APPENDED_ORDER`` -- ``[PAD] [CLS] [SEP] [MASK] [EOD]``
-- skipping those already present, so ``vocab_size`` grows deterministically.  For
GPT-2 this gives ``[PAD]``=50257, ``[CLS]``=50258, ``[SEP]``=50259, ``[MASK]``=50260 and
``vocab_size`` = 50261.  ``encode`` never produces appended ids (the text is always
tokenized by the base vocabulary; a literal ``<|endoftext|>`` in the text is plain text).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

#: Names of the special tokens, in the order they are appended when missing.
APPENDED_ORDER: tuple[str, ...] = ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[EOD]")

#: The attribute each special token name fills.
_ROLE_OF: dict[str, str] = {
    "[PAD]": "pad_id", "[CLS]": "cls_id", "[SEP]": "sep_id", "[MASK]": "mask_id", "[EOD]": "eod_id",
}


def asset_path(name: str) -> str:
    """Absolute path of a file shipped in ``megapar/assets`` (e.g. ``"gpt2_vocab.json"``)."""
    path = Path(__file__).resolve().parent.parent / "assets" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"megapar asset {name!r} not found at {path}; the package install is incomplete "
            "-- reinstall megapar (pip install -e .) so that megapar/assets/* is included"
        )
    return str(path)


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens of a tokenizer, as needed by the datasets."""

    pad_id: int
    """Padding token."""
    cls_id: int
    """``[CLS]``: first token of an MLM sample."""
    sep_id: int
    """``[SEP]``: ends each MLM segment."""
    mask_id: int
    """``[MASK]``: replaces masked tokens."""
    eod_id: int
    """End of document: written after every document in the indexed dataset."""
    base_vocab_size: int
    """Size of the tokenizer's own vocabulary, before appended special tokens."""
    vocab_size: int
    """Total vocabulary size including appended special tokens."""
    reserved_ids: tuple[int, ...]
    """Every special/control id (base or appended); never masked, never a random replacement."""


class Tokenizer:
    """A loaded tokenizer: ``encode``/``decode`` plus special-token ids.

    Build it with :func:`load_tokenizer`; the constructor is internal.
    """

    def __init__(self, kind: str, path: str, backend: Any, base_vocab_size: int,
                 present: dict[str, int], base_reserved: Sequence[int]) -> None:
        self.kind = kind
        self.path = path
        self._backend = backend
        self.base_vocab_size = base_vocab_size
        ids = dict(present)
        self.appended: list[str] = []
        next_id = base_vocab_size
        for name in APPENDED_ORDER:
            if name not in ids:
                ids[name] = next_id
                self.appended.append(name)
                next_id += 1
        self.vocab_size = next_id
        for name, role in _ROLE_OF.items():
            setattr(self, role, ids[name])
        self._id_to_appended = {ids[n]: n for n in self.appended}
        self._reserved = tuple(sorted(set(base_reserved) | set(ids.values())))

    # Declared for type checkers; filled in __init__.
    eod_id: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int

    #: Beginning-of-sequence id that starts each document (transformers tokenizers only).
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        if self.kind == "gpt2-bpe":
            return list(self._backend.encode(text).ids)
        if self.kind == "hf":
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._backend.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, faster."""
        if self.kind == "gpt2-bpe":
            return [list(e.ids) for e in self._backend.encode_batch(list(texts))]
        if self.kind == "hf":
            return [list(e.ids) for e in
                    self._backend.encode_batch(list(texts), add_special_tokens=False)]
        return [list(x) for x in self._backend.encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; appended special tokens are rendered by name, e.g. ``[MASK]``."""
        out: list[str] = []
        run: list[int] = []
        for i in (int(x) for x in ids):
            if i in self._id_to_appended or not 0 <= i < self.base_vocab_size:
                if run:
                    out.append(self._decode_base(run))
                    run = []
                out.append(self._id_to_appended.get(i, f"[UNK-ID-{i}]"))
            else:
                run.append(i)
        if run:
            out.append(self._decode_base(run))
        return "".join(out)

    def _decode_base(self, ids: list[int]) -> str:
        if self.kind in ("gpt2-bpe", "hf"):
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._backend.decode(ids)

    def special_tokens(self) -> SpecialTokens:
        """The special-token ids as a :class:`SpecialTokens` record."""
        return SpecialTokens(
            pad_id=self.pad_id, cls_id=self.cls_id, sep_id=self.sep_id, mask_id=self.mask_id,
            eod_id=self.eod_id, base_vocab_size=self.base_vocab_size,
            vocab_size=self.vocab_size, reserved_ids=self._reserved,
        )

    def spec(self) -> dict[str, Any]:
        """JSON-able description recorded in a dataset index; ``load_tokenizer(spec()["path"])`` reloads it."""
        return {
            "kind": self.kind,
            "path": self.path,
            "vocab_size": self.vocab_size,
            "base_vocab_size": self.base_vocab_size,
            "appended_special_tokens": list(self.appended),
            "eod_id": self.eod_id,
        }

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, path={self.path!r}, vocab_size={self.vocab_size})"


def _load_gpt2_bpe(vocab: str, merges: str, path: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    backend = HFTokenizer(models.BPE.from_file(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    size = backend.get_vocab_size()
    present = {}
    eod = backend.token_to_id("<|endoftext|>")
    if eod is not None:
        present["[EOD]"] = eod
    for name in ("[PAD]", "[CLS]", "[SEP]", "[MASK]"):
        tid = backend.token_to_id(name)
        if tid is not None:
            present[name] = tid
    return Tokenizer("gpt2-bpe", path, backend, size, present, base_reserved=list(present.values()))


def _load_sentencepiece(model_path: str) -> Tokenizer:
    import sentencepiece as spm

    try:
        proc = spm.SentencePieceProcessor(model_file=model_path)
    except (RuntimeError, OSError) as exc:  # not a ModelProto: garbage, truncated, another file
        raise ValueError(f"tokenizer {model_path} is not a SentencePiece model (sentencepiece: "
                         f"{' '.join(str(exc).split())[:160]}); pass a .model file written by "
                         f"SentencePiece (or megapar-data --train-tokenizer sentencepiece)"
                         ) from None
    size = proc.vocab_size()
    present: dict[str, int] = {}
    for name in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[EOD]"):
        tid = proc.piece_to_id(name)
        if proc.id_to_piece(tid) == name:
            present[name] = tid
    if "[EOD]" not in present and proc.eos_id() >= 0:
        present["[EOD]"] = proc.eos_id()
    if "[PAD]" not in present and proc.pad_id() >= 0:
        present["[PAD]"] = proc.pad_id()
    reserved = [i for i in range(size) if proc.is_control(i) or proc.is_unknown(i)]
    return Tokenizer("sentencepiece", model_path, proc, size, present, reserved + list(present.values()))


def tokenizer_files(tok: "Tokenizer") -> list[str]:
    """The files that define `tok` (its vocabulary, merges, model or tokenizer.json and its
    special-token configs), for fingerprints and exports."""
    if tok.kind == "sentencepiece":
        return [tok.path]
    if tok.path == "gpt2":
        return [asset_path("gpt2_vocab.json"), asset_path("gpt2_merges.txt")]
    if tok.kind == "hf":
        return [os.path.join(tok.path, n) for n in
                ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
                if os.path.isfile(os.path.join(tok.path, n))]
    return [os.path.join(tok.path, "vocab.json"), os.path.join(tok.path, "merges.txt")]


PROBE_TEXT = "Hello world"
"""Ordinary text every usable tokenizer turns into some non-special ids."""


def _count_merges(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip() and not line.startswith("#version"))


def load_tokenizer(spec: str | os.PathLike | dict) -> Tokenizer:
    """Load a tokenizer from ``spec`` (see the module docstring), or from a ``Tokenizer.spec()`` dict."""
    if isinstance(spec, dict):
        if "path" not in spec:
            raise ValueError(f"tokenizer spec {spec!r} has no 'path'; pass a Tokenizer.spec() dict")
        spec = spec["path"]
    spec = os.fspath(spec)
    if spec == "gpt2":
        return _load_gpt2_bpe(asset_path("gpt2_vocab.json"), asset_path("gpt2_merges.txt"), "gpt2")
    if spec == "sentencepiece":
        return _load_sentencepiece(asset_path("botchan_en_unigram_1000.model"))
    if os.path.basename(spec) == "tokenizer.json" and os.path.isfile(spec):
        spec = os.path.dirname(os.path.abspath(spec))
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        from megapar.data.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(os.path.abspath(spec))
    if os.path.isdir(spec):
        vocab, merges = os.path.join(spec, "vocab.json"), os.path.join(spec, "merges.txt")
        missing = [p for p in (vocab, merges) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"tokenizer directory {spec!r} lacks {', '.join(os.path.basename(m) for m in missing)}; "
                "a GPT-2 BPE directory needs vocab.json and merges.txt"
            )
        tok = _load_gpt2_bpe(vocab, merges, os.path.abspath(spec))
        if not tok.encode(PROBE_TEXT):
            raise ValueError(
                f"tokenizer {spec} encodes text to nothing: its vocab.json has "
                f"{tok.base_vocab_size:,} tokens and merges.txt {_count_merges(merges):,} merges; "
                f"point --tokenizer at a complete GPT-2 style vocab.json + merges.txt")
        return tok
    if os.path.isfile(spec) and spec.endswith(".model"):
        return _load_sentencepiece(os.path.abspath(spec))
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'gpt2', 'sentencepiece', a directory with "
        "tokenizer.json (transformers) or vocab.json + merges.txt, or the path of an existing "
        "SentencePiece .model file"
    )
