"""The device mesh: tensor (fastest) x context x pipeline x data (outermost) parallelism.

Global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank, so the ranks of a
tensor-parallel group are contiguous (they stay inside a node), a context-parallel group (the
ranks that split each sequence, which exchange keys / values in every layer) comes next, as in
Megatron, and data parallelism crosses nodes. That is the default rank order "tp-pp-dp";
Megatron's "tp-dp-pp" puts pp outermost instead, rank = ((pp_rank * dp + dp_rank) * cp +
cp_rank) * tp + tp_rank, so the cheap point-to-point pipeline traffic crosses nodes and the
data-parallel gradient reduction stays closer (see `RANK_ORDERS`; cp is next to tp in both).

Parameters are replicated over cp (each cp rank holds other tokens of the same sequences), so
gradients are reduced over cp x dp (`dp_cp_group`, Megatron's data-parallel group with context
parallelism), while the data is split over dp only (`dp_group`).

Expert parallelism (ep) is folded into the data- and context-parallel ranks, as in Megatron-core
and torchtitan (which borrows ep from dp_shard x cp): it adds no ranks. The cp x dp ranks of a
(tp, pp) coordinate, flattened in the order `dp_cp_group` has them (cp inner: index dp_rank *
cp + cp_rank), are cut into dp x cp / ep blocks of ep consecutive ranks (index = edp_rank * ep
+ ep_rank); the ranks of a block (`ep_group`) hold different experts of the same layers and
exchange tokens with all-to-all (`megapar.expert_parallel`): at an ep dividing cp some cp
ranks of one sequence, at a multiple of cp the cp groups of ep / cp consecutive dp ranks.
Routing is per token, so which tokens a rank holds (another sequence, another chunk of the
same one) does not matter. Dense parameters keep their cp x dp reduction group; an expert
parameter is reduced over the ranks that hold the same experts, the same ep rank in every
block (`expert_dp_group`, cp x dp / ep ranks; the cp x dp group itself when ep is 1). ep must
divide dp x cp.

There are no module-level process groups: code that communicates receives a `Mesh`. Beside
the groups' small helpers (`all_reduce`, `group_size`), text and bytes cross the world here
(`broadcast_text`, `gather_payloads`: checkpoint outcomes, step records, the non-finite search).
A 1x1x1 mesh needs no process group at all (every group is then None and every collective
over it is skipped), which is how serial reference models are built.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megapar import device as _device
from megapar.comm_wait import blocked
from megapar.wording import and_list, counted, first_few


def tp_spans_nodes(tp: int, world: int, per_node: int) -> bool:
    """Whether a tp group of a job of `world` ranks, numbered node by node, spans two nodes of
    `per_node` ranks: tp is the fastest axis in every rank order, so its groups are tp
    consecutive ranks, and one crosses a node's end where tp does not divide `per_node` (on
    more than one node)."""
    return tp > 1 and world > per_node and per_node % tp != 0


class LayoutError(ValueError):
    """A parallel layout that cannot work (sizes, world size, model shapes)."""


class EpSplitError(LayoutError):
    """An ep that does not divide dp x cp (`ep_split_error`), with the sizes, so that a caller
    that knows the model can say which values also divide its experts."""

    def __init__(self, ep: int, dp: int, cp: int):
        super().__init__(ep_split_error(ep, dp, cp))
        self.ep, self.dp, self.cp = ep, dp, cp


RANK_ORDERS = ("tp-pp-dp", "tp-dp-pp")
"""How mesh coordinates map to global ranks, fastest-varying dimension first. tp is always
fastest (tensor-parallel groups are contiguous ranks, inside a node) and cp always next to it
(so "tp-pp-dp" is tp-cp-pp-dp, "tp-dp-pp" is tp-cp-dp-pp)."""


def layout_option(name: str, value: object = None, api: bool = False) -> str:
    """A layout setting as its caller gives it: megapar-train's flag (``--tp 2``, ``--pp``),
    or with `api` megapar.prepare's keyword (``tp=2``, ``pp``)."""
    if api:
        return name if value is None else f"{name}={value}"
    return f"--{name}" if value is None else f"--{name} {value}"


