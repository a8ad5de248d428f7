"""megapar-generate against transformers and a reference sampling loop.

* greedy: a tiny GPT-2 and a tiny Llama, imported with `megapar-convert --from-hf` at tp 2 x
  pp 2 and generated from at tp 1 (with the KV cache, the prompts in one left-padded batch),
  give transformers' `generate(do_sample=False, use_cache=True)` token for token, each prompt
  alone and as its left-padded batch with an attention_mask (a prompt that reaches the model's
  positions stops there, as transformers' max_length); `--precision bf16` gives transformers'
  model cast to bfloat16;
* sampling: the tokens a reference loop draws with torch.multinomial from
  softmax(top-p(top-k(logits / T))) of transformers' logits, sample i with a generator seeded
  with seed + i, and transformers' own `generate(do_sample=True)` after `torch.manual_seed`;
* tp 2 x pp 2, the samples in one batch, gives the tokens of tp 1 one sample at a time;
* the KV cache (GPT-2, Llama, Qwen3, Qwen2, Mixtral) gives the tokens and each step's logits
  of the whole sequence's forward per token, forwarding one position per new token (at tp 2 x
  pp 2 too: each stage's cache of its layers and tp rank's heads); a left-padded batch gives
  each prompt's tokens and logits alone, a row leaving at its end-of-sequence token;
* bad input: one line, exit 2, before any model is built.

The command runs in-process (`main(argv)`); its ranks at tp x pp > 1 are forked gloo ranks.
"""

import contextlib
import copy
import json
import signal
from pathlib import Path

import pytest
import torch

from megapar.cli.convert import main as convert
from megapar.cli.generate import main as generate
from megapar.data import load_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 1004  # the shipped sentencepiece model's 1000 pieces + 4 appended special tokens
EOS = 2  # its end-of-document id (SentencePiece's </s>)
PROMPTS = ["To be, or not to be", "Hello world"]


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=32, bos_token_id=EOS, eos_token_id=EOS)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       bos_token_id=EOS, eos_token_id=EOS)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # a peaked distribution: greedy ties are out of reach of rounding
        for name, p in model.named_parameters():
            if "wte" in name or "embed" in name:
                p.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def imported(request, tmp_path_factory):
    """(kind, transformers model, megapar checkpoint saved at tp 2 x pp 2)."""
    model = _hf_model(request.param)
    tmp = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(tmp / "hf")
    assert convert(["--from-hf", str(tmp / "hf"), str(tmp / "ckpt"), "--tp", "2", "--pp", "2",
                    "--no-progress"]) == 0
    return request.param, model, tmp / "ckpt"


