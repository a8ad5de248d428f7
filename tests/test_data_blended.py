"""Blended datasets (--data 0.7 A 0.3 B): proportions, determinism, layout independence and
exact resume."""

import json
from pathlib import Path

import numpy as np
import pytest

from megapar.cli.data import main as data_main
from megapar.cli.train import main as train
from megapar.data import asset_path
from megapar.data.blended import BlendedDataset, blend_indices, parse_blend


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05)])
def test_proportions_within_one_percent_over_1000_samples(weights):
    lengths = [37, 1000, 5][:len(weights)]
    which, sample = blend_indices(weights, lengths, 5000, seed=3)
    for start in (0, 1234, 4000):  # any 1000 consecutive samples, not only the first
        counts = np.bincount(which[start:start + 1000], minlength=len(weights)) / 1000
        assert np.all(np.abs(counts - weights) <= 0.01), (start, counts)
    for d, n in enumerate(lengths):  # each dataset is walked through a permutation per pass
        drawn = sample[which == d]
        first_pass = drawn[:n].tolist()
        assert len(set(first_pass)) == len(first_pass) and drawn.max() < n  # no repeat early
        if len(drawn) >= n:
            assert sorted(first_pass) == list(range(n))
    again = blend_indices(weights, lengths, 5000, seed=3)
    assert np.array_equal(again[0], which) and np.array_equal(again[1], sample)
    assert not np.array_equal(blend_indices(weights, lengths, 5000, seed=4)[1], sample)


def test_blended_dataset_items_and_description():
    a, b = [("a", i) for i in range(10)], [("b", i) for i in range(30)]
    blend = BlendedDataset([a, b], [3, 1], ["A", "B"], seed=0)
    assert len(blend) == 40 and blend.weights.tolist() == [0.75, 0.25]
    items = [blend[i] for i in range(len(blend))]
    assert sum(x[0] == "a" for x in items) == 30  # A (10 samples) is drawn 3 times over
    # "10 samples" read as what the blend draws of A: 30 drawn of the part's 10
    assert "A 0.7500 (weight 0.7500: 30 drawn of the part's 10 samples)" in blend.describe()
    assert "B 0.2500 (weight 0.2500: 10 drawn of the part's 30 samples)" in blend.describe()


def test_each_epoch_of_a_blend_draws_on_where_the_last_left_off():
    """Every epoch of a blend was the same sequence (the sampler takes a blend unshuffled), so
    a dataset weighted below its share had the same few samples drawn every epoch and the
    rest never: here A (90 samples, weight 0.1 of a 100-sample blend) gave the same 10 each
    epoch. Epoch e's sample j is the blend's index e * len + j: the same dataset as sample j,
    its draws continuing through its seeded permutations, so over 9 epochs A's 90 are all
    drawn once; epoch 0 is the blend as it was."""
    from megapar.data.sampler import GlobalBatchSampler

    a, b = [("a", i) for i in range(90)], [("b", i) for i in range(10)]
    blend = BlendedDataset([a, b], [0.1, 0.9], ["A", "B"], seed=3)
    sampler = GlobalBatchSampler(len(blend), 10, 5, 2, 0, seed=3, shuffle=False,
                                 epoch_offset=True)
    assert sampler.epoch_order(2).tolist() == list(range(200, 300))
    epochs = [[blend[e * len(blend) + j] for j in range(len(blend))] for e in range(9)]
    assert epochs[0] == [blend[j] for j in range(len(blend))]
    which, sample = blend_indices([0.1, 0.9], [90, 10], 100, seed=3)
    assert [x[1] for x in epochs[0]] == sample.tolist()  # epoch 0 unchanged
    assert all([x[0] for x in ep] == [x[0] for x in epochs[0]] for ep in epochs)
    drawn = [x[1] for ep in epochs for x in ep if x[0] == "a"]
    assert len(drawn) == 90 and sorted(drawn) == list(range(90))
    b_drawn = [x[1] for x in epochs[1] if x[0] == "b"]  # B: 9 permutations a blend epoch
    assert all(sorted(b_drawn[k:k + 10]) == list(range(10)) for k in range(0, 90, 10))
    assert epochs[1] != epochs[0]
    assert blend.proportions(np.arange(100, 200)).tolist() == [0.1, 0.9]


