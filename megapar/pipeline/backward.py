"""A pipeline stage's backward: whole, or split into B and W, from outputs whose storage was freed.

Once a stage's output activation is sent its values are not needed any more, only its autograd
graph (Megatron's deallocate_output_tensor): the executor's walk swaps its storage (unless it is
a view's, another tensor's) for a one-element stand-in that every freed output of a dtype and
device shares (`stand_in_for`), and `backward` runs from the graph with the gradient the
output had. Zero-bubble schedules split the backward into B (`backward_input`: the gradient
w.r.t. the chunk's input, sent upstream next; the linear layers store their (X, dY) products in
a `WeightGradStore`) and W (`backward_weight`: those products added to the weight gradients,
in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import nn

from megapar.pipeline.schedules import Action
from megapar.tensor_parallel.weight_grad import WeightGradStore

if TYPE_CHECKING:
    from megapar.data_parallel.grad_sync import GradSync
    from megapar.mesh import Mesh

_FREED: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the one-element stand-in


def stand_in_for(dtype: torch.dtype, device) -> torch.Tensor:
    """The one-element tensor every freed output of `dtype` on `device` shares."""
    key = (dtype, torch.device(device))
    stand_in = _FREED.get(key)
    if stand_in is None:
        stand_in = _FREED[key] = torch.empty((1,), dtype=dtype, device=device)
    return stand_in


def backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """`torch.autograd.backward(output, grad)`, also for an output whose storage was freed
    (autograd checks `grad` against the shape the output had when it was made)."""
    if grad is None:
        torch.autograd.backward(output)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True
    )  # keep_graph, create_graph, inputs,
    # allow_unreachable, accumulate_grad: what torch.autograd.backward passes


class PendingWeightGrad:
    """What W of one micro-batch of one chunk needs from its B: the deferred products."""

    def __init__(self, entries: list):
        self.entries = entries


def backward_input(
    output: torch.Tensor,
    grad: torch.Tensor | None,
    inp: torch.Tensor | None,
    store: WeightGradStore,
) -> tuple[torch.Tensor | None, PendingWeightGrad]:
    """B: returns (d loss / d inp or None, the PendingWeightGrad for W). `grad` is None when
    `output` is the (scaled) loss; `store` must be enabled and attached to the stage's linear
    layers before their forward."""
    if len(store):
        raise RuntimeError(
            "the weight-gradient store holds products of another backward; "
            "every B must be followed by taking its products"
        )
    backward(output, grad)
    return (inp.grad if inp is not None else None), PendingWeightGrad(store.take())


def backward_weight(pending: PendingWeightGrad, ready=None) -> None:
    """W: accumulate the weight gradients of one B into `param.grad`, in place. `ready`
    (optional) is called with [weight] as soon as a weight's gradient has been added (the last
    W of a step: its gradient is then final)."""
    WeightGradStore.apply(pending.entries, ready)
    pending.entries = []


class StageBackward:
    """The backward handlers of `PipelineExecutor` (a whole backward, B and W) over the step's
    per-slot state: `outputs`, `inputs` (popped here: a micro-batch's backward frees both),
    `_out_grads` (received), `_in_grads` (to send upstream), `_pending_w` (B done, W not yet),
    `weight_grads` (the stage's `WeightGradStore`), `_loss_chunk`, `_batches`, `_loss_scale`
    and `_ready` (`grad_sync.grads_ready` where a chunk's weight gradients become final)."""

    # What the executor sets (`PipelineExecutor.__init__` and `_reset`), declared for the
    # handlers here:
    mesh: Mesh
    weight_grads: WeightGradStore
    _chunk_count: int
    _loss_chunk: int | None
    inputs: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    _out_grads: dict[int, torch.Tensor]
    _in_grads: dict[int, torch.Tensor]
    _pending_w: dict[int, PendingWeightGrad]
    _batches: list[dict]
    _loss_scale: float | torch.Tensor
    _loss_grad: torch.Tensor | None
    _grad_sync: GradSync | None
    _step_index: int | None
    _report_at: frozenset[int]
    _ready: Callable[[], Callable[[Iterable[nn.Parameter]], None] | None]

    def _backward(self, a: Action) -> None:
        key, out, grad = self._output_and_grad(a)
        backward(out, grad)
        store = self.weight_grads  # deferring only in a step with split backwards (DualPipeV):
        if store.enabled and len(store):  # a whole backward there applies what it deferred
            WeightGradStore.apply(store.take(), self._ready())
        x = self.inputs.pop(key, None)
        self._keep_input_grad(a, key, x, None if x is None else x.grad)

    def _output_and_grad(self, a: Action) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The action's slot, and its micro-batch's chunk output (popped) with the gradient it
        is backpropagated with: the received one (popped), or at the loss the step's loss
        gradient."""
        key = a.mb * self._chunk_count + a.chunk
        out = self.outputs.pop(key)
        if a.chunk == self._loss_chunk:
            grad = self._loss_grad if self._loss_grad is not None else self._first_loss_grad(out)
        else:
            grad = self._out_grads.pop(key)
        return key, out, grad

    def _keep_input_grad(
        self, a: Action, key: int, x: torch.Tensor | None, dx: torch.Tensor | None
    ) -> None:
        """Keep the gradient of the chunk's received input `x` to send upstream (none for a
        chunk that received none); an output that did not depend on its input is an error."""
        if x is not None:
            if dx is None:
                self._no_input_grad(a)
            self._in_grads[key] = dx

    def _first_loss_grad(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a micro-batch's loss is backpropagated with, made at the step's first:
        what autograd would pass back through ``loss * loss_scale / m`` (ones / m, times the
        scale: the same operations in the same order, so the same bits), so the forward needs
        no scaling operation per micro-batch."""
        grad = torch.ones_like(loss) / len(self._batches)
        scale = self._loss_scale
        if isinstance(scale, torch.Tensor) or scale != 1.0:  # x * 1.0 is x
            grad = grad * scale
        self._loss_grad = grad
        return grad

    def _backward_input(self, a: Action) -> None:
        """B: the gradient w.r.t. the chunk's input only (sent upstream next); W comes later."""
        key, out, grad = self._output_and_grad(a)
        x = self.inputs.pop(key, None)
        dx, self._pending_w[key] = backward_input(out, grad, x, self.weight_grads)
        self._keep_input_grad(a, key, x, dx)

    def _backward_weight(self, a: Action) -> None:
        """W: the chunk's weight gradients of one micro-batch, added in place to `.grad`; a
        chunk's last W reports each finished weight to the data-parallel reduction."""
        backward_weight(
            self._pending_w.pop(a.mb * self._chunk_count + a.chunk),
            self._grad_sync.grads_ready
            if self._grad_sync is not None and self._step_index in self._report_at
            else None,
        )  # `_ready`, inline

    def _no_input_grad(self, a: Action) -> NoReturn:
        raise RuntimeError(
            f"pp stage {self.mesh.pp_rank}: the output of micro-batch {a.mb} "
            f"(chunk {a.chunk}) does not depend on the received activation"
        )
