"""Every collective runs on tensors of the mesh device (NCCL rejects CPU tensors).

On this CPU-only machine the mesh device is the CPU, so "a CPU tensor where a GPU one belongs"
cannot be seen directly. The test makes it visible: it runs a 2x2x2 training step (ZeRO-1,
bucketed dp reduction, tied embeddings, pipeline p2p), the timeline gather behind the logged
bubble, the bubble benchmark's stage-info gather and a checkpoint save with torch's tensor
factories (torch.tensor, zeros, empty, ...) creating on "meta" whenever megapar code names no
device.
Code that creates a tensor without naming a device (which on a GPU machine lands on the CPU,
not the mesh's GPU) then gets a meta tensor, and the wrapped collectives report any payload
not on the mesh device.
"""

import contextlib
import sys

import torch
from test_comm_counts import make_step, micro_batches

from megapar.comm_count import count_collectives
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh

FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint")


@contextlib.contextmanager
def unnamed_device_is(device: str):
    """torch's factories, called from megapar code without a `device=`, create on `device`."""
    originals = {name: getattr(torch, name) for name in FACTORIES}

    def wrap(fn):
        def factory(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if kwargs.get("device") is None and caller.startswith("megapar."):
                kwargs["device"] = device
            return fn(*args, **kwargs)
        return factory

    for name, fn in originals.items():
        setattr(torch, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


def _worker(root):
    import torch.distributed as dist

    from megapar.checkpoint.distributed import save_checkpoint
    from megapar.data_parallel import GradBuckets
    from megapar.pipeline.trace import gather_timeline
    from megapar.training.bubble import gather_stage_info

    mesh = Mesh(Layout(2, 2, 2), dist.get_rank())
    step = make_step("gpt2", mesh, grad_sync=None)
    step.grad_sync = GradBuckets(list(step.model.parameters()), mesh.dp_group, bucket_mb=0.01)
    step.step(micro_batches("gpt2"), 0)   # warm-up: lazily created optimizer state
    with count_collectives(mesh.device) as calls, unnamed_device_is("meta"):
        step.step(micro_batches("gpt2"), 1)
        gather_timeline(step.executor.last_timeline, mesh)
        gather_stage_info(mesh, [1.0, 2.0])
        save_checkpoint(root, 2, step.model, mesh, step.optimizer.state_tensors(), {}, {})
    return {c.op for c in calls}, [c for c in calls if c.device != mesh.device]


def test_every_collective_uses_mesh_device_tensors(tmp_path):
    results = run_local(_worker, 8, str(tmp_path / "ckpt"))
    ops = set().union(*(ops for ops, _ in results))
    assert {"all_reduce", "isend", "irecv", "broadcast", "all_gather", "gather"} <= ops
    for rank, (_, wrong) in enumerate(results):
        assert not wrong, f"rank {rank}: collectives on tensors not on the mesh device: {wrong}"
