"""examples/*.sh pass flags that megapar-train accepts, including with the overrides their own
comments suggest (checked with plan_run, megapar-train's up-front validation: no training)."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megapar.cli.train import plan_run
from megapar.training.config import parse_args

ROOT = Path(__file__).resolve().parent.parent


def _argv_of(script: Path, tmp_path: Path, *extra: str) -> list[str]:
    """The arguments `script` gives megapar-train (a stand-in on PATH records them)."""
    fake = tmp_path / "bin" / "megapar-train"
    fake.parent.mkdir(exist_ok=True)
    record = tmp_path / "argv.txt"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {record}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", str(script), *extra], check=True, env=env, timeout=60)
    return record.read_text().splitlines()


@pytest.mark.parametrize("extra", [[], ["--max-steps", "5"], ["--max-steps=3"],
                                   ["--max-steps", "200", "--warmup-steps", "7"]],
                         ids=lambda e: shlex.join(e) or "as-is")
def test_lamb_large_batch_accepts_the_max_steps_its_comment_suggests(tmp_path, extra):
    # `--max-steps 5` used to be refused: "warmup of 10 steps is longer than the 5 training
    # steps" (the script hard-coded --warmup-steps 10)
    argv = _argv_of(ROOT / "examples" / "lamb_large_batch.sh", tmp_path, *extra)
    cfg = parse_args([*argv, "--data-cache", str(tmp_path / "cache")])
    plan_run(cfg)
    expected = {(): (40, 10), ("--max-steps", "5"): (5, 0), ("--max-steps=3",): (3, 0),
                ("--max-steps", "200", "--warmup-steps", "7"): (200, 7)}[tuple(extra)]
    assert (cfg.max_steps, cfg.warmup_steps) == expected
    assert cfg.optimizer == "lamb" and cfg.global_batch_size == 256
