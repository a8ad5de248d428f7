"""Helpers shared by the parallel tests."""

import os

import torch
import torch.distributed as dist

from megapar.mesh import Layout, Mesh


def make_mesh(tp=1, pp=1, dp=1) -> Mesh:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Mesh(Layout(tp, pp, dp), rank)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


# Some gradients are exactly zero in exact arithmetic (e.g. the attention key bias: adding a
# constant to every score of a query leaves softmax unchanged), so both sides are rounding noise
# and a relative error means nothing. Below this magnitude the reference counts as zero.
ZERO_FLOOR = 1e-7


def assert_close(a, b, tol=1e-5, what=""):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if b.detach().abs().max().item() < ZERO_FLOOR:
        diff = (a.detach().double() - b.detach().double()).abs().max().item()
        assert diff < ZERO_FLOOR, f"{what}: reference is zero, got max |diff| {diff:.3g}"
        return
    err = rel_err(a, b)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def world(n):
    return int(os.environ.get("WORLD_SIZE", "1")) == n
