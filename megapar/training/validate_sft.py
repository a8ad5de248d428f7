"""--sft-keys's checks (`check_sft_keys`): the records it reads and the settings it cannot be
combined with, refused in one line before any worker starts. A record without a key is named
(file and line) when the launcher tokenizes the records, also before any worker starts."""

from __future__ import annotations

import json
import os

from megapar.data.blended import data_paths, parse_blend
from megapar.data.inputs import check_sft_inputs, expand_inputs, is_raw_text, parse_sft_keys
from megapar.models.config import CAUSAL_LM_TYPES
from megapar.training.usage import UsageError


def check_sft_keys(cfg, given: set[str]) -> None:
    """UsageError for --sft-keys that is malformed, given with --jsonl-key, with a blend, or
    with --data that is not JSON Lines records (the shipped sample, a tokenized dataset, a .txt
    or .parquet file). A --data path that is not there is left to its own check."""
    if cfg.sft_keys is None:
        return
    try:
        keys = parse_sft_keys(cfg.sft_keys)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    flag = f"--sft-keys {cfg.sft_keys}"
    if "jsonl_key" in given:
        raise UsageError(
            f"--jsonl-key {cfg.jsonl_key} would be ignored: {flag} names the fields read; "
            f"drop --jsonl-key"
        )
    if cfg.data is None:
        raise UsageError(
            f"{flag} reads JSON Lines records, and no --data is given (the shipped sample is "
            f"plain text); pass --data RECORDS.jsonl"
        )
    try:
        blend = parse_blend(cfg.data)
    except ValueError:  # a malformed blend: named by its own check
        return
    if blend is not None:
        raise UsageError(
            f"{flag} reads one --data of records, not a blend; tokenize each part with "
            f"megapar-data --sft-keys {','.join(keys)} --output-prefix PART and blend the "
            f"prefixes without --sft-keys (--data 0.7 PART1 0.3 PART2)"
        )
    path = os.path.expanduser(data_paths(cfg.data)[0] or "")
    if not os.path.exists(path) and not os.path.exists(path + ".bin"):
        return
    if not is_raw_text(path):
        raise UsageError(
            f"{flag} reads JSON Lines records, and --data {path} is a dataset megapar-data "
            f"--sft-keys wrote, which trains on its responses as it is; drop --sft-keys"
            if holds_records(path)
            else f"{flag} reads JSON Lines records, and --data {path} is a dataset of text "
            f"(no prompt lengths); pass the .jsonl, or tokenize it with megapar-data "
            f"--sft-keys {','.join(keys)} and pass that without --sft-keys"
        )
    try:
        check_sft_inputs(expand_inputs([path]), keys)
    except FileNotFoundError:  # an empty directory: named by the data's own check
        return
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def holds_records(prefix: str) -> bool:
    """Whether the prepared dataset `prefix` holds prompt / response records (its .json's
    ``sft``)."""
    try:
        with open(prefix + ".json", encoding="utf-8") as f:
            return "sft" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def check_sft_model(cfg, model_type: str) -> None:
    """UsageError for --sft-keys on a model that is not a causal LM (BERT's MLM labels are its
    own)."""
    if cfg.sft_keys is not None and model_type not in CAUSAL_LM_TYPES:
        raise UsageError(
            f"--sft-keys {cfg.sft_keys} trains a causal language model on the responses, and "
            f"the model is {model_type} (masked-LM samples); use a GPT / Llama-style --model "
            f"or --from-hf, or drop --sft-keys"
        )
