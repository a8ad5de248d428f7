"""A new user's ordinary runs, end to end through the real CLIs, on text of every shape.

Texts are generated here (many short paragraphs, one paragraph, CRLF, JSONL, a directory, a
tiny file, invalid UTF-8, an empty file). Each run either trains (finite losses, every step
logged) or fails with its documented message and exit code 2: never a traceback. The CLIs run
in-process (their workers are forked from this test process), with a tiny model and 1-5 steps.
"""

import dataclasses
import json
import math
import random
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from megapar.cli.convert import main as convert
from megapar.cli.data import main as data_cli
from megapar.cli.eval import main as evaluate
from megapar.cli.train import main as train

SYLLABLES = ["ka", "lo", "mi", "ra", "ten", "su", "vo", "the", "an", "dor", "wyn", "el", "ish"]


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
                    for _ in range(n))


def poem(rng: random.Random, paragraphs: int) -> str:
    """Many short paragraphs (1-3 short lines each), blank-line separated, like a poem."""
    return "\n\n".join("\n".join(words(rng, rng.randint(1, 6)) for _ in range(rng.randint(1, 3)))
                       for _ in range(paragraphs)) + "\n"


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    rng = random.Random(0)
    out = {}
    out["poem"] = root / "poem.txt"
    out["poem"].write_text(poem(rng, 600))
    out["one_paragraph"] = root / "one.txt"
    out["one_paragraph"].write_text("\n".join(words(rng, 12) for _ in range(300)) + "\n")
    out["crlf"] = root / "crlf.txt"
    out["crlf"].write_bytes(poem(rng, 300).replace("\n", "\r\n").encode())
    out["jsonl"] = root / "docs.jsonl"
    out["jsonl"].write_text("".join(json.dumps({"text": words(rng, rng.randint(5, 60))}) + "\n"
                                    for _ in range(200)))
    folder = root / "folder"
    (folder / "sub").mkdir(parents=True)
    for i in range(3):
        (folder / f"part{i}.txt").write_text(poem(rng, 60))
    (folder / "sub" / "more.jsonl").write_text(json.dumps({"text": words(rng, 300)}) + "\n")
    (folder / "notes.bin").write_bytes(b"\x00\xff" * 10)  # not a .txt / .jsonl: ignored
    out["directory"] = folder
    out["few_bad_bytes"] = root / "latin1_bits.txt"
    out["few_bad_bytes"].write_bytes(poem(rng, 300).encode() + "café naïve".encode("latin-1")
                                     + b"\n\xff\n")
    out["tiny"] = root / "tiny.txt"
    out["tiny"].write_text(words(rng, 30) + "\n")
    out["invalid_utf8"] = root / "junk.txt"
    # not UTF-8 but no NUL byte: one among the first KiB makes it binary, refused as such
    out["invalid_utf8"].write_bytes(bytes(b or 0xFF for b in random.Random(1).randbytes(20_000)))
    out["empty"] = root / "empty.txt"
    out["empty"].write_text("\n\n  \n")
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer GPT-2 config without vocab_size (it takes the tokenizer's) and 64 positions."""
    path = tmp_path_factory.mktemp("model") / "tiny.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                "n_positions": 64}))
    return str(path)


def _run(cli, argv, capsys):
    rc = cli([str(a) for a in argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err[-3000:]
    return rc, out.err


def _records(log):
    return [json.loads(line) for line in Path(log).read_text().splitlines()]


def _assert_trained(log, steps):
    records = _records(log)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.parametrize("shape", ["poem", "one_paragraph", "crlf", "jsonl", "directory",
                                   "few_bad_bytes"])
def test_text_of_every_shape_trains(shape, texts, cache, tiny_model, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    rc, err = _run(train, ["--data", texts[shape], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32", "--max-steps", "2",
                           "--no-progress", "--log-json", log], capsys)
    assert rc == 0, err
    _assert_trained(log, 2)
    if shape == "one_paragraph":  # one document: no validation split, said once
        assert err.count("no validation split: the data is one document") == 1
    if shape == "few_bad_bytes":  # under 0.1 % of the bytes: replaced and counted
        assert "warning: " in err and "3 bytes of invalid UTF-8 replaced" in err
        # and again when the run reads the cached copy (said the first time alone, where the
        # unknown-token warning is said every time; a new user's tryout)
        rc, err = _run(train, ["--data", texts[shape], "--data-cache", cache, "--model",
                               tiny_model, "--tokenizer", "sentencepiece", "--seq-len", "32",
                               "--max-steps", "1", "--no-progress"], capsys)
        assert rc == 0 and f"warning: {texts[shape]}: 3 bytes of invalid UTF-8 replaced" in err


def test_a_poem_whose_held_out_paragraph_is_tiny_still_trains_and_evaluates(
        texts, cache, tiny_model, tmp_path, capsys):
    """The regression: short paragraphs at --seq-len 32 held out a few-token validation split
    (here one paragraph: --val-fraction 0.001 of 600) and the run died. The split now grows
    to one global batch, and evaluation runs."""
    log = tmp_path / "log.jsonl"
    rc, err = _run(train, ["--data", texts["poem"], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32", "--max-steps", "2",
                           "--val-fraction", "0.001",
                           "--eval-interval", "2", "--eval-steps", "1", "--no-progress",
                           "--log-json", log], capsys)
    assert rc == 0, err
    assert "validation split:" in err and "instead of 1, so it holds one global batch" in err
    assert math.isfinite(_records(log)[-1]["val_loss"])


def test_a_tiny_file_trains_with_a_batch_that_fits(texts, cache, tiny_model, tmp_path, capsys):
    """One short paragraph, a window or two: no validation split (warned, training goes on);
    --global-batch-size 1 alone is enough (the micro-batch size adapts)."""
    log = tmp_path / "log.jsonl"
    rc, err = _run(train, ["--data", texts["tiny"], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32",
                           "--global-batch-size", "1", "--max-steps", "2", "--no-progress",
                           "--log-json", log], capsys)
    assert rc == 0, err
    assert "no validation split: the data is one document" in err
    assert "--micro-batch-size not given: using 1" in err
    _assert_trained(log, 2)


@pytest.mark.parametrize("doc_tokens, gbs, expect", [
    ([5] * 100, 4, "grown"),           # 5 held-out docs of 5 tokens: grown to one batch
    ([400] * 100, 4, "as asked"),      # 5 % of the docs already hold a batch
    ([20] * 10, 8, "none"),            # a batch would take more than half the data
    ([40, 40], 2, "none"),             # a batch needs both documents: none left to train
    # enough tokens, in too few documents to hold out whole ones: the fix is more documents,
    # not "use more data" (a user's 667k tokens in 3 paragraphs were called too small)
    ([20000, 40, 40], 4, "uneven"),
])
def test_the_validation_split_grows_to_one_batch_or_steps_aside(doc_tokens, gbs, expect):
    import numpy as np

    from megapar.training.config import TrainConfig
    from megapar.training.data import split_for_training

    class Indexed:
        doc_offsets = np.concatenate([[0], np.cumsum(doc_tokens)])
        num_docs = len(doc_tokens)
        prompt_lengths = None  # text, not prompt / response records

    cfg = TrainConfig(seq_len=32, global_batch_size=gbs, micro_batch_size=1)
    train_docs, val_docs, note = split_for_training(cfg, Indexed, "gpt2")
    if expect in ("none", "uneven"):
        assert val_docs is None and train_docs is None, (train_docs, val_docs)
        assert note.startswith("no validation split: " + (
            "the data is too small for a validation batch of" if expect == "none" else
            f"its 3 documents are too few or too uneven to hold out whole ones for a validation "
            f"batch of {gbs} x 32 tokens besides training; training without validation (split "
            f"the text into more documents: paragraphs separated by blank lines, or megapar-data "
            f"--split-lines)")), note
        return
    assert sorted([*train_docs, *val_docs]) == list(range(len(doc_tokens)))
    val_tokens = sum(doc_tokens[i] for i in val_docs)
    assert val_tokens >= gbs * 32 + 1  # one global batch of windows
    assert (len(val_docs) > 5) == (expect == "grown") and (note is not None) == (expect == "grown")


@pytest.mark.parametrize("shape, argv, message", [
    ("tiny", ["--global-batch-size", "16"], "fewer than one global batch of 16"),  # given: kept
    ("invalid_utf8", [], "are not valid UTF-8"),
    ("empty", [], "every input is empty or whitespace"),
])
def test_unusable_text_fails_with_its_message(shape, argv, message, texts, cache, tiny_model,
                                              capsys):
    rc, err = _run(train, ["--data", texts[shape], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32", "--no-progress",
                           *argv], capsys)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_tiny_file_with_default_flags_trains_with_a_smaller_global_batch(
        texts, cache, tiny_model, tmp_path, capsys):
    """The regression: a file of a window or two and no batch flags failed with "fewer than
    one global batch of 16"; the global batch (and micro-batch) not given now shrink to what
    the data holds, with a note. Given, the error stays (test_unusable_text_fails_...)."""
    log = tmp_path / "log.jsonl"
    rc, err = _run(train, ["--data", texts["tiny"], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32", "--max-steps", "2",
                           "--no-progress", "--log-json", log], capsys)
    assert rc == 0, err
    assert "--global-batch-size not given: using" in err and "instead of 16" in err
    _assert_trained(log, 2)
    # at dp 2 (pp 1, tp 1 with --dp is not launched here): a batch a multiple of mbs x dp
    from megapar.training.config import TrainConfig
    from megapar.training.validate import fit_batch_to_data

    cfg = TrainConfig()
    cfg.explicit = frozenset()
    assert "using 6 and micro-batch size 3" in fit_batch_to_data(cfg, 7, 2)
    assert (cfg.global_batch_size, cfg.micro_batch_size) == (6, 3)
    cfg = TrainConfig()
    cfg.explicit = frozenset({"micro_batch_size"})
    assert fit_batch_to_data(cfg, 7, 2) is None  # 4 x 2 does not fit; --micro-batch-size given
    assert fit_batch_to_data(TrainConfig(global_batch_size=8), 3, 1) is None  # given


def test_a_file_too_short_for_one_window_is_named_not_its_cache(cache, tiny_model, tmp_path,
                                                                capsys):
    short = tmp_path / "short.txt"
    short.write_text("hello there world ok")  # 20 bytes
    rc, err = _run(train, ["--data", short, "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32", "--no-progress"],
                   capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--data {short} (tokenized with --tokenizer sentencepiece): " in err
    assert cache not in err and "fewer than one window of --seq-len + 1 = 33" in err


def test_min_lr_not_given_follows_a_lower_lr(texts, cache, tiny_model, tmp_path, capsys):
    """The regression: `--lr 5e-5` alone failed ("--min-lr 0.0001 is larger than --lr");
    --min-lr not given now keeps the defaults' ratio (0.1) below a lower --lr."""
    from megapar.optim import LRScheduler

    log = tmp_path / "log.jsonl"
    rc, err = _run(train, ["--data", texts["poem"], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32", "--max-steps", "3",
                           "--lr", "5e-5", "--no-progress", "--log-json", log], capsys)
    assert rc == 0, err
    assert "--min-lr not given: using 5e-06 (--lr 5e-05 x 0.1" in err
    expected = LRScheduler(5e-5, 5e-6, 0, 3, "cosine")
    lrs = [r["lr"] for r in _records(log)]
    assert lrs == pytest.approx([expected.lr(i) for i in range(3)], rel=1e-6)
    rc, err = _run(train, ["--data", texts["poem"], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32", "--max-steps", "2",
                           "--lr", "3e-3", "--no-progress", "--sequence-parallel"], capsys)
    assert rc == 0 and "--min-lr not given" not in err  # a higher --lr keeps the default
    # a flag with nothing to do at tp 1 says so (it was accepted without a word)
    assert "--sequence-parallel at --tp 1: nothing to split" in err


def test_config_file_values_are_parsed_like_flags(texts, cache, tiny_model, tmp_path, capsys):
    """The regression: YAML reads `lr: 1e-3` as a string (refused), "no" was true and null a
    traceback. Values now go through each flag's type."""
    from megapar.training.config import parse_args

    run = tmp_path / "run.yaml"
    run.write_text('lr: 1e-3\nmin_lr: "1e-5"\nsequence_parallel: "no"\nprogress: off\n'
                   'global_batch_size: "8"\nmicro_batch_size: 4.0\nmax_steps: 2\n'
                   'seq_len: 32\ndebug: 1\n')
    cfg = parse_args(["--config", str(run)])
    assert (cfg.lr, cfg.min_lr, cfg.global_batch_size, cfg.micro_batch_size) == \
        (1e-3, 1e-5, 8, 4)
    assert cfg.sequence_parallel is False and cfg.progress is False and cfg.debug is True
    assert type(cfg.micro_batch_size) is int
    assert parse_args(["--config", str(run), "--sequence-parallel"]).sequence_parallel is True
    run.write_text(run.read_text().replace("debug: 1", "debug: false"))
    rc, err = _run(train, ["--config", run, "--data", texts["poem"], "--data-cache", cache,
                           "--model", tiny_model, "--tokenizer", "sentencepiece",
                           "--log-json", tmp_path / "log.jsonl"], capsys)
    assert rc == 0, err
    _assert_trained(tmp_path / "log.jsonl", 2)


def test_a_config_files_value_out_of_range_is_said_with_the_file(tmp_path):
    """A type error in a --config file named the file, a value out of range did not (the same
    line as the flag's). It does now; a flag given beside the file's value replaces it."""
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    run = tmp_path / "run.yaml"
    for text, said in [("label_smoothing: 1.5\n", "--label-smoothing 1.5 is invalid: it must be "
                                                  "in [0, 1) (the default is 0.0)"),
                       ("max_steps: 1.5\n", "--max-steps 1.5 is invalid: it must be a whole "
                                            "number >= 1"),
                       ("timeout_s: 1e12\n", "--timeout-s 1e+12 is invalid: at most 1e+09 s")]:
        run.write_text(text)
        with pytest.raises(ConfigError) as err:
            parse_args(["--config", str(run)])
        assert str(err.value).startswith(f"{run}: {said}"), err.value
    run.write_text("label_smoothing: 1.5\n")
    assert parse_args(["--config", str(run), "--label-smoothing", "0.1"]).label_smoothing == 0.1


def test_the_raw_text_flags_its_messages_recommend_exist(texts, cache, tiny_model, tmp_path,
                                                         capsys):
    """megapar-train said "pass --allow-invalid-utf8" / "pass --jsonl-key", flags only
    megapar-data had. Both are megapar-train flags now, and part of the cache key (a dataset
    cached with other settings is not reused)."""
    common = ["--data-cache", cache, "--model", tiny_model, "--tokenizer", "sentencepiece",
              "--seq-len", "32", "--max-steps", "1", "--no-progress"]
    body = tmp_path / "body.jsonl"
    rng = random.Random(3)
    body.write_text("".join(json.dumps({"body": words(rng, 40)}) + "\n" for _ in range(100)))
    rc, err = _run(train, ["--data", body, *common], capsys)
    assert rc == 2 and "pass --jsonl-key" in err
    rc, err = _run(train, ["--data", body, "--jsonl-key", "body", *common], capsys)
    assert rc == 0, err
    rc, err = _run(train, ["--data", body, *common], capsys)  # not the cached "body" dataset
    assert rc == 2 and "pass --jsonl-key" in err

    junk = tmp_path / "junk.txt"
    junk.write_bytes(texts["poem"].read_bytes() + random.Random(1).randbytes(2_000))
    rc, err = _run(train, ["--data", junk, *common], capsys)
    assert rc == 2 and "pass --allow-invalid-utf8" in err
    rc, err = _run(train, ["--data", junk, "--allow-invalid-utf8", *common], capsys)
    assert rc == 0 and "bytes of invalid UTF-8 replaced with U+FFFD" in err, err
    rc, err = _run(train, ["--data", junk, *common], capsys)  # not the cached dataset
    assert rc == 2 and "pass --allow-invalid-utf8" in err


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
def test_default_flags_with_a_few_steps(steps, texts, cache, tiny_model, tmp_path, capsys):
    """Only --max-steps (and a small model and tokenizer): the default warmup (20) and
    --seq-len (128, the model has 64 positions) adapt, and the log says so."""
    log = tmp_path / "log.jsonl"
    rc, err = _run(train, ["--max-steps", steps, "--data", texts["poem"], "--data-cache", cache,
                           "--model", tiny_model, "--tokenizer", "sentencepiece",
                           "--log-json", log], capsys)
    assert rc == 0, err
    assert f"--warmup-steps not given: using {steps // 10}" in err
    assert "--seq-len not given: using the model's 64 positions" in err
    # how much data there is and how much the run reads (a new user found no line saying it)
    said = re.search(r"data: --data \S+ holds ([\d,]+) training samples of 64 tokens \(([\d,]+) "
                     r"samples? held out for validation\); --max-steps (\d+) x (\d+) sequences "
                     r"read ([\d,]+) of them: ([\d.]+) of an epoch", err)
    assert said, err
    samples, held, drawn = (int(said[i].replace(",", "")) for i in (1, 2, 5))
    assert int(said[3]) == steps and drawn == steps * int(said[4]) and held > 0
    per_epoch = samples // int(said[4]) * int(said[4])  # an epoch's last, incomplete batch
    assert said[6] == f"{drawn / per_epoch:.2f}"
    _assert_trained(log, steps)


def test_megapar_data_refuses_junk_and_warns_on_a_few_bad_bytes(texts, tmp_path, capsys):
    rc, err = _run(data_cli, ["--input", texts["invalid_utf8"], "--output-prefix",
                              tmp_path / "junk", "--no-progress"], capsys)
    assert rc == 2 and "--allow-invalid-utf8" in err
    assert not list(tmp_path.iterdir())  # nothing half-written
    rc, err = _run(data_cli, ["--input", texts["empty"], "--output-prefix", tmp_path / "empty",
                              "--no-progress"], capsys)
    assert rc == 2 and "every input is empty" in err
    mostly = tmp_path / "mostly.txt"
    mostly.write_bytes(texts["poem"].read_bytes() + b"\xff\xfe")
    rc, err = _run(data_cli, ["--input", mostly, "--output-prefix", tmp_path / "mostly",
                              "--no-progress"], capsys)
    assert rc == 0 and "2 bytes of invalid UTF-8 replaced" in err
    rc, err = _run(data_cli, ["--input", texts["invalid_utf8"], "--output-prefix",
                              tmp_path / "forced", "--no-progress", "--allow-invalid-utf8"],
                   capsys)
    assert rc == 0 and "invalid UTF-8 replaced" in err


@pytest.mark.parametrize("content, message", [
    ({"model_type": "gpt2", "n_embd": 32, "n_layers": 4, "n_head": 4},
     "unknown key 'n_layers' for gpt2; did you mean 'n_layer'?"),
    ({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
      "tie_word_embeddings": False}, "tie_word_embeddings=False is a transformers GPT2Config "
                                     "setting megapar does not implement"),
    ({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
      "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"model_type": "gpt2", "n_embd": -32, "n_layer": 2, "n_head": 4},
     "n_embd=-32 must be a whole number >= 1"),
])
def test_model_config_typos_are_errors(content, message, texts, cache, tmp_path, capsys):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(content))
    rc, err = _run(train, ["--data", texts["poem"], "--data-cache", cache, "--model", model,
                           "--tokenizer", "sentencepiece", "--no-progress"], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_flag_typo_names_the_closest_flag(capsys):
    from megapar.cli.bubble import main as bubble
    with pytest.raises(SystemExit) as exit_:
        train(["--max-step", "3", "--sed=1", "--tp", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("--max-step: did you mean --max-steps?; --sed: did you mean --seed?" in err), err
    with pytest.raises(SystemExit):
        bubble(["--pp", "2", "-m", "4", "--simulate", "--shedule", "zb-v"])
    assert "--shedule: did you mean --schedule?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not the router's --moe-z-loss-coef, for a dense model
        train(["--z-loss-coef", "1e-4"])
    assert "--z-loss-coef: did you mean --z-loss (the output z-loss;" in capsys.readouterr().err


def test_every_config_file_typo_is_named_at_once(tmp_path):
    from megapar.training.config import ConfigError, read_run_config
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"seqlen": 32, "max_step": 4, "tp": 1}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(run))
    assert ("unknown setting 'max_step'; did you mean 'max_steps'?; unknown setting 'seqlen'; "
            "did you mean 'seq_len'?") in str(err.value)


def test_a_deepspeed_config_names_megapars_flags_for_its_keys(tmp_path):
    """A ds_config.json given to --config is one line naming the megapar-train flags its
    settings are (was a list of "unknown setting" naming --micro-batch-size for
    train_batch_size, the global batch), and its keys that have none (zero_optimization's
    too: its bucket in elements as --grad-bucket-mb of fp32 gradients, overlap_comm what megapar
    always does, stage3_prefetch_bucket_size none)."""
    from megapar.training.config import ConfigError, read_run_config
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "nvme"},
                              "stage3_param_persistence_threshold": 1e5,
                              "reduce_bucket_size": 5e8, "overlap_comm": True,
                              "stage3_prefetch_bucket_size": 5e7},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "wall_clock_breakdown": False}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value) == (
        f"{ds} is a DeepSpeed config, which megapar-train does not read: give its settings as "
        f"megapar-train flags (or a --config file of them): --dp 2 --global-batch-size 16 "
        f"--micro-batch-size 2 --clip-grad 1.0 --precision bf16 --zero 3 --offload-optimizer "
        f"--zero3-persistence-threshold 100000 --grad-bucket-mb 1907.349 --optimizer adamw "
        f"--lr 0.0003 --weight-decay 0 --adam-beta2 0.999 --lr-decay constant --warmup-steps 0 "
        f"(no equivalent: zero_optimization.offload_param.device "
        f"nvme (the host only), zero_optimization.stage3_prefetch_bucket_size, "
        f"wall_clock_breakdown)"), err.value
    # the Hugging Face Trainer's "auto" values: were --global-batch-size auto and both
    # --precision fp16 and --precision bf16
    ds.write_text(json.dumps({"train_batch_size": "auto", "fp16": {"enabled": "auto"},
                              "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith(
        ": --zero 2; and for the keys the Hugging Face Trainer fills (\"auto\"): train_batch_size, "
        "fp16.enabled, bf16.enabled, megapar's own values"), err.value


def test_a_deepspeed_fp16_section_names_the_loss_scale_flags(tmp_path):
    """DeepSpeed's fp16 loss-scaler keys are megapar-train's flags (were dropped without a word:
    hysteresis 2, DeepSpeed's default, named even where absent, as megapar's is 1; a static
    loss_scale was "no equivalent"); consecutive_hysteresis has none."""
    from megapar.training.config import ConfigError, read_run_config
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
        "min_loss_scale": 0.5}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith(
        "--global-batch-size 8 --precision fp16 --initial-loss-scale 4096 "
        "--loss-scale-window 500 --min-loss-scale 0.5 --hysteresis 2 --clip-grad 0 --lr-decay "
        "constant --warmup-steps 0"), err.value
    ds.write_text(json.dumps({"fp16": {"enabled": True, "hysteresis": 4,
                                       "consecutive_hysteresis": True}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith(
        "--precision fp16 --hysteresis 4 --clip-grad 0 --lr-decay constant --warmup-steps 0 (no "
        "equivalent: fp16.consecutive_hysteresis (megapar's "
        "hysteresis is restored when the scale grows, not after each clean step))"), err.value
    # a static scale: DeepSpeed reads none of the dynamic keys then, and they are named so
    # (consecutive_hysteresis beside one was dropped without a word: a new user's tryout)
    ds.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 128}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith("--precision fp16 --loss-scale 128 --clip-grad 0 --lr-decay "
                                   "constant --warmup-steps 0"), err.value
    ds.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4,
                                       "consecutive_hysteresis": True}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith(
        "--precision fp16 --loss-scale 128 --clip-grad 0 --lr-decay constant --warmup-steps 0 "
        "(no equivalent: fp16.hysteresis, "
        "fp16.consecutive_hysteresis (unused with a static loss_scale))"), err.value


def test_a_deepspeed_config_gets_deepspeeds_defaults_where_megapars_differ(tmp_path):
    """A stage-3 config without stage3_param_persistence_threshold (DeepSpeed's 1e5, megapar's
    0), a micro-batch without train_batch_size (DeepSpeed accumulates nothing, megapar-train's
    default global batch is 16) and an activation_checkpointing section were translated as
    `--zero 3 --micro-batch-size 4` and "no equivalent: activation_checkpointing" (a DeepSpeed
    user's tryout of docs/comparison.md)."""
    from megapar.training.config import ConfigError, read_run_config
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3},
                              "train_micro_batch_size_per_gpu": 4,
                              "activation_checkpointing": {"partition_activations": True}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith(
        "--zero 3 --zero3-persistence-threshold 100000 --micro-batch-size 4 "
        "--global-batch-size (4 x dp) --clip-grad 0 --lr-decay constant --warmup-steps 0 (no "
        "equivalent: activation_checkpointing (it tunes the "
        "model's own checkpoint calls; megapar's --recompute full recomputes every block))"
    ), err.value
    # the micro-batch times the accumulation steps (was "(micro-batch x 3 x dp)" beside the
    # micro-batch's 4), a number at the command line's --dp
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 3}))
    for dp, batch in [(None, "(12 x dp)"), (2, "24")]:
        with pytest.raises(ConfigError) as err:
            read_run_config(str(ds), dp)
        assert f": --micro-batch-size 4 --global-batch-size {batch} --clip-grad 0" in str(
            err.value), err.value
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2},
                              "train_micro_batch_size_per_gpu": 4, "train_batch_size": 32}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith(": --zero 2 --micro-batch-size 4 --global-batch-size 32 "
                                   "--clip-grad 0 --lr-decay constant --warmup-steps 0"), err.value
    # the Hugging Face Trainer's ZeRO-3 config ("auto" values it fills: not DeepSpeed's
    # defaults then), a stage of 3.0 and its dynamic fp16 scaler under "enabled": "auto" (a
    # re-test's: --zero3-persistence-threshold 100000 beside "megapar's own values", the
    # batch "(4 x dp)" the Trainer's accumulation makes, --zero 3.0, the scaler dropped)
    ds.write_text(json.dumps({
        "zero_optimization": {"stage": 3.0, "stage3_param_persistence_threshold": "auto"},
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    # the scaler's flags where the Trainer runs fp16 (alone, without --precision fp16, they
    # were refused: "--initial-loss-scale 65536 would be ignored"; a re-test)
    assert ": --zero 3 --micro-batch-size 4; and for the keys the Hugging Face Trainer fills " \
        '("auto"): zero_optimization.stage3_param_persistence_threshold, train_batch_size, ' \
        "fp16.enabled (where the Trainer runs fp16: --precision fp16 --initial-loss-scale " \
        "65536 --hysteresis 2)" in str(err.value), err.value


@pytest.mark.parametrize("scheduler, flags, left", [
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 100}},
     ["--lr-decay constant", "--warmup-steps 100", "--lr 0.0003", "--clip-grad 0"],
     ["scheduler.params.warmup_type log (megapar's warmup is linear)"]),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 90,
                                          "warmup_min_lr": 1e-5, "warmup_type": "linear"}},
     ["--lr-decay linear", "--warmup-steps 10", "--max-steps 90", "--lr 0.001", "--min-lr 1e-05",
      "--clip-grad 0"], []),
    ({"type": "OneCycle", "params": {}}, ["--clip-grad 0"], ["scheduler.type OneCycle"]),
])
def test_a_deepspeed_scheduler_names_megapars_decay(scheduler, flags, left):
    """A ds_config's scheduler: its warmup steps were named without its decay, so a WarmupLR
    (constant after warmup) became megapar's default cosine decay; now the decay (and the
    peak and floor) too, and a scheduler megapar has none of is named as such."""
    from megapar.training.deepspeed_config import deepspeed_equivalents

    assert deepspeed_equivalents({"scheduler": scheduler}) == (flags, left, [])


