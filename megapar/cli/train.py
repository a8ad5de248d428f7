"""megapar-train: the command users run.

    megapar-train                                  # small GPT-2 on the shipped Shakespeare sample
    megapar-train --tp 2 --pp 2 --model gpt2-tiny  # starts 4 local workers itself
    torchrun --nproc-per-node 8 -m megapar.cli.train --tp 2 --pp 2   # dp = 8 / 4 = 2

Everything that can be checked before a worker starts is checked here, so a mistake gives
one clear message instead of N stack traces or a hung process group.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import traceback
from dataclasses import fields
from pathlib import Path

from megapar.checkpoint.lock import LOCK_NAME, SaveLock, SaveLockError, read_owner
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import clean_stale, has_checkpoint, remove_steps_after
from megapar.cli.closed_stdout import quiet_when_stdout_closes
from megapar.cli.worker_exit import TRACEBACK, parser_errors_once, refused
from megapar.device import SHORT_JOIN_S, DeviceError, check_gpus, use_cuda
from megapar.dryrun.command import rehearse
from megapar.dryrun.modelled import expert_tp_note, planned_job
from megapar.dryrun.sample import check_world
from megapar.faults import status as rank_status
from megapar.faults.processes import exit_uncollected
from megapar.faults.report import (
    log_dir_for,
    run_log_name,
    tell_torchrun,
    use_run_log_name,
    worker_failure,
)
from megapar.faults.stop import (
    ABORT_SIGNALS,
    SIGTERM_EXIT_CODE,
    exit_codes,
    exit_on_signals,
    install_stop_handlers,
    parse_signals,
    sigterm_as_exit,
)
from megapar.host_memory import share_host_arena
from megapar.launcher import (
    WorkerError,
    check_local_workers,
    check_same_settings,
    launched_local_size,
    launched_world_size,
    run_workers,
    under_launcher,
)
from megapar.made_dirs import missing_dirs, remove_empty
from megapar.mesh import EpSplitError, Layout, LayoutError, ep_split_error
from megapar.models.config import ConfigError, config_from_dict
from megapar.models.recipes import resolve_model
from megapar.plan.host import check_host_memory
from megapar.training.config import TrainConfig, parse_args
from megapar.training.data import DataPlan
from megapar.training.loop import train
from megapar.training.model_config import DEFAULT_MODEL, capacity_note, ep_model_error
from megapar.training.run_plan import (
    plan_data,
    read_resumed_settings,
    takes_save_lock,
    tps_the_world_takes,
)
from megapar.training.validate import UsageError, explicit


def plan_run(cfg: TrainConfig, notes: list[str] | None = None) -> tuple[Layout, DataPlan]:
    """Validate the run and resolve its data and model (`training.run_plan`); raises with a
    clear message. Settings the user did not give may adapt to the ones they gave (said in
    `notes`)."""
    notes = [] if notes is None else notes
    manifest = read_resumed_settings(cfg, notes)
    try:
        layout = _layout(cfg)
    except EpSplitError as exc:  # the values offered: those dividing the model's experts too
        config = _known_model(cfg, manifest)
        if config is None:
            raise
        if getattr(config, "num_local_experts", None) is None:  # no experts to shard at all
            raise UsageError(ep_model_error(config, exc.ep) or str(exc)) from None
        experts = config.num_local_experts
        raise UsageError(ep_split_error(exc.ep, exc.dp, exc.cp, experts=experts)) from None
    except LayoutError:  # a world --tp x --pp does not divide: first a --tp the model refuses,
        config = _known_model(cfg, manifest)  # which a world of its multiple would meet next
        if config is not None:
            try:
                config.validate(Layout(cfg.tp, cfg.pp, 1, cp=cfg.cp))
            except LayoutError as model:
                raise UsageError(f"{model}{tps_the_world_takes(cfg, config)}") from None
        raise
    plan = plan_data(cfg, layout, notes, manifest)
    given = "expert_tensor_parallel_size" in explicit(cfg)
    config = config_from_dict(plan.model_config)
    notes.extend(expert_tp_note(cfg, config, layout, given))
    notes.extend(
        capacity_note(config, layout, cfg.sequence_parallel, cfg.expert_tensor_parallel_size)
    )
    if not (cfg.dry_run or under_launcher() or use_cuda()):  # the ranks forked here, on CPU
        _check_host_memory(cfg, layout, plan)
    return layout, plan


def _known_model(cfg: TrainConfig, manifest: dict | None):
    """The run's model config where it is known before the layout: a resumed run's checkpoint's,
    or a fresh run's --model (or the default one); None otherwise."""
    if manifest is not None and manifest.get("model"):
        return config_from_dict(manifest["model"])
    fresh = not (cfg.load or cfg.from_hf)
    return _model_of(cfg.model or (DEFAULT_MODEL if fresh else None))


