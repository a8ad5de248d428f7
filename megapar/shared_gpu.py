"""Several ranks on one GPU: gloo carrying CUDA tensors (`MEGAPAR_SHARED_GPU=1`).

NCCL needs a GPU per rank. With `SHARED_GPU_ENV` set to 1 the ranks of a node share its GPUs
instead (rank r takes cuda:(r mod GPUs), `megapar.device.device`), the backend is gloo, and
`install` wraps torch.distributed's functions (looked up at call time by every megapar module,
as `megapar.comm_count` relies on) so that gloo receives CUDA tensors only where it has a CUDA
path of its own: `all_reduce` and `broadcast` (torch's backend table: gloo copies them to pinned
host memory and back on a stream of its own). Every other op megapar issues (point-to-point
messages, all-gather, reduce-scatter, all-to-all, gather) is staged through the host here: the
inputs copied to host tensors before the call, gloo run on those, the results copied back into
the caller's device tensors when the work is waited for (at once for a blocking call). Waits
then block the host as on the CPU (`megapar.device.polls_host`), so the pipeline takes gloo's
path (receives posted ahead, every wait with a timeout).

It is how one GPU runs the multi-process tier (`tests/test_cuda_shared.py`): device placement,
streams and the memory of several CUDA processes, at gloo's speed. What only NCCL between GPUs
shows (its issue order, group calls, its kernels on the streams) it does not. Written here
because torch offers no host staging for gloo (its backend refuses or misreads a CUDA tensor in
these ops). On the CPU (no CUDA, or `MEGAPAR_CPU=1`) the same staging copies host tensors too,
which is how the tier is rehearsed without a GPU.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist

SHARED_GPU_ENV = "MEGAPAR_SHARED_GPU"
"""Set to 1: the ranks of a node share its GPUs over gloo (this module)."""

STAGED = {
    "all_gather": (("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "all_gather_single": (("input_tensor",), ("output_tensor",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "reduce_scatter_single": (("input",), ("output",)),
    "gather": (("tensor",), ("gather_list",)),
    "all_to_all_single": (("input",), ("output",)),
    "send": (("tensor",), ()),
    "recv": ((), ("tensor",)),
}
"""Op -> (its input arguments, its output arguments): staged through host tensors."""

_INSTALLED: dict[str, object] = {}
"""The torch functions `install` replaced, by name (empty: not installed)."""


def enabled() -> bool:
    """Whether this process runs with several ranks per GPU (`SHARED_GPU_ENV` is 1)."""
    return os.environ.get(SHARED_GPU_ENV, "") == "1"


def installed() -> bool:
    return bool(_INSTALLED)


def _stages(t: torch.Tensor) -> bool:
    """A tensor this module copies through the host: a CUDA tensor, or on the CPU (a
    rehearsal) every tensor."""
    return (
        t.device.type == "cuda"
        or not torch.cuda.is_available()
        or os.environ.get("MEGAPAR_CPU") == "1"
    )


def _to_host(value, copy_in: bool):
    """(host stand-in, [(host, original) pairs to copy back]) for a tensor, a list of them or
    None."""
    if value is None:
        return None, []
    if isinstance(value, torch.Tensor):
        if not _stages(value):
            return value, []
        if copy_in:
            host = value.detach().to("cpu", copy=True)
        else:
            host = torch.empty(value.shape, dtype=value.dtype)
        return host, [(host, value)]
    hosts, pairs = [], []
    for t in value:
        h, p = _to_host(t, copy_in)
        hosts.append(h)
        pairs += p
    return hosts, pairs


@torch.no_grad()
def _copy_back(pairs) -> None:
    for host, original in pairs:
        original.copy_(host)


class StagedWork:
    """The work of an op run on host copies: waiting copies the results back into the
    caller's tensors (once) and releases the copies."""

    def __init__(self, work, pairs, keep=None):
        self.work, self.pairs, self.keep = work, pairs, keep

    def wait(self, timeout=None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        if ok is not False and self.pairs:
            _copy_back(self.pairs)
        self.pairs, self.keep = [], None
        return ok

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name):  # exception(), get_future(), ...: the inner work's
        if name == "work":
            raise AttributeError(name)
        return getattr(self.work, name)


def _staged(name: str, original):
    inputs, outputs = STAGED[name]
    signature = inspect.signature(original)

    def staged(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        pairs = []
        for arg in inputs:
            if arg in bound.arguments:
                bound.arguments[arg] = _to_host(bound.arguments[arg], True)[0]
        for arg in outputs:
            if arg in bound.arguments:
                bound.arguments[arg], out = _to_host(bound.arguments[arg], False)
                pairs += out
        result = original(*bound.args, **bound.kwargs)
        if bound.arguments.get("async_op"):
            return StagedWork(result, pairs)
        _copy_back(pairs)
        return result

    staged.__wrapped__ = original  # type: ignore[attr-defined]
    return staged


def _staged_batch(original):
    """`batch_isend_irecv` with each message's tensor staged: a send's copied to the host
    (kept until its work is waited for), a receive's made on the host and copied back when its
    work is waited for."""

    def batch_isend_irecv(p2p_op_list):
        ops, staging = [], []
        for op in p2p_op_list:
            receiving = op.op is dist.irecv
            host, pairs = _to_host(op.tensor, not receiving)
            if pairs:  # the same message with the host tensor (peer: the global rank)
                op = dist.P2POp(op.op, host, op.peer, op.group, op.tag)
            ops.append(op)
            staging.append((pairs if receiving else [], host if pairs else None))
        works = original(ops)
        if len(works) != len(ops):  # coalesced: one work for the group
            return [StagedWork(works[-1], [p for s in staging for p in s[0]], staging)]
        return [StagedWork(w, pairs, keep) for w, (pairs, keep) in zip(works, staging)]

    batch_isend_irecv.__wrapped__ = original
    return batch_isend_irecv


def install() -> None:
    """Wrap torch.distributed's ops for this process (once; `megapar.device.init_distributed`
    calls it when `enabled`)."""
    if _INSTALLED:
        return
    for name in STAGED:
        original = getattr(dist, name, None)
        if original is not None:
            _INSTALLED[name] = original
            setattr(dist, name, _staged(name, original))
    _INSTALLED["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _staged_batch(dist.batch_isend_irecv)