def test_a_deepspeed_config_says_deepspeeds_own_defaults_and_refuses_a_value_for_a_section(
        tmp_path):
    """DeepSpeed's optimizers decay no weights and it clips nothing unless told, and without a
    scheduler section its lr is constant: the translation kept megapar-train's 0.1, 1.0 and a
    warmed-up cosine (the losses differed); an optimizer-only config was read as torchtitan's
    (its schedule, --lr twice); adam_w_mode false, SGD's momentum and other params were
    unsaid; a value where a section goes was a traceback (a DeepSpeed user's re-test)."""
    from megapar.training.config import ConfigError, read_run_config
    from megapar.training.deepspeed_config import deepspeed_equivalents

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {
        "lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": False, "torch_adam": True}}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value) == (
        f"{ds} is a DeepSpeed config, which megapar-train does not read: give its settings as "
        f"megapar-train flags (or a --config file of them): --optimizer adamw --lr 0.001 "
        f"--weight-decay 0.1 --adam-beta2 0.999 --clip-grad 0 --lr-decay constant "
        f"--warmup-steps 0 (no equivalent: optimizer.params.adam_w_mode false (Adam with L2 "
        f"decay in the gradient; megapar's adamw decays the weights apart from it))")
    flags, left, _ = deepspeed_equivalents({"optimizer": {"type": "SGD", "params": {
        "lr": 0.1, "momentum": 0.5, "nesterov": True}}, "gradient_clipping": 1.0})
    assert flags == ["--optimizer sgd", "--lr 0.1", "--weight-decay 0", "--clip-grad 1.0",
                     "--lr-decay constant --warmup-steps 0"], flags
    assert left == ["optimizer.params.momentum 0.5 (megapar's sgd uses 0.9)",
                    "optimizer.params.nesterov true"], left
    for bad, said in (({"scheduler": {"type": "WarmupLR", "params": "x"}},
                       'scheduler.params is "x": DeepSpeed takes a section there'),
                      ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}},
                       'zero_optimization.offload_optimizer is "cpu": DeepSpeed takes a section '
                       'there ({...}, e.g. {"device": "cpu"})')):
        ds.write_text(json.dumps(bad))
        with pytest.raises(ConfigError) as err:
            read_run_config(str(ds))
        assert str(err.value).startswith(f"{ds}: {said}"), err.value


