"""Where model chunks live: virtual stages <-> (pipeline rank, chunk), and who talks to whom.

A model cut into pp * V slices (virtual stages) runs on pp ranks holding V chunks each. Pure
functions, shared by the schedules, the simulator, the executor and the model builder.
"""

from __future__ import annotations

PLACEMENTS = ("loop", "v")
"""How a rank's chunks map to virtual stages. "loop" (Megatron's interleaving): chunk c of rank r
is virtual stage c * pp + r, so activations go 0 -> 1 -> ... -> pp-1 -> 0 for the next chunk.
"v" (ZB-V, two chunks): chunk 0 of rank r is virtual stage r, chunk 1 is 2 * pp - 1 - r."""


def virtual_stage(rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """The virtual stage (index into the model's layer slices) of `chunk` on pp rank `rank`."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_location(vs: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(pp rank, chunk) holding virtual stage `vs`; inverse of `virtual_stage`."""
    if placement == "v":
        return (vs, 0) if vs < pp else (2 * pp - 1 - vs, 1)
    return vs % pp, vs // pp


def peer_of(rank: int, action, pp: int, num_chunks: int,
            placement: str = "loop") -> tuple[int, int] | None:
    """(pp rank, chunk) a send goes to or a receive comes from; None for compute actions or
    beyond the ends of the model."""
    vs = virtual_stage(rank, action.chunk, pp, placement)
    step = {"send_act": 1, "recv_grad": 1, "recv_act": -1, "send_grad": -1}.get(action.kind)
    if step is None or not 0 <= vs + step < pp * num_chunks:
        return None
    return stage_location(vs + step, pp, placement)
