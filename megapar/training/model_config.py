"""The run's model config from --load / --model / --from-hf, checked against the data's
tokenizer and --seq-len (`training.data.resolve_model` gives it the tokenizer)."""

from __future__ import annotations

import json
import os

from megapar.checkpoint.distributed import NON_STRUCTURAL, differing_fields
from megapar.checkpoint.hf import HFReader
from megapar.mesh import ep_split_error, expert_tp_error, layout_option
from megapar.models.config import CAUSAL_LM_TYPES, ConfigError, load_config_file, no_experts
from megapar.models.recipes import resolve_model as recipe
from megapar.training.config import TrainConfig
from megapar.training.validate import (
    UsageError,
    check_mlm_seq_len,
    check_mlm_token_types,
    explicit,
)
from megapar.training.validate_resume import model_from_checkpoint
from megapar.training.validate_sft import check_sft_model
from megapar.wording import and_list, counted

DEFAULT_MODEL = "gpt2-tiny"
"""The recipe of a run that names no model."""


def resolve_model_config(
    cfg: TrainConfig,
    vocab_size: int,
    tokenizer_name: str,
    gpt_vocab_size: int | None = None,
    manifest: dict | None = None,
    notes: list[str] | None = None,
    special_ids: dict | None = None,
    appended: tuple[list[str], int] | None = None,
):
    """The model config for --load / --model / --from-hf, checked against the tokenizer and
    seq-len.

    vocab_size is the tokenizer's, special tokens appended for BERT included; gpt_vocab_size
    the ids GPT data can contain (base vocabulary and end-of-document), so the real GPT-2
    (50257) trains on GPT-2-tokenized data although the tokenizer appends [MASK] and friends.
    With --load (`manifest` given) the model is the checkpoint's; a --model or --from-hf given
    as well must describe the same model. `special_ids` (bos_token_id / eos_token_id of the
    tokenizer) replace a recipe's own, so an exported model generates with the data's ids.
    `appended` (the special tokens the tokenizer appends after its vocabulary, and its size)
    names the one a --from-hf BERT has no row for.
    """

    def needed(config) -> int:
        causal = config.model_type in CAUSAL_LM_TYPES
        return gpt_vocab_size if causal and gpt_vocab_size else vocab_size

    def needs(config) -> str:
        return needs_ids(needed(config), vocab_size)

    given_from = ""
    if cfg.from_hf:
        reader = HFReader(cfg.from_hf)
        config, given_from = reader.config, f"--from-hf {cfg.from_hf}"
        if cfg.model:
            _check_same_model(cfg, config)
        reader.check_files()  # a damaged file is named here, before any worker reads it
        if notes is not None and manifest is None:
            notes += trainer_checkpoint_note(cfg.from_hf)
        # --sft-keys on a BERT is refused as that, not for the vocabulary its data would need
        check_sft_model(cfg, config.model_type)
        if config.vocab_size < needed(config) and manifest is None:
            _check_appended(cfg, config, tokenizer_name, appended)
            raise ConfigError(
                f"tokenizer {tokenizer_name} {needs(config)} but the model from "
                f"{cfg.from_hf} has a vocabulary of {config.vocab_size}; use the model's own "
                f"tokenizer (--tokenizer) or data tokenized with it"
            )
    elif cfg.model and os.path.exists(os.path.expanduser(cfg.model)):
        path = os.path.expanduser(cfg.model)
        config, given_from = recipe(path), f"--model {cfg.model}"
        check_sft_model(cfg, config.model_type)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if "vocab_size" not in load_config_file(path):
            config.vocab_size = vocab_size  # a config without a vocabulary takes the tokenizer's
            _take_special_ids(config, special_ids)
            given_from = "recipe"
        elif config.vocab_size < needed(config) and manifest is None:
            raise ConfigError(
                f"the model config {cfg.model} has vocab_size {config.vocab_size} but the data's "
                f"tokenizer {tokenizer_name} {needs(config)}; make them match "
                f"(or leave vocab_size out of the config to take the tokenizer's)"
            )
    else:
        config = recipe(cfg.model or DEFAULT_MODEL)
        if (
            config.vocab_size not in (vocab_size, needed(config))
            and notes is not None
            and manifest is None
        ):  # (GPT-2's 50,257 on the GPT-2 BPE is no news)
            notes.append(
                f"model {cfg.model or DEFAULT_MODEL}: the recipe's vocab_size "
                f"{config.vocab_size:,} gives way to the tokenizer's {vocab_size:,} "
                f"(a recipe follows the data's tokenizer; a --model config file with "
                f"vocab_size fixes it instead)"
            )
        config.vocab_size = vocab_size  # recipes take the tokenizer's vocabulary
        _take_special_ids(config, special_ids)
        given_from = "recipe"
    if manifest is not None:
        config = _checkpoint_model(
            cfg, manifest, config, given_from, needed, vocab_size, tokenizer_name
        )
    _fit_seq_len(cfg, config, notes)
    apply_moe_flags(cfg, config)
    _check_ep(cfg, config)
    return config


