"""Megatron-LM's indexed dataset index (``MMIDIDX``, version 1), read and written.

The ``.bin`` file is the same in both formats: every token of every sequence, concatenated.
Megatron-LM / NeMo's ``.idx`` (``megatron/core/datasets/indexed_dataset.py``), all little-endian:

=========================  ===========================================================
``b"MMIDIDX\\x00\\x00"``      9-byte magic
``uint64``                  version (1)
``uint8``                   dtype code of the tokens (see ``DTYPE_CODES``)
``uint64``                  S, the number of sequences
``uint64``                  D + 1, the number of document indices
``int32[S]``                sequence lengths, in tokens
``int64[S]``                sequence pointers, byte offsets into ``.bin``
``int64[D + 1]``            document indices: document d is sequences [idx[d], idx[d+1])
=========================  ===========================================================

A multimodal index (megatron-core's ``multimodal=True``) ends with one ``int8`` mode per
sequence: one whose sequences are all text (mode 0) is read like any other, one with other
modes (images) is refused. megapar reads any such index whose sequences are stored back to
back (what Megatron's preprocessing writes) as documents; it writes one sequence per document
(the eod included, like ``--append-eod``), with uint16 tokens below 65,500 ids and int32
otherwise, as Megatron.
"""

from __future__ import annotations

import numpy as np

from megapar.wording import counted

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's choice (DType.optimal_dtype): uint16 below 65,500 ids, else int32."""
    return np.dtype("<u2") if vocab_size < 65500 else np.dtype("<i4")


def code_of(dtype: np.dtype) -> int:
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == np.dtype(dtype).newbyteorder("="):
            return code
    raise ValueError(f"dtype {dtype} has no Megatron dtype code")


def is_megatron_index(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def write_index(path: str, dtype: np.dtype, doc_lengths: np.ndarray) -> None:
    """An MMIDIDX index for documents of `doc_lengths` tokens, one sequence each."""
    lengths = np.asarray(doc_lengths, dtype="<i4")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype="<i8")
    if len(lengths) > 1:
        pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * itemsize
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(np.asarray([VERSION], dtype="<u8").tobytes())
        f.write(np.asarray([code_of(dtype)], dtype="<u1").tobytes())
        f.write(np.asarray([len(lengths), len(lengths) + 1], dtype="<u8").tobytes())
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())


def read_index(path: str) -> tuple[np.dtype, np.ndarray]:
    """(token dtype, int64 document token offsets [D + 1]) of an MMIDIDX index."""
    with open(path, "rb") as f:
        data = f.read()
    fix = "re-create the dataset with megapar-data (or Megatron-LM's preprocess_data.py)"
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{path} is not a Megatron index (no MMIDIDX magic); {fix}")
    pos = len(MAGIC)
    if len(data) < pos + 9 + 16:
        raise ValueError(
            f"{path} is truncated or not an index file ({counted(len(data), 'byte')}): {fix}"
        )
    version = int(np.frombuffer(data, "<u8", 1, pos)[0])
    if version != VERSION:
        raise ValueError(
            f"{path}: Megatron index version {version}; megapar reads version 1 "
            f"(a corrupt index?); {fix}"
        )
    code = int(data[pos + 8])
    if code not in DTYPE_CODES:
        raise ValueError(f"{path}: unknown Megatron dtype code {code} (a corrupt index?); {fix}")
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    seqs, docs = (int(x) for x in np.frombuffer(data, "<u8", 2, pos + 9))
    pos += 9 + 16
    need = pos + seqs * 4 + seqs * 8 + docs * 8
    if len(data) == need + seqs:  # a multimodal index: one int8 mode per sequence follows
        modes = np.frombuffer(data, "<i1", seqs, need)
        if np.any(modes != 0):
            raise ValueError(
                f"{path} is a multimodal Megatron index: {int(np.sum(modes != 0)):,} "
                f"of its {counted(seqs, 'sequence')} are not text (sequence mode != 0); "
                f"megapar trains language models on text only"
            )
    elif len(data) != need:
        raise ValueError(
            f"{path} is truncated or corrupt ({counted(len(data), 'byte')}): its header "
            f"({counted(seqs, 'sequence')}, {counted(docs, 'document index', 'document indices')}) "
            f"needs {counted(need, 'byte')}; "
            f"{fix}"
        )
    lengths = np.frombuffer(data, "<i4", seqs, pos).astype(np.int64)
    pointers = np.frombuffer(data, "<i8", seqs, pos + seqs * 4)
    doc_idx = np.frombuffer(data, "<i8", docs, pos + seqs * 12)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    if not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        raise ValueError(
            f"{path}: sequences are not stored back to back in the .bin; megapar "
            f"reads contiguous Megatron datasets only"
        )
    if docs < 1 or doc_idx[0] != 0 or doc_idx[-1] != seqs or np.any(np.diff(doc_idx) < 0):
        raise ValueError(
            f"{path}: document indices must rise from 0 to the {seqs} sequences "
            f"(a corrupt index); {fix}"
        )
    return dtype, starts[doc_idx]
