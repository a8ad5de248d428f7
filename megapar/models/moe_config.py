"""Configs of the mixture-of-experts Llama variants: Mixtral, Qwen3-MoE and DeepSeek-V3.

Each is a `LlamaConfig` (norms, rotary as Llama; DeepSeek-V3's attention is Multi-head Latent
Attention, `megapar.models.deepseek`) whose MLPs are MoE layers (`megapar.models.moe`). Field names
are transformers' `MixtralConfig` / `Qwen3MoeConfig` / `DeepseekV3Config`'s, so their
config.json files load as they are; the `moe_*` fields and `shared_expert_intermediate_size`
are megapar's own (never exported).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from megapar.mesh import Layout
from megapar.models.config import ConfigError, LlamaConfig

ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass
class _MoEConfig(LlamaConfig):
    """The fields every MoE recipe has (megapar's own and transformers' common ones)."""

    experts_key: ClassVar[str] = "num_local_experts"
    """The config.json key of the routed experts, as refusals name it."""
    megapar_only: ClassVar[frozenset[str]] = frozenset(
        {
            "make_vocab_size_divisible_by",
            "moe_router_score",
            "moe_z_loss_coef",
            "moe_capacity_factor",
            "moe_bias_update_rate",
            "shared_expert_intermediate_size",
            "attention_bias",
            "mlp_bias",
        }
    )
    num_local_experts: int = 8
    """Routed experts per MoE layer (Qwen3-MoE's config.json calls it num_experts)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    router_aux_loss_coef: float = 0.001
    """Coefficient of the switch-style load-balancing loss (0: none), per model: each MoE
    layer's loss counts 1 / (MoE layers)."""
    output_router_logits: bool = False
    """transformers' switch for adding the aux loss to its loss; megapar always adds it
    (coefficient > 0), carried to exported configs."""
    moe_router_score: str = "softmax"
    """Router scores: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)."""
    moe_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss (ST-MoE: mean logsumexp(logits)^2; 0: none)."""
    moe_capacity_factor: float | None = None
    """None: dropless. Else each expert keeps at most ceil(factor * tokens * k / experts)
    assignments per micro-batch; the rest are dropped (zero output) and counted."""
    moe_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: the per-expert routing bias moves by this
    much per step toward a balanced load (0: off)."""
    shared_expert_intermediate_size: int | None = None
    """Size of the shared experts' SwiGLU that every token passes (DeepSeek style; None:
    none)."""

    @property
    def renormalize_topk(self) -> bool:
        return True

    @property
    def router_bias(self) -> bool:
        """Whether the router holds a per-expert bias that chooses (never weighs): DeepSeek-V3's
        e_score_correction_bias, or megapar's auxiliary-loss-free balancing's."""
        return bool(self.moe_bias_update_rate)

    @property
    def routed_scale(self) -> float:
        """The factor of the routed experts' combine weights (DeepSeek-V3's
        routed_scaling_factor; 1 elsewhere)."""
        return 1.0

    @property
    def expert_groups(self) -> tuple[int, int]:
        """(groups of experts, groups a token's experts are chosen from): DeepSeek-V3's n_group
        / topk_group group-limited routing; (1, 1): any expert."""
        return (1, 1)

    def _why_no_moe_layer(self) -> str:
        """What leaves every layer dense, for the refusal of a config without MoE layers."""
        return ""

    @property
    def expert_size(self) -> int:
        return self.intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        return True

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def idle_expert_params(self) -> int:
        """Parameters of the routed experts a token does not use: the SwiGLUs (3 x hidden x
        expert_size) of the E - k experts it is not routed to, in every MoE layer. The model's
        parameters less these are its active parameters per token (Mixtral 8x7B: 12.9B)."""
        idle = self.num_local_experts - self.num_experts_per_tok
        return self.num_moe_layers * idle * 3 * self.hidden_size * self.expert_size

    @property
    def qk_norm(self) -> bool:
        return False

    def to_hf(self):
        import transformers

        hf = getattr(transformers, self.hf_config_class)(
            **{k: v for k, v in dataclasses.asdict(self).items() if k not in self.megapar_only}
        )
        hf.architectures = [self.hf_config_class.replace("Config", "ForCausalLM")]
        return hf

    def validate(self, layout: Layout, api: bool = False) -> None:
        super().validate(layout, api)
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                f"{self.num_local_experts} routed experts ({self.experts_key}); route each "
                f"token to at most {self.num_local_experts}"
            )
        if self.moe_router_score not in ROUTER_SCORES:
            raise ConfigError(
                f"moe_router_score {self.moe_router_score!r} is not a router megapar has; use "
                f"'softmax' (Mixtral, Qwen3-MoE) or 'sigmoid' (DeepSeek-V3)"
            )
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ConfigError(
                f"moe_capacity_factor {self.moe_capacity_factor} must be > 0 (or null: dropless)"
            )
        for name in ("router_aux_loss_coef", "moe_z_loss_coef", "moe_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} {getattr(self, name)} must be >= 0")
        if self.num_moe_layers == 0:
            raise ConfigError(
                f"the config has no MoE layer{self._why_no_moe_layer()}; use a llama config instead"
            )


