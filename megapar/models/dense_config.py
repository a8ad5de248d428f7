"""Configs of the dense models with Llama's layout: Qwen3, Qwen2 (Qwen2.5) and Mistral.

Each is a `LlamaConfig` (RMSNorm, rotary positions, SwiGLU, grouped-query attention) with what
its transformers class adds: Qwen3 an RMSNorm over each head's q and k (as Qwen3-MoE), Qwen2
biases on the q, k and v projections. Field names and defaults are transformers'
`Qwen3Config` / `Qwen2Config` / `MistralConfig`'s (`save_pretrained` leaves out the fields at
their default, so a default here is the class's there), and their config.json files load as
they are.

The sliding window is transformers': in a windowed layer (`layer_window`: every layer of a
Mistral with `sliding_window`; a Qwen's with `use_sliding_window`, those `layer_types` names
"sliding_attention" or, without it, those from `max_window_layers` on) the query at position i
attends to the keys at positions i - window + 1 .. i (transformers' `sliding_window_overlay`:
key > query - window), the other layers to every earlier key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from megapar.mesh import Layout
from megapar.models.config import ConfigError, LlamaConfig


@dataclass
class _DenseConfig(LlamaConfig):
    """What the three families share: the export (fields transformers' class has, the
    architecture) and the sliding window's checks."""

    not_in_hf: ClassVar[frozenset[str]] = frozenset({"make_vocab_size_divisible_by"})
    """Fields transformers' class does not have (never exported)."""

    def to_hf(self):
        import transformers

        fields = dataclasses.asdict(self)
        if fields["head_dim"] is None:  # transformers' hidden / heads (Qwen2 has no field)
            del fields["head_dim"]
        hf = getattr(transformers, self.hf_config_class)(
            **{k: v for k, v in fields.items() if k not in self.not_in_hf}
        )
        hf.architectures = [self.hf_config_class.replace("Config", "ForCausalLM")]
        return hf

    def validate(self, layout: Layout, api: bool = False) -> None:
        super().validate(layout, api)
        window = getattr(self, "sliding_window", None)
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConfigError(
                f"sliding_window {window!r} must be a whole number >= 1 or null (no window)"
            )


@dataclass
class _QwenWindow(_DenseConfig):
    """What Qwen2 and Qwen3 share: transformers' defaults of both classes, and the
    sliding-window fields (a window on the layers `layer_types`, or, without it, those from
    `max_window_layers` on, when `use_sliding_window`)."""

    vocab_size: int = 151936
    """Vocabulary size (unpadded)."""
    hidden_size: int = 4096
    """Hidden size."""
    intermediate_size: int = 22016
    """SwiGLU MLP size."""
    num_key_value_heads: int | None = 32
    """Key/value heads (grouped-query attention)."""
    max_position_embeddings: int = 32768
    """Longest sequence the model is meant for."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id (carried to exported configs)."""
    eos_token_id: int | None = None
    """End-of-sequence id (carried to exported configs)."""
    use_sliding_window: bool = False
    """transformers' switch of the sliding window (off in every published Qwen2.5 / Qwen3)."""
    sliding_window: int | None = 4096
    """The window of the sliding layers, where use_sliding_window."""
    max_window_layers: int = 28
    """Layers from this one on use the window (when use_sliding_window and no layer_types)."""
    layer_types: list[str] | None = None
    """Per layer "full_attention" or "sliding_attention" (transformers >= 4.53 writes it)."""

    def layer_window(self, index: int) -> int | None:
        """transformers' rule: the window where use_sliding_window on the layers `layer_types`
        names "sliding_attention" (without it: from `max_window_layers` on)."""
        if not self.use_sliding_window or self.sliding_window is None:
            return None
        if self.layer_types is not None:
            sliding = self.layer_types[index : index + 1] == ["sliding_attention"]
        else:
            sliding = index >= self.max_window_layers
        return self.sliding_window if sliding else None

    def validate(self, layout: Layout, api: bool = False) -> None:
        super().validate(layout, api)
        kinds = ("full_attention", "sliding_attention")
        types = self.layer_types
        if types is not None and (
            len(types) != self.num_hidden_layers or any(t not in kinds for t in types)
        ):
            raise ConfigError(
                f"layer_types {types!r} must name each of the {self.num_hidden_layers} layers "
                f"{' or '.join(kinds)}; fix it or remove it"
            )


@dataclass
class Qwen3Config(_QwenWindow):
    """Qwen3 (dense): Llama with an RMSNorm over each head's q and k (before the rotation) and
    a head size of its own (head_dim 128 in every published size, whatever hidden / heads)."""

    model_type = "qwen3"
    hf_config_class = "Qwen3Config"
    not_in_hf: ClassVar[frozenset[str]] = frozenset({"make_vocab_size_divisible_by", "mlp_bias"})
    head_dim: int | None = 128
    """Size of one head (transformers' Qwen3 default: 128)."""

    @property
    def qk_norm(self) -> bool:
        return True


@dataclass
class Qwen2Config(_QwenWindow):
    """Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (not on the output
    projection nor the MLP)."""

    model_type = "qwen2"
    hf_config_class = "Qwen2Config"
    not_in_hf: ClassVar[frozenset[str]] = frozenset(
        {"make_vocab_size_divisible_by", "attention_bias", "mlp_bias"}
    )

    @property
    def qkv_bias(self) -> bool:
        return True


@dataclass
class MistralConfig(_DenseConfig):
    """Mistral: Llama's layout; v0.1 has a sliding window of 4096 in every layer, v0.2 and
    later none (`sliding_window` null)."""

    model_type = "mistral"
    hf_config_class = "MistralConfig"
    not_in_hf: ClassVar[frozenset[str]] = frozenset(
        {"make_vocab_size_divisible_by", "attention_bias", "mlp_bias"}
    )
    intermediate_size: int = 14336
    """SwiGLU MLP size."""
    num_key_value_heads: int | None = 8
    """Key/value heads (grouped-query attention)."""
    max_position_embeddings: int = 131072
    """Longest sequence the model is meant for."""
    sliding_window: int | None = 4096
    """Each token attends to this many tokens up to itself, in every layer (null: the whole
    sequence, as Mistral v0.2+)."""

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window


DENSE_SUPPORTED_DEFAULTS: dict[str, dict] = {
    kind: {
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
        **({"use_mrope": False} if kind == "qwen2" else {}),
    }
    for kind in ("qwen3", "qwen2", "mistral")
}
"""transformers settings megapar does not implement, with the one value it does (Qwen2.5's
config.json files carry ``use_mrope: false``, the multimodal rotary of Qwen2-VL)."""
