"""BERT for masked-LM (numerically the same model as transformers' BertForMaskedLM).

Post-LN encoder layers built from tp layers; token types; a padding attention mask; the MLM
head (dense + GELU + LayerNorm transform, then the decoder tied to the word embedding, plus a
vocab-parallel bias). Like GPT2, one class is the whole model or any pipeline stage of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megapar.mesh import Mesh
from megapar.models.blocks import (
    ParallelAttention,
    ParallelMLP,
    ResidualDropout,
    activation,
    embedding,
    layer_norm,
    run_layers,
)
from megapar.models.config import BertConfig
from megapar.models.stage import StageModel
from megapar.tensor_parallel import (
    VocabParallelEmbedding,
    initialize,
    normal_init,
    parallel_lm_logits,
)
from megapar.tensor_parallel.partition import local_size, set_partition


class BertLayer(nn.Module):
    """Post-LN: h = norm(x + attn(x)); out = norm(h + mlp(h))."""

    def __init__(self, config: BertConfig, mesh: Mesh, tracker):
        super().__init__()
        eps, d = config.layer_norm_eps, mesh.device
        self.attn = ParallelAttention(
            config.hidden_size,
            config.num_attention_heads,
            mesh,
            tracker,
            config.attention_probs_dropout_prob,
            causal=False,
        )
        self.attn_norm = layer_norm(config.hidden_size, eps, d)
        self.mlp = ParallelMLP(
            config.hidden_size, config.intermediate_size, mesh, config.hidden_act
        )
        self.mlp_norm = layer_norm(config.hidden_size, eps, d)
        self.dropout = ResidualDropout(config.hidden_dropout_prob, mesh, tracker)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        x = self.attn_norm(x + self.dropout(self.attn(x, mask)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class BertEmbedding(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout: of this rank's sequence
    slice under SP (`positions` and `token_types` are that slice's)."""

    def __init__(self, config: BertConfig, mesh: Mesh, tracker):
        super().__init__()
        d = mesh.device
        self.word = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, mesh, config.make_vocab_size_divisible_by
        )
        self.position = embedding(config.max_position_embeddings, config.hidden_size, d)
        self.token_type = embedding(config.type_vocab_size, config.hidden_size, d)
        self.norm = layer_norm(config.hidden_size, config.layer_norm_eps, d)
        self.dropout = ResidualDropout(config.hidden_dropout_prob, mesh, tracker)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor
    ) -> torch.Tensor:
        x = self.word(ids) + self.position(positions) + self.token_type(token_types)
        return self.dropout(self.norm(x))


class BertMLMHead(nn.Module):
    """transform (dense, GELU, LayerNorm), then logits = x E^T + bias with the tied embedding."""

    def __init__(self, config: BertConfig, mesh: Mesh):
        super().__init__()
        h, d = config.hidden_size, mesh.device
        local = local_size(config.vocab_size, mesh.tp, config.make_vocab_size_divisible_by)
        self.transform = nn.Linear(h, h, device=d)
        self.act = activation(config.hidden_act)
        self.norm = layer_norm(h, config.layer_norm_eps, d)
        self.bias = set_partition(
            nn.Parameter(torch.empty(local, device=d)), 0, (config.vocab_size,)
        )

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The transformed hidden states the logits are computed from."""
        return self.norm(self.act(self.transform(x)))

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor, mesh: Mesh):
        return parallel_lm_logits(self.features(x), word_embeddings, mesh, self.bias)


class Bert(StageModel):
    """BERT MLM, or one pipeline stage of it.

    batch: "input_ids" [b, s], optional "token_type_ids" [b, s], optional "attention_mask"
    [b, s] (1 = real token, 0 = padding; needed on every stage), and "labels" [b, s] (-100 where
    no loss). Returns hidden states, or on the last stage the mean MLM loss (or this rank's
    vocab slice of the logits when the batch has no labels).
    """

    def __init__(
        self,
        config: BertConfig,
        mesh: Mesh,
        layers: Sequence[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        tracker=None,
    ):
        super().__init__()
        layers = self._begin(config, mesh, layers, pre_process, post_process, tracker)
        self.embed = BertEmbedding(config, mesh, self.tracker) if pre_process else None
        self.layers = self._build_layers(layers, lambda: BertLayer(config, mesh, self.tracker))
        self.head = BertMLMHead(config, mesh) if post_process else None
        if post_process and not pre_process:
            assert self.head is not None  # built where post_process
            self.head.weight = self.tied_copy()
        self._end()

    def init_weights(self, seed: int) -> None:
        """Layout-independent init, as transformers initialises BertForMaskedLM: biases zero, norm
        weights one, the rest N(0, initializer_range)."""
        initialize(self, seed, normal_init(self.config.initializer_range), self.mesh.tp_rank)

    def forward(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        if self.pre_process:
            ids, types = batch["input_ids"], batch.get("token_type_ids")
            types = self._local_tokens(torch.zeros_like(ids) if types is None else types)
            assert self.embed is not None  # built where pre_process
            hidden = self.embed(self._cp_tokens(ids), self._positions(ids), types)
        assert hidden is not None  # later stages: the previous stage's output
        mask = batch.get("attention_mask")  # of the whole sequence (cp: every rank's keys)
        if mask is not None:
            mask = mask.bool()
        hidden = run_layers(self.layers, hidden, mask, self.recompute, self.tracker)
        if not self.post_process:
            return hidden
        assert self.head is not None  # built where post_process
        return self._head(self.head.features(hidden), self.word_embeddings, batch, self.head.bias)