def _model_of(model: str | None):
    """The config of the --model recipe or config file; None without one, or where it cannot
    be read (that is refused later, on its own)."""
    if not model:
        return None
    try:
        return resolve_model(model)
    except (ConfigError, OSError, ValueError):
        return None


def _check_host_memory(cfg: TrainConfig, layout: Layout, plan: DataPlan) -> None:
    """ValueError (one line) when the ranks this machine would fork cannot hold the model's
    state in the memory it has available (`plan.host`)."""
    problem, candidate = planned_job(cfg, config_from_dict(plan.model_config), layout, target="cpu")
    cp = f" x --cp {layout.cp}" if layout.cp > 1 else ""
    check_host_memory(
        problem,
        candidate,
        f"{cfg.model or problem.config.model_type} at --tp {layout.tp}{cp} x --pp {layout.pp} "
        f"x --dp {layout.dp}",
        "use a smaller --model, rehearse the job on this machine with --dry-run (fake "
        "tensors), or plan its layout on a cluster with megapar-plan",
        optimizer=cfg.optimizer in ("adamw", "lamb", "muon"),  # sgd / lars: less; a lower bound
    )


def _layout(cfg: TrainConfig) -> Layout:
    """The job's layout: a rehearsed job's as given (on this one process), torchrun's or
    Slurm's world, or the local workers megapar-train starts (checked against the GPUs and
    CPU cores there are)."""
    if cfg.dry_run and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        size = os.environ["WORLD_SIZE"]  # torchrun's: each process would rehearse its own job
        raise UsageError(
            f"--dry-run rehearses a job in one process, not under torchrun (RANK and "
            f"WORLD_SIZE {size} are set here): run megapar-train --dry-run --world-size {size} "
            f"with the same flags on its own"
        )
    if cfg.dry_run:  # the job's size as given, on this one process
        world = cfg.world_size or cfg.tp * cfg.cp * cfg.pp * (cfg.dp or 1)
        check_world(world)
        if world > cfg.gpus_per_node and world % cfg.gpus_per_node:
            raise UsageError(
                f"--world-size {world} spans several nodes of --gpus-per-node "
                f"{cfg.gpus_per_node} but is not a multiple of it (torchrun starts "
                f"the same number of processes on every node); give a multiple "
                f"of {cfg.gpus_per_node}, or the --gpus-per-node each node really "
                f"uses"
            )
        return Layout.infer(
            world, cfg.tp, cfg.pp, cfg.dp, cfg.rank_order, cfg.cp, cfg.ep, "--world-size"
        )
    if under_launcher():
        layout = Layout.infer(
            launched_world_size(), cfg.tp, cfg.pp, cfg.dp, cfg.rank_order, cfg.cp, cfg.ep
        )
        check_gpus(launched_local_size())  # every process of this node: a GPU each
        return layout
    layout = Layout(cfg.tp, cfg.pp, cfg.dp or 1, cfg.rank_order, cfg.cp, cfg.ep)
    check_gpus(layout.world_size)
    if not cfg.oversubscribe:
        cp = f" x --cp {layout.cp}" if layout.cp > 1 else ""
        check_local_workers(
            layout.world_size, f"--tp {layout.tp}{cp} x --pp {layout.pp} x --dp {layout.dp}"
        )
    return layout


def _what_is_saved(cfg: TrainConfig) -> str:
    """After an abort: what --save holds to resume from (a write in flight is lost)."""
    root = os.path.expanduser(cfg.save) if cfg.save else ""
    latest = os.path.join(root, "latest")
    if not root or not os.path.isfile(latest):
        return "nothing saved"
    with open(latest) as f:
        name = f.read().strip()
    return (
        f"any save in flight is lost; {cfg.save}/latest is {name}, the checkpoint to "
        f"resume from (--load {cfg.save})"
    )


def _remove_dead_saves(cfg: TrainConfig) -> None:
    """After local workers failed (all of them gone): remove the staging directory of a save
    they were writing, so that --save holds complete checkpoints only. Under torchrun / Slurm
    another rank may still be writing: the next save removes it there."""
    if cfg.save and not under_launcher():
        try:
            clean_stale(os.path.expanduser(cfg.save))
        except OSError:
            pass


