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

from megapar.launcher import WorkerError, launched_world_size, run_workers, under_launcher
from megapar.mesh import Layout, LayoutError
from megapar.models.config import ConfigError, config_from_dict
from megapar.training.config import TrainConfig, parse_args
from megapar.training.data import DataPlan, build_datasets, prepare_data


def plan_run(cfg: TrainConfig) -> tuple[Layout, DataPlan]:
    """Validate the run and resolve its data and model; raises with a clear message."""
    if under_launcher():
        layout = Layout.infer(launched_world_size(), cfg.tp, cfg.pp, cfg.dp, cfg.rank_order)
    else:
        layout = Layout(cfg.tp, cfg.pp, cfg.dp or 1, cfg.rank_order)
    per_step = cfg.micro_batch_size * layout.dp
    if cfg.micro_batch_size < 1 or cfg.global_batch_size % per_step:
        raise ValueError(f"global batch size {cfg.global_batch_size} is not divisible by "
                         f"micro-batch size {cfg.micro_batch_size} x dp {layout.dp} = {per_step}; "
                         f"choose a multiple of {per_step}")
    if cfg.save_interval < 0 or cfg.max_steps < 1:
        raise ValueError("--max-steps must be >= 1 and --save-interval >= 0")
    from megapar.pipeline.schedules import check_schedule

    check_schedule(cfg.schedule, layout.pp, cfg.global_batch_size // per_step, cfg.virtual_stages)
    if cfg.grad_bucket_mb <= 0:
        raise ValueError(f"--grad-bucket-mb must be > 0, got {cfg.grad_bucket_mb}")
    if cfg.sequence_parallel and cfg.seq_len % layout.tp:
        raise ValueError(f"--seq-len {cfg.seq_len} is not divisible by --tp {layout.tp}, which "
                         f"--sequence-parallel needs; choose a multiple of {layout.tp}")
    from megapar.optim import LRScheduler

    LRScheduler(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps, cfg.lr_decay)  # checks
    if cfg.profile_steps:
        from megapar.training.profiling import parse_steps

        parse_steps(cfg.profile_steps)
    plan = prepare_data(cfg)
    config = config_from_dict(plan.model_config)
    config.validate(layout)
    if cfg.sequence_parallel and config.model_type == "llama":
        raise ValueError("--sequence-parallel is not supported for Llama models yet (tested for "
                         "GPT-2 and BERT only); drop --sequence-parallel")
    if cfg.virtual_stages > 1:
        from megapar.pipeline.partition import chunk_specs

        chunk_specs(config.num_layers, layout.pp, 0, cfg.virtual_stages)  # enough layers?
    train, _ = build_datasets(cfg, plan.prefix, config.model_type)
    if len(train) < cfg.global_batch_size:
        raise ValueError(f"the training split has {len(train)} samples of {cfg.seq_len} tokens, "
                         f"fewer than one global batch of {cfg.global_batch_size}; use more data, "
                         f"a shorter --seq-len or a smaller --global-batch-size")
    return layout, plan


def _worker(cfg: TrainConfig, plan: DataPlan):
    from megapar.training.loop import train

    return train(cfg, plan)


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
    try:
        run_workers(_worker, layout.world_size, cfg, plan, collective_timeout_s=cfg.timeout_s)
    except WorkerError as exc:
        print(f"megapar-train: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