@dataclass
class MixtralConfig(_MoEConfig):
    """Mixtral: Llama with an MoE MLP in every layer (softmax router, top-k renormalised,
    experts of intermediate_size)."""

    model_type = "mixtral"
    hf_config_class = "MixtralConfig"
    rope_theta: float = 1e6
    """Base of the rotary frequencies."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""


@dataclass
class Qwen3MoeConfig(_MoEConfig):
    """Qwen3-MoE: Llama with q / k RMSNorm over each head, MoE MLPs of moe_intermediate_size in
    the layers decoder_sparse_step and mlp_only_layers choose (dense SwiGLU of
    intermediate_size in the others), top-k renormalised when norm_topk_prob."""

    model_type = "qwen3_moe"
    hf_config_class = "Qwen3MoeConfig"
    experts_key: ClassVar[str] = "num_experts, or num_local_experts as transformers 5 writes it"
    moe_intermediate_size: int = 768
    """Size of each routed expert's SwiGLU."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 (and i not in mlp_only_layers)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers with a dense MLP whatever decoder_sparse_step says."""
    norm_topk_prob: bool = False
    """Renormalise the top-k weights to sum to 1."""
    use_sliding_window: bool = False
    """transformers' option; megapar's Qwen3-MoE has no sliding window: must be False."""
    sliding_window: int | None = None
    """Ignored unless use_sliding_window (which megapar refuses)."""
    max_window_layers: int | None = None
    """Ignored unless use_sliding_window (which megapar refuses)."""

    @classmethod
    def from_dict(cls, d: dict):
        d = dict(d)
        if "num_experts" in d:  # the hub's config.json spelling
            d["num_local_experts"] = d.pop("num_experts")
        if d.get("mlp_only_layers") is None:
            d.pop("mlp_only_layers", None)
        return super().from_dict(d)

    @property
    def renormalize_topk(self) -> bool:
        return self.norm_topk_prob

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    @property
    def qk_norm(self) -> bool:
        return True

    def _why_no_moe_layer(self) -> str:
        return (
            f" (of its {self.num_hidden_layers} layers, mlp_only_layers "
            f"{sorted(self.mlp_only_layers)} and decoder_sparse_step {self.decoder_sparse_step} "
            f"leave none sparse)"
        )

    def validate(self, layout: Layout, api: bool = False) -> None:
        super().validate(layout, api)
        if self.use_sliding_window:
            raise ConfigError(
                "use_sliding_window is not supported for qwen3_moe (megapar's sliding window "
                "serves Mistral, Qwen2 and Qwen3); set use_sliding_window false (attention over "
                "the whole sequence)"
            )