def _remove_newer_steps(cfg: TrainConfig) -> list[str]:
    """--overwrite-newer: remove the steps of --save newer than the one this run starts from
    (and their records), so none of an earlier run is left mixed with this run's; a note."""
    start = (
        int(read_manifest(cfg.load).get("step", 0)) if cfg.load and has_checkpoint(cfg.load) else 0
    )
    assert cfg.save is not None  # the caller runs this under the lock of --save
    removed = remove_steps_after(cfg.save, start)
    if not removed:
        return []
    return [
        f"--overwrite-newer: removed {', '.join(removed)} of --save {cfg.save} (newer than "
        f"step {start}, where this run starts)"
    ]


PER_NODE_SETTINGS = frozenset(
    {
        "progress",
        "debug",
        "log_json",
        "tensorboard",
        "wandb_project",
        "profile_dir",
        "data_cache",
        "json",
        "timeout_s",
        "nccl_timeout_s",
        "oversubscribe",
    }
)
"""TrainConfig fields that may differ between a job's ranks (what each prints or writes where,
its waits); every other one must be rank 0's (`check_same_settings`)."""


def _worker(cfg: TrainConfig, plan: DataPlan):
    if under_launcher():  # nodes started with other flags would build other groups
        # --dp not given is the world size's share: a --tp that differs is named, not it
        derived = set() if "dp" in explicit(cfg) else {"dp"}
        settings = {
            "--" + f.name.replace("_", "-"): getattr(cfg, f.name)
            for f in fields(cfg)
            if f.name not in PER_NODE_SETTINGS | derived
        }
        check_same_settings(settings, cfg.timeout_s, "megapar-train flags")
    saving = ", then saves" if cfg.save else " (nothing is saved without --save)"
    acknowledge = (  # rank 0 says so at once, where the stop comes at the step's end
        f"megapar-train: interrupt received: the run stops at the end of this step{saving}; "
        f"Ctrl-C again aborts without saving"
        if int(os.environ.get("RANK", "0")) == 0
        else None
    )
    restore = install_stop_handlers(cfg.exit_signals, acknowledge)
    try:
        return train(cfg, plan)
    finally:
        restore()


@quiet_when_stdout_closes
def main(argv=None) -> int:
    exit_uncollected()  # torch's heap left to the OS at exit
    share_host_arena()  # before any thread (the tokenizer's) allocates: workers inherit it
    notes: list[str] = []
    lock, cfg = None, None
    made: list[Path] = []  # the directories of --save this run makes: removed if left empty
    previous = sigterm_as_exit()  # a SIGTERM while starting ends it as a Ctrl-C there does
    starting = exit_on_signals(ABORT_SIGNALS)  # and so do SIGHUP, SIGQUIT and SIGUSR2
    use_run_log_name(None)  # this run's own (an earlier run in this process had its own)
    try:
        with parser_errors_once():  # under torchrun / Slurm: one process a node prints
            cfg = parse_args(argv)  # a bad flag: the parser's line, then SystemExit(2)
        layout, plan = plan_run(cfg, notes)
        if cfg.save and takes_save_lock() and not cfg.dry_run:  # held until this exits
            command = shlex.join(["megapar-train", *(sys.argv[1:] if argv is None else argv)])
            made = missing_dirs(cfg.save)
            run = run_log_name()
            use_run_log_name(run)  # the name rank 0 gives its job's store (`run_workers`)
            rank_logs = {"in_save": not made, "run": run}  # for the other ranks
            lock = SaveLock(cfg.save, command, rank_logs).acquire()
            notes.extend(filter(None, [lock.taken_over]))
            if cfg.overwrite_newer:  # under the lock: nobody else writes --save now
                notes.extend(_remove_newer_steps(cfg))
    except (
        UsageError,
        LayoutError,
        ConfigError,
        ValueError,
        FileNotFoundError,
        SaveLockError,
        DeviceError,
    ) as exc:
        if lock is not None:
            lock.release()
        remove_empty(made)
        tell_torchrun(str(exc), None)  # its summary's root cause, not "error_file: <N/A>"
        return refused("megapar-train", exc)  # once per node under torchrun / Slurm
    except OSError as exc:  # a full disk under --save or --data-cache: one line, not a stack
        if lock is not None:
            lock.release()
        remove_empty(made)
        where = f": {exc.filename}" if exc.filename else ""
        fix = {  # a read's error (a --data file it may not read) gets no disk advice
            errno.ENOSPC: "; free space on that disk, or choose another directory",
            errno.EDQUOT: "; free space within the quota, or choose another directory",
            errno.EROFS: "; that file system is read-only: choose another directory",
        }.get(exc.errno or 0, "")
        message = f"{exc.strerror or exc}{where} while starting; nothing was trained{fix}"
        tell_torchrun(message, None)
        refused("megapar-train", message)
        return 1
    except (KeyboardInterrupt, SystemExit) as exc:  # e.g. while --data is tokenized: no worker
        signals = exit_codes(starting)
        signals[SIGTERM_EXIT_CODE] = "SIGTERM"
        exit_code = exc.code if isinstance(exc, SystemExit) else 130
        if (
            not isinstance(exit_code, int)
            or isinstance(exc, SystemExit)
            and (exit_code not in signals)
        ):
            raise
        if lock is not None:
            lock.release()
        remove_empty(made)
        saved = _what_is_saved(cfg) if cfg is not None else "nothing saved"
        what = signals[exit_code] if isinstance(exc, SystemExit) else "SIGINT"
        print(f"megapar-train: aborted ({what} while starting): {saved}", file=sys.stderr)
        return exit_code
    finally:
        if previous is not None:  # the workers' and the launcher's own handling from here
            signal.signal(signal.SIGTERM, previous)
        for sig, handler in starting.items():
            signal.signal(sig, handler)
    code = 1
    try:
        code = _run(cfg, layout, plan, notes, made)
        return code
    finally:
        if lock is not None:
            lock.release()
        if code != 0:  # a failed run (its first save, say) leaves no empty --save behind
            remove_empty(made)


