"""TrainConfig: every setting of a training run, one field per `megapar-train` flag.

The command-line parser is generated from these fields (the flag is the field name with dashes,
the help is the field's docstring), and a `--config FILE` (JSON or YAML) uses the same names,
so there is one list of settings and nothing to keep in step by hand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class TrainConfig:
    # --- layout ---
    tp: int = 1
    """Tensor-parallel size (ranks that split each layer)."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    dp: int | None = None
    """Data-parallel size; default world size / (tp * pp) (1 when megapar-train starts the workers)."""
    # --- model ---
    model: str | None = None
    """Model recipe from models/ (e.g. gpt2-124m, bert-base, gpt2-tiny) or a JSON/YAML config file."""
    from_hf: str | None = None
    """Start from a local transformers checkpoint directory (GPT2LMHeadModel / BertForMaskedLM)."""
    # --- data ---
    data: str | None = None
    """Dataset prefix (PREFIX.bin/.idx from megapar-data) or a raw .txt file (preprocessed into a cache). Default: the shipped Shakespeare sample."""
    tokenizer: str = "gpt2"
    """Tokenizer for raw text: gpt2, sentencepiece, a vocab.json+merges.txt dir or a .model file."""
    data_cache: str = "~/.cache/megapar"
    """Where raw text is tokenized to (keyed by content hash)."""
    val_fraction: float = 0.05
    """Share of documents held out for validation."""
    seq_len: int = 128
    """Sequence length in tokens."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    global_batch_size: int = 16
    """Sequences per optimizer step (micro-batch size x micro-batches x dp)."""
    # --- pipeline / memory ---
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe or 1f1b."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core) or full (each block)."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, fp32 master weights) or fp16 (dynamic loss scaling)."""
    zero: int = 0
    """1 shards the optimizer state over data-parallel ranks (ZeRO-1)."""
    # --- optimisation ---
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    lr_decay: str = "cosine"
    """Decay after warmup: cosine, linear or constant."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and norms)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    max_steps: int = 300
    """Optimizer steps to train for."""
    seed: int = 1234
    """Seed for weights, data order and dropout (results do not depend on the layout)."""
    # --- evaluation, checkpoints, logging ---
    eval_interval: int = 100
    """Evaluate on the validation split every N steps (0 disables)."""
    eval_steps: int = 4
    """Validation batches per evaluation."""
    save: str | None = None
    """Checkpoint directory to save into."""
    save_interval: int = 0
    """Save every N steps (0: only at the end)."""
    load: str | None = None
    """Checkpoint to resume from (a directory written by --save, or one of its step dirs). A directory that does not exist yet or holds no checkpoint starts a fresh run (logged), so a requeued job can pass the same --load as its --save."""
    load_strict: bool = False
    """Fail instead of starting fresh when --load holds no checkpoint."""
    log_interval: int = 10
    """Print a log line every N steps."""
    log_json: str | None = None
    """Write one JSON object per step (step, loss, lr, grad_norm, tokens_per_s, ...) to this file."""
    tensorboard: str | None = None
    """Write TensorBoard scalars to this directory."""
    wandb_project: str | None = None
    """Log to Weights & Biases (offline mode when there is no network)."""
    peak_tflops: float = 1.0
    """Peak TFLOP/s of one device, for MFU (e.g. 312 for A100 bf16; 1.0 is a rough CPU figure)."""
    timeout_s: float = 300.0
    """Timeout of every collective / point-to-point wait, in seconds."""
    # --- faults and clean stops ---
    max_nonfinite_steps: int = 5
    """Stop (rc 1, nothing saved) after this many consecutive steps with a non-finite loss or gradient norm (fp16: skipped steps; also when the loss scale overflows at its floor). 0 never stops."""
    exit_signals: str = "SIGTERM,SIGUSR1"
    """Signals that make every rank finish its step, save (with --save) and exit 0; "" for none. A first SIGINT does the same, a second aborts."""
    exit_duration_mins: float = 0.0
    """Finish the step, save and exit 0 once the run has trained this many minutes (0: no limit)."""
    exit_interval: int = 0
    """Finish, save and exit 0 at the first step that is a multiple of N (0: never)."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal right after it in the class body)."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and \
                isinstance(getattr(nxt, "value", None), ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def _choices() -> dict[str, list]:
    """Allowed values, taken from the modules that implement them."""
    from megapar.models.blocks import RECOMPUTE_MODES
    from megapar.optim.precision import PRECISIONS
    from megapar.optim.scheduler import DECAY_STYLES
    from megapar.pipeline.schedules import SCHEDULES

    return {"schedule": list(SCHEDULES), "recompute": list(RECOMPUTE_MODES),
            "precision": list(PRECISIONS), "zero": [0, 1], "lr_decay": list(DECAY_STYLES)}


def _type_of(f) -> Any:
    text = str(f.type)
    if "bool" in text:
        return "bool"
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def build_parser(prog: str = "megapar-train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Train a GPT-2 or BERT with tensor, pipeline and data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="JSON or YAML file whose keys are these flags' names "
                        "(command-line flags override it)")
    docs, choices = field_docs(), _choices()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _type_of(f)
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=docs.get(f.name, ""))
        else:
            parser.add_argument(flag, type=kind, default=None, choices=choices.get(f.name),
                                help=f"{docs.get(f.name, '')} (default: {f.default})")
    return parser


def load_config_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    data = _yaml(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
    known = {f.name for f in fields(TrainConfig)}
    data = {k.replace("-", "_"): v for k, v in (data or {}).items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}; valid names are the megapar-train "
                         f"flags, e.g. {sorted(known)[:6]}")
    return data


def _yaml(text: str):
    import yaml

    return yaml.safe_load(text)


def parse_args(argv=None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = load_config_file(args.config) if args.config else {}
    for f in fields(TrainConfig):
        given = getattr(args, f.name)
        if given is not None:
            values[f.name] = given
    return TrainConfig(**values)
