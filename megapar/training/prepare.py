"""`megapar.prepare`: a user's transformers model (or config, or recipe) sharded over the ranks
and wrapped in an `Engine` (see engine.py), for users who write their own training loop."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import warnings
from pathlib import Path

import torch

from megapar.checkpoint.convert import recorded_tokenizer
from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.format import LATEST, MANIFEST
from megapar.checkpoint.hf import ARCHITECTURES, HFReader, load_hf_weights, model_rows
from megapar.checkpoint.hf_names import hf_parameter_names
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.data.tokenizer import TOKENIZER_SPECS
from megapar.data.tokenizers import hf_dir_tokenizer, load_tokenizer
from megapar.device import DEFAULT_TIMEOUT_S, bound_world_waits
from megapar.env_seconds import problem as env_problem
from megapar.faults.status import set_action, set_step
from megapar.launcher import launched_world_size
from megapar.mesh import (
    Layout,
    LayoutError,
    Mesh,
    ep_split_error,
    expert_tp_error,
    same_on_all_ranks,
)
from megapar.models import set_loss_fn
from megapar.models.config import ConfigError, config_from_dict, config_from_hf
from megapar.models.recipes import resolve_model
from megapar.optim import LRScheduler
from megapar.pipeline.partition import chunk_specs, partition_layers
from megapar.pipeline.schedules import (
    CHUNKED_SCHEDULES,
    chunks_per_rank,
    one_stage_chunks_error,
    placement_of,
    schedule_named_elsewhere,
)
from megapar.tensor_parallel.cross_entropy import LOSS_MEANS
from megapar.tensor_parallel.fp8_convert import all_layers_hint, none_kept_by_size
from megapar.training.config import TrainConfig, flag_choices
from megapar.training.engine import ON_NONFINITE, Engine
from megapar.training.model_config import apply_moe_flags, ep_model_error
from megapar.training.other_tools import (
    TORCHTITAN_MODULE_API,
    other_tools_answer,
)
from megapar.training.ranges import check_ranges
from megapar.training.usage import UsageError
from megapar.training.validate import check_cp_comm, check_documents
from megapar.training.validate_fp8 import check_fp8, check_fp8_layout, fp8_layout_problem
from megapar.training.validate_sharding import (
    check_grad_wire,
    check_optimizer_sharding,
    check_powersgd_rank,
    check_zero3,
)


def _resolve_model(model):
    """(megapar config, where its weights come from) for a transformers model (an HF reader) /
    config or a recipe name (None: initialised from the seed), or a megapar checkpoint (its
    step directory)."""

    if isinstance(model, (str, os.PathLike)):
        if not os.fspath(model).strip():  # an unset $MODEL ("config.json: no such config file")
            raise ConfigError(
                f"megapar.prepare: model {os.fspath(model)!r} is empty: give a transformers "
                f"model or its directory, a recipe name (e.g. 'gpt2-tiny'), a model config file "
                f"or a megapar checkpoint directory"
            )
        path = Path(model).expanduser()
        if path.is_dir() and ((path / MANIFEST).exists() or (path / LATEST).exists()):
            step_dir = resolve_checkpoint(path)
            return config_from_dict(read_manifest(step_dir)["model"]), step_dir
        if path.is_dir() and any((path / f).exists() for f in HF_WEIGHT_FILES):
            reader = HFReader(str(path))  # a transformers directory: its weights, as --from-hf
            return reader.config, reader
        try:
            return resolve_model(str(model), api=True), None
        except ConfigError as exc:  # prepare's own prefix, as its other refusals
            raise ConfigError(f"megapar.prepare: {exc}") from None
    if hasattr(model, "state_dict") and hasattr(model, "config"):
        name = type(model).__name__
        kind = getattr(model.config, "model_type", None)
        if kind not in ARCHITECTURES:
            raise ConfigError(
                f"megapar.prepare: {name} (model_type {kind!r}) is not a model "
                f"megapar builds; it trains {' / '.join(LM_CLASSES)}"
            )
        if name not in LM_CLASSES + BASE_CLASSES:
            raise ConfigError(
                f"megapar.prepare: a {name} has a head megapar does not train (it "
                f"would be dropped); pass {' / '.join(LM_CLASSES)}, the model "
                f"megapar trains, with the same weights"
            )
        if any(t.is_meta for t in model.state_dict().values()):
            raise ConfigError(
                f"megapar.prepare: the {name}'s weights are on the meta device (no values "
                f"to shard); pass its config, megapar.prepare(model.config, ...), to build "
                f"it with weights initialised from seed on each rank's shard only, or "
                f"build the model with its weights"
            )
        reader = HFReader.from_model(model)
        return reader.config, reader
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return config_from_hf(model), None
    raise ConfigError(
        f"megapar.prepare: cannot train a {type(model).__name__!r} object; pass a "
        f"transformers {' / '.join(LM_CLASSES)} (or its config), a recipe name such as "
        f"'gpt2-tiny', a config file, a transformers model's directory or a megapar checkpoint"
    )


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""What makes a directory passed to `prepare` a transformers model's, weights and all (without
them, its config.json is a config)."""

LM_CLASSES = tuple(ARCHITECTURES.values())
"""The transformers models megapar trains as they are."""
BASE_CLASSES = ("GPT2Model", "BertModel", "LlamaModel")
"""Their bodies without the head: accepted, the head's missing tensors initialised (a warning
names them)."""