def test_a_deepspeed_scheduler_gets_deepspeeds_own_defaults(tmp_path):
    """WarmupLR / WarmupDecayLR train at warmup_max_lr, 1e-3 unless given, after 1000 warmup
    steps unless given (within total_num_steps): the optimizer's lr was printed and megapar's
    warmup kept; a WarmupCosineLR's floor is the optimizer's lr x cos_min_ratio, a number;
    a log warmup of 0 steps is no warmup to warn of; "auto" keys are the Trainer's (a re-test)."""
    from megapar.training.config import ConfigError, read_run_config
    from megapar.training.deepspeed_config import deepspeed_equivalents

    adamw = {"type": "AdamW", "params": {"lr": 3e-4}}
    flags = deepspeed_equivalents({"optimizer": adamw, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}})[0]
    assert "--lr 0.001" in flags and "--lr 0.0003" not in flags, flags
    flags = deepspeed_equivalents({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 100}}})[0]
    assert "--warmup-steps 100" in flags and "--max-steps 100" in flags, flags
    flags, left, _ = deepspeed_equivalents({"optimizer": adamw, "scheduler": {
        "type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1, "warmup_num_steps": 0,
                                             "total_num_steps": 100}}})
    assert "--min-lr 3e-05" in flags and "--lr 0.0003" in flags and not left, (flags, left)
    trainer = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                         "betas": "auto"}},
               "scheduler": {"type": "WarmupDecayLR", "params": {
                   "warmup_num_steps": "auto", "warmup_max_lr": "auto", "total_num_steps": "auto",
                   "warmup_min_lr": "auto"}}, "zero_optimization": {"stage": "auto"}}
    flags = " ".join(deepspeed_equivalents(trainer)[0])
    assert flags == "--optimizer adamw --lr-decay linear", flags
    # megapar-train's own settings beside DeepSpeed's were "no equivalent"
    ds = tmp_path / "mixed.json"
    ds.write_text(json.dumps({"model": "gpt2-tiny", "max_steps": 3, "zero_optimization": {
        "stage": 1}}))
    with pytest.raises(ConfigError) as err:
        read_run_config(str(ds))
    assert str(err.value).endswith("--zero 1 --clip-grad 0 --lr-decay constant --warmup-steps 0 "
                                   "--model gpt2-tiny --max-steps 3"), err.value
    for bad, said in (({"train_batch_size": 8, "fp16": True}, 'fp16 is true: DeepSpeed takes a '
                       'section there ({...}, e.g. {"enabled": true})'),
                      # bf16: true alone is a flag's key, not a DeepSpeed config (it was told
                      # that DeepSpeed takes a section there; a re-test)
                      ({"bf16": True}, "unknown setting 'bf16'; did you mean --precision bf16?"),
                      # a cosine scheduler read before an optimizer given as a word: traceback
                      ({"scheduler": {"type": "WarmupCosineLR", "params": {}},
                        "optimizer": "adam"}, 'optimizer is "adam": DeepSpeed takes a section'),
                      ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
                       "fp16 and bf16 are both enabled, which DeepSpeed refuses: enable one")):
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=re.escape(f"{ds}: {said}")):
            read_run_config(str(ds))


