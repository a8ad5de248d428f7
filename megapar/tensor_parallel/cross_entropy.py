"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

The full logits are never gathered: each rank reduces its slice (max, sum of exponentials and
the target's logit) and the tp group sums those. Padding columns (global index >= vocab_size)
are excluded; targets equal to `ignore_index` give zero loss and zero gradient. A micro-batch's
loss is its mean over its labelled tokens (`masked_mean`), or under ``--loss-mean token`` its
sum times the step's weight (`weighted_sum`; see `LOSS_MEANS`).
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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy, holding one fp32 [tokens x local vocab] tensor.

    The forward makes one fp32 copy of the logits (shifted by the max), turns it into the
    softmax in place and keeps it for backward, which turns it into the gradient in place (so,
    as in Megatron, backward may run once: no ``retain_graph``). Padding columns are known from
    the sizes alone, so nothing waits for the device."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index):
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
        _all_reduce(target_logit, group)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad, local_target, outside, ignored = ctx.saved_tensors  # the softmax, made the grad
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token loss (fp32, same shape as `target`; 0 where target == ignore_index).

    logits: [..., local_vocab], this rank's columns [vocab_start, vocab_start + local_vocab) of
    the padded vocabulary; vocab_size: the true vocabulary (columns beyond it are padding).
    """
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    if (group is None or dist.get_world_size(group) == 1) and vocab_start == 0:
        # the whole vocabulary is here: torch's fused kernel, which keeps one [tokens x vocab]
        # tensor for backward instead of the several the parallel version materialises
        whole = logits[..., :vocab_size].reshape(-1, vocab_size).float()
        return F.cross_entropy(
            whole, target.reshape(-1), ignore_index=ignore_index, reduction="none"
        ).view(target.shape)
    return _VocabParallelCrossEntropy.apply(
        logits, target, group, vocab_start, vocab_size, ignore_index
    )


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
