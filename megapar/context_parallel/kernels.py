"""Attention of one block of queries against one block of keys / values, with its log-sum-exp.

Context-parallel attention computes a query's attention piece by piece (one block of keys at a
time) and merges the pieces with their log-sum-exp (`merge`). That needs a kernel that returns
the log-sum-exp in forward and, in backward, takes the *merged* output and log-sum-exp (flash
attention's backward: P = exp(S - lse), dS = P (dP - rowsum(dO O))), so that each block's
gradients are its share of the whole attention's.

`F.scaled_dot_product_attention` returns neither, so the kernels are the fused ops behind it,
called directly, which return the log-sum-exp and take it back in backward (as torch's own
context parallelism, `torch.distributed.tensor.experimental.context_parallel`, calls them):

- "flash": the fused CPU kernel that `scaled_dot_product_attention` itself runs on CPU
  (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward).
- "cuda-flash": FlashAttention-2 on CUDA (`aten._scaled_dot_product_flash_attention`), for
  bf16 / fp16 blocks without a padding mask.
- "cuda-efficient": the memory-efficient kernel on CUDA
  (`aten._scaled_dot_product_efficient_attention`), for fp32 blocks and BERT's padding bias.
  Neither CUDA kernel materialises the s_q x s_k scores; which head sizes each takes on a GPU
  is PyTorch's answer (`choose_kernel`, `torch_accepts`).
- "math": the same computation written out in fp32 matmuls, on any device: wherever attention
  dropout is on (its masks are drawn again in backward from the RNG state saved in forward, so
  nothing quadratic is kept), and as the reference the others are tested against.

The fused kernels have no dropout here (their dropout draws from a Philox stream megapar does
not replay), so dropout always takes "math".

Blocks are [b, heads, s_q, d] queries against [b, heads, s_k, d] keys and [b, heads, s_k, d_v]
values, d_v <= d (Multi-head Latent Attention's values are narrower than its keys: the fused
kernels take one head size, so a narrower v is zero-padded to d for each of their calls and the
output and dV cut back, exactly, the padded columns being zero; "math" takes it as it is);
`causal` is the square causal mask (a block against its own positions), `bias` an additive mask
broadcastable to [b, 1, 1, s_k] (BERT's padding) or [b, 1, s_q, s_k] (a sliding window's): 0 or
the dtype's lowest value, never -inf, so a block whose keys are all masked has a finite
log-sum-exp and merges with weight 0.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def in_window(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """[len(queries), len(keys)] True where the query at each position attends to the key at
    each position under a sliding window of `window` with the causal rule: transformers'
    `sliding_window_overlay` (key > query - window) and key <= query. The one statement of the
    rule, for the model's masks, the KV cache's and context parallelism's."""
    q, k = queries[:, None], keys[None, :]
    return (k <= q) & (k > q - window)


def choose_kernel(
    device: torch.device,
    dropout_p: float,
    dtype: torch.dtype = torch.float32,
    masked: bool = False,
    head_dim: int = 64,
) -> str:
    """The kernel for a device: "math" with attention dropout; on CPU "flash"; on CUDA
    "cuda-flash" for 16-bit blocks without a mask and "cuda-efficient" otherwise, where PyTorch
    says the kernel runs (`torch_accepts`: its own checks, forward and backward) for this GPU,
    dtype and head size, and for "cuda-flash" the head size is a multiple of 8 too (the op
    megapar calls does not pad it, as `scaled_dot_product_attention` does before calling it:
    `mha_fwd` / `mha_bwd` in aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp
    refuse any other); else "math". Head sizes above 128 (MLA's 192) run fused where PyTorch
    runs them: flash up to 256 (on sm86 / sm89 / sm120 / sm121 in training not 193-224), the
    memory-efficient kernel at any size aligned to its GEMMs."""
    if dropout_p:
        return "math"
    if device.type == "cpu":
        return "flash"
    if device.type == "cuda":
        half = dtype in (torch.bfloat16, torch.float16)
        if half and not masked and head_dim % 8 == 0:
            if torch_accepts("cuda-flash", device, dtype, head_dim):
                return "cuda-flash"
        if torch_accepts("cuda-efficient", device, dtype, head_dim):
            return "cuda-efficient"
    return "math"