def _check_same_weights(model, mesh: Mesh) -> None:
    """Every rank must pass the same weights: compare a checksum over the world."""
    if mesh.layout.world_size == 1:
        return
    with torch.no_grad():
        total = sum(p.detach().double().abs().sum() for p in model.parameters())
    if not same_on_all_ranks(float(total), mesh.device):
        raise ValueError(
            "megapar.prepare: the model's weights differ between ranks; build it the "
            "same way on every rank (torch.manual_seed before constructing it, or "
            "from_pretrained)"
        )


def _check_sharding(cfg: TrainConfig) -> None:
    """zero: a ZeRO stage (ValueError naming the keyword argument); what megapar-train refuses
    of its combinations (offload_params, the zero3_* options) `check_zero3` checks."""
    if cfg.zero not in (0, 1, 2, 3):
        raise ValueError(
            f"megapar.prepare: zero={cfg.zero!r} is not a ZeRO stage; use 0 (no "
            f"sharding), 1 (optimizer state sharded over data-parallel ranks), 2 "
            f"(gradients too) or 3 (parameters too)"
        )


def _check_choices(cfg: TrainConfig) -> None:
    """A setting of a fixed set of values (megapar-train's flag choices: precision, schedule,
    recompute, optimizer, ...) outside it, or a switch given other than True or False (a
    string is truthy: fp8_emulate="no" emulated): ValueError naming the keyword, before
    anything is built (the engine's own checks raised later, not in the API's terms)."""
    for name, allowed in flag_choices().items():
        value = getattr(cfg, name)
        if value not in allowed:  # None too: no setting means None (fp8=None switched it on)
            elsewhere = schedule_named_elsewhere(value, keywords=True) if name == "schedule" else ""
            raise UsageError(
                f"megapar.prepare: {name}={value!r} is invalid: choose one of "
                f"{', '.join(map(repr, allowed))}" + (f"; {elsewhere}" if elsewhere else "")
            )
    for f in dataclasses.fields(TrainConfig):  # a switch: "no" or "False" would switch it on
        value = getattr(cfg, f.name)
        switch = (
            value is None or isinstance(value, bool) or (type(value) is int and value in (0, 1))
        )
        if "bool" in str(f.type) and not switch:
            raise UsageError(
                f"megapar.prepare: {f.name}={value!r} is invalid: a switch is True or False"
            )


def _keyword_terms(text: str, fields: list[str]) -> str:
    """megapar-train's hint `text` in `prepare`'s terms: a flag that is a `TrainConfig` field
    becomes its keyword (``--clip-grad``: ``clip_grad``; ``--precision fp16``:
    ``precision='fp16'``)."""
    choices = flag_choices()

    def keyword(m: re.Match) -> str:
        name, value = m.group(1).replace("-", "_"), m.group(2)
        if name not in fields:
            return m.group(0)
        chosen = [c for c in choices.get(name, ()) if value is not None and str(c) == value]
        if chosen:
            return f"{name}={chosen[0]!r}"  # zero=3, precision='fp16'
        return name + (f" {value}" if value is not None else "")

    return re.sub(r"--([a-z][a-z0-9-]*)(?: ([a-z0-9][\w.]*))?", keyword, text)


LR_SCHEDULE = (
    "prepare takes the learning-rate schedule as lr_schedule={'max_steps': ..., "
    "'warmup_steps': ..., 'decay': ..., 'min_lr': ...}"
)
"""Where another tool's schedule setting goes in `prepare` (megapar-train's flags for it,
`SCHEDULE_OPTIONS`, are refused there)."""

API_ANSWERS = {
    "per_device_train_batch_size": "did you mean micro_batch_size? (each train_step's batch is "
    "the global batch: its rows over micro_batch_size x dp are the accumulation steps)",
    **dict.fromkeys(
        ("deepspeed", "deepspeed_config", "zero_optimization"),
        "megapar's ZeRO is built in: give zero=1, 2 or 3 (with offload_optimizer, "
        "offload_params) and the config's other settings as keywords",
    ),
    **dict.fromkeys(
        ("activation_checkpoint", "activation_checkpointing", "gradient_checkpointing"),
        "did you mean recompute='full'? (or 'selective')",
    ),
}
"""Keywords of other tools whose megapar-train answer names what `prepare` has otherwise."""


def _unknown_hint(name: str, fields: list[str]) -> str:
    """What to pass instead of the unknown keyword `name`: megapar-train's answer to another
    tool's flag of that name (DeepSpeed's, Megatron-LM's, Hugging Face Trainer's: ``fp16``,
    ``gradient_clipping``, ``train_batch_size``; torchtitan's job config keys without their
    section: ``tensor_parallel_degree``), in keyword terms, else the closest field."""
    if name == "config":
        return (
            "config: megapar.prepare reads no config file (a DeepSpeed config neither): pass "
            "its settings as keywords (zero, offload_optimizer, precision, micro_batch_size, "
            "global_batch_size, clip_grad, ...)"
        )
    if name == "module":  # torchtitan's config registry: megapar-train's answer names flags
        return f"module: {TORCHTITAN_MODULE_API}"
    if name in API_ANSWERS:
        return f"{name}: {API_ANSWERS[name]}"
    other = other_tools_answer(name)
    if other:
        said = _keyword_terms(other, fields)
        if any(re.search(rf"\b{option}\b", said) for option in SCHEDULE_OPTIONS):
            return f"{name}: {LR_SCHEDULE} (megapar-train's answer: {said})"
        return f"{name}: did you mean {said}?" if other.startswith("--") else f"{name}: {said}"
    close = difflib.get_close_matches(name, fields, n=1)
    return f"{name}: did you mean {close[0]}?" if close else ""