def ep_split_error(ep: int, dp: int, cp: int, api: bool = False, experts: int | None = None) -> str:
    """The one line for an ep that does not divide dp x cp (megapar-train's check of the
    model's experts, `Layout`'s and megapar.prepare's): the product, and the ep values that
    divide it and, where `experts` (the model's routed experts) is given, them too; worded for
    the caller (`layout_option`)."""
    ranks = dp * cp
    fits = [e for e in range(1, ranks + 1) if ranks % e == 0 and (experts or e) % e == 0]
    rule = f"dp x cp = {ranks}" + (f" and the {experts} experts" if experts else "")
    if len(fits) == 1:
        use = f"{layout_option('ep', fits[0], api)} (the only value dividing {rule})"
    else:
        choices = and_list([str(e) for e in fits], "or")
        too = "" if experts else "; it must divide the model's experts too"
        use = f"{layout_option('ep', choices, api)} (each divides {rule}{too})"
    dp_cp = f"{layout_option('dp', None, api)} / {layout_option('cp', None, api)}"
    return (
        f"{layout_option('ep', ep, api)} does not divide dp x cp = {layout_option('dp', dp, api)}"
        f" x {layout_option('cp', cp, api)} = {ranks}: experts are sharded over the data- and "
        f"context-parallel ranks; use {use}, or change {dp_cp}"
    )


def expert_tp_error(etp: int, tp: int, api: bool = False) -> str | None:
    """The one line for an expert tensor-parallel size that is neither 1 nor tp (None when it
    is one of them), worded for the caller (`layout_option`)."""
    if etp in (1, tp):
        return None
    flag = "expert_tensor_parallel_size" if api else "expert-tensor-parallel-size"
    choices = "1" if tp == 1 else f"1 or {tp}"
    return (
        f"{layout_option(flag, etp, api)} must be 1 (experts whole on every tp rank) or the "
        f"tp size {layout_option('tp', tp, api)} (each expert split over tp); use {choices}"
    )


