"""megapar-eval: loss / perplexity of a checkpoint on a dataset, or its logits for given ids.

    megapar-eval --load CKPT --data PREFIX [--seq-len 128] --max-batches 8 [--tp 2 --pp 2 --cp 2]
    megapar-eval --load CKPT --data held_out.txt   # raw text: the checkpoint's tokenizer
    megapar-eval --load CKPT --input-ids ids.npy --save-logits logits.npy
    megapar-eval --load BERT --input-ids ids.npy --attention-mask mask.npy \
        --token-type-ids types.npy --save-logits logits.npy

A BERT checkpoint's report holds its masked-LM accuracy beside the loss: the share of masked
positions whose top-1 prediction is the original token (transformers' run_mlm's accuracy).

Windows are taken in order, unshuffled: window i is tokens [i*seq_len, i*seq_len + seq_len + 1)
of the stream (token 0 first; consecutive windows share one boundary token). The checkpoint is
resharded on load when --tp / --pp differ from its layout.
"""

from __future__ import annotations

import math
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapar.checkpoint.format import CheckpointError
from megapar.cli.closed_stdout import quiet_when_stdout_closes
from megapar.cli.worker_exit import (
    launched_size_refusal,
    parser_errors_once,
    prints_refusals,
    refused,
    run_reported,
)
from megapar.context_parallel import split as cp_split
from megapar.data import (
    GPTDataset,
    IndexedDataset,
    MLMDataset,
    SFTDataset,
    collate,
    load_tokenizer,
)
from megapar.data.blended import parse_blend
from megapar.device import use_cuda
from megapar.disk import DISK_ERRORS, refused_write, write_whole
from megapar.faults.processes import exit_uncollected, remove_stale_tmps
from megapar.faults.status import set_action
from megapar.faults.stop import SIGTERM_EXIT_CODE, RunStopped, sigterm_as_exit
from megapar.host_memory import host_memory_available
from megapar.made_dirs import missing_dirs, remove_empty
from megapar.models.config import CAUSAL_LM_TYPES, config_from_dict
from megapar.models.documents import mask_eod_labels
from megapar.one_line_parser import SHARDING_NAMES, OneLineParser, layout_names, shell_word
from megapar.pipeline.executor import PipelineExecutor
from megapar.training.empty_values import check_blank_flags
from megapar.training.eval_text import DEFAULT_CACHE, data_tokenizer
from megapar.training.inference import (
    forward_logits,
    load_model,
    trained_documents,
    trained_documents_note,
)
from megapar.training.logging import perplexity, strict_json
from megapar.training.tokenizer_checks import check_given_tokenizer
from megapar.training.usage import flag_of
from megapar.training.validate import UsageError, check_writable, names_directory
from megapar.training.validate_tools import check_eval_args, load_input_ids
from megapar.wording import counted

LOSS_ONLY = (
    "data",
    "seq_len",
    "micro_batch_size",
    "max_batches",
    "seed",
    "tokenizer",
    "jsonl_key",
    "sft_keys",
    "allow_invalid_utf8",
    "data_cache",
)
"""The options only --data reads (--input-ids gives logits of the ids as they are)."""

IDS_ONLY = ("attention_mask", "token_type_ids")
"""The options only --input-ids reads (--data's BERT samples carry their own)."""

