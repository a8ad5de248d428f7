"""What megapar needs of a tokenizer: ``encode`` / ``decode`` and its special-token ids.

Every tokenizer megapar loads (`megapar.data.tokenizers.load_tokenizer`: the GPT-2 BPE,
SentencePiece, a transformers ``tokenizer.json``) is a `Tokenizer`. Special tokens the base
vocabulary lacks are appended after it in the fixed order of ``APPENDED_ORDER`` -- ``[PAD]
[CLS] [SEP] [MASK] [EOD]`` -- skipping those already present, so ``vocab_size`` grows
deterministically; ``encode`` never produces appended ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Names of the special tokens, in the order they are appended when missing.
APPENDED_ORDER: tuple[str, ...] = ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[EOD]")

#: The attribute each special token name fills.
_ROLE_OF: dict[str, str] = {
    "[PAD]": "pad_id",
    "[CLS]": "cls_id",
    "[SEP]": "sep_id",
    "[MASK]": "mask_id",
    "[EOD]": "eod_id",
}

TOKENIZER_SPECS = (
    "'gpt2', 'sentencepiece', a SentencePiece .model file, or a transformers tokenizer's "
    "directory (e.g. the one tok.save_pretrained(DIR) writes)"
)
"""What the Python API's `tokenizer` keywords (`megapar.prepare`'s, `engine.export_hf`'s) take,
as words for their errors."""


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


def _covered(spans: list[tuple[int, int]]) -> int:
    """The characters [start, end) `spans` cover together: a normalizer's expansion (NFKC's ㈱
    is the words "(", "株", ")") gives several tokens one character's span."""
    covered, reach = 0, 0
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            covered += end - start
            reach = end
    return covered


class Tokenizer:
    """A loaded tokenizer: ``encode``/``decode`` plus special-token ids.

    Build it with :func:`load_tokenizer`; the constructor is internal.
    """

    def __init__(
        self,
        kind: str,
        path: str,
        backend: Any,
        base_vocab_size: int,
        present: dict[str, int],
        base_reserved: Sequence[int],
    ) -> None:
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

    #: Beginning-of-sequence id that starts each document (transformers tokenizers only: the
    #: one their tokenizer.json's post-processor puts before a text, as transformers does).
    bos_id: int | None = None
    #: The BOS a transformers tokenizer's configs name (or a conventional ``<s>`` of its
    #: vocabulary), whether or not a document starts with it (`bos_id`).
    named_bos_id: int | None = None
    #: The end-of-document token's name where a transformers tokenizer's configs name no
    #: ``eos_token`` and it was found by a usual name (``<|end_of_text|>``, ...); else None.
    eod_guessed: str | None = None
    #: The id text the vocabulary cannot spell encodes to (SentencePiece's ``<unk>``,
    #: WordPiece's ``[UNK]``); None where there is none (a byte-level BPE spells every text).
    unk_id: int | None = None

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
            return [
                list(e.ids)
                for e in self._backend.encode_batch(list(texts), add_special_tokens=False)
            ]
        return [list(x) for x in self._backend.encode(list(texts))]

    def encode_counting_unknown(
        self, texts: Sequence[str]
    ) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """`encode_batch(texts)`, and for each text (the characters its unknown tokens stand
        for, its characters): what of it the vocabulary does not spell (a WordPiece's
        ``[UNK]`` is a whole word, a SentencePiece ``<unk>`` a run of characters), counted on
        the text as the tokenizer reads it (a SentencePiece model's normalized text, so a
        share is never over the whole); (0, its length) where there is no unknown token."""
        unk = self.unk_id
        if self.kind == "hf" and unk is not None:  # the offsets of the one encoding
            encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
            ids = [list(e.ids) for e in encodings]
            counts = []
            for e, text_ids, text in zip(encodings, ids, texts):
                spans = (
                    [span for i, span in zip(e.ids, e.offsets) if i == unk]
                    if (unk in text_ids)
                    else []
                )
                counts.append((_covered(spans), len(text)))
            return ids, counts
        ids = self.encode_batch(texts)
        counts = [(0, len(text)) for text in texts]
        if self.kind == "sentencepiece" and unk is not None:
            hit = [k for k, e in enumerate(ids) if unk in e]
            for k, count in zip(
                hit, self._unknown_pieces_characters([texts[k] for k in hit], [ids[k] for k in hit])
            ):
                counts[k] = count
        return ids, counts

    def _unknown_pieces_characters(
        self, texts: Sequence[str], encoded: Sequence[Sequence[int]]
    ) -> list[tuple[int, int]]:
        """`encode_counting_unknown`'s counts of a SentencePiece model's texts holding its
        unknown token: an unknown piece is the normalized text itself, so the normalized text's
        characters less those of its known pieces, and the normalized text's (one normalizing,
        no second encoding). A model with byte pieces (``<0xE4>``) spells every text, so never
        gets here."""
        if self._piece_chars is None:
            proc = self._backend
            self._piece_chars = [len(proc.id_to_piece(i)) for i in range(proc.vocab_size())]
        known, unk = self._piece_chars, self.unk_id
        assert unk is not None  # the texts hold it
        spelt = known.__getitem__
        return [
            (len(normal) - sum(map(spelt, ids)) + ids.count(unk) * known[unk], len(normal))
            for normal, ids in zip(self._backend.normalize(list(texts)), encoded)
        ]

    _piece_chars: list[int] | None = None

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
            pad_id=self.pad_id,
            cls_id=self.cls_id,
            sep_id=self.sep_id,
            mask_id=self.mask_id,
            eod_id=self.eod_id,
            base_vocab_size=self.base_vocab_size,
            vocab_size=self.vocab_size,
            reserved_ids=self._reserved,
        )

    def spec(self) -> dict[str, Any]:
        """JSON-able description recorded in a dataset index;
        ``load_tokenizer(spec()["path"])`` reloads it."""
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


PROBE_TEXT = "Hello world"
"""Ordinary text every usable tokenizer turns into some non-special ids."""
