"""Supervised fine-tuning on prompt / response records (--sft-keys): the first step's loss equals
transformers' forward on the same masked batch, tp / pp / dp equal one process, a resume
continues the run, and bad input is refused in one line before any worker starts.

The CLI is called in-process (`main(argv)`), so its workers are forked from this process."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from megapar.cli.convert import main as convert
from megapar.cli.data import main as data_main
from megapar.cli.eval import main as evaluate
from megapar.cli.train import main
from megapar.data import IndexedDataset, SFTDataset, asset_path, collate

TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "1",
        "--val-fraction", "0"]  # --loss-mean: its default on records, token
LINES = [x.strip() for x in Path(asset_path("shakespeare_sample.txt")).read_text().splitlines()
         if len(x.strip()) > 20]


def _records(path, n, keys=("prompt", "completion"), long=True):
    """`n` records of Shakespeare lines under `keys`; with `long`, the first has a prompt of
    more than 33 GPT-2 tokens (no response token left at --seq-len 32) and the second a
    response that runs past them (truncated)."""
    rows = [(LINES[2 * i], " " + LINES[2 * i + 1]) for i in range(n)]
    if long:
        rows[0] = (" ".join(LINES[100:104]), " " + LINES[104])
        rows[1] = (LINES[105], " " + " ".join(LINES[106:110]))
    path.write_text("".join(json.dumps(dict(zip(keys, row))) + "\n" for row in rows))
    return rows


def _losses(log):
    return [json.loads(x)["loss"] for x in Path(log).read_text().splitlines()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_first_step_loss_equals_transformers_forward_on_the_masked_batch(tmp_path, cache, capsys):
    """A transformers GPT-2 trained by megapar-train --from-hf --sft-keys prompt,completion on
    8 records, one global batch (its token mean is the same in any order): the first step's
    loss equals transformers' forward on the records tokenized by transformers' GPT-2
    tokenizer (prompt, completion, eos; cut to 33 tokens; right-padded; labels -100 on the
    prompt and the padding) with F.cross_entropy(ignore_index=-100) (fp32, 1e-5 relative)."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    torch.manual_seed(0)
    hf, bpe = tmp_path / "hf", tmp_path / "bpe"
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.save_pretrained(hf)
    bpe.mkdir()
    for name in ("vocab.json", "merges.txt"):  # megapar's GPT-2 BPE, under transformers' names
        shutil.copy(Path(asset_path(f"gpt2_{name}")), bpe / name)
    data, log = tmp_path / "pairs.jsonl", tmp_path / "log.jsonl"
    rows = _records(data, 8)
    assert main(["--from-hf", str(hf), "--tokenizer", "gpt2", "--data", str(data),
                 "--sft-keys", "prompt,completion", "--data-cache", cache, "--max-steps", "1",
                 "--log-json", str(log), *TINY]) == 0
    err = capsys.readouterr().err
    assert ("supervised fine-tuning: 8 records (prompt,completion), one right-padded sample "
            "each, the loss on the responses only; 2 longer than --seq-len + 1 = 33 tokens "
            "truncated at the end; 1 with no response token to learn (a prompt that fills the "
            "sample, or a record of no text); the loss the mean "
            "over the global batch's response tokens (--loss-mean token, TRL's and "
            "torchtune's)") in err, err

    tokenizer = GPT2TokenizerFast.from_pretrained(bpe)
    eos, ids, labels = tokenizer.eos_token_id, [], []
    for prompt, response in rows:
        p, r = tokenizer(prompt)["input_ids"], tokenizer(response)["input_ids"]
        tokens = (p + r + [eos])[:33]
        target = [-100] * len(p) + tokens[len(p):]
        ids.append(tokens[:-1] + [eos] * (33 - len(tokens)))
        labels.append((target[1:] + [-100] * 33)[:32])
    assert sum(t != -100 for t in labels[0]) == 0 and len(labels[1]) == 32
    with torch.no_grad():
        logits = GPT2LMHeadModel.from_pretrained(hf)(input_ids=torch.tensor(ids)).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor(labels).flatten(),
                                            ignore_index=-100).item()
    loss = _losses(log)[0]
    assert math.isclose(loss, ref, rel_tol=1e-5), (loss, ref)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """16 records tokenized by megapar-data --sft-keys prompt,response (a prepared dataset of
    records: megapar-train needs no flag), two of them longer than --seq-len + 1."""
    tmp = tmp_path_factory.mktemp("records")
    _records(tmp / "pairs.jsonl", 16, keys=("prompt", "response"))
    prefix = str(tmp / "sft")
    assert data_main(["--input", str(tmp / "pairs.jsonl"), "--sft-keys", "prompt,response",
                      "--output-prefix", prefix, "--no-progress"]) == 0
    return prefix


