"""The LM head and its cross-entropy fused and run a chunk of tokens at a time, so the logits of
a whole micro-batch never exist (torchtitan's chunked loss, Liger's fused linear cross-entropy).

The forward computes each chunk's logits (x W^T + b, in the autocast dtype when autocast is on,
as ``F.linear`` would), reduces them to three fp32 numbers per token (the max and the sum of
exponentials of this rank's vocabulary slice, and the target's logit) and drops them; with a
vocabulary split over the tp group those three vectors are all-reduced once for all chunks
(the same three all-reduces as `vocab_parallel_cross_entropy`), giving each token's log-sum-exp.
It keeps the head's input, the weights, the targets and the log-sum-exp (4 bytes a token). The
backward recomputes each chunk's logits, turns them into the gradient (softmax minus the one-hot
target, times the incoming gradient) and multiplies it out at once into the input's gradient
and the fp32 weight (and bias) gradients, so one chunk's logits are the most that ever lives.
The price is one more head matmul (the logits recomputed in the backward).

With ``reduction="sum"`` (what the models call: their loss is this sum over the count of
labelled tokens, so the incoming gradient is one scalar for every token, the loss scale and
the micro-batch count in it) and the whole vocabulary on this rank (tp 1), Liger's way runs
instead: each chunk's gradient (softmax minus the one-hot target, 0 for ignored targets) is
formed in the forward right after its logits and multiplied out at once into the input's
[tokens x h] and the weight's (and bias's) gradients, fp32, kept from forward to backward; the
backward only scales them by the incoming scalar (in place: a second backward through the same
graph fails). The logits are computed once. The trade: the fp32 weight gradient ([vocab x h],
which the backward would make anyway) and the input's gradient are held from the forward to
the backward, per micro-batch in flight, instead of the head's input, targets and log-sum-exp.
At tp > 1 a token's softmax needs the log-sum-exp all-reduced over tp, known only after every
chunk's statistics, so there the gradients are not formed in the forward: the sum is the
per-token path's, recomputing the logits in the backward.

Label smoothing adds each token's logit sum over the real vocabulary to the statistics (all-reduced
with the target's logit: no collective added) and eps / vocabulary to every real column's
gradient; the z-loss's gradient (2 z lse x the softmax) is formed with the softmax's.

The weight gradient is never deferred (a zero-bubble W pass has nothing of the head's to run
later), and accumulates over the chunks in fp32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megapar.mesh import all_reduce as _all_reduce
from megapar.tensor_parallel.cross_entropy import token_loss

LOSS_CHUNK_TOKENS = 1024
"""Tokens per chunk of the fused head and loss by default (`TrainConfig.loss_chunk_tokens`)."""


def _no_autocast(device: str):
    """Autocast off on `device` (nothing to do where it has none, e.g. meta)."""
    if torch.amp.is_autocast_available(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


class _Buffers:
    """One chunk's logits, made in place chunk after chunk: a [chunk x vocab] buffer in the
    compute dtype and, when that is not fp32, an fp32 one (so a pass over the chunks holds the
    same two tensors whatever the number of tokens, not one new tensor per chunk)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        self.out = torch.empty(rows, cols, dtype=dtype, device=device)
        self.fp32 = (
            self.out
            if dtype == torch.float32
            else torch.empty(rows, cols, dtype=torch.float32, device=device)
        )

    def logits(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits of the rows `x` (x w^T + b computed in w's dtype), in the buffer."""
        n, out = x.shape[0], self.out[: x.shape[0]]
        x = x.to(w.dtype)
        if b is None:
            torch.mm(x, w.t(), out=out)
        else:
            torch.addmm(b, x, w.t(), out=out)
        return out if self.fp32 is self.out else self.fp32[:n].copy_(out)

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """The fp32 chunk `t` in the compute dtype (itself in fp32), in the buffer."""
        return t if self.fp32 is self.out else self.out[: t.shape[0]].copy_(t)


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``x @ weight.T + bias`` against `target`, chunked as above.

    x: [tokens, h]; weight: [local_vocab, h], this rank's rows [vocab_start, vocab_start +
    local_vocab) of the padded vocabulary (columns past `vocab_size` are padding); target:
    [tokens]. Returns the fp32 loss per token (0 where target == ignore_index)."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        target,
        group,
        vocab_start,
        vocab_size,
        ignore_index,
        chunk,
        dtype,
        eps,
        z_coef,
    ):
        local_vocab = weight.shape[0]
        real = max(0, min(local_vocab, vocab_size - vocab_start))  # columns before the padding
        ignored = target == ignore_index
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= real) | ignored
        local_target = local_target.masked_fill(outside, 0)
        tokens = x.shape[0]
        logits_max = x.new_full((tokens,), float("-inf"), dtype=torch.float32)
        sum_exp = x.new_zeros((tokens,), dtype=torch.float32)
        target_logit = x.new_zeros((tokens,), dtype=torch.float32)
        logit_sum = x.new_zeros((tokens,), dtype=torch.float32) if eps else None
        if real:
            w = weight[:real].to(dtype)
            b = bias[:real].to(dtype) if bias is not None else None
            buffers = _Buffers(min(chunk, tokens), real, dtype, x.device)
            for i in range(0, tokens, chunk):
                j = min(tokens, i + chunk)
                logits = buffers.logits(x[i:j], w, b)
                m = logits.amax(dim=-1)  # the values only (max's indices cost 5x on the CPU)
                logits_max[i:j] = m
                target_logit[i:j] = logits.gather(-1, local_target[i:j, None]).squeeze(-1)
                if logit_sum is not None:  # label smoothing's mean logit over the vocabulary
                    logit_sum[i:j] = logits.sum(dim=-1)
                sum_exp[i:j] = logits.sub_(m[:, None]).exp_().sum(dim=-1)
            del buffers
        target_logit.masked_fill_(outside, 0.0)
        if group is not None and dist.get_world_size(group) > 1:
            local_max = logits_max.clone()
            _all_reduce(logits_max, group, dist.ReduceOp.MAX)
            if logit_sum is not None:  # with the target's logit: one all-reduce
                both = torch.stack([target_logit, logit_sum])
                _all_reduce(both, group)
                target_logit, logit_sum = both[0], both[1]
            else:
                _all_reduce(target_logit, group)
            sum_exp.mul_((local_max - logits_max).exp_().nan_to_num_(0.0))  # -inf - m: exp = 0
            _all_reduce(sum_exp, group)
        lse = sum_exp.log_().add_(logits_max)
        loss = token_loss(lse, target_logit, logit_sum, eps, vocab_size).masked_fill_(ignored, 0.0)
        ctx.save_for_backward(x, weight, bias, local_target, outside, ignored, lse)
        ctx.real, ctx.chunk, ctx.dtype = real, chunk, dtype
        ctx.eps, ctx.z_coef, ctx.vocab_size = eps, z_coef, vocab_size
        lse = lse.masked_fill(ignored, 0.0)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        with _no_autocast(grad_loss.device.type):  # casts as the forward did
            return _LinearCrossEntropy._backward(ctx, grad_loss)

    @staticmethod
    def _backward(ctx, grad_loss):
        x, weight, bias, local_target, outside, ignored, lse = ctx.saved_tensors
        real, chunk, dtype = ctx.real, ctx.chunk, ctx.dtype
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        scale = (grad_loss.float() * (~ignored)).reshape(-1)
        # fp16: the incoming gradient (fp16's loss scale in it) divided by a power of two at
        # least its largest, given back to the fp32 results: no scaled value sits in an fp16
        # tensor (the weight gradient's fp16 product would overflow where its fp32 value is
        # finite), as in the fused path, which scales in fp32 after its product; the smallest
        # terms then round in fp16's subnormals as the fused path's do (not the same bits as
        # scaling first, the same accuracy)
        top = _power_of_two_at_least(scale) if dtype == torch.float16 else None
        if top is not None:
            scale = scale / top
        eps, z_coef, smooth = ctx.eps, ctx.z_coef, ctx.eps / ctx.vocab_size
        hit = (~outside).float()
        if eps:
            hit.mul_(1.0 - eps)
        lse_scale = (1.0 + 2.0 * z_coef * lse) if z_coef else None  # + d(z lse^2) / d logits
        grad_x = torch.zeros_like(x) if need_x else None
        grad_w = (
            torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        if need_w:  # the vocabulary's padding rows: zero; the others written by the first chunk
            grad_w[real:].zero_()
        grad_b = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        )
        if real:
            w = weight[:real].to(dtype)
            b = bias[:real].to(dtype) if bias is not None else None
            buffers = _Buffers(min(chunk, x.shape[0]), real, dtype, x.device)
            for i in range(0, x.shape[0], chunk):
                j = min(x.shape[0], i + chunk)
                grad = buffers.logits(x[i:j], w, b)
                grad.sub_(lse[i:j, None]).exp_()  # the softmax
                if lse_scale is not None:
                    grad.mul_(lse_scale[i:j, None])
                grad.scatter_add_(-1, local_target[i:j, None], -hit[i:j, None])
                if eps:  # the smoothing's uniform target over the real columns
                    grad.sub_(smooth)
                grad.mul_(scale[i:j, None])
                grads = [grad_x, grad_w, grad_b]
                _chunk_grads(grads, grad, buffers.to_compute(grad), x[i:j].to(dtype), w, i, j)
            del buffers
        if top is not None:
            for g in (grad_x, grad_w, grad_b):
                if g is not None:
                    g.mul_(top)
        return (
            grad_x,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
        ) + (None,) * 9