def test_a_deepspeed_config_deepspeed_refuses_or_reads_otherwise_is_said(tmp_path):
    """A re-test's findings: batch keys DeepSpeed refuses were translated (train_batch_size 16
    beside a micro-batch of 4 and 3 accumulation steps); train_batch_size with accumulation
    steps gave no micro-batch; an offload_param DeepSpeed ignores (stage 2) or megapar cannot
    do alone (stage 3 without offload_optimizer) gave a flag megapar-train refuses; Lamb kept
    megapar's beta2 0.95; a warmup past total_num_steps, a missing total_num_steps, a missing
    optimizer type and WarmupLR's warmup_min_lr were unsaid."""
    from megapar.training.config import ConfigError, read_run_config
    from megapar.training.deepspeed_config import deepspeed_equivalents

    ds = tmp_path / "ds.json"
    for batch, dp, said in (
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 3}, None, "train_batch_size 16 is no multiple of "
         "train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 3, which DeepSpeed "
         "refuses"),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, None,
         "train_batch_size 10 is no multiple of train_micro_batch_size_per_gpu 4,"),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2}, 4, "train_batch_size 16 is not "
         "train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x --dp 4 = 32, "
         "which DeepSpeed refuses: correct one of them"),
    ):
        ds.write_text(json.dumps(batch))
        with pytest.raises(ConfigError, match=re.escape(f"{ds}: {said}")):
            read_run_config(str(ds), dp)
    steps = {"train_batch_size": 16, "gradient_accumulation_steps": 2}
    assert "--micro-batch-size (8 / dp)" in deepspeed_equivalents(steps)[0]
    assert "--micro-batch-size 4" in deepspeed_equivalents(steps, 2)[0]
    for zero, left in (({"stage": 2, "offload_param": {"device": "cpu"}},
                        "zero_optimization.offload_param (DeepSpeed offloads parameters at "
                        "stage 3 only)"),
                       ({"stage": 3, "offload_param": {"device": "cpu"}},
                        "zero_optimization.offload_param without offload_optimizer (megapar "
                        "offloads the parameters with the optimizer state: --offload-optimizer "
                        "--offload-params)")):
        flags, said, _ = deepspeed_equivalents({"zero_optimization": zero})
        assert "--offload-params" not in flags and said == [left], (flags, said)
    assert "--adam-beta2 0.999" in deepspeed_equivalents({"optimizer": {"type": "Lamb"}})[0]
    _, left, _ = deepspeed_equivalents({"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 50, "total_num_steps": 20, "warmup_type": "linear"}}})
    assert left == ["scheduler.params.warmup_num_steps 50 above total_num_steps 20 (DeepSpeed "
                    "warms up over all 50, never reaching its peak lr; megapar's warmup ends "
                    "within --max-steps)"], left
    _, left, _ = deepspeed_equivalents({"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_type": "linear"}}, "optimizer": {"params": {"lr": 1e-3}}})
    assert left == ["scheduler.params.total_num_steps (none given, which DeepSpeed's "
                    "WarmupCosineLR requires: give --max-steps)",
                    "optimizer.type (none given, which DeepSpeed refuses)"], left
    _, left, _ = deepspeed_equivalents({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-5, "warmup_type": "linear"}}})
    assert left == ["scheduler.params.warmup_min_lr 1e-05 (megapar's warmup rises from 0)"]


