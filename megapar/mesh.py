"""The 3D device mesh: tensor (fastest) x pipeline x data (outermost) parallelism.

Global rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so the ranks of a tensor-parallel group
are contiguous (they stay inside a node) and data parallelism crosses nodes. That is the default
rank order "tp-pp-dp"; Megatron's "tp-dp-pp" puts pp outermost instead,
rank = (pp_rank * dp + dp_rank) * tp + tp_rank, so the cheap point-to-point pipeline traffic
crosses nodes and the data-parallel gradient reduction stays closer (see `RANK_ORDERS`).

There are no module-level process groups: code that communicates receives a `Mesh`.
A 1x1x1 mesh needs no process group at all (every group is then None and every collective
over it is skipped), which is how serial reference models are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from megapar import device as _device


class LayoutError(ValueError):
    """A parallel layout that cannot work (sizes, world size, model shapes)."""


RANK_ORDERS = ("tp-pp-dp", "tp-dp-pp")
"""How mesh coordinates map to global ranks, fastest-varying dimension first. tp is always
fastest (tensor-parallel groups are contiguous ranks, inside a node)."""


@dataclass(frozen=True)
class Layout:
    """A parallel layout: how many ways each dimension is split."""

    tp: int = 1
    """Tensor-parallel size: ranks that split each layer's weights."""
    pp: int = 1
    """Pipeline-parallel size: number of pipeline stages."""
    dp: int = 1
    """Data-parallel size: model replicas that see different data."""
    order: str = "tp-pp-dp"
    """Rank order (`RANK_ORDERS`): "tp-pp-dp" (dp outermost) or "tp-dp-pp" (pp outermost)."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"--{name} must be an integer >= 1, got {value!r}")
        if self.order not in RANK_ORDERS:
            raise LayoutError(f"--rank-order must be one of {', '.join(RANK_ORDERS)}, "
                              f"got {self.order!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank."""
        if self.order == "tp-dp-pp":
            return rank % self.tp, rank // (self.tp * self.dp), (rank // self.tp) % self.dp
        return rank % self.tp, (rank // self.tp) % self.pp, rank // (self.tp * self.pp)

    def rank(self, tp: int, pp: int, dp: int) -> int:
        """Global rank of mesh coordinates."""
        if self.order == "tp-dp-pp":
            return (pp * self.dp + dp) * self.tp + tp
        return (dp * self.pp + pp) * self.tp + tp

    @property
    def mesh_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """DeviceMesh dimension names and sizes, outermost first (row-major = `rank`)."""
        if self.order == "tp-dp-pp":
            return ("pp", "dp", "tp"), (self.pp, self.dp, self.tp)
        return ("dp", "pp", "tp"), (self.dp, self.pp, self.tp)

    def to_dict(self) -> dict:
        """{"tp", "pp", "dp"} (plus "order" when it is not the default), as manifests store it."""
        out = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        if self.order != RANK_ORDERS[0]:
            out["order"] = self.order
        return out

    def __str__(self) -> str:
        order = "" if self.order == RANK_ORDERS[0] else f" order={self.order}"
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{order}"

    @staticmethod
    def infer(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
              order: str = "tp-pp-dp") -> "Layout":
        """Layout for a world size; dp defaults to world_size / (tp * pp)."""
        if tp < 1 or pp < 1:
            raise LayoutError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")
        if dp is None:
            if world_size % (tp * pp):
                raise LayoutError(
                    f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}; "
                    f"launch a multiple of {tp * pp} processes or change --tp/--pp")
            dp = world_size // (tp * pp)
        layout = Layout(tp, pp, dp, order)
        if layout.world_size != world_size:
            raise LayoutError(
                f"world size {world_size} != tp*pp*dp = {tp}*{pp}*{dp} = {layout.world_size}; "
                f"launch {layout.world_size} processes or change --tp/--pp/--dp")
        return layout


