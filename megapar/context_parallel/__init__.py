"""Context parallelism: every sequence split over the cp ranks of the mesh (`Mesh.cp_group`).

- `split`: which tokens a cp rank holds (2 x cp chunks, rank r takes chunks r and 2cp - 1 - r)
  and their global positions;
- `attention`: self-attention over the split sequence, by a ring of K/V blocks or one
  all-gather of them (`method_for` chooses per model), merged with their log-sum-exp;
- `a2a`: the all-to-all alternative (Ulysses, ``--cp-comm-type a2a``): heads traded for the
  whole sequence around ordinary attention;
- `kernels`: attention of one block with its log-sum-exp; `ring`: the grouped exchanges.

Everything outside attention is per token, so a cp rank runs the rest of the model on its
tokens alone; the loss sums its token sums and counts over cp (`masked_mean(..., group)`), and
gradients are reduced over cp x dp (`Mesh.dp_cp_group`).
"""

from megapar.context_parallel.attention import (
    METHODS,
    LayerAttention,
    Spec,
    attention,
    method_for,
)
from megapar.context_parallel.ring import CPTimeoutError, Ring
from megapar.context_parallel.split import (
    check_length,
    chunk_ids,
    positions,
    split,
    unsplit,
)

__all__ = [
    "METHODS",
    "LayerAttention",
    "Spec",
    "attention",
    "method_for",
    "CPTimeoutError",
    "Ring",
    "check_length",
    "chunk_ids",
    "positions",
    "split",
    "unsplit",
]