def expert_tp_size(etp: int, tp: int) -> int:
    """The expert tensor-parallel size a mesh keeps: `etp` (1 or tp), or a LayoutError."""
    error = expert_tp_error(int(etp), tp, api=True)
    if error:
        raise LayoutError(error)
    return int(etp)


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
    cp: int = 1
    """Context-parallel size: ranks that split every sequence (`megapar.context_parallel`)."""
    ep: int = 1
    """Expert-parallel size: cp x dp ranks that split each MoE layer's experts (folded into
    them: it divides dp x cp and adds no ranks)."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"--{name} must be an integer >= 1, got {value!r}")
        if self.dp * self.cp % self.ep:
            raise EpSplitError(self.ep, self.dp, self.cp)
        if self.order not in RANK_ORDERS:
            raise LayoutError(
                f"--rank-order must be one of {', '.join(RANK_ORDERS)}, got {self.order!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords4(self, rank: int) -> tuple[int, int, int, int]:
        """(tp_rank, cp_rank, pp_rank, dp_rank) of a global rank."""
        names, sizes = self.mesh_dims
        coords = {}
        for name, size in zip(reversed(names), reversed(sizes)):
            rank, coords[name] = divmod(rank, size)
        return coords["tp"], coords["cp"], coords["pp"], coords["dp"]

    def ep_coords(self, dp_rank: int, cp_rank: int) -> tuple[int, int]:
        """(ep_rank, edp_rank) of a (dp, cp) coordinate: its place in its block of ep
        consecutive ranks of the flattened cp x dp index dp_rank * cp + cp_rank, and the
        block's index (its rank in the expert-data-parallel group)."""
        edp_rank, ep_rank = divmod(dp_rank * self.cp + cp_rank, self.ep)
        return ep_rank, edp_rank

    def ep_block(self, tp: int, pp: int, edp_rank: int) -> list[int]:
        """Global ranks of the ep group of block `edp_rank` at (tp, pp), in ep-rank order
        (ascending: a global rank grows with the flattened index in both rank orders, so a
        rank's place in its ep group is its ep rank, and in its expert-dp group its edp
        rank)."""
        flat = range(edp_rank * self.ep, (edp_rank + 1) * self.ep)
        return [self.rank(tp, pp, *divmod(f, self.cp)) for f in flat]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank (`coords4` has its cp rank too)."""
        tp, _, pp, dp = self.coords4(rank)
        return tp, pp, dp

    def place(self, rank: int) -> str:
        """Where a global rank sits, as a failure names it: "tp rank 0, pp rank 1, dp rank 0
        of tp=1 pp=2 dp=2" (its cp rank too where cp > 1)."""
        tp, cp, pp, dp = self.coords4(rank)
        at_cp = f", cp rank {cp}" if self.cp > 1 else ""
        return f"tp rank {tp}{at_cp}, pp rank {pp}, dp rank {dp} of {self}"

    def rank(self, tp: int, pp: int, dp: int, cp: int = 0) -> int:
        """Global rank of mesh coordinates."""
        if self.order == "tp-dp-pp":
            return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    @property
    def mesh_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """DeviceMesh dimension names and sizes, outermost first (row-major = `rank`)."""
        if self.order == "tp-dp-pp":
            return ("pp", "dp", "cp", "tp"), (self.pp, self.dp, self.cp, self.tp)
        return ("dp", "pp", "cp", "tp"), (self.dp, self.pp, self.cp, self.tp)

    def tp_spans_nodes(self, per_node: int) -> bool:
        """Whether a tp group spans two nodes of `per_node` ranks (`tp_spans_nodes`)."""
        return tp_spans_nodes(self.tp, self.world_size, per_node)

    def across_nodes(self, per_node: int) -> list[str]:
        """The axes (tp, cp, pp, dp, in that order) any of whose groups spans more than one
        node of `per_node` consecutive ranks (ranks are numbered node by node)."""
        crossing = []
        for axis in ("tp", "cp", "pp", "dp"):
            for rank in range(self.world_size):
                tp, cp, pp, dp = self.coords4(rank)
                at = {"tp": tp, "pp": pp, "dp": dp, "cp": cp}
                nodes = {
                    self.rank(**{**at, axis: i}) // per_node for i in range(getattr(self, axis))
                }
                if len(nodes) > 1:
                    crossing.append(axis)
                    break
        return crossing

    def to_dict(self) -> dict:
        """{"tp", "pp", "dp"} (plus "cp", "ep" and "order" when they are not the defaults),
        as manifests store it."""
        out: dict[str, int | str] = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        if self.cp != 1:
            out["cp"] = self.cp
        if self.ep != 1:
            out["ep"] = self.ep
        if self.order != RANK_ORDERS[0]:
            out["order"] = self.order
        return out

    def __str__(self) -> str:
        order = "" if self.order == RANK_ORDERS[0] else f" order={self.order}"
        cp = f" cp={self.cp}" if self.cp != 1 else ""
        ep = f" ep={self.ep}" if self.ep != 1 else ""
        return f"tp={self.tp}{cp} pp={self.pp} dp={self.dp}{ep}{order}"

    @staticmethod
    def infer(
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        order: str = "tp-pp-dp",
        cp: int = 1,
        ep: int = 1,
        world_flag: str | None = None,
    ) -> Layout:
        """Layout for a world size; dp defaults to world_size / (tp * cp * pp). A world that
        does not fit is refused saying how many processes to launch, or with `world_flag`
        (megapar-train --dry-run's ``--world-size``, where the size is a flag) which value to
        give it."""
        if tp < 1 or pp < 1:
            raise LayoutError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")
        if cp < 1:
            raise LayoutError(f"--cp must be >= 1, got {cp}")
        split = tp * cp * pp
        names = "tp*cp*pp" if cp > 1 else "tp*pp"
        sizes = f"{tp}*{cp}*{pp}" if cp > 1 else f"{tp}*{pp}"
        if dp is None:
            if world_size % split:
                fix = (
                    f"give a {world_flag} that is a multiple of {split}"
                    if world_flag
                    else f"launch a multiple of {split} processes"
                )
                raise LayoutError(
                    f"world size {world_size} is not divisible by {names} = {sizes}; "
                    f"{fix} or change --tp/--pp" + ("/--cp" if cp > 1 else "")
                )
            dp = world_size // split
        layout = Layout(tp, pp, dp, order, cp, ep)
        if layout.world_size != world_size:
            fix = (
                f"give {world_flag} {layout.world_size}"
                if world_flag
                else f"launch {counted(layout.world_size, 'process', 'processes')}"
            )
            raise LayoutError(
                f"world size {world_size} != {names}*dp = {sizes}*{dp} = {layout.world_size}; "
                f"{fix} or change --tp/--pp/--dp" + ("/--cp" if cp > 1 else "")
            )
        return layout


