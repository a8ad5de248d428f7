"""The indexed dataset: a tokenized corpus as three files sharing a prefix.

* ``PREFIX.bin`` -- every document's token ids, each followed by the end-of-document
  token, concatenated into one flat little-endian array (``uint16`` when the vocabulary
  has at most 65,536 ids, else ``uint32``).
* ``PREFIX.idx`` -- document boundaries: the 8-byte magic ``b"MPIDX\\x00\\x00\\x01"``, the
  number of documents ``D`` as a little-endian ``uint64``, then ``D + 1`` little-endian
  ``int64`` token offsets (document ``i`` is ``tokens[off[i]:off[i+1]]``, its eod included).
* ``PREFIX.json`` -- metadata: format, version, dtype, vocab size, tokenizer spec (and its
  files' ``sha256``; older datasets lack them),
  number of documents and tokens, the largest token id (``max_id``); for supervised
  fine-tuning records (``megapar-data --sft-keys``) also ``sft``: the record keys and each
  document's prompt length in tokens (its first tokens, the BOS included, are the prompt; the
  rest, the eod included, the response).

Files are written to temporary names and renamed into place (the ``.json`` last), so an
interrupted write never leaves a dataset that looks complete.

Megatron-LM's format (``format="megatron"``: the same ``.bin``, an ``MMIDIDX`` ``.idx``, see
``megatron.py``) is written on request and read wherever a prefix is, detected by the magic of
the ``.idx``. A Megatron dataset made by Megatron-LM / NeMo has no ``.json``: its tokenizer
(``--tokenizer``) supplies the vocabulary size and the end-of-document id.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from megapar.data import megatron
from megapar.data.tokenizers import load_tokenizer
from megapar.faults.processes import remove_stale_tmps, tmp_name
from megapar.one_line_parser import shell_word
from megapar.wording import counted

IDX_MAGIC = b"MPIDX\x00\x00\x01"
FORMAT_NAME = "megapar-indexed"
FORMAT_VERSION = 1
INDEX_FORMATS = ("megapar", "megatron")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype that holds every id of ``vocab_size``."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def _missing_error(prefix: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"dataset prefix {prefix}: {prefix}{what} not found; create it with "
        f"`megapar-data --input TEXT_FILES --output-prefix {shell_word(prefix)} --tokenizer gpt2`"
    )


def check_index_magic(path: str) -> None:
    """Raise ValueError naming `path` when it starts with neither megapar's nor Megatron-LM's
    magic (empty, cut short, another file): a dataset without its ``.json`` is then reported
    for its ``.idx``, not for the ``.json`` that only a megapar index needs."""
    with open(path, "rb") as f:
        head = f.read(max(len(IDX_MAGIC), len(megatron.MAGIC)))
    if head.startswith((IDX_MAGIC, megatron.MAGIC)):
        return
    size = os.path.getsize(path)
    what = (
        "is empty (0 bytes)"
        if size == 0
        else f"is truncated or another file ({counted(size, 'byte')})"
    )
    raise ValueError(
        f"{path} {what}: not a megapar or Megatron-LM index; re-create the dataset "
        f"with megapar-data (or copy its .idx again)"
    )


class IndexedDatasetBuilder:
    """Streams documents into ``PREFIX.{bin,idx,json}``; call :meth:`finalize` at the end.

    Use it as a context manager: on an exception the temporary files are removed.
    """

    def __init__(
        self,
        prefix: str,
        vocab_size: int,
        eod_id: int,
        tokenizer_spec: dict[str, Any],
        format: str = "megapar",
        sft_keys: Sequence[str] | None = None,
        replace: bool = True,
    ):
        if format not in INDEX_FORMATS:
            raise ValueError(f"unknown dataset format {format!r}; expected one of {INDEX_FORMATS}")
        self.prefix = os.fspath(prefix)
        self.vocab_size = int(vocab_size)
        self.eod_id = int(eod_id)
        self.tokenizer_spec = dict(tokenizer_spec)
        self.format = format
        self.dtype = (
            dtype_for_vocab(self.vocab_size)
            if format == "megapar"
            else megatron.dtype_for_vocab(self.vocab_size)
        )
        parent = os.path.dirname(os.path.abspath(self.prefix))
        self._made: list[str] = []  # the directories made here, deepest first (abort: removed)
        while not os.path.lexists(parent):
            self._made.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        for ext in (".bin", ".idx", ".json"):  # the leftovers of a writer killed before us
            remove_stale_tmps(self.prefix + ext)
        self._bin_tmp = tmp_name(self.prefix + ".bin")
        self._tmps: list[str] = []  # the index's and metadata's temporaries, once begun
        self._bin = open(self._bin_tmp, "wb")
        self._offsets = array.array("q", [0])  # 8 bytes per document, not a Python int
        self.max_id = -1
        self.sft_keys = list(sft_keys) if sft_keys is not None else None
        self._prompt_lengths = array.array("q")
        self.replace = replace
        """Whether `finalize` replaces a dataset at the prefix (False: one that another writer
        finished meanwhile is refused, this one discarded)."""
        self.unknown_tokens: dict[str, int] | None = None
        """How many of the text's tokens are its tokenizer's unknown token (`preprocess`'s
        counts, `unknown_tokens_note`), recorded in the metadata where set."""
        self.invalid_utf8: dict[str, int] | None = None
        """Bytes of invalid UTF-8 replaced with U+FFFD, per input file (--allow-invalid-utf8
        or under 0.1 %), recorded in the metadata where set: a run that reads the dataset
        from a cache says them again."""

    def add_document(
        self, ids: Sequence[int] | np.ndarray, prompt_length: int | None = None
    ) -> None:
        """Append one document; its end-of-document token is added here. A builder made with
        ``sft_keys`` takes each document's `prompt_length` (its first tokens that are the
        prompt)."""
        if (prompt_length is None) != (self.sft_keys is None) or not (
            prompt_length is None or 0 <= prompt_length <= len(ids)
        ):
            raise ValueError(
                f"prompt_length {prompt_length} does not fit a document of "
                f"{counted(len(ids), 'token')} "
                f"of a builder {'with' if self.sft_keys else 'without'} sft_keys"
            )
        if prompt_length is not None:
            self._prompt_lengths.append(int(prompt_length))
        arr = np.empty(len(ids) + 1, dtype=np.int64)
        arr[:-1] = ids
        arr[-1] = self.eod_id
        if arr.size > 1 and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"token id {int(arr.max())} or {int(arr.min())} is outside the vocabulary "
                f"[0, {self.vocab_size}); the tokenizer and vocab_size passed to the builder "
                f"disagree"
            )
        self.max_id = max(self.max_id, int(arr.max()))
        self._bin.write(arr.astype(self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + arr.size)

    def add_documents(self, docs: Iterable[Sequence[int]]) -> None:
        """``add_document`` for each of ``docs``."""
        for d in docs:
            self.add_document(d)

    def finalize(self) -> str:
        """Write the index and metadata, rename everything into place, return the prefix."""
        self._bin.close()
        landed = [
            self.prefix + e for e in (".bin", ".idx", ".json") if os.path.lexists(self.prefix + e)
        ]
        if landed and not self.replace:
            raise ValueError(
                f"{', '.join(landed)} appeared while this run tokenized (another run wrote "
                f"them); this run's dataset is discarded: pass --overwrite to replace them, or "
                f"choose another prefix"
            )
        offsets = np.frombuffer(self._offsets, dtype=np.int64).astype("<i8")
        idx_tmp = tmp_name(self.prefix + ".idx")
        self._tmps.append(idx_tmp)
        if self.format == "megatron":
            megatron.write_index(idx_tmp, self.dtype, np.diff(offsets))
        else:
            with open(idx_tmp, "wb") as f:
                f.write(IDX_MAGIC)
                f.write(np.asarray([len(offsets) - 1], dtype="<u8").tobytes())
                f.write(offsets.tobytes())
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "tokenizer": self.tokenizer_spec,
            "num_docs": int(len(offsets) - 1),
            "num_tokens": int(offsets[-1]),
            "index_format": self.format,
            "max_id": self.max_id,
        }
        if self.sft_keys is not None:
            meta["sft"] = {"keys": self.sft_keys, "prompt_lengths": self._prompt_lengths.tolist()}
        if self.unknown_tokens:
            meta["unknown_tokens"] = self.unknown_tokens
        if self.invalid_utf8:
            meta["invalid_utf8"] = self.invalid_utf8
        json_tmp = tmp_name(self.prefix + ".json")
        self._tmps.append(json_tmp)
        with open(json_tmp, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")
        os.replace(json_tmp, self.prefix + ".json")
        return self.prefix

    @property
    def num_docs(self) -> int:
        """Documents added so far."""
        return len(self._offsets) - 1

    def abort(self) -> None:
        """Close and delete the temporary files (nothing is renamed), and the directories made
        for them where they are empty."""
        try:
            self._bin.close()  # flushes its buffer: on a full disk that fails again
        except OSError:
            pass
        for path in (self._bin_tmp, *self._tmps):  # the index's and metadata's, once begun
            try:
                os.remove(path)
            except OSError:  # gone, or a directory made read-only meanwhile: the first error
                pass  # is the one said
        for directory in self._made:
            try:
                os.rmdir(directory)
            except OSError:  # another writer's files there (or gone): kept
                break

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            if isinstance(exc, OSError) and exc.filename is None:  # a write's: name the dataset
                exc.filename = self.prefix


def read_doc_offsets(path: str) -> np.ndarray:
    """Read the ``int64`` document offsets of a ``.idx`` file (validating its header); megapar's
    index or Megatron's (``MMIDIDX``), told apart by the magic."""

    if megatron.is_megatron_index(path):
        return megatron.read_index(path)[1]
    with open(path, "rb") as f:
        data = f.read()
    if len(data) >= 8 and data[:8] != IDX_MAGIC:
        raise ValueError(
            f"{path} is not a megapar index (bad magic {data[:8]!r}, "
            f"{counted(len(data), 'byte')}): re-create the dataset with megapar-data"
        )
    if len(data) < 16 + 8:  # magic, document count, at least the first offset
        raise ValueError(
            f"{path} is truncated or not an index file ({counted(len(data), 'byte')}): "
            f"re-create the dataset with megapar-data"
        )
    count = int(np.frombuffer(data, "<u8", 1, 8)[0])
    if (len(data) - 16) % 8 or (len(data) - 16) // 8 != count + 1:
        raise ValueError(
            f"{path} is truncated or corrupt ({counted(len(data), 'byte')}): its header says "
            f"{counted(count, 'document')}, which needs {16 + 8 * (count + 1):,} bytes; re-create "
            "the dataset "
            f"with megapar-data"
        )
    offsets = np.frombuffer(data, "<i8", count + 1, 16).astype(np.int64)
    if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise ValueError(
            f"{path} is corrupt: its document offsets do not rise from 0; "
            f"re-create the dataset with megapar-data"
        )
    return offsets


