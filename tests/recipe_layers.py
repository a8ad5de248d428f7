"""A recipe's model config with another layer count, for tests whose checks are per layer and
that rehearse fewer layers to run faster."""

import json

from megapar.models.recipes import resolve_model


def with_layers(recipe: str, layers: int) -> dict:
    """The config fields of `recipe` (a name of models/ or a config file) with `layers`
    layers (GPT-2's n_layer, the others' num_hidden_layers)."""
    fields = resolve_model(recipe).to_dict()
    fields["n_layer" if "n_layer" in fields else "num_hidden_layers"] = layers
    return fields


def write_with_layers(path, recipe: str, layers: int, **changes) -> str:
    """`with_layers(recipe, layers)` with `changes`, written as a config file at `path`, which
    is returned as a string (megapar-plan's and megapar-train's --model takes it)."""
    path.write_text(json.dumps({**with_layers(recipe, layers), **changes}))
    return str(path)