class Mesh:
    """This rank's view of the 3D mesh: its coordinates and its process groups.

    Built collectively (every rank must construct it, in the same order) on top of
    `torch.distributed.device_mesh.DeviceMesh` with dims ("dp", "pp", "tp").
    """

    sequence_parallel: bool = False
    """Megatron sequence parallelism: outside the tp regions activations are split along the
    sequence over the tp group (`tensor_parallel/sequence_parallel.py`). Set it on the mesh
    before building a model; layers read it when they are built."""

    def __init__(self, layout: Layout, rank: int = 0):
        self.layout = layout
        self.rank = rank
        self.tp_rank, self.pp_rank, self.dp_rank = layout.coords(rank)
        self.device = _device.device()
        self.device_mesh = None
        self.tp_group = self.pp_group = self.dp_group = None
        self.mp_group = self.embedding_group = None
        if layout.world_size == 1:
            return
        if not dist.is_initialized():
            raise LayoutError(
                f"a {layout} mesh needs {layout.world_size} processes; torch.distributed is not "
                f"initialised (run under megapar-train / torchrun)")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise LayoutError(
                f"world size {world} != tp*pp*dp = {layout.tp}*{layout.pp}*{layout.dp} = "
                f"{layout.world_size}; launch {layout.world_size} processes or change the layout")
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = layout.mesh_dims
        self.device_mesh = init_device_mesh(self.device.type, sizes, mesh_dim_names=names)
        self.tp_group = self.device_mesh.get_group("tp")
        self.pp_group = self.device_mesh.get_group("pp")
        self.dp_group = self.device_mesh.get_group("dp")
        # Model-parallel (tp x pp) groups and embedding groups (first + last stage). new_group is
        # collective over the whole world, so every rank creates every group in the same order.
        for d in range(layout.dp):
            ranks = [layout.rank(t, p, d) for p in range(layout.pp) for t in range(layout.tp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.mp_group = group
        for d in range(layout.dp):
            for t in range(layout.tp):
                ranks = sorted({layout.rank(t, 0, d), layout.rank(t, layout.pp - 1, d)})
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.embedding_group = group

    @classmethod
    def virtual(cls, layout: Layout, rank: int = 0, device: str = "meta") -> "Mesh":
        """A mesh with coordinates but no process groups, for planning without processes.

        Building a model on it with device "meta" lists each rank's parameters (names, shard
        shapes, partitions) without allocating memory; the checkpoint converter uses this.
        """
        mesh = cls.__new__(cls)
        mesh.layout, mesh.rank = layout, rank
        mesh.tp_rank, mesh.pp_rank, mesh.dp_rank = layout.coords(rank)
        mesh.device = torch.device(device)
        mesh.device_mesh = None
        mesh.tp_group = mesh.pp_group = mesh.dp_group = mesh.mp_group = None
        mesh.embedding_group = None
        return mesh

    @classmethod
    def from_env(cls, tp: int = 1, pp: int = 1, dp: int | None = None,
                 timeout_s: float | None = None, order: str = "tp-pp-dp") -> "Mesh":
        """Initialise torch.distributed from the environment (if needed) and build the mesh."""
        import os

        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = Layout.infer(world, tp, pp, dp, order)
        if world > 1:
            _device.init_distributed(timeout_s=timeout_s)
            return cls(layout, dist.get_rank())
        return cls(layout, 0)

    # sizes --------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the rank with my tp and dp coordinates on pipeline stage `pp_rank`."""
        return self.layout.rank(self.tp_rank, pp_rank, self.dp_rank)

    @cached_property
    def prev_stage_rank(self) -> int | None:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @cached_property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    def __repr__(self) -> str:
        return (f"Mesh({self.layout}, rank={self.rank}: tp_rank={self.tp_rank} "
                f"pp_rank={self.pp_rank} dp_rank={self.dp_rank})")


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over `group`; a no-op when the group is None (size 1)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def same_on_all_ranks(value: float, device: torch.device, dtype=torch.float64,
                      group=None) -> bool:
    """Whether every rank of `group` (default: the world) holds the same `value`: one
    all-reduce of [v, -v] with MAX (max == min). Every rank gets the same answer, so all can
    raise together instead of some hanging."""
    t = torch.tensor([value, -value], dtype=dtype, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t[0].item() == -t[1].item()


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)
