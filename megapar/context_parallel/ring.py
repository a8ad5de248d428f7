"""The context-parallel ring: each rank sends a tensor to the next cp rank and receives the
previous one's, in one group.

Every exchange is one ``dist.batch_isend_irecv`` of [send to next, receive from previous]: an
NCCL group call on GPUs, so the send and the receive progress together and a ring of zero-
buffered sends cannot deadlock (NCCL's user guide, Group calls); single isend / irecv calls on
gloo. All ranks of the group issue the same exchanges in the same order (the attention of the
same layer), so a rank pair's k-th message is the same tensor on both sides; no tags are used.
Every rank of the group takes part in the group's first call, which is what NCCL needs of a
first ``batch_isend_irecv`` (torch.distributed's documentation of it). `start` returns at once
(the transfer overlaps the caller's compute); `finish` waits, never forever: on gloo after
`timeout_s` it raises `CPTimeoutError` naming the rank, the peer and the exchange (on NCCL
the process group's own timeout ends a hang, `megapar.device.wait`).

`issued` records the exchanges (send and receive peers as global ranks, elements, a label) for
checking against NCCL's pairing rules in tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar import device as _device
from megapar.comm_wait import blocked


class CPTimeoutError(TimeoutError):
    """A context-parallel exchange did not complete in time (a peer died, hangs or diverged)."""


class Ring:
    """Exchanges around one context-parallel group (rank i sends to i + 1, receives from i - 1)."""

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_global_rank(group, self.rank)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.issued: list[tuple[int, int, int, str]] | None = None
        """When a list: (send peer, receive peer, elements, label) of every exchange started."""

    def start(self, send: torch.Tensor, label: str):
        """Send `send` to the next rank and receive the previous rank's tensor of the same
        shape and dtype; returns a handle for `finish`."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, self.next, self.group),
                dist.P2POp(dist.irecv, recv, self.prev, self.group),
            ]
        )
        if self.issued is not None:
            self.issued.append((self.next, self.prev, send.numel(), label))
        return works, send, recv, label

    def finish(self, handle) -> torch.Tensor:
        """Wait for an exchange; the received tensor."""
        works, _send, recv, label = handle
        with blocked(recv.device):
            self._wait(works, recv, label)
        return recv

    def _wait(self, works, recv, label) -> None:
        for work in works:
            _device.wait(
                work,
                recv.device,
                self.timeout_s,
                f"rank {self.global_rank} (cp rank {self.rank}): {label} (sending to "
                f"rank {self.next}, receiving from rank {self.prev})",
                CPTimeoutError,
                ". Another rank of the context-parallel group probably failed (look for "
                "its error) or runs another layer / micro-batch",
            )