def prepare(
    model,
    tp: int = 1,
    pp: int = 1,
    micro_batch_size: int = 1,
    schedule: str = "1f1b",
    recompute: str = "none",
    precision: str = "fp32",
    zero: int = 0,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    clip_grad: float = 0.0,
    lr_schedule=None,
    seed: int = 1234,
    timeout_s: float | None = None,
    on_nonfinite: str = "raise",
    loss_fn=None,
    **options,
) -> Engine:
    """Shard `model` over this process's ranks and return its `Engine` (collective: call it on
    every rank, inside the function `megapar.launch` runs, or under torchrun / Slurm).

    model: a transformers `GPT2LMHeadModel` / `BertForMaskedLM` / `LlamaForCausalLM` /
    `Qwen3ForCausalLM` / `Qwen2ForCausalLM` / `MistralForCausalLM` / `MixtralForCausalLM` /
    `Qwen3MoeForCausalLM` / `DeepseekV3ForCausalLM` instance (its weights are copied into the
    engine's own sharded model, so the instance itself is not trained: `engine.export_hf(dir)`
    writes the trained weights for `from_pretrained`; build it identically on every rank; a
    bare `GPT2Model` / `BertModel` / `LlamaModel` gets its missing head initialised, with a
    warning; a model with another head, e.g. for classification, is
    refused; one built on the meta device has no weights: pass its config), a transformers
    config (weights initialised from `seed`, the same in every layout; each rank keeps only its
    stage's shards, one full tensor at a time made to cut them), a megapar recipe name
    ("gpt2-tiny", "bert-base"), a transformers directory (`save_pretrained`'s: its weights read
    as `megapar-train --from-hf` reads them, and its tokenizer; a directory holding only a
    config.json is a config), or a megapar checkpoint directory (`megapar-train --save`'s or
    `engine.save`'s: its model with its weights, resharded to this layout, and the tokenizer
    it trained with; the optimizer state, step and RNG are `engine.load(dir)`'s to restore).
    dp = world size / (tp x cp x pp); context parallelism is a keyword too (`cp=2`: every
    sequence split over 2 ranks, its length a multiple of 2 x cp), and so is expert
    parallelism for a mixture of experts (`ep=2`: each MoE layer's experts split over 2 of the
    dp x cp ranks, as `--ep`; `expert_tensor_parallel_size=tp`: each expert's weights split
    over the tp ranks, as `--expert-tensor-parallel-size`, default 1). optimizer: adamw, lamb,
    lars, sgd or muon (muon_momentum=, muon_adjust_lr= as keywords, `TrainConfig`'s fields).
    weight_decay applies to matrices and embeddings only. clip_grad: global
    gradient-norm clip (0: off).
    lr_schedule: None (constant `lr`; attach a torch LR scheduler to `engine.optimizer` if you
    like), a megapar `LRScheduler`, or a dict of its fields (warmup_steps, max_steps, decay,
    min_lr; with decay "wsd" decay_steps and wsd_style). fp8: "tensorwise" / "rowwise" runs
    the blocks' linears in FP8 with torchao (a GPU with FP8, or fp8_emulate=True;
    docs/guides/fp8.md). Any other `TrainConfig` field (e.g. lr_scale_with_batch,
    global_batch_size) can be passed as a keyword (global_batch_size: every `train_step` batch
    must then have that many rows), except megapar-train's schedule flags (max_steps,
    warmup_steps, lr_decay, min_lr, lr_wsd_*: use lr_schedule) and what only its loop
    reads (save, load, log_interval, eval_interval, exit_interval, ...: `LOOP_OPTIONS`),
    refused with ValueError rather than ignored;
    compile=True torch.compiles each transformer block (`--compile`); sequence_parallel=True
    (tp > 1) splits the sequence between the tp regions, sp_regather=True with it keeps only
    the sequence slice of the column-parallel inputs for the backward (`--sp-regather`).
    timeout_s: how long any wait on other ranks may last (default: $MEGAPAR_TIMEOUT_S or
    300 s), the world group's too on gloo (a rank stalled in your loop's own code is then named
    after that long, not the launcher's default).
    loss_mean="token" makes the loss the global batch's mean over its labelled tokens,
    whatever the micro-batch size and layout (`--loss-mean`; default "microbatch": the mean of
    each micro-batch's token mean).
    on_nonfinite: a step whose loss or gradients are not finite is never applied (weights and
    optimizer state stay as they were); "raise" (default): `train_step` raises
    `megapar.faults.stop.NonFiniteError` on every rank, naming the step and what was not
    finite (in fp16 an overflow with a finite loss is skipped and not counted: only
    `max_nonfinite_steps` non-finite losses (or overflows at a static `loss_scale`) in a row, or
    an overflow at the loss scale's floor, raise, as in megapar-train); "skip": it returns the
    non-finite loss, for loops that handle it themselves.
    loss_fn: the training loss of each micro-batch, ``loss_fn(per_token, batch)`` -> a 0-dim
    tensor, called on the last pipeline stage with the micro-batch's per-token cross-entropy
    ([b, s] fp32, label-smoothed under label_smoothing, 0 where the label is -100; the
    vocab-parallel loss, the same on every tp rank, the logits never gathered) and the
    micro-batch (its rows of every batch key: the batch may then carry keys for it, such as
    per-token weights [G, s]); the step's loss is its mean over the micro-batches and dp ranks
    (None: each micro-batch's mean over its labelled tokens). eval_step uses it too, on the
    plain cross-entropy. Not with cp > 1, loss_mean="token" or z_loss (docs/guides/python-api.md).
    label_smoothing=EPS and z_loss=COEF (keywords, `--label-smoothing`, `--z-loss`) shape the
    training loss as in megapar-train.
    Packed documents (keywords, `--attention-mask-type`, `--reset-position-ids`,
    `--eod-mask-loss`): attention_mask_type="block_causal" keeps each token's attention within
    its document, reset_position_ids=True restarts positions at each, eod_mask_loss=True labels
    the end-of-document positions -100 in `train_step` / `eval_step`; each needs eod_id= (the
    end-of-document token's id, found in the batches' input_ids: no other batch key).
    """

    set_step(None)  # a new engine: no step yet (a forked rank inherits its parent's status)
    set_action("megapar.prepare: checking its arguments")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(
            f"megapar.prepare: on_nonfinite={on_nonfinite!r} is not one of "
            f"{', '.join(map(repr, ON_NONFINITE))}"
        )
    config, reader = _resolve_model(model)
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        hint = "; ".join(h for h in (_unknown_hint(u, fields) for u in unknown) if h)
        raise TypeError(
            f"megapar.prepare got unknown options {unknown}; {hint + '; ' if hint else ''}"
            f"see TrainConfig"
        )
    _refuse_unread(options)
    cfg = TrainConfig(
        tp=tp,
        pp=pp,
        micro_batch_size=micro_batch_size,
        schedule=schedule,
        recompute=recompute,
        precision=precision,
        zero=zero,
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        seed=seed,
        timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
        progress=False,
        **options,
    )
    wrong = env_problem()  # every timeout variable: the launcher and the mesh read them
    if wrong:  # read at import, where an invalid value falls back to the default
        raise ValueError(f"megapar.prepare: {wrong}")
    check_ranges(cfg, keyword="megapar.prepare")  # megapar-train's ranges, in keyword terms
    _check_sharding(cfg)
    if cfg.loss_mean not in LOSS_MEANS:
        raise ValueError(
            f"megapar.prepare: loss_mean={cfg.loss_mean!r} is not one of "
            f"{', '.join(map(repr, LOSS_MEANS))} ('microbatch', the default: the mean of each "
            f"micro-batch's token mean; 'token': the global batch's token mean)"
        )
    _check_choices(cfg)
    _check_loss_fn(loss_fn, cfg)
    given_tokenizer = _given_tokenizer(options, config)
    _check_loss_scale(cfg, options)
    check_zero3(cfg, keyword="megapar.prepare")  # and its ZeRO-3 combinations
    check_optimizer_sharding(cfg, keyword="megapar.prepare")  # ZeRO 1/2, offloaded LAMB
    check_grad_wire(cfg, keyword="megapar.prepare")  # compression beside a reduce dtype
    _check_powersgd_rank(cfg, options)
    if cfg.sp_regather and not (cfg.sequence_parallel and tp > 1):
        raise ValueError(
            "megapar.prepare: sp_regather=True needs sequence_parallel=True and tp > 1 "
            "(it changes what sequence parallelism keeps for the backward)"
        )
    if cfg.cp_comm_type != "auto" and cfg.cp == 1:
        raise ValueError(
            f"megapar.prepare: cp_comm_type={cfg.cp_comm_type!r} chooses how context-parallel "
            f"attention communicates, and cp=1 has none: pass cp > 1 or drop cp_comm_type"
        )
    check_fp8(cfg, keyword="megapar.prepare")  # Fp8Error (a ValueError): torchao, a GPU with FP8
    apply_moe_flags(cfg, config, keyword="megapar.prepare")  # the moe_* keywords, as the flags
    _check_schedule(cfg, config.num_layers)
    _check_model_layout(config, cfg)
    check_powersgd_rank(cfg, config, cfg.tp, cfg.pp, keyword="megapar.prepare")
    _check_world(cfg, getattr(config, "num_local_experts", None))
    bound_world_waits(cfg.timeout_s)  # the launcher's world group: prepare's timeout too
    lr_schedule = _lr_scheduler(lr_schedule, cfg)
    set_action("megapar.prepare: building the engine (mesh, model stage, optimizer)")
    engine = Engine(cfg, config, scheduler=lr_schedule, on_nonfinite=on_nonfinite)
    if loss_fn is not None:
        set_loss_fn(engine.model, loss_fn)
        engine.loss_fn = loss_fn
    engine.batches_from_caller = True
    if "global_batch_size" in options:  # every train_step's batch has these rows
        engine.batch_rows = cfg.global_batch_size
    _warn_no_float8(engine, cfg)
    if isinstance(reader, Path):  # a megapar checkpoint: its weights (engine.load: the rest)
        _load_checkpoint_weights(engine, reader)
    elif reader is not None:
        _load_model_weights(engine, model, reader, seed)
    if given_tokenizer is not None:
        _take_tokenizer(engine, given_tokenizer, options["tokenizer"])
    set_action("megapar.prepare returned; in the caller's code")
    return engine


