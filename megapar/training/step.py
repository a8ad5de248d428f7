"""One optimizer step of 3D-parallel training, and the global-batch arithmetic behind it.

`TrainStep.step` on every rank, in this order:

1. zero the gradients, set this step's learning rate;
2. run the pipeline schedule under autocast (gradients accumulate over the m micro-batches; the
   dp average (a sum over cp) is bucketed and overlapped with the last micro-batch's backward
   by `grad_sync`); under ``--loss-mean token`` each micro-batch's loss is its labelled tokens'
   loss sum times m x dp / (the global batch's labelled tokens) (`loss_weight`), so the mean
   over micro-batches and dp ranks is the global token mean and the gradients are its own:
   everything below (clipping, fp16's unscale) sees the true gradients;
   sum over tp the gradients that are partial there (--sequence-parallel's replicated
   parameters; Llama's k / v kept whole where tp does not divide the kv heads);
3. sum the tied embedding's gradient over the first and last stage (pp > 1; under an
   all-reduce that rounds, --grad-compression or a 16-bit --grad-reduce-dtype, inside
   `grad_sync.finish()` before the tied buckets are reduced: the rounding must see the
   stages' sum, as pp 1 does);
4. fp16: unscale the gradients and agree, over the whole world, whether any is inf / NaN (the
   losses were backpropagated with the loss scale over dp, `Precision.backward_scale`, so
   a rank's fp16 backward holds one process's values and overflows where it does);
5. clip to the global gradient norm (over tp x pp, each parameter counted once);
6. step the optimizer unless the step overflowed (any precision: a non-finite gradient norm or
   loss is never applied); update the loss scale. The loss is all-reduced over dp before the
   norm (every rank holds the same global loss) and read with it, so a non-finite loss skips
   the update on every rank alike, without another wait for the device.

With a sharded grad sync (`build_grad_sync`: ZeRO-1 / ZeRO-2 with the distributed optimizer,
`optim/zero.py`, dp x cp > 1) the gradient buffer is reduce-scattered, not all-reduced (ZeRO-2:
every micro-batch, into this rank's shard; gradients partial over tp are then summed on the
shard): step 3 runs inside `grad_sync.finish()` before the buffer slice holding the embedding
is reduced (`_attach` below), and steps 4-6 read only this rank's slices (the norm is
all-reduced over dp as well); the optimizer all-gathers the weights.
ZeRO-3 (`optim/zero3.py`, `grad_sync` a `ShardedParams`) is the same with units instead of
buckets, except that nothing is gathered after the step (each unit is gathered at its next use)
and the replicated parameters' tp sum runs on the reduced pieces.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megapar.data_parallel.grad_sync import summed_before_reduction
from megapar.data_parallel.sharded_params import ShardedParams
from megapar.faults.status import set_action
from megapar.mesh import Mesh, all_reduce
from megapar.models.moe import finish_step, set_penalty_grad
from megapar.optim.clip import clip_grad_norm
from megapar.pipeline.tied import equal_tied_grads, sync_tied_embeddings
from megapar.tensor_parallel.cross_entropy import LOSS_MEANS
from megapar.tensor_parallel.fp8 import weight_cast_cache
from megapar.tensor_parallel.partition import shared_embedding_params
from megapar.tensor_parallel.sequence_parallel import sync_sequence_parallel_grads


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is split: G = micro-batch size x micro-batches per step x dp."""

    global_batch_size: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int
    """Sequences per micro-batch (one pipeline forward / backward)."""
    dp: int
    """Data-parallel size."""

    def __post_init__(self):
        if min(self.global_batch_size, self.micro_batch_size, self.dp) < 1:
            raise ValueError(
                f"batch sizes and dp must be >= 1, got global {self.global_batch_size}"
                f", micro {self.micro_batch_size}, dp {self.dp}"
            )
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global batch size {self.global_batch_size} is not divisible by micro-batch size "
                f"{self.micro_batch_size} x dp {self.dp} = {per_step}; choose a global batch size "
                f"that is a multiple of {per_step}"
            )

    @property
    def micro_batches(self) -> int:
        """m: micro-batches each dp rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def split(self, global_batch: dict[str, torch.Tensor], dp_rank: int) -> list[dict]:
        """dp rank's contiguous slice of a global batch, cut into its m micro-batches."""
        per_rank = self.global_batch_size // self.dp
        out = []
        for i in range(self.micro_batches):
            start = dp_rank * per_rank + i * self.micro_batch_size
            out.append(
                {k: v[start : start + self.micro_batch_size] for k, v in global_batch.items()}
            )
        return out