def test_a_deepspeed_configs_batch_sgd_and_cosine_warmup_as_deepspeed_reads_them(tmp_path):
    """A second re-test's: the three batch keys imply the dp (16 = 2 x 4 x 2) and were taken
    at dp 1 without a word; train_batch_size alone at a --dp it is no multiple of, and SGD's
    betas (DeepSpeed's torch.optim.SGD refuses them), were flags megapar-train then refused;
    the Trainer's "auto" micro-batch was derived anyway; WarmupCosineLR's warmup_min_ratio was
    dropped unsaid."""
    from megapar.training.config import ConfigError, read_run_config
    from megapar.training.deepspeed_config import deepspeed_equivalents

    three = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
             "gradient_accumulation_steps": 3}
    assert deepspeed_equivalents(three)[0][0] == "--dp 2"
    assert "--dp 2" not in deepspeed_equivalents(three, 2)[0]
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16}))
    with pytest.raises(ConfigError, match="train_batch_size 16 is no multiple of --dp 3, which "
                                          "DeepSpeed refuses"):
        read_run_config(str(ds), 3)
    flags, left, _ = deepspeed_equivalents({"optimizer": {"type": "SGD", "params": {
        "lr": 0.1, "betas": [0.9, 0.99]}}})
    assert not any("--adam-beta" in f for f in flags), flags
    assert left[0] == ("optimizer.params.betas [0.9, 0.99] (SGD has none: DeepSpeed's "
                       "torch.optim.SGD refuses them)"), left
    flags, _, auto = deepspeed_equivalents({"train_batch_size": 32, "gradient_accumulation_steps":
                                            2, "train_micro_batch_size_per_gpu": "auto"}, 1)
    assert not any("--micro-batch-size" in f for f in flags) and auto, flags
    _, left, _ = deepspeed_equivalents({"scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.1,
        "warmup_type": "linear"}}})
    assert left == ["scheduler.params.warmup_min_ratio 0.1 (megapar's warmup rises from 0)",
                    "scheduler.params.cos_min_ratio 0.0001 (of the optimizer's lr, which the "
                    "file does not give: --lr x 0.0001)"], left  # no lr known: no --min-lr


def test_a_deepspeed_optimizers_lr_under_a_warmup_schedulers_peak_is_named_once():
    """An optimizer's lr and a WarmupLR's warmup_max_lr (which DeepSpeed trains at) gave two
    --lr flags, a new user's finding; now the scheduler's alone, in either order."""
    from megapar.training.deepspeed_config import deepspeed_equivalents

    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_type": "linear"}}
    for data in ({"optimizer": optimizer, "scheduler": scheduler},
                 {"scheduler": scheduler, "optimizer": optimizer}):
        flags = " ".join(deepspeed_equivalents(data)[0]).split()
        assert flags.count("--lr") == 1 and flags[flags.index("--lr") + 1] == "0.0003", flags
    alone = deepspeed_equivalents({"optimizer": optimizer})[0]
    assert "--lr 0.001" in alone, alone


def test_run_config_typo_is_an_error(texts, cache, tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("max_step: 3\nseq_len: 32\n")
    rc, err = _run(train, ["--config", run, "--data", texts["poem"], "--data-cache", cache],
                   capsys)
    assert rc == 2 and "unknown setting 'max_step'; did you mean 'max_steps'?" in err


def test_resume_a_from_hf_checkpoint_at_another_layout_with_no_model_flags(
        texts, cache, tmp_path, capsys):
    """The regression: a transformers GPT-2 (vocab 50257) started with --from-hf, saved,
    converted to pp 2, then resumed with only --load: the model comes from the checkpoint
    (the recipe default would have had the tokenizer's 50261 and died in the workers)."""
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    hf = tmp_path / "hf"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_positions=64, n_embd=32, n_layer=2, n_head=4)).save_pretrained(hf)
    common = ["--data", texts["poem"], "--data-cache", cache, "--tokenizer", "gpt2",
              "--seq-len", "32", "--global-batch-size", "4", "--no-progress"]
    ckpt, moved, log = tmp_path / "ckpt", tmp_path / "ckpt-pp2", tmp_path / "log.jsonl"
    rc, err = _run(train, [*common, "--from-hf", hf, "--max-steps", "2", "--save", ckpt], capsys)
    assert rc == 0, err
    assert _run(convert, [ckpt, moved, "--tp", "1", "--pp", "2", "--no-progress"], capsys)[0] == 0
    rc, err = _run(train, [*common, "--load", moved, "--pp", "2", "--max-steps", "3",
                           "--log-json", log], capsys)
    assert rc == 0, err
    assert [r["step"] for r in _records(log)] == [3]
    # flags that agree with the checkpoint are fine; flags that contradict it are an error
    rc = train([str(a) for a in [*common, "--load", moved, "--from-hf", hf, "--max-steps", "3"]])
    out = capsys.readouterr()
    assert rc == 0, out.err  # a requeued --from-hf run: the checkpoint's weights, as it says
    assert f"resumed from {moved} at step 2 (resharded from tp=1 pp=2 dp=1; its weights, " \
           f"not --from-hf {hf}'s)" in out.out, out.out
    rc, err = _run(train, [*common, "--load", moved, "--model", "gpt2-124m", "--max-steps", "3"],
                   capsys)
    assert rc == 2 and "holds another model than --model gpt2-124m" in err and "n_embd=32" in err
    # megapar-eval --load takes the model from the checkpoint too, at any layout
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(16, dtype=np.int64).reshape(2, 8))
    rc, err = _run(evaluate, ["--load", moved, "--tp", "2", "--input-ids", ids, "--save-logits",
                              tmp_path / "logits.npy"], capsys)
    assert rc == 0, err
    assert np.load(tmp_path / "logits.npy").shape == (2, 8, 50257)