def _given_tokenizer(options: dict, config) -> dict | None:
    """What the checkpoints record of the `tokenizer` keyword's tokenizer (`recorded_tokenizer`),
    None where none is given (or None); TypeError for a value that is no spec (a tokenizer
    object), ValueError for one that does not load or has more ids than model `config`'s
    vocabulary (as export_hf would refuse it, after the training)."""
    spec = options.get("tokenizer")
    if spec is None:
        return None
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"megapar.prepare: tokenizer takes a tokenizer's name or path ({TOKENIZER_SPECS}), "
            f"not a value of type {type(spec).__name__}"
        )
    path = os.path.expanduser(os.fspath(spec))
    if not path.strip():
        raise ValueError(f"megapar.prepare: tokenizer={spec!r} is empty; pass {TOKENIZER_SPECS}")
    try:
        tok = load_tokenizer(path)  # (its reason, worded for megapar-train's --tokenizer)
    except (OSError, ValueError) as exc:
        reason = str(exc).replace("--tokenizer ", "tokenizer=")  # it names the spec
        raise ValueError(f"megapar.prepare: {reason}") from None
    record = recorded_tokenizer(path)
    assert record is not None  # it loads
    fix = "; pass the tokenizer of the model's data"
    _check_fits(tok, config, f"tokenizer={spec!r}", "the model's", fix)
    return record


