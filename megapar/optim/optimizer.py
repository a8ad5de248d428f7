"""The optimizer of one pipeline stage: AdamW (or LAMB / LARS / SGD, or Muon with AdamW:
`muon.py`), with Megatron's weight-decay groups and checkpointable state.

The wrapper is a real `torch.optim.Optimizer` (its `param_groups` hold every parameter of the
stage, decay group first; under --optimizer muon Muon's matrices before them, decayed too), so
torch's LR schedulers (`LambdaLR`, ...) drive it: the learning
rate and weight decay of each group are read at every `step()`.

Weight decay applies to matrices and embeddings (params with 2+ dims) and not to biases or norm
weights (1-D params). Parameters and optimizer state are fp32 (the master weights under mixed
precision). The distributed optimizer (`zero.py`, where `build_optimizer` chooses between
the two) shards the state over the data-parallel ranks.

Checkpoint format (the same with or without ZeRO, so a run can be resumed with either):

- `state_tensors()`: canonical parameter name -> {"exp_avg": t, "exp_avg_sq": t} (for SGD / LARS,
  and Muon's matrices, {"momentum_buffer": t}), each of the parameter's local (tp / pp shard) shape,
  for every parameter of the stage except tied copies (`param.tied_to`), whose state equals the
  parameter they are tied to. Under ZeRO-1 / 2 the state is sharded by buffer slice and gathered to
  rank 0 of each bucket's group only (dp rank 0, the checkpoint writer; expert parameters' to
  expert-data-parallel rank 0); `load_state_tensors` takes full per-parameter tensors on every rank.
- `state_json()`: step count and hyper-parameters, JSON-able.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NoReturn, overload

import torch
from torch import nn

from megapar.optim.muon import MuonAdamW, is_muon_matrix
from megapar.optim.offload import HostStep
from megapar.optim.trust_ratio import LAMB, LARS

STATE_KEYS = ("exp_avg", "exp_avg_sq")
OPTIMIZERS = ("adamw", "lamb", "lars", "sgd", "muon")
"""`--optimizer` choices: AdamW, the layer-wise trust-ratio LAMB / LARS (`trust_ratio.py`),
SGD, and Muon for the blocks' matrices with AdamW for the rest (`muon.py`)."""
NOT_OFFLOADED = ("lamb", "lars", "muon")
"""The optimizers --offload-optimizer does not step on the host: they need whole parameters'
norms (LAMB, LARS) or whole matrices (Muon) over the devices."""


def optimizer_named_elsewhere(value: str) -> str:
    """For an --optimizer value megapar does not take but another tool names (Megatron-LM's
    `adam`, torchtitan's `AdamW`, the Trainer's `adamw_torch_fused`), what megapar calls it;
    "" for a name it does not know."""
    key = str(value).lower()
    if key == "adam":  # Megatron-LM's adam decouples the weight decay; torch's Adam does not
        return (
            f"{value!r} is megapar's --optimizer adamw (decoupled weight decay, as Megatron-LM's "
            f"adam; torch's Adam adds the decay to the gradient)"
        )
    if key.startswith("adamw") or key in ("fusedadam", "deepspeedcpuadam"):
        return f"{value!r} is megapar's --optimizer adamw (torch's fused kernel)"
    if key in ("lamb", "fusedlamb", "lars", "sgd"):
        return f"{value!r} is megapar's --optimizer {key.removeprefix('fused')}"
    return ""


def state_keys(kind: str) -> tuple[str, ...]:
    """The per-parameter state an optimizer of `kind` keeps (and a checkpoint stores); Muon's:
    momentum_buffer for its matrices, exp_avg and exp_avg_sq for AdamW's parameters."""
    if kind == "muon":
        return ("momentum_buffer", *STATE_KEYS)
    return STATE_KEYS if kind in ("adamw", "lamb") else ("momentum_buffer",)


def decays(param: torch.Tensor) -> bool:
    """Megatron convention: decay matrices and embeddings, not biases or norm weights."""
    return param.dim() >= 2