@pytest.mark.parametrize("spec, message", [
    ("0.7 a 0.3", "pairs of WEIGHT PREFIX"), (["x", "a", "0.3", "b"], "'x' is not a weight"),
    ("-1 a 1 b", "weight -1 of a must be positive and finite, or 0 to leave the part out"),
    ("0 a 0.0 b", r"every weight of the blend is 0 \(0 0.0\), so nothing would be drawn"),
    # inf normalised to nan ('cannot convert float NaN to integer' in the sampler)
    ("inf a 1 b", "weight inf of a must be positive and finite"),
    ("nan a 1 b", "weight nan of a must be positive and finite"),
    ("1e308 a 1e308 b", "add up to more than a float holds")])
def test_bad_blend_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(spec)
    assert parse_blend("data/a") is None and parse_blend(["1", "a", "3", "b"]) == [
        (0.25, "a"), (0.75, "b")]


def test_a_part_weighted_0_is_left_out_as_in_megatron(parts, tmp_path, capfd):
    """--data 0.7 A 0 B 0.3 C: Megatron-LM users switch a part off with weight 0; it was
    refused ("must be positive"). The part is left out (said in one line, not read: here it
    does not exist) and the run trains as --data 0.7 A 0.3 C does."""
    (a, b), model = parts
    assert parse_blend(["0.7", a, "0", "gone", "0.3", b]) == [(0.7, a), (0.3, b)]
    common = ["--tokenizer", "sentencepiece", "--model", model, "--seq-len", "32",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--max-steps", "1",
              "--eval-interval", "0", "--no-progress", "--log-interval", "1"]
    off, ref = tmp_path / "off.jsonl", tmp_path / "ref.jsonl"
    gone = str(tmp_path / "gone")
    assert train(["--data", "0.7", a, "0", gone, "0.3", b, *common, "--log-json", str(off)]) == 0
    out = capfd.readouterr()
    said = [x for x in (out.out + out.err).splitlines() if "weight 0 in" in x]
    assert len(said) == 1 and said[0].endswith(
        f"{gone}: weight 0 in --data, so it is left out of the blend (not drawn, not read; no "
        f"such file or prefix there either)"), said  # a mistyped path said so (a re-test)
    assert train(["--data", "0.7", a, "0.3", b, *common, "--log-json", str(ref)]) == 0
    assert _losses(off) == _losses(ref)


def test_a_part_given_twice_is_noted(parts):
    """--data 0.7 A 0.3 A trained without a word, drawing A's samples by two independent
    orders (megapar-data refuses a file given twice)."""
    from megapar.training.config import parse_args
    from megapar.training.data import build_datasets

    (a, b), model = parts
    cfg = parse_args(["--data", "0.6", a, "0.2", b, "0.2", a, "--tokenizer", "sentencepiece",
                      "--model", model, "--seq-len", "32", "--global-batch-size", "8",
                      "--val-fraction", "0"])
    notes: list[str] = []
    build_datasets(cfg, a, "gpt2", notes)
    twice = [n for n in notes if "given more than once" in n]
    assert twice == [f"{a}: given more than once in --data, so its samples are drawn by as many "
                     f"independent orders (some twice before others once); give it once with "
                     f"the weights summed to draw each sample once per pass"], notes


