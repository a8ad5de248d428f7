"""`MEGAPAR_SHARED_GPU=1` (megapar/shared_gpu.py) on two forked gloo ranks: the ops gloo has no
CUDA path for run on host copies, whose results reach the caller's tensors when the work is
waited for; all-reduce and broadcast go to gloo as they are. On the CPU the staging copies host
tensors too (how tests/test_cuda_shared.py is rehearsed), so what is checked here is the GPU's
code path: a receive's tensor is untouched until its wait, a send carries the values it had
when it was issued, and every staged collective gives gloo's result.
"""

import torch

from megapar.launcher import run_local


def _staged_ops():
    import torch.distributed as dist

    from megapar import device, shared_gpu

    rank = dist.get_rank()
    assert shared_gpu.installed() and device.backend() == "gloo"
    assert device.polls_host(torch.device("cuda", 0))  # the pipeline's gloo path on CUDA
    mine = torch.arange(4.0) + 10 * rank
    parts = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(parts, mine)
    whole = torch.zeros(8)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(whole, mine)
    out = torch.zeros(2)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = rs(out, torch.arange(4.0) * (rank + 1), async_op=True)
    before_wait = out.clone()
    work.wait()
    a2a = torch.zeros(3)
    splits = [2, 1] if rank else [1, 2]
    dist.all_to_all_single(a2a, torch.arange(3.0) + 10 * rank, splits, splits)
    total = mine.clone()
    dist.all_reduce(total)
    # a message: rank 0 changes its tensor after issuing the send; rank 1's copy arrives at wait
    message = torch.full((5,), 7.0) if rank == 0 else torch.zeros(5)
    op = dist.isend if rank == 0 else dist.irecv
    (msg_work,) = dist.batch_isend_irecv([dist.P2POp(op, message, 1 - rank)])
    if rank == 0:
        message.fill_(-1.0)
    dist.barrier()  # the message has surely arrived in the host copy by now
    untouched = message.clone()
    msg_work.wait()
    return {"parts": parts, "whole": whole, "rs": out, "rs_before_wait": before_wait,
            "a2a": a2a, "total": total, "untouched": untouched, "message": message}


def test_staged_ops_give_gloo_results_at_the_wait():
    outs = run_local(_staged_ops, 2, env={"MEGAPAR_CPU": "1", "MEGAPAR_SHARED_GPU": "1"})
    ones = [torch.arange(4.0), torch.arange(4.0) + 10]
    for rank, out in enumerate(outs):
        assert all(torch.equal(a, b) for a, b in zip(out["parts"], ones))
        assert torch.equal(out["whole"], torch.cat(ones))
        assert torch.equal(out["rs"], (torch.arange(4.0) * 3)[2 * rank:2 * rank + 2])
        assert torch.equal(out["rs_before_wait"], torch.zeros(2))  # copied back at the wait
        assert torch.equal(out["total"], ones[0] + ones[1])
    assert torch.equal(outs[0]["a2a"], torch.tensor([0.0, 10.0, 11.0]))
    assert torch.equal(outs[1]["a2a"], torch.tensor([1.0, 2.0, 12.0]))
    assert torch.equal(outs[1]["untouched"], torch.zeros(5))  # the receive: only at its wait
    assert torch.equal(outs[1]["message"], torch.full((5,), 7.0))  # the send: its issued values
