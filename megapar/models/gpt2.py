"""GPT-2 (numerically the same model as transformers' GPT2LMHeadModel), built from tp layers.

One class serves the whole model and any pipeline stage of it (see `stage.py`): the embedding
on the first stage, blocks by global index, the final norm + LM head (tied to the word
embedding; `head.weight` is the last stage's tied copy) on the last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from megapar.mesh import Mesh
from megapar.models.blocks import (
    ParallelAttention,
    ParallelMLP,
    ResidualDropout,
    embedding,
    layer_norm,
    run_layers,
)
from megapar.models.config import GPT2Config
from megapar.models.documents import document_positions, stage_documents
from megapar.models.stage import StageModel
from megapar.tensor_parallel import (
    VocabParallelEmbedding,
    initialize,
)


class GPT2Block(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x)), dropout before each residual add."""

    def __init__(self, config: GPT2Config, mesh: Mesh, tracker):
        super().__init__()
        d = mesh.device
        self.ln_1 = layer_norm(config.n_embd, config.layer_norm_epsilon, d)
        self.attn = ParallelAttention(
            config.n_embd, config.n_head, mesh, tracker, config.attn_pdrop, causal=True
        )
        self.ln_2 = layer_norm(config.n_embd, config.layer_norm_epsilon, d)
        self.mlp = ParallelMLP(config.n_embd, config.ffn_size, mesh, config.activation_function)
        self.dropout = ResidualDropout(config.resid_pdrop, mesh, tracker)

    def forward(self, x: torch.Tensor, mask=None, docs=None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x), mask, docs))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT2Embedding(nn.Module):
    """Word + position embeddings, then dropout: of this rank's sequence slice under SP."""

    def __init__(self, config: GPT2Config, mesh: Mesh, tracker):
        super().__init__()
        self.word = VocabParallelEmbedding(
            config.vocab_size, config.n_embd, mesh, config.make_vocab_size_divisible_by
        )
        self.position = embedding(config.n_positions, config.n_embd, mesh.device)
        self.dropout = ResidualDropout(config.embd_pdrop, mesh, tracker)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.word(ids) + self.position(positions))


class GPT2(StageModel):
    """GPT-2 LM, or one pipeline stage of it.

    forward(hidden, batch): `hidden` is the previous stage's output (None on the first stage);
    `batch` holds "input_ids" [b, s] and, for a loss, "labels" [b, s] (next-token ids, -100 to
    ignore) and, generating with a KV cache (`megapar.models.kv_cache`), "positions_from": the
    position of input_ids' first (the ids after the cached ones): an int, or [b, 1] per row of
    a left-padded batch (negative at its padding). Packed documents (`set_documents`): the
    attention kept within each and positions restarting at each, as the model's `documents`
    says. Returns the hidden states,
    or on the last stage the mean loss over labelled tokens (or this rank's vocab slice of the
    logits when the batch has no labels).
    """

    def __init__(
        self,
        config: GPT2Config,
        mesh: Mesh,
        layers: Sequence[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        tracker=None,
    ):
        super().__init__()
        layers = self._begin(config, mesh, layers, pre_process, post_process, tracker)
        self.embed: GPT2Embedding | None = (
            GPT2Embedding(config, mesh, self.tracker) if pre_process else None
        )
        self.layers = self._build_layers(layers, lambda: GPT2Block(config, mesh, self.tracker))
        if post_process:
            self.final_norm = layer_norm(config.n_embd, config.layer_norm_epsilon, mesh.device)
            if not pre_process:
                self.head = nn.Module()
                self.head.weight = self.tied_copy()
        self._end()

    def init_weights(self, seed: int) -> None:
        """Layout-independent init, as transformers initialises GPT2LMHeadModel."""
        std = self.config.initializer_range
        proj_std = std / math.sqrt(2 * self.config.n_layer)

        def init(name, shape, gen):
            if name.endswith("bias"):
                return torch.zeros(shape)
            if ".ln_" in name or name.startswith("final_norm"):
                return torch.ones(shape)
            s = proj_std if name.endswith("proj.weight") else std
            return torch.empty(shape).normal_(0.0, s, generator=gen)

        initialize(self, seed, init, self.mesh.tp_rank)

    def forward(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        if self.pre_process:
            assert self.embed is not None  # built where pre_process
            ids = batch["input_ids"]
            positions = self._positions(ids)
            if "positions_from" in batch:  # generation with a KV cache: the new positions
                # (per row [b, 1] in a left-padded batch: its pad slots at 0)
                positions = (positions + batch["positions_from"]).clamp_min(0)
            elif self.documents.reset_position_ids:  # each token's position in its document
                assert self.documents.eod_id is not None  # `set_documents` checks
                positions = self._local_tokens(document_positions(ids, self.documents.eod_id))
            hidden = self.embed(self._cp_tokens(ids), positions)
        assert hidden is not None  # later stages: the previous stage's output
        docs = stage_documents(self, batch)  # block_causal's document ids, else None
        docs = docs if docs is not None and docs.ids is not None else None
        hidden = run_layers(self.layers, hidden, None, self.recompute, self.tracker, docs)
        if not self.post_process:
            return hidden
        return self._head(self.final_norm(hidden), self.word_embeddings, batch)
