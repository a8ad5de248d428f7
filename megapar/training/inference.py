"""A checkpoint's model for inference at any tp x pp: loaded (resharded on load) and run forward
once over given ids, its logits gathered over tp on the last stage.

megapar-eval's `--input-ids` and megapar-generate run the model this way: the pipeline's stages
pass the hidden states on with send / recv (no schedule: one forward of one batch), and the last
stage gathers the vocab-parallel logits over its tp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.device import keep_freed_host_memory
from megapar.mesh import Mesh
from megapar.models.config import config_from_dict
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import gather_full


def load_model(load: str, tp: int, pp: int):
    """(mesh, config, this rank's stage model) of checkpoint `load` at tp x pp (resharded on
    load), in eval mode."""
    mesh = Mesh.from_env(tp, pp, 1)
    config = config_from_dict(read_manifest(resolve_checkpoint(load))["model"])
    model = build_stage(config, mesh, seed=0, init=False)
    load_checkpoint(load, model, mesh)
    model.eval()
    keep_freed_host_memory()  # the weights are in place: later tensors are kept
    return mesh, config, model


@torch.no_grad()
def forward_logits(
    model, mesh: Mesh, ids: torch.Tensor, hidden_size: int, vocab_size: int, last_only: bool = False
):
    """The logits of `ids` ([batch, seq] on the mesh's device), [batch, seq, vocab] in the
    model's dtype (with `last_only`, the last position's: [batch, 1, vocab], the only vocab
    slice gathered), on the last stage's ranks; None on the others. A pipeline stage receives
    the previous stage's hidden states and sends its own on; collective over tp."""
    shape = (ids.shape[0], ids.shape[1], hidden_size)
    hidden = None
    if not mesh.is_first_stage:
        hidden = torch.empty(shape, device=mesh.device)
        dist.recv(hidden, src=mesh.prev_stage_rank)
    out = model(hidden, {"input_ids": ids})
    if not mesh.is_last_stage:
        dist.send(out.contiguous(), dst=mesh.next_stage_rank)
        return None
    if last_only:
        out = out[:, -1:].contiguous()
    return gather_full(out, 2, (out.shape[0], out.shape[1], vocab_size), mesh.tp_group)