def _power_of_two_at_least(t: torch.Tensor) -> torch.Tensor:
    """The least power of two at least every |t| (float32's least normal number where t is all
    zeros: a zero gradient stays zero), on t's device: no host sync."""
    top = t.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.ceil(torch.log2(top)))


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``out = a @ b`` when `first`, else ``out += a @ b``: in place, without a product tensor,
    where `out` has the product's dtype (fp32 compute); else through it."""
    if out.dtype != a.dtype:
        if first:
            out.copy_(a @ b)
        else:
            out.add_(a @ b)
    elif first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


class _FusedSum(torch.autograd.Function):
    """The sum over tokens of the per-token cross-entropy of ``x @ weight.T + bias`` against
    `target` with the whole vocabulary on this rank, its gradients made in the forward (see
    the module docstring). x: [tokens, h]; weight: [vocab (padded), h]; needs: which of x,
    weight, bias get a gradient. Returns the fp32 sum (ignored targets add nothing)."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, target, vocab_size, ignore_index, chunk, dtype, needs, eps, z_coef
    ):
        real = min(weight.shape[0], vocab_size)
        ignored = target == ignore_index
        keep = (~ignored).float()
        target = target.masked_fill(ignored, 0)
        grads = _fp32_zeros(needs, x, weight, bias)
        total = x.new_zeros((), dtype=torch.float32)
        z_total = x.new_zeros((), dtype=torch.float32)
        w = weight[:real].to(dtype)
        b = bias[:real].to(dtype) if bias is not None else None
        buffers = _Buffers(min(chunk, x.shape[0]), real, dtype, x.device)
        for i in range(0, x.shape[0], chunk):
            j = min(x.shape[0], i + chunk)
            logits = buffers.logits(x[i:j], w, b)
            m = logits.amax(dim=-1)
            target_logit = logits.gather(-1, target[i:j, None]).squeeze(-1)
            logit_sum = logits.sum(dim=-1) if eps else None
            grad = logits.sub_(m[:, None]).exp_()
            sum_exp = grad.sum(dim=-1)
            lse = sum_exp.log() + m
            loss = token_loss(lse, target_logit, logit_sum, eps, real)
            total += (loss * keep[i:j]).sum()
            if z_coef:
                z_total += (lse.square() * keep[i:j]).sum()
            if any(needs):  # softmax minus the one-hot target, times 1 (0 where ignored)
                weight_i = keep[i:j] * (1.0 + 2.0 * z_coef * lse) if z_coef else keep[i:j]
                grad.mul_((weight_i / sum_exp)[:, None])  # z-loss: + 2 z lse softmax
                grad.scatter_add_(-1, target[i:j, None], -((1.0 - eps) * keep[i:j, None]))
                if eps:  # the smoothing's uniform target over the vocabulary
                    grad.sub_((eps / real) * keep[i:j, None])
                _chunk_grads(grads, grad, buffers.to_compute(grad), x[i:j].to(dtype), w, i, j)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.needs = needs
        ctx.dtypes = [t.dtype if t is not None else None for t in (x, weight, bias)]
        ctx.mark_non_differentiable(z_total)
        return total, z_total

    @staticmethod
    def backward(ctx, grad_total, _grad_z):
        saved = iter(ctx.saved_tensors)  # scaled in place: a second backward fails loudly
        grads = [
            next(saved).mul_(grad_total).to(dtype) if need else None
            for need, dtype in zip(ctx.needs, ctx.dtypes)
        ]
        return tuple(grads) + (None,) * 8


def _fp32_zeros(needs, x, weight, bias) -> list:
    """fp32 gradients of x, weight and bias (None where not needed), zero."""
    return [
        torch.zeros(t.shape, dtype=torch.float32, device=t.device) if need else None
        for need, t in zip(needs, (x, weight, bias))
    ]


def _chunk_grads(grads: list, grad32, grad, xc, w, i: int, j: int) -> None:
    """Add one chunk's gradients into `grads` (x's rows [i, j), weight, bias): grad32 / grad
    the logits' gradient in fp32 / the compute dtype, xc the chunk's input in that dtype."""
    grad_x, grad_w, grad_b = grads
    real = w.shape[0]
    if grad_x is not None:
        grad_x[i:j] = grad @ w
    if grad_w is not None:
        _accumulate_mm(grad_w[:real], grad.t(), xc, first=i == 0)
    if grad_b is not None:
        grad_b[:real].add_(grad32.sum(dim=0))


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    reduction: str = "none",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token loss (fp32, the shape of `target`) of the logits ``x @ weight.T + bias``,
    never holding more than `chunk_tokens` tokens' logits; equal to
    ``vocab_parallel_cross_entropy(F.linear(x, weight, bias), target, ...)``.

    x: [..., h], the head's input as every rank of `group` sees it (the tp region's copy or the
    gathered sequence); weight: this rank's vocabulary rows [vocab_start, vocab_start +
    local_vocab); vocab_size: the true vocabulary (rows beyond it are padding); chunk_tokens:
    tokens per chunk (> 0). Under autocast the logits are computed in its dtype, as
    ``F.linear`` would, and the loss in fp32. reduction: "none" (the per-token loss) or "sum"
    (its sum, a scalar): with the whole vocabulary on this rank (no `group`, or one of size
    1) the sum's gradients are made in the forward and the logits computed once.
    label_smoothing: torch's, over the real vocabulary (`vocab_parallel_cross_entropy`)."""
    return linear_cross_entropy_terms(
        x,
        weight,
        target,
        bias,
        group,
        vocab_start,
        vocab_size,
        ignore_index,
        chunk_tokens,
        reduction,
        label_smoothing,
    )[0]


