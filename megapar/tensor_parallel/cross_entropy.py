"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

The full logits are never gathered: each rank reduces its slice (max, sum of exponentials and
the target's logit) and the tp group sums those. Padding columns (global index >= vocab_size)
are excluded; targets equal to `ignore_index` give zero loss and zero gradient. A micro-batch's
loss is its mean over its labelled tokens (`masked_mean`), or under ``--loss-mean token`` its
sum times the step's weight (`weighted_sum`; see `LOSS_MEANS`).

Label smoothing is torch's (``F.cross_entropy(..., label_smoothing=eps)``): each token's loss is
(1 - eps) x its cross-entropy + eps x the mean over the real vocabulary of -log p; the sum of
the token's logits over its columns travels in the target logit's all-reduce. PaLM's output
z-loss (`cross_entropy_terms`) is the squared log-sum-exp the loss already has: no collective
is added for either.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapar.mesh import all_reduce as _all_reduce
from megapar.mesh import group_size as _size
from megapar.tensor_parallel.mappings import reduce_from_tp_region

LOSS_MEANS = ("microbatch", "token")
"""What a step's loss averages (`TrainConfig.loss_mean`): "microbatch", each micro-batch's mean
over its labelled tokens, averaged over the micro-batches and dp ranks (Megatron's default);
"token", the sum over every labelled token of the global batch over their count (Megatron's
--calculate-per-token-loss, torchtitan's and transformers' Trainer's normalisation)."""


def token_loss(
    log_sum: torch.Tensor,
    target_logit: torch.Tensor,
    logit_sum: torch.Tensor | None,
    eps: float,
    vocab_size: int,
) -> torch.Tensor:
    """Each token's cross-entropy from its logits' log-sum-exp, its target's logit and, under
    label smoothing `eps`, the sum of its real columns' logits (`logit_sum`; None where eps is
    0): log_sum - (1 - eps) target - eps / vocab_size x sum (torch's smoothing over the
    `vocab_size` real columns), log_sum - target without. The log-sum-exp and the logits may
    be shifted by the same amount. One formula for the vocab-parallel loss and the fused
    heads' (`linear_cross_entropy`)."""
    if not eps or logit_sum is None:
        return log_sum - target_logit
    return log_sum - (1.0 - eps) * target_logit - (eps / vocab_size) * logit_sum


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy, holding one fp32 [tokens x local vocab] tensor.

    The forward makes one fp32 copy of the logits (shifted by the max), turns it into the
    softmax in place and keeps it for backward, which turns it into the gradient in place (so,
    as in Megatron, backward may run once: no ``retain_graph``). Padding columns are known from
    the sizes alone, so nothing waits for the device."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index, eps, z_coef):
        local_vocab = logits.shape[-1]
        real = max(0, min(local_vocab, vocab_size - vocab_start))  # columns before the padding
        logits_max = (
            logits[..., :real].max(dim=-1).values.float()
            if real
            else logits.new_full(logits.shape[:-1], float("-inf"), dtype=torch.float32)
        )
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        if logits.dtype == torch.float32:
            shifted = logits - logits_max.unsqueeze(-1)
        else:
            shifted = logits.float().sub_(logits_max.unsqueeze(-1))
        shifted[..., real:] = float("-inf")  # padding: exp() = 0

        ignored = target == ignore_index
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab) | ignored
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        logit_sum = None
        if eps:  # the real columns' logit sum travels with the target's logit: one all-reduce
            both = torch.stack([target_logit, shifted[..., :real].sum(dim=-1)])
            _all_reduce(both, group)
            target_logit, logit_sum = both[0], both[1]
        else:
            _all_reduce(target_logit, group)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, group)
        log_sum = sum_exp.log()  # the log-sum-exp minus the max
        loss = token_loss(log_sum, target_logit, logit_sum, eps, vocab_size)
        loss = loss.masked_fill(ignored, 0.0)
        lse = (log_sum + logits_max).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored, lse)
        ctx.eps, ctx.z_coef, ctx.real, ctx.vocab_size = eps, z_coef, real, vocab_size
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        grad, local_target, outside, ignored, lse = ctx.saved_tensors  # the softmax, made the grad
        eps, z_coef = ctx.eps, ctx.z_coef
        if z_coef:  # d(z lse^2) / d logits = 2 z lse softmax
            grad.mul_((1.0 + 2.0 * z_coef * lse).unsqueeze(-1))
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -((1.0 - eps) * hit).unsqueeze(-1))
        if eps:  # the smoothing's uniform target over the real columns
            grad[..., : ctx.real].sub_(eps / ctx.vocab_size)
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token loss (fp32, same shape as `target`; 0 where target == ignore_index).

    logits: [..., local_vocab], this rank's columns [vocab_start, vocab_start + local_vocab) of
    the padded vocabulary; vocab_size: the true vocabulary (columns beyond it are padding).
    label_smoothing: torch's (``F.cross_entropy(..., label_smoothing=)``): the target is
    1 - eps on the label plus eps / vocab_size on every real column, the label's included.
    """
    return cross_entropy_terms(
        logits, target, group, vocab_start, vocab_size, ignore_index, label_smoothing
    )[0]


def cross_entropy_terms(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token loss, per-token logsumexp(logits)^2 or None): `vocab_parallel_cross_entropy`,
    and with `z_loss` > 0 PaLM's output z-loss: the squared log-sum-exp of each labelled token's
    logits (0 where ignored; detached, to report), whose gradient times `z_loss` joins the
    returned loss's own (its value is the cross-entropy alone). The log-sum-exp over the vocab
    shards is the cross-entropy's own: no collective is added."""
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    if (group is None or dist.get_world_size(group) == 1) and vocab_start == 0:
        # the whole vocabulary is here: torch's fused kernel, which keeps one [tokens x vocab]
        # tensor for backward instead of the several the parallel version materialises
        whole = logits[..., :vocab_size].reshape(-1, vocab_size).float()
        flat = target.reshape(-1)
        loss = F.cross_entropy(
            whole,
            flat,
            ignore_index=ignore_index,
            reduction="none",
            label_smoothing=label_smoothing,
        )
        if not z_loss:
            return loss.view(target.shape), None
        lse2 = torch.logsumexp(whole, dim=-1).masked_fill(flat == ignore_index, 0.0).square()
        loss = loss + z_loss * (lse2 - lse2.detach())  # the value unchanged, the gradient added
        return loss.view(target.shape), lse2.detach().view(target.shape)
    loss, lse = _VocabParallelCrossEntropy.apply(
        logits,
        target,
        group,
        vocab_start,
        vocab_size,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
    )
    return loss, (lse.square() if z_loss else None)


