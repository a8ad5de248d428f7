"""Linear layers whose weight gradient can be deferred: the zero-bubble split of backward.

A linear layer's backward is two matrix products: the input gradient ``dX = dY W`` (what the
previous pipeline stage waits for) and the weight gradient ``dW = dY^T X`` (which nobody waits
for). Zero-bubble schedules (Qi et al. 2024) run the first at once (B) and the second later (W),
in the pipeline bubble. As in Megatron-core, the linear layers do the split themselves: while a
`WeightGradStore` is attached and enabled, their backward computes dX (and the cheap bias
gradient) and puts (weight, X, dY) in the store instead of computing dW; `apply` computes the
stored dW products later and adds them *in place* to ``weight.grad`` (which may be a view into
a flat data-parallel buffer). Everything else (LayerNorm, embeddings, the loss) runs in B as
usual, so B + W does the work of one ordinary backward, no more.

The layers hold a reference (``weight_grad_store``, None by default: an ordinary F.linear);
the pipeline attaches a store to the modules of a stage it runs with a split backward. Nothing
here is global, and the model code does not know whether its weight gradients are deferred.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapar.graph_break import graph_break


class WeightGradStore:
    """Weight-gradient products deferred by the linear layers of one pipeline stage."""

    def __init__(self) -> None:
        self.enabled = False
        """Defer while True (the pipeline enables it for steps whose backward is split)."""
        self._entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.deferred = 0
        """Weight-gradient products deferred so far (all steps)."""

    def put(self, weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        self._entries.append((weight, x, grad_out))
        self.deferred += 1

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The products deferred since the last `take` (one backward's), and forget them."""
        entries, self._entries = self._entries, []
        return entries

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    @torch.no_grad()
    def apply(entries, ready=None) -> None:
        """W: ``weight.grad += dY^T X`` for each entry, in the dtype autograd would use (the
        autocast dtype of dY under mixed precision), accumulated into the weight's dtype.
        `ready([weight])`, if given, follows a weight's last entry."""
        last = {id(weight): i for i, (weight, _, _) in enumerate(entries)}
        for i, (weight, x, grad_out) in enumerate(entries):
            g = grad_out.reshape(-1, grad_out.shape[-1])
            dw = g.t().matmul(x.reshape(-1, x.shape[-1]).to(g.dtype))
            if weight.grad is None:
                weight.grad = dw.to(weight.dtype)
            else:
                weight.grad.add_(dw)
            if ready is not None and last[id(weight)] == i:
                ready([weight])


class _DeferredWeightGradLinear(torch.autograd.Function):
    """F.linear whose backward returns dX and db now and stores dW's operands."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, param):
        # `weight` comes detached, so autograd has no edge to the parameter (no AccumulateGrad
        # runs for it in B, and no post-accumulate hook says its gradient is ready before W);
        # the parameter itself and the weight dX reads (`param`, a tuple: not inputs of the
        # graph; the same tensor unless W is read from a 16-bit copy) are kept for B and W,
        # also under activation checkpointing, whose saved tensors are recomputed stand-ins.
        ctx.save_for_backward(x)
        (ctx.param, ctx.read), ctx.store, ctx.has_bias = param, store, bias is not None
        return F.linear(x, weight, bias)  # autocast (if on) casts here, as for F.linear

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        read = ctx.read
        grad_x = grad_out.matmul(read.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        ctx.store.put(ctx.param, x.detach(), grad_out.detach())
        return grad_x, None, grad_b, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    store: WeightGradStore | None,
    param: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, with the weight gradient deferred into `store` when it is enabled. `param`:
    the parameter whose gradient a deferred W accumulates into, where `weight` is read from
    a copy of it (`weight_copy.WeightCopy`); None: `weight` is the parameter."""
    if (
        store is None
        or not store.enabled
        or not torch.is_grad_enabled()
        or not weight.requires_grad
    ):
        return F.linear(x, weight, bias)
    kept = (weight, weight) if param is None or param is weight else (param, weight.detach())
    if torch.compiler.is_compiling():
        return _deferred_linear(x, weight, bias, store, kept)
    return _DeferredWeightGradLinear.apply(x, weight.detach(), bias, store, kept)


@graph_break
def _deferred_linear(x, weight, bias, store: WeightGradStore, kept: tuple) -> torch.Tensor:
    """The deferring F.linear, run eagerly also inside torch.compile'd code (`--compile`: a
    graph break): its backward puts (X, dY) in the Python store, which a compiled backward
    would not do."""
    return _DeferredWeightGradLinear.apply(x, weight.detach(), bias, store, kept)


def attach(module: torch.nn.Module, store: WeightGradStore | None) -> int:
    """Point every layer of `module` that can defer its weight gradient at `store` (None
    detaches); returns how many layers that is."""
    count = 0
    for m in module.modules():
        if hasattr(m, "weight_grad_store"):
            # a plain attribute; nn.Module's stubs only type tensors and modules
            m.weight_grad_store = store  # type: ignore[assignment]
            count += 1
    return count


def store_of(module: torch.nn.Module) -> WeightGradStore:
    """The store `module`'s layers point at, attaching a new one if they have none. Every
    pipeline executor of one stage (one per sequence length) gets the same store this way, so
    a second executor does not detach the first one's."""
    for m in module.modules():
        found = getattr(m, "weight_grad_store", None)
        if found is not None:
            return found
    store = WeightGradStore()
    attach(module, store)
    return store
