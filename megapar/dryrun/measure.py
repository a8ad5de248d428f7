"""What a real rank holds and sends, measured: the reference the dry run is checked against.

`measure_step(engine, micro_batches)` runs one real optimizer step of an `Engine` and returns
the same figures a `RankReport` has, measured on the real tensors:

- weights, gradients, optimizer state: the bytes of the distinct storages behind the
  parameters, their gradients and every tensor of the optimizer's state after the step
  (`storage_bytes`, the rule the dry run applies to its fake tensors);
- activations: the peak over the step, sampled after every schedule action, of the distinct
  storages held for backward (`HeldStorages`): what autograd saved, seen through
  `torch.autograd.graph.saved_tensors_hooks` and counted while any saved reference is alive; the
  inputs of checkpointed regions (recomputation), which non-reentrant `torch.utils.checkpoint`
  keeps in its own frame where the outer hooks do not see them, counted while they are alive;
  and the executor's in-flight inputs and outputs. Parameters are not activations;
- communication: every collective of the step (`comm_count`).

`benchmarks/plan/dry_run_validate.py` and `tests/test_dry_run.py` compare these with the dry run
of the same layout; `benchmarks/plan/plan_validate.py` with the planner.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from megapar.comm_count import count_collectives
from megapar.dryrun.rank import traffic
from megapar.dryrun.world import held_bytes
from megapar.models.config import config_from_dict
from megapar.training.config import TrainConfig
from megapar.training.engine import Engine


class HeldStorages:
    """Distinct storages held for backward: refcounted by the saved-tensor references, plus the
    live inputs of checkpointed regions."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = {p.untyped_storage()._cdata for p in params}
        self.live: dict[int, list[int]] = {}  # storage -> [references, nbytes]
        self.region_inputs: list[weakref.ref] = []

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key in self.params:
            return t
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        entry[0] += 1
        return _Ref(self, key, t)

    @staticmethod
    def unpack(ref):
        return ref.tensor if isinstance(ref, _Ref) else ref

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]

    @contextlib.contextmanager
    def counting(self):
        """Saved-tensor hooks on, and every checkpointed region's tensor inputs recorded."""
        original = torch_checkpoint.checkpoint

        def checkpoint(fn, *args, **kwargs):
            self.region_inputs += [weakref.ref(a) for a in args if isinstance(a, torch.Tensor)]
            return original(fn, *args, **kwargs)

        torch_checkpoint.checkpoint = checkpoint
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            torch_checkpoint.checkpoint = original

    def bytes_with(self, tensors) -> int:
        """Bytes held now, `tensors` (the executor's in-flight ones) included."""
        sizes = {k: v[1] for k, v in self.live.items()}
        self.region_inputs = [r for r in self.region_inputs if r() is not None]
        for t in list(tensors) + [r() for r in self.region_inputs]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.params:
                    sizes[storage._cdata] = storage.nbytes()
        return sum(sizes.values())


class _Ref:
    def __init__(self, owner: HeldStorages, key: int, tensor: torch.Tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner.release(self.key)


@contextlib.contextmanager
def peak_held(executor, held: HeldStorages):
    """While in the block, after every compute and message group of the executor: the bytes
    `held` holds with the executor's in-flight inputs and outputs and the pipeline's message
    buffers (a sent output's storage lives on in its send until the peer has it); yields [the
    peak so far] (reset it by assigning 0). After a group is sampled where the walk goes on:
    at the wait for the next received message, or at the next compute (a group that no
    compute follows only sends, which adds nothing held)."""
    peak, handlers = [0], dict(executor.handlers)

    def sample():
        live = list(executor.inputs.values()) + list(executor.outputs.values())
        if executor.p2p is not None:
            live += [tensor for _, tensor, _ in executor.p2p.held()]
        peak[0] = max(peak[0], held.bytes_with(live))

    def dispatched(handler, action):
        sample()
        handler(action)
        sample()

    def waited(key):
        sample()
        return wait_recv(key)

    executor.handlers.update(
        {kind: functools.partial(dispatched, handler) for kind, handler in handlers.items()}
    )
    if executor.p2p is not None:
        wait_recv = executor.p2p.wait_recv
        executor.p2p.wait_recv = waited
    try:
        yield peak
    finally:
        executor.handlers.clear()
        executor.handlers.update(handlers)
        if executor.p2p is not None:
            del executor.p2p.wait_recv  # the class's again


def measure_step(engine, micro_batches: list[dict], step_index: int = 0) -> dict:
    """One real optimizer step of `engine` on this rank's `micro_batches`; returns params,
    weights, grads, optimizer, activations (bytes, as above) and `calls` (its collectives)."""
    held = HeldStorages(engine.model.parameters())
    engine.executor.post_ahead = False  # the program as NCCL runs it, which the model counts
    gathered = [0]
    sharded = engine.sharded_params
    if sharded is not None:  # ZeRO-3: the most bytes of units gathered at once
        gather, prefetch = sharded.gather, sharded.prefetch

        def watched(fn):
            def call(u):
                fn(u)
                gathered[0] = max(gathered[0], sharded.gathered_bytes())

            return call

        sharded.gather, sharded.prefetch = watched(gather), watched(prefetch)
    try:
        with (
            peak_held(engine.executor, held) as peak,
            count_collectives() as calls,
            held.counting(),
        ):
            engine.step_fn.step(micro_batches, step_index)
    finally:
        if sharded is not None:
            del sharded.gather, sharded.prefetch
    return {
        **held_bytes(engine.model, engine.optimizer, sharded),
        "gathered": gathered[0],
        "activations": peak[0],
        "calls": list(calls),
    }


def measured_rank(
    cfg_dict: dict, config_dict: dict, steps: int = 2, save: str | None = None, per_node: int = 8
) -> dict:
    """A worker (for `megapar.launcher.run_local`): this rank of a real run of `cfg` on the
    model, `steps` optimizer steps of megapar-train's `Engine` on seeded random batches, the
    last one measured (`measure_step`); its communication as the dry run reports it (groups
    named, `traffic`) without the scalar all-reduces the dry run does not run; with `save`, a
    checkpoint written there after the steps."""

    cfg, config = TrainConfig(**cfg_dict), config_from_dict(config_dict)
    engine = Engine(cfg, config)
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        ids = torch.randint(
            0, config.vocab_size, (cfg.global_batch_size, cfg.seq_len + 1), generator=gen
        )
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        if config.model_type == "bert":
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        result = measure_step(engine, engine.split(batch), i)
    mesh = engine.mesh
    result["comm"] = traffic(without_scalars(result.pop("calls"), mesh), mesh, per_node)
    if save:
        engine.save(save)
    return {
        "rank": mesh.rank,
        "tp_rank": mesh.tp_rank,
        "pp_rank": mesh.pp_rank,
        "dp_rank": mesh.dp_rank,
        **result,
    }


def without_scalars(calls, mesh) -> list:
    """`calls` without the one-element all-reduces the dry run does not run (`NOT_RUN`): the
    gradient norm's over tp x pp (and dp x cp under ZeRO-1), the loss's over dp, fp16's overflow
    flag's over every rank and --loss-mean token's labelled-token count's over dp."""

    groups = {
        tuple(dist.get_process_group_ranks(g))
        for g in (mesh.mp_group, mesh.dp_group, mesh.dp_cp_group)
        if g is not None
    }
    return [
        c
        for c in calls
        if not (c.op == "all_reduce" and c.numel == 1 and (c.ranks is None or c.ranks in groups))
    ]