def masked_mean(
    per_token: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, group=None
):
    """Mean of per-token losses over the tokens that are not ignored (0 if all are);
    `per_token` may be their sum already (a scalar, `linear_cross_entropy`'s "sum").

    With `group` (context parallelism: each rank holds other tokens of the same sequences) the
    mean is over the tokens of every rank of the group: the sums and counts are all-reduced
    together (one all-reduce of two numbers), forward only, so each rank's tokens get the
    gradient 1 / (the group's count), as the sum over tp in the vocab-parallel loss."""
    total, count = per_token.sum(), (target != ignore_index).sum()
    if _size(group) > 1:
        both = reduce_from_tp_region(torch.stack([total, count.to(total.dtype)]), group)
        total, count = both[0], both[1]
    return total / count.clamp(min=1)


def weighted_sum(per_token: torch.Tensor, weight, group=None) -> torch.Tensor:
    """`weight` times the sum of per-token losses (0 where the target is ignored), or of
    their sum already (a scalar): a micro-batch's loss under ``--loss-mean token``, where
    `weight` (a float or a 0-dim tensor, the same for every micro-batch of the step) is m x dp
    over the global batch's labelled tokens, so that the step's mean over micro-batches and dp
    ranks is the global token mean.

    With `group` (context parallelism) the sum is over the tokens of every rank of the group,
    all-reduced in the forward only, as in `masked_mean`: each rank's tokens get the gradient
    `weight`."""
    total = per_token.sum()
    if _size(group) > 1:
        total = reduce_from_tp_region(total, group)
    return total * weight


def masked_means(
    per_token: torch.Tensor,
    also: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`masked_mean` of `per_token` and of `also` (a detached per-token quantity, or its sum,
    to report beside the loss: the z-loss), over the same tokens; under `group` the two sums
    and the count are all-reduced together (still one all-reduce)."""
    total, extra, count = per_token.sum(), also.sum().detach(), (target != ignore_index).sum()
    if _size(group) > 1:
        sums = torch.stack([total, extra.to(total.dtype), count.to(total.dtype)])
        sums = reduce_from_tp_region(sums, group)
        total, extra, count = sums[0], sums[1], sums[2]
    count = count.clamp(min=1)
    return total / count, extra / count


def weighted_sums(
    per_token: torch.Tensor, also: torch.Tensor, weight, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weighted_sum` of `per_token` and of `also` (detached, as in `masked_means`); under
    `group` the two sums are all-reduced together (one all-reduce)."""
    total, extra = per_token.sum(), also.sum().detach()
    if _size(group) > 1:
        sums = reduce_from_tp_region(torch.stack([total, extra.to(total.dtype)]), group)
        total, extra = sums[0], sums[1]
    return total * weight, extra * weight
