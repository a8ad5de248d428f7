"""From `--data` / `--tokenizer` / `--model` to datasets, the model config and batches.

`prepare_data` runs once, in the launching process, before any worker starts: it checks the
data exists, tokenizes raw text into the cache, and resolves the model config against the
tokenizer, so the usual mistakes are reported before a process group could hang.
Workers then call `build_datasets` and `batches`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megapar.data import (
    GlobalBatchSampler, GPTDataset, IndexedDataset, MLMDataset, asset_path, collate,
    ensure_dataset, load_tokenizer, split_documents,
)
from megapar.models.config import CAUSAL_LM_TYPES, ConfigError
from megapar.training.config import TrainConfig

DEFAULT_TEXT = "shakespeare_sample.txt"
DEFAULT_MODEL = "gpt2-tiny"


@dataclass
class DataPlan:
    """What the launcher resolved before starting workers."""

    prefix: str
    """Tokenized dataset prefix (PREFIX.bin / .idx / .json)."""
    model_config: dict
    """The model config (a dict with model_type), vocab size matched to the tokenizer."""


def resolve_data_prefix(cfg: TrainConfig) -> str:
    """The dataset prefix for --data: tokenizing raw text (or the shipped sample) if needed.

    For a blend, every part is resolved and checked to share one tokenizer; the first
    part's prefix is returned (it stands for the vocabulary)."""
    from megapar.data.blended import parse_blend

    blend = parse_blend(cfg.data) if cfg.data is not None else None
    if blend is None:
        return _resolve_one(cfg, cfg.data if not isinstance(cfg.data, list) else cfg.data[0])
    prefixes = [_resolve_one(cfg, p) for _, p in blend]
    first = IndexedDataset(prefixes[0], cfg.tokenizer)
    for prefix in prefixes[1:]:
        other = IndexedDataset(prefix, cfg.tokenizer)
        if (other.vocab_size, other.eod_id) != (first.vocab_size, first.eod_id):
            raise ValueError(f"--data blend: {prefix} (vocab {other.vocab_size}, eod "
                             f"{other.eod_id}) and {prefixes[0]} (vocab {first.vocab_size}, eod "
                             f"{first.eod_id}) were made with different tokenizers; "
                             f"tokenize every part with the same one")
    return prefixes[0]


def _resolve_one(cfg: TrainConfig, data: str | None) -> str:
    if data is None:
        data = asset_path(DEFAULT_TEXT)
    data = os.path.expanduser(data)
    if data.endswith((".txt", ".text", ".md")) or (os.path.isfile(data) and
                                                    not os.path.exists(data + ".bin")):
        if not os.path.isfile(data):
            raise FileNotFoundError(f"--data {data}: no such text file")
        return ensure_dataset(data, cfg.tokenizer, os.path.expanduser(cfg.data_cache),
                              split_paragraphs=True, progress=cfg.progress)
    needed = (".bin", ".idx") if _is_megatron(data) else (".bin", ".idx", ".json")
    missing = [data + ext for ext in needed if not os.path.exists(data + ext)]
    if missing:
        raise FileNotFoundError(
            f"--data {data}: {', '.join(os.path.basename(m) for m in missing)} not found; pass "
            f"the prefix written by `megapar-data --output-prefix`, or a raw .txt file")
    return data


def _is_megatron(prefix: str) -> bool:
    """A Megatron-LM dataset (MMIDIDX index): its .json (megapar's metadata) is optional."""
    from megapar.data.megatron import is_megatron_index

    return os.path.isfile(prefix + ".idx") and is_megatron_index(prefix + ".idx")


def resolve_model_config(cfg: TrainConfig, vocab_size: int, tokenizer_name: str,
                         gpt_vocab_size: int | None = None):
    """The model config for --model / --from-hf, checked against the tokenizer and seq-len.

    vocab_size is the tokenizer's, special tokens appended for BERT included; gpt_vocab_size
    the ids GPT data can contain (base vocabulary and end-of-document), so the real GPT-2
    (50257) trains on GPT-2-tokenized data although the tokenizer appends [MASK] and friends.
    """
    from megapar.models.recipes import resolve_model

    def needed(config) -> int:
        causal = config.model_type in CAUSAL_LM_TYPES
        return gpt_vocab_size if causal and gpt_vocab_size else vocab_size

    if cfg.from_hf:
        from megapar.checkpoint.hf import HFReader

        config = HFReader(cfg.from_hf).config
        if config.vocab_size < needed(config):
            raise ConfigError(
                f"tokenizer {tokenizer_name} needs {needed(config)} token ids but the model from "
                f"{cfg.from_hf} has a vocabulary of {config.vocab_size}; use the model's own "
                f"tokenizer (--tokenizer) or data tokenized with it")
    elif cfg.model and os.path.exists(os.path.expanduser(cfg.model)):
        config = resolve_model(os.path.expanduser(cfg.model))
        if "vocab_size" not in _raw_keys(os.path.expanduser(cfg.model)):
            config.vocab_size = vocab_size  # a config without a vocabulary takes the tokenizer's
        elif config.vocab_size < needed(config):
            raise ConfigError(
                f"the model config {cfg.model} has vocab_size {config.vocab_size} but the data's "
                f"tokenizer {tokenizer_name} needs {needed(config)} token ids; make them match "
                f"(or leave vocab_size out of the config to take the tokenizer's)")
    else:
        config = resolve_model(cfg.model or DEFAULT_MODEL)
        config.vocab_size = vocab_size  # recipes take the tokenizer's vocabulary
    max_len = getattr(config, "n_positions", None) or config.max_position_embeddings
    if cfg.seq_len > max_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's maximum of {max_len} "
                          f"positions; lower --seq-len")
    return config


