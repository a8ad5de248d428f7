"""Identical transformer layers of a stage, rehearsed once and replayed: the recorded effect of one.

On fake tensors a layer is a function of metadata only: given its input's shape, strides, dtype
and the same mask and documents, a layer built alike (the same module classes, attributes,
parameter shapes and dtypes: `signature`) makes the same collectives (op, bytes, dtype, group)
in its forward and in its backward, returns an output of the same metadata, sends its input a
gradient of the same metadata and gives each of its parameters a gradient. A uniform stack of
n >= 3 such layers in one model chunk is rehearsed as:

- the first layer runs for real, and its forward's collectives and output are recorded;
- the last layer runs for real; the collectives of its backward (between the gradient of its
  output and that of its input, recomputation included, the gradient buckets' reductions
  launched meanwhile left out) and its input's gradient are recorded;
- every layer between is one autograd node (`_Replay`) whose forward appends the first layer's
  recorded collectives to the count and returns an output of its metadata, and whose backward
  appends the last layer's and returns the recorded input gradient's metadata and a gradient of
  each parameter's shape and dtype (autograd accumulates them into ``.grad`` and runs the
  parameters' hooks, so the gradient buckets launch as in the real backward).

A stage is replayed only where that holds by construction: no ZeRO-3 (its hooks gather per
module), no float8 (per-weight casts and scales), no deferred weight gradients (zero-bubble's W
passes report weights themselves: the real layer's graph must reach every parameter of the
layer and no other leaf), no module hooks in the layer, a layer whose output has its input's
metadata, and grad mode on. Anywhere else the layers simply run.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megapar.comm_count import Call
from megapar.models.stage import StageModel

MIN_LAYERS = 3
"""Fewest identical layers in a chunk worth replaying (the first and last always run)."""


def _describe(value: Any, depth: int) -> Any:
    """A comparable description of an attribute of a layer's module: plain values as they are,
    tensors by metadata, other objects by type and their attributes (`depth` levels down),
    modules and deeper objects by identity."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(value).__name__, value)
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__qualname__, value.name)
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            value.requires_grad,
        )
    if isinstance(value, (tuple, list, collections.deque)):
        return (type(value).__name__, tuple(_describe(v, depth) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_describe(v, depth)) for v in value)))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _describe(v, depth)) for k, v in value.items()))
    if isinstance(value, nn.Module) or depth <= 0 or not hasattr(value, "__dict__"):
        return ("id", id(value))
    return (type(value).__qualname__, _describe(vars(value), depth - 1))


_MODULE_STATE = {"_parameters", "_buffers", "_modules"}