def loss_weight(micro_batches: list[dict], mesh: Mesh, labelled=None):
    """The weight of every micro-batch's labelled-token loss sum under ``--loss-mean token``:
    m x dp / the global batch's labelled tokens (labels not -100; at least 1), so the mean over
    the m micro-batches and the dp ranks is the global token mean. `labelled`: that count
    where the caller knows it (an int, or a tensor: then the weight is one on the device);
    None: this rank's micro-batches' labels counted on the device and summed over dp (one
    all-reduce of one int64). No host sync either way."""
    scale = len(micro_batches) * mesh.dp
    labelled = labelled_tokens(micro_batches, mesh, labelled)
    if isinstance(labelled, int):
        return scale / max(labelled, 1)
    return scale / labelled.to(mesh.device, torch.float32).clamp(min=1)


def labelled_tokens(micro_batches: list[dict], mesh: Mesh, labelled=None):
    """The global batch's labelled tokens: `labelled` where the caller knows it (an int or a
    tensor), else this rank's micro-batches' labels counted on the device and summed over dp
    (one all-reduce of one int64, no host sync)."""
    if labelled is not None:
        return labelled
    labelled = torch.stack([(mb["labels"] != -100).sum() for mb in micro_batches]).sum()
    if mesh.dp > 1:
        set_action("labelled-token count all-reduce over dp (--loss-mean token)")
        all_reduce(labelled, mesh.dp_group)
    return labelled


@dataclass
class StepResult:
    """What one optimizer step reports (identical on every rank)."""

    loss: float
    """Mean loss over the global batch (averaged over micro-batches and dp ranks; under
    --loss-mean token the mean over its labelled tokens)."""
    grad_norm: float
    """Global gradient norm before clipping (inf when the step overflowed)."""
    lr: float
    """Learning rate used for this step."""
    skipped: bool
    """The step found an inf / NaN gradient or loss and did not update the weights."""
    loss_scale: float
    """Loss scale used for this step's backward (1.0 unless fp16)."""
    router: dict | None = None
    """A mixture-of-experts model's router statistics of the step (`moe.finish_step`)."""
    z_loss: float | None = None
    """The step's output z-loss term (--z-loss: its coefficient x the mean squared
    log-sum-exp, averaged as the loss), which the backward adds to `loss`; None without."""
    empty: bool = False
    """The global batch held no labelled token (--loss-mean token; an SFT batch of prompts
    that fill their samples): nothing to learn, so the update was not applied (on a zero
    gradient AdamW's momentum and weight decay would still have moved the weights)."""


