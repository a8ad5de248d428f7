"""RNG states for dropout under tensor parallelism.

Two streams: the *default* stream (torch's global RNG) is seeded the same on every tp rank, so
dropout on replicated activations (after a row-parallel layer) draws the same mask everywhere;
the *tp* stream is seeded differently per tp rank and used, through `tracker.fork()`, for
dropout on sharded activations (attention probabilities of this rank's heads).
Both are offset per context-parallel rank too (each holds other tokens of the sequences).
`checkpoint` wraps torch.utils.checkpoint so a recomputed forward replays both streams exactly.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint as torch_checkpoint

from megapar.mesh import Mesh

_TP_OFFSET = 2718
_CP_OFFSET = 1_000_003


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Owns the tp dropout stream and seeds the default one (seed depends on the pp stage and
    the cp rank)."""

    def __init__(self, seed: int, mesh: Mesh):
        self.device = mesh.device
        default_seed = seed + 100 * mesh.pp_rank + _CP_OFFSET * getattr(mesh, "cp_rank", 0)
        torch.manual_seed(default_seed)
        saved = _get_state(self.device)
        torch.manual_seed(default_seed + _TP_OFFSET + mesh.tp_rank)
        self.tp_state = _get_state(self.device)
        _set_state(saved, self.device)
        torch.manual_seed(default_seed)

    @contextlib.contextmanager
    def fork(self):
        """Run the block on the tp stream, then return to the default stream."""
        saved = _get_state(self.device)
        _set_state(self.tp_state, self.device)
        try:
            yield
        finally:
            self.tp_state = _get_state(self.device)
            _set_state(saved, self.device)

    def checkpoint(self, fn, *args):
        """torch.utils.checkpoint(fn, *args) that also replays the tp stream on recompute."""
        snapshot = self.tp_state
        calls = [0]

        def run(*inner):
            calls[0] += 1
            if calls[0] == 1:  # the real forward: the tp stream advances as usual
                return fn(*inner)
            current, self.tp_state = self.tp_state, snapshot
            try:
                return fn(*inner)
            finally:
                self.tp_state = current

        return torch_checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


class NullTracker:
    """A tracker for modules built without one (e.g. reference models): no stream switching."""

    device = torch.device("cpu")

    @contextlib.contextmanager
    def fork(self):
        yield

    def checkpoint(self, fn, *args):
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
