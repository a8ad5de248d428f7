"""The training loop one rank runs: build everything, resume, step, evaluate, log, save.

Read top to bottom: `train()`, one worker's entry, is `Trainer(cfg, plan).run()`.
`Trainer.__init__` builds the `Engine` (the mesh, the model stage, the pipeline executor and the
optimizer: `engine.py`, `engine_parts.py`) and the data, and resumes from a checkpoint if asked;
`Trainer.run` loops over optimizer steps. Every rank runs the same loop (same step count, same
collectives); only global rank 0 logs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from megapar.checkpoint.convert import recorded_tokenizer
from megapar.checkpoint.format import CheckpointError
from megapar.checkpoint.hf import HFReader, load_hf_weights
from megapar.checkpoint.publish import has_checkpoint, remove_steps_before_latest
from megapar.data import IndexedDataset
from megapar.data.blended import BlendedDataset
from megapar.data.tokenizers import forget_loaded
from megapar.device import peak_tflops
from megapar.diagnostics.replay import StepRecorder, StepReplay, find_record, load_record
from megapar.expert_parallel import is_expert
from megapar.faults import progress
from megapar.faults.blame import consequential, stopped_siblings, without_gloo_noise
from megapar.faults.processes import launcher_alive
from megapar.faults.status import set_action
from megapar.faults.stop import (
    NonFiniteError,
    NonFiniteGuard,
    RunStopped,
    StopRequests,
    params_finite,
)
from megapar.launcher import error_line, launched_local_size, under_launcher
from megapar.mesh import Layout, Mesh, all_reduce
from megapar.models.config import config_from_dict
from megapar.models.flops import training_flops_per_token
from megapar.optim import LRScheduler
from megapar.optim.scheduler import changed_fields, resume_change
from megapar.pipeline.partition import split_phrase
from megapar.pipeline.placement import chunks_per_rank, placement_of
from megapar.pipeline.timeline import bubble_stats
from megapar.pipeline.trace import gather_timeline
from megapar.tensor_parallel.partition import local_size
from megapar.training.config import TrainConfig
from megapar.training.data import (
    DataPlan,
    batches,
    build_datasets,
    continue_order,
    make_sampler,
    planned_samples,
)
from megapar.training.documents import eod_masked
from megapar.training.engine import Engine
from megapar.training.engine import dp_mean as _dp_mean
from megapar.training.engine_parts import fp8_note
from megapar.training.logging import (
    MetricsLogger,
    NullLogger,
    format_line,
    peak_memory_mb,
    perplexity,
)
from megapar.training.profiling import StepProfiler, parse_steps
from megapar.training.resume import resume_phrase, rng_notes
from megapar.training.step import loss_weight
from megapar.training.tokenizer_checks import data_tokenizer_spec
from megapar.training.validate import explicit, given_now
from megapar.wording import and_list, counted


class TrainingError(RuntimeError):
    """A failure on one rank, naming the rank and the step."""

    no_traceback: bool = False
    """Set from the exception it wraps: a clean stop is reported in one line."""


def _num_params(model, mesh: Mesh) -> tuple[int, int]:
    """(parameters of the model, as transformers and megapar-convert --info count them;
    parameters allocated, the vocabulary padded for the tp split included), each counted once
    across tp and pp (and experts over ep: each ep rank holds E / ep of them)."""

    own = [p for p in model.parameters() if not hasattr(p, "tied_to")]

    def ep(p) -> int:
        return mesh.ep if is_expert(p) else 1

    allocated = sum(p.numel() * ep(p) for p in own if p.tp_dim is not None or mesh.tp_rank == 0)
    real = (
        sum(math.prod(getattr(p, "full_shape", p.shape)) * ep(p) for p in own)
        if mesh.tp_rank == 0
        else 0
    )
    t = torch.tensor([real, allocated], dtype=torch.float64, device=mesh.device)
    real, allocated = (int(x) for x in all_reduce(t, mesh.mp_group).tolist())
    return real, allocated


def batch_phrase(global_batch: int, seq_len: int, dp: int, micro_batches: int, size: int) -> str:
    """How the start-up line splits a step's global batch, its factors named so they multiply
    back to it: "global batch 8 sequences of 32 tokens: 2 dp ranks x 2 micro-batches per step x
    micro-batch size 2" (without "dp ranks x" at dp 1)."""
    ranks = f"{dp} dp ranks x " if dp > 1 else ""
    return (
        f"global batch {counted(global_batch, 'sequence')} of {seq_len} tokens: {ranks}"
        f"{counted(micro_batches, 'micro-batch', 'micro-batches')} per step x micro-batch "
        f"size {size}"
    )