def test_a_prepared_dataset_of_records_keeps_the_prompt_out_of_the_labels(records):
    """The dataset megapar-data wrote: one sample per record, labels -100 up to the prompt's
    last token, then the response's tokens and the eod, then -100 on the padding."""
    ds = IndexedDataset(records)
    sample, n = SFTDataset(ds, 32)[2], int(ds.doc_offsets[3] - ds.doc_offsets[2])
    p = int(ds.prompt_lengths[2])
    doc = ds.doc(2)
    assert sample["input_ids"].tolist() == doc[:-1].tolist() + [ds.eod_id] * (33 - n)
    assert sample["labels"].tolist() == [-100] * (p - 1) + doc[p:].tolist() + [-100] * (33 - n)
    assert len(SFTDataset(ds, 32)) == 16 == ds.num_docs


def test_an_empty_record_counts_as_one_with_no_response_token(tmp_path):
    """An empty prompt and response under a tokenizer without BOS is its end-of-document token
    alone, which no position predicts. The log named such records only as "of them" among the
    truncated ones (where some were: one they were not part of) and not at all where none was,
    a new user's finding; the count is its own clause now."""
    from types import SimpleNamespace

    from megapar.data import IndexedDataset, IndexedDatasetBuilder, SFTDataset
    from megapar.training.data import _records_note

    prefix = str(tmp_path / "recs")
    with IndexedDatasetBuilder(prefix, 101, 0, {"kind": "x"}, sft_keys=["p", "r"]) as b:
        for doc, prompt in (([5, 6, 7, 0], 1), ([0], 0), ([8, 9, 0], 0)):
            b.add_document(doc[:-1], prompt_length=prompt)  # the eod follows each
        b.finalize()
    ds = IndexedDataset(prefix)
    sft = SFTDataset(ds, 8)
    assert (sft.truncated, sft.unlabelled) == (0, 1)
    sample = sft[1]  # [eod] then padding: nothing to learn
    assert (sample["labels"] != -100).sum() == 0
    note = _records_note(SimpleNamespace(seq_len=8, loss_mean="token"), ds, [sft])
    assert "none longer than --seq-len + 1 = 9 tokens; 1 with no response token to learn" in note


def test_the_log_line_names_records_without_a_response_token_only_where_there_are(records):
    """At a --seq-len where the long prompt and one of its response tokens fit (the long
    response's record fits whole), the line says 1 truncated, without "(0 of them with no
    response token left)"; at 32 two are cut and one has none left."""
    from types import SimpleNamespace

    from megapar.training.data import _records_note

    ds = IndexedDataset(records)
    seq_len = int(ds.prompt_lengths[0])  # its prompt and one response token fit
    notes = []
    for n in (seq_len, 32):
        cfg = SimpleNamespace(seq_len=n, loss_mean="token")
        notes.append(_records_note(cfg, ds, [SFTDataset(ds, n), None]))
    mean = "; the loss the mean over the global batch's response tokens (--loss-mean token, "
    assert notes[0].endswith(f"1 longer than --seq-len + 1 = {seq_len + 1} tokens truncated at "
                             f"the end{mean}TRL's and torchtune's)"), notes
    # with a validation split, the counts are of every record, and the line says so (it read
    # as the training records'; a new user's tryout)
    cfg = SimpleNamespace(seq_len=32, loss_mean="token")
    half = ds.num_docs // 2
    split = _records_note(cfg, ds, [SFTDataset(ds, 32, (0, half)),
                                    SFTDataset(ds, 32, (half, ds.num_docs))])
    assert f"; of all {ds.num_docs}, 2 longer than --seq-len + 1 = 33 tokens truncated" in split
    assert notes[1].endswith("2 longer than --seq-len + 1 = 33 tokens truncated at the end; 1 "
                             "with no response token to learn (a prompt that fills the sample, "
                             "or a record of no text)"
                             f"{mean}TRL's and torchtune's)"), notes


