"""The public API: megapar.launch + megapar.prepare in a user's own loop.

The user-script test runs examples/own_loop_gpt2.py as a user would (a subprocess: its own loop
over a transformers GPT2LMHeadModel at tp 2 x pp 2) and compares its losses with megapar-train
on the same data, seed and weights, and with the same script on one process.
"""

import argparse
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked import run_python
from repo_script import load_script
from tp_utils import assert_close, refusal

import megapar
from megapar.cli.train import main as train_main
from megapar.data import asset_path, ensure_dataset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_loop_gpt2.py"


def _example():
    return load_script("examples/own_loop_gpt2.py")


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:40_000])
    return ensure_dataset(str(text), "gpt2", str(tmp_path_factory.mktemp("cache")))


def test_import_megapar_is_cheap():
    out = subprocess.run([sys.executable, "-c", "import sys, megapar; "
                          "print(set(megapar.__all__) <= set(dir(megapar))); "
                          "print('torch' in sys.modules, callable(megapar.launch))"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    # dir() (what a notebook completes megapar.<Tab> from) names the lazy public names too,
    # before their first use, and listing them imports nothing
    assert out.stdout.split() == ["True", "False", "True"], out.stderr


def test_the_api_docstrings_name_every_model_class_prepare_takes():
    """docs/reference/api.md is built from these docstrings, and they stopped at
    Qwen3MoeForCausalLM when prepare took DeepseekV3ForCausalLM too (a python-api tryout)."""
    from megapar.checkpoint.hf_names import ARCHITECTURES
    from megapar.training.prepare import prepare

    for doc in (megapar.__doc__, prepare.__doc__):
        flat = " ".join(doc.split())
        assert all(name in flat for name in ARCHITECTURES.values()), [
            name for name in ARCHITECTURES.values() if name not in flat]


def test_user_script_equals_megapar_train_and_one_process(tmp_path, prefix):
    steps = 5
    out = tmp_path / "losses.json"
    rc, stdout, stderr = run_python([EXAMPLE, "--data", prefix, "--steps", str(steps), "--json",
                                     str(out)], {**os.environ, "PYTHONPATH": str(ROOT)}, 600,
                                    tmp_path)
    assert rc == 0, stderr
    user = json.loads(out.read_text())
    assert len(user) == steps and "step 5: loss" in stdout

    example = _example()
    hf_dir = tmp_path / "hf"
    example.make_model().save_pretrained(hf_dir)
    log = tmp_path / "log.jsonl"
    rc = train_main(["--from-hf", str(hf_dir), "--data", prefix, "--val-fraction", "0",
                     "--tp", "2", "--pp", "2", "--seq-len", "32", "--micro-batch-size", "2",
                     "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
                     "--warmup-steps", "2", "--max-steps", str(steps), "--weight-decay", "0.1",
                     "--clip-grad", "1.0", "--seed", "1234", "--eval-interval", "0",
                     "--log-interval", "1", "--no-progress", "--log-json", str(log)])
    assert rc == 0
    cli = [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    serial = example.train(example.main.__globals__["argparse"].Namespace(
        tp=1, pp=1, steps=steps, seq_len=32, batch_size=8, seed=1234, data=prefix, save=None))
    assert_close(torch.tensor(user), torch.tensor(cli), 1e-5, "user script vs megapar-train")
    assert_close(torch.tensor(user), torch.tensor(serial), 1e-5, "tp2 x pp2 vs one process")
    assert user[-1] < user[0]


def test_sft_example_reads_trl_keys_and_refuses_a_bad_line_in_one_line(tmp_path, monkeypatch):
    """examples/sft_prompt_mask.py --keys prompt,completion reads TRL's records; a record
    without the fields and a line that is not JSON each end with one line naming the line."""
    example = load_script("examples/sft_prompt_mask.py")
    data, bad = tmp_path / "trl.jsonl", tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c", "completion": ""}\n')
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a" "completion": "b"}\n')
    assert example._keys("prompt,completion") == ("prompt", "completion")
    with pytest.raises(argparse.ArgumentTypeError):
        example._keys("prompt")
    assert example.read_pairs(str(data), ("prompt", "completion")) == [("a", "b"), ("c", "")]
    with pytest.raises(SystemExit) as no_field:
        example.read_pairs(str(data))
    assert str(no_field.value) == (
        f"sft_prompt_mask.py: error: {data}:1: needs string fields 'prompt' and 'response' "
        f"(its fields: 'prompt', 'completion'); pass --keys naming them")
    with pytest.raises(SystemExit) as not_json:
        example.read_pairs(str(bad), ("prompt", "completion"))
    assert str(not_json.value) == (
        f"sft_prompt_mask.py: error: {bad}:2: not valid JSON (Expecting ',' delimiter at "
        f"column 16); repair or delete the line")
    # a response ending in the end of text written out (a chat template's <|im_end|>) ends
    # with that one, as megapar-train --sft-keys makes it: the example had added a second,
    # one more label per record (a new user's finding)
    class Chars:  # one id per character; "$" is the end of text
        eos_token_id = ord("$")

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    once = example.sft_batch(Chars(), [("ab", "cd")], 8)
    assert once["labels"][0].tolist() == [-100, ord("c"), ord("d"), ord("$")] + [-100] * 4
    for key, value in example.sft_batch(Chars(), [("ab", "cd$")], 8).items():
        assert torch.equal(value, once[key]), key
    # checked before any rank starts: a --batch-size above the pairs had looped forever
    def refuse(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(example.megapar, "launch", refuse)
    with pytest.raises(SystemExit) as too_big:
        example.main(["--model", str(tmp_path), "--data", str(data), "--keys",
                      "prompt,completion", "--batch-size", "8"])
    assert too_big.value.code == 2


def test_sft_example_masks_the_prompt_and_equals_one_forward(tmp_path):
    """examples/sft_prompt_mask.py at tp 2 on a transformers Llama directory with a GPT-2
    tokenizer: the labels are -100 on the prompt and the padding and the next tokens on the
    response; the first step's loss equals one forward of the transformers model on the same
    batch with F.cross_entropy (fp32, 1e-5), and the export loads in transformers with the
    directory's tokenizer."""
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast,
                              LlamaConfig, LlamaForCausalLM)

    example = load_script("examples/sft_prompt_mask.py")
    assets, bpe = Path(asset_path("shakespeare_sample.txt")).parent, tmp_path / "bpe"
    bpe.mkdir()
    for name in ("vocab.json", "merges.txt"):  # megapar's GPT-2 BPE, under transformers' names
        shutil.copy(assets / f"gpt2_{name}", bpe / name)
    tokenizer = GPT2TokenizerFast.from_pretrained(bpe)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    src, out = tmp_path / "src", tmp_path / "sft"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    lines = [x.strip() for x in Path(asset_path("shakespeare_sample.txt")).read_text()
             .splitlines() if len(x.strip()) > 20][:16]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": a, "response": b}) + "\n"
                            for a, b in zip(lines[0::2], lines[1::2])))
    example.main(["--model", str(src), "--data", str(data), "--out", str(out), "--steps", "2",
                  "--json", str(tmp_path / "losses.json")])
    losses = json.loads((tmp_path / "losses.json").read_text())

    pairs = example.read_pairs(str(data))
    batch = next(example.global_batches(tokenizer, pairs, 32, 8, 1234))
    gen = torch.Generator().manual_seed(1234)
    first = torch.randperm(len(pairs), generator=gen).tolist()[0]
    prompt, response = pairs[first]
    p, r = tokenizer(prompt)["input_ids"], tokenizer(response)["input_ids"]
    assert batch["labels"][0].tolist() == \
        [-100] * (len(p) - 1) + r + [50256] + [-100] * (32 - len(p) - len(r))
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(src)(input_ids=batch["input_ids"]).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                            ignore_index=-100).item()
    assert len(losses) == 2 and math.isclose(losses[0], ref, rel_tol=1e-5), (losses, ref)
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"
    assert AutoTokenizer.from_pretrained(out)(prompt)["input_ids"] == p


def test_notebook_cell_runs_under_ipython(tmp_path):
    """The example notebook's cell, run by IPython (get_ipython() is set, as in Jupyter)."""
    cell = json.loads((ROOT / "examples" / "notebook_launch.ipynb").read_text())["cells"][1]
    rc, stdout, stderr = run_python(["-m", "IPython", "--no-banner", "--quick", "-c",
                                     "".join(cell["source"])],
                                    {**os.environ, "PYTHONPATH": str(ROOT)}, 600, tmp_path)
    line = [x for x in stdout.splitlines() if x.startswith("losses")]
    assert line, stdout + stderr
    losses = json.loads(line[0].split(" ", 1)[1])
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.3


# --- engine features on a tiny model, forked ranks ---------------------------------------------
VOCAB, SEQ, G = 96, 8, 8


def _hf_model(dropout=0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout, bos_token_id=None, eos_token_id=None))


def _batches(n):
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (G, SEQ), generator=gen)
        out.append({"input_ids": x, "labels": (x * 3 + 1) % VOCAB})
    return out


def _lambda_lr(zero_after):
    engine = megapar.prepare(_hf_model(), tp=2, pp=2, micro_batch_size=2, lr=1e-2)
    sched = None
    if zero_after is not None:
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer,
                                                  lambda s: 1.0 if s < zero_after else 0.0)
    batch, losses, lrs = _batches(1)[0], [], []
    for _ in range(4):
        losses.append(engine.train_step(batch))
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        if sched is not None:
            sched.step()
    both = ""  # a torch scheduler beside prepare's lr_schedule, which would override it
    if zero_after is not None:
        scheduled = megapar.prepare(_hf_model(), tp=2, pp=2, micro_batch_size=2, lr=1e-2,
                                    lr_schedule={"max_steps": 4})
        torch.optim.lr_scheduler.LambdaLR(scheduled.optimizer, lambda s: 0.0)
        try:
            scheduled.train_step(batch)
        except ValueError as exc:
            both = str(exc)
    return losses, lrs, isinstance(engine.optimizer, torch.optim.Optimizer), both


def test_torch_lambda_lr_drives_engine_optimizer(run):
    losses, lrs, is_optimizer, both = run(_lambda_lr, 4, 1)[0]
    assert is_optimizer
    # with lr_schedule= too, megapar's schedule silently set the lr the step used (the torch
    # LambdaLR's 0 ignored): refused, naming both
    assert both == ("train_step: engine.optimizer has a torch LR scheduler, but megapar.prepare("
                    "lr_schedule=...) sets the learning rate at every step, overriding it; use "
                    "one of them: drop lr_schedule= or the torch scheduler"), both
    assert lrs == [1e-2, 0.0, 0.0, 0.0]
    # lr 0 from the second step on: the weights stop changing, so the same batch's loss repeats
    assert losses[1] < losses[0] and losses[1] == losses[2] == losses[3]
    plain = run(_lambda_lr, 4, None)[0][0]
    assert plain[0] == losses[0] and plain[3] < plain[2] < plain[1]  # constant lr keeps training


