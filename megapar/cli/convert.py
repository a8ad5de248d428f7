"""``megapar-convert``: rewrite a checkpoint for another layout; Hugging Face import/export; info.

Examples:

    megapar-convert ckpt/ ckpt_tp4/ --tp 4 --pp 1            # any layout -> tp 4, pp 1
    megapar-convert --from-hf gpt2-dir/ ckpt/ --tp 2 --pp 2  # transformers -> megapar (step 0)
    megapar-convert ckpt/ --to-hf exported/                  # megapar -> transformers
                                                             # (weights, config, tokenizer)
    megapar-convert --info ckpt/                             # layout, step, model, sizes
                                                             # (files verified; --fast: sizes)
    megapar-convert --from-dcp titan/checkpoint/step-1000 ckpt/ --job-config llama3_8b.toml
                                                             # torchtitan (DCP) -> megapar
    megapar-convert ckpt/ --to-dcp titan_step/               # megapar -> torchtitan (DCP)
    megapar-convert --from-megatron megatron_ckpt/ ckpt/ --model gpt.json
                                                             # Megatron torch_dist -> megapar

SRC may be a checkpoint root (its ``latest`` is followed) or a step directory; DST is a new
checkpoint root. Sources are verified (sizes and sha256) first. Outputs are built in a hidden
temporary directory and renamed at the end: on any error DST is left as it was. An empty DST
directory is taken; any other existing DST is refused unless --overwrite, which replaces only a
checkpoint, and the --save root of a live run always. A target --tp or
--pp not given keeps the source's (1 with --from-hf). --to-hf DIR writes config.json +
model.safetensors and the tokenizer the checkpoint trained with (tokenizer.json +
tokenizer_config.json, checked to encode as megapar does, truncating at the model's positions;
--tokenizer to say where it is now, --allow-other-tokenizer to export another on purpose) into DIR
as transformers' save_pretrained does, the config's special token ids the tokenizer's, in the dtype
of the Hugging Face model it came from (else float32; --dtype to choose); a GPT-2 or Llama gets a
generation_config.json too (the one of the model it was imported from, else one made from its
config); other files there are kept, an earlier export (or another save's weights: shards and
index, pytorch_model.bin) is replaced only with --overwrite.
--from-dcp / --to-dcp move a Llama's weights between megapar and torchtitan's DCP checkpoints
(torchtitan's names; wq and wk in its rotary layout); the model is the one --job-config's
[model] flavor names (torchtitan's job config TOML) or --model SPEC; optimizer state does not
move (docs/guides/checkpoints.md says why). --from-megatron imports the weights of a Megatron-core
torch_dist GPT checkpoint (a root with latest_checkpointed_iteration.txt, or one iter_NNNNNNN
directory) as megapar's GPT-2 (learned positions), Llama (RoPE, SwiGLU) or Mixtral (its MoE
layers); the model is the training args its common.pt records (read without unpickling) or
--model SPEC.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from megapar.cli.closed_stdout import quiet_when_stdout_closes
from megapar.cli.entry import ENDED_WORDS, exit_while_starting
from megapar.disk import DISK_ERRORS
from megapar.faults.processes import exit_uncollected
from megapar.one_line_parser import (
    SHARDING_NAMES,
    OneLineParser,
    layout_names,
    shell_word,
    show_progress,
)
from megapar.wording import and_list

_NOT_IN_FILES = (
    "a checkpoint does not depend on {flag} ({what}): megapar-train --load reads it at any "
    "{flag}; drop it"
)

OTHER_FLAGS = {
    # it takes its paths as positional words: megapar-convert SRC DST [--tp N ...]
    "--input": "SRC, its first positional path (megapar-convert SRC DST)",
    "--output": "DST, its second positional path (megapar-convert SRC DST)",
    "--out": "DST, its second positional path (megapar-convert SRC DST)",
    "--hf": "--from-hf DIR (a transformers model in) or --to-hf DIR (out)",
    "--target-tensor-parallel-size": "--tp",
    "--target-pipeline-parallel-size": "--pp",
    **layout_names("--tp", "--pp", "--dp"),
    "--load-dir": "the source is the first PATH: megapar-convert SRC DST (a Megatron-LM "
    "checkpoint: megapar-convert --from-megatron DIR DST)",
    # Megatron-LM's tools/checkpoint/convert.py: difflib named --model, --seed,
    # --from-megatron (for the path to Megatron's code), --tokenizer-rows, or nothing
    "--loader": "megapar-convert --from-megatron DIR DST reads Megatron-LM's torch_dist "
    "checkpoints (megatron-core's); drop it",
    "--saver": "--to-hf HF_DIR (a transformers model; megapar's own checkpoint is DST), or "
    "--to-dcp",
    "--megatron-path": "megapar-convert reads Megatron-LM's checkpoints without its code; drop it",
    "--tokenizer-model": "--tokenizer (the tokenizer --to-hf exports)",
    "--bf16": "--dtype bfloat16",
    "--fp16": "--dtype float16",
    **dict.fromkeys(
        ("--true-vocab-size", "--make-vocab-size-divisible-by"),
        "the vocabulary is the checkpoint's own (--tokenizer-rows exports only the tokenizer's "
        "rows with --to-hf)",
    ),
    "--checkpoint-type": "the format is read from the source (a megapar checkpoint, or "
    "--from-hf, --from-dcp, --from-megatron); drop it",
    "--position-embedding-type": "the model is the source's own (--model for --from-megatron "
    "and --from-dcp); drop it",
    "--save-dir": "the destination is the second PATH: megapar-convert SRC DST",
    "--model-type": "the model is the source's own; drop it",
    "--load": "the source is the first PATH: megapar-convert SRC DST",
    "--save": "the destination is the second PATH: megapar-convert SRC DST",
    "--ep": _NOT_IN_FILES.format(flag="--ep", what="every expert is saved whole"),
    "--target-expert-parallel-size": _NOT_IN_FILES.format(
        flag="--ep", what="every expert is saved whole"
    ),
    "--expert-tensor-parallel-size": _NOT_IN_FILES.format(
        flag="--expert-tensor-parallel-size", what="every expert is saved whole"
    ),
    "--zero": _NOT_IN_FILES.format(flag="--zero", what="the optimizer state is saved whole"),
    **dict.fromkeys(
        SHARDING_NAMES,
        _NOT_IN_FILES.format(flag="--zero", what="the optimizer state is saved whole"),
    ),
    "--cp": _NOT_IN_FILES.format(flag="--cp", what="context parallelism splits no weight"),
    "--target-context-parallel-size": _NOT_IN_FILES.format(
        flag="--cp", what="context parallelism splits no weight"
    ),
    "--virtual-stages": _NOT_IN_FILES.format(
        flag="--virtual-stages", what="its layers are saved by their number, not their chunk"
    ),
    "--schedule": _NOT_IN_FILES.format(flag="--schedule", what="a schedule holds no weight"),
    "--to-megatron": "megapar-convert reads Megatron-LM's checkpoints (--from-megatron) but "
    "writes none: give --to-hf (which Megatron's own converters import) or --to-dcp",
}
"""Megatron-LM's checkpoint converter's flags, answered with megapar-convert's way (difflib
named `--model`, a --from-dcp option, for `--model-type`), and megapar-train's layout flags no
checkpoint depends on (difflib named `--tp` for `--ep` and `--cp`)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``megapar-convert`` argument parser."""
    p = OneLineParser(
        prog="megapar-convert",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        known_as=OTHER_FLAGS,
    )
    add_layout_arguments(p)
    add_mode_arguments(p)
    add_export_arguments(p)
    add_info_arguments(p)
    add_run_arguments(p)
    return p


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """The paths and the target layout: PATH..., --tp, --pp, --dp."""
    # every path takes a leading ~ (quoted) as the home directory, as a shell would: DST '~/x'
    # was written to a directory named ~ here
    p.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        type=os.path.expanduser,
        help="SRC DST, DST (--from-hf) or SRC (--to-hf)",
    )
    p.add_argument(
        "--tp",
        type=int,
        help="target tensor-parallel size (default: the source's; 1 with --from-hf)",
    )
    p.add_argument(
        "--pp",
        type=int,
        help="target pipeline-parallel size (default: the source's; 1 with --from-hf)",
    )
    p.add_argument(
        "--dp",
        type=int,
        help="target data-parallel size: recorded, and the ranks' RNG states are kept only in "
        "the source's own tp, pp and dp (shards never depend on dp) (default: the source's; 1 "
        "with --from-hf)",
    )


def add_mode_arguments(p: argparse.ArgumentParser) -> None:
    """The conversion modes: --from-hf, --to-hf, --from-dcp, --to-dcp and the DCP model."""
    path = os.path.expanduser  # a leading ~ (quoted) is the home directory, as a shell's
    p.add_argument("--from-hf", metavar="HF_DIR", type=path, help="import a transformers directory")
    p.add_argument(
        "--to-hf", metavar="HF_DIR", type=path, help="export SRC as a transformers directory"
    )
    p.add_argument(
        "--from-dcp",
        metavar="DCP_DIR",
        type=path,
        help="import a torchtitan Llama checkpoint (a DCP step directory: "
        ".metadata + *.distcp); needs --job-config or --model",
    )
    p.add_argument(
        "--to-dcp",
        metavar="DCP_DIR",
        type=path,
        help="export SRC's Llama weights as a DCP checkpoint in torchtitan's names",
    )
    p.add_argument(
        "--from-megatron",
        metavar="MEGATRON_DIR",
        type=path,
        help="import a Megatron-core torch_dist GPT checkpoint (its root or one "
        "iter_NNNNNNN directory); the model from its recorded args, or --model",
    )
    p.add_argument(
        "--job-config",
        metavar="TOML",
        type=path,
        help="--from-dcp: torchtitan's job config; its [model] flavor (debugmodel, "
        "8B, 70B, 405B) and [training] seq_len give the model",
    )
    p.add_argument(
        "--model",
        metavar="SPEC",
        help="--from-dcp, --from-megatron: the model as a megapar recipe name or config "
        "file (with --from-dcp, instead of --job-config)",
    )


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """--to-hf's options: the tokenizer to export, its rows, the weights' dtype."""
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help="--to-hf: the tokenizer to export ('gpt2', 'sentencepiece', a .model "
        "file, a vocab.json + merges.txt or tokenizer.json directory); default: "
        "the one the checkpoint records (files that differ from those it records "
        "are refused unless --allow-other-tokenizer)",
    )
    p.add_argument(
        "--allow-other-tokenizer",
        action="store_true",
        help="--to-hf: export --tokenizer even though it is not the tokenizer the "
        "checkpoint trained with",
    )
    p.add_argument(
        "--tokenizer-rows",
        action="store_true",
        help="--to-hf of a GPT-2 or Llama: export only the rows of the tokenizer's ids "
        "(the GPT-2 BPE's 50,257, as Hugging Face's GPT-2), not the [PAD] [CLS] "
        "[SEP] [MASK] megapar appends; logits on those ids are unchanged, "
        "probabilities shift slightly (the model's softmax spanned every row)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        type=_dtype,
        help="--to-hf: the dtype of the exported weights, or its short name bf16, "
        "fp16, fp32 (default: the dtype of the Hugging Face model the "
        "checkpoint came from, else float32)",
    )


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    """--info and what it lists and checks: --tensors, --fast."""
    p.add_argument(
        "--info",
        metavar="CKPT",
        type=os.path.expanduser,
        help="print a summary of a checkpoint",
    )
    p.add_argument("--tensors", action="store_true", help="with --info: list every tensor")
    p.add_argument(
        "--fast", action="store_true", help="with --info: check file sizes only, not their sha256"
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options of every write: --seed (--from-hf), --overwrite, --no-progress."""
    p.add_argument(
        "--seed",
        type=int,
        help="--from-hf: seed for tensors the HF model lacks (plain BertModel's head) (default: 0)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress bar (shown only when stderr is a terminal)",
    )


