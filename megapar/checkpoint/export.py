"""Export of a checkpoint as a transformers directory: the weights in the dtype asked for,
the tokenizer it trained with (checked to be that one), the generation config (`save_hf`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from megapar.checkpoint.convert import check_output, model_tensors
from megapar.checkpoint.format import CheckpointError, ShardReader
from megapar.checkpoint.hf import (
    ARCHITECTURES,
    GENERATION_FILE,
    HF_FILES,
    model_rows,
    other_weights,
    recover_stopped_export,
    save_hf,
)
from megapar.checkpoint.hf_names import DEEPSEEK_ROUTER_TYPES
from megapar.checkpoint.manifest import read_manifest, verify
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.data.assets import moved_asset
from megapar.data.preprocess import file_sha256
from megapar.data.tokenizers import load_tokenizer, tokenizer_files
from megapar.models.config import config_from_dict
from megapar.wording import and_list

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes an export can write its weights in."""
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The short names (--precision's) an export's dtype may also be given by."""


def export_dtype(name: str) -> str:
    """An export dtype's full name: a short name (bf16, fp16, fp32) is its alias."""
    return DTYPE_ALIASES.get(name, name)


def option(name: str, value: str | None, api: bool) -> str:
    """An option as its caller gives it: megapar-convert's flag (``--tokenizer SPEC``,
    ``--allow-other-tokenizer``), or with `api` Engine.export_hf's keyword (``tokenizer=SPEC``,
    ``allow_other_tokenizer=True``)."""
    if api:
        return f"{name}={value if value is not None else True}"
    flag = "--" + name.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def export_hf(
    src,
    hf_dir,
    overwrite: bool = False,
    tokenizer=None,
    dtype: str | None = None,
    allow_other_tokenizer: bool = False,
    tokenizer_rows: bool = False,
    api: bool = False,
) -> Path:
    """A transformers directory (the model's class in `hf_names.ARCHITECTURES`: GPT2LMHeadModel,
    BertForMaskedLM, LlamaForCausalLM, MixtralForCausalLM, ...) from a checkpoint, with the
    tokenizer it trained with (`export_tokenizer`: `tokenizer`, a `load_tokenizer` spec, names
    where it is now; another tokenizer than the recorded one only
    with `allow_other_tokenizer`), in `dtype` (default: the dtype of the Hugging Face model it
    came from, recorded on import, else float32); a causal LM with the generation config of
    the model it was imported from, else one made from its config (`save_hf`); with
    `tokenizer_rows`, a causal LM's vocabulary cut to its tokenizer's ids (`cut_to_tokenizer`).
    Errors name the options as megapar-convert's flags, or with `api` as `Engine.export_hf`'s
    keywords (`option`)."""

    step_dir = resolve_checkpoint(src)
    hf_dir = Path(hf_dir)
    note = recover_stopped_export(hf_dir)
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    existing = [n for n in (*HF_FILES, GENERATION_FILE) if (hf_dir / n).exists()]
    existing += other_weights(hf_dir)
    if not overwrite and existing:
        shown = ", ".join(existing[:3])
        shown = f"{len(existing)} files: {shown}, ..." if existing[3:] else shown
        flag = option("overwrite", None, api)
        if _started_from(step_dir, hf_dir):  # the only copy of the weights it started from
            raise CheckpointError(
                f"{hf_dir} is the transformers model this checkpoint started from ({shown}); "
                f"export to another directory ({flag} would replace its weights with the "
                f"trained ones)"
            )
        raise CheckpointError(
            f"{hf_dir} already holds an exported model ({shown})"
            f"; pass {flag} to replace those files (other files there "
            f"are kept)"
        )
    if dtype is not None and export_dtype(dtype) not in EXPORT_DTYPES:
        given = option("dtype", repr(dtype) if api else dtype, api)
        raise CheckpointError(
            f"{given} is not one of {', '.join(EXPORT_DTYPES)} (or {', '.join(DTYPE_ALIASES)})"
        )
    dtype = None if dtype is None else export_dtype(dtype)
    check_output(hf_dir, into=True)
    manifest = verify(step_dir)
    model_tensors(step_dir, manifest)
    config = config_from_dict(manifest["model"])
    _refuse_unrepresentable(config)
    tok = export_tokenizer(manifest, config, tokenizer, allow_other_tokenizer, api)
    reader = ShardReader(step_dir, manifest)
    canonical = {}
    for name, e in manifest["tensors"].items():
        if e.get("buffer") and config.model_type in DEEPSEEK_ROUTER_TYPES:
            canonical[name] = reader.shard(name, None, 1, 0, None)  # e_score_correction_bias
            continue
        if e.get("buffer"):  # the balancing bias: transformers' Mixtral / Qwen3-MoE have none
            if reader.shard(name, None, 1, 0, None).any():
                reader.release()
                rate = option("moe_bias_update_rate", "0", api)
                raise CheckpointError(
                    f"{name} is not zero (auxiliary-loss-free balancing, "
                    f"moe_bias_update_rate): transformers' {ARCHITECTURES[config.model_type]} "
                    f"routes without such a bias, so the export would not be this model; "
                    f"evaluate it with megapar-eval, or train with {rate} to export"
                )
            continue
        dim = e["tp_dim"]
        canonical[name] = reader.shard(
            name, None, 1, 0, None if dim is None else e["full_shape"][dim]
        )
    reader.release()
    dtype = dtype or manifest["meta"].get("hf_dtype") or "float32"
    return save_hf(
        canonical,
        config,
        hf_dir,
        tok,
        getattr(torch, dtype),
        generation_config=manifest["meta"].get("hf_generation_config"),
        tokenizer_rows=tokenizer_rows,
    )


def _started_from(step_dir, hf_dir) -> bool:
    """Whether `hf_dir` is the transformers directory the checkpoint at `step_dir` was imported
    from (megapar-convert --from-hf: meta ``imported_from_hf``) or trained from (megapar-train
    --from-hf, `megapar.prepare(DIR)`: ``hf_source_dir``)."""
    try:
        meta = read_manifest(step_dir).get("meta", {})
    except (CheckpointError, OSError, ValueError):
        return False
    here = Path(hf_dir).resolve()
    sources = (meta.get("imported_from_hf"), meta.get("hf_source_dir"))
    return any(s and Path(s).resolve() == here for s in sources)


def _refuse_unrepresentable(config) -> None:
    """Raise `CheckpointError` when `config` has a part its transformers class lacks (a MoE's
    sigmoid router or shared experts: DeepSeek-style, megapar's own fields), which an export
    would leave out or write as weights transformers ignores, giving another model."""
    parts: list[str] = []
    if config.model_type in DEEPSEEK_ROUTER_TYPES:  # its transformers class has them all
        return
    if getattr(config, "moe_router_score", "softmax") != "softmax":
        parts.append(f"moe_router_score {config.moe_router_score!r}")
    if getattr(config, "shared_expert_intermediate_size", None):
        parts.append(
            f"shared experts (shared_expert_intermediate_size "
            f"{config.shared_expert_intermediate_size})"
        )
    if parts:
        raise CheckpointError(
            f"this {config.model_type} model has {and_list(parts)}, which transformers' "
            f"{ARCHITECTURES[config.model_type]} does not have, so the export would not be this "
            f"model; evaluate it with megapar-eval, or train a model without them to export"
        )


GPT2_BPE_IDS = 50257
"""The ids of GPT-2's BPE, the ``"gpt2"`` tokenizer megapar ships."""


def tokenizer_hint(config, api: bool) -> str:
    """How to give an export of `config`'s model the tokenizer it lacks, fitting that model:
    the tokenizer its data was tokenized with, as the kinds of `load_tokenizer` spec a model of
    its type comes with (for a Llama or BERT, a transformers directory holding it, wherever
    the model came from: Hugging Face, Megatron-LM, torchtitan or megapar's own training);
    ``"gpt2"`` (GPT-2's BPE) only for a GPT-2 whose vocabulary holds its 50,257 ids. In
    megapar-convert's terms, or with `api` in `Engine.export_hf`'s (`option`)."""
    spec = option("tokenizer", "SPEC", api)
    arch = ARCHITECTURES.get(config.model_type, "Hugging Face model")
    files = "tokenizer.json or vocab.json + merges.txt" if config.model_type == "gpt2" else ""
    kinds = f"a transformers directory with its {files or 'tokenizer.json'} (a {arch}'s)"
    if config.model_type in ("llama", "mixtral", "mistral"):  # SentencePiece's, no .json
        kinds += ", or its tokenizer.model file"
    if config.model_type == "gpt2" and config.vocab_size >= GPT2_BPE_IDS:
        gpt2 = option("tokenizer", "'gpt2'" if api else "gpt2", api)
        return f"pass {gpt2} if it trained on GPT-2's BPE, else {spec}: {kinds}"
    return f"pass {spec}, the tokenizer it trained with: {kinds}"


def _described(spec: dict) -> str:
    """A recorded tokenizer in a few words: its path and the start of its files' sha256."""
    digests = ",".join(d[:12] for d in spec.get("sha256", []))
    return f"{spec.get('path')} (sha256 {digests})" if digests else str(spec.get("path"))


def export_tokenizer(
    manifest: dict,
    config,
    given: str | dict | None = None,
    allow_other: bool = False,
    api: bool = False,
):
    """The megapar Tokenizer an export carries: `given` (a spec), else the one the checkpoint
    records (meta ``tokenizer``: what megapar-train's data was tokenized with, or the
    transformers directory it was imported from); None when it records none. A recorded
    tokenizer that cannot be loaded, or whose files changed since, is an error naming the fix
    (the export must not carry a tokenizer the model did not train with); so is a `given` one
    whose files are not the recorded ones (the same files elsewhere are fine), unless
    `allow_other` (errors in `api`'s terms, as `export_hf`'s)."""

    spec = given or manifest["meta"].get("tokenizer")
    if not spec:
        return None
    what = (
        option("tokenizer", repr(given) if api else str(given), api)
        if given
        else f"the checkpoint's tokenizer {spec.get('path') if isinstance(spec, dict) else spec}"
    )
    spec_option = option("tokenizer", "SPEC", api)
    path = spec.get("path") if isinstance(spec, dict) else spec
    assert path is not None  # a recorded tokenizer names its path
    try:
        if (
            path not in ("gpt2", "sentencepiece")
            and not os.path.exists(path)
            and not moved_asset(path)
        ):
            raise FileNotFoundError("no such file or directory: moved or deleted?")
        tok = load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{what} cannot be loaded ({exc}); pass {spec_option} (the "
            f"tokenizer it trained with, wherever it is now)"
        ) from None
    if not given and isinstance(spec, dict) and spec.get("sha256"):
        if [file_sha256(p) for p in tokenizer_files(tok)] != spec["sha256"]:
            raise CheckpointError(
                f"{what} has changed since the checkpoint was trained (its "
                f"files' sha256 differ); pass {spec_option} naming the "
                f"tokenizer it trained with"
            )
    recorded = manifest["meta"].get("tokenizer")
    if given and not allow_other and isinstance(recorded, dict) and recorded.get("sha256"):
        digests = [file_sha256(p) for p in tokenizer_files(tok)]
        if digests != recorded["sha256"]:
            raise CheckpointError(
                f"{what} is not the tokenizer the {'engine' if api else 'checkpoint'} records, "
                f"{_described(recorded)}: its files differ (sha256 "
                f"{','.join(d[:12] for d in digests)}); pass that tokenizer (wherever it is "
                f"now), or add {option('allow_other_tokenizer', None, api)} to export "
                f"another one on purpose"
            )
    # a causal LM sees only the base vocabulary and the end of document (the appended
    # [PAD] [CLS] [SEP] [MASK] are BERT's), as megapar-train counts it
    needed = model_rows(tok, config.model_type)
    if needed > config.vocab_size:
        raise CheckpointError(
            f"{what} has {needed:,} token ids, more than the model's "
            f"vocabulary of {config.vocab_size:,}; pass the tokenizer it "
            f"trained with ({spec_option})"
        )
    return tok
