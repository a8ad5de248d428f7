"""Transformer pieces built from tensor-parallel layers, shared by GPT-2 and BERT.

Attention heads are split across the tp group: q, k and v are one fused column-parallel
projection (`qkv`, rows head-major: each rank holds whole heads, see
`partition.fuse_heads`), the output projection is row-parallel (partial sums reduced over tp).
The MLP is column-parallel up, row-parallel down. So each attention and each MLP has exactly one
copy-to region (an all-reduce in backward) and one reduce-from region (an all-reduce in
forward): Megatron's 2 + 2 all-reduces of b x s x h per layer. Between the two halves nothing is
communicated.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from megapar.context_parallel import LayerAttention
from megapar.mesh import Mesh
from megapar.models.kv_cache import KVCache
from megapar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, divide

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def fork_for(tracker, dropout: float):
    """`tracker.fork()` (the per-tp-rank RNG stream) where attention dropout draws random
    numbers; with dropout 0 nothing is drawn, so the stream switch (a host read and write of the
    RNG state, which torch.compile cannot trace: a graph break) is skipped."""
    return tracker.fork() if dropout > 0 else contextlib.nullcontext()


def checkpoint_for(tracker, dropout: float, fn, *args):
    """`fn(*args)` recomputed in backward (selective recomputation): `tracker.checkpoint`, which
    replays the per-tp-rank RNG stream, where `fn` draws random numbers (dropout > 0); with
    dropout 0 torch's own checkpoint, which torch.compile traces into the compiled graph."""
    if dropout > 0:
        return tracker.checkpoint(fn, *args)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def layer_norm(size: int, eps: float, device) -> nn.LayerNorm:
    return nn.LayerNorm(size, eps=eps, device=device)


def embedding(num: int, dim: int, device) -> nn.Embedding:
    """An `nn.Embedding` whose weight torch leaves uninitialised: megapar's layout-independent
    `init_weights` (or a checkpoint) fills every parameter, so torch's own N(0, 1) draw would be
    wasted work (large for a big model's position embedding, even on the meta device)."""
    return nn.Embedding(num, dim, device=device, _weight=torch.empty(num, dim, device=device))


class ParallelAttention(nn.Module):
    """Multi-head self-attention with this rank's share of the heads.

    `mask` is a padding mask [b, s] (True: a real token; BERT) of the whole sequence, or None;
    `docs` a micro-batch's packed documents (`megapar.models.documents.Documents`: attention
    within each document), or None.
    With `kv_cache` set (causal attention, generation) the keys and values of earlier
    positions are the cache's and `x` holds only the new positions (`megapar.models.kv_cache`).
    Under context parallelism (cp > 1) the queries, keys and values are this cp rank's tokens
    and the core is ring attention (`megapar.context_parallel`: keys and values as many as the
    queries, so the ring, not an all-gather; `set_cp_comm` may choose another).
    `recompute_core` (selective recomputation) recomputes only the attention core
    (softmax(QK^T)V) in backward instead of storing its activations.
    """

    def __init__(self, hidden: int, heads: int, mesh: Mesh, tracker, dropout: float, causal: bool):
        super().__init__()
        self.local_heads = divide(heads, mesh.tp, "attention heads")
        self.head_dim = divide(hidden, heads, f"hidden size (for {heads} heads)")
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, mesh, name="3 x hidden size")
        # rows [heads, (q, k, v), head_dim]: Muon orthogonalises q, k and v apart (`muon.py`)
        self.qkv.weight.muon_split = (3, self.head_dim)  # type: ignore[attr-defined]
        self.proj = RowParallelLinear(hidden, hidden, mesh, name="hidden size")
        self.tracker = tracker
        self.dropout = dropout
        self.causal = causal
        self.recompute_core = False
        self.context_parallel = LayerAttention(mesh, causal, "ring") if mesh.cp > 1 else None
        if causal:  # generation's cache of this rank's heads (`megapar.models.kv_cache`)
            self.kv_cache: KVCache | None = None

    def _core(self, q, k, v, mask, docs=None):
        dropout = self.dropout if self.training else 0.0
        with fork_for(self.tracker, dropout):  # this rank's heads: the per-tp-rank stream
            if self.context_parallel is not None:
                return self.context_parallel(q, k, v, mask, dropout_p=dropout, documents=docs)
            bias = None if docs is None else docs.bias(None, q.dtype)
            if bias is not None:  # documents: the causal rule included
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout)
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if mask is None else mask[:, None, None, :],
                dropout_p=dropout,
                is_causal=self.causal and mask is None,
            )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, docs=None):
        qkv = self.qkv(x)  # the whole sequence, also when x is a sequence-parallel slice
        b, s = qkv.shape[:2]
        # [b, s, local heads, (q, k, v), head_dim] -> three [b, local heads, s, head_dim]
        qkv = qkv.view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)
        cache = getattr(self, "kv_cache", None)
        if cache is not None:
            out = cache.attend(q, k, v)
        elif self.recompute_core and torch.is_grad_enabled():
            dropout = self.dropout if self.training else 0.0
            if mask is None and docs is None:
                out = checkpoint_for(
                    self.tracker, dropout, lambda q_, k_, v_: self._core(q_, k_, v_, None), q, k, v
                )
            else:
                out = checkpoint_for(self.tracker, dropout, self._core, q, k, v, mask, docs)
        else:
            out = self._core(q, k, v, mask, docs)
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj(out)


