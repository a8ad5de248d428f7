"""megapar-train: the command users run.

    megapar-train                                  # small GPT-2 on the shipped Shakespeare sample
    megapar-train --tp 2 --pp 2 --model gpt2-tiny  # starts 4 local workers itself
    torchrun --nproc-per-node 8 -m megapar.cli.train --tp 2 --pp 2   # dp = 8 / 4 = 2

Everything that can be checked before a worker starts is checked here, so a mistake gives
one clear message instead of N stack traces or a hung process group.
"""

from __future__ import annotations

import os
import sys

from megapar.checkpoint.publish import has_checkpoint
from megapar.data import IndexedDataset
from megapar.launcher import WorkerError, launched_world_size, run_workers, under_launcher
from megapar.mesh import Layout, LayoutError
from megapar.models.config import ConfigError, config_from_dict
from megapar.training.config import TrainConfig, parse_args
from megapar.training.data import DataPlan, build_datasets, prepare_data
from megapar.training.faults import check_outputs, parse_signals


def plan_run(cfg: TrainConfig) -> tuple[Layout, DataPlan]:
    """Validate the run and resolve its data and model; raises with a clear message."""
    if under_launcher():
        layout = Layout.infer(launched_world_size(), cfg.tp, cfg.pp, cfg.dp)
    else:
        layout = Layout(cfg.tp, cfg.pp, cfg.dp or 1)
    per_step = cfg.micro_batch_size * layout.dp
    if cfg.micro_batch_size < 1 or cfg.global_batch_size % per_step:
        raise ValueError(f"global batch size {cfg.global_batch_size} is not divisible by "
                         f"micro-batch size {cfg.micro_batch_size} x dp {layout.dp} = {per_step}; "
                         f"choose a multiple of {per_step}")
    parse_signals(cfg.exit_signals)  # a typo is an error now, not when the signal comes
    check_outputs(cfg)  # before any work: an unwritable --save is not found after the run
    if cfg.load and cfg.load_strict and not has_checkpoint(cfg.load):
        raise ValueError(f"--load {cfg.load}: no checkpoint there (--load-strict); drop "
                         f"--load-strict to start fresh when there is none")
    if cfg.save_interval < 0 or cfg.max_steps < 1:
        raise ValueError("--max-steps must be >= 1 and --save-interval >= 0")
    from megapar.optim import LRScheduler

    LRScheduler(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps, cfg.lr_decay)  # checks
    plan = prepare_data(cfg)
    config = config_from_dict(plan.model_config)
    config.validate(layout)
    IndexedDataset(plan.prefix).check_vocab(config.vocab_size)  # ids outside it: refused at any tp
    train, _ = build_datasets(cfg, plan.prefix, config.model_type)
    if len(train) < cfg.global_batch_size:
        raise ValueError(f"the training split has {len(train)} samples of {cfg.seq_len} tokens, "
                         f"fewer than one global batch of {cfg.global_batch_size}; use more data, "
                         f"a shorter --seq-len or a smaller --global-batch-size")
    return layout, plan


def _worker(cfg: TrainConfig, plan: DataPlan):
    from megapar.training.faults import install_stop_handlers
    from megapar.training.loop import train

    restore = install_stop_handlers(cfg.exit_signals)
    try:
        return train(cfg, plan)
    finally:
        restore()


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        layout, plan = plan_run(cfg)
    except (LayoutError, ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"megapar-train: error: {exc}", file=sys.stderr)
        return 2
    cfg.dp = layout.dp
    if under_launcher() and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        cfg.progress = False
    forward = tuple(s.name for s in parse_signals(cfg.exit_signals)) + ("SIGINT",)
    try:
        run_workers(_worker, layout.world_size, cfg, plan, collective_timeout_s=cfg.timeout_s,
                    forward=forward)
    except WorkerError as exc:
        print(f"megapar-train: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # in-process (one rank): a clean stop is one line, not a traceback
        if not getattr(exc, "no_traceback", False):
            raise
        print(f"megapar-train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megapar-train: aborted (second SIGINT): nothing saved", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