def test_a_blend_of_two_tokenizers_of_one_size_is_refused(tmp_path):
    """Parts made with different tokenizers of the same vocabulary size and end-of-document id
    (the two botchan SentencePiece models of 1,000 pieces; here GPT-2's BPE and one with two
    ids swapped) trained as one blend without a word: only those two numbers were compared.
    The same files in another directory are the same tokenizer."""
    import shutil
    from types import SimpleNamespace

    from megapar.data import load_tokenizer
    from megapar.training.tokenizer_checks import check_blend_tokenizers

    vocab = json.loads(Path(asset_path("gpt2_vocab.json")).read_text())
    vocab["\u0120the"], vocab["\u0120and"] = vocab["\u0120and"], vocab["\u0120the"]
    for name, words in (("swapped", vocab), ("copy", None)):
        (tmp_path / name).mkdir()
        shutil.copy(asset_path("gpt2_merges.txt"), tmp_path / name / "merges.txt")
        if words is None:
            shutil.copy(asset_path("gpt2_vocab.json"), tmp_path / name / "vocab.json")
        else:
            (tmp_path / name / "vocab.json").write_text(json.dumps(words))

    def part(spec):
        tok = load_tokenizer(spec)
        return SimpleNamespace(vocab_size=tok.vocab_size, eod_id=tok.eod_id,
                               tokenizer_spec=tok.spec())

    gpt2, swapped = part("gpt2"), part(str(tmp_path / "swapped"))
    assert (gpt2.vocab_size, gpt2.eod_id) == (swapped.vocab_size, swapped.eod_id)
    with pytest.raises(ValueError, match=r"--data blend: b \(.*swapped\) and a \(gpt2\) were "
                                         r"made with different tokenizers"):
        check_blend_tokenizers(["a", "b"], [gpt2, swapped])
    check_blend_tokenizers(["a", "c"], [gpt2, part(str(tmp_path / "copy"))])


def test_a_path_with_spaces_is_one_path(tmp_path):
    odd = tmp_path / "with space" / "0.5 a"
    odd.mkdir(parents=True)
    (odd / "x y.bin").write_bytes(b"")
    assert parse_blend(str(odd / "x y")) is None  # an existing prefix: never split
    assert parse_blend(str(odd / "x y.txt")) is None  # a string not starting with a weight
    assert parse_blend("x a 0.3 b") is None and parse_blend(["/a b/c"]) is None
    assert parse_blend("0.7 a 0.3 b") == [(0.7, "a"), (pytest.approx(0.3), "b")]
    with pytest.raises(ValueError, match=r"quote it, --data '.*with space/0.5 a/x y'"):
        parse_blend(str(odd / "x y").split(" "))  # the shell split an unquoted path


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    text = Path(asset_path("shakespeare_sample.txt")).read_text()
    prefixes = []
    for name, chunk in (("a", text[:20_000]), ("b", text[100_000:130_000])):
        (root / f"{name}.txt").write_text(chunk)
        prefix = str(root / name)
        assert data_main(["--input", str(root / f"{name}.txt"), "--output-prefix", prefix,
                          "--tokenizer", "sentencepiece", "--split-lines", "--no-progress"]) == 0
        prefixes.append(prefix)
    model = root / "gpt2.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                 "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                 "attn_pdrop": 0.0}))
    return prefixes, str(model)


def _losses(path):
    return [json.loads(x)["loss"] for x in Path(path).read_text().splitlines()]


def test_blend_trains_the_same_in_any_layout_and_resumes_exactly(parts, tmp_path, capfd):
    (a, b), model = parts
    common = ["--data", "0.7", a, "0.3", b, "--tokenizer", "sentencepiece", "--model", model,
              "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
              "--max-steps", "4", "--warmup-steps", "1", "--eval-interval", "0",
              "--no-progress", "--log-interval", "1"]
    serial, parallel, resumed = (tmp_path / f"{n}.jsonl" for n in ("s", "p", "r"))
    assert train([*common, "--log-json", str(serial)]) == 0
    assert "blend: the 32 samples drawn:" in capfd.readouterr().out
    ckpt = tmp_path / "ckpt"
    assert train([*common, "--dp", "2", "--log-json", str(parallel), "--save", str(ckpt),
                  "--save-interval", "2"]) == 0
    capfd.readouterr()
    assert train([*common, "--pp", "2", "--log-json", str(resumed),
                  "--load", str(ckpt / "step_00000002")]) == 0
    assert "blend: the 16 samples drawn:" in capfd.readouterr().out  # steps 3-4: what it will see
    ref = _losses(serial)
    got = _losses(parallel)
    both = got[:2] + _losses(resumed)
    assert len(ref) == len(got) == len(both) == 4
    for x, y, z in zip(ref, got, both):
        assert abs(x - y) / x < 1e-5 and abs(x - z) / x < 1e-5, (ref, got, both)