SPECIAL_KEYS = {
    "[PAD]": "pad_token",
    "[CLS]": "cls_token",
    "[SEP]": "sep_token",
    "[MASK]": "mask_token",
}
"""The special tokens megapar appends where a tokenizer lacks them, by their transformers key."""


def _check_appended(
    cfg: TrainConfig, config, tokenizer_name: str, appended: tuple[list[str], int] | None
) -> None:
    """A --from-hf BERT whose vocabulary holds the tokenizer's own ids but not the special
    tokens megapar appends after them (a WordPiece without [MASK]) is refused naming them."""
    if appended is None or config.model_type in CAUSAL_LM_TYPES:
        return
    names, base = appended
    if base > config.vocab_size:
        return  # the tokenizer's own ids do not fit: another tokenizer
    beyond = [(n, base + i) for i, n in enumerate(names) if base + i >= config.vocab_size]
    if not beyond or any(n not in SPECIAL_KEYS for n, _ in beyond):
        return
    tokens = " ".join(n for n, _ in beyond)
    ids = ", ".join(str(i) for _, i in beyond)
    add = ", ".join(f"'{SPECIAL_KEYS[n]}': '{n}'" for n, _ in beyond)
    raise ConfigError(
        f"--from-hf {cfg.from_hf}: its tokenizer ({tokenizer_name}) has no {tokens} "
        f"token{'s' if len(beyond) > 1 else ''}, which BERT's masking needs; megapar would "
        f"append {'them as ids' if len(beyond) > 1 else 'it as id'} {ids}, beyond the model's "
        f"vocabulary of {config.vocab_size}: add {'them' if len(beyond) > 1 else 'it'} to both "
        f"and save them again (tok.add_special_tokens({{{add}}}); "
        f"model.resize_token_embeddings(len(tok)))"
    )


def _check_ep(cfg: TrainConfig, config) -> None:
    """--ep > 1 needs a model with experts, as many as ep divides; so does
    --expert-tensor-parallel-size > 1, which must be --tp, with an expert intermediate size it
    divides."""
    etp = cfg.expert_tensor_parallel_size
    if etp > 1:
        flag = f"--expert-tensor-parallel-size {etp}"
        if getattr(config, "num_local_experts", None) is None:
            raise ConfigError(
                f"{flag} splits a mixture-of-experts model's experts over tp "
                f"{no_experts(config)}: use --expert-tensor-parallel-size 1"
            )
        error = expert_tp_error(etp, cfg.tp)  # after the model's: a dense one's says that
        if error:
            raise ConfigError(error)
        if config.expert_size % etp:
            moe_key = hasattr(config, "moe_intermediate_size")  # a Mixtral's is its own
            key = "moe_intermediate_size" if moe_key else "intermediate_size"
            raise ConfigError(
                f"{flag} does not divide the experts' intermediate size {config.expert_size} "
                f"({key}): use --expert-tensor-parallel-size 1, or a --tp "
                f"that divides {config.expert_size}"
            )
    experts = getattr(config, "num_local_experts", None)
    if cfg.ep > 1 and experts is not None and cfg.dp is not None and cfg.dp * cfg.cp % cfg.ep:
        raise ConfigError(ep_split_error(cfg.ep, cfg.dp, cfg.cp, experts=experts))
    error = ep_model_error(config, cfg.ep, ranks=cfg.dp * cfg.cp if cfg.dp else None)
    if error:
        raise ConfigError(error)


