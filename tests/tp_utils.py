"""Helpers shared by the parallel tests."""

import os

import torch
import torch.distributed as dist

from megapar.data_parallel import shard_comm
from megapar.data_parallel.zero3_units import all_gather
from megapar.mesh import Layout, Mesh


def make_mesh(tp=1, pp=1, dp=1) -> Mesh:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Mesh(Layout(tp, pp, dp), rank)


def to_device(batches, device):
    """A micro-batch (a dict of tensors) or a list of them on `device` (the mesh's: on a GPU a
    model cannot read host tensors)."""
    if isinstance(batches, dict):
        return {k: v.to(device) for k, v in batches.items()}
    return [to_device(b, device) for b in batches]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


# Some gradients are exactly zero in exact arithmetic (e.g. the attention key bias: adding a
# constant to every score of a query leaves softmax unchanged), so both sides are rounding noise
# and a relative error means nothing. Below this magnitude the reference counts as zero.
ZERO_FLOOR = 1e-7


def assert_close(a, b, tol=1e-5, what=""):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if b.detach().abs().max().item() < ZERO_FLOOR:
        diff = (a.detach().double() - b.detach().double()).abs().max().item()
        assert diff < ZERO_FLOOR, f"{what}: reference is zero, got max |diff| {diff:.3g}"
        return
    err = rel_err(a, b)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def world(n):
    return int(os.environ.get("WORLD_SIZE", "1")) == n


def saved_bytes(model, run):
    """(bytes of the distinct storages autograd keeps for backward while `run()` executes,
    parameters excluded; run's result)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(saved.values()), out


def refusal(engine, batch) -> str:
    """The ValueError `engine.train_step(batch)` raises, as text ("accepted" if it trains)."""
    try:
        engine.train_step(batch)
    except ValueError as exc:
        return str(exc)
    return "accepted"


@torch.no_grad()
def gather_grads(optimizer) -> None:
    """ZeRO-1 / ZeRO-2: all-gather the reduced gradient slices so every ``.grad`` is the full
    dp-averaged gradient (collective over dp; the step does not need it). Nothing when the
    optimizer is not sharded."""
    if not optimizer.sharded:
        return
    sync = optimizer.grad_sync
    buffers = sync.buffers
    if sync.sharded_grads:  # ZeRO-2: full buffers made here, this rank's slices filled in
        devices = {b.params[0].dtype: b.shard.device for b in sync.buckets}
        buffers = {dt: torch.zeros(n, dtype=dt, device=devices[dt])
                   for dt, n in sync.buffer_sizes().items()}
        for b in sync.buckets:
            lo, hi = sync.shard_range(b)
            flat = buffers[b.params[0].dtype][b.start:b.start + b.padded]
            flat[lo:hi] = b.shard
            offset = 0
            for p in b.params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
    for b in sync.buckets:
        flat = buffers[b.params[0].dtype][b.start:b.start + b.padded]
        shard_comm.all_gather(flat, sync.dp, sync.group, sync.host_waits).wait()


@torch.no_grad()
def full_grads(sharded) -> dict[int, torch.Tensor]:
    """ZeRO-3: id(param) -> the dp-averaged full gradient of a `ShardedParams` (all-gathers
    the gradient shards; collective)."""
    out = {}
    for u in sharded.units:
        flat = u.grad_shard  # a unit over this rank alone: its shard is whole
        if u.group_size > 1:
            flat = torch.empty(u.padded, dtype=u.shard.dtype, device=u.shard.device)
            all_gather(flat, u.grad_shard, u.group).wait()
        offset = 0
        for p in u.params:
            out[id(p)] = flat[offset:offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
    return out


def record_first_grads(optimizer, model, mesh, sharded=None) -> dict[str, torch.Tensor]:
    """Wrap ``optimizer.step`` so that, at the first step, the gradients the optimizer sees
    (clipped, dp-averaged) are recorded whole: gathered over dp (ZeRO-1 / 2's slices,
    `gather_grads`; ZeRO-3's shards of `sharded`, `full_grads`) and over tp. Returns the dict
    the first step fills, parameter name -> full gradient (collective at that step)."""
    from megapar.tensor_parallel.partition import gather_full

    recorded: dict[str, torch.Tensor] = {}
    optimizer_step = optimizer.step

    def step_and_record_first_grads():
        if not recorded:
            if sharded is not None:
                grads = full_grads(sharded)
            else:
                if getattr(optimizer, "sharded", False):  # ZeRO reduced only this rank's slices
                    gather_grads(optimizer)
                grads = {id(p): p.grad for p in model.parameters()}
            for name, p in model.named_parameters():
                recorded[name] = gather_full(grads[id(p)], p.tp_dim, p.full_shape,
                                             mesh.tp_group).clone()
        optimizer_step()

    optimizer.step = step_and_record_first_grads
    return recorded