def test_a_worker_error_is_one_line_with_the_traceback_in_the_ranks_log(
        texts, cache, tiny_model, tmp_path, capsys, monkeypatch):
    """Rank 1 (forked) fails while saving after the last of 2 steps: one line naming rank 1 and
    step 2 (not 3), the traceback in CACHE/logs/run-*/rank1.log (the --save it made is removed:
nothing was saved); --debug puts it on the terminal."""
    import torch.distributed as dist

    from megapar.training.loop import Trainer

    real_save = Trainer.save

    def failing_save(self, *args, **kwargs):
        if dist.get_rank() == 1:
            raise OSError("disk on fire")
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "save", failing_save)
    argv = ["--data", texts["poem"], "--data-cache", cache, "--model", tiny_model, "--tokenizer",
            "sentencepiece", "--seq-len", "32", "--pp", "2", "--max-steps", "2", "--no-progress",
            "--save", tmp_path / "ckpt"]
    rc = train([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("megapar-train: ") and "not given" not in x
             and not x.startswith("megapar-train: data: ")]
    assert rc == 1 and "Traceback" not in err
    # the line also says what the failure cost (issue 11): nothing was saved yet
    assert lines[0] == ("megapar-train: error: rank 1 failed at step 2: OSError: disk on fire"
                        " -- not saved: steps 1-2 (last checkpoint: none)")
    # nothing saved in the --save this run made: it is removed, the log kept in the cache
    assert not (tmp_path / "ckpt").exists()
    log = Path(lines[1].removeprefix("megapar-train: full traceback in ").split(" (or ")[0])
    assert lines[1] == f"megapar-train: full traceback in {log} (or rerun with --debug)"
    assert log.parent.parent == Path(cache) / "logs" and log.parent.name.startswith("run-")
    assert "Traceback" in log.read_text() and "disk on fire" in log.read_text()
    rc = train([str(a) for a in argv] + ["--debug"])
    assert rc == 1 and "Traceback" in capsys.readouterr().err


def test_wandb_mode_follows_wandb_mode_else_the_network(monkeypatch):
    import socket

    from megapar.training.logging import wandb_mode

    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode()[0] == "online"
    monkeypatch.delenv("WANDB_MODE")

    def unreachable(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    assert wandb_mode()[0] == "offline"

    class Conn:
        def close(self):
            pass

    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: Conn())
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == ("online", "api.wandb.ai reachable")


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        train(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps "(default: 1)" by width
    assert "(default: None)" not in out and out.count("(default: 1)") == 7  # --tp, --cp, --pp, --ep,
    # --virtual-stages, --hysteresis, --expert-tensor-parallel-size
    assert "(default: 1) (default" not in out


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_the_unsupported_transformers_settings_table_matches_transformers(kind, tmp_path):
    """Checked against transformers itself: each setting megapar accepts only at one value
    accepts transformers' default, and a config.json saved by transformers (all keys at their
    defaults) loads; one setting changed is refused."""
    import transformers

    from megapar.models.config import (
        HF_SUPPORTED_DEFAULTS,
        ConfigError,
        config_from_dict,
        config_from_file,
    )

    hf = getattr(transformers, {"gpt2": "GPT2Config", "bert": "BertConfig"}[kind])()
    for key, value in HF_SUPPORTED_DEFAULTS[kind].items():
        if hasattr(hf, key):
            assert getattr(hf, key) == value, key
    hf.save_pretrained(tmp_path)
    assert config_from_file(tmp_path / "config.json").model_type == kind
    data = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="tie_word_embeddings=False"):
        config_from_dict({**data, "tie_word_embeddings": False})


def test_load_alone_resumes_with_the_checkpoints_settings(texts, cache, tiny_model, tmp_path,
                                                          capsys):
    """`--load CKPT` with no other flag takes data, batch, seq-len, ... from the checkpoint;
    a setting given that breaks its data order is an error before workers start."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    rc, err = _run(train, ["--data", texts["poem"], "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32",
                           "--global-batch-size", "8", "--max-steps", "4", "--save-interval", "2",
                           "--save", ckpt, "--no-progress"], capsys)
    assert rc == 0, err
    rc, err = _run(train, ["--load", ckpt / "step_00000002", "--data-cache", cache, "--pp", "2",
                           "--log-json", log, "--no-progress"], capsys)
    assert rc == 0, err
    assert "from the checkpoint (not given):" in err and "--seq-len 32" in err
    assert "--save-interval" not in err  # no --save: the checkpoint's interval does nothing
    assert [r["step"] for r in _records(log)] == [3, 4]
    rc, err = _run(train, ["--load", ckpt, "--data-cache", cache, "--max-steps", "6",
                           "--seq-len", "16", "--no-progress"], capsys)
    assert rc == 2 and "--seq-len 16 differs from the checkpoint's 32: --load" in err


@pytest.mark.parametrize("key, value, lead", [
    ("seq_len", 64, "--seq-len 64 differs from the checkpoint's 128: --load ck cannot continue"),
    ("val_fraction", 0.1, "--val-fraction 0.1 differs from the checkpoint's 0.0: --load ck"),
    # was "cannot continue its data order: dataset_len 682 (checkpoint) vs 1364", no --data named
    ("data", "b.txt", "--data b.txt differs from the checkpoint's /d/a.txt: --load ck cannot"),
])
def test_a_resume_refused_for_its_sample_count_names_the_flag_that_changed_it(
        key, value, lead, monkeypatch):
    """A --data, --seq-len (or --val-fraction) other than the checkpoint's changes the number of
    training samples: the refusal names that flag first and the value to resume with, not the
    internal dataset_len alone; the recorded (absolute) --data given as a relative path is the
    same data and is not named."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_resumable

    monkeypatch.chdir("/")
    saved = {"seq_len": 128, "val_fraction": 0.0, "global_batch_size": 16, "seed": 1234,
             "data": "/d/a.txt"}
    cfg = TrainConfig(load="ck", global_batch_size=16, seed=1234, seq_len=128, val_fraction=0.0,
                      data="d/a.txt")
    setattr(cfg, key, value)
    manifest = {"meta": {"train_config": saved, "sampler": {
        "dataset_len": 682, "global_batch_size": 16, "seed": 1234}}}
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 1364)
    assert str(e.value).startswith(lead), str(e.value)
    assert f"resume with {lead.split(' differs')[0].split()[0]} {saved[key]}" in str(e.value)
    assert str(e.value).count("differs") == 1, str(e.value)  # d/a.txt from / is /d/a.txt
    if key != "val_fraction":
        check_resumable(cfg, manifest, 682)  # the same sample count continues
        return
    # another split of as many samples holds out other documents, some trained on (a helper:
    # --val-fraction 0.052 for 0.051 resumed without a word, 16 of 40 samples other)
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 682)
    assert str(e.value).startswith("--val-fraction 0.1 differs from the checkpoint's 0.0: it "
                                   "can hold out other documents"), str(e.value)
    assert "resume with --val-fraction 0.0" in str(e.value)
    check_resumable(dataclasses.replace(cfg, allow_data_change=True), manifest, 682)
    # where the training documents are known, the same ones continue and others are refused
    asked = []

    def split_of(fraction, batch):
        asked.append((fraction, batch))
        return [np.arange(3)] if fraction == 0.0 else [docs]

    docs = np.arange(3)
    check_resumable(cfg, manifest, 682, split_of)
    assert asked == [(0.0, 16), (0.1, 16)]  # the checkpoint's split with the checkpoint's batch
    docs = np.array([0, 1, 4])
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 682, split_of)
    assert "it holds out other documents" in str(e.value), str(e.value)
    assert "its data order cannot continue" in str(e.value), str(e.value)