def test_tp_pp_dp_equal_one_process_over_three_steps(tmp_path, records):
    """gpt2-tiny on the records: tp 2 x pp 2, dp 2 and cp 2 give one process's losses (and grad
    norms) at every one of 3 steps (fp32, 1e-5 relative)."""
    common = ["--model", "gpt2-tiny", "--data", records, "--max-steps", "3", *TINY]
    runs = {}
    for name, layout in (("serial", []), ("tp2pp2", ["--tp", "2", "--pp", "2"]),
                         ("dp2", ["--dp", "2"]), ("cp2", ["--cp", "2"])):
        log = tmp_path / f"{name}.jsonl"
        assert main([*common, *layout, "--log-json", str(log)]) == 0
        runs[name] = [(r["loss"], r["grad_norm"]) for r in map(json.loads,
                                                               log.read_text().splitlines())]
    assert len(runs["serial"]) == 3
    for name in ("tp2pp2", "dp2", "cp2"):
        for (a, ga), (b, gb) in zip(runs["serial"], runs[name]):
            assert math.isclose(a, b, rel_tol=1e-5) and math.isclose(ga, gb, rel_tol=1e-5), \
                (name, runs)


def test_the_default_loss_is_the_global_token_mean_where_a_micro_batch_has_no_response(
        tmp_path, records):
    """Micro-batches of one record, so the record with no response token left at --seq-len 32
    (record 0; 16 records, 2 steps of 8: both steps see every record once) is a micro-batch
    with no labelled token: with no --loss-mean, pp 2 and dp 2 give at both steps the loss and
    grad norm of one process whose one micro-batch is the whole global batch, its mean over
    the batch's response tokens (fp32, 1e-5 relative); --loss-mean microbatch (given) at dp 2
    misses it by more than 1 % at the step holding record 0 (its micro-batch counts as a loss
    of 0: 9.50 against 10.86)."""
    assert int((SFTDataset(IndexedDataset(records), 32)[0]["labels"] != -100).sum()) == 0
    common = ["--model", "gpt2-tiny", "--data", records, "--max-steps", "2", *TINY,
              "--global-batch-size", "8"]
    runs = {}
    for name, extra in (("whole", ["--micro-batch-size", "8"]),
                        ("pp2", ["--micro-batch-size", "1", "--pp", "2"]),
                        ("dp2", ["--micro-batch-size", "1", "--dp", "2"]),
                        ("dp2-micro", ["--micro-batch-size", "1", "--dp", "2",
                                       "--loss-mean", "microbatch"])):
        log = tmp_path / f"{name}.jsonl"
        assert main([*common, *extra, "--log-json", str(log)]) == 0
        runs[name] = [(r["loss"], r["grad_norm"]) for r in map(json.loads,
                                                               log.read_text().splitlines())]
    assert len(runs["whole"]) == 2
    for name in ("pp2", "dp2"):
        for (a, ga), (b, gb) in zip(runs["whole"], runs[name]):
            assert math.isclose(a, b, rel_tol=1e-5) and math.isclose(ga, gb, rel_tol=1e-5), \
                (name, runs)
    # at the step that holds record 0 (the other step's micro-batch means differ less)
    assert max(abs(b / a - 1) for (a, _), (b, _) in zip(runs["whole"],
                                                        runs["dp2-micro"])) > 1e-2, runs


