"""Every bad input is caught in the launching process: exit code 2, one line on stderr naming
the problem, and no worker started (starting one fails the test)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import megapar.cli.train as train_cli
import megapar.launcher as launcher
import megapar.training.bubble as bubble_engine
from megapar.cli.bubble import main as bubble
from megapar.cli.eval import main as evaluate
from megapar.cli.train import main as train
from megapar.data import asset_path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Text, a cache, a tiny model, its 1-step checkpoint (and a corrupted copy), a dataset."""
    root = tmp_path_factory.mktemp("bad")
    text = root / "text.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    model = root / "tiny.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                 "n_positions": 64}))
    cache, ckpt = root / "cache", root / "ckpt"
    common = ["--data", str(text), "--data-cache", str(cache), "--tokenizer", "sentencepiece",
              "--model", str(model), "--seq-len", "32", "--no-progress"]
    assert train([*common, "--max-steps", "1", "--save", str(ckpt)]) == 0
    corrupt = root / "corrupt"
    shutil.copytree(ckpt, corrupt)
    shard = next((corrupt / "step_00000001").glob("model_*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    prefix = str(next(cache.glob("*.bin")))[:-4]
    configs = {}
    for name, content in {"missing.yaml": None, "bad.yaml": "seq_len: [1, 2\n",
                          "bad.json": "{\"seq_len\": 32,}", "list.yaml": "- 1\n- 2\n",
                          "typo.yaml": "max_step: 3\n", "choice.yaml": "schedule: zigzag\n",
                          "half.yaml": "log_interval: 2.5\n", "null.json": "{\"lr\": null}",
                          "switch.yaml": "sequence_parallel: \"maybe\"\n",
                          "word.yaml": "lr: fast\n", "flag.yaml": "max_steps: true\n"}.items():
        if content is not None:
            (root / name).write_text(content)
        configs[name] = str(root / name)
    negative = root / "negative.json"
    negative.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": -2,
                                    "n_head": 4}))
    ids = {}
    for name, array in {"float": np.zeros((1, 4)), "flat": np.zeros(4, dtype=np.int64),
                        "long": np.zeros((1, 100), dtype=np.int64)}.items():
        ids[name] = root / f"{name}.npy"
        np.save(ids[name], array)
    (root / "empty_dir").mkdir()
    return dict(common=common, ckpt=str(ckpt), corrupt=str(corrupt), prefix=prefix,
                configs=configs, negative=str(negative), ids=ids, root=root)