def linear_cross_entropy_terms(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    reduction: str = "none",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`linear_cross_entropy`'s loss, the squared log-sum-exp of each labelled token's logits
    or None): with `z_loss` > 0 PaLM's output z-loss, as `cross_entropy_terms` gives it (its
    gradient times `z_loss` joins the loss's, its value is reported alone, per token or summed
    as `reduction` says; no collective added)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if reduction not in ("none", "sum"):
        raise ValueError(f"reduction must be 'none' or 'sum', got {reduction!r}")
    if vocab_size is None:
        vocab_size = vocab_start + weight.shape[0]
    device = x.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    whole = group is None or dist.get_world_size(group) == 1
    eps, z_coef = float(label_smoothing), float(z_loss)
    if reduction == "sum" and whole and vocab_start == 0:
        grad_on = torch.is_grad_enabled()
        needs = tuple(grad_on and t is not None and t.requires_grad for t in (x, weight, bias))
        with _no_autocast(device):
            total, z_total = _FusedSum.apply(
                x.reshape(-1, x.shape[-1]),
                weight,
                bias,
                target.reshape(-1),
                vocab_size,
                ignore_index,
                chunk_tokens,
                dtype,
                needs,
                eps,
                z_coef,
            )
        return total, (z_total if z_coef else None)
    with _no_autocast(device):  # the function casts as autocast would
        loss, lse = _LinearCrossEntropy.apply(
            x.reshape(-1, x.shape[-1]),
            weight,
            bias,
            target.reshape(-1),
            group,
            vocab_start,
            vocab_size,
            ignore_index,
            chunk_tokens,
            dtype,
            eps,
            z_coef,
        )
    lse2 = lse.square() if z_coef else None
    if reduction == "sum":
        return loss.sum(), (None if lse2 is None else lse2.sum())
    return loss.view(target.shape), (None if lse2 is None else lse2.view(target.shape))
