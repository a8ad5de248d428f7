"""BERT-style masked-language-model samples over an indexed dataset.

Samples.  Each selected document (its eod dropped, where it ends with one: a Megatron-LM
dataset made without ``--append-eod`` ends with a real token) is cut into consecutive chunks of
at most ``seq_len - 3`` tokens; chunks shorter than 2 tokens are dropped.  Sample ``i`` is
chunk ``i`` split at a point ``a`` drawn uniformly from ``[1, len - 1]`` into segments
``A = chunk[:a]`` and ``B = chunk[a:]``, laid out as ``[CLS] A [SEP] B [SEP]`` followed by
``[PAD]`` up to ``seq_len``.

Masking.  Candidates are the real tokens of A and B whose ids are not special.  Exactly
``max(1, round(mask_prob * #candidates))`` of them are chosen; each chosen token becomes
``[MASK]`` with probability 0.8, a random non-special token of the base vocabulary with
probability 0.1, and stays unchanged with probability 0.1.  ``labels`` holds the original
id at chosen positions and -100 elsewhere.

Every random draw of sample ``i`` comes from ``numpy.random.default_rng([seed, i])``, so a
sample depends only on ``(seed, i)`` -- never on worker, rank or the order of access.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from megapar.data.gpt_dataset import DocRange, select_docs
from megapar.data.indexed import IndexedDataset
from megapar.data.tokenizers import SpecialTokens, Tokenizer

IGNORE_INDEX = -100


def _as_special_tokens(special: Any, indexed: IndexedDataset) -> SpecialTokens:
    """Normalise a ``SpecialTokens``, ``Tokenizer`` or mapping of ids into ``SpecialTokens``."""
    if isinstance(special, SpecialTokens):
        return special
    if isinstance(special, Tokenizer):
        return special.special_tokens()
    if isinstance(special, Mapping):
        needed = ("pad_id", "cls_id", "sep_id", "mask_id")
        missing = [k for k in needed if k not in special]
        if missing:
            raise ValueError(
                f"tokenizer_special_ids lacks {missing}; pass tokenizer.special_tokens() or a dict "
                f"with keys {list(needed)}"
            )
        base = int(
            special.get(
                "base_vocab_size", indexed.tokenizer_spec.get("base_vocab_size", indexed.vocab_size)
            )
        )
        ids = {k: int(special[k]) for k in needed}
        eod = int(special.get("eod_id", indexed.eod_id))
        reserved = tuple(sorted(set(special.get("reserved_ids", ())) | set(ids.values()) | {eod}))
        return SpecialTokens(
            eod_id=eod,
            base_vocab_size=base,
            vocab_size=int(special.get("vocab_size", indexed.vocab_size)),
            reserved_ids=reserved,
            **ids,
        )
    raise TypeError(
        f"tokenizer_special_ids must be SpecialTokens, Tokenizer or a dict, not "
        f"{type(special).__name__}"
    )


MIN_SEQ_LEN = 5
"""The shortest sample: [CLS] A [SEP] B [SEP], a token of each segment."""


class MLMDataset(torch.utils.data.Dataset):
    """Samples ``dict(input_ids, token_type_ids, attention_mask, labels)``, each
    ``LongTensor[seq_len]``."""

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        tokenizer_special_ids: Any,
        seed: int,
        mask_prob: float = 0.15,
        doc_range: DocRange = None,
    ):
        if seq_len < MIN_SEQ_LEN:
            raise ValueError(
                f"seq_len must be >= {MIN_SEQ_LEN} for [CLS] A [SEP] B [SEP], got {seq_len}"
            )
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        self.indexed = indexed
        self.seq_len = int(seq_len)
        self.special = _as_special_tokens(tokenizer_special_ids, indexed)
        self.seed = int(seed)
        self.mask_prob = float(mask_prob)
        self._reserved = np.asarray(self.special.reserved_ids, dtype=np.int64)
        self._random_pool = np.setdiff1d(np.arange(self.special.base_vocab_size), self._reserved)
        self.chunk_start, self.chunk_len = self._build_chunks(doc_range)
        if len(self.chunk_start) == 0:
            raise ValueError(
                f"{indexed.prefix}: no document in the selection has the 2 tokens an MLM "
                f"sample needs"
            )

    def _build_chunks(self, doc_range: DocRange) -> tuple[np.ndarray, np.ndarray]:
        """Start (in the flat token array) and length of every chunk, vectorised."""
        offsets = self.indexed.doc_offsets
        docs = select_docs(self.indexed, doc_range)
        starts = offsets[docs]
        lens = offsets[docs + 1] - starts
        if self.indexed.eod_written:
            lens = lens - 1  # drop each document's eod
        else:  # Megatron-LM data made without --append-eod ends documents with a real token
            last = self.indexed.tokens[np.maximum(starts + lens - 1, 0)].astype(np.int64)
            lens = lens - ((lens > 0) & (last == self.indexed.eod_id))
        most = self.seq_len - 3
        counts = -(-lens // most)
        doc_of = np.repeat(np.arange(len(docs)), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        k = np.arange(len(doc_of)) - first
        c_start = starts[doc_of] + k * most
        c_len = np.minimum(most, lens[doc_of] - k * most)
        keep = c_len >= 2
        return c_start[keep].astype(np.int64), c_len[keep].astype(np.int64)

    def __len__(self) -> int:
        return len(self.chunk_start)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)}")
        sp = self.special
        rng = np.random.default_rng([self.seed, i])
        length = int(self.chunk_len[i])
        chunk = self.indexed.get(int(self.chunk_start[i]), length)
        a = int(rng.integers(1, length))  # A = chunk[:a], B = chunk[a:], both non-empty

        input_ids = np.full(self.seq_len, sp.pad_id, dtype=np.int64)
        input_ids[0] = sp.cls_id
        input_ids[1 : a + 1] = chunk[:a]
        input_ids[a + 1] = sp.sep_id
        input_ids[a + 2 : length + 2] = chunk[a:]
        input_ids[length + 2] = sp.sep_id
        token_type_ids = np.zeros(self.seq_len, dtype=np.int64)
        token_type_ids[a + 2 : length + 3] = 1
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[: length + 3] = 1

        real = np.concatenate([np.arange(1, a + 1), np.arange(a + 2, length + 2)])
        candidates = real[~np.isin(input_ids[real], self._reserved)]
        if candidates.size == 0:  # a chunk made only of special ids: mask among them anyway
            candidates = real
        n_mask = max(1, int(round(self.mask_prob * candidates.size)))
        chosen = np.sort(rng.choice(candidates, size=n_mask, replace=False))
        action = rng.random(n_mask)
        replacements = self._random_pool[rng.integers(0, len(self._random_pool), size=n_mask)]

        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[chosen] = input_ids[chosen]
        to_mask = action < 0.8
        to_random = (action >= 0.8) & (action < 0.9)
        input_ids[chosen[to_mask]] = sp.mask_id
        input_ids[chosen[to_random]] = replacements[to_random]
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
        }

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (for logs)."""
        return {
            "samples": len(self),
            "seq_len": self.seq_len,
            "seed": self.seed,
            "mask_prob": self.mask_prob,
            "special": dataclasses.asdict(self.special),
        }
