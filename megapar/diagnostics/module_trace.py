"""Hooks on a rank's stage that watch every module's values during a step, named as in the
Hugging Face export (`transformer.h.2.mlp.c_fc`), put on from outside the model.

`hf_modules(stage, config)` names a stage's modules: a module that holds parameters is named
after them (`checkpoint.hf.hf_parameter_names` without `.weight` / `.bias`; BERT's fused q, k, v
after their parent `attention.self`), and a module that holds such modules inside one layer
(`transformer.h.2.attn`, `transformer.h.2`) after their common prefix.

`ModuleTrace` hooks them for as long as it is attached to an executor (`attached`) and records,
per event, on the device and without reading anything back: whether the value is finite (the
earliest non-finite event as one int64, `first`). The events are:

- forward: each module's output, in a forward action (not the recomputation of a forward
  inside a backward), and the loss a last stage returns;
- backward: the gradient with respect to each module's input, as its backward produces it,
  and after each backward action (B or W under zero bubble) each module's weight gradients.

Each event has a key that orders it among the events of every rank: (micro-batch, forward
before backward, pipeline position of the model chunk (in backward, from the last), the call
order on this rank). Ranks that run the same modules (tp, cp, dp peers) give the same module
the same key, so the rank whose value turns non-finite first has the smallest key.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from megapar.checkpoint.hf import hf_parameter_names
from megapar.models.config import LLAMA_TYPES

if TYPE_CHECKING:
    from megapar.pipeline.executor import PipelineExecutor

LAYER_NAME = re.compile(r"\.(h|layer|layers)\.\d+(\.|$)")
"""A transformers name inside one layer (`transformer.h.2`, `bert.encoder.layer.0.attention`)."""

LOSS_NAME = {"gpt2": "lm_head", **dict.fromkeys(LLAMA_TYPES, "lm_head"), "bert": "cls.predictions"}
"""What the loss event is named after (the head whose logits give the loss)."""

NONE = 2**62
"""The key of "no non-finite event"."""

BACKWARD_KINDS = ("backward", "backward_input", "backward_weight")


def _common(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    out = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        out.append(column[0])
    return ".".join(out)


def hf_modules(stage: nn.Module, config) -> list[tuple[int, nn.Module, str]]:
    """(chunk, module, transformers name) of every named module of `stage`, in registration
    order (parents before children)."""
    chunks = list(getattr(stage, "chunks", [stage]))
    out = []
    for c, chunk in enumerate(chunks):
        own: dict[int, str] = {}
        for path, module in chunk.named_modules():
            names = []
            for pname, p in module.named_parameters(recurse=False):
                canonical = f"{path}.{pname}" if path else pname
                names += [
                    n.rsplit(".", 1)[0]
                    for n in hf_parameter_names(config, canonical, hasattr(p, "tied_to"))
                ]
            if names:
                own[id(module)] = _common(names)
        for _, module in chunk.named_modules():
            if id(module) in own:
                out.append((c, module, own[id(module)]))
                continue
            inner = [own[id(m)] for m in module.modules() if id(m) in own]
            name = _common(inner) if inner else ""
            if LAYER_NAME.search(name + ".") and name not in inner:
                out.append((c, module, name))
    return out


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


class ModuleTrace:
    """Finiteness of every named module's values during the steps it is attached to."""

    def __init__(self, stage: nn.Module, config, mesh, weight_grads: bool = True):
        self.stage, self.mesh = stage, mesh
        self.weight_grads = weight_grads
        """Check the weight gradients after each backward action (off where only the forward
        outputs are wanted: a recorded step, whose gradients the dp reduction may be reading)."""
        self.modules = hf_modules(stage, config)
        self.loss_name = LOSS_NAME[config.model_type]
        self.chunks = len(list(getattr(stage, "chunks", [stage])))
        self.first = torch.full((), NONE, dtype=torch.int64, device=mesh.device)
        """The smallest key of a non-finite event (`NONE`: none), on the device."""
        self.events: dict[int, tuple] = {}
        """key -> (module name, "forward" / "backward", what, micro-batch) for every event."""
        self.observers: list = []
        """Called with (key, module name, micro-batch, module, output) at each forward
        output event (`replay`)."""
        self.current = None  # (action kind, micro-batch, chunk) while an action runs
        self.executor: PipelineExecutor | None = None
        self.calls = 0

    # keys -----------------------------------------------------------------------------------
    def key(self, mb: int, backward: bool, chunk: int) -> int:
        """The order of an event now: (micro-batch, phase, pipeline position, call on this
        rank), packed into an int64 (up to 4096 pipeline positions, 2^28 events a step)."""
        vs = (
            chunk * self.mesh.pp + self.mesh.pp_rank
            if self.executor is None
            else self._virtual_stage(chunk)
        )
        n = self.mesh.pp * self.chunks
        position = n - 1 - vs if backward else vs
        self.calls += 1
        return ((((mb * 2 + int(backward)) << 12) + position) << 28) + self.calls

    def _virtual_stage(self, chunk: int) -> int:
        assert self.executor is not None  # called only while attached (`key`)
        return self.executor.virtual_stage(chunk)

    def describe(self, key: int) -> str:
        name, phase, what, mb = self.events[key]
        return f"{phase}: {what} of {name}, micro-batch {mb}"

    def _record(self, key: int, event: tuple, value: torch.Tensor) -> None:
        self.events[key] = event
        bad = ~torch.isfinite(value.detach()).all()
        self.first = torch.minimum(self.first, torch.where(bad, key, NONE))

    # hooks ----------------------------------------------------------------------------------
    def _forward_hook(self, chunk: int, name: str, module, args, output):
        ctx = self.current
        if ctx is None or ctx[0] != "forward":  # a recomputation inside a backward
            return
        mb = ctx[1]
        out = _first_tensor(output)
        if out is not None and out.is_floating_point():
            key = self.key(mb, False, chunk)
            self._record(key, (name, "forward", "output", mb), out)
            for observe in self.observers:
                observe(key, name, mb, module, out)
        if torch.is_grad_enabled():
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    a.register_hook(functools.partial(self._grad_hook, chunk, name, mb))

    def _grad_hook(self, chunk: int, name: str, mb: int, grad):
        if grad is not None:
            self._record(self.key(mb, True, chunk), (name, "backward", "input gradient", mb), grad)

    def _loss_hook(self, chunk: int, module, args, output):
        ctx = self.current
        if (
            ctx is None
            or ctx[0] != "forward"
            or not isinstance(output, torch.Tensor)
            or output.dim() != 0
        ):
            return
        self._record(
            self.key(ctx[1], False, chunk), (self.loss_name, "forward", "loss", ctx[1]), output
        )

    def _weight_grads(self, chunk: int, mb: int) -> None:
        """After a backward action: each module's weight gradients, in backward order."""
        for c, module, name in reversed(self.modules):
            grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            if c != chunk or not grads:
                continue
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            key = self.key(mb, True, chunk)
            self.events[key] = (name, "backward", "weight gradient", mb)
            self.first = torch.minimum(self.first, torch.where(finite, NONE, key))

    def _wrap(self, kind: str, handler):
        def run(action):
            self.current = (kind, action.mb, action.chunk)
            try:
                handler(action)
            finally:
                self.current = None
            if kind in BACKWARD_KINDS and self.weight_grads:
                self._weight_grads(action.chunk, action.mb)

        return run

    @contextlib.contextmanager
    def attached(self, executor):
        """Hooks on, and the executor's actions seen, inside the block."""
        handles = []
        saved = dict(executor.handlers)
        self.executor = executor
        try:
            for kind, handler in saved.items():
                executor.handlers[kind] = self._wrap(kind, handler)
            for chunk, module, name in self.modules:
                handles.append(
                    module.register_forward_hook(functools.partial(self._forward_hook, chunk, name))
                )
            for chunk, root in enumerate(getattr(self.stage, "chunks", [self.stage])):
                handles.append(
                    root.register_forward_hook(functools.partial(self._loss_hook, chunk))
                )
            yield self
        finally:
            for h in handles:
                h.remove()
            executor.handlers.clear()
            executor.handlers.update(saved)
            self.executor = None