_ACCEPTS: dict[tuple[str, str, torch.dtype, int, bool], bool] = {}
"""(kernel, device, dtype, head size, whether the kernel is enabled) -> `torch_accepts`'s
answer, asked once."""


def _probe(device: torch.device, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """A [1, 1, 1, head_dim] tensor on `device` that requires its gradient: what PyTorch's
    kernel checks read (device, dtype, sizes, strides; never its values)."""
    return torch.empty((1, 1, 1, head_dim), dtype=dtype, device=device, requires_grad=True)


def torch_accepts(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether PyTorch runs `kernel` ("cuda-flash" or "cuda-efficient") on q, k and v of
    `dtype` and `head_dim` on `device`, in training: its own checks,
    `torch.backends.cuda.can_use_flash_attention` / `can_use_efficient_attention` (the
    filters of `scaled_dot_product_attention`'s choice: sdp::can_use_flash_attention /
    can_use_mem_efficient_attention in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:
    the GPU's architecture, the dtype, check_head_dim_size_flash / _mem_efficient, and with
    grad enabled check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120, the
    backward's limit), asked with tensors that require their gradient under grad mode, no
    mask, no dropout and no causal flag (the calls with one are square). Asked once per
    kernel, device, dtype, head size and whether the kernel is enabled (PyTorch's checks read
    `torch.backends.cuda.enable_flash_sdp` / `enable_mem_efficient_sdp`, which a user may
    switch between runs in one process): no host synchronisation, no kernel launched."""
    flash = kernel == "cuda-flash"
    enabled = (
        torch.backends.cuda.flash_sdp_enabled()
        if flash
        else torch.backends.cuda.mem_efficient_sdp_enabled()
    )
    key = (kernel, str(device), dtype, head_dim, enabled)
    if key not in _ACCEPTS:
        check = (
            torch.backends.cuda.can_use_flash_attention
            if flash
            else torch.backends.cuda.can_use_efficient_attention
        )
        with torch.enable_grad():
            t = _probe(device, dtype, head_dim)
            params = torch.backends.cuda.SDPAParams(t, t, t, None, 0.0, False, False)
            _ACCEPTS[key] = bool(check(params, False))
    return _ACCEPTS[key]


_EFFICIENT_ALIGN = 16
"""The memory-efficient kernel reads its bias in rows aligned to 16 elements (torch pads a
mask the same way before calling it)."""


def _efficient_bias(bias, q, k):
    """The additive mask (of keys, [b, 1, 1, s_k], or of each query's keys, [b or 1, 1, s_q,
    s_k]: a sliding window's) as the memory-efficient kernel takes it: [b, heads, s_q, s_k] in
    q's dtype, its storage padded to rows of a multiple of 16 keys (broadcast: no copy per
    head, nor per query of a key mask)."""
    if bias is None:
        return None
    b, heads, s_q, _ = q.shape
    s_k = k.shape[2]
    padded = -(-s_k // _EFFICIENT_ALIGN) * _EFFICIENT_ALIGN
    rows_q = s_q if bias.shape[-2] != 1 else 1
    rows = bias.to(q.dtype).expand(b, 1, rows_q, s_k)
    store = rows.new_zeros(b, 1, rows_q, padded)
    store[..., :s_k] = rows
    return store[..., :s_k].expand(b, heads, s_q, s_k)


_FORWARD_RNG: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
"""(kernel, device) -> the dropout RNG seed and offset its forward returned. The backward ops
take them back; without dropout (always, here) they are placeholders whose types the kernel
chooses, so the first forward's are kept and given to every backward, as torch's own
autograd gives each backward its forward's."""


def _keep_rng(kernel: str, device, seed: torch.Tensor, offset: torch.Tensor) -> None:
    _FORWARD_RNG.setdefault((kernel, str(device)), (seed, offset))


def _forward_rng(kernel: str, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed and offset for `kernel`'s backward on q's device (a forward made them)."""
    key = (kernel, str(q.device))
    if key not in _FORWARD_RNG:  # a backward before any forward: run one of one query
        one = q[:1, :1, :1].contiguous()
        block_forward(one, one, one, False, None, kernel)
    return _FORWARD_RNG[key]


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
        s = s.masked_fill(
            torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    return s, scale


def block_forward(
    q, k, v, causal: bool, bias=None, kernel: str = "flash", dropout: DropoutMasks | None = None
):
    """(out in q's dtype, lse fp32 [b, heads, s_q]) of q against k / v."""
    width = v.shape[-1]
    if kernel != "math" and width < q.shape[-1]:
        pad = (0, q.shape[-1] - width)
        out, lse = block_forward(q, k, F.pad(v, pad), causal, bias, kernel, dropout)
        return out[..., :width], lse
    if kernel == "flash":
        if bias is not None:
            bias = bias.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias
        )
    if kernel == "cuda-flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal
        )
        _keep_rng(kernel, q.device, res[6], res[7])
        return res[0], res[1]
    if kernel == "cuda-efficient":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            _efficient_bias(bias, q, k),
            True,
            0.0,
            causal,
        )
        _keep_rng(kernel, q.device, seed, offset)
        return out, lse[..., : q.shape[2]]  # its rows are padded to a multiple of 32
    s, _ = _scores(q, k, causal, bias)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if dropout is not None:
        p = p * dropout.draw(p.shape).to(p.dtype)
    return torch.matmul(p, wide(v)).to(q.dtype), lse


def block_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    bias=None,
    kernel: str = "flash",
    dropout: DropoutMasks | None = None,
):
    """(dq, dk, dv) of this block's share, from the *merged* out and lse of the query rows."""
    width = v.shape[-1]
    if kernel != "math" and width < q.shape[-1]:
        pad = (0, q.shape[-1] - width)
        dq, dk, dv = block_backward(
            F.pad(dout, pad),
            q,
            k,
            F.pad(v, pad),
            F.pad(out, pad),
            lse,
            causal,
            bias,
            kernel,
            dropout,
        )
        return dq, dk, dv[..., :width]
    if kernel == "flash":
        if bias is not None:
            bias = bias.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse.contiguous(),
            0.0,
            causal,
            attn_mask=bias,
        )
    if kernel in ("cuda-flash", "cuda-efficient"):
        return _cuda_backward(dout, q, k, v, out, lse, causal, bias, kernel)
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