def _run(ckpt, capsys, *args, err: list | None = None) -> list[dict]:
    capsys.readouterr()
    rc = generate(["--load", str(ckpt), "--tokenizer", "sentencepiece", "--json", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    if err is not None:
        err.append(out.err)
    return [json.loads(line) for line in out.out.splitlines()]


def _ids(prompt: str) -> list[int]:
    return load_tokenizer("sentencepiece").encode(prompt)


def test_greedy_equals_transformers_generate(imported, capsys):
    kind, model, ckpt = imported
    long = " ".join(["the"] * 40)  # more ids than fit: cut to 30, it stops at 32 positions
    long = load_tokenizer("sentencepiece").decode(_ids(long)[:30])
    prompts = [*PROMPTS, long]
    err: list[str] = []
    got = _run(ckpt, capsys, *[a for p in prompts for a in ("--prompt", p)],
               "--temperature", "0", "--max-new-tokens", "12", err=err)
    for record, prompt in zip(got, prompts, strict=True):
        ids = torch.tensor([_ids(prompt)])
        with torch.no_grad():  # transformers' max_length: the model's 32 positions
            want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  use_cache=True, max_new_tokens=min(12, 32 - ids.shape[1]),
                                  eos_token_id=EOS, pad_token_id=EOS)[0, ids.shape[1]:]
        assert record["prompt_ids"] == ids[0].tolist()
        assert record["new_ids"] == want.tolist(), (kind, prompt)
        assert record["stop"] == ("positions" if prompt == long else "max_new_tokens")
    assert len(got[2]["new_ids"]) == 2
    assert err[0] == ("megapar-generate: prompt 2 stopped at the model's 32 positions (its "
                      "prompt's 30 tokens and 2 new ones)\n")  # counted from 0, as --json's
    # transformers' batch of the two short prompts, left-padded with an attention_mask
    rows = [_ids(p) for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[EOS] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, do_sample=False, use_cache=True,
                              max_new_tokens=12, eos_token_id=EOS, pad_token_id=EOS)
    assert [r["new_ids"] for r in got[:2]] == want[:, width:].tolist(), kind


def test_a_prompt_the_vocabulary_cannot_spell_is_noted(imported, capsys):
    """A SentencePiece model makes "日本語" its unknown token, and nothing said so (--json's
    "prompt" repeats the text): a new-user tryout. One note per such prompt, the model's
    answer unchanged."""
    _, _, ckpt = imported
    tok = load_tokenizer("sentencepiece")
    assert tok.unk_id in _ids("日本語")
    err: list[str] = []
    got = _run(ckpt, capsys, "--prompt", "日本語", "--prompt", "Hello", "--max-new-tokens", "2",
               err=err)
    n = _ids("日本語").count(tok.unk_id)
    assert err[0] == (f"megapar-generate: note: --prompt '日本語' holds characters the "
                      f"tokenizer's vocabulary cannot spell: {n} token{'s' * (n > 1)} of it "
                      f"{'are' if n > 1 else 'is'} its unknown token (id {tok.unk_id}), which "
                      f"is what the model sees there\n")
    assert [r["prompt_ids"] for r in got] == [_ids("日本語"), _ids("Hello")]


def _reference_samples(model, prompt: str, n: int, new: int, t: float, k: int, p: float,
                       seed: int) -> list[list[int]]:
    """Samples drawn by a plain loop: transformers' logits of the last position, divided by t,
    cut to the top k and to the top-p set (transformers' warpers), softmax, torch.multinomial
    with sample i's generator seeded with seed + i."""
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(seed + i)
        ids = _ids(prompt)
        drawn = []
        for _ in range(new):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float() / t
            kth = torch.topk(logits, k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            ordered, order = torch.sort(logits)
            drop = ordered.softmax(-1).cumsum(-1) <= 1 - p
            drop[-1] = False
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
            drawn.append(token)
            ids.append(token)
            if token == EOS:
                break
        out.append(drawn)
    return out


def test_sampling_equals_a_reference_loop_and_transformers(imported, capsys):
    kind, model, ckpt = imported
    top_p = 1.0 if kind == "gpt2" else 0.9
    got = _run(ckpt, capsys, "--prompt", PROMPTS[0], "--samples", "2", "--max-new-tokens", "10",
               "--temperature", "0.7", "--top-k", "20", "--top-p", str(top_p), "--seed", "3")
    want = _reference_samples(model, PROMPTS[0], 2, 10, 0.7, 20, top_p, 3)
    assert [r["new_ids"] for r in got] == want
    assert want[0] != want[1]  # two samples, not one drawn twice
    ids = torch.tensor([_ids(PROMPTS[0])])
    torch.manual_seed(3)  # transformers draws from the global generator: sample 0's stream
    with torch.no_grad():
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                temperature=0.7, top_k=20, top_p=top_p, max_new_tokens=10,
                                eos_token_id=EOS, pad_token_id=EOS)[0, ids.shape[1]:]
    assert theirs.tolist()[:len(want[0])] == want[0]


def test_bf16_greedy_equals_transformers_bf16_generate(imported, capsys):
    """--precision bf16: the weights and the KV cache in bfloat16 (the checkpoint's float32
    cast once loaded), and a batch's greedy tokens are those of transformers' model cast to
    bfloat16, each prompt alone."""
    from megapar.training.generate import Sampling, generate_batch
    from megapar.training.inference import load_model

    kind, model, ckpt = imported
    got = _run(ckpt, capsys, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--temperature",
               "0", "--max-new-tokens", "8", "--precision", "bf16")
    theirs = copy.deepcopy(model).to(torch.bfloat16)
    for record, prompt in zip(got, PROMPTS, strict=True):
        ids = torch.tensor([_ids(prompt)])
        with torch.no_grad():
            want = theirs.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=8, eos_token_id=EOS, pad_token_id=EOS)
        assert record["new_ids"] == want[0, ids.shape[1]:].tolist(), (kind, prompt)
    mesh, config, ours, _ = load_model(str(ckpt), 1, 1, dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    cached = []
    hook = next(iter(ours.layers.values())).register_forward_hook(
        lambda module, args, out: cached.append(module.attn.kv_cache.k.dtype))
    generate_batch(ours, mesh, [_ids(p) for p in PROMPTS], 2, Sampling(temperature=0),
                   [torch.Generator()] * 2, config.hidden_size, config.vocab_size, 32, None)
    hook.remove()
    assert cached == [torch.bfloat16] * 2


@pytest.mark.parametrize("imported", ["gpt2"], indirect=True)  # tied embedding across pp
def test_tp2_pp2_batched_equals_tp1_one_at_a_time(imported, capfd):
    """Two prompts of different lengths x 2 samples: one left-padded batch of 4 at tp 2 x pp 2
    draws the text of --batch-size 1 at tp 1. (capfd: a forked rank 0 prints each batch as it
    finishes, on the command's standard output.)"""
    _, _, ckpt = imported
    args = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--samples", "2",
            "--max-new-tokens", "6", "--seed", "5"]
    one = _run(ckpt, capfd, *args, "--batch-size", "1")
    four = _run(ckpt, capfd, *args, "--tp", "2", "--pp", "2")
    assert [r["new_ids"] for r in four] == [r["new_ids"] for r in one]
    assert all(len(r["new_ids"]) == 6 for r in one)