#: Keys of PREFIX.json that reading a dataset needs.
_META_KEYS = ("format", "version", "dtype", "vocab_size", "eod_id", "tokenizer", "num_tokens")


def _read_meta(path: str) -> dict[str, Any]:
    """The parsed ``PREFIX.json``, or a ValueError naming the file, the problem and the fix."""
    fix = "re-create the dataset with megapar-data"
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno} column "
            f"{e.colno}): the dataset's metadata is damaged; {fix}"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(
            f"{path} is not a text file: the dataset's metadata is damaged; {fix}"
        ) from None
    if not isinstance(meta, dict):
        raise ValueError(
            f"{path} holds a JSON {type(meta).__name__}, not the dataset's metadata object; {fix}"
        )
    if meta.get("format") == FORMAT_NAME and meta.get("version") == FORMAT_VERSION:
        missing = [k for k in _META_KEYS if k not in meta]
        if missing:
            raise ValueError(
                f"{path} lacks {', '.join(missing)}: the dataset's metadata is incomplete; {fix}"
            )
    return meta


class IndexedDataset:
    """Read-only view of ``PREFIX.{bin,idx,json}``; the tokens are memory-mapped.

    ``tokenizer`` (a spec for ``load_tokenizer``) is needed only for a Megatron dataset
    without megapar's ``.json``: it gives the vocabulary size and the end-of-document id.
    """

    def __init__(self, prefix: str | os.PathLike, tokenizer: Any = None):
        prefix = os.path.expanduser(os.fspath(prefix))  # '~/ds' quoted, or from a --config file
        if os.path.isfile(prefix + ".idx") and not os.path.isfile(prefix + ".json"):
            check_index_magic(prefix + ".idx")
        megatron_index = os.path.isfile(prefix + ".idx") and megatron.is_megatron_index(
            prefix + ".idx"
        )
        for ext in (".bin", ".idx") if megatron_index else (".json", ".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise _missing_error(prefix, ext)
        self.index_format = "megatron" if megatron_index else "megapar"
        if os.path.isfile(prefix + ".json"):
            meta = _read_meta(prefix + ".json")
        else:
            meta = _megatron_meta(prefix, tokenizer)
        if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{prefix}.json is format {meta.get('format')!r} version {meta.get('version')!r}, "
                f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}; regenerate it with "
                f"megapar-data"
            )
        self.prefix = prefix
        self.meta: dict[str, Any] = meta
        self.eod_written: bool = os.path.isfile(prefix + ".json")
        """Whether megapar wrote the dataset, so that every document ends with the eod; a
        Megatron-LM one may not (made without --append-eod)."""
        try:
            self.dtype = np.dtype(meta["dtype"]).newbyteorder("<")
            if self.dtype.kind not in "ui":
                raise TypeError(self.dtype)
            self.vocab_size: int = int(meta["vocab_size"])
            self.eod_id: int = int(meta["eod_id"])
            num_tokens = int(meta["num_tokens"])
        except (TypeError, ValueError):
            raise ValueError(
                f"{prefix}.json has an invalid dtype, vocab_size, eod_id or num_tokens "
                f"({meta.get('dtype')!r}, {meta.get('vocab_size')!r}, {meta.get('eod_id')!r}, "
                f"{meta.get('num_tokens')!r}): the dataset's metadata is damaged; re-create the "
                f"dataset with megapar-data"
            ) from None
        self.tokenizer_spec: dict[str, Any] = meta["tokenizer"]
        self.doc_offsets: np.ndarray = read_doc_offsets(prefix + ".idx")
        self.num_docs: int = len(self.doc_offsets) - 1
        self.sft_keys, self.prompt_lengths = _sft_meta(prefix, meta, self.doc_offsets)
        size = os.path.getsize(prefix + ".bin")
        expected = num_tokens * self.dtype.itemsize
        described = f"{prefix}.json" if os.path.isfile(prefix + ".json") else f"{prefix}.idx"
        if size != expected:
            raise ValueError(
                f"{prefix}.bin holds {counted(size, 'byte')} but {described} describes "
                f"{counted(num_tokens, self.dtype.name + ' token')} "
                f"({counted(expected, 'byte')}): it is "
                f"{'cut short (an interrupted copy?)' if size < expected else 'too long'} or "
                f"from another run; re-create the dataset with megapar-data"
            )
        if self.doc_offsets[-1] != num_tokens:
            raise ValueError(
                f"{prefix}.idx ends its documents at token {int(self.doc_offsets[-1]):,} but "
                f"{prefix}.json says {counted(num_tokens, 'token')}: the files are from different "
                "runs; "
                f"re-create the dataset with megapar-data"
            )
        if num_tokens == 0:
            self.tokens: np.ndarray = np.zeros(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(
                prefix + ".bin", dtype=self.dtype, mode="r", shape=(num_tokens,)
            )

    @property
    def num_tokens(self) -> int:
        """Total number of tokens, eod tokens included."""
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_docs

    def get(self, start: int, length: int) -> np.ndarray:
        """A copy of ``tokens[start:start+length]`` as ``int64``."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(
                f"token range [{start}, {start + length}) is outside the dataset's "
                f"{counted(self.num_tokens, 'token')}"
            )
        return np.asarray(self.tokens[start : start + length], dtype=np.int64)

    def doc(self, i: int, include_eod: bool = True) -> np.ndarray:
        """Document ``i``'s tokens as ``int64``; ``include_eod=False`` drops its last token when
        that is the end-of-document token (data written without one, e.g. by Megatron-LM
        without ``--append-eod``, keeps every token)."""
        start, end = int(self.doc_offsets[i]), int(self.doc_offsets[i + 1])
        ends_with_eod = end > start and int(self.tokens[end - 1]) == self.eod_id
        return self.get(start, end - start - (1 if ends_with_eod and not include_eod else 0))

    #: Datasets up to this many tokens are scanned for their largest id (exact even if the .bin
    #: was edited); larger ones trust the ``max_id`` recorded at preprocessing.
    SCAN_LIMIT = 1 << 28

    #: A dataset of up to this many tokens (or documents) is fingerprinted whole; beyond, by
    #: `FINGERPRINT_BLOCKS` blocks of `FINGERPRINT_BLOCK` ids spread evenly over it.
    FINGERPRINT_WHOLE = 1 << 22
    FINGERPRINT_BLOCKS = 256
    FINGERPRINT_BLOCK = 4096

    def fingerprint(self) -> str:
        """A cheap digest of the dataset's content (hex SHA-256 of its document boundaries and
        token ids), the same whatever the index format (megapar's or Megatron-LM's), the .bin's
        dtype or where the files are. Up to `FINGERPRINT_WHOLE` tokens every id is hashed; a
        larger dataset reads `FINGERPRINT_BLOCKS` x `FINGERPRINT_BLOCK` ids of its tokens (and of
        its document offsets): 256 short reads, milliseconds for 100 GB, so a change outside
        those blocks goes unseen."""
        h = hashlib.sha256(np.asarray([self.num_docs, self.num_tokens], "<i8").tobytes())
        if self.prompt_lengths is not None:  # the same tokens trained on other labels
            h.update(np.asarray(self.prompt_lengths, dtype="<i8").tobytes())
        for values in (self.doc_offsets, self.tokens):
            n, block = len(values), self.FINGERPRINT_BLOCK
            if n <= self.FINGERPRINT_WHOLE:
                h.update(np.asarray(values, dtype="<i8").tobytes())
                continue
            for start in np.linspace(0, n - block, self.FINGERPRINT_BLOCKS).astype(np.int64):
                h.update(np.asarray(values[start : start + block], dtype="<i8").tobytes())
        return h.hexdigest()

    def max_id(self) -> int:
        """The largest token id in the dataset (-1 when empty)."""
        if self.num_tokens == 0:
            return -1
        if self.num_tokens > self.SCAN_LIMIT and "max_id" in self.meta:
            return int(self.meta["max_id"])
        return int(self.tokens.max())

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if any id is outside a model vocabulary of `vocab_size` ids (at
        tp > 1 such ids would silently embed to zero vectors instead of failing)."""
        top = self.max_id()
        if top >= vocab_size:
            raise ValueError(
                f"dataset {self.prefix} holds token id {top}, outside the model's "
                f"vocabulary of {vocab_size} ids (0-{vocab_size - 1}); tokenize it "
                f"with the model's tokenizer or use a model with a larger vocabulary"
            )

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, docs={self.num_docs}, tokens={self.num_tokens})"


