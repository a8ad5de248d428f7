"""The tests' view of a stage's parameters: full tensors by canonical name, gathered over tp."""

import torch

from megapar.tensor_parallel.partition import gather_full


@torch.no_grad()
def gather_canonical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of this stage's parameters, gathered over the tp group (collective)."""
    out = {}
    for name, param in model.named_parameters():
        if hasattr(param, "tied_to"):
            continue
        out[name] = gather_full(param.detach(), getattr(param, "tp_dim", None),
                                getattr(param, "full_shape", tuple(param.shape)),
                                model.mesh.tp_group).cpu()
    return out