def test_a_resume_of_the_shipped_sample_on_other_data_names_data():
    """A checkpoint trained on the shipped sample, resumed with a --data: the refusal said
    "dataset_len 1364 (checkpoint) vs 22648" and the four flags to check, not --data (a guide
    re-test); it names --data and the sample, with a second flag beside it."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_resumable

    saved = {"seq_len": 128, "val_fraction": 0.0, "global_batch_size": 16, "seed": 1234,
             "data": None}
    manifest = {"meta": {"train_config": saved, "sampler": {
        "dataset_len": 682, "global_batch_size": 16, "seed": 1234}}}
    cfg = TrainConfig(load="ck", global_batch_size=16, seed=1234, seq_len=128, val_fraction=0.0,
                      data="corpus.txt")
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 22648)
    assert str(e.value) == (
        "--data corpus.txt differs from the checkpoint's (the shipped sample): --load ck cannot "
        "continue its data order (dataset_len 682 (checkpoint) vs 22648); resume without --data "
        "(the checkpoint's shipped sample is taken), or pass --allow-data-change to continue on "
        "this data on purpose (its data order starts anew)")
    cfg.seq_len = 64
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 45296)
    assert "; --seq-len 64 differs from the checkpoint's 128: --load ck" in str(e.value)
    assert "resume with --seq-len 128 and without --data (or leave them out" in str(e.value)


def test_other_data_of_as_many_samples_is_named_as_other_data_not_changed():
    """A checkpoint of the shipped sample resumed with another file of as many samples said
    "the content of swapped.txt changed since the checkpoint was saved", of a file it never
    trained on (a re-test): other data is said to be other data."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_same_data

    for trained, back in ((None, "resume without --data (the checkpoint's shipped sample is "
                                 "taken)"),
                          ("/d/a.txt", "resume with --data /d/a.txt (or leave --data out: the "
                                       "checkpoint's is taken)")):
        manifest = {"meta": {"train_config": {"data": trained}, "data_fingerprint": ["aaa"]}}
        cfg = TrainConfig(load="ck", data="/d/swapped.txt")
        with pytest.raises(UsageError) as e:
            check_same_data(cfg, manifest, ["bbb"])
        was = "the shipped sample" if trained is None else "--data /d/a.txt"
        assert str(e.value) == (
            f"--load ck trained on {was}, and --data /d/swapped.txt holds other tokens (their "
            f"fingerprints differ); {back}, or pass --allow-data-change to continue on this data "
            f"on purpose"), str(e.value)
    # the same file, changed since: said so
    cfg = TrainConfig(load="ck", data="/d/a.txt")
    with pytest.raises(UsageError, match="the content of /d/a.txt changed since the checkpoint"):
        check_same_data(cfg, manifest, ["bbb"])


def _split_of_documents(tmp_path, lengths, **settings):
    """A run's config on an index of documents of `lengths` tokens (seq-len 32), its
    `training_documents` as a resume compares them, and the training samples they make."""
    import functools

    from megapar.data import GPTDataset, IndexedDataset, IndexedDatasetBuilder
    from megapar.training.config import TrainConfig
    from megapar.training.data import training_documents

    prefix = str(tmp_path / "ds")
    with IndexedDatasetBuilder(prefix, vocab_size=100, eod_id=0, tokenizer_spec={}) as b:
        b.add_documents([np.full(n, 5, dtype=np.int64) for n in lengths])
        b.finalize()
    cfg = TrainConfig(load="ck", seq_len=32, micro_batch_size=1, data=prefix, **settings)
    split_of = functools.partial(training_documents, cfg, prefix, "gpt2")

    def samples(fraction, batch):
        return len(GPTDataset(IndexedDataset(prefix), 32, doc_range=split_of(fraction, batch)[0]))

    return cfg, split_of, samples


def test_another_val_fraction_is_refused_only_where_it_moves_documents(tmp_path):
    """`training_documents` on a real index: --val-fraction 0.04 for 0.05 trains on as many
    samples (616) but not the same documents (a one-token document moved), so a resume is
    refused; 0.0501 holds out the same documents, so it continues."""
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_resumable

    cfg, split_of, samples = _split_of_documents(tmp_path, [400] * 50 + [1] * 50,
                                                 global_batch_size=4, val_fraction=0.04)
    assert samples(0.04, 4) == samples(0.05, 4) == 616
    manifest = {"meta": {"train_config": {"val_fraction": 0.05, "data": cfg.data}, "sampler": {
        "dataset_len": 616, "global_batch_size": 4, "seed": cfg.seed}}}
    with pytest.raises(UsageError, match="it holds out other documents"):
        check_resumable(cfg, manifest, 616, split_of)
    check_resumable(dataclasses.replace(cfg, val_fraction=0.0501), manifest, 616, split_of)


def test_another_global_batch_that_grows_the_split_over_other_documents_is_refused(tmp_path):
    """On data so small that the validation split grows to hold one global batch, a resume at
    global batch 5 for 4 held out one more document (a short one: the training samples stayed
    25) and went on without a word (a helper's review); it is refused, naming the batch. A
    batch that keeps the split continues."""
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_resumable

    rng = random.Random(4)
    lengths = [rng.choice([1, 1, 2, 5, 20, 33, 64, 100]) for _ in range(44)]
    cfg, split_of, samples = _split_of_documents(tmp_path, lengths, global_batch_size=5,
                                                 val_fraction=0.05)
    assert samples(0.05, 4) == samples(0.05, 5) == 25
    assert not np.array_equal(split_of(0.05, 4)[0], split_of(0.05, 5)[0])
    manifest = {"meta": {"train_config": {"val_fraction": 0.05, "data": cfg.data}, "sampler": {
        "dataset_len": 25, "global_batch_size": 4, "seed": cfg.seed}}}
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 25, split_of)
    assert str(e.value).startswith(
        "--global-batch-size 5 (the checkpoint's 4) holds out other documents for validation "
        "than --load ck did"), str(e.value)
    assert "resume with --global-batch-size 4 (or leave it out" in str(e.value)
    both = dataclasses.replace(cfg, val_fraction=0.0501)
    with pytest.raises(UsageError, match="resume with --val-fraction 0.05 --global-batch-size 4"):
        check_resumable(both, manifest, 25, split_of)
    check_resumable(dataclasses.replace(cfg, global_batch_size=4), manifest, 25, split_of)
    check_resumable(dataclasses.replace(cfg, allow_data_change=True), manifest, 25, split_of)


def test_a_resume_with_another_val_fraction_of_the_same_split_continues(texts, cache, tiny_model,
                                                                      tmp_path, capsys):
    """A --val-fraction that holds out the very documents the checkpoint's did (0.0501 for 0.05:
    both round to the same count) continues its data order, losses equal to a resume with the
    checkpoint's own; it was refused as one that "can hold out other documents"."""
    ckpt = tmp_path / "ckpt"
    base = ["--data", texts["poem"], "--data-cache", cache, "--model", tiny_model,
            "--tokenizer", "sentencepiece", "--seq-len", "32", "--global-batch-size", "8",
            "--no-progress"]
    rc, err = _run(train, [*base, "--val-fraction", "0.05", "--max-steps", "2", "--save", ckpt],
                   capsys)
    assert rc == 0, err
    losses = []
    for fraction in ("0.05", "0.0501"):
        log = tmp_path / f"{fraction}.jsonl"
        rc, err = _run(train, ["--load", ckpt, "--data-cache", cache, "--max-steps", "4",
                               "--val-fraction", fraction, "--log-json", log, "--no-progress"],
                       capsys)
        assert rc == 0, err
        losses.append([(r["step"], r["loss"]) for r in _records(log)])
    assert losses[0] == losses[1] and [s for s, _ in losses[0]] == [3, 4]


def test_a_resume_on_a_blend_of_one_part_names_the_data():
    """--data "1 PREFIX" for a checkpoint of --data PREFIX (or back): the same tokens drawn in
    a blend's order; it failed in the worker with the sampler's ValueError ("sampler state has
    shuffle=True but this sampler has False")."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_resumable

    manifest = {"meta": {"train_config": {"data": "/d/small", "seed": 1234},
                         "sampler": {"dataset_len": 87, "global_batch_size": 8, "seed": 1234}}}
    cfg = TrainConfig(load="ck", global_batch_size=8, seed=1234, data="1 /d/small")
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 87)
    assert str(e.value).startswith("--data 1 /d/small differs from the checkpoint's /d/small: "
                                   "a blend draws its samples in another order"), str(e.value)
    check_resumable(dataclasses.replace(cfg, data="/d/small"), manifest, 87)


def test_a_resume_whose_global_batch_moved_the_validation_split_names_the_batch():
    """The validation split holds out documents until it holds one global batch, so another
    --global-batch-size can change the training samples: the refusal named --data, --seq-len,
    --val-fraction and --seed, which had not changed; it names the batch size."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_resumable

    cfg = TrainConfig(load="ck", global_batch_size=16, seed=1234, seq_len=32, val_fraction=0.05)
    manifest = {"meta": {"train_config": {"seq_len": 32, "val_fraction": 0.05, "seed": 1234},
                         "sampler": {"dataset_len": 87, "global_batch_size": 8, "seed": 1234}}}
    with pytest.raises(UsageError) as e:
        check_resumable(cfg, manifest, 81)
    assert str(e.value).startswith("--global-batch-size 16 (the checkpoint's 8) changes the "
                                   "validation split"), str(e.value)
    assert "resume with --global-batch-size 8 (a run trained with --val-fraction 0 has no split" in str(e.value)
    check_resumable(cfg, manifest, 87)  # where the split held: the order continues at 16