def ep_model_error(config, ep: int, api: bool = False, ranks: int | None = None) -> str | None:
    """Why `ep` > 1 cannot split `config`'s experts (it has none, or ep does not divide
    them), worded for megapar-train or with `api` for megapar.prepare (`layout_option`);
    None where it can. `ranks`: dp x cp where known, which the ep values offered divide too."""
    if ep == 1:
        return None
    experts = getattr(config, "num_local_experts", None)
    if experts is None:
        return (
            f"{layout_option('ep', ep, api)} shards a mixture-of-experts model's experts "
            f"{no_experts(config, api)}: use {layout_option('ep', 1, api)}"
        )
    if experts % ep:
        if ranks is None:
            fix = f"choose an {layout_option('ep', None, api)} that divides {experts}"
        else:
            fits = [e for e in range(1, ranks + 1) if ranks % e == 0 and experts % e == 0]
            rule = f"the {experts} experts and dp x cp = {ranks}"
            fix = f"use {layout_option('ep', and_list([str(e) for e in fits], 'or'), api)} " + (
                f"(each divides {rule})" if len(fits) > 1 else f"(the only value dividing {rule})"
            )
        return (
            f"{layout_option('ep', ep, api)} does not divide the model's "
            f"{counted(experts, 'expert')}: {fix}"
        )
    return None


def capacity_note(config, layout, sequence_parallel: bool, expert_tp: int = 1) -> list[str]:
    """megapar-train's start-up note where an expert capacity counts a split sequence's tokens:
    under cp, or sequence parallelism at tp > 1 with the experts whole on each tp rank
    (`expert_tp` 1: with them split over tp the tp ranks gather the sequence's tokens before
    the experts), each rank's capacity is of its own tokens (as Megatron's is), so which tokens
    are dropped depends on the layout; [] otherwise."""
    factor = getattr(config, "moe_capacity_factor", None)
    split = [f"--cp {layout.cp}"] if layout.cp > 1 else []
    if sequence_parallel and layout.tp > 1 and expert_tp != layout.tp:
        split.append(f"--sequence-parallel at --tp {layout.tp}")
    if not factor or not split:
        return []
    return [
        f"an expert capacity factor of {factor:g} (--moe-capacity-factor, or the model "
        f"config's moe_capacity_factor) under {' and '.join(split)}: each rank's expert "
        f"capacity counts its own share of a sequence's tokens (as Megatron's), so the tokens "
        f"dropped, and the loss, differ from a layout without it (dropless, no capacity "
        f"factor, gives every layout the same numbers)"
    ]


MOE_FLAGS = {
    "moe_aux_loss_coef": "router_aux_loss_coef",
    "moe_z_loss_coef": "moe_z_loss_coef",
    "moe_capacity_factor": "moe_capacity_factor",
    "moe_bias_update_rate": "moe_bias_update_rate",
}
"""The --moe-* flags and the model config field each sets."""


def apply_moe_flags(cfg: TrainConfig, config, keyword: str | None = None) -> None:
    """The --moe-* flags given set their model config fields (--moe-capacity-factor 0:
    dropless); refused for a model without experts (worded for megapar-train, or with
    `keyword`, the function whose keywords they are: "megapar.prepare")."""
    given = [name for name in MOE_FLAGS if getattr(cfg, name) is not None]
    if given and not hasattr(config, "num_local_experts"):
        name = given[0]
        flag = (
            f"{keyword}: {name}={getattr(cfg, name)!r}"
            if keyword
            else "--" + name.replace("_", "-")
        )
        fix = "drop it" if keyword else "remove the flag"
        raise ConfigError(
            f"{flag} applies to a mixture-of-experts model {no_experts(config, bool(keyword))}: "
            f"{fix}"
        )
    for name in given:
        value = getattr(cfg, name)
        setattr(
            config, MOE_FLAGS[name], None if name == "moe_capacity_factor" and not value else value
        )


def needs_ids(needed: int, vocab_size: int) -> str:
    """ "needs N token ids" of a tokenizer of `vocab_size` ids, saying why `needed` is fewer
    where it is: a causal model reads its base vocabulary and end-of-document id only."""
    why = (
        f" (of its {vocab_size:,}: a causal model does not read the {vocab_size - needed} "
        f"special tokens appended after its vocabulary)"
        if needed < vocab_size
        else ""
    )
    return f"needs {needed:,} token ids{why}"


