"""Llama-family decoder (numerically the same model as transformers' LlamaForCausalLM, and as
its Qwen3ForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, MixtralForCausalLM and
Qwen3MoeForCausalLM for their configs).

RMSNorm, rotary position embeddings (rope_theta; linear or Llama 3 frequency scaling), a SwiGLU
MLP and grouped-query attention, an own or a tied LM head; no biases but Qwen2's on q, k and v
(split with their rows), and Qwen3's RMSNorm over each head's q and k. Built from the same tp
layers as GPT-2, and like GPT-2 one class is the whole model or any pipeline stage of it.

Tensor parallelism keeps whole heads on each rank. Query heads are split across tp (column-
parallel q; the output projection is row-parallel). Key/value heads are split too when tp divides
num_key_value_heads (each rank holds exactly the kv heads its query heads use); otherwise k and v
stay whole on every rank (replicated, tp_dim None), each rank projects only the kv heads its
query heads need, and their weight gradient is summed over tp once per step (with the
sequence-parallel ones: `sync_sequence_parallel_grads`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megapar.context_parallel import LayerAttention, method_for
from megapar.context_parallel import positions as cp_positions
from megapar.mesh import Mesh
from megapar.models.blocks import activation, checkpoint_for, fork_for, run_layers
from megapar.models.config import LlamaConfig
from megapar.models.documents import document_positions, stage_documents
from megapar.models.kv_cache import KVCache, window_mask
from megapar.models.moe import MoE
from megapar.models.stage import StageModel
from megapar.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    divide,
    initialize,
    normal_init,
)
from megapar.tensor_parallel.layers import regathers
from megapar.tensor_parallel.mappings import to_wire_dtype
from megapar.tensor_parallel.partition import local_size, mark_replicated, set_partition
from megapar.tensor_parallel.regather import regathered_linear, shard_of
from megapar.tensor_parallel.sequence_parallel import (
    gather_from_sequence_parallel_region,
)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor of a context `scale` (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(config: LlamaConfig) -> float:
    """The factor of the rotary cos / sin tables: YaRN's attention_factor (given, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim)); 1 for the other scalings."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = (
        scaling["factor"],
        scaling.get("mscale"),
        scaling.get("mscale_all_dim"),
    )
    if mscale and all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    return _yarn_mscale(factor)


