"""A progress bar only in a terminal: in a log file (`megapar-train ... > run.log 2>&1`, a pipe
to `tee`, a Slurm job's output) tqdm's carriage-return updates land in front of the log lines,
so `grep '^step'` misses them. Not given, --progress follows whether stderr is a terminal;
--progress / --no-progress still decide."""

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from megapar.data import asset_path
from megapar.one_line_parser import show_progress
from megapar.training.config import TrainConfig
from megapar.training.logging import MetricsLogger


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "stderr, flag, shown",
    [(io.StringIO, None, False), (Terminal, None, True), (io.StringIO, True, True),
     (Terminal, False, False)],
)
def test_the_bar_follows_the_terminal_unless_a_flag_decides(monkeypatch, stderr, flag, shown):
    monkeypatch.setattr("sys.stderr", stderr())
    assert show_progress(flag) is shown
    cfg = SimpleNamespace(progress=flag, max_steps=3, log_json=None, tensorboard=None,
                          wandb_project=None)
    logger = MetricsLogger(cfg, 0, {})
    assert (logger.bar is not None) is shown
    logger.close()


def test_megapar_train_leaves_it_to_the_terminal_by_default():
    assert TrainConfig().progress is None


def test_megapar_data_writes_no_bar_into_a_log(tmp_path, capfd):
    from megapar.cli.data import main as data

    text = tmp_path / "t.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:5_000])
    assert data(["--input", str(text), "--tokenizer", "sentencepiece",
                 "--output-prefix", str(tmp_path / "d")]) == 0
    captured = capfd.readouterr()
    assert "\r" not in captured.err
    assert "tokenizing" not in captured.err and "wrote" in captured.out + captured.err
