"""Data pipeline: tokenizers, the indexed dataset, preprocessing, GPT/MLM/SFT datasets, sampler.

Typical use::

    from megapar.data import ensure_dataset, IndexedDataset, GPTDataset, split_documents
    prefix = ensure_dataset("corpus.txt", "gpt2", cache_dir="~/.cache/megapar")
    ds = IndexedDataset(prefix)
    train_docs, val_docs = split_documents(ds.num_docs, val_fraction=0.05, seed=0)
    train = GPTDataset(ds, seq_len=256, doc_range=train_docs)
"""

from megapar.data.gpt_dataset import GPTDataset, TokenStream, split_documents
from megapar.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megapar.data.mlm_dataset import IGNORE_INDEX, MLMDataset
from megapar.data.preprocess import (
    ensure_dataset,
    preprocess_files,
    train_sentencepiece,
)
from megapar.data.sampler import GlobalBatchSampler, collate
from megapar.data.sft_dataset import SFTDataset
from megapar.data.tokenizers import SpecialTokens, Tokenizer, asset_path, load_tokenizer

__all__ = [
    "GPTDataset",
    "TokenStream",
    "split_documents",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IGNORE_INDEX",
    "MLMDataset",
    "ensure_dataset",
    "preprocess_files",
    "train_sentencepiece",
    "SFTDataset",
    "GlobalBatchSampler",
    "collate",
    "SpecialTokens",
    "Tokenizer",
    "asset_path",
    "load_tokenizer",
]
