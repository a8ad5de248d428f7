"""What a stage's schedule implies about its messages, worked out before the step runs.

Both answers come from the schedules alone (this stage's, and its peers' for the first), so they
are computed once per step and the executor only looks them up:

- `acknowledgements`: which of my sends are known to have been received once a given receive of
  mine returns (so their buffers can be freed early);
- `early_receives`: which receives to post ahead of their turn, and when.
"""

from __future__ import annotations

from typing import Callable

from megapar.pipeline.schedules import Action

SENDS = ("send_act", "send_grad")
RECEIVES = ("recv_act", "recv_grad")


def acknowledgements(actions: list[Action], me: int,
                     peer_of: Callable[[int, Action], tuple[int, int]],
                     actions_of: Callable[[int], list[Action]]) -> dict[tuple, list[tuple]]:
    """{(recv kind, mb, chunk): [(send kind, mb, chunk), ...]}: my sends proven received when
    that receive of mine returns.

    A gloo send completes only when the peer receives it, and sends are waited for at the end of
    the step, so without this every sent buffer would live until then (all m activations,
    defeating 1F1B's memory bound). From the peer's schedule: my send is matched by the peer's
    receive of the same (micro-batch, chunk) message; the first message the peer sends me
    *after* that receive proves it completed, so when I receive that message the send can be
    waited for at no cost. `peer_of(rank, action)` is the (pp rank, chunk) at the other end of
    a message; `actions_of(rank)` is that rank's schedule for this step.
    """
    acks, schedules = {}, {}
    for send in actions:
        if send.kind not in SENDS:
            continue
        peer, peer_chunk = peer_of(me, send)
        if peer not in schedules:
            schedules[peer] = actions_of(peer)
        theirs = schedules[peer]
        recv_kind = "recv_act" if send.kind == "send_act" else "recv_grad"
        j = theirs.index(Action(recv_kind, send.mb, peer_chunk))
        for later in theirs[j + 1:]:  # the peer's next message to me
            if later.kind in SENDS and peer_of(peer, later)[0] == me:
                key = ("recv_act" if later.kind == "send_act" else "recv_grad", later.mb,
                       peer_of(peer, later)[1])
                acks.setdefault(key, []).append((send.kind, send.mb, send.chunk))
                break
    return acks


def early_receives(actions: list[Action]) -> tuple[list[Action], dict[Action, Action]]:
    """(receives to post at the start of the step, {receive: the next one on its channel}).

    A channel is one (kind, chunk): one peer, one tag. Its first receive is posted when the step
    starts and each next one as soon as the previous one has arrived, so a message can land
    while the stage computes, each channel's receives are posted in the order the schedule
    receives them, and at most one buffer per channel waits ahead (1F1B's memory bound holds).
    Only for backends that pair messages per channel (gloo; see `p2p.StageP2P.can_post_early`).
    """
    last: dict[tuple, Action] = {}
    first, after = [], {}
    for a in actions:
        if a.kind in RECEIVES:
            channel = (a.kind, a.chunk)
            if channel in last:
                after[last[channel]] = a
            else:
                first.append(a)
            last[channel] = a
    return first, after