@dataclass
class DeepseekV3Config(_MoEConfig):
    """DeepSeek-V3 (transformers' DeepseekV3ForCausalLM, without its multi-token prediction
    layers, which transformers does not build either): Multi-head Latent Attention
    (`megapar.models.deepseek`: low-rank q (q_lora_rank; None: a plain q projection) and a shared
    kv latent of kv_lora_rank with one rotary key part of qk_rope_head_dim for all heads),
    dense SwiGLU layers for the first first_k_dense_replace, then MoE layers: a sigmoid router
    whose e_score_correction_bias chooses (never weighs), group-limited top-k (n_group /
    topk_group: the experts of the topk_group groups with the highest top-2 sums), the weights
    renormalised (norm_topk_prob) and scaled by routed_scaling_factor, and n_shared_experts
    shared experts of moe_intermediate_size each. transformers computes no load-balancing
    loss for it: router_aux_loss_coef defaults to 0."""

    model_type = "deepseek_v3"
    hf_config_class = "DeepseekV3Config"
    experts_key: ClassVar[str] = "n_routed_experts"
    rope_yarn: ClassVar[bool] = True
    zero_ok: ClassVar[frozenset[str]] = frozenset(
        {"first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers"}
    )
    hub_code_keys: ClassVar[frozenset[str]] = frozenset(
        {
            "auto_map",
            "aux_loss_alpha",
            "ep_size",
            "moe_layer_freq",
            "quantization_config",
            "scoring_func",
            "seq_aux",
            "topk_method",
        }
    )
    hub_code_note: ClassVar[str] = (
        "settings of DeepSeek's own code and FP8 weights in the hub's config.json, which megapar "
        "does not read: docs/guides/moe.md"
    )
    megapar_only: ClassVar[frozenset[str]] = _MoEConfig.megapar_only | {
        "num_local_experts",
        "head_dim",
        "mlp_bias",
        "rope_scaling",
        "rope_theta",
    }
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    """The dense layers' SwiGLU size."""
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    num_local_experts: int = 256
    """Routed experts per MoE layer (config.json: n_routed_experts)."""
    num_experts_per_tok: int = 8
    router_aux_loss_coef: float = 0.0
    moe_router_score: str = "sigmoid"
    moe_intermediate_size: int = 2048
    """Size of each routed (and each shared) expert's SwiGLU."""
    n_shared_experts: int = 1
    """Shared experts (one SwiGLU of n_shared_experts x moe_intermediate_size; 0: none)."""
    routed_scaling_factor: float = 2.5
    """Factor of the routed experts' combine weights."""
    n_group: int = 8
    """Groups the routed experts are split into (consecutive ids)."""
    topk_group: int = 4
    """Groups a token's experts are chosen from (by each group's top-2 score sum)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k weights to sum to 1 (before routed_scaling_factor)."""
    first_k_dense_replace: int = 3
    """The first layers with a dense SwiGLU of intermediate_size (the others are MoE)."""
    q_lora_rank: int | None = 1536
    """Rank of q's down projection (q_a_proj, then q_a_layernorm and q_b_proj); None: one
    q_proj."""
    kv_lora_rank: int = 512
    """Rank of the compressed key / value latent (kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj)."""
    qk_nope_head_dim: int = 128
    """Elements of a q / k head without rotary positions (from the latents)."""
    qk_rope_head_dim: int = 64
    """Elements of a q / k head turned by the rotary embedding (k's shared by the heads)."""
    v_head_dim: int = 128
    """Elements of a value head."""
    rope_interleave: bool = True
    """The rotary pairs are interleaved (x0, x1), (x2, x3), ... (transformers' rope_interleave;
    False: the rotate-half halves)."""
    num_nextn_predict_layers: int = 0
    """transformers' multi-token prediction modules (num_mtp_layers): neither transformers'
    DeepseekV3ForCausalLM nor megapar builds them; carried to exported configs."""

    def __post_init__(self) -> None:
        if self.shared_expert_intermediate_size is None and self.n_shared_experts:
            self.shared_expert_intermediate_size = (
                self.n_shared_experts * self.moe_intermediate_size
            )

    @classmethod
    def from_dict(cls, d: dict):
        d = dict(d)
        if "n_routed_experts" in d:  # the hub's config.json spelling
            d["num_local_experts"] = d.pop("n_routed_experts")
        if "num_mtp_layers" in d:
            d["num_nextn_predict_layers"] = d.pop("num_mtp_layers")
        # transformers' derived sizes (head_dim is its qk_rope_head_dim: the rotary's)
        d.pop("qk_head_dim", None)
        d.pop("head_dim", None)
        for key in ("n_group", "topk_group", "first_k_dense_replace"):
            if key in d and d[key] is None:
                d.pop(key)
        return super().from_dict(d)

    def to_hf(self):
        hf = super().to_hf()
        hf.n_routed_experts = self.num_local_experts
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        rope.pop("type", None)
        hf.rope_parameters = rope
        return hf

    @property
    def kv_heads(self) -> int:
        """Every head has its own keys and values (MLA expands them from the latent)."""
        return self.num_attention_heads

    @property
    def head_size(self) -> int:
        """Elements of a q / k head (qk_nope_head_dim + qk_rope_head_dim)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def mla(self) -> bool:
        return True

    @property
    def renormalize_topk(self) -> bool:
        return self.norm_topk_prob

    @property
    def router_bias(self) -> bool:
        return True

    @property
    def routed_scale(self) -> float:
        return self.routed_scaling_factor

    @property
    def expert_groups(self) -> tuple[int, int]:
        return (self.n_group, self.topk_group)

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    def _why_no_moe_layer(self) -> str:
        return (
            f" (first_k_dense_replace {self.first_k_dense_replace} makes all "
            f"{self.num_hidden_layers} layers dense)"
        )

    def validate(self, layout: Layout, api: bool = False) -> None:
        super().validate(layout, api)
        e, groups, chosen = self.num_local_experts, self.n_group, self.topk_group
        if e % groups or chosen > groups:
            raise ConfigError(
                f"n_group {groups} / topk_group {chosen}: the {e} routed experts split into "
                f"n_group equal groups and a token chooses from topk_group <= n_group of them; "
                f"set n_group to a divisor of {e} and topk_group to at most n_group"
            )
        if self.num_experts_per_tok > chosen * (e // groups) or e // groups < 2:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} needs at least that many "
                f"experts in its topk_group {chosen} groups of {e // groups} (and groups of at "
                f"least 2 experts); raise topk_group or lower n_group"
            )
        if self.moe_router_score != "sigmoid":
            raise ConfigError(
                f"moe_router_score {self.moe_router_score!r}: DeepSeek-V3's router is "
                f"'sigmoid'; remove moe_router_score"
            )
        size = self.n_shared_experts * self.moe_intermediate_size
        if (self.shared_expert_intermediate_size or 0) != size:
            raise ConfigError(
                f"shared_expert_intermediate_size {self.shared_expert_intermediate_size} is "
                f"DeepSeek-V3's n_shared_experts x moe_intermediate_size ({size}); remove it"
            )


MOE_SUPPORTED_DEFAULTS: dict[str, dict] = {
    "mixtral": {
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
    },
    "deepseek_v3": {
        "pretraining_tp": 1,
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
    },
    "qwen3_moe": {
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
    },
}
"""transformers settings megapar does not implement, with the one value it does."""
