"""Typed model configs that map one-to-one onto transformers' GPT2Config / BertConfig.

Field names are Hugging Face's, so `config.json` of a transformers checkpoint and a megapar
recipe are read the same way. `validate(layout)` checks, before any process group is used,
that the model can be split the way the user asked.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megapar.mesh import Layout, LayoutError


class ConfigError(ValueError):
    """A model config that is unknown or inconsistent."""


@dataclass
class _Base:
    hf_config_class = ""  # the transformers config class this one maps onto

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, **dataclasses.asdict(self)}

    def to_hf(self):
        """The transformers config with the same fields (megapar-only fields left out)."""
        import transformers

        return getattr(transformers, self.hf_config_class)(
            **{k: v for k, v in dataclasses.asdict(self).items()
               if k != "make_vocab_size_divisible_by"})

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in d.items() if k in names}
        return cls(**known)

    def _check(self, layout: Layout, hidden: int, heads: int, ffn: int, layers: int) -> None:
        if hidden % heads:
            raise LayoutError(f"hidden size {hidden} is not divisible by {heads} attention heads")
        if heads % layout.tp:
            raise LayoutError(f"{heads} attention heads are not divisible by --tp {layout.tp}")
        if hidden % layout.tp:
            raise LayoutError(f"hidden size {hidden} is not divisible by --tp {layout.tp}")
        if ffn % layout.tp:
            raise LayoutError(f"FFN size {ffn} is not divisible by --tp {layout.tp}")
        if layers < layout.pp:
            raise LayoutError(f"{layers} layers cannot be cut into --pp {layout.pp} stages "
                              f"(each stage needs at least one layer); lower --pp")


@dataclass
class GPT2Config(_Base):
    """GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh), tied input/output embedding."""

    model_type = "gpt2"
    hf_config_class = "GPT2Config"
    vocab_size: int = 50257
    """Vocabulary size (unpadded)."""
    n_positions: int = 1024
    """Maximum sequence length (learned position embeddings)."""
    n_embd: int = 768
    """Hidden size."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block."""
    n_inner: int | None = None
    """FFN size; None means 4 * n_embd."""
    activation_function: str = "gelu_new"
    """FFN activation; GPT-2 uses the tanh approximation of GELU."""
    resid_pdrop: float = 0.1
    """Dropout after attention and MLP, before the residual add."""
    embd_pdrop: float = 0.1
    """Dropout on the summed embeddings."""
    attn_pdrop: float = 0.1
    """Dropout on attention probabilities."""
    layer_norm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    initializer_range: float = 0.02
    """Std of the normal initialisation (output projections scaled by 1/sqrt(2 n_layer))."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x tp (padding never leaves the model)."""

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def ffn_size(self) -> int:
        return self.n_inner or 4 * self.n_embd

    def validate(self, layout: Layout) -> None:
        self._check(layout, self.n_embd, self.n_head, self.ffn_size, self.n_layer)


@dataclass
class BertConfig(_Base):
    """BERT: post-LayerNorm encoder, token types, attention mask, MLM head with tied decoder."""

    model_type = "bert"
    hf_config_class = "BertConfig"
    vocab_size: int = 30522
    """Vocabulary size (unpadded)."""
    hidden_size: int = 768
    """Hidden size."""
    num_hidden_layers: int = 12
    """Number of encoder layers."""
    num_attention_heads: int = 12
    """Attention heads per layer."""
    intermediate_size: int = 3072
    """FFN size."""
    hidden_act: str = "gelu"
    """FFN and MLM-transform activation (exact erf GELU)."""
    hidden_dropout_prob: float = 0.1
    """Dropout on embeddings and after attention / FFN output projections."""
    attention_probs_dropout_prob: float = 0.1
    """Dropout on attention probabilities."""
    max_position_embeddings: int = 512
    """Maximum sequence length."""
    type_vocab_size: int = 2
    """Number of token types (segments)."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon."""
    initializer_range: float = 0.02
    """Std of the normal initialisation."""
    pad_token_id: int = 0
    """Padding token id."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x tp (padding never leaves the model)."""

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size

    def validate(self, layout: Layout) -> None:
        self._check(layout, self.hidden_size, self.num_attention_heads, self.intermediate_size,
                    self.num_hidden_layers)


CONFIG_CLASSES = {"gpt2": GPT2Config, "bert": BertConfig}


def config_from_dict(d: dict):
    """A model config from a dict with a "model_type" key ("gpt2" or "bert")."""
    kind = d.get("model_type")
    if kind not in CONFIG_CLASSES:
        raise ConfigError(f"unknown model_type {kind!r}; expected one of {sorted(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[kind].from_dict(d)


def config_from_hf(hf_config):
    """A megapar config from a transformers config object."""
    return config_from_dict(hf_config.to_dict())


def load_config_file(path: str | Path):
    """A model config from a JSON or YAML file (megapar recipe or transformers config.json)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    return config_from_dict(data)