def _checkpoint_model(
    cfg: TrainConfig,
    manifest: dict,
    config,
    given_from: str,
    needed,
    vocab_size: int,
    tokenizer_name: str,
):
    """--load's model (`model_from_checkpoint`: a --model or --from-hf `config` given as well
    must be the same), refused when its vocabulary holds fewer than the ids the data's
    tokenizer (of `vocab_size`) gives a model of its type (`needed(config)`)."""
    given = config if (cfg.model or cfg.from_hf) else None
    config = model_from_checkpoint(cfg, manifest, given, given_from)
    if config.vocab_size < needed(config):
        raise ConfigError(
            f"--load {cfg.load} holds a model with a vocabulary of {config.vocab_size} but the "
            f"data's tokenizer {tokenizer_name} {needs_ids(needed(config), vocab_size)}; use data "
            f"tokenized with the checkpoint's tokenizer"
        )
    return config


def _fit_seq_len(cfg: TrainConfig, config, notes: list[str] | None) -> None:
    """A --seq-len beyond the model's positions is refused when given, else lowered to them
    (with a note)."""
    max_len = config.max_positions
    if config.model_type not in CAUSAL_LM_TYPES:
        check_mlm_seq_len(cfg.seq_len)
        check_mlm_token_types(config)
    if cfg.seq_len > max_len:
        if "seq_len" in explicit(cfg):
            raise ConfigError(
                f"--seq-len {cfg.seq_len} exceeds the model's maximum of "
                f"{max_len} positions; lower --seq-len"
            )
        if notes is not None:
            notes.append(
                f"--seq-len not given: using the model's {max_len} positions instead of the "
                f"default {cfg.seq_len}"
            )
        cfg.seq_len = max_len


def _check_same_model(cfg: TrainConfig, config) -> None:
    """A --model given with --from-hf must describe the model the directory holds (which is the
    run's model): UsageError naming what differs otherwise. A recipe, or a config file without
    vocab_size, takes the tokenizer's vocabulary: vocab_size is not compared then; neither are
    dropouts, initialisation and token ids."""
    assert cfg.model is not None  # called with --model given
    path = os.path.expanduser(cfg.model)
    given = recipe(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    own_vocab = os.path.isfile(file) and "vocab_size" in load_config_file(file)
    ours, theirs = given.to_dict(), config.to_dict()
    where = f"--from-hf {cfg.from_hf}"
    if ours["model_type"] != theirs["model_type"]:
        raise UsageError(
            f"{where} holds a {theirs['model_type']} model and --model {cfg.model} "
            f"is a {ours['model_type']}; the model comes from {where} (its "
            f"config.json): drop --model"
        )
    skip = NON_STRUCTURAL | {"pad_token_id"} | (set() if own_vocab else {"vocab_size"})
    diff = differing_fields(ours, theirs, skip)
    if diff:
        shown = ", ".join(f"{k}={theirs.get(k)!r} (--from-hf) vs {ours.get(k)!r}" for k in diff)
        raise UsageError(
            f"--model {cfg.model} describes another model than {where}: {shown}; "
            f"the model comes from {where} (its config.json): drop --model"
        )


def _take_special_ids(config, special_ids: dict | None) -> None:
    """A recipe's bos / eos ids (Llama's 1 / 2) become the tokenizer's (None where it has none)."""
    for key, value in (special_ids or {}).items():
        if hasattr(config, key):
            setattr(config, key, value)


TRAINER_STATE = ("optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth")
"""What a Hugging Face Trainer's ``checkpoint-N`` directory holds besides the model."""


def trainer_checkpoint_note(path: str) -> list[str]:
    """A note where --from-hf `path` is a Hugging Face Trainer checkpoint (``checkpoint-N``:
    its optimizer, scheduler and step beside the model): megapar-train starts from its weights
    alone, at step 1; none otherwise."""
    held = [n for n in TRAINER_STATE if os.path.exists(os.path.join(path, n))]
    if not held:
        return []
    step = ""
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            step = f" at step {int(json.load(f)['global_step']):,}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return [
        f"--from-hf {path}: a Hugging Face Trainer checkpoint{step}; megapar-train starts from "
        f"its weights alone, at step 1 with a new optimizer and schedule (its "
        f"{', '.join(held)} are not read)"
    ]