def _sft_meta(
    prefix: str, meta: dict[str, Any], offsets: np.ndarray
) -> tuple[list[str] | None, np.ndarray | None]:
    """(record keys, per-document prompt lengths as ``int64``) of a dataset of supervised
    fine-tuning records (its metadata's ``sft``), or (None, None); ValueError when they do not
    fit its documents."""
    sft = meta.get("sft")
    if sft is None:
        return None, None
    try:
        keys = [str(k) for k in sft["keys"]]
        lengths = np.asarray(sft["prompt_lengths"], dtype=np.int64).reshape(-1)
    except (TypeError, KeyError, ValueError):
        lengths = None
    if (
        lengths is None
        or len(lengths) != len(offsets) - 1
        or np.any(lengths < 0)
        or np.any(lengths >= np.diff(offsets))
    ):
        raise ValueError(
            f"{prefix}.json's sft prompt lengths do not fit its {len(offsets) - 1:,} documents: "
            f"the dataset's metadata is damaged; re-create the dataset with megapar-data"
        )
    return keys, lengths


def _megatron_meta(prefix: str, tokenizer: Any) -> dict[str, Any]:
    """Metadata of a Megatron dataset made elsewhere: from its index and the given tokenizer."""

    if tokenizer is None:
        raise ValueError(
            f"{prefix}.idx is a Megatron-LM index without megapar's {prefix}.json; "
            f"name the tokenizer it was made with (--tokenizer gpt2, a "
            f"tokenizer.json directory, ...)"
        )
    tok = load_tokenizer(tokenizer)
    dtype, offsets = megatron.read_index(prefix + ".idx")
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
        "tokenizer": tok.spec(),
        "num_docs": int(len(offsets) - 1),
        "num_tokens": int(offsets[-1]),
        "index_format": "megatron",
    }