def _cuda_backward(dout, q, k, v, out, lse, causal: bool, bias, kernel: str):
    """(dq, dk, dv) of a block by PyTorch's CUDA flash or memory-efficient backward (`kernel`),
    given the seed and offset a forward of that kernel made (`_forward_rng`)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    seed, offset = _forward_rng(kernel, q)
    if kernel == "cuda-flash":
        s_q, s_k = q.shape[2], k.shape[2]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.float().contiguous(),
            None,
            None,
            s_q,
            s_k,
            0.0,
            causal,
            seed,
            offset,
        )
    padded = -(-q.shape[2] // 32) * 32  # the log-sum-exp rows as its forward returns them
    lse_rows = lse.new_zeros(*lse.shape[:-1], padded)
    lse_rows[..., : q.shape[2]] = lse
    # out and dout laid out as its forward returns out, [b, s, heads, d] in memory: in
    # 16-bit it computes wrong dq / dk from [b, heads, s, d] ones (measured on an H200)
    dout, out = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (dout, out))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        _efficient_bias(bias, q, k),
        out,
        lse_rows,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
    )
    return dq, dk, dv


def merge(out, lse, block_out, block_lse):
    """Merge a block's (out, lse) into the running (out, wide, lse) of the same query rows:
    out = sum of each part weighted by exp(its lse - the merged lse). (None, None) starts."""
    if out is None:
        return wide(block_out), block_lse
    new = torch.logaddexp(lse, block_lse)
    return (
        out * torch.exp(lse - new).unsqueeze(-1)
        + wide(block_out) * torch.exp(block_lse - new).unsqueeze(-1)
    ), new
