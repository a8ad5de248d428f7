"""Supervised fine-tuning samples over an indexed dataset of prompt / response records.

One sample per document (record, as ``megapar-data --sft-keys`` writes it: the BOS when the
tokenizer has one, the prompt's tokens, the response's tokens, the eod; its prompt length in
``IndexedDataset.prompt_lengths``). The document is cut to its first ``seq_len + 1`` tokens
(a longer record is truncated at the end, as TRL's SFTTrainer, torchtune and Megatron-LM's
SFT dataset do; `truncated` counts them) and laid out like every causal sample in megapar:
``input_ids = tokens[:-1]``, ``labels = tokens[1:]``, right-padded to ``seq_len`` with the
eod id. A label is the token it predicts where that token is the response's (or the eod),
and -100 where it is the prompt's and on the padding: the loss is the response's only, as
TRL's completion-only loss and torchtune's ``train_on_input=False`` give. ``attention_mask``
is 1 on the sample's tokens and 0 on the padding, as a transformers tokenizer pads on the
right: causal attention keeps the padding out of the tokens before it anyway; a mixture of
experts routes no padding and leaves it out of its balancing terms (`megapar.models.moe`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megapar.data.gpt_dataset import DocRange, select_docs
from megapar.data.indexed import IndexedDataset
from megapar.data.mlm_dataset import IGNORE_INDEX


class SFTDataset(torch.utils.data.Dataset):
    """Samples ``dict(input_ids, labels, attention_mask)`` (``LongTensor[seq_len]`` each), one
    per document of
    ``doc_range``; see the module docstring."""

    def __init__(self, indexed: IndexedDataset, seq_len: int, doc_range: DocRange = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if indexed.prompt_lengths is None:
            raise ValueError(
                f"{indexed.prefix} holds no prompt lengths: tokenize the records with "
                f"megapar-data --sft-keys PROMPT,RESPONSE"
            )
        self.indexed = indexed
        self.seq_len = int(seq_len)
        docs = select_docs(indexed, doc_range)
        if docs.size == 0:
            raise ValueError(f"{indexed.prefix}: no record in the selection")
        self.start = indexed.doc_offsets[docs]
        self.length = indexed.doc_offsets[docs + 1] - self.start
        self.prompt = np.maximum(indexed.prompt_lengths[docs], 1)  # token 0 is no target
        self.pad_id = indexed.eod_id

    def __len__(self) -> int:
        return len(self.start)

    @property
    def truncated(self) -> int:
        """Records longer than ``seq_len + 1`` tokens, cut at the end."""
        return int(np.count_nonzero(self.length > self.seq_len + 1))

    @property
    def unlabelled(self) -> int:
        """Records whose prompt fills the whole sample: no response token is left to learn."""
        return int(np.count_nonzero(np.minimum(self.length, self.seq_len + 1) <= self.prompt))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)}")
        n = min(int(self.length[i]), self.seq_len + 1)
        tokens = self.indexed.get(int(self.start[i]), n)
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        input_ids[: n - 1] = tokens[:-1]
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        p = int(self.prompt[i])
        if n > p:
            labels[p - 1 : n - 1] = tokens[p:]
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[: n - 1] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attention_mask),
        }

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (for logs)."""
        return {
            "samples": len(self),
            "seq_len": self.seq_len,
            "truncated": self.truncated,
            "unlabelled": self.unlabelled,
        }