def test_resume_continues_the_losses_and_validates(tmp_path, records, capsys):
    """4 steps with validation every 2 steps, and the same stopped after 2 steps and resumed:
    the same losses and validation losses (the sampler's position is in the checkpoint); then
    megapar-eval of the checkpoint on the records."""
    common = ["--model", "gpt2-tiny", "--data", records, "--max-steps", "4", *TINY,
              "--val-fraction", "0.25", "--eval-interval", "2", "--eval-steps", "1"]
    full, part, ckpt = tmp_path / "full.jsonl", tmp_path / "part.jsonl", tmp_path / "ckpt"
    assert main([*common, "--log-json", str(full)]) == 0
    assert main([*common, "--exit-interval", "2", "--save", str(ckpt), "--log-json",
                 str(part)]) == 0
    assert main([*common, "--load", str(ckpt), "--save", str(ckpt), "--log-json",
                 str(part)]) == 0
    a = [json.loads(x) for x in full.read_text().splitlines()]
    b = [json.loads(x) for x in part.read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r.get("val_loss") for r in a][1::2] == [r.get("val_loss") for r in b][1::2]
    assert a[1].get("val_loss") is not None
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5), (a, b)

    # megapar-eval on the dataset of records: its samples, the loss on the responses only,
    # equal to transformers' forward of the exported model on them (fp32, 1e-5 relative)
    from transformers import GPT2LMHeadModel

    assert convert([str(ckpt), "--to-hf", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert evaluate(["--load", str(ckpt), "--data", records, "--seq-len", "32",
                     "--micro-batch-size", "16", "--max-batches", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    batch = collate([s for s in SFTDataset(IndexedDataset(records), 32)])
    with torch.no_grad():
        logits = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")(batch["input_ids"]).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                            ignore_index=-100).item()
    assert report["tokens"] == int((batch["labels"] != -100).sum()) < 16 * 32
    assert math.isclose(report["loss"], ref, rel_tol=1e-5), (report, ref)


@pytest.mark.parametrize("argv, message", [
    (["--sft-keys", "prompt"], "--sft-keys 'prompt' is not two different field names "
     "PROMPT,RESPONSE; pass e.g. --sft-keys prompt,response"),
    (["--sft-keys", "prompt,response", "--data", "0.5", "{prefix}", "0.5", "{prefix}"],
     "reads one --data of records, not a blend"),
    (["--sft-keys", "prompt,response", "--data", "{prefix}"],
     "is a dataset megapar-data --sft-keys wrote, which trains on its responses as it is; "
     "drop --sft-keys"),
    (["--sft-keys", "prompt,response", "--data", "{text}"],
     "is not .jsonl / .json; convert it to one"),
    (["--sft-keys", "prompt,response", "--data", "{bad}"],
     "bad.jsonl:2: the record has no field 'response' (its fields: 'prompt', 'answer'); add "
     "it, or pass --sft-keys naming the prompt and response fields"),
    (["--sft-keys", "prompt,response", "--data", "{good}", "--jsonl-key", "prompt"],
     "--jsonl-key prompt would be ignored: --sft-keys prompt,response names the fields read"),
    (["--sft-keys", "prompt,response", "--data", "{good}", "--model", "bert-tiny"],
     "trains a causal language model on the responses, and the model is bert"),
    (["--sft-keys", "prompt,response", "--data", "{good}", "--from-hf", "{bert}"],
     "trains a causal language model on the responses, and the model is bert"),
    (["--sft-keys", "prompt,response", "--data", "{good}", "--model", "{bert}/config.json"],
     "trains a causal language model on the responses, and the model is bert"),
    (["--sft-keys", "prompt,response", "--data", "{array}"],
     "array.json is one JSON array; write one object per line (e.g. jq -c '.[]'"),
    (["--sft-keys", "prompt,response", "--data", "{longp}", "--seq-len", "2",
      "--global-batch-size", "2", "--micro-batch-size", "1", "--val-fraction", "0", "--model",
      "gpt2-tiny"],
     "every one of the 2 training records of --data {longp} has a prompt of at least --seq-len "
     "+ 1 = 3 tokens: no response token is left to train on (the loss would be 0); raise "
     "--seq-len to at least 3 (the shortest prompt) or shorten the prompts"),
    (["--sft-keys", "prompt,response", "--data", "{good}", "--global-batch-size", "2",
      "--micro-batch-size", "1", "--val-fraction", "0", "--model", "gpt2-tiny"],
     "fewer than one global batch of 2; use more records or a smaller --global-batch-size"),
    (["--data", "{good}", "--model", "gpt2-tiny"],  # records, --sft-keys forgotten
     "the object has no field 'text' (its fields: 'prompt', 'response'); pass --jsonl-key "
     "naming the text field, or add 'text' to the line; or, for prompt / response records, "
     "--sft-keys prompt,response to read them as records (the loss on the responses only)"),
    (["--data", "0.5", "{prefix}", "0.5", "{text}", "--model", "gpt2-tiny"],
     "blends prompt / response records"),
])
def test_bad_input_is_refused_in_one_line_before_any_worker(argv, message, tmp_path, records,
                                                             cache, capsys):
    text = tmp_path / "plain.txt"
    text.write_text("\n\n".join(LINES[:200]))
    bad, good = tmp_path / "bad.jsonl", tmp_path / "good.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "answer": "d"}\n')
    good.write_text('{"prompt": "a", "response": "b"}\n')
    longp = tmp_path / "longp.jsonl"  # prompts of 3 and 4 GPT-2 tokens
    longp.write_text('{"prompt": "a b c", "response": "d"}\n'
                     '{"prompt": "a b c d", "response": ""}\n')
    (tmp_path / "array.json").write_text('[\n{"prompt": "a", "response": "b"}\n]\n')
    if any("{bert}" in a for a in argv):  # a transformers BERT of GPT-2's 50,257 ids
        from transformers import BertConfig, BertForMaskedLM

        BertForMaskedLM(BertConfig(vocab_size=50257, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32)
                        ).save_pretrained(tmp_path / "bert")
        capsys.readouterr()  # transformers' progress bar
    paths = {"prefix": records, "text": str(text), "bad": str(bad), "good": str(good),
             "array": str(tmp_path / "array.json"), "bert": str(tmp_path / "bert"),
             "longp": str(longp)}
    argv, message = [a.format(**paths) for a in argv], message.format(**paths)
    assert main([*argv, "--data-cache", cache, "--max-steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("megapar-train: error:"), err


def test_megapar_data_refuses_a_record_without_a_key_and_non_jsonl(tmp_path, capsys):
    bad, text = tmp_path / "bad.jsonl", tmp_path / "plain.txt"
    bad.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c"}\n')
    text.write_text("some text\n")
    out = str(tmp_path / "out")
    assert data_main(["--input", str(bad), "--sft-keys", "prompt,completion",
                      "--output-prefix", out, "--no-progress"]) == 2
    assert data_main(["--input", str(text), "--sft-keys", "prompt,completion",
                      "--output-prefix", out, "--no-progress"]) == 2
    assert data_main(["--input", str(bad), "--sft-keys", "prompt,completion", "--split-lines",
                      "--output-prefix", out, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "bad.jsonl:3: the record has no field 'completion'" in err[0], err
    assert "plain.txt is not .jsonl / .json" in err[1], err
    assert err[2].startswith("megapar-data: error: --split-lines cannot be combined"), err
    assert not any(Path(out + ext).exists() for ext in (".bin", ".idx", ".json"))


def test_megapar_eval_reads_raw_records_as_the_checkpoint_trained_on_them(tmp_path, records,
                                                                          cache, capsys):
    """megapar-eval of a checkpoint trained with --sft-keys on raw records: the raw .jsonl is
    read as those records (a note says so; --sft-keys given says the same), with the loss of
    the dataset megapar-data --sft-keys made of it; --jsonl-key reads a field's text instead;
    --sft-keys with a prepared dataset or beside --jsonl-key is refused in one line."""
    raw, ckpt = str(Path(records).parent / "pairs.jsonl"), str(tmp_path / "ckpt")
    assert main(["--model", "gpt2-tiny", "--data", raw, "--sft-keys", "prompt,response",
                 "--data-cache", cache, "--max-steps", "1", "--save", ckpt, *TINY]) == 0
    capsys.readouterr()
    common = ["--load", ckpt, "--seq-len", "32", "--micro-batch-size", "4", "--max-batches", "2",
              "--data-cache", cache]
    reports, notes = [], []
    for data in (["--data", records], ["--data", raw],
                 ["--data", raw, "--sft-keys", "prompt,response"],
                 ["--data", raw, "--jsonl-key", "prompt"]):
        argv = [*common, *data] if data[1] == raw else [*common[:-2], *data]
        assert evaluate(argv) == 0
        out = capsys.readouterr()
        reports.append(json.loads(out.out.strip().splitlines()[-1]))
        notes.append(out.err)
    assert reports[1] == reports[2] == reports[0], reports
    assert reports[3]["tokens"] == reports[3]["batches"] * 4 * 32, reports  # text windows
    assert "is read as prompt / response records (--sft-keys prompt,response, as --load" in notes[1]
    assert "--sft-keys" not in notes[2] + notes[3], notes
    # ... and of one trained on the dataset megapar-data made of them (it asked for --sft-keys;
    # a new user's tryout)
    prepared = str(tmp_path / "prepared")
    assert main(["--model", "gpt2-tiny", "--data", records, "--max-steps", "1", "--save",
                 prepared, *TINY]) == 0
    capsys.readouterr()
    assert evaluate(["--load", prepared, *common[2:], "--data", raw]) == 0
    out = capsys.readouterr()
    assert "is read as prompt / response records (--sft-keys prompt,response, as --load" in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["tokens"] == reports[0]["tokens"]
    # whole batches: 15 of the 16 records at --micro-batch-size 5, said with a size that
    # scores all; nothing said where --max-batches asks for fewer
    whole = ["--load", ckpt, "--seq-len", "32", "--micro-batch-size", "5", "--data", records]
    assert evaluate(whole) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["batches"] == 3
    assert ("scores 15 of the 16 records of --data" in out.err and "(3 batches of "
            "--micro-batch-size 5); the last 1 is left out, as only whole batches are scored: "
            "--micro-batch-size 4 scores every one") in out.err, out.err
    assert evaluate([*whole, "--max-batches", "2"]) == 0
    assert "left out" not in capsys.readouterr().err
    # records scored that keep no response token are said (they add nothing to the loss: its
    # "tokens" fell with no word; a re-test), as megapar-train's line counts them
    assert evaluate(["--load", ckpt, "--seq-len", "5", "--micro-batch-size", "4", "--data",
                     records]) == 0
    said = re.search(r"megapar-eval: (\d+) of the 16 records scored keeps? no response token "
                     r"at --seq-len 5 \(a prompt that fills the sample, or a record of no text\): "
                     r"they add nothing to the loss", capsys.readouterr().err)
    assert said and 0 < int(said[1]) < 16, said
    for argv, message in (
        (["--data", records, "--sft-keys", "prompt,response"],
         "--sft-keys prompt,response applies to raw JSON Lines records, and --data "
         f"{records} is a prepared dataset of records (made with --sft-keys prompt,response) "
         "that already holds their prompt lengths"),
        (["--data", raw, "--seq-len", "1", "--micro-batch-size", "4", "--data-cache", cache],
         # the shortest prompt, twice (it said "every prompt is at least" --seq-len + 1, a
         # bound, beside the shortest prompt's length; a re-test)
         "none of the 16 records evaluated keeps a response token at --seq-len 1 (the shortest "
         "prompt is 5 tokens), so there is no loss to report; raise --seq-len to at least 5"),
        (["--data", raw, "--micro-batch-size", "32", "--data-cache", cache],
         "has 16 records (samples) of up to 33 tokens, fewer than one batch of "
         "--micro-batch-size 32; lower --micro-batch-size or give more records"),
        (["--data", raw, "--sft-keys", "prompt,response", "--jsonl-key", "prompt"],
         "--jsonl-key prompt would be ignored: --sft-keys prompt,response names the fields"),
    ):
        assert evaluate(["--load", ckpt, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    # resuming on the same records with the keys swapped: refused as that, not as changed data
    assert main(["--model", "gpt2-tiny", "--data", raw, "--sft-keys", "response,prompt",
                 "--data-cache", cache, "--max-steps", "2", "--load", ckpt, *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (
        f"trained on the records of --data {raw} with --sft-keys prompt,response, and "
        f"--sft-keys response,prompt reads them otherwise; leave --sft-keys out (the "
        f"checkpoint's), or pass --allow-data-change") in err[0], err


def test_the_records_line_says_how_many_are_held_out_for_validation():
    """With a validation split the log's count of records was all of them, the held-out ones
    included (a new user's finding): it says how many of them train."""
    from types import SimpleNamespace

    from megapar.training.config import TrainConfig
    from megapar.training.data import _records_note

    class Part(SimpleNamespace):
        def __len__(self):
            return self.n

    indexed = SimpleNamespace(num_docs=40, sft_keys=("prompt", "completion"))
    train = Part(n=24, truncated=0, unlabelled=0)
    val = Part(n=16, truncated=0, unlabelled=0)
    cfg = TrainConfig(seq_len=32)
    assert _records_note(cfg, indexed, [train, val]).startswith(
        "supervised fine-tuning: 40 records (prompt,completion), 24 to train on and 16 held out "
        "for validation, one right-padded sample each")
    assert _records_note(cfg, indexed, [train, None]).startswith(
        "supervised fine-tuning: 40 records (prompt,completion), one right-padded sample each")