def test_a_resume_with_the_blend_reweighed_or_reordered_is_refused_unless_allowed(
        parts, tmp_path, capsys):
    """--load of a 0.7 A 0.3 B run with --data 0.5 A 0.5 B continued silently on another
    mixture (the parts' fingerprints and sizes are the same), and 0.3 B 0.7 A was called a
    change of their content. Both are refused in one line, before any worker starts; 7 A 3 B
    (the same weights) resumes, and --allow-data-change reweighs on purpose."""
    (a, b), model = parts
    ckpt = tmp_path / "ckpt"
    common = ["--tokenizer", "sentencepiece", "--seq-len", "32", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--eval-interval", "0", "--no-progress"]
    assert train(["--data", "0.7", a, "0.3", b, "--model", model, *common, "--max-steps", "1",
                  "--save", str(ckpt)]) == 0
    capsys.readouterr()
    resume = [*common, "--load", str(ckpt), "--max-steps", "2"]
    assert train(["--data", "0.5", a, "0.5", b, *resume]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        f"trained on the blend 0.7 {a}, 0.3 {b} and --data weighs the same parts 0.5 {a}, "
        f"0.5 {b}, which draws other samples from here on;") in err and "--allow-data-change" in err
    assert train(["--data", "0.3", b, "0.7", a, *resume]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gives the same parts in another order" in err, err
    assert "changed since" not in err
    assert train(["--data", "7", a, "3", b, *resume, "--max-steps", "2"]) == 0
    assert train(["--data", "0.5", a, "0.5", b, *resume, "--max-steps", "3",
                  "--allow-data-change"]) == 0


def test_a_blend_with_a_part_too_small_to_validate_trains_on_all_of_every_part(tmp_path):
    """--data 0.9 BIG 0.1 SMALL, SMALL too small for a validation batch: the blend has no
    validation, so BIG's held-out documents go back to training (they were held out for
    nothing), and the notes name the part that is too small, not "the data", and say that the
    blend trains without validation."""
    from megapar.training.config import TrainConfig
    from megapar.training.data import build_datasets

    text = Path(asset_path("shakespeare_sample.txt")).read_text()
    (tmp_path / "big.txt").write_text(text[:40_000])
    (tmp_path / "small.txt").write_text("A small part.\n\nOf two documents.\n")
    prefixes = []
    for name in ("big", "small"):
        prefix = str(tmp_path / name)
        assert data_main(["--input", str(tmp_path / f"{name}.txt"), "--output-prefix", prefix,
                          "--split-lines", "--no-progress"]) == 0
        prefixes.append(prefix)
    blend = ["0.9", prefixes[0], "0.1", prefixes[1]]
    cfg = TrainConfig(data=blend, seq_len=8, global_batch_size=4, micro_batch_size=2)
    notes: list[str] = []
    train_ds, val = build_datasets(cfg, prefixes[0], "gpt2", notes)
    whole, _ = build_datasets(TrainConfig(data=blend, seq_len=8, global_batch_size=4,
                                          micro_batch_size=2, val_fraction=0),
                              prefixes[0], "gpt2")
    assert val is None
    assert [len(d) for d in train_ds.datasets] == [len(d) for d in whole.datasets]
    assert len(notes) == 2 and notes[0].startswith(f"{prefixes[1]}: no validation split"), notes
    # and that the whole blend has none, not only that part (the part's note alone read as if
    # the other parts still validated, with --eval-interval given and no val_loss ever logged)
    assert notes[1] == ("the blend validates only when every part has a validation split: "
                        "training without validation, on all of every part"), notes


def test_several_paths_without_weights_are_named_as_such(tmp_path):
    """--data corpus/*.txt (the shell expands it to several paths) was "'a.txt' is not a
    weight; a blend is pairs of WEIGHT PREFIX": the line says several paths were given and
    the three ways to train on them."""
    paths = []
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text("text\n")
        paths.append(str(tmp_path / name))
    with pytest.raises(ValueError, match=r"^--data takes one path or a blend of WEIGHT PATH "
                                         r"pairs, got 3 paths .*pass the directory that holds "
                                         r"them .*megapar-data --input A B .*--data 0.5 A 0.5 B$"):
        parse_blend(paths)
    with pytest.raises(ValueError, match="'x' is not a weight"):  # not all of them data
        parse_blend([paths[0], "x"][::-1] + ["y", "z"])
