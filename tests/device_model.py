"""A GPU's placement rule, modelled on the CPU: a host tensor handed to a model on the device
fails, as `F.embedding(ids on the CPU, weight on cuda:0)` does on a GPU.

On the CPU, where the CUDA tier is rehearsed, host and device are the same memory, so a worker
that forgets `.to(mesh.device)` passes there and fails on its first GPU run. `DeviceModel` (a
torch function mode) keeps track of which tensors would live on the device:

- tensors created with a `device=` argument (the model's weights, pipeline buffers) or moved
  with `.to(<a device>)` / `.cuda()`, and every result of an operation with such an input;
- everything else is a host tensor (`torch.randint(...)` without a device, `.cpu()`).

While it is active, calling a megapar model (`StageModel`) with a host tensor that is not a
0-dim scalar (CUDA takes those) raises `HostTensorError` naming the input. Used by the CUDA
tier's rehearsal (`MEGAPAR_CUDA_TIER_ON_CPU=1`) and by tests/test_cuda.py's CPU test of it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megapar.models.stage import StageModel

MARK = "_megapar_on_device"


class HostTensorError(RuntimeError):
    """A host tensor reached a model whose parameters live on the device."""


def on_device(t: torch.Tensor) -> bool:
    return getattr(t, MARK, False)


def _mark(out) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, MARK, True)


def _moves_to_device(func, args, kwargs) -> bool:
    """`.to(device)`, `.to(other)`, `.to(device, dtype)`, `.cuda()`."""
    if func in (torch.Tensor.cuda,):
        return True
    if func is torch.Tensor.to:
        if "device" in kwargs or "other" in kwargs:
            return True
        return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])
    return False


class DeviceModel(TorchFunctionMode):
    """Tracks device placement (see the module docstring); `check_model_inputs` is the rule."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.pin_memory):
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if kwargs.get("device") is not None or _moves_to_device(func, args, kwargs) or \
                any(on_device(t) for t in inputs):
            _mark(out)
        return out


def check_model_inputs(module, args) -> None:
    """The rule: every non-scalar tensor a `StageModel` receives is on the device."""
    if not isinstance(module, StageModel):
        return
    hidden, batch = (args + (None, None))[:2]
    named = [("hidden", hidden)] + sorted((batch or {}).items())
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and not on_device(t):
            raise HostTensorError(
                f"{type(module).__name__} got the host tensor {name!r} {tuple(t.shape)}; on a "
                f"GPU this fails ('Expected all tensors to be on the same device'): move it "
                f"with .to(mesh.device)")


@contextlib.contextmanager
def device_model():
    """While active: placement is tracked and megapar models refuse host tensors."""
    hook = torch.nn.modules.module.register_module_forward_pre_hook(check_model_inputs)
    try:
        with DeviceModel():
            yield
    finally:
        hook.remove()


def call_with_device_model(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` under `device_model()` (picklable: a worker's target)."""
    with device_model():
        return fn(*args, **kwargs)
