"""megapar-train with Llama end to end: the recipe at tp 2 x pp 2 with bf16 and recompute, and a
run started from a transformers LlamaForCausalLM (--from-hf) that resumes exactly in another
layout (tp 2 -> pp 2, kv heads split -> whole). The dense families of Llama's layout (Qwen3,
Qwen2, Mistral) train from their transformers directories as one process does, and their
exports load back in transformers with megapar's logits."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import skip_unless_transformers_converts
from tp_utils import assert_close, make_mesh

from megapar.checkpoint.hf import HFReader, load_hf_weights
from megapar.cli.convert import main as convert
from megapar.cli.train import main
from megapar.data import asset_path
from megapar.models import Llama

TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "2",
        "--tokenizer", "sentencepiece"]


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_cli")
    text = root / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:40_000])
    return ["--data", str(text), "--data-cache", str(root / "cache"), *TINY]


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_llama_tiny_recipe_trains_at_tp2_pp2_bf16_recompute(tmp_path, common):
    log = tmp_path / "log.jsonl"
    assert main(["--model", "llama-tiny", "--tp", "2", "--pp", "2", "--precision", "bf16",
                 "--recompute", "selective", "--max-steps", "10", "--lr", "3e-3",
                 "--log-json", str(log), *common]) == 0
    losses = [r["loss"] for r in _records(log)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses


def test_from_hf_llama_resumes_exactly(tmp_path, common):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1004, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")
    args = ["--from-hf", str(tmp_path / "hf"), "--tp", "2", "--lr", "2e-3", *common]
    full, first, second = (tmp_path / f"{n}.jsonl" for n in ("full", "a", "b"))
    assert main([*args, "--max-steps", "4", "--log-json", str(full)]) == 0
    ckpt = tmp_path / "ckpt"
    assert main([*args, "--max-steps", "4", "--save", str(ckpt), "--save-interval", "2",
                 "--log-json", str(first)]) == 0
    assert main([*args, "--max-steps", "4", "--load", str(ckpt / "step_00000002"), "--pp", "2",
                 "--tp", "1", "--log-json", str(second)]) == 0
    reference = [r["loss"] for r in _records(full)]
    resumed = [r["loss"] for r in _records(first)][:2] + [r["loss"] for r in _records(second)]
    assert [r["step"] for r in _records(second)] == [3, 4]
    for a, b in zip(resumed, reference):
        assert abs(a - b) / b < 1e-5, (resumed, reference)


def test_llama_recipe_exports_the_tokenizers_special_ids(tmp_path, common):
    """A recipe trained on another tokenizer's data must not export Llama's own bos 1 / eos 2:
    generate() would stop on whatever id 2 means in the data's vocabulary. The config's ids are
    the exported tokenizer's (GPT-2's <|endoftext|> begins and ends, as in transformers)."""
    import transformers

    from megapar.checkpoint.export import export_hf
    from megapar.data import load_tokenizer

    assert main(["--model", "llama-tiny", "--max-steps", "2", "--save", str(tmp_path / "ck"),
                 *common, "--tokenizer", "gpt2"]) == 0
    export_hf(tmp_path / "ck", tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    tok = load_tokenizer("gpt2")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (exported["bos_token_id"], exported["eos_token_id"]) == \
        (hf.bos_token_id, hf.eos_token_id) == (tok.eod_id, tok.eod_id) == (50256, 50256)


def test_the_recipes_vocabulary_gives_way_to_the_tokenizers_and_the_log_says_so(common):
    """llama-tiny's recipe says 32,000 ids; trained on GPT-2 BPE data it has the tokenizer's
    50,261, and the run's notes say which wins. GPT-2's 50,257 on that tokenizer is no news."""
    from megapar.cli.train import parse_args, plan_run

    notes = []
    plan_run(parse_args(["--model", "llama-tiny", *common, "--tokenizer", "gpt2"]), notes)
    said = [n for n in notes if "gives way" in n]
    assert len(said) == 1 and "vocab_size 32,000 gives way to the tokenizer's 50,261" in said[0]
    notes = []
    plan_run(parse_args(["--model", "gpt2-tiny", *common, "--tokenizer", "gpt2"]), notes)
    assert not [n for n in notes if "gives way" in n], notes


DENSE = {  # transformers' config, what it adds to the tiny model, the layout trained
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True),
              ["--pp", "2"]),
    # Qwen2's window over the cp ranks' chunks of 8 (a rank's last chunk skips the first)
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=8,
                                             max_window_layers=1), ["--cp", "2", "--dp", "2"]),
    "mistral": (transformers.MistralConfig, dict(sliding_window=8), ["--tp", "2", "--pp", "2"]),
}


@pytest.mark.parametrize("family", sorted(DENSE))
def test_from_hf_dense_family_trains_as_one_process_and_exports(tmp_path, common, family):
    """A seeded transformers Qwen3 (q / k norms, tied), Qwen2 (q / k / v biases, a sliding
    window of 8 in its second layer, at cp 2 x dp 2) or Mistral (a sliding window of 8 in both,
    within --seq-len 32, at tp 2 x pp 2) trains by --from-hf at another layout with the
    losses and grad norms of one process (3 steps, fp32); the one-process run's checkpoint,
    exported, loads back as the same transformers class with megapar's logits, its tokenizer
    taking the model's positions."""
    cls, extra, layout = DENSE[family]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cls(
        vocab_size=1004, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra))
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "hf")
    args = ["--from-hf", str(tmp_path / "hf"), "--lr", "3e-3", "--max-steps", "3", *common]
    one, other, ckpt = tmp_path / "one.jsonl", tmp_path / "other.jsonl", tmp_path / "ckpt"
    assert main([*args, "--save", str(ckpt), "--save-interval", "3", "--log-json", str(one)]) == 0
    assert main([*args, *layout, "--log-json", str(other)]) == 0
    want, got = _records(one), _records(other)
    assert len(want) == len(got) == 3 and want[-1]["loss"] < want[0]["loss"]
    for step, (a, b) in enumerate(zip(got, want), 1):
        for key in ("loss", "grad_norm"):
            assert_close(torch.tensor(a[key]), torch.tensor(b[key]),
                         what=f"{family} {layout} step {step} {key}")
    skip_unless_transformers_converts()  # --to-hf exports the SentencePiece tokenizer too
    out = tmp_path / "exported"
    assert convert([str(ckpt / "step_00000003"), "--to-hf", str(out)]) == 0
    back = type(hf).from_pretrained(str(out)).eval()
    assert back.config.model_type == family
    assert back.config.sliding_window == extra.get("sliding_window")  # the window exported
    # the tokenizer takes the model's 64 positions (a sliding window is not a length limit)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 64
    reader = HFReader(str(out))
    ours = Llama(reader.config, make_mesh(1))
    assert load_hf_weights(ours, reader) == []
    ids = torch.randint(0, 1004, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(ours.eval()(None, {"input_ids": ids})[..., :1004], back(ids).logits,
                     what=f"exported {family}'s logits")
        assert not torch.allclose(back(ids).logits, hf.eval()(ids).logits)  # it trained
