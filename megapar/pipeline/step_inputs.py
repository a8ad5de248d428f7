"""How a pipeline step's computes get inputs besides the walk's own waits: receives posted ahead
(gloo) and the V's hand-over in memory.

On gloo a message moves only once its receive is posted, so the executor queues each peer's
receives in program order (the order it sends in) and posts the next as soon as the previous one
has arrived (`StepInputs._post_ahead`, `_post_next`: at most one ahead per peer); on NCCL the
queues are empty. In the V placement (ZB-V, DualPipeV) the turn from one chunk to the other is
on one rank: the output (or input gradient) is handed over in memory (`_hand_over`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from megapar.pipeline.p2p import StageP2P
from megapar.pipeline.schedules import Action


class StepInputs:
    """The receive side of `PipelineExecutor` besides its walk's waits: gloo's receives posted
    ahead per peer and the in-memory hand-over between two chunks of this rank."""

    # What the executor sets (`PipelineExecutor.__init__` and `_reset`), declared for the
    # methods here:
    p2p: StageP2P | None
    post_ahead: bool
    inputs: dict[int, torch.Tensor]
    _forward_only: bool
    _out_grads: dict[int, torch.Tensor]
    _in_grads: dict[int, torch.Tensor]
    _ahead: dict[int, deque]
    _recvs_issued: set[int]
    _take_output: Callable[[int], torch.Tensor | None]
    slot: Callable[[int, int], int]

    def _post_ahead(self, posts: dict[int, tuple]) -> None:
        """gloo (`post_ahead`): every peer's receives in program order, and the first of each
        posted now; NCCL queues none."""
        self._ahead = (
            {rank: deque(recvs) for rank, recvs in posts.items()} if self.post_ahead else {}
        )
        for rank in self._ahead:
            self._post_next(rank)

    def _post_next(self, rank: int) -> None:
        """Post the next receive from peer `rank` unless its group has issued it: a peer's
        receives are posted in program order (the order it sends in), at most one ahead."""
        queue, issued = self._ahead[rank], self._recvs_issued
        while queue and queue[0].uid in issued:
            queue.popleft()
        if queue:
            message = queue.popleft()
            issued.add(message.uid)
            assert self.p2p is not None  # posting ahead needs a peer (`post_ahead`)
            self.p2p.issue([(message.key, None, message.peer, message.carries, message.label)])

    def _hand_over(self, hand_over: tuple[str, int], a: Action) -> None:
        """In-memory handover between two chunks of this rank (no message), `hand_over` being
        (kind, source) (`WalkStep.hand_over`): the forward of `a`'s chunk takes the output of
        slot `source` (the same micro-batch's, of the other chunk) as its input leaf, the
        backward its input gradient."""
        kind, source = hand_over
        slot = self.slot(a.mb, a.chunk)
        if kind == "recv_act":
            out = self._take_output(source)
            assert out is not None  # the forward of `source` ran before this one (the V's turn)
            self.inputs[slot] = out.detach().requires_grad_(not self._forward_only)
        else:
            self._out_grads[slot] = self._in_grads.pop(source)
