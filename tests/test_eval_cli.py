"""megapar-eval end to end, checked against transformers.

* logits: a transformers model -> `megapar-convert --from-hf` (tp=2 x pp=2) -> `megapar-eval
  --input-ids --save-logits`, at 2x2 and resharded on load to 1x1, equal transformers' logits;
* loss: `megapar-eval --data` on a checkpoint trained by megapar-train equals the loss computed
  here with transformers on the weights exported by `megapar-convert --to-hf`, over windows cut
  from the token stream read straight from the dataset's .bin file;
* clear errors.

The CLIs are called in-process (`main(argv)`); their workers are forked from this process.
"""

import json
import math
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import exit_code, fork_running

from megapar.cli.convert import main as convert
from megapar.cli.data import main as data_main
from megapar.cli.eval import main as evaluate
from megapar.cli.train import main as train
from megapar.data import IndexedDataset, asset_path

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB = 1004  # the shipped sentencepiece model's 1000 pieces + 4 appended special tokens


def _rel(a, b) -> float:
    """max |a - b| / max |b| (relative error of a whole tensor)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max())


DENSE = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True,
                                             use_sliding_window=True, sliding_window=8,
                                             layer_types=["sliding_attention",
                                                          "full_attention"] * 2)),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=8,
                                             max_window_layers=2)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=8)),
}
"""The dense families of Llama's layout, as their transformers configs build them, with
sliding windows of 8: Qwen3's on the layers its layer_types names, Qwen2's on its last two
(max_window_layers), Mistral's on every layer."""


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=2, eos_token_id=2)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64,
                                       bos_token_id=2, eos_token_id=2)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind in DENSE:  # Qwen3 (tied, head_dim 16 of hidden 32 / 4 heads), Qwen2, Mistral
        cls, extra = DENSE[kind]
        cfg = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=2, eos_token_id=2, **extra)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    else:
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(cfg)
    with torch.no_grad():  # non-trivial biases and norms, so a mis-mapped one shows up
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name.lower() or "norm" in name.lower():
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama", *DENSE])
def test_hf_logits_round_trip_through_convert_and_eval(tmp_path, kind, capsys, corpus,
                                                       monkeypatch):
    model = _hf_model(kind)
    if kind == "bert":  # the input token's embedding dominates the hidden states (the
        # head's transform the identity), so where the masking kept a token (BERT's 10 %) it is
        # predicted: the MLM accuracy below is neither 0 nor 1 (3 of 25)
        with torch.no_grad():
            model.bert.embeddings.word_embeddings.weight.mul_(20.0)
            dense = model.cls.predictions.transform.dense
            dense.weight.copy_(torch.eye(dense.weight.shape[0]))
            dense.bias.zero_()
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    model.save_pretrained(hf_dir)
    assert convert(["--from-hf", str(hf_dir), str(ckpt), "--tp", "2", "--pp", "2",
                    "--no-progress"]) == 0
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(3, 24), dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits.float()
    assert expected.shape == (3, 24, VOCAB)

    measured = []
    # the checkpoint's own layout, then resharded on load; and each sequence split over two
    # cp ranks (ring attention; Llama's and Mistral's all-gathered keys and values, Mistral's
    # window of 8 over the cp ranks' chunks of 6), at pp 2
    cp_too = ("gpt2", "bert", "llama", "mistral")
    layouts = [(2, 2, 1), (1, 1, 1)] + ([(1, 2, 2)] if kind in cp_too else [])
    for tp, pp, cp in layouts:
        out = tmp_path / f"logits_{tp}x{pp}x{cp}.npy"
        capsys.readouterr()
        assert evaluate(["--load", str(ckpt), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp),
                         "--input-ids", str(tmp_path / "ids.npy"),
                         "--save-logits", str(out)]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report == {"saved": str(out), "shape": [3, 24, VOCAB]}
        logits = np.load(out)
        assert logits.dtype == np.float32 and logits.shape == (3, 24, VOCAB)  # no vocab padding
        err = _rel(logits, expected)
        measured.append(f"{kind} logits at tp={tp} pp={pp} cp={cp}: max relative error "
                        f"{err:.3g}")
        assert err < TOL, (kind, tp, pp, cp, err)
    print("\n".join(measured))  # shown with -s
    if kind == "bert":
        _bert_masks_and_token_types(model, ckpt, tmp_path, capsys)  # raw text, tokenized into --data-cache: the same MLM samples and loss
        # as the prefix megapar-data made of it (an imported checkpoint records no tokenizer:
        # --tokenizer names it)
        text, cache = str(corpus[2] / "sample.txt"), ["--data-cache", str(tmp_path / "cache")]
        args = ["--load", str(ckpt), "--seq-len", "32", "--max-batches", "2"]
        reports, errs = [], []
        # (and the prefix at cp 2 x pp 2: each sample over two cp ranks)
        for data in ([corpus[0]], [text, "--tokenizer", "sentencepiece", *cache],
                     [corpus[0], "--cp", "2", "--pp", "2"]):
            capsys.readouterr()
            assert evaluate([*args, "--data", *data]) == 0, capsys.readouterr().err
            said = capsys.readouterr()
            reports.append(json.loads(said.out.strip().splitlines()[-1]))
            errs.append(said.err)
        assert reports[1] == reports[0] and reports[0]["batches"] == 2, reports
        # the raw text's paragraphs are its documents, which megapar-eval now says (a held-out
        # play scored 6.76 raw, 6.36 as megapar-data's one document: unexplained)
        paragraphs = len(IndexedDataset(corpus[0]))
        assert (f"megapar-eval: --data {text}: read as {paragraphs:,} documents, one per "
                f"blank-line paragraph") in errs[1], errs[1]
        assert "blank-line paragraph" not in errs[0] + errs[2]
        nll, tokens, correct = _mlm_loss_sum(model, corpus[0], seq=32, batch=4, batches=2)
        # the loss is the mean over every masked token of the batches (each batch masks its
        # own number of them), as transformers' model gives it on the same samples; the
        # accuracy the share of them whose top-1 logit is the original token (run_mlm's)
        assert reports[0]["tokens"] == tokens
        assert abs(reports[0]["loss"] - nll / tokens) / (nll / tokens) < TOL, (reports, nll)
        assert reports[0]["accuracy"] == correct / tokens and 0 < correct < tokens, reports
        # cp 2 x pp 2: the same tokens and accuracy, the loss and perplexity within 1e-5 (fp32)
        cp2 = reports[2]
        assert (cp2["tokens"], cp2["accuracy"]) == (tokens, reports[0]["accuracy"]), reports
        for key in ("loss", "perplexity"):
            assert abs(cp2[key] / reports[0][key] - 1) < TOL, reports
        # BERT's MLM samples too few, or too short; text without a tokenizer, or one whose
        # ids the model does not have: one line before any worker
        _refuse_workers(monkeypatch)  # (both were a worker's ValueError, exit 1, a traceback)
        assert evaluate([*args, "--data", text, *cache]) == 2
        assert (f"--data {text} is raw text, and --load {ckpt} records no tokenizer to "
                f"tokenize it with") in _one_error_line(capsys)
        assert evaluate([*args, "--data", text, "--tokenizer", "gpt2", *cache]) == 2
        assert (f"--data {text} tokenized with --tokenizer gpt2 holds token id 50256, outside "
                f"the model's vocabulary of {VOCAB} ids") in _one_error_line(capsys)
        data = ["--load", str(ckpt), "--data", corpus[0]]
        assert evaluate([*data, "--seq-len", "4"]) == 2
        assert "--seq-len 4 is too short for a BERT model's samples: [CLS] A [SEP] B [SEP] " \
               "takes at least 5 tokens; raise --seq-len" in _one_error_line(capsys)
        assert evaluate([*data, "--seq-len", "64", "--micro-batch-size", "100000"]) == 2
        assert "MLM samples of 64 tokens, fewer than one batch" in _one_error_line(capsys)
        # a refused text leaves no copy in --data-cache (the gpt2 one above was left there,
        # and a text too small to evaluate), as megapar-train's; an earlier run's copy is kept
        kept = sorted(p.name for p in (tmp_path / "cache").iterdir())
        assert len(kept) == 3 and all(n.startswith("sample-") for n in kept), kept
        assert evaluate([*args, "--data", text, "--tokenizer", "sentencepiece", *cache,
                         "--micro-batch-size", "100000"]) == 2
        assert "fewer than one batch" in _one_error_line(capsys)
        tiny = tmp_path / "tiny.txt"
        tiny.write_text("Shall I compare thee to a summer's day?\n")
        assert evaluate([*args, "--data", str(tiny), "--tokenizer", "sentencepiece",
                         *cache]) == 2
        assert f"--data {tiny} has 1 MLM sample of" in _one_error_line(capsys)
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == kept


