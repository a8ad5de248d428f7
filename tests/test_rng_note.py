"""The note on a resume in another layout says what not restoring the RNG states costs: the
ranks' RNG streams belong to the checkpoint's layout, so dropout masks differ from an
uninterrupted run, and a model without dropout draws none, so its losses are unaffected (they
continue to 1e-7). It used to read "RNG states not restored: checkpoint layout tp=1 pp=1 dp=1 !=
tp=1 pp=1 dp=2" alone, for a dropout-free model whose curve continued exactly."""

import json
from pathlib import Path

import pytest

from megapar.cli.train import main as train
from megapar.data import asset_path
from megapar.models.config import BertConfig, GPT2Config, LlamaConfig

TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "1"]


def test_draws_dropout_reads_every_dropout_probability():
    assert GPT2Config().draws_dropout and BertConfig().draws_dropout
    assert not LlamaConfig().draws_dropout and LlamaConfig(attention_dropout=0.1).draws_dropout
    assert not GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).draws_dropout
    assert GPT2Config(resid_pdrop=0.0, embd_pdrop=0.1, attn_pdrop=0.0).draws_dropout


@pytest.mark.parametrize("pdrop, unaffected", [(0.0, True), (0.1, False)])
def test_the_note_on_a_layout_change_names_the_cost(tmp_path, capfd, pdrop, unaffected):
    text = tmp_path / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps({
        "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": pdrop, "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
    common = ["--model", str(model), "--data", str(text), "--tokenizer", "sentencepiece",
              "--data-cache", str(tmp_path / "cache"), *TINY]
    ckpt = tmp_path / "ckpt"
    assert train([*common, "--max-steps", "1", "--save", str(ckpt)]) == 0
    capfd.readouterr()
    assert train([*common, "--max-steps", "2", "--load", str(ckpt), "--dp", "2"]) == 0
    out = capfd.readouterr().out
    note = ("RNG states not restored: they are the ranks' of the checkpoint's layout tp=1 pp=1 "
            "dp=1, not of tp=1 pp=1 dp=2; dropout masks differ from an uninterrupted run")
    assert note in out, out
    assert ("(this model has no dropout: its losses are unaffected)" in out) is unaffected, out
