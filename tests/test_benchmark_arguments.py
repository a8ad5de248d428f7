"""The benchmarks' bad arguments: one line before any work (a new user's tryout of
benchmarks/README.md found tracebacks and mislabelled rows), and `common.write_json` whole or
not at all."""

import json
import math
import sys

import pytest
from repo_script import ROOT, load_script


@pytest.mark.parametrize("script, argv, said", [
    # an unknown recipe was a ConfigError traceback after the parse
    ("benchmarks/generate/batched_generation.py", ["--model", "nosuch"],
     "argument --model: unknown model 'nosuch'"),
    ("benchmarks/plan/dry_run_validate.py", ["--model", "nosuch"],
     "argument --model: unknown model 'nosuch'"),
    # cp 3 measured 1,023 tokens under the label 1024, compared with no cp 1, then failed
    ("benchmarks/memory/cp_memory.py", ["--cps", "3"],
     "--cps 3: cp 3 splits each sequence into 2 x cp chunks, and --seqs 1024,2048,4096 are "
     "not all multiples of 6"),
    ("benchmarks/memory/cp_memory.py", ["--cps", "2,4"],
     "--cps 2,4: start with 1, the run the others are compared with"),
])
def test_a_bad_argument_is_one_line(script, argv, said, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / script.rpartition("/")[0]))  # as run: its folder
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as info:
        module.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and said in err[-1], err


def test_write_json_is_whole_or_nothing(tmp_path):
    common = load_script("benchmarks/common.py")
    out = tmp_path / "r.json"
    common.write_json(str(out), {"a": 1})
    with pytest.raises(ValueError):  # not strict JSON: the old file stays, no part left
        common.write_json(str(out), {"a": math.nan})
    assert json.loads(out.read_text()) == {"a": 1} and list(tmp_path.iterdir()) == [out]