def _dtype(name: str) -> str:
    """--dtype's value: a short name (bf16, fp16, fp32, as --precision takes) is its alias; a
    bad value is refused naming both kinds of name (argparse's choices name only the long)."""
    from megapar.checkpoint.export import DTYPE_ALIASES, EXPORT_DTYPES, export_dtype

    if export_dtype(name) not in EXPORT_DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {name!r} (choose from {', '.join(EXPORT_DTYPES)}, or their short "
            f"names {', '.join(DTYPE_ALIASES)})"
        )
    return export_dtype(name)


def _need(args, n: int, usage: str) -> list[str]:
    if len(args.paths) != n:
        raise ValueError(f"expected {usage}, got {len(args.paths)} path(s): {args.paths}")
    return args.paths


def _fill_layout(args, source: dict) -> None:
    """A target size not given keeps the source's (`source`: {"tp": .., "pp": .., "dp": ..})."""
    for name in ("tp", "pp", "dp"):
        if getattr(args, name) is None:
            setattr(args, name, int(source.get(name, 1)))
        elif getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)}: a parallel size is at least 1")


def run(args) -> str:
    """Do what the arguments ask; returns the report to print. A file of the checkpoint read
    that fails its check is named with its checkpoint and the newest other step of it whose
    files are whole (`load_refusal`, as megapar-train --load says it)."""
    from megapar.checkpoint.format import LATEST, MANIFEST, CheckpointError, CheckpointFileError
    from megapar.checkpoint.manifest import verify
    from megapar.training.validate_resume import load_refusal

    progress = show_progress(False if args.no_progress else None)
    _check_modes(args)
    imported = args.from_hf or args.from_dcp or args.from_megatron
    source = args.info or (None if imported or not args.paths else args.paths[0])
    here = Path(os.path.expanduser(source)) if source else None
    if source and here and ((here / MANIFEST).is_file() or (here / LATEST).is_file()):
        try:  # its manifest, its latest step and its files' sizes (the checksums: below)
            verify(here, checksums=False)
        except (CheckpointError, KeyError, OSError) as exc:
            raise load_refusal(source, exc, what="") from None
    try:
        return _run(args, progress)
    except CheckpointFileError as exc:  # the step named, and another step of it to use
        if source is None:
            raise
        raise load_refusal(source, exc, what="") from None


