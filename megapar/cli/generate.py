"""megapar-generate: text sampled from a checkpoint, at any layout.

    megapar-generate --load CKPT --prompt "To be" [--max-new-tokens 100] [--temperature 0.8]
    megapar-generate --load CKPT --prompt "To be" --temperature 0      # greedy
    megapar-generate --load CKPT --prompt-file prompt.txt --tp 2 --json
    megapar-generate --load CKPT --prompt "A" --prompt "B" --samples 4 --precision bf16

Each sample is the prompt, tokenized with the tokenizer the checkpoint trained with, grown one
token at a time, with a KV cache (the prompts' forward fills it, then one position's forward
per new token; `megapar.training.generate`), until the end-of-sequence token,
--max-new-tokens or the model's positions. Up to --batch-size samples are grown together, in one
left-padded batch; the weights are cast to --precision once loaded (the checkpoint's float32 by
default).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from megapar.checkpoint.format import LATEST, MANIFEST
from megapar.checkpoint.hf import causal_rows
from megapar.cli.closed_stdout import quiet_when_stdout_closes, stdout_closed
from megapar.cli.worker_exit import (
    launched_size_refusal,
    parser_errors_once,
    prints_refusals,
    refused,
    run_reported,
)
from megapar.data import load_tokenizer
from megapar.data.tokenizers import Tokenizer, encodes_alike, same_tokenizer
from megapar.faults.processes import exit_uncollected
from megapar.launcher import check_local_workers, under_launcher
from megapar.mesh import Layout, LayoutError
from megapar.models.config import CAUSAL_LM_TYPES, ConfigError, config_from_dict
from megapar.one_line_parser import (
    SHARDING_NAMES,
    OneLineParser,
    layout_names,
    other_switch_value,
    shell_word,
)
from megapar.training.config import precision_named_elsewhere
from megapar.training.empty_values import check_blank_flags
from megapar.training.generate import Sampling, generate_batch
from megapar.training.inference import load_model
from megapar.training.tokenizer_checks import (
    matches_recorded,
    recorded_as_trained,
    unlike_vocab_note,
)
from megapar.training.validate import UsageError
from megapar.training.validate_resume import checked_step, checkpoint_manifest, worker_verify
from megapar.wording import counted

OTHER_FLAGS = {
    "--cp": "megapar-generate has no context parallelism; drop it, or use --tp / --pp",
    "--schedule": "megapar-generate runs the forward alone, stage after stage (no pipeline "
    "schedule to choose); drop it",
    "--virtual-stages": "megapar-generate holds each rank's layers as one chunk (a checkpoint does "
    "not depend on the chunks); drop it",
    "--zero": "megapar-generate holds no optimizer state and no ZeRO shards (a checkpoint does not "
    "depend on --zero); drop it",
    **dict.fromkeys(
        SHARDING_NAMES,
        "megapar-generate holds no optimizer state and no ZeRO / FSDP shards (a checkpoint "
        "does not depend on --zero); drop it",
    ),
    "--dp": "megapar-generate runs on --tp x --pp processes, without data parallelism; drop it",
    "--ep": "megapar-generate holds every expert on each rank; drop it, or use --tp / --pp",
    "--expert-tensor-parallel-size": "megapar-generate holds every expert whole on each rank; "
    "drop it",
    "--model": "the model is the checkpoint's (--load); drop it",
    "--data": "megapar-generate continues prompts (--prompt TEXT, --prompt-file FILE); "
    "megapar-eval --load CKPT --data FILE gives a checkpoint's loss on a dataset",
    "--from-hf": "import the directory first (megapar-convert --from-hf HF_DIR CKPT), then "
    "--load CKPT",
    **layout_names("--tp", "--pp"),
    "--checkpoint": "--load",
    "--ckpt": "--load",
    "--out-dir": "--load (the checkpoint directory)",
    "--start": "--prompt (or --prompt-file FILE)",
    "--max-tokens": "--max-new-tokens",
    "--max-new-tokens-per-sample": "--max-new-tokens",
    "--num-samples": "--samples",
    "--num-return-sequences": "--samples (samples per prompt)",
    "--do-sample": "megapar-generate samples by default (--temperature 0 is greedy); drop it",
    "--greedy": "--temperature 0 (greedy decoding)",
    "--bf16": "--precision bf16",
    "--fp16": "--precision fp16",
    "--micro-batch-size": "--batch-size",
    "--fp8": "megapar-generate computes in --precision fp32, bf16 or fp16 (an --fp8 run's "
    "checkpoint holds fp32 weights); drop it",
    "--fp8-emulate": "megapar-generate computes in --precision fp32, bf16 or fp16 (an --fp8 "
    "run's checkpoint holds fp32 weights); drop it",
    "--dtype": "--precision",
    "--torch-dtype": "--precision",
}
"""Other tools' names for megapar-generate's flags (nanoGPT's sample.py, torchtitan's
test_generate.py, transformers' generate, megapar-train's), answered with what to do."""


DEFAULT_BATCH = 32
"""--batch-size's default: samples grown together (their KV cache holds rows x layers x 2 x
hidden x positions values: at most 2.25 GiB for GPT-2 124M's 1,024 positions in float32)."""

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""--precision's names (megapar-train's) and their dtypes."""


def _do_sample_off(flag: str, value: str) -> str | None:
    """transformers' do_sample given false (`--do_sample=False`): greedy decoding; bf16 / fp16
    given false: fp32, the default --precision."""
    if flag in ("--bf16", "--fp16") and other_switch_value(value) is False:
        return "false computes in fp32, megapar-generate's default --precision: leave the flag out"
    if flag == "--do-sample" and other_switch_value(value) is False:
        return (
            "false is greedy decoding: --temperature 0, which reads no --top-k or --top-p: "
            "drop those"
        )
    return None


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="megapar-generate",
        description=__doc__.split("\n")[0],
        stray=(("--prompt", "the prompt"),),
        known_as=OTHER_FLAGS,
        switch_known_as=_do_sample_off,
        value_known_as={"--precision": precision_named_elsewhere},
    )
    p.add_argument("--load", required=True, help="checkpoint (a --save dir or a step dir)")
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="text to continue; repeat for several prompts (an empty prompt starts a new "
        "document: the tokenizer's beginning-of-sequence token, else its end-of-document one)",
    )
    p.add_argument(
        "--prompt-file",
        action="append",
        default=[],
        type=os.path.expanduser,
        help="a UTF-8 file whose whole text is one prompt; repeatable, after the --prompt ones",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=100,
        help="tokens to add to each prompt, at most (default: 100)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="divides the logits before sampling; 0 is greedy: the most likely token "
        "(default: 0.8)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=200,
        help="sample among the K most likely tokens only; 0: all (default: 200)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the fewest most likely tokens whose probability reaches P, in "
        "(0, 1]; 1: all (default: 1.0)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="samples per prompt (default: 1)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1337,
        help="seed of the sampling: sample i (from 0, in the order printed) draws from a "
        "generator seeded with SEED + i, the same draws at any layout and --batch-size "
        "(default: 1337)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help="samples grown together in one left-padded batch (a finished one leaves it) "
        f"(default: {DEFAULT_BATCH})",
    )
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="fp32",
        help="dtype of the weights (cast once loaded; the checkpoint stays float32), "
        "activations and KV cache (default: fp32)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer of the prompts and the output (default: the one the checkpoint "
        "trained with; needed where it records none, as megapar-eval takes it)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON line per sample (prompt, completion, their ids, why it stopped) "
        "instead of the text",
    )
    p.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start more local processes (tp x pp) than 4 per CPU core (at least 8), as "
        "megapar-eval --oversubscribe; refused otherwise",
    )
    # --load's step directory the start-up checked and how the ranks check what they read
    # (`main`); parsed arguments unchecked: --load itself, each rank hashing its files
    p.set_defaults(load_step=None, load_verify="sha256")
    return p


SAMPLING_ONLY = ("top_k", "top_p", "seed")
"""The options --temperature 0 (greedy) does not read."""


def check_values(args, given) -> None:
    """UsageError for a value out of range, no prompt, or a sampling option greedy ignores."""
    for name in ("tp", "pp", "max_new_tokens", "samples", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(
                f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: it must be >= 1"
            )
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(
            f"--temperature {args.temperature} is invalid: it must be a finite number >= 0 "
            f"(0: greedy)"
        )
    if args.top_k < 0:
        raise UsageError(f"--top-k {args.top_k} is invalid: it must be >= 0 (0: all tokens)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p} is invalid: it must be in (0, 1] (1: all tokens)")
    if args.temperature == 0:
        named = [f"--{n.replace('_', '-')}" for n in SAMPLING_ONLY if n in given]
        if named:
            raise UsageError(
                f"{', '.join(named)} would be ignored: --temperature 0 is greedy (the most "
                f"likely token, no sampling); drop {'it' if len(named) == 1 else 'them'}"
            )
    drawn = (len(args.prompt) + len(args.prompt_file)) * args.samples  # (a file: 1 at least)
    if args.seed < 0 or args.seed + drawn - 1 > 2**63 - 1:
        raise UsageError(
            f"--seed {args.seed} is invalid: sample i draws with seed SEED + i, which must be "
            f"in [0, 2**63 - 1]; give a seed from 0 to {2**63 - drawn:,}"
            + (f" (for these {drawn:,} samples)" if drawn > 1 else "")
        )
    if not args.prompt and not args.prompt_file:
        raise UsageError(
            'give a prompt: --prompt "TEXT" (repeatable) or --prompt-file FILE '
            '(--prompt "" starts a new document)'
        )


def read_prompts(args) -> list[str]:
    """The prompts: every --prompt, then every --prompt-file's whole text."""
    prompts = list(args.prompt)
    for path in args.prompt_file:
        try:
            with open(path, encoding="utf-8") as f:
                prompts.append(f.read())
        except FileNotFoundError:
            raise UsageError(f"--prompt-file {path}: no such file") from None
        except IsADirectoryError:
            raise UsageError(
                f"--prompt-file {path} is a directory; give a text file (one prompt: its whole "
                f"text), or several --prompt-file"
            ) from None
        except UnicodeDecodeError:
            raise UsageError(f"--prompt-file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise UsageError(f"--prompt-file {path}: {exc.strerror}") from None
    return prompts


def checkpoint_of(load: str) -> dict:
    """The --load checkpoint's manifest; a transformers directory is named with the import."""
    path = os.path.expanduser(load)
    if (
        os.path.isfile(os.path.join(path, "config.json"))
        and not os.path.isfile(os.path.join(path, MANIFEST))
        and not os.path.isfile(os.path.join(path, LATEST))
    ):
        model_type = None
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            pass
        if model_type == "bert":  # importing it would only lead to the refusal below
            raise UsageError(
                f"--load {load} is a Hugging Face {model_type}, a masked language model; "
                f"megapar-generate continues text with a causal one (GPT-2, Llama and its kin)"
            )
        raise UsageError(
            f"--load {load} is a Hugging Face directory, not a megapar checkpoint; import it "
            f"first: megapar-convert --from-hf {shell_word(load)} CKPT, then --load CKPT"
        )
    return checkpoint_manifest(load)


def prompt_tokenizer(args, manifest: dict) -> Tokenizer:
    """--tokenizer, which must be the one the checkpoint trained with where it records one that
    still loads as it trained; else the recorded one. UsageError where there is none to take."""
    recorded = (manifest.get("meta") or {}).get("tokenizer")
    path = str(recorded["path"]) if isinstance(recorded, dict) and recorded.get("path") else None
    trained = None  # the recorded tokenizer, loaded as it trained (its files' sha256)
    if isinstance(recorded, dict) and path:
        if recorded.get("sha256"):
            trained = recorded_as_trained(recorded)
        else:  # recorded before the files' sha256 were
            try:
                trained = load_tokenizer(path)
            except (OSError, ValueError):
                pass
    if args.tokenizer:
        try:
            tok = load_tokenizer(args.tokenizer)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--tokenizer {args.tokenizer}: {exc}") from None
        if isinstance(recorded, dict) and recorded.get("sha256"):  # as eval and --load check
            other = not matches_recorded(recorded, tok)
        else:  # recorded before the files' sha256 were, or not at all
            other = trained is not None and not (
                same_tokenizer(trained, tok) or encodes_alike(trained, tok)
            )
        if other:
            raise UsageError(
                f"--tokenizer {args.tokenizer} is not the tokenizer --load {args.load} trained "
                f"with ({path}): its ids would be other tokens to the model; "
                + (
                    "leave --tokenizer out"
                    if trained is not None
                    else "pass that tokenizer, wherever it is now"
                )
            )
        return tok
    if path is None:
        raise UsageError(
            f"--load {args.load} records no tokenizer (imported without one, or older); pass "
            f"--tokenizer with the one the model trained with"
        )
    if trained is None:
        raise UsageError(
            f"--load {args.load} trained with the tokenizer {path}, which no longer loads from "
            f"there with the files it trained with (moved, deleted or changed); pass "
            f"--tokenizer with where that tokenizer is now"
        )
    return trained


def prompt_ids(tok: Tokenizer, prompt: str) -> list[int]:
    """The ids a prompt starts its sample with: the tokenizer's beginning-of-sequence token
    where it has one (as megapar-data starts every document, and transformers' tokenizer does),
    then the text's; an empty prompt without one is the end-of-document token (a new
    document follows it in the training data)."""
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)
    return ids or [tok.eod_id]


