"""Next-token-prediction samples over an indexed dataset, and the train/val split.

Window convention (Megatron's): the selected documents are concatenated, eod tokens
included, into one token *stream*; sample ``i`` is the window of ``seq_len + 1`` tokens
``stream[i*seq_len : i*seq_len + seq_len + 1]`` -- windows start at token 0 and
consecutive windows share one boundary token, so every stream token except the first is
a target exactly once.  ``input_ids = window[:-1]``, ``labels = window[1:]``.  The number of
samples is ``(len(stream) - 1) // seq_len``; the incomplete tail is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megapar.data.indexed import IndexedDataset
from megapar.wording import counted

#: A set of documents: ``None`` (all), a ``(start, end)`` range, or an array of doc indices.
DocRange = None | tuple[int, int] | Sequence[int] | np.ndarray


def split_documents(num_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split document indices into ``(train, val)``, each a sorted ``int64`` array.

    ``round(num_docs * val_fraction)`` documents (at least one when ``val_fraction > 0``)
    drawn by ``numpy.random.default_rng(seed).permutation`` go to validation; the same
    arguments always give the same split.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(num_docs * val_fraction))
    if val_fraction > 0:
        n_val = max(1, n_val)
    if val_fraction > 0 and num_docs - n_val < 1:
        raise ValueError(
            f"cannot split {num_docs} document(s) into train and val; use more documents "
            "(e.g. preprocess with --split-lines so each paragraph is a document) or val_fraction=0"
        )
    perm = np.random.default_rng(seed).permutation(num_docs)
    return np.sort(perm[n_val:]).astype(np.int64), np.sort(perm[:n_val]).astype(np.int64)


def select_docs(indexed: IndexedDataset, doc_range: DocRange) -> np.ndarray:
    """The document indices (``int64``) named by ``doc_range``, validated."""
    if doc_range is None:
        return np.arange(indexed.num_docs, dtype=np.int64)
    if isinstance(doc_range, tuple) and len(doc_range) == 2:
        start, end = int(doc_range[0]), int(doc_range[1])
        if not 0 <= start <= end <= indexed.num_docs:
            raise ValueError(f"doc_range {doc_range} is outside [0, {indexed.num_docs}]")
        return np.arange(start, end, dtype=np.int64)
    docs = np.asarray(doc_range, dtype=np.int64).reshape(-1)
    if docs.size and (docs.min() < 0 or docs.max() >= indexed.num_docs):
        raise ValueError(f"doc_range holds indices outside [0, {indexed.num_docs})")
    return docs


def doc_pieces(indexed: IndexedDataset, doc_range: DocRange) -> np.ndarray:
    """Token spans ``[[start, end), ...]`` (shape ``(P, 2)``) of the documents in ``doc_range``.

    Runs of consecutive documents are merged into one span.
    """
    docs = select_docs(indexed, doc_range)
    if docs.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    offsets = indexed.doc_offsets
    breaks = np.nonzero(np.diff(docs) != 1)[0] + 1
    runs = np.split(docs, breaks)
    return np.asarray([[offsets[r[0]], offsets[r[-1] + 1]] for r in runs], dtype=np.int64)


class TokenStream:
    """The concatenation of some token spans of an indexed dataset, sliced like one array."""

    def __init__(self, indexed: IndexedDataset, doc_range: DocRange = None):
        self.indexed = indexed
        self.pieces = doc_pieces(indexed, doc_range)
        lengths = self.pieces[:, 1] - self.pieces[:, 0]
        self.cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.cum[-1])

    def slice(self, start: int, length: int) -> np.ndarray:
        """``stream[start:start+length]`` as ``int64``."""
        if start < 0 or start + length > len(self):
            raise IndexError(
                f"stream range [{start}, {start + length}) outside its {len(self)} tokens"
            )
        out = []
        p = int(np.searchsorted(self.cum, start, side="right")) - 1
        while length > 0:
            offset = start - int(self.cum[p])
            take = min(length, int(self.cum[p + 1]) - start)
            out.append(self.indexed.get(int(self.pieces[p, 0]) + offset, take))
            start, length, p = start + take, length - take, p + 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class GPTDataset(torch.utils.data.Dataset):
    """Samples ``dict(input_ids, labels)`` (``LongTensor[seq_len]`` each); see the module
    docstring."""

    def __init__(self, indexed: IndexedDataset, seq_len: int, doc_range: DocRange = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.indexed = indexed
        self.seq_len = int(seq_len)
        self.stream = TokenStream(indexed, doc_range)
        self.num_samples = max(0, (len(self.stream) - 1) // self.seq_len)
        if self.num_samples == 0:
            raise ValueError(
                f"{indexed.prefix}: {'its' if doc_range is None else 'its split'} "
                f"documents hold {counted(len(self.stream), 'token')}, "
                f"fewer than "
                f"one window of --seq-len + 1 = {self.seq_len + 1}; use more data or a shorter "
                f"--seq-len"
            )

    def __len__(self) -> int:
        return self.num_samples

    def window(self, i: int) -> np.ndarray:
        """The ``seq_len + 1`` stream tokens of sample ``i``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for a dataset of {self.num_samples}")
        return self.stream.slice(i * self.seq_len, self.seq_len + 1)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = torch.from_numpy(self.window(int(i)))
        return {"input_ids": w[:-1].clone(), "labels": w[1:].clone()}
