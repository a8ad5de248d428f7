"""Attention of one block of queries against one block of keys / values, with its log-sum-exp.

Context-parallel attention computes a query's attention piece by piece (one block of keys at a
time) and merges the pieces with their log-sum-exp (`merge`). That needs a kernel that returns
the log-sum-exp in forward and, in backward, takes the *merged* output and log-sum-exp (flash
attention's backward: P = exp(S - lse), dS = P (dP - rowsum(dO O))), so that each block's
gradients are its share of the whole attention's.

`F.scaled_dot_product_attention` returns neither, so the kernels are:

- "flash": the fused CPU kernel that `scaled_dot_product_attention` itself runs on CPU
  (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward), which returns the
  log-sum-exp and takes it back. It has no dropout.
- "math": the same computation written out in fp32 matmuls, on any device (used on CUDA, and
  wherever attention dropout is on: its masks are drawn again in backward from the RNG state
  saved in forward, so nothing quadratic is kept). On GPUs a fused kernel with a log-sum-exp
  (flash / memory-efficient attention's) would be faster; this one is written out so that the
  exact code path GPUs run is the one the CPU tests check.

Blocks are [b, heads, s_q, d] queries against [b, heads, s_k, d] keys / values; `causal` is the
square causal mask (a block against its own positions), `bias` an additive key mask
broadcastable to [b, 1, 1, s_k] (BERT's padding: 0 or the dtype's lowest value, never -inf, so
a block whose keys are all padding has a finite log-sum-exp and merges with weight 0).
"""

from __future__ import annotations

import contextlib

import torch

KERNELS = ("flash", "math")


def choose_kernel(device: torch.device, dropout_p: float) -> str:
    """The kernel for a device: the fused CPU kernel unless attention dropout is on."""
    return "flash" if device.type == "cpu" and dropout_p == 0 else "math"


class DropoutMasks:
    """Dropout masks of attention probabilities: drawn in forward from the current RNG stream,
    each draw's RNG state kept (a few bytes) so that backward draws the same masks again."""

    def __init__(self, p: float, device: torch.device):
        self.p, self.device = p, device
        self.states: list[torch.Tensor] = []
        self._replay: int | None = None

    def _get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def draw(self, shape) -> torch.Tensor:
        """The keep-mask (already divided by 1 - p) of the next block, as a float tensor."""
        if self._replay is None:
            self.states.append(self._get_state())
        else:
            self._set_state(self.states[self._replay])
            self._replay += 1
        keep = torch.rand(shape, device=self.device) >= self.p
        return keep.float().div_(1 - self.p)

    def replaying(self):
        """A context in which `draw` gives the forward's masks again, in the same order (and
        the RNG stream is left as it was)."""

        @contextlib.contextmanager
        def ctx():
            saved = self._get_state()
            self._replay = 0
            try:
                yield
            finally:
                self._replay = None
                self._set_state(saved)
        return ctx()


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 at least (fp64 stays fp64): the precision results are accumulated in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, causal, bias):
    scale = q.shape[-1] ** -0.5
    s = torch.matmul(wide(q), wide(k).transpose(-1, -2)).mul_(scale)
    if bias is not None:
        s = s + wide(bias)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s, scale


def block_forward(q, k, v, causal: bool, bias=None, kernel: str = "flash",
                  dropout: DropoutMasks | None = None):
    """(out in q's dtype, lse fp32 [b, heads, s_q]) of q against k / v."""
    if kernel == "flash":
        if bias is not None:
            bias = bias.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias)
    s, _ = _scores(q, k, causal, bias)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if dropout is not None:
        p = p * dropout.draw(p.shape).to(p.dtype)
    return torch.matmul(p, wide(v)).to(q.dtype), lse


def block_backward(dout, q, k, v, out, lse, causal: bool, bias=None, kernel: str = "flash",
                   dropout: DropoutMasks | None = None):
    """(dq, dk, dv) of this block's share, from the *merged* out and lse of the query rows."""
    if kernel == "flash":
        if bias is not None:
            bias = bias.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal,
            attn_mask=bias)
    s, scale = _scores(q, k, causal, bias)
    p = torch.exp(s - lse.unsqueeze(-1))
    do, vf = wide(dout), wide(v)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    if dropout is not None:
        keep = dropout.draw(p.shape).to(p.dtype)
        dv = torch.matmul((p * keep).transpose(-1, -2), do)
        dp = dp * keep
    else:
        dv = torch.matmul(p.transpose(-1, -2), do)
    delta = (do * wide(out)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, wide(k)).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), wide(q)).mul_(scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(out, lse, block_out, block_lse):
    """Merge a block's (out, lse) into the running (out, wide, lse) of the same query rows:
    out = sum of each part weighted by exp(its lse - the merged lse). (None, None) starts."""
    if out is None:
        return wide(block_out), block_lse
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new).unsqueeze(-1)
            + wide(block_out) * torch.exp(block_lse - new).unsqueeze(-1)), new