class ParallelMLP(nn.Module):
    """fc (column-parallel) -> activation -> proj (row-parallel)."""

    def __init__(self, hidden: int, ffn: int, mesh: Mesh, act: str):
        super().__init__()
        self.fc = ColumnParallelLinear(hidden, ffn, mesh, name="FFN size")
        self.proj = RowParallelLinear(ffn, hidden, mesh, name="FFN size")
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class ResidualDropout(nn.Dropout):
    """Dropout on the residual stream. Under sequence parallelism each tp rank holds other
    positions, so its mask comes from the per-tp-rank stream (`tracker.fork()`); otherwise every
    tp rank holds the same tensor and draws the same mask from the default stream."""

    def __init__(self, p: float, mesh: Mesh, tracker):
        super().__init__(p)
        self.tracker = tracker
        self.split = mesh.sequence_parallel and mesh.tp > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split and self.training and self.p > 0:
            with self.tracker.fork():
                return super().forward(x)
        return super().forward(x)


def run_layers(
    layers: nn.ModuleDict, hidden: torch.Tensor, mask, recompute: str, tracker, docs=None
):
    """Run blocks in order; with recompute == "full" keep only each block's input for backward.
    `docs`: the micro-batch's `megapar.models.documents.Documents`, handed to every block (as
    a third argument) where not None."""
    extra = () if docs is None else (docs,)
    for layer in layers.values():
        if recompute == "full" and torch.is_grad_enabled():
            hidden = (
                tracker.checkpoint(layer, hidden, mask, *extra)
                if mask is not None or extra
                else tracker.checkpoint(layer, hidden)
            )
        else:
            hidden = layer(hidden, mask, *extra)
    return hidden


RECOMPUTE_MODES = ("none", "selective", "full")


def set_recompute(model: nn.Module, mode: str) -> None:
    """Choose activation recomputation for a model (or stage): none, selective or full."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; expected one of {RECOMPUTE_MODES}")
    # plain attributes, which nn.Module's stubs type as tensors or modules
    model.recompute = mode  # type: ignore[assignment]
    _apply_sp_regather(model)
    for module in model.modules():
        if hasattr(module, "recompute_core"):  # ParallelAttention, LlamaAttention
            module.recompute_core = mode == "selective"  # type: ignore[assignment]
        if hasattr(module, "keep_route"):  # MoE under expert parallelism: one route per forward
            module.keep_route = mode == "full"  # type: ignore[assignment]


CP_COMM_TYPES = {"auto": None, "p2p": "ring", "all_gather": "all-gather", "a2a": "a2a"}
"""--cp-comm-type (Megatron-core's names) -> the context-parallel attention it runs
(`megapar.context_parallel`; None: the model's own choice, `method_for`)."""


def set_cp_comm(model: nn.Module, comm_type: str) -> None:
    """`--cp-comm-type`: the context-parallel attention of every attention layer (a model built
    at cp 1 has none to set): auto keeps each model's choice (the ring, or the all-gather with
    grouped-query heads), p2p the ring, all_gather the all-gather, a2a the all-to-all (Ulysses)."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"unknown --cp-comm-type {comm_type!r}; expected one of {list(CP_COMM_TYPES)}"
        )
    method = CP_COMM_TYPES[comm_type]
    if method is None:
        return
    for module in model.modules():
        if getattr(module, "context_parallel", None) is not None:
            module.context_parallel.method = method  # type: ignore[union-attr]


def set_sp_regather(model: nn.Module, on: bool) -> None:
    """`--sp-regather`: under sequence parallelism the column-parallel layers keep only this
    rank's slice of their input for the backward and all-gather it again there
    (`megapar.tensor_parallel.regather`). Not under full recomputation, whose backward rebuilds
    the block and its gathered input anyway (a re-gather would be a third gather): there the
    layers keep the gathered input, also when `set_recompute` chooses "full" later."""
    for module in [model, *(m for m in model.modules() if hasattr(m, "recompute"))]:
        module.sp_regather = bool(on)  # type: ignore[assignment]  # a plain attribute
    _apply_sp_regather(model)


def _apply_sp_regather(model: nn.Module) -> None:
    on = getattr(model, "sp_regather", False) and getattr(model, "recompute", "none") != "full"
    for module in model.modules():
        if hasattr(module, "regather"):  # ColumnParallelLinear
            module.regather = on  # type: ignore[assignment]