def _check_fits(tok, config, named: str, whose: str, fix: str) -> None:
    """ValueError where tokenizer `tok` (`named` in the line) has more token ids than model
    `config`'s vocabulary (`whose` it is), as export_hf would refuse it after the training;
    `fix`: the line's end, what to do."""
    needed = model_rows(tok, config.model_type)
    if needed > config.vocab_size:
        raise ValueError(
            f"megapar.prepare: {named} has {needed:,} token ids, more than {whose} vocabulary "
            f"of {config.vocab_size:,}{fix}"
        )


def _take_tokenizer(engine, record: dict, given) -> None:
    """The `tokenizer` keyword's tokenizer (`record`) as the engine's, which its checkpoints
    and export_hf carry; ValueError where the source (a checkpoint, a transformers directory)
    records another."""
    own = engine.tokenizer
    if isinstance(own, dict) and own.get("sha256") and own["sha256"] != record["sha256"]:
        raise ValueError(
            f"megapar.prepare: tokenizer={given!r} is not the tokenizer the model comes with "
            f"({own.get('path')}: its files differ); drop tokenizer= (the model's is taken)"
        )
    engine.tokenizer = record


def _check_loss_fn(loss_fn, cfg: TrainConfig) -> None:
    """ValueError (TypeError for a non-callable, or one that does not take (per_token, batch)) for
    a loss hook `prepare` cannot serve."""
    if loss_fn is None:
        return
    if not callable(loss_fn):
        raise TypeError(
            f"megapar.prepare: loss_fn must be a function (per_token, batch) -> loss, got "
            f"{type(loss_fn).__name__}"
        )
    try:
        inspect.signature(loss_fn).bind(None, None)
    except TypeError:  # it would fail on the last stage, in the first micro-batch
        raise TypeError(
            f"megapar.prepare: loss_fn must take two arguments (per_token, batch), but "
            f"{getattr(loss_fn, '__name__', type(loss_fn).__name__)}"
            f"{inspect.signature(loss_fn)} does not"
        ) from None
    except ValueError:  # a builtin without a signature: not checkable here
        pass
    problems = (
        (cfg.cp > 1, f"cp={cfg.cp}: each rank holds a part of every sequence; drop cp"),
        (
            cfg.loss_mean == "token",
            'loss_mean="token": it sets the reduction, which loss_fn owns; drop one of them',
        ),
        (
            cfg.z_loss > 0,
            f"z_loss={cfg.z_loss}: its gradient rides on the per-token losses loss_fn may "
            f"reweigh; drop one of them",
        ),
    )
    for refused, why in problems:
        if refused:
            raise ValueError(f"megapar.prepare: loss_fn cannot be combined with {why}")


SCHEDULE_OPTIONS = (
    *("max_steps", "warmup_steps", "lr_decay", "min_lr"),
    *("lr_decay_steps", "lr_wsd_decay_steps", "lr_wsd_decay_fraction", "lr_wsd_decay_style"),
)
"""megapar-train's schedule flags: prepare builds a schedule only from `lr_schedule`."""

LOOP_OPTIONS = (
    *("save", "save_interval", "keep_latest_k", "load", "load_strict", "overwrite_newer"),
    "log_interval",
    *("eval_interval", "eval_steps", "log_json", "tensorboard", "wandb_project", "peak_tflops"),
    *("profile_steps", "profile_dir", "exit_signals", "exit_duration_mins", "exit_interval"),
    *("record_step", "replay", "replay_against", "world_size", "dry_run_ranks", "json", "debug"),
    "gpu_memory_gb",
)
"""TrainConfig fields only megapar-train's run and loop read (saving, loading, logging,
evaluation, stopping, the dry run), which a caller's loop replaces: the engine never reads
them."""


DATA_OPTIONS = (
    *("data", "data_cache", "jsonl_key", "sft_keys", "allow_invalid_utf8", "val_fraction"),
    "allow_data_change",
)
"""TrainConfig fields of megapar-train's data (the corpus, its cache and split), which the
caller's batches replace: the engine never reads them."""


LOSS_SCALE_OPTIONS = (
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
)
"""The fp16 loss scaler's settings (megapar-train's --loss-scale ... --hysteresis)."""


