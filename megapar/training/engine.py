"""The engine: one rank's model stage, pipeline, dp reduction, optimizer and loss scaler.

`Engine` is what `megapar-train` runs (the `Trainer` in loop.py adds data, logging and the loop
around it) and what `megapar.prepare(...)` returns to users who write their own loop:

    engine = megapar.prepare(GPT2LMHeadModel(cfg), tp=2, pp=2, micro_batch_size=2, lr=1e-3)
    for batch in my_batches:                    # the global batch, the same on every rank
        loss = engine.train_step(batch)         # one optimizer step; the global mean loss

Every rank calls every method together (they are collective).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from megapar import comm_wait
from megapar.checkpoint.async_save import AsyncSaver
from megapar.checkpoint.distributed import (
    VERIFY_MODES,
    SavedState,
    capture,
    load_checkpoint,
    save_checkpoint,
)
from megapar.checkpoint.export import DTYPE_ALIASES, EXPORT_DTYPES, export_dtype
from megapar.checkpoint.format import CheckpointError
from megapar.checkpoint.publish import steps_after
from megapar.checkpoint.stage_tensors import gathers_experts
from megapar.context_parallel import check_length
from megapar.data.tokenizer import TOKENIZER_SPECS
from megapar.data_parallel.compression import make_compressor
from megapar.data_parallel.grad_sync import build_grad_sync
from megapar.data_parallel.sharded_params import HostStage, ShardedParams
from megapar.device import process_group_timeout_s
from megapar.diagnostics.nonfinite import KeptStep, locate
from megapar.diagnostics.probes import build_probes
from megapar.diagnostics.straggler import StragglerReport
from megapar.faults.status import set_action, set_step
from megapar.host_memory import keep_freed_host_memory, return_freed_host_memory
from megapar.mesh import Mesh, all_reduce, broadcast_text
from megapar.optim import DynamicLossScaler, LRScheduler, Precision
from megapar.optim.precision import comm_dtypes
from megapar.optim.scheduler import flags_schedule
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.schedules import chunks_per_rank
from megapar.training.batch_check import (
    UNSHIFTED_WARNING,
    check_batch,
    same_call_on_every_rank,
    unshifted_labels,
)
from megapar.training.config import TrainConfig
from megapar.training.documents import eod_masked
from megapar.training.engine_parts import api_guard, mesh_for, optimizer_for, stage_for
from megapar.training.export import export_engine
from megapar.training.resume import checkpoint_meta, recorded_settings, restore_meta
from megapar.training.rng import (
    default_rng_state,
    rng_state,
    set_default_rng_state,
    set_rng_state,
)
from megapar.training.step import BatchPlan, StepResult, TrainStep, loss_weight
from megapar.training.validate_resume import load_everywhere
from megapar.wording import counted

ON_NONFINITE = ("raise", "skip")
"""What `train_step` does with a step whose loss or gradients are not finite (the optimizer step
is skipped either way): raise `NonFiniteError`, or return the non-finite loss."""


class Engine:
    """Builds and owns one rank's training state for `model_config` under `cfg`.

    `scheduler`: a megapar `LRScheduler` (the learning rate is set at every step), or None to
    leave the optimizer's learning rate alone (constant, or driven by a torch LR scheduler on
    `engine.optimizer`). The default builds one from cfg's lr / warmup / decay fields.
    `on_nonfinite`: what `train_step` does with a non-finite step (`ON_NONFINITE`).
    """

    step: int
    """Steps run (restored by `load`), those not applied included: a non-finite step
    (raised or skipped, see `train_step`) counts, as megapar-train counts the fp16 loss
    scaler's skipped steps."""
    schedule_step: int
    """The learning-rate schedule's position (restored by `load`; a checkpoint without it:
    `step`): the steps applied, so a skipped step (an fp16 overflow, a non-finite loss or
    gradient) does not advance it and the schedule lags `step` by the skipped steps, as
    Megatron-LM's, DeepSpeed's and the Hugging Face Trainer's do. Every rank skips the
    same steps, so it is the same on every rank in any layout."""
    last_skipped: bool
    """Whether the last training step's update was skipped (an fp16 overflow; a non-finite
    step under `on_nonfinite="skip"`): megapar-train's `skipped`."""
    tokenizer: dict | None
    """The tokenizer the model trains with (`checkpoint.convert.recorded_tokenizer`), saved
    in checkpoints and carried by `export_hf`."""
    source_dtype: str | None
    """The dtype of the Hugging Face weights it started from: `export_hf` writes it."""
    on_nonfinite: str
    """`"raise"` or `"skip"`: what `train_step` does with a non-finite step."""

    def __init__(
        self,
        cfg: TrainConfig,
        model_config,
        mesh: Mesh | None = None,
        scheduler="from_cfg",
        on_nonfinite: str = "raise",
    ):
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"on_nonfinite={on_nonfinite!r} is not one of {', '.join(map(repr, ON_NONFINITE))}"
            )
        self.cfg, self.config = cfg, model_config
        self.mesh = mesh = mesh_for(cfg, mesh)
        """This rank's `Mesh`: its layout, its tp / cp / pp / dp coordinates and process groups."""
        self.world = dist.group.WORLD if mesh.layout.world_size > 1 else None
        """The default process group the mesh's groups were made in (None: one rank); a
        collective call refuses once it is gone (`in_its_group`)."""
        callers = default_rng_state(mesh.device)  # the stage's seeding must not touch the caller's
        self.model, self.fp8_summary = stage_for(cfg, model_config, mesh)
        """This rank's stage; and under --fp8 the line naming its float8 layers (else None)."""
        self.precision = Precision(
            cfg.precision,
            mesh.device,
            DynamicLossScaler(
                init_scale=cfg.loss_scale or cfg.initial_loss_scale,
                growth_interval=cfg.loss_scale_window,
                min_scale=cfg.loss_scale or cfg.min_loss_scale,
                hysteresis=cfg.hysteresis,
                dynamic=not cfg.loss_scale,
            ),
        )
        self.wire_dtype, reduce_dtype = comm_dtypes(
            cfg.precision, cfg.p2p_dtype, cfg.grad_reduce_dtype
        )
        self.optimizer = optimizer_for(cfg, self.model, mesh, self.scaled_lr(cfg))
        """A `torch.optim.Optimizer` over this rank's parameters (under ZeRO-1 / 2 / 3, its slices
        of the optimizer state): torch's LR schedulers can drive it."""
        self.scheduler = self.flags_schedule(cfg) if scheduler == "from_cfg" else scheduler
        if self.scheduler is not None:  # the first step's lr, as a torch scheduler sets it
            self.optimizer.set_lr(self.scheduler.lr(0))  # (and after each step, the next's)
        self._build_grad_sync(cfg, mesh, reduce_dtype)
        self.straggler, self._slowdown, self.injector = build_probes(
            self.model,
            model_config,
            mesh,
            cfg.straggler_factor,
            cfg.inject_slow,
            cfg.inject_corrupt,
        )
        """Straggler detection (compared by `stragglers()`), `--inject-slow`'s slowdown and the
        `--inject-corrupt` testing tool's hooks; each None when off (`diagnostics.probes`)."""
        self._executors: dict[int, PipelineExecutor] = {}
        self.executor = self.executor_for(cfg.seq_len)
        self.step_fn = TrainStep(
            self.model,
            mesh,
            self.executor,
            self.optimizer,
            self.scheduler,
            self.precision,
            cfg.clip_grad,
            self.grad_sync,
            cfg.loss_mean,
        )
        self._init_run_state(cfg, on_nonfinite)
        self._start_saver(cfg, mesh)
        self._rng: dict[str, torch.Tensor] | None = default_rng_state(mesh.device)
        """The engine's default-generator state (its dropout stream, seeded per stage), swapped
        in for its steps (`own_rng`); None while swapped in."""
        set_default_rng_state(callers, mesh.device)

    def __repr__(self) -> str:
        """What a notebook shows for `engine`: the model, the layout and this rank's place in
        it, the step, the optimizer and the precision."""
        cfg = self.cfg
        zero = f" zero={cfg.zero}" if cfg.zero else ""
        return (
            f"Engine({self.config.model_type}, {self.mesh!r}, step={self.step}, "
            f"optimizer={cfg.optimizer} lr={self.optimizer.param_groups[0]['lr']:g}{zero}, "
            f"precision={cfg.precision})"
        )

    def _build_grad_sync(self, cfg: TrainConfig, mesh: Mesh, reduce_dtype) -> None:
        """The stage's gradient sync (and under ZeRO-3 its sharded parameters)."""
        compressor = make_compressor(cfg.grad_compression, cfg.powersgd_rank, cfg.seed)
        # gradients live in one buffer even at dp=1 (no per-step allocation); dp > 1 reduces it
        # (summed over cp, averaged over dp); the kind (all-reduce, ZeRO-1 / 2 / 3) chosen once
        self.grad_sync = build_grad_sync(
            self.model,
            mesh,
            cfg.zero,
            cfg.grad_bucket_mb,
            compressor,
            reduce_dtype,
            zero3_keep_params=cfg.zero3_keep_params,
            zero3_persistence_threshold=cfg.zero3_persistence_threshold,
            offload_params=cfg.offload_params,
            zero3_reduce=cfg.zero3_reduce,
            zero3_float8=cfg.zero3_float8 is not None,
            zero3_half=cfg.zero3_half,
            zero12_half=cfg.zero12_half,
        )
        """The stage's `GradSync` (`megapar.data_parallel.grad_sync`)."""
        self.sharded_params: ShardedParams | None = (
            self.grad_sync if isinstance(self.grad_sync, ShardedParams) else None
        )
        """ZeRO-3 (dp x cp > 1): the stage's parameters sharded over dp x cp, gathered per
        unit (also the gradient sync); None otherwise."""

    def _init_run_state(self, cfg: TrainConfig, on_nonfinite: str) -> None:
        """What the run keeps beside the model: the last step, the step count, the tokenizer
        and Hugging Face source, and the non-finite policy and guard (the public attributes
        are documented in the class body, where the API reference finds them)."""
        self.kept: KeptStep | None = None
        """What the last step needs to run again (`nonfinite.locate`)."""
        self.step = 0
        self.schedule_step = 0
        self.labels_checked = False
        """Whether a batch's labels were checked for transformers' unshifted ones
        (`batch_check.unshifted_labels`: the first batch of `train_step` / `eval_step`)."""
        self.last_skipped = False
        self.last_z_loss: float | None = None
        """The last training step's output z-loss term (`z_loss`; None without), which its
        backward added to the loss `train_step` returned."""
        self.loss_fn = None
        """The loss hook `megapar.prepare(..., loss_fn=)` set on the stage (`set_loss_fn`), or
        None; with one, batches may carry keys for it."""
        self.tokenizer = None
        self.source_dtype = None
        self.source_dir: str | None = None
        """The transformers directory the model's weights came from (absolute), where they did:
        an export there would replace the only copy of them (`export_hf` refuses)."""
        self.source_generation_config: dict | None = None
        """The generation_config.json of the Hugging Face directory it started from (None:
        none), saved in checkpoints; `export_hf` writes it back."""
        self.on_nonfinite = on_nonfinite
        self.batch_rows: int | None = None
        """The rows every `train_step` batch has: the global batch size `prepare` was given
        (what lr_scale_with_batch scales by and checkpoints record); None: any multiple of
        micro_batch_size x dp."""
        self.batches_from_caller = False
        """Whether `megapar.prepare` made it: its batches are its caller's, so its `cfg`'s data,
        sequence length and (without a megapar schedule) step count are defaults it never
        read, and checkpoints do not record them (`recorded_settings`)."""
        self._guard = api_guard(cfg, self.precision)

    def _start_saver(self, cfg: TrainConfig, mesh: Mesh) -> None:
        """The background checkpoint writer (with `cfg.async_save`), then the host allocator
        set for the training state just built."""
        self.saver = None
        """The background checkpoint writer with `cfg.async_save` (see `save`), else None."""
        if cfg.async_save and not cfg.dry_run:  # its gloo group is made now, collectively
            self.saver = AsyncSaver(mesh, process_group_timeout_s() or cfg.timeout_s, cfg.timeout_s)
        if self.sharded_params is None:
            keep_freed_host_memory()  # from here on: the training state is built
        elif mesh.device.type == "cpu":
            return_freed_host_memory()  # ZeRO-3 frees and makes its units at every use

    @classmethod
    def flags_schedule(cls, cfg: TrainConfig) -> LRScheduler:
        """The `LRScheduler` cfg's lr / min-lr / warmup / decay fields describe (scaled)."""
        lr = cls.scaled_lr(cfg)
        min_lr = cfg.min_lr if lr == cfg.lr else cfg.min_lr * lr / cfg.lr
        return flags_schedule(cfg, lr, min_lr)

    @staticmethod
    def scaled_lr(cfg: TrainConfig) -> float:
        """--lr, times global batch / --lr-scale-with-batch when that is set (linear scaling)."""
        base = getattr(cfg, "lr_scale_with_batch", 0) or 0
        return cfg.lr * cfg.global_batch_size / base if base > 0 else cfg.lr

    def executor_for(self, seq_len: int):
        """The pipeline executor of micro-batches of `seq_len` tokens (one per length, built
        on first use)."""
        if seq_len not in self._executors:
            seq_len_sent = seq_len // self.mesh.cp  # stages exchange this cp rank's tokens
            if self.mesh.sequence_parallel:  # ... and of them this tp rank's slice
                seq_len_sent //= self.mesh.tp
            shape = (self.cfg.micro_batch_size, seq_len_sent, self.config.hidden_size)
            self._executors[seq_len] = PipelineExecutor(
                self.model,
                self.mesh,
                self.cfg.schedule,
                shape,
                timeout_s=self.cfg.timeout_s,
                virtual_stages=self.cfg.virtual_stages,
                wire_dtype=self.wire_dtype,
            )
            self._executors[seq_len].count_comm_wait = (
                self.straggler is not None and self.mesh.device.type == "cuda"
            )
        return self._executors[seq_len]

    # steps ----------------------------------------------------------------------------------
    def run_step(self, micro_batches: list[dict], labelled=None) -> StepResult:
        """One optimizer step on this rank's micro-batches (its share of the global batch).
        `labelled`: the global batch's labelled tokens where known (`TrainStep.step`)."""
        self.executor = self.step_fn.executor = self.executor_for(
            micro_batches[0]["input_ids"].shape[1]
        )
        with self.own_rng():
            return self._run_step(micro_batches, labelled)

    def _run_step(self, micro_batches: list[dict], labelled) -> StepResult:
        set_step(self.step + 1)
        if self._slowdown is not None:
            self._slowdown.begin_step(
                self.step + 1,
                len(micro_batches) * chunks_per_rank(self.cfg.schedule, self.cfg.virtual_stages),
            )
        comm_wait.take()  # what evaluation forwards counted is not this step's
        self.kept = KeptStep(
            micro_batches,
            self.rng_state(),
            self.step + 1,
            self.precision.backward_scale(self.mesh.dp),
        )
        start, cpu = time.perf_counter(), time.thread_time()
        with self.injecting(self.executor, self.step + 1):
            result = self.step_fn.step(micro_batches, self.schedule_step, labelled)
        self.schedule_step += not (result.skipped or result.empty)  # the steps applied
        if self.scheduler is not None:  # the next step's, as a torch scheduler's step() leaves
            self.optimizer.set_lr(self.scheduler.lr(self.schedule_step))
        self.last_skipped = bool(result.skipped)
        self.last_z_loss = result.z_loss
        self.kept.loss_weight = self.step_fn.last_loss_weight
        if self.straggler is not None:
            self.straggler.add(time.perf_counter() - start, self._compute_s(cpu))
        self.step += 1
        set_action(f"done, before step {self.step + 1}")  # read "step S, done, before ..."
        return result

    def _compute_s(self, cpu_start: float) -> float:
        """This rank's compute time in the step just run, in the device's own time: on CUDA
        its compute actions' kernels less their tp / cp collectives' (which wait for the
        slowest rank of the group); on the CPU the CPU time of the thread that computes (time
        blocked in a wait, or taken by other processes of a shared host, is not its work;
        gloo's threads moving data are left out too)."""
        if self.mesh.device.type != "cuda":
            return time.thread_time() - cpu_start
        return max(self.executor.last_compute_s - comm_wait.take(), 0.0)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the next step uses (1.0 in fp32 and bf16): megapar-train's
        `scale`. It halves on an overflow and grows after `loss_scale_window` clean steps."""
        return self.precision.loss_scale

    def stragglers(self) -> StragglerReport | None:
        """Every rank's compute and wait time per step since the last call, and the ranks
        named slow (`megapar.diagnostics.straggler`); None when straggler detection is off
        (`straggler_factor` 0, or one rank) or no step ran. Collective: one all-gather over the
        world; megapar-train calls it once per log interval."""
        return self.straggler.report() if self.straggler is not None else None

    def injecting(self, executor, step: int):
        """A context in which `executor` runs step `step` with `--inject-corrupt` armed."""
        if self.injector is None:
            return contextlib.nullcontext()
        return self.injector.armed(executor, step)

    def locate_nonfinite(self) -> str:
        """Where the first non-finite value of the last step appeared (`nonfinite.locate`: the
        step re-run with per-module checks). Collective."""
        try:
            with self.own_rng():
                return locate(self, self.kept)
        except Exception as exc:  # noqa: BLE001 - the non-finite step stays the error
            return f"re-running it with per-module checks failed: {type(exc).__name__}: {exc}"

    def split(self, batch: dict) -> list[dict]:
        """This dp rank's micro-batches of a global batch, on the mesh device: its rows are
        copied there once per tensor (on a GPU each copy from host memory makes the host
        wait), then cut into micro-batches (views)."""
        size = batch["input_ids"].shape[0]
        plan = BatchPlan(size, self.cfg.micro_batch_size, self.mesh.dp)
        rows = size // self.mesh.dp
        first = self.mesh.dp_rank * rows
        mine = {k: v[first : first + rows].to(self.mesh.device) for k, v in batch.items()}
        return BatchPlan(rows, plan.micro_batch_size, 1).split(mine, 0)

    def train_step(self, batch: dict[str, torch.Tensor]) -> float:
        """One full optimizer step on a global batch; returns its mean loss (the same everywhere).

        `batch`: the *global* batch, the same on every rank, a dict of [G, seq] tensors:
        GPT-2 `input_ids` and `labels` (labels are the next-token ids aligned with input_ids,
        i.e. labels[:, t] = the token after input_ids[:, t]; -100 is ignored; unlike
        transformers, megapar does not shift them), or BERT's MLM fields (input_ids, labels,
        token_type_ids, attention_mask). Each dp rank takes its contiguous G / dp rows and cuts
        them into micro-batches of `micro_batch_size`; G must be a multiple of
        micro_batch_size x dp. The batch is checked first (ids inside the vocabulary, keys the
        model reads; at every call, the same call, step and batch on every rank: one all-reduce of
        six int64s):
        a clear error, not silent nonsense. The loss is Megatron's: the mean over micro-batches
        (and dp ranks) of each micro-batch's mean over its labelled tokens, so with unevenly
        spread -100 labels it differs from one token mean over the whole batch (and depends on the
        micro-batch size; a micro-batch with no labelled token counts as 0).

        With `loss_mean="token"` (`prepare(..., loss_mean="token")`) it is instead the sum over
        every labelled token of the batch over their count, as one forward of the whole batch
        with reduction="mean" would give, whatever the micro-batch size and layout.

        A step whose loss or gradients are not finite is never applied (weights and optimizer
        state stay as they were; the step is counted in `step`, and the learning-rate schedule
        does not advance: `schedule_step`). With `on_nonfinite="raise"`
        (`prepare`'s default) every rank then raises `megapar.faults.stop.NonFiniteError`
        naming the step and what was not finite; in fp16, where the loss scaler skips steps
        whose gradients overflow, such a step with a finite loss does not count: only
        `max_nonfinite_steps` (default 5) non-finite losses (or overflows at a static
        `loss_scale`) in a row, or an overflow at the loss scale's floor, raise, as in
        megapar-train. With "skip" the non-finite loss is returned.
        """
        self.in_its_group("train_step")
        if self.scheduler is not None and "initial_lr" in self.optimizer.param_groups[0]:
            raise ValueError(  # torch's LRScheduler sets initial_lr; the same on every rank
                "train_step: engine.optimizer has a torch LR scheduler, but "
                "megapar.prepare(lr_schedule=...) sets the learning rate at every step, "
                "overriding it; use one of them: drop lr_schedule= or the torch scheduler"
            )
        batch = eod_masked(self.cfg, self._checked(batch, "train_step"))
        if self.saver is not None:  # a background save's outcome, agreed by every rank
            self.saver.poll()
        result = self.run_step(self.split(batch), self._labelled(batch))
        if self.on_nonfinite == "raise":
            self._guard.observe(
                self.step,
                result.loss,
                result.grad_norm,
                result.skipped,
                result.loss_scale,
                self.locate_nonfinite,
            )
        _returned("train_step")
        return result.loss

    def _labelled(self, batch: dict):
        """Under --loss-mean token, the global batch's labelled tokens (labels not -100),
        which every rank holds: an int counted on the host for a batch in host memory, else a
        tensor on its device (no wait for the device); None otherwise."""
        if self.cfg.loss_mean != "token":
            return None
        count = (batch["labels"] != -100).sum()
        return int(count) if count.device.type == "cpu" else count

    def _checked(self, batch, what: str) -> dict:
        if what == "train_step":
            set_step(self.step + 1)  # the step this batch is for
        set_action(f"{what}: checking the batch")
        batch = check_batch(batch, self.config, what, extra=self.loss_fn is not None)
        mesh = self.mesh
        check_length(batch["input_ids"].shape[1], mesh.cp, mesh.tp, mesh.sequence_parallel)
        step = self.step + 1 if what == "train_step" else self.step  # the one it is for
        same_call_on_every_rank(what, step, self.mesh.device, batch)
        rows = batch["input_ids"].shape[0]
        if what == "train_step" and self.batch_rows is not None and rows != self.batch_rows:
            raise ValueError(
                f"train_step: the batch has {counted(rows, 'row')} but megapar.prepare was given "
                f"global_batch_size={self.batch_rows} (the batch size the learning rate is "
                "scaled by and checkpoints record); give batches of "
                f"{counted(self.batch_rows, 'row')}, "
                f"or drop global_batch_size"
            )
        try:  # `split`'s cut, refused here with the others, before the one-time labels check
            BatchPlan(rows, self.cfg.micro_batch_size, self.mesh.dp)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        if not self.labels_checked and "labels" in batch:  # a batch refused does not count
            self.labels_checked = True
            if unshifted_labels(batch, self.config) and self.mesh.rank == 0:
                warnings.warn(UNSHIFTED_WARNING.format(what=what), stacklevel=3)
        return batch

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor]) -> float:
        """Mean loss of a global batch (same format as `train_step`, the same mean), without
        training."""
        self.in_its_group("eval_step")
        batch = eod_masked(self.cfg, self._checked(batch, "eval_step"))
        micro = self.split(batch)
        executor = self.executor_for(micro[0]["input_ids"].shape[1])
        labelled = self._labelled(batch)
        weight = None if labelled is None else loss_weight(micro, self.mesh, labelled)
        self.model.eval()
        try:
            with self.precision.autocast():
                loss = executor.run(micro, forward_only=True, loss_weight=weight)
        finally:
            self.model.train()
        loss = dp_mean(float(loss), self.mesh)
        _returned("eval_step")
        return loss

    # checkpoints ----------------------------------------------------------------------------
    def recorded_settings(self) -> dict:
        """This engine's settings as `megapar-train --load` takes those it is not given: its
        `TrainConfig` with local paths absolute (the resume may start in another directory),
        and the learning-rate schedule it runs where that is not the flags' own (constant
        without a megapar `LRScheduler`: a torch scheduler on `engine.optimizer` is the
        user's)."""
        return recorded_settings(self)

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        """Checkpoint into `path/step_XXXXXXXX` (megapar's format: convertible between layouts
        with megapar-convert, exact resume with `load`). `extra`: JSON-able values of yours
        (e.g. a torch LR scheduler's state_dict()), returned by `load`. Collective.

        With `async_save` (`prepare(..., async_save=True)`, `megapar-train --async-save`) the
        state is copied to host memory and written in the background: `save` returns the step
        directory it will publish once every rank's files are written (``latest`` moves then);
        a save that finds the previous write still in flight waits for it; `train_step` checks
        at every step whether the write is done (and raises on every rank if it failed);
        `wait_save` waits for it (and a write still in flight when the process's work ends is
        waited for before it exits: `megapar.launch`'s workers, torchrun's ranks)."""
        _check_path("engine.save", path)
        self.in_its_group("engine.save")
        same_call_on_every_rank("engine.save", self.step, self.mesh.device)
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(
                f"engine.save(extra=...) takes a dict of JSON-able values (e.g. "
                f"{{'sched': sched.state_dict()}}), got a {type(extra).__name__}"
            )
        self._refuse_newer_steps(path)
        meta = checkpoint_meta(self, extra)
        set_action(f"saving the checkpoint of step {self.step} to {path}")
        if self.saver is not None:
            out = self._save_in_background(path, meta)
        else:
            out = save_checkpoint(
                path,
                self.step,
                self.saved_model(),
                self.mesh,
                self.optimizer.state_tensors(),
                meta,
                self.rng_state(),
            )
        _returned("engine.save")
        return out

    def _refuse_newer_steps(self, path: str | Path) -> None:
        """ValueError on every rank (rank 0 looks, as it publishes) where `path` holds steps
        newer than this engine's: the save would point ``latest`` back at this step and leave
        those of another run (or of this one's future) mixed with it, as megapar-train refuses
        without --overwrite-newer."""
        newer = steps_after(path, self.step) if self.mesh.rank == 0 else None
        found = ", ".join(newer[-3:]) if newer else ""
        found = broadcast_text(found, self.mesh)
        if found:
            raise ValueError(
                f"engine.save: {path} holds {found}, newer than this engine's step "
                f"{self.step}: saving would move latest back and mix those with this run's "
                f"steps; save into another directory, or remove those steps first"
            )

    def params_whole(self):
        """A context in which the stage's parameters are whole and exact on this rank, to read
        or write them (loading weights): under ZeRO-3 every unit is gathered inside and each
        rank keeps its shards of what they hold on exit (collective over dp x cp); under
        ZeRO-1 / 2 the 16-bit gathered weights made exact first (`exact_params`); otherwise
        nothing."""
        self.in_its_group("engine.params_whole")
        same_call_on_every_rank("engine.params_whole", self.step, self.mesh.device)
        if self.sharded_params is None:
            self.exact_params()
            return contextlib.nullcontext()
        return self.sharded_params.whole()

    def exact_params(self) -> None:
        """Under ZeRO-1 / 2 in bf16 / fp16, where the last step all-gathered the blocks'
        linear weights in 16 bits (other ranks' slices of them hold autocast's rounding of
        their values, which is all a step or an evaluation under autocast reads), gather them
        in fp32 again so every rank's parameters are the exact fp32 weights (collective over
        dp x cp; nothing to do, no communication, otherwise). Checkpoints, exports and
        `params_whole` call it."""
        exact = getattr(self.optimizer, "exact_params", None)
        if exact is not None:
            exact()

    def held_weights(self) -> list[torch.Tensor]:
        """The weights this rank holds between steps: the parameters (exact: `exact_params`,
        collective), or under ZeRO-3 its shards of them (the gathered parameters' storage is
        freed then: reading them is reading freed memory)."""
        if self.sharded_params is None:
            self.exact_params()
            return list(self.model.parameters())
        return self.sharded_params.held_weights()

    def saved_model(self):
        """What a checkpoint reads the weights from: the stage (its weights made exact:
        `exact_params`; collective), or under ZeRO-3 host copies
        of its parameters gathered a unit at a time (`HostStage`; collective over dp x cp, and
        the expert-data-parallel group under ep): every parameter on the writer (dp rank 0, cp
        rank 0), and under ep the experts on the ranks of its ep group too, which gather them
        over ep (`expert_blocks`)."""
        if self.sharded_params is None:
            self.exact_params()
            return self.model
        writer = self.mesh.dp_rank == 0 and self.mesh.cp_rank == 0
        experts = writer or gathers_experts(self.mesh)
        return HostStage(self.model, self.sharded_params.host_params(writer, experts))

    def _save_in_background(self, path, meta: dict) -> Path:
        assert self.saver is not None  # called with async_save only
        self.saver.wait()  # at most one write in flight
        set_action(f"copying the checkpoint of step {self.step} to host memory")
        optim = self.optimizer.state_tensors(copy=False)  # copied into the saver's buffers
        gathered = getattr(self.optimizer, "sharded", False)  # ZeRO-1: fresh host copies
        host: SavedState | CheckpointError
        try:
            state = capture(self.step, self.saved_model(), self.mesh, optim, meta, self.rng_state())
            tensors = state.shard[1] if state.shard is not None else {}
            private = frozenset(k for k in tensors if gathered and k.startswith("optim/"))
            host = self.saver.host_copy(state, private)
        except CheckpointError as exc:
            host = exc  # raised on every rank when the write ends
        return self.saver.start(path, host, self.step)

    def wait_save(self) -> Path | None:
        """Wait for the background save in flight (with `async_save`) and return the step
        directory it published (None: none was in flight); raises CheckpointError on every
        rank when it failed. Collective."""
        if self.saver is None:  # nothing to wait for: no collective
            return None
        same_call_on_every_rank("engine.wait_save", self.step, self.mesh.device)
        return self.saver.wait()

    def poll_save(self) -> Path | None:
        """The step directory a background save has published since the last call, once every
        rank's writer is done (None: none, or still writing); raises CheckpointError on every
        rank when it failed. Collective with `async_save` (the calls' agreement, and one small
        all-reduce while a write is in flight)."""
        if self.saver is None:  # no background saves: no collective
            return None
        same_call_on_every_rank("engine.poll_save", self.step, self.mesh.device)
        return self.saver.poll()

    def load(self, path: str | Path, verify: str = "sha256", what: str = "engine.load"):
        """Restore weights, optimizer, loss scale, LR schedule, RNG and step from a checkpoint
        (any layout: resharded on load). The checkpoint's megapar schedule replaces the
        engine's, or becomes it when `prepare` was given none and no torch scheduler drives
        `optimizer`. Returns the checkpoint's `LoadedState` (its `.meta` holds what
        `save(extra=...)` stored). `verify`: how each rank checks the files it reads
        (`load_checkpoint`: "sha256", "size" where every file was hashed before, or "none");
        a file that fails it is refused in one line naming it and the fix, and under torchrun
        / Slurm every rank then raises, naming the one that failed (`load_everywhere`; `what`:
        where `path` was given, for the line)."""

        _check_path("engine.load", path)
        if verify not in VERIFY_MODES:
            raise ValueError(
                f"engine.load: verify={verify!r} is not one of "
                f"{', '.join(map(repr, VERIFY_MODES))}; leave it out to hash every file read"
            )
        self.in_its_group("engine.load")
        same_call_on_every_rank("engine.load", self.step, self.mesh.device)
        if self.saver is not None:  # its own background save of `path` may be in flight
            self.saver.wait()
        with self.params_whole():  # ZeRO-3: loaded into the gathered units
            set_action(f"loading the checkpoint {path} ({what})")
            state = load_everywhere(
                str(path),
                lambda: load_checkpoint(path, self.model, self.mesh, verify=verify),
                self.mesh.device,
                what,
            )
        if state.optim_tensors:
            self.optimizer.load_state_tensors(state.optim_tensors)
        restore_meta(self, state.meta)
        if state.rng:
            self.set_rng_state(state.rng)
        set_step(self.step)
        read = zlib.crc32(json.dumps(state.files, sort_keys=True).encode())
        same_call_on_every_rank("engine.load", self.step, self.mesh.device, read=read)
        _returned("engine.load")
        return state

    def export_hf(
        self,
        path: str | Path,
        tokenizer=None,
        dtype: str | torch.dtype | None = None,
        allow_other_tokenizer: bool = False,
    ) -> Path:
        """Write config.json + model.safetensors into `path` (GPT2LMHeadModel /
        BertForMaskedLM / LlamaForCausalLM `from_pretrained` loads it) and the tokenizer in
        transformers' format, so `AutoTokenizer.from_pretrained(path)` loads it: `tokenizer`
        (a `load_tokenizer` spec: "gpt2", a .model file, a transformers directory ...), else
        the engine's (megapar-train's data tokenizer, or the directory's own of a model `prepare`
        got from `from_pretrained(DIR)`; with none, a warning and no tokenizer);
        a `tokenizer` whose files are not those of the engine's is refused unless
        `allow_other_tokenizer`.
        `dtype`: float32, bfloat16 or float16, as a name or a torch.dtype (default: the dtype
        of the transformers model given to `prepare`, else float32). Replaces those files,
        leaves anything else there alone; refuses the directory the weights came from
        (`source_dir`). Collective; rank 0 writes (`training.export`)."""
        _check_path("engine.export_hf", path)
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(  # on every rank: a transformers tokenizer object, say
                f"engine.export_hf: tokenizer takes a tokenizer's name or path "
                f"({TOKENIZER_SPECS}), not a value of type {type(tokenizer).__name__}"
            )
        if self.source_dir and Path(path).expanduser().resolve() == Path(self.source_dir):
            raise ValueError(  # on every rank: the one copy of the weights it started from
                f"engine.export_hf: {path} is the transformers model this engine started from; "
                f"export to another directory (the export would replace its weights with the "
                f"trained ones)"
            )
        self.in_its_group("engine.export_hf")
        same_call_on_every_rank("engine.export_hf", self.step, self.mesh.device)
        if isinstance(dtype, torch.dtype):  # as transformers' from_pretrained(dtype=) takes it
            dtype = str(dtype).removeprefix("torch.")
        if dtype is not None and export_dtype(dtype) not in EXPORT_DTYPES:
            raise ValueError(  # on every rank, before the weights are gathered and written
                f"engine.export_hf: dtype={dtype!r} is not one of {', '.join(EXPORT_DTYPES)} "
                f"(or {', '.join(DTYPE_ALIASES)}, or the torch.dtype)"
            )
        path = export_engine(self, path, tokenizer, dtype, allow_other_tokenizer)
        _returned("engine.export_hf")
        return path

    def in_its_group(self, call: str) -> None:
        """RuntimeError in one line, on every rank that calls, unless the default process
        group this engine was prepared in is still the one set up (after
        ``torch.distributed.destroy_process_group()`` its groups are gone: its collectives
        would fail or, where they are skipped without a group, train unchecked)."""
        if self.world is not None and dist.group.WORLD is not self.world:
            raise RuntimeError(
                f"{call}: the process group this engine was prepared in was destroyed "
                f"(torch.distributed.destroy_process_group()), and an engine works only in "
                f"its own; call megapar.prepare again for a new engine (in a megapar.launch "
                f"function it joins a new group; engine.load a checkpoint to continue)"
            )

    # RNG ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def own_rng(self):
        """A context in which torch's default generators (CPU, and the rank's GPU) hold the
        engine's stream, put back as the caller's on exit: the engine's dropout masks do not
        depend on what the caller's code draws between steps (or on another engine), and its
        steps draw nothing from the caller's stream. Re-entrant."""
        if self._rng is None:  # already inside
            yield
            return
        callers = default_rng_state(self.mesh.device)
        set_default_rng_state(self._rng, self.mesh.device)
        self._rng = None
        try:
            yield
        finally:
            self._rng = default_rng_state(self.mesh.device)
            set_default_rng_state(callers, self.mesh.device)

    def rng_state(self) -> dict[str, torch.Tensor]:
        """This rank's RNG state as checkpoints keep it (`training.rng`): the engine's own
        stream (`own_rng`) and the tp stream."""
        with self.own_rng():
            return rng_state(self.model, self.mesh.device)

    def set_rng_state(self, rng: dict[str, torch.Tensor]) -> None:
        """Restore an `rng_state` (into the engine's own stream: `own_rng`)."""
        with self.own_rng():
            set_rng_state(self.model, self.mesh.device, rng)


def _check_path(call: str, path) -> None:
    """TypeError in one line (on every rank, before any collective) unless `path` is a
    directory's path: a str or an os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{call}(path): path must be a directory's path, a str or a pathlib.Path, got "
            f"{type(path).__name__} {path!r:.60}"
        )


def _returned(call: str) -> None:
    """The rank's status (`megapar.faults.status`) once an API call is done: the caller's own
    code runs until the next one, and a failure there is not megapar's last action."""
    set_action(f"{call} returned; in the caller's code")


def dp_mean(value: float, mesh: Mesh) -> float:
    """Mean of a per-rank float over the dp group."""
    t = torch.tensor([value], dtype=torch.float64, device=mesh.device)
    return all_reduce(t, mesh.dp_group).item() / mesh.dp
