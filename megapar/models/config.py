"""Typed model configs that map one-to-one onto transformers' GPT2Config / BertConfig.

Field names are Hugging Face's, so `config.json` of a transformers checkpoint and a megapar
recipe are read the same way. `validate(layout)` checks, before any process group is used,
that the model can be split the way the user asked.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import yaml

from megapar.mesh import Layout, LayoutError, layout_option
from megapar.wording import counted, or_list

ACTIVATION_NAMES = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
"""The activations megapar's blocks implement (transformers' names; `blocks.ACTIVATIONS`)."""


class ConfigError(ValueError):
    """A model config that is unknown or inconsistent."""


def tp_split_error(what: str, size: int, tp: int, sizes: dict[str, int], api: bool = False) -> str:
    """The one line for a model size that --tp does not split: the size, and the --tp values
    that split every size tensor parallelism cuts (`sizes`, by name); worded for the caller
    (`layout_option`)."""
    fits = [
        1,
        *(t for t in range(2, min(sizes.values()) + 1) if not any(n % t for n in sizes.values())),
    ]
    choices = str(fits[0]) if len(fits) == 1 else f"{', '.join(map(str, fits[:-1]))} or {fits[-1]}"

    def named(name: str, n: int) -> str:
        return f"{n} {name}" if name == "attention heads" else f"{name} {n}"

    verb = "are" if what == "attention heads" else "is"
    return (
        f"{named(what, size)} {verb} not divisible by {layout_option('tp', tp, api)}; use "
        f"{layout_option('tp', choices, api)} (each "
        f"divides the {', '.join(named(k, n) for k, n in sizes.items())})"
    )


def too_few_layers(layers: int, pp: int, api: bool = False) -> str:
    """The one line for more pipeline stages than layers, worded for the caller (megapar-train's
    flags, or with `api` megapar.prepare's keywords)."""
    return (
        f"{counted(layers, 'layer')} cannot be cut into {layout_option('pp', pp, api)} stages "
        f"(each stage needs at least one layer); lower {layout_option('pp', None, api)} to {layers}"
        + (" or less" if layers > 1 else "")
    )


@dataclass
class _Base:
    model_type: ClassVar[str]  # "gpt2", "bert" or "llama", set by each subclass
    hf_config_class = ""  # the transformers config class this one maps onto
    zero_ok: ClassVar[frozenset[str]] = frozenset({"max_window_layers"})
    """Whole-number fields that may be 0 (`check_sizes`; every other one is >= 1)."""
    hub_code_keys: ClassVar[frozenset[str]] = frozenset()
    """Keys of a hub config.json that are settings of the model's own code (not transformers'
    class), refused as such (`hub_code_note`) rather than with difflib's closest field."""
    hub_code_note: ClassVar[str] = ""
    """What `hub_code_keys` are, as a refusal names them."""

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, **dataclasses.asdict(self)}

    def to_hf(self):
        """The transformers config with the same fields (megapar-only fields left out). A
        special token id outside the vocabulary, the class's default (GPT-2's 50256 in a
        SentencePiece vocabulary of 1,004) or this config's, is None: transformers warns of
        one as the config is made ("must be `None` or an integer within the vocabulary")."""
        import transformers

        cls = getattr(transformers, self.hf_config_class)
        fields = {
            k: v for k, v in dataclasses.asdict(self).items() if k != "make_vocab_size_divisible_by"
        }
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # transformers 5's
        for name in {**defaults, **fields}:
            value = fields.get(name, defaults.get(name))
            if name.endswith("_token_id") and isinstance(value, int):
                if not 0 <= value < self.vocab_size:
                    fields[name] = None
        return cls(**fields)

    @classmethod
    def from_dict(cls, d: dict):
        """The config from a dict; an unknown key, or a transformers setting megapar does not
        implement set to anything but its default, is an error (never silently dropped), all of
        them named in one line (`_refusal`)."""
        d = dict(d)
        for key in ("bos_token_id", "eos_token_id"):  # Llama 3 instruct lists several eos ids
            if isinstance(d.get(key), list):
                d[key] = d[key][0] if d[key] else None  # (generation_config.json keeps all)
        names = {f.name for f in dataclasses.fields(cls)}
        supported = HF_SUPPORTED_DEFAULTS[cls.model_type]
        unknown = [
            key
            for key in d
            if key not in names
            and key != "model_type"
            and key not in HF_METADATA_KEYS
            and not key.startswith("summary_")
            and key not in supported
        ]
        unsupported = [key for key in d if key in supported and d[key] != supported[key]]
        if unknown or unsupported:
            raise ConfigError(cls._refusal(d, unknown, unsupported))
        config = cls(**{k: v for k, v in d.items() if k in names})
        config.check_sizes()
        for key in ("activation_function", "hidden_act"):
            if key in names and getattr(config, key) not in ACTIVATION_NAMES:
                raise ConfigError(
                    f"model config: {key}={getattr(config, key)!r} is an activation megapar "
                    f"does not implement; it implements {', '.join(ACTIVATION_NAMES)}"
                )
        return config

    @classmethod
    def _refusal(cls, d: dict, unknown: list[str], unsupported: list[str]) -> str:
        """The one line refusing every key of `d` megapar does not take: the `unknown` keys (a
        did-you-mean each where a field is close; the `hub_code_keys` together, named as such)
        and the transformers settings of `unsupported` at a value megapar does not implement.
        One unknown key without a close field lists the valid keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        supported = HF_SUPPORTED_DEFAULTS[cls.model_type]
        if not unknown and len(unsupported) == 1:
            key = unsupported[0]
            return (
                f"model config: {key}={d[key]!r} is a transformers {cls.hf_config_class} "
                f"setting megapar does not implement (only {key}={supported[key]!r}); "
                f"remove it or use a model without it"
            )
        code = [key for key in unknown if key in cls.hub_code_keys]
        close = {
            key: difflib.get_close_matches(key, sorted(names | set(supported)), n=1)
            for key in unknown
            if key not in code
        }
        if len(close) == 1 and not code and not unsupported:
            key, match = next(iter(close.items()))
            hint = (
                f"did you mean {match[0]!r}?"
                if match
                else f"valid keys: {', '.join(sorted(names))}"
            )
            return f"model config: unknown key {key!r} for {cls.model_type}; {hint}"
        parts = [f"{', '.join(map(repr, code))} ({cls.hub_code_note})"] if code else []
        parts += [
            f"{key!r}" + (f" (did you mean {m[0]!r}?)" if m else "") for key, m in close.items()
        ]
        parts += [
            f"{key}={d[key]!r} (a transformers {cls.hf_config_class} setting megapar implements "
            f"only at {supported[key]!r})"
            for key in unsupported
        ]
        count = len(unknown) + len(unsupported)
        return (
            f"model config: {cls.model_type} does not take {', '.join(parts)}; remove "
            f"{'it' if count == 1 else f'these {count} keys'}"
        )

    @property
    def draws_dropout(self) -> bool:
        """Whether training draws random dropout masks: a dropout probability above 0 (GPT-2's
        *_pdrop, BERT's *_dropout_prob, Llama's attention_dropout, a classifier's)."""
        return any(
            f.name.endswith(("pdrop", "dropout_prob", "dropout"))
            and (getattr(self, f.name) or 0) > 0
            for f in dataclasses.fields(self)
        )

    def check_sizes(self) -> None:
        """Every size and count is a whole number >= 1 (dropouts in [0, 1)); every value that is
        not, named in one line."""
        problems = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.type == "int | None":
                continue
            # token ids may be 0, and the fields of `zero_ok` (Qwen's max_window_layers: every
            # layer windowed; DeepSeek-V3's first_k_dense_replace: no dense layer)
            low = 0 if f.name.endswith("token_id") or f.name in self.zero_ok else 1
            if f.type in ("int", "int | None") and (
                not isinstance(value, int) or isinstance(value, bool) or value < low
            ):
                problems.append(f"{f.name}={value!r} must be a whole number >= {low}")
            if f.name.endswith(("pdrop", "dropout_prob")) and not (
                isinstance(value, (int, float)) and 0 <= value < 1
            ):
                problems.append(f"{f.name}={value!r} must be in [0, 1)")
        if problems:
            raise ConfigError("model config: " + "; ".join(problems))

    def _check(
        self, layout: Layout, hidden: int, heads: int, ffn: int, layers: int, api: bool
    ) -> None:
        if hidden % heads:
            raise LayoutError(f"hidden size {hidden} is not divisible by {heads} attention heads")
        sizes = {"attention heads": heads, "hidden size": hidden, "FFN size": ffn}
        for what, size in sizes.items():
            if size % layout.tp:
                raise LayoutError(tp_split_error(what, size, layout.tp, sizes, api))
        if layers < layout.pp:
            raise LayoutError(too_few_layers(layers, layout.pp, api))


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
    bos_token_id: int | None = 50256
    """Beginning-of-sequence id (carried to exported configs; a recipe takes its tokenizer's)."""
    eos_token_id: int | None = 50256
    """End-of-sequence id (carried to exported configs; a recipe takes its tokenizer's)."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x tp (padding never leaves the model)."""

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes."""
        return self.n_positions

    @property
    def ffn_size(self) -> int:
        return self.n_inner or 4 * self.n_embd

    def validate(self, layout: Layout, api: bool = False) -> None:
        """LayoutError / ConfigError unless the model can take `layout` (worded for
        megapar-train, or with `api` for megapar.prepare: `layout_option`)."""
        self._check(layout, self.n_embd, self.n_head, self.ffn_size, self.n_layer, api)


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
    def max_positions(self) -> int:
        """The longest sequence the model takes."""
        return self.max_position_embeddings

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size

    def validate(self, layout: Layout, api: bool = False) -> None:
        """LayoutError / ConfigError unless the model can take `layout` (worded for
        megapar-train, or with `api` for megapar.prepare: `layout_option`)."""
        self._check(
            layout,
            self.hidden_size,
            self.num_attention_heads,
            self.intermediate_size,
            self.num_hidden_layers,
            api,
        )


@dataclass
class LlamaConfig(_Base):
    """Llama family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases.

    Field names are transformers' `LlamaConfig`'s (Llama 2 / 3 / 3.1 / 3.2 config.json files
    load as they are; transformers 5's `rope_parameters` is read too). With tp, query heads are
    split across ranks; key/value heads are split too when tp divides num_key_value_heads and
    otherwise kept whole (replicated) on every tp rank, each rank using the ones its query heads
    need (their gradient is summed over tp).
    """

    model_type = "llama"
    hf_config_class = "LlamaConfig"
    vocab_size: int = 32000
    """Vocabulary size (unpadded)."""
    hidden_size: int = 4096
    """Hidden size."""
    intermediate_size: int = 11008
    """SwiGLU MLP size (gate and up projections)."""
    num_hidden_layers: int = 32
    """Number of decoder layers."""
    num_attention_heads: int = 32
    """Query heads per layer."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_attention_heads (MHA)."""
    head_dim: int | None = None
    """Size of one head; None means hidden_size / num_attention_heads."""
    hidden_act: str = "silu"
    """Activation of the gate projection (SwiGLU uses silu)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is meant for (rotary positions have no table)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: dict | None = None
    """Rotary frequency scaling: None, {"rope_type": "linear", "factor": f} or Llama 3's
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    tie_word_embeddings: bool = False
    """The LM head reuses the input embedding (Llama 3.2 1B / 3B) instead of its own weight."""
    attention_bias: bool = False
    """Biases on q / k / v / o (transformers' option); megapar's Llama has none: must be False."""
    mlp_bias: bool = False
    """Biases in the MLP (transformers' option); megapar's Llama has none: must be False."""
    initializer_range: float = 0.02
    """Std of the normal initialisation (every linear and the embedding, as transformers does)."""
    bos_token_id: int | None = 1
    """Beginning-of-sequence id (carried to exported configs)."""
    eos_token_id: int | None = 2
    """End-of-sequence id (carried to exported configs)."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x tp (padding never leaves the model)."""

    @classmethod
    def from_dict(cls, d: dict):
        d = dict(d)
        params = d.pop("rope_parameters", None)  # transformers >= 5 spelling of theta + scaling
        if isinstance(params, dict):
            params = dict(params)
            d.setdefault("rope_theta", params.pop("rope_theta", 10000.0))
            if params.get("rope_type", params.get("type", "default")) != "default":
                d.setdefault("rope_scaling", params)
        return super().from_dict(d)

    def to_hf(self):
        hf = super().to_hf()
        hf.architectures = ["LlamaForCausalLM"]
        return hf

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes."""
        return self.max_position_embeddings

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def qk_norm(self) -> bool:
        """An RMSNorm over each head's q and k (Qwen3, Qwen3-MoE)."""
        return False

    @property
    def mla(self) -> bool:
        """Multi-head Latent Attention (DeepSeek-V3) instead of grouped-query attention."""
        return False

    @property
    def qkv_bias(self) -> bool:
        """Biases on the q, k and v projections (Qwen2)."""
        return False

    @property
    def attention_window(self) -> int | None:
        """The largest sliding window of a layer (None: every layer attends to the whole
        sequence)."""
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        return max((w for w in windows if w is not None), default=None)

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index`: each query attends to the `layer_window` keys
        up to itself (None: causal attention over the whole sequence)."""
        return None

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    rope_yarn: ClassVar[bool] = False
    """Whether the model takes YaRN rope_scaling (DeepSeek-V3; the other Llama types refuse
    it)."""

    @property
    def rope_dim(self) -> int:
        """The elements of a head the rotary embedding turns (all of it; DeepSeek-V3: its
        qk_rope_head_dim part)."""
        return self.head_size

    def validate(self, layout: Layout, api: bool = False) -> None:
        """LayoutError / ConfigError unless the model can take `layout` (worded for
        megapar-train, or with `api` for megapar.prepare: `layout_option`)."""
        q, kv = self.num_attention_heads, self.kv_heads
        if q % kv:
            raise ConfigError(
                f"num_attention_heads {q} is not a multiple of num_key_value_heads {kv}"
            )
        if self.head_dim is None and self.hidden_size % q:
            raise LayoutError(
                f"hidden size {self.hidden_size} is not divisible by {q} "
                f"attention heads (or set head_dim)"
            )
        if self.rope_dim % 2:
            if self.rope_dim != self.head_size:
                odd = f"qk_rope_head_dim {self.rope_dim}"
            elif self.head_dim is not None:
                odd = f"head_dim {self.head_dim}"
            else:
                odd = (
                    f"the head size {self.rope_dim} (hidden_size {self.hidden_size} / "
                    f"num_attention_heads {q})"
                )
            raise ConfigError(
                f"{odd} must be even for rotary embeddings; choose sizes that make it even"
            )
        sizes = {"attention heads": q, "FFN size": self.intermediate_size}
        for what, size in sizes.items():
            if size % layout.tp:
                raise LayoutError(tp_split_error(what, size, layout.tp, sizes, api))
        if self.num_hidden_layers < layout.pp:
            raise LayoutError(too_few_layers(self.num_hidden_layers, layout.pp, api))
        biased = [k for k in ("attention_bias", "mlp_bias") if getattr(self, k)]
        if biased and self.model_type in ("llama", "mixtral", "qwen3_moe"):
            raise ConfigError(
                f"the config's {' and '.join(f'{k}=True' for k in biased)}: not supported; "
                f"megapar's Llama has no biases (as every published Llama): use a model "
                f"without them ({' and '.join(biased)} false)"
            )
        if biased:  # Qwen3, Qwen2, Mistral: no published model sets them
            has = "only q / k / v biases" if self.qkv_bias else "no biases"
            raise ConfigError(
                f"the config's {' and '.join(f'{k}=True' for k in biased)}: not supported; "
                f"megapar's {self.model_type} has {has}"
                f" (as every published {self.model_type}): use a model without them "
                f"({' and '.join(biased)} false)"
            )
        rope_type = (self.rope_scaling or {}).get(
            "rope_type", (self.rope_scaling or {}).get("type")
        )
        kinds = ("default", "linear", "llama3", *(("yarn",) if self.rope_yarn else ()))
        if self.rope_scaling is not None and rope_type not in kinds:
            raise ConfigError(
                f"rope_scaling type {rope_type!r} is not supported; megapar "
                f"implements default, linear and llama3: remove rope_scaling from config.json "
                f"(transformers 5 writes it into rope_parameters: set its rope_type to "
                f"'default') to train at the model's original length (as Qwen's published "
                f"configs ship; they add YaRN only to run past it), or choose one of those"
            )
        scaling = self.rope_scaling or {}
        needed = ROPE_SCALING_FIELDS.get(str(rope_type), ()) if scaling else ()
        missing = [
            k
            for k in needed
            if isinstance(scaling.get(k), bool) or not isinstance(scaling.get(k), (int, float))
        ]
        if missing:
            raise ConfigError(
                f"rope_scaling of type {rope_type!r} needs {', '.join(missing)} (a number; "
                f"got {scaling}); give every one of {', '.join(needed)}, as "
                f"transformers' {rope_type} rope_parameters has them"
            )


ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
"""The numbers each rotary scaling megapar implements reads from `rope_scaling`."""

ModelConfig = GPT2Config | BertConfig | LlamaConfig
"""Any megapar model config."""

LLAMA_TYPES = ("llama", "mixtral", "qwen3_moe", "qwen3", "qwen2", "mistral", "deepseek_v3")
"""Model types built as megapar's `Llama` (Llama's layout: RMSNorm, rotary, SwiGLU, GQA)."""

CAUSAL_LM_TYPES = ("gpt2", *LLAMA_TYPES)
"""Model types trained on next-token windows (GPT data); the others are masked LMs."""

MOE_TYPES = ("mixtral", "qwen3_moe", "deepseek_v3")
"""Model types with routed experts (mixtures of experts)."""


def no_experts(config, api: bool = False) -> str:
    """The words a refusal of an expert setting for `config`, a model without experts, ends
    its reason with: which models have them, and that this one has none (an example recipe
    as megapar-train's --model names it, or with `api` as megapar.prepare's model does)."""
    example = "'mixtral-tiny'" if api else "--model mixtral-tiny"
    return (
        f"({', '.join(MOE_TYPES)}: e.g. {example}); this {config.model_type} model has no experts"
    )


CONFIG_CLASSES: dict[str, type[_Base]] = {
    "gpt2": GPT2Config,
    "bert": BertConfig,
    "llama": LlamaConfig,
}

HF_SUPPORTED_DEFAULTS = {
    "gpt2": {
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
    },
    "bert": {
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
    },
    "llama": {
        "pretraining_tp": 1,
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
    },
}
"""transformers settings megapar does not implement, with the one value it does (their
transformers default): a config.json may carry them at that value, never another."""

HF_METADATA_KEYS = {
    "_name_or_path",
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "task_specific_params",
    "n_ctx",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "torchscript",
    "gradient_checkpointing",
    "classifier_dropout",
    "tokenizer_class",
    "finetuning_task",
    "prefix",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
} | {"pad_token_id"}
"""transformers config keys that do not change the network megapar builds (metadata, token ids
for generation, heads other than the LM / MLM one); ignored when read. BERT's pad_token_id is
a megapar field and read as such."""


def config_from_dict(d: dict):
    """A model config from a dict with a "model_type" key (one of `CONFIG_CLASSES`)."""
    kind = d.get("model_type")
    if kind not in CONFIG_CLASSES:
        kinds = or_list(sorted(CONFIG_CLASSES))
        if not kind:
            raise ConfigError(f'the config has no model_type; add "model_type": one of {kinds}')
        raise ConfigError(f"unknown model_type {kind!r}; expected one of {kinds}")
    return CONFIG_CLASSES[kind].from_dict(d)


def config_from_hf(hf_config):
    """A megapar config from a transformers config object."""
    return config_from_dict(hf_config.to_dict())


def load_config_file(path: str | Path) -> dict:
    """The mapping in a JSON or YAML file (a model config, a transformers config.json or a
    megapar-train --config), with one clear ConfigError for a missing file, bad syntax or a
    file that is not a mapping. The one reader of config files in megapar."""
    typed, path = path, Path(path).expanduser()  # named as given (./x.json, ~/x.json)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{typed}: no such config file") from None
    except (IsADirectoryError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: cannot be read as a config file ({exc})") from None
    if path.suffix.lower() in (".yaml", ".yml"):  # run.YAML too
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(
                f"{path}: not valid YAML{at}: {getattr(exc, 'problem', None) or exc}"
            ) from None
    elif not text.strip():  # empty, as YAML's empty file is: the caller says what it lacks
        data = None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of names to values, got a {type(data).__name__}"
        )
    return data


def config_from_file(path: str | Path):
    """A model config from a JSON or YAML file (megapar recipe or transformers config.json)."""
    try:
        return config_from_dict(load_config_file(path))
    except ConfigError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith(str(path)) else f"{path}: {text}") from None
