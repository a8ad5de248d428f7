"""The memory guard before local CPU ranks are forked (`megapar.plan.host`): a model whose
state the machine cannot hold is refused in one line, exit 2, before any worker starts
(megapar-train, megapar-bubble); the README's main job and the tests' tiny models are far
below it."""

import pytest

import megapar.cli.bubble as bubble_cli
import megapar.cli.train as train_cli
import megapar.plan.host as host
from megapar.data import asset_path
from megapar.host_memory import host_memory_available
from megapar.mesh import Layout
from megapar.models.recipes import resolve_model
from megapar.plan.params import model_params
from megapar.training.config import parse_args

GIB = 2**30


@pytest.fixture
def no_workers(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started for a job the machine cannot hold")

    monkeypatch.setattr(train_cli, "run_workers", refuse)
    monkeypatch.setattr("megapar.training.bubble.run_local", refuse)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(open(asset_path("shakespeare_sample.txt")).read()[:20_000])
    return str(path)


def _one_line(capsys, prog: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
    return lines[0]


def test_the_state_counted_is_16_bytes_a_parameter_on_every_rank():
    """megapar-train's fp32 parameters, gradients and AdamW's two moments, on each of the
    ranks (dp replicas hold it all; tp and pp split it, the last stage holding its own copy of
    the tied word embedding), as megapar-plan counts them."""
    config = resolve_model("gpt2-124m")
    n, tied = model_params(config), 50304 * 768  # the vocabulary padded to 128 x tp
    cfg = parse_args(["--model", "gpt2-124m"])
    for layout, params in ((Layout(1, 1, 1), n), (Layout(1, 1, 2), 2 * n),
                           (Layout(2, 2, 1), n + tied)):
        problem, candidate = train_cli.planned_job(cfg, config, layout, target="cpu")
        need = host.local_state_bytes(problem, candidate)
        assert need == pytest.approx(16 * params, rel=0.01), (layout, need / (16 * params))
        assert host.local_state_bytes(problem, candidate, optimizer=False) == \
            pytest.approx(need / 2, rel=0.01)


def test_the_main_job_and_a_tiny_model_are_far_below_the_memory_there_is():
    available = host_memory_available()
    assert available is not None and available > 0  # Linux: /proc/meminfo
    for argv, layout in (([], Layout(1, 1, 1)), (["--model", "gpt2-tiny"], Layout(2, 2, 1))):
        cfg = parse_args(argv)
        config = resolve_model(cfg.model or "gpt2-tiny")
        problem, candidate = train_cli.planned_job(cfg, config, layout, target="cpu")
        assert host.local_state_bytes(problem, candidate) < 128 * 2**20, argv


def test_megapar_train_refuses_a_model_larger_than_the_memory_available(
        tmp_path, text, capsys, monkeypatch, no_workers):
    """megapar-train --model llama-70b on a CPU forked ranks that the OOM killer ended; the
    guard names the estimate, the memory and the fix (here gpt2-tiny's two ranks, about 105
    MiB, against 16 MiB available). The dry run holds fake tensors: it is not refused."""
    monkeypatch.setattr(host, "host_memory_available", lambda: 16 * 2**20)
    monkeypatch.setattr(train_cli, "use_cuda", lambda: False)
    argv = ["--model", "gpt2-tiny", "--dp", "2", "--data", text, "--data-cache",
            str(tmp_path / "cache"), "--seq-len", "32", "--max-steps", "1", "--no-progress"]
    assert train_cli.main(argv) == 2
    assert _one_line(capsys, "megapar-train") == (
        "megapar-train: error: gpt2-tiny at --tp 1 x --pp 1 x --dp 2 needs at least 105 MiB "
        "for its 2 ranks' parameters, gradients and optimizer state (megapar-plan's count, "
        "activations not included), more than the 16 MiB this machine has available; use a "
        "smaller --model, rehearse the job on this machine with --dry-run (fake tensors), or "
        "plan its layout on a cluster with megapar-plan")
    assert train_cli.main([*argv, "--dry-run"]) == 0


def test_megapar_bubble_refuses_a_measured_model_larger_than_the_memory_available(
        capsys, monkeypatch, no_workers):
    """megapar-bubble --model llama-8b forked ranks building 8 B parameters each stage half;
    its measurement runs no optimizer, so parameters and gradients are counted."""
    monkeypatch.setattr(host, "host_memory_available", lambda: GIB)
    monkeypatch.setattr("megapar.device.use_cuda", lambda: False)
    assert bubble_cli.main(["--pp", "2", "-m", "4", "--model", "gpt2-124m"]) == 2
    line = _one_line(capsys, "megapar-bubble")
    assert line.startswith("megapar-bubble: error: --model gpt2-124m at --pp 2 x --tp 1 needs "
                           "at least "), line
    assert line.endswith(" GiB for its 2 ranks' parameters and gradients (megapar-plan's "
                         "count, activations not included), more than the 1.0 GiB this machine "
                         "has available; measure a smaller --model (the default one is sized "
                         "for this), or simulate this one from given costs (--simulate "
                         "--fwd-ms MS)"), line