def test_a_resume_refused_for_its_seed_names_it_and_offers_no_allow_data_change():
    """--seed (which also moves the validation split: another sample count) other than the
    checkpoint's: the refusal offered --allow-data-change, which is refused again for the same
    setting; now it names that flag and its value alone. Another --global-batch-size is no
    refusal: the data order continues at the new size."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_resumable

    cfg = TrainConfig(load="ck", global_batch_size=16, seed=5, seq_len=128)
    manifest = {"meta": {"train_config": {"seq_len": 128}, "sampler": {
        "dataset_len": 682, "global_batch_size": 16, "seed": 1234}}}
    for train_len in (681, 682):
        with pytest.raises(UsageError) as e:
            check_resumable(cfg, manifest, train_len)
        assert str(e.value).startswith("--seed 5 differs from the checkpoint's 1234: "
                                       "--load ck cannot continue"), str(e.value)
        assert "resume with --seed 1234" in str(e.value)
        assert "--allow-data-change" not in str(e.value)
    cfg = TrainConfig(load="ck", global_batch_size=32, seed=1234, seq_len=128)
    check_resumable(cfg, manifest, 682)
    with pytest.raises(UsageError, match="dataset_len 682 \\(checkpoint\\) vs 681"):
        check_resumable(cfg, manifest, 681)


def test_a_checkpoint_resumes_from_another_directory_and_names_data_that_moved(
        texts, cache, tiny_model, tmp_path, capsys, monkeypatch):
    """A relative --data is recorded as an absolute path, so `--load` alone resumes from any
    directory; data moved since is named (never replaced by the shipped sample)."""
    (tmp_path / "job").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "job" / "my text.txt").write_text(texts["poem"].read_text())
    monkeypatch.chdir(tmp_path / "job")
    rc, err = _run(train, ["--data", "my text.txt", "--data-cache", cache, "--model", tiny_model,
                           "--tokenizer", "sentencepiece", "--seq-len", "32",
                           "--global-batch-size", "8", "--max-steps", "2", "--save", "ckpt",
                           "--no-progress"], capsys)
    assert rc == 0, err
    monkeypatch.chdir(tmp_path / "elsewhere")
    log = tmp_path / "log.jsonl"
    rc, err = _run(train, ["--load", "../job/ckpt", "--data-cache", cache, "--max-steps", "3",
                           "--log-json", log, "--no-progress"], capsys)
    assert rc == 0, err
    # the note gives the flags to paste: the path with its space quoted
    assert f"--data {shlex.quote(str(tmp_path / 'job' / 'my text.txt'))}" in err
    assert [r["step"] for r in _records(log)] == [3]
    (tmp_path / "job" / "my text.txt").rename(tmp_path / "job" / "moved.txt")
    rc, err = _run(train, ["--load", "../job/ckpt", "--data-cache", cache, "--max-steps", "4",
                           "--no-progress"], capsys)
    assert rc == 2, err
    assert (f"was trained on --data {tmp_path / 'job' / 'my text.txt'}, which is not found "
            f"from here; pass --data") in err


def test_a_wsd_run_extended_from_its_stable_phase_holds_the_lr_then_decays(
        texts, cache, tiny_model, tmp_path, capsys):
    """The WSD way to train longer: --load a checkpoint of the stable phase with a larger
    --max-steps. The schedule flags come from the checkpoint; the lr stays at --lr up to the
    new decay, which takes the last --lr-wsd-decay-steps before the new --max-steps; the log
    lines and --log-json give each step's lr."""
    from megapar.optim import LRScheduler

    ckpt, first, log = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "log.jsonl"
    common = ["--data", texts["poem"], "--data-cache", cache, "--tokenizer", "sentencepiece",
              "--seq-len", "32", "--global-batch-size", "8", "--no-progress", "--log-interval",
              "1"]
    rc, err = _run(train, [*common, "--model", tiny_model, "--max-steps", "6", "--save", ckpt,
                           "--save-interval", "3", "--log-json", first, "--lr", "1e-3",
                           "--min-lr", "1e-4", "--warmup-steps", "1", "--lr-decay", "wsd",
                           "--lr-wsd-decay-steps", "2"], capsys)
    assert rc == 0, err
    planned = LRScheduler(1e-3, 1e-4, 1, 6, "wsd", decay_steps=2)
    assert [r["lr"] for r in _records(first)] == pytest.approx(
        [planned.lr(s) for s in range(6)], rel=1e-6)
    rc = train([str(a) for a in [*common, "--load", ckpt / "step_00000003", "--max-steps", "8",
                                 "--log-json", log]])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "learning-rate schedule follows the flags, not the checkpoint: max_steps 6 -> 8\n" \
        in out.out
    extended = LRScheduler(1e-3, 1e-4, 1, 8, "wsd", decay_steps=2)
    lrs = {r["step"]: r["lr"] for r in _records(log)}
    assert list(lrs) == [4, 5, 6, 7, 8]
    assert list(lrs.values()) == pytest.approx([1e-3] * 4 + [extended.lr(7)], rel=1e-6)
    assert extended.lr(7) == pytest.approx(5.5e-4)
    assert "lr 5.500e-04" in [line for line in out.out.splitlines()
                              if line.startswith("step      8")][0]


def test_a_raised_max_steps_stretches_the_lr_schedule(texts, cache, tiny_model, tmp_path,
                                                      capsys):
    """Extending a finished run (`--load CKPT --max-steps` higher, as the 'nothing left to
    train' error advises) decays the learning rate over the new length, with a note; the
    checkpoint's schedule is not silently kept (it would hold --min-lr for every new step)."""
    from megapar.optim import LRScheduler

    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    common = ["--data", texts["poem"], "--data-cache", cache, "--tokenizer", "sentencepiece",
              "--seq-len", "32", "--global-batch-size", "8", "--no-progress", "--lr", "1e-3",
              "--min-lr", "1e-4", "--warmup-steps", "1"]
    rc, err = _run(train, [*common, "--model", tiny_model, "--max-steps", "3", "--save", ckpt],
                   capsys)
    assert rc == 0, err
    rc = train([str(a) for a in [*common, "--load", ckpt, "--max-steps", "6", "--log-json", log]])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "learning-rate schedule follows the flags, not the checkpoint: max_steps 3 -> 6" \
        in out.out
    expected = LRScheduler(1e-3, 1e-4, 1, 6, "cosine")
    lrs = {r["step"]: r["lr"] for r in _records(log)}
    assert list(lrs) == [4, 5, 6]
    for step, lr in lrs.items():
        assert lr == pytest.approx(expected.lr(step - 1), rel=1e-6)
    assert lrs[4] > 2e-4  # mid-decay, not the floor


def test_a_resume_with_another_loss_mean_says_so():
    """--loss-mean microbatch on a checkpoint trained with token means: allowed, but it
    changed the loss's scale without a word (another learning-rate schedule is noted)."""
    from megapar.training.config import TrainConfig
    from megapar.training.validate_resume import settings_from_checkpoint

    manifest = {"meta": {"train_config": {"loss_mean": "token", "seq_len": 32}}}
    cfg = TrainConfig(load="ck", loss_mean="microbatch")
    cfg.explicit = frozenset({"load", "loss_mean"})
    notes = settings_from_checkpoint(cfg, manifest)
    assert any(n.startswith("--loss-mean microbatch differs from the checkpoint's token: from "
                            "here the loss is the mean of the micro-batches' means")
               for n in notes), notes
    cfg = TrainConfig(load="ck")
    cfg.explicit = frozenset({"load"})
    notes = settings_from_checkpoint(cfg, manifest)  # taken from the checkpoint: no such note
    assert cfg.loss_mean == "token" and not any("differs" in n for n in notes), notes