def _failure_log(
    cfg: TrainConfig, made: list[Path], text: str, rank: int | None
) -> tuple[str, str | None]:
    """`worker_failure` into the run's log directory (`_rank_log_dir`), or, where that cannot
    be written (--save moved, replaced by a file or read-only under the run, or its disk full),
    into the cache's log directory of the run: the line names a log either way."""
    line, log = worker_failure(text, _rank_log_dir(cfg, made), rank)
    if log is None and cfg.save:
        line, log = worker_failure(text, log_dir_for(None, cfg.data_cache), rank)
    timed_out = any(w in line.lower() for w in ("timed out", "timeout", "time out"))
    if timed_out and cfg.timeout_s < SHORT_JOIN_S and "--timeout-s" not in line:
        line += (  # (a wait of 10 ms timed out at step 1, with no word on the bound given)
            f" (--timeout-s {cfg.timeout_s:g} bounds every wait on other ranks: under "
            f"{SHORT_JOIN_S:g} s it may be too short for them to answer; raise it)"
        )
    return line, log


def _rank_log_dir(cfg: TrainConfig, made: list[Path]) -> Path:
    """Where this process writes a failed rank's log, the same place for every rank of the run:
    SAVE/logs when --save holds a checkpoint, or when --save was there before the run; else
    the cache's log directory of the run (`log_dir_for`), named by the lock holder. The
    process holding --save's lock knows whether it made --save (`made`: the directories of it
    it made); under torchrun / Slurm the other ranks read it, and the run's name, from the
    lock's record (`SaveLock.rank_logs`), and where they cannot (the holder is gone, and its
    lock with it) write under the cache: never a logs/ in a --save the run made and removes
    when it fails, nor a --save made again after that."""
    if not cfg.save:
        return log_dir_for(None, cfg.data_cache)
    record = (read_owner(Path(cfg.save).expanduser() / LOCK_NAME) or {}).get("rank_logs")
    agreed = record if isinstance(record, dict) else {}
    if takes_save_lock():
        in_save = not made
    else:
        in_save = agreed.get("in_save") is True
    kept = cfg.save if in_save or has_checkpoint(cfg.save) else None
    return log_dir_for(kept, cfg.data_cache, agreed.get("run"))


