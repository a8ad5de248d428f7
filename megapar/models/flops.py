"""Matmul FLOPs of megapar's models per token, counted from the config as the models build them.

The one count behind megapar-train's logged MFU and megapar-plan's step time and MFU. A
multiply-add is 2 FLOPs; only matrix products are counted (embedding lookups, norms, biases,
activations, softmax and the loss are not matmuls). Per token and block:

- GPT-2 / BERT: the fused q/k/v projection (3 h^2), the output projection (h^2) and the MLP's
  two (2 h f): 2 (4 h^2 + 2 h f);
- Llama: q and the output projection (h x heads x head size each), k and v (h x kv heads x
  head size each: grouped-query attention), SwiGLU's gate, up and down (3 h f);
- DeepSeek-V3's Multi-head Latent Attention: its down projections (whole on every tp rank), q's
  up projection, kv_b and the output projection (`mla_widths`);
- attention's core, q k^T and the probabilities times v, over `seq_len` keys: 4 s x heads x
  head size (the whole s x s square, as Megatron counts it, also for causal models; MLA: 2 s x
  heads x (qk head size + v head size)).

The head: the logits (h x vocabulary; BERT's MLM head adds its h x h transform). The backward
is twice the forward (the input gradient and, for the weights, their gradient). Per tp rank
(`tp` > 1) each product is this rank's share as megapar splits it: the padded vocabulary's
shard, BERT's MLM transform whole on every rank, a grouped-query model's k / v heads whole when
tp does not divide them (a rank projects the kv heads its query heads use).
"""

from __future__ import annotations

from dataclasses import dataclass

from megapar.models.config import LLAMA_TYPES
from megapar.tensor_parallel.partition import local_size


@dataclass(frozen=True)
class MatmulFlops:
    """Forward matmul FLOPs per token of one tp rank."""

    block: float
    """One block's products with weights (projections and MLP): a zero-bubble schedule's
    weight-gradient pass (W) repeats them, the attention core has none."""
    attention: float
    """One block's attention core (q k^T and attention over v) for the sequence's keys."""
    head: float
    """The LM head (BERT: the MLM transform and the decoder); 0 for the embedding: lookups."""

    def layer(self) -> float:
        """One block's forward, attention core included."""
        return self.block + self.attention


def heads(config) -> int:
    """Query heads per block."""
    return config.n_head if hasattr(config, "n_head") else config.num_attention_heads


def head_size(config) -> int:
    """Elements of one attention head."""
    return getattr(config, "head_size", config.hidden_size // heads(config))


def kv_heads_per_rank(config, tp: int) -> int:
    """Key (as many value) heads one tp rank projects, on the busiest rank: its share when tp
    divides the kv heads, else the kv heads its query heads use (`LlamaAttention`)."""
    a, kv = heads(config), getattr(config, "kv_heads", heads(config))
    if kv % tp == 0:
        return kv // tp
    local, group = a // tp, a // kv
    return max((r * local + local - 1) // group - (r * local) // group + 1 for r in range(tp))


def mlp_widths(config, etp: int = 1) -> tuple[float, float]:
    """(SwiGLU width split over tp, width every tp rank computes whole) of the average layer:
    the dense MLP's; a mixture of experts' active width instead (k routed experts, replicated on
    every tp rank, or with `etp` > 1 split over tp, plus the tp-split shared experts; the
    router's E outputs count as E / 3, whole)."""
    moe = getattr(config, "num_moe_layers", 0)
    if not moe:
        return float(config.ffn_size), 0.0
    layers = config.num_layers
    shared = config.shared_expert_intermediate_size or 0
    split = (layers - moe) * config.intermediate_size + moe * shared
    experts = moe * config.num_experts_per_tok * config.expert_size
    router = moe * config.num_local_experts / 3
    if etp > 1:
        return (split + experts) / layers, router / layers
    return split / layers, (experts + router) / layers


def mla_widths(config, tp: int = 1) -> float:
    """Multiply-adds per token of one tp rank's Multi-head Latent Attention projections
    (DeepSeek-V3): the down projections q_a (h x q_lora_rank) and kv_a (h x (kv_lora_rank +
    qk_rope_head_dim)), whole on every rank, and this rank's heads' share of q_b (q_lora_rank,
    or h with a plain q projection, x heads x qk head size), kv_b (kv_lora_rank x heads x
    (qk_nope_head_dim + v_head_dim)) and the output projection (heads x v_head_dim x h)."""
    h, a, qk, v = config.hidden_size, heads(config), head_size(config), config.v_head_dim
    q_in = config.q_lora_rank or h
    down = h * (config.q_lora_rank or 0) + h * (config.kv_lora_rank + config.qk_rope_head_dim)
    per_head = q_in * qk + config.kv_lora_rank * (config.qk_nope_head_dim + v) + v * h
    return down + a * per_head / tp


def matmul_flops(
    config, seq_len: int, tp: int = 1, padded: bool = True, etp: int = 1
) -> MatmulFlops:
    """Forward matmul FLOPs per token of one tp rank of `config`'s model with `seq_len` keys
    per query; `padded=False`: the model's own vocabulary, not the shard padded for tp (what
    MFU counts, at tp 1); `etp`: the routed experts split over tp (`mlp_widths`)."""
    h, f, d, a = config.hidden_size, config.ffn_size, head_size(config), heads(config)
    attention = 4 * seq_len * a * d / tp
    if getattr(config, "mla", False):
        split, whole = mlp_widths(config, etp)
        block = 2 * (mla_widths(config, tp) + 3 * h * split / tp + 3 * h * whole)
        attention = 2 * seq_len * a * (d + config.v_head_dim) / tp
    elif config.model_type in LLAMA_TYPES:
        kv = kv_heads_per_rank(config, tp) * d
        split, whole = mlp_widths(config, etp)
        block = 2 * (2 * h * a * d / tp + 2 * h * kv + 3 * h * split / tp + 3 * h * whole)
    else:
        block = 2 * (4 * h * h + 2 * h * f) / tp
    vocab = (
        local_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
        if padded
        else config.vocab_size / tp
    )
    head = 2 * h * vocab + (2 * h * h if config.model_type == "bert" else 0)
    return MatmulFlops(block, attention, head)


def training_flops_per_token(config, seq_len: int) -> float:
    """The model's FLOPs per trained token, forward and backward, without recomputation: 3 x
    (layers x (block + attention) + head) of `matmul_flops` at tp 1 and the unpadded
    vocabulary. MFU's numerator (megapar-train's log, megapar-plan)."""
    f = matmul_flops(config, seq_len, 1, padded=False)
    return 3 * (config.num_layers * f.layer() + f.head)