def signature(layer: nn.Module) -> tuple | None:
    """What makes two layers trace alike on fake tensors: each submodule's path, class,
    attributes, parameters and buffers (metadata). None where the layer cannot be replayed: a
    module with hooks, or a parameter shared with another module of it."""
    parts: list = []
    seen: set[int] = set()
    for name, module in layer.named_modules(remove_duplicate=False):
        hooks = (
            module._forward_hooks,
            module._forward_pre_hooks,
            module._backward_hooks,
            module._backward_pre_hooks,
        )
        if any(hooks):
            return None
        attrs = {
            k: v for k, v in vars(module).items() if k not in _MODULE_STATE and "hook" not in k
        }
        parts.append((name, type(module).__qualname__, _describe(attrs, 2)))
        for pname, p in module._parameters.items():
            if p is not None:
                if id(p) in seen:
                    return None
                seen.add(id(p))
            parts.append((name, pname, _describe(p, 0)))
        for bname, b in module._buffers.items():
            parts.append((name, bname, _describe(b, 0)))
    return tuple(parts)


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _empty(meta: tuple) -> torch.Tensor:
    shape, stride, dtype, device = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _reached_leaves(out: torch.Tensor, stop: torch.Tensor) -> list[torch.Tensor] | None:
    """The leaf tensors autograd reaches from `out` without passing `stop` (the layer's input),
    or None where the graph leaves the layer another way (`stop` is not reached)."""
    stop_node = stop.grad_fn
    leaves: list[torch.Tensor] = []
    found_stop = False
    seen: set = set()
    todo = [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if stop_node is not None and node is stop_node:
            found_stop = True
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad
            if variable is stop:
                found_stop = True
            else:
                leaves.append(variable)
            continue
        todo.extend(n for n, _ in node.next_functions)
    return leaves if found_stop else None


class _Replay(torch.autograd.Function):
    """A replayed layer: its recorded collectives and its output's and gradients' metadata."""

    @staticmethod
    def forward(ctx, stack: _Stack, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.stack, ctx.params = stack, [(tuple(p.shape), p.dtype, p.device) for p in params]
        assert stack.forward_calls is not None and stack.out_meta is not None
        stack.emit(stack.forward_calls)
        return _empty(stack.out_meta)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        stack: _Stack = ctx.stack
        if stack.backward_calls is None or stack.grad_in_meta is None:
            raise RuntimeError("a replayed layer's backward ran before its stack's last layer's")
        stack.emit(stack.backward_calls)
        grads = [
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.params
        ]
        return (None, _empty(stack.grad_in_meta), *grads)


class _Stack:
    """One chunk's uniform stack of layers: the first and last run and record, the rest replay."""

    def __init__(self, layers: list[nn.Module], calls: Callable[[], list[Call]], skip: Callable):
        self.layers = layers
        self.calls, self.skip = calls, skip
        self.in_meta: tuple | None = None
        self.extra: tuple | None = None
        self.out_meta: tuple | None = None
        self.params: list[torch.Tensor] | None = None
        self.forward_calls: list[Call] | None = None
        self.backward_calls: list[Call] | None = None
        self.grad_in_meta: tuple | None = None
        self.ok = False
        """The first layer's forward qualified the stack for replay."""
        self._window: list[int] = []
        self._watching = False

    def emit(self, calls: list[Call]) -> None:
        self.calls().extend(calls)

    def _taken(self, start: int, end: int) -> list[Call]:
        calls, skip = self.calls(), self.skip()
        return [calls[i] for i in range(start, end) if i not in skip]

    def forward(self, index: int, original, x, *extra, **kwargs):
        if kwargs:
            return original(x, *extra, **kwargs)
        layer = self.layers[index]
        real = (
            not torch.is_grad_enabled()
            or not isinstance(x, torch.Tensor)
            or not x.requires_grad
            or index in (0, len(self.layers) - 1)
            or not self.ok
            or _meta(x) != self.in_meta
            or len(extra) != len(self.extra or ())
            or any(a is not b for a, b in zip(extra, self.extra or ()))
        )
        if not real:
            assert self.params is not None
            return _Replay.apply(self, x, *(self.params[index]))
        if index == 0 and self.forward_calls is None:
            return self._record_forward(layer, original, x, extra)
        out = original(x, *extra)
        if index == len(self.layers) - 1 and self.ok and not self._watching:
            self._watching = True
            self._watch_backward(x, out)
        return out

    def _record_forward(self, layer, original, x, extra):
        start = len(self.calls())
        out = original(x, *extra)
        self.forward_calls = self._taken(start, len(self.calls()))
        if not (
            torch.is_grad_enabled()
            and isinstance(x, torch.Tensor)
            and isinstance(out, torch.Tensor)
            and x.requires_grad
            and out.grad_fn is not None
            and _meta(out) == _meta(x)
        ):
            return out
        leaves = _reached_leaves(out, x)
        wanted = [p for p in layer.parameters() if p.requires_grad]
        if leaves is None or {id(t) for t in leaves} != {id(p) for p in wanted}:
            return out
        if len(leaves) != len(wanted) or any(p.grad is None for p in wanted):
            return out
        self.in_meta, self.extra, self.out_meta = _meta(x), tuple(extra), _meta(out)
        # the same parameters of every layer, in one order
        self.params = [[p for p in m.parameters() if p.requires_grad] for m in self.layers]
        self.ok = all(
            len(ps) == len(wanted) and all(p.grad is not None for p in ps) for ps in self.params
        )
        return out

    def _watch_backward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Record the last layer's backward: from its output's gradient to its input's."""

        def began(grad):
            self._window.append(len(self.calls()))

        def ended(grad):
            if self._window and self.backward_calls is None:
                self.backward_calls = self._taken(self._window[0], len(self.calls()))
                self.grad_in_meta = _meta(grad)

        out.register_hook(began)
        x.register_hook(ended)


def replay_layers(engine, calls: Callable[[], list[Call]], skip: Callable[[], set[int]]):
    """Replay the uniform layer stacks of `engine`'s stage where that is exact (see the module
    docstring); `calls`: the counted calls; `skip`: indices of the calls that are not a
    layer's (the gradient buckets' reductions). Returns the function that puts the layers'
    own forwards back."""
    undo: list[nn.Module] = []
    if engine.sharded_params is not None or engine.step_fn.fp8_weight_casts is not None:
        return lambda: None
    if getattr(engine.cfg, "fp8", "off") != "off":
        return lambda: None
    for chunk in engine.model.modules():
        if not isinstance(chunk, StageModel):
            continue
        layers = list(getattr(chunk, "layers", {}).values())
        if len(layers) < MIN_LAYERS:
            continue
        first = signature(layers[0])
        if first is None or any(signature(layer) != first for layer in layers[1:]):
            continue
        stack = _Stack(layers, calls, skip)
        for i, layer in enumerate(layers):
            original = layer.forward
            layer.forward = lambda x, *extra, i=i, original=original, stack=stack, **kw: (
                stack.forward(i, original, x, *extra, **kw)
            )
            undo.append(layer)

    def restore() -> None:
        for layer in undo:
            del layer.forward

    return restore