def test_load_continues_a_checkpoints_schedule_without_one_given(tmp_path):
    """A checkpoint with a megapar schedule (every megapar-train one) loaded into an engine
    prepared without lr_schedule continues that schedule, as engine.load promises (the engine
    went on at a constant lr: the last one the checkpoint's optimizer had); with a torch
    scheduler on engine.optimizer that scheduler keeps the learning rate."""
    schedule = {"warmup_steps": 1, "max_steps": 4, "min_lr": 1e-4}
    saved = megapar.prepare(_hf_model(), micro_batch_size=4, lr=1e-2, lr_schedule=schedule)
    # read before the first step, the lr is that step's (warmup's), as a torch scheduler sets
    # it on construction (it was the peak, 1e-2)
    warming = megapar.prepare(_hf_model(), micro_batch_size=4, lr=1e-2,
                              lr_schedule={**schedule, "warmup_steps": 4})
    assert warming.optimizer.param_groups[0]["lr"] == warming.scheduler.lr(0) == 2.5e-3
    batch = _batches(1)[0]
    for _ in range(2):
        saved.train_step(batch)
    saved.save(tmp_path)
    want = [saved.scheduler.lr(s) for s in (2, 3)]  # the lr of steps 3 and 4: cosine decay
    engine = megapar.prepare(_hf_model(), micro_batch_size=4, lr=1e-2)
    engine.load(tmp_path)
    assert engine.optimizer.param_groups[0]["lr"] == want[0]  # the next step's, not the last's
    lrs = []
    for _ in range(2):  # read before each step: the lr it trains at (after it: the next one's,
        lrs.append(engine.optimizer.param_groups[0]["lr"])  # as a torch scheduler leaves it)
        engine.train_step(batch)
    assert lrs == want and 1e-4 < want[1] < want[0] < 1e-2, (lrs, want)
    assert engine.optimizer.param_groups[0]["lr"] == saved.scheduler.lr(4)  # step 5's
    driven = megapar.prepare(_hf_model(), micro_batch_size=4, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(driven.optimizer, lambda s: 0.5)
    driven.load(tmp_path)
    driven.train_step(batch)  # (megapar's schedule beside a torch one would be refused here)
    sched.step()
    assert driven.scheduler is None and driven.optimizer.param_groups[0]["lr"] == 5e-3


def _resume_run(ckpt, stop_at, load, layout):
    tp, pp, zero = layout
    engine = megapar.prepare(_hf_model(dropout=0.1), tp=tp, pp=pp, micro_batch_size=2, lr=3e-3,
                             weight_decay=0.1, clip_grad=0.5, zero=zero,
                             lr_schedule={"warmup_steps": 2, "max_steps": 6})
    if load:
        state = engine.load(ckpt)
        assert state.meta["mine"] == {"note": "x"}
        loaded = engine.eval_step(_batches(1)[0])  # no dropout draw: the resumed losses stay
    losses = []
    for batch in _batches(6)[engine.step:stop_at]:
        losses.append(engine.train_step(batch))
    if not load:
        engine.save(ckpt, extra={"mine": {"note": "x"}})
    else:  # prepare(checkpoint directory): its model and weights, resharded to another layout
        # (a ConfigError 'no such config file' before: a checkpoint was no model to prepare)
        resharded = megapar.prepare(ckpt, tp=2, micro_batch_size=2)
        assert resharded.step == 0 and abs(resharded.eval_step(_batches(1)[0]) / loaded - 1) < 1e-6
    return losses, engine.step


def test_a_refused_batch_does_not_use_up_the_unshifted_labels_check():
    """A first train_step of 3 rows at micro_batch_size 2 was refused (without the
    "train_step:" its other batch refusals have) after marking the labels checked, so a later
    batch with labels = input_ids trained without the one-time warning."""
    engine = megapar.prepare(_hf_model(), micro_batch_size=2)
    x = _batches(1)[0]["input_ids"][:4]
    with pytest.raises(ValueError, match=r"^train_step: global batch size 3 is not divisible by "
                                         r"micro-batch size 2 x dp 1 = 2; "):
        engine.train_step({"input_ids": x[:3], "labels": x[:3]})
    with pytest.warns(UserWarning, match="^train_step: the labels equal input_ids"):
        engine.train_step({"input_ids": x, "labels": x})


def test_engine_load_refuses_a_verify_it_does_not_know(tmp_path, monkeypatch):
    """engine.load(verify="md5") (or "SHA256") checked sizes only, without a word, and loaded
    a checkpoint with a flipped byte that the default refuses. Any word but "sha256", "size"
    and "none" is one line now, before anything is read."""
    engine = megapar.prepare(_hf_model(), micro_batch_size=4)
    engine.save(tmp_path)
    for word in ("md5", "SHA256"):
        with pytest.raises(ValueError) as refused:
            engine.load(tmp_path, verify=word)
        assert str(refused.value) == (
            f"engine.load: verify={word!r} is not one of 'sha256', 'size', 'none'; leave it "
            f"out to hash every file read")
    assert engine.load(tmp_path, verify="size") is not None
    from megapar.checkpoint.format import CheckpointError

    missing = tmp_path / "nope"  # its path was said twice: "engine.load X: X: no such ..."
    with pytest.raises(CheckpointError) as refused:
        engine.load(missing)
    assert str(refused.value) == f"engine.load {missing}: no such checkpoint directory"
    monkeypatch.chdir(tmp_path)  # other spellings of it too (a re-test)
    for spelling in ("./nope", "nope/", "my: nope"):  # a path holding ": " said once too
        with pytest.raises(CheckpointError) as refused:
            engine.load(spelling)
        assert str(refused.value) == f"engine.load {spelling}: no such checkpoint directory"
    # a message that names the path without a colon after it said it twice too (a re-test):
    # "engine.load X: X holds a gpt2 model, not a llama"
    megapar.prepare("gpt2-tiny").save(tmp_path / "my: gpt2")
    with pytest.raises(CheckpointError) as refused:
        megapar.prepare("llama-tiny").load(tmp_path / "my: gpt2" / "step_00000000")
    assert str(refused.value).startswith(
        f"engine.load {tmp_path}/my: gpt2/step_00000000 holds a gpt2 model, not a llama; "), \
        str(refused.value)


@pytest.mark.parametrize("layout", [(2, 2, 0), (1, 2, 1)])
def test_engine_save_load_resumes_exactly(run, tmp_path, layout):
    full, _ = run(_resume_run, 4, str(tmp_path / "a"), 6, False, layout)[0]
    first, step = run(_resume_run, 4, str(tmp_path / "b"), 3, False, layout)[0]
    rest, end = run(_resume_run, 4, str(tmp_path / "b"), 6, True, layout)[0]
    assert step == 3 and end == 6
    assert first + rest == full  # bitwise: weights, Adam moments, schedule, dropout RNG restored


def test_megapar_train_load_takes_an_engine_checkpoints_settings(run, tmp_path):
    """A checkpoint of `engine.save` records the engine's settings as a megapar-train run does,
    so `megapar-train --load CKPT` continues with its learning rate, schedule, weight decay and
    clipping (not megapar-train's defaults); without a megapar schedule the rate is constant."""
    from megapar.checkpoint.manifest import read_manifest
    from megapar.training.config import parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    run(_resume_run, 4, str(tmp_path / "scheduled"), 3, False, (2, 2, 0))
    cfg = parse_args(["--load", str(tmp_path / "scheduled")])
    note = settings_from_checkpoint(cfg, read_manifest(tmp_path / "scheduled"))[0]
    assert (cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps, cfg.lr_decay) == \
        (3e-3, 0.0, 2, 6, "cosine")
    assert (cfg.weight_decay, cfg.clip_grad, cfg.micro_batch_size) == (0.1, 0.5, 2)
    assert "--lr 0.003" in note and "--max-steps 6" in note and "--clip-grad 0.5" in note
    run(_constant_save, 4, str(tmp_path / "constant"))
    cfg = parse_args(["--load", str(tmp_path / "constant")])
    notes = settings_from_checkpoint(cfg, read_manifest(tmp_path / "constant"))
    assert (cfg.lr, cfg.min_lr, cfg.lr_decay, cfg.warmup_steps, cfg.weight_decay) == \
        (3e-3, 3e-3, "constant", 0, 0.0)
    # its batches were the caller's: megapar-train's --seq-len 128, --global-batch-size 16 and
    # --max-steps 300 were recorded as the run's, and taken, silently (a --seq-len 128 then
    # refused on a model of 64 positions as if given)
    trained = read_manifest(tmp_path / "constant")["meta"]["train_config"]
    assert not {"data", "seq_len", "global_batch_size", "max_steps"} & set(trained), trained
    assert "--global-batch-size" not in notes[0] and "--seq-len" not in notes[0], notes
    assert (f"--load {tmp_path / 'constant'} records no --seq-len, --global-batch-size, "
            f"--max-steps (saved by a megapar.prepare engine, whose batches were its caller's): "
            f"megapar-train's defaults --seq-len 128 (or the model's positions, where fewer), "
            f"--global-batch-size 16, --max-steps 300; "
            f"give the run's own") in notes, notes
    cfg = parse_args(["--load", str(tmp_path / "scheduled"), "--seq-len", "32"])
    notes = settings_from_checkpoint(cfg, read_manifest(tmp_path / "scheduled"))
    assert any("records no --seq-len, --global-batch-size (saved by a megapar.prepare engine"
               in n and "defaults --global-batch-size 16;" in n for n in notes), notes


def _train_and_save(ckpt, steps):
    engine = megapar.prepare(_hf_model(), tp=2, micro_batch_size=2)
    for batch in _batches(steps):
        engine.train_step(batch)
    return str(engine.save(ckpt))


def test_engine_save_refuses_a_directory_holding_newer_steps(run, tmp_path):
    """A fresh engine at step 1 saving where another run's step 2 is: it wrote step_1 beside
    it and pointed latest back at it, one directory holding two runs (megapar-train refuses
    that without --overwrite-newer). Refused on every rank, before anything is written."""
    ckpt = tmp_path / "ckpt"
    assert run(_train_and_save, 2, str(ckpt), 2)[0] == str(ckpt / "step_00000002")
    with pytest.raises(megapar.WorkerError, match=(
            f"engine.save: {ckpt} holds step_00000002, newer than this engine's step 1: saving "
            f"would move latest back and mix those with this run's steps; save into another "
            f"directory, or remove those steps first")):
        run(_train_and_save, 2, str(ckpt), 1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002"]
    assert (ckpt / "latest").read_text().strip() == "step_00000002"


def _constant_save(ckpt):
    engine = megapar.prepare(_hf_model(), tp=2, pp=2, micro_batch_size=2, lr=3e-3)
    engine.train_step(_batches(1)[0])
    engine.save(ckpt)


def _export(out_dir):
    engine = megapar.prepare(_hf_model(), tp=2, pp=2, micro_batch_size=2, lr=3e-3)
    batches = _batches(3)
    for batch in batches[:2]:
        engine.train_step(batch)
    engine.export_hf(out_dir)
    return engine.eval_step(batches[2])


def test_export_hf_loads_in_transformers_with_the_engine_loss(run, tmp_path):
    from transformers import GPT2LMHeadModel

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")   # the user's file: kept
    loss = run(_export, 4, str(tmp_path / "hf"))[0]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    batch = _batches(3)[2]
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
    assert math.isclose(loss, ref.item(), rel_tol=1e-5)


def _actions_seen(ckpt, out_dir):
    """The status a rank shows while engine.load reads a checkpoint and while engine.export_hf
    saves and writes (what a hang there is reported as)."""
    import megapar.training.engine as engine_module
    import megapar.training.export as export_module
    from megapar.faults import status as rank_status

    seen = []

    def watching(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            seen.append(rank_status.status())
            return real(*args, **kwargs)

        setattr(module, name, call)

    for module, name in ((engine_module, "load_checkpoint"), (export_module, "save_checkpoint"),
                         (export_module, "export_checkpoint")):
        watching(module, name)
    engine = megapar.prepare(_hf_model(), tp=2, micro_batch_size=2, lr=3e-3)
    engine.train_step(_batches(1)[0])
    engine.save(ckpt)
    engine.load(ckpt)
    engine.export_hf(out_dir)
    return seen


def test_a_rank_says_it_is_loading_or_exporting_and_an_export_killed_leaves_nothing(
        run, tmp_path):
    """A rank hung while engine.load read the checkpoint said "engine.params_whole: agreeing on
    the call", and one hung in engine.export_hf "engine.export_hf: agreeing on the call" (a
    fault drill's finding): each now says what it does. The staging checkpoint of an export
    whose rank 0 was killed (its process gone) was left beside the export for good; the next
    export removes it."""
    import subprocess

    from megapar.faults.processes import _host

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f".hf.megapar-export-{gone.pid}-{_host()}-7"
    (stale / "step_00000007").mkdir(parents=True)
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    seen = run(_actions_seen, 2, str(ckpt), str(out))[0]
    assert seen[0] == f"step 1, loading the checkpoint {ckpt} (engine.load)", seen
    assert seen[1].startswith("step 1, engine.export_hf: saving the weights to export to "), seen
    assert seen[2] == f"step 1, engine.export_hf: rank 0 writing the export {out}", seen
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _export_interrupted(out_dir):
    """engine.export_hf interrupted (Ctrl-C) while rank 0 writes the export: what is left beside
    it."""
    import megapar.training.export as export_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    engine = megapar.prepare(_hf_model(), micro_batch_size=2, lr=3e-3)
    engine.train_step(_batches(1)[0])
    export_module.export_checkpoint = interrupted
    try:
        engine.export_hf(out_dir)
    except KeyboardInterrupt:
        return sorted(p.name for p in Path(out_dir).parent.iterdir())
    return None


def test_an_interrupted_export_leaves_no_staging_checkpoint(run, tmp_path):
    """A Ctrl-C while rank 0 wrote the export left its staging checkpoint beside the export,
    which no later export of the same (live) process removes: a copy of the weights per
    interrupt in a notebook (a re-test's finding)."""
    assert run(_export_interrupted, 1, str(tmp_path / "hf"))[0] == []


def _numpy_inside_whole(read):
    engine = megapar.prepare(_hf_model(), zero=3, micro_batch_size=2, lr=1e-2)
    with engine.params_whole():
        weight = next(engine.model.parameters()).detach()
        held = weight.numpy() if read else weight.clone().numpy()  # numpy's view, or a copy
        first = held.copy()
    losses = [engine.train_step(batch) for batch in _batches(3)]
    return losses, bool((held == first).all())


def test_a_weight_read_with_numpy_inside_params_whole_frees_under_zero3(run):
    """`.numpy()` of a parameter inside `params_whole` made its ZeRO-3 unit's storage
    unresizable, and leaving the context failed ("Trying to resize storage that is not
    resizable", a re-test); the unit now takes a new buffer, numpy's array keeps the weights
    it read, and training goes on as without it."""
    (losses, kept), _ = run(_numpy_inside_whole, 2, True)
    (copied, _), _ = run(_numpy_inside_whole, 2, False)
    assert kept and len(losses) == 3 and losses == copied, (losses, copied)


def _fails_on_rank(bad):
    import torch.distributed as dist

    if dist.get_rank() == bad:
        raise ValueError("user code broke")
    dist.barrier()
    return "ok"


def test_launch_names_the_failing_rank_and_returns_rank0_value():
    assert megapar.launch(_fails_on_rank, 2, -1) == "ok"
    with pytest.raises(megapar.WorkerError, match="rank 1 failed: ValueError: user code broke"):
        megapar.launch(_fails_on_rank, 2, 1)


def test_prepare_rejects_different_weights_per_rank(run):
    def differ():
        import torch.distributed as dist

        model = _hf_model()
        with torch.no_grad():
            model.transformer.wte.weight[0, 0] += dist.get_rank()
        megapar.prepare(model, tp=2)

    with pytest.raises(megapar.WorkerError, match="weights differ between ranks"):
        run(differ, 2)


def _moe_prepared(kw):
    """A tiny transformers Mixtral prepared with keywords `kw`: (its router's auxiliary-loss
    and capacity settings as the engine's model has them, the eval loss of a fixed batch)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, router_aux_loss_coef=0.02))
    engine = megapar.prepare(model, micro_batch_size=2, **kw)
    ids = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    loss = engine.eval_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    config = engine.config
    return config.router_aux_loss_coef, config.moe_capacity_factor, loss


def test_prepare_applies_the_moe_keywords_and_refuses_them_for_a_dense_model(run):
    """moe_aux_loss_coef, moe_z_loss_coef, moe_capacity_factor and moe_bias_update_rate reached
    the model only through megapar-train's flags: prepare accepted them and trained with the
    config's own (a user's moe_aux_loss_coef=0, the MoE guide's way to train as transformers'
    Trainer does, left its 0.02 in the router's gradients); on a dense model they were taken
    without a word, where megapar-train refuses the flags."""
    aux, capacity, loss = run(_moe_prepared, 1, {})[0]
    assert (aux, capacity) == (0.02, None)
    aux, capacity, capped = run(_moe_prepared, 1, {"moe_aux_loss_coef": 0.0,
                                                   "moe_capacity_factor": 0.1})[0]
    assert (aux, capacity) == (0.0, 0.1) and capped != loss  # tokens over capacity dropped
    with pytest.raises(megapar.WorkerError, match=(
            r"megapar.prepare: moe_aux_loss_coef=0.1 applies to a mixture-of-experts model "
            r"\(mixtral, qwen3_moe, deepseek_v3: e.g. 'mixtral-tiny'\); this gpt2 model has no "
            r"experts: drop it")):  # was e.g. --model mixtral-tiny, megapar-train's terms
        run(lambda: megapar.prepare(_hf_model(), moe_aux_loss_coef=0.1), 1)


def test_prepare_refuses_an_ep_the_model_cannot_take(run):
    """ep=2 on a dense model built and trained without a word (megapar-train refuses --ep 2
    there), and an ep that does not divide the experts failed inside the model's build with a
    traceback naming --ep (an expert-parallel tryout's findings): each is one line in the
    API's terms."""
    with pytest.raises(megapar.WorkerError, match=(
            r"megapar.prepare: ep=2 shards a mixture-of-experts model's experts \(mixtral, "
            r"qwen3_moe, deepseek_v3: e.g. 'mixtral-tiny'\); this llama model has no experts: "
            r"use ep=1")):
        run(lambda: megapar.prepare("llama-tiny", ep=2), 2)
    with pytest.raises(megapar.WorkerError, match=(
            r"megapar.prepare: ep=3 does not divide the model's 4 experts: use ep=1 \(the only "
            r"value dividing the 4 experts and dp x cp = 3\)")):
        run(lambda: megapar.prepare("mixtral-tiny", ep=3), 3)


def test_prepare_refuses_a_timeout_torch_cannot_wait():
    """timeout_s=1e10 passed prepare's checks (megapar-train refuses --timeout-s above 1e9 s)
    and failed at the world group's first wait; it is one line in the API's terms, before any
    group is touched."""
    for name in ("timeout_s", "nccl_timeout_s"):
        with pytest.raises(ValueError) as exc:
            megapar.prepare("gpt2-tiny", **{name: 1e10})
        assert str(exc.value) == (
            f"megapar.prepare: {name}=1e+10 is invalid: at most 1e+09 s (about 31 years; "
            f"torch's rendezvous store counts its wait in nanoseconds and fails at once from "
            f"about 1e10 s); give a finite wait in seconds")
    for value, said in ((1e9 + 1, "=1000000001 is invalid: at most 1e+09 s"),
                        (0.0005, "=0.0005 is invalid: it must be a finite number >= 0.001 (torch "
                                 "counts a wait in whole milliseconds")):
        with pytest.raises(ValueError, match=f"^megapar.prepare: timeout_s{re.escape(said)}"):
            megapar.prepare("gpt2-tiny", timeout_s=value)
    # the [0, 1) settings too, in the API's terms (megapar-train's own check only)
    with pytest.raises(ValueError, match=r"^megapar.prepare: adam_beta2=1.0 is invalid: it must "
                                         r"be in \[0, 1\)$"):
        megapar.prepare("gpt2-tiny", adam_beta2=1.0)


def _tiny_bert():
    """The seeded tiny transformers BertForMaskedLM the BERT tests train and compare against."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(4)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=16, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def _bert(tp, pp):
    model = _tiny_bert()
    engine = megapar.prepare(model, tp=tp, pp=pp, micro_batch_size=4, lr=1e-3)
    batch = _bert_batch()
    return engine.eval_step(batch), engine.train_step(batch), engine.eval_step(batch)


def _bert_batch():
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (G, SEQ), generator=gen)
    mask = torch.ones(G, SEQ, dtype=torch.long)
    mask[::3, -2:] = 0  # padding at the end of some rows
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (G, SEQ), generator=gen),
            "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(G, SEQ).clone(),
            "attention_mask": mask}


def test_prepare_bert_for_masked_lm_matches_transformers(run):
    """Every token labelled, so each micro-batch's mean has the same weight as in one batch."""
    before, trained, after = run(_bert, 4, 2, 2)[0]
    hf = _tiny_bert().eval()
    with torch.no_grad():
        ref = hf(**_bert_batch()).loss.item()
    assert math.isclose(before, ref, rel_tol=1e-5) and math.isclose(trained, ref, rel_tol=1e-5)
    assert after < before


def _mlm_batch():
    """`_bert_batch` with MLM labels: about 30 % of each row's tokens labelled, rows 2 and 3
    none (a micro-batch of 1 or 2 with no labelled token on dp rank 0 at dp 2)."""
    batch = _bert_batch()
    keep = torch.rand(G, SEQ, generator=torch.Generator().manual_seed(2)) < 0.3
    keep[:, 0] = True
    keep[2:4] = False
    batch["labels"] = batch["labels"].masked_fill(~keep, -100)
    return batch


def _bert_token_means():
    """BERT's MLM loss at pp 2 x dp 2 with ZeRO-3 through `train_step` / `eval_step`:
    --loss-mean token in fp32 at micro-batches of 1 (its step's host syncs counted), in fp16
    at micro-batches of 4; the default micro-batch mean at 1."""
    from sync_count import count_syncs

    out = {}
    for name, mean, mbs, precision in (("token", "token", 1, "fp32"),
                                       ("token fp16", "token", 4, "fp16"),
                                       ("microbatch", "microbatch", 1, "fp32")):
        model = _tiny_bert()
        engine = megapar.prepare(model, pp=2, micro_batch_size=mbs, lr=1e-3, zero=3,
                                 precision=precision, loss_mean=mean)
        before = engine.eval_step(_mlm_batch())
        with count_syncs() as syncs:
            trained = engine.train_step(_mlm_batch())
        out[name] = (before, trained, [where for _, where in syncs])
    return out


def test_bert_mlm_token_mean_is_transformers_loss_at_any_micro_batch(run):
    """loss_mean="token": BERT's MLM loss with unevenly masked rows (one micro-batch without a
    label), through prepare / train_step / eval_step at pp 2 x dp 2 with ZeRO-3, equals
    transformers' BertForMaskedLM loss on the whole batch (the token mean), fp32 < 1e-5 at
    micro-batches of 1 and fp16 (loss-scaled) < 1e-2 at 4, with no host sync on the
    micro-batch path; the default micro-batch mean misses it by > 1 %."""
    out = run(_bert_token_means, 4)[0]
    hf = _tiny_bert().eval()
    with torch.no_grad():
        ref = hf(**_mlm_batch()).loss.item()
    before, trained, syncs = out["token"]
    assert math.isclose(before, ref, rel_tol=1e-5) and math.isclose(trained, ref, rel_tol=1e-5)
    inside = [w for w in syncs if w.startswith(("models/", "tensor_parallel/", "pipeline/",
                                                "data_parallel/", "context_parallel/"))]
    assert not inside, inside
    before, trained, _ = out["token fp16"]
    assert math.isclose(before, ref, rel_tol=1e-2) and math.isclose(trained, ref, rel_tol=1e-2)
    before, trained, _ = out["microbatch"]
    assert abs(before / ref - 1) > 1e-2 and abs(trained / ref - 1) > 1e-2, (before, ref)


def _bad_batches():
    import numpy as np

    engine = megapar.prepare(_hf_model(), tp=2, micro_batch_size=2, lr=3e-3, global_batch_size=G)
    good = _batches(1)[0]
    x = good["input_ids"]
    cases = {
        "rows": {"input_ids": x[: G // 2], "labels": good["labels"][: G // 2]},
        "id": {"input_ids": torch.where(x == x[0, 0], VOCAB + 5, x), "labels": good["labels"]},
        "negative id": {"input_ids": x - 200, "labels": good["labels"]},
        "label": {"input_ids": x, "labels": torch.full_like(x, VOCAB)},
        "key": {**good, "position_ids": torch.zeros_like(x)},
        "mask": {**good, "attention_mask": torch.ones_like(x).index_fill_(1, torch.tensor([0]), 0)},
        "numpy": {"input_ids": np.zeros((G, SEQ), dtype=np.int64), "labels": good["labels"]},
        "float": {"input_ids": x.float(), "labels": good["labels"]},
        "long": {"input_ids": torch.zeros(G, 128, dtype=torch.long),
                 "labels": torch.zeros(G, 128, dtype=torch.long)},
        "no labels": {"input_ids": x},
        "mask shape": {**good, "attention_mask": torch.ones(G, SEQ - 2, dtype=torch.long)},
        "int32": {"input_ids": x.int(), "labels": good["labels"].int()},        # trains
        "uint8": {"input_ids": x.to(torch.uint8), "labels": good["labels"].to(torch.uint8)},
    }
    out = {}
    for name, batch in cases.items():
        try:
            engine.train_step(batch)
            out[name] = "accepted"
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
    try:  # eval_step's loss needs labels too: refused on every rank, not by the last stage only
        engine.eval_step({"input_ids": x})
        out["eval no labels"] = "accepted"
    except ValueError as exc:
        out["eval no labels"] = str(exc)
    engine.train_step({**good, "attention_mask": torch.ones_like(x)})  # a tokenizer's: accepted
    return out, engine.step


def test_bad_batches_are_refused_at_any_layout(run):
    out, steps = run(_bad_batches, 2)[0]
    expected = {"rows": f"the batch has {G // 2} rows but megapar.prepare was given "
                        f"global_batch_size={G}",
                "id": f"input id {VOCAB + 5} is outside the model's vocabulary of {VOCAB}",
                "negative id": "is outside the model's vocabulary",
                "label": f"label {VOCAB} is outside the vocabulary",
                "key": "batch key 'position_ids' is not used by gpt2",
                "mask": "takes right padding only; pack sequences without padding, or pad on the "
                        "right (a tokenizer's padding_side='right'",
                "numpy": "is a ndarray; pass torch tensors",
                "float": "holds torch.float32; token ids",
                "long": "longer than the model's 16 positions",
                "no labels": "train_step needs 'labels'",
                "eval no labels": "eval_step needs 'labels'",
                "mask shape": "attention_mask has shape (8, 6), input_ids (8, 8)",
                "int32": "accepted", "uint8": "accepted"}   # any integer width, as int64
    for name, message in expected.items():
        assert message in out[name], (name, out[name])
    assert steps == 3   # int32, uint8 and the all-ones attention mask trained


def _warned(engine, batches, what="train_step"):
    """The warnings `engine.<what>` gives on each batch in turn."""
    import warnings

    out = []
    for batch in batches:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            getattr(engine, what)(batch)
        out.append([str(w.message) for w in caught])
    return out


def _label_warnings():
    x = _batches(1)[0]["input_ids"]
    hf = x.clone()  # transformers' labels: input_ids, a prompt masked with -100
    hf[:, :3] = -100
    same = torch.full_like(x, 5)  # a row of one token: its next-token labels equal its ids
    sparse = torch.full_like(x, -100)  # isolated labels that happen to equal their own id
    sparse[:, 2] = x[:, 2]
    shifted = {"input_ids": x[:, :-1], "labels": torch.where(hf[:, 1:] < 0, -100, x[:, 1:])}
    return {"hf": _warned(megapar.prepare(_hf_model(), micro_batch_size=2),
                          [{"input_ids": x, "labels": hf}, {"input_ids": x, "labels": x}]),
            "eval": _warned(megapar.prepare(_hf_model(), micro_batch_size=2),
                            [{"input_ids": x, "labels": x}], "eval_step"),
            "next-token": [_warned(megapar.prepare(_hf_model(), micro_batch_size=2), [batch])[0]
                           for batch in (shifted, {"input_ids": same, "labels": same},
                                         {"input_ids": x, "labels": sparse})]}


def test_transformers_unshifted_labels_are_named_once(run):
    """A transformers user's batch, labels = input_ids (transformers' models shift them; megapar
    does not, so it would train each position on its own token): the first train_step or
    eval_step warns once, on rank 0, naming the fix; next-token labels never warn, also where
    they happen to equal their ids (a row of one token, isolated labels; each the first batch of
    its own engine, the one checked)."""
    ranks = run(_label_warnings, 2)
    message = ("train_step: the labels equal input_ids at every labelled position, as "
               "transformers' models take them (they shift the labels themselves); megapar does "
               "not shift them, so this trains each position to predict its own token: pass "
               "next-token labels, e.g. input_ids[:, :-1] with labels input_ids[:, 1:] "
               "(labels[:, t] is the token after input_ids[:, t])")
    assert ranks[0]["hf"] == [[message], []], ranks[0]["hf"]
    assert ranks[0]["eval"] == [[message.replace("train_step", "eval_step")]]
    assert ranks[0]["next-token"] == [[], [], []], ranks[0]["next-token"]
    assert ranks[1] == {"hf": [[], []], "eval": [[]], "next-token": [[], [], []]}, ranks[1]


def _global_rng_batches():
    from megapar.device import process_group_timeout_s

    engine = megapar.prepare(_hf_model(), pp=2, micro_batch_size=2, lr=3e-3, timeout_s=37)
    torch.manual_seed(engine.mesh.rank)  # as unseeded processes (torchrun's) differ
    x = torch.randint(0, VOCAB, (G, SEQ))   # torch's global RNG, another on every rank
    return refusal(engine, {"input_ids": x, "labels": x}), process_group_timeout_s()


def test_a_batch_that_differs_between_ranks_is_refused_on_every_rank(run):
    for message, world_timeout in run(_global_rng_batches, 2):
        assert "got another global batch than other ranks" in message
        assert "torch.Generator" in message
        # prepare's timeout_s bounds the world group's waits too (the batch check is one): a
        # rank stalled in the caller's code left the others there the launcher's 300 s
        assert world_timeout == 37


def _prepare_classes():
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2Model

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(3)
    try:
        megapar.prepare(GPT2ForSequenceClassification(cfg))
        refused = "accepted"
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        refused = str(exc)
    torch.manual_seed(3)
    body = GPT2Model(cfg)   # GPT-2's head is the tied embedding: nothing is missing
    engine = megapar.prepare(body, micro_batch_size=2)
    return refused, engine.eval_step(_batches(1)[0])


def test_prepare_refuses_a_model_whose_head_it_would_drop(run):
    refused, loss = run(_prepare_classes, 1)[0]
    assert "GPT2ForSequenceClassification has a head megapar does not train" in refused
    assert "GPT2LMHeadModel" in refused and math.isfinite(loss)


def _headless_llama():
    import warnings

    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(3)
    body = LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megapar.prepare(body, micro_batch_size=2)
    return [str(w.message) for w in caught if "megapar.prepare" in str(w.message)]


def test_a_headless_models_missing_head_is_named_as_transformers_names_it(run):
    """A LlamaModel (no LM head) was warned of as lacking 'head.weight', megapar's own name;
    the warning names transformers' lm_head.weight."""
    assert run(_headless_llama, 1)[0] == [
        "megapar.prepare: the LlamaModel has no lm_head.weight; initialised from seed 1234 "
        "(pass the model with its head to keep trained ones)"]


def _betas_vs_torch_default():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None)
    torch.manual_seed(3)
    ref = GPT2LMHeadModel(cfg)
    engine = megapar.prepare(ref, micro_batch_size=G, lr=3e-2, adam_beta2=0.999)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-2, weight_decay=0.0)   # torch's betas
    ours, theirs = [], []
    for batch in _batches(4):
        ours.append(engine.train_step(batch))
        logits = ref(batch["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 batch["labels"].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    return ours, theirs, engine.optimizer.inner.param_groups[0]["betas"]


def test_adam_betas_are_settings_and_match_torch_adamw(run):
    ours, theirs, betas = run(_betas_vs_torch_default, 1)[0]
    assert betas == (0.9, 0.999)
    assert theirs[3] < theirs[0] - 0.1     # a large lr: the second moment's decay matters
    for a, b in zip(ours, theirs):
        assert math.isclose(a, b, rel_tol=1e-5), (ours, theirs)


def _extra_clash(ckpt):
    engine = megapar.prepare(_hf_model(), micro_batch_size=2)
    try:
        engine.save(ckpt, extra={"step": 100})
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_save_extra_may_not_overwrite_megapars_own_keys(run, tmp_path):
    message = run(_extra_clash, 1, str(tmp_path / "ck"))[0]
    assert "['step'] are megapar's own checkpoint keys" in message


def _prepare_twice():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4, vocab_size=128,
                     bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    torch.manual_seed(0)
    alone = megapar.prepare(GPT2LMHeadModel(cfg), tp=2, micro_batch_size=2)
    uninterrupted = [alone.train_step(batch) for _ in range(3)]
    torch.manual_seed(0)
    first = megapar.prepare(GPT2LMHeadModel(cfg), tp=2, micro_batch_size=2)
    before = [first.train_step(batch) for _ in range(2)]
    torch.manual_seed(0)  # a notebook cell run again: a second engine
    second = megapar.prepare(GPT2LMHeadModel(cfg), tp=2, micro_batch_size=2)
    callers = torch.get_rng_state()
    again = [second.train_step(batch) for _ in range(2)]
    untouched = torch.equal(torch.get_rng_state(), callers)  # the engines draw from their own
    torch.randn(5)  # the caller's loop drawing from torch's global RNG between steps
    return uninterrupted, before, again, first.train_step(batch), untouched


def test_prepare_twice_in_one_process_gives_two_independent_engines(run):
    """Documented (README): each call builds a new engine (its own model, optimizer, step and
    dropout stream; the process groups are torch's, shared); the earlier one keeps its state
    and works on, its dropout masks (GPT2Config's 0.1) untouched by the second engine and by
    the caller's own draws from torch's global RNG (its third step differed from an
    uninterrupted engine's before: prepare reseeded, and dropout drew from, the caller's
    RNG), and prepare and the steps leave the caller's RNG as it was."""
    for uninterrupted, before, again, third, untouched in run(_prepare_twice, 2):
        assert again == before == uninterrupted[:2] and third == uninterrupted[2] and untouched


def _export_with_tokenizer(out):
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                       vocab_size=1004, bos_token_id=2, eos_token_id=2))
    engine = megapar.prepare(model.to(torch.bfloat16), micro_batch_size=2)
    engine.export_hf(out + "/with", tokenizer="sentencepiece")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.export_hf(out + "/without", dtype=torch.float16)  # a torch.dtype, as transformers
    refused = []  # in export_hf's keywords, not megapar-convert's flags
    for bad in ({"dtype": "float12"}, {"tokenizer": out + "/nowhere"}):
        try:
            engine.export_hf(out + "/bad", **bad)
        except (RuntimeError, ValueError) as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    for call in (lambda: engine.save(5), lambda: engine.load(None),
                 lambda: engine.export_hf(5), lambda: engine.save(out + "/c", extra=[1])):
        try:
            call()
        except TypeError as exc:
            refused.append(str(exc))
    return [str(w.message) for w in caught], refused


def test_export_hf_carries_a_given_tokenizer_and_the_models_dtype(run, tmp_path):
    from conftest import skip_unless_transformers_converts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    skip_unless_transformers_converts()
    from megapar.data import load_tokenizer

    said, refused = run(_export_with_tokenizer, 1, str(tmp_path))[0]
    # a bad dtype: ValueError before anything is gathered or written (was the RuntimeError
    # 'export to ... failed: CheckpointError: ...' after the weights were saved to a temporary
    # checkpoint)
    assert refused[0] == ("ValueError: engine.export_hf: dtype='float12' is not one of float32, "
                          "bfloat16, float16 (or fp32, bf16, fp16, or the torch.dtype)"), refused
    assert (f"tokenizer='{tmp_path}/nowhere' cannot be loaded" in refused[1]
            and "pass tokenizer=SPEC" in refused[1]), refused
    assert not any("--" in r for r in refused), refused
    hf = AutoTokenizer.from_pretrained(tmp_path / "with")
    assert hf("Hello world")["input_ids"] == load_tokenizer("sentencepiece").encode("Hello world")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "with").dtype == torch.bfloat16
    assert any("no tokenizer given or known, the export has none" in s for s in said), said
    # the hint fits the model: it suggested tokenizer='gpt2' for any model, here a GPT-2 of
    # 1,004 ids (GPT-2's BPE has 50,257 ids: that export is refused)
    (gpt2,) = [s for s in said if "no tokenizer given" in s]
    assert "'gpt2'" not in gpt2 and "pass tokenizer=SPEC, the tokenizer it trained with: a " \
        "transformers directory with its tokenizer.json or vocab.json + merges.txt (a " \
        "GPT2LMHeadModel's)" in gpt2, gpt2
    assert not (tmp_path / "without" / "tokenizer_config.json").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "without").dtype == torch.float16
    # wrong types: one line naming the call and what it takes (was os's 'expected str, bytes
    # or os.PathLike object, not int' and "'list' object is not a mapping")
    assert refused[2:] == [
        "engine.save(path): path must be a directory's path, a str or a pathlib.Path, got int 5",
        "engine.load(path): path must be a directory's path, a str or a pathlib.Path, got "
        "NoneType None",
        "engine.export_hf(path): path must be a directory's path, a str or a pathlib.Path, got "
        "int 5",
        "engine.save(extra=...) takes a dict of JSON-able values (e.g. {'sched': "
        "sched.state_dict()}), got a list"], refused


def _export_refused(out):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                       vocab_size=1004))
    engine = megapar.prepare(model, micro_batch_size=1)
    Path(out).mkdir(exist_ok=True)
    Path(out, "a_file").write_text("")
    refused = []
    for path, tokenizer in (("a_file", None), ("hf", out + "/nowhere"), ("hf", "gpt2")):
        try:
            engine.export_hf(f"{out}/{path}", tokenizer=tokenizer)
        except Exception as exc:  # noqa: BLE001 - its type is what is checked
            refused.append((type(exc), str(exc)))
    return refused


