"""benchmarks/pipeline/bubble_sweep.py writes strict JSON: a theory that does not apply (ZB-H1's
formula when the measured W > min(F, B), or m < pp) is null in --json and n/a in the table,
never NaN; each schedule's theory is its own."""

import json

import pytest
from repo_script import load_script

from megapar.pipeline.simulate import theoretical_bubble
from megapar.training import bubble


def _sweep_module():
    return load_script("benchmarks/pipeline/bubble_sweep.py")


def test_a_theory_outside_its_assumptions_is_null_not_nan(tmp_path, monkeypatch, capsys):
    costs = {"fwd_ms": 1.0, "bwd_ms": 4.0, "p2p_ms": 0.0, "bwd_input_ms": 0.5,
             "bwd_weight_ms": 3.5}  # W 3.5 > min(F, B) = 0.5: ZB-H1's formula does not say

    def measured(pp, m, schedule, steps, micro_batch_size, seq_len, virtual_stages):
        # no processes: the simulator stands in for the real run, with the costs above
        run = bubble.simulate(pp, m, schedule, costs["fwd_ms"], costs["bwd_ms"], 0.0,
                              virtual_stages, costs["bwd_input_ms"], costs["bwd_weight_ms"])
        run.activation_mb, run.costs = [1.0] * pp, costs
        return run

    monkeypatch.setattr(bubble, "measure", measured)
    out_json = tmp_path / "rows.json"
    sweep = _sweep_module()
    assert sweep.main(["--pp", "2", "--m", "4", "--schedules", "1f1b", "zb-h1", "--plot", "",
                       "--json", str(out_json)]) == 0
    table = capsys.readouterr().out.splitlines()

    def refuse(name):
        raise AssertionError(f"{name} in the --json output")

    rows = json.loads(out_json.read_text(), parse_constant=refuse)
    theory = {r["schedule"]: r["theory"] for r in rows}
    assert theory["zb-h1"] is None and theory["1f1b"] == 1 / 5
    zb = next(line for line in table if line.split()[1:3] == ["zb-h1", "4"])
    assert zb.split()[5] == "n/a" and "nan" not in zb.lower()
    one = next(line for line in table if line.split()[1:3] == ["1f1b", "4"])
    assert one.split()[5] == "20.0"


def test_each_schedule_has_its_own_theory_line():
    """The plot drew one theory line per pp, keyed by m over every schedule, so the last
    schedule's formula at each m won: at pp 2 the line was zb-h1's 7.7 % at m 4 under a
    1F1B curve whose formula is 20 %."""
    rows = [{"pp": 2, "schedule": s, "m": m,
             "theory": theoretical_bubble(2, m, s, 2 if s == "interleaved" else 1)}
            for s in ("1f1b", "interleaved", "zb-h1") for m in (2, 4)]
    lines = _sweep_module().theory_lines(rows)
    assert lines[(2, "1f1b")] == [(2, 1 / 3), (4, 1 / 5)]
    assert lines[(2, "interleaved")] == [(2, 1 / 5), (4, 1 / 9)]
    assert lines[(2, "zb-h1")] == [(2, 1 / 7), (4, 1 / 13)]


def test_an_output_it_cannot_write_is_refused_before_the_sweep(tmp_path, monkeypatch, capsys):
    """The sweep wrote its --json and --plot only at the end: a path in a missing directory was a
    traceback after minutes of measuring. benchmarks/common.py's `output_file` checks them when
    the flags are read, and `positive` refuses --m 0."""
    def measured(*args, **kwargs):
        raise AssertionError("the sweep ran")

    monkeypatch.setattr(bubble, "measure", measured)
    sweep = _sweep_module()
    for argv, words in ((["--json", str(tmp_path / "no" / "rows.json")], "no directory"),
                        (["--plot", str(tmp_path)], "is a directory"),
                        (["--m", "0"], "'0' is not a whole number >= 1")):
        with pytest.raises(SystemExit) as exit_:
            sweep.main(["--pp", "2", *argv])
        assert exit_.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert words in last, last
    assert not (tmp_path / "no").exists()
