"""A stage's backward from its output: whole, or split for zero-bubble schedules into B (input
gradient) now and W (weight gradients) later.

`free_output` / `backward` are Megatron's deallocate_output_tensor and custom_backward: once a
stage's output activation has been sent, its storage is released (the send keeps its own
reference until it completes) and the backward runs from its autograd graph alone, which is all
backward needs, so a stage holds only what backward saved, never the outputs of the micro-batches
in flight.

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


def free_output(output: torch.Tensor) -> None:
    """Release the storage of a sent output, keeping its autograd graph (a no-op for views,
    whose storage is another tensor's)."""
    if output._base is None and output.numel() > 1:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """`torch.autograd.backward(output, grad)`, also for an output freed by `free_output`
    (autograd checks `grad` against the shape the output had when it was made)."""
    if grad is None:
        torch.autograd.backward(output)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)  # keep_graph, create_graph, inputs,
    # allow_unreachable, accumulate_grad: what torch.autograd.backward passes


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
    backward(output, grad)
    return (inp.grad if inp is not None else None), PendingWeightGrad(store.take())


def backward_weight(pending: PendingWeightGrad, ready=None) -> None:
    """W: accumulate the weight gradients of one B into `param.grad`, in place. `ready`
    (optional) is called with [weight] as soon as a weight's gradient has been added (the last
    W of a step: its gradient is then final)."""
    WeightGradStore.apply(pending.entries, ready)
    pending.entries = []