def _check_loss_scale(cfg: TrainConfig, options: dict) -> None:
    """Refuse, in the API's terms, a loss-scale setting outside precision='fp16' (nothing would
    read it) and a floor above the initial scale, as megapar-train does."""
    given = [name for name in LOSS_SCALE_OPTIONS if name in options]
    if given and cfg.precision != "fp16":
        raise ValueError(
            f"megapar.prepare: {given[0]}={options[given[0]]!r} sets the fp16 loss scale, and "
            f"precision={cfg.precision!r} has none: pass precision='fp16' or drop {given[0]}"
        )
    dynamic = [name for name in LOSS_SCALE_OPTIONS[1:] if name in options]
    if cfg.loss_scale and dynamic:
        raise ValueError(
            f"megapar.prepare: {dynamic[0]}={options[dynamic[0]]!r} sets the dynamic loss "
            f"scale, and loss_scale={cfg.loss_scale!r} is static: drop one"
        )
    if cfg.min_loss_scale > cfg.initial_loss_scale:
        raise ValueError(
            f"megapar.prepare: min_loss_scale={cfg.min_loss_scale!r} is above "
            f"initial_loss_scale={cfg.initial_loss_scale!r}: lower min_loss_scale or raise "
            f"initial_loss_scale"
        )


def _check_powersgd_rank(cfg: TrainConfig, options: dict) -> None:
    """Refuse, in the API's terms, powersgd_rank without grad_compression='powersgd' (nothing
    would read it; megapar-train refuses --powersgd-rank so, `check_unused`)."""
    if "powersgd_rank" in options and cfg.grad_compression != "powersgd":
        raise ValueError(
            f"megapar.prepare: powersgd_rank={options['powersgd_rank']!r} would be ignored: it "
            f"is PowerSGD's rank, and grad_compression={cfg.grad_compression!r}: pass "
            f"grad_compression='powersgd' or drop powersgd_rank"
        )


def _refuse_unread(options: dict) -> None:
    """Refuse, in one line with the API's way, an option the engine would not read: one of
    megapar-train's schedule flags (`SCHEDULE_OPTIONS`: the schedule comes from `lr_schedule`)
    or of its loop's (`LOOP_OPTIONS`: the caller's loop replaces it) or data's (`DATA_OPTIONS`:
    the caller's batches replace it)."""
    for name in SCHEDULE_OPTIONS:
        if name in options:
            raise ValueError(
                f"megapar.prepare: {name}={options[name]!r} is megapar-train's learning-rate "
                f"schedule, which prepare does not build from options: pass lr_schedule="
                f"{{'max_steps': ..., 'warmup_steps': ..., 'decay': ..., 'min_lr': ...}} (or "
                f"drive engine.optimizer with a torch LR scheduler)"
            )
    for name in DATA_OPTIONS:
        if name in options:
            raise ValueError(
                f"megapar.prepare: {name}={options[name]!r} is megapar-train's data, which the "
                f"engine does not read: your loop feeds engine.train_step(batch) its batches of "
                f"token ids; drop it"
            )
    for name in LOOP_OPTIONS:
        if name in options:
            raise ValueError(
                f"megapar.prepare: {name}={options[name]!r} is read only by megapar-train's "
                f"own loop, which your loop replaces: drop it (save with engine.save(dir), "
                f"resume with engine.load(dir), evaluate with engine.eval_step(batch))"
            )