BAD = [
    ([], 'give a prompt: --prompt "TEXT" (repeatable) or --prompt-file FILE'),
    (["--prompt", "a", "--temperature", "-0.5"], "--temperature -0.5 is invalid: it must be a finite number >= 0"),
    (["--prompt", "a", "--top-k", "-1"], "--top-k -1 is invalid: it must be >= 0"),
    (["--prompt", "a", "--top-p", "0"], "--top-p 0.0 is invalid: it must be in (0, 1]"),
    (["--prompt", "a", "--top-p", "1.5"], "--top-p 1.5 is invalid: it must be in (0, 1]"),
    (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens 0 is invalid"),
    (["--prompt", "a", "--temperature", "0", "--top-k", "5"],
     "--top-k would be ignored: --temperature 0 is greedy"),
    (["--prompt-file", "{tmp}/none.txt"], "--prompt-file {tmp}/none.txt: no such file"),
    (["--prompt-file", "{tmp}"], "--prompt-file {tmp} is a directory; give a text file"),
    (["--prompt", " ".join(["the"] * 40)],
     "is 40 tokens, which leaves no room in the model's 32 positions; shorten it to at most 31"),
    (["--prompt-file", "{tmp}/long.txt"],
     "--prompt-file {tmp}/long.txt is 40 tokens, which leaves no room in the model's 32"),
    (["--prompt", "a", "--tp", "3"], "4 attention heads are not divisible by --tp 3"),
    (["--prompt", "a", "--batch-size", "0"], "--batch-size 0 is invalid: it must be >= 1"),
    (["--prompt", "a", "--seed", "-1"], "--seed -1 is invalid"),
    # the largest seed these samples take, not the range SEED + i must lie in, which the seed
    # given did (a re-test)
    (["--prompt", "a", "--samples", "2", "--seed", str(2**63 - 1)],
     f"--seed {2**63 - 1} is invalid: sample i draws with seed SEED + i, which must be in "
     f"[0, 2**63 - 1]; give a seed from 0 to 9,223,372,036,854,775,806 (for these 2 samples)"),
    # a tokenizer larger than the model's vocabulary: refused only where a prompt's id fell
    # outside it ("," is id 11 in GPT-2's BPE, so the sample ran with other tokens' ids)
    (["--prompt", ",", "--tokenizer", "gpt2"],
     "--tokenizer gpt2 has 50,257 token ids, more than the model's vocabulary of"),
]


@pytest.mark.parametrize("imported", ["gpt2"], indirect=True)
@pytest.mark.parametrize("argv, line", BAD)
def test_bad_input_is_one_line_and_exit_2_before_any_model(imported, tmp_path, argv, line,
                                                            capsys, monkeypatch):
    _, _, ckpt = imported

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for bad input")

    monkeypatch.setattr("megapar.cli.worker_exit.run_workers", refuse)
    monkeypatch.setattr("megapar.cli.generate.load_model", refuse)
    (tmp_path / "long.txt").write_text(" ".join(["the"] * 40))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert generate(["--load", str(ckpt), "--tokenizer", "sentencepiece", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("megapar-generate: error: "), err
    assert line.replace("{tmp}", str(tmp_path)) in err[0]


@pytest.mark.parametrize("imported", ["gpt2"], indirect=True)
def test_a_torchrun_world_other_than_tp_x_pp_is_refused_by_all_and_said_once(
        imported, capsys, monkeypatch):
    """3 torchrun processes for --tp 2: every one exits 2 before any model; only LOCAL_RANK 0
    says why (each of them printed the line), in megapar-eval's words."""
    _, _, ckpt = imported

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for a refused job")

    monkeypatch.setattr("megapar.cli.worker_exit.run_workers", refuse)
    monkeypatch.setenv("WORLD_SIZE", "3")
    said = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert generate(["--load", str(ckpt), "--tokenizer", "sentencepiece", "--prompt", "a",
                         "--tp", "2"]) == 2
        said.append(capsys.readouterr().err)
    assert said == ["megapar-generate: error: torchrun / Slurm started 3 processes but "
                    "megapar-generate runs on tp x pp = 2 x 1 = 2 (it has no data parallelism); "
                    "start 2 or change --tp / --pp\n", "", ""]


def _signalled_self(signum):
    """A worker that sends `signum` to its own process (at tp 1: the command's)."""

    def worker(args):
        import os
        import time

        os.kill(os.getpid(), signum)
        time.sleep(60)

    return worker


@pytest.mark.parametrize("imported", ["gpt2"], indirect=True)
@pytest.mark.parametrize("signum, rc, what", [
    (signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_ctrl_c_or_sigterm_at_tp_1_is_the_one_line_of_tp_2(imported, tmp_path, signum, rc,
                                                              what):
    """At tp 1 x pp 1 the rank runs in the command's own process: a SIGTERM ended it with no
    word (-15), a Ctrl-C with a KeyboardInterrupt traceback (-2)."""
    import megapar.cli.generate as generate_cli
    from forked import exit_code, fork_running

    _, _, ckpt = imported
    out = tmp_path / "out.txt"

    def run():
        generate_cli._worker = _signalled_self(signum)
        return generate(["--load", str(ckpt), "--tokenizer", "sentencepiece", "--prompt", "a"])

    got = exit_code(fork_running(run, out))
    err = out.read_text().strip()
    assert (got, err) == (rc, f"megapar-generate: {what}"), err


def test_a_missing_checkpoint_or_a_transformers_directory_is_named(tmp_path, capsys):
    assert generate(["--load", str(tmp_path / "nothing"), "--prompt", "a"]) == 2
    assert f"--load {tmp_path / 'nothing'}: no such checkpoint directory" in \
        capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert generate(["--load", str(tmp_path / "hf"), "--prompt", "a"]) == 2
    assert capsys.readouterr().err == (
        f"megapar-generate: error: --load {tmp_path / 'hf'} is a Hugging Face directory, not "
        f"a megapar checkpoint; import it first: megapar-convert --from-hf {tmp_path / 'hf'} "
        f"CKPT, then --load CKPT\n")
    # a BERT one is not sent to an import whose checkpoint would then be refused
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "bert"}')
    assert generate(["--load", str(tmp_path / "hf"), "--prompt", "a"]) == 2
    assert capsys.readouterr().err == (
        f"megapar-generate: error: --load {tmp_path / 'hf'} is a Hugging Face bert, a masked "
        f"language model; megapar-generate continues text with a causal one (GPT-2, Llama and "
        f"its kin)\n")


class _Counting(torch.nn.Module):
    """A stand-in stage model whose most likely next token is the last one + 1."""

    def forward(self, hidden, batch):
        ids = batch["input_ids"]
        return torch.nn.functional.one_hot((ids + 1) % VOCAB, VOCAB).float()


@pytest.mark.parametrize("eos, limit, new, stop", [
    (13, 32, [11, 12, 13], "eos"),  # the end-of-sequence token is kept and ends it
    (None, 32, [11, 12, 13, 14, 15], "max_new_tokens"),
    (None, 4, [11, 12], "positions"),
])
def test_a_sample_stops_at_eos_max_new_tokens_or_the_positions(eos, limit, new, stop):
    from megapar.mesh import Mesh
    from megapar.training.generate import Sampling, generate as grow

    out = grow(_Counting(), Mesh.from_env(1, 1, 1), [9, 10], 5, Sampling(temperature=0),
               torch.Generator(), 8, VOCAB, limit, eos)
    assert (out.prompt_ids, out.new_ids, out.stop) == ([9, 10], new, stop)


@pytest.mark.parametrize("imported", ["gpt2"], indirect=True)
def test_the_text_is_prompt_and_completion_without_the_end_of_sequence_token(imported, capsys,
                                                                            monkeypatch):
    _, _, ckpt = imported
    tok = load_tokenizer("sentencepiece")
    new = [*tok.encode(" and so on"), EOS]

    def rank_0_printing(worker, world_size, args, **kwargs):  # as the worker prints a batch
        args.printer.batch(0, [(new, "eos")])
        return [None]

    monkeypatch.setattr("megapar.cli.worker_exit.run_workers", rank_0_printing)
    argv = ["--load", str(ckpt), "--tokenizer", "sentencepiece", "--prompt", "Hello world"]
    assert generate(argv) == 0
    said = capsys.readouterr()
    assert said.out == "Hello world and so on\n" + "-" * 15 + "\n"
    # a completion the model ended early reads as the command's fault unless said (README's
    # "ROMEO:" gave "And for love" and nothing more: a new user's tryout)
    assert said.err == ("megapar-generate: the sample ended where the model chose its "
                        "end-of-text token, after 3 new tokens of --max-new-tokens 100 (another "
                        "--seed, or --samples N, draws others)\n"), said.err
    assert generate([*argv, "--json"]) == 0
    said = capsys.readouterr()
    assert "end-of-text" not in said.err  # --json's "stop" says it
    assert json.loads(said.out) == {
        "prompt": "Hello world", "sample": 0, "completion": " and so on",
        "prompt_ids": tok.encode("Hello world"), "new_ids": new, "stop": "eos"}

    # several samples: one line for those ended, after the last (a line for each was 63 lines
    # for --samples 64, each offering --samples N; a new user's tryout)
    def three_samples(worker, world_size, args, **kwargs):
        args.printer.batch(0, [(new, "eos"), ([*new[:-1], 5, 6], "max_new_tokens"),
                               ([new[0], EOS], "eos")])
        args.printer.finish()
        return [None]

    monkeypatch.setattr("megapar.cli.worker_exit.run_workers", three_samples)
    assert generate([*argv, "--samples", "3"]) == 0
    said = capsys.readouterr()
    assert said.out.count("-" * 15) == 3 and said.err == (
        "megapar-generate: 2 of the 3 samples ended where the model chose its end-of-text "
        "token, after 1 to 3 new tokens of --max-new-tokens 100 (--json's \"stop\" names "
        "each)\n"), said.err

    def at_the_positions(worker, world_size, args, **kwargs):  # the same for the positions
        args.printer.batch(0, [(new[:2], "positions")] * 3)
        args.printer.finish()
        return [None]

    monkeypatch.setattr("megapar.cli.worker_exit.run_workers", at_the_positions)
    assert generate([*argv, "--samples", "3"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("megapar-generate: 3 of the 3 samples stopped at the model's ") and \
        err.endswith("(2 new tokens each)\n"), err

    def one_new_token(worker, world_size, args, **kwargs):  # "1 new tokens each" (a re-test)
        args.printer.batch(0, [(new[:1], "positions")] * 2)
        args.printer.finish()
        return [None]

    monkeypatch.setattr("megapar.cli.worker_exit.run_workers", one_new_token)
    assert generate([*argv, "--samples", "2", "--json"]) == 0
    err = capsys.readouterr().err
    assert err.endswith(" (1 new token each) (--json's \"stop\" names each)\n"), err


def test_the_positions_note_counts_one_new_token_in_the_singular():
    from megapar.cli.generate import positions_note

    assert positions_note(0, 0, (1, 1), "the model's 64 positions", 63, 1) == (
        "megapar-generate: the sample stopped at the model's 64 positions (its prompt's 63 "
        "tokens and 1 new one)")
    assert positions_note(0, 1, (1, 2), "the model's 32 positions", 30, 2).endswith(
        "and 2 new ones)")
    # the numbers --json gives its records ("sample" from 0 for each prompt, prompts in order)
    assert positions_note(2, 1, (3, 2), "the model's 32 positions", 30, 2).startswith(
        "megapar-generate: prompt 2's sample 1 stopped at")
    assert positions_note(0, 1, (1, 2), "x", 30, 2).startswith("megapar-generate: sample 1 ")


KV_MODELS = {  # tiny ones of each attention: GPT-2's, Llama's GQA, Qwen3's q / k norms,
    # Qwen2's q / k / v biases, Mixtral's (dropless MoE) routed one token at a time
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                            n_positions=32),
    "llama": lambda: transformers.LlamaConfig(**LLAMA_KV),
    "qwen3": lambda: transformers.Qwen3Config(**LLAMA_KV, head_dim=16),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_KV),
    "mixtral": lambda: transformers.MixtralConfig(**LLAMA_KV, num_local_experts=4,
                                                  num_experts_per_tok=2),
}
LLAMA_KV = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


@pytest.mark.parametrize("kind", list(KV_MODELS))
def test_the_kv_cache_gives_each_steps_logits_forwarding_one_position_per_token(kind):
    """Greedy with the KV cache: the tokens and each step's fp32 logits (within 1e-5 of their
    largest) of the whole sequence's forward per token, and after the prompt's forward one
    position per new token."""
    from megapar.mesh import Mesh
    from megapar.models import config_from_hf
    from megapar.pipeline.partition import build_stage

    config = config_from_hf(KV_MODELS[kind]())
    mesh = Mesh.from_env(1, 1, 1)
    model = build_stage(config, mesh, seed=0).eval()
    with torch.no_grad():  # non-zero biases and norms, a peaked distribution
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "embed" in name:
                p.mul_(4.0)
    prompt = _ids(PROMPTS[0])
    from megapar.models.kv_cache import KVCache

    made, real_mask = [], KVCache._mask
    KVCache._mask = lambda self, *a: made.append(a[:2]) or real_mask(self, *a)
    try:
        (cached, cached_seen, cached_logits), (plain, plain_seen, plain_logits) = _both_ways(
            model, mesh, config, prompt, 8)
    finally:
        KVCache._mask = real_mask
    assert made == [(len(prompt), len(prompt))] + [(1, len(prompt) + i) for i in range(1, 8)]
    assert cached == plain and len(cached) == 8
    assert cached_seen == [len(prompt)] + [1] * 7
    assert plain_seen == [len(prompt) + i for i in range(8)]
    for step, (a, b) in enumerate(zip(cached_logits, plain_logits, strict=True)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (kind, step)
    assert all(m.kv_cache is None for m in model.modules() if hasattr(m, "kv_cache"))
    _batch_equals_each_alone(model, mesh, config, [prompt, prompt[:2], prompt[1:4]], kind)


def _batch_equals_each_alone(model, mesh, config, prompts, kind):
    """Greedy, one left-padded batch: each row's tokens, stop and each step's fp32 logits
    (within 1e-5 of their largest) are the prompt's generated alone; the second row stops at
    its end-of-sequence token (its 3rd token alone taken as one) and leaves the batch while
    another goes on."""
    from megapar.training import generate as gen

    def run(rows, eos):
        logits: list = []
        real = gen.last_logits
        gen.last_logits = lambda *a: logits.append(real(*a)) or logits[-1]
        try:
            out = gen.generate_batch(model, mesh, rows, 6, gen.Sampling(temperature=0),
                                     [torch.Generator() for _ in rows], config.hidden_size,
                                     config.vocab_size, config.max_positions, eos)
        finally:
            gen.last_logits = real
        return out, logits

    eos = run([prompts[1]], None)[0][0].new_ids[2]
    batch, batch_logits = run(prompts, eos)
    lengths = [len(g.new_ids) for g in batch]
    assert batch[1].stop == "eos" and lengths[1] <= 3 and max(lengths) == 6, lengths
    active = [[r for r, g in enumerate(batch) if len(g.new_ids) > k] for k in range(6)]
    assert [len(x) for x in batch_logits] == [len(rows) for rows in active]
    for r, prompt in enumerate(prompts):
        (alone,), alone_logits = run([prompt], eos)
        assert (batch[r].new_ids, batch[r].stop) == (alone.new_ids, alone.stop), (kind, r)
        for k, want in enumerate(alone_logits):
            got = batch_logits[k][active[k].index(r)]
            assert (got - want[0]).abs().max() <= 1e-5 * want[0].abs().max(), (kind, r, k)


def _both_ways(model, mesh, config, prompt, new_tokens):
    """Greedy generation of `new_tokens` tokens with the cache, then without: for each, the new
    ids, the positions this stage's first layer forwards each time, and `last_logits`' result
    per step (float32; None off the last stage)."""
    from megapar.training import generate as gen

    seen: list[int] = []
    hook = next(iter(model.layers.values())).register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1]))
    logits: list = []
    real = gen.last_logits
    gen.last_logits = lambda *a: logits.append(real(*a)) or logits[-1]
    runs = []
    try:
        for cache in (True, False):
            seen.clear()
            logits.clear()
            out = gen.generate(model, mesh, prompt, new_tokens, gen.Sampling(temperature=0),
                               torch.Generator(), config.hidden_size, config.vocab_size,
                               config.max_positions, None, cache=cache)
            runs.append((out.new_ids, list(seen), list(logits)))
    finally:
        gen.last_logits = real
        hook.remove()
    return runs


def _cached_and_plain(ckpt, prompt):
    """`_both_ways` on this rank at tp 2 x pp 2, the logits as lists (sent back from a forked
    rank), and the point-to-point messages and broadcasts it issued in order."""
    import torch.distributed as dist

    from megapar.training.inference import load_model

    mesh, config, model, _ = load_model(str(ckpt), 2, 2)
    issued: list = []
    real = {name: getattr(dist, name) for name in ("send", "recv", "broadcast")}

    def recording(name):
        def call(tensor, *args, **kwargs):
            peer = kwargs.get("dst", kwargs.get("src", args[0] if args else None))
            issued.append((name, peer, tuple(tensor.shape), str(tensor.dtype)))
            return real[name](tensor, *args, **kwargs)
        return call

    try:
        for name in real:
            setattr(dist, name, recording(name))
        runs = _both_ways(model, mesh, config, prompt, 6)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return [(ids, seen, [None if x is None else x.tolist() for x in logits])
            for ids, seen, logits in runs], (mesh.rank, issued)


def _follows_nccl_rules(issued: dict[int, list]) -> None:
    """The ranks' blocking sends and receives (each its own group call) pair in issue order
    with the same shape and dtype and finish under NCCL's rules (no buffering, tags ignored);
    every rank broadcasts the same tokens from the same source in the same order."""
    from megapar.pipeline import nccl_rules

    streams = {rank: [[nccl_rules.Op(name == "send", peer, (shape, dtype), f"{name}{i}")]
                      for i, (name, peer, shape, dtype) in enumerate(calls) if name != "broadcast"]
               for rank, calls in issued.items()}
    assert all(streams.values())
    nccl_rules.check(streams)
    broadcasts = {rank: [c for c in calls if c[0] == "broadcast"] for rank, calls in issued.items()}
    assert len({tuple(b) for b in broadcasts.values()}) == 1 and broadcasts[0], broadcasts


@pytest.mark.parametrize("imported", ["gpt2", "llama"], indirect=True)
def test_the_kv_cache_at_tp2_pp2_crosses_stages_with_one_position(imported):
    """Each stage's first layer forwards the prompt, then one position per new token, and the
    last stage's logits of each step are the whole sequence's (fp32, within 1e-5 of their
    largest), on both of its tp ranks; the stages' messages follow NCCL's rules and every rank
    takes each token (and so the stop) from the same broadcast."""
    from megapar.launcher import run_workers

    _, _, ckpt = imported
    prompt = _ids(PROMPTS[0])
    ranks, issued = zip(*run_workers(_cached_and_plain, 4, ckpt, prompt))
    for (cached, cached_seen, cached_logits), (plain, plain_seen, plain_logits) in ranks:
        assert cached == plain and len(cached) == 6
        assert cached_seen == [len(prompt)] + [1] * 5
        assert plain_seen == [len(prompt) + i for i in range(6)]
        for a, b in zip(cached_logits, plain_logits, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                a, b = torch.tensor(a), torch.tensor(b)
                assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert sum(logits[0] is not None for *_, logits in (r[0] for r in ranks)) == 2  # last stage
    _follows_nccl_rules(dict(issued))


WINDOWED = {  # a sliding window of 4: Mistral's in every layer, Qwen2's in its second only
    "mistral": lambda: transformers.MistralConfig(**LLAMA_KV, sliding_window=4),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_KV, use_sliding_window=True,
                                              sliding_window=4, max_window_layers=1),
}


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request, tmp_path_factory):
    """(kind, transformers model with a sliding window of 4, its saved directory)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(WINDOWED[request.param]()).eval()
    with torch.no_grad():  # a peaked distribution: greedy ties are out of reach of rounding
        hf.get_input_embeddings().weight.mul_(4.0)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def test_greedy_beyond_a_sliding_window_equals_transformers_generate(windowed):
    """A prompt longer than the sliding window and 12 new tokens: greedy with the KV cache
    (one position per token, the window over the cached keys) and without it give
    transformers' `generate(do_sample=False, use_cache=True)` tokens, and the same logits at
    each step (fp32, within 1e-5 of their largest)."""
    from megapar.checkpoint.hf import HFReader, load_hf_weights
    from megapar.mesh import Mesh
    from megapar.models import Llama

    kind, hf, path = windowed
    reader = HFReader(str(path))
    config, mesh = reader.config, Mesh.from_env(1, 1, 1)
    model = Llama(config, mesh)
    assert load_hf_weights(model, reader) == []
    prompt = _ids(PROMPTS[0])
    assert len(prompt) > config.attention_window == 4
    (cached, cached_seen, cached_logits), (plain, _, plain_logits) = _both_ways(
        model.eval(), mesh, config, prompt, 12)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           use_cache=True, max_new_tokens=12, pad_token_id=EOS)[0, len(prompt):]
    assert cached == plain == want.tolist(), kind
    assert cached_seen == [len(prompt)] + [1] * 11
    for a, b in zip(cached_logits, plain_logits, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), kind
    # a left-padded batch: the window in the pad mask's slots (a row's positions are its slots
    # less its pads, so the same distances)
    _batch_equals_each_alone(model, mesh, config, [prompt, prompt[:2], _ids(PROMPTS[1])], kind)


WINDOWED_PROMPTS = ["Now is the winter of our discontent", PROMPTS[0], "Hello world!", "To be"]


def _windowed_generate(path, tp: int, pp: int, prompts: list[list[int]], new: int):
    """This rank's greedy `generate_batch` of `prompts` (one left-padded batch, `new` tokens
    each) at tp x pp from the transformers model saved at `path`: the new ids, each cache's
    (window, trims, shape of its keys) once the batch ended, and the most keys a trimming
    cache's queries attended over in a step of one new position."""
    from megapar.checkpoint.hf import HFReader, load_hf_weights
    from megapar.mesh import Mesh
    from megapar.models import kv_cache as kv
    from megapar.pipeline.partition import build_stage
    from megapar.training import generate as gen

    mesh = Mesh.from_env(tp, pp, 1)
    reader = HFReader(str(path))
    config = reader.config
    model = build_stage(config, mesh, seed=0, init=False)
    assert load_hf_weights(model, reader) == []
    caches: list = []
    decode_keys = [0]
    real_cache, real_append = gen.kv_cache, kv.KVCache.append

    @contextlib.contextmanager
    def kept(*args):
        with real_cache(*args) as made:
            caches.extend(made)
            yield made

    def append(self, k, v):
        keys, values = real_append(self, k, v)
        if self.trims and k.shape[2] == 1:
            decode_keys[0] = max(decode_keys[0], keys.shape[2])
        return keys, values

    gen.kv_cache, kv.KVCache.append = kept, append
    try:
        out = gen.generate_batch(model.eval(), mesh, prompts, new, gen.Sampling(temperature=0),
                                 [torch.Generator() for _ in prompts], config.hidden_size,
                                 config.vocab_size, config.max_positions, None)
    finally:
        gen.kv_cache, kv.KVCache.append = real_cache, real_append
    return ([g.new_ids for g in out], [(c.window, c.trims, tuple(c.k.shape)) for c in caches],
            decode_keys[0])


def test_a_sliding_windows_cache_keeps_the_window_and_batches_equal_transformers(windowed):
    """Prompts of 14, 7, 5 and 2 tokens and 16 new ones in one left-padded batch, at tp 1 and at
    tp 2 x pp 2 (Qwen2's full layer on one stage, its windowed one on the other): the greedy
    tokens of transformers' left-padded batch with an attention_mask (the 2 tokens' row keeps
    a pad slot in its rolling buffer, which has wrapped, past the prefill). A windowed layer's cache
    ends as [rows, this rank's kv heads, window, head_dim] (the rolling buffer: the 30
    positions generated are not kept) and a step of one new position attends over the window's
    4 keys; a full layer's keeps every position (the batch's 30)."""
    from megapar.launcher import run_workers

    kind, hf, path = windowed
    rows = [_ids(p) for p in WINDOWED_PROMPTS]
    width, new = max(map(len, rows)), 16
    assert [len(r) for r in rows] == [14, 7, 5, 2] and width + new <= 32
    ids = torch.tensor([[EOS] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, do_sample=False, use_cache=True,
                           max_new_tokens=new, pad_token_id=EOS)[:, width:].tolist()
    for tp, ranks in ((1, [_windowed_generate(path, 1, 1, rows, new)]),
                      (2, run_workers(_windowed_generate, 4, path, 2, 2, rows, new))):
        for tokens, caches, decode_keys in ranks:
            assert tokens == want, (kind, tp)
            for window, trims, shape in caches:
                kv_heads = 2 // tp
                if window is None:
                    assert kind == "qwen2" and shape == (4, kv_heads, width + new, 8)
                else:
                    assert trims and shape == (4, kv_heads, 4, 8), (kind, tp, shape)
            assert decode_keys == (4 if any(c[1] for c in caches) else 0)
        assert sum(len(c) for _, c, _ in ranks) == 2 * tp  # each layer on each of its tp ranks


def _attention_over_all(q, k, v, first: int, window, pads):
    """SDPA of the queries of positions first.. over the keys of every position 0.. (under the
    window, the pad slots seen by no other slot): what a cache's attention must give."""
    from megapar.context_parallel.kernels import in_window

    keys, queries = torch.arange(k.shape[2]), torch.arange(first, first + q.shape[2])
    seen = in_window(queries, keys, window) if window else keys[None] <= queries[:, None]
    if pads is not None:
        real = keys[None] >= pads[:, None]
        seen = (seen[None] & (real[:, None] | (keys[None] == queries[:, None])[None]))[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen)


@pytest.mark.parametrize("pads", [None, [0, 3, 1]])
def test_a_trimmed_cache_attends_as_one_over_every_position(pads):
    """Forwards of 5, 1, 3, 1, 1, 6, 1, 2 positions (after the first, more than one new
    position grows the rolling buffer) through the caches of layers of windows 3, none, 3, 4,
    none sharing a step's masks, a row dropped midway: each forward's attention is that over
    every position so far (fp32, 1e-5); a step makes at most one mask per kind of layer (3);
    a window's buffer holds window - 1 + the most positions a forward after the first added."""
    from megapar.models.kv_cache import KVCache, StepMasks

    torch.manual_seed(0)
    chunks, total, windows = [5, 1, 3, 1, 1, 6, 1, 2], 20, [3, None, 3, 4, None]
    pad = None if pads is None else torch.tensor(pads)
    q, k, v = (torch.randn(3, 2, total, 4) for _ in range(3))
    masks = StepMasks()
    caches = [KVCache(total, pad, masks, w) for w in windows]
    made, real_mask = [], KVCache._mask
    rows, at = torch.arange(3), 0
    KVCache._mask = lambda self, *a: made.append(self.length) or real_mask(self, *a)
    try:
        for step, s in enumerate(chunks):
            if step == 4:  # row 1 finished
                keep = torch.tensor([0, 2])
                rows = rows[keep]
                pad = None if pad is None else pad[keep]
                for cache in caches:
                    cache.keep_rows(keep)
            new = slice(at, at + s)
            for window, cache in zip(windows, caches, strict=True):
                got = cache.attend(q[rows][:, :, new], k[rows][:, :, new], v[rows][:, :, new])
                want = _attention_over_all(q[rows][:, :, new], k[rows][:, :, : at + s],
                                           v[rows][:, :, : at + s], at, window, pad)
                assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (window, step)
            at += s
            assert made.count(at) <= 3, (step, made)
    finally:
        KVCache._mask = real_mask
    assert [(c.trims, c.k.shape[2]) for c in caches] == [
        (True, 8), (False, 20), (True, 8), (True, 9), (False, 20)]


@pytest.mark.parametrize("argv, line", [
    (["--num_return_sequences", "3"],
     "--num_return_sequences: did you mean --samples (samples per prompt)?"),
    (["--do_sample"], "--do_sample: megapar-generate samples by default (--temperature 0 is "
     "greedy); drop it"),
    # megapar-eval's (a reference reader's: "did you mean --tp?")
    (["--data", "a.txt"], "--data: megapar-generate continues prompts (--prompt TEXT, "
     "--prompt-file FILE); megapar-eval --load CKPT --data FILE gives a checkpoint's loss"),
])
def test_transformers_generate_flags_are_answered(argv, line, capsys):
    """transformers' `generate` names (a Hugging Face user's): one line naming megapar's way
    (--do_sample was answered with --samples, the number of samples)."""
    with pytest.raises(SystemExit) as stop:
        generate(["--load", "ckpt", "--prompt", "a", *argv])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(err) == 1 and line in err[0], err


def test_each_file_of_the_checkpoint_is_hashed_once(imported, capsys, monkeypatch):
    """megapar-generate's start-up hashed every file of --load, then its rank (at --tp 1 this
    very process, reading all four files of the tp 2 x pp 2 checkpoint) hashed them again (2
    hashes of each file); the rank now loads the step directory the start-up checked with the
    sizes checked only: each file hashed once."""
    import megapar.checkpoint.manifest as manifest_module
    from megapar.checkpoint.publish import resolve_checkpoint

    _, _, ckpt = imported
    hashed = []
    record = manifest_module.file_record
    monkeypatch.setattr(manifest_module, "file_record",
                        lambda path: hashed.append(Path(path).name) or record(path))
    assert len(_run(ckpt, capsys, "--prompt", "To be", "--max-new-tokens", "1")) == 1
    files = sorted(p.name for p in resolve_checkpoint(ckpt).glob("*.safetensors"))
    assert len(files) == 4 and sorted(hashed) == files


def test_a_temperature_whose_division_overflows_samples_the_largest_logit():
    """--temperature 1e-45 passed the checks, and logits / 1e-45 overflowed to inf: the rank
    failed mid-generation drawing from NaN probabilities (a helper's find). Such a temperature
    draws the largest logit, as any small one does; a usual one is unchanged, bit for bit."""
    from megapar.training.generate import Sampling, filtered_logits, next_token

    logits = torch.tensor([0.5, 2.0, -1.0, 1.9])
    gen = torch.Generator().manual_seed(0)
    for t in (1e-45, 1e-38):
        assert [next_token(logits, Sampling(temperature=t), gen) for _ in range(20)] == [1] * 20
    assert torch.equal(filtered_logits(logits, Sampling(temperature=0.7)), logits / 0.7)


@pytest.mark.parametrize("dp,cp", [(2, 1), (1, 2)])
def test_generate_batch_refuses_a_mesh_with_replicas(dp, cp):
    """Each token is broadcast over the world from the last stage's tp rank 0 of the caller's
    own dp / cp coordinates: on a mesh with dp or cp replicas the ranks would name different
    sources (a hang under NCCL; a reviewer's finding). megapar-generate builds tp x pp alone;
    any other caller is refused in one line before a token."""
    from types import SimpleNamespace

    from megapar.training.generate import Sampling, generate_batch

    mesh = SimpleNamespace(dp=dp, cp=cp, tp=1, pp=1)
    with pytest.raises(ValueError, match=f"dp={dp} cp={cp}; build the mesh with dp = cp = 1"):
        generate_batch(None, mesh, [[1, 2]], 2, Sampling(temperature=0), [torch.Generator()],
                       8, 16, 32, None)
