"""Point-to-point messages between pipeline stages, issued in groups.

Activations flow forward (stage s -> s+1), gradients flow backward (s+1 -> s). Every message of a
run has the same static shape (micro-batch x seq x hidden) and dtype, so only the payload is sent:
no shape or metadata messages. The payload may travel in a narrower `wire_dtype` (bf16 / fp16
under mixed precision, as Megatron's pipeline_dtype): it is cast on send and cast back to the
stage's `dtype` on receipt, so the stages compute exactly as before on the rounded values.

Messages go out in groups (`issue`), one ``dist.batch_isend_irecv`` each: an NCCL group call on
GPUs, single isend / irecv calls on gloo. Which messages share a group and in what order is
decided by `megapar.pipeline.messages` so that NCCL's rules hold; tags are not used (every
message has tag 0), so gloo pairs a rank pair's messages in issue order exactly as NCCL does,
and the CPU tests exercise the pairing the GPUs will see. Where `issued` is a list (a checker
sets it: `certify`, the tests), every group issued in a step is recorded there (as
`nccl_rules.Op`s) for checking against NCCL's rules; a training run records nothing.

- a send's tensor and work are kept until the send is waited for: by `release()` as soon as the
  executor knows the peer has received it, or by `wait_sends()` at the end of the step (a buffer
  must stay alive until its send completes);
- a receive is waited for by `wait_recv()` when its tensor is needed; on gloo never forever:
  after `timeout_s` it raises `P2PTimeoutError` naming this rank, the peer and the message. On
  NCCL the wait only orders the stream (`megapar.device.wait`), and the process group's timeout
  ends a hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar import device as _device
from megapar.mesh import Mesh
from megapar.pipeline.nccl_rules import Op

CARRIES = {
    "send_act": "activation",
    "recv_act": "activation",
    "send_grad": "gradient",
    "recv_grad": "gradient",
}
"""What a message of each action kind carries (the word used in error messages)."""


class P2PTimeoutError(TimeoutError):
    """A pipeline send or receive did not complete in time (the peer died, hangs or mismatched)."""


def _torch_batch_isend_irecv(ops):
    """torch's `dist.batch_isend_irecv` as it is when called (a test may wrap torch's)."""
    return dist.batch_isend_irecv(ops)


class StageP2P:
    """Activation / gradient messages of one pipeline stage with the other stages."""

    def __init__(
        self,
        mesh: Mesh,
        shape: tuple,
        dtype: torch.dtype = torch.float32,
        timeout_s: float | None = None,
        wire_dtype: torch.dtype | None = None,
    ):
        self.mesh = mesh
        self.shape = tuple(shape)
        self.dtype = dtype
        self.wire_dtype = wire_dtype or dtype
        """The dtype messages travel in (`dtype` unless narrowed)."""
        self.narrowed = self.wire_dtype != dtype
        """Messages travel in a narrower dtype than the stage's (cast on send and receipt)."""
        self.message_bytes = (
            torch.Size(self.shape).numel() * torch.empty((), dtype=self.wire_dtype).element_size()
        )
        """Bytes of one message's payload (every message has the same shape and dtype)."""
        self.bytes_sent = 0
        """Payload bytes this rank has sent (all steps)."""
        self.timeout_s = timeout_s or mesh.timeout_s
        """How long a message may take (default: the run's, `mesh.timeout_s`)."""
        self.issued: list[list[Op]] | None = None
        """When a list (set it to record): the groups issued since the last `begin_step`, in
        order (global ranks as peers). None by default: a step's record holds an `Op` per
        message and a list per group to the next step, objects the garbage collector then
        finds alive and traverses again (at pp 16, m 256: 1,000-3,500 a step)."""
        self._sends: dict[tuple, tuple[int, torch.Tensor, object]] = {}
        self._recvs: dict[tuple, tuple[int, torch.Tensor, object]] = {}
        self._joined = False
        self.failed = False
        """A send or receive failed: messages may still be in flight, the stage is out of step."""
        self.batch_isend_irecv = _torch_batch_isend_irecv
        """What issues a group's `dist.P2POp`s: torch's `dist.batch_isend_irecv`, looked up at
        the call (`megapar.pipeline.certify` replaces it to record the operations a real step
        hands to torch)."""

    def begin_step(self) -> None:
        """Start a step's record of issued groups. On NCCL the first step also runs one
        collective over the pipeline group: NCCL needs every rank of a group in the group's
        first call of `batch_isend_irecv` (torch.distributed's documentation of it)."""
        if self.issued is not None:
            self.issued = []
        if not self._joined and not _device.polls_host(self.mesh.device):
            flag = torch.zeros(1, device=self.mesh.device)
            _device.wait(
                dist.all_reduce(flag, group=self.mesh.pp_group, async_op=True),
                self.mesh.device,
                self.timeout_s,
                f"rank {self.mesh.rank}: the pipeline group's first collective",
                P2PTimeoutError,
            )
            self._joined = True

    # issuing -------------------------------------------------------------------------------
    def issue(self, group: list[tuple[tuple, torch.Tensor | None, int, tuple, str]]) -> None:
        """Issue one group (a list or tuple, only read), in order. Each message is (key, tensor to
        send or None to receive, peer rank, message, label): a key is (action kind, mb, chunk), a
        message says what travels, the same on both sides (`nccl_rules.Op.message`), a label names
        it ("SA1")."""
        ops, kept = [], []
        issued = self.issued
        record: list[Op] | None = [] if issued is not None else None
        for key, tensor, peer, message, label in group:
            if tensor is not None:
                self._check(tensor, CARRIES[key[0]], key[1])
                payload = tensor.detach()  # `_check`: in the stage's dtype
                if self.narrowed:
                    payload = payload.to(self.wire_dtype)
                payload = payload.contiguous()
                self.bytes_sent += self.message_bytes
                ops.append(dist.P2POp(dist.isend, payload, peer, self.mesh.pp_group))
                kept.append((self._sends, key, peer, payload))
            else:
                payload = torch.empty(self.shape, dtype=self.wire_dtype, device=self.mesh.device)
                ops.append(dist.P2POp(dist.irecv, payload, peer, self.mesh.pp_group))
                kept.append((self._recvs, key, peer, payload))
            if record is not None:
                record.append(Op(tensor is not None, peer, message, label, self.message_bytes))
        works = self.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a coalesced group (NCCL): one work for all its messages
            works = works[-1:] * len(ops)
        for (where, key, peer, tensor), work in zip(kept, works):
            where[key] = (peer, tensor, work)
        if issued is not None and record is not None:
            issued.append(record)

    # waiting -------------------------------------------------------------------------------
    def wait_recv(self, key: tuple) -> torch.Tensor:
        """The received tensor of an issued receive (`key` = (kind, mb, chunk), kind
        "recv_act" / "recv_grad"), once it has arrived, in the stage's dtype."""
        entry = self._recvs.pop(key, None)
        if entry is None:
            kind, mb, chunk = key
            raise RuntimeError(
                f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}) needs the "
                f"{CARRIES[kind]} of micro-batch {mb} (chunk {chunk}) before its receive was "
                f"issued; the program is wrong"
            )
        peer, buffer, work = entry
        self._wait(work, "receiving", key, peer)
        return buffer.to(self.dtype) if self.narrowed else buffer

    def release(self, key: tuple) -> None:
        """Wait for one send that is known to have been received, and free its buffer (`key` =
        (kind, mb, chunk), kind "send_act" / "send_grad"; sends already waited for are
        ignored). The executor calls it only when a later message from the peer proves the
        receive has happened, so the wait returns at once."""
        entry = self._sends.pop(key, None)
        if entry is not None:
            self._wait(entry[2], "sending", key, entry[0])

    def wait_sends(self) -> None:
        """Wait for every send not waited for yet."""
        sends, self._sends = self._sends, {}
        for key, (peer, _payload, work) in sends.items():
            self._wait(work, "sending", key, peer)

    @property
    def pending_sends(self) -> int:
        """Sends issued but not yet waited for (their buffers are still held)."""
        return len(self._sends)

    def held(self) -> list[tuple[int, torch.Tensor, object]]:
        """(peer, buffer, work) of every message whose buffer this stage still holds: sends not
        waited for, receives not taken."""
        return list(self._sends.values()) + list(self._recvs.values())

    @property
    def pending_recvs(self) -> int:
        """Receives issued whose tensors have not been taken yet."""
        return len(self._recvs)

    # helpers -------------------------------------------------------------------------------
    def _wait(self, work, doing: str, key: tuple, peer: int) -> None:
        """Wait for the work of message `key` ("receiving" from / "sending" to `peer`); the
        error's text is made only if it fails."""

        def what() -> str:
            kind, mb, _ = key
            return (
                f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}): {doing} the "
                f"{CARRIES[kind]} of micro-batch {mb} {'from' if doing == 'receiving' else 'to'}"
                f" rank {peer}"
            )

        try:
            _device.wait(
                work,
                self.mesh.device,
                self.timeout_s,
                what,
                P2PTimeoutError,
                ". The peer stage probably failed or is stuck (look for its error), or "
                "the stages run mismatched schedules / micro-batch counts; raise the "
                "pipeline timeout if a step is legitimately this slow",
            )
        except P2PTimeoutError:
            self.failed = True
            raise

    def _check(self, tensor: torch.Tensor, what: str, mb: int) -> None:
        if tensor.shape != self.shape or tensor.dtype != self.dtype:  # a Size is a tuple
            raise ValueError(
                f"rank {self.mesh.rank}: the {what} of micro-batch {mb} has shape "
                f"{tuple(tensor.shape)} {tensor.dtype}, but the pipeline was set up for "
                f"{self.shape} {self.dtype}; every micro-batch must have the same "
                f"(micro-batch size, seq, hidden) and act_shape must match it"
            )


def wait_work(work, device, timeout_s: float, what: str) -> None:
    """Wait for an asynchronous collective of the pipeline (loss broadcast, timeline gathering)
    on tensors of `device`, raising P2PTimeoutError naming `what` (see `megapar.device.wait`)."""
    _device.wait(
        work,
        device,
        timeout_s,
        what,
        P2PTimeoutError,
        "; another rank of the pipeline group probably failed (look for its error)",
    )