def _dp_cp(cfg: TrainConfig) -> int | None:
    """dp x cp of the launched world (dp given, or what the world leaves); None where the world
    is no multiple of tp x cp x pp (refused by `_check_world`)."""
    split, world = cfg.tp * cfg.cp * cfg.pp, launched_world_size()
    if cfg.dp is None and world % split:
        return None
    return (cfg.dp if cfg.dp is not None else world // split) * cfg.cp


def _check_world(cfg: TrainConfig, experts: int | None = None) -> None:
    """Refuse a world size that is not a multiple of tp x cp x pp (when dp is not given), and
    an ep that does not divide the dp x cp it leaves, as Mesh would, in the API's terms (the
    values offered divide the model's `experts` too)."""
    split, world = cfg.tp * cfg.cp * cfg.pp, launched_world_size()
    ranks = _dp_cp(cfg)
    if not world % split and cfg.ep > 1 and ranks is not None and ranks % cfg.ep:
        said = ep_split_error(cfg.ep, ranks // cfg.cp, cfg.cp, api=True, experts=experts)
        raise LayoutError(f"megapar.prepare: {said}")
    if cfg.dp is None and world % split:  # what Mesh would refuse, in the API's terms
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun started them: it decides the count
            fix = f"start a multiple of {split} processes (torchrun --nproc-per-node x --nnodes)"
        elif "SLURM_PROCID" in os.environ:
            fix = f"start a multiple of {split} tasks (srun --ntasks)"
        else:
            fix = (
                f"call prepare on every rank inside the function "
                f"megapar.launch(fn, nprocs={split}) runs (or a multiple of {split}), "
                f"or under torchrun"
            )
        raise LayoutError(
            f"megapar.prepare: tp={cfg.tp} x cp={cfg.cp} x pp={cfg.pp} = {split} "
            f"ranks per model replica, but this job runs {world} process"
            f"{'es' if world > 1 else ''}; {fix}, or pass a smaller tp / cp / pp"
        )


def _check_schedule(cfg: TrainConfig, layers: int) -> None:
    """The schedule's model chunks at this pp, in the API's terms, before the engine is built
    (the schedule's own check ran at the first train_step, in megapar-train's flags): a
    schedule of several chunks per rank needs pp > 1, interleaved virtual_stages >= 2; a fix
    offered is one the model's `layers` hold."""
    name, v = cfg.schedule, cfg.virtual_stages
    one_stage = one_stage_chunks_error(name, v, cfg.pp, api=True, layers=layers)
    if one_stage:
        raise ValueError(f"megapar.prepare: {one_stage}")
    try:
        chunks = chunks_per_rank(name, v, api=True, layers=layers, pp=cfg.pp)
    except ValueError as exc:
        raise ValueError(f"megapar.prepare: {exc}") from None
    if name not in CHUNKED_SCHEDULES:
        return
    if cfg.pp < 2:
        raise ValueError(
            f"megapar.prepare: schedule={name!r} runs several model chunks on each of "
            f"pp > 1 stages, and pp={cfg.pp}: give pp=2 or more, or schedule='1f1b'"
        )
    if chunks < 2:
        raise ValueError(
            f"megapar.prepare: schedule={name!r} needs virtual_stages >= 2 model chunks "
            f"per rank, got virtual_stages={v}: give virtual_stages=2 (or "
            f"more), or schedule='1f1b' for one chunk per rank"
        )


def _split_keywords(said: str) -> str:
    """A refusal of the pipeline's cut in megapar-train's flags (`pipeline.partition`) in
    `prepare`'s keywords: ``--pp 4`` is ``pp=4`` (``lower --pp to 2``: ``lower pp to 2``),
    ``--decoder-last-pipeline-num-layers 2`` ``decoder_last_pipeline_num_layers=2``, a switch
    ``account_for_loss_in_pipeline_split=True``, a schedule ``schedule='1f1b'``."""

    def keyword(m: re.Match) -> str:
        name, value = m.group(1).replace("-", "_"), m.group(2)
        if value is not None:
            return f"{name}={value}"
        return f"{name}=True" if name.startswith("account_for_") else name

    said = said.replace("(--schedule 1f1b or zb-h1)", "(schedule='1f1b' or 'zb-h1')")
    said = said.replace("(1f1b, zb-h1)", "(schedule='1f1b' or 'zb-h1')")
    said = said.replace("drop the flags", "drop them").replace("drop the flag", "drop it")
    flags = "pp|virtual-stages|decoder-(?:first|last)-pipeline-num-layers|account-for-[a-z-]+"
    return re.sub(rf"--({flags})(?: (-?\d+)\b)?", keyword, said)


def _check_model_layout(config, cfg: TrainConfig) -> None:
    """Refuse a tp / pp the model cannot take (heads tp does not divide, fewer layers than
    stages), as megapar-train does, in the API's terms: `tp=2`, not `--tp 2`."""
    split = cfg.pipeline_split
    try:
        split.check(cfg.pp)
        chunks = chunks_per_rank(cfg.schedule, cfg.virtual_stages)
        if chunks > 1:  # zb-v at pp 3 on 4 layers: here, not in the engine's build; before
            # the model's own stage count, so that the schedule's line names the pp it takes
            chunk_specs(config.num_layers, cfg.pp, 0, chunks, placement_of(cfg.schedule), split)
        else:
            partition_layers(config.num_layers, cfg.pp, split)
    except LayoutError as exc:  # named by megapar-train's flags: said as prepare's keywords
        raise LayoutError(f"megapar.prepare: {_split_keywords(str(exc))}") from None
    try:
        config.validate(Layout(cfg.tp, cfg.pp, 1, cp=cfg.cp), api=True)
    except LayoutError as exc:
        raise LayoutError(f"megapar.prepare: {exc}") from None
    etp = cfg.expert_tensor_parallel_size
    size = getattr(config, "expert_size", None) if hasattr(config, "num_local_experts") else None
    # a dense model's refusal says it has no experts, whatever tp (was "the tp size tp=1")
    error = None if size is None else expert_tp_error(etp, cfg.tp, api=True)
    if error is None and etp > 1 and (size is None or size % etp):
        what = "has no experts" if size is None else f"has an expert intermediate size of {size}"
        error = (
            f"expert_tensor_parallel_size={etp} splits each routed expert over tp, and this "
            f"{config.model_type} model {what}: use expert_tensor_parallel_size=1"
        )
    error = error or ep_model_error(config, cfg.ep, api=True, ranks=_dp_cp(cfg))
    if error:
        raise LayoutError(f"megapar.prepare: {error}")
    check_fp8_layout(cfg, config, cfg.tp, keyword="megapar.prepare")  # Fp8Error
    try:
        check_cp_comm(cfg.cp_comm_type, Layout(cfg.tp, cfg.pp, 1, cp=cfg.cp), config, api=True)
        check_documents(cfg, config, api=True)
    except UsageError as exc:
        raise LayoutError(f"megapar.prepare: {exc}") from None


def _lr_scheduler(lr_schedule, cfg: TrainConfig):
    """prepare's `lr_schedule` as the engine takes it: None, or a megapar `LRScheduler` (a dict
    of its fields is built into one, from the scaled lr); anything else is refused."""
    if isinstance(lr_schedule, dict):
        known = {"min_lr", "warmup_steps", "max_steps", "decay", "decay_steps", "wsd_style"}
        unknown = sorted(set(lr_schedule) - known)
        if unknown or "max_steps" not in lr_schedule:
            what = f"unknown keys {unknown}" if unknown else "no 'max_steps'"
            raise ValueError(
                f"megapar.prepare: lr_schedule has {what}; its keys are max_steps (needed), "
                f"warmup_steps, decay, min_lr (the peak is lr), and with decay 'wsd' "
                f"decay_steps and wsd_style"
            )
        if lr_schedule.get("decay") == "wsd" and "decay_steps" not in lr_schedule:
            raise ValueError(
                "megapar.prepare: lr_schedule decay 'wsd' needs decay_steps (the steps of its "
                "final decay, which ends at max_steps); wsd_style is linear unless given"
            )
        fields = {"min_lr": 0.0, "warmup_steps": 0, "decay": "cosine", **lr_schedule}
        try:
            lr_schedule = LRScheduler(Engine.scaled_lr(cfg), **fields)
        except ValueError as exc:
            raise ValueError(f"megapar.prepare: lr_schedule {lr_schedule}: {exc}") from None
    elif lr_schedule is not None and not isinstance(lr_schedule, LRScheduler):
        raise TypeError(
            "lr_schedule must be None, a dict of LRScheduler fields or an "
            "LRScheduler; for any other schedule use a torch LR scheduler on "
            "engine.optimizer"
        )
    return lr_schedule


def _load_checkpoint_weights(engine: Engine, step_dir: Path) -> None:
    """A megapar checkpoint's weights (resharded to this layout) and provenance (tokenizer,
    Hugging Face dtype and generation config) into the engine; its optimizer state, step, RNG
    and schedule stay as `prepare` made them (`engine.load` restores those)."""
    set_action(f"megapar.prepare: loading the weights of {step_dir}")
    with engine.params_whole():
        meta = load_checkpoint(step_dir, engine.model, engine.mesh).meta
    engine.tokenizer = meta.get("tokenizer")
    engine.source_dtype = meta.get("hf_dtype")
    engine.source_generation_config = meta.get("hf_generation_config")
    engine.source_dir = meta.get("hf_source_dir")


def _warn_no_float8(engine: Engine, cfg: TrainConfig) -> None:
    """Warn (rank 0) when fp8 converts none of the stage's linears (a small model under
    fp8_layers='auto', dims not multiples of 16): the API prints no line of its own, so this
    says fp8 is on in name only. `engine.fp8_summary` has the line either way."""
    summary = engine.fp8_summary
    if summary is None or ": 0 linears in float8" not in summary or engine.mesh.rank != 0:
        return
    tp = engine.mesh.tp
    all_problem = fp8_layout_problem(engine.config, tp, cfg.fp8, "all")
    hint = (
        f"; {all_layers_hint(all_problem, tp, api=True)}"
        if none_kept_by_size(summary, cfg.fp8_layers)
        else ""
    )
    warnings.warn(
        f"megapar.prepare: fp8={cfg.fp8!r} runs none of this model's linears in float8 "
        f"({summary}){hint}",
        stacklevel=3,
    )


def _warn_model_settings(model, what: str, dtype: str, cfg: TrainConfig) -> None:
    """Warn of what a transformers model was set to do that the engine's own model does not
    take from it: its gradient checkpointing (`recompute`) and 16-bit weights (the engine keeps
    fp32 ones and computes in `precision`)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers 5.2x
    if checkpointing is None:  # its older name (deprecated there)
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing and cfg.recompute == "none":
        warnings.warn(
            f"megapar.prepare: the {what}'s gradient checkpointing is not read (the engine "
            f"trains its own model): pass recompute='full' (or 'selective')",
            stacklevel=4,
        )
    if dtype in ("bfloat16", "float16") and cfg.precision == "fp32":
        half = "bf16" if dtype == "bfloat16" else "fp16"
        warnings.warn(
            f"megapar.prepare: the {what}'s weights are {dtype}: the engine keeps them in "
            f"fp32 and computes in fp32; pass precision={half!r} for {dtype} autocast "
            f"(export_hf writes {dtype} back either way)",
            stacklevel=4,
        )


def _load_model_weights(engine: Engine, model, reader, seed: int) -> None:
    """Load the transformers model's weights (`reader`) into the engine's stage, after checking
    every rank holds the same; warn (rank 0, at prepare's caller) of a head initialised from
    `seed` because the model lacks it."""
    from_dir = isinstance(model, (str, os.PathLike))  # every rank reads the same files
    what = f"transformers directory {model}" if from_dir else type(model).__name__
    set_action(f"megapar.prepare: loading the {what}'s weights")
    engine.source_dtype = reader.dtype  # export_hf writes the model's own dtype back
    engine.source_generation_config = reader.generation_config  # and its generation_config
    engine.source_dir = str(reader.path.resolve())  # export_hf never writes there

    if not from_dir:
        _check_same_weights(model, engine.mesh)
        if engine.mesh.rank == 0:
            _warn_model_settings(model, what, reader.dtype, engine.cfg)
    # the directory, or from_pretrained(DIR)'s DIR
    source = (
        os.path.expanduser(os.fspath(model)) if from_dir else getattr(model, "name_or_path", "")
    )
    own = hf_dir_tokenizer(source) if source and os.path.isdir(source) else None
    if own is not None:  # its tokenizer, as megapar-train --from-hf DIR takes it: export_hf
        fix = (
            ": it is not the model's; save the model's tokenizer there (save_pretrained), or "
            "remove the tokenizer's files from it"
        )
        _check_fits(
            load_tokenizer(own), engine.config, f"the tokenizer in {own}", "its model's", fix
        )
        engine.tokenizer = recorded_tokenizer(own)  # and checkpoints carry it
    with engine.params_whole():
        missing = load_hf_weights(engine.model, reader)
    if missing and engine.mesh.rank == 0:
        names = [n for m in missing for n in hf_parameter_names(engine.config, m)]  # theirs
        warnings.warn(
            f"megapar.prepare: the {what} has no {', '.join(names)}"
            f"; initialised from seed {seed} (pass the model with its head to keep "
            f"trained ones)",
            stacklevel=3,
        )