@pytest.fixture
def no_workers(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started for a bad input")

    for target, name in [(train_cli, "run_workers"), (launcher, "run_workers"),
                         (launcher, "run_local"), (bubble_engine, "measure"),
                         (bubble_engine, "simulate")]:
        monkeypatch.setattr(target, name, refuse)


TRAIN = [
    (["--global-batch-size", "0"], "--global-batch-size 0 is invalid: it must be a whole number >= 1"),
    (["--global-batch-size", "-8"], "--global-batch-size -8 is invalid"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0 is invalid"),
    (["--max-steps", "0"], "--max-steps 0 is invalid"),
    (["--warmup-steps", "-1"], "--warmup-steps -1 is invalid"),
    (["--lr", "nan"], "--lr nan is invalid: it must be a finite number > 0.0"),
    (["--adam-beta2", "1"], "--adam-beta2 1.0 is invalid: it must be in [0, 1)"),
    (["--load", "{ckpt}", "--model", "llama-tiny"],
     "holds a gpt2 model and --model llama-tiny is a llama; with --load the model comes from"),
    (["--load", "{ckpt/latest/ck}"], "is a file, so no checkpoint can be there"),
    (["--adam-beta1", "nan"], "--adam-beta1 nan is invalid"),
    (["--lr", "inf"], "--lr inf is invalid"),
    (["--lr", "0"], "--lr 0.0 is invalid"),
    (["--min-lr", "nan"], "--min-lr nan is invalid"),
    (["--min-lr", "0.5"], "--min-lr 0.5 is larger than --lr 0.001"),
    (["--weight-decay", "nan"], "--weight-decay nan is invalid"),
    (["--clip-grad", "nan"], "--clip-grad nan is invalid"),
    (["--val-fraction", "-0.5"], "--val-fraction -0.5 is invalid"),
    (["--val-fraction", "1"], "--val-fraction 1.0 is invalid: it is the share of documents"),
    (["--timeout-s", "0"], "--timeout-s 0.0 is invalid"),
    (["--timeout-s", "-5"], "--timeout-s -5.0 is invalid"),
    (["--log-interval", "0"], "--log-interval 0 is invalid"),
    (["--peak-tflops", "0"], "--peak-tflops 0.0 is invalid"),
    (["--eval-steps", "0"], "--eval-steps 0 is invalid"),
    (["--eval-interval", "-1"], "--eval-interval -1 is invalid"),
    (["--tp", "0"], "--tp 0 is invalid"),
    (["--grad-reduce-dtype", "bf16", "--grad-compression", "fp16"],
     "--grad-reduce-dtype bf16 and --grad-compression fp16 both choose how gradients travel"),
    (["--seed", "-1"], "--seed -1 is invalid"),
    (["--tokenizer", "no-such-tokenizer"], "no-such-tokenizer"),
    (["--tp", "3"], "4 attention heads are not divisible by --tp 3"),
    (["--pp", "3"], "2 layers cannot be cut into --pp 3 stages"),
    (["--seq-len", "100"], "--seq-len 100 exceeds the model's maximum of 64 positions"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     "global batch size 10 is not divisible by micro-batch size 4"),
    (["--config", "{missing.yaml}"], "no such config file"),
    (["--config", "{bad.yaml}"], "not valid YAML at line"),
    (["--config", "{bad.json}"], "not valid JSON at line 1"),
    (["--config", "{list.yaml}"], "expected a mapping of names to values, got a list"),
    (["--config", "{typo.yaml}"], "unknown setting 'max_step'; did you mean 'max_steps'?"),
    (["--config", "{choice.yaml}"], "--schedule 'zigzag' is invalid: choose one of"),
    (["--config", "{half.yaml}"], "--log-interval 2.5 is invalid: it must be a whole number >= 1"),
    (["--model", "{negative}"], "n_layer=-2 must be a whole number >= 1"),
    (["--load", "/nonexistent/ckpt", "--load-strict"], "--load /nonexistent/ckpt: no such checkpoint directory"),  # without --load-strict: starts fresh (requeue)
    (["--load", "{empty_dir}", "--load-strict"], "empty_dir: no checkpoint there (--load-strict)"),
    (["--load", "{corrupt}"], "checksum mismatch"),
    (["--load", "{ckpt}", "--model", "gpt2-124m"], "holds another model than --model gpt2-124m"),
    (["--load", "{ckpt}", "--max-steps", "1"], "is at step 1 and --max-steps is 1"),
    # --config values are parsed like the flags: null and values a flag cannot take are errors
    (["--config", "{null.json}"], "--lr: null is not a value; remove the key to use the default"),
    (["--config", "{switch.yaml}"], "--sequence-parallel 'maybe' is invalid: a switch is true or "
                                    "false"),
    (["--config", "{word.yaml}"], "--lr 'fast' is invalid: expected a number"),
    (["--config", "{flag.yaml}"], "--max-steps True is invalid: expected a whole number"),
    # values that failed late (or never): refused up front
    (["--exit-duration-mins", "-1"], "--exit-duration-mins -1.0 is invalid: it must be a finite "
                                     "number > 0.0, or 0 for no limit"),
    (["--exit-duration-mins", "nan"], "--exit-duration-mins nan is invalid"),
    (["--exit-interval", "-2"], "--exit-interval -2 is invalid: it must be a whole number >= 1, "
                                "or 0 for never"),
    (["--max-nonfinite-steps", "-1"], "--max-nonfinite-steps -1 is invalid: it must be a whole "
                                      "number >= 1, or 0 for never stop"),
    (["--lr-scale-with-batch", "-1"], "--lr-scale-with-batch -1 is invalid: it must be a whole "
                                      "number >= 1, or 0 for off"),
    (["--adam-eps", "0"], "--adam-eps 0.0 is invalid: it must be a finite number > 0.0"),
    (["--adam-eps", "nan"], "--adam-eps nan is invalid"),
    (["--adam-eps", "inf"], "--adam-eps inf is invalid"),
    (["--adam-eps=-1e-8"], "--adam-eps -1e-08 is invalid"),
    (["--powersgd-rank", "0"], "--powersgd-rank 0 is invalid: it must be a whole number >= 1"),
    (["--powersgd-rank", "-2"], "--powersgd-rank -2 is invalid"),
    (["--grad-bucket-mb", "nan"], "--grad-bucket-mb nan is invalid: it must be a finite number"),
    (["--grad-bucket-mb", "inf"], "--grad-bucket-mb inf is invalid"),
    (["--virtual-stages", "0"], "--virtual-stages 0 is invalid"),
    (["--profile-steps", "2:3", "--profile-dir", "{text}"], "text.txt is a file, not a directory"),
    (["--profile-steps", "2:3", "--profile-dir", "/proc/megapar-test/x"],
     "--profile-dir /proc/megapar-test/x is not writable"),
    (["--profile-steps", "5:400"], "--profile-steps 5:400 goes beyond --max-steps 300"),
    (["--load", "{ckpt}", "--max-steps", "3", "--profile-steps", "1:2"],
     "--profile-steps 1:2 starts at or before step 1, where --load resumes"),
    (["--lr", "5e-5", "--min-lr", "1e-4"], "--min-lr 0.0001 is larger than --lr 5e-05"),
    # --load: a file, or a step that is not there, is never a fresh start
    (["--load", "{ckpt/latest}"], "ckpt/latest is a file; give the checkpoint directory (e.g. "
                                  "its parent"),
    (["--load", "{ckpt/shard}"], ".safetensors is a file; give the checkpoint directory (e.g. "
                                 "its parent"),
    (["--load", "{ckpt/step_00000099}"], "step_00000099: no such checkpoint; "),
    (["--load", "{ckpt/step_00000099}"], "ckpt holds step_00000001; pass one of them"),
    (["--load", "{ckpt/typo}"], "ckpt holds step_00000001; pass one of them"),
    (["--load", "/nonexistent/ckpt/step_00000003"], "no such checkpoint step, and /nonexistent/"
                                                    "ckpt holds no step_* checkpoints"),
    # a global batch the user gave stays an error on data too small for it
    (["--global-batch-size", "4096"], "fewer than one global batch of 4096"),
]


def _fill(argv, env):
    names = {**{k.split(".")[0] + "." + k.split(".")[1]: v for k, v in env["configs"].items()},
             "negative": env["negative"], "ckpt": env["ckpt"], "corrupt": env["corrupt"],
             "prefix": env["prefix"], "empty_dir": str(env["root"] / "empty_dir"),
             "text": str(env["root"] / "text.txt"), "ckpt/latest": env["ckpt"] + "/latest",
             "ckpt/latest/ck": env["ckpt"] + "/latest/ck",
             "ckpt/shard": str(next(Path(env["ckpt"], "step_00000001").glob("*.safetensors"))),
             "ckpt/step_00000099": env["ckpt"] + "/step_00000099",
             "ckpt/typo": env["ckpt"] + "/typo",
             **{f"ids:{k}": str(v) for k, v in env["ids"].items()}}
    return [names[a[1:-1]] if a.startswith("{") else a for a in argv]


def _one_line(capsys, prog):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, message", TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_megapar_train(argv, message, env, no_workers, capsys):
    rc = train([*env["common"], *_fill(argv, env)])
    line = _one_line(capsys, "megapar-train")
    assert rc == 2 and message in line, line


EVAL = [
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "16", "--max-batches", "0"],
     "--max-batches 0 is invalid"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "0"], "--seq-len 0 is invalid"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "100"],
     "--seq-len 100 exceeds the model's 64 positions"),
    (["--load", "{ckpt}", "--data", "/nonexistent/prefix", "--seq-len", "16"],
     "--data /nonexistent/prefix: .bin, .idx, .json not found"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "16", "--tp", "3"],
     "not divisible by --tp 3"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "16", "--pp", "0"],
     "--pp 0 is invalid"),
    (["--load", "/nonexistent/ckpt", "--data", "{prefix}", "--seq-len", "16"],
     "no such checkpoint directory"),
    (["--load", "{corrupt}", "--data", "{prefix}", "--seq-len", "16"], "checksum mismatch"),
    (["--load", "{ckpt}", "--input-ids", "{ids:float}", "--save-logits", "out.npy"],
     "holds float64 values; token ids must be integers"),
    (["--load", "{ckpt}", "--input-ids", "{ids:flat}", "--save-logits", "out.npy"],
     "must be a non-empty [batch, seq] array, got shape (4,)"),
    (["--load", "{ckpt}", "--input-ids", "{ids:long}", "--save-logits", "out.npy"],
     "sequences of 100 tokens, more than the model's 64 positions"),
    (["--load", "{ckpt}", "--input-ids", "/nonexistent.npy", "--save-logits", "out.npy"],
     "--input-ids /nonexistent.npy: no such file"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "64",
      "--micro-batch-size", "100000"], "fewer than one batch of --micro-batch-size 100000"),
]