def _run(args, progress) -> str:
    from megapar.checkpoint import convert as cv
    from megapar.checkpoint.manifest import read_manifest
    from megapar.mesh import Layout

    if args.overwrite:  # without it an existing output is refused anyway
        _refuse_onto_source(args)
    if args.from_dcp or args.to_dcp:
        return _dcp(args, progress)
    if args.from_megatron:
        return _from_megatron(args, progress)
    if args.info:
        _need(args, 0, "no positional path with --info CKPT")
        _check_export_flags(args)  # --to-hf's options: refused, not ignored
        return cv.checkpoint_info(args.info, tensors=args.tensors, checksums=not args.fast)
    _check_export_flags(args)
    if args.to_hf:
        return _to_hf(args)
    if args.from_hf:
        return _from_hf(args, progress)
    src, dst = _need(args, 2, "SRC DST [--tp N] [--pp M]")
    given = (args.tp, args.pp, args.dp)
    _fill_layout(args, read_manifest(src)["layout"] if None in given else {})
    path = cv.convert_checkpoint(
        src, dst, args.tp, args.pp, args.dp, overwrite=args.overwrite, progress=progress
    )
    return f"wrote {path} ({Layout(**read_manifest(path)['layout'])})"  # a copy's cp, ep too


def _refuse_onto_source(args) -> None:
    """Refuse an import or export whose output would replace its own source (DST the source
    directory or one holding it): with --overwrite it deleted the source model. A conversion
    between megapar layouts checks the same (`convert_checkpoint`)."""
    first = args.paths[0] if args.paths else None
    imported = args.from_hf or args.from_dcp or args.from_megatron
    exported = args.to_hf or args.to_dcp
    source, output = (imported, first) if imported else (first, exported)
    if source is None or output is None:
        return
    src = Path(os.path.expanduser(source)).resolve()
    dst = Path(os.path.expanduser(output)).resolve()
    if dst == src or dst in src.parents:
        where = "is the source" if dst == src else f"holds the source {source}"
        raise ValueError(
            f"{output} {where}: writing there would delete the source; give another output "
            f"directory"
        )