def _bert_masks_and_token_types(model, ckpt, tmp_path, capsys):
    """--input-ids with --attention-mask (rows padded to 24, 17 and 9 tokens) and
    --token-type-ids (sentence B from the middle of each row): the logits of every position
    equal transformers' BertForMaskedLM(input_ids, attention_mask, token_type_ids) at pp 2 x
    cp 2 (the mask on both stages, cut to each cp rank's keys), fp32 < 1e-5; without the mask
    and types they are other logits (so both are read)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(5, VOCAB, size=(3, 24), dtype=np.int64)
    mask = np.zeros((3, 24), dtype=np.int64)
    types = np.zeros((3, 24), dtype=np.int64)
    for row, n in enumerate((24, 17, 9)):
        mask[row, :n] = 1
        types[row, n // 2:n] = 1
        ids[row, n:] = 0  # [PAD]
    files = {name: tmp_path / f"{name}.npy" for name in ("ids", "mask", "types")}
    for name, values in (("ids", ids), ("mask", mask), ("types", types)):
        np.save(files[name], values)
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         token_type_ids=torch.from_numpy(types)).logits.float()
        plain = model(input_ids=torch.from_numpy(ids)).logits.float()
    assert _rel(plain, expected) > 1e-2
    for tp, pp, cp in [(1, 2, 2)]:  # the mask on every stage, cut to each cp rank's keys
        out = tmp_path / f"masked_{tp}x{pp}x{cp}.npy"
        capsys.readouterr()
        assert evaluate(["--load", str(ckpt), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp),
                         "--input-ids", str(files["ids"]), "--attention-mask",
                         str(files["mask"]), "--token-type-ids", str(files["types"]),
                         "--save-logits", str(out)]) == 0, capsys.readouterr().err
        err = _rel(np.load(out), expected)
        assert err < TOL, (tp, pp, cp, err)


def _mlm_loss_sum(model, prefix: str, seq: int, batch: int,
                  batches: int) -> tuple[float, int, int]:
    """transformers' BERT on megapar-eval's first `batches` batches of MLM samples of `prefix`
    (its default --seed): (the loss summed over their masked tokens, how many there are, how
    many of them the top-1 logit predicts: transformers' run_mlm's accuracy's numerator), with
    the batches' masked-token counts checked to differ (else pooling equals averaging) and
    every masked position's top two logits more than 1e-4 apart (so the top-1 is no tie that
    float noise could flip)."""
    from megapar.data import IndexedDataset, MLMDataset, collate, load_tokenizer

    indexed = IndexedDataset(prefix)
    dataset = MLMDataset(indexed, seq, load_tokenizer(indexed.tokenizer_spec), 1234)
    nll, counts, correct = 0.0, [], 0
    for i in range(batches):
        samples = collate([dataset[j] for j in range(i * batch, (i + 1) * batch)])
        labels = samples.pop("labels")
        with torch.no_grad():
            logits = model(**samples).logits.double()
        nll += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"))
        counts.append(int((labels != -100).sum()))
        masked = labels != -100
        top2 = logits[masked].topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
        correct += int((logits.argmax(-1)[masked] == labels[masked]).sum())  # run_mlm's metric
    assert len(set(counts)) > 1, counts
    return nll, sum(counts), correct


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small real-text dataset made with megapar-data (sentencepiece, a document per
    paragraph) and the token stream read straight from its .bin file."""
    root = tmp_path_factory.mktemp("corpus")
    text = root / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    prefix = str(root / "shakespeare")
    assert data_main(["--input", str(text), "--output-prefix", prefix, "--tokenizer",
                      "sentencepiece", "--split-lines", "--no-progress"]) == 0
    meta = json.loads(Path(prefix + ".json").read_text())
    stream = np.fromfile(prefix + ".bin", dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
    assert len(stream) == meta["num_tokens"] and meta["vocab_size"] == VOCAB
    # the stream is what sentencepiece makes of the text: the first paragraph, then eod
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(
        model_file=asset_path("botchan_en_unigram_1000.model"))
    first = sp.encode(text.read_text().split("\n\n")[0].strip())
    assert stream[:len(first)].tolist() == first and stream[len(first)] == meta["eod_id"]
    return prefix, stream.astype(np.int64), root


def test_eval_loss_on_a_dataset_equals_transformers(tmp_path, corpus, capsys):
    from conftest import skip_unless_transformers_converts

    skip_unless_transformers_converts()  # --to-hf exports the SentencePiece tokenizer too
    prefix, stream, root = corpus
    model_json = tmp_path / "gpt2.json"
    model_json.write_text(json.dumps({
        "model_type": "gpt2", "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
    ckpt = tmp_path / "ckpt"
    assert train(["--tp", "2", "--pp", "2", "--model", str(model_json), "--data", prefix,
                  "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                  "--max-steps", "12", "--lr", "1e-2", "--warmup-steps", "1",
                  "--eval-interval", "0", "--no-progress", "--save", str(ckpt)]) == 0

    # the reference: transformers on the exported weights, windows of seq_len + 1 tokens
    # starting at token 0, consecutive windows sharing one boundary token
    hf_dir = tmp_path / "hf"
    assert convert([str(ckpt), "--to-hf", str(hf_dir)]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    seq, batch, k = 32, 4, 3
    n = k * batch
    assert len(stream) > n * seq + 1

    def loss_of(start, stride):
        windows = torch.from_numpy(np.stack([stream[start + i * stride:][:seq + 1]
                                             for i in range(n)]))
        with torch.no_grad():
            logits = hf(windows[:, :-1]).logits.double()
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       windows[:, 1:].reshape(-1)))

    expected = loss_of(0, seq)
    assert 3.0 < expected < math.log(VOCAB)  # a real, partly trained loss
    # the tolerance tells the window convention apart from its near misses (windows shifted
    # by one token; windows that do not share their boundary token)
    for start, stride in [(1, seq), (0, seq + 1)]:
        assert abs(loss_of(start, stride) - expected) / expected > 3 * TOL, (start, stride)

    measured, by_cp = [], {}
    for tp, pp, cp in [(2, 2, 1), (1, 2, 1), (1, 2, 2)]:  # cp 2: each window over two ranks
        capsys.readouterr()
        assert evaluate(["--load", str(ckpt), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp),
                         "--data", prefix, "--seq-len", str(seq), "--micro-batch-size",
                         str(batch), "--max-batches", str(k)]) == 0
        report = by_cp[cp] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        err = abs(report["loss"] - expected) / expected
        measured.append(f"eval loss at tp={tp} pp={pp} cp={cp}: {report['loss']:.6f} vs "
                        f"transformers {expected:.6f}, relative error {err:.3g}")
        assert err < TOL, (tp, pp, cp, report, expected)
        assert report["perplexity"] == pytest.approx(math.exp(report["loss"]), rel=1e-12)
        assert report["tokens"] == k * batch * seq
        assert report["batches"] == k
    for key in ("loss", "perplexity"):  # cp 2 against cp 1 at pp 2
        assert abs(by_cp[2][key] / by_cp[1][key] - 1) < TOL, by_cp
    print("\n".join(measured))  # shown with -s
    report = by_cp[1]

    # the text the prefix was made from, tokenized into --data-cache with the tokenizer the
    # checkpoint records: the same windows, the same loss at the same layout
    capsys.readouterr()
    assert evaluate(["--load", str(ckpt), "--tp", "1", "--pp", "2", "--data",
                     str(root / "sample.txt"), "--data-cache", str(tmp_path / "cache"),
                     "--seq-len", str(seq), "--micro-batch-size", str(batch),
                     "--max-batches", str(k)]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report

    # Under torchrun each process prints what its rank returns: only rank 0 returns the report
    from megapar.cli.eval import _loss_worker, build_parser
    from megapar.launcher import run_local

    args = build_parser().parse_args(["--load", str(ckpt), "--tp", "2", "--data", prefix,
                                      "--seq-len", str(seq), "--micro-batch-size", str(batch),
                                      "--max-batches", "1"])
    first, second = run_local(_loss_worker, 2, args)
    assert first["batches"] == 1 and second is None


def test_eval_without_data_or_input_ids_exits_2(tmp_path, capsys):
    assert evaluate(["--load", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "give --data PREFIX|TEXT [--seq-len N], or --input-ids IDS.npy" in err


def test_eval_of_a_missing_checkpoint_names_the_path(tmp_path, capsys):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.zeros((1, 4), dtype=np.int64))
    missing = tmp_path / "no_such_checkpoint"
    rc = evaluate(["--load", str(missing), "--input-ids", str(ids),
                   "--save-logits", str(tmp_path / "out.npy")])
    assert rc == 2  # reported before any worker starts, not as a worker's traceback
    err = capsys.readouterr().err
    assert err.startswith("megapar-eval: error:") and "Traceback" not in err
    assert f"{missing}: no such checkpoint directory" in err
    assert not (tmp_path / "out.npy").exists()


def test_layout_the_model_cannot_take_is_refused_before_workers(tmp_path, capsys):
    """A tp that does not divide the heads: exit 2, one clear message, no worker traceback."""
    import transformers

    hf = tmp_path / "hf"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)).save_pretrained(hf)
    assert convert(["--from-hf", str(hf), str(tmp_path / "ckpt"), "--tp", "1",
                             "--pp", "1"]) == 0
    np.save(tmp_path / "ids.npy", np.zeros((1, 4), dtype=np.int64))
    capsys.readouterr()
    rc = evaluate(["--load", str(tmp_path / "ckpt"), "--tp", "3", "--input-ids",
                        str(tmp_path / "ids.npy"), "--save-logits", str(tmp_path / "out.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and "4 attention heads are not divisible by --tp 3" in err
    assert "Traceback" not in err and not (tmp_path / "out.npy").exists()


# --save-logits: checked before any worker, the real file name reported ------------------------
@pytest.fixture
def tiny_ckpt(tmp_path):
    """A 1x1 checkpoint of a tiny GPT-2 (vocab 101) and a [2, 8] ids file."""
    from test_checkpoint_helpers import save_serial

    save_serial(tmp_path / "ckpt")
    np.save(tmp_path / "ids.npy", np.arange(16, dtype=np.int64).reshape(2, 8))
    return tmp_path / "ckpt", tmp_path / "ids.npy"


def _refuse_workers(monkeypatch):
    import megapar.launcher

    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started for a bad --save-logits")

    monkeypatch.setattr(megapar.launcher, "run_workers", refuse)
    monkeypatch.setattr("megapar.cli.worker_exit.run_workers", refuse)  # its own reference too


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megapar-eval: error: "), err
    return lines[0]


def test_more_ranks_than_the_machine_runs_well_are_refused_as_megapar_train_refuses_them(
        tmp_path, capsys, monkeypatch):
    """megapar-eval --tp 4 --pp 4 forked 16 ranks on 2 cores where megapar-train refuses more
    than `local_worker_limit`: the same check and line now, before the checkpoint is read,
    and --oversubscribe starts them anyway."""
    from megapar.launcher import local_worker_limit

    _refuse_workers(monkeypatch)
    limit = local_worker_limit()
    ids = tmp_path / "ids.npy"
    np.save(ids, np.zeros((1, 4), dtype=np.int64))
    argv = ["--load", str(tmp_path / "no_such_checkpoint"), "--tp", "2", "--pp", str(limit),
            "--input-ids", str(ids), "--save-logits", str(tmp_path / "out.npy")]
    assert evaluate(argv) == 2
    assert _one_error_line(capsys) == (
        f"megapar-eval: error: --tp 2 x --pp {limit} starts {2 * limit} local worker "
        f"processes, more than this machine runs well ({limit}: 4 per CPU core, at least 8); "
        f"use fewer, run under torchrun / Slurm across machines, or pass --oversubscribe to "
        f"start them anyway")
    assert evaluate([*argv, "--oversubscribe"]) == 2  # past the check: the checkpoint's turn
    assert "no such checkpoint directory" in _one_error_line(capsys)


def test_a_pp_the_checkpoints_model_cannot_take_is_named_before_the_process_count(
        tiny_ckpt, tmp_path, capsys, monkeypatch):
    """--pp 9 of a 4-layer model said it started too many processes (--oversubscribe), where
    no --oversubscribe could make 9 stages of 4 layers."""
    from megapar.launcher import local_worker_limit

    _refuse_workers(monkeypatch)
    ckpt, ids = tiny_ckpt
    pp = local_worker_limit() + 1
    assert evaluate(["--load", str(ckpt), "--pp", str(pp), "--input-ids", str(ids),
                     "--save-logits", str(tmp_path / "out.npy")]) == 2
    assert _one_error_line(capsys) == (
        f"megapar-eval: error: 4 layers cannot be cut into --pp {pp} stages (each stage needs "
        f"at least one layer); lower --pp to 4 or less")  # a number (a re-test)


def test_unwritable_save_logits_is_refused_before_the_evaluation(tiny_ckpt, tmp_path, capsys,
                                                                  monkeypatch):
    # used to fail with exit 1 (rank 0's FileNotFoundError) after the evaluation
    _refuse_workers(monkeypatch)
    ckpt, ids = tiny_ckpt
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "sub" / "lg.npy"
    assert evaluate(["--load", str(ckpt), "--input-ids", str(ids), "--save-logits",
                     str(out)]) == 2
    line = _one_error_line(capsys)
    assert f"--save-logits {out} is not writable" in line and "choose a location" in line


def test_save_logits_naming_a_directory_is_refused(tiny_ckpt, tmp_path, capsys, monkeypatch):
    # used to print {"saved": "txt"} while numpy wrote txt.npy next to the directory
    _refuse_workers(monkeypatch)
    ckpt, ids = tiny_ckpt
    (tmp_path / "txt").mkdir()
    assert evaluate(["--load", str(ckpt), "--input-ids", str(ids), "--save-logits",
                     str(tmp_path / "txt")]) == 2
    assert f"--save-logits {tmp_path / 'txt'} is a directory" in _one_error_line(capsys)
    assert not (tmp_path / "txt.npy").exists()
    (tmp_path / "d.npy").mkdir()  # the name numpy would write is a directory
    assert evaluate(["--load", str(ckpt), "--input-ids", str(ids), "--save-logits",
                     str(tmp_path / "d")]) == 2
    assert "which is a directory" in _one_error_line(capsys)


def test_an_existing_save_logits_file_is_replaced_only_with_overwrite(tiny_ckpt, tmp_path,
                                                                      capsys):
    """A second run into the same --save-logits used to replace the first's logits silently,
    where megapar-data and megapar-convert ask for --overwrite: refused before any worker, the
    file untouched; --overwrite replaces it; --overwrite with --data (nothing written) refused."""
    ckpt, ids = tiny_ckpt
    out = tmp_path / "lg.npy"
    np.save(out, np.zeros(3, dtype=np.float32))
    argv = ["--load", str(ckpt), "--input-ids", str(ids), "--save-logits", str(tmp_path / "lg")]
    assert evaluate(argv) == 2
    assert _one_error_line(capsys) == (
        f"megapar-eval: error: --save-logits {tmp_path / 'lg'} would replace {out}, which "
        f"exists; pass --overwrite to replace it, or give another file name")
    assert np.load(out).shape == (3,)
    assert evaluate([*argv[:-1], str(out)]) == 2  # its own name: said once (it was said twice)
    assert _one_error_line(capsys) == (
        f"megapar-eval: error: --save-logits {out} exists; pass --overwrite to replace it, or "
        f"give another file name")
    assert evaluate([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    assert np.load(out).shape == (2, 8, 101)
    capsys.readouterr()
    assert evaluate(["--load", str(ckpt), "--data", "x", "--seq-len", "8", "--overwrite"]) == 2
    assert "--overwrite is used only with --save-logits" in _one_error_line(capsys)
    # the --input-ids file itself is never replaced (--overwrite wrote the logits over the ids)
    assert evaluate([*argv[:-1], str(ids), "--overwrite"]) == 2
    assert _one_error_line(capsys) == (
        f"megapar-eval: error: --save-logits {ids} is the --input-ids file; give another file "
        f"name")
    assert np.load(ids).ndim == 2


def test_save_logits_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    """The logits written beside the file and renamed over it made a private (0600) file
    world-readable (a re-test)."""
    import os

    import megapar.cli.eval as eval_cli

    out = tmp_path / "logits.npy"
    np.save(out, np.zeros(3, dtype=np.float32))
    os.chmod(out, 0o600)
    eval_cli.save_logits(str(out), np.ones((2, 3), dtype=np.float32))
    assert np.load(out).shape == (2, 3) and os.stat(out).st_mode & 0o777 == 0o600


def test_save_logits_on_a_full_disk_is_one_line_and_leaves_the_old_file(tmp_path,
                                                                         monkeypatch):
    """A full disk was "OSError: [Errno 28] No space left on device" and a log of no
    traceback (a re-test): the run's stop names the file and the fix; the older file stays."""
    import errno

    import megapar.cli.eval as eval_cli
    from megapar.faults.stop import RunStopped

    out = tmp_path / "logits.npy"
    np.save(out, np.zeros(3, dtype=np.float32))
    written = []

    class Full:
        def __init__(self, path, mode):
            written.append(path)
            open(path, mode).close()  # (the real file, which the run then removes)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eval_cli, "open", Full, raising=False)
    with pytest.raises(RunStopped) as info:
        eval_cli.save_logits(str(out), np.ones((2, 3), dtype=np.float32))
    assert str(info.value) == (
        f"--save-logits {out}: No space left on device while writing it; nothing was written "
        f"(free space there, or give another file name)")
    assert info.value.no_traceback and written
    assert np.load(out).shape == (3,) and sorted(p.name for p in tmp_path.iterdir()) == [
        "logits.npy"]


def test_save_logits_interrupted_mid_write_leaves_no_partial_file(tmp_path, monkeypatch):
    # a Ctrl-C inside np.save used to leave a cut-short logits.npy behind "nothing was written"
    import megapar.cli.eval as eval_cli

    out = tmp_path / "logits.npy"
    np.save(out, np.zeros(3, dtype=np.float32))  # an older file, kept until the new is whole

    import signal

    # a signal's handler runs between chunks (one np.save ran seconds in C, the signal waiting
    # on it, and a rank killed after its grace left an 800 MB temporary file; a new user's
    # tryout): a Ctrl-C 50 ms into the write of 8 MB in 4 KB chunks ends it, the file removed
    monkeypatch.setattr(eval_cli, "WRITE_CHUNK_BYTES", 4096)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(50):  # (a fast disk finishes one in less: the next one is cut)
                eval_cli.save_logits(str(out), np.ones((2048, 1024), dtype=np.float32))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]
    assert np.load(out).shape in ((3,), (2048, 1024))  # the older file, or a whole new one
    eval_cli.save_logits(str(out), np.ones((2, 3), dtype=np.float32))
    np.testing.assert_array_equal(np.load(out), np.ones((2, 3), dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]


def test_logits_that_would_not_fit_the_host_memory_are_refused_before_any_worker(
        tiny_ckpt, tmp_path, capsys, monkeypatch):
    """256 x 128 ids of gpt2's vocabulary at --tp 2 (6.6 GB of logits, about 12 GB a rank) ran
    46 s and ended "rank 1 was killed by SIGKILL (9)", the OOM killer's (a new user's tryout):
    refused in one line, before any worker, with the rows that fit."""
    import megapar.cli.eval as eval_cli

    _refuse_workers(monkeypatch)
    ckpt, ids = tiny_ckpt  # 2 x 8 ids of a 101-id vocabulary: 6,464 bytes of logits
    monkeypatch.setattr(eval_cli, "use_cuda", lambda: False)
    monkeypatch.setattr(eval_cli, "RANK_BASE_BYTES", 1000)  # each process's own
    out = tmp_path / "lg.npy"
    argv = ["--load", str(ckpt), "--input-ids", str(ids), "--save-logits", str(out)]
    # 2 x tp x cp = 4 copies of 6,464 bytes, 12,928 a row, beside 2 x 1,000 bytes of the
    # processes' own: none fits in 12 kB, one in 22 kB
    for free, fix in ((12_000, "give shorter sequences (or a smaller --tp x --cp)"),
                      (22_000, "give at most 1 row of ids at a time (or a smaller --tp x --cp)")):
        monkeypatch.setattr(eval_cli, "host_memory_available", lambda free=free: free)
        assert evaluate([*argv, "--tp", "2"]) == 2
        line = _one_error_line(capsys)
        assert line == (f"megapar-eval: error: --save-logits: the logits of --input-ids {ids} "
                        f"(2 x 8 tokens x 101 ids, fp32) are 0.0 GiB, and this run would hold "
                        f"about 0.0 GiB of them in host memory, more than the 0.0 GiB free "
                        f"less 2 x 0.0 GiB for the processes themselves: {fix}"), line
    assert not out.exists()
    from megapar.cli.eval import build_parser, logits_memory_refusal

    args = build_parser().parse_args([*argv, "--tp", "2"])
    assert logits_memory_refusal(args, (2, 8), 101, None) is None  # unknown: not checked
    # less free than the processes' own: fewer processes, not shorter sequences (a re-test)
    assert logits_memory_refusal(args, (2, 8), 101, 1500).endswith(
        "less than the 2 x 0.0 GiB this run's processes hold themselves: free memory, or run "
        "fewer processes (a smaller --tp x --cp x --pp)")
    assert logits_memory_refusal(args, (2, 8), 101, 4 * 6464 + 2000) is None  # 2 x tp x cp copies
    assert logits_memory_refusal(args, (2, 8), 101, 4 * 6464 + 1999) is not None
    monkeypatch.setattr(eval_cli, "use_cuda", lambda: True)  # on GPUs rank 0's copy alone
    assert logits_memory_refusal(args, (2, 8), 101, 6464 + 2000) is None


def test_a_failed_run_leaves_no_directory_made_for_its_logits(tiny_ckpt, tmp_path, capsys,
                                                              monkeypatch):
    """A run ended by SIGTERM (or a rank killed) said "nothing was written" and left the empty
    nd/sub/ rank 0 had made for --save-logits nd/sub/l.npy (a re-test)."""
    import megapar.cli.eval as eval_cli

    def made_then_ended(*args, **kwargs):
        (tmp_path / "nd" / "sub").mkdir(parents=True)  # as rank 0's save_logits makes it
        return 143

    monkeypatch.setattr(eval_cli, "run_reported", made_then_ended)
    ckpt, ids = tiny_ckpt
    out = tmp_path / "nd" / "sub" / "l.npy"
    assert evaluate(["--load", str(ckpt), "--input-ids", str(ids), "--save-logits",
                     str(out)]) == 143
    assert not (tmp_path / "nd").exists()


def test_save_logits_without_input_ids_is_refused(tiny_ckpt, capsys):
    ckpt, _ = tiny_ckpt
    assert evaluate(["--load", str(ckpt), "--data", "x", "--seq-len", "8", "--save-logits",
                     "out.npy"]) == 2
    assert "--save-logits is used only with --input-ids" in _one_error_line(capsys)


def test_loss_options_with_input_ids_are_refused_not_ignored(tiny_ckpt, tmp_path, capsys,
                                                            monkeypatch):
    # used to write the logits and ignore --data (and --max-batches, --seed, ...) silently
    _refuse_workers(monkeypatch)
    ckpt, ids = tiny_ckpt
    base = ["--load", str(ckpt), "--input-ids", str(ids), "--save-logits",
            str(tmp_path / "lg.npy")]
    assert evaluate(base + ["--data", "x", "--seq-len", "8"]) == 2
    assert "--data and --input-ids are two modes" in _one_error_line(capsys)
    # without --save-logits too: the two modes first (it said "--input-ids needs --save-logits",
    # and the mode conflict after the user added it; a re-test)
    assert evaluate(base[:4] + ["--data", "x"]) == 2
    assert "--data and --input-ids are two modes" in _one_error_line(capsys)
    assert evaluate(base + ["--max-batches", "8", "--seed", "2"]) == 2
    line = _one_error_line(capsys)
    assert "--max-batches, --seed are used only with --data" in line and "drop them" in line
    assert evaluate(base + ["--micro-batch-size", "4"]) == 2
    assert "--micro-batch-size is used only with --data" in _one_error_line(capsys)
    assert not (tmp_path / "lg.npy").exists()


def test_bert_inputs_and_cp_are_checked_before_any_worker(tiny_ckpt, tmp_path, capsys,
                                                           monkeypatch):
    """--attention-mask / --token-type-ids: BERT's, of --input-ids' shape, a 0 / 1 mask with a
    token in every row, types the model has, never with --data; --cp: the sequences a
    multiple of 2 x cp, its processes in the torchrun count. One line each, exit 2."""
    from test_checkpoint_helpers import save_serial

    _refuse_workers(monkeypatch)
    gpt, ids = tiny_ckpt
    bert = tmp_path / "bert"
    save_serial(bert, kind="bert")
    arrays = {"ok": np.ones((2, 8)), "shape": np.ones((2, 6)), "two": np.full((2, 8), 2),
              "empty": np.array([[1] * 8, [0] * 8]), "float": np.ones((2, 8)) / 2}
    files = {}
    for name, values in arrays.items():
        files[name] = tmp_path / f"{name}.npy"
        dtype = np.float32 if name == "float" else np.int64
        np.save(files[name], values.astype(dtype))
    logits = ["--save-logits", str(tmp_path / "lg.npy")]
    cases = [
        ([gpt, "--attention-mask", files["ok"]], "--attention-mask is BERT's input, and the "
         "checkpoint holds a gpt2: its attention is causal over every token (pad on the right "
         "and read the real tokens' logits); drop --attention-mask"),
        ([gpt, "--token-type-ids", files["ok"]], "--token-type-ids is BERT's input, and the "
         "checkpoint holds a gpt2: it has no token-type embedding; drop --token-type-ids"),
        ([bert, "--attention-mask", files["shape"]], f"--attention-mask {files['shape']} has "
         f"shape (2, 6), and --input-ids (2, 8); give one value per token"),
        ([bert, "--attention-mask", files["two"]], f"--attention-mask {files['two']} holds 2; "
         f"it holds 1 for a token and 0 for padding"),
        ([bert, "--attention-mask", files["empty"]], f"--attention-mask {files['empty']}: row 1 "
         f"is all 0 (no token to attend to); give every row at least one 1"),
        ([bert, "--token-type-ids", files["two"]], f"--token-type-ids {files['two']} holds 2, "
         f"outside the model's 2 token types (0-1)"),
        ([bert, "--token-type-ids", files["float"]], f"--token-type-ids {files['float']} holds "
         f"float32 values; it must be integers"),
        ([bert, "--cp", "3"], "--input-ids has sequences of 8 tokens, not a multiple of 2 x cp "
         "= 6: --cp 3 cuts each sequence into 6 chunks; pad them"),
    ]
    for extra, message in cases:
        argv = ["--load", *map(str, extra[:1]), "--input-ids", str(ids), *map(str, extra[1:])]
        assert evaluate([*argv, *logits]) == 2, extra
        assert message in _one_error_line(capsys), extra
    assert evaluate(["--load", str(bert), "--data", "x", "--seq-len", "8", "--attention-mask",
                     str(files["ok"])]) == 2
    assert ("--attention-mask is used only with --input-ids (the logits of given ids); "
            "--data's BERT samples carry their own: drop it") in _one_error_line(capsys)
    assert evaluate(["--load", str(gpt), "--data", "x", "--seq-len", "6", "--cp", "2"]) == 2
    assert "--seq-len 6 is not divisible by 4: --cp 2 cuts each sequence into 2 x cp = 4 " \
           "chunks" in _one_error_line(capsys)
    monkeypatch.setenv("RANK", "0")  # as torchrun starts a process
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert evaluate(["--load", str(gpt), "--cp", "2", "--pp", "2", "--input-ids", str(ids),
                     *logits]) == 2
    assert ("torchrun / Slurm started 2 processes but megapar-eval runs on tp x cp x pp = "
            "1 x 2 x 2 = 4 (it has no data parallelism); start 4 or change --tp / --cp / --pp"
            ) in _one_error_line(capsys)
    assert not (tmp_path / "lg.npy").exists()


def test_sft_keys_with_a_prepared_dataset_says_what_is_wrong(tiny_ckpt, tmp_path, capsys,
                                                             monkeypatch):
    """--sft-keys beside a tokenized --data (and --data-cache) was "--sft-keys P,R, --data-cache
    C would be ignored": both are for raw text, but the line did not say that --sft-keys reads
    raw JSON Lines records, and that a dataset megapar-data made of records holds its prompt
    lengths already (its responses are scored without the flag), or that plain text has none."""
    from megapar.data import IndexedDatasetBuilder

    ckpt, _ = tiny_ckpt
    _refuse_workers(monkeypatch)
    for name, keys in (("records", ["prompt", "response"]), ("plain", None)):
        with IndexedDatasetBuilder(str(tmp_path / name), 101, 0, {"kind": "x"},
                                   sft_keys=keys) as b:
            b.add_document([5, 6, 7], prompt_length=1 if keys else None)
            b.finalize()
    cache = str(tmp_path / "cache")
    for name, message in (
        ("records", f"--sft-keys prompt,response applies to raw JSON Lines records, and --data "
                    f"{tmp_path / 'records'} is a prepared dataset of records (made with "
                    f"--sft-keys prompt,response) that already holds their prompt lengths: "
                    f"megapar-eval scores its responses without it; drop --sft-keys and "
                    f"--data-cache"),
        ("plain", f"--sft-keys prompt,response applies to raw JSON Lines records, and --data "
                  f"{tmp_path / 'plain'} is a prepared dataset of plain text, with no prompt "
                  f"lengths: give the records' .jsonl as --data (or prepare them with "
                  f"megapar-data --sft-keys prompt,response), or drop --sft-keys and "
                  f"--data-cache to score every token"),
    ):
        assert evaluate(["--load", str(ckpt), "--data", str(tmp_path / name), "--sft-keys",
                         "prompt,response", "--data-cache", cache, "--seq-len", "8"]) == 2
        assert _one_error_line(capsys) == f"megapar-eval: error: {message}"
    # without --sft-keys, the raw-text options alone are still "would be ignored"
    assert evaluate(["--load", str(ckpt), "--data", str(tmp_path / "plain"), "--data-cache",
                     cache, "--seq-len", "8"]) == 2
    assert f"--data-cache {cache} would be ignored: --data" in _one_error_line(capsys)


def test_saved_reports_the_file_numpy_wrote(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """Every path flag takes a leading ~ (quoted) as the home directory: --input-ids '~/x' was
    'no such file', and --save-logits '~/lg' was written under a directory named ~ here."""
    ckpt, ids = tiny_ckpt
    monkeypatch.setenv("HOME", str(tmp_path))
    assert evaluate(["--load", "~/ckpt", "--input-ids", f"~/{ids.name}", "--save-logits",
                     "~/lg"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["saved"] == str(tmp_path / "lg.npy")
    assert np.load(report["saved"]).shape == (2, 8, 101) == tuple(report["shape"])


def test_eval_reads_a_megatron_dataset_written_by_megapar(tmp_path, corpus, capsys,
                                                          monkeypatch):
    """The same text as megapar's index and as Megatron-LM's MMIDIDX (megapar-data --format
    megatron, its .json removed as a Megatron-LM made dataset has none): the same loss. The
    Megatron-LM copy is written and read as '~/megatron' (quoted: the home directory, as
    megapar-eval --load reads it; --data '~/x' was 'not found', --output-prefix made ./~)."""
    prefix, _, root = corpus
    ckpt = tmp_path / "ckpt"
    _hf_model("gpt2").save_pretrained(tmp_path / "hf")
    assert convert(["--from-hf", str(tmp_path / "hf"), str(ckpt), "--tp", "1", "--pp", "1",
                    "--no-progress"]) == 0
    megatron = str(tmp_path / "megatron")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert data_main(["--input", str(root / "sample.txt"), "--output-prefix", "~/megatron",
                      "--tokenizer", "sentencepiece", "--split-lines", "--no-progress",
                      "--format", "megatron"]) == 0
    Path(megatron + ".json").unlink()
    args = ["--load", str(ckpt), "--seq-len", "32", "--max-batches", "2"]
    losses = []
    for data, extra in [(prefix, []), ("~/megatron", ["--tokenizer", "sentencepiece"])]:
        capsys.readouterr()
        assert evaluate([*args, "--data", data, *extra]) == 0, capsys.readouterr().err
        losses.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"])
    assert losses[0] == losses[1]
    # --seq-len left out: the import records none (was: refused, asking for it); megapar-train's
    # default 128 capped at the model's 64 positions, as megapar-train caps it, said on stderr
    capsys.readouterr()
    assert evaluate(["--load", str(ckpt), "--data", prefix, "--micro-batch-size", "1",
                     "--max-batches", "1"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["tokens"] == 64, out
    assert (f"megapar-eval: --seq-len not given and --load {ckpt} records none (it was not "
            "trained by megapar-train): using the model's 64 positions (megapar-train's "
            "default 128, capped at them); give --seq-len N for another") in out.err, out.err
    # a refusal after that default stays one line: the note came first, then the error
    assert evaluate(["--load", str(ckpt), "--data", str(root / "sample.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "records no tokenizer to tokenize it" in err, err
    gpt2 = str(tmp_path / "gpt2")  # ids beyond the model's vocabulary: refused, one line
    assert data_main(["--input", str(root / "sample.txt"), "--output-prefix", gpt2,
                      "--split-lines", "--no-progress"]) == 0
    capsys.readouterr()
    assert evaluate(["--load", str(ckpt), "--data", gpt2]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "outside the model's vocabulary" in err, err
    assert evaluate([*args, "--data", megatron]) == 2  # which tokenizer made it: one line
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "name the tokenizer it was made with" in err, err
    # megapar's index keeps its own tokenizer: another --tokenizer is refused, not ignored
    assert evaluate([*args, "--data", prefix, "--tokenizer", "gpt2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not the tokenizer --data" in err, err


def test_a_tokenizer_far_smaller_than_an_unrecorded_models_vocabulary_gets_a_note(
        tmp_path, corpus, capsys):
    """A checkpoint that records no tokenizer took any --tokenizer whose ids stayed in range:
    the shipped 1,004-id sentencepiece on a 2,100-id model scored without a word. Now megapar-eval
    (raw text and a prepared dataset) and megapar-generate say it is likely another tokenizer;
    a model padded within 1,024 ids of it (2,000) gets no note, as a real model's padding."""
    from test_checkpoint_helpers import save_serial

    from megapar.cli.generate import main as generate

    prefix, _, root = corpus
    text = str(root / "sample.txt")
    for vocab, noted in ((2100, True), (2000, False)):
        ckpt = tmp_path / f"v{vocab}"
        save_serial(ckpt, vocab_size=vocab)
        base = ["--load", str(ckpt), "--seq-len", "16", "--max-batches", "1"]
        runs = [
            (evaluate, [*base, "--data", text, "--tokenizer", "sentencepiece", "--data-cache",
                        str(tmp_path / "cache")], "--tokenizer sentencepiece"),
            (evaluate, [*base, "--data", prefix],
             f"the tokenizer --data {prefix} was made with ("),
            (generate, ["--load", str(ckpt), "--tokenizer", "sentencepiece", "--prompt", "To be",
                        "--max-new-tokens", "2"], "--tokenizer sentencepiece"),
        ]
        for command, argv, name in runs:
            assert command(argv) == 0, capsys.readouterr().err
            err = capsys.readouterr().err
            note = (f"has 1,004 ids and --load {ckpt}'s model {vocab:,}, which records no "
                    f"tokenizer: a model's vocabulary is its tokenizer's (padded by at most a few "
                    f"hundred), so this is likely not the one it trained with")
            assert (note in err and name in err) == noted, (argv, err)


def test_a_torchrun_world_other_than_tp_x_pp_is_a_usage_error(tiny_ckpt, capsys, monkeypatch):
    """megapar-eval has no data parallelism: 4 torchrun processes for --tp 2 is one line, rc 2,
    before any process group (not a LayoutError from every rank, each calling itself rank 0)."""
    ckpt, ids = tiny_ckpt
    _refuse_workers(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rc = evaluate(["--load", str(ckpt), "--tp", "2", "--input-ids", str(ids),
                   "--save-logits", str(ckpt.parent / "out.npy")])
    line = _one_error_line(capsys)
    assert rc == 2
    assert ("torchrun / Slurm started 4 processes but megapar-eval runs on tp x pp = 2 x 1 = 2 "
            "(it has no data parallelism); start 2 or change --tp / --pp") in line
    # the other processes of the node refuse it too, without a word: the line is printed once
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    rc = evaluate(["--load", str(ckpt), "--tp", "2", "--input-ids", str(ids),
                   "--save-logits", str(ckpt.parent / "out.npy")])
    assert rc == 2 and capsys.readouterr().err == ""


def test_the_notes_before_the_evaluation_are_printed_once_per_node_under_torchrun(
        tiny_ckpt, capsys, monkeypatch):
    """The lines said once every check passes ("scores N of the M windows ...
    --micro-batch-size K scores every one", the --seq-len a checkpoint gets) were printed by
    every torchrun process, twice on a node of two: now by the first of each node only, as the
    refusals are (`prints_refusals`)."""
    import megapar.cli.eval as eval_cli

    note = "megapar-eval: scores 8 of the 10 windows of --data d (...)"
    checked = eval_cli.check_eval_args

    def check_with_note(args, given=()):
        manifest = checked(args, given)
        args.seq_len_note = note
        return manifest

    class Started(Exception):
        pass

    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr(eval_cli, "check_eval_args", check_with_note)
    monkeypatch.setattr(eval_cli, "run_reported", start)
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a node of two processes at tp 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ckpt, ids = tiny_ckpt
    for rank, said in (("0", f"{note}\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(Started):
            evaluate(["--load", str(ckpt), "--tp", "2", "--input-ids", str(ids),
                      "--save-logits", str(ckpt.parent / "out.npy")])
        assert capsys.readouterr().err == said, rank


def test_data_of_another_tokenizer_is_refused_and_seq_len_defaults_to_the_checkpoints(
        tmp_path, corpus, capsys):
    """A checkpoint trained on GPT-2 tokens scores SentencePiece data (ids 0-1003, inside its
    vocabulary) only to refuse it, as megapar-train --load does (one line naming both
    tokenizers); on its own data, --seq-len left out is the one it trained with."""
    sp, _, root = corpus
    gpt2 = str(tmp_path / "gpt2")
    assert data_main(["--input", str(root / "sample.txt"), "--output-prefix", gpt2,
                      "--tokenizer", "gpt2", "--split-lines", "--no-progress"]) == 0
    ckpt = str(tmp_path / "ckpt")
    assert train(["--model", "gpt2-tiny", "--data", gpt2, "--seq-len", "16",
                  "--micro-batch-size", "2", "--global-batch-size", "2", "--max-steps", "1",
                  "--eval-interval", "0", "--save", ckpt, "--no-progress"]) == 0
    capsys.readouterr()
    rc = evaluate(["--load", ckpt, "--data", sp, "--seq-len", "16", "--max-batches", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--load {ckpt} trained with the tokenizer gpt2 (sha256 " in err, err
    assert f"--data {sp} was made with {asset_path('botchan_en_unigram_1000.model')}" in err, err
    assert err.endswith("use data made with megapar-data --tokenizer gpt2"), err
    assert evaluate(["--load", ckpt, "--data", gpt2, "--micro-batch-size", "2",
                     "--max-batches", "1"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["tokens"] == 2 * 16 and report["batches"] == 1  # windows of the trained 16
    # the same tokens as a Megatron-LM dataset (no .json, so no tokenizer recorded): the
    # checkpoint's tokenizer, as megapar-train --load takes it (was: refused, naming
    # --tokenizer), the same loss
    megatron = str(tmp_path / "megatron")
    assert data_main(["--input", str(root / "sample.txt"), "--output-prefix", megatron,
                      "--tokenizer", "gpt2", "--split-lines", "--no-progress",
                      "--format", "megatron"]) == 0
    Path(megatron + ".json").unlink()
    assert evaluate(["--load", ckpt, "--data", megatron, "--micro-batch-size", "2",
                     "--max-batches", "1"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    # the text it was made from: tokenized with the tokenizer the checkpoint records (GPT-2's;
    # a --tokenizer of other files is refused) into --data-cache, the same bytes and loss
    text, cache = str(root / "sample.txt"), tmp_path / "cache"
    assert evaluate(["--load", ckpt, "--data", text, "--data-cache", str(cache),
                     "--micro-batch-size", "2", "--max-batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    [cached] = cache.glob("*.bin")
    assert cached.read_bytes() == Path(gpt2 + ".bin").read_bytes()
    assert evaluate(["--load", ckpt, "--data", text, "--data-cache", str(cache),
                     "--tokenizer", "sentencepiece"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"but --data {text} is tokenized with --tokenizer " \
        "sentencepiece: its token ids would be other tokens to the model; pass --tokenizer " \
        "gpt2" in err, err
    # exported and imported back, it records the export's tokenizer.json: another format of
    # GPT-2's BPE that encodes alike, so the GPT-2 data is its own; once the export is gone,
    # the recorded sizes still tell the SentencePiece data apart
    hf, again = tmp_path / "hf", str(tmp_path / "again")
    assert convert([ckpt, "--to-hf", str(hf)]) == 0
    assert convert(["--from-hf", str(hf), again, "--no-progress"]) == 0
    args = ["--load", again, "--seq-len", "16", "--micro-batch-size", "2", "--max-batches", "1"]
    for _ in ("the export there", "the export gone"):
        capsys.readouterr()
        assert evaluate([*args, "--data", gpt2]) == 0, capsys.readouterr().err
        assert evaluate([*args, "--data", sp]) == 2
        assert f"--load {again} trained with the tokenizer {hf} (sha256 " in \
            capsys.readouterr().err
        shutil.rmtree(hf, ignore_errors=True)  # then: kind, vocabulary size and eod compared


def _signalled_worker(signum):
    """A worker during which `signum` reaches the launcher (which passes it on to the ranks)."""

    def worker(args):
        import os
        import time

        if "RANK" not in os.environ:  # tp 1: the one rank runs in the command's process
            os.kill(os.getpid(), signum)
        elif os.environ["RANK"] == "0":
            time.sleep(0.3)
            os.kill(os.getppid(), signum)
        time.sleep(60)

    return worker


def _evaluate_in_child(argv, out, patch=None) -> int:
    """megapar-eval's exit code, run in a forked child (stdout and stderr to `out`), so the
    signals a test sends its launcher never reach this process; `patch()` runs there first."""

    def run():
        if patch is not None:
            patch()
        return evaluate(argv)

    return exit_code(fork_running(run, out))


def _logits_in_child(tiny_ckpt, tmp_path, patch, *flags) -> tuple[int, str]:
    """megapar-eval's --input-ids run of `tiny_ckpt` (its logits to tmp_path / "lg.npy", more
    `flags` beside) in a forked child with `patch()`: (exit code, its output stripped)."""
    ckpt, ids = tiny_ckpt
    out = tmp_path / "out.txt"
    got = _evaluate_in_child(["--load", str(ckpt), *flags, "--input-ids", str(ids),
                              "--save-logits", str(tmp_path / "lg.npy")], out, patch)
    return got, out.read_text().strip()


@pytest.mark.parametrize("tp", ["1", "2"])
@pytest.mark.parametrize("signum, rc, what", [
    (signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_ctrl_c_or_sigterm_during_the_evaluation_is_one_line_not_a_failure(
        tiny_ckpt, tmp_path, signum, rc, what, tp):
    # was: "megapar-eval: error: rank 0 failed in evaluation: KeyboardInterrupt:  (full
    # traceback in ~/.cache/megapar/logs/...)" (SIGTERM: "SystemExit: 143"), exit 1; at tp 1
    # (the rank in the command's own process) a traceback and -2, or no word and -15
    import megapar.cli.eval as eval_cli

    def patch():
        eval_cli._logits_worker = _signalled_worker(signum)

    got, err = _logits_in_child(tiny_ckpt, tmp_path, patch, "--tp", tp)
    assert got == rc, err
    assert err == f"megapar-eval: {what}; nothing was written", err
    assert not (tmp_path / "lg.npy").exists()


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_sigterm_under_torchrun_is_one_line_per_node_and_exit_143(tiny_ckpt, tmp_path,
                                                                   local_rank):
    """A torchrun rank (its environment: a job of one process at tp 1) that torchrun's SIGTERM
    stops ended with exit 143 and no word; the first process of its node now prints the
    command's line (the others only end with 143), as megapar-generate's does (`run_reported`)."""
    import os

    import megapar.cli.eval as eval_cli
    from megapar.launcher import free_port

    port = free_port()

    def sigterm_itself(args):
        import time

        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

    def patch():
        for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
            os.environ.pop(name, None)
        os.environ.update(RANK="0", LOCAL_RANK=local_rank, WORLD_SIZE="1", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        eval_cli._logits_worker = sigterm_itself

    got, err = _logits_in_child(tiny_ckpt, tmp_path, patch)
    assert got == 143, err
    want = "megapar-eval: terminated (SIGTERM); nothing was written" if local_rank == "0" else ""
    assert err == want, err


def test_a_sigterm_before_the_ranks_start_is_one_line_and_exit_143(tiny_ckpt, tmp_path):
    """A SIGTERM while megapar-eval checks its inputs (or tokenizes raw --data: a partial
    .bin.tmp was left in --data-cache) killed it without a word (exit -15)."""
    import os

    import megapar.cli.eval as eval_cli

    def patch():
        check = eval_cli.check_eval_args

        def check_then_sigterm(args, given=()):
            manifest = check(args, given)
            os.kill(os.getpid(), signal.SIGTERM)
            return manifest

        eval_cli.check_eval_args = check_then_sigterm

    got, err = _logits_in_child(tiny_ckpt, tmp_path, patch)
    assert got == 143, err
    assert err == "megapar-eval: terminated (SIGTERM); nothing was written", err


def test_help_gives_the_layout_defaults(capsys):
    # --tp and --pp defaulted to 1 without --help saying so
    with pytest.raises(SystemExit):
        evaluate(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "tensor-parallel size (default: 1)" in out
    assert "pipeline-parallel size (default: 1)" in out


def test_a_blend_or_several_paths_as_data_name_the_fix(capsys, tmp_path):
    # megapar-train's blend syntax gave argparse's "unrecognized arguments: data/a 0.5 data/b"
    for data, line in (
        (["0.5", "data/a", "0.5", "data/b"],
         "--data 0.5 data/a 0.5 data/b is a blend; megapar-eval evaluates one dataset at a "
         "time: run it once per part (--data data/a, then --data data/b)"),
        (["my", "corpus.txt"],
         "--data takes one dataset or text, got 2 paths (my corpus.txt); give one (a path with "
         "spaces is one argument: quote it, --data 'my corpus.txt')"),
    ):
        assert evaluate(["--load", str(tmp_path / "ckpt"), "--data", *data, "--seq-len", "8"]) == 2
        assert capsys.readouterr().err == f"megapar-eval: error: {line}\n"


def test_the_paragraphs_note_counts_non_empty_files_and_names_mixed_inputs(tmp_path):
    """The note on raw text's paragraphs was silent for a directory of a two-paragraph file
    and an empty one (2 documents, 2 files) and for .txt beside .jsonl (a re-test's
    findings)."""
    import argparse

    from megapar.training.eval_text import _paragraphs_note

    def note(files: dict, documents: int):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
        return _paragraphs_note(argparse.Namespace(data=str(folder), sft_keys=None), documents)

    assert "read as 2 documents, one per blank-line paragraph" in note(
        {"a.txt": "one\n\ntwo\n", "b.txt": ""}, 2)
    assert "read as 2 documents, one per blank-line paragraph" in note(
        {"a.txt": "one\n\ntwo\n", "b.txt": "  \n\n \t\n"}, 2)  # white space alone: none
    assert note({"a.txt": "one\n", "b.txt": "two\n"}, 2) is None  # a paragraph a file
    assert "its .txt files are read as a document per blank-line paragraph" in note(
        {"a.txt": "x\n\ny\n", "b.jsonl": '{"text": "z"}\n'}, 3)
    assert note({"b.jsonl": '{"text": "z"}\n'}, 1) is None


def test_seed_on_raw_text_for_a_causal_lm_is_refused_before_any_tokenizing(
        tiny_ckpt, tmp_path, capsys, monkeypatch):
    """--seed with a causal LM's checkpoint and raw --data: refused (it seeds only BERT's
    masking) before the text is tokenized; the refusal came after tokenizing, which also left
    the tokenized copy in --data-cache."""
    import megapar.training.validate_tools as tools

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the text was tokenized before --seed was refused")

    monkeypatch.setattr(tools, "tokenize_text", no_tokenizing)
    _refuse_workers(monkeypatch)
    text = tmp_path / "corpus.txt"
    text.write_text("Some words of a corpus. " * 50)
    ckpt, _ = tiny_ckpt
    assert evaluate(["--load", str(ckpt), "--data", str(text), "--seed", "5", "--data-cache",
                     str(tmp_path / "cache")]) == 2
    assert _one_error_line(capsys) == (
        "megapar-eval: error: --seed 5 would be ignored: it seeds BERT's masking, and the "
        "checkpoint holds a gpt2 (its loss masks nothing); drop it")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("seed", ["-5", "4294967296"])
def test_a_seed_out_of_range_is_refused_before_any_worker(tmp_path, capsys, monkeypatch, seed):
    """--seed -5 failed in rank 0's masking ('expected non-negative integer'), 2**64 was taken
    (a re-test): megapar-train's range, one line."""
    from test_checkpoint_helpers import save_serial

    _refuse_workers(monkeypatch)
    save_serial(tmp_path / "bert", kind="bert")
    text = tmp_path / "corpus.txt"
    text.write_text("Some words of a corpus. " * 50)
    assert evaluate(["--load", str(tmp_path / "bert"), "--data", str(text), "--seed", seed,
                     "--data-cache", str(tmp_path / "cache")]) == 2
    assert _one_error_line(capsys) == (
        f"megapar-eval: error: --seed {seed} is invalid: it must be a whole number from 0 to "
        f"4,294,967,295 (as megapar-train's; the default is 1234)")


def test_perplexity_is_never_capped_and_an_overflow_is_null_in_valid_json(
        tmp_path, corpus, capsys, monkeypatch):
    """The loss's exponential as it is: at a loss of 60 exp(60) (was exp(50): capped silently);
    past the largest float (a loss above 709.78) null, said on stderr, and the line stays
    strict JSON (no Infinity); the loss itself is reported as measured."""
    from megapar.pipeline.executor import PipelineExecutor

    prefix, _, _ = corpus
    model_json = tmp_path / "gpt2.json"
    model_json.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2,
                                      "n_head": 4, "n_positions": 64}))
    ckpt = tmp_path / "ckpt"
    assert train(["--model", str(model_json), "--data", prefix, "--seq-len", "16",
                  "--micro-batch-size", "2", "--global-batch-size", "2", "--max-steps", "1",
                  "--eval-interval", "0", "--no-progress", "--save", str(ckpt)]) == 0

    def strict(text):
        def refuse(constant):
            raise ValueError(f"not JSON: {constant}")
        return json.loads(text, parse_constant=refuse)

    for loss, expected in ((60.0, math.exp(60.0)), (1000.0, None)):
        monkeypatch.setattr(PipelineExecutor, "run",
                            lambda self, *a, _loss=loss, **k: torch.tensor(_loss))
        capsys.readouterr()
        assert evaluate(["--load", str(ckpt), "--data", prefix, "--seq-len", "16",
                         "--micro-batch-size", "2", "--max-batches", "2"]) == 0
        out, err = capsys.readouterr()
        report = strict(out.strip().splitlines()[-1])
        assert report["loss"] == loss
        assert report["perplexity"] == expected
        overflow = ("megapar-eval: perplexity exp(1000) exceeds the largest float (a loss "
                    "above 709.78): written as null")
        assert (overflow in err) == (expected is None), err


def test_perplexity_is_the_exponential_or_inf_and_strict_json_writes_null():
    """`perplexity` (megapar-eval's and the training log's val_ppl): exp(loss) uncapped, inf
    past the largest float, nan for nan; `strict_json` writes those as null."""
    from megapar.training.logging import perplexity, strict_json

    assert perplexity(60.0) == math.exp(60.0) and perplexity(709.0) == math.exp(709.0)
    assert perplexity(710.0) == math.inf and math.isnan(perplexity(math.nan))
    assert strict_json({"a": math.inf, "b": math.nan, "c": 1.5}) == \
        '{"a": null, "b": null, "c": 1.5}'


def test_windows_whole_batches_leave_out_are_said_in_one_line():
    """Text --data: whole batches of --micro-batch-size windows are scored, and the windows
    after the last whole one were dropped without a word (a prompt / response dataset said
    so). Now one line names how many windows and predicted tokens are left out, why, and a
    --micro-batch-size that scores every one; nothing where they all are, or where
    --max-batches asks for fewer batches than the data holds."""
    from types import SimpleNamespace

    from megapar.training.validate_tools import _check_batches

    def line(tokens, max_batches=8):
        args = SimpleNamespace(data="held_out.txt", seq_len=4, micro_batch_size=4,
                               max_batches=max_batches)
        return _check_batches(args, SimpleNamespace(num_tokens=tokens, prompt_lengths=None),
                              None, causal=True)

    assert line(4 * 10 + 1) == (  # 10 windows of 5 tokens: 2 batches of 4, 2 windows left
        "megapar-eval: scores 8 of the 10 windows of --data held_out.txt (2 batches of "
        "--micro-batch-size 4); the last 2 (8 predicted tokens) are left out, as only whole "
        "batches are scored: --micro-batch-size 5 scores every one")
    assert "(1 batch of --micro-batch-size 4); the last 1 (4 predicted tokens) is left " in (
        line(4 * 5 + 1))
    assert line(4 * 8 + 1) is None and line(4 * 8 + 3) is None  # every window scored
    assert line(4 * 30 + 1).endswith("--micro-batch-size 5 scores every one")  # 6 batches
    # a prime count: 479 windows were told --micro-batch-size 479 (one batch of them all)
    assert line(4 * 479 + 1, max_batches=200).endswith(
        "--micro-batch-size 1 --max-batches 479 scores every one")
    assert line(4 * 10 + 1, max_batches=2) is None  # fewer batches asked for


def test_the_default_max_batches_leaving_samples_out_is_said_in_one_line():
    """Raw text's perplexity over the first 32 of its 386 windows (the default --max-batches 8)
    was printed without a word; now one line names how many are scored and the --max-batches
    that scores them all. Nothing where --max-batches was given (fewer asked for)."""
    from types import SimpleNamespace

    from megapar.training.validate_tools import _check_batches

    def line(tokens, given=False, micro_batch_size=4):
        args = SimpleNamespace(data="held_out.txt", seq_len=4, micro_batch_size=micro_batch_size,
                               max_batches=8, max_batches_given=given)
        return _check_batches(args, SimpleNamespace(num_tokens=tokens, prompt_lengths=None),
                              None, causal=True)

    assert line(4 * 386 + 1) == (
        "megapar-eval: scores the first 32 of the 386 windows of --data held_out.txt (the "
        "default --max-batches 8 of --micro-batch-size 4): --max-batches 96 scores all but the "
        "last 2 (only whole batches are scored)")
    assert line(4 * 40 + 1).endswith("--max-batches 10 scores every one")
    # the flag's value as a shell takes it ("--max-batches 2,980" was refused: invalid int)
    assert line(4 * 11923 + 1).endswith(": --max-batches 2980 scores all but the last 3 (only "
                                        "whole batches are scored)")
    assert line(4 * 40 + 1, micro_batch_size=5) is None  # 8 batches of 5 take all 40
    assert line(4 * 386 + 1, given=True) is None


def test_too_little_data_is_counted_in_words():
    """The refusal of --data smaller than one batch counts its windows in words ("1 window",
    not "1 windows")."""
    from types import SimpleNamespace

    from megapar.training.validate import UsageError
    from megapar.training.validate_tools import _check_batches

    args = SimpleNamespace(data="d", seq_len=4, micro_batch_size=4)
    for tokens, said in ((6, "has 1 window of 5 tokens"), (10, "has 2 windows of 5 tokens")):
        with pytest.raises(UsageError, match=said):
            _check_batches(args, SimpleNamespace(num_tokens=tokens, prompt_lengths=None), None,
                           causal=True)


def test_each_file_of_the_checkpoint_is_hashed_once(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """megapar-eval's start-up hashed every file of --load, then its rank (at --tp 1 this very
    process) hashed each one it read again (2 hashes of each file); the rank now loads the step
    directory the start-up checked with the sizes checked only: each file hashed once."""
    import megapar.checkpoint.manifest as manifest_module

    ckpt, ids = tiny_ckpt
    hashed = []
    record = manifest_module.file_record
    monkeypatch.setattr(manifest_module, "file_record",
                        lambda path: hashed.append(Path(path).name) or record(path))
    assert evaluate(["--load", str(ckpt), "--input-ids", str(ids), "--save-logits",
                     str(tmp_path / "out.npy")]) == 0, capsys.readouterr().err
    files = sorted(p.name for p in (ckpt / "step_00000003").glob("*.safetensors"))
    assert files and sorted(hashed) == files


def test_under_torchrun_a_corrupt_file_fails_the_rank_reading_it_and_the_other_names_it(
        tiny_ckpt, tmp_path):
    """megapar-eval --pp 2 under torchrun (two processes forked with its variables, each
    running the command), a byte of stage 1's file altered (its size kept): the start-up checks
    the sizes only and each rank hashes the file it reads, as megapar-train's do
    (test_cli_train's torchrun hashing test). Rank 1 fails in one line naming the step, the file
    and the fix; rank 0, which loaded its own file, comes down naming rank 1's failure."""
    from forked import torchrun_ranks

    ckpt, ids = tiny_ckpt
    pp2 = tmp_path / "pp2"
    assert convert([str(ckpt), str(pp2), "--pp", "2", "--no-progress"]) == 0
    step = pp2 / "step_00000003"
    shard = step / "model_tp00_pp01.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte: the header still reads
    shard.write_bytes(bytes(data))
    out = tmp_path / "logits.npy"
    argv = ["--load", str(pp2), "--pp", "2", "--input-ids", str(ids), "--save-logits", str(out)]
    codes, outs = torchrun_ranks(lambda: evaluate(argv), 2, tmp_path)
    assert codes == [1, 1], outs
    refusal = (f"--load {step}: model_tp00_pp01.safetensors: checksum mismatch (file altered or "
               f"truncated); restore it or use another checkpoint")
    assert outs[1] == f"megapar-eval: error: rank 1 failed in evaluation: {refusal}\n", outs[1]
    assert outs[0].startswith(f"megapar-eval: error: rank 0 failed in evaluation: --load {step}: "
                              f"rank 1 failed at checking --load's files: ") \
        and refusal in outs[0] and outs[0].count("\n") == 1, outs[0]
    assert not out.exists()


def test_a_forked_ranks_clean_stop_is_its_message_alone(capsys, monkeypatch, tmp_path):
    # megapar-eval --tp 2 on a full disk said "rank 0 failed in evaluation: RunStopped:
    # --save-logits ..." where one rank said the message alone (a session's tryout); another
    # clean failure keeps its type, which says what failed
    from megapar.cli.worker_exit import worker_exit
    from megapar.faults.stop import RunStopped
    from megapar.launcher import WorkerError, error_line

    monkeypatch.setenv("HOME", str(tmp_path))
    full = "--save-logits out.npy: No space left on device while writing it"
    reported = f"rank 0 failed: {error_line(RunStopped(full))}"  # as a forked rank reports it
    assert worker_exit("megapar-eval", WorkerError(reported), "in evaluation") == 1
    assert capsys.readouterr().err == f"megapar-eval: error: rank 0 failed in evaluation: {full}\n"
    worker_exit("megapar-eval", WorkerError("rank 1 failed: CheckpointError: bad file"),
                "in evaluation")
    assert capsys.readouterr().err == (
        "megapar-eval: error: rank 1 failed in evaluation: CheckpointError: bad file\n")
