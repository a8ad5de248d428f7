"""Point-to-point communication between neighbouring pipeline stages.

Activations flow forward (stage s -> s+1), gradients flow backward (s+1 -> s). Every message of a
run has the same static shape (micro-batch x seq x hidden) and dtype, so only the payload is sent:
no shape or metadata messages. The payload may travel in a narrower `wire_dtype` (bf16 / fp16
under mixed precision, as Megatron's pipeline_dtype): it is cast on send and cast back to the
stage's `dtype` on receipt, so the stages compute exactly as before on the rounded values.

Plain `dist.isend` / `dist.irecv` (not `batch_isend_irecv`, which is unreliable on gloo), with one
tag per channel (and per receiving model chunk) so an activation can never be mistaken for a
gradient between the same two ranks. NCCL ignores tags and pairs a rank pair's messages in issue
order; every schedule issues them in the order the receiver receives them (tested), so both
backends pair the same messages:

- a send returns at once; the tensor and its work handle are kept until the send is waited for:
  by `release()` as soon as the executor knows the peer has received it, or by `wait_sends()` at
  the end of the step (a buffer must stay alive until its send completes);
- a receive blocks, but never forever: after `timeout_s` it raises `P2PTimeoutError` naming this
  rank, the peer and the micro-batch;
- a receive may be *posted* ahead of time (`post_recv`) and collected when its action comes up.
  gloo moves a message only once its receive is posted (the receiver tells the sender it is
  ready), so a receive posted when the action comes up costs a round trip through two busy
  processes; posted early, the data lands while the receiver computes. gloo pairs messages per
  (peer, tag), so posting early on one channel never changes which message a receive gets.
  NCCL pairs a rank pair's messages in issue order, whatever the tag, and runs them in that
  order on one stream, so there `can_post_early` is False and receives are issued where the
  schedule has them.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megapar.mesh import Mesh

ACT_TAG = 1
"""Tag of the activation channel (s -> s+1)."""
GRAD_TAG = 2
"""Tag of the gradient channel (s+1 -> s)."""
CARRIES = {"send_act": "activation", "recv_act": "activation",
           "send_grad": "gradient", "recv_grad": "gradient"}
"""What a message of each action kind carries (the word used in messages and send keys)."""


class P2PTimeoutError(TimeoutError):
    """A pipeline send or receive did not complete in time (the peer died, hangs or mismatched)."""


class StageP2P:
    """Activation / gradient messages of one pipeline stage with its two neighbours."""

    def __init__(self, mesh: Mesh, shape: tuple, dtype: torch.dtype = torch.float32,
                 timeout_s: float = 300.0, wire_dtype: torch.dtype | None = None):
        self.mesh = mesh
        self.shape = tuple(shape)
        self.dtype = dtype
        self.wire_dtype = wire_dtype or dtype
        """The dtype messages travel in (`dtype` unless narrowed)."""
        self.bytes_sent = 0
        """Payload bytes this rank has sent (all steps)."""
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self._pending: dict[tuple[str, int], tuple[int, torch.Tensor, object]] = {}
        self._posted: dict[tuple[str, int, int], tuple[int, torch.Tensor, object]] = {}
        self.failed = False
        """A send or receive failed: messages may still be in flight, the stage is out of step."""
        self.can_post_early = mesh.pp_group is not None and \
            dist.get_backend(mesh.pp_group) == "gloo"
        """Receives may be posted before their turn (gloo: messages pair per channel, by tag)."""

    # sends ---------------------------------------------------------------------------------
    def send_act(self, tensor: torch.Tensor, mb: int, chunk: int = 0,
                 to: tuple[int, int] | None = None) -> None:
        """Start sending micro-batch `mb`'s output activation to the next stage; `to` =
        (pp rank, chunk) of the receiver for model chunks (default: the next rank, chunk 0)."""
        peer, tag = self._route(to, self.mesh.next_stage_rank, ACT_TAG)
        self._isend(tensor, peer, tag, "activation", mb, chunk)

    def send_grad(self, tensor: torch.Tensor, mb: int, chunk: int = 0,
                  to: tuple[int, int] | None = None) -> None:
        """Start sending d(loss)/d(input) of micro-batch `mb` to the previous stage."""
        peer, tag = self._route(to, self.mesh.prev_stage_rank, GRAD_TAG)
        self._isend(tensor, peer, tag, "gradient", mb, chunk)

    def _route(self, where, default_peer, base_tag) -> tuple[int | None, int]:
        """Global rank and tag of a message to/from (pp rank, chunk) `where`. Every receiving
        chunk has its own tag per direction, so messages to different chunks never mix."""
        if where is None:
            return default_peer, base_tag
        pp_rank, receiver_chunk = where
        return self.mesh.stage_rank(pp_rank), base_tag + 2 * receiver_chunk

    def _isend(self, tensor, peer, tag, what, mb, chunk=0) -> None:
        if peer is None:
            raise RuntimeError(f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}) has no "
                               f"neighbour to send the {what} of micro-batch {mb} to; the "
                               f"schedule is wrong for this stage")
        self._check(tensor, what, mb)
        payload = tensor.detach().to(self.wire_dtype).contiguous()
        self.bytes_sent += payload.numel() * payload.element_size()
        work = dist.isend(payload, dst=peer, tag=tag, group=self.mesh.pp_group)
        self._pending[(what, mb, chunk)] = (peer, payload, work)

    @property
    def pending_sends(self) -> int:
        """Sends started but not yet waited for (their buffers are still held)."""
        return len(self._pending)

    def release(self, kind: str, mb: int, chunk: int = 0) -> None:
        """Wait for one send that is known to have been received, and free its buffer.

        A gloo send only completes once the peer has posted the matching receive, so waiting
        early could block; the executor calls this only when a later message from the peer
        proves the receive has happened (then the wait returns at once). `kind` is "send_act"
        or "send_grad"; sends already waited for are ignored.
        """
        what = CARRIES[kind]
        entry = self._pending.pop((what, mb, chunk), None)
        if entry is not None:
            self._wait(entry[2], f"sending the {what} of micro-batch {mb} to rank {entry[0]}")

    def wait_sends(self) -> None:
        """Wait (with the timeout) for every send not waited for yet."""
        pending, self._pending = self._pending, {}
        for (what, mb, _chunk), (peer, _payload, work) in pending.items():
            self._wait(work, f"sending the {what} of micro-batch {mb} to rank {peer}")

    # receives ------------------------------------------------------------------------------
    def recv_act(self, mb: int, chunk: int = 0,
                 source: tuple[int, int] | None = None) -> torch.Tensor:
        """Block until micro-batch `mb`'s input activation arrives from the previous stage
        (`source` = its (pp rank, chunk) for model chunks)."""
        return self._recv("recv_act", mb, chunk, source)

    def recv_grad(self, mb: int, chunk: int = 0,
                  source: tuple[int, int] | None = None) -> torch.Tensor:
        """Block until d(loss)/d(output) of micro-batch `mb` arrives from the next stage."""
        return self._recv("recv_grad", mb, chunk, source)

    def post_recv(self, kind: str, mb: int, chunk: int = 0,
                  source: tuple[int, int] | None = None) -> None:
        """Start receiving a message ahead of its `recv_act` / `recv_grad` (`kind`), which then
        only waits for it. Only where `can_post_early`, in each channel's receive order."""
        self._posted[kind, mb, chunk] = self._irecv(kind, mb, chunk, source)

    @property
    def posted_recvs(self) -> int:
        """Receives posted ahead and not collected yet."""
        return len(self._posted)

    def _irecv(self, kind, mb, chunk, source) -> tuple[int, torch.Tensor, object]:
        default, base = (self.mesh.prev_stage_rank, ACT_TAG) if kind == "recv_act" \
            else (self.mesh.next_stage_rank, GRAD_TAG)
        peer, what = self._route(source, default, base)[0], CARRIES[kind]
        if peer is None:
            raise RuntimeError(f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}) has no "
                               f"neighbour to receive the {what} of micro-batch {mb} from; the "
                               f"schedule is wrong for this stage")
        tag = base + 2 * chunk if source is not None else base
        buffer = torch.empty(self.shape, dtype=self.wire_dtype, device=self.mesh.device)
        return peer, buffer, dist.irecv(buffer, src=peer, tag=tag, group=self.mesh.pp_group)

    def _recv(self, kind, mb, chunk, source) -> torch.Tensor:
        posted = self._posted.pop((kind, mb, chunk), None)
        peer, buffer, work = posted or self._irecv(kind, mb, chunk, source)
        self._wait(work, f"receiving the {CARRIES[kind]} of micro-batch {mb} from rank {peer}")
        return buffer.to(self.dtype)

    # helpers -------------------------------------------------------------------------------
    def _wait(self, work, doing: str) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except Exception as exc:  # gloo raises on timeout or when the peer's connection closes
            self.failed = True
            raise P2PTimeoutError(self._message(doing, exc)) from exc
        if ok is False:
            self.failed = True
            raise P2PTimeoutError(self._message(doing, "wait() returned False"))

    def _message(self, doing: str, cause) -> str:
        return (f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}) failed {doing} within "
                f"{self.timeout_s:g} s ({cause}). The peer stage probably failed or is stuck "
                f"(look for its error), or the stages run mismatched schedules / micro-batch "
                f"counts; raise the pipeline timeout if a step is legitimately this slow")

    def _check(self, tensor: torch.Tensor, what: str, mb: int) -> None:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"rank {self.mesh.rank}: the {what} of micro-batch {mb} has shape "
                f"{tuple(tensor.shape)} {tensor.dtype}, but the pipeline was set up for "
                f"{self.shape} {self.dtype}; every micro-batch must have the same "
                f"(micro-batch size, seq, hidden) and act_shape must match it")


def wait_work(work, timeout_s: float, what: str) -> None:
    """Wait for an asynchronous collective, raising P2PTimeoutError naming `what` after
    `timeout_s` (the pipeline's collectives: loss broadcast, timeline gathering)."""
    from datetime import timedelta

    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise P2PTimeoutError(f"{what} did not complete within {timeout_s:g} s ({exc}); another "
                              f"rank of the pipeline group probably failed (look for its error)"
                              ) from exc
