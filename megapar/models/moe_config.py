"""Configs of the mixture-of-experts Llama variants: Mixtral and Qwen3-MoE.

Both are `LlamaConfig`s (attention, norms, rotary as Llama) whose MLPs are MoE layers
(`megapar.models.moe`). Field names are transformers' `MixtralConfig` / `Qwen3MoeConfig`'s, so
their config.json files load as they are; the `moe_*` fields and
`shared_expert_intermediate_size` are megapar's own (never exported).
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
    experts_key: ClassVar[str] = "num_experts"
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
    "qwen3_moe": {
        "add_cross_attention": False,
        "is_encoder_decoder": False,
        "is_decoder": False,
        "chunk_size_feed_forward": 0,
        "pruned_heads": {},
    },
}
"""transformers settings megapar does not implement, with the one value it does."""