@pytest.mark.parametrize("argv, message", EVAL, ids=[" ".join(a) for a, _ in EVAL])
def test_megapar_eval(argv, message, env, no_workers, capsys):
    rc = evaluate(_fill(argv, env))
    line = _one_line(capsys, "megapar-eval")
    assert rc == 2 and message in line, line


BUBBLE = [
    (["--pp", "0", "-m", "4"], "--pp 0 is invalid"),
    (["--pp", "2", "-m", "0"], "--microbatches 0 is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "-1"], "--fwd-ms -1.0 is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "nan"], "--fwd-ms nan is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--bwd-ms", "inf"],
     "--bwd-ms inf is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--p2p-ms", "-1"],
     "--p2p-ms -1.0 is invalid"),
    (["--pp", "2", "-m", "4", "--tp", "3"], "8 attention heads are not divisible by --tp 3"),
    (["--pp", "2", "-m", "4", "--seq-len", "100000"],
     "--seq-len 100000 exceeds the model's 256 positions"),
    (["--pp", "100000", "-m", "100000", "--simulate", "--fwd-ms", "1"],
     "more than megapar-bubble handles"),
    (["--pp", "2", "-m", "4", "--steps", "0"], "--steps 0 is invalid"),
]


@pytest.mark.parametrize("argv, message", BUBBLE, ids=[" ".join(a) for a, _ in BUBBLE])
def test_megapar_bubble(argv, message, no_workers, capsys):
    rc = bubble(argv)
    line = _one_line(capsys, "megapar-bubble")
    assert rc == 2 and message in line, line
