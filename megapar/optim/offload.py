"""`--offload-optimizer`: the optimizer steps in host memory (DeepSpeed's offload_optimizer).

An optimizer steps a list of tensors: its parameters, or under ZeRO its pieces (slices of the
flat parameter buffer). `HostStep(stepped)` keeps, for each, an fp32 master copy in host memory
(pinned when the tensors are on CUDA) with a host gradient of the same shape; the torch
optimizer is built over the masters, so its moments are made in host memory too. Each step:

1. copy the (reduced, unscaled, clipped) gradients of the stepped tensors to the host masters'
   ``.grad`` (one device-to-host copy per tensor; the first waits for the backward);
2. step the torch optimizer on the host;
3. copy the updated masters back into the stepped tensors (host-to-device from pinned memory,
   queued on the current stream).

Weights set from outside between steps (a checkpoint loaded into the model) are seen by their
tensors' version counters (under ZeRO by the parameters', which a write into a parameter moves
and its pieces' do not) and copied to the masters at the next step.

On the CPU the host is the device: the masters are the stepped tensors themselves, nothing is
copied and only the accounting changes (the dry run counts the state as host memory). The
environment's `MEGAPAR_HOST_COPIES=1` makes separate copies on the CPU too, as on CUDA: the
dry run rehearses a GPU job with it, and the tests run the copying path with it.

The optimizer's state stays keyed by the stepped tensors for the rest of megapar (checkpoints,
`state_dict`): `HostKeyed` is torch's state mapping with the stepped tensor looked up as its
master, and state set for it (a checkpoint being loaded) moved to the master's memory.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from megapar.device import HOST_COPIES_ENV, host_copies_wanted

__all__ = ["HOST_COPIES_ENV", "HostKeyed", "HostStep"]


class HostKeyed(defaultdict):
    """torch's optimizer state (a defaultdict(dict)) whose keys may also be given as the
    stepped tensors: each is looked up as its host master, and its state is moved to the
    master's device when set."""

    def __init__(self, master_of: dict[int, torch.Tensor]):
        super().__init__(dict)
        self.master_of = master_of

    def _key(self, t):
        return self.master_of.get(id(t), t)

    def __getitem__(self, t):
        return super().__getitem__(self._key(t))

    def __setitem__(self, t, state):
        key = self._key(t)
        if isinstance(state, dict) and isinstance(key, torch.Tensor):
            state = {
                k: v.to(key.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
        super().__setitem__(key, state)

    def __contains__(self, t):
        return super().__contains__(self._key(t))

    def __delitem__(self, t):
        super().__delitem__(self._key(t))

    def get(self, t, default=None):
        return super().get(self._key(t), default)


class HostStep:
    """The host side of an offloaded optimizer over `stepped` (see the module docstring).

    `masters` (--offload-params: views into the host-held parameter shards): the host tensors
    that *are* the weights, one per stepped tensor. Then the stepped tensors only carry the
    device gradients (their storage may be freed between steps): the step writes nothing back
    to them, and weights set from outside are set in the masters."""

    def __init__(
        self,
        stepped: list[torch.Tensor],
        masters: list[torch.Tensor] | None = None,
        watched: list[torch.Tensor] | None = None,
    ):
        """`watched`: per stepped tensor, the tensor through which weights are set from
        outside (ZeRO's pieces: their parameters, whose in-place writes do not reach the
        pieces' version counter); default: the stepped tensors themselves."""
        self.stepped = list(stepped)
        self.watched = list(watched) if watched is not None else self.stepped
        device = self.stepped[0].device if self.stepped else torch.device("cpu")
        self.given = masters is not None
        """The masters were given (they hold the weights; nothing is copied back)."""
        self.copies = self.given or host_copies_wanted(device)
        """Separate host masters (CUDA, or asked for); otherwise the masters are `stepped`."""
        pin = self.pinned = device.type == "cuda"
        if self.copies:
            self.masters = (
                list(masters)
                if masters is not None
                else [_host_like(t, pin, t.detach()) for t in self.stepped]
            )
            self.grads = [_host_like(m, pin) for m in self.masters]
            for m, g in zip(self.masters, self.grads):
                m.grad = g
        else:
            self.masters, self.grads = self.stepped, []
        self.master_of = {id(t): m for t, m in zip(self.stepped, self.masters)}
        self._seen: list[tuple[int, int] | None] = []
        self.refreshed = 0
        """Masters copied from their stepped tensors, set from outside between steps."""
        self.settled()

    def settled(self) -> None:
        """Note the stepped tensors as the masters hold them (after a step and its all-gather):
        a later change from outside (weights loaded from a checkpoint) is copied to the masters
        at the next step."""
        self._seen = (
            [_mark(t) for t in self.watched]
            if self.copies and not self.given
            else [None] * len(self.stepped)
        )

    def groups(self, groups: list[dict]) -> list[dict]:
        """The optimizer's param groups with each stepped tensor replaced by its master."""
        return [
            {**g, "params": [self.master_of.get(id(p), p) for p in g["params"]]} for g in groups
        ]

    def adopt(self, inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Key `inner`'s state by the stepped tensors too (`HostKeyed`)."""
        if self.copies:
            state = HostKeyed(self.master_of)
            state.update(inner.state)
            inner.state = state
        return inner

    @torch.no_grad()
    def step(self, inner_step) -> None:
        """Gradients to the host, `inner_step()` there, parameters back."""
        if not self.copies:
            inner_step()
            return
        for t, w, m, g, seen in zip(
            self.stepped, self.watched, self.masters, self.grads, self._seen
        ):
            if seen is not None and _mark(w) != seen:  # weights set from outside since then
                m.copy_(t)
                self.refreshed += 1
            m.grad = None if t.grad is None else g  # no gradient: not stepped, as on the device
            if t.grad is not None:
                g.copy_(t.grad)  # device to pinned host: waits for the gradients
        inner_step()
        if not self.given:
            for t, m in zip(self.stepped, self.masters):
                t.copy_(m, non_blocking=True)

    def host_tensors(self) -> list[torch.Tensor]:
        """The host copies this offload made (masters and their gradients; [] without)."""
        return [*self.masters, *self.grads] if self.copies else []


def _mark(t: torch.Tensor) -> tuple[int, int]:
    """What changes when a tensor's values are set in place (its version) or replaced (its
    storage)."""
    return t._version, t.untyped_storage()._cdata


def _host_like(t: torch.Tensor, pin: bool, src: torch.Tensor | None = None) -> torch.Tensor:
    """A host tensor of `t`'s shape and dtype (pinned when `pin`), a copy of `src` if given."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    if src is not None:
        out.copy_(src)
    return out