def test_export_hf_raises_its_failures_own_type_on_every_rank(run, tmp_path):
    """A refused export raises on every rank the exception the export raised (its type and
    message), as a failure before any collective does; it was a RuntimeError 'export to ...
    failed: CheckpointError: ...' that an `except CheckpointError` missed."""
    from megapar.checkpoint.format import CheckpointError

    ranks = run(_export_refused, 2, str(tmp_path))
    assert ranks[0] == ranks[1], ranks
    (file_type, file_said), (missing_type, missing_said), (bpe_type, bpe_said) = ranks[0]
    assert file_type is CheckpointError and file_said == (
        f"cannot create {tmp_path}/a_file: it is a file, and the export is a directory; choose "
        "another path"), file_said
    assert missing_type is CheckpointError and missing_said.startswith(
        f"tokenizer='{tmp_path}/nowhere' cannot be loaded"), missing_said
    assert bpe_type is CheckpointError and bpe_said == (
        "tokenizer='gpt2' has 50,257 token ids, more than the model's vocabulary of 1,004; pass "
        "the tokenizer it trained with (tokenizer=SPEC)"), bpe_said


def test_an_export_failure_is_raised_again_as_its_type_or_the_nearest_shared_one():
    """What rank 0's failed export sends the other ranks (`failure`) raises there as the same
    class with the same message (`raise_failure`): megapar's and builtin classes as they are,
    a library's subclass as the nearest megapar or builtin class it derives from."""
    from megapar.checkpoint.format import CheckpointError
    from megapar.models.config import ConfigError
    from megapar.training.export import failure, raise_failure

    class LibraryError(FileNotFoundError):
        pass

    bad_bytes = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    for exc, cls, said in (
            (CheckpointError("a: torn"), CheckpointError, "a: torn"),
            (ConfigError("b: no"), ConfigError, "b: no"),
            (ValueError("two\nlines"), ValueError, "two\nlines"),
            (LibraryError("c"), FileNotFoundError, "c"),
            (bad_bytes, RuntimeError, f"UnicodeDecodeError: {bad_bytes}")):
        with pytest.raises(Exception) as raised:
            raise_failure(failure(exc))
        assert type(raised.value) is cls and str(raised.value) == said, raised.value