def _run(
    cfg: TrainConfig, layout: Layout, plan: DataPlan, notes: list[str], made: list[Path]
) -> int:
    """Start the workers (or run this rank) and turn a failure into one line. The rank logs go
    to SAVE/logs, or to the cache's run log directory when this run made --save (`made`) and
    saved nothing there (`_rank_log_dir`, the same for every rank): that --save is removed
    again, and the line names where the log is."""
    cfg.dp = layout.dp
    if cfg.dry_run:
        return rehearse(cfg, layout, plan, notes)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    if under_launcher() and rank != 0:
        cfg.progress = False
    for note in notes if rank == 0 else []:
        print(f"megapar-train: {note}", file=sys.stderr)
    forward = tuple(s.name for s in parse_signals(cfg.exit_signals)) + ("SIGINT",)
    # a SIGTERM --exit-signals does not name aborts the run (no save) as a second SIGINT does,
    # and so does one that comes before the launcher forwards it (the workers starting): with
    # its default action it would kill this process with --save's lock in place, saying nothing
    previous = sigterm_as_exit()
    aborting = exit_on_signals(ABORT_SIGNALS, skip=forward)  # a closed terminal's SIGHUP, ...
    try:
        run_workers(
            _worker,
            layout.world_size,
            cfg,
            plan,
            collective_timeout_s=cfg.timeout_s,
            forward=forward,
            nccl_timeout_s=cfg.nccl_timeout_s,
            rank_place=layout.place,
        )
    except Exception as exc:  # noqa: BLE001 - one line here, the traceback in the rank's log
        if isinstance(exc, WorkerError):
            text, failed = str(exc), None
        elif getattr(exc, "no_traceback", False):  # a clean stop in this process: one line
            text, failed = str(exc), rank
        else:  # a rank run in this process (one worker, or under torchrun)
            text, failed = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", rank
        line, log = _failure_log(cfg, made, text, failed)
        _remove_dead_saves(cfg)
        saved = _what_is_saved(cfg)
        if not any(s in line for s in ("before training started", "not saved", "nothing saved")):
            if saved != "nothing saved":  # where to resume (an async save in flight is lost)
                line += f"; {saved}"
        print(f"megapar-train: error: {line}", file=sys.stderr)
        tell_torchrun(line, log)  # its summary's root cause: this line, not "<N/A>"
        if cfg.debug:  # the text below the line, its first sentence not said twice (a re-test)
            first, _, rest = text.partition("\n")
            print(rest if first and line.startswith(first) else text, file=sys.stderr)
        elif log and " was killed by " in line:  # no traceback: its log and every rank's stack
            print(
                f"megapar-train: its output in {log}; every rank's stack: --debug", file=sys.stderr
            )
        elif log and failed is None and " did not answer" in line:  # named by our launcher
            print(
                f"megapar-train: every rank's step, action and stack in {log} (or rerun with "
                f"--debug)",
                file=sys.stderr,
            )
        elif log and TRACEBACK in text and not getattr(exc, "no_traceback", False):  # (a clean
            # line has none: a worker's full disk was pointed at a log of no traceback)
            print(
                f"megapar-train: full traceback in {log} (or rerun with --debug)", file=sys.stderr
            )
        return 1
    except KeyboardInterrupt as exc:  # the launcher's second SIGINT, or one while starting
        why = "second SIGINT" if "second SIGINT" in str(exc) else "SIGINT while starting"
        _remove_dead_saves(cfg)
        print(f"megapar-train: aborted ({why}): {_what_is_saved(cfg)}", file=sys.stderr)
        return 130
    except SystemExit as exc:  # SIGTERM, not forwarded: the workers are gone, none saved
        named = exit_codes(aborting)
        if isinstance(exc.code, int) and exc.code in named:  # SIGHUP, SIGQUIT, SIGUSR2: their
            # default action ended the run without a word
            _remove_dead_saves(cfg)
            print(
                f"megapar-train: aborted ({named[exc.code]}, which --exit-signals "
                f"{cfg.exit_signals!r} does not name, so no save at the stop; name it there to "
                f"save): {_what_is_saved(cfg)}",
                file=sys.stderr,
            )
            return exc.code
        if exc.code != SIGTERM_EXIT_CODE or previous is None:
            raise
        _remove_dead_saves(cfg)
        if "SIGTERM" not in forward:
            why = (
                f"SIGTERM, which --exit-signals {cfg.exit_signals!r} does not name, so no save "
                f"at the stop"
            )
        elif not under_launcher() or rank_status.current().step is None:  # before the
            why = "SIGTERM while starting"  # launcher (ours) forwards it to the workers
        else:  # this process's rank (torchrun's, srun's) trained, and was stopped in a wait
            why = (  # (its own line may be lost: it said 'while starting' after 50 steps)
                f"SIGTERM at {rank_status.status()}, as the launcher stops every rank when one "
                f"fails: see the others' lines"
            )
        print(f"megapar-train: aborted ({why}): {_what_is_saved(cfg)}", file=sys.stderr)
        return SIGTERM_EXIT_CODE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for sig, handler in aborting.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
