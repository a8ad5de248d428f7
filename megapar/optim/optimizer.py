"""AdamW over one pipeline stage, with Megatron's weight-decay groups and checkpointable state.

Weight decay applies to matrices and embeddings (params with 2+ dims) and not to biases or norm
weights (1-D params). Parameters and optimizer state are fp32 (the master weights under mixed
precision). `build_optimizer(..., zero=1)` shards the state over the dp group (`zero.py`).

Checkpoint format (the same with or without ZeRO, so a run can be resumed with either):

- `state_tensors()`: canonical parameter name -> {"exp_avg": t, "exp_avg_sq": t}, each of the
  parameter's local (tp / pp shard) shape, for every parameter of the stage except tied copies
  (`param.tied_to`), whose state equals the parameter they are tied to.
- `state_json()`: step count and hyper-parameters, JSON-able.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def decays(param: torch.Tensor) -> bool:
    """Megatron convention: decay matrices and embeddings, not biases or norm weights."""
    return param.dim() >= 2


class AdamWOptimizer:
    """AdamW over a stage's parameters (every parameter stepped on this rank)."""

    zero = 0

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], lr: float,
                 weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8):
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        if not self.named:
            raise ValueError("the optimizer got no trainable parameters (is the stage empty?)")
        self.params = [p for _, p in self.named]
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self.num_steps = 0
        decay = [p for p in self.params if decays(p)]
        no_decay = [p for p in self.params if not decays(p)]
        self.param_groups = [
            {"params": decay, "lr": lr, "weight_decay": weight_decay},
            {"params": no_decay, "lr": lr, "weight_decay": 0.0},
        ]
        owned = set(id(p) for p in self.owned_params())
        groups = [{"params": [p for p in g["params"] if id(p) in owned], "lr": lr,
                   "weight_decay": g["weight_decay"]} for g in self.param_groups]
        groups = [g for g in groups if g["params"]]
        # A ZeRO rank may own nothing (more dp ranks than parameters): then it steps nothing.
        self.inner = (torch.optim.AdamW(groups, lr=lr, betas=self.betas, eps=eps)
                      if groups else None)

    def owned_params(self) -> list[nn.Parameter]:
        """The parameters this rank updates (all of them without ZeRO)."""
        return self.params

    # training -------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr
        if self.inner is not None:
            for g in self.inner.param_groups:
                g["lr"] = lr

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()
        self.num_steps += 1
        self._after_step()

    def _after_step(self) -> None:
        """Hook for ZeRO: make every rank's parameters current."""

    # checkpoints ----------------------------------------------------------------------------
    def _local_state(self, p: nn.Parameter, key: str) -> torch.Tensor:
        state = self.inner.state.get(p, {}) if self.inner is not None else {}
        t = state.get(key)
        return t.detach().clone() if t is not None else torch.zeros_like(p)

    def _checkpointed(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named if getattr(p, "tied_to", None) is None]

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """name -> {"exp_avg", "exp_avg_sq"} for every non-tied parameter of the stage."""
        return {n: {k: self._local_state(p, k) for k in STATE_KEYS}
                for n, p in self._checkpointed()}

    @staticmethod
    def _entry(d: dict, name: str, p: nn.Parameter) -> dict[str, torch.Tensor]:
        tied = getattr(p, "tied_to", None)
        for key in (name, tied):
            if key is not None and key in d:
                return d[key]
        raise KeyError(f"optimizer state has no entry for parameter {name!r}"
                       + (f" (nor for {tied!r}, which it is tied to)" if tied else "")
                       + "; was the checkpoint written for a different model?")

    @torch.no_grad()
    def load_state_tensors(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load `state_tensors()` output; a tied copy takes its source's entry when absent."""
        if self.inner is None:
            return
        owned = set(id(p) for p in self.owned_params())
        for n, p in self.named:
            if id(p) not in owned:
                continue
            entry = self._entry(d, n, p)
            state = {"step": torch.tensor(float(self.num_steps))}
            for k in STATE_KEYS:
                t = entry[k]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {k} of {n!r} has shape {tuple(t.shape)}, "
                                     f"the parameter has {tuple(p.shape)}: the checkpoint is for "
                                     f"another layout; convert it first")
                state[k] = t.to(device=p.device, dtype=p.dtype).clone()
            self.inner.state[p] = state

    def state_json(self) -> dict:
        return {"step": self.num_steps, "zero": self.zero, "lr": self.lr,
                "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    def load_state_json(self, d: dict) -> None:
        self.num_steps = int(d["step"])
        self.set_lr(float(d.get("lr", self.lr)))
        if self.inner is not None:
            for state in self.inner.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(float(self.num_steps))


def build_optimizer(model: nn.Module, mesh, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    zero: int = 0) -> AdamWOptimizer:
    """AdamW for this rank's stage; zero=1 shards the optimizer state over mesh.dp_group."""
    named = list(model.named_parameters())
    if zero == 0:
        return AdamWOptimizer(named, lr, weight_decay, betas, eps)
    if zero == 1:
        from megapar.optim.zero import ZeroOptimizer

        return ZeroOptimizer(named, mesh.dp_group, lr, weight_decay, betas, eps)
    raise ValueError(f"--zero {zero} is not supported; use 0 (no sharding) or 1 (optimizer "
                     f"state sharded over data-parallel ranks)")
