"""The reduce-scatter and all-gather of a dp-sharded bucket (`data_parallel/shard_comm.py`): on
the host a bucket above `HOST_PIECE_BYTES` goes in pieces (gloo copies what it is given), with
the same result and the same bytes as one collective."""

import torch

from megapar.comm_count import count_collectives
from megapar.data_parallel import shard_comm
from megapar.launcher import run_local


def _worker(piece_bytes: int) -> dict:
    import torch.distributed as dist

    shard_comm.HOST_PIECE_BYTES = piece_bytes
    rank, dp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    flat = torch.randn(dp * 1000, generator=gen)
    total = flat.clone()
    dist.all_reduce(total)
    size = flat.numel() // dp
    out = torch.empty(size)
    with count_collectives() as calls:
        shard_comm.reduce_scatter(flat, out, dp, None, host=True).wait()
        flat[rank * size:(rank + 1) * size] = out
        shard_comm.all_gather(flat, dp, None, host=True).wait()
    return {"ok": torch.equal(out, total[rank * size:(rank + 1) * size]) and
            torch.equal(flat, total), "calls": [(c.op, c.bytes) for c in calls]}


def test_pieces_give_the_whole_collectives_result_and_bytes():
    whole = run_local(_worker, 2, 2**30)
    pieces = run_local(_worker, 2, 2 * 4 * 300)  # 300 elements per rank and piece: 4 pieces
    for w, p in zip(whole, pieces):
        assert w["ok"] and p["ok"]
        assert [op for op, _ in w["calls"]] == ["reduce_scatter_tensor", "all_gather_into_tensor"]
        assert len(p["calls"]) == 8
        for op in ("reduce_scatter_tensor", "all_gather_into_tensor"):
            assert sum(b for o, b in p["calls"] if o == op) == \
                sum(b for o, b in w["calls"] if o == op)
