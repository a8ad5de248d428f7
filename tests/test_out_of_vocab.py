"""Token ids outside the model's vocabulary are refused at every layout, before any work."""

import numpy as np
import pytest
from test_checkpoint_helpers import save_serial

from megapar.cli import eval as eval_cli
from megapar.cli.data import main as data_main
from megapar.cli.train import main as train_main
from megapar.data import IndexedDataset, asset_path

ARGS = ["--model", "gpt2-tiny", "--seq-len", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--eval-interval", "0", "--no-progress", "--max-steps", "2",
        "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def bad_prefix(tmp_path_factory):
    d = tmp_path_factory.mktemp("oov")
    text = d / "t.txt"
    text.write_text(open(asset_path("shakespeare_sample.txt")).read()[:20_000])
    prefix = str(d / "data")
    assert data_main(["--input", str(text), "--output-prefix", prefix, "--no-progress"]) == 0
    ds = IndexedDataset(prefix)
    assert ds.meta["max_id"] == ds.max_id() < 50261  # recorded at preprocessing
    tokens = np.memmap(prefix + ".bin", dtype=ds.dtype, mode="r+")
    tokens[100] = 65000  # a corrupted / foreign id, as in the issue
    tokens.flush()
    return prefix


@pytest.mark.parametrize("layout", [["--tp", "1"], ["--tp", "2"], ["--pp", "2"]])
def test_training_refuses_out_of_vocab_ids(bad_prefix, capsys, layout):
    assert train_main([*ARGS, "--data", bad_prefix, *layout]) == 2
    err = capsys.readouterr().err
    assert "holds token id 65000, outside the model's vocabulary of 50261" in err


@pytest.mark.parametrize("tp", ["1", "2"])
def test_eval_refuses_out_of_vocab_input_ids(tmp_path, capsys, tp):
    root = save_serial(tmp_path / "ckpt").parent  # tiny GPT-2, vocabulary of 101 ids
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[1, 2, 99_999_999, 4]], dtype=np.int64))
    out = tmp_path / "logits.npy"
    rc = eval_cli.main(["--load", str(root), "--input-ids", str(ids), "--save-logits", str(out),
                        "--tp", tp])
    assert rc == 2 and not out.exists()
    assert "holds id 99999999" in capsys.readouterr().err
    np.save(ids, np.array([[1, 2, -3, 4]], dtype=np.int64))
    assert eval_cli.main(["--load", str(root), "--input-ids", str(ids), "--save-logits",
                          str(out), "--tp", tp]) == 2
    assert "holds id -3" in capsys.readouterr().err
