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


def document_notes(
    cfg,
    data_eod: int,
    parts: list[tuple[str, int, int]],
    data_name: str,
    records: bool = False,
) -> list[str]:
    """Start-up notes for a run that reads documents (`reads_documents`) where its settings
    likely do not do what the user meant: an --eod-id other than the end-of-document token of
    the data's tokenizer (`data_eod`, which ends each of its documents; a blend's parts share
    one), or documents so long (10 x --seq-len or more on average) that few sequences hold a
    document boundary and the flags change little (a text file tokenized whole as one
    document), said of each of `parts` ((name, documents, tokens): --data, or each part of a
    blend) that holds such; or `records`, fine-tuning records (--sft-keys), each one
    right-padded sample: no sequence holds two documents, and the flags change nothing.
    `data_name` names --data as a whole."""
    flags = ", ".join(
        flag
        for flag, on in (
            ("--attention-mask-type block_causal", cfg.attention_mask_type == "block_causal"),
            ("--reset-position-ids", cfg.reset_position_ids),
            ("--eod-mask-loss", cfg.eod_mask_loss),
        )
        if on
    )
    notes = []
    if cfg.eod_id is not None and cfg.eod_id != data_eod:
        notes.append(
            f"--eod-id {cfg.eod_id} is not the end-of-document token of {data_name}'s tokenizer "
            f"({data_eod}, which ends each of its documents): {flags} take token {cfg.eod_id} "
            f"as a document's end instead; drop --eod-id unless that token is meant"
        )
    verb = "change" if ", " in flags else "changes"
    if records:
        notes.append(
            f"{data_name} holds fine-tuning records (--sft-keys), one right-padded sample "
            f"each: no sequence holds two documents, so {flags} {verb} nothing (drop "
            f"{'them' if verb == 'change' else 'it'})"
        )
        return notes
    for name, num_docs, num_tokens in parts:
        if num_docs and num_tokens >= 10 * cfg.seq_len * num_docs:
            notes.append(
                f"{name} holds "
                + (
                    f"1 document of {num_tokens:,} tokens"
                    if num_docs == 1
                    else f"{num_docs:,} documents of {num_tokens // num_docs:,} tokens on average"
                )
                + f", at least 10 x --seq-len "
                f"{cfg.seq_len}: few sequences hold two documents, so {flags} "
                f"{verb} little (a "
                f"text tokenized whole is one document: megapar-data --split-lines, or a .jsonl "
                f"of one record per document, keeps them apart)"
            )
    return notes
