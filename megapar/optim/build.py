"""`build_optimizer`: the optimizer of one rank's stage, chosen by its ZeRO stage (0: the
whole-parameter `AdamWOptimizer`; 1 / 2: `ZeroOptimizer`; 3: `Zero3Optimizer`)."""

from __future__ import annotations

import torch
from torch import nn

from megapar.optim.optimizer import AdamWOptimizer
from megapar.optim.zero import ZeroOptimizer
from megapar.optim.zero3 import Zero3Optimizer


def build_optimizer(
    model: nn.Module,
    mesh,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    zero: int = 0,
    kind: str = "adamw",
    offload: bool = False,
    momentum: float | None = None,
    muon_adjust_lr: str = "match_rms_adamw",
    muon_ns_dtype: torch.dtype = torch.bfloat16,
    muon_distributed: bool = False,
) -> AdamWOptimizer:
    """The optimizer (`kind`: adamw, lamb, lars, sgd, muon) for this rank's stage; zero=1
    shards its state over mesh.dp_cp_group (the ranks holding the same parameters: dp, and
    cp's); zero=2 its reduced gradients as well; zero=3 steps the parameter shards of a model
    wrapped by `ShardedParams` (`Zero3Optimizer`, over its named parameters). `offload` steps
    it in host memory (`offload.py`). `momentum`: SGD / LARS's (0.9 if None) or Muon's (0.95
    if None); `muon_adjust_lr`, `muon_ns_dtype`: Muon's lr adjustment and Newton-Schulz dtype;
    `muon_distributed`: each Muon matrix orthogonalised by one rank of the dp group (ZeRO 1-3
    only: at zero=0 every rank holds whole matrices and has nothing to exchange)."""
    named = list(model.named_parameters())
    if muon_distributed and zero == 0:
        raise ValueError("distributed Muon splits ZeRO's sharded updates: use zero=1, 2 or 3")
    if momentum is None:
        momentum = 0.95 if kind == "muon" else 0.9
    if zero == 0:
        ep_group = mesh.ep_group if getattr(mesh, "ep", 1) > 1 else None
        return AdamWOptimizer(
            named,
            lr,
            weight_decay,
            betas,
            eps,
            kind,
            mesh.tp_group,
            momentum=momentum,
            offload=offload,
            ep_group=ep_group,
            muon_adjust_lr=muon_adjust_lr,
            muon_ns_dtype=muon_ns_dtype,
        )
    if zero in (1, 2, 3):  # ZeRO-3's over the model's shards, its stage set by the class
        sharded = {"stage": zero} if zero != 3 else {}
        return (Zero3Optimizer if zero == 3 else ZeroOptimizer)(
            named,
            mesh.dp_cp_group,
            lr,
            weight_decay,
            betas,
            eps,
            kind,
            mesh.tp_group,
            offload=offload,
            momentum=momentum,
            muon_adjust_lr=muon_adjust_lr,
            muon_ns_dtype=muon_ns_dtype,
            muon_distributed=muon_distributed,
            **sharded,
        )
    raise ValueError(
        f"zero={zero}: use 0 (no sharding), 1 (optimizer state sharded over data-parallel "
        f"ranks), 2 (gradients too) or 3 (parameters too)"
    )
