"""megapar-train --from-hf of seeded transformers MoE models (MixtralForCausalLM and
Qwen3MoeForCausalLM, tiny, GQA) trains with expert parallelism as one process does: ep 2, ep 2 x
tp 2, ep 2 x pp 2 (1F1B and ZB-H1), ep 2 with ZeRO-1 and ZeRO-3, ep 2 x cp 2. Each layout's
losses and grad norms over three steps, and the weights and Adam moments its step-3 checkpoint
holds (every expert whole), equal the one-process run's (fp32, dropless, 1e-5 relative).

The in-process parity tests (test_moe_parallel.py, test_moe_ep.py) hold every layout against a
plain PyTorch loop per element; this one takes the user's path: the transformers files read by
--from-hf, the CLI's data, schedule, optimizer and checkpoint. Each model runs the layouts its
architecture exercises most (Mixtral: a router of softmax top-2 without shared experts;
Qwen3-MoE: q / k norms, renormalised top-k), so both see the ZeRO stages and the pipeline.
AdamW's epsilon is 1e-4, as test_moe_cli's: at 1e-8 an element whose gradient is near 0 takes a
step of about lr whichever way its rounding goes (test_moe_cli.py says more)."""

from pathlib import Path

import pytest
import torch
import transformers
from test_moe_cli import _canonical, _records
from tp_utils import assert_close

from megapar.cli.train import main
from megapar.data import asset_path

STEPS = 3
COMMON = ["--seq-len", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "1",
          "--tokenizer", "sentencepiece", "--max-steps", str(STEPS), "--lr", "3e-3",
          "--adam-eps", "1e-4", "--save-interval", str(STEPS)]


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=1004, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.02))


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=1004, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64))


EP2 = ["--dp", "2", "--ep", "2"]
CASES = {
    "mixtral": (_mixtral, {
        "ep2": EP2,
        "ep2_tp2": [*EP2, "--tp", "2"],
        "ep2_pp2_1f1b": [*EP2, "--pp", "2", "--schedule", "1f1b"],
        "ep2_zero3": [*EP2, "--zero", "3"],
    }),
    "qwen3_moe": (_qwen3_moe, {
        "ep2_pp2_zbh1": [*EP2, "--pp", "2", "--schedule", "zb-h1"],
        "ep2_zero1": [*EP2, "--zero", "1"],
        "ep2_cp2": ["--cp", "2", "--ep", "2"],
    }),
}


@pytest.mark.parametrize("model", sorted(CASES))
def test_from_hf_moe_layouts_train_as_one_process(tmp_path, model):
    make, layouts = CASES[model]
    torch.manual_seed(0)
    make().save_pretrained(tmp_path / "hf")
    text = tmp_path / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    common = ["--from-hf", str(tmp_path / "hf"), "--data", str(text),
              "--data-cache", str(tmp_path / "cache"), *COMMON]
    runs, saved = {}, {}
    for run, layout in {"one": [], **layouts}.items():
        log = tmp_path / f"{run}.jsonl"
        assert main([*layout, *common, "--save", str(tmp_path / run),
                     "--log-json", str(log)]) == 0, run
        runs[run] = _records(log)
        saved[run], _ = _canonical(tmp_path / run / f"step_{STEPS:08d}")
    one = runs["one"]
    assert len(one) == STEPS and one[-1]["loss"] < one[0]["loss"]  # it trains
    assert any("experts" in name for name in saved["one"])
    for run in layouts:
        assert len(runs[run]) == STEPS, run
        for step, (got, want) in enumerate(zip(runs[run], one), 1):
            for key in ("loss", "grad_norm", "moe_aux_loss"):
                assert_close(torch.tensor(got[key]), torch.tensor(want[key]),
                             what=f"{run} step {step} {key}")
            assert got["moe_tokens_per_expert"] == want["moe_tokens_per_expert"], (run, step)
        assert set(saved[run]) == set(saved["one"]), run
        for name, want in saved["one"].items():
            assert_close(saved[run][name], want, what=f"{run} saved {name}")