def _prepare_after_destroy():
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    def fresh():
        torch.manual_seed(0)
        return megapar.prepare(GPT2LMHeadModel(GPT2Config(
            n_positions=16, n_embd=16, n_layer=1, n_head=2, vocab_size=64)), micro_batch_size=1)

    batch = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(1, 17).view(2, 8)}
    old = fresh()
    first = old.train_step(batch)
    dist.destroy_process_group()
    refused = []
    for call in (lambda: old.train_step(batch), lambda: old.eval_step(batch)):
        try:
            call()
        except RuntimeError as exc:
            refused.append(str(exc))
    again = fresh().train_step(batch)
    return first, again, dist.get_world_size(), refused


def test_prepare_after_destroy_process_group_joins_the_launchs_store_again(run):
    """In a megapar.launch function, megapar.prepare after torch.distributed.destroy_process_
    group() sets the group up again on the launch's store (it said 'the port is in use on this
    host (another job ...)': rank 0 serves that store), and the new engine's first step is the
    first engine's; the first engine refuses in one line (its train_step trained on, the
    batch's same-on-every-rank check skipped without a group)."""
    for first, again, world, refused in run(_prepare_after_destroy, 2):
        assert world == 2 and again == first, (first, again)
        assert refused == [
            f"{call}: the process group this engine was prepared in was destroyed "
            "(torch.distributed.destroy_process_group()), and an engine works only in its own; "
            "call megapar.prepare again for a new engine (in a megapar.launch function it joins "
            "a new group; engine.load a checkpoint to continue)"
            for call in ("train_step", "eval_step")], refused


