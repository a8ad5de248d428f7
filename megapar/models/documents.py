"""Packed documents: attention kept within each document (``block_causal``), positions that
restart at each document, and no loss on the end-of-document token's position.

A packed sequence holds several documents, each ended by the tokenizer's end-of-document token
(`eod`). As Megatron-LM's ``_get_ltor_masks_and_position_ids`` (``--reset-attention-mask``,
``--reset-position-ids``, ``--eod-mask-loss``) the eod token belongs to the document it ends:
the tokens after it neither attend to it nor to anything before it, their positions start at 0
again, and (`mask_eod_labels`) the position whose input is the eod (whose label is the next
document's first token) gets no loss. torchtitan's ``attn_mask_type = "block_causal"`` (document
masking through FlexAttention) and Llama 3's pretraining mask the same way.

Everything is made on the device from the micro-batch's input_ids with tensor operations (a
cumulative sum, a cumulative maximum, comparisons): no host synchronisation, no host data
copied to the device. A stage makes a micro-batch's mask once per sliding window its layers use
(the first layer to ask makes it) and every layer's attention shares it, as `WindowMasks` shares
a window's mask; every pipeline stage reads the whole micro-batch (its input_ids included), so
each makes its own. Under context parallelism the all-to-all takes the same mask; the ring and
the all-gather mask each kernel call from the document ids (`megapar.context_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megapar.graph_break import graph_break

MASK_TYPES = ("causal", "block_causal")
"""--attention-mask-type: causal over the whole packed sequence (the default), or causal within
each document (torchtitan's name)."""


@dataclass
class DocumentSettings:
    """How a model treats the documents of its packed sequences (`set_documents`)."""

    mask_type: str = "causal"
    reset_position_ids: bool = False
    eod_id: int | None = None

    @property
    def active(self) -> bool:
        """Whether the model reads documents at all (causal without reset positions: no)."""
        return self.mask_type == "block_causal" or self.reset_position_ids


@dataclass
class Documents:
    """One micro-batch's documents as a stage's layers read them: `ids` the document of each
    token of the whole sequence ([b, s], `document_ids`; None: causal attention across them),
    from which `bias` makes each sliding window's mask once (the first layer to ask makes it,
    the others share it); `cos` / `sin` the rotary tables of this rank's tokens at their
    positions in their documents ([b, 1, s_cp, head_dim]; Llama with reset positions, else
    None)."""

    ids: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    biases: dict = field(default_factory=dict, repr=False)

    @graph_break
    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask [b, 1, s, s] of the whole sequence for sliding `window` (None:
        none) in `dtype` (`block_causal_bias`), made on first use (a window of s or more cuts
        nothing: it shares the unwindowed mask); None without `ids`. Eager inside a
        torch.compile'd block (`--compile`): made in a block's forward and found made in its
        recomputation (--recompute full), it was two graphs that saved different tensors,
        which torch.utils.checkpoint refused (a fuzz run's finding); eager, the mask is an
        input of the same graph both times."""
        if self.ids is None:
            return None
        if window is not None and window >= self.ids.shape[1]:
            window = None
        key = (window, dtype)
        if key not in self.biases:
            self.biases[key] = block_causal_bias(self.ids, window, dtype)
        return self.biases[key]


def document_ids(ids: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: each token's document within its row (0, 1, ...); an eod token belongs
    to the document it ends."""
    ends = ids == eod
    return ends.long().cumsum(1) - ends.long()


def document_positions(ids: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: each token's position within its document (0 at a row's first token and
    after each eod)."""
    s = ids.shape[1]
    t = torch.arange(s, device=ids.device).expand_as(ids)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, :-1] == eod
    starts[:, 0] = True
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(1).values
    return t - first


def block_causal_bias(docs: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[b, 1, s, s] additive mask from `document_ids` [b, s]: the query at i sees the key at j
    where j <= i, both are in one document and (a sliding window) j > i - window; 0 there,
    -inf elsewhere (a token always sees itself, so no row is all -inf)."""
    s = docs.shape[1]
    t = torch.arange(s, device=docs.device)
    keep = (docs[:, :, None] == docs[:, None, :]) & (t[None, :, None] >= t[None, None, :])
    if window is not None and window < s:
        keep &= t[None, :, None] - t[None, None, :] < window
    bias = torch.zeros(keep.shape, dtype=dtype, device=docs.device)
    return bias.masked_fill_(~keep, float("-inf"))[:, None]


def stage_documents(stage, batch: dict) -> Documents | None:
    """The `Documents` of a micro-batch for `stage` (a StageModel), or None where its
    settings read no documents (or the batch is a generation step's: no input_ids, or
    positions after a KV cache)."""
    settings = stage.documents
    if not settings.active or "input_ids" not in batch or "positions_from" in batch:
        return None
    docs = Documents()
    if settings.mask_type == "block_causal":
        assert settings.eod_id is not None  # `set_documents` checks
        docs.ids = document_ids(batch["input_ids"], settings.eod_id)
    return docs


def mask_eod_labels(batch: dict, eod: int) -> dict:
    """The batch with label -100 where the input is the eod token (Megatron's --eod-mask-loss:
    the prediction made at the end of a document, of the next document's first token, gets no
    loss); a new dict, the other tensors shared."""
    out = dict(batch)
    out["labels"] = batch["labels"].masked_fill(batch["input_ids"] == eod, -100)
    return out


def set_documents(
    model: torch.nn.Module,
    mask_type: str = "causal",
    reset_position_ids: bool = False,
    eod_id: int | None = None,
) -> None:
    """The document treatment of every stage model in `model`: `mask_type` (`MASK_TYPES`) and
    whether positions restart at each document, the documents being ended by `eod_id`."""
    if mask_type not in MASK_TYPES:
        raise ValueError(f"unknown attention mask type {mask_type!r}; expected one of {MASK_TYPES}")
    settings = DocumentSettings(mask_type, bool(reset_position_ids), eod_id)
    if settings.active and eod_id is None:
        raise ValueError(
            "document masking and reset position ids need the end-of-document token's id (eod_id)"
        )
    for module in model.modules():
        if hasattr(module, "documents"):  # a StageModel
            module.documents = settings  # type: ignore[assignment]
