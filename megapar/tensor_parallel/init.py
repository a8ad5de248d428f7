"""Layout-independent initialisation.

Each parameter's *full* tensor is drawn from its own generator, seeded from (seed, canonical
parameter name), and each rank keeps its shard. So the same seed gives bitwise the same full
weights whatever tp and pp are, and a pipeline stage only ever draws its own layers.
A routed expert's stacked weights under expert parallelism (``param.ep_shard = (ep_rank, ep)``,
set by `megapar.expert_parallel.mark_expert`) hold block ep_rank of ep of dim 0 of the whole
[E, ...] tensor, drawn whole and cut the same way.
A parameter that is a tied copy (``param.tied_to = "embed.word.weight"``) is drawn as the
parameter it is tied to.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from megapar.tensor_parallel.partition import full_shape, shard_of, tp_dim, tp_parts

InitFn = Callable[[str, tuple, torch.Generator], torch.Tensor]


def param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode()) + (seed % 65536) * 2**32


def normal_init(std: float = 0.02) -> InitFn:
    """Biases zero, norm weights one, everything else N(0, std)."""

    def init(name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape)
        if ".ln" in name or "norm" in name or "LayerNorm" in name:
            return torch.ones(shape)
        return torch.empty(shape).normal_(0.0, std, generator=gen)

    return init


@torch.no_grad()
def initialize(module: nn.Module, seed: int, init_fn: InitFn, tp_rank: int = 0) -> None:
    """Fill every parameter of `module` with its shard of the seeded full tensor."""
    for name, param in module.named_parameters():
        source = getattr(param, "tied_to", name)
        gen = torch.Generator().manual_seed(param_seed(seed, source))
        shape = full_shape(param)
        ep_rank, ep = getattr(param, "ep_shard", (0, 1))
        if ep > 1:  # this rank's experts: block ep_rank of the [E, ...] tensor's dim 0
            shape = (shape[0] * ep, *shape[1:])
        full = init_fn(source, shape, gen)
        if ep > 1:
            full = full.narrow(0, ep_rank * param.shape[0], param.shape[0])
        dim = tp_dim(param)
        local = param.shape[dim] if dim is not None else 0  # unused when nothing is split
        param.copy_(shard_of(full, dim, local, tp_rank, tp_parts(param)).to(param.device))