class AdamWOptimizer(torch.optim.Optimizer):
    """AdamW (or `kind` lamb / lars / sgd / muon) over a stage's parameters (every parameter
    stepped on this rank). `tp_group` is needed by LAMB / LARS (their norms are of full
    parameters) and Muon (it orthogonalises whole matrices), and under expert parallelism
    `ep_group` (the experts' norms are of the stacked tensor). `offload`: step in host memory
    (`offload.HostStep`; AdamW and SGD). `momentum`: SGD's / LARS's, or Muon's;
    `muon_adjust_lr`: Muon's lr adjustment (`muon.lr_ratio`)."""

    zero = 0
    host_masters: dict[int, torch.Tensor] | None = None
    """id(stepped tensor) -> the host tensor holding its weights, where they are held on the
    host (ZeRO-3 with --offload-params); None: `HostStep` makes the masters."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        kind: str = "adamw",
        tp_group=None,
        momentum: float = 0.9,
        offload: bool = False,
        ep_group=None,
        muon_adjust_lr: str = "match_rms_adamw",
        muon_ns_dtype: torch.dtype = torch.bfloat16,
    ):
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        if not self.named:
            raise ValueError("the optimizer got no trainable parameters (is the stage empty?)")
        if kind not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {kind!r}; expected one of {OPTIMIZERS}")
        if offload and kind in NOT_OFFLOADED:
            raise ValueError(
                f"--offload-optimizer steps AdamW or SGD on the host, not {kind} "
                f"(it needs whole parameters' norms or matrices over the devices)"
            )
        self.offload, self.tp_group, self.ep_group = offload, tp_group, ep_group
        self.host: HostStep | None = None
        """`host`: the `HostStep` of an offloaded optimizer (None without offload)."""
        self.params = [p for _, p in self.named]
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self.kind, self.momentum = kind, momentum
        self.muon_adjust_lr, self.muon_ns_dtype = muon_adjust_lr, muon_ns_dtype
        self.state_keys = state_keys(kind)
        self.num_steps = 0
        muon = {id(p) for n, p in self.named if kind == "muon" and is_muon_matrix(n, p)}
        self.muon_ids = muon
        """id() of the parameters Muon steps (the rest, under --optimizer muon, AdamW's)."""
        decay = [p for p in self.params if decays(p) and id(p) not in muon]
        no_decay = [p for p in self.params if not decays(p)]
        # Hyperparameters a torch LR scheduler may change live in these groups (OneCycleLR /
        # CyclicLR cycle "betas" or "momentum" too); _sync_groups copies them inward.
        adam = {"betas": self.betas}
        defaults = {
            "lr": lr,
            **(adam if kind in ("adamw", "lamb", "muon") else {"momentum": momentum}),
        }
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if kind == "muon":  # Muon's matrices first: param_groups[0] is the one --lr reads
            matrices = [p for p in self.params if id(p) in muon]
            muon_group = {"params": matrices, "weight_decay": weight_decay, "momentum": momentum}
            groups = [{**muon_group, "muon": True}, *({**g, "muon": False} for g in groups)]
        super().__init__(groups, defaults)
        owned = set(id(p) for p in self.owned_params())
        groups = [
            {
                "params": [p for p in g["params"] if id(p) in owned],
                "lr": lr,
                "weight_decay": g["weight_decay"],
                **({"muon": g["muon"]} if "muon" in g else {}),
            }
            for g in self.param_groups
        ]
        self._inner_group_of = [i for i, g in enumerate(groups) if g["params"]]
        groups = [g for g in groups if g["params"]]
        # A ZeRO rank may own nothing (more dp ranks than parameters): then it steps nothing.
        self.inner = self._make_inner(groups) if groups else None
        self.allocate_state()

    def _watched(self, stepped: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per stepped tensor, the tensor weights are set through from outside (`HostStep`'s
        `watched`); None: the stepped tensors themselves."""
        return None

    def _make_inner(self, groups: list[dict]) -> torch.optim.Optimizer:
        """The torch optimizer over `groups` (of the stepped tensors: parameters, or ZeRO's
        pieces); with offload, over their host masters."""
        if self.offload:
            stepped = [p for g in groups for p in g["params"]]
            masters = self.host_masters
            self.host = HostStep(
                stepped,
                None if masters is None else [masters[id(p)] for p in stepped],
                self._watched(stepped),
            )
            groups = self.host.groups(groups)
        inner = _inner(
            self.kind,
            groups,
            self.lr,
            self.betas,
            self.eps,
            self.momentum,
            self.tp_group,
            self.ep_group,
            self.muon_adjust_lr,
            self.muon_ns_dtype,
        )
        return self.host.adopt(inner) if self.host is not None else inner

    @torch.no_grad()
    def allocate_state(self) -> None:
        """AdamW's moments made now, as torch would at the first step (zeros; the step count a
        float32 scalar, on the device for the fused kernel), instead of in that step. Made
        while the training state is being built, they sit where the allocator has room then,
        not after the first step's activations (on the CPU a freed block is kept: made later,
        they stacked on the first step's high-water mark, so the OS saw them on top of it)."""
        if self.kind != "adamw" or self.inner is None:
            return
        for group in self.inner.param_groups:
            for p in group["params"]:
                if not self.inner.state.get(p):
                    self.inner.state[p] = {
                        "step": step_state(self.inner, 0, p),
                        "exp_avg": self._zeros(p),
                        "exp_avg_sq": self._zeros(p),
                    }

    def _zeros(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros of `p`'s shape for a moment (pinned host memory for an offloaded CUDA run)."""
        zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
        return zeros.pin_memory() if self.host is not None and self.host.pinned else zeros

    def owned_params(self) -> list[nn.Parameter]:
        """The parameters this rank updates (all of them without ZeRO)."""
        return self.params

    # training -------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr
        self._sync_groups()

    def _sync_groups(self) -> None:
        """Copy lr, weight decay and betas / momentum (possibly set by a torch LR scheduler) to
        the inner groups."""
        if self.inner is not None:
            for i, g in zip(self._inner_group_of, self.inner.param_groups):
                outer = self.param_groups[i]
                for key in ("lr", "weight_decay", "betas", "momentum"):
                    if key in outer and key in g:
                        g[key] = outer[key]

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("megapar optimizers take no closure (the engine runs the step)")
        if self.inner is not None:
            self._sync_groups()
            if self.host is not None:
                self.host.step(self.inner.step)
            else:
                self.inner.step()
        self.num_steps += 1
        self._after_step()
        if self.host is not None:
            self.host.settled()

    def _after_step(self) -> None:
        """Hook for ZeRO: make every rank's parameters current."""

    # checkpoints ----------------------------------------------------------------------------
    def _local_state(self, p: nn.Parameter, key: str, copy: bool = True) -> torch.Tensor:
        """A host copy of one state tensor (a save never adds device memory), or with
        `copy=False` the state tensor itself."""
        state = self.inner.state.get(p, {}) if self.inner is not None else {}
        t = state.get(key)
        if t is None:
            return torch.zeros(p.shape, dtype=p.dtype)
        return t.detach().to("cpu", copy=True) if copy else t.detach()

    def keys_of(self, p: nn.Parameter) -> tuple[str, ...]:
        """The state keys parameter `p` has (under --optimizer muon: momentum_buffer for
        Muon's matrices, exp_avg and exp_avg_sq for AdamW's parameters)."""
        if self.kind != "muon":
            return self.state_keys
        return ("momentum_buffer",) if id(p) in self.muon_ids else STATE_KEYS

    def _checkpointed(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named if getattr(p, "tied_to", None) is None]

    def state_tensors(self, copy: bool = True) -> dict[str, dict[str, torch.Tensor]]:
        """name -> {"exp_avg", "exp_avg_sq"} (or {"momentum_buffer"}) for every non-tied
        parameter of the stage, in host memory; `copy=False`: the state tensors themselves
        where this rank holds them (on its device; the caller copies them before the next
        step), host copies where it does not."""
        return {
            n: {k: self._local_state(p, k, copy) for k in self.keys_of(p)}
            for n, p in self._checkpointed()
        }

    @staticmethod
    def _entry(d: dict, name: str, p: nn.Parameter) -> dict[str, torch.Tensor]:
        tied = getattr(p, "tied_to", None)
        for key in (name, tied):
            if key is not None and key in d:
                return d[key]
        raise KeyError(
            f"optimizer state has no entry for parameter {name!r}"
            + (f" (nor for {tied!r}, which it is tied to)" if tied else "")
            + "; was the checkpoint written for a different model?"
        )

    def _checked_entry(self, d: dict, name: str, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """`p`'s entry of `state_tensors()` output `d` (`_entry`), each of its `keys_of` in it
        checked: present (else the checkpoint is of another --optimizer) and of `p`'s full
        shape (else of another layout)."""
        entry = self._entry(d, name, p)
        keys = self.keys_of(p)
        for k in keys:
            if k not in entry:
                raise KeyError(
                    f"optimizer state of {name!r} has {sorted(entry)}, not "
                    f"{list(keys)}: the checkpoint was written with "
                    f"another --optimizer than {self.kind}"
                )
            t = entry[k]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"optimizer state {k} of {name!r} has shape {tuple(t.shape)}, "
                    f"the parameter has {tuple(p.shape)}: the checkpoint is for "
                    f"another layout; convert it first"
                )
        return {k: entry[k] for k in keys}

    @torch.no_grad()
    def load_state_tensors(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load `state_tensors()` output; a tied copy takes its source's entry when absent."""
        if self.inner is None:
            return
        owned = set(id(p) for p in self.owned_params())
        for n, p in self.named:
            if id(p) not in owned:
                continue
            entry = self._checked_entry(d, n, p)
            state = (
                {"step": step_state(self.inner, self.num_steps, p)} if self.counts_steps(p) else {}
            )
            for k, t in entry.items():
                state[k] = t.to(device=p.device, dtype=p.dtype).clone()
            self.inner.state[p] = state

    def counts_steps(self, p: nn.Parameter) -> bool:
        """Whether `p`'s state holds a step count: AdamW's and LAMB's (and under --optimizer
        muon, AdamW's parameters'); not SGD's, LARS's, nor a Muon matrix's."""
        return self.kind not in ("sgd", "lars") and id(p) not in self.muon_ids

    def _held_state(self) -> list[tuple[nn.Parameter, dict]]:
        """(parameter, the state this rank holds for it) for every parameter it updates."""
        if self.inner is None:
            return []
        return [
            (p, dict(self.inner.state[p])) for p in self.owned_params() if p in self.inner.state
        ]

    def _hold_state(self, p: nn.Parameter, state: dict) -> None:
        assert self.inner is not None  # called only when it is
        self.inner.state[p] = {k: v.to(p.device) if k != "step" else v for k, v in state.items()}

    def state_dict(self) -> dict:
        """torch's optimizer format: {"state": {index: {...}}, "param_groups": [...]}, indices
        counting the parameters of `param_groups` in order. "state" is what this rank holds:
        per parameter Adam's "step", "exp_avg", "exp_avg_sq" (LARS / SGD: "momentum_buffer");
        under ZeRO-1 the slice of each parameter on this rank, flat, with its "elements"
        (start, end). It loads back in the same layout only; checkpoints that move between
        layouts are megapar's own (`engine.save`, `state_tensors`)."""
        order = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        return {
            "state": {index[id(p)]: state for p, state in self._held_state()},
            "param_groups": [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [index[id(p)] for p in g["params"]],
                }
                for g in self.param_groups
            ],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load `state_dict()` output of the same layout (hyper-parameters and moments)."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "the optimizer state_dict has other parameter groups than this "
                "stage's; load megapar checkpoints with engine.load instead"
            )
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        order = [p for g in self.param_groups for p in g["params"]]
        if self.inner is not None:
            for i, state in state_dict["state"].items():
                self._hold_state(order[int(i)], state)
        self._sync_groups()

    def state_json(self) -> dict:
        return {
            "step": self.num_steps,
            "zero": self.zero,
            "lr": self.lr,
            "kind": self.kind,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "momentum": self.momentum,
            **({"muon_adjust_lr": self.muon_adjust_lr} if self.kind == "muon" else {}),
            # what a torch scheduler may have moved (OneCycleLR cycles betas / momentum)
            "groups": [
                {
                    k: list(g[k]) if k == "betas" else g[k]
                    for k in ("lr", "betas", "momentum")
                    if k in g
                }
                for g in self.param_groups
            ],
        }

    def load_state_json(self, d: dict) -> None:
        self.num_steps = int(d["step"])
        self.set_lr(float(d.get("lr", self.lr)))
        saved = {"betas": d.get("betas"), "momentum": d.get("momentum")}
        for group, moved in zip(self.param_groups, d.get("groups", [])):
            group["lr"] = float(moved.get("lr", group["lr"]))
            for key in ("betas", "momentum"):  # restored only where a scheduler moved them, so
                if key in group and key in moved and moved[key] != saved[key]:  # new flags win
                    group[key] = tuple(moved[key]) if key == "betas" else float(moved[key])
        self._sync_groups()
        if self.inner is not None:
            for p, state in self.inner.state.items():
                if "step" in state:
                    state["step"] = step_state(self.inner, self.num_steps, p)


def step_state(inner: torch.optim.Optimizer, steps: int, p: torch.Tensor) -> torch.Tensor:
    """An Adam-style `state["step"]` as torch keeps it: a float32 scalar on the parameter's
    device for the fused kernel, on the CPU otherwise."""
    fused = bool(inner.defaults.get("fused"))
    # torch.full, not torch.tensor: the same 0-d tensor, made without a host value to copy in
    # (under the dry run's FakeTensorMode, torch.tensor converts a real tensor)
    return torch.full((), float(steps), dtype=torch.float32, device=p.device if fused else "cpu")


FUSED_DEVICES = ("cpu", "cuda")
"""Devices where megapar runs torch's fused AdamW kernel (one pass over parameter, gradient and
both moments, as Megatron's fused Adam on GPU, where the per-tensor loop passes once per
operation)."""


def _inner(
    kind,
    groups,
    lr,
    betas,
    eps,
    momentum,
    tp_group,
    ep_group,
    adjust_lr="match_rms_adamw",
    ns_dtype=torch.bfloat16,
) -> torch.optim.Optimizer:
    """The torch optimizer that updates the parameters this rank owns."""
    if kind == "muon":
        return MuonAdamW(groups, lr, betas, eps, momentum, adjust_lr, tp_group, ns_dtype)
    if kind == "adamw":
        params = [p for g in groups for p in g["params"]]
        fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)

    if kind == "lamb":
        return LAMB(groups, lr=lr, betas=betas, eps=eps, tp_group=tp_group, ep_group=ep_group)
    return LARS(groups, lr=lr, momentum=momentum, tp_group=tp_group, ep_group=ep_group)