def _raw_keys(path: str) -> set:
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        return set(yaml.safe_load(text) or {})
    import json

    return set(json.loads(text))


def prepare_data(cfg: TrainConfig) -> DataPlan:
    prefix = resolve_data_prefix(cfg)
    indexed = IndexedDataset(prefix, cfg.tokenizer)
    tokenizer = load_tokenizer(indexed.tokenizer_spec)
    gpt_vocab = max(tokenizer.base_vocab_size, tokenizer.eod_id + 1)
    config = resolve_model_config(cfg, indexed.vocab_size, str(tokenizer.path), gpt_vocab)
    return DataPlan(prefix=prefix, model_config=config.to_dict())


def build_datasets(cfg: TrainConfig, prefix: str, model_type: str):
    """(train, val) datasets: GPT windows or BERT MLM samples, split by documents; for a
    blended --data, each part is split and the parts are blended by weight."""
    from megapar.data.blended import BlendedDataset, parse_blend

    blend = parse_blend(cfg.data) if cfg.data is not None else None
    if blend is None:
        return _build_one(cfg, prefix, model_type)
    parts = [_build_one(cfg, _resolve_one(cfg, p), model_type) for _, p in blend]
    weights, names = [w for w, _ in blend], [p for _, p in blend]
    train = BlendedDataset([t for t, _ in parts], weights, names, cfg.seed)
    val = None
    if all(v is not None and len(v) > 0 for _, v in parts):
        val = BlendedDataset([v for _, v in parts], weights, names, cfg.seed)
    return train, val


def _build_one(cfg: TrainConfig, prefix: str, model_type: str):
    indexed = IndexedDataset(prefix, cfg.tokenizer)
    if cfg.val_fraction > 0 and indexed.num_docs > 1:
        train_docs, val_docs = split_documents(indexed.num_docs, cfg.val_fraction, cfg.seed)
    else:
        train_docs, val_docs = None, None
    if model_type in CAUSAL_LM_TYPES:
        make = lambda docs: GPTDataset(indexed, cfg.seq_len, doc_range=docs)  # noqa: E731
    else:
        special = load_tokenizer(indexed.tokenizer_spec)
        make = lambda docs: MLMDataset(indexed, cfg.seq_len, special, cfg.seed,  # noqa: E731
                                       doc_range=docs)
    train = make(train_docs)
    val = make(val_docs) if val_docs is not None else None
    return train, val


def planned_samples(sampler: GlobalBatchSampler, steps: int):
    """Indices of the samples `steps` global batches from the sampler's position draw."""
    import numpy as np

    want, out = steps * sampler.global_batch_size, []
    start, epoch = sampler.consumed_samples, 0
    while want > 0:
        order = sampler.epoch_order(epoch)[:sampler.samples_per_epoch]
        skip = min(start, len(order))
        take = order[skip:skip + want]
        out.append(take)
        start -= skip
        want -= len(take)
        epoch += 1
    return np.concatenate(out)


def make_sampler(cfg: TrainConfig, dataset, dp: int, dp_rank: int, shuffle=True, seed=None):
    shuffle = shuffle and not getattr(dataset, "shuffled", False)  # a blend comes shuffled
    return GlobalBatchSampler(len(dataset), cfg.global_batch_size, cfg.micro_batch_size, dp,
                              dp_rank, cfg.seed if seed is None else seed, shuffle=shuffle)


def batches(dataset, sampler, device: torch.device):
    """Endless: per global batch, this rank's micro-batches as dicts of tensors on `device`."""
    while True:
        for micro_batches in sampler:
            yield [{k: v.to(device) for k, v in collate([dataset[i] for i in mb]).items()}
                   for mb in micro_batches]
