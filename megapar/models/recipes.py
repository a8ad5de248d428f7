"""Named model recipes (the JSON files in the repository's top-level `models/` folder).

`resolve_model("gpt2-124m")` gives the config of a recipe; a path to a JSON/YAML file (a megapar
recipe or a transformers config.json) works too. The vocabulary size of a recipe is a default:
training overrides it with the tokenizer's.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

from megapar.models.config import ConfigError, config_from_file
from megapar.wording import or_list


def recipe_dirs() -> list[Path]:
    """Where recipes live: the source tree's models/ (editable installs), then the installed
    copy."""
    here = Path(__file__).resolve().parents[2] / "models"
    return [d for d in (here, Path(sys.prefix) / "share" / "megapar" / "models") if d.is_dir()]


def list_recipes() -> list[str]:
    return sorted({p.stem for d in recipe_dirs() for p in d.glob("*.json")})


def recipe_file(name: str) -> Path | None:
    """Recipe `name`'s config file, from the first of `recipe_dirs` that holds it; None where
    none does."""
    return next((d / f"{name}.json" for d in recipe_dirs() if (d / f"{name}.json").exists()), None)


HUB_NAMES = {
    "gpt2": "gpt2-124m",
    "gpt2-small": "gpt2-124m",
    "gpt2-medium": "gpt2-350m",
    "gpt2-large": "gpt2-774m",
    "gpt2-xl": "gpt2-1.5b",
    "bert-base-uncased": "bert-base",
    "bert-large-uncased": "bert-large",
    "llama-3.2-1b": "llama-1b",
    "llama-3.1-8b": "llama-8b",
    "meta-llama-3.1-8b": "llama-8b",
    "llama-3.1-70b": "llama-70b",
    "meta-llama-3.1-70b": "llama-70b",
    "qwen3-0.6b": "qwen3-0.6b",
    "qwen2.5-0.5b": "qwen2.5-0.5b",
    "mistral-7b-v0.1": "mistral-7b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "qwen3-30b-a3b": "qwen3-30b-a3b",
    "deepseek-v3": "deepseek-v3",
}
"""Hugging Face Hub's names of the models a recipe is (the shapes; its weights come with
--from-hf), lowercased, without the owner (meta-llama/, Qwen/) or an -Instruct suffix (the
same shapes)."""


def is_address(name: str) -> bool:
    """Whether `name` is a network address (hf://gpt2, https://...), not a local path."""
    return "://" in name and not os.path.exists(name)


def address_line(shown: str, then: str) -> str:
    """The refusal of an address given for a model (`shown`), saying to pass `then` instead."""
    return (
        f"{shown} is an address, and megapar downloads nothing: save the model with "
        f"save_pretrained(DIR) where it can be reached, then pass {then}"
    )


def is_hub_name(name: str) -> bool:
    """Whether `name` is a Hugging Face Hub name of a recipe's model (gpt2, bert-base-uncased)."""
    return _hub_shape_name(name.rstrip("/").rpartition("/")[2]) in HUB_NAMES


def _hub_shape_name(name: str) -> str:
    """A hub model's name as `HUB_NAMES` keys it: lowercased, without an -Instruct (before the
    version too: Mistral-7B-Instruct-v0.1) or a -Base suffix, whose shapes are the model's."""
    bare = name.lower().replace("-instruct", "")
    return bare.removesuffix("-base")


def resolve_model(name_or_path: str, api: bool = False):
    """A model config from a recipe name or a JSON/YAML config file; `api`: refusals name
    `megapar.prepare`'s arguments, not megapar-train's --model / --from-hf."""
    recipe = (lambda name: f"prepare({name!r})") if api else (lambda name: f"--model {name}")
    weights = "prepare(DIR)" if api else "--from-hf DIR"
    if is_address(name_or_path):
        raise ConfigError(address_line(f"model {name_or_path!r}", weights))
    path = Path(name_or_path).expanduser()  # `--model=~/x.json`: no shell expands it
    if path.suffix in (".json", ".yaml", ".yml") or path.exists():
        if not path.exists():
            close = difflib.get_close_matches(path.stem.lower(), list_recipes(), n=3, cutoff=0.7)
            raise ConfigError(
                f"model config file {name_or_path} not found; pass an existing JSON/YAML config "
                + (
                    f"file or a recipe name: did you mean {or_list(close)}?"
                    if close
                    else f"file or a recipe name: {', '.join(list_recipes())}"
                )
            )
        if path.is_dir():
            path = path / "config.json"
        return config_from_file(path)
    found = recipe_file(name_or_path)
    if found is not None:
        return config_from_file(found)
    owner, slash, bare = name_or_path.rstrip("/").rpartition("/")  # gpt2/ is gpt2
    hub = HUB_NAMES.get(_hub_shape_name(bare))
    hub_id = not slash or ("/" not in owner and not os.path.exists(owner))  # not a local path
    if hub is not None and hub_id:  # gpt2, openai-community/gpt2
        raise ConfigError(
            f"model {name_or_path!r} is a Hugging Face Hub id, and megapar downloads nothing: "
            f"its shape is the recipe {recipe(hub)} (its weights: {weights} of a saved copy)"
        )
    if hub_id and slash and bare:  # meta-llama/Meta-Llama-3-8B: a hub id, no local path
        raise ConfigError(
            f"model {name_or_path!r}: no such file or directory, and megapar downloads nothing "
            f"(a Hugging Face Hub id is read from a saved copy: save_pretrained(DIR), then "
            + (
                "prepare(DIR)"
                if api
                else "--from-hf DIR for its weights, or --model DIR for its config"
            )
            + f"); or pass a recipe name: {', '.join(list_recipes())}"
        )
    if "/" in name_or_path or os.sep in name_or_path or name_or_path.startswith(("~", ".")):
        raise ConfigError(  # a path (no recipe name has a separator): not "unknown model"
            f"model {name_or_path!r}: no such file or directory; pass a recipe name, a JSON/YAML "
            f"config file, or a directory that holds config.json"
        )
    close = difflib.get_close_matches(name_or_path.lower(), list_recipes(), n=3, cutoff=0.7)
    if close:  # --model gpt2-tinny
        raise ConfigError(f"unknown model {name_or_path!r}; did you mean {or_list(close)}?")
    raise ConfigError(
        f"unknown model {name_or_path!r}; known recipes: "
        f"{', '.join(list_recipes())} (or pass a JSON/YAML config file)"
    )
