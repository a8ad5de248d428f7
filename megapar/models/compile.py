"""`--compile`: torch.compile applied to each transformer block's forward, as torchtitan does.

Each block of every stage model (or model chunk) gets its `forward` replaced by
``torch.compile(block.forward)``. The block module itself is left as it is, so its hooks run
outside the compiled region: ZeRO-3's gather before a block's forward and its backward hook on
the output, and the gradient buckets' post-accumulate hooks on the parameters (autograd's
AccumulateGrad nodes sit outside the compiled graph), fire as in eager mode. Identical blocks
share one compiled graph (dynamo treats a module's parameters as inputs), so the first
micro-batch compiles once per distinct block and nothing recompiles after it.

What stays eager, by design (each is a graph break inside a block, listed in
docs/guides/training.md "Compiling the blocks"):

- the tensor-parallel collectives (tp > 1, with or without sequence parallelism): the region
  primitives run eagerly (`tensor_parallel.mappings.eager_region`), so they stay the in-place
  torch.distributed calls that the collective counters and the tp wait clock see;
- the zero-bubble linear layers while their weight gradient is deferred (ZB-H1 / ZB-V /
  DualPipeV steps): their backward puts (X, dY) in a Python store;
- at cp > 1 the attention core with its ring / all-gather exchanges (`LayerAttention`);
- in a mixture-of-experts block the routed experts (`MoE._routed`): their rows per expert are
  data-dependent shapes, which would recompile the block every micro-batch;
- attention dropout > 0: the per-tp-rank RNG stream switch reads and writes the host RNG state;
- on packed documents the document mask's making (`Documents.bias`: made once, then shared).

The embedding and the LM head with its chunked loss are not compiled: the loss is a
hand-written autograd function over a chunk loop of in-place matmuls (its point is the memory
it never holds) with its own collectives at tp > 1.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from megapar.models.stage import StageModel


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of every stage model in `model` (a stage, or `ModelChunks`)."""
    return [
        block
        for stage in model.modules()
        if isinstance(stage, StageModel)
        for block in cast(nn.ModuleDict, stage.layers).values()
    ]


def compile_blocks(model: nn.Module) -> int:
    """Replace each block's `forward` with its torch.compile'd form (hooks on the block stay
    outside the compiled region); returns the number of blocks compiled."""
    blocks = blocks_of(model)
    for block in blocks:
        # an instance attribute: nn.Module.__call__ runs the hooks, then this
        block.forward = torch.compile(block.forward)
    return len(blocks)