class TrainStep:
    """Runs optimizer steps for one rank's stage; every rank calls `step` together."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        executor,
        optimizer,
        scheduler,
        precision,
        clip_grad: float,
        grad_sync=None,
        loss_mean: str = "microbatch",
    ):
        if loss_mean not in LOSS_MEANS:
            raise ValueError(
                f"loss_mean={loss_mean!r} is not one of {', '.join(map(repr, LOSS_MEANS))}"
            )
        self.loss_mean = loss_mean
        """What the step's loss averages (`LOSS_MEANS`)."""
        self.last_loss_weight = None
        """The last step's micro-batch loss weight (`loss_weight`; None: micro-batch means)."""
        self.model, self.mesh = model, mesh
        self.executor, self.optimizer, self.scheduler = executor, optimizer, scheduler
        self.precision, self.clip_grad, self.grad_sync = precision, clip_grad, grad_sync
        self.params = [p for p in model.parameters() if p.requires_grad]
        float8 = getattr(grad_sync, "float8", None)  # ZeRO-3's float8 all-gather
        self.zero3_float8 = float8 if float8 is not None and float8.units else None
        """Under ZeRO-3 with --fp8 tensorwise: the stage's float8 units, gathered in float8
        during a step (`data_parallel.zero3_float8`); else None."""
        zero3 = getattr(optimizer, "zero", 0) == 3
        self.fp8_weight_casts = (
            weight_cast_cache(model) if not zero3 or self.zero3_float8 is not None else None
        )
        """Under --fp8, where a step's micro-batches share each weight's float8 cast (under
        ZeRO-3, the float8 weights its gathers fill); None without float8 layers and under
        ZeRO-3 without its float8 all-gather, whose gathered weights are not held whole
        through the step (each use casts its own)."""
        self.num_experts = getattr(getattr(model, "config", None), "num_local_experts", 0)
        """Routed experts per MoE layer (0: a dense model): the same on every rank, so every
        rank takes part in the step's router statistics."""
        self.partial_over_tp = mesh.tp > 1 and any(
            getattr(p, "sequence_parallel", False) for p in self.params
        )
        """Some gradients are partial over tp and summed once per step: sequence parallelism's
        replicated parameters, Llama's replicated k / v heads."""
        if mesh.cp > 1 and grad_sync is None:
            raise ValueError(
                "context parallelism needs grad_sync (build_grad_sync: its "
                "reduction is over mesh.dp_cp_group, averaged over dp): each cp "
                "rank's gradient is only its tokens' share until they are summed"
            )
        self.sharded = grad_sync is not None and grad_sync.sharded and mesh.dp * mesh.cp > 1
        """The grad sync shards the gradients, so the optimizer steps only this rank's
        slices (ZeRO-1 / 2 / 3 with dp x cp > 1)."""
        kind = getattr(optimizer, "kind", "adamw")
        collectives = [
            *(["ZeRO's collectives over dp x cp"] if self.sharded else []),
            *([f"{kind}'s trust-ratio all-reduces"] if kind in ("lamb", "lars") else []),
        ]
        self._optimizer_action = "optimizer step" + (
            f" ({', '.join(collectives)})" if collectives else ""
        )
        """What a hang in the optimizer step was doing (`set_action`): its collectives, if any."""
        rounds = getattr(grad_sync, "defers_last", False)
        self.tied_in_finish = self.sharded or (mesh.pp > 1 and rounds)
        """The tied embedding's sum over the first and last stage runs inside the grad sync's
        finish(), before its (deferred) dp reduction: the sharded kinds, and the all-reduce
        that rounds (`GradBuckets.defers_last`: compressed, or in a 16-bit reduce dtype); else
        `sync_gradients` sums the reduced shares."""
        self.partial_in_finish = self.partial_over_tp and not self.sharded and rounds
        """What is partial over tp is summed there too, before the reduction that rounds
        (PowerSGD compressing each tp rank's share apart was not one process's step); else
        `sync_gradients` sums it after."""
        if self.sharded:
            self._attach()
        elif self.tied_in_finish or self.partial_in_finish:
            self.grad_sync.defer(*self._deferred_sync())
        elif optimizer.zero and mesh.dp * mesh.cp > 1:
            raise ValueError(
                f"the ZeRO-{optimizer.zero} optimizer with dp x cp > 1 needs its "
                f"grad sync: pass grad_sync=build_grad_sync(..., "
                f"zero={optimizer.zero}) to TrainStep"
            )

    def _attach(self) -> None:
        """Attach the distributed optimizer to the sharded grad sync; with pp > 1 the tied
        embedding is synchronised inside finish(), before its bucket's reduce-scatter."""
        self.optimizer.attach(self.grad_sync, *self._tied_sync())

    def _deferred_sync(self):
        """(`summed_before_reduction`'s parameters, the function summing them: the tied
        embedding over the first and last stage, what is partial over tp over tp): what the
        all-reduce kind defers when its reduction rounds."""
        _, sum_tied = self._tied_sync()
        tp_group = self.mesh.tp_group

        def before() -> None:
            if sum_tied is not None:
                sum_tied()
            if self.partial_in_finish:
                set_action("sequence-parallel gradient all-reduce over tp (before dp's)")
                sync_sequence_parallel_grads(self.model, tp_group)

        return summed_before_reduction(self.model, self.mesh), before

    def _tied_sync(self):
        """(the tied embedding's parameters on this stage, the function summing their
        gradients over the first and last stage), or ((), None) where there are none or pp
        is 1: what the grad sync defers (`defer`) when it runs the sum in finish()."""
        last: Sequence[nn.Parameter] = ()
        before = None
        if self.mesh.pp > 1:
            last = shared_embedding_params(self.model)
            if last:

                def before() -> None:
                    set_action("tied-embedding gradient all-reduce (first + last stage)")
                    sync_tied_embeddings(self.model, self.mesh)

        return last, before

    def sync_gradients(self) -> None:
        """After the schedule: sum what is partial over tp (`partial_over_tp`) and the tied
        embedding over the first and last stage (unless the grad sync's finish() did that
        already: `tied_in_finish`)."""
        if self.partial_in_finish:  # summed before the dp reduction, in the grad sync's finish()
            pass
        elif self.partial_over_tp and self.sharded and self.grad_sync.sharded_grads:
            # ZeRO-2 / 3: the gradients are this rank's pieces by now (the sum is linear)
            self.optimizer.sum_partial_over_tp(self.mesh.tp_group)
        elif self.partial_over_tp:  # each rank's share: its positions (SP), its heads (k / v)
            sync_sequence_parallel_grads(self.model, self.mesh.tp_group)
        if self.mesh.pp > 1 and not self.tied_in_finish:  # else done in grad_sync.finish()
            set_action("tied-embedding gradient all-reduce (first + last stage)")
            sync_tied_embeddings(self.model, self.mesh)
        elif self.mesh.pp > 1:
            self._equal_tied_grads()

    def _equal_tied_grads(self) -> None:
        """After a dp reduction that followed the tied embedding's sum (`tied_in_finish`),
        the last stage's copy takes the first stage's reduced gradient (`equal_tied_grads`):
        each end reduced its copy in its own order of summation. The grad sync says what
        this rank holds of it (`reduced_part`)."""
        if self.grad_sync is None or self.mesh.dp * self.mesh.cp == 1:
            return
        part = self.grad_sync.reduced_part
        set_action("tied-embedding gradient broadcast (first stage to last)")
        equal_tied_grads([part(p) for p in shared_embedding_params(self.model)], self.mesh)

    def weights_scope(self):
        """The context of one step's forwards and backwards: under ZeRO-3 its gathers in the
        matmuls' precision (16-bit and float8 weights: `ShardedParams.step_scope`, collective
        under --fp8), and under --fp8 the weights' float8 casts kept for the step
        (`Fp8WeightCache.per_step`); a no-op without either."""
        casts = self.fp8_weight_casts
        if isinstance(self.grad_sync, ShardedParams):
            return self.grad_sync.step_scope(casts)  # casts only with the float8 all-gather
        return contextlib.nullcontext() if casts is None else casts.per_step()

    def step(self, micro_batches: list[dict], step_index: int, labelled=None) -> StepResult:
        """One optimizer step on this rank's `micro_batches`, at the learning-rate schedule's
        position `step_index` (`Engine.schedule_step`: the steps applied before it).
        `labelled`: under ``loss_mean="token"``, the global batch's labelled tokens where the
        caller knows them (an int or a 0-dim tensor); None: counted here (`loss_weight`)."""
        self.optimizer.zero_grad()
        if self.scheduler is not None:  # else the optimizer's lr (e.g. set by a torch scheduler)
            self.optimizer.set_lr(self.scheduler.lr(step_index))
        lr = self.optimizer.lr
        scale = self.precision.loss_scale
        seed = self.precision.backward_scale(self.mesh.dp)  # fp16: the scale over dp
        if self.num_experts:  # each micro-batch's balancing penalty, weighted as its loss
            set_penalty_grad(self.model, seed / len(micro_batches))
        count = None  # --loss-mean token: the global batch's labelled tokens (none: no update)
        if self.loss_mean == "token":
            count = labelled_tokens(micro_batches, self.mesh, labelled)
        weight = self.last_loss_weight = (
            None if count is None else loss_weight(micro_batches, self.mesh, count)
        )
        with self.precision.autocast(), self.weights_scope():
            loss = self.executor.run(
                micro_batches, grad_sync=self.grad_sync, loss_scale=seed, loss_weight=weight
            )
        self.sync_gradients()
        loss = loss.detach().float().reshape(()).clone()
        z = getattr(self.executor, "last_z_loss", None)
        if z is not None:  # the z-loss rides with the loss: one all-reduce
            loss = torch.stack([loss, z.detach().float().reshape(())])
        set_action("loss all-reduce over dp")
        all_reduce(loss, self.mesh.dp_group)
        set_action("gradient inf/NaN check (all-reduce over all ranks)")
        skipped = self.precision.unscale_and_check(
            self.optimizer.grad_tensors() if self.sharded else self.params, seed
        )
        set_action("gradient-norm all-reduce over tp x pp (clipping)")
        if skipped:
            norm = math.inf
        elif self.sharded:  # from this rank's slices, all-reduced over dp too
            norm = self.optimizer.clip_grad_norm(self.mesh, self.clip_grad)
        else:
            norm = clip_grad_norm(self.model, self.mesh, self.clip_grad)
        # complete by now: the norm was read after it (the z-loss and the labelled-token count
        # read with it, one host read)
        read = loss.reshape(-1)
        if isinstance(count, torch.Tensor):
            read = torch.cat([read, count.to(read).reshape(1)])
        values = read.tolist()
        if isinstance(count, torch.Tensor):
            count = values.pop()
        values = [v / self.mesh.dp for v in values]
        mean_loss, z_loss = values[0], (values[1] if z is not None else None)
        # A non-finite gradient or loss is never applied (both are global: every rank agrees),
        # nor a batch of no labelled token (the count is global too)
        skipped = skipped or not (math.isfinite(norm) and math.isfinite(mean_loss))
        empty = count == 0
        if not skipped and not empty:
            set_action(self._optimizer_action)
            self.optimizer.step()
        self.precision.update(skipped)
        compressor = getattr(self.grad_sync, "compressor", None)
        if compressor is not None:  # PowerSGD's state: dropped if skipped, in the new scale
            compressor.after_step(skipped, self.precision.loss_scale / scale)
        router = None
        if self.num_experts:
            set_action("router statistics all-reduce (dp x cp, pp)")
            router = finish_step(self.model, self.mesh, self.num_experts, not skipped)
        return StepResult(mean_loss, norm, lr, skipped, scale, router, z_loss, empty)
