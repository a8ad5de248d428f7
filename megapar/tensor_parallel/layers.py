"""Megatron-style tensor-parallel layers.

Weights follow `nn.Linear`'s [out_features, in_features] layout and are created empty at their
*local* (shard) size; `megapar.tensor_parallel.init.initialize` fills them from the full tensor, so
initialisation does not depend on the layout. Every parameter records its partition
(`tp_dim`, `full_shape`, see `partition.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapar.mesh import LayoutError, Mesh
from megapar.tensor_parallel.fp8 import Fp8Spec, fp8_linear
from megapar.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    to_wire_dtype,
)
from megapar.tensor_parallel.partition import local_size, set_partition
from megapar.tensor_parallel.regather import (
    Shard,
    gather_keeping_shard,
    regathered_linear,
    shard_of,
)
from megapar.tensor_parallel.sequence_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megapar.tensor_parallel.weight_copy import WeightCopy, weight_as_read
from megapar.tensor_parallel.weight_grad import linear


def _sequence_parallel(mesh: Mesh) -> bool:
    return mesh.sequence_parallel and mesh.tp > 1


def divide(numerator: int, tp: int, what: str) -> int:
    """numerator / tp, or a LayoutError that names the sizes."""
    if numerator % tp:
        raise LayoutError(f"{what} {numerator} is not divisible by --tp {tp}")
    return numerator // tp


def _param(shape, tp_dim, full_shape, device) -> nn.Parameter:
    return set_partition(nn.Parameter(torch.empty(shape, device=device)), tp_dim, full_shape)


def _matmul(
    layer, x: torch.Tensor, bias: torch.Tensor | None, shard: Shard | None = None
) -> torch.Tensor:
    """X W^T + b of a parallel linear: in float8 when converted (its weight gradient then
    computed in the backward, never deferred), else F.linear or its zero-bubble split; or,
    given the `shard` of a sequence-parallel X (`--sp-regather`), keeping only its slice for
    the backward where neither of those applies (`regathers`). Outside float8, W is read from
    its 16-bit copy where ZeRO-3 gathered one (`weight_copy.py`)."""
    if layer.fp8 is not None:
        return fp8_linear(x, layer.weight, bias, layer.fp8)
    weight = weight_as_read(layer)
    if shard is not None and regathers(layer.weight_grad_store, layer.weight):
        return regathered_linear(x, weight, bias, shard)
    return linear(x, weight, bias, layer.weight_grad_store, layer.weight)


def regathers(store, weight: torch.Tensor) -> bool:
    """Whether a linear given a `SequenceShard` keeps only its slice: in a backward-recording
    forward whose weight gradient is not deferred to a zero-bubble W pass (whose store keeps
    the gathered X until then)."""
    return torch.is_grad_enabled() and weight.requires_grad and (store is None or not store.enabled)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dim: each rank computes a slice of Y.

    gather_output=True all-gathers Y so every rank holds it whole; otherwise the output stays
    split (feed it to a RowParallelLinear with input_is_parallel=True). Under sequence
    parallelism (`mesh.sequence_parallel`) X arrives split along the sequence and is all-gathered
    first (its gradient reduce-scattered) instead of entering through `copy_to_tp_region`.
    """

    heads: int | None = None
    """An attention projection's heads, which tp splits (set by its model; `fp8_convert` names
    the tps that divide them)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        bias: bool = True,
        gather_output: bool = False,
        name: str = "output features",
    ):
        super().__init__()
        self.group = mesh.tp_group
        self.gather_output = gather_output
        self.sequence_parallel = _sequence_parallel(mesh)
        local = divide(out_features, mesh.tp, name)
        self.weight = _param((local, in_features), 0, (out_features, in_features), mesh.device)
        self.bias = _param((local,), 0, (out_features,), mesh.device) if bias else None
        self.weight_grad_store = None
        """A `WeightGradStore` to defer the weight gradient into (zero-bubble pipelines)."""
        self.fp8: Fp8Spec | None = None
        """Run the matmul in float8 this way (`fp8_convert.convert_to_fp8`); None: as F.linear."""
        self.weight_copy: WeightCopy | None = None
        """The weight's 16-bit copy the matmul reads while it is live (ZeRO-3's 16-bit
        all-gather, `data_parallel.zero3_half`); None: the weight."""
        self.regather = False
        """Under SP keep only this rank's slice of X for the backward and all-gather it again
        there (`--sp-regather`, `megapar.models.set_sp_regather`); False: keep the gathered X."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """X as this layer needs it: all-gathered along the sequence (SP) or copied into the tp
        region. Several projections of one X (q, k, v; gate, up) enter once and share it, so
        the backward reduces their summed input gradient in one collective (and under
        `regather` re-gathers X once for all of them: the gathered X carries its shard).
        Under autocast X enters in its dtype (`to_wire_dtype`: what the matmuls read), so the
        collective and its gradient's move 16 bits, not the fp32 of a norm's output."""
        x = to_wire_dtype(x, self.group)
        if not self.sequence_parallel:
            return copy_to_tp_region(x, self.group)
        if self._keeps_shard():
            return gather_keeping_shard(x, self.group)
        return gather_from_sequence_parallel_region(x, self.group)

    def _keeps_shard(self) -> bool:
        """`regather` where it applies: not in float8, nor with the weight gradient deferred
        (zero-bubble W), nor inside torch.compile'd code (the tag on X is not traced)."""
        return (
            self.regather
            and self.fp8 is None
            and regathers(self.weight_grad_store, self.weight)
            and not torch.compiler.is_compiling()
        )

    def forward(self, x: torch.Tensor, entered: bool = False) -> torch.Tensor:
        """`entered`: X already went through `enter` (of this or a sibling projection)."""
        x = x if entered else self.enter(x)
        y = _matmul(self, x, self.bias, shard_of(x))
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dim: each rank computes a partial sum of Y.

    input_is_parallel=True takes X already split along its last dim (from a column-parallel
    layer); otherwise X is whole and each rank keeps its slice. The bias is replicated and added
    once, after the partial sums are reduced. Under sequence parallelism the partial sums are
    reduce-scattered along the sequence instead of all-reduced.
    """

    heads: int | None = None
    """An attention output projection's heads, which tp splits (as `ColumnParallelLinear`'s)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        bias: bool = True,
        input_is_parallel: bool = True,
        name: str = "input features",
    ):
        super().__init__()
        self.group = mesh.tp_group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = _sequence_parallel(mesh)
        local = divide(in_features, mesh.tp, name)
        self.weight = _param((out_features, local), 1, (out_features, in_features), mesh.device)
        self.bias = _param((out_features,), None, (out_features,), mesh.device) if bias else None
        self.weight_grad_store = None
        """A `WeightGradStore` to defer the weight gradient into (zero-bubble pipelines)."""
        self.fp8: Fp8Spec | None = None
        """Run the matmul in float8 this way (`fp8_convert.convert_to_fp8`); None: as F.linear."""
        self.weight_copy: WeightCopy | None = None
        """The weight's 16-bit copy the matmul reads while it is live (ZeRO-3's 16-bit
        all-gather, `data_parallel.zero3_half`); None: the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        y = _matmul(self, x, None)
        y = (
            reduce_scatter_to_sequence_parallel_region(y, self.group)
            if self.sequence_parallel
            else reduce_from_tp_region(y, self.group)
        )
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split across tp ranks.

    The vocabulary is padded to a multiple of tp x `divisible_by` (Megatron's
    make-vocab-size-divisible-by); ids outside this rank's rows give zeros here and the sum over
    the tp group fills them in. Padding rows are never looked up and never leave the model.
    Under sequence parallelism the sum is a reduce-scatter: each rank gets its sequence slice
    of the embeddings (half the bytes of an all-reduce, and nothing to slice afterwards).
    """

    def __init__(self, vocab_size: int, dim: int, mesh: Mesh, divisible_by: int = 1):
        super().__init__()
        self.group = mesh.tp_group
        self.vocab_size = vocab_size
        self.local_vocab = local_size(vocab_size, mesh.tp, divisible_by)
        self.vocab_start = mesh.tp_rank * self.local_vocab
        self.weight = _param((self.local_vocab, dim), 0, (vocab_size, dim), mesh.device)
        self.sequence_parallel = _sequence_parallel(mesh)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        # under autocast the sum travels in its dtype (one rank holds each row, the others'
        # zeros: the sum is the row rounded once) and returns to the weight's (the residual
        # stream's fp32); under SP the gradient's all-gather then moves 16 bits too
        wire = to_wire_dtype(out, self.group)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(wire, self.group).to(out.dtype)
        return reduce_from_tp_region(wire, self.group).to(out.dtype)


def parallel_lm_logits(
    hidden: torch.Tensor,
    word_embeddings: torch.Tensor,
    mesh: Mesh,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's vocab slice of the logits, from (tied) vocab-parallel word embeddings
    (under sequence parallelism `hidden` is this rank's sequence slice, gathered first)."""
    return F.linear(lm_head_input(hidden, mesh), word_embeddings, bias)


def lm_head_input(hidden: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The LM head's input as every tp rank multiplies it by its vocabulary rows: the tp
    region's copy (its gradient summed over tp), or under sequence parallelism the gathered
    sequence (its gradient reduce-scattered); under autocast in its dtype (`to_wire_dtype`)."""
    hidden = to_wire_dtype(hidden, mesh.tp_group)
    if _sequence_parallel(mesh):
        return gather_from_sequence_parallel_region(hidden, mesh.tp_group)
    return copy_to_tp_region(hidden, mesh.tp_group)
