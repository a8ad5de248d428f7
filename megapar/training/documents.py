"""megapar-train's and `megapar.prepare`'s packed-document settings
(`megapar.models.documents`): whether a run reads documents, and the labels of its batches."""

from __future__ import annotations

from megapar.models.documents import mask_eod_labels


def reads_documents(cfg) -> bool:
    """Whether the run's settings read the documents packed into its sequences (and so need
    the end-of-document id)."""
    return cfg.attention_mask_type == "block_causal" or cfg.reset_position_ids or cfg.eod_mask_loss


def eod_masked(cfg, batch: dict) -> dict:
    """`batch` with --eod-mask-loss applied (labels -100 where the input is the eod token), or
    as it is without it (or without labels)."""
    if not cfg.eod_mask_loss or "labels" not in batch:
        return batch
    assert cfg.eod_id is not None  # `check_documents` / `plan_data` set or refuse it
    return mask_eod_labels(batch, cfg.eod_id)
