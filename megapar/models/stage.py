"""What GPT-2 and BERT share as pipeline-stage models: the layer slice, the tied word embedding
and the vocab-parallel loss at the end.

Under context parallelism every stage reads the whole micro-batch (ids, labels, BERT's mask)
and takes this cp rank's tokens of it (`_cp_tokens`, `megapar.context_parallel.split`), with
their global positions; the loss sums token losses and counts over the cp group.

The last stage returns a micro-batch's mean loss over its labelled tokens, or, while the
pipeline executor has set `loss_weight` for a step (``--loss-mean token``), their sum times
that weight (`_reduce_loss`).

A stage holds the embedding if it is first (`pre_process`), blocks named by their *global*
index (so parameter names are the same in every layout), and the head if it is last
(`post_process`). The LM head reuses the word embedding; a last stage without the embedding
keeps a tied copy (`tied_to = "embed.word.weight"`, created by `tied_copy`), whose gradient
the trainer sums with the first stage's (`shared_embedding = True` on both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from megapar import context_parallel as cp
from megapar.mesh import Mesh
from megapar.models.documents import DocumentSettings
from megapar.tensor_parallel import (
    LOSS_CHUNK_TOKENS,
    NullTracker,
    masked_mean,
    parallel_lm_logits,
    weighted_sum,
)
from megapar.tensor_parallel.cross_entropy import cross_entropy_terms, masked_means, weighted_sums
from megapar.tensor_parallel.layers import lm_head_input
from megapar.tensor_parallel.linear_cross_entropy import linear_cross_entropy_terms
from megapar.tensor_parallel.partition import local_size, mark_replicated, set_partition
from megapar.tensor_parallel.sequence_parallel import (
    mark_sequence_parallel,
    split_sequence,
)

WORD_EMBEDDING = "embed.word.weight"


class StageModel(nn.Module):
    """Base of GPT2, Bert and Llama. Subclasses build `embed`, `layers` and their head in between
    `_begin` and `_end`, and finish `forward` with `_output`."""

    def _begin(
        self,
        config,
        mesh: Mesh,
        layers: Sequence[int] | None,
        pre_process: bool,
        post_process: bool,
        tracker,
    ) -> range | Sequence[int]:
        config.validate(mesh.layout)
        self.config, self.mesh = config, mesh
        self.tracker = tracker or NullTracker()
        self.pre_process, self.post_process = pre_process, post_process
        self.recompute = "none"
        self.loss_chunk_tokens = LOSS_CHUNK_TOKENS
        self.loss_grads_in_forward = True
        """At tp 1, whether the chunked loss makes its gradients in the forward (the logits
        computed once; the head's fp32 weight gradient held from the loss's forward to its
        backward). The pipeline executor turns it off for a step whose schedule holds several
        losses in flight at once (GPipe): there the backward recomputes the logits instead."""
        self.documents = DocumentSettings()
        """How packed documents are read (`megapar.models.documents.set_documents`): causal
        attention over the whole sequence and positions from 0 by default."""
        self.loss_weight: torch.Tensor | float | None = None
        """None: the loss is the micro-batch's mean over its labelled tokens; else (set by the
        pipeline executor for one step, ``--loss-mean token``) their sum times this weight."""
        self.label_smoothing = 0.0
        """Label smoothing of the training loss (torch's; `set_loss_terms`)."""
        self.z_loss = 0.0
        """Coefficient of the output z-loss of the training loss (`set_loss_terms`)."""
        self.loss_fn: Callable[[torch.Tensor, dict], torch.Tensor] | None = None
        """The Python API's loss hook (`set_loss_fn`): the micro-batch's loss from its per-token
        losses and the micro-batch; None: their mean over the labelled tokens."""
        self.last_z_loss: torch.Tensor | None = None
        """The last training forward's z-loss term (z_loss x the mean squared log-sum-exp,
        reduced as the loss is; detached), for the pipeline executor to report; None when
        there is none."""
        return range(config.num_layers) if layers is None else layers

    def _build_layers(self, layers, make_block: Callable[[], nn.Module]) -> nn.ModuleDict:
        return nn.ModuleDict({str(i): make_block() for i in layers})

    def tied_copy(self) -> nn.Parameter:
        """The last stage's copy of the word embedding (when it does not hold the embedding)."""
        c = self.config
        local = local_size(c.vocab_size, self.mesh.tp, c.make_vocab_size_divisible_by)
        param = set_partition(
            nn.Parameter(torch.empty(local, c.hidden_size, device=self.mesh.device)),
            0,
            (c.vocab_size, c.hidden_size),
        )
        param.tied_to = WORD_EMBEDDING  # type: ignore[attr-defined]  # a tag torch does not declare
        return param

    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from `seed`; each model defines it."""
        raise NotImplementedError

    def _end(self) -> None:
        if self.pre_process or self.post_process:
            # a tag torch does not declare
            self.word_embeddings.shared_embedding = True  # type: ignore[attr-defined]
        mark_replicated(self)
        self._mark_sequence_parallel()

    def _mark_sequence_parallel(self) -> None:
        """Under SP every replicated parameter sees a sequence slice (position and token-type
        embeddings too: the word embedding reduce-scatters its output): mark them (their
        gradients are summed over tp)."""
        if self.mesh.sequence_parallel and self.mesh.tp > 1:
            mark_sequence_parallel(self.parameters())

    @property
    def _sp_group(self):
        """The group the sequence is split over (None without sequence parallelism)."""
        return self.mesh.tp_group if self.mesh.sequence_parallel else None

    def _positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Global position ids of this rank's tokens: its cp tokens, or its slice of them
        under SP."""
        positions = cp.positions(ids.shape[1], self.mesh.cp, self.mesh.cp_rank, ids.device)
        return split_sequence(positions[None], self._sp_group)[0]

    def _cp_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """This cp rank's tokens of per-token ids [b, s] (all of them at cp 1)."""
        return cp.split(ids, self.mesh.cp, self.mesh.cp_rank)

    def _local_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's slice of per-token ids [b, s]: its cp tokens, split again under SP."""
        return split_sequence(self._cp_tokens(ids), self._sp_group)

    @property
    def word_embeddings(self) -> nn.Parameter:
        owner = self.get_submodule("embed.word" if self.pre_process else "head")
        return cast(nn.Parameter, owner.weight)

    @property
    def vocab_start(self) -> int:
        return self.mesh.tp_rank * self.word_embeddings.shape[0]

    def _head(
        self, x: torch.Tensor, weight: torch.Tensor, batch: dict, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The LM head on the final hidden states `x`: the loss over labelled tokens
        (`_reduce_loss`), computed `loss_chunk_tokens` tokens at a time (`linear_cross_entropy`:
        the whole logits never exist; 0: at once, through the logits), or the logits slice
        when the batch has no labels."""
        if "labels" not in batch or not self.loss_chunk_tokens:
            return self._output(parallel_lm_logits(x, weight, self.mesh, bias), batch)
        labels = self._cp_tokens(batch["labels"])
        eps, z_coef = self._loss_terms()
        total, lse2 = linear_cross_entropy_terms(
            lm_head_input(x, self.mesh),
            weight,
            labels,
            bias,
            self.mesh.tp_group,
            self.vocab_start,
            self.config.vocab_size,
            chunk_tokens=self.loss_chunk_tokens,
            # the sum, a scalar: at tp 1 its gradients are made in the forward (a loss hook
            # takes the per-token losses)
            reduction="sum" if self.loss_grads_in_forward and self.loss_fn is None else "none",
            label_smoothing=eps,
            z_loss=z_coef,
        )
        return self._reduce_loss(total, labels, lse2, batch)

    def _loss_terms(self) -> tuple[float, float]:
        """(label smoothing, z-loss coefficient) of this forward's loss: the training ones in
        training, none in evaluation (its loss is the plain cross-entropy)."""
        return (self.label_smoothing, self.z_loss) if self.training else (0.0, 0.0)

    def _reduce_loss(
        self,
        per_token: torch.Tensor,
        labels: torch.Tensor,
        lse2: torch.Tensor | None = None,
        batch: dict | None = None,
    ) -> torch.Tensor:
        """The micro-batch's loss from its per-token losses (or their sum): their mean over
        the labelled tokens, or with `loss_weight` set their sum times it (summed over the cp
        group either way), or what `loss_fn` makes of them and the micro-batch `batch`.
        `lse2`: the tokens' squared log-sum-exp (or its sum) under a z-loss, reduced the same
        way (in the same all-reduce over cp) into `last_z_loss`."""
        self.last_z_loss = None
        if self.loss_fn is not None and batch is not None:
            return self._hooked_loss(per_token, batch)
        if lse2 is None:
            if self.loss_weight is None:
                return masked_mean(per_token, labels, group=self.mesh.cp_group)
            return weighted_sum(per_token, self.loss_weight, group=self.mesh.cp_group)
        if self.loss_weight is None:
            loss, z = masked_means(per_token, lse2, labels, group=self.mesh.cp_group)
        else:
            loss, z = weighted_sums(per_token, lse2, self.loss_weight, group=self.mesh.cp_group)
        self.last_z_loss = z * self.z_loss
        return loss

    def _hooked_loss(self, per_token: torch.Tensor, batch: dict) -> torch.Tensor:
        """`loss_fn(per_token, batch)`, checked to be a 0-dim floating tensor."""
        assert self.loss_fn is not None
        loss = self.loss_fn(per_token, batch)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            shown = (
                f"a {str(loss.dtype).removeprefix('torch.')} tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else f"a {type(loss).__name__}"
            )
            raise TypeError(
                f"megapar.prepare's loss_fn returned {shown}, not a 0-dim floating tensor: "
                f"return the micro-batch's loss, e.g. (per_token * w).sum() / w.sum()"
            )
        return loss

    def _output(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """The loss over labelled tokens (`_reduce_loss`), or the logits slice when there are no
        labels."""
        if "labels" not in batch:
            return logits
        labels = self._cp_tokens(batch["labels"])
        eps, z_coef = self._loss_terms()
        per_token, lse2 = cross_entropy_terms(
            logits,
            labels,
            self.mesh.tp_group,
            self.vocab_start,
            self.config.vocab_size,
            label_smoothing=eps,
            z_loss=z_coef,
        )
        return self._reduce_loss(per_token, labels, lse2, batch)


def set_loss_chunk_tokens(model: nn.Module, tokens: int) -> None:
    """Tokens per chunk of the fused head and loss of every stage model in `model` (0: the
    whole logits at once; `StageModel._head`)."""
    if tokens < 0:
        raise ValueError(f"loss chunk tokens must be >= 0 (0: whole), got {tokens}")
    for module in model.modules():
        if isinstance(module, StageModel):
            module.loss_chunk_tokens = tokens


def set_loss_terms(model: nn.Module, label_smoothing: float = 0.0, z_loss: float = 0.0) -> None:
    """The training loss's label smoothing (torch's, in [0, 1)) and output z-loss coefficient
    (>= 0) on every stage model in `model`; evaluation forwards use neither."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"the z-loss coefficient must be >= 0, got {z_loss}")
    for module in model.modules():
        if isinstance(module, StageModel):
            module.label_smoothing, module.z_loss = float(label_smoothing), float(z_loss)


def set_loss_fn(model: nn.Module, loss_fn: Callable[[torch.Tensor, dict], torch.Tensor] | None):
    """The loss hook of every stage model in `model` (None: the default mean): called on the
    last stage with each micro-batch's per-token losses ([b, s] fp32, 0 where the label is
    -100; the vocab-parallel loss, the same on every tp rank) and the micro-batch, it returns
    that micro-batch's loss (`megapar.prepare(..., loss_fn=)`)."""
    for module in model.modules():
        if isinstance(module, StageModel):
            module.loss_fn = loss_fn


class ModelChunks(nn.Module):
    """Several model chunks (virtual pipeline stages) held by one rank, e.g. for interleaved 1F1B.

    `chunks[i]` is an ordinary stage model (any `StageModel`: its own layer slice, the embedding
    if it is the model's first slice, the head if it is the last). Parameter and buffer names
    are the *canonical* ones (the chunks' own, without a "chunks.i." prefix; blocks are named by
    global index, so they never collide), so optimizers, checkpoints and conversion see the same
    names as in any other layout. `forward(hidden, batch, chunk=0)` runs one chunk.
    """

    def __init__(self, chunks: Sequence[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        first = self.chunks[0]
        self.config, self.mesh, self.tracker = first.config, first.mesh, first.tracker
        names = [n for c in self.chunks for n, _ in c.named_parameters()]
        if len(names) != len(set(names)):
            raise ValueError(
                "model chunks share parameter names; each chunk must hold different blocks"
            )

    @property
    def pre_process(self) -> bool:
        return any(c.pre_process for c in self.chunks)

    @property
    def post_process(self) -> bool:
        return any(c.post_process for c in self.chunks)

    @property
    def recompute(self) -> str:
        return cast(str, self.chunks[0].recompute)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk in self.chunks:  # canonical names, as the parameters'
            yield from chunk.named_buffers(prefix, recurse, remove_duplicate)

    def init_weights(self, seed: int) -> None:
        for chunk in self.chunks:
            cast(StageModel, chunk).init_weights(seed)

    def forward(self, hidden, batch: dict, chunk: int = 0):
        return self.chunks[chunk](hidden, batch)