def stages_phrase(cfg: TrainConfig, num_layers: int, pp: int) -> str:
    """The start-up line's blocks per stage (or model chunk) where --decoder-first/last-pipeline-
    num-layers or --account-for-embedding/loss-in-pipeline-split cut them unevenly ("stages of
    1 + 3 blocks (--decoder-first-pipeline-num-layers 1)", `split_phrase`); "" otherwise."""
    if pp == 1:
        return ""
    per_rank = chunks_per_rank(cfg.schedule, cfg.virtual_stages)
    return split_phrase(num_layers, pp, cfg.pipeline_split, per_rank, placement_of(cfg.schedule))


class Trainer:
    """Everything one rank needs for a run, built from a TrainConfig and a DataPlan."""

    def __init__(self, cfg: TrainConfig, plan: DataPlan):
        self.cfg = cfg
        self.config = config_from_dict(plan.model_config)
        self.engine = engine = Engine(cfg, self.config)
        self.mesh = mesh = engine.mesh
        self.model, self.executor, self.precision = engine.model, engine.executor, engine.precision
        self.optimizer, self.scheduler = engine.optimizer, engine.scheduler
        assert plan.prefix is not None  # only a dry run (which trains nothing) has no data
        self.train_ds, self.val_ds = build_datasets(cfg, plan.prefix, self.config.model_type)
        self.data_fingerprint = plan.data_fingerprint  # recorded in checkpoints

        # checkpoints record the data's tokenizer, so megapar-convert --to-hf exports it
        engine.tokenizer = recorded_tokenizer(
            data_tokenizer_spec(
                cfg.data, cfg.tokenizer, IndexedDataset(plan.prefix, cfg.tokenizer).tokenizer_spec
            )
        )
        forget_loaded()  # the run's tokenizer, loaded once for its planning and datasets
        self.sampler = make_sampler(cfg, self.train_ds, mesh.dp, mesh.dp_rank)
        self.notes: list[str] = (
            [fp8_note(engine.fp8_summary, cfg, engine.config, mesh.tp)]
            if engine.fp8_summary
            else []
        )
        resume = bool(cfg.load and (cfg.load_strict or has_checkpoint(cfg.load)))
        if cfg.load and not resume:
            self.notes.append(
                f"--load {cfg.load}: no checkpoint there yet, starting from scratch "
                f"(--load-strict makes this an error)"
            )
        if cfg.from_hf and not resume:
            self._load_hf(cfg.from_hf)
        self.resumed = resume
        self.wandb_run: dict | None = None
        """The W&B run the checkpoint resumed from recorded (`MetricsLogger.checkpoint_meta`)."""
        self.skipped_since_line = 0
        """Steps skipped for inf / nan since the last console line (`log_step`)."""
        if resume:
            assert cfg.load is not None  # resume: --load names a checkpoint
            self._resume(cfg.load, plan.checked_load, plan.load_verify)
        if isinstance(self.train_ds, BlendedDataset):  # the proportions this run will see: its
            # steps from the sampler's position (a resumed run's, where the checkpoint left it)
            planned = planned_samples(self.sampler, cfg.max_steps - self.step)
            self.notes.append(self.train_ds.describe(planned))
        self.n_params, allocated = _num_params(self.model, mesh)
        self.flops_per_token = training_flops_per_token(self.config, cfg.seq_len)
        """MFU's numerator per token: the model's matmul FLOPs (`megapar.models.flops`, what
        megapar-plan's MFU counts too)."""
        self.allocated_params = allocated
        known = peak_tflops(mesh.device, cfg.precision, cfg.tf32)
        self.peak_tflops = (
            cfg.peak_tflops if "peak_tflops" in explicit(cfg) or known is None else known
        )
        """MFU's denominator per device: --peak-tflops, else the GPU's datasheet figure."""

    @property
    def step(self) -> int:
        return self.engine.step

    # -- start ------------------------------------------------------------------------------
    def _labels(self, batch: dict) -> dict:
        """A collated micro-batch with --eod-mask-loss applied to its labels (`eod_masked`)."""
        return eod_masked(self.cfg, batch)

    def _load_hf(self, path: str) -> None:
        reader = HFReader(path)
        with self.engine.params_whole():
            missing = load_hf_weights(self.model, reader)
        self.engine.source_dtype = reader.dtype  # exports write the model's own dtype back
        self.engine.source_generation_config = reader.generation_config  # and its generation
        self.engine.source_dir = str(reader.path.resolve())  # an export never writes there
        note = f"loaded weights from {path}"
        if missing:
            note += f"; initialised from --seed (not in the checkpoint): {', '.join(missing)}"
        self.notes.append(note)

    def _resume(self, path: str, checked: str | None = None, verify: str = "sha256") -> None:
        """Restore the run from --load `path`; `checked`: its step directory whose files the
        start-up checked (`DataPlan.checked_load`), loaded with the files read checked as
        `verify` says (`DataPlan.load_verify`; without `checked`, each rank hashes the files it
        reads). A file that fails this rank's check is refused in one line naming the rank, the
        file and the fix, and under torchrun / Slurm every other rank with it
        (`Engine.load`)."""
        planned = self.scheduler.state_dict() if self.scheduler is not None else None
        load = checked or path
        state = self.engine.load(load, verify=verify if checked else "sha256", what="--load")
        if planned is not None and self.scheduler.state_dict() != planned:
            # the flags (or, where not given, the checkpoint's saved flags) set the schedule:
            # e.g. a raised --max-steps stretches the decay instead of staying at --min-lr
            saved = self.scheduler.state_dict()
            self.scheduler.load_state_dict(planned)
            self.notes.append(
                "learning-rate schedule follows the flags, not the checkpoint: "
                + changed_fields(saved, planned)
                + resume_change(
                    LRScheduler(**saved), self.scheduler, self.step, self.engine.schedule_step
                )
            )
        self.notes.extend(
            continue_order(self.cfg, self.sampler, state.meta.get("sampler"), self.step)
        )
        self.notes.extend(self._restart_loss_scale(state.meta.get("scaler")))
        self.wandb_run = state.meta.get("wandb_run")
        trained = state.meta.get("train_config") or {}
        how = resume_phrase(state.layout, self.mesh.layout, state.resharded, trained, self.cfg)
        self.notes.append(f"resumed from {path} at step {self.step} ({how})")
        self.notes.extend(rng_notes(state.notes, self.config.draws_dropout))

    def _restart_loss_scale(self, saved: dict | None) -> list[str]:
        """--initial-loss-scale given to a resumed fp16 run, other than the checkpoint's run
        had (`saved`: its precision state, whose scale the engine's load restored): its scaler
        restarts there (with its hysteresis and growth count), not at the scale the checkpoint's
        had reached, which a resume keeps, as Megatron-LM's does, where the flag is not given
        or is the same (a requeued job's command line); a note where the scale changes."""
        scaler = self.engine.precision.scaler
        given = given_now(self.cfg)
        if scaler is None or not scaler.dynamic or not saved or "initial_loss_scale" not in given:
            return []
        if (saved.get("scaler") or {}).get("init_scale") == self.cfg.initial_loss_scale:
            return []  # the same run's flag again
        # the checkpoint's (the engine's load raised it to a higher --min-loss-scale)
        kept = (saved.get("scaler") or {}).get("scale")
        reached = float(kept) if kept is not None else float(scaler.scale or 0.0)
        scaler.scale = max(scaler.min_scale, float(self.cfg.initial_loss_scale))
        scaler.clean_steps, scaler.hysteresis_left = 0, scaler.hysteresis
        if scaler.scale == reached:
            return []
        return [
            f"the fp16 loss scale restarts at --initial-loss-scale {scaler.scale:.10g}, not at the "
            f"checkpoint's {reached:.10g} (which a resume without the flag continues)"
        ]

    # -- save / eval -------------------------------------------------------------------------
    def save(self, logger) -> Path:
        """Save the current step into --save (with --async-save: start its background write,
        after waiting for the one in flight) and log it."""
        if not launcher_alive():
            raise RunStopped(f"the launcher is gone: step {self.step} not saved")
        if not params_finite(self.engine.held_weights()):
            raise NonFiniteError(
                f"weights are not finite at step {self.step}: checkpoint not "
                f"written (the last one, if any, is intact)"
            )
        if self.engine.saver is not None:  # at most one write in flight
            self.log_saved(logger, self.engine.wait_save())
        assert self.cfg.save is not None  # called only with --save
        path = self.engine.save(
            self.cfg.save,
            {
                "consumed_samples": self.sampler.consumed_samples,
                "sampler": self.sampler.state_dict(),
                **({"data_fingerprint": self.data_fingerprint} if self.data_fingerprint else {}),
                **logger.checkpoint_meta(),  # rank 0's (the one written): its W&B run
            },
        )
        if self.engine.saver is not None:
            logger.message(f"saving {path} in the background")
        else:
            logger.message(f"saved {path}")
            self.keep_latest(logger)
        return path

    def log_saved(self, logger, published: Path | None) -> None:
        """Log a checkpoint a background save has published, and apply --keep-latest-k."""
        if published is not None:
            logger.message(f"saved {published}")
            self.keep_latest(logger)

    def keep_latest(self, logger) -> None:
        """--keep-latest-k K: rank 0 deletes the --save steps older than the newest K (after a
        step is published, so the newest K are complete)."""
        if self.cfg.keep_latest_k and self.cfg.save and self.mesh.rank == 0:
            removed = remove_steps_before_latest(self.cfg.save, self.cfg.keep_latest_k)
            if removed:
                logger.message(
                    f"removed {', '.join(removed)} (--keep-latest-k {self.cfg.keep_latest_k})"
                )

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the first --eval-steps global batches of the validation split, as
        --loss-mean says: the mean of the batches' means ("microbatch"), or the mean over all
        their labelled tokens ("token")."""
        if self.val_ds is None or len(self.val_ds) < self.cfg.global_batch_size:
            return None
        sampler = make_sampler(
            self.cfg, self.val_ds, self.mesh.dp, self.mesh.dp_rank, shuffle=False
        )
        losses, counts = [], []
        self.model.eval()
        for i, micro_batches in enumerate(
            batches(self.val_ds, sampler, self.mesh.device, self._labels)
        ):
            if i >= min(self.cfg.eval_steps, sampler.batches_per_epoch):
                break
            weight, count = None, 1
            if self.cfg.loss_mean == "token":  # the batch's token mean, weighted by its tokens
                count = _labelled_over_dp(micro_batches, self.mesh)
                weight = loss_weight(micro_batches, self.mesh, count)
            with self.precision.autocast():
                loss = self.executor.run(micro_batches, forward_only=True, loss_weight=weight)
            losses.append(_dp_mean(float(loss), self.mesh))
            counts.append(count)
        self.model.train()
        if not any(counts):  # no labelled token in any batch: each batch's mean is 0
            return 0.0
        return sum(loss * n for loss, n in zip(losses, counts)) / sum(counts)

    # -- the loop ----------------------------------------------------------------------------
    def record(self) -> dict | None:
        """The record --replay compares with (None: none found)."""
        assert self.cfg.load is not None  # --replay re-runs a step from --load's checkpoint
        path = self.cfg.replay_against or find_record(self.cfg.load, self.cfg.replay)
        return load_record(path) if path else None

    def bubble(self) -> float:
        """The idle share of the last step's schedule, averaged over the stages (collective over
        pp): the time from the first forward to the loss in which a stage ran no forward /
        backward. With pp > 1 that is the pipeline bubble (plus any gradient reduction the
        backward did not hide); at pp 1 there is no bubble, and it is the wait after the last
        backward for the data-parallel (x cp) gradient reduction (and for slower dp ranks),
        logged as `grad_reduce_wait`."""

        timeline = gather_timeline(self.executor.last_timeline, self.mesh)
        if timeline is None or not timeline.events:  # not pp rank 0, or tracing was off
            return float("nan")
        return bubble_stats(timeline)["measured_bubble"]

    def announce(self, logger) -> None:
        """The run's first lines: the model, its parameters, the layout and the batch; then
        the notes of the launching process."""
        cfg, mesh = self.cfg, self.mesh
        vocab = self.config.vocab_size
        padded = mesh.tp * local_size(vocab, mesh.tp, self.config.make_vocab_size_divisible_by)
        multiple = self.config.make_vocab_size_divisible_by
        notes = []
        idle = getattr(self.config, "idle_expert_params", 0)
        if idle:  # a mixture of experts: the parameters a token's routed experts use
            notes.append(
                f"{self.n_params - idle:,} active per token: {self.config.num_experts_per_tok} "
                f"of {self.config.num_local_experts} experts"
            )
        if self.allocated_params != self.n_params:
            notes.append(
                f"{self.allocated_params:,} allocated: the vocabulary of {vocab:,} padded "
                f"to {padded:,}, a multiple of {multiple} x tp"
            )
        sampler = self.sampler
        batch = batch_phrase(
            cfg.global_batch_size,
            cfg.seq_len,
            mesh.dp,
            sampler.micro_batches_per_rank,
            sampler.micro_batch_size,
        )
        stages = stages_phrase(cfg, self.config.num_layers, mesh.pp)
        logger.message(
            f"megapar: {self.config.model_type} with {self.n_params:,} parameters"
            + (f" ({'; '.join(notes)})" if notes else "")
            + f", {mesh.layout}{nodes_phrase(mesh.layout)}, "
            + (f"{stages}, " if stages else "")
            + batch
        )
        spans = tp_across_nodes(mesh.layout, launched_local_size()) if under_launcher() else ""
        if spans:
            logger.message(f"megapar: note: {spans}")
        for note in self.notes:
            logger.message(note)

    def watched_step(self, at: int, micro_batches, logger):
        """Step `at` run under `--record-step` (recorded) or `--replay` (compared with the
        record and reported); returns its result, or None after a replay (the run ends)."""
        cfg = self.cfg
        watch: StepReplay | StepRecorder = (
            StepReplay(self.engine, cfg.global_batch_size, self.record())
            if at == cfg.replay
            else StepRecorder(self.engine, cfg.global_batch_size)
        )
        with watch.trace.attached(self.engine.executor_for(cfg.seq_len)):
            result = self.engine.run_step(micro_batches)
        if at == cfg.replay:
            assert isinstance(watch, StepReplay)
            logger.end_progress()  # the bar would stay below the report, at "step - 1 of N"
            logger.message(watch.report() or "")
            return None
        assert isinstance(watch, StepRecorder)
        assert cfg.save is not None  # --record-step needs --save (check_settings)
        logger.message(f"recorded step {at}: {watch.write(cfg.save, at)}")
        return result

    def metrics(self, result, elapsed: float, logging_step: bool) -> dict:
        """A step's metrics; on a logging step also the bubble (or the dp wait), the peak
        memory and the straggler fields (collective), on an evaluation step the validation
        loss (collective)."""
        cfg, mesh = self.cfg, self.mesh
        tokens_per_s = cfg.global_batch_size * cfg.seq_len / elapsed
        tflops = self.flops_per_token * tokens_per_s / 1e12
        metrics = {
            "loss": float(result.loss),
            "lr": result.lr,
            "grad_norm": float(result.grad_norm),
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed,
            "tflops": tflops,
            "tflops_per_rank": tflops / mesh.layout.world_size,
            "mfu": tflops / (self.peak_tflops * mesh.layout.world_size),
            "skipped": bool(result.skipped),
            "loss_scale": float(result.loss_scale),
        }
        if result.empty:  # no labelled token: nothing applied (its loss 0 is no loss)
            metrics["no_labelled_tokens"] = True
        if result.z_loss is not None:  # --z-loss: its term, beside the cross-entropy
            metrics["z_loss"] = result.z_loss
        if result.router is not None:  # a mixture of experts: the step's router statistics
            metrics.update({f"moe_{k}": v for k, v in result.router.items()})
        if logging_step:
            if mesh.pp > 1:
                metrics["bubble"] = self.bubble()
            elif mesh.dp * mesh.cp > 1:  # no pipeline: the idle share is this wait
                metrics["grad_reduce_wait"] = self.bubble()
            metrics["peak_mem_mb"] = peak_memory_mb(mesh.device)
            times = self.engine.stragglers()  # collective: every rank's step times
            if times is not None:
                metrics.update(times.fields())
        if cfg.eval_interval and self.step % cfg.eval_interval == 0:
            val = self.evaluate()
            if val is not None:
                metrics["val_loss"] = val
                metrics["val_ppl"] = perplexity(val)  # inf: null in --log-json
        return metrics

    def failure(
        self, exc: Exception, at: int, saved: int | None, loaded_step: int | None
    ) -> TrainingError:
        """The error a rank's failure at step `at` raises: where it failed, the rank it follows
        from under torchrun / srun (`cause`), and the steps not saved (`saved`: the last saved
        step)."""
        cfg, mesh = self.cfg, self.mesh
        what = without_gloo_noise(error_line(exc))  # (a RunStopped's: its message)
        saver = self.engine.saver
        if saver is not None:  # a checkpoint from before the failure is still good
            note = saver.wait_quietly(cfg.timeout_s)
            what += f" ({note})" if note else ""
            saved = saver.published if saver.published is not None else loaded_step
        cause = self.cause(what)  # one rank's place says nothing ("of tp=1 pp=1 dp=1")
        place = f" ({mesh.layout.place(mesh.rank)})" if mesh.layout.world_size > 1 else ""
        err = TrainingError(f"rank {mesh.rank}{place} failed at step {at}: {cause}{what}")
        err.no_traceback = getattr(exc, "no_traceback", False)
        if isinstance(exc, (OSError, CheckpointError)) and cfg.save:  # a disk error
            first = (saved or 0) + 1
            lost = f"step {first}" if first == self.step else f"steps {first}-{self.step}"
            last = f"step {saved:d}; resume with --load {cfg.save}" if saved else "none"
            err.args = (f"{err} -- not saved: {lost} (last checkpoint: {last})",)
        return err

    def cause(self, what: str) -> str:
        """Under torchrun / srun, when this rank's wait timed out (`what`): the rank it follows
        from, as the start of its error: a stopped rank of this node (continued, so that it
        ends too), else from every rank's record in the store the one holding the others up
        (`megapar.faults.progress`); "" when none is known. An error of this rank's own is
        recorded there instead, for the ranks that time out waiting for it."""
        if not consequential(what):
            progress.mark_failed(what)
            return ""
        stopped = stopped_siblings()
        if stopped:
            progress.mark_failed(found=stopped)  # for the ranks of other nodes
            return f"{stopped}; here: "
        behind = progress.holding_up()
        return f"{behind}{progress.gave_up(behind, self.mesh.rank)}: " if behind else ""

    def saved_at_start(self) -> int | None:
        """The step resumed from when it is already saved: it came from --save itself (a
        requeue); else None."""
        cfg = self.cfg
        save_root = Path(cfg.save).expanduser().resolve() if cfg.save else None
        loaded = None
        if self.resumed:
            assert cfg.load is not None  # resumed from --load
            loaded = Path(cfg.load).expanduser().resolve()
        return self.step if loaded and save_root in (loaded, *loaded.parents) else None

    def log_step(self, logger, metrics: dict, loss: float, logging_step: bool) -> None:
        """Record a step's metrics and loss; on a logging step also print its line, with the
        steps skipped for inf / nan since the last line (Megatron's "number of skipped
        iterations": a skip between --log-interval lines would not show otherwise); on an
        evaluation step between logging steps a line of its validation loss (as Megatron
        prints every evaluation)."""
        logger.log(self.step, metrics)
        logger.advance(self.step, loss)
        self.skipped_since_line += bool(metrics["skipped"])
        if logging_step:
            line = {**metrics, "skipped_steps": self.skipped_since_line}
            self.skipped_since_line = 0
            logger.message(
                format_line(self.step, line, fp16=self.cfg.precision == "fp16")
                + (f" | val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else "")
            )
        elif "val_loss" in metrics:
            logger.message(
                f"step {self.step:>6} | loss {loss:.4f} | val_loss {metrics['val_loss']:.4f}"
            )

    def run(self) -> list[dict]:
        """Run the steps from the one resumed to --max-steps (or a stop request), evaluating,
        logging and saving on the way; returns the per-step metrics history."""
        cfg, mesh = self.cfg, self.mesh
        logger = (
            MetricsLogger(cfg, self.step, cfg.to_dict(), self.wandb_run)
            if mesh.rank == 0
            else NullLogger()
        )
        self.announce(logger)
        history: list[dict] = []
        data = batches(self.train_ds, self.sampler, mesh.device, self._labels)
        profiler = StepProfiler(cfg.profile_steps, cfg.profile_dir, mesh.rank, mesh.device)
        at = self.step + 1  # the step being run (or saved), for the failure message
        guard = NonFiniteGuard(
            cfg.max_nonfinite_steps,
            cfg.precision,
            self.precision.scaler,
            NonFiniteGuard.INJECTED_ADVICE.format(spec=cfg.inject_corrupt)
            if cfg.inject_corrupt
            else NonFiniteGuard.CLI_ADVICE.format(clip="lower" if cfg.clip_grad else "use"),
        )
        stop = StopRequests(cfg.exit_duration_mins, cfg.exit_interval, mesh.device)
        saved = self.saved_at_start()
        loaded_step, saved_path = saved, None
        failed = False
        try:
            while self.step < cfg.max_steps:
                at = self.step + 1
                start = time.perf_counter()
                set_action(f"reading the batch of step {at}")
                micro_batches = next(data)
                set_action(f"starting step {at}, its batch read")
                profiler.before_step(self.step + 1)
                if at in (cfg.record_step, cfg.replay):
                    result = self.watched_step(at, micro_batches, logger)
                    if result is None:  # a replay: reported, the run ends
                        return history
                else:
                    result = self.engine.run_step(micro_batches)
                elapsed = time.perf_counter() - start
                if profiler.after_step(self.step):
                    first, last = parse_steps(str(cfg.profile_steps))
                    steps = f"step {first}" if first == last else f"steps {first}-{last}"
                    logger.message(
                        f"profiler traces of {steps}: "
                        f"{profiler.path.replace('rank0', 'rank<R>')} (one per rank)"
                    )
                loss = float(result.loss)  # already averaged over the global batch
                logging_step = self.step % cfg.log_interval == 0 or self.step == cfg.max_steps
                metrics = self.metrics(result, elapsed, logging_step)
                self.log_step(logger, metrics, loss, logging_step)
                history.append({"step": self.step, **metrics})
                guard.observe(
                    self.step,
                    loss,
                    metrics["grad_norm"],
                    result.skipped,
                    metrics["loss_scale"],
                    self.engine.locate_nonfinite,
                )
                self.log_saved(logger, self.engine.poll_save())  # a background save done?
                if (
                    cfg.save
                    and cfg.save_interval
                    and self.step % cfg.save_interval == 0
                    and self.step < cfg.max_steps
                ):
                    saved_path = self.save(logger)
                    saved = self.step
                why = stop.reason(self.step) if self.step < cfg.max_steps else None
                if why:
                    if not cfg.save:
                        why = why.replace(", saving", "") + " (no --save given: nothing saved)"
                    elif saved == self.step:  # --save-interval saved this step: no other save
                        done = (
                            "being saved" if self.engine.saver is not None else "saved just before"
                        )
                        why = why.replace(", saving", f" ({done}: {saved_path})")
                    logger.message(why)
                    break
            at = self.step
            if cfg.save and saved != self.step:
                self.save(logger)
            self.log_saved(logger, self.engine.wait_save())  # before the process exits
        except Exception as exc:
            failed = True
            raise self.failure(exc, at, saved, loaded_step) from exc
        finally:
            try:
                logger.close()
            except OSError:  # a log that cannot be written: the failure said so already
                if not failed:
                    raise
        return history


def train(cfg: TrainConfig, plan: DataPlan) -> list[dict]:
    """Entry point of one worker (rank): returns the per-step metrics history."""
    return Trainer(cfg, plan).run()


def _labelled_over_dp(micro_batches: list[dict], mesh: Mesh) -> int:
    """The labelled tokens (labels not -100) of a global batch: this rank's micro-batches'
    summed over dp (read on the host: validation waits for its losses anyway)."""
    count = torch.stack([(mb["labels"] != -100).sum() for mb in micro_batches]).sum()
    return int(all_reduce(count.to(mesh.device), mesh.dp_group))


def nodes_phrase(layout: Layout) -> str:
    """ " on 2 nodes of 4 ranks (dp across them)": where torchrun or srun started the ranks on
    more than one node (the groups that cross them, by `Layout.across_nodes`); "" on one node,
    or where megapar-train started its own workers."""
    if not under_launcher():
        return ""
    per_node = launched_local_size()
    if layout.world_size <= per_node or layout.world_size % per_node:
        return ""
    crossing = layout.across_nodes(per_node)
    return (
        f" on {layout.world_size // per_node} nodes of {counted(per_node, 'rank')}"
        f" ({and_list(crossing)} across them)"
    )


def tp_across_nodes(layout: Layout, per_node: int, given_by: str = "") -> str:
    """The note on a tp group that spans nodes of `per_node` ranks (every layer's tp collectives
    then cross the link between nodes, which megapar-plan refuses for tp); "" where each stays
    inside a node. `given_by`: the flag that set `per_node`, named after it."""
    if not layout.tp_spans_nodes(per_node):
        return ""
    # tp is the fastest axis: a group crosses nodes where tp does not divide the node
    fit = (
        f"keep --tp {per_node} or less"
        if layout.tp > per_node
        else f"give a --tp that divides {per_node}"
    )
    return (
        f"tp {layout.tp} spans nodes of {counted(per_node, 'rank')}{given_by}: every layer's tp "
        f"collectives cross the link between nodes, which megapar-plan refuses for tp; {fit}"
    )
