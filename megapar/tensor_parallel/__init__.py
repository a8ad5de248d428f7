"""Tensor parallelism: region primitives, parallel layers, vocab-parallel cross-entropy, RNG."""

from megapar.tensor_parallel.cross_entropy import (
    LOSS_MEANS,
    masked_mean,
    vocab_parallel_cross_entropy,
    weighted_sum,
)
from megapar.tensor_parallel.init import initialize, normal_init
from megapar.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    parallel_lm_logits,
)
from megapar.tensor_parallel.linear_cross_entropy import (
    LOSS_CHUNK_TOKENS,
    linear_cross_entropy,
)
from megapar.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from megapar.tensor_parallel.random import NullTracker, RNGTracker

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "divide",
    "parallel_lm_logits",
    "vocab_parallel_cross_entropy",
    "linear_cross_entropy",
    "LOSS_CHUNK_TOKENS",
    "masked_mean",
    "weighted_sum",
    "LOSS_MEANS",
    "initialize",
    "normal_init",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "RNGTracker",
    "NullTracker",
]