def completion_text(tok: Tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text `new` adds after `prompt`: decoded together with the prompt, so that a piece's
    leading space (SentencePiece's) or a character split over tokens comes out as in the whole
    text; `new` alone where the prompt's text is not a prefix of the whole."""
    before, whole = tok.decode(prompt), tok.decode(prompt + new)
    return whole[len(before) :] if whole.startswith(before) else tok.decode(new)


def prompt_names(args) -> list[str]:
    """How messages name each prompt of `read_prompts`: --prompt and its start, quoted, or
    --prompt-file and the file."""
    names = []
    for prompt in args.prompt:
        short = prompt if len(prompt) <= 40 else prompt[:37] + "..."
        names.append(f"--prompt {shell_word(short) if short else repr('')}")
    return names + [f"--prompt-file {path}" for path in args.prompt_file]


def check_prompts(
    prompts: list[str], names: list[str], tok: Tokenizer, config
) -> tuple[list[list[int]], int, str]:
    """The prompts' ids, the longest sequence the model takes and its name in messages;
    UsageError for an id outside the model's vocabulary or a prompt that leaves no position."""
    limit, what = config.max_positions, f"the model's {config.max_positions} positions"
    out = []
    for prompt, name in zip(prompts, names, strict=True):
        ids = prompt_ids(tok, prompt)
        top = max(ids)
        if top >= config.vocab_size:
            raise UsageError(
                f"{name} holds token id {top}, outside the model's "
                f"vocabulary of {config.vocab_size} ids; pass --tokenizer with the tokenizer "
                f"the model trained with"
            )
        if len(ids) >= limit:
            raise UsageError(
                f"{name} is {len(ids)} tokens, which leaves no room in "
                f"{what}; shorten it to at most {limit - 1} tokens"
            )
        out.append(ids)
    return out, limit, what


def unknown_notes(prompts: list[str], names: list[str], tok: Tokenizer) -> list[str]:
    """A note for each prompt holding characters the tokenizer's vocabulary cannot spell
    (a SentencePiece model's "日本語" or "é"): their tokens are its unknown token, which is what
    the model sees (--json's prompt_ids hold it; its "prompt" is the text as given)."""
    if tok.unk_id is None:
        return []
    notes = []
    for prompt, name in zip(prompts, names, strict=True):
        n = tok.encode(prompt).count(tok.unk_id)
        if n:
            notes.append(
                f"note: {name} holds characters the tokenizer's vocabulary cannot spell: "
                f"{counted(n, 'token')} of it {'is' if n == 1 else 'are'} its unknown token "
                f"(id {tok.unk_id}), which is what the model sees there"
            )
    return notes


def positions_note(
    prompt: int, sample: int, shape: tuple[int, int], limit_name: str, prompt_len: int, new_len: int
) -> str:
    """The stderr line for `sample` of `prompt` (both from 0, as --json's "sample" counts;
    `shape`: how many prompts and samples per prompt, which name it only where there are
    several), stopped at the model's positions."""
    new = f"{new_len} new one" if new_len == 1 else f"{new_len} new ones"
    return (
        f"megapar-generate: {_sample_named(prompt, sample, shape)} stopped at {limit_name} "
        f"(its prompt's {prompt_len} tokens and {new})"
    )


def eos_note(prompt: int, sample: int, shape: tuple[int, int], new_len: int, most: int) -> str:
    """The stderr line for a sample (`positions_note`'s names) the model ended with its
    end-of-text token after `new_len` new tokens, fewer than --max-new-tokens `most`: a
    completion of three words read as the command's fault."""
    return (
        f"megapar-generate: {_sample_named(prompt, sample, shape)} ended where the model chose "
        f"its end-of-text token, after {counted(new_len, 'new token')} of --max-new-tokens "
        f"{most} (another --seed, or --samples N, draws others)"
    )


def ended_note(ended: list[int], most: int, samples: int) -> str:
    """The stderr line for the `ended` of several `samples` (their new tokens each) that the
    model ended with its end-of-text token before --max-new-tokens `most`."""
    lo, hi = min(ended), max(ended)
    after = f"{counted(lo, 'new token')}" if lo == hi else f"{lo} to {hi} new tokens"
    return (
        f"megapar-generate: {len(ended)} of the {samples} samples ended where the model chose "
        f'its end-of-text token, after {after} of --max-new-tokens {most} (--json\'s "stop" '
        f"names each)"
    )


def _sample_named(prompt: int, sample: int, shape: tuple[int, int]) -> str:
    """ "prompt 1's sample 2", or "the sample" where there is one prompt and one sample."""
    prompts, samples = shape
    named = [f"prompt {prompt}"] if prompts > 1 else []
    named += [f"sample {sample}"] if samples > 1 else []
    return "'s ".join(named) if named else "the sample"


class SamplePrinter:
    """Prints the samples of rank 0's batches as each batch finishes (text, or `--json` lines,
    with their stderr notes), so an interrupted run keeps what it finished. A reader that
    closes standard output (`| head`) ends the printing, not the generation (the other ranks
    are in the same collectives)."""

    def __init__(self, args, tok: Tokenizer, prompts: list[str], limit_name: str):
        self.args, self.tok, self.prompts, self.limit_name = args, tok, prompts, limit_name
        self.closed = False
        self.ended: list[int] = []
        """New tokens of each sample the model ended with its end-of-text token (of several)."""
        self.limited: list[int] = []
        """New tokens of each sample that stopped at the model's positions (of several)."""

    def finish(self) -> None:
        """After the last batch, where each prompt has several --samples: one stderr line for
        the samples that stopped at the model's positions, and one for those the model ended
        with its end-of-text token (a line for each was 63 lines for --samples 64, each
        offering --samples N); with one sample a prompt each has its own line."""
        if self.closed:
            return
        sys.stdout.flush()
        samples = len(self.args.prompt_ids) * self.args.samples
        if self.limited:  # (said under --json too: the model's limit, not its choice)
            lo, hi = min(self.limited), max(self.limited)
            new = counted(lo, "new token") if lo == hi else f"{lo} to {hi} new tokens"
            named = ' (--json\'s "stop" names each)' if self.args.json else ""
            print(
                f"megapar-generate: {len(self.limited)} of the {samples} samples stopped at "
                f"{self.limit_name} ({new} each){named}",
                file=sys.stderr,
                flush=True,
            )
        if self.ended:
            print(
                ended_note(self.ended, self.args.max_new_tokens, samples),
                file=sys.stderr,
                flush=True,
            )

    def batch(self, start: int, samples: list[tuple[list[int], str]]) -> None:
        """Print `samples`, the batch whose first sample is sample `start` of the command."""
        if self.closed:
            return
        try:
            for i, (new_ids, stop) in enumerate(samples, start):
                self._sample(i, new_ids, stop)
            sys.stdout.flush()
        except BrokenPipeError:
            if not stdout_closed():
                raise
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.closed = True

    def _sample(self, i: int, new_ids: list[int], stop: str) -> None:
        args = self.args
        p = i // args.samples
        ids = args.prompt_ids[p]
        text = new_ids[:-1] if stop == "eos" else new_ids
        completion = completion_text(self.tok, ids, text)
        shape = (len(args.prompt_ids), args.samples)
        if stop == "positions" and args.samples > 1:  # a prompt's several: one line at the end
            self.limited.append(len(new_ids))
        elif stop == "positions":
            sys.stdout.flush()  # the note under the samples before it
            note = positions_note(
                p, i % args.samples, shape, self.limit_name, len(ids), len(new_ids)
            )
            print(note, file=sys.stderr, flush=True)
        elif stop == "eos" and not args.json and args.samples == 1:  # --json: its "stop"
            sys.stdout.flush()  # the note above its sample on a terminal
            print(
                eos_note(p, i % args.samples, shape, len(text), args.max_new_tokens),
                file=sys.stderr,
                flush=True,
            )
        elif stop == "eos" and not args.json:  # a prompt's several: one line at the end
            self.ended.append(len(text))
        if args.json:
            record = {
                "prompt": self.prompts[p],
                "sample": i % args.samples,
                "completion": completion,
                "prompt_ids": ids,
                "new_ids": new_ids,
                "stop": stop,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(self.prompts[p] + completion)
            print("-" * 15)


def _worker(args):
    mesh, config, model, _ = load_model(
        args.load_step or args.load,
        args.tp,
        args.pp,
        dtype=PRECISIONS[args.precision],
        verify=args.load_verify,
    )
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    rows = [ids for ids in args.prompt_ids for _ in range(args.samples)]
    # sample i's own CPU generator: the same draws on any device, layout and batch size
    generators = [torch.Generator().manual_seed(args.seed + i) for i in range(len(rows))]
    for start in range(0, len(rows), args.batch_size):
        end = start + args.batch_size
        outs = generate_batch(
            model,
            mesh,
            rows[start:end],
            args.max_new_tokens,
            sampling,
            generators[start:end],
            config.hidden_size,
            config.vocab_size,
            args.limit,
            args.eos_id,
        )
        if mesh.rank == 0:  # printed as each batch finishes
            args.printer.batch(start, [(out.new_ids, out.stop) for out in outs])
    if mesh.rank == 0:
        args.printer.finish()


def _run(args):
    """The workers' samples, or the exit code of a failure (its line already printed)."""
    return run_reported("megapar-generate", _worker, args.tp * args.pp, args, "in generation")


@quiet_when_stdout_closes
def main(argv=None) -> int:
    exit_uncollected()  # torch's heap left to the OS at exit
    parser = build_parser()
    with parser_errors_once():  # under torchrun / Slurm: one process a node prints
        args = parser.parse_args(argv)
    try:  # every argument, the checkpoint and the prompts: before any model is built
        check_blank_flags(  # an unset $TOKENIZER ran the checkpoint's without a word
            args,
            {
                "tokenizer": "give one, or leave the flag out (the checkpoint's)",
                "prompt_file": "give a file of the prompt's text",
            },
        )
        check_values(args, parser.given(argv))
        prompts = read_prompts(args)
        refusal = launched_size_refusal("megapar-generate", args.tp, args.pp)
        if refusal:
            return refused("megapar-generate", refusal)
        if not args.oversubscribe and not under_launcher():
            check_local_workers(args.tp * args.pp, f"--tp {args.tp} x --pp {args.pp}")
        manifest = checkpoint_of(args.load)
        args.load_step, args.load_verify = checked_step(args.load, manifest), worker_verify()
        config = config_from_dict(manifest["model"])
        if config.model_type not in CAUSAL_LM_TYPES:
            raise UsageError(
                f"--load {args.load} holds a {config.model_type}, a masked language model; "
                f"megapar-generate continues text with a causal one (GPT-2, Llama and its kin)"
            )
        try:
            config.validate(Layout(args.tp, args.pp, 1))
        except (LayoutError, ConfigError) as exc:
            raise UsageError(str(exc)) from None
        tok = prompt_tokenizer(args, manifest)
        if causal_rows(tok) > config.vocab_size:  # its ids mean other tokens, or none
            named = (
                f"--tokenizer {args.tokenizer}" if args.tokenizer else f"its tokenizer {tok.path}"
            )
            raise UsageError(
                f"{named} has {causal_rows(tok):,} token ids, more than the model's vocabulary "
                f"of {config.vocab_size:,}; pass --tokenizer with the tokenizer the model "
                f"trained with"
            )
        names = prompt_names(args)
        args.prompt_ids, args.limit, limit_name = check_prompts(prompts, names, tok, config)
        args.eos_id = tok.eod_id if tok.eod_id < config.vocab_size else None
        for note in unknown_notes(prompts, names, tok) if prints_refusals() else ():
            print(f"megapar-generate: {note}", file=sys.stderr)
        unlike = unlike_vocab_note(
            args.load, manifest, tok, config.vocab_size, f"--tokenizer {args.tokenizer}"
        )
        if unlike and prints_refusals():  # once per node
            print(f"megapar-generate: {unlike}", file=sys.stderr)
    except (UsageError, OSError, ValueError) as exc:
        return refused("megapar-generate", exc)
    args.printer = SamplePrinter(args, tok, prompts, limit_name)  # rank 0's (`_worker`)
    sys.stdout.flush()  # nothing buffered for a forked rank to print again
    results = _run(args)
    return results if isinstance(results, int) else 0


if __name__ == "__main__":
    sys.exit(main())