OTHER_FLAGS = {
    "--bs": "--micro-batch-size",
    "--batch-size": "--micro-batch-size",
    "--gpu": "megapar-eval runs on the GPUs it is given (one a rank), else on the CPU",
    "--checkpoint": "--load",
    "--ckpt": "--load",
    **layout_names("--tp", "--pp", "--cp"),
    "--schedule": "megapar-eval runs the forward alone, stage after stage (no pipeline "
    "schedule to choose); drop it",
    "--virtual-stages": "megapar-eval holds each rank's layers as one chunk (a checkpoint does "
    "not depend on the chunks); drop it",
    "--zero": "megapar-eval holds no optimizer state and no ZeRO shards (a checkpoint does not "
    "depend on --zero); drop it",
    **dict.fromkeys(
        SHARDING_NAMES,
        "megapar-eval holds no optimizer state and no ZeRO / FSDP shards (a checkpoint does not "
        "depend on --zero); drop it",
    ),
    "--dp": "megapar-eval runs on --tp x --cp x --pp processes, without data parallelism; drop it",
    "--ep": "megapar-eval holds every expert on each rank (a checkpoint does not depend on ep); "
    "drop it, or use --tp / --pp",
    "--expert-tensor-parallel-size": "megapar-eval holds every expert whole on each rank (a "
    "checkpoint does not depend on it); drop it",
    "--cp-comm-type": "megapar-eval's --cp runs each model's default context-parallel "
    "attention (megapar-train's --cp-comm-type auto: the ring, or the all-gather of K/V for "
    "grouped-query heads); drop it",
    "--model": "the model is the checkpoint's (--load); drop it",
    "--from-hf": "import the directory first (megapar-convert --from-hf HF_DIR CKPT), then "
    "--load CKPT",
    "--precision": "megapar-eval computes in float32; drop it",
    "--fp8": "megapar-eval computes in float32 (an --fp8 run's checkpoint holds fp32 weights); "
    "drop it",
    "--fp8-emulate": "megapar-eval computes in float32 (an --fp8 run's checkpoint holds fp32 "
    "weights); drop it",
    "--eval-iters": "--max-batches",
    "--eval-steps": "--max-batches",
    "--data-path": "--data",
    "--input": "--data",
    "--max-steps": "--max-batches",
    "--save": "megapar-eval writes only the logits of --input-ids, to --save-logits; drop it",
    "--lr": "megapar-eval does not train; drop it",
    "--split-lines": "megapar-eval already reads a .txt as a document per blank-line paragraph; "
    "drop it",
    "--output-prefix": "megapar-eval keeps raw text's tokens in --data-cache; drop it",
    "--json": "megapar-eval always prints its result as one JSON line on stdout (> FILE keeps "
    "it); drop it",
    # the Hugging Face Trainer's and nanoGPT's (they had no answer; a re-test)
    **dict.fromkeys(("--bf16", "--fp16", "--tf32"), "megapar-eval computes in float32; drop it"),
    **dict.fromkeys(
        ("--do-eval", "--eval-only", "--do-predict"),
        "megapar-eval evaluates: the loss of --data, or the logits of --input-ids; drop it",
    ),
    "--block-size": "--seq-len",
    "--max-seq-length": "--seq-len",
    "--per-device-eval-batch-size": "--micro-batch-size",
    "--eval-batch-size": "--micro-batch-size",
}
"""megapar-train's and other tools' flags megapar-eval does not take, answered with what to do
(difflib named unrelated ones: `--cp`, `--dp`: `--tp`)."""


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="megapar-eval",
        description=__doc__.split("\n")[0],
        stray=(("--load", "the checkpoint"),),
        known_as=OTHER_FLAGS,
    )
    p.add_argument("--load", required=True, help="checkpoint (a --save dir or a step dir)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size: each sequence split over cp ranks as megapar-train --cp "
        "splits it (2 x cp chunks; a ring of key / value blocks, Llama and its kin: one "
        "all-gather of them), for sequences too long for one device; "
        "--seq-len (or --input-ids' length) a multiple of 2 x cp (default: 1)",
    )
    p.add_argument(
        "--data",
        help="dataset prefix (PREFIX.bin/.idx/.json from megapar-data, or a Megatron-LM "
        "MMIDIDX PREFIX.bin/.idx with --tokenizer), or raw text: a .txt / .jsonl / .json / "
        ".parquet file or a directory of them, tokenized with the tokenizer the checkpoint "
        "trained with into --data-cache (a document per paragraph, as megapar-train does); "
        "one at a time, not a blend",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="sequence length of the windows (default: the one the checkpoint trained with; "
        "for one that records none, such as megapar-convert --from-hf's, megapar-train's "
        "default 128 capped at the model's positions, said on stderr)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=4,
        help="windows per batch (default: 4)",
    )
    p.add_argument(
        "--max-batches",
        type=int,
        default=8,
        help="batches to evaluate, at most; fewer where the data holds fewer (default: 8)",
    )
    # a leading ~ of a file flag (quoted) is the home directory, as --load's and --data's are
    p.add_argument(
        "--input-ids",
        type=os.path.expanduser,
        help="a [batch, seq] integer array in a .npy file (np.save; read without pickle)",
    )
    p.add_argument(
        "--attention-mask",
        type=os.path.expanduser,
        help="with --input-ids of a BERT checkpoint: a [batch, seq] array of 1 (a token) and 0 "
        "(padding, attended to by no position) in a .npy file, transformers' attention_mask "
        "(default: all 1)",
    )
    p.add_argument(
        "--token-type-ids",
        type=os.path.expanduser,
        help="with --input-ids of a BERT checkpoint: a [batch, seq] array of segment ids "
        "(0: sentence A, 1: sentence B) in a .npy file, transformers' token_type_ids "
        "(default: all 0)",
    )
    p.add_argument(
        "--save-logits",
        type=os.path.expanduser,
        help="where rank 0 writes the float32 logits (.npy; the "
        "suffix is added when missing, as numpy does); an existing file only with --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --save-logits file (as megapar-data and megapar-convert ask)",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed for BERT masking (default: 1234)")
    p.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start more local processes (tp x cp x pp) than 4 per CPU core (at least 8), as "
        "megapar-train --oversubscribe; refused otherwise",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer of raw text and of a Megatron-LM dataset that has no megapar .json "
        "(default: the one the checkpoint trained with, which raw text must use, wherever it is "
        "now; refused when it records none)",
    )
    p.add_argument(
        "--data-cache",
        default=None,
        help="where raw text is tokenized to, keyed by its content and the tokenizer's "
        "(default: ~/.cache/megapar, megapar-train's)",
    )
    p.add_argument(
        "--jsonl-key",
        default=None,
        help="for raw .jsonl / .json / .parquet data: the key (column) holding each "
        "document's text (default: text)",
    )
    p.add_argument(
        "--sft-keys",
        default=None,
        metavar="PROMPT,RESPONSE",
        help="for raw JSON Lines prompt / response records: the two fields; each record is "
        "one sample, the loss the responses' (as megapar-train --sft-keys trains; default: "
        "the checkpoint's, when it trained with --sft-keys and --data is .jsonl / .json)",
    )
    p.add_argument(
        "--allow-invalid-utf8",
        action="store_true",
        help="for raw text: replace invalid UTF-8 with U+FFFD even above 0.1%% of a file's "
        "bytes (else an error; fewer are replaced with a warning)",
    )
    # --load's step directory the start-up checked and how the ranks check what they read
    # (`check_eval_args`); parsed arguments unchecked: --load itself, each rank hashing its files
    p.set_defaults(load_step=None, load_verify="sha256")
    return p


