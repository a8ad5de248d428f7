"""The zero-bubble split of a stage's backward: B (input gradient) now, W (weight gradients) later.

B runs the stage's ordinary backward while its linear layers defer their weight-gradient
products (``dW = dY^T X``) into the stage's `WeightGradStore`
(`megapar.tensor_parallel.weight_grad`): it yields d(loss)/d(input), the gradient the previous
stage waits for, plus every gradient that is cheap (LayerNorms, biases, embeddings, the loss).
W computes the deferred products and adds them IN PLACE into ``param.grad`` (``grad += dw``),
so ``.grad`` tensors that are views into a flat buffer (data-parallel buckets) stay those views.
B + W is the work of one ordinary backward: nothing is traversed twice.

A stage without an input (the model's first slice) splits the same way: its B sends nothing
upstream, and its W is the linear layers' weight products.
"""

from __future__ import annotations

import torch

from megapar.tensor_parallel.weight_grad import WeightGradStore


class PendingWeightGrad:
    """What W of one micro-batch of one chunk needs from its B: the deferred products."""

    def __init__(self, entries: list):
        self.entries = entries


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   store: WeightGradStore):
    """B: returns (d loss / d inp or None, the PendingWeightGrad for W). `grad` is None when
    `output` is the (scaled) loss; `store` must be enabled and attached to the stage's linear
    layers before their forward."""
    if len(store):
        raise RuntimeError("the weight-gradient store holds products of another backward; "
                           "every B must be followed by taking its products")
    torch.autograd.backward(output, grad_tensors=grad)
    return (inp.grad if inp is not None else None), PendingWeightGrad(store.take())


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate the weight gradients of one B into `param.grad`, in place."""
    WeightGradStore.apply(pending.entries)
    pending.entries = []
