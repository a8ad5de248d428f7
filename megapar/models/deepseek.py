"""DeepSeek-V3: the Llama-layout decoder (`megapar.models.llama`) with Multi-head Latent
Attention (MLA) and DeepSeek's MoE layers (numerically transformers' DeepseekV3ForCausalLM,
without multi-token prediction, which transformers does not build either).

MLA, per layer, on the normed hidden states x [b, s, H]:

- q: q_b(RMSNorm(q_a(x))) through a rank-q_lora_rank latent (or one q projection where
  q_lora_rank is None), [heads, qk_nope_head_dim + qk_rope_head_dim] per token;
- kv_a(x) = [c, k_rope]: a latent c of kv_lora_rank, RMS-normed, and one rotary key part of
  qk_rope_head_dim that every head shares; kv_b(c) = [k_nope, v] per head (qk_nope_head_dim,
  v_head_dim);
- q's and k's rope parts are turned by the rotary embedding of qk_rope_head_dim (transformers'
  rope_interleave: the pairs (x0, x1), (x2, x3), ... taken apart into halves first, q's and k's
  alike, so the dot products are the interleaved rotation's); k = [k_nope, k_rope];
- causal attention with the softmax scale (qk head size)^-1/2, times YaRN's mscale(factor,
  mscale_all_dim)^2 under a YaRN rope_scaling; the output projection of heads x v_head_dim.

Tensor parallelism splits the heads: q_b (or q) and kv_b are column-parallel by heads, the
output projection row-parallel. The down projections (q_a, kv_a) and their norms are whole on
every tp rank and computed there on the rank's tokens; their outputs (the q latent, the normed
kv latent and the rotary key part: q_lora_rank + kv_lora_rank + qk_rope_head_dim numbers a
token) enter the tp region together, as one tensor: copied (its gradient, each rank's heads'
share, all-reduced in the backward, so every rank's down projections get the whole gradient),
or under sequence parallelism all-gathered along the sequence (the gradient reduce-scattered;
each rank's down projections see only its slice of the tokens, and their gradients are summed
over tp once a step as every replicated parameter's under SP). So the tp collective of the
attention's input carries the latent, not the hidden states. With --sp-regather q_b and kv_b
read their columns of it through `tensor_parallel.regather.split_keeping_shard`: they keep this
rank's slice of the whole tensor for the backward (once between them) and all-gather it once
there, as the other column-parallel layers do their inputs.

Context parallelism runs the core through `megapar.context_parallel` (`LayerAttention`: the
ring by default, every head having its own keys and values; the all-gather or the all-to-all
by --cp-comm-type), as Llama's attention does: a cp rank projects its tokens' latents, turns
their rotary parts by their global positions, and the kernels see the whole sequence's keys.
The ring and the all-gather send k and v as one flat buffer, v at its own head size (a K/V
block carries heads x (qk + v_head_dim) numbers a token), and zero-pad v to the qk head size
only around each fused kernel call, which takes one head size, cutting the output and dV back;
the all-to-all sends q, k and v in one tensor, so for it v is zero-padded first and the output
cut back, as for SDPA. The cp kernels take one dtype: under autocast k is fp32
at tp 1 (its rotary part is the latent's, which the norms' fp32 weights make fp32; at tp > 1
the latents enter the tp region in the autocast dtype, `to_wire_dtype`) and is cast to q's, as
SDPA's autocast casts it at cp 1. Their softmax scale is the head size's (qk^-1/2); a YaRN
mscale factor on it is applied to q before them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapar.context_parallel import LayerAttention, method_for
from megapar.mesh import Mesh
from megapar.models.blocks import checkpoint_for, fork_for
from megapar.models.kv_cache import KVCache
from megapar.models.llama import (
    Llama,
    RMSNorm,
    Rotary,
    apply_rotary,
    rope_softmax_factor,
    rotary_angles,
)
from megapar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, divide
from megapar.tensor_parallel.partition import set_partition
from megapar.tensor_parallel.regather import split_keeping_shard


class WholeLinear(nn.Module):
    """x W^T with W [out, in] whole on every tp rank (MLA's down projections)."""

    def __init__(self, in_features: int, out_features: int, device):
        super().__init__()
        self.weight = set_partition(
            nn.Parameter(torch.empty(out_features, in_features, device=device)),
            None,
            (out_features, in_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with its rotary pairs interleaved (x0, x1, x2, ...) as halves [x0, x2, ... |
    x1, x3, ...], the rotate-half layout (transformers' apply_rotary_pos_emb_interleave)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    """Multi-head Latent Attention with this tp rank's heads (see the module docstring).

    Takes `LlamaAttention`'s arguments; `window` must be None (DeepSeek-V3 has no sliding
    window). With `kv_cache` set (generation) the cache holds this rank's heads' expanded keys
    and values, as a Llama's."""

    def __init__(self, config, mesh: Mesh, rotary: Rotary, tracker, window=None, masks=None):
        super().__init__()
        assert window is None  # DeepSeek-V3 has no sliding window
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.q_rank = config.q_lora_rank
        self.qk_dim = self.nope + self.rope
        self.local_heads = divide(heads, mesh.tp, "attention heads")
        d = mesh.device
        name = "attention heads x head size"
        self.q: ColumnParallelLinear | None = None
        self.q_a: WholeLinear | None = None
        self.q_a_norm: RMSNorm | None = None
        self.q_b: ColumnParallelLinear | None = None
        if self.q_rank is None:
            self.q = ColumnParallelLinear(hidden, heads * self.qk_dim, mesh, bias=False, name=name)
        else:
            self.q_a = WholeLinear(hidden, self.q_rank, d)
            self.q_a_norm = RMSNorm(self.q_rank, 1e-6, d)  # transformers' default eps
            self.q_b = ColumnParallelLinear(
                self.q_rank, heads * self.qk_dim, mesh, bias=False, name=name
            )
        self.kv_a = WholeLinear(hidden, self.kv_rank + self.rope, d)
        self.kv_a_norm = RMSNorm(self.kv_rank, 1e-6, d)
        self.kv_b = ColumnParallelLinear(
            self.kv_rank, heads * (self.nope + self.v_dim), mesh, bias=False, name=name
        )
        self.proj = RowParallelLinear(heads * self.v_dim, hidden, mesh, bias=False, name=name)
        self.interleave = config.rope_interleave
        self.softmax_factor = rope_softmax_factor(config)
        self.scaling = self.qk_dim**-0.5 * self.softmax_factor
        self.rotary, self.tracker = rotary, tracker
        self.window = None
        self.dropout = config.attention_dropout
        self.recompute_core = False
        self.cp = mesh.cp
        # every head its own keys and values (kv heads = query heads): the ring by default
        self.context_parallel = (
            LayerAttention(mesh, True, method_for(heads, heads)) if mesh.cp > 1 else None
        )
        self.kv_cache: KVCache | None = None  # generation's (`megapar.models.kv_cache`)

    def _core(self, q, k, v, docs=None):
        """Causal attention of this rank's heads (within each packed document of `docs`);
        under cp over the whole sequence, by `megapar.context_parallel`. v narrower than q / k
        is zero-padded to their size and the output cut back where one tensor or kernel
        takes them together: SDPA's fused kernels (FlashAttention, the CPU's) take one head
        size, and without them it would keep the s x s probabilities for the backward; the
        cp all-to-all sends q, k and v in one tensor. The ring and the all-gather send v at
        its own size (k and v in one flat buffer) and pad it only around each fused kernel
        call (`megapar.context_parallel.kernels`)."""
        dropout = self.dropout if self.training else 0.0
        width = v.shape[-1]
        cp = self.context_parallel
        if width < q.shape[-1] and (cp is None or cp.method == "a2a"):
            v = F.pad(v, (0, q.shape[-1] - width))
        with fork_for(self.tracker, dropout):  # this rank's heads: the per-tp-rank stream
            if cp is not None:
                # under autocast k is fp32 at tp 1 (its rotary part comes from the latent,
                # which the fp32 norm weight's product makes fp32; at tp > 1 the latent enters
                # the tp region in the autocast dtype): the cp kernels take one dtype, the
                # activations' (what SDPA's autocast casts k to), as they take one head size
                k, v = k.to(q.dtype), v.to(q.dtype)
                # the ring and the all-gather keep v for the backward: in its own storage, not
                # as a view of kv_b's output, which would keep k_nope's columns alive with it
                v = v.contiguous()
                # the cp kernels' scale is the head size's: YaRN's mscale factor goes on q
                if self.softmax_factor != 1.0:
                    q = q * self.softmax_factor
                out = cp(q, k, v, dropout_p=dropout, documents=docs)
                return out[..., :width]
            bias = None if docs is None else docs.bias(None, q.dtype)
            if bias is not None:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, dropout_p=dropout, scale=self.scaling
                )
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=self.scaling
                )
        return out[..., :width]

    def forward(self, x: torch.Tensor, docs=None) -> torch.Tensor:
        """`docs`: the micro-batch's `megapar.models.documents.Documents` (None: causal over
        the whole sequence, positions from 0)."""
        kv_latent, k_rot = self.kv_a(x).split([self.kv_rank, self.rope], dim=-1)
        parts = [self.kv_a_norm(kv_latent), k_rot]
        if self.q_a is not None and self.q_a_norm is not None:
            parts.insert(0, self.q_a_norm(self.q_a(x)))
        # one tp region for the latents (under SP: the whole sequence, gathered)
        latent = self.kv_b.enter(torch.cat(parts, dim=-1))
        b, s, _ = latent.shape
        if self.q_b is not None:
            assert self.q_rank is not None
            q_latent, kv_latent, k_rot = split_keeping_shard(
                latent, [self.q_rank, self.kv_rank, self.rope]
            )
            q = self.q_b(q_latent, entered=True)
        else:
            assert self.q is not None
            kv_latent, k_rot = split_keeping_shard(latent, [self.kv_rank, self.rope])
            q = self.q(x)
        q = q.view(b, s, self.local_heads, self.qk_dim).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv = self.kv_b(kv_latent, entered=True).view(b, s, self.local_heads, -1).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.view(b, 1, s, self.rope)
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        cache = self.kv_cache
        cos, sin = rotary_angles(self.rotary, s, self.cp, x.device, cache, docs)
        q = torch.cat([q_pass, apply_rotary(q_rot, cos, sin)], dim=-1)
        k_rot = apply_rotary(k_rot, cos, sin)
        k = torch.cat([k_pass, k_rot.expand(b, self.local_heads, s, self.rope)], dim=-1)
        if cache is not None:
            out = cache.attend(q, k, v, scale=self.scaling)
        elif self.recompute_core and torch.is_grad_enabled():
            dropout = self.dropout if self.training else 0.0
            out = checkpoint_for(self.tracker, dropout, self._core, q, k, v, docs)
        else:
            out = self._core(q, k, v, docs)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.v_dim))


class DeepseekV3(Llama):
    """DeepSeek-V3 causal LM, or one pipeline stage of it: `Llama` with `MLAttention` (its MoE
    layers after the first first_k_dense_replace are the config's, `megapar.models.moe`)."""

    attention = MLAttention
