"""Settings that may not be empty: a path or a name given as "" or spaces, which an unset shell
variable leaves ($CKPT, $DATA), would otherwise run the default without a word, or write into
the working directory. megapar-train's (`check_empty`), read by its checks
(`megapar.training.validate`) and by a --config file's reading (`megapar.training.config`),
which names the file; the other commands' flags (`check_blank_flags`)."""

from __future__ import annotations

from megapar.training.usage import UsageError, flag_of

_EXAMPLE_PATHS = {
    "save": "ckpt",
    "load": "ckpt",  # an unset $CKPT: a run from scratch, without a word
    "from_hf": "hf_model",
    "log_json": "run.jsonl",
    "tensorboard": "tb",
    "data_cache": "~/.cache/megapar",
    "profile_dir": "profile",  # "" wrote the traces into the working directory
}


def _empty_shown(data) -> str:
    """The empty part of a --data value as the refusal shows it ('' or ' ')."""
    parts = data if isinstance(data, list) else [data]
    return repr(next(d for d in parts if isinstance(d, str) and not d.strip()))


def check_empty(cfg) -> None:
    """UsageError in one line for the first setting of `cfg` (a TrainConfig) that is an empty
    path or name, naming an example and the flag's default."""
    for name in _EXAMPLE_PATHS:  # "" would silently write nothing (or into the working directory)
        if isinstance(getattr(cfg, name), str) and not getattr(cfg, name).strip():
            raise UsageError(
                f"{flag_of(name)} {getattr(cfg, name)!r} is an empty path: give a path (e.g. "
                f"{flag_of(name)} {_EXAMPLE_PATHS[name]}), or leave the flag out"
            )
    if cfg.data == []:  # a TrainConfig made in Python (a --config file's [] is refused there)
        raise UsageError(
            "TrainConfig(data=[]) names no data: give a text file, a directory of them or a "
            'prepared prefix (e.g. data=["corpus.txt"]), or None (the shipped sample)'
        )
    data = cfg.data if isinstance(cfg.data, list) else [cfg.data]
    if any(isinstance(d, str) and not d.strip() for d in data):
        # an unset $DATA: the shipped sample, without a word ("data": [] in a --config file:
        # a traceback)
        raise UsageError(
            f"--data {_empty_shown(cfg.data)} is an empty path: give a text file, a directory "
            "of them or a prepared "
            "prefix (e.g. --data corpus.txt), or leave the flag out (the shipped sample)"
        )
    if isinstance(cfg.tokenizer, str) and not cfg.tokenizer.strip():  # an unset $TOKENIZER
        raise UsageError(
            f"--tokenizer {cfg.tokenizer!r} is an empty name: give one (e.g. --tokenizer "
            f"sentencepiece), or leave the flag out (gpt2; with --load, the checkpoint's; with "
            f"--from-hf, the model's own)"
        )
    if isinstance(cfg.model, str) and not cfg.model.strip():  # an unset $MODEL: the default
        raise UsageError(
            f"--model {cfg.model!r} is an empty name: give a recipe (e.g. --model gpt2-tiny) "
            "or a model "
            "config file, or leave the flag out"
        )
    if cfg.wandb_project is not None and not cfg.wandb_project.strip():  # an unset $PROJECT
        raise UsageError(
            "--wandb-project '' is an empty name: give a project (e.g. --wandb-project "
            "megapar), or leave the flag out (no W&B log)"
        )
    if isinstance(cfg.jsonl_key, str) and not cfg.jsonl_key.strip():  # "add '' to the line"
        raise UsageError(
            f"--jsonl-key {cfg.jsonl_key!r} is an empty name: give the field holding each "
            f"record's text (e.g. --jsonl-key body), or leave the flag out (text)"
        )


def check_blank_flags(args, fixes: dict[str, str]) -> None:
    """UsageError in one line for the first flag of `fixes` ({dest: what to give instead}) that
    `args` holds as "" or spaces (of a repeated flag, any one)."""
    for name, fix in fixes.items():
        value = getattr(args, name, None)
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, str) and not one.strip():
                raise UsageError(f"{flag_of(name)} {one!r} is empty: {fix}")
