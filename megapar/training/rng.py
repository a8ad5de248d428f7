"""A rank's RNG state as a checkpoint keeps it: torch's CPU and CUDA generators and the stage's
tensor-parallel stream (`tensor_parallel.random`)."""

from __future__ import annotations

import torch


def rng_state(model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG state: "cpu", "cuda" (on a GPU) and "tp" (the model's tp stream)."""
    out = default_rng_state(device)
    tp_state = getattr(getattr(model, "tracker", None), "tp_state", None)
    if tp_state is not None:
        out["tp"] = tp_state
    return out


def set_rng_state(
    model: torch.nn.Module, device: torch.device, rng: dict[str, torch.Tensor]
) -> None:
    """Restore what `rng_state` returned (a part the checkpoint lacks is left as it is)."""
    set_default_rng_state(rng, device)
    tracker = getattr(model, "tracker", None)
    if "tp" in rng and tracker is not None:
        tracker.tp_state = rng["tp"]


def default_rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's default generators' state: the CPU's, and on a GPU the device's."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_default_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what `default_rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