def _check_modes(args) -> None:
    """Refuse an empty mode path, two modes at once, and the DCP model without --from-dcp."""
    modes = ("from_hf", "to_hf", "info", "from_dcp", "to_dcp", "from_megatron")
    for flag in modes:
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise ValueError(
                f"--{flag.replace('_', '-')} {value!r} is an empty path: give a directory"
            )
    importing = args.from_hf or args.from_dcp or args.from_megatron  # its one path: DST
    names = ("DST",) if importing and len(args.paths) == 1 else ("SRC", "DST")
    for name, path in zip(names, args.paths):  # an unset $DST, $SRC
        if not path.strip():
            raise ValueError(f"{name} {path!r} is an empty path: give a directory")
    if sum(getattr(args, flag) is not None for flag in modes) > 1:
        raise ValueError(
            "--from-hf, --to-hf, --from-dcp, --to-dcp, --from-megatron and --info are "
            "separate modes; give one"
        )
    if args.job_config and args.from_megatron:
        raise ValueError(
            "--job-config is torchtitan's (--from-dcp); a Megatron checkpoint's model is "
            "--model SPEC: drop --job-config"
        )
    if (args.job_config or args.model) and not (args.from_dcp or args.from_megatron):
        given = " and ".join(
            f for f, v in (("--job-config", args.job_config), ("--model", args.model)) if v
        )
        source = (
            "the model is the transformers directory's config.json"
            if args.from_hf
            else "the model is the checkpoint's"
        )
        one = " and " not in given
        readers = (
            "a torchtitan checkpoint (--from-dcp)"
            if args.job_config
            else "a torchtitan or Megatron checkpoint (--from-dcp, --from-megatron)"
        )
        raise ValueError(
            f"{given} name{'s' if one else ''} the model of {readers} only; here {source}: "
            f"drop {'it' if one else 'them'}"
        )
    _check_unused_options(args)


def _check_unused_options(args) -> None:
    """Refuse an option the chosen mode does not read (it would be ignored without a word), and
    give --dp and --seed their defaults where they are read."""
    if (args.tensors or args.fast) and not args.info:
        given = [f for f, on in (("--tensors", args.tensors), ("--fast", args.fast)) if on]
        flags, ckpt = " ".join(given), shell_word(args.paths[0]) if args.paths else "CKPT"
        raise ValueError(
            f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} used only with "
            f"--info CKPT; to describe a checkpoint run megapar-convert --info {ckpt} {flags}, "
            f"to convert drop {flags}"
        )
    if args.overwrite and args.info:
        raise ValueError("--overwrite is not used with --info (it writes nothing); drop it")
    if (args.tp is not None or args.pp is not None) and args.info:
        raise ValueError(
            "--tp and --pp are not used with --info (it describes the checkpoint's own "
            "layout); drop them"
        )
    if args.seed is not None and not args.from_hf:
        raise ValueError(
            "--seed is used only with --from-hf (it initialises the tensors a transformers "
            "model lacks); drop it"
        )
    if args.dp is not None and (args.info or args.to_hf or args.to_dcp):
        raise ValueError(
            "--dp is used only where a checkpoint is written (SRC DST, --from-hf, "
            "--from-dcp, --from-megatron); drop it"
        )
    args.seed = 0 if args.seed is None else args.seed