def rope_softmax_factor(config: LlamaConfig) -> float:
    """The factor of the attention's softmax scale from the rotary scaling: mscale(factor,
    mscale_all_dim)^2 where a scaled rope gives mscale_all_dim (DeepSeek-V3's YaRN,
    transformers' yarn_apply_mscale); else 1."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    all_dim = scaling.get("mscale_all_dim") or 0
    if kind == "default" or not all_dim:
        return 1.0
    return _yarn_mscale(scaling["factor"], all_dim) ** 2


def _yarn_frequencies(config: LlamaConfig, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies (transformers' _compute_yarn_parameters): interpolated by
    `factor` below the beta_slow correction dimension, kept above beta_fast's, a linear ramp
    between."""
    scaling, base = config.rope_scaling or {}, config.rope_theta
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_frequencies(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the config's scaling applied."""
    dim = config.rope_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn_frequencies(config, dim)
    if kind != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos / sin tables for the positions of this rank's tokens of a sequence of `seq_len`:
    0..seq_len-1, or its cp chunks' global positions (fp32, cached per length and device).

    The frequencies are computed on the CPU (as transformers does) and moved to `device` once,
    when the model is built; the tables are computed where they are used, so a step never
    copies host data to the device (a copy that would make a GPU's host wait)."""

    def __init__(
        self, config: LlamaConfig, cp: int = 1, cp_rank: int = 0, device: torch.device | str = "cpu"
    ):
        self.inv_freq = rope_frequencies(config).to(device)
        self.scale = rope_attention_factor(config)
        """The factor of the cos / sin tables (YaRN's attention_factor; 1 elsewhere)."""
        self.cp, self.cp_rank = cp, cp_rank
        self._cache: dict = {}

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [..., rope dim] of float `positions` [...] (on the frequencies' device)."""
        freqs = positions[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.scale, emb.sin() * self.scale

    def __call__(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._cache:
            # the frequencies are on the device they were built on: no copy
            positions = cp_positions(seq_len, self.cp, self.cp_rank, device).float()
            self._cache = {key: self.tables(positions)}
        return self._cache[key]


AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
"""Device types autocast knows (torch raises on others, such as the dry run's "meta")."""


class WindowMasks:
    """The additive masks [s, s] of sliding-window causal attention (0: attend, -inf: not), in
    the attention's dtype, made on the device from arange (no host data copied to it) and
    cached per length, window, dtype and device: a step makes each once, and every layer's
    attention (and what its backward keeps) shares the one tensor, where SDPA would convert a
    boolean mask into a new one per call. The query at position i attends to the keys at
    i - window + 1 .. i, transformers' `sliding_window_causal_mask_function` (key > query -
    window, key <= query)."""

    def __init__(self) -> None:
        self._cache: dict = {}

    def __call__(
        self, seq_len: int, window: int | None, dtype: torch.dtype, device
    ) -> torch.Tensor | None:
        """The mask of a sequence of `seq_len`, or None where the window cuts nothing (no
        window, or one no shorter than the sequence: plain causal attention)."""
        if window is None or window >= seq_len:
            return None
        key = (seq_len, window, dtype, str(device))
        if key not in self._cache:
            if len(self._cache) >= 8:  # lengths of other batches (evaluation, generation)
                self._cache.clear()
            keep = window_mask(seq_len, seq_len, window, device)
            self._cache[key] = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(
                ~keep, float("-inf")
            )
        return self._cache[key]


def rotary_angles(
    rotary: Rotary, s: int, cp: int, device, cache: KVCache | None = None, docs=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of an attention's `s` tokens (the whole sequence under SP, this cp rank's
    under cp): their global positions; each token's position in its document (`docs` with
    reset positions); in generation (`cache`) the positions after the cached ones, or in a
    left-padded batch each row's [b, 1, s, d], from its first real token."""
    if cache is None and docs is not None and docs.cos is not None:
        return docs.cos, docs.sin
    if cache is None:
        return rotary(s * cp, device)
    cos, sin = rotary(cache.length + s, device)
    if cache.pads is None:
        return cos[cache.length :], sin[cache.length :]
    positions = cache.positions(s, device)
    return cos[positions][:, None], sin[positions][:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, heads, s, d] by the position angles (the rotate-half convention)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class ReplicatedHeads(nn.Module):
    """A projection kept whole on every tp rank; this rank computes output rows [start, stop).

    Used for k / v when tp does not divide the kv heads. The weight's gradient is summed over
    the tp group (each rank only sees its query heads' share), so the copies stay equal.
    """

    replicated_projection = True
    """`--fp8` cannot convert it (`fp8_convert.REPLICATED`): a tp at which it is one of the
    float8 linears is refused."""
    heads: int | None = None
    """The kv heads it holds (set by its attention): a tp dividing them splits it
    (`fp8_convert.layout_problem`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rows: tuple[int, int],
        mesh: Mesh,
        bias: bool = False,
    ):
        super().__init__()
        self.group = mesh.tp_group
        self.rows = rows
        self.sequence_parallel = mesh.sequence_parallel and mesh.tp > 1
        self.weight = set_partition(
            nn.Parameter(torch.empty(out_features, in_features, device=mesh.device)),
            None,
            (out_features, in_features),
        )
        self.bias = (
            set_partition(
                nn.Parameter(torch.empty(out_features, device=mesh.device)), None, (out_features,)
            )
            if bias
            else None
        )
        # this rank's gradient covers only its rows' share: summed over tp once per step,
        # with the sequence-parallel ones (`sync_sequence_parallel_grads`), not per micro-batch
        for p in (self.weight, self.bias):
            if p is not None:
                p.sequence_parallel = True  # type: ignore[attr-defined]  # a tag on the tensor

    def forward(self, x: torch.Tensor, entered: bool = False) -> torch.Tensor:
        """`entered`: x is already the tp region's input (`ColumnParallelLinear.enter` of the
        attention's q projection); this layer only reads its rows of the whole weight."""
        weight = self.weight[self.rows[0] : self.rows[1]]
        bias = None if self.bias is None else self.bias[self.rows[0] : self.rows[1]]
        if not entered:
            x = to_wire_dtype(x, self.group)  # under autocast in its dtype, as `enter`
            x = (
                gather_from_sequence_parallel_region(x, self.group)
                if self.sequence_parallel
                else copy_to_tp_region(x, self.group)
            )
        shard = shard_of(x)  # --sp-regather: keep only this rank's slice of X
        if shard is not None and regathers(None, weight):
            return regathered_linear(x, weight, bias, shard)
        return F.linear(x, weight, bias)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary q / k and this rank's query heads.

    Under context parallelism the tokens are this cp rank's (rotated by their global positions)
    and the core is `megapar.context_parallel` attention with the kv heads unexpanded: an
    all-gather of K/V with grouped-query heads (few kv heads: little to gather, as in Llama 3),
    the ring with as many kv heads as query heads (`method_for`; `set_cp_comm` may choose
    another). With `kv_cache` set
    (generation) `x` holds only the new positions, rotated by their absolute positions (after
    the cached ones; in a left-padded batch each row's from its first real token), and the
    cache holds this rank's kv heads (`megapar.models.kv_cache`).

    `window` (the config's `layer_window` of this layer; None: none): each query attends to
    the `window` keys up to itself, by an explicit mask (`WindowMasks`) where it cuts the
    sequence, by SDPA's fused causal path where it does not."""

    def __init__(
        self,
        config: LlamaConfig,
        mesh: Mesh,
        rotary: Rotary,
        tracker,
        window: int | None = None,
        masks: WindowMasks | None = None,
    ):
        super().__init__()
        self.window, self.masks = window, masks or WindowMasks()
        hidden, hd = config.hidden_size, config.head_size
        n_q, n_kv = config.num_attention_heads, config.kv_heads
        self.head_dim, self.local_heads = hd, divide(n_q, mesh.tp, "attention heads")
        group = n_q // n_kv  # query heads per kv head
        first_q = mesh.tp_rank * self.local_heads
        bias = config.qkv_bias  # Qwen2: q, k and v biases, split (or kept whole) as their rows
        self.q = ColumnParallelLinear(
            hidden, n_q * hd, mesh, bias=bias, name="attention heads x head size"
        )
        if n_kv % mesh.tp == 0:
            first_kv = mesh.tp_rank * (n_kv // mesh.tp)
            self.k: ColumnParallelLinear | ReplicatedHeads = ColumnParallelLinear(
                hidden, n_kv * hd, mesh, bias=bias, name="kv heads x head size"
            )
            self.v: ColumnParallelLinear | ReplicatedHeads = ColumnParallelLinear(
                hidden, n_kv * hd, mesh, bias=bias, name="kv heads x head size"
            )
        else:
            first_kv = first_q // group
            last_kv = (first_q + self.local_heads - 1) // group
            rows = (first_kv * hd, (last_kv + 1) * hd)
            self.k = ReplicatedHeads(hidden, n_kv * hd, rows, mesh, bias)
            self.v = ReplicatedHeads(hidden, n_kv * hd, rows, mesh, bias)
        self.q.heads, self.k.heads, self.v.heads = n_q, n_kv, n_kv  # what a tp must divide
        # local query head j attends with local kv head kv_index[j]
        self.kv_index = [(first_q + j) // group - first_kv for j in range(self.local_heads)]
        local_kv = max(self.kv_index) + 1
        per_kv = self.local_heads // local_kv
        self.grouped = local_kv < self.local_heads and self.kv_index == [
            j // per_kv for j in range(self.local_heads)
        ]
        """Each local kv head serves the same number of consecutive query heads: FlashAttention
        (SDPA's enable_gqa, bf16 / fp16 on CUDA) reads k / v unexpanded. Otherwise (other
        devices and dtypes, or a replicated kv head split unevenly across tp ranks) k / v are
        expanded per query head."""
        self._first_q, self._group, self._first_kv = first_q, group, first_kv
        self._kv_index_on: dict[str, torch.Tensor] = {}  # kv_index as a tensor per device
        self.proj = RowParallelLinear(
            n_q * hd, hidden, mesh, bias=False, name="attention heads x head size"
        )
        self.proj.heads = n_q
        self.rotary, self.tracker = rotary, tracker
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:  # Qwen3: RMSNorm over each head's q and k
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, mesh.device)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, mesh.device)
            for norm in (self.q_norm, self.k_norm):  # shared by the heads of every tp rank:
                # a rank's gradient is its heads' share, summed over tp once per step
                norm.weight.sequence_parallel = mesh.tp > 1  # type: ignore[attr-defined]
        self.dropout = config.attention_dropout
        self.recompute_core = False
        self.cp = mesh.cp
        self.context_parallel = (
            LayerAttention(mesh, True, method_for(n_q, n_kv)) if mesh.cp > 1 else None
        )
        if self.context_parallel is not None:  # the all-to-all's static kv-head plan
            self.context_parallel.kv_map = self.kv_index
        self.kv_cache: KVCache | None = None  # generation's (`megapar.models.kv_cache`)
        if mesh.device.type != "meta" and self.kv_index != list(range(local_kv)):
            self._index_on(mesh.device)

    def _index_on(self, device) -> torch.Tensor:
        """`kv_index` as a tensor on `device`, made once per device from arange (no host data
        copied to it); made for the mesh's device when the layer is built, so a compiled block
        only reads it (`--compile`: a dict filled inside the block would compile it again)."""
        index = self._kv_index_on.get(str(device))
        if index is None:
            head_ids = torch.arange(self.local_heads, device=device)
            index = self._kv_index_on[str(device)] = (
                torch.div(self._first_q + head_ids, self._group, rounding_mode="floor")
                - self._first_kv
            )
        return index

    def _core(self, q, k, v, index=None, docs=None):
        """`docs`: the micro-batch's packed documents (`megapar.models.documents.Documents`:
        attention within each, this layer's window ANDed), or None."""
        dropout = self.dropout if self.training else 0.0
        with fork_for(self.tracker, dropout):  # this rank's heads: the per-tp-rank stream
            if self.context_parallel is not None:
                return self.context_parallel(
                    q, k, v, kv_index=index, dropout_p=dropout, window=self.window, documents=docs
                )
            bias = None if docs is None else docs.bias(self.window, q.dtype)
            mask = (
                bias if bias is not None else self.masks(q.shape[2], self.window, q.dtype, q.device)
            )
            if mask is not None:  # the window cuts the sequence: SDPA with the explicit mask
                if index is not None:
                    k, v = k.index_select(1, index), v.index_select(1, index)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
            if self.grouped and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
                # FlashAttention reads grouped k / v as they are; SDPA's other kernels do not
                # take enable_gqa (fp32 would fall back to the unfused one), so elsewhere k / v
                # are expanded below
                return F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=True
                )
            if index is not None:
                k, v = k.index_select(1, index), v.index_select(1, index)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    def forward(self, x: torch.Tensor, docs=None) -> torch.Tensor:
        """`docs`: the micro-batch's `megapar.models.documents.Documents` (None: causal over
        the whole sequence, positions from 0)."""
        x = self.q.enter(x)  # one region for q, k and v (under SP: the whole sequence, gathered)
        b, s, _ = x.shape

        def heads(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        cache = self.kv_cache
        cos, sin = rotary_angles(self.rotary, s, self.cp, x.device, cache, docs)
        q, k = heads(self.q(x, entered=True)), heads(self.k(x, entered=True))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = heads(self.v(x, entered=True))
        index = None if self.kv_index == list(range(k.shape[1])) else self._index_on(k.device)
        if cache is not None:
            out = cache.attend(q, k, v, index)
        elif self.recompute_core and torch.is_grad_enabled():
            dropout = self.dropout if self.training else 0.0
            out = checkpoint_for(self.tracker, dropout, self._core, q, k, v, index, docs)
        else:
            out = self._core(q, k, v, index, docs)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)): gate / up column-parallel, down row-parallel."""

    def __init__(self, config: LlamaConfig, mesh: Mesh):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate = ColumnParallelLinear(h, f, mesh, bias=False, name="FFN size")
        self.up = ColumnParallelLinear(h, f, mesh, bias=False, name="FFN size")
        self.down = RowParallelLinear(f, h, mesh, bias=False, name="FFN size")
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gate.enter(x)  # one region for gate and up
        return self.down(self.act(self.gate(x, entered=True)) * self.up(x, entered=True))


class LlamaBlock(nn.Module):
    """x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)); the MLP is a mixture of experts
    (`MoE`) in the layers an MoE config (Mixtral, Qwen3-MoE) says."""

    def __init__(
        self,
        config: LlamaConfig,
        mesh: Mesh,
        rotary: Rotary,
        tracker,
        index: int = 0,
        masks: WindowMasks | None = None,
        attention: type[nn.Module] | None = None,
    ):
        """`attention`: the attention's class (None: `LlamaAttention`; DeepSeek-V3's MLA)."""
        super().__init__()
        eps, d = config.rms_norm_eps, mesh.device
        self.attn_norm = RMSNorm(config.hidden_size, eps, d)
        window = config.layer_window(index)
        self.attn = (attention or LlamaAttention)(config, mesh, rotary, tracker, window, masks)
        self.mlp_norm = RMSNorm(config.hidden_size, eps, d)
        moe = getattr(config, "is_moe_layer", None)
        self.mlp: SwiGLU | MoE = MoE(config, mesh) if moe and moe(index) else SwiGLU(config, mesh)

    def forward(self, x: torch.Tensor, mask=None, docs=None) -> torch.Tensor:
        """`mask` [b, s] (this rank's tokens; None: no padding): an MoE MLP routes no padding.
        Causal attention keeps right-padding out of the tokens before it. `docs`: the
        micro-batch's packed documents (`megapar.models.documents.Documents`), or None."""
        x = x + self.attn(self.attn_norm(x), docs)
        if isinstance(self.mlp, MoE):
            return x + self.mlp(self.mlp_norm(x), mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(StageModel):
    """Llama causal LM, or one pipeline stage of it (same interface as `GPT2`).

    Untied (`tie_word_embeddings` False): the last stage holds its own vocab-parallel
    `head.weight`. Tied: the head reuses the embedding, and a last stage without it holds the
    tied copy, exactly as GPT-2 does.
    """

    attention: type[nn.Module] | None = None
    """The blocks' attention class (None: `LlamaAttention`; a subclass's own)."""

    def __init__(
        self,
        config: LlamaConfig,
        mesh: Mesh,
        layers: Sequence[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        tracker=None,
    ):
        super().__init__()
        layers = self._begin(config, mesh, layers, pre_process, post_process, tracker)
        rotary = self.rotary = Rotary(config, mesh.cp, mesh.cp_rank, mesh.device)
        masks = self.window_masks = WindowMasks()  # every sliding layer's, made once per length
        self.embed: nn.Module | None
        if pre_process:
            self.embed = nn.Module()
            self.embed.word = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, mesh, config.make_vocab_size_divisible_by
            )
        else:
            self.embed = None
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaBlock(config, mesh, rotary, self.tracker, i, masks, self.attention)
                for i in layers
            }
        )
        self.tied = config.tie_word_embeddings
        if post_process:
            self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, mesh.device)
            if not self.tied:
                local = local_size(config.vocab_size, mesh.tp, config.make_vocab_size_divisible_by)
                self.head = nn.Module()
                self.head.weight = set_partition(
                    nn.Parameter(torch.empty(local, config.hidden_size, device=mesh.device)),
                    0,
                    (config.vocab_size, config.hidden_size),
                )
            elif not pre_process:
                self.head = nn.Module()
                self.head.weight = self.tied_copy()
        if self.tied:
            self._end()
        else:
            mark_replicated(self)
            self._mark_sequence_parallel()

    @property
    def output_weights(self) -> nn.Parameter:
        """The LM head's weight (this rank's vocab rows)."""
        # `head` is a plain nn.Module, whose __getattr__ torch types Tensor | Module
        return self.word_embeddings if self.tied else self.head.weight  # type: ignore[return-value]

    def init_weights(self, seed: int) -> None:
        """Layout-independent init, as transformers initialises LlamaForCausalLM: biases zero, norm
        weights one, the rest N(0, initializer_range)."""
        initialize(self, seed, normal_init(self.config.initializer_range), self.mesh.tp_rank)

    def forward(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        if self.pre_process:
            assert self.embed is not None  # built where pre_process
            # SP: its slice (`embed` is a plain nn.Module, whose __getattr__ torch types Tensor |
            # Module)
            hidden = self.embed.word(self._cp_tokens(batch["input_ids"]))  # type: ignore[operator]
        assert hidden is not None  # later stages: the previous stage's output
        if "input_ids" in batch and "positions_from" not in batch:
            # the rope tables (and a sliding window's mask) made here, so a compiled block only
            # reads them
            seq_len = batch["input_ids"].shape[1]
            self.rotary(seq_len, hidden.device)
            windows = {getattr(layer.attn, "window", None) for layer in self.layers.values()}
            cutting = sorted(w for w in windows if w is not None and w < seq_len)
            if self.mesh.cp == 1 and cutting and self.documents.mask_type == "causal":
                dtype = (  # the attention's: autocast's, else the hidden states'
                    torch.get_autocast_dtype(kind)
                    if (kind := hidden.device.type) in AUTOCAST_DEVICES
                    and torch.is_autocast_enabled(kind)
                    else hidden.dtype
                )
                for window in cutting:
                    self.window_masks(seq_len, window, dtype, hidden.device)
        padding = None  # an MoE layer's: which of this rank's tokens are not right-padding
        if "attention_mask" in batch and any(
            isinstance(layer.mlp, MoE) for layer in self.layers.values()
        ):
            padding = self._local_tokens(batch["attention_mask"])
        docs = stage_documents(self, batch)
        if docs is not None and self.documents.reset_position_ids:
            assert self.documents.eod_id is not None  # `set_documents` checks
            # this cp rank's tokens (the attention holds the whole sequence under SP)
            positions = self._cp_tokens(
                document_positions(batch["input_ids"], self.documents.eod_id)
            )
            cos, sin = self.rotary.tables(positions.float())
            docs.cos, docs.sin = cos[:, None], sin[:, None]
        hidden = run_layers(self.layers, hidden, padding, self.recompute, self.tracker, docs)
        if not self.post_process:
            return hidden
        return self._head(self.final_norm(hidden), self.output_weights, batch)