def _load(args):
    """The checkpoint at the step directory the start-up checked (else --load), with its
    packed-document settings, at this worker's layout: `load_model`'s LoadedModel."""
    return load_model(
        args.load_step or args.load,
        args.tp,
        args.pp,
        args.cp,
        documents=True,
        verify=args.load_verify,
    )


@torch.no_grad()
def _loss_worker(args):
    mesh, config, model, trained = _load(args)
    indexed = IndexedDataset(args.data, args.tokenizer)
    dataset: GPTDataset | MLMDataset | SFTDataset
    if config.model_type in CAUSAL_LM_TYPES and indexed.prompt_lengths is not None:
        dataset = SFTDataset(indexed, args.seq_len)  # records: the loss on the responses
    elif config.model_type in CAUSAL_LM_TYPES:
        dataset = GPTDataset(indexed, args.seq_len)
    else:
        dataset = MLMDataset(indexed, args.seq_len, data_tokenizer(args, indexed), args.seed)
    b, k = args.micro_batch_size, args.max_batches
    if len(dataset) < b * k:
        k = len(dataset) // b
        if k == 0:
            shown = getattr(args, "data_shown", args.data)  # the text, not its cached prefix
            raise ValueError(
                f"{shown} has {counted(len(dataset), 'window')} of {args.seq_len + 1} "
                f"tokens, fewer than one batch of {b}"
            )
    batches = (
        {
            key: v.to(mesh.device)
            for key, v in collate([dataset[j] for j in range(i * b, (i + 1) * b)]).items()
        }
        for i in range(k)
    )
    if trained.get("eod_mask_loss"):  # as the run trained and validated: no loss at an eod
        batches = (mask_eod_labels(batch, trained["eod_id"]) for batch in batches)
    if config.model_type not in CAUSAL_LM_TYPES:
        return _mlm_report(mesh, config, model, batches, k)
    shape = (b, args.seq_len // mesh.cp, config.hidden_size)  # a cp rank's tokens
    executor = PipelineExecutor(model, mesh, "1f1b", shape)
    nll, tokens = 0.0, 0  # the loss summed over every labelled token, and their count
    for batch in batches:
        labelled = int((batch["labels"] != -100).sum())
        nll += float(executor.run([batch], forward_only=True)) * labelled  # the batch's mean
        tokens += labelled
    if mesh.rank != 0:  # every rank has the loss; rank 0 reports it (once under torchrun)
        return None
    loss = nll / max(tokens, 1)
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": tokens, "batches": k}


def _mlm_report(mesh, config, model, batches, k: int):
    """A BERT checkpoint's report: the loss over every masked token and the masked-LM accuracy
    (the share of them whose top-1 logit is the original token, as transformers' run_mlm's
    eval computes it), from each batch's logits on the last stage (its cp rank's tokens, the
    vocabulary gathered over tp), summed over cp and sent to rank 0."""
    sums = torch.zeros(3, dtype=torch.float64, device=mesh.device)  # loss sum, correct, tokens
    for batch in batches:
        labels = batch.pop("labels")
        logits = forward_logits(
            model, mesh, batch, config.hidden_size, config.vocab_size, cp_gather=False
        )
        if logits is None:  # not the last stage
            continue
        labels = cp_split(labels, mesh.cp, mesh.cp_rank)
        masked = labels != -100
        nll = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        correct = (logits.argmax(-1) == labels)[masked].sum()
        sums += torch.stack([nll.double(), correct.double(), masked.sum().double()])
    if mesh.is_last_stage and mesh.cp > 1:
        dist.all_reduce(sums, group=mesh.cp_group)
    if mesh.pp > 1 and mesh.tp_rank == 0 and mesh.cp_rank == 0:  # the last stage to rank 0
        if mesh.is_last_stage:
            dist.send(sums, dst=mesh.stage_rank(0))
        elif mesh.is_first_stage:
            dist.recv(sums, src=mesh.stage_rank(mesh.pp - 1))
    if mesh.rank != 0:
        return None
    nll, correct, tokens = sums.tolist()
    loss = nll / max(tokens, 1)
    return {
        "loss": loss,
        "perplexity": perplexity(loss),
        "accuracy": correct / max(tokens, 1),
        "tokens": int(tokens),
        "batches": k,
    }


@torch.no_grad()
def _logits_worker(args):
    mesh, config, model, _ = _load(args)
    batch = {"input_ids": load_input_ids(args.input_ids)}
    if args.attention_mask:
        batch["attention_mask"] = load_input_ids(args.attention_mask, flag="--attention-mask")
    if args.token_type_ids:
        batch["token_type_ids"] = load_input_ids(args.token_type_ids, flag="--token-type-ids")
    batch = {key: torch.from_numpy(v.astype(np.int64)).to(mesh.device) for key, v in batch.items()}
    ids = batch["input_ids"]
    if ids.ndim != 2:
        raise ValueError(f"--input-ids must be a [batch, seq] array, got shape {tuple(ids.shape)}")
    set_action("computing the logits of --input-ids")
    logits = forward_logits(model, mesh, batch, config.hidden_size, config.vocab_size)
    full_shape = (ids.shape[0], ids.shape[1], config.vocab_size)
    if mesh.pp > 1 and mesh.tp_rank == 0 and mesh.cp_rank == 0:  # the last stage to rank 0
        if mesh.is_last_stage:
            dist.send(logits.float().contiguous(), dst=mesh.stage_rank(0))
        elif mesh.is_first_stage:
            logits = torch.empty(full_shape, device=mesh.device)
            dist.recv(logits, src=mesh.stage_rank(mesh.pp - 1))
    if mesh.rank == 0:
        set_action(f"writing the logits to {args.save_logits}")
        save_logits(args.save_logits, logits.float().cpu().numpy())
        return {"saved": args.save_logits, "shape": list(full_shape)}
    return None


WRITE_CHUNK_BYTES = 64 << 20
"""How much of the logits `save_logits` writes per call: between calls Python runs its signal
handlers (one np.save of the whole array runs in C, a Ctrl-C or SIGTERM waiting on it)."""


def save_logits(path: str, logits: np.ndarray) -> None:
    """Write `logits` to `path` as a .npy whole or not at all: into a temporary file beside it,
    renamed over `path` once complete (a Ctrl-C or SIGTERM mid-write leaves no partial .npy,
    and an older file there stays as it was until the new one is whole), in chunks of
    `WRITE_CHUNK_BYTES`, so that a signal ends the write at once and the temporary file is
    removed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    logits = np.ascontiguousarray(logits)
    flat = logits.reshape(-1)
    step = max(1, WRITE_CHUNK_BYTES // max(logits.itemsize, 1))

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.lib.format.write_array_header_1_0(
                f, np.lib.format.header_data_from_array_1_0(logits)
            )
            for start in range(0, flat.size, step):
                f.write(flat[start : start + step].tobytes())

    try:
        write_whole(path, write)
    except OSError as exc:  # a full disk: one line with its fix, no traceback to point to (it
        if exc.errno not in DISK_ERRORS:  # was "OSError: [Errno 28] ..." and a log; a re-test)
            raise
        raise RunStopped(refused_write("--save-logits", path, exc)) from None


RANK_BASE_BYTES = 1 << 29
"""Host memory a megapar-eval process holds besides the logits (torch, the model, the ids),
left free beside them by `logits_memory_refusal` (docs/guides/evaluation.md)."""


def logits_memory_refusal(
    args, shape: tuple[int, ...] | None, vocab_size: int, available: int | None
) -> str | None:
    """Why --save-logits of --input-ids (of `shape`) would not fit the host memory `available`
    (bytes; None: unknown, not checked), or None. Each rank of the last stage gathers the fp32
    logits of every token over tp (and cp) and holds about twice them at the peak; on GPUs only
    rank 0's copy to the host is host memory (docs/guides/evaluation.md)."""
    if available is None or shape is None or len(shape) != 2 or 0 in shape:
        return None  # (the worker's own check names a shape of another rank)
    rows, seq = shape
    logits = rows * seq * vocab_size * 4
    gpu = use_cuda()
    holders = 1 if gpu else 2 * args.tp * args.cp + (1 if args.pp > 1 else 0)
    need = holders * logits
    ranks = args.tp * args.cp * args.pp
    usable = available - ranks * RANK_BASE_BYTES  # each process's own (torch, the model)
    if need <= usable:
        return None
    fit = max(0, int(usable // (holders * seq * vocab_size * 4)))
    if usable <= 0:  # ("give shorter sequences" could not help; a re-test)
        return (
            f"--save-logits: {available / 2**30:.1f} GiB of host memory is free, less than the "
            f"{ranks} x {RANK_BASE_BYTES / 2**30:.1f} GiB this run's processes hold themselves: "
            f"free memory"
            + (", or run fewer processes (a smaller --tp x --cp x --pp)" if ranks > 1 else "")
        )
    return (
        f"--save-logits: the logits of --input-ids {args.input_ids} ({rows} x {seq} tokens x "
        f"{vocab_size} ids, fp32) are {logits / 2**30:.1f} GiB, and this run would hold about "
        f"{need / 2**30:.1f} GiB of them in host memory, more than the "
        f"{available / 2**30:.1f} GiB free less {ranks} x {RANK_BASE_BYTES / 2**30:.1f} GiB for "
        f"the processes themselves: give "
        + (f"at most {counted(fit, 'row')} of ids at a time" if fit else "shorter sequences")
        + ("" if args.tp * args.cp == 1 or gpu else " (or a smaller --tp x --cp)")
    )


def _check_ids(args, vocab_size: int) -> tuple[int, ...] | None:
    """Token ids outside the vocabulary are refused at any layout (at tp > 1 the vocab-parallel
    embedding would silently turn them into zero vectors). Returns --input-ids' shape (read
    once here, for `logits_memory_refusal`), None without them."""
    if args.input_ids:
        ids = load_input_ids(args.input_ids)
        if ids.size and (
            not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_size
        ):
            bad = ids.max() if ids.max() >= vocab_size else ids.min()
            raise ValueError(
                f"--input-ids {args.input_ids} holds id {bad} ({ids.dtype}), outside "
                f"the model's vocabulary of {vocab_size} ids (0-{vocab_size - 1})"
            )
        return ids.shape
    if args.data and getattr(args, "data_shown", args.data) == args.data:  # text: checked
        indexed = IndexedDataset(args.data, args.tokenizer)
        indexed.check_vocab(vocab_size)
        if args.tokenizer and os.path.isfile(args.data + ".json"):
            check_given_tokenizer(
                args.tokenizer, args.data, load_tokenizer(indexed.tokenizer_spec), checkpoint=True
            )
    return None


def logits_file(path: str, overwrite: bool = False, input_ids: str | None = None) -> str:
    """The file `np.save(path, ...)` writes (it adds .npy when missing), checked up front:
    not a directory, not an existing file unless `overwrite`, not the `input_ids` file it
    reads, and its directory writable (created if missing, as the run needs)."""

    target = os.path.expanduser(path)
    if names_directory(path):
        raise ValueError(
            f"--save-logits {path} is a directory; give a file name, e.g. "
            f"--save-logits {shell_word(os.path.join(path, 'logits.npy'))}"
        )
    real = target if target.endswith(".npy") else target + ".npy"
    if os.path.isdir(real):
        raise ValueError(
            f"--save-logits {path} would write {real}, which is a directory; give another file name"
        )
    ids = os.path.expanduser(input_ids) if input_ids else None
    if ids and os.path.exists(real) and os.path.exists(ids) and os.path.samefile(real, ids):
        raise ValueError(  # (--overwrite replaced the ids with their logits; a re-test)
            f"--save-logits {path} is the --input-ids file; give another file name"
        )
    if os.path.exists(real) and not overwrite:
        named = f"{path} exists" if real == path else f"{path} would replace {real}, which exists"
        raise ValueError(  # (one path said once where numpy adds no .npy; a re-test)
            f"--save-logits {named}; pass --overwrite to replace it, or give another file name"
        )
    check_writable(real, "--save-logits", kind="file")
    return real


def _refuse_given(given: tuple[str, ...], names: tuple[str, ...], only_with: str) -> None:
    """Refuse the flags among `names` the command line gave that the chosen mode does not use:
    "--a, --b are used only with ONLY_WITH" ({it} in it: "it" or "them")."""
    named = [flag_of(name) for name in names if name in given]
    if named:
        one = len(named) == 1
        raise UsageError(
            f"{', '.join(named)} {'is' if one else 'are'} used only with "
            + only_with.format(it="it" if one else "them")
        )


def _choose_worker(args, given: tuple[str, ...]):
    """The worker the mode asks for (--data: the loss, --input-ids: the logits); UsageError for
    no mode, both, or an option the chosen mode does not read (`given`: the options on the
    command line, `OneLineParser.given`)."""
    if args.input_ids:
        if args.data:  # before what either mode lacks
            raise UsageError(
                "--data and --input-ids are two modes (the loss on a dataset, the logits "
                "of given ids); give one, or run them as two commands"
            )
        if not args.save_logits:
            raise UsageError("--input-ids needs --save-logits OUT.npy")
        _refuse_given(
            given,
            LOSS_ONLY,
            "--data (the loss); --input-ids gives the logits of its ids as they are: drop {it}",
        )
        return _logits_worker
    if args.save_logits:
        raise UsageError(
            "--save-logits is used only with --input-ids IDS.npy (--data reports the loss); "
            "drop it or give --input-ids"
        )
    if args.overwrite:
        raise UsageError(
            "--overwrite is used only with --save-logits (--data reports the loss and writes "
            "nothing); drop it"
        )
    _refuse_given(
        given,
        IDS_ONLY,
        "--input-ids (the logits of given ids); --data's BERT samples carry their own: "
        "drop {it}, or give --input-ids",
    )
    if args.data:  # --seq-len not given: the checkpoint's (check_eval_args)
        return _loss_worker
    raise UsageError(
        "give --data PREFIX|TEXT [--seq-len N], or --input-ids IDS.npy --save-logits OUT.npy"
    )


def data_values(argv: list[str]) -> list[str]:
    """The words after the last --data of a command line, up to the next flag: one for a
    valid --data, several for megapar-train's blend syntax or a path the shell split."""
    values: list[str] = []
    for i, word in enumerate(argv):
        if word == "--data":
            values = []
            for value in argv[i + 1 :]:
                if value.startswith("-") and not _is_number(value):
                    break
                values.append(value)
    return values


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def several_data(items: list[str]) -> str:
    """The one line for several --data values: run a blend's parts one at a time, quote a
    path with spaces."""
    shown = " ".join(items)
    try:
        blend = parse_blend(items)
    except ValueError:
        blend = None
    if blend is not None:
        runs = ", then ".join(f"--data {shell_word(path)}" for _, path in blend)
        return (
            f"--data {shown} is a blend; megapar-eval evaluates one dataset at a time: "
            f"run it once per part ({runs})"
        )
    return (
        f"--data takes one dataset or text, got {len(items)} paths ({shown}); give one (a "
        f"path with spaces is one argument: quote it, --data {shell_word(shown)})"
    )


@quiet_when_stdout_closes
def main(argv=None) -> int:
    exit_uncollected()  # torch's heap left to the OS at exit
    parser = build_parser()
    several = data_values(list(sys.argv[1:] if argv is None else argv))
    if len(several) > 1:  # argparse would say "unrecognized arguments" and name no fix
        return refused("megapar-eval", several_data(several))
    with parser_errors_once():  # under torchrun / Slurm: one process a node prints
        args = parser.parse_args(argv)
    try:
        check_blank_flags(  # an unset $TOKENIZER ran the checkpoint's without a word
            args,
            {
                "data": "give a prepared prefix or a text file, or leave the flag out "
                "(--input-ids)",
                "tokenizer": "give one, or leave the flag out (the checkpoint's)",
                "input_ids": "give a .npy file of token ids, or leave the flag out (--data)",
                "save_logits": "give a .npy file to write",
                "data_cache": "give a directory, or leave the flag out (~/.cache/megapar)",
                "jsonl_key": "give the field holding each record's text (e.g. --jsonl-key "
                "body), or leave the flag out (text)",
            },
        )
        worker = _choose_worker(args, parser.given(argv))
    except UsageError as exc:
        return refused("megapar-eval", exc)
    previous = sigterm_as_exit()  # a SIGTERM here (raw --data tokenized) cleans up, as Ctrl-C
    # the --data-cache directories raw text's tokens would be kept in: a refusal leaves none
    made = missing_dirs(args.data_cache or DEFAULT_CACHE) if args.data else []
    try:  # every argument, the checkpoint and the ids: reported once, before any worker starts
        world = args.tp * args.cp * args.pp
        refusal = launched_size_refusal("megapar-eval", args.tp, args.pp, args.cp)
        if refusal:
            return refused("megapar-eval", refusal)
        manifest = check_eval_args(args, parser.given(argv))
        vocab = config_from_dict(manifest["model"]).vocab_size
        shape = _check_ids(args, vocab)
        if args.input_ids:  # the output too, before the evaluation (rank 0 writes it last)
            args.save_logits = logits_file(args.save_logits, args.overwrite, args.input_ids)
            made += missing_dirs(os.path.dirname(os.path.abspath(args.save_logits)))
            if refusal := logits_memory_refusal(args, shape, vocab, host_memory_available()):
                raise UsageError(refusal)
        if args.seq_len_note and prints_refusals():  # after every check, once per node
            print(args.seq_len_note, file=sys.stderr)
        said = trained_documents_note(trained_documents(manifest))
        if said and (args.data or args.input_ids) and prints_refusals():
            print(f"megapar-eval: {said}", file=sys.stderr)
    except (UsageError, CheckpointError, OSError, ValueError) as exc:
        remove_empty(made)
        return refused("megapar-eval", exc)
    except SystemExit as exc:
        if exc.code != SIGTERM_EXIT_CODE:
            raise
        remove_empty(made)
        print("megapar-eval: terminated (SIGTERM); nothing was written", file=sys.stderr)
        return SIGTERM_EXIT_CODE
    finally:
        if previous is not None:  # the ranks' and the launcher's own handling from here
            signal.signal(signal.SIGTERM, previous)
    # rank 0 writes --save-logits only once all are done
    results = run_reported(
        "megapar-eval", worker, world, args, "in evaluation", "; nothing was written"
    )
    if isinstance(results, int):
        if args.input_ids:  # a rank 0 killed mid-write (SIGKILL after a grace) left its file
            remove_stale_tmps(args.save_logits)
        remove_empty(made)  # and the directories rank 0 made for it ("nothing was written")
        return results
    if results and results[0] is not None:
        result = results[0]
        if "perplexity" in result and not math.isfinite(result["perplexity"]):
            loss = result["loss"]
            why = (
                f"exp({loss:.6g}) exceeds the largest float (a loss above "
                f"{math.log(sys.float_info.max):.2f})"
                if math.isfinite(loss)
                else f"the loss is {loss}"
            )
            print(f"megapar-eval: perplexity {why}: written as null", file=sys.stderr)
        print(strict_json(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