def _export_from_pretrained(out):
    import shutil
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from megapar.data import load_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=1004, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
    )).save_pretrained(f"{out}/src")
    shutil.copy(load_tokenizer("sentencepiece").path, f"{out}/src/tokenizer.model")
    engine = megapar.prepare(LlamaForCausalLM.from_pretrained(f"{out}/src"), micro_batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.export_hf(f"{out}/hf")
    engine.save(f"{out}/ckpt")
    return [str(w.message) for w in caught]


def test_export_hf_of_a_from_pretrained_model_carries_its_directorys_tokenizer(run, tmp_path):
    """prepare(LlamaForCausalLM.from_pretrained(DIR)) trains with DIR's tokenizer, as
    megapar-train --from-hf DIR does: export_hf writes it without tokenizer= (it warned that the
    export had none), and the engine's checkpoints record it, so megapar-convert --to-hf
    writes it too."""
    from conftest import skip_unless_transformers_converts
    from transformers import AutoTokenizer

    from megapar.cli.convert import main as convert
    from megapar.data import load_tokenizer

    skip_unless_transformers_converts()
    said = run(_export_from_pretrained, 1, str(tmp_path))[0]
    assert said == [], said
    assert convert([str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf2"), "--no-progress"]) == 0
    ids = load_tokenizer("sentencepiece").encode("Hello world")
    for hf in ("hf", "hf2"):
        assert AutoTokenizer.from_pretrained(tmp_path / hf)("Hello world")["input_ids"] == ids


def _export_llama_without_tokenizer(out):
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    engine = megapar.prepare(LlamaForCausalLM(LlamaConfig(
        vocab_size=1004, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)),
        micro_batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.export_hf(out)
    return [str(w.message) for w in caught]


def test_export_hf_without_a_tokenizer_names_one_that_fits_the_model(run, tmp_path):
    """A Llama exported with no tokenizer known: the warning names where a Llama's tokenizer
    is (it suggested tokenizer='gpt2', GPT-2's BPE, for any model)."""
    said = [s for s in run(_export_llama_without_tokenizer, 1, str(tmp_path / "out"))[0]
            if "no tokenizer given" in s]
    assert len(said) == 1 and "'gpt2'" not in said[0] and (
        "pass tokenizer=SPEC, the tokenizer it trained with: a transformers directory with "
        "its tokenizer.json (a LlamaForCausalLM's), or its tokenizer.model file"
    ) in said[0], said
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()


# --- a non-finite step: an error naming the step, nothing applied ---------------------------
def _state(engine):
    """This rank's weights and optimizer state (Adam's moments and step count), as copies."""
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return weights, engine.optimizer.state_tensors(), engine.optimizer.state_json()["step"]


def _same(a, b) -> bool:
    (wa, oa, sa), (wb, ob, sb) = a, b
    return sa == sb and wa.keys() == wb.keys() and oa.keys() == ob.keys() and \
        all(torch.equal(wa[n], wb[n]) for n in wa) and \
        all(torch.equal(oa[n][k], ob[n][k]) for n in oa for k in oa[n])


def _nonfinite_step(tp, pp, zero, inf_before_prepare, on_nonfinite=None):
    """One weight set to inf (in the transformers model before `prepare`, or in the engine after
    a good step); then a train_step: what it did, and whether weights and optimizer state are
    those before it."""
    model = _hf_model()
    if inf_before_prepare:
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[3, 5] = float("inf")
    options = {} if on_nonfinite is None else {"on_nonfinite": on_nonfinite}
    engine = megapar.prepare(model, tp=tp, pp=pp, micro_batch_size=2, lr=1e-2, zero=zero,
                             **options)
    batches = _batches(2)
    if not inf_before_prepare:
        engine.train_step(batches[0])  # a good step first: Adam's state exists
        mesh = engine.mesh
        if mesh.pp_rank == 0 and mesh.tp_rank == 0:
            with torch.no_grad():
                next(engine.model.parameters()).view(-1)[0] = float("inf")
    before = _state(engine)
    try:
        outcome = f"returned {engine.train_step(batches[-1])}"
    except Exception as exc:  # noqa: BLE001 - the outcome is the test's subject
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, _same(before, _state(engine)), engine.step


@pytest.mark.parametrize("layout", [(2, 2, 0, 4, True), (1, 1, 1, 2, False), (1, 1, 2, 2, False)],
                         ids=["tp2xpp2-inf-in-the-hf-model", "dp2-zero1-inf-after-a-step",
                              "dp2-zero2-inf-after-a-step"])
def test_a_non_finite_step_raises_naming_the_step_and_applies_nothing(run, layout):
    """The field's case: a transformers GPT-2 with an inf weight "trained" at tp 2 x pp 2 and
    returned nan. Now every rank raises (NonFiniteError) naming the step and what went
    non-finite, and the weights and the optimizer state are those before that step."""
    tp, pp, zero, world, inf_before_prepare = layout
    step = 1 if inf_before_prepare else 2
    for outcome, unchanged, _ in run(_nonfinite_step, world, tp, pp, zero, inf_before_prepare):
        assert outcome.startswith(f"NonFiniteError: training diverged at step {step}: "
                                  f"non-finite loss (nan) and gradients (norm nan)"), outcome
        assert "on_nonfinite='skip'" in outcome
        assert unchanged


def _nan_loss_on_dp_rank_1():
    """Finite gradients, but dp rank 1's loss is nan: no replica may apply the step."""
    import torch.distributed as dist

    engine = megapar.prepare(_hf_model(), micro_batch_size=2, lr=1e-2)
    batches = _batches(2)
    engine.train_step(batches[0])
    executor = engine.executor_for(SEQ)
    if dist.get_rank() == 1:
        run_pipeline = executor.run
        executor.run = lambda *args, **kwargs: run_pipeline(*args, **kwargs) * float("nan")
    before = _state(engine)
    try:
        outcome = f"returned {engine.train_step(batches[1])}"
    except Exception as exc:  # noqa: BLE001 - the outcome is the test's subject
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, _same(before, _state(engine))


def test_a_non_finite_loss_alone_is_not_applied_on_any_replica(run):
    for outcome, unchanged in run(_nan_loss_on_dp_rank_1, 2):
        assert outcome.startswith("NonFiniteError: training diverged at step 2: non-finite "
                                  "loss (nan); step 2 re-run with per-module checks found every "
                                  "module's values finite"), outcome  # the loss made nan outside
        assert "; the optimizer step was skipped" in outcome
        assert unchanged


def test_on_nonfinite_skip_returns_the_nan_and_skips_the_update(run):
    for outcome, unchanged, step in run(_nonfinite_step, 2, 1, 1, 0, False, "skip"):
        assert outcome == "returned nan" and unchanged and step == 2


def _fp16_overflows():
    engine = megapar.prepare(_hf_model(), micro_batch_size=2, lr=1e-3, precision="fp16")
    engine.precision.scaler.scale = 2.0**40  # every gradient overflows in fp16
    before = _state(engine)
    losses = [engine.train_step(batch) for batch in _batches(4)]  # finite losses: not counted
    seen = (engine.loss_scale, engine.last_skipped, engine.step, engine.schedule_step)
    return losses, _same(before, _state(engine)), seen


def test_fp16_overflows_are_the_loss_scalers_business_not_an_error(run):
    """...and the engine shows them as megapar-train's log line does (`skipped`, `scale`)."""
    losses, unchanged, seen = run(_fp16_overflows, 1)[0]
    assert all(math.isfinite(x) for x in losses) and unchanged
    assert seen == (2.0**36, True, 4, 0)  # halved 4 times; 4 steps run, none applied


def _a_directory_and_its_model(path):
    model = _hf_model()
    from_dir = megapar.prepare(path, tp=2, micro_batch_size=2)
    in_memory = megapar.prepare(model, tp=2, micro_batch_size=2)
    batch = _batches(1)[0]
    return from_dir.eval_step(batch), in_memory.eval_step(batch)


def test_a_transformers_directory_is_prepared_with_its_weights(run, tmp_path):
    """prepare("DIR") of a save_pretrained directory built its config alone and drew the weights
    from seed, without a word (BERT's loss 11.79 for transformers' 12.13); it now reads them,
    as megapar-train --from-hf DIR does."""
    _hf_model().save_pretrained(tmp_path / "hf")
    for from_dir, in_memory in run(_a_directory_and_its_model, 2, str(tmp_path / "hf")):
        assert from_dir == in_memory


def test_on_nonfinite_is_checked(run):
    with pytest.raises(megapar.WorkerError, match="on_nonfinite='never' is not one of"):
        run(lambda: megapar.prepare(_hf_model(), on_nonfinite="never"), 1)


# --- the batch is the same on every rank, at every step -------------------------------------
def _later_batches_differ():
    import torch.distributed as dist

    engine = megapar.prepare(_hf_model(), pp=2, micro_batch_size=2, lr=3e-3)
    good = _batches(3)
    out = [refusal(engine, good[0])]
    other = {k: v.clone() for k, v in good[1].items()}
    if dist.get_rank() == 1:  # the last stage's labels of another batch: silently wrong before
        other["labels"][0, 0] = (other["labels"][0, 0] + 1) % VOCAB
    out.append(refusal(engine, other))
    shorter = {k: v[:, :-2] if dist.get_rank() == 1 else v for k, v in good[1].items()}
    out.append(refusal(engine, shorter))  # another shape on one rank: refused, no hang
    out.append(refusal(engine, good[2]))  # the engine goes on with the same batch everywhere
    return out, engine.step


def test_a_batch_that_differs_between_ranks_at_a_later_step_is_refused(run):
    for out, step in run(_later_batches_differ, 2):
        assert out[0] == "accepted" and out[3] == "accepted", out
        for message in out[1:3]:
            assert "got another global batch than other ranks" in message, out
        assert step == 2  # the refused batches did not train


def _different_calls(path):
    import time

    import torch.distributed as dist

    engine = megapar.prepare(_hf_model(), pp=2, micro_batch_size=2, lr=3e-3, timeout_s=60,
                             async_save=True)
    good = _batches(2)
    engine.train_step(good[0])
    out = []
    for other in ("save", "eval_step", "poll_save"):  # rank 1's call; rank 0 trains
        began = time.monotonic()
        try:
            if dist.get_rank() == 0:
                engine.train_step(good[1])
            elif other == "save":
                engine.save(path)
            elif other == "poll_save":
                engine.poll_save()
            else:
                engine.eval_step(good[1])
            out.append(("accepted", 0.0))
        except RuntimeError as exc:
            out.append((str(exc), time.monotonic() - began))
    out.append((refusal(engine, good[1]), 0.0))  # then the same call everywhere: it trains
    return out, engine.step


def test_ranks_making_different_calls_all_stop_at_once_naming_them(run, tmp_path):
    """A save (or an eval_step, or a background save's poll) on one rank while the other trains:
    each rank raises at once, naming both calls, where the two calls' collectives paired up and
    the others waited out the timeout with gloo's "Timed out waiting for recv" (the user's
    tryout's finding; a poll against a train_step aborted one rank: the re-test's); nothing is
    trained or written, and the engine goes on."""
    again = ("every rank must make the same megapar calls in the same order (train_step, "
             "eval_step, save, load, export_hf, params_whole, poll_save, wait_save: each is "
             "collective)")
    ranks = run(_different_calls, 2, str(tmp_path / "ck"))
    for rank, (out, step) in enumerate(ranks):
        (saved, t1), (evaluated, t2), (polled, t3), (last, _) = out
        for line, other in ((saved, "engine.save"), (evaluated, "eval_step"),
                            (polled, "engine.poll_save")):
            mine, theirs = ("train_step", other) if rank == 0 else (other, "train_step")
            # engine.step on both: it said the step a train_step is for (2) on one rank and
            # the steps done (1) on the other (a Python API tryout)
            assert line == (f"{mine}: rank {rank} is in {mine} at engine.step 1 while rank "
                            f"{1 - rank} is in {theirs}; {again}"), line
        assert max(t1, t2, t3) < 30, (t1, t2, t3)  # at once, not after the 60 s timeout
        assert last == "accepted" and step == 2, (last, step)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def _loads_other_checkpoints(path):
    import torch.distributed as dist

    def load(engine, ours):
        try:
            engine.load(ours)
        except RuntimeError as exc:
            return str(exc)
        return "loaded"

    engine = megapar.prepare("gpt2-tiny", dp=2, micro_batch_size=2, lr=3e-3, timeout_s=60)
    for step, batch in enumerate(_batches(2), 1):
        engine.train_step(batch)
        engine.save(f"{path}/{step}")
    steps = load(engine, f"{path}/{1 + dist.get_rank()}")  # rank 0 step 1, rank 1 step 2
    other = megapar.prepare("gpt2-tiny", dp=2, micro_batch_size=2, lr=1e-2, timeout_s=60)
    other.train_step(_batches(1)[0])
    other.save(f"{path}/other")  # step 1 too, other weights
    files = load(other, f"{path}/{'1' if dist.get_rank() == 0 else 'other'}")
    return steps, files


def test_ranks_loading_other_checkpoints_stop_at_the_load(run, tmp_path):
    """Each rank loading a checkpoint of another step raises at the load, naming the steps read
    (it surfaced only at the next train_step; a save or export straight after would have
    written weights that differ between ranks); loading checkpoints of one step with other files
    raises too, naming that (it loaded: re-tests' findings)."""
    results = run(_loads_other_checkpoints, 2, str(tmp_path))
    for rank, (steps, files) in enumerate(results):
        assert steps.startswith(f"engine.load: rank {rank} is at step {1 + rank} while rank "
                                f"{1 - rank} is at step {2 - rank}; every rank must make"), steps
        assert files == ("engine.load: the ranks read 2 different checkpoints of step 1 (their "
                         "manifests list other files): rank 0 read one, rank 1 another; every "
                         "rank must load the same checkpoint"), files


def _loads_its_own_save_in_flight(path):
    engine = megapar.prepare("gpt2-tiny", dp=2, micro_batch_size=2, lr=3e-3, timeout_s=60,
                             async_save=True)
    good = _batches(2)
    engine.train_step(good[0])
    engine.save(path)  # written in the background
    engine.train_step(good[1])
    engine.load(path)  # at once: waits for that write
    return engine.step, engine.wait_save()


def test_a_load_waits_for_the_engines_own_save_in_flight(run, tmp_path):
    """engine.load(path) straight after an async save of path loads it (it said "no
    manifest.json ... was the save interrupted?" while the write ran, or loaded an older step
    and then published the newer as latest: the re-test's finding)."""
    for step, pending in run(_loads_its_own_save_in_flight, 2, str(tmp_path / "ck")):
        assert step == 1 and pending is None, (step, pending)


def test_ranks_making_different_calls_are_each_named():
    """With three calls among four ranks, each rank's line names every other call and its ranks
    (it named two calls, from the all-reduce's highest and lowest: the re-test's finding); at
    different steps, each rank's step."""
    from megapar.training.batch_check import API_CALLS, ranks_doing_otherwise

    calls = [(2, 2), (1, 2), (4, 2), (1, 2)]  # save, eval_step, export_hf, eval_step
    named = ranks_doing_otherwise(calls, lambda c, _: f"in {API_CALLS[c]}", 0)
    assert named == "ranks 1 and 3 are in eval_step and rank 2 is in engine.export_hf", named
    steps = [(0, 3), (0, 2), (0, 3), (0, 4)]
    named = ranks_doing_otherwise(steps, lambda _, s: f"at step {s}", 2)
    assert named == "rank 1 is at step 2 and rank 3 is at step 4", named


def _raises_in_the_loop(error):
    import torch.distributed as dist

    # a recipe: a transformers model imports transformers in each rank (15 s on 2 cores)
    engine = megapar.prepare("gpt2-tiny", pp=2, micro_batch_size=2, lr=3e-3, timeout_s=20)
    for step, batch in enumerate(_batches(3)):
        if step == 1 and dist.get_rank() == 1:
            raise error
        engine.train_step(batch)


def _launched_under_torchrun(error):
    import traceback

    try:
        megapar.launch(_raises_in_the_loop, 2, error)
    except BaseException as exc:
        print("".join(traceback.format_exception_only(exc)), flush=True)
        return 1
    return 0


@pytest.mark.parametrize("error, said", [
    (KeyError("oops"), "KeyError: 'oops'"), (KeyboardInterrupt(), "KeyboardInterrupt"),
    (SystemExit(0), "SystemExit(0): it exited while the other ranks still waited for it")])
def test_under_torchrun_a_rank_that_raises_in_the_loop_is_named_by_the_others(tmp_path, error,
                                                                               said):
    """Under torchrun (each rank its own launch, no launcher of ours), rank 1 raising in the
    caller's loop left rank 0 with gloo's bare "Connection closed by peer" (the API tryout's
    finding): rank 0's error now names rank 1, its step, what it was doing and its error, from
    the job's store, as megapar-train's does; a Ctrl-C or an exit there too (rank 0 named rank
    1 at its prepare, 11 s later: the re-test's finding)."""
    import torch._dynamo  # noqa: F401  # what torch's optimizers import: once, not in each rank
    from forked import torchrun_ranks

    codes, outs = torchrun_ranks(lambda: _launched_under_torchrun(error), 2, tmp_path)
    assert codes == [1, 1], outs
    assert (f"rank 1 failed at step 1, train_step returned; in the caller's code: {said}; "
            f"rank 0 gave up waiting") in outs[0], outs[0]


def _returns_after_one_step():
    import torch.distributed as dist

    engine = megapar.prepare("gpt2-tiny", pp=2, micro_batch_size=2, lr=3e-3, timeout_s=20)
    for step, batch in enumerate(_batches(2)):
        if step == 1 and dist.get_rank() == 1:
            return "returned"
        engine.train_step(batch)
    return "trained"


def _launched_returning_early():
    import time
    import traceback

    began = time.monotonic()
    try:
        print(megapar.launch(_returns_after_one_step, 2), flush=True)
    except BaseException as exc:
        print("".join(traceback.format_exception_only(exc)), flush=True)
        print(f"after {time.monotonic() - began:.1f} s", flush=True)
        return 1
    return 0


def test_under_torchrun_a_rank_that_returns_early_is_named_as_returned(tmp_path):
    """Under torchrun, rank 1 returning from the function after step 1 while rank 0 trains step
    2: rank 0's error says rank 1 returned, where it said that rank 1 "did not answer ... (killed,
    stopped, frozen, or its node lost?)" at a step it had finished (the re-test's finding)."""
    import torch._dynamo  # noqa: F401  # what torch's optimizers import: once, not in each rank
    from forked import torchrun_ranks

    codes, outs = torchrun_ranks(_launched_returning_early, 2, tmp_path)
    assert codes == [1, 0], outs
    assert ("rank 1 returned from the function (its last call: step 1, train_step returned; in "
            "the caller's code) while rank 0 still waited for it at step 2, train_step: "
            "checking the batch; every rank must make the same megapar calls") in outs[0], outs[0]
    assert "did not answer" not in outs[0], outs[0]


def _fails_on_rank_1(where):
    import torch.distributed as dist

    engine = megapar.prepare(_hf_model(), tp=2, micro_batch_size=2, lr=3e-3)
    batch = _batches(1)[0]
    if where == "caller" and dist.get_rank() == 1:
        raise ValueError("user code broke")
    if dist.get_rank() == 1:  # ids outside the vocabulary on this rank only
        batch = {**batch, "input_ids": batch["input_ids"] + VOCAB}
    engine.train_step(batch)


@pytest.mark.parametrize("where, status", [
    ("caller", "megapar.prepare returned; in the caller's code"),
    ("batch", "step 1, train_step: checking the batch")])
def test_a_failed_api_ranks_status_says_what_it_was_doing(run, where, status):
    """It said "starting" whatever the rank had done. (" [exited]" follows once the failed rank
    is gone; it may still be tearing down when the report is written.) The ranks are forked from
    a process that ran 5 steps itself (as a notebook might): a new engine has no step yet."""
    from megapar.faults import status as rank_status

    saved = rank_status.use(rank_status.RankStatus())
    rank_status.set_step(5)
    rank_status.set_action("done, before step 6")
    try:
        with pytest.raises(megapar.WorkerError) as info:
            run(_fails_on_rank_1, 2, where)
    finally:
        rank_status.use(saved)
    assert f"--- rank 1: {status}\n" in str(info.value) + "\n" or \
        f"--- rank 1: {status} [exited]" in str(info.value), str(info.value)


def _fails_before_prepare():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("user code broke")
    megapar.prepare(_hf_model(), tp=2, micro_batch_size=2, lr=3e-3)


def test_a_rank_failing_in_the_callers_code_before_prepare_is_said_to_be_there():
    """A rank that stalled or failed in the launched function before calling megapar.prepare
    was reported "setting up after joining the process group", megapar's words for its own
    workers; it is in the caller's function now, named."""
    with pytest.raises(megapar.WorkerError) as info:  # a partial: its function named
        megapar.launch(functools.partial(_fails_before_prepare), 2, timeout_s=120)
    said = str(info.value)
    status = "calling _fails_before_prepare (the caller's code, which megapar.launch runs)"
    assert f"--- rank 1: {status}" in said and "setting up after" not in said, said


def test_prepare_outside_a_launch_names_the_processes_it_needs(monkeypatch):
    """One process asking for tp 2 x pp 2: the error is in the API's terms (megapar.launch's
    nprocs), before any process group or model is built."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    with pytest.raises(megapar.mesh.LayoutError,
                       match=r"megapar.prepare: tp=2 x cp=1 x pp=2 = 4 ranks per model replica, "
                             r"but this job runs 1 process; .*megapar.launch\(fn, nprocs=4\)"):
        megapar.prepare("gpt2-tiny", tp=2, pp=2)


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_prepare_under_torchrun_with_too_few_processes_says_how_many_to_start(
        monkeypatch, launcher):
    """torchrun --nproc-per-node 2 examples/own_loop_gpt2.py (tp 2 x pp 2): the error told the
    user to call prepare inside megapar.launch(fn, nprocs=4) "or under torchrun", which it
    already was; it now names the process count to start."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(*{"torchrun": ("TORCHELASTIC_RUN_ID", "none"),
                         "srun": ("SLURM_PROCID", "0")}[launcher])
    fix = {"torchrun": r"start a multiple of 4 processes \(torchrun --nproc-per-node x --nnodes\)",
           "srun": r"start a multiple of 4 tasks \(srun --ntasks\)"}[launcher]
    with pytest.raises(megapar.mesh.LayoutError) as info:
        megapar.prepare("gpt2-tiny", tp=2, pp=2)
    assert re.search(r"= 4 ranks per model replica, but this job runs 2 processes; " + fix,
                     str(info.value)), str(info.value)
    assert "megapar.launch" not in str(info.value)


def test_own_loop_example_under_torchrun_with_too_few_processes_is_one_line(
        monkeypatch, capsys):
    """torchrun --nproc-per-node 2 examples/own_loop_gpt2.py (tp 2 x pp 2 by default) was a
    LayoutError traceback from every rank; now one line each, exit 2, before any data or model
    is made (megapar.launch fails the test)."""
    example = _example()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(example.megapar, "launch", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(example, "ensure_dataset", lambda *a: pytest.fail("tokenized"))
    with pytest.raises(SystemExit) as exit_:
        example.main(["--steps", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [
        "own_loop_gpt2.py: error: 2 processes started, not a multiple of --tp 2 x --pp 2 = 4; "
        "start a multiple of 4 (torchrun --nproc-per-node) or change --tp / --pp"], err


def test_prepare_names_an_architecture_it_does_not_build():
    """An OPT model is not 'a head megapar does not train': the error says megapar does not
    build OPT, and which models it trains."""
    from transformers import OPTConfig, OPTForCausalLM

    from megapar.models.config import ConfigError

    opt = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                   ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16,
                                   max_position_embeddings=16))
    with pytest.raises(ConfigError,
                       match=r"prepare: OPTForCausalLM \(model_type 'opt'\) is not a model megapar "
                             r"builds; it trains GPT2LMHeadModel / BertForMaskedLM"):
        megapar.prepare(opt)


def test_prepare_names_a_model_on_the_meta_device_and_takes_its_config():
    """A model built on the meta device (torchtitan's way to skip materialising it) has no
    weights to shard: one line naming its config as the fix (torch's 'Cannot copy out of meta
    tensor' from deep inside the weight reader before), and its config builds (and shows
    itself in a notebook by its model, layout, step and optimizer)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megapar.models.config import ConfigError

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    with pytest.raises(ConfigError, match=r"prepare: the GPT2LMHeadModel's weights are on the "
                                          r"meta device .*; pass its config, "
                                          r"megapar.prepare\(model.config, ...\)"):
        megapar.prepare(model)
    engine = megapar.prepare(model.config, lr=3e-4)
    # what a notebook shows for it (was <megapar.training.engine.Engine object at 0x...>)
    assert repr(engine) == ("Engine(gpt2, Mesh(tp=1 pp=1 dp=1, rank=0: tp_rank=0 pp_rank=0 "
                            "dp_rank=0), step=0, optimizer=adamw lr=0.0003, precision=fp32)")


def test_prepare_names_the_option_a_misspelt_one_meant():
    """A misspelt keyword said only 'see TrainConfig' (megapar-train's parser names the flag)."""
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    with pytest.raises(TypeError, match=r"unknown options \['lrr', 'zzz'\]; lrr: did you mean "
                                        r"lr\?; see TrainConfig"):
        megapar.prepare(cfg, lrr=1e-3, zzz=1)


@pytest.mark.parametrize("keyword, said", [
    # were "did you mean micro_batch_size?" (train_batch_size is the global batch), or nothing
    # (loss_scale is an option now: refused outside precision='fp16' below)
    ("train_batch_size", "train_batch_size: did you mean global_batch_size?"),
    ("gradient_accumulation_steps", "give global_batch_size (= micro_batch_size x the "
     "accumulation steps x dp)"),
    ("gradient_clipping", "gradient_clipping: did you mean clip_grad?"),
    ("fp16", "fp16: did you mean precision='fp16'?"),
    ("checkpoint_activations", "checkpoint_activations: did you mean recompute='full'?"),
    ("config", "config: megapar.prepare reads no config file (a DeepSpeed config neither)"),
    ("stage", "stage: did you mean zero?"),  # was "did you mean save?"
    ("module", "module: torchtitan's module and config name a Python config of its registry "
     "(llama3, llama3_8b), which megapar.prepare cannot read: pass the model"),
    # torchtitan's float8 names: "did you mean load?", or nothing; an int choice was quoted
    ("float8", "float8: did you mean fp8='tensorwise' (or rowwise"),
    ("enable_fsdp_float8_all_gather", "megapar's zero=3 gathers the fp8='tensorwise' linears'"),
    # torchtitan's job config keys without their section: "did you mean
    # expert_tensor_parallel_size?", or nothing
    ("tensor_parallel_degree", "tensor_parallel_degree: did you mean tp?"),
    ("pipeline_parallel_degree", "pipeline_parallel_degree: did you mean pp?"),
    ("data_parallel_shard_degree", "data_parallel_shard_degree: did you mean zero=3"),
    ("local_batch_size", "local_batch_size: did you mean micro_batch_size?"),
    # hints that named keywords prepare refuses (warmup_steps, lr_decay) or megapar-train's
    # terms (a default global batch of 16, "as megapar-train flags"), or nothing (a re-test)
    ("warmup_ratio", "warmup_ratio: prepare takes the learning-rate schedule as "
     "lr_schedule={'max_steps': ..., 'warmup_steps': ..., 'decay': ..., 'min_lr': ...}"),
    ("lr_scheduler_type", "lr_scheduler_type: prepare takes the learning-rate schedule as "
     "lr_schedule="),
    ("per_device_train_batch_size", "per_device_train_batch_size: did you mean "
     "micro_batch_size? (each train_step's batch is the global batch"),
    ("zero_optimization", "zero_optimization: megapar's ZeRO is built in: give zero=1, 2 or 3 "
     "(with offload_optimizer, offload_params) and the config's other settings as keywords"),
    ("activation_checkpoint", "activation_checkpoint: did you mean recompute='full'?"),
])
def test_prepare_answers_deepspeeds_keywords_with_its_own(keyword, said):
    """DeepSpeed's config keys as keywords get megapar-train's answer to the flag of that name,
    in keyword terms (`OTHER_TOOLS_FLAGS`)."""
    with pytest.raises(TypeError) as err:
        megapar.prepare("gpt2-tiny", **{keyword: 1})
    assert said in str(err.value), err.value


def test_prepare_warns_of_what_the_transformers_model_was_set_to_do(recwarn):
    """A model's gradient checkpointing and 16-bit weights were dropped without a word: the
    engine trains its own fp32 model at recompute='none', precision='fp32' (a Trainer user's
    re-test); said, and not where the keywords ask for the same."""
    model = _hf_model().to(torch.bfloat16)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    megapar.prepare(model, micro_batch_size=2)
    said = [str(w.message) for w in recwarn if "megapar.prepare" in str(w.message)]
    assert said == [
        "megapar.prepare: the GPT2LMHeadModel's gradient checkpointing is not read (the engine "
        "trains its own model): pass recompute='full' (or 'selective')",
        "megapar.prepare: the GPT2LMHeadModel's weights are bfloat16: the engine keeps them in "
        "fp32 and computes in fp32; pass precision='bf16' for bfloat16 autocast (export_hf "
        "writes bfloat16 back either way)"], said
    recwarn.clear()
    megapar.prepare(model, micro_batch_size=2, recompute="full", precision="bf16")
    assert not [w for w in recwarn if "megapar.prepare" in str(w.message)]


def test_prepare_names_what_it_trains_for_an_object_it_cannot():
    """An object that is no model, config or path said "cannot use a object" and named the
    transformers classes only, not the paths `prepare` reads too."""
    from megapar.models.config import ConfigError
    from megapar.training.prepare import LM_CLASSES

    with pytest.raises(ConfigError) as err:
        megapar.prepare(object())
    assert str(err.value) == (
        f"megapar.prepare: cannot train a 'object' object; pass a transformers "
        f"{' / '.join(LM_CLASSES)} (or its config), a recipe name such as 'gpt2-tiny', a "
        f"config file, a transformers model's directory or a megapar checkpoint")


def test_prepare_offers_the_chunks_the_models_layers_hold():
    """virtual_stages beside a one-chunk schedule was offered the interleaved schedules at its
    own V, which a 4-layer model refuses in turn (megapar-train's flags were fixed alone; a
    re-test): the V the layers hold at this pp, or none."""
    with pytest.raises(ValueError) as info:
        megapar.prepare("gpt2-tiny", pp=2, schedule="zb-h1", virtual_stages=3)
    assert str(info.value) == (
        "megapar.prepare: virtual_stages=3 with schedule='zb-h1': zb-h1 runs one model chunk per "
        "rank, and the model's 4 layers at pp=2 hold 2 per rank at most; leave virtual_stages "
        "out, or give schedule='interleaved' or 'zb-v' or 'dualpipev' with virtual_stages=2")
    with pytest.raises(ValueError, match=r"pp=1 runs no pipeline: drop virtual_stages \(or pass "
                                         r"pp=2, schedule='interleaved', virtual_stages=2: pp x "
                                         r"virtual_stages at most the model's 4 layers\)$"):
        megapar.prepare("gpt2-tiny", virtual_stages=4)


@pytest.mark.parametrize("kwargs, words", [
    ({"zero": 3, "offload_params": True},
     ["megapar.prepare: offload_params=True needs offload_optimizer=True"]),
    ({"zero": 1, "offload_params": True, "offload_optimizer": True},
     ["megapar.prepare: offload_params=True needs zero=3"]),
    ({"zero": 9}, ["megapar.prepare: zero=9 is not a ZeRO stage", "or 3 (parameters too)"]),
    # at pp 1: was "needs schedule='interleaved'", which then needs pp 2; a dense model at tp 1
    # was told "the tp size tp=1", not that it has no experts (a re-test)
    ({"virtual_stages": 2}, ["megapar.prepare: virtual_stages=2 cuts each pipeline stage into "
                             "model chunks, and pp=1 runs no pipeline: drop virtual_stages"]),
    ({"expert_tensor_parallel_size": 2}, ["expert_tensor_parallel_size=2 splits each routed "
                                          "expert over tp, and this gpt2 model has no experts"]),
    # a string is truthy: fp8_emulate="no" ran emulated, sequence_parallel="False" split
    ({"fp8": "tensorwise", "fp8_emulate": "no"},
     ["megapar.prepare: fp8_emulate='no' is invalid: a switch is True or False"]),
    ({"sequence_parallel": "False"}, ["sequence_parallel='False' is invalid: a switch is True"]),
    # a layout the model cannot take named --tp / --pp (checked before the world size)
    ({"tp": 3}, ["megapar.prepare: 4 attention heads are not divisible by tp=3; use tp=1, 2 or "
                 "4 (each divides the 4 attention heads, hidden size 32, FFN size 128)"]),
    ({"pp": 8}, ["megapar.prepare: 2 layers cannot be cut into pp=8 stages (each stage needs "
                 "at least one layer); lower pp"]),
    # a two-chunk schedule's refusal came from the engine's build, without the prefix and in
    # megapar-train's flags (a re-test)
    ({"pp": 2, "schedule": "zb-v"}, ["megapar.prepare: 2 layers cannot be cut into 2 x pp=2 = "
                                     "4 model chunks"]),
    # the V's line before the model's "lower pp to 2 or less", which the V refuses at 2 (the
    # API missed megapar-train's reordering; a re-test)
    ({"pp": 8, "schedule": "zb-v"}, ["megapar.prepare: 2 layers cannot be cut into 2 x pp=8 = "
                                     "16 model chunks", "use a schedule with one chunk per rank"]),
    # the split's flags in prepare's keywords (they were megapar-train's: "--decoder-last-
    # pipeline-num-layers 3", "(1f1b, zb-h1)", "drop the flags")
    ({"pp": 2, "decoder_last_pipeline_num_layers": 3}, [
        "megapar.prepare: decoder_last_pipeline_num_layers=3 is more than the model's 2 layers"]),
    ({"pp": 2, "schedule": "interleaved", "virtual_stages": 2,
      "decoder_first_pipeline_num_layers": 1}, [
        "megapar.prepare: 2 layers cannot be cut into pp=2 x virtual_stages=2 = 4 model chunks",
        "decoder_first_pipeline_num_layers=1 leaves no interleaved cut of them: use a schedule "
        "with one chunk per rank (schedule='1f1b' or 'zb-h1')"]),
    ({"pp": 2, "decoder_first_pipeline_num_layers": 1,
      "account_for_loss_in_pipeline_split": True}, [
        "megapar.prepare: decoder_first_pipeline_num_layers=1 "
        "account_for_loss_in_pipeline_split=True: give the first / last stage's layers or "
        "count the embedding / loss as a layer, not both"]),
    ({"cp_comm_type": "p2p"}, ["megapar.prepare: cp_comm_type='p2p' chooses how "
                               "context-parallel attention communicates, and cp=1 has none"]),
    ({"cp": 8, "cp_comm_type": "a2a"}, ["megapar.prepare: cp_comm_type='a2a' at cp 8: "
                                        "all-to-all context parallelism", "use cp=2 or 4 "
                                        "(dividing 4), or cp_comm_type='p2p' (the ring"]),
    # packed documents: the eod id has no default here, and must be in the vocabulary
    ({"attention_mask_type": "block_causal"},
     ["megapar.prepare: attention_mask_type='block_causal' needs the end-of-document token's "
      "id: pass eod_id="]),
    ({"reset_position_ids": True, "eod_id": 50257},
     ["megapar.prepare: eod_id=50257 is outside the model's vocabulary"]),
    # megapar-train's ranges: clip_grad=-1 trained unclipped, weight_decay=-0.1 grew the weights
    ({"clip_grad": -1.0}, ["megapar.prepare: clip_grad=-1.0 is invalid", ">= 0.0"]),
    ({"weight_decay": -0.1}, ["megapar.prepare: weight_decay=-0.1 is invalid"]),
    ({"micro_batch_size": 0}, ["megapar.prepare: micro_batch_size=0 is invalid", ">= 1"]),
    # a misspelt or missing key of the schedule was LRScheduler's raw TypeError
    ({"lr_schedule": {"max_step": 10}}, ["lr_schedule has unknown keys ['max_step']"]),
    ({"lr_schedule": {"warmup_steps": 2}}, ["lr_schedule has no 'max_steps'", "(needed)"]),
    ({"lr_schedule": {"max_steps": 0}}, ["megapar.prepare: lr_schedule {'max_steps': 0}: "
                                         "need warmup_steps >= 0 and max_steps >= 1"]),
    # 0 was the default (300 s), taken silently
    ({"timeout_s": 0}, ["megapar.prepare: timeout_s=0 is invalid", ">= 0.001"]),
    ({"lr_schedule": {"max_steps": 10, "decay": "wsd"}},
     ["megapar.prepare: lr_schedule decay 'wsd' needs decay_steps"]),
    # read by no part of the engine: trained at a constant lr, saved nothing
    ({"warmup_steps": 100}, ["megapar.prepare: warmup_steps=100 is megapar-train's learning-rate "
                             "schedule", "pass lr_schedule={'max_steps'"]),
    ({"max_steps": 10, "lr": 1e-3}, ["max_steps=10", "pass lr_schedule="]),
    ({"save": "ckpt", "save_interval": 1}, ["megapar.prepare: save='ckpt' is read only by "
                                            "megapar-train's own loop", "engine.save(dir)"]),
    ({"log_interval": 1}, ["log_interval=1 is read only by megapar-train's own loop"]),
    # megapar-train's data: the caller's batches replace it (taken, unread; a re-test)
    ({"data": "corp.txt"}, ["megapar.prepare: data='corp.txt' is megapar-train's data, which "
                            "the engine does not read: your loop feeds engine.train_step(batch)"]),
    ({"val_fraction": 0.1}, ["val_fraction=0.1 is megapar-train's data"]),
    # megapar-train's ZeRO-3 refusals: prepare trained on, ignoring them
    ({"zero": 3, "zero3_persistence_threshold": -5},
     ["megapar.prepare: zero3_persistence_threshold=-5 is invalid"]),
    ({"zero": 1, "zero3_keep_params": True},
     ["megapar.prepare: zero3_keep_params=True only applies to zero=3"]),
    ({"zero": 2, "zero3_reduce": "micro-batch"},
     ["megapar.prepare: zero3_reduce='micro-batch' only applies to zero=3", "(zero=2 reduces"]),
    ({"zero": 3, "grad_compression": "powersgd"},
     ["megapar.prepare: grad_compression='powersgd' cannot be combined with zero=3"]),
    ({"zero": 3, "precision": "bf16", "grad_reduce_dtype": "bf16"},
     ["megapar.prepare: grad_reduce_dtype='bf16' is not served with zero=3", "use zero=0, zero=1 or zero=2 for a bf16"]),
    # refused only inside the engine, in megapar-train's flags ("--grad-compression ... --zero")
    ({"zero": 1, "grad_compression": "powersgd"},
     ["megapar.prepare: grad_compression='powersgd' cannot be combined with zero=1",
      "(zero=0 or grad_compression='none')"]),
    ({"zero": 2, "grad_compression": "fp16"},
     ["megapar.prepare: grad_compression='fp16' cannot be combined with zero=2"]),
    # megapar-train refused these; prepare trained on, the dtype or the rank unread (a tryout)
    ({"grad_compression": "fp16", "grad_reduce_dtype": "bf16"},
     ["megapar.prepare: grad_reduce_dtype='bf16' and grad_compression='fp16' both choose how "
      "gradients travel; give one (grad_compression='bf16' / 'fp16' is a reduction in that "
      "dtype)"]),
    ({"grad_compression": "powersgd", "powersgd_rank": 10**6},
     ["megapar.prepare: powersgd_rank=1000000 compresses nothing: every gradient matrix of this "
      "model would send at least as many numbers as it holds", "give a rank of at most"]),
    ({"powersgd_rank": 8},
     ["megapar.prepare: powersgd_rank=8 would be ignored: it is PowerSGD's rank, and "
      "grad_compression='none': pass grad_compression='powersgd' or drop powersgd_rank"]),
    ({"offload_optimizer": True, "optimizer": "lamb"},
     ["megapar.prepare: offload_optimizer=True steps AdamW or SGD on the host, not "
      "optimizer='lamb'", "drop offload_optimizer=True or use optimizer='adamw'"]),
    ({"zero": 1, "offload_optimizer": True, "optimizer": "lars"},
     ["offload_optimizer=True steps AdamW or SGD on the host, not optimizer='lars'"]),
    ({"loss_mean": "mean"}, ["megapar.prepare: loss_mean='mean' is not one of 'microbatch', "
                             "'token'"]),
    # the fp16 loss scale's settings: hysteresis=2 was unread in fp32, a floor above the
    # start was the scaler's own "need 0 < min_scale <= init_scale"
    ({"hysteresis": 2}, ["megapar.prepare: hysteresis=2 sets the fp16 loss scale, and "
                         "precision='fp32' has none: pass precision='fp16' or drop hysteresis"]),
    ({"loss_scale": 128.0}, ["megapar.prepare: loss_scale=128.0 sets the fp16 loss scale"]),
    ({"precision": "fp16", "loss_scale": 128.0, "hysteresis": 2},
     ["megapar.prepare: hysteresis=2 sets the dynamic loss scale, and loss_scale=128.0 is "
      "static: drop one"]),
    ({"precision": "fp16", "min_loss_scale": 128.0, "initial_loss_scale": 64.0},
     ["megapar.prepare: min_loss_scale=128.0 is above initial_loss_scale=64.0"]),
    # megapar-train's choices: each was the engine's own error, raised after the mesh was made
    # ("unknown precision 'fp64'; expected one of [...]"), not naming the keyword
    ({"precision": "fp64"}, ["megapar.prepare: precision='fp64' is invalid: choose one of "
                             "'fp32', 'bf16', 'fp16'"]),
    ({"schedule": "gpipe2"}, ["megapar.prepare: schedule='gpipe2' is invalid: choose one of"]),
    # torch's class name, answered in the API's terms
    ({"schedule": "ScheduleInterleaved1F1B"}, ["schedule='ScheduleInterleaved1F1B' is invalid",
                                               "is megapar's schedule='interleaved', "
                                               "virtual_stages=V"]),
    ({"optimizer": "adam"}, ["megapar.prepare: optimizer='adam' is invalid", "'adamw'"]),
    # a schedule's model chunks: refused at the first train_step, in megapar-train's flags
    ({"pp": 2, "schedule": "interleaved"}, [
        "megapar.prepare: schedule='interleaved' needs virtual_stages >= 2 model chunks per "
        "rank, got virtual_stages=1: give virtual_stages=2 (or more), or schedule='1f1b'"]),
    ({"schedule": "zb-v"}, ["megapar.prepare: schedule='zb-v' runs several model chunks on each "
                            "of pp > 1 stages, and pp=1: give pp=2 or more"]),
    # the 2-layer model holds one chunk per rank at pp 2: the interleaved schedules it was
    # offered were refused next (a re-test)
    ({"pp": 2, "virtual_stages": 2}, [
        "megapar.prepare: virtual_stages=2 with schedule='1f1b': 1f1b runs one model chunk per "
        "rank, and the model's 2 layers at pp=2 hold no more than one per rank; leave "
        "virtual_stages out"]),
    ({"pp": 2, "schedule": "dualpipev", "virtual_stages": 3}, [
        "megapar.prepare: virtual_stages=3 does not apply to schedule='dualpipev'"]),
    ({"recompute": "some"}, ["megapar.prepare: recompute='some' is invalid", "'selective'"]),
    # None is no setting: fp8=None was "needs a GPU with FP8 matmuls" (None switched it on),
    # and with fp8_emulate=True the engine's "fp8 recipe None / layers 'auto' unknown"
    ({"fp8": None}, ["megapar.prepare: fp8=None is invalid: choose one of 'off', "]),
    ({"fp8": None, "fp8_emulate": True, "precision": "bf16"}, ["fp8=None is invalid"]),
    ({"schedule": None}, ["megapar.prepare: schedule=None is invalid: choose one of"]),
])
def test_prepare_refuses_what_megapar_train_refuses_in_the_apis_terms(kwargs, words):
    """zero=3 with offload_params=True but no offload_optimizer trained as plain ZeRO-3 (the CLI
    refuses it); zero=9 said 'use 0, 1 or 2' naming --zero. One line, the keyword arguments."""
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    with pytest.raises(ValueError) as info:
        megapar.prepare(cfg, **kwargs)
    message = str(info.value)
    assert all(w in message for w in words) and "--" not in message, message
    assert len(message.splitlines()) == 1, message


def _export_with_generation_config(out):
    model = _hf_model()
    model.generation_config.update(do_sample=True, top_k=7, max_new_tokens=11)
    model.save_pretrained(f"{out}/src")
    engine = megapar.prepare(model, micro_batch_size=2)
    engine.train_step(_batches(1)[0])
    engine.export_hf(f"{out}/hf")
    engine.save(f"{out}/ckpt")


def test_export_hf_of_an_in_memory_model_carries_its_generation_config(run, tmp_path):
    """prepare(model) records the model's generation_config, as megapar-train --from-hf
    records its directory's: export_hf and megapar-convert --to-hf of the engine's checkpoint
    write it back as save_pretrained does (they wrote one made from the config: do_sample,
    top_k and max_new_tokens were lost)."""
    import warnings

    from megapar.cli.convert import main as convert

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer known: said, and not what this tests
        run(_export_with_generation_config, 1, str(tmp_path))
    assert convert([str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf2"),
                    "--no-progress"]) == 0
    source = json.loads((tmp_path / "src" / "generation_config.json").read_text())
    assert source["top_k"] == 7 and source["do_sample"] is True
    for hf in ("hf", "hf2"):
        assert json.loads((tmp_path / hf / "generation_config.json").read_text()) == source


def _prepare_mixtral_at_ep(ep: int) -> str:
    from megapar.models.recipes import resolve_model

    try:
        megapar.prepare(resolve_model("mixtral-tiny"), ep=ep, seq_len=16)
    except ValueError as exc:
        return str(exc)
    return "prepared"


def test_prepare_offers_only_eps_that_divide_the_experts_too():
    """At 6 ranks, ep=4 on 4 experts offered "ep=1, 2, 3 or 6", and ep=3 then "choose an ep
    that divides 4", whose ep=4 was refused again (a re-test): both name 1 or 2 now."""
    said = megapar.launch(_prepare_mixtral_at_ep, 6, 4)
    assert said.endswith("use ep=1 or 2 (each divides dp x cp = 6 and the 4 experts), or "
                         "change dp / cp"), said
    said = megapar.launch(_prepare_mixtral_at_ep, 6, 3)
    assert said == ("megapar.prepare: ep=3 does not divide the model's 4 experts: use ep=1 or 2 "
                    "(each divides the 4 experts and dp x cp = 6)"), said


def test_prepare_refuses_an_ep_that_does_not_divide_dp_x_cp_in_the_apis_terms():
    """An ep that does not divide the dp x cp prepare's world leaves was refused by the mesh in
    megapar-train's flags ('--ep 2 does not divide dp x cp = --dp 1 x --cp 1')."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, max_position_embeddings=16)
    with pytest.raises(ValueError) as info:
        megapar.prepare(cfg, ep=2)
    assert str(info.value) == (
        "megapar.prepare: ep=2 does not divide dp x cp = dp=1 x cp=1 = 1: experts are sharded "
        "over the data- and context-parallel ranks; use ep=1 (the only value dividing dp x cp = "
        "1 and the 4 experts), or change dp / cp")


def test_a_batch_without_input_ids_names_its_keys():
    """A misspelt key ({"input_id": ...}) read "takes a dict of tensors ..., got dict" about a
    dict (a Python API tryout); it names the keys the batch has."""
    from types import SimpleNamespace

    from megapar.training.batch_check import check_batch

    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(TypeError) as exc:
        check_batch({"input_id": ids, "labels": ids}, SimpleNamespace(model_type="gpt2"))
    assert str(exc.value) == ("train_step: the batch has no 'input_ids' (its keys: 'input_id', "
                              "'labels'); it takes a dict of tensors with at least 'input_ids' "
                              "(and 'labels' to train)")
    with pytest.raises(TypeError, match=r"at least 'input_ids' \(and 'labels' to train\), got "
                                        r"tuple$"):
        check_batch((ids, ids), SimpleNamespace(model_type="gpt2"))


def _tokenizer_taken(tmp):
    engine = megapar.prepare("gpt2-tiny", tokenizer="gpt2")
    engine.save(f"{tmp}/ck")
    from megapar.checkpoint.manifest import read_manifest
    from megapar.checkpoint.publish import resolve_checkpoint

    recorded = read_manifest(resolve_checkpoint(f"{tmp}/ck"))["meta"]["tokenizer"]
    try:
        engine.export_hf(f"{tmp}/hf", tokenizer=object())
    except TypeError as exc:
        refused = str(exc)
    try:
        engine.export_hf(f"{tmp}/hf", tokenizer="sentencepiece")
    except RuntimeError as exc:  # (a CheckpointError)
        other = str(exc)
    return engine.tokenizer["path"], recorded["path"], refused, other


def test_prepare_s_tokenizer_is_the_engine_s_and_a_tokenizer_object_is_refused(tmp_path):
    """prepare(tokenizer=...) was taken and never read (engine.tokenizer None, the checkpoint
    recording none, export_hf warning of none), tokenizer=12345 failed at engine.save with a
    TypeError from os.path, and export_hf(tokenizer=<a transformers tokenizer>) with one from
    os.stat (a Python API tryout): the spec is the engine's tokenizer, anything else one
    line."""
    from megapar.launcher import run_local

    taken, recorded, refused, other = run_local(_tokenizer_taken, 1, str(tmp_path))[0]
    assert taken == recorded == "gpt2"
    # another tokenizer than the engine's: said of the engine (it said "the checkpoint
    # records", with no checkpoint in sight; a re-test)
    assert other.startswith("tokenizer='sentencepiece' is not the tokenizer the engine "
                            "records, gpt2 "), other
    assert refused == ("engine.export_hf: tokenizer takes a tokenizer's name or path ('gpt2', "
                       "'sentencepiece', a SentencePiece .model file, or a transformers "
                       "tokenizer's directory (e.g. the one tok.save_pretrained(DIR) writes)), "
                       "not a value of type object")
    with pytest.raises(TypeError, match=r"^megapar.prepare: tokenizer takes a tokenizer's name "
                                        r"or path \(.*\), not a value of type int$"):
        megapar.prepare("gpt2-tiny", tokenizer=12345)
    # more ids than the model's vocabulary: refused here, not after the training by export_hf
    # (a re-test: a transformers GPT-2 tokenizer of 50,261 ids at the 50,257 of gpt2-tiny)
    assets, wide = ROOT / "megapar" / "assets", tmp_path / "wide"
    wide.mkdir()
    vocab = json.loads((assets / "gpt2_vocab.json").read_text())
    vocab.update({f"<extra{i}>": len(vocab) + i for i in range(5)})
    (wide / "vocab.json").write_text(json.dumps(vocab))
    shutil.copy(assets / "gpt2_merges.txt", wide / "merges.txt")
    with pytest.raises(ValueError, match=r"^megapar.prepare: tokenizer='.*wide' has 50,26\d "
                                         r"token ids, more than the model's vocabulary of "
                                         r"50,257; pass the tokenizer of the model's data$"):
        megapar.prepare("gpt2-tiny", tokenizer=str(tmp_path / "wide"))
    # what does not load says why, as megapar-train's --tokenizer does (it was "cannot be
    # loaded" for a directory of tokenizer.model alone, where the file is what to pass)
    with pytest.raises(ValueError, match=r"^megapar.prepare: tokenizer 'nowhere/tok': no such "
                                         r"file or directory, .* and pass tokenizer=DIR$"):
        megapar.prepare("gpt2-tiny", tokenizer="nowhere/tok")
    (tmp_path / "sp").mkdir()
    shutil.copy(ROOT / "megapar" / "assets" / "botchan_en_unigram_1000.model",
                tmp_path / "sp" / "tokenizer.model")
    with pytest.raises(ValueError, match=r"^megapar.prepare: tokenizer directory '.*sp' holds "
                                         r"SentencePiece model\(s\) \(tokenizer.model\), .*; "
                                         r"pass the model file itself, e.g. .*sp/tokenizer.model"):
        megapar.prepare("gpt2-tiny", tokenizer=str(tmp_path / "sp"))
    # a hub id in prepare's own terms (it said --model llama-1b, --from-hf DIR; a re-test)
    with pytest.raises(ValueError, match=r"^megapar.prepare: model 'meta-llama/Llama-3.2-1B' is a "
                                         r"Hugging Face Hub id, and megapar downloads nothing: "
                                         r"its shape is the recipe prepare\('llama-1b'\) \(its "
                                         r"weights: prepare\(DIR\) of a saved copy\)$"):
        megapar.prepare("meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match=r"^megapar.prepare: tokenizer=' ' is empty; pass 'gpt2'"):
        megapar.prepare("gpt2-tiny", tokenizer=" ")  # was "cannot be loaded"
    # a transformers directory whose own tokenizer has more ids than its model: refused here
    # too (it was taken, and export_hf refused it after the training)
    import transformers

    small = tmp_path / "small"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=1000, n_positions=64)).save_pretrained(small)
    shutil.copy(assets / "gpt2_vocab.json", small / "vocab.json")
    shutil.copy(assets / "gpt2_merges.txt", small / "merges.txt")
    with pytest.raises(ValueError) as err:
        megapar.prepare(str(small))
    assert str(err.value) == (f"megapar.prepare: the tokenizer in {small} has 50,257 token ids, "
                              f"more than its model's vocabulary of 1,000: it is not the "
                              f"model's; save the model's tokenizer there (save_pretrained), "
                              f"or remove the tokenizer's files from it")


def _a_batch_with_no_labelled_token():
    """AdamW at loss_mean="token", dp 2: a step, then two batches whose labels are all -100
    (an SFT batch of prompts that fill their samples), their count made on the device as
    megapar-train's loop leaves it (`run_step`) and on the host as `train_step` counts a
    batch in host memory, then a step again."""
    from canonical import gather_canonical

    engine = megapar.prepare(_hf_model(), dp=2, micro_batch_size=2, lr=3e-3,
                             global_batch_size=G, loss_mean="token", weight_decay=0.1)
    good = _batches(1)[0]
    empty = {**good, "labels": torch.full_like(good["labels"], -100)}
    engine.train_step(good)
    before = {k: v.clone() for k, v in gather_canonical(engine.model).items()}
    result = engine.run_step(engine.split(engine._checked(empty, "train_step")))
    loss = engine.train_step(empty)
    after = gather_canonical(engine.model)
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    engine.train_step(good)
    return (result.loss, result.empty, loss), moved, engine.step, engine.schedule_step


def test_a_batch_with_no_labelled_token_applies_nothing(run):
    """Such a step logged loss 0 and stepped AdamW on a zero gradient, whose momentum and weight
    decay moved every weight (a new user's SFT tryout). It applies nothing now, and the
    learning-rate schedule counts the steps applied."""
    for losses, moved, step, applied in run(_a_batch_with_no_labelled_token, 2):
        assert (losses, moved, step, applied) == ((0.0, True, 0.0), 0.0, 4, 2)