def _check_export_flags(args) -> None:
    """Refuse --to-hf's options without --to-hf, and --allow-other-tokenizer without one."""
    given = [
        flag
        for flag, value in (
            ("--tokenizer", args.tokenizer),
            ("--allow-other-tokenizer", args.allow_other_tokenizer),
            ("--tokenizer-rows", args.tokenizer_rows),
            ("--dtype", args.dtype),
        )
        if value
    ]
    if given and not args.to_hf:
        said = and_list(given) + (" are" if given[1:] else " is")
        drop = "them" if given[1:] else given[0]
        raise ValueError(f"{said} used only with --to-hf (an export); drop {drop}")
    if args.allow_other_tokenizer and not args.tokenizer:
        raise ValueError("--allow-other-tokenizer needs --tokenizer SPEC, the tokenizer to export")


def _to_hf(args) -> str:
    """--to-hf: export SRC as a transformers directory; returns the report with its notes."""
    from megapar.checkpoint.export import export_hf

    (src,) = _need(args, 1, "SRC --to-hf HF_DIR")
    if args.tp is not None or args.pp is not None:
        raise ValueError(
            "--tp and --pp are not used with --to-hf: an export is one unsharded model; drop them"
        )
    if args.tokenizer_rows:
        _check_tokenizer_rows(src)
    before = _tokenizer_files(Path(args.to_hf))
    out = export_hf(
        src,
        args.to_hf,
        overwrite=args.overwrite,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        allow_other_tokenizer=args.allow_other_tokenizer,
        tokenizer_rows=args.tokenizer_rows,
    )
    report = f"wrote transformers directory {out}"
    rows = _exported_rows(args, src, out)
    if rows is not None and rows[0] < rows[1]:
        report += (
            f"\nnote: --tokenizer-rows: the embedding has the tokenizer's {rows[0]:,} "
            f"rows of the model's {rows[1]:,}; logits on those ids are the model's, "
            f"probabilities differ slightly (it trained its softmax over all)"
        )
    elif rows is not None:
        beyond = [f"the tokenizer's {rows[2]:,} ids"]
        names = rows[4]  # those of megapar's appended special tokens inside the vocabulary
        if names:
            beyond.append(
                f"the special token{'s' if len(names) > 1 else ''} {' '.join(names)} megapar's "
                f"tokenizers append for every model (BERT's, where missing)"
            )
        if rows[1] > rows[3]:
            beyond.append(
                f"{rows[1] - rows[3]} rows of padding (a vocabulary padded to a multiple, as "
                f"Megatron-LM pads it)"
            )
        report += (
            f"\nnote: vocab_size {rows[1]:,}: {and_list(beyond)}, "
            f"which this model trained its softmax over, so they stay (cutting them would "
            f"change every probability); --tokenizer-rows exports {rows[2]:,} rows, "
            f"shaped as Hugging Face's model"
        )
    from megapar.checkpoint.manifest import read_manifest
    from megapar.checkpoint.publish import resolve_checkpoint

    manifest = read_manifest(resolve_checkpoint(src))
    narrowed = _narrowed_to(manifest) if args.dtype is None else None
    if narrowed:
        report += (
            f"\nnote: the weights are written in {narrowed[1]}, the dtype of the Hugging Face "
            f"model the checkpoint was imported from; the checkpoint holds them in "
            f"{narrowed[0]} (trained since the import), which --dtype {narrowed[0]} keeps exactly"
        )
    after = _tokenizer_files(out)
    written = {n for n, stamp in after.items() if before.get(n) != stamp}
    left = sorted(set(after) - written)  # an earlier export's (--overwrite keeps them), or yours
    if "tokenizer.model" in written:  # a SentencePiece model's export
        report += (
            "\nnote: tokenizer.json is transformers' conversion of the SentencePiece model "
            "tokenizer.model, checked on sample texts; it can still split a word otherwise "
            "where two splits score alike to rounding, and take some combining accents as "
            "unknown (rare: 14 of 118,610 tokens of three plays); the sentencepiece library "
            "on tokenizer.model gives megapar's ids exactly"
        )
    if left and not written:
        report += (
            f"\nnote: the checkpoint records no tokenizer, so the export wrote none, but {out} "
            f"holds tokenizer files it did not write ({', '.join(left)}: an earlier export's, "
            f"or yours), which AutoTokenizer loads with this model: remove them unless they are "
            f"the tokenizer it trained with, or pass --tokenizer SPEC"
        )
    elif not (out / "tokenizer_config.json").exists():
        from megapar.checkpoint.export import tokenizer_hint
        from megapar.models.config import config_from_dict

        config = config_from_dict(manifest["model"])
        written = json.loads((out / "config.json").read_text())
        ids = {
            k: written[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if written.get(k) is not None
        }
        said = ", ".join(f"{k} {v}" for k, v in ids.items())
        report += (
            f"\nnote: the checkpoint records no tokenizer, so the export has none "
            f"(AutoTokenizer cannot load it), and its config's special token ids ({said}) are "
            f"the model config's, not checked against a tokenizer (generate stops at "
            f"eos_token_id; --tokenizer sets them from it); {tokenizer_hint(config, api=False)}"
            if ids
            else f"\nnote: the checkpoint records no tokenizer, so the export has none "
            f"(AutoTokenizer cannot load it); {tokenizer_hint(config, api=False)}"
        )
    return report


def _tokenizer_files(directory: Path) -> dict[str, tuple[int, int]]:
    """{name: (mtime_ns, size)} of the tokenizer files in `directory` (`TOKENIZER_FILES` and a
    SentencePiece tokenizer.model), to tell the files an export writes from those it finds."""
    from megapar.data.inputs import TOKENIZER_FILES

    out = {}
    for name in (*TOKENIZER_FILES, "tokenizer.model"):
        try:
            st = (directory / name).stat()
        except OSError:
            continue
        out[name] = (st.st_mtime_ns, st.st_size)
    return out


def _narrowed_to(manifest: dict) -> tuple[str, str] | None:
    """(the checkpoint's dtype, the export's) where `--to-hf` without --dtype writes a trained
    checkpoint's weights narrower than it holds them (a bf16 model's import, trained in fp32
    master weights), else None."""
    from megapar.checkpoint.format import dtype_from_name

    hf = manifest["meta"].get("hf_dtype")
    held = {e["dtype"] for e in manifest["tensors"].values() if not e.get("buffer")}
    if hf is None or manifest["step"] == 0 or len(held) != 1:
        return None
    (ours,) = held
    narrower = dtype_from_name(hf).itemsize < dtype_from_name(ours).itemsize
    return (ours, hf) if narrower else None


def _from_hf(args, progress: bool) -> str:
    """--from-hf: import a transformers directory as a step-0 checkpoint; returns the report."""
    from megapar.checkpoint import convert as cv
    from megapar.data.tokenizers import hf_dir_tokenizer, sentencepiece_dir_bos
    from megapar.training.tokenizer_checks import HF_TOKENIZER_FILES

    (dst,) = _need(args, 1, "--from-hf HF_DIR DST [--tp N] [--pp M]")
    _fill_layout(args, {})
    path, initialised = cv.import_hf(
        args.from_hf,
        dst,
        args.tp,
        args.pp,
        args.dp,
        seed=args.seed,
        overwrite=args.overwrite,
        progress=progress,
    )
    report = f"wrote {path} ({_written_layout(path)}, step 0, no optimizer state)"
    bos = sentencepiece_dir_bos(
        args.from_hf, then=f"import it again (add --overwrite to replace {dst})"
    )
    if bos:  # its tokenizer.model was recorded: megapar's documents, prompts would lack the BOS
        report += f"\nnote: recorded {args.from_hf}'s tokenizer.model as its tokenizer, but {bos}"
    if hf_dir_tokenizer(args.from_hf) is None:
        report += (
            f"\nnote: {args.from_hf} holds no tokenizer ({HF_TOKENIZER_FILES}), so the "
            f"checkpoint records none: megapar-eval and megapar-generate then need "
            f"--tokenizer with the model's own, and --to-hf writes one only given --tokenizer"
        )
    if initialised:
        report += (
            f"\nnot in {args.from_hf}, initialised from --seed {args.seed}: "
            f"{', '.join(initialised)}"
        )
    return report


def _check_tokenizer_rows(src: str) -> None:
    """--tokenizer-rows of a model that is not a causal LM (a BERT): it would be ignored."""
    from megapar.checkpoint.manifest import read_manifest
    from megapar.checkpoint.publish import resolve_checkpoint
    from megapar.models.config import CAUSAL_LM_TYPES

    kind = read_manifest(resolve_checkpoint(src))["model"].get("model_type")
    if kind not in CAUSAL_LM_TYPES:
        raise ValueError(
            f"--tokenizer-rows applies to a causal LM (GPT-2, Llama, Qwen3, Qwen2, Mistral, "
            f"Mixtral, Qwen3-MoE, DeepSeek-V3), "
            f"whose appended [PAD] [CLS] [SEP] [MASK] rows it cuts; this is a {kind}, which "
            f"uses them: drop --tokenizer-rows"
        )


def _exported_rows(args, src: str, out) -> tuple[int, int, int, int, list[str]] | None:
    """(rows exported, the checkpoint's vocabulary, its tokenizer's ids, those with the
    special tokens megapar appends, the names of those of them inside the vocabulary) of a
    causal LM's export whose vocabulary holds more rows than its tokenizer has ids (None
    otherwise)."""
    import json

    from megapar.checkpoint.hf import causal_rows
    from megapar.checkpoint.manifest import read_manifest
    from megapar.data.tokenizers import load_tokenizer
    from megapar.models.config import CAUSAL_LM_TYPES

    manifest = read_manifest(src)
    model, spec = manifest["model"], args.tokenizer or manifest["meta"].get("tokenizer")
    if (
        model.get("model_type") not in CAUSAL_LM_TYPES
        or not spec
        or not (out / "tokenizer_config.json").exists()
    ):
        return None
    tok = load_tokenizer(spec)
    rows = causal_rows(tok)
    if rows >= model["vocab_size"]:
        return None
    exported = json.loads((out / "config.json").read_text())["vocab_size"]
    inside = range(rows, min(tok.vocab_size, model["vocab_size"]))
    return exported, model["vocab_size"], rows, tok.vocab_size, [tok.decode([i]) for i in inside]


def _dcp(args, progress: bool) -> str:
    """--from-dcp / --to-dcp."""
    from megapar.checkpoint import dcp

    _check_export_flags(args)
    if args.to_dcp:
        (src,) = _need(args, 1, "SRC --to-dcp DCP_DIR")
        if args.tp is not None or args.pp is not None:
            raise ValueError(
                "--tp and --pp are not used with --to-dcp: the export is one "
                "unsharded model; drop them"
            )
        out, titan = dcp.export_dcp(src, args.to_dcp, overwrite=args.overwrite)
        scaling = titan.pop("rope_scaling")
        shown = ", ".join(f"{k}={v}" for k, v in titan.items())
        report = (
            f"wrote DCP checkpoint {out} (torchtitan's Llama names; weights only, no "
            f"optimizer state)\ntorchtitan model args: {shown}"
        )
        if scaling != dcp.TITAN_ROPE_SCALING:
            said = "none" if scaling is None else ", ".join(f"{k} {v}" for k, v in scaling.items())
            report += (
                f"\nnote: the model's RoPE scaling is {said}, not that of torchtitan's Llama 3 "
                f"flavors ({dcp.TITAN_ROPE_SAID}): run the weights with this scaling there, or "
                f"their logits are another model's"
            )
        return report
    (dst,) = _need(
        args, 1, "--from-dcp DCP_DIR DST (--job-config TOML | --model SPEC) [--tp N] [--pp M]"
    )
    if args.job_config and args.model:
        raise ValueError("--job-config and --model both name the model; give one")
    _fill_layout(args, {})
    path, reader = dcp.import_dcp(
        args.from_dcp,
        dst,
        args.tp,
        args.pp,
        args.dp,
        config=args.model,
        job_config=args.job_config,
        overwrite=args.overwrite,
        progress=progress,
    )
    report = f"wrote {path} ({_written_layout(path)}, step 0, weights only)"
    if args.job_config:
        report += (
            f"\nnote: RoPE scaled as torchtitan's Llama 3 flavors scale it "
            f"({dcp.TITAN_ROPE_SAID}); a checkpoint of an earlier torchtitan trained without: "
            f"import it with --model SPEC (the flavor's sizes, no rope_scaling)"
        )
    if reader.spec_vocab is not None:
        report += (
            f"\nnote: the vocabulary is the checkpoint's {reader.config.vocab_size:,} tokens "
            f"(its embedding's rows), not --model {args.model}'s {reader.spec_vocab:,}: "
            f"torchtitan's follows the tokenizer the job trained with"
        )
    if reader.optimizer:
        report += (
            f"\nnote: {args.from_dcp} holds optimizer state too; it is not imported "
            f"(the run starts its optimizer afresh, as after --from-hf)"
        )
    return report


def _from_megatron(args, progress: bool) -> str:
    """--from-megatron."""
    from megapar.checkpoint import megatron

    _check_export_flags(args)
    (dst,) = _need(args, 1, "--from-megatron MEGATRON_DIR DST [--model SPEC] [--tp N] [--pp M]")
    _fill_layout(args, {})
    path, reader = megatron.import_megatron(
        args.from_megatron,
        dst,
        args.tp,
        args.pp,
        args.dp,
        config=args.model,
        overwrite=args.overwrite,
        progress=progress,
    )
    it = "" if reader.iteration is None else f" iteration {reader.iteration}"
    report = (
        f"wrote {path} ({_written_layout(path)}, step 0, weights only) from Megatron "
        f"{reader.path.name}{it}"
    )
    if reader.spec_vocab is not None:
        report += (
            f"\nnote: the vocabulary is the checkpoint's {reader.config.vocab_size:,} rows "
            f"(Megatron's padded embedding), not --model {args.model}'s "
            f"{reader.spec_vocab:,}"
        )
    if reader.from_args:
        report += f"\nthe model is the training args {reader.path.name}/common.pt records"
    elif reader.config.model_type == "gpt2" and reader.config.activation_function != "gelu":
        report += (
            f"\nnote: --model's activation is {reader.config.activation_function}; Megatron's "
            f"GPT uses exact GELU (activation_function gelu) unless it trained with "
            f"--openai-gelu or --squared-relu"
        )
    if reader.optimizer:
        report += (
            f"\nnote: {args.from_megatron} holds optimizer state too; it is not imported "
            f"(the run starts its optimizer afresh, as Megatron's --finetune --no-load-optim)"
        )
    return report


def _disk_full(exc: BaseException) -> str | None:
    """The words of a write error of the disk (`DISK_ERRORS`: exit 1, not bad input's 2), or
    None: an OSError's, or the
    text of one the tokenizers and safetensors libraries raise as their own exception types
    ("No space left on device (os error 28)")."""
    if isinstance(exc, OSError):
        return (exc.strerror or str(exc)) if exc.errno in DISK_ERRORS else None
    for code in DISK_ERRORS:
        words = os.strerror(code)
        if words in str(exc) or f"os error {code})" in str(exc):
            return words
    return None


def _written_layout(path) -> str:
    """The layout the checkpoint step `path` was written in (its manifest's: tp, pp and dp)."""
    from megapar.checkpoint.manifest import read_manifest
    from megapar.mesh import Layout

    return str(Layout(**read_manifest(path)["layout"]))


@quiet_when_stdout_closes
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on bad input, 1 where the destination
    cannot be written, with the reason printed; 130 on Ctrl-C and 143 on SIGTERM, in one
    line: every output is renamed into place only when complete)."""
    # SIGTERM, SIGHUP, SIGQUIT and SIGUSR2 (where they have their default action): while the
    # imports run (seconds: torch), one line and an exit at once, as while the command imports
    # (they ended it without a word); then they clean up (the staging directory) as Ctrl-C does
    starting = exit_while_starting("megapar-convert")
    previous = _on_ending_signals(starting)
    try:
        exit_uncollected()  # torch's heap (where a command imports it) left to the OS at exit
        args = build_parser().parse_args(argv)
        import megapar.checkpoint.convert  # noqa: F401 - torch and the writers, imported first
        from megapar.checkpoint.format import CheckpointError
        from megapar.models.config import ConfigError

        _on_ending_signals(_raise_exit, replace=starting)

        try:
            report = run(args)
        except Exception as exc:  # noqa: BLE001 - the writers' own errors of a full disk too
            # a CheckpointError is megapar's own line, said as it is: a destination read-only
            # from the start, refused before any work ("cannot create DST: ... Read-only file
            # system"), was read as a disk gone read-only while writing (exit 1, "free space")
            full = None if isinstance(exc, CheckpointError) else _disk_full(exc)
            if full is None:
                if isinstance(exc, (CheckpointError, ConfigError, ValueError, OSError)):
                    print(f"megapar-convert: error: {exc}", file=sys.stderr)
                    return 2
                raise
            dst = args.to_hf or args.to_dcp or (args.paths[-1] if args.paths else "DST")
            name = getattr(exc, "filename", None)
            inside = name and os.path.abspath(str(name)).startswith(os.path.abspath(dst))
            where = f" ({name})" if inside else ""  # a copy's error names its source file
            print(
                f"megapar-convert: error: {full}{where} while writing {dst}; "
                f"nothing was written (an output is renamed into place only when complete, so "
                f"{dst} is as it was); free space or choose another destination",
                file=sys.stderr,
            )
            return 1
        print(report)  # a reader gone (| head) is not an error of the conversion's
    except (KeyboardInterrupt, SystemExit) as exc:
        ended = {128 + int(sig): sig.name for sig in map(signal.Signals, previous)}
        code = exc.code if isinstance(exc, SystemExit) else 130
        if isinstance(exc, SystemExit) and not (isinstance(code, int) and code in ended):
            raise
        name = ended.get(code) if isinstance(code, int) else None
        what = f"{ENDED_WORDS[name]} ({name})" if name else "interrupted"
        print(
            f"megapar-convert: {what}; nothing was written (an output is renamed into place "
            f"only when complete, so the destination is as it was)",
            file=sys.stderr,
        )
        return code if isinstance(code, int) else 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _on_ending_signals(handler, replace=None) -> dict:
    """In the main thread: `handler` for each of `ENDED_WORDS`' signals that has its default
    action (or `replace`, the handler an earlier call installed); returns {signal: the handler
    it had}. `megapar.faults.stop.exit_on_signals` does the like, and imports torch (its
    module's), which takes seconds: this runs before."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    installed = {}
    for name in ENDED_WORDS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, replace):
            installed[sig] = signal.signal(sig, handler)
    return installed


if __name__ == "__main__":
    sys.exit(main())
