"""One rank of an N-rank job inside this process: a fake process group and fake tensors.

`fake_process_group(world_size, rank)` initialises torch.distributed's "fake" backend as `rank`
of `world_size` (the real group construction runs: `Mesh` builds its DeviceMesh and every
subgroup, but no collective communicates: each completes at once and leaves its tensors alone)
and tears it down after; `fake_tensors()` is a `FakeTensorMode` (every tensor made inside has a
shape, a dtype and a CPU device but no memory, and every operator runs its shape rule only). Nothing
lives in a module global: each rank of a dry run gets its own group, one after the other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from megapar.optim.offload import HOST_COPIES_ENV


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """Run the block as `rank` of a `world_size`-rank job on the fake process group, with the
    CPU as the device (as a real rank would see its own GPU; --offload-optimizer makes its
    host copies, as on a GPU: `HOST_COPIES_ENV`)."""
    if dist.is_initialized():
        raise RuntimeError(
            "a dry run needs a process without a torch.distributed process group "
            "(it creates a fake one per rehearsed rank)"
        )
    saved, hook = {k: os.environ.get(k) for k in ("MEGAPAR_CPU", HOST_COPIES_ENV)}, sys.excepthook
    os.environ.update({k: "1" for k in saved})
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook  # torch's hook would prefix later tracebacks with "[rank R]:"
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_autograd() -> None:
    """One backward of a real tensor, outside any FakeTensorMode: autograd's engine sizes its
    device threads once per process, at its first backward, and torch 2.11's CUDA build counts
    8 fake devices when that backward is fake (on a machine without GPUs too), starts 8 threads,
    and every process forked after (`launcher.run_local`'s ranks) then fails at its first
    backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). Counted here, the devices are the real ones."""
    torch.zeros((), requires_grad=True).backward()


@contextlib.contextmanager
def fake_tensors():
    """Tensors made in the block are fake (shape, dtype, device; no memory, no values). Enter it
    after the `Mesh`: DeviceMesh reads its rank grid's values."""
    _start_autograd()
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        # GradBuckets compares .grad and buffer-view data pointers (all 0 on fake tensors: it
        # then treats every gradient as accumulated in place, which it is here)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once): what
    they occupy in memory. Works alike on real and fake tensors."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def held_bytes(model, optimizer, sharded=None) -> dict[str, int]:
    """What a rank holds besides activations: {"params": parameter elements, "weights",
    "grads", "optimizer": bytes of the distinct storages behind the parameters, their gradients
    and every tensor of the optimizer's state (Adam's step counters included), "master": the
    host copies of an offloaded optimizer (`offload.HostStep`) and "host": the bytes of all
    these in host memory (an offloaded optimizer's state and copies); under ZeRO-2 the
    gradients are the optimizer pieces' (this rank's shards); under ZeRO-3 (`sharded`, its
    `ShardedParams`) the weights are the units' shards (the parameters are views into the
    units' full buffers, freed between uses) and the gradients their gradient shards}."""
    params = list(model.parameters())
    state = [
        t for s in (optimizer.inner.state.values() if optimizer.inner else ()) for t in s.values()
    ]
    host = getattr(optimizer, "host", None)
    master = storage_bytes(host.host_tensors()) if host is not None else 0
    weights = storage_bytes([u.shard for u in sharded.units] if sharded is not None else params)
    held = {
        "params": sum(p.numel() for p in params),
        "weights": weights,
        "grads": storage_bytes(
            [p.grad for p in params if p.grad is not None]
            + [t.grad for t in getattr(optimizer, "pieces", ())]
        ),
        "optimizer": storage_bytes(state),
        "master": master,
    }
    return {**held, "host": held["optimizer"] + master if host is not None else 0}