_STORE_KEYS = re.compile(r"keys: (.*)$", re.MULTILINE)


def group_join_timeout(rank: int, ranks: list[int], desc: str, wait_s: float, error: str) -> str:
    """The one line for a process group whose creation timed out (gloo's store wait for its
    members' addresses, `error`): the members that never came, named from the keys waited for
    (each ends with the member's index in `ranks`), and the flag that sets the wait."""
    found = _STORE_KEYS.search(error)
    indices = [
        k.rstrip("/").rsplit("/", 1)[-1] for k in (found.group(1) if found else "").split(",")
    ]
    missing = sorted(
        {ranks[int(i)] for i in indices if i.strip().isdigit() and int(i) < len(ranks)}
    )
    who = (
        f"{'rank' if len(missing) == 1 else 'ranks'} {first_few(list(map(str, missing)), 8)} "
        f"never did"
        if missing
        else "some never did"
    )
    shown = first_few(list(map(str, ranks)), 8)
    return (
        f"rank {rank} waited {wait_s:g} s for ranks {shown} to create process group "
        f"{desc} and {who} (a rank that failed, stopped or hung before "
        f"it, or one started with other flags); --timeout-s sets the wait"
    )


class Mesh:
    """This rank's view of the mesh: its coordinates and its process groups.

    Built collectively (every rank must construct it, in the same order) on top of
    `torch.distributed.device_mesh.DeviceMesh` with dims ("dp", "pp", "cp", "tp") (or
    ("pp", "dp", "cp", "tp")); `dp_cp_group` (gradients), `mp_group` (tp x pp: the gradient
    norm), `embedding_group` (the tied embedding's first and last stage) and, with ep > 1,
    `ep_group` / `expert_dp_group` (the experts' all-to-all and gradient groups) come on top.

    Every group waits at most `timeout_s` (`group_timeout`): a collective on it that a rank
    never joins raises on the others after that long, synchronous ones included (torch's
    subgroups would otherwise keep its default of 30 minutes on gloo).
    """

    timeout_s: float = _device.DEFAULT_TIMEOUT_S
    """How long a wait on this mesh's groups may last (gloo; on NCCL the groups keep the world
    group's watchdog timeout, see `group_timeout`). `timeout_s` of the constructor or
    `from_env` sets it; by default the world group's own."""

    def __init__(
        self,
        layout: Layout,
        rank: int = 0,
        timeout_s: float | None = None,
        sequence_parallel: bool = False,
        expert_tp: int = 1,
    ):
        self.layout = layout
        self.rank = rank
        self.sequence_parallel = bool(sequence_parallel) and layout.tp > 1
        """Megatron sequence parallelism: outside the tp regions activations are split along the
        sequence over the tp group (`tensor_parallel/sequence_parallel.py`); never with tp 1.
        A constructor argument; layers read it when they are built."""
        self.etp = expert_tp_size(expert_tp, layout.tp)
        """Expert tensor parallelism (Megatron's --expert-tensor-parallel-size): 1, each routed
        expert whole on every tp rank, or tp, each expert's weights split over the tp group
        (`models.moe`). A constructor argument; MoE layers read it when they are built."""
        self.tp_rank, self.cp_rank, self.pp_rank, self.dp_rank = layout.coords4(rank)
        self.ep_rank, self.edp_rank = layout.ep_coords(self.dp_rank, self.cp_rank)
        self.device = _device.device()
        if timeout_s:
            self.timeout_s = timeout_s
        self.device_mesh = None
        self.tp_group = self.cp_group = self.pp_group = self.dp_group = None
        self.dp_cp_group = self.mp_group = self.embedding_group = None
        self.ep_group = self.expert_dp_group = None
        if layout.world_size == 1:
            return
        if not dist.is_initialized():
            raise LayoutError(
                f"a {layout} mesh needs {counted(layout.world_size, 'process', 'processes')}; "
                "torch.distributed is not "
                f"initialised (run under megapar-train / torchrun)"
            )
        world = dist.get_world_size()
        if world != layout.world_size:
            split = "tp*cp*pp*dp" if layout.cp > 1 else "tp*pp*dp"
            raise LayoutError(
                f"world size {world} != {split} = "
                f"{'*'.join(str(getattr(layout, n)) for n in split.split('*'))} = "
                f"{layout.world_size}; launch "
                f"{counted(layout.world_size, 'process', 'processes')} or change the layout"
            )

        world_timeout = _device.process_group_timeout_s()
        if not timeout_s and world_timeout and _device.backend() != "nccl":
            self.timeout_s = world_timeout
        self.group_timeout = timedelta(
            seconds=_device.group_timeout_s(_device.backend(), self.timeout_s, world_timeout)
        )
        """The timeout every group of this mesh is created with: gloo's is `timeout_s`;
        NCCL's is its watchdog's, the world group's (`init_distributed`), never shorter."""

        # new_group is collective over the whole world, so every rank creates every group in
        # the same order. The mesh dimensions, as init_device_mesh would make them but with
        # the run's timeout (it takes none); one spanning the world is the world group, as
        # there, when its timeout is the same (no second NCCL communicator):
        names, sizes = layout.mesh_dims
        grid = torch.arange(layout.world_size).reshape(sizes)
        dims: dict[str, dist.ProcessGroup] = {}
        for i, name in enumerate(names):
            along = grid.movedim(i, -1).reshape(-1, sizes[i]).tolist()
            if sizes[i] == world and world_timeout == self.group_timeout.total_seconds():
                assert dist.group.WORLD is not None  # the default group is initialised
                dims[name] = dist.group.WORLD
            else:
                dims[name] = self._new_groups(along, f"mesh_{name}")
        self.device_mesh = DeviceMesh.from_group(
            [dims[n] for n in names], self.device.type, mesh=grid, mesh_dim_names=names
        )
        self.tp_group, self.cp_group = dims["tp"], dims["cp"]
        self.pp_group, self.dp_group = dims["pp"], dims["dp"]
        self.dp_cp_group = self.dp_group
        self._new_reduction_groups()
        self.expert_dp_group = self.dp_cp_group
        if layout.ep > 1:
            self._new_expert_groups()

    def _new_reduction_groups(self) -> None:
        """Create the groups beyond the mesh dimensions (collective, as `_new_groups`): the
        gradient reduction group (cp x dp; the dp group when cp is 1), the model-parallel group
        (tp x pp) and the embedding group (first + last stage)."""
        # Gradient reduction (cp x dp), model-parallel (tp x pp) and embedding groups (first +
        # last stage):
        L = self.layout
        if L.cp > 1:
            self.dp_cp_group = self._new_groups(
                [
                    [L.rank(t, p, d, c) for d in range(L.dp) for c in range(L.cp)]
                    for p in range(L.pp)
                    for t in range(L.tp)
                ],
                "mesh_dp_cp",
            )
        self.mp_group = self._new_groups(
            [
                [L.rank(t, p, d, c) for p in range(L.pp) for t in range(L.tp)]
                for d in range(L.dp)
                for c in range(L.cp)
            ],
            "mesh_mp",
        )
        self.embedding_group = self._new_groups(
            [
                sorted({L.rank(t, 0, d, c), L.rank(t, L.pp - 1, d, c)})
                for d in range(L.dp)
                for c in range(L.cp)
                for t in range(L.tp)
            ],
            "mesh_embedding",
        )

    def _new_expert_groups(self) -> None:
        """Create expert parallelism's groups (collective, as `_new_groups`): `ep_group`, a
        block of ep consecutive ranks of the flattened cp x dp index (same tp, pp;
        `Layout.ep_block`), which exchange tokens; and `expert_dp_group`, the ranks holding
        the same experts (same tp, pp and ep rank; every block), over which expert gradients
        are reduced."""
        L = self.layout
        blocks = range(L.dp * L.cp // L.ep)
        self.ep_group = self._new_groups(
            [L.ep_block(t, p, b) for p in range(L.pp) for b in blocks for t in range(L.tp)],
            "ep",
        )
        self.expert_dp_group = self._new_groups(
            [
                [L.ep_block(t, p, b)[e] for b in blocks]
                for p in range(L.pp)
                for e in range(L.ep)
                for t in range(L.tp)
            ],
            "expert_dp",
        )

    def _new_groups(self, all_ranks: list[list[int]], desc: str):
        """Create one process group per rank list, each with `group_timeout` (collective:
        every rank creates all of them, in the same order); returns the one holding this
        rank."""
        mine = None
        for ranks in all_ranks:
            wait = self.group_timeout.total_seconds()
            try:
                with _device.connect_bound(f"creating process group {desc}", wait, self.rank):
                    group = dist.new_group(ranks, timeout=self.group_timeout, group_desc=desc)
            except dist.DistStoreError as exc:  # its words name only store keys
                raise TimeoutError(
                    group_join_timeout(self.rank, ranks, desc, wait, str(exc))
                ) from None
            if self.rank in ranks:
                mine = group
        return mine

    @classmethod
    def virtual(
        cls,
        layout: Layout,
        rank: int = 0,
        device: str = "meta",
        sequence_parallel: bool = False,
        expert_tp: int = 1,
    ) -> Mesh:
        """A mesh with coordinates but no process groups, for planning without processes.

        Building a model on it with device "meta" lists each rank's parameters (names, shard
        shapes, partitions) without allocating memory; the checkpoint converter uses this.
        """
        mesh = cls.__new__(cls)
        mesh.layout, mesh.rank = layout, rank
        mesh.sequence_parallel = bool(sequence_parallel) and layout.tp > 1
        mesh.etp = expert_tp_size(expert_tp, layout.tp)
        mesh.tp_rank, mesh.cp_rank, mesh.pp_rank, mesh.dp_rank = layout.coords4(rank)
        mesh.ep_rank, mesh.edp_rank = layout.ep_coords(mesh.dp_rank, mesh.cp_rank)
        mesh.device = torch.device(device)
        mesh.device_mesh = None
        mesh.tp_group = mesh.cp_group = mesh.pp_group = mesh.dp_group = mesh.mp_group = None
        mesh.dp_cp_group = mesh.embedding_group = mesh.ep_group = mesh.expert_dp_group = None
        return mesh

    @classmethod
    def from_env(
        cls,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        timeout_s: float | None = None,
        order: str = "tp-pp-dp",
        cp: int = 1,
        sequence_parallel: bool = False,
        ep: int = 1,
        expert_tp: int = 1,
    ) -> Mesh:
        """Initialise torch.distributed from the environment (if needed) and build the mesh:
        torchrun's, our launcher's, or an `srun` step's (`device.adopt_slurm_environment`)."""

        _device.adopt_slurm_environment()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = Layout.infer(world, tp, pp, dp, order, cp, ep)
        if world > 1:
            _device.init_distributed(timeout_s=timeout_s)
            mesh = cls(layout, dist.get_rank(), timeout_s, sequence_parallel, expert_tp)
        else:
            mesh = cls(layout, 0, timeout_s, sequence_parallel, expert_tp)
        return mesh

    # sizes --------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the rank with my tp, cp and dp coordinates on stage `pp_rank`."""
        return self.layout.rank(self.tp_rank, pp_rank, self.dp_rank, self.cp_rank)

    @cached_property
    def prev_stage_rank(self) -> int | None:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @cached_property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    def __repr__(self) -> str:
        cp = f" cp_rank={self.cp_rank}" if self.layout.cp > 1 else ""
        ep = f" ep_rank={self.ep_rank}" if self.layout.ep > 1 else ""
        return (
            f"Mesh({self.layout}, rank={self.rank}: tp_rank={self.tp_rank}{cp} "
            f"pp_rank={self.pp_rank} dp_rank={self.dp_rank}{ep})"
        )


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over `group`; a no-op when the group is None (size 1)."""
    if group is not None and dist.get_world_size(group) > 1:
        with blocked(tensor.device):  # counted inside a compute action (comm_wait)
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def same_on_all_ranks(value: float, device: torch.device) -> bool:
    """Whether every rank of the world holds the same `value`: one all-reduce of [v, -v] in
    float64 with MAX (max == min). Every rank gets the same answer, so all can raise together
    instead of some hanging."""
    t = torch.tensor([value, -value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item() == -t[1].item()


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _world(mesh: Mesh) -> bool:
    """Whether `mesh` spans several processes joined by torch.distributed."""
    return mesh.layout.world_size > 1 and dist.is_initialized()


def _bytes_tensor(data: bytes, device, pad_to: int = 0) -> torch.Tensor:
    """`data` as a uint8 tensor on the device collectives use (zero-padded to `pad_to`)."""
    buf = torch.zeros(max(pad_to, len(data)), dtype=torch.uint8, device="cpu")  # staging
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)


def broadcast_text(text: str | None, mesh: Mesh, src: int = 0, group=None) -> str:
    """Rank `src`'s text on every rank (a uint8 tensor broadcast over the world, or over
    `group`: a gloo group spanning the world, on host tensors)."""
    if not _world(mesh):
        assert text is not None  # the only rank is `src`
        return text
    device = mesh.device if group is None else torch.device("cpu")
    if mesh.rank == src:
        assert text is not None  # `src` gives its text
        data = text.encode()
    else:
        data = b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    buf = _bytes_tensor(data, device, int(length))
    dist.broadcast(buf, src, group=group)
    return buf.cpu().numpy().tobytes().decode()


def gather_payloads(payload: bytes, mesh: Mesh, group=None) -> list[bytes] | None:
    """Every rank's bytes on rank 0 (None elsewhere), via padded uint8 tensor gathers over the
    world (or `group`, as in `broadcast_text`)."""
    if not _world(mesh):
        return [payload]
    device = mesh.device if group is None else torch.device("cpu")
    n = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(mesh.layout.world_size)]
    dist.all_gather(sizes, n, group=group)
    buf = _bytes_tensor(payload, device, max(int(s) for s in sizes))
    parts = [torch.empty_like(buf) for _ in sizes] if mesh.rank == 0 else None
    dist.gather(buf, parts, dst=0, group=group)
    if mesh.rank != 0:
        return None
    assert parts is not None  # rank 0's
    return [p[: int(s)].cpu().numpy().tobytes() for p, s in zip(parts, sizes)]
