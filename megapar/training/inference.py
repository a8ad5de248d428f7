"""A checkpoint's model for inference at any tp x cp x pp: loaded (resharded on load) and run
forward once over given ids, its logits gathered over tp (and cp) on the last stage.

megapar-eval's `--input-ids` and BERT loss, and megapar-generate, run the model this way: the
pipeline's stages pass the hidden states of their cp rank's tokens on with send / recv (no
schedule: one forward of one batch), and the last stage gathers the vocab-parallel logits over
its tp group and, under context parallelism, the cp ranks' tokens (`context_parallel.unsplit`).
Parameters are replicated over cp, so a checkpoint loads at any cp.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.context_parallel import unsplit
from megapar.host_memory import keep_freed_host_memory
from megapar.mesh import Mesh
from megapar.models.config import ModelConfig, config_from_dict
from megapar.models.documents import set_documents
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import gather_full
from megapar.training.validate_resume import load_everywhere


class LoadedModel(NamedTuple):
    """A checkpoint's model as `load_model` loads it for inference."""

    mesh: Mesh
    config: ModelConfig
    """The model config (`config_from_dict` of the manifest's)."""
    model: torch.nn.Module
    """This rank's stage model, in eval mode."""
    documents: dict
    """The packed-document settings it applies (`trained_documents`; {}: none, or not asked)."""


def load_model(
    load: str,
    tp: int,
    pp: int,
    cp: int = 1,
    dtype: torch.dtype | None = None,
    documents: bool = False,
    verify: str = "sha256",
) -> LoadedModel:
    """(mesh, config, this rank's stage model, its document settings) of checkpoint `load` at
    tp x cp x pp (resharded on load), in eval mode; its parameters cast to `dtype` once loaded
    (None: as saved); with `documents`, attending and placing positions within the packed
    documents as the checkpoint trained (`trained_documents`, returned so its manifest is read
    once; megapar-eval's forwards of whole sequences, not a KV cache's). `verify`: how this
    rank checks the files it reads (`load_checkpoint`: "sha256", or "size" where the start-up
    hashed every file); a file that fails it is refused in one line naming the rank, the file
    and the fix, and under torchrun / Slurm every other rank with it (`load_everywhere`)."""
    mesh = Mesh.from_env(tp, pp, 1, cp=cp)
    manifest = read_manifest(resolve_checkpoint(load))
    config = config_from_dict(manifest["model"])
    model = build_stage(config, mesh, seed=0, init=False)
    trained = trained_documents(manifest) if documents else {}
    if trained:
        set_documents(
            model, trained["attention_mask_type"], trained["reset_position_ids"], trained["eod_id"]
        )
    load_everywhere(load, lambda: load_checkpoint(load, model, mesh, verify=verify), mesh.device)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    keep_freed_host_memory()  # the weights are in place: later tensors are kept
    return LoadedModel(mesh, config, model, trained)


def trained_documents(manifest: dict) -> dict:
    """The packed-document settings a checkpoint's run trained with (its manifest's saved
    train_config: attention_mask_type, reset_position_ids, eod_mask_loss, eod_id), or {} where
    it attended causally across its sequences with positions from 0 and every label counted."""
    saved = (manifest.get("meta") or {}).get("train_config") or {}
    got = {
        "attention_mask_type": saved.get("attention_mask_type") or "causal",
        "reset_position_ids": bool(saved.get("reset_position_ids")),
        "eod_mask_loss": bool(saved.get("eod_mask_loss")),
        "eod_id": saved.get("eod_id"),
    }
    reads = got["attention_mask_type"] != "causal" or got["reset_position_ids"]
    return got if (reads or got["eod_mask_loss"]) and got["eod_id"] is not None else {}


@torch.no_grad()
def forward_logits(
    model,
    mesh: Mesh,
    inputs: torch.Tensor | dict,
    hidden_size: int,
    vocab_size: int,
    last_only: bool = False,
    cp_gather: bool = True,
):
    """The logits of `inputs` (ids [batch, seq] on the mesh's device, or a batch dict of them:
    "input_ids" and BERT's optional "attention_mask" / "token_type_ids", without "labels"),
    [batch, seq, vocab] in the model's dtype (with `last_only`, the last position's:
    [batch, 1, vocab], the only vocab slice gathered at cp 1), on the last stage's ranks; None
    on the others. A pipeline stage receives the previous stage's hidden states of its cp
    rank's tokens and sends its own on; collective over tp, and over cp unless `cp_gather` is
    False (then the last stage's logits are this cp rank's tokens', in `context_parallel.split`
    order)."""
    batch = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
    ids = batch["input_ids"]
    shape = (ids.shape[0], ids.shape[1] // mesh.cp, hidden_size)
    hidden = None
    if not mesh.is_first_stage:  # in the stage's dtype (its first parameter's)
        dtype = next(iter(model.parameters()), torch.empty(0)).dtype
        hidden = torch.empty(shape, device=mesh.device, dtype=dtype)
        dist.recv(hidden, src=mesh.prev_stage_rank)
    out = model(hidden, batch)
    if not mesh.is_last_stage:
        dist.send(out.contiguous(), dst=mesh.next_stage_rank)
        return None
    gather_cp = cp_gather and mesh.cp > 1
    if last_only and not gather_cp:
        out = out[:, -1:].contiguous()
    logits = gather_full(out, 2, (out.shape[0], out.shape[1], vocab_size), mesh.tp_group)
    if gather_cp:
        parts = [torch.empty_like(logits) for _ in range(mesh.cp)]
        dist.all_gather(parts, logits.contiguous(), group=mesh.cp_group)
        logits = unsplit(parts)
        if last_only:
            logits = logits[:, -1:].contiguous()
    return logits


def trained_documents_note(trained: dict) -> str | None:
    """One line naming the packed-document settings `trained` (`trained_documents`) that an
    evaluation applies as the run trained, or None where there are none."""
    if not trained:
        return None
    flags = [
        flag
        for flag, on in (
            ("--attention-mask-type block_causal", trained["attention_mask_type"] != "causal"),
            ("--reset-position-ids", trained["reset_position_ids"]),
            ("--eod-mask-loss", trained["eod_mask_loss"]),
        )
        if on
    ]
    return (
        f"evaluates as the checkpoint's run trained: {', '.join(flags)} (end-of-document id "
        f"{trained['eod_id']})"
    )
