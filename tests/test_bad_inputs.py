"""Every bad input is caught in the launching process: exit code 2, one line on stderr naming
the problem, and no worker started (starting one fails the test)."""

import functools
import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

import megapar.cli.train as train_cli
import megapar.cli.worker_exit as worker_exit
import megapar.launcher as launcher
import megapar.training.bubble as bubble_engine
import megapar.training.bubble_run as bubble_run
from megapar.cli.bubble import main as bubble
from megapar.cli.eval import main as evaluate
from megapar.cli.train import main as train
from megapar.data import asset_path
from megapar.models.recipes import recipe_dirs

RECIPES = recipe_dirs()[0]
"""Where megapar's recipe files lie (this source tree's models/)."""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Text, a cache, a tiny model, its 1-step checkpoint (and a corrupted copy), a dataset."""
    root = tmp_path_factory.mktemp("bad")
    text = root / "text.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    model = root / "tiny.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                 "n_positions": 64}))
    cache, ckpt = root / "cache", root / "ckpt"
    common = ["--data", str(text), "--data-cache", str(cache), "--tokenizer", "sentencepiece",
              "--model", str(model), "--seq-len", "32", "--no-progress"]
    assert train([*common, "--max-steps", "1", "--save", str(ckpt)]) == 0
    corrupt = root / "corrupt"
    shutil.copytree(ckpt, corrupt)
    shard = next((corrupt / "step_00000001").glob("model_*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    prefix = str(next(cache.glob("*.bin")))[:-4]
    shutil.copy(prefix + ".bin", root / "empty_idx.bin")  # a 0-byte .idx and no .json
    (root / "empty_idx.idx").write_bytes(b"")
    configs = {}
    for name, content in {"missing.yaml": None, "bad.yaml": "seq_len: [1, 2\n",
                          "bad.json": "{\"seq_len\": 32,}", "list.yaml": "- 1\n- 2\n",
                          "typo.yaml": "max_step: 3\n", "choice.yaml": "schedule: zigzag\n",
                          "half.yaml": "log_interval: 2.5\n", "null.json": "{\"lr\": null}",
                          "switch.yaml": "sequence_parallel: \"maybe\"\n",
                          "word.yaml": "lr: fast\n", "flag.yaml": "max_steps: true\n",
                          "garbage.model": "not a sentencepiece model"}.items():
        if content is not None:
            (root / name).write_text(content)
        configs[name] = str(root / name)
    negative = root / "negative.json"
    negative.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": -2,
                                    "n_head": 4, "resid_pdrop": 1.5}))
    ids = {}
    for name, array in {"float": np.zeros((1, 4)), "flat": np.zeros(4, dtype=np.int64),
                        "long": np.zeros((1, 100), dtype=np.int64),
                        "good": np.zeros((1, 4), dtype=np.int64)}.items():
        ids[name] = root / f"{name}.npy"
        np.save(ids[name], array)
    ids["json"] = root / "ids.json"  # ids as JSON, and an object array (pickled by numpy)
    ids["json"].write_text("[[1, 2, 3]]")
    ids["object"] = root / "object.npy"
    np.save(ids["object"], np.array([[1, "a"]], dtype=object), allow_pickle=True)
    (root / "empty_dir").mkdir()
    (root / "mixed").mkdir()  # text and a dataset megapar-data wrote beside it
    (root / "mixed" / "a.txt").write_text("text to train on\n")
    (root / "few_words.txt").write_text("A few words.\n")
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(prefix + ext, root / "mixed" / f"tok{ext}")
    import torch
    from transformers import BertConfig, BertForMaskedLM, GPT2Config

    # a BERT with one token type (RoBERTa-style): trained, segment B's type 1 was out of range
    (root / "bert_t1.json").write_text(json.dumps({
        "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
        "type_vocab_size": 1}))
    configs["bert_t1.json"] = str(root / "bert_t1.json")
    BertForMaskedLM(BertConfig(vocab_size=1004, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=64, type_vocab_size=1)
                    ).save_pretrained(root / "bert_t1_hf")
    from megapar.cli.convert import main as convert
    assert convert(["--from-hf", str(root / "bert_t1_hf"), str(root / "bert_t1_ckpt")]) == 0

    GPT2Config(vocab_size=1004, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=2,
               eos_token_id=2).save_pretrained(root / "pickled_hf")
    torch.save({"transformer.wte.weight": shutil.rmtree}, root / "pickled_hf" / "pytorch_model.bin")
    return dict(common=common, ckpt=str(ckpt), corrupt=str(corrupt), prefix=prefix,
                configs=configs, negative=str(negative), ids=ids, root=root)


TOO_MANY = str(2 * launcher.local_worker_limit())
"""More local workers than this machine is allowed to start without --oversubscribe."""


@pytest.fixture
def no_workers(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started for a bad input")

    for target, name in [(train_cli, "run_workers"), (launcher, "run_workers"),
                         (worker_exit, "run_workers"),  # megapar-eval's and -generate's
                         (launcher, "run_local"), (bubble_engine, "measure"),
                         (bubble_run, "simulate")]:
        monkeypatch.setattr(target, name, refuse)


TRAIN = [
    (["--global-batch-size", "0"], "--global-batch-size 0 is invalid: it must be a whole number >= 1"),
    (["--global-batch-size", "-8"], "--global-batch-size -8 is invalid"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0 is invalid"),
    (["--max-steps", "0"], "--max-steps 0 is invalid"),
    (["--warmup-steps", "-1"], "--warmup-steps -1 is invalid"),
    (["--lr", "nan"], "--lr nan is invalid: it must be a finite number > 0.0"),
    (["--adam-beta2", "1"], "--adam-beta2 1.0 is invalid: it must be in [0, 1)"),
    (["--load", "{ckpt}", "--model", "llama-tiny"],
     "holds a gpt2 model and --model llama-tiny is a llama; with --load the model comes from"),
    (["--load", "{ckpt/latest/ck}"], "is a file, so no checkpoint can be there"),
    (["--adam-beta1", "nan"], "--adam-beta1 nan is invalid"),
    (["--lr", "inf"], "--lr inf is invalid"),
    (["--lr", "0"], "--lr 0.0 is invalid"),
    (["--min-lr", "nan"], "--min-lr nan is invalid"),
    (["--min-lr", "0.5"], "--min-lr 0.5 is larger than --lr 0.001"),
    (["--weight-decay", "nan"], "--weight-decay nan is invalid"),
    (["--clip-grad", "nan"], "--clip-grad nan is invalid"),
    (["--val-fraction", "-0.5"], "--val-fraction -0.5 is invalid"),
    (["--val-fraction", "1"], "--val-fraction 1.0 is invalid: it is the share of documents"),
    (["--timeout-s", "0"], "--timeout-s 0.0 is invalid"),
    (["--timeout-s", "-5"], "--timeout-s -5.0 is invalid"),
    (["--timeout-s", "1e15"], "--timeout-s 1e+15 is invalid: at most 1e+09 s (about 31 years"),
    # below 1 ms one line, the same as 0's (">= 0.001", not "> 0.0": a re-test)
    (["--timeout-s", "1e-300"], "--timeout-s 1e-300 is invalid: it must be a finite number >= "
                                "0.001 (torch counts a wait in whole milliseconds: a shorter one "
                                "times out at once; the default is 300.0)"),
    (["--timeout-s", "0"], "--timeout-s 0.0 is invalid: it must be a finite number >= 0.001 ("),
    (["--nccl-timeout-s", "0.0001"], "--nccl-timeout-s 0.0001 is invalid: it must be a finite "
                                     "number >= 0.001"),
    # just above the bound: the value as given (1e+09 read as the bound itself: a re-test)
    (["--timeout-s", "1000000001"], "--timeout-s 1000000001 is invalid: at most 1e+09 s"),
    (["--nccl-timeout-s", "1e10"], "--nccl-timeout-s 1e+10 is invalid: at most 1e+09 s"),
    (["--log-interval", "0"], "--log-interval 0 is invalid"),
    (["--peak-tflops", "0"], "--peak-tflops 0.0 is invalid"),
    (["--eval-steps", "0"], "--eval-steps 0 is invalid"),
    (["--eval-interval", "-1"], "--eval-interval -1 is invalid"),
    (["--tp", "0"], "--tp 0 is invalid"),
    (["--zero3-keep-params"], "--zero3-keep-params would be ignored: it applies to --zero 3, "
     "and --zero is 0: add --zero 3, or drop --zero3-keep-params"),
    # the --zero3-* and --fp8-* flags a run would not read are named with the others, in one
    # line (each was refused alone, a run apiece; a re-test of 62a971a0)
    (["--zero3-keep-params", "--zero3-persistence-threshold", "100", "--fp8-layers", "all",
      "--muon-momentum", "0.9"], "--muon-momentum 0.9 would be ignored: it is Muon's, and "
     "--optimizer is adamw: add --optimizer muon, or drop --muon-momentum; and "
     "--zero3-keep-params and --zero3-persistence-threshold 100 would be ignored: each applies "
     "to --zero 3, and --zero is 0: add --zero 3, or drop --zero3-keep-params and "
     "--zero3-persistence-threshold; and --fp8-layers all would be ignored: it applies to --fp8, "
     "and --fp8 is off: add --fp8 tensorwise (or --fp8 rowwise), or drop --fp8-layers"),
    # ... and --offload-params without --zero 3 with them (refused in a run of its own next;
    # a re-test), --zero 2's note on --zero3-reduce alone
    (["--zero", "2", "--zero3-keep-params", "--offload-params"], "--zero3-keep-params would be "
     "ignored: it applies to --zero 3, and --zero is 2: add --zero 3, or drop "
     "--zero3-keep-params; and --offload-params needs --zero 3 (it keeps the parameter shards in "
     "host memory; --zero 2 keeps whole parameters on the device): add --zero 3 and "
     "--offload-optimizer, or use --offload-optimizer alone"),
    (["--sp-regather", "--tp", "2"], "--sp-regather changes what sequence parallelism keeps "
                                     "for the backward: add --sequence-parallel with --tp > 1"),
    # --sequence-parallel given: tp is what is missing (a fuzz run's: "add --sequence-parallel")
    (["--sp-regather", "--sequence-parallel"], "for the backward: give --tp > 1 (sequence "
                                               "parallelism splits over tp), or drop"),
    (["--compile", "--inject-corrupt", "rank=0,step=1,module=layers.0"],
     "--inject-corrupt cannot be combined with --compile: its per-module hooks"),
    (["--zero", "2", "--zero3-reduce", "micro-batch"],
     "--zero3-reduce micro-batch would be ignored: it applies to --zero 3, and --zero is 2 "
     "(which reduces every micro-batch already)"),
    (["--zero3-persistence-threshold", "100"],
     "--zero3-persistence-threshold 100 would be ignored: it applies to --zero 3"),
    (["--zero", "3", "--zero3-persistence-threshold", "-1"],
     "--zero3-persistence-threshold -1 is invalid"),
    (["--zero", "3", "--grad-compression", "powersgd"],
     "--grad-compression powersgd cannot be combined with --zero 3"),
    (["--zero", "3", "--grad-reduce-dtype", "bf16"],
     "--grad-reduce-dtype bf16 is not served with --zero 3"),
    (["--grad-reduce-dtype", "bf16", "--grad-compression", "fp16"],
     "--grad-reduce-dtype bf16 and --grad-compression fp16 both choose how gradients travel"),
    # a rank that compresses no matrix: every gradient went uncompressed, unsaid (a tryout)
    (["--dp", "2", "--grad-compression", "powersgd", "--powersgd-rank", "32"],
     "--powersgd-rank 32 compresses nothing: every gradient matrix of this model would send at "
     "least as many numbers as it holds ((n + m) x rank >= n x m), so each would go "
     "uncompressed in fp32; give a rank of at most 31 (the default is 4)"),
    # at tp 2 the shards are smaller: the word embedding's 512 x 32 takes at most 30
    (["--dp", "2", "--tp", "2", "--grad-compression", "powersgd", "--powersgd-rank", "31"],
     "--powersgd-rank 31 compresses nothing: every gradient matrix of this model at --tp 2 "
     "would send"),
    (["--seed", "-1"], "--seed -1 is invalid: it must be a whole number from 0 to 4,294,967,295"),
    (["--tokenizer", "no-such-tokenizer"], "no-such-tokenizer"),
    (["--tp", "3"], "4 attention heads are not divisible by --tp 3"),
    (["--pp", "3"], "2 layers cannot be cut into --pp 3 stages"),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "2"],
     "--decoder-first-pipeline-num-layers 2 leaves 0 of the model's 2 layers for the other 1 "
     "of --pp 2 stages (each needs at least one); give at most 1"),
    (["--decoder-last-pipeline-num-layers", "1"], "--decoder-last-pipeline-num-layers 1 cuts the "
     "layers over pipeline stages, but --pp is 1 (one stage holds every layer)"),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "0"],
     "--decoder-first-pipeline-num-layers 0 is invalid"),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "1",
      "--account-for-loss-in-pipeline-split"], "not both"),
    (["--seq-len", "100"], "--seq-len 100 exceeds the model's maximum of 64 positions"),
    # was the dataset's "seq_len must be >= 5 ..., got 4", naming neither the flag nor the fix
    (["--model", "bert-tiny", "--seq-len", "4"], "--seq-len 4 is too short for a BERT model's "
                                                 "samples: [CLS] A [SEP] B [SEP] takes at least "
                                                 "5 tokens; raise --seq-len"),
    # was "IndexError: index out of range in self" from rank 0 at step 1
    (["--model", "{bert_t1.json}", "--seq-len", "32"], "the model's type_vocab_size is 1, and "
     "megapar's BERT samples ([CLS] A [SEP] B [SEP]) give segment B token type 1; use a BERT "
     "with type_vocab_size >= 2"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     "global batch size 10 is not divisible by micro-batch size 4 x dp 1 = 4; choose a "
     "--global-batch-size that is a multiple of 4 (8 or 12), or --micro-batch-size 1 / 2 / 5"),
    # the sizes nearest the given one that the schedule takes (a fuzz run's: DualPipeV at pp 2
    # was offered sizes leaving fewer than 4 micro-batches; zb-h1 at pp 4 the 3 largest, 24 one)
    (["--model", "llama-tiny", "--pp", "2", "--schedule", "dualpipev", "--global-batch-size",
      "4", "--micro-batch-size", "5"], "choose a --global-batch-size that is a multiple of 5 "
     "(20), or --micro-batch-size 1"),
    (["--model", "llama-tiny", "--pp", "4", "--schedule", "zb-h1", "--global-batch-size", "24",
      "--micro-batch-size", "5"], "a multiple of 5 (20 or 25), or --micro-batch-size 3 / 4 / 6"),
    # the micro-batch size not given adapts to any multiple of dp: "choose a multiple of 12"
    # (the default micro-batch size 4 x dp 3) was stricter than the fix needs
    (["--dp", "3", "--global-batch-size", "16"],
     "global batch size 16 is not divisible by dp 3: each dp rank takes an equal share; choose "
     "a multiple of 3 (e.g. 15 or 18; the micro-batch size, not given, then adapts to it)"),
    (["--config", "{missing.yaml}"], "no such config file"),
    # torchtitan's config registry name (--config llama3_8b): "no such config file" alone
    (["--config", "llama3_8b"], "llama3_8b: no such config file; torchtitan's module and "
     "config name a Python config of its registry"),
    (["--config", "{bad.yaml}"], "not valid YAML at line"),
    (["--config", "{bad.json}"], "not valid JSON at line 1"),
    (["--config", "{list.yaml}"], "expected a mapping of names to values, got a list"),
    (["--config", "{typo.yaml}"], "unknown setting 'max_step'; did you mean 'max_steps'?"),
    (["--config", "{choice.yaml}"], "choice.yaml: --schedule 'zigzag' is invalid: choose one of"),
    (["--config", "{half.yaml}"], "--log-interval 2.5 is invalid: it must be a whole number >= 1"),
    (["--model", "{negative}"],  # every bad value in the one line, not the first alone
     "n_layer=-2 must be a whole number >= 1; resid_pdrop=1.5 must be in [0, 1)"),
    (["--load", "/nonexistent/ckpt", "--load-strict"], "--load /nonexistent/ckpt: no such checkpoint directory"),  # without --load-strict, with --model: starts fresh (requeue)
    (["--load", "{empty_dir}", "--load-strict"], "empty_dir: no checkpoint there (--load-strict)"),
    (["--load", "{corrupt}"], "checksum mismatch"),
    (["--load", "{ckpt}", "--model", "gpt2-124m"], "holds another model than --model gpt2-124m"),
    (["--load", "{ckpt}", "--max-steps", "1"], "is at step 1 and --max-steps is 1"),
    # --config values are parsed like the flags: null and values a flag cannot take are errors
    (["--config", "{null.json}"], "--lr: null is not a value; remove the key to use the default"),
    (["--config", "{switch.yaml}"], "--sequence-parallel 'maybe' is invalid: a switch is true or "
                                    "false"),
    (["--config", "{word.yaml}"], "--lr 'fast' is invalid: expected a number"),
    (["--config", "{flag.yaml}"], "--max-steps True is invalid: expected a whole number"),
    # values that failed late (or never): refused up front
    (["--exit-duration-mins", "-1"], "--exit-duration-mins -1.0 is invalid: it must be a finite "
                                     "number > 0.0, or 0 for no limit"),
    (["--exit-duration-mins", "nan"], "--exit-duration-mins nan is invalid"),
    (["--exit-interval", "-2"], "--exit-interval -2 is invalid: it must be a whole number >= 1, "
                                "or 0 for never"),
    (["--max-nonfinite-steps", "-1"], "--max-nonfinite-steps -1 is invalid: it must be a whole "
                                      "number >= 1, or 0 for never stop"),
    (["--lr-scale-with-batch", "-1"], "--lr-scale-with-batch -1 is invalid: it must be a whole "
                                      "number >= 1, or 0 for off"),
    (["--adam-eps", "0"], "--adam-eps 0.0 is invalid: it must be a finite number > 0.0"),
    (["--adam-eps", "nan"], "--adam-eps nan is invalid"),
    (["--adam-eps", "inf"], "--adam-eps inf is invalid"),
    (["--adam-eps=-1e-8"], "--adam-eps -1e-08 is invalid"),
    (["--powersgd-rank", "0"], "--powersgd-rank 0 is invalid: it must be a whole number >= 1"),
    (["--powersgd-rank", "-2"], "--powersgd-rank -2 is invalid"),
    (["--grad-bucket-mb", "nan"], "--grad-bucket-mb nan is invalid: it must be a finite number"),
    (["--grad-bucket-mb", "inf"], "--grad-bucket-mb inf is invalid"),
    (["--virtual-stages", "0"], "--virtual-stages 0 is invalid"),
    (["--profile-steps", "2:3", "--profile-dir", "{text}"], "text.txt is a file, not a directory"),
    (["--profile-steps", "2:3", "--profile-dir", "/proc/megapar-test/x"],
     "--profile-dir /proc/megapar-test/x is not writable"),
    (["--profile-steps", "5:400"], "--profile-steps 5:400 goes beyond --max-steps 300"),
    (["--load", "{ckpt}", "--max-steps", "3", "--profile-steps", "1:2"],
     "--profile-steps 1:2 starts at or before step 1, where --load resumes"),
    (["--lr", "5e-5", "--min-lr", "1e-4"], "--min-lr 0.0001 is larger than --lr 5e-05"),
    # --load: a file, or a step that is not there, is never a fresh start
    (["--load", "{ckpt/latest}"], "ckpt/latest is a file; give the checkpoint directory (e.g. "
                                  "its parent"),
    (["--load", "{ckpt/shard}"], ".safetensors is a file; give the checkpoint directory (e.g. "
                                 "its parent"),
    # ... its parent only where it holds one ("its parent ." was refused next; a re-test)
    (["--load", "{text}"], "text.txt is a file; give a checkpoint directory written by --save "
                           "(or one of its step_* directories)"),
    (["--load", "{ckpt/step_00000099}"], "step_00000099: no such checkpoint; "),
    # one step is named as one (it said "pass one of them")
    (["--load", "{ckpt/step_00000099}"], "ckpt holds step_00000001; pass "),
    (["--load", "{ckpt/typo}"], "/ckpt/step_00000001, or "),
    (["--load", "/nonexistent/ckpt/step_00000003"], "no such checkpoint step, and /nonexistent/"
                                                    "ckpt holds no step_* checkpoints"),
    # a global batch the user gave stays an error on data too small for it
    (["--global-batch-size", "1024"], "fewer than one global batch of 1024"),
    (["--global-batch-size", "4096"], "fewer than one global batch of 4096"),
    # unbounded work from one flag: refused in one line, from the sizes alone
    (["--dp", "{too_many}"], "local worker processes, more than this machine runs well"),
    # a file that is not what the flag needs: one line, not a traceback
    (["--tokenizer", "{garbage.model}"], "garbage.model is not a SentencePiece model"),
    (["--from-hf", "{pickled_hf}"], "pytorch_model.bin: refused: not a plain pickle of weights"),
    (["--global-batch-size", "1000000000"], "holds fewer than one global batch of "
                                            "1000000000: at most"),
    # a Hugging Face directory is not a checkpoint to resume (it would start from scratch)
    (["--load", "{pickled_hf}"], "holds a Hugging Face model (config.json), not a megapar "
                                 "checkpoint; start from it with --from-hf"),
    # a dataset's file, a directory of datasets or a checkpoint is not text to tokenize
    (["--data", "{prefix.bin}"], ".bin is a file of the dataset"),
    (["--data", "{prefix.bin}"], "; pass the prefix without .bin: --data "),
    # its .json too: it was read as a JSON text missing a 'text' field (fix: --jsonl-key)
    (["--data", "{prefix.json}"], "; pass the prefix without .json: --data "),
    (["--data", "{cache}"], "is a directory of tokenized datasets; pass a dataset's prefix"),
    (["--data", "{mixed}"], "mixed holds tokenized datasets beside its text; pass a dataset's "
                            "prefix (e.g. --data "),
    (["--data", "{ckpt}"], "is a megapar checkpoint, not data; pass it to --load"),
    # nor a directory of datasets a checkpoint: --save mixed step_* and latest in among them
    # (after which --data called it a checkpoint); --load said only "no checkpoint there"
    (["--save", "{cache}"], "holds tokenized datasets ("),
    (["--save", "{cache}"], "megapar-data's .bin / .idx): this run's checkpoints would be mixed "
                            "into it; give another --save"),
    (["--load", "{cache}"], "megapar-data's .bin / .idx), not a megapar checkpoint; pass a "
                            "dataset's prefix to --data (--data "),
    # an empty .idx is what is wrong, not the .json a megapar index would need
    (["--data", "{empty_idx}"], ("empty_idx.idx is empty (0 bytes): not a megapar or "
                                 "Megatron-LM index")),
    # an empty path would log nothing (or save nothing) without a word
    (["--log-json", ""], "--log-json '' is an empty path"),
    (["--tensorboard", ""], "--tensorboard '' is an empty path"),
    (["--wandb-project", ""], "--wandb-project '' is an empty name: give a project"),
    (["--save", ""], "--save '' is an empty path"),
    (["--data-cache", ""], "--data-cache '' is an empty path"),
    # an unset $CKPT / $MODEL / $DATA started from scratch, or trained the default model or the
    # shipped sample, without a word (a re-test)
    (["--load", ""], "--load '' is an empty path: give a path (e.g. --load ckpt)"),
    (["--from-hf", ""], "--from-hf '' is an empty path"),
    (["--model", ""], "--model '' is an empty name: give a recipe (e.g. --model gpt2-tiny)"),
    (["--data", ""], "--data '' is an empty path: give a text file"),
    (["--data", "0.5", "a.txt", "0.5", ""], "--data '' is an empty path"),
    (["--data", " "], "--data ' ' is an empty path"),  # whitespace alone too (a re-test)
    # an unset $TOKENIZER was "unknown tokenizer ''" with the list of what is known
    (["--tokenizer", " "], "--tokenizer ' ' is an empty name: give one (e.g. --tokenizer "
                           "sentencepiece), or leave the flag out (gpt2; with --load"),
    # a [0, 1) setting said with its whole range on either side, and inf without the reason of
    # a wait too short (a re-test)
    (["--adam-beta1", "-0.1"], "--adam-beta1 -0.1 is invalid: it must be in [0, 1) (the "
                               "default is 0.9)"),
    (["--timeout-s", "inf"], "--timeout-s inf is invalid: it must be a finite number >= 0.001 "
                             "(the default is 300.0)"),
    (["--timeout-s", "1000000000.5"], "--timeout-s 1000000000.5 is invalid: at most 1e+09 s"),
    (["--save", " "], "--save ' ' is an empty path"),
    # a seed past what torch's generators take failed in rank 0 ("Overflow when unpacking long
    # long", a re-test)
    (["--seed", "100000000000000000000"], "--seed 100000000000000000000 is invalid: it must be "
                                          "a whole number from 0 to 4,294,967,295 (megapar "
                                          "offsets it per rank"),
    # a file's path ending in / names a directory (it was written as ck/logs/ after the start)
    (["--log-json", "{new_dir/}"], "new_dir/ is a directory; give a file name"),
    # the fault injector (a testing tool): a spec it cannot carry out, before any worker starts
    (["--inject-corrupt", "step=2,module=transformer.h.1.atn"],
     "--inject-corrupt: gpt2 has no module 'transformer.h.1.atn' (names as in the Hugging Face "
     "export); did you mean transformer.h.1.attn"),
    (["--inject-corrupt", "module=transformer.h.1.attn"], "step missing; e.g. step=3,module="),
    (["--inject-corrupt", "step=2,module=transformer.h.1.attn,tp=1"],
     "--inject-corrupt: tp=1 is outside the layout's tp 1; choose tp < 1"),
    (["--inject-corrupt", "step=2,module=transformer.h.1.attn,value=big"],
     "value=big is not a number (nan, inf, -inf, 1e4)"),
    (["--inject-corrupt", "step=400,module=transformer.h.1.attn"],
     "--inject-corrupt: step=400 is not run (this run trains steps 1-300)"),
    # issue 44, drill round 3: caught before any worker starts, not in one
    (["--inject-corrupt", "step=2,module=transformer.h.1.attn,index=99999999999"],
     "--inject-corrupt: index=99999999999 is past any module's output on a rank"),
    (["--inject-corrupt", "step=2,module=transformer.h.1.attn,step=3"],
     "step is given twice; give it once"),
    (["--inject-slow", "rank=0,ms=5,from_step=500"],
     "from_step=500 is after the run's last step (--max-steps 300)"),
    (["--allow-data-change"], "--allow-data-change only applies to a resume"),
    # were ignored without a word
    (["--load-strict"], "--load-strict only applies to --load (it makes a --load that holds no "
                        "checkpoint an error): add --load CKPT or drop it"),
    (["--overwrite-newer"], "--overwrite-newer only applies to --save (it lets this run replace "
                            "newer steps there): add --save DIR or drop it"),
    # a flag this run would not read was ignored without a word
    (["--save-interval", "5"], "--save-interval 5 would be ignored: it is how often checkpoints "
                               "go into --save, and no --save is given: give --save DIR too, or "
                               "drop --save-interval"),
    (["--powersgd-rank", "8"], "--powersgd-rank 8 would be ignored: it is PowerSGD's rank"),
    # under ZeRO the fix names --zero 0 too: PowerSGD beside ZeRO was refused next (a new
    # user's tryout of precision-zero.md)
    (["--powersgd-rank", "8", "--zero", "1"], "add --grad-compression powersgd with --zero 0 "
     "(PowerSGD compresses all-reduced gradients), or drop --powersgd-rank"),
    (["--hysteresis", "2", "--precision", "bf16"], "--hysteresis 2 would be ignored: it sets "
     "the fp16 loss scale, and --precision is bf16 (no loss scaling): add --precision fp16, or "
     "drop --hysteresis"),
    # GFLOP/s read as TFLOP/s: an MFU of 0.00 % (megapar-plan refuses it too)
    (["--peak-tflops", "989e3"], "--peak-tflops 989000 is more than any GPU's dense peak: give "
     "TFLOP/s, such as 989 for an H100 / H200 in bf16 (989000 GFLOP/s is 989 TFLOP/s)"),
    # at fp32 the flags are unused first: "raise --initial-loss-scale" was refused next
    (["--min-loss-scale", "1e6"], "--min-loss-scale 1000000 would be ignored: it sets the fp16 "
     "loss scale, and --precision is fp32 (no loss scaling): add --precision fp16, or drop "
     "--min-loss-scale"),
    # every unused flag of the one reason at once (dropping the one named was refused next
    # for the other; a re-test)
    (["--min-loss-scale", "1e6", "--initial-loss-scale", "1e3"], "--initial-loss-scale 1000 "
     "and --min-loss-scale 1000000 would be ignored: each sets the fp16 loss scale, and "
     "--precision is fp32 (no loss scaling): add --precision fp16, or drop "
     "--initial-loss-scale and --min-loss-scale"),
    # a fix that would be refused next says what else it drops (fp16 with a static
    # --loss-scale then refused the dynamic scale's flags; --lr-decay wsd refused
    # --lr-wsd-decay-fraction beside --lr-wsd-decay-steps), and two flags of one fix are one
    # line (--min-lr's and --lr-decay-steps' reasons differed in words; a re-test)
    (["--initial-loss-scale", "1e3", "--loss-scale", "1024"], "add --precision fp16 and drop "
     "--initial-loss-scale (--loss-scale 1024 is static), or drop --loss-scale and "
     "--initial-loss-scale"),
    (["--lr-wsd-decay-steps", "2", "--lr-wsd-decay-fraction", "0.2"], "add --lr-decay wsd and "
     "drop --lr-wsd-decay-fraction (--lr-wsd-decay-steps sets the decay's length)"),
    (["--min-lr", "1e-5", "--lr-decay-steps", "10", "--lr-decay", "constant"], "--min-lr 1e-05 "
     "and --lr-decay-steps 10 would be ignored: each is where the decay ends"),
    # every reason in one line (dropping the wsd flag was refused next for --min-lr; a re-test)
    (["--lr-wsd-decay-steps", "2", "--lr-decay", "constant", "--min-lr", "1e-5"],
     "or drop --lr-wsd-decay-steps; and --min-lr 1e-05 would be ignored: it is where the decay "
     "ends"),
    (["--precision", "fp16", "--min-loss-scale", "128", "--initial-loss-scale", "64"],
     "--min-loss-scale 128 is above --initial-loss-scale 64: lower --min-loss-scale or raise "
     "--initial-loss-scale"),
    (["--precision", "fp16", "--loss-scale", "128", "--hysteresis", "2"], "--hysteresis 2 would "
     "be ignored: it sets the dynamic loss scale, and --loss-scale 128 is static: drop "
     "--loss-scale, or drop --hysteresis"),
    (["--loss-scale", "128"], "--loss-scale 128 would be ignored: it sets the fp16 loss scale"),
    (["--precision", "fp16", "--hysteresis", "0"], "--hysteresis 0 is invalid: it must be a "
     "whole number >= 1 (the default is 1)"),
    (["--eval-steps", "3", "--eval-interval", "0"], "--eval-steps 3 would be ignored"),
    (["--eval-interval", "5", "--val-fraction", "0"], "--eval-interval 5 would be ignored"),
    (["--profile-dir", "prof"], "--profile-dir prof would be ignored: it is where the traces "
                                "of --profile-steps go"),
    # a rule with no setting to add ends in "; drop FLAG" (not ", or drop FLAG" after no choice)
    (["--data", "{prefix}", "--jsonl-key", "body"], "--jsonl-key body would be ignored: --data "
                                                    "is tokenized data, and --jsonl-key is for "
                                                    "the raw text megapar-train tokenizes (.txt / "
                                                    ".jsonl / .json / .parquet); drop --jsonl-key"),
    (["--data", "{text}", "--jsonl-key", "body"], "--jsonl-key body would be ignored: no --data "
                                                  "input is .jsonl / .json / .parquet (a .txt "
                                                  "file's text is all of it); drop --jsonl-key"),
    (["--data", "{prefix}", "--allow-invalid-utf8"], "error: --allow-invalid-utf8 would be "
                                                     "ignored: --data is tokenized data, and "
                                                     "--allow-invalid-utf8 is for the raw text "
                                                     "megapar-train tokenizes (.txt / .jsonl / "
                                                     ".json / .parquet); drop "
                                                     "--allow-invalid-utf8"),
    (["--adam-beta2", "0.99", "--optimizer", "sgd"],
     "--adam-beta2 0.99 would be ignored: --optimizer sgd has no Adam moments"),
    # mixture of experts
    (["--moe-aux-loss-coef", "0.1"],
     "--moe-aux-loss-coef applies to a mixture-of-experts model (mixtral, qwen3_moe"),
    (["--moe-capacity-factor", "-1"],
     "--moe-capacity-factor -1.0 is invalid: it must be a finite number > 0.0, or 0 for dropless"),
    # --record-step / --replay
    (["--record-step", "2"], "--record-step 2 writes SAVE/records/: give --save"),
    (["--replay", "2"], "--replay 2 re-runs a step from a checkpoint: give --load CKPT"),
    (["--load", "{empty_dir}", "--replay", "2"],
     "empty_dir holds no checkpoint; --replay 2 re-runs a step from a checkpoint"),
    (["--load", "{ckpt}", "--replay", "1", "--max-steps", "3"],
     "is at step 1; no run saves a checkpoint before step 1: record and replay a later step"),
    (["--cp-comm-type", "a2a"], "--cp-comm-type a2a would be ignored: it chooses how "
                                "context-parallel attention communicates, and --cp 1 has none: "
                                "add --cp N (N > 1)"),
    # the all-to-all's heads: a cp-th of a tp rank's (llama-tiny: 4 heads, 2 per tp rank)
    (["--model", "llama-tiny", "--tp", "2", "--cp", "4", "--cp-comm-type", "a2a",
      "--seq-len", "64"], "--cp-comm-type a2a at cp 4: all-to-all context parallelism gives "
     "each cp rank a cp-th of a tp rank's attention heads, and 2 heads per tp rank do not "
     "divide over cp 4 (4 heads / tp 2); use --cp 2 (dividing 2), --tp 1 (its heads per tp "
     "rank divide over cp 4), or --cp-comm-type p2p (the ring scales past the head count)"),
    # a dry run's world is --world-size, not processes to launch
    (["--dry-run", "--cp", "2", "--dp", "2", "--world-size", "8"],
     "world size 8 != tp*cp*pp*dp = 1*2*1*2 = 4; give --world-size 4 or change --tp/--pp/--dp/--cp"),
    (["--dry-run", "--tp", "2", "--world-size", "7"],
     "world size 7 is not divisible by tp*pp = 2*1; give a --world-size that is a multiple of 2"),
    # a --tp the model's heads refuse is said first: --world-size 3 (a multiple of 3) was
    # refused next for the heads (under torchrun too; a new user's tryout)
    (["--dry-run", "--tp", "3", "--world-size", "8"],
     "4 attention heads are not divisible by --tp 3; use --tp 1, 2 or 4"),
    # ... and those of its --tp the world takes, where not all (--tp 4 was offered to 4
    # processes at --pp 2, refused next; a re-test)
    (["--dry-run", "--model", "llama-tiny", "--tp", "3", "--pp", "2", "--world-size", "4"],
     "use --tp 1, 2 or 4 (each divides the 4 attention heads, FFN size 176); of those, 4 "
     "processes at --pp 2 take --tp 1 or 2"),
    # and where the --tp given divides the world (the model refused it later, without the
    # note; a re-test)
    (["--dry-run", "--tp", "3", "--world-size", "6", "--cp", "2", "--seq-len", "32"],
     "; of those, 6 processes at --cp 2 take --tp 1"),
    # and whose dp x cp the --ep divides (--tp 2 was offered at --ep 4 of 4 processes, refused
    # next: ep 4 does not divide dp x cp 2; a re-test)
    (["--dry-run", "--model", "mixtral-tiny", "--seq-len", "32", "--tp", "3", "--ep", "4",
      "--world-size", "4"], "; of those, 4 processes at --ep 4 take --tp 1"),
    # ... and whose dp the given global batch divides (--tp 2 and 1 left a dp of 4 and 8 for
    # a batch of 6, refused next; a re-test)
    (["--dry-run", "--model", "llama-tiny", "--seq-len", "32", "--tp", "3", "--world-size", "8",
      "--global-batch-size", "6"], "FFN size 176); of those, 8 processes take --tp 4"),
    # the --pp the layers take beside the world's (--pp 4 was offered to 6 processes, refused
    # next; a re-test)
    (["--dry-run", "--model", "llama-tiny", "--seq-len", "32", "--pp", "6", "--world-size", "6"],
     "4 layers cannot be cut into --pp 6 stages (each stage needs at least one layer); lower "
     "--pp to 4 or less; of those, 6 processes take --pp 3 or 2"),
]


def _fill(argv, env):
    names = {**{k.split(".")[0] + "." + k.split(".")[1]: v for k, v in env["configs"].items()},
             "negative": env["negative"], "ckpt": env["ckpt"], "corrupt": env["corrupt"],
             "prefix": env["prefix"], "empty_dir": str(env["root"] / "empty_dir"),
             "text": str(env["root"] / "text.txt"), "ckpt/latest": env["ckpt"] + "/latest",
             "ckpt/latest/ck": env["ckpt"] + "/latest/ck",
             "ckpt/shard": str(next(Path(env["ckpt"], "step_00000001").glob("*.safetensors"))),
             "ckpt/step_00000099": env["ckpt"] + "/step_00000099",
             "ckpt/typo": env["ckpt"] + "/typo", "too_many": TOO_MANY,
             "pickled_hf": str(env["root"] / "pickled_hf"),
             "bert_t1_ckpt": str(env["root"] / "bert_t1_ckpt"),
             "prefix.bin": env["prefix"] + ".bin",
             "prefix.json": env["prefix"] + ".json", "cache": str(env["root"] / "cache"),
             "empty_idx": str(env["root"] / "empty_idx"),
             "new_dir/": str(env["root"] / "new_dir") + "/", "mixed": str(env["root"] / "mixed"),
             "few_words.txt": str(env["root"] / "few_words.txt"),
             **{f"ids:{k}": str(v) for k, v in env["ids"].items()}}
    return [names[a[1:-1]] if a.startswith("{") else a for a in argv]


def _one_line(capsys, prog):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, message", TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_megapar_train(argv, message, env, no_workers, capsys):
    rc = train([*env["common"], *_fill(argv, env)])
    line = _one_line(capsys, "megapar-train")
    assert rc == 2 and message in line, line


def test_the_timeout_environment_variables_give_megapar_trains_defaults(env, no_workers,
                                                                        monkeypatch, capsys):
    """MEGAPAR_TIMEOUT_S was read by the library alone: megapar-train kept --timeout-s 300 (a
    rank 20 s late under MEGAPAR_TIMEOUT_S=4 was waited for), and an invalid value was a
    traceback at import. It is --timeout-s's default now (a given flag wins), and an invalid one
    is refused in one line."""
    from megapar.env_seconds import env_seconds
    from megapar.training.config import parse_args

    monkeypatch.setenv("MEGAPAR_TIMEOUT_S", "4")
    monkeypatch.setenv("MEGAPAR_NCCL_TIMEOUT_S", "60")
    cfg = parse_args([])
    assert (cfg.timeout_s, cfg.nccl_timeout_s) == (4.0, 60.0)
    assert "timeout_s" not in cfg.explicit
    assert parse_args(["--timeout-s", "9"]).timeout_s == 9.0
    monkeypatch.delenv("MEGAPAR_NCCL_TIMEOUT_S")
    assert parse_args([]).nccl_timeout_s == 1800.0
    # above 1e9 s (torch's store fails at once from about 1e10) it was "--timeout-s 1e+10 is
    # invalid", a flag never given; megapar-eval took any value unsaid (a re-test)
    # under 1 ms (1e-300, 1e-4) torch's wait is 0: every rank's join failed with gloo's stack
    # dumps (a re-test)
    for bad in ("abc", "0", "-3", "inf", "1e10", "1e-300", "0.0004"):
        monkeypatch.setenv("MEGAPAR_TIMEOUT_S", bad)
        assert env_seconds("MEGAPAR_TIMEOUT_S", 300.0) == 300.0  # an import never fails
        said = (f"MEGAPAR_TIMEOUT_S={bad!r} is invalid: give a number of seconds from 0.001 "
                f"to 1e+09, or unset it")
        assert train([*env["common"]]) == 2
        assert _one_line(capsys, "megapar-train") == f"megapar-train: error: {said}"
    monkeypatch.delenv("MEGAPAR_TIMEOUT_S")
    monkeypatch.setenv("MEGAPAR_NCCL_TIMEOUT_S", "abc")
    from argparse import Namespace

    from megapar.training.usage import UsageError
    from megapar.training.validate_tools import check_eval_args

    with pytest.raises(UsageError, match=r"^MEGAPAR_NCCL_TIMEOUT_S='abc' is invalid"):
        check_eval_args(Namespace())


def test_gpu_memory_is_read_in_gib_with_or_without_its_unit(env, no_workers, tmp_path, capsys):
    """--gpu-memory-gb 16GB was argparse's "invalid float value", and 16000 (MB meant) held
    the dry run to 16000 GiB: the unit's name is read, another unit or a figure no GPU has is
    refused in one line, on the command line and in a --config file."""
    from megapar.training.config import parse_args

    assert parse_args(["--gpu-memory-gb", "40GB"]).gpu_memory_gb == 40.0
    assert parse_args(["--gpu-memory-gb", "40 GiB"]).gpu_memory_gb == 40.0
    with pytest.raises(SystemExit) as stop:
        train([*env["common"], "--dry-run", "--gpu-memory-gb", "24000"])
    assert stop.value.code == 2
    assert ("--gpu-memory-gb: 24000 GiB is more than any GPU holds: give a number of GiB, such "
            "as 80 for an 80 GB GPU (24000 MB is 23.4 GiB)") in _one_line(capsys, "megapar-train")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"gpu_memory_gb": "40MB"}))
    assert train([*env["common"], "--config", str(config), "--dry-run"]) == 2
    assert f"{config}: --gpu-memory-gb '40MB' is not a size in GiB" in _one_line(
        capsys, "megapar-train")


def test_a_read_only_data_cache_is_read_where_it_holds_the_text(env, tmp_path, monkeypatch):
    """A shared, pre-filled --data-cache mounted read-only was refused ("is not writable")
    though the run only reads its copy (a data tryout): its copy is read; a text it holds no
    copy of is refused in one line naming the cache, when the write is refused."""
    import errno

    import megapar.data.preprocess as preprocess
    import megapar.training.validate as validate
    from megapar.training.config import parse_args

    cache = env["common"][env["common"].index("--data-cache") + 1]

    def probe(path, flag, kind="dir"):  # the directory's mode: writes refused
        raise ValueError(f"{flag} {path} is not writable (probed)")

    def write(inputs, prefix, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", prefix + ".bin.tmp")

    monkeypatch.setattr(validate, "check_writable", probe)
    monkeypatch.setattr(preprocess, "preprocess_files", write)
    layout, plan = train_cli.plan_run(parse_args([*env["common"], "--max-steps", "1"]))
    assert plan.prefix.startswith(cache), plan.prefix  # the cached copy, nothing written
    other = tmp_path / "other.txt"
    other.write_text("Another text, which the cache holds no copy of.\n\n" * 50)
    argv = [*env["common"], "--max-steps", "1"]
    argv[argv.index("--data") + 1] = str(other)
    with pytest.raises(ValueError, match=(
            rf"^--data-cache {cache} is not writable \(Permission denied\) and holds no tokenized "
            rf"copy of --data {other} for this tokenizer; choose a location you can write to$")):
        train_cli.plan_run(parse_args(argv))


def test_a_load_with_no_checkpoint_and_no_model_is_refused(env, no_workers, tmp_path, capsys):
    """`megapar-train --load ckpt_typo` (no --model: the settings were to come from the
    checkpoint) started a fresh run of the default model, 300 steps, with a note. A requeue
    gives --model (or --from-hf) and still starts fresh; without either it is one line."""
    out = tmp_path / "out"
    for where in (tmp_path / "typo", env["root"] / "empty_dir"):
        rc = train(["--load", str(where), "--save", str(out), "--no-progress"])
        line = _one_line(capsys, "megapar-train")
        assert rc == 2 and line.endswith(
            f"--load {where}: no checkpoint there, and no --model or --from-hf says what a "
            f"fresh run would train; pass the directory written by --save (or one of its "
            f"step_* directories), or give --model / --from-hf to start a run there"), line
        assert not out.exists()


def test_a_resumed_dp_that_does_not_divide_the_checkpoints_global_batch(env, no_workers,
                                                                         capsys):
    """The global batch is the checkpoint's when not given: a dp that does not divide it was
    told 'choose a multiple of 12'; the line names the dp values and micro-batch sizes that
    divide it, and a --global-batch-size this dp takes (the data order continues)."""
    manifest = json.loads((Path(env["ckpt"]) / "step_00000001" / "manifest.json").read_text())
    config = manifest["meta"]["train_config"]
    gbs, mbs = config["global_batch_size"], config["micro_batch_size"]
    dp = next(d for d in range(2, 9) if gbs % (mbs * d))
    assert train(["--load", env["ckpt"], "--dp", str(dp), "--max-steps", "3"]) == 2
    line = _one_line(capsys, "megapar-train")
    good = " / ".join(str(d) for d in range(1, gbs + 1) if gbs % (mbs * d) == 0)
    assert (f"--global-batch-size {gbs} (not given: the value --load {env['ckpt']} recorded) "
            f"is not divisible by micro-batch size {mbs} x dp {dp} = {mbs * dp}, and a resumed "
            f"run keeps its checkpoint's global batch unless --global-batch-size is given; "
            f"choose a layout with dp {good}") in line, line
    assert line.endswith(f", or --global-batch-size a multiple of {mbs * dp} (the data order "
                         f"continues)"), line
    assert "choose a multiple" not in line


def test_a_resumed_warmup_longer_than_a_shortened_run_names_the_checkpoint(env, capsys,
                                                                           tmp_path):
    """A fresh run's default warmup shrinks to 10 % of a short run; a resumed one keeps its
    checkpoint's, and a --max-steps below it was told 'warmup of 20 steps is longer than the 6
    training steps; lower --warmup-steps', a flag the user never gave. The line names the
    checkpoint's value and both fixes."""
    ckpt = tmp_path / "ckpt"
    assert train([*env["common"], "--max-steps", "40", "--exit-interval", "1", "--save",
                  str(ckpt)]) == 0
    capsys.readouterr()
    assert train(["--load", str(ckpt), "--max-steps", "3"]) == 2  # its warmup: 4, 10 % of 40
    assert _one_line(capsys, "megapar-train") == (
        f"megapar-train: error: --warmup-steps 4 (not given: the value --load {ckpt} recorded) "
        f"is longer than the 3 steps of --max-steps 3; give --warmup-steps 3 or fewer (the "
        f"steps after the checkpoint follow the new schedule), or --max-steps 4 or more")
    # at the checkpoint's step or below, nothing is left to train: said first (it offered
    # --warmup-steps 1, refused next for this; a new user's tryout)
    assert train(["--load", str(ckpt), "--max-steps", "1"]) == 2
    assert _one_line(capsys, "megapar-train") == (
        f"megapar-train: error: --load {ckpt} is at step 1 and --max-steps is 1: nothing left "
        f"to train; raise --max-steps")


def test_a_model_configs_vocabulary_smaller_than_the_tokenizers_names_both_counts(
        env, no_workers, capsys, tmp_path):
    """A config's vocab_size 32000 under the default gpt2 tokenizer was told the tokenizer
    'needs 50257 token ids' while every other line says it has 50,261; the line says why the
    counts differ (a new user's finding)."""
    model = tmp_path / "l32.json"
    model.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "vocab_size": 32000}))
    assert train(["--model", str(model), "--max-steps", "1", "--seq-len", "32"]) == 2
    assert _one_line(capsys, "megapar-train") == (
        f"megapar-train: error: the model config {model} has vocab_size 32000 but the data's "
        f"tokenizer gpt2 needs 50,257 token ids (of its 50,261: a causal model does not read "
        f"the 4 special tokens appended after its vocabulary); make them match (or leave "
        f"vocab_size out of the config to take the tokenizer's)")


def test_a_resumed_cp_that_cannot_split_the_checkpoints_seq_len(env, no_workers, capsys):
    """--seq-len is the checkpoint's when not given: --cp 3 at its 32 said '--seq-len 32 is not
    divisible by 6' as if the user had typed it, and named no --cp that fits; a new user's
    finding."""
    assert train(["--load", env["ckpt"], "--cp", "3", "--max-steps", "3"]) == 2
    assert _one_line(capsys, "megapar-train").endswith(
        f"--seq-len 32 (not given: the value --load {env['ckpt']} recorded) is not divisible "
        f"by 6: --cp 3 cuts each sequence into 2 x cp = 6 chunks; choose a multiple of 6, or a "
        f"--cp it allows (2, 4)")  # up to 2 x the --cp given (a --cp 31 offered to --cp 2
    # for --seq-len 62 meant 29 more processes; a re-test): none there, none offered
    assert train(["--load", env["ckpt"], "--cp", "2", "--seq-len", "62", "--max-steps", "3"]) == 2
    assert _one_line(capsys, "megapar-train").endswith(
        "--cp 2 cuts each sequence into 2 x cp = 4 chunks; choose a multiple of 4")


@pytest.mark.parametrize("args, offered", [
    (["--cp", "8", "--seq-len", "100"], " (2, 5)"),  # 10 processes on nodes of 8: refused next
    (["--cp", "4", "--seq-len", "36", "--world-size", "16"], " (2)"),  # not 3: 16 / 3
    (["--cp", "2", "--seq-len", "30", "--world-size", "4"], ""),  # not 3: 4 / 3
    # not 5: llama-tiny's 4 heads do not divide over it under a2a (a re-test)
    (["--cp", "8", "--seq-len", "20", "--cp-comm-type", "a2a", "--model", "llama-tiny"], " (2)"),
])
def test_the_cp_offered_for_a_seq_len_is_one_the_job_runs(capsys, no_workers, args, offered):
    """A --seq-len cp does not split offered --cp sizes whose world the job refused next (a
    --cp 10 for --gpus-per-node 8; a session's finding) or which do not divide --world-size."""
    assert train(["--model", "gpt2-tiny", "--dry-run", "--max-steps", "1", *args]) == 2
    line = _one_line(capsys, "megapar-train")
    need = 2 * int(args[1])
    assert line.endswith(f"choose a multiple of {need}" + (
        f", or a --cp it allows{offered}" if offered else "")), line


def test_from_hf_tokenizes_with_the_directorys_own_tokenizer(env, tmp_path, no_workers, capsys):
    """--from-hf DIR without --tokenizer tokenizes with DIR's own tokenizer (here its
    SentencePiece tokenizer.model), said in a start-up note; a --tokenizer, or a prepared --data,
    of another tokenizer is refused in one line naming both and the fix (it was trained on
    silently); a DIR without a tokenizer keeps the default --tokenizer, with a note."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megapar.cli.data import main as data
    from megapar.data import IndexedDataset
    from megapar.training.config import parse_args
    from megapar.training.run_plan import read_resumed_settings

    hf, bare, gpt2 = tmp_path / "hf", tmp_path / "bare", str(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=1004, n_positions=64, n_embd=32, n_layer=2,
                               n_head=4, bos_token_id=1, eos_token_id=2)).save_pretrained(hf)
    shutil.copytree(hf, bare)
    shutil.copy(asset_path("botchan_en_unigram_1000.model"), hf / "tokenizer.model")
    text = str(env["root"] / "text.txt")
    common = ["--data", text, "--data-cache", str(env["root"] / "cache"), "--seq-len", "32",
              "--no-progress"]
    notes: list[str] = []
    cfg = parse_args(["--from-hf", str(hf), *common])
    _, plan = train_cli.plan_run(cfg, notes)  # in this process: tokenized, split, checked
    assert cfg.tokenizer == str(hf / "tokenizer.model")
    assert IndexedDataset(plan.prefix).tokenizer_spec["kind"] == "sentencepiece"
    assert (f"--tokenizer not given: using --from-hf {hf}'s own tokenizer "
            f"({hf / 'tokenizer.model'})") in notes, notes
    capsys.readouterr()
    for rehearsal in ([], ["--dry-run"]):  # a dry run on raw text checks it too
        assert train(["--from-hf", str(hf), *common, "--tokenizer", "gpt2", *rehearsal]) == 2
        line = _one_line(capsys, "megapar-train")
        assert (f"--from-hf {hf} holds its tokenizer {hf / 'tokenizer.model'} (sha256 " in line
                and "but --tokenizer gpt2 is another (sha256 " in line
                and line.endswith("drop --tokenizer (with --from-hf its own, "
                                  f"{hf / 'tokenizer.model'}, is the default)")), line
    assert data(["--input", text, "--output-prefix", gpt2, "--tokenizer", "gpt2",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert train(["--from-hf", str(hf), *common[2:], "--data", gpt2]) == 2
    line = _one_line(capsys, "megapar-train")
    assert (f"but --data {gpt2} was made with another, gpt2 (sha256 " in line
            and line.endswith(f"megapar-data --tokenizer {hf / 'tokenizer.model'}")), line
    notes = []
    cfg = parse_args(["--from-hf", str(bare), *common])
    read_resumed_settings(cfg, notes)
    assert cfg.tokenizer == "gpt2"
    assert notes == [f"--from-hf {bare} holds no tokenizer (tokenizer.json, vocab.json + "
                     f"merges.txt, or tokenizer.model): raw text is tokenized with the default "
                     f"--tokenizer gpt2 (a prepared --data keeps its own); pass --tokenizer "
                     f"with the model's own if it is another"], notes


def test_a_load_that_records_no_tokenizer_says_the_default_tokenizes():
    """A checkpoint imported without a tokenizer (megapar-convert --from-hf of a directory
    without one) resumed on raw text with the default gpt2 without a word, where --from-hf of
    the same directory says so in a note: --load says it too; not where --tokenizer is given,
    nor where the checkpoint records one."""
    from megapar.training.config import parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    bare = {"meta": {"train_config": {"seq_len": 32}}}
    cfg = parse_args(["--load", "ck", "--data", "held.txt"])
    assert settings_from_checkpoint(cfg, bare) == [
        "from the checkpoint (not given): --seq-len 32",
        "--load ck records no tokenizer (imported without one, or older): raw text is "
        "tokenized with the default --tokenizer gpt2 (a prepared --data keeps its own); pass "
        "--tokenizer with the model's own if it is another"]
    cfg = parse_args(["--load", "ck", "--tokenizer", "sentencepiece"])
    assert settings_from_checkpoint(cfg, bare) == ["from the checkpoint (not given): --seq-len 32"]
    recorded = {"meta": {"train_config": {}, "tokenizer": {"kind": "gpt2", "sha256": ["0"]}}}
    assert settings_from_checkpoint(parse_args(["--load", "ck"]), recorded) == []


def test_under_torchrun_a_start_up_error_is_printed_once_a_node(env, no_workers, capsys,
                                                                monkeypatch):
    """Under torchrun every rank runs the command on the same flags and finds the same bad
    input: the first process of each node (LOCAL_RANK 0) prints the line, the others exit with
    the same code silently (N ranks printed N copies). megapar-train, megapar-eval and
    megapar-generate; both kinds: a value refused before any worker (exit 2) and a flag the
    parser does not know (SystemExit 2, argparse's line)."""
    from megapar.cli.generate import main as generate

    missing = str(env["root"] / "nothing")
    said = {"--load": f"--load {missing}: no such checkpoint directory; pass a directory "
                      f"written by --save (or one of its step_* directories)"}
    cases = [  # (command, its name, bad value, its line's start, bad flag)
        (train, "megapar-train", [*env["common"], "--global-batch-size", "0"],
         "--global-batch-size 0 is invalid: it must be a whole number >= 1 (the default is 16)",
         [*env["common"], "--globl-batch-size", "3"]),
        (evaluate, "megapar-eval", ["--load", missing, "--tp", "4", "--data", env["common"][1]],
         said["--load"], ["--lod", missing]),
        (generate, "megapar-generate", ["--load", missing, "--tp", "4", "--prompt", "To be"],
         said["--load"], ["--lod", missing]),
    ]
    for rank, local, prints in ((0, 0, True), (1, 1, False), (2, 0, True), (3, 1, False)):
        for name, value in (("RANK", rank), ("LOCAL_RANK", local), ("WORLD_SIZE", 4),
                            ("LOCAL_WORLD_SIZE", 2)):
            monkeypatch.setenv(name, str(value))
        for command, prog, bad_value, line, bad_flag in cases:
            assert command(bad_value) == 2
            err = capsys.readouterr().err
            assert _lines(err) == ([f"{prog}: error: {line}"] if prints else []), (rank, err)
            with pytest.raises(SystemExit) as stop:
                command(bad_flag)
            assert stop.value.code == 2
            err = capsys.readouterr().err
            if prints:
                assert _lines(err)[0].startswith(
                    f"{prog}: error: unrecognized arguments: {bad_flag[-2]} "), err
            else:
                assert err == "", (prog, rank, err)


def _lines(err: str) -> list[str]:
    return err.strip().splitlines()


def test_from_hf_with_another_familys_tokenizer_is_refused(env, tmp_path, no_workers, capsys):
    """A Qwen2 directory holding GPT-2's tokenizer files (vocab.json + merges.txt): megapar reads
    them with GPT-2's splitting, transformers' AutoTokenizer builds Qwen2's over them (a Qwen2
    model gets Qwen2Tokenizer whatever the files say), so the same text has other ids in each.
    It trained silently (an export carried the mismatch); now it is refused before any worker
    in one line naming the class transformers builds, the first text that differs and the fix
    (and so is megapar-convert's import of the directory).
    The tokenizer that AutoTokenizer saves from those files (Qwen2's splitting in its
    tokenizer.json), the model's own, is taken and trains."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from megapar.cli.convert import main as convert

    hf, own = tmp_path / "qwen2", tmp_path / "own"
    AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=50304, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True)).save_pretrained(hf)
    shutil.copytree(hf, own)
    shutil.copy(asset_path("gpt2_vocab.json"), hf / "vocab.json")
    shutil.copy(asset_path("gpt2_merges.txt"), hf / "merges.txt")
    common = ["--data", str(env["root"] / "text.txt"), "--data-cache", str(tmp_path / "cache"),
              "--seq-len", "32", "--no-progress"]
    capsys.readouterr()
    assert train(["--from-hf", str(hf), *common]) == 2
    line = _one_line(capsys, "megapar-train")
    assert line.startswith(
        f"megapar-train: error: --from-hf {hf}: transformers reads its tokenizer files otherwise "
        f"than megapar does for this qwen2 model (AutoTokenizer builds a Qwen2Tokenizer that "
        f"encodes "), line
    assert line.endswith(
        f"so the model's token ids and megapar's would differ; put the model's own tokenizer "
        f"there (AutoTokenizer.from_pretrained(<the model's name>).save_pretrained({hf})), or "
        f"train another tokenizer from --model with --tokenizer"), line
    # megapar-convert's import of it refuses it too, and writes nothing
    assert convert(["--from-hf", str(hf), str(tmp_path / "ckpt"), "--no-progress"]) == 2
    line = _one_line(capsys, "megapar-convert")
    assert line.startswith(f"megapar-convert: error: {hf}: transformers reads its tokenizer "
                           f"files otherwise than megapar does for this model (AutoTokenizer "
                           f"builds a Qwen2Tokenizer that encodes "), line
    assert not (tmp_path / "ckpt").exists()
    AutoTokenizer.from_pretrained(hf).save_pretrained(own)  # Qwen2's splitting, GPT-2's vocab
    from megapar.training.config import parse_args

    notes: list[str] = []
    train_cli.plan_run(parse_args(["--from-hf", str(own), *common]), notes)
    assert f"--tokenizer not given: using --from-hf {own}'s own tokenizer ({own})" in notes


def test_a_bert_tokenizer_without_mask_is_named_as_that(env, tmp_path, no_workers, capsys):
    """--from-hf a BERT whose own tokenizer has no [MASK]: megapar appends [MASK] after the
    vocabulary, beyond the model's rows. The line names the missing token and how to add it
    (it said "use the model's own tokenizer", which it was using)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *letters, *(f"##{c}" for c in letters)]
    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf = tmp_path / "bert"
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                            cls_token="[CLS]", sep_token="[SEP]").save_pretrained(hf)
    BertForMaskedLM(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=64)).save_pretrained(hf)
    capsys.readouterr()  # transformers' progress bar
    assert train(["--from-hf", str(hf), "--data", str(env["root"] / "text.txt"), "--data-cache",
                  str(tmp_path / "cache"), "--seq-len", "32", "--no-progress"]) == 2
    line = _one_line(capsys, "megapar-train")
    assert line == (
        f"megapar-train: error: --from-hf {hf}: its tokenizer ({hf}) has no [MASK] token, "
        f"which BERT's masking needs; megapar would append it as id {len(vocab)}, beyond the "
        f"model's vocabulary of {len(vocab)}: add it to both and save them again "
        f"(tok.add_special_tokens({{'mask_token': '[MASK]'}}); "
        f"model.resize_token_embeddings(len(tok)))"), line


def test_wandb_project_without_wandb_is_refused_before_the_run(env, no_workers, capsys,
                                                               monkeypatch):
    """wandb is an extra (`megapar[wandb]`): without it --wandb-project is one line, not a
    rank 0 traceback after the workers started."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real(name, *args))
    rc = train([*env["common"], "--wandb-project", "mine"])
    line = _one_line(capsys, "megapar-train")
    assert rc == 2 and "--wandb-project needs wandb, which is not installed" in line, line


def test_a_wandb_mode_that_wandb_does_not_take_is_refused_before_the_run(env, no_workers,
                                                                        capsys, monkeypatch):
    """WANDB_MODE=bogus was rank 0's pydantic ValidationError after the workers started; the
    modes listed are the ones the installed wandb's settings take."""
    from typing import get_args

    from megapar.training.logging import WANDB_MODES

    settings = pytest.importorskip("wandb.sdk.wandb_settings", reason="wandb is not installed")
    assert set(WANDB_MODES) == set(get_args(settings.Settings.model_fields["mode"].annotation))
    monkeypatch.setenv("WANDB_MODE", "bogus")
    rc = train([*env["common"], "--wandb-project", "mine"])
    line = _one_line(capsys, "megapar-train")
    assert rc == 2 and "WANDB_MODE='bogus' is not one of W&B's modes (online, offline" in line


EVAL = [
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "16", "--max-batches", "0"],
     "--max-batches 0 is invalid"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "0"], "--seq-len 0 is invalid"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "100"],
     "--seq-len 100 exceeds the model's 64 positions"),
    (["--load", "{ckpt}", "--data", "/nonexistent/prefix", "--seq-len", "16"],
     "--data /nonexistent/prefix: prefix.bin, prefix.idx, prefix.json not found"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "16", "--tp", "3"],
     "not divisible by --tp 3"),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "16", "--pp", "0"],
     "--pp 0 is invalid"),
    (["--load", "/nonexistent/ckpt", "--data", "{prefix}", "--seq-len", "16"],
     "no such checkpoint directory"),
    (["--load", "{corrupt}", "--data", "{prefix}", "--seq-len", "16"], "checksum mismatch"),
    (["--load", "{pickled_hf}", "--data", "{prefix}", "--seq-len", "16"],
     "holds a Hugging Face model (config.json), not a megapar checkpoint; import it with "
     "megapar-convert --from-hf"),
    (["--load", "{ckpt}", "--data", "{empty_idx}", "--seq-len", "16"],
     "empty_idx.idx is empty (0 bytes): not a megapar or Megatron-LM index"),
    (["--load", "{ckpt}", "--input-ids", "{ids:float}", "--save-logits", "out.npy"],
     "holds float64 values; token ids must be integers"),
    (["--load", "{ckpt}", "--input-ids", "{ids:flat}", "--save-logits", "out.npy"],
     "must be a non-empty [batch, seq] array, got shape (4,); one sequence of 4 ids is "
     "ids.reshape(1, 4)"),
    (["--load", "{ckpt}", "--input-ids", "{ids:long}", "--save-logits", "out.npy"],
     "sequences of 100 tokens, more than the model's 64 positions"),
    (["--load", "{ckpt}", "--input-ids", "/nonexistent.npy", "--save-logits", "out.npy"],
     "--input-ids /nonexistent.npy: no such file"),
    # was numpy's "Cannot load file containing pickled data when allow_pickle=False"
    (["--load", "{ckpt}", "--input-ids", "{ids:json}", "--save-logits", "out.npy"],
     "ids.json is a JSON file; megapar-eval reads a [batch, seq] integer array from a .npy "
     "file: convert it with: python3 -c 'import json, numpy as np; np.save("),
    (["--load", "{ckpt}", "--input-ids", "{ids:object}", "--save-logits", "out.npy"],
     "object.npy holds Python objects, not numbers (megapar never unpickles a file)"),
    (["--load", "{ckpt}", "--input-ids", "{ids:good}", "--save-logits", "{new_dir/}"],
     "new_dir/ is a directory; give a file name, e.g. --save-logits "),
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "64",
      "--micro-batch-size", "100000"], "fewer than one batch of --micro-batch-size 100000"),
    # data with no window at all: was "lower --seq-len or --micro-batch-size", and no
    # micro-batch size helps
    (["--load", "{ckpt}", "--data", "{few_words.txt}", "--seq-len", "16",
      "--data-cache", "{cache}"], "has 0 windows of 17 tokens (it holds "),
    # was "IndexError: index out of range in self" from rank 0
    (["--load", "{bert_t1_ckpt}", "--data", "{prefix}", "--seq-len", "16"],
     "the model's type_vocab_size is 1, and megapar's BERT samples ([CLS] A [SEP] B [SEP]) "
     "give segment B token type 1"),
    # was ignored without a word: a causal LM's loss masks nothing
    (["--load", "{ckpt}", "--data", "{prefix}", "--seq-len", "16", "--seed", "5"],
     "--seed 5 would be ignored: it seeds BERT's masking, and the checkpoint holds a gpt2"),
]


@pytest.mark.parametrize("argv, message", EVAL, ids=[" ".join(a) for a, _ in EVAL])
def test_megapar_eval(argv, message, env, no_workers, capsys):
    rc = evaluate(_fill(argv, env))
    line = _one_line(capsys, "megapar-eval")
    assert rc == 2 and message in line, line


def test_a_refused_evaluation_leaves_no_data_cache_directory_it_made(env, no_workers, capsys,
                                                                      tmp_path):
    """A raw text refused for holding no window left the --data-cache directory it had made,
    empty (a user's tryout of evaluation.md, which says such a refusal leaves no copy there);
    `--json` is answered (it was "did you mean --jsonl-key?")."""
    cache = tmp_path / "made" / "cache"
    argv = _fill(["--load", "{ckpt}", "--data", "{few_words.txt}", "--seq-len", "16"], env)
    assert evaluate([*argv, "--data-cache", str(cache)]) == 2
    assert "has 0 windows" in _one_line(capsys, "megapar-eval")
    assert not (tmp_path / "made").exists()
    with pytest.raises(SystemExit):
        evaluate([*argv, "--json"])
    line = _one_line(capsys, "megapar-eval")
    assert "--json: megapar-eval always prints its result as one JSON line" in line, line


BUBBLE = [
    (["--pp", "0", "-m", "4"], "--pp 0 is invalid"),
    (["--pp", "2", "-m", "0"], "--microbatches 0 is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "-1"], "--fwd-ms -1.0 is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "nan"], "--fwd-ms nan is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--bwd-ms", "inf"],
     "--bwd-ms inf is invalid"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--p2p-ms", "-1"],
     "--p2p-ms -1.0 is invalid"),
    (["--pp", "2", "-m", "4", "--tp", "3"], "8 attention heads are not divisible by --tp 3"),
    (["--pp", "2", "-m", "4", "--seq-len", "100000"],
     "--seq-len 100000 exceeds the model's 256 positions"),
    (["--pp", "100000", "-m", "100000", "--simulate", "--fwd-ms", "1"],
     "more actions and stages than megapar-bubble simulates"),
    (["--pp", "1000", "-m", "1000", "--simulate", "--fwd-ms", "1"],
     "2,000,000 actions on 1000 stages, more actions and stages than megapar-bubble "
     "simulates in seconds (50,000 actions, 256 stages)"),
    # the stages are what is too many: it read as if 8,000 actions were more than 50,000
    (["--pp", "1000", "-m", "4", "--simulate", "--fwd-ms", "1"],
     "8,000 actions on 1000 stages, more stages than megapar-bubble simulates in seconds "
     "(256)"),
    # the bubble named instead is the schedule's own (it was 1F1B's for every schedule:
    # 0.0014 here, and 0.9868 for interleaved at m < pp where the exact one is 597 / 601)
    (["--pp", "8", "-m", "5000", "--schedule", "zb-h1", "--simulate", "--fwd-ms", "1"],
     "zb-h1's bubble formula gives 0.0005, with no run"),
    (["--pp", "300", "-m", "2", "--schedule", "interleaved", "--virtual-stages", "2",
      "--simulate", "--fwd-ms", "1"], "interleaved's bubble formula gives 0.9933"),
    # a bubble under 1e-4 in two significant digits (was "0.0000": a new user's tryout)
    (["--pp", "4", "-m", "100000"], "1f1b's bubble formula gives 3.00e-05, with no run"),
    # zb-v holds two chunks per rank: 2 x 100 x 249 x 2 = 99,600 actions (counted as one chunk,
    # 49,800, it was printed, in 12.8 s where 1f1b's 49,800 took 5.8 s)
    (["--pp", "100", "-m", "249", "--schedule", "zb-v", "--show-schedule"],
     "--pp 100 x --microbatches 249 x 2 model chunks per rank is 99,600 actions on 100 stages"),
    (["--pp", "{too_many}", "-m", "4"], "local worker processes, more than this machine runs"),
    (["--pp", "2", "-m", "4", "--cp", "{limit}"],
     "--pp 2 x --tp 1 x --cp {limit} starts {twice_limit} local worker processes"),
    (["--pp", "2", "-m", "4", "--virtual-stages", "0"],
     "--virtual-stages 0 is invalid: it must be >= 1"),
    (["--pp", "2", "-m", "4", "--steps", "0"], "--steps 0 is invalid"),
    # a file's path ending in / names a directory (the trace failed after the run, the plot
    # was written as new_dir/.png.png)
    (["--pp", "2", "-m", "4", "--trace", "{new_dir/}"], "new_dir/ is a directory; give a file"),
    (["--pp", "2", "-m", "4", "--plot", "{new_dir/}"], "new_dir/ is a directory; give a file"),
    # measured runs are bounded too, and the chunks checked before a worker starts
    (["--pp", "2", "-m", "20000"], "80,000 actions on 2 stages, more actions than "
     "megapar-bubble measures or simulates in seconds (50,000)"),
    (["--pp", "2", "-m", "4", "--schedule", "interleaved", "--virtual-stages", "100000"],
     "--virtual-stages 100000 is 1,600,000 actions"),
    (["--pp", "2", "-m", "4", "--schedule", "interleaved", "--virtual-stages", "3", "--model",
      "gpt2-tiny"], "4 layers cannot be cut into --pp 2 x --virtual-stages 3 = 6 model chunks"),
]


@pytest.mark.parametrize("argv, message", BUBBLE, ids=[" ".join(a) for a, _ in BUBBLE])
def test_megapar_bubble(argv, message, no_workers, capsys, tmp_path):
    limit = launcher.local_worker_limit()
    names = {"{too_many}": TOO_MANY, "{limit}": str(limit), "{new_dir/}": f"{tmp_path}/new_dir/"}
    rc = bubble([names.get(a, a) for a in argv])
    line = _one_line(capsys, "megapar-bubble")
    message = message.format(limit=limit, twice_limit=2 * limit)
    assert rc == 2 and message in line, line


# --- model and layout checks come before any data is read or anything written ----------------
EARLY = [
    (["--tp", "3"], "4 attention heads are not divisible by --tp 3"),
    (["--pp", "8"], "2 layers cannot be cut into --pp 8 stages"),
    (["--model", "no-such-recipe"], "no-such-recipe"),
    (["--model", "{broken}"], "not valid JSON"),
    (["--model", "{heads}"], "hidden size 32 is not divisible by 5 attention heads"),
    (["--model", "{layers}"], "n_layer=0 must be a whole number >= 1"),
    (["--from-hf", "{missing}"], "no such directory"),
]


@pytest.mark.parametrize("argv, message", EARLY, ids=[" ".join(a) for a, _ in EARLY])
def test_model_and_layout_errors_come_before_tokenizing_and_writing(tmp_path, argv, message,
                                                                    no_workers, capsys):
    text = tmp_path / "fresh.txt"
    text.write_text(f"{tmp_path}\n\n" + Path(asset_path("shakespeare_sample.txt")).read_text())
    files = {"broken": "{\"model_type\": \"gpt2\",", "missing": None,
             "heads": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 5},
             "layers": {"model_type": "gpt2", "n_embd": 32, "n_layer": 0, "n_head": 4}}
    for name, content in files.items():
        if content is not None:
            (tmp_path / f"{name}.json").write_text(content if isinstance(content, str)
                                                   else json.dumps(content))
    argv = [str(tmp_path / f"{a[1:-1]}.json") if a.startswith("{") else a for a in argv]
    model = [] if "--model" in argv else ["--model", str(tmp_path / "tiny.json")]
    (tmp_path / "tiny.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32,
                                                    "n_layer": 2, "n_head": 4}))
    rc = train(["--data", str(text), "--data-cache", str(tmp_path / "cache"), "--tokenizer",
                "sentencepiece", "--seq-len", "32", "--no-progress", "--save",
                str(tmp_path / "ckpt"), "--log-json", str(tmp_path / "logs" / "log.jsonl"),
                *model, *argv])
    line = _one_line(capsys, "megapar-train")
    assert rc == 2 and message in line, line
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["fresh.txt", "tiny.json", *(f"{n}.json" for n, c in files.items()
                                                         if c is not None)]), left


# DeepSeek-V3's config.json on the hub (deepseek-ai/DeepSeek-V3), as docs/guides/moe.md
# describes it: transformers' keys plus the eight of DeepSeek's own code and FP8 weights
DEEPSEEK_HUB_CODE_KEYS = {
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "ep_size": 1, "moe_layer_freq": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "scoring_func": "sigmoid", "seq_aux": True, "topk_method": "noaux_tc",
}
DEEPSEEK_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
    "topk_group": 4, "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280, **DEEPSEEK_HUB_CODE_KEYS,
}


def test_the_hubs_deepseek_v3_config_is_refused_naming_every_key_at_once(tmp_path, no_workers,
                                                                         capsys):
    """The hub's DeepSeek-V3 config.json was refused one key at a time ("unknown key
    'auto_map' for deepseek_v3; valid keys: ..."), eight reruns to load it; now megapar-train
    --model, megapar-plan --model and megapar-convert --from-hf name all eight in one line, and
    the file without them loads. A typo and a transformers setting at a value megapar does not
    implement are named in the same line."""
    from megapar.cli.convert import main as convert
    from megapar.cli.plan import main as plan
    from megapar.models.config import config_from_file

    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps(DEEPSEEK_HUB))
    config = str(hub / "config.json")
    code = ", ".join(repr(key) for key in DEEPSEEK_HUB_CODE_KEYS)
    says = (f"model config: deepseek_v3 does not take {code} (settings of DeepSeek's own code "
            f"and FP8 weights in the hub's config.json, which megapar does not read: "
            f"docs/guides/moe.md); remove these 8 keys")
    for tool, run in [("megapar-train", lambda: train(["--model", config, "--dry-run"])),
                      ("megapar-plan", lambda: plan(["--model", config, "--gpus", "64",
                                                     "--seq-len", "4096"])),
                      ("megapar-convert", lambda: convert(["--from-hf", str(hub),
                                                           str(tmp_path / "out")]))]:
        assert run() == 2, tool
        line = _one_line(capsys, tool)
        assert line.endswith(f"{config}: {says}"), line
    assert not (tmp_path / "out").exists()
    clean = {k: v for k, v in DEEPSEEK_HUB.items() if k not in DEEPSEEK_HUB_CODE_KEYS}
    (hub / "config.json").write_text(json.dumps(clean))
    assert config_from_file(config).num_local_experts == 256
    (hub / "config.json").write_text(json.dumps({**clean, "ep_size": 1, "n_grup": 8,
                                                 "frobnicate": 1, "pretraining_tp": 2}))
    assert train(["--model", config, "--dry-run"]) == 2
    line = _one_line(capsys, "megapar-train")
    assert line.endswith(
        "deepseek_v3 does not take 'ep_size' (settings of DeepSeek's own code and FP8 weights in "
        "the hub's config.json, which megapar does not read: docs/guides/moe.md), 'n_grup' (did "
        "you mean 'n_group'?), 'frobnicate', pretraining_tp=2 (a transformers DeepseekV3Config "
        "setting megapar implements only at 1); remove these 4 keys"), line


# --- unbounded work: answered in seconds (a generous timeout, not a performance assert) -----
@pytest.mark.timeout(60)
def test_a_billion_gpus_are_planned_in_seconds(capsys):
    from megapar.cli.plan import main as plan

    assert plan(["--model", "gpt2-124m", "--gpus", "1000000000", "--global-batch-size",
                 "1000000000", "--seq-len", "1024"]) == 0
    assert "chosen: tp" in capsys.readouterr().out
    assert plan(["--model", "gpt2-124m", "--gpus", "1000000000", "--global-batch-size", "512",
                 "--seq-len", "1024"]) == 1
    assert "no valid layout" in capsys.readouterr().out


def test_megapar_data_caps_workers_at_the_cores(tmp_path, capsys):
    from megapar.cli.data import main as data
    from megapar.device import cpu_cores

    text = tmp_path / "t.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    common = ["--input", str(text), "--tokenizer", "sentencepiece", "--no-progress",
              "--split-lines"]
    assert data([*common, "--output-prefix", str(tmp_path / "many"), "--workers", "500"]) == 0
    assert f"--workers 500: using {cpu_cores()}, the CPU cores" in capsys.readouterr().err
    assert data([*common, "--output-prefix", str(tmp_path / "one"), "--workers", "1"]) == 0
    assert (tmp_path / "many.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()


# --- megapar-data: one line, and no progress bar before it -------------------------------------
DATA = [
    ({"--output-prefix": ""}, "--output-prefix '' is empty: give a prefix such as data/corpus"),
    ({"--output-prefix": "{root}/"}, "names no file"),
    ({"--input": "{binary}"}, "binary is binary (NUL bytes in its first KiB), not text"),
    ({"--input": "{latin1}"}, "are not valid UTF-8 (binary data or another encoding?)"),
    ({"--input": "{bad.jsonl}"}, "bad.jsonl:2: the line is not valid JSON (Expecting value at "
                                 "column 1); repair or delete the line"),
    ({"--input": "{empty.txt}"}, "no text in"),
    ({"--tokenizer": "{garbage.model}"}, "is not a SentencePiece model"),
    # a flag this run would not read was ignored without a word
    ({"--sp-model-type": "bpe"}, "--sp-model-type bpe would be ignored: it is the type of the "
                                 "SentencePiece model --train-tokenizer sentencepiece trains, "
                                 "and this run trains none"),
    ({"--jsonl-key": "body"}, "--jsonl-key body would be ignored: no input is .jsonl"),
    # a directory of .model files: the fix is the file, not a vocab.json + merges.txt
    ({"--tokenizer": "{root}"}, "holds SentencePiece model(s) (garbage.model), not a "
                                "tokenizer.json or vocab.json + merges.txt; pass the model file"),
]


@pytest.mark.parametrize("flags, message", DATA, ids=[m for _, m in DATA])
def test_megapar_data(tmp_path, flags, message, capsys, monkeypatch):
    from megapar.cli.data import main as data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "binary").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "latin1").write_bytes(bytes(range(1, 256)) * 40)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "garbage.model").write_bytes(b"\x00not a sentencepiece model" * 10)
    (tmp_path / "ok.txt").write_text("Some text to tokenize.\n")
    args = {"--input": str(tmp_path / "ok.txt"), "--output-prefix": str(tmp_path / "out" / "x"),
            "--tokenizer": "sentencepiece", **flags}
    argv = [x for k, v in args.items() for x in
            (k, v.replace("{root}", str(tmp_path)) if "{root}" in v else
             str(tmp_path / v[1:-1]) if v.startswith("{") else v)]
    assert data(argv) == 2  # with the progress bar on: it must not show before the error
    line = _one_line(capsys, "megapar-data")
    assert message in line, line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("train", [["--train-tokenizer", "bpe", "--vocab-size", "300"],
                                   ["--train-tokenizer", "wordpiece", "--vocab-size", "50"],
                                   ["--train-sentencepiece", "--vocab-size", "50"]])
def test_training_a_tokenizer_on_no_text_is_the_no_text_line(tmp_path, train, capsys):
    """An empty input trained a BPE ("trained a byte-level BPE ...", then "no text"), failed in
    SentencePiece's trainer ("a smaller --vocab-size ... fixes it") or WordPiece's ("encodes
    text to nothing ... save it with AutoTokenizer"): each is refused before training."""
    from megapar.cli.data import main as data

    (tmp_path / "empty.txt").write_text("\n \n")
    assert data(["--input", str(tmp_path / "empty.txt"), "--output-prefix",
                 str(tmp_path / "out" / "x"), *train]) == 2
    line = _one_line(capsys, "megapar-data")
    assert line == (f"megapar-data: error: no text in {tmp_path / 'empty.txt'}: every input is "
                    "empty or whitespace; nothing written"), line
    assert not (tmp_path / "out").exists()


def test_megapar_data_split_lines_without_a_txt_input_is_refused(tmp_path, capsys):
    """--split-lines cuts a .txt into paragraphs; with only .jsonl inputs it was ignored."""
    from megapar.cli.data import main as data

    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert data(["--input", str(tmp_path / "docs.jsonl"), "--split-lines", "--output-prefix",
                 str(tmp_path / "out" / "x"), "--tokenizer", "sentencepiece"]) == 2
    line = _one_line(capsys, "megapar-data")
    assert ("--split-lines would be ignored: it cuts a .txt input into paragraphs, and no input "
            "is .txt" in line), line
    assert not (tmp_path / "out").exists()


# --- a damaged tokenizer file: one line naming the file, in every command that takes one ------
def _broken_tokenizers(root: Path) -> dict[str, Path]:
    """A truncated tokenizer.json, a tokenizer.json with a truncated tokenizer_config.json, and
    GPT-2 vocab.json + merges.txt directories whose merges.txt / vocab.json is damaged (a
    merges.txt empty or cut at a line break loads, but encodes nearly byte by byte)."""
    from megapar.data import load_tokenizer

    made = {name: root / name for name in ("truncated", "bad_merges", "bad_vocab", "bad_config",
                                           "empty_merges", "cut_merges")}
    for path in made.values():
        path.mkdir(exist_ok=True)
    whole = load_tokenizer("gpt2")._backend.to_str()
    (made["truncated"] / "tokenizer.json").write_text(whole[:len(whole) // 2])
    (made["bad_config"] / "tokenizer.json").write_text(whole)
    (made["bad_config"] / "tokenizer_config.json").write_text('{"eos_token": ')
    vocab, merges = Path(asset_path("gpt2_vocab.json")), Path(asset_path("gpt2_merges.txt"))
    (made["bad_merges"] / "vocab.json").write_bytes(vocab.read_bytes())
    (made["bad_merges"] / "merges.txt").write_text("#version: 0.2\nnot a merge line at all\n")
    (made["bad_vocab"] / "vocab.json").write_bytes(vocab.read_bytes()[:300])
    (made["bad_vocab"] / "merges.txt").write_bytes(merges.read_bytes())
    lines = merges.read_bytes().splitlines(keepends=True)
    for name, kept in (("empty_merges", b""), ("cut_merges", b"".join(lines[:1000]))):
        (made[name] / "vocab.json").write_bytes(vocab.read_bytes())  # cut at a line break:
        (made[name] / "merges.txt").write_bytes(kept)                # valid lines, too few
    return made


BROKEN = [("truncated", "tokenizer.json"), ("bad_merges", "merges.txt"),
          ("bad_vocab", "vocab.json"), ("bad_config", "tokenizer_config.json"),
          ("empty_merges", "merges.txt"), ("cut_merges", "merges.txt")]


@pytest.mark.parametrize("tool", ["megapar-data", "megapar-train", "megapar-convert",
                                  "megapar-eval"])
@pytest.mark.parametrize("broken, culprit", BROKEN, ids=[b for b, _ in BROKEN])
def test_a_damaged_tokenizer_file_is_one_line_naming_it(tool, broken, culprit, env, no_workers,
                                                        capsys, tmp_path):
    from megapar.cli.convert import main as convert
    from megapar.cli.data import main as data

    spec = str(_broken_tokenizers(tmp_path)[broken])
    text = str(env["root"] / "text.txt")
    if tool == "megapar-data":
        rc = data(["--input", text, "--output-prefix", str(tmp_path / "out" / "x"),
                   "--tokenizer", spec])
    elif tool == "megapar-train":
        rc = train(["--data", text, "--data-cache", str(tmp_path / "cache"), "--tokenizer",
                    spec, "--model", "gpt2-tiny", "--no-progress"])
    elif tool == "megapar-convert":
        rc = convert([env["ckpt"], "--to-hf", str(tmp_path / "hf"), "--tokenizer", spec])
    else:  # a Megatron-LM dataset without megapar's .json takes its tokenizer from --tokenizer
        prefix = str(tmp_path / "mt")
        assert data(["--input", text, "--output-prefix", prefix, "--format", "megatron",
                     "--tokenizer", "sentencepiece", "--no-progress"]) == 0
        Path(prefix + ".json").unlink()
        capsys.readouterr()
        rc = evaluate(["--load", env["ckpt"], "--data", prefix, "--seq-len", "16",
                       "--tokenizer", spec])
    line = _one_line(capsys, tool)
    assert rc == 2 and f"{spec}/{culprit}" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_convert_names_an_empty_path_and_a_file_in_the_way(env, tmp_path, capsys):
    """`--to-hf ''` is named as an empty path (it read as no --to-hf: "expected SRC DST"), and
    a destination under a file names that file (not an internal probe's name)."""
    from megapar.cli.convert import main as convert

    assert convert([env["ckpt"], "--to-hf", ""]) == 2
    assert "--to-hf '' is an empty path" in _one_line(capsys, "megapar-convert")
    (tmp_path / "afile").write_text("x")
    assert convert([env["ckpt"], "--to-hf", str(tmp_path / "afile" / "sub")]) == 2
    line = _one_line(capsys, "megapar-convert")
    assert f"{tmp_path / 'afile'} is a file, not a directory" in line and "probe" not in line


def test_a_fresh_run_says_it_starts_an_earlier_runs_log_json_anew(env, tmp_path, monkeypatch,
                                                                  capsys):
    """Issue 44 (drill round 3): a fresh run truncated another run's --log-json silently."""
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n')
    monkeypatch.setattr(train_cli, "run_workers", lambda *a, **k: [None])
    assert train([*env["common"], "--log-json", str(log)]) == 0
    err = capsys.readouterr().err
    assert (f"--log-json {log} holds 2 records of an earlier run: this fresh run starts the "
            f"file anew") in err, err


def test_a_second_ctrl_c_names_the_checkpoint_left_to_resume_from(env, tmp_path, monkeypatch,
                                                                  capsys):
    """Issue 44 (drill round 3): 'nothing saved' although --save's latest was there."""
    save = tmp_path / "ck"
    save.mkdir()
    (save / "latest").write_text("step_00000004\n")

    def abort(*args, **kwargs):
        raise KeyboardInterrupt("second SIGINT")

    monkeypatch.setattr(train_cli, "run_workers", abort)
    assert train([*env["common"], "--save", str(save), "--save-interval", "0"]) == 130
    err = capsys.readouterr().err
    assert "nothing saved" not in err and f"{save}/latest is step_00000004" in err, err
    assert "aborted (second SIGINT)" in err, err
    # a first Ctrl-C before the launcher forwards it (Python's KeyboardInterrupt) is no second
    monkeypatch.setattr(train_cli, "run_workers", lambda *a, **k: signal.default_int_handler(
        signal.SIGINT, None))
    assert train([*env["common"], "--save", str(save), "--save-interval", "0"]) == 130
    err = capsys.readouterr().err
    assert "aborted (SIGINT while starting): any save in flight" in err, err
    # a Ctrl-C while --data is tokenized (before the launcher): one line, not a traceback,
    # and the --save lock (when taken) released
    real_plan = train_cli.plan_run

    def tokenizing(cfg, notes=None):
        real_plan(cfg, notes)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "plan_run", tokenizing)
    assert train([*env["common"], "--save", str(save), "--save-interval", "0"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == (f"megapar-train: aborted (SIGINT while starting): any save in flight "
                           f"is lost; {save}/latest is step_00000004, the checkpoint to resume "
                           f"from (--load {save})"), err
    # one after the --save lock is taken releases it
    monkeypatch.setattr(train_cli, "plan_run", real_plan)

    def removing(cfg):
        assert (save / "megapar.lock").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "_remove_newer_steps", removing)
    assert train([*env["common"], "--save", str(save), "--overwrite-newer"]) == 130
    assert "aborted (SIGINT while starting)" in capsys.readouterr().err
    assert not (save / "megapar.lock").exists()


def test_an_unknown_flag_is_never_taken_for_help(capsys):
    """megapar-eval has no --ep (a megapar-train flag): the line named --help as its likely
    spelling ("--ep: did you mean --help?"); now it suggests nothing, and a real typo still
    gets its flag."""
    from megapar.cli.eval import main as eval_main

    for argv, hint in ((["--load", "x", "--ep", "2"], None),
                       (["--load", "x", "--max-batch", "2"], "did you mean --max-batches?")):
        with pytest.raises(SystemExit) as exc:
            eval_main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--help?" not in err, err
        assert hint is None or hint in err, err


def test_a_flag_cut_short_is_answered_with_the_one_it_begins(capsys):
    """No flag takes an abbreviation, and `megapar-data --out DIR` was answered "--out: did you
    mean --input?" (difflib's closest spelling); a name that begins one flag only is that
    flag."""
    from megapar.cli.data import main as data_main

    with pytest.raises(SystemExit) as exc:
        data_main(["--input", "a.txt", "--out", "data/x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--out: did you mean --output-prefix?" in err


def test_a_misspelt_choice_is_answered_with_the_closest(capsys):
    """A value a flag's choices lack (`--attention-mask-type block-causal`, `--optimizer Muon`)
    was refused with the choices only; now the closest is named, and none when none is close."""
    from megapar.training.config import parse_args

    for argv, hint in ((["--attention-mask-type", "block-causal"], "did you mean block_causal?"),
                       (["--optimizer", "Muon"], "did you mean muon?"),
                       (["--schedule", "xyz"], None)):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "invalid choice" in err, err
        assert (hint in err) if hint else ("did you mean" not in err), err


def test_a_value_given_to_a_switch_is_answered_with_the_switch(capsys):
    """`--account-for-embedding-in-pipeline-split=1` got argparse's "argument
    --account-for-embedding-in-pipeline-split/--no-account-for-embedding-in-pipeline-split:
    ignored explicit argument '1'"; now the switch is named with what the value meant: the flag
    alone for on, its --no- spelling for off."""
    from megapar.cli.plan import main as plan
    from megapar.training.config import parse_args

    flag = "--account-for-embedding-in-pipeline-split"
    for argv, says in [
        ([f"{flag}=1"], f"{flag} is a switch and takes no value (=1 given); give {flag} alone"),
        ([f"{flag}=false"], f"{flag} is a switch and takes no value (=false given); give "
                            f"--no-{flag[2:]}"),
        (["--dry-run=maybe"], "--dry-run is a switch and takes no value (=maybe given); give "
                              "--dry-run alone to turn it on; to turn it off, give --no-dry-run"),
        # the --no- spelling's true is off (--no-compile=true was told "give --compile alone")
        (["--no-compile=true"], "--no-compile is a switch and takes no value (=true given); "
                                "give --no-compile (see"),
        (["--no-compile=0"], "--no-compile is a switch and takes no value (=0 given); give "
                             "--compile alone"),
        (["--compile", "--no-compile=true"], "--no-compile is a switch and takes no value "
                                             "(=true given); give --no-compile (see"),  # beside
        # the plain switch too (it answered --compile's, the opposite; a re-test)
    ]:
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2
        line = _one_line(capsys, "megapar-train")
        assert says in line, line
    with pytest.raises(SystemExit) as exc:
        plan(["--model", "llama-tiny", "--gpus", "2", "--seq-len", "128",
              "--account-for-loss-in-pipeline-split=1"])
    assert exc.value.code == 2
    assert "give --account-for-loss-in-pipeline-split alone" in _one_line(capsys, "megapar-plan")


def test_a_pipeline_split_given_to_explain_names_megapar_plans_flag(capsys):
    """`megapar-plan --explain tp=1,pp=2,first=1` was "unknown key 'first'; keys: tp, pp, ..."
    (the split is no layout key): now the flag that gives it beside --explain is named."""
    from megapar.cli.plan import main as plan

    common = ["--model", "llama-tiny", "--gpus", "2", "--seq-len", "128", "--explain"]
    for item, says in [
        ("first=1", "--explain: first=1 is not a layout item: the pipeline split is "
                    "megapar-plan's flag, which --explain's layout takes too; drop it and give "
                    "--decoder-first-pipeline-num-layers 1 beside --explain"),
        ("decoder-last-pipeline-num-layers=3", "give --decoder-last-pipeline-num-layers 3 "
                                               "beside --explain"),
        ("embedding=1", "give --account-for-embedding-in-pipeline-split beside --explain"),
        ("loss=0", "megapar-plan's --account-for-loss-in-pipeline-split, off unless given; "
                   "drop loss=0"),
    ]:
        assert plan([*common, f"tp=1,pp=2,{item}"]) == 2
        line = _one_line(capsys, "megapar-plan")
        assert says in line, line


def test_another_tools_flag_is_answered_with_megapars(tmp_path, capsys):
    """Megatron-LM's, torchtitan's or Hugging Face Trainer's name for a flag: difflib named an
    unrelated one (`--resume: did you mean --recompute?`, `--train-iters`: `--rank-order`,
    `--ckpt`: `--cp`); now megapar's. Each named flag exists; a --config key likewise."""
    from megapar.training.config import build_parser, parse_args
    from megapar.training.other_tools import OTHER_TOOLS_FLAGS

    for argv, hint in ((["--resume", "ck"], "--resume: did you mean --load?"),
                       (["--train-iters=5"], "--train-iters: did you mean --max-steps?"),
                       (["--ckpt", "ck"], "--ckpt: did you mean --load or --save?"),
                       (["--max-step", "5"], "--max-step: did you mean --max-steps?"),
                       # Megatron's: difflib named --val-fraction, --cp-comm-type, --timeout-s
                       (["--normalization", "RMSNorm"], "--normalization: a model's "
                        "normalisation comes with its family"),
                       (["--tp-comm-overlap"], "--tp-comm-overlap: megapar-train does not"),
                       (["--moe-router-fusion"], "--moe-router-fusion: megapar's router"),
                       (["--moe-extended-tp"], "--moe-extended-tp: Megatron's extended tp")):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and hint in err, err
    known = build_parser()._option_string_actions
    nameable = set(known) | _every_commands_flags()
    for other, ours in OTHER_TOOLS_FLAGS.items():
        assert other not in known, other
        if ours.startswith("--"):  # "did you mean": megapar-train's own flags
            assert all(w in known for w in ours.split() if w.startswith("--")), ours
        else:  # a sentence: it names megapar-train's, or another megapar command's, flags
            assert all(w.rstrip(",;)") in nameable
                       for w in ours.split() if w.startswith("--")), ours
    config = tmp_path / "run.yaml"
    config.write_text("train_iters: 3\n")
    with pytest.raises(Exception, match="unknown setting 'train_iters'; did you mean --max-steps"):
        parse_args(["--config", str(config)])
    # a key no spelling is close to, sharing a word with a setting: named by that word (it said
    # "valid keys are the megapar-train flags"; a user's tryout)
    for key in ("lr_warmup", "learning_rate_warmup"):
        config.write_text(f"{key}: 3\n")
        with pytest.raises(Exception, match=f"unknown setting '{key}'; did you mean "
                                            f"'warmup_steps'\\?$"):
            parse_args(["--config", str(config)])
    # names of many training scripts, which the spelling matched to the wrong setting (max_lr to
    # min_lr, save_dir to save_interval, peak_lr to peak_tflops; a second re-test)
    for key, said in (("max_lr", "did you mean --lr (the peak"), ("peak_lr", "did you mean --lr (the peak"),
                      ("save_dir", "did you mean --save?"),
                      ("lr_schedule", "did you mean --lr-decay"),
                      ("min_learning_rate", "did you mean --min-lr?"),
                      # tensor_parallel was 'expert_tensor_parallel_size', pipeline_parallel
                      # 'sequence_parallel' (a re-test)
                      ("tensor_parallel", "did you mean --tp?"),
                      ("pipeline_parallel", "did you mean --pp?")):
        config.write_text(f"{key}: 3\n")
        with pytest.raises(Exception, match=f"unknown setting '{key}'; {said}".replace(
                "(", r"\(").replace("?", r"\?")):
            parse_args(["--config", str(config)])
    # a switch given as false was answered with what true asks for (bf16: false, "did you
    # mean --precision bf16?"; a re-test)
    for text, said in (("bf16: false", "false asks for no bf16: remove the key (fp32 is "
                                       "megapar-train's default --precision; true would be "
                                       "--precision bf16)"),
                       ("use_tp_pp_dp_mapping: false", "false is Megatron-LM's default rank "
                        "order, tp-cp-ep-dp-pp: --rank-order tp-dp-pp"),
                       # any other switch's false was told what true asks for (a re-test:
                       # gradient_checkpointing: false, "did you mean --recompute full?")
                       ("gradient_checkpointing: false", "false leaves it off, as megapar-train "
                        "does by default: remove the key (true would be --recompute full)"),
                       ("use_distributed_optimizer: false", "(true would be --zero 1)"),
                       ("decay_lr: false", "false asks for a constant learning rate: --lr-decay "
                        "constant"),
                       ("decay_lr: true", "true is megapar-train's default: it decays the "
                        "learning rate (--lr-decay cosine); remove the key"),
                       ("dynamic_loss_scale: false", "false asks for a static fp16 loss scale: "
                        "--loss-scale S"),
                       ("dynamic_loss_scale: true", "megapar's fp16 loss scale is dynamic "
                        "unless --loss-scale S is given: drop it"),
                       ("mock_data: false", "false asks for your corpus: --data PATH"),
                       # a flag whose default is no "off" is not said to be the default
                       # (lr_scheduler: false was "leaves it off, as megapar-train does"), but
                       # the value that turns it off (it was "did you mean --lr-decay (the
                       # learning rate's schedule ...)?", which false is not)
                       ("lr_scheduler: false", "false turns it off: --lr-decay constant"),
                       ("grad_clip: false", "false turns it off: --clip-grad 0"),
                       ("accumulate_allreduce_grads_in_fp32: false", "false reduces the "
                        "gradients in the 16-bit dtype: --grad-reduce-dtype bf16"),
                       # YAML's 0 / 1 for a switch (bf16: 0 was "did you mean --precision
                       # bf16?"; a re-test), and a switch of megapar's spelt otherwise, false
                       # (torch_compile: false was "did you mean 'compile'?")
                       ("bf16: 0", "false asks for no bf16: remove the key"),
                       ("decay_lr: 1", "true is megapar-train's default"),
                       ("torch_compile: false", "did you mean 'compile'? false is its default "
                        "(off): remove the key"),
                       ("warmup_ratio: 0", "did you mean --warmup-steps (a step count"),
                       # a string YAML does not read as a boolean, or quoted (bf16: n was
                       # "did you mean --precision bf16?"; a re-test)
                       ("bf16: n", "false asks for no bf16: remove the key"),
                       ('bf16: "0"', "false asks for no bf16: remove the key"),
                       ('decay_lr: "true"', "true is megapar-train's default"),
                       # a switch the run turns on where not given (--progress, at a terminal)
                       # is not off by default (it was told to remove the key; a re-test)
                       ("progress_bar: false", "did you mean 'progress'? write progress: false")):
        config.write_text(text + "\n")
        with pytest.raises(Exception) as info:
            parse_args(["--config", str(config)])
        assert said in str(info.value), str(info.value)
    # a number's false: the value that is off (zero: false was "--zero False is invalid:
    # expected a whole number", where --no-zero is told --zero 0; a re-test)
    for text, said in (("zero: false", "zero: false: its default is 0 (off); remove the key"),
                       ("clip_grad: false", "clip_grad: false: write clip_grad: 0 (off)"),
                       ("label_smoothing: false", "label_smoothing: false: its default is 0")):
        config.write_text(text + "\n")
        with pytest.raises(Exception) as info:
            parse_args(["--config", str(config)])
        assert str(info.value) == f"{config}: {said}" or said in str(info.value), str(info.value)
    # a choice's false is its off as the command line's --no- spelling is told (precision:
    # false was "choose one of ..."; a re-test)
    config.write_text("precision: false\nlr_decay: false\nmax_steps: 3\n")
    cfg = parse_args(["--config", str(config)])
    assert (cfg.precision, cfg.lr_decay) == ("fp32", "constant")
    # megapar's own switches read the same words (tf32: n was "'n' is invalid"; a re-test)
    config.write_text('tf32: n\nprogress: "y"\nmax_steps: 3\n')
    cfg = parse_args(["--config", str(config)])
    assert cfg.tf32 is False and cfg.progress is True


@pytest.mark.parametrize("line, said", [
    # on the command line a switch's value was not read (--gradient_checkpointing=False: "did
    # you mean --recompute full?"; --decay_lr=True: "did you mean --lr-decay constant"; a
    # re-test): answered as in a --config file
    (["--gradient_checkpointing=False"], "--gradient_checkpointing=False: false leaves it off, "
     "as megapar-train does by default: leave the flag out (true would be --recompute full)"),
    (["--decay_lr=True"], "--decay_lr=True: true is megapar-train's default: it decays the "
     "learning rate (--lr-decay cosine); leave the flag out"),
    (["--decay_lr", "false"], "--decay_lr: false asks for a constant learning rate: "
     "--lr-decay constant"),
    (["--bf16=no"], "--bf16=no: false asks for no bf16: leave the flag out"),
    # a number is no switch's value (--loss_scale 0 was "false leaves it off")
    (["--loss_scale", "0"], "--loss_scale: did you mean --loss-scale (a static scale"),
    # the Trainer's other spellings of false (its string_to_bool: 0, f, n) were read as true
    # ("--bf16: did you mean --precision bf16?"; a re-test), and 1 as false (--decay_lr=1:
    # "--lr-decay constant")
    (["--bf16", "0"], "--bf16: false asks for no bf16: leave the flag out"),
    (["--bf16=f"], "--bf16=f: false asks for no bf16"),
    (["--gradient_checkpointing=n"], "--gradient_checkpointing=n: false leaves it off"),
    (["--decay_lr=1"], "--decay_lr=1: true is megapar-train's default"),
    # megapar's own switch spelt otherwise, given false, was offered the switch itself
    # (--sequence_parallel=False: "did you mean --sequence-parallel?", which turns it on), and
    # the Trainer's torch_compile its --no- spelling or --compile by its value's absence
    (["--sequence_parallel=False"], "--sequence_parallel=False: false leaves "
     "--sequence-parallel off, as it is by default: leave the flag out"),
    (["--torch_compile=False"], "false leaves --compile off, as it is by default"),
    # one whose default the run chooses (--progress: at a terminal) was "off, as it is by
    # default: leave the flag out", leaving the bar on (a re-test)
    (["--progress_bar=False"], "--progress_bar=False: did you mean --no-progress?"),
    (["--torch-compile", "False"], "--torch-compile: false leaves --compile off"),
    (["--torch-compile"], "--torch-compile: did you mean --compile?"),
    # another tool's switch in its --no- spelling is its false (--no-decay-lr was "did you
    # mean --no-dry-run?"; --no-bf16 had no answer)
    (["--no-decay-lr"], "--no-decay-lr: false asks for a constant learning rate: --lr-decay "
     "constant"),
    (["--no-bf16"], "--no-bf16: false asks for no bf16: leave the flag out"),
    (["--no-gradient-checkpointing"], "--no-gradient-checkpointing: false leaves it off"),
    # megapar's own flag of a list of values, one of them off, in a --no- spelling: that value
    # (--no-fp8 was "did you mean --no-fp8-emulate?", another switch; --no-zero "--no-zero3-")
    (["--no-recompute"], "--no-recompute: did you mean --recompute none?"),
    (["--no-fp8"], "--no-fp8: did you mean --fp8 off?"),
    (["--no-zero"], "--no-zero: did you mean --zero 0?"),
    (["--no_grad_compression"], "--no_grad_compression: did you mean --grad-compression none?"),
    # and of a flag on by default that a value turns off, or off unless given (--no-save was
    # "did you mean --save?", --no-wandb "--no-debug?", --no-lr-scheduler "--schedule?")
    (["--no-clip-grad"], "--no-clip-grad: did you mean --clip-grad 0?"),
    # a value flag without an off: that it takes a value (--no-label-smoothing was "did you
    # mean --label-smoothing?", which then wanted one); mixed precision's off is fp32
    (["--no-label-smoothing"], "--no-label-smoothing: --label-smoothing takes a value (no --no- "
     "spelling): leave it out for its default, or give one"),
    (["--no-amp"], "--no-amp: false turns it off: --precision fp32"),
    (["--no-warmup"], "--no-warmup: false turns it off: --warmup-steps 0"),  # (no answer)
    (["--no-mixed-precision"], "--no-mixed-precision: false turns it off: --precision fp32"),
    # a --no- typo of a switch is still guessed, by what follows the "no-"
    (["--no-compil"], "--no-compil: did you mean --no-compile?"),
    (["--no-weight-decay"], "--no-weight-decay: did you mean --weight-decay 0?"),
    (["--no-save"], "--no-save: --save is off unless given: leave it out"),
    (["--no-grad-clip"], "--no-grad-clip: false turns it off: --clip-grad 0"),
    (["--no-lr-scheduler"], "--no-lr-scheduler: false turns it off: --lr-decay constant"),
    (["--no-wandb"], "--no-wandb: false leaves it off, as megapar-train does by default: leave "
     "the flag out (true would be --wandb-project NAME)"),
    (["--do_eval=False"], "--do_eval=False: false asks for no evaluation: --eval-interval 0"),
    (["--no-eval"], "--no-eval: false asks for no evaluation: --eval-interval 0"),
    # nanoGPT's eval_only false is a training run (it was told megapar-eval); megapar's own
    # switch given a spaced true / false (the Hugging Face parser's --tf32 False) is told
    # its spelling (it was "takes no value"; a re-test)
    (["--eval_only=False"], "--eval_only=False: false is a training run, megapar-train's: "
     "leave the flag out"),
    (["--tf32", "False"], "unexpected argument 'False': --tf32 takes no value: for false give "
     "--no-tf32"),
    (["--tf32", "true"], "--tf32 takes no value: give --tf32 alone"),
    # true (or no value) keeps what the flag asks for
    (["--bf16=True"], "--bf16: did you mean --precision bf16?"),
    (["--gradient_checkpointing"], "--gradient_checkpointing: did you mean --recompute full?"),
])
def test_another_tools_switch_on_the_line_is_answered_by_its_value(line, said, capsys):
    from megapar.training.config import parse_args

    with pytest.raises(SystemExit) as code:
        parse_args(line)
    assert code.value.code == 2
    err = capsys.readouterr().err
    assert said in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flag", ["--no-dropout", "--no-lr-warmup", "--no-tp", "--no-dp",
                                  "--no-profile", "--no-cosine", "--no-pin-memory", "--no-fp32"])
def test_a_no_flag_is_not_guessed_as_another_switchs_off(flag, capsys):
    """--no-dropout and --no-lr-warmup were "did you mean --no-dry-run?" (which starts a real
    run), --no-tp "--no-tf32?", --no-profile "--no-compile?": the "no-" they share made them
    close (a re-test); none is guessed now."""
    from megapar.training.config import parse_args

    with pytest.raises(SystemExit):
        parse_args([flag, "--dry-run"])
    line = _one_line(capsys, "megapar-train")
    assert "did you mean" not in line, line


@pytest.mark.parametrize("flag, hint", [
    ("--save_steps", "did you mean --save-interval?"),  # difflib: --max-steps
    ("--report-to", "did you mean --wandb-project NAME or --tensorboard DIR?"),  # --record-step
    ("--eval_steps", "did you mean --eval-interval (steps between evaluations"),  # --eval-steps
    ("--learning-rate", "did you mean --lr?"),  # nothing
    ("--logging-steps", "did you mean --log-interval?"),  # --profile-steps
    # FSDP's, DeepSpeed's dotted keys and torchtitan's --module: "did you mean --dp?",
    # "--config?" (which then refused an FSDP config's keys), "--model?", or nothing
    ("--fsdp", "megapar's FSDP is --zero 3"),
    ("--fsdp_config", "megapar's FSDP is --zero 3"),
    ("--zero_optimization.stage", "did you mean --zero?"),
    ("--zero_optimization.sub_group_size", "megapar's ZeRO is built in: give --zero 1, 2 or 3"),
    ("--module", "torchtitan's module and config name a Python config of its registry"),
    # megapar-generate's flags: "did you mean --recompute?", "--loss-chunk-tokens?"
    ("--prompt", "megapar-generate continues prompts with a checkpoint"),
    ("--max-new-tokens", "megapar-generate continues prompts with a checkpoint"),
    # DeepSpeed's keys under their section, in either spelling (a re-test's: "did you mean
    # --precision fp16?" for the loss scale, --optimizer for its lr)
    ("--fp16.loss_scale", "did you mean --loss-scale (a static scale"),
    ("--optimizer.params.lr", "did you mean --lr?"),
    ("--zero-optimization.stage", "did you mean --zero?"),
    ("--zero_optimization.offload_param.device", "did you mean --offload-params (to the host; "
     "no NVMe)?"),
])
def test_a_hugging_face_trainer_flag_is_answered_with_megapars(flag, hint, capsys):
    """The Trainer's names, in either spelling: difflib named an unrelated flag or none (a
    Trainer user's tryout)."""
    from megapar.training.config import parse_args

    with pytest.raises(SystemExit):
        parse_args([flag, "5"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{flag}: {hint}" in err, err


@pytest.mark.parametrize("tool", ["eval", "generate", "convert"])
def test_each_command_answers_fsdp_and_deepspeed_names(tool, capsys):
    """FSDP's and DeepSpeed's names given to megapar-eval, -generate and -convert were difflib's
    guesses ("--fsdp: did you mean --seed?", "--stage: did you mean --samples?"): each is
    answered as the command answers --zero (a re-test's finding)."""
    import importlib

    from megapar.one_line_parser import SHARDING_NAMES

    module = importlib.import_module(f"megapar.cli.{tool}")
    for flag in SHARDING_NAMES:
        with pytest.raises(SystemExit):
            module.build_parser().parse_args([flag, "3"])
        err = capsys.readouterr().err
        said = module.OTHER_FLAGS[flag]
        assert f"; {flag}: {said}" in err and "does not depend on --zero" in said, err


def test_a_required_flag_missing_beside_an_unknown_one_is_said_with_it(capsys):
    """megapar-plan --model M --gpus 2 --bf16 0 was answered for --bf16 alone, and its fix
    refused next for the --seq-len it lacked (a re-test): both in one line."""
    from megapar.cli.plan import main as plan

    with pytest.raises(SystemExit) as code:
        plan(["--model", "gpt2-tiny", "--gpus", "2", "--bf16", "0"])
    line = _one_line(capsys, "megapar-plan")
    assert code.value.code == 2 and line.endswith(
        "--bf16: false counts fp32 activations: --precision fp32 (megapar-plan counts bf16 by "
        "default); and --seq-len is required (see megapar-plan --help)"), line


def test_flags_one_sentence_answers_are_answered_together(capsys):
    """Several flags one sentence answers (megapar-generate's) were each followed by the whole
    sentence, three times over (a re-test's finding): it is said once, after all of them."""
    from megapar.training.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--prompt", "hi", "--max-new-tokens=5", "--top-p", "0.9", "--resume", "x"])
    err = capsys.readouterr().err
    assert "; --prompt, --max-new-tokens, --top-p: megapar-generate continues prompts" in err
    assert err.count("megapar-generate continues") == 1 and "--resume: did you mean --load?" \
        in err, err


@pytest.mark.parametrize("flag, hint", [
    ("--stage", "megapar-plan tries every ZeRO stage of --zero-stages itself"),  # --target?
    ("--zero_optimization.stage", "give zero=N to --explain"),  # nothing
    ("--fsdp", "FSDP's full_shard is zero 3"),  # --fp8?
    ("--deepspeed", "reads no FSDP or DeepSpeed config"),  # --fp8-speedup?
    ("--deepspeed-config", "reads no FSDP or DeepSpeed config"),  # nothing
    ("--zero_stage", "give zero=N to --explain"),  # --zero-stages?
    ("--moe-top-k", "set num_experts_per_tok there"),  # --top?
    ("--moe-router-topk", "set num_experts_per_tok there"),  # nothing
    ("--moe-token-dropping", "takes a capacity factor from the model config"),  # nothing
    ("--module", "torchtitan's module and config name a Python config"),  # --model?
])
def test_megapar_plan_answers_fsdp_deepspeed_and_torchtitan_names(flag, hint, capsys):
    """megapar-plan's answers to the names megapar-train answers (a re-test's finding: each
    was difflib's guess of an unrelated flag, or nothing)."""
    from megapar.cli.plan import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([flag, "3"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{flag}: " in err and hint in err, err


def test_megapar_plan_names_an_unknown_model_before_a_missing_flag(capsys):
    """`megapar-plan --model gtp2-124m --gpus 8` asked for --seq-len first, and once given it
    said the model was unknown: two tries for one typo. The model's line comes first now."""
    from megapar.cli.plan import main

    assert main(["--model", "gtp2-124m", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err == "megapar-plan: error: unknown model 'gtp2-124m'; did you mean gpt2-124m?\n", err
    with pytest.raises(SystemExit):  # a known one: the missing flag, as before
        main(["--model", "gpt2-124m", "--gpus", "8"])
    assert "the following arguments are required: --seq-len" in capsys.readouterr().err
    with pytest.raises(SystemExit) as help_:  # --help is answered whatever --model says
        main(["--model", "gtp2-124m", "--help"])
    assert help_.value.code == 0 and "usage: megapar-plan" in capsys.readouterr().out


def test_a_misspelt_data_path_names_the_close_ones_beside_it(tmp_path, monkeypatch):
    """`--data data/corpu` (for data/corpus) said the prefix's three files were not found and
    to pass a prefix or a .txt file; a name close to one beside it is named (a getting-started
    tryout)."""
    from megapar.training.config import parse_args
    from megapar.training.data import _text_or_prefix

    (tmp_path / "data" / "corpus").mkdir(parents=True)
    (tmp_path / "data" / "hamlet.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    cfg = parse_args([])
    for given, said in [("data/corpu", "data/corpu: corpu.bin, corpu.idx, corpu.json not found; "
                                       "did you mean data/corpus?"),
                        ("data/hamlt.txt", "data/hamlt.txt: no such text file; did you mean "
                                           "data/hamlet.txt?")]:
        with pytest.raises(FileNotFoundError) as exc:
            _text_or_prefix(cfg, given)
        assert str(exc.value) == f"--data {said}"
    with pytest.raises(FileNotFoundError, match="zzz.json not found; pass the prefix written"):
        _text_or_prefix(cfg, "data/zzz")
    # a prefix's files name the prefix, which --data takes, not its .json (a re-test)
    for suffix in (".bin", ".idx", ".json"):
        (tmp_path / "data" / f"ready{suffix}").write_text("x")
    with pytest.raises(FileNotFoundError, match="; did you mean data/ready[?]$"):
        _text_or_prefix(cfg, "data/ready.jsn")
    # the directory misspelt: the close one holding that name (a file, or a dataset's prefix)
    with pytest.raises(FileNotFoundError, match="; did you mean data/hamlet.txt[?]$"):
        _text_or_prefix(cfg, "dta/hamlet.txt")
    with pytest.raises(FileNotFoundError, match="; did you mean data/ready[?]$"):
        _text_or_prefix(cfg, "daat/ready")
    with pytest.raises(FileNotFoundError, match=r"dta/macbeth.txt: no such text file$"):
        _text_or_prefix(cfg, "dta/macbeth.txt")
    # a short name transposed, a misspelt directory above the last, both (a re-test)
    (tmp_path / "data" / "sub").mkdir()
    (tmp_path / "data" / "sub" / "c.txt").write_text("x")
    for given in ("data/sbu/c.txt", "dtaa/sub/c.txt", "dtaa/sbu/c.txt", "./dtaa/sub/c.txt"):
        with pytest.raises(FileNotFoundError, match="; did you mean data/sub/c.txt[?]$"):
            _text_or_prefix(cfg, given)
    with pytest.raises(FileNotFoundError, match=f"; did you mean {tmp_path}/data/sub/c.txt[?]$"):
        _text_or_prefix(cfg, f"{tmp_path}/dtaa/sub/c.txt")
    # a directory meant (its trailing /) was ".bin, .idx, .json not found"
    with pytest.raises(FileNotFoundError) as exc:
        _text_or_prefix(cfg, "dtaa/")
    assert str(exc.value) == "--data dtaa/: no such directory; did you mean data/?"
    # a directory meant without its / (a re-test), and a file given a / (it lost its hint)
    with pytest.raises(FileNotFoundError, match="; did you mean data/sub/[?]$"):
        _text_or_prefix(cfg, "dtaa/sbu")
    with pytest.raises(FileNotFoundError) as exc:
        _text_or_prefix(cfg, "data/sub/c.txt/")
    assert str(exc.value) == ("--data data/sub/c.txt/: data/sub/c.txt is a file, not a "
                              "directory; drop the trailing /")
    with pytest.raises(FileNotFoundError) as exc:
        _text_or_prefix(cfg, "zzz/")
    assert str(exc.value) == ("--data zzz/: no such directory; pass a directory of text, a "
                              "text file or a prepared prefix")


def test_an_eval_steps_beyond_the_validation_split_says_what_it_counts():
    """A Trainer user's --eval-steps 500 (every 500 steps there) read as 500 validation batches
    an evaluation, silently: the data line says what it counts, and what the split holds."""
    from megapar.training.config import parse_args
    from megapar.training.run_plan import _data_line

    line = _data_line(parse_args(["--eval-steps", "500"]), 2729, 142)
    assert ("(142 samples held out for validation; --eval-steps 500 counts the validation "
            "batches an evaluation reads, not the steps between evaluations, --eval-interval's "
            "100: each reads all 8 batches the split holds)") in line, line
    assert "--eval-steps" not in _data_line(parse_args(["--eval-steps", "5"]), 2729, 142)
    # a --load run takes the checkpoint's --eval-steps (its default, never given): said as if
    # the user gave it (a getting-started tryout); none, as on the run that saved it
    resumed = parse_args(["--load", "ckpt"])
    resumed.explicit, resumed.from_checkpoint = frozenset({"load", "eval_steps"}), \
        frozenset({"eval_steps"})
    assert "--eval-steps" not in _data_line(resumed, 60, 2), _data_line(resumed, 60, 2)
    # a small share of an epoch was "0.00 of an epoch" (a getting-started tryout)
    assert _data_line(parse_args(["--max-steps", "2"]), 20_000, 142).endswith(
        "--max-steps 2 x 16 sequences read 32 of them: 0.0016 of an epoch")
    tiny = parse_args(["--max-steps", "1", "--global-batch-size", "1", "--micro-batch-size", "1"])
    assert _data_line(tiny, 90_000, 142).endswith("read 1 of them: 0.000011 of an epoch")
    # resumed at another global batch: "--max-steps 4 x 8 sequences read 32 of them", where
    # the checkpoint's 3 steps had read 12 (a re-test); at its own batch the line is as before
    saved = {"step": 3, "meta": {"consumed_samples": 12}}
    wider = parse_args(["--load", "ck", "--max-steps", "4", "--global-batch-size", "8"])
    assert _data_line(wider, 2729, 142, saved).endswith(
        "--max-steps 4 read 20 of them (12 in the checkpoint's 3 steps, then 1 x 8): 0.0073 of "
        "an epoch")
    same = parse_args(["--load", "ck", "--max-steps", "5", "--global-batch-size", "4"])
    assert _data_line(same, 2729, 142, saved).endswith(
        "--max-steps 5 x 4 sequences read 20 of them: 0.0073 of an epoch")
    # 31 samples at a global batch of 16: an epoch reads 16 (was "read 32 of them: 1.0
    # epochs", more than there are, in what are 2 epochs; a new user's finding)
    assert _data_line(parse_args(["--max-steps", "2"]), 31, 2840).endswith(
        "--max-steps 2 x 16 sequences read 32 of them: 2.0 epochs (an epoch reads 16 of them, "
        "whole global batches: the last 15 of each epoch's order are left out)")
    assert _data_line(parse_args(["--max-steps", "2"]), 3201, 142).endswith("read 32 of them: "
                                                                           "0.01 of an epoch")
    # the main job's 4,800 of 682 samples is 7.0 x 682, shown as 7.1 epochs of 672 without a
    # word, the 10 left out under a twentieth (a new user's tryout): said wherever it shows
    assert _data_line(parse_args(["--max-steps", "300"]), 682, 128).endswith(
        "read 4,800 of them: 7.1 epochs (an epoch reads 672 of them, whole global batches: the "
        "last 10 of each epoch's order are left out)")


def test_the_data_line_names_the_text_files_a_directory_given_to_data_holds(tmp_path):
    """--data DIR/ read every text file under it, unnamed: a stray .txt (a tokenizer's merges
    beside the corpus) trained silently. The data line names them (the first three, and how
    many more)."""
    from megapar.training.config import parse_args
    from megapar.training.run_plan import _data_line

    (tmp_path / "texts" / "more").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "more/c.jsonl", "more/d.txt"):
        (tmp_path / "texts" / name).write_text("x")
    line = _data_line(parse_args(["--data", f"{tmp_path}/texts/"]), 100, 0)
    assert line.startswith(f"data: --data {tmp_path}/texts/ (its 4 text files: a.txt, b.txt, "
                           "more/c.jsonl and 1 more) holds 100 training samples"), line
    (tmp_path / "texts" / "more" / "d.txt").unlink()
    line = _data_line(parse_args(["--data", f"{tmp_path}/texts/"]), 100, 0)
    assert "(its 3 text files: a.txt, b.txt and more/c.jsonl) holds" in line, line  # a re-test
    (tmp_path / "texts" / "more" / "d.txt").write_text("x")
    (tmp_path / "texts" / "b.txt").unlink()
    (tmp_path / "texts" / "more" / "c.jsonl").unlink()
    (tmp_path / "texts" / "more" / "d.txt").unlink()
    line = _data_line(parse_args(["--data", str(tmp_path / "texts")]), 100, 0)
    assert f"--data {tmp_path}/texts (its 1 text file: a.txt) holds" in line, line
    line = _data_line(parse_args(["--data", str(tmp_path / "texts" / "a.txt")]), 100, 0)
    assert "text file" not in line, line


def _toml_refusal(job, text: str, *line: str) -> str:
    """megapar-train's refusal of a TOML --config holding `text`, written at `job` (beside the
    command line's flags `line`)."""
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    job.write_text(text)
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", str(job), *line])
    return str(exc.value)


def _flags(said: str) -> str:
    """The flags a job config's refusal gives, before its sentences."""
    return said.split("megapar-train flags: ", 1)[1].split(";")[0]


def test_a_torchtitan_job_config_is_answered_with_megapar_trains_flags(tmp_path):
    """A torchtitan TOML given to --config was 'not valid JSON at line 1 column 2'; now one
    line names its settings as megapar-train's flags, the float8 recipe with its value."""
    job = tmp_path / "llama3_debug.toml"
    said = _toml_refusal(job, '[job]\ndescription = "debug"\n[model]\nconverters = ["float8"]\n'
                         '[training]\nsteps = 1000\nmixed_precision_param = "bfloat16"\n'
                         '[float8]\nrecipe_name = "rowwise"\n'
                         'enable_fsdp_float8_all_gather = true\n')
    assert said.startswith(f"{job}: --config takes a JSON or YAML file of megapar-train's "
                           "flags, not a TOML job config (torchtitan's); give its settings as "
                           "megapar-train flags: --warmup-steps 200 --lr 0.0008 --lr-decay linear "
                           "--min-lr 0 --max-steps 1000 --precision bf16 --fp8 "
                           "rowwise; float8.enable_fsdp_float8_all_gather: megapar's --zero 3 "
                           "gathers") and said.endswith("(no flag named for: job.description)")
    assert "\n" not in said, said
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    # a switch written as a string is read by its word (compile.enable = "false" was "--compile
    # takes no value", checkpoint.enable = "no" still offered --save; a re-test)
    for word, compiled in (("false", False), ("true", True)):
        said = _toml_refusal(job, f'[training]\nsteps = 10\n[compile]\nenable = "{word}"\n'
                             f'[checkpoint]\nenable = "{"yes" if compiled else "no"}"\n'
                             f'folder = "ck"\n')
        assert ("--compile" in said) == compiled and ("--save" in said) == compiled, said
        assert "takes no value" not in said, said
    # [training] compile and [compile] enable both true: --compile said once (twice; a re-test)
    said = _toml_refusal(job, "[training]\nsteps = 10\ncompile = true\n[compile]\nenable = true\n")
    assert said.count("--compile") == 1, said
    job.write_text('[job]\ndescription = "debug"\n[model]\nconverters = ["float8"]\n'
                   '[training]\nsteps = 1000\nmixed_precision_param = "bfloat16"\n'
                   '[float8]\nrecipe_name = "rowwise"\n')
    with pytest.raises(ConfigError) as exc:  # the command line's over the file's
        parse_args(["--config", str(job), "--max-steps", "20", "--fp8", "off"])
    said = str(exc.value)
    assert "--max-steps 20 --precision bf16 --fp8 off;" in said and "the command line's " \
        "--max-steps 20 over the file's training.steps 1000; the command line's --fp8 off over " \
        "the file's --fp8 rowwise" in said, said


def test_a_flag_a_job_config_gives_twice_is_given_once_with_the_files_value(tmp_path):
    """A TOML holding DeepSpeed's [optimizer.params] lr printed torchtitan's default --lr
    0.0008 and then the file's --lr 0.0003: the default a key gives again is dropped."""
    said = _toml_refusal(tmp_path / "ds.toml", '[optimizer]\ntype = "AdamW"\n'
                         '[optimizer.params]\nlr = 3e-4\n')
    assert said.endswith("megapar-train flags: --warmup-steps 200 --lr-decay linear --min-lr 0 "
                         "--lr 0.0003 (no flag named for: optimizer.type)"), said


def test_a_toml_lr_in_two_tables_is_torchtitans_whatever_their_order(tmp_path):
    """[optimizer] lr beside an [optimizer.params] lr gave the later one's --lr (3e-4 or 1e-4
    by the order of the keys; a second re-test): torchtitan's [optimizer] lr, the other named."""
    for text in ('[optimizer]\nname = "AdamW"\nlr = 3e-4\n[optimizer.params]\nlr = 1e-4\n',
                 '[optimizer]\nparams = {lr = 1e-4}\nname = "AdamW"\nlr = 3e-4\n'):
        said = _toml_refusal(tmp_path / "two.toml", text)
        assert said.endswith("--optimizer adamw --lr 0.0003 (no flag named for: "
                             "optimizer.params.lr (torchtitan reads [optimizer] lr))"), said


def test_a_torchtitan_optimizer_name_is_megapars_optimizer(tmp_path):
    """[optimizer] name = "AdamW" was "optimizer.name: --optimizer (adamw, lamb, ...)": it is
    --optimizer adamw; torch's Adam (coupled decay) is named as megapar's nearest."""
    said = _toml_refusal(tmp_path / "a.toml", '[optimizer]\nname = "AdamW"\nlr = 3e-4\n')
    assert _flags(said).endswith(" --optimizer adamw --lr 0.0003"), said
    assert "optimizer.name" not in said, said
    said = _toml_refusal(tmp_path / "b.toml", '[optimizer]\nname = "Adam"\nlr = 3e-4\n')
    assert "optimizer.name Adam: torch's Adam (the weight decay added to the gradient), which " \
           "megapar has not; its nearest is --optimizer adamw" in said, said


def test_a_torchtitan_job_config_says_its_batch_sharding_and_model(tmp_path):
    """What a migrant's torchtitan job got wrong (a reviewer's finding): local_batch_size was
    --micro-batch-size alone (megapar's default global batch of 16 then two micro-batches of
    8), data_parallel_shard_degree (FSDP) and the model's flavor were "no flag named", and
    [checkpoint] enable = false still gave --save-interval."""
    job = tmp_path / "debug.toml"
    said = _toml_refusal(job, '[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\n'
                         'steps = 10\nlocal_batch_size = 8\n[parallelism]\n'
                         'data_parallel_replicate_degree = 1\ndata_parallel_shard_degree = -1\n'
                         'tensor_parallel_degree = 2\n[checkpoint]\nenable = false\n'
                         'folder = "ckpt"\ninterval = 10\n')
    assert "--micro-batch-size 8 --tp 2 --global-batch-size (8 x dp);" in said, said
    assert "parallelism.data_parallel_shard_degree: --zero 3 (torchtitan's FSDP) over" in said, said
    assert "model.flavor: --model (a recipe such as llama-1b" in said, said
    assert "replicate_degree" not in said and "checkpoint" not in said, said
    assert "no flag named" not in said, said
    said = _toml_refusal(job, '[training]\nlocal_batch_size = 8\nglobal_batch_size = 32\n'
                         '[checkpoint]\nenable = true\nfolder = "ckpt"\ninterval = 10\n')
    # both batches given; checkpointing on (torchtitan's default)
    assert "--micro-batch-size 8 --global-batch-size 32 --save-interval 10" in said, said
    assert "x dp" not in said and "checkpoint.folder: --save" in said, said
    assert "no flag named" not in said, said  # enable = true: its folder names --save


def test_a_torchtitan_lr_scheduler_is_named_as_megapars_schedule(tmp_path):
    """A torchtitan job's [lr_scheduler]: decay_ratio / decay_type / min_lr_factor were
    sentences to work out, and torchtitan's defaults (a linear decay to 0) went unsaid, so the
    flags trained megapar's cosine to a tenth of --lr; now its schedule as flags with values."""
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    job = tmp_path / "wsd.toml"
    job.write_text('[training]\nsteps = 1000\n[optimizer]\nlr = 4e-4\n[lr_scheduler]\n'
                   'warmup_steps = 100\ndecay_ratio = 0.2\ndecay_type = "sqrt"\n'
                   'min_lr_factor = 0.1\n')
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", str(job)])
    assert str(exc.value).endswith(
        "give its settings as megapar-train flags: --warmup-steps 100 --lr-decay wsd "
        "--lr-wsd-decay-fraction 0.2 --lr-wsd-decay-style sqrt --min-lr 4e-05 --max-steps 1000 "
        "--lr 0.0004; lr_scheduler: torchtitan's decay runs one step ahead of these flags' (its "
        "last step trains at the minimum lr; megapar's, as Megatron-LM's, reaches it at step "
        "--max-steps)"), exc.value  # training.md's measured case (a session's finding)
    for text in ("[training]\nsteps = 1000\n[lr_scheduler]\n", "[training]\nsteps = 1000\n"):
        # a job without [lr_scheduler] trains torchtitan's defaults too (it was named no flag)
        job.write_text(text)
        with pytest.raises(ConfigError) as exc:
            parse_args(["--config", str(job)])
        assert str(exc.value).endswith(": --warmup-steps 200 --lr 0.0008 --lr-decay linear --min-lr 0 "
                                       "--max-steps 1000"), exc.value


def test_a_torchtitan_job_config_is_translated_as_torchtitan_reads_it(tmp_path):
    """A torchtitan user's findings: [float8] without model.converters float8 gave --fp8
    (torchtitan converts nothing then); a pipeline schedule came out as a --schedule value
    megapar refuses (Interleaved1F1B); seed, log_freq, keep_latest_k, async_mode,
    reshard_after_forward and the pipeline's micro-batch were "no flag named" though megapar
    has them; mode selective became --recompute selective unsaid (torchtitan's default
    recomputes every 2nd layer whole); the default warmup of 200 exceeded a short job's steps;
    a YAML or JSON job config was "unknown setting 'training'"."""
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    job = tmp_path / "job.toml"
    said = _toml_refusal(job, '[training]\nsteps = 10\nlocal_batch_size = 8\nseed = 3\n'
                         '[parallelism]\npipeline_parallel_degree = 2\n'
                         'pipeline_parallel_schedule = "Interleaved1F1B"\n'
                         'pipeline_parallel_microbatch_size = 2\n'
                         'fsdp_reshard_after_forward = "never"\n'
                         '[float8]\nrecipe_name = "rowwise"\nemulate = true\n'
                         '[metrics]\nlog_freq = 5\n[checkpoint]\nfolder = "ck"\n'
                         'async_mode = "async"\nkeep_latest_k = 3\n'
                         '[activation_checkpoint]\nmode = "selective"\n')
    assert ("flags: --warmup-steps 10 --lr 0.0008 --lr-decay constant --max-steps 10 --seed 3 "
            "--pp 2 --micro-batch-size 2 --zero3-keep-params --log-interval 5 --async-save "
            "--keep-latest-k 3 --recompute selective --global-batch-size (8 x dp);") in said, said
    assert "--fp8" not in _flags(said) and 'only with model.converters = ["float8"]' in said
    assert ("parallelism.pipeline_parallel_schedule Interleaved1F1B: 'Interleaved1F1B' is "
            "megapar's --schedule interleaved --virtual-stages V") in said, said
    assert "default selective_ac_option 2 recomputes every 2nd layer whole" in said, said
    assert "no flag named" not in said, said
    said = _toml_refusal(job, '[model]\nconverters = ["float8"]\n[parallelism]\n'
                         'pipeline_parallel_schedule = "1F1B"\n[float8]\nemulate = true\n'
                         '[debug]\nseed = 4\n[training]\nseed = 3\n')
    assert "--schedule 1f1b --seed 4 --fp8 tensorwise --fp8-emulate" in said, said
    assert "--seed 3" not in said, said  # debug.seed is the one torchtitan reads
    said = _toml_refusal(job, '[model]\nconverters = ["float8"]\n[quantize.linear.float8]\n'
                         'recipe_name = "rowwise"\nnew_knob = 3\n')
    assert "--fp8 rowwise" in said and "(no flag named for: quantize.linear.float8.new_knob)" in said
    # a recipe megapar has not: was --fp8 tensorwise beside "not rowwise_with_gw_hp" (a re-test)
    said = _toml_refusal(job, '[model]\nconverters = ["float8"]\n[float8]\n'
                         'recipe_name = "rowwise_with_gw_hp"\n')
    assert "--fp8 rowwise" in _flags(said) and "(the nearest given: --fp8 rowwise)" in said, said
    said = _toml_refusal(job, '[model]\nconverters = ["mx"]\n')
    assert "--fp8" not in _flags(said) and "no layers but float8 linears" in said, said
    # a reviewer's: a warmup past the steps (torchtitan clamps it; megapar-train refuses it)
    said = _toml_refusal(job, '[training]\nsteps = 50\n[lr_scheduler]\nwarmup_steps = 500\n')
    assert "--warmup-steps 50 " in said and "--warmup-steps 500" not in said, said
    assert ("lr_scheduler.warmup_steps 500 is more than the run's 50 steps: torchtitan warms up "
            "over all 50 instead") in said, said
    # the line's own warmup stands as given, unsaid as cut (the note named the line's 100 the
    # file's, and a second one put it 'over the file's --warmup-steps 50'; a read of the change)
    said = _toml_refusal(job, '[training]\nsteps = 100\n[lr_scheduler]\nwarmup_steps = 20\n',
                         "--max-steps", "50", "--warmup-steps", "100")
    assert "--warmup-steps 100 " in said and "is more than the run's" not in said, said
    assert said.count("--warmup-steps 100 over") == 1, said
    # a decay past the steps after warmup: cut as torchtitan cuts it (the line was refused)
    said = _toml_refusal(job, '[training]\nsteps = 100\n[lr_scheduler]\nwarmup_steps = 50\n'
                         'decay_ratio = 0.8\n')
    assert "--warmup-steps 50 --lr 0.0008 --lr-decay wsd --lr-wsd-decay-steps 50 " in said, said
    said = _toml_refusal(job, '[training]\nsteps = 10\n[lr_scheduler]\ndecay_ratio = 0.2\n')
    assert _flags(said) == "--warmup-steps 10 --lr 0.0008 --lr-decay constant --max-steps 10", said
    # a third re-test's: torchtitan's default lr (8e-4, megapar-train's 1e-3) named; a float's
    # whole number an int flag's; a negative ratio holds the lr; a decay torchtitan lacks, a
    # negative warmup and a min_lr_factor past 1 said, not put in the line
    said = _toml_refusal(job, '[training]\nsteps = 6\n[lr_scheduler]\nwarmup_steps = 1\n'
                         'decay_ratio = 1.0\ndecay_type = "cosine"\nmin_lr_factor = 0.5\n')
    assert _flags(said) == ("--warmup-steps 1 --lr 0.0008 --lr-decay wsd --lr-wsd-decay-steps 5 "
                            "--lr-wsd-decay-style cosine --min-lr 0.0004 --max-steps 6"), said
    said = _toml_refusal(job, '[training]\nsteps = 10.0\nlocal_batch_size = 8.0\n')
    assert "--max-steps 10 " in _flags(said) and "--global-batch-size (8 x dp)" in said, said
    said = _toml_refusal(job, '[training]\nsteps = 10\n[lr_scheduler]\nwarmup_steps = 2\n'
                         'decay_ratio = -0.5\n')
    assert "--lr-decay constant" in _flags(said), said
    said = _toml_refusal(job, '[training]\nsteps = 10\n[lr_scheduler]\nwarmup_steps = 2\n'
                         'decay_type = "exp"\nmin_lr_factor = 1.5\n')
    assert "--lr-decay" not in _flags(said) and "torchtitan has no such decay" in said, said
    said = _toml_refusal(job, '[training]\nsteps = 10\n[lr_scheduler]\nwarmup_steps = -2\n'
                         'min_lr_factor = 1.5\n')
    assert "--warmup-steps" not in _flags(said) and "--min-lr" not in _flags(said), said
    assert "warmup_steps = -2: --warmup-steps takes a whole number >= 0" in said, said
    assert "min_lr_factor 1.5: megapar's --min-lr is at most --lr" in said, said
    # values of another kind than the flag takes are said so, not put in the line
    said = _toml_refusal(job, '[training]\nsteps = "many"\n[optimizer]\nlr = "3e-4"\n')
    assert "training.steps = 'many': --max-steps takes a whole number" in said, said
    assert "--lr 3e-4" in _flags(said) and "--max-steps" not in _flags(said), said
    # steps that are no number: a traceback (TypeError) before
    said = _toml_refusal(job, '[training]\nsteps = [100]\n')
    assert "\n" not in said and "--warmup-steps 200" in said, said
    # pipeline micro-batches of torchtitan's default 1, not the local batch
    said = _toml_refusal(job, '[training]\nlocal_batch_size = 4\n[parallelism]\n'
                         'pipeline_parallel_degree = 2\n')
    assert "--micro-batch-size 1 --pp 2" in said and "--micro-batch-size 4" not in said, said
    # true where a number belongs gave a bare --seq-len; a switch's true is its flag
    said = _toml_refusal(job, '[training]\nseq_len = true\n[compile]\nenable = true\n')
    assert "training.seq_len = true: --seq-len takes a whole number" in said, said
    assert "--compile" in _flags(said) and "--seq-len" not in _flags(said), said
    # a TOML with no torchtitan table (a pyproject.toml) is named no schedule
    said = _toml_refusal(job, '[project]\nname = "x"\n[tool.ruff]\nline-length = 100\n')
    assert said.endswith("give its settings as megapar-train flags (megapar-train --help)"), said
    for name, text in (("mixed.json", '{"model": "llama-tiny", "tp": 2, '
                                      '"float8": {"recipe_name": "rowwise"}}'),
                       ("mixed.yaml", "model: llama-tiny\ntraining:\n  steps: 5\n")):
        (tmp_path / name).write_text(text)  # megapar's keys beside torchtitan's tables
        with pytest.raises(ConfigError) as exc:  # was an AttributeError's traceback
            parse_args(["--config", str(tmp_path / name)])
        said = str(exc.value)
        assert ": outside torchtitan's tables; a --config file of megapar-train's flags" in said
        assert "model" in said.split(": outside")[0].split("; ")[-1], said
        assert "\n" not in said, said
    for name, text in (("job.yaml", "training:\n  steps: 5\nparallelism:\n"
                                    "  tensor_parallel_degree: 2\n"),
                       ("job.json", '{"training": {"steps": 5}, '
                                    '"parallelism": {"tensor_parallel_degree": 2}}')):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as exc:
            parse_args(["--config", str(tmp_path / name)])
        assert str(exc.value) == (
            f"{tmp_path / name} is a torchtitan job config, which megapar-train does not read; "
            "give its settings as megapar-train flags: --warmup-steps 5 --lr 0.0008 --lr-decay constant "
            "--max-steps 5 --tp 2; torchtitan's warmup 200 is more than the run's 5 steps: "
            "torchtitan warms up over all 5 instead, and so do these flags (no step left to "
            "decay in)"), exc.value  # (the warmup was cut to the steps without a word; a re-test)


OTHER_TOOLS = [
    ("train", ["--debug.seed", "1"], "--debug.seed: did you mean --seed?"),  # was --debug
    ("train", ["--training.seed", "1"], "--training.seed: did you mean --seed?"),  # nothing
    # torchtitan's names without their section: --expert-tensor-parallel-size, --log-interval
    ("train", ["--tensor_parallel_degree", "2"], "--tensor_parallel_degree: did you mean --tp?"),
    ("train", ["--steps", "5"], "--steps: did you mean --max-steps?"),
    ("train", ["--local_batch_size", "2"], "did you mean --micro-batch-size?"),
    ("train", ["--log_freq", "5"], "--log_freq: did you mean --log-interval?"),
    ("train", ["--optimizer.name", "muon"], "(adamw, lamb, lars, sgd or muon)"),
    # difflib's guesses were unrelated flags: --data-cache, --world-size, --no-offload-optimizer
    ("train", ["--data-path", "x"], "--data-path: did you mean --data?"),
    ("train", ["--hidden-size", "64"], "--hidden-size: a model's sizes come from --model"),
    ("train", ["--no-load-optim"], "--no-load-optim: megapar-train's --load resumes the "
     "optimizer state too; to start from a checkpoint's weights alone, export it"),
    ("train", ["--recompute-activations"], "did you mean --recompute selective?"),
    ("train", ["--learning_rate", "1e-3"], "--learning_rate: did you mean --lr?"),
    # learning-rate schedule and optimizer names: --lr-decay-iters was answered --max-steps
    # (which stretched the decay), --optimizer.eps --optimizer, --lr-scheduler-type --schedule
    # (the pipeline's), torchtitan's decay_ratio and Megatron's WSD iterations nothing useful
    ("train", ["--lr-decay-iters", "5"], "--lr-decay-iters: did you mean --lr-decay-steps?"),
    ("train", ["--optimizer.eps", "1e-8"], "--optimizer.eps: did you mean --adam-eps?"),
    ("train", ["--lr-scheduler-type", "cosine"], "did you mean --lr-decay (linear or cosine"),
    ("train", ["--lr_scheduler.decay_ratio", "0.2"], "did you mean --lr-wsd-decay-fraction"),
    ("train", ["--lr-wsd-decay-iters", "9"], "did you mean --lr-wsd-decay-steps (with --lr-decay"),
    # their names for a decay: only the choices were listed
    ("train", ["--lr-decay", "WSD"], "'WSD' is megapar's --lr-decay wsd"),
    ("train", ["--optimizer", "adam"], "'adam' is megapar's --optimizer adamw (decoupled"),
    ("train", ["--optimizer", "AdamW"], "'AdamW' is megapar's --optimizer adamw"),
    # apex's and fairseq's --loss-scale dynamic: "invalid float value" alone
    ("train", ["--loss-scale", "dynamic"], "'dynamic'; leave --loss-scale out: megapar's fp16 "
     "loss scale is dynamic unless --loss-scale S sets a static one"),
    ("train", ["--lr-decay", "wsd", "--lr-wsd-decay-style", "minus_sqrt"],
     "'minus_sqrt' is megapar's --lr-wsd-decay-style sqrt"),
    # nanoGPT's --key=value settings: --block_size was 'did you mean --tokenizer?', --out_dir
    # '--optimizer?', --grad_clip nothing
    ("train", ["--block_size=64"], "--block_size: did you mean --seq-len?"),
    ("train", ["--out_dir=out"], "--out_dir: did you mean --save (checkpoints)"),
    ("train", ["--grad_clip=1.0"], "--grad_clip: did you mean --clip-grad?"),
    # Megatron's interleaving, sample counts, ramp-up, overlap and model flags: nothing was
    # named, or an unrelated flag (--overlap-grad-reduce: "did you mean --grad-reduce-dtype?")
    ("train", ["--virtual-pipeline-model-parallel-size", "2"],
     "did you mean --schedule interleaved --virtual-stages?"),
    ("train", ["--num-layers-per-virtual-pipeline-stage", "1"],
     "did you mean --schedule interleaved --virtual-stages (model chunks per rank"),
    ("train", ["--train-samples", "100"], "megapar-train counts steps: give --max-steps"),
    ("train", ["--rampup-batch-size", "4", "4", "100"], "has no batch-size ramp-up"),
    ("train", ["--overlap-grad-reduce"], "always overlaps the gradient reduction"),
    ("train", ["--distributed-backend", "gloo"], "picks gloo on the CPU and NCCL with CUDA"),
    ("train", ["--init-method-std", "0.02"], "in transformers' names): set initializer_range there"),
    ("train", ["--hidden-dropout", "0"], "set resid_pdrop (GPT-2), hidden_dropout_prob (BERT)"),
    ("train", ["--log-throughput"], "tokens/s, TFLOP/s and MFU are on every log line"),
    # Megatron's mixture-of-experts flags: "--num-experts: did you mean --adam-eps?", "--sp:
    # did you mean --tp?", "--moe-router-topk-scaling-factor: did you mean
    # --moe-capacity-factor?", or nothing (--moe-router-topk, --moe-grouped-gemm)
    ("train", ["--sp"], "--sp: did you mean --sequence-parallel?"),
    ("train", ["--num-experts", "8"], "--num-experts: a mixture of experts' routing and sizes "
     "come from the model config"),
    ("train", ["--moe-router-topk", "2"], "set num_experts_per_tok there"),
    # the file named was models/mixtral-tiny.json, a path only inside the source tree; and
    # these two were answered with nothing
    ("train", ["--gpu", "a100"], "--gpu: megapar-train runs on the GPUs it is given"),  # --tp?
    ("train", ["--moe-top-k", "2"], f"such as a copy of {RECIPES}/mixtral-tiny.json, or "),
    ("train", ["--moe-token-dropping"], "--moe-token-dropping: megapar drops an expert's tokens "
     "over its capacity with --moe-capacity-factor C (not given: dropless)"),
    ("train", ["--moe-router-topk-scaling-factor", "2.5"], "with no scaling factor; drop it"),
    ("train", ["--moe-grouped-gemm"], "one grouped matmul per projection by themselves"),
    ("train", ["--moe-token-dispatcher-type", "alltoall"], "always travel by all-to-all"),
    ("train", ["--moe-router-load-balancing-type", "aux_loss"],
     "did you mean --moe-aux-loss-coef (aux_loss; 0: none)"),
    ("train", ["--etp", "2"], "--etp: did you mean --expert-tensor-parallel-size?"),
    ("train", ["--moe-layer-recompute"], "did you mean --recompute full"),
    # Megatron-LM's and transformers' run_mlm.py BERT flags: nothing was named, or (HF's
    # --max_seq_length) only the flag, not that the masking rate is fixed
    ("train", ["--mask-prob", "0.3"], "--mask-prob: megapar masks 15 % of a BERT sample's "
     "tokens (80 % [MASK], 10 % a random token, 10 % kept), a fixed rate"),
    ("train", ["--mlm_probability", "0.3"], "mask_prob=P) in your own loop"),
    ("train", ["--whole-word-masking"], "masks single tokens (a word's WordPiece pieces "
     "independently), not whole words"),
    ("train", ["--bert-no-binary-head"], "no next-sentence (binary) head: it trains the "
     "masked-LM loss only, as this flag asks of Megatron-LM; drop it"),
    ("train", ["--short-seq-prob", "0.1"], "--seq-len - 3 tokens, none shortened at random"),
    # more of a Megatron-LM BERT script's flags: "--data-impl: did you mean --data?",
    # "--num-workers: did you mean --rank-order?", nothing for the others
    ("train", ["--data-impl", "mmap"], "--data-impl: megapar reads Megatron-LM's mmap datasets "
     "(MMIDIDX .bin / .idx) as they are; drop it"),
    ("train", ["--num-workers", "2"], "--num-workers: megapar-train collates each batch in the "
     "training process"),
    ("train", ["--dataloader-type", "cyclic"], "reshuffles the samples every epoch"),
    ("train", ["--bert-load", "ck"], "--bert-load: did you mean --from-hf DIR (a transformers "
     "BERT directory) or --load CKPT (a megapar checkpoint)?"),
    ("train", ["--make-vocab-size-divisible-by", "64"], "set make_vocab_size_divisible_by there"),
    # DeepSpeed's flags: "--train-batch-size: did you mean --micro-batch-size?" (it is the
    # global batch), "--loss-scale: did you mean --loss-mean?", "--num-gpus: did you mean
    # --adam-eps?", "--cpu-offload: did you mean --load?", "--deepspeed_config: did you mean
    # --config?" (which reads megapar's flags), nothing for the others
    ("train", ["--train-batch-size", "32"], "--train-batch-size: did you mean --global-batch-size?"),
    ("train", ["--train_micro_batch_size_per_gpu", "2"], "did you mean --micro-batch-size?"),
    ("train", ["--gradient-accumulation-steps", "4"], "give --global-batch-size (= "
     "--micro-batch-size x the accumulation steps x dp)"),
    # its shortening, and Lightning's name: no hint (a new user's tryout)
    ("train", ["--grad-accumulation-steps", "4"], "give --global-batch-size (= "
     "--micro-batch-size x the accumulation steps x dp)"),
    ("train", ["--accumulate-grad-batches", "4"], "give --global-batch-size (= "),
    ("train", ["--loss_scale", "0"], "--loss_scale: did you mean --loss-scale (a static scale; "
     "DeepSpeed's 0, dynamic, is megapar's default)?"),
    ("train", ["--initial-scale-power", "16"], "--initial-scale-power: did you mean "
     "--initial-loss-scale (2 ** the power: 65536 for 16)?"),
    ("train", ["--loss_scale_window", "500"], "--loss_scale_window: did you mean "
     "--loss-scale-window?"),
    # fp16 flags of Megatron-LM, DeepSpeed and the Hugging Face Trainer: "did you mean
    # --hysteresis?" (megapar's is not consecutive), "--save?" or nothing
    ("train", ["--consecutive-hysteresis"], "--consecutive-hysteresis: megapar's --hysteresis is "
     "restored when the loss scale grows"),
    ("train", ["--fp16-lm-cross-entropy"], "LM-head cross-entropy runs in fp32"),
    ("train", ["--accumulate-allreduce-grads-in-fp32"], "did you mean --grad-reduce-dtype fp32"),
    ("train", ["--apex"], "--apex: megapar's fp16 is torch's autocast with its own loss scaler "
     "(--precision fp16), not apex"),
    ("train", ["--opt-level", "O2"], "--opt-level: apex's opt levels are megapar's --precision "
     "flag: O0 is --precision fp32; O1, O2 and O3 are --precision fp16"),
    ("train", ["--fp16_opt_level", "O2"], "did you mean --precision fp16 (autocast with fp32 "
     "weights"),
    ("train", ["--half_precision_backend", "apex"], "megapar's fp16 is torch's autocast with its "
     "own loss scaler (--precision fp16), not apex; drop it"),
    ("train", ["--gradient_clipping", "1.0"], "--gradient_clipping: did you mean --clip-grad?"),
    ("train", ["--checkpoint-activations"], "did you mean --recompute full?"),
    ("train", ["--cpu-offload"], "--cpu-offload: did you mean --offload-optimizer?"),
    # torchtitan's keys without their section: "did you mean --log-interval / --model?", or
    # nothing (a re-test); gradient accumulation's other spellings: --adam-eps, --warmup-steps
    ("train", ["--interval", "2"], "--interval: did you mean --save-interval?"),
    ("train", ["--folder", "ck"], "--folder: did you mean --save (and --load to resume)?"),
    ("train", ["--max_norm", "1.0"], "--max_norm: did you mean --clip-grad?"),
    ("train", ["--pipeline_parallel_schedule", "1F1B"], "--pipeline_parallel_schedule: did you "
     "mean --schedule?"),
    ("train", ["--grad_accum_steps", "2"], "--grad_accum_steps: megapar-train derives the "
     "micro-batches per step: give --global-batch-size"),
    ("train", ["--accumulation-steps", "2"], "--accumulation-steps: megapar-train derives"),
    ("train", ["--epochs", "2"], "--epochs: megapar-train counts optimizer steps: --max-steps"),
    ("train", ["--scheduler", "cosine"], "--scheduler: did you mean --lr-decay"),
    ("train", ["--loss-scale-power", "12"], "--loss-scale-power: did you mean "
     "--initial-loss-scale (2 ** the power: 65536 for 16)?"),
    ("train", ["--activation_checkpointing"], "did you mean --recompute full?"),
    ("train", ["--ddp_backend", "gloo"], "--ddp_backend: megapar-train chooses the backend by "
     "the device"),
    # megapar-plan's own --offload was "did you mean --load?" (a re-test)
    ("train", ["--offload"], "--offload: did you mean --offload-optimizer (and --offload-params "
     "under --zero 3: its parameter shards too)?"),
    ("train", ["--deepspeed"], "megapar's ZeRO is built in: give --zero 1, 2 or 3"),
    ("train", ["--deepspeed_config", "ds.json"], "megapar-train reads no DeepSpeed config"),
    ("train", ["--num-gpus", "2"], "starts its tp x cp x pp x dp local workers itself (give --dp)"),
    ("train", ["--local_rank", "0"], "takes its rank from torchrun's environment (LOCAL_RANK)"),
    ("train", ["--stage3-prefetch-bucket-size", "1e8"], "gathers one unit (a block) ahead"),
    # megapar-eval has no --dp (was "did you mean --tp?"), no --model, no --from-hf; its --cp
    # under Megatron's and torchtitan's names
    ("eval", ["--load", "ck", "--context-parallel-size", "2"],
     "--context-parallel-size: did you mean --cp?"),
    ("eval", ["--load", "ck", "--parallelism.context_parallel_degree", "2"], "did you mean --cp?"),
    # torchtitan's context-parallel communication: megapar-train's --cp-comm-type
    ("train", ["--parallelism.context_parallel_rotate_method", "allgather"],
     "--cp-comm-type (with Megatron-core's names: p2p, all_gather, a2a"),
    ("train", ["--hierarchical-context-parallel-sizes", "2", "2"], "give the whole size to --cp"),
    # DeepSpeed's / Megatron-LM's name for the default: "did you mean --min-loss-scale?"
    ("train", ["--dynamic-loss-scale"], "--dynamic-loss-scale: megapar's fp16 loss scale is "
     "dynamic unless --loss-scale S is given: drop it"),
    ("train", ["--no-dynamic-loss-scale"], "--no-dynamic-loss-scale: a static fp16 loss scale "
     "is --loss-scale S"),  # was "did you mean --min-loss-scale?" (a re-test)
    # Megatron's rank order flag: no hint (a new user's tryout of parallelism.md)
    ("train", ["--use-tp-pp-dp-mapping"], "--use-tp-pp-dp-mapping: megapar's default rank order "
     "is the one it asks for, --rank-order tp-pp-dp: drop it (Megatron-LM's own default, "
     "tp-cp-ep-dp-pp, is megapar's --rank-order tp-dp-pp)"),
    # Megatron's hierarchical cp: only argparse's "invalid choice"
    ("train", ["--cp-comm-type", "a2a+p2p"], "invalid choice: 'a2a+p2p' (choose from 'auto', "
     "'p2p', 'all_gather', 'a2a'); megapar's cp group is one level (no hierarchical a2a+p2p)"),
    # torch's dtype names, Lightning's precision strings and FP8: only "invalid choice"
    ("train", ["--precision", "bfloat16"], "invalid choice: 'bfloat16' (choose from 'fp32', "
     "'bf16', 'fp16'); give --precision bf16"),
    ("train", ["--precision", "16-mixed"], "; give --precision fp16"),
    ("train", ["--precision", "fp8"], "; FP8 linears are --fp8 tensorwise (or rowwise)"),
    ("generate", ["--load", "x", "--precision", "half"], "; give --precision fp16"),
    # Megatron's, in a MoE plan: no hint was given
    ("plan", ["--model", "mixtral-tiny", "--use-distributed-optimizer"],
     "--use-distributed-optimizer: megapar-plan tries every ZeRO stage of --zero-stages itself"),
    ("plan", ["--model", "mixtral-tiny", "--num-experts", "8"], "--num-experts: a mixture of "
     "experts' routing and sizes come from the model config"),
    ("plan", ["--model", "mixtral-tiny", "--moe-grouped-gemm"], "--moe-grouped-gemm: "
     "megapar-train runs the experts as one grouped matmul"),
    ("bubble", ["--pp", "2", "-m", "4", "--parallelism.context_parallel_degree", "2"],
     "did you mean --cp?"),
    ("eval", ["--load", "ck", "--dp", "2"], "--dp: megapar-eval runs on --tp x --cp x --pp processes"),
    ("eval", ["--load", "ck", "--model", "m"], "--model: the model is the checkpoint's (--load)"),
    ("eval", ["--load", "ck", "--cp", "2", "--cp-comm-type", "a2a"], "--cp-comm-type: "
     "megapar-eval's --cp runs each model's default context-parallel attention"),
    ("eval", ["--load", "ck", "--from-hf", "d"], "import the directory first (megapar-convert "
     "--from-hf HF_DIR CKPT), then --load CKPT"),
    ("convert", ["a", "b", "--target-tensor-parallel-size", "2"], "did you mean --tp?"),
    # Megatron-LM's converter's: difflib named --model, --seed, --from-megatron (a re-test)
    ("convert", ["a", "b", "--saver", "hf"], "--saver: did you mean --to-hf HF_DIR"),
    ("convert", ["a", "b", "--loader", "mcore"], "--loader: megapar-convert --from-megatron DIR"),
    ("convert", ["a", "b", "--megatron-path", "/x"], "reads Megatron-LM's checkpoints without"),
    ("convert", ["a", "b", "--bf16"], "--bf16: did you mean --dtype bfloat16?"),
    # megapar-train's Megatron names, given to the converter: no hint was given
    ("convert", ["a", "b", "--tensor-model-parallel-size", "2"], "did you mean --tp?"),
    ("convert", ["a", "b", "--expert-model-parallel-size", "4"], "--expert-model-parallel-size: "
     "a checkpoint does not depend on --ep (every expert is saved whole)"),
    ("convert", ["a", "b", "--model-type", "GPT"], "--model-type: the model is the source's own"),
    # megapar-train's layout flags no checkpoint depends on: "--ep: did you mean --tp?"
    ("convert", ["a", "b", "--ep", "2"], "--ep: a checkpoint does not depend on --ep (every "
     "expert is saved whole): megapar-train --load reads it at any --ep"),
    ("convert", ["a", "b", "--zero", "3"], "--zero: a checkpoint does not depend on --zero"),
    ("convert", ["a", "b", "--cp", "2"], "--cp: a checkpoint does not depend on --cp"),
    ("convert", ["a", "b", "--context-parallel-size", "2"], "--context-parallel-size: a "
     "checkpoint does not depend on --cp"),
    ("eval", ["--load", "ck", "--ep", "2"], "--ep: megapar-eval holds every expert on each rank"),
    # megapar-plan: "--tp: did you mean --top?"
    ("plan", ["--model", "llama-1b", "--tp", "2"], "--tp: megapar-plan ranks every layout "
     "itself; to check one, give it to --explain (e.g. --explain tp=2,pp=2,cp=2,mbs=1)"),
    ("plan", ["--model", "llama-1b", "--cp", "2"], "--cp: did you mean --cp-sizes?"),
    # "--sp: did you mean --top?", nothing for Megatron's --expert-model-parallel-size
    ("plan", ["--model", "mixtral-tiny", "--sp"], "--sp: megapar-plan tries sequence "
     "parallelism at every tp > 1 itself; to check one layout with it, give sp=1 to --explain"),
    ("plan", ["--model", "mixtral-tiny", "--expert-model-parallel-size", "2"],
     "give ep=N to --explain (e.g. --explain dp=8,ep=8,mbs=1)"),
    ("plan", ["--model", "mixtral-tiny", "--ep", "2"], "--ep: megapar-plan tries every ep "
     "dividing dp x cp and the experts itself"),
    ("plan", ["--model", "llama-1b", "--data", "d"], "--data: megapar-plan reads no data"),
    # DeepSpeed's: "--fp16: did you mean --fp8?", "--train-batch-size: did you mean
    # --micro-batch-sizes?" (the global batch), nothing for --bf16 and the accumulation steps
    ("plan", ["--model", "llama-1b", "--fp16"], "--fp16: did you mean --precision fp16?"),
    ("plan", ["--model", "llama-1b", "--train-batch-size", "8"],
     "--train-batch-size: did you mean --global-batch-size?"),
    ("plan", ["--model", "llama-1b", "--gradient-accumulation-steps", "4"],
     "derives each layout's micro-batches per step from --global-batch-size"),
    ("plan", ["--model", "llama-1b", "--grad-accumulation-steps", "4"],
     "derives each layout's micro-batches per step from --global-batch-size"),
    ("plan", ["--model", "llama-1b", "--offload-optimizer"], "did you mean --offload optimizer?"),
    # Megatron's preprocess_data.py: "--vocab-file: did you mean --vocab-size?"
    ("data", ["--input", "a", "--vocab-file", "v.json"], "--vocab-file: did you mean --tokenizer "
     "DIR (a directory holding the vocabulary's files as vocab.json and merges.txt"),
    # Megatron-LM's tokenizer type named --tokenizer alone, whose GPT2BPETokenizer was then
    # "unknown tokenizer"; wrong "did you mean"s, or none, to other Megatron-LM flags (a
    # Megatron-LM user's re-test)
    ("train", ["--tokenizer-type", "GPT2BPETokenizer"], "GPT2BPETokenizer: --tokenizer gpt2"),
    ("train", ["--no-save-optim"], "--no-save-optim: megapar's checkpoints hold the optimizer "
     "state"),
    ("train", ["--sequence-parallel-size", "2"], "did you mean --cp N --cp-comm-type a2a"),
    ("train", ["--num-virtual-stages-per-pipeline-rank", "2"], "did you mean --schedule "
     "interleaved --virtual-stages?"),
    ("train", ["--recompute-method", "uniform"], "(no uniform / block method, no layer count)"),
    ("train", ["--untie-embeddings-and-output-weights"], "megapar's GPT-2 ties its embedding"),
    ("train", ["--manual-gc"], "--manual-gc: a Megatron-LM setting megapar has no counterpart"),
    ("data", ["--input", "a", "--append-eod"], "--append-eod: megapar-data always ends each "
     "document with the end-of-document token; drop it"),
    # ... and "--split-sentences / --keep-newlines / --partitions: did you mean --split-lines?"
    ("data", ["--input", "a", "--split-sentences"], "--split-sentences: megapar-data splits no "
     "sentences"),
    ("data", ["--input", "a", "--keep-newlines"], "keeps every newline as it is; drop it"),
    ("data", ["--input", "a", "--partitions", "2"], "--partitions: did you mean --workers?"),
    ("bubble", ["--stages", "4"], "--stages: did you mean --pp?"),
    # Megatron's model and batch flags: no hint (the measured model's size is --model's)
    ("bubble", ["--pp", "3", "-m", "4", "--num-layers", "7"],
     "--num-layers: the measured model's layers are those of --model"),
    ("bubble", ["--pp", "2", "--global-batch-size", "8"],
     "--global-batch-size: megapar-bubble takes the micro-batches per step as --microbatches"),
    ("bubble", ["--pp", "2", "-m", "4", "--json", "out.json"],
     "--json: megapar-bubble always prints its JSON summary, as the last line of its output"),
    # torch's and the papers' schedule names: only the list of choices was given
    ("bubble", ["--pp", "2", "-m", "4", "--schedule", "ScheduleInterleaved1F1B"],
     "'ScheduleInterleaved1F1B' is megapar's --schedule interleaved --virtual-stages V"),
    ("bubble", ["--pp", "2", "-m", "4", "--schedule", "ZB-H1"], "is megapar's --schedule zb-h1"),
    ("train", ["--schedule", "ZBVZeroBubble"], "'ZBVZeroBubble' is megapar's --schedule zb-v"),
    ("plan", ["--model", "llama-1b", "--schedules", "1f1b", "ScheduleInterleaved1F1B"],
     "'ScheduleInterleaved1F1B' is megapar's --schedules interleaved --virtual-stages V"),
    ("plan", ["--model", "llama-1b", "--schedules", "DualPipeV"],
     "'DualPipeV' is megapar's --schedules dualpipev"),
    ("bubble", ["--pp", "2", "-m", "4", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size: did you mean --tp?"),
    ("bubble", ["--pp", "2", "-m", "4", "--virtual-pipeline-model-parallel-size", "2"],
     "did you mean --schedule interleaved --virtual-stages?"),
    # another megapar command's flag: "--vocab-size: did you mean --world-size?", "--to-hf:
    # did you mean --from-hf?", megapar-eval's "--save: did you mean --seed?"
    ("train", ["--vocab-size", "100"], "--vocab-size: the vocabulary follows the tokenizer"),
    ("train", ["--to-hf", "x"], "--to-hf: export the checkpoint after training: "
     "megapar-convert CKPT --to-hf HF_DIR"),
    ("eval", ["--load", "ck", "--save", "x"], "--save: megapar-eval writes only the logits"),
    ("data", ["--data", "a.txt"], "--data: did you mean --input?"),
    ("convert", ["--load", "a", "--save", "b"], "--load: the source is the first PATH"),
    # torchtitan's float8 options, Megatron-LM's fp8 flags and --fp8 where a command has none:
    # "--float8: did you mean --load?", "--fp8-format: did you mean --fp8-emulate?", megapar-plan's
    # "--fp8-emulate: did you mean --fp8-layers?" / "--compile: did you mean --recompute?",
    # megapar-eval's "--fp8: did you mean --tp?", or nothing
    ("train", ["--model.converters", "float8", "--float8.recipe_name", "rowwise"],
     "--float8.recipe_name: did you mean --fp8 tensorwise or rowwise (torchao's recipes"),
    # Transformer Engine's delayed scaling: said to be none (it named the recipes alone)
    ("train", ["--fp8-recipe", "delayed"], "and no delayed scaling: the scales are each "
     "tensor's current amax"),
    ("train", ["--float8"], "--float8: did you mean --fp8 tensorwise (or rowwise"),
    ("train", ["--quantize.linear.float8.enable_fsdp_float8_all_gather"],
     "megapar's --zero 3 gathers the --fp8 tensorwise linears' weights as float8 bytes"),
    ("train", ["--float8.filter_fqns", "output"], "megapar has no per-module float8 filter"),
    ("train", ["--fp8-format", "hybrid"], "--fp8-format: megapar's float8 casts are torchao's"),
    ("train", ["--no-fp8-wgrad"], "--no-fp8-wgrad: megapar's float8 linears compute dW"),
    ("plan", ["--model", "llama-1b", "--fp8", "tensorwise", "--fp8-emulate"],
     "--fp8-emulate: megapar-plan plans the job's GPUs"),
    ("plan", ["--model", "llama-1b", "--compile"], "--compile: megapar-plan plans eager blocks"),
    ("eval", ["--load", "ck", "--fp8", "tensorwise"], "--fp8: megapar-eval computes in float32"),
    # a Megatron user's flags to megapar-generate were "unrecognized" where train, eval and
    # convert named --tp (a reviewer's finding); Megatron's log and kernel switches to train
    ("generate", ["--load", "ck", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size: did you mean --tp?"),
    ("generate", ["--load", "ck", "--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size: did you mean --pp?"),
    ("generate", ["--load", "ck", "--context-parallel-size", "2"],
     "--context-parallel-size: megapar-generate has no context parallelism"),
    ("train", ["--log-params-norm"], "--log-params-norm: megapar-train logs the gradient norm"),
    ("train", ["--use-torch-fsdp2"], "--use-torch-fsdp2: did you mean --zero 3"),
    ("train", ["--yaml-cfg", "c.yaml"], "--yaml-cfg: did you mean --config"),
    ("train", ["--no-load-rng"], "--no-load-rng: on --load megapar-train continues the "
     "checkpoint's random state"),
    ("train", ["--use-cpu-initialization"], "--use-cpu-initialization: a Megatron-LM kernel or "
     "initialization setting"),
    ("generate", ["--load", "ck", "--fp8-emulate"],
     "--fp8-emulate: megapar-generate computes in --precision fp32, bf16 or fp16"),
    # transformers' do_sample false is greedy (it was told sampling is the default; a re-test)
    ("generate", ["--load", "ck", "--do_sample=False"],
     "--do_sample=False: false is greedy decoding: --temperature 0"),
    # ... which reads no top-k / top-p (given beside it, they were refused next; a re-test),
    # and other tools' greedy and precision switches (--greedy was "did you mean --seed?",
    # --bf16 had no answer)
    ("generate", ["--load", "ck", "--do_sample=False", "--top-k", "50"],
     "--temperature 0, which reads no --top-k or --top-p: drop those"),
    ("generate", ["--load", "ck", "--greedy"], "--greedy: did you mean --temperature 0"),
    # the Trainer's flags megapar-eval and megapar-train had no answer for (a re-test)
    ("eval", ["--load", "ck", "--bf16"], "--bf16: megapar-eval computes in float32; drop it"),
    ("eval", ["--load", "ck", "--do_eval=True"], "--do_eval: megapar-eval evaluates: the loss of "
     "--data, or the logits of --input-ids; drop it"),
    ("eval", ["--load", "ck", "--block_size", "64"], "--block_size: did you mean --seq-len?"),
    ("eval", ["--load", "ck", "--per_device_eval_batch_size", "4"],
     "--per_device_eval_batch_size: did you mean --micro-batch-size?"),
    # the Trainer's report_to none reports nowhere (it was told --wandb-project NAME or
    # --tensorboard DIR; a re-test)
    ("train", ["--report_to", "none"], "--report_to: none reports nowhere, as megapar-train "
     "does without --wandb-project or --tensorboard: leave the flag out"),
    ("train", ["--use_cpu"], "--use_cpu: megapar-train runs on the GPUs it finds, one a rank, "
     "and on the CPU without them (or with MEGAPAR_CPU=1); drop it"),
    ("train", ["--disable_tqdm"], "--disable_tqdm: did you mean --no-progress?"),
    ("train", ["--disable_tqdm=False"], "--disable_tqdm=False: false shows the progress bar: "
     "--progress"),
    ("generate", ["--load", "ck", "--bf16"], "--bf16: did you mean --precision bf16?"),
    ("generate", ["--load", "ck", "--bf16", "0"], "--bf16: false computes in fp32, "
     "megapar-generate's default --precision: leave the flag out"),
    # nanoGPT's decay_lr false beside its min_lr / lr_decay_iters: a constant lr reads neither
    # (--min-lr and --lr-decay-steps were refused next; a re-test)
    ("train", ["--decay_lr=False", "--min_lr=6e-5"], "--lr-decay constant (megapar-train decays "
     "it by default, --lr-decay cosine), which reads no --min-lr or --lr-decay-steps: drop those"),
    ("train", ["--no-lr-scheduler"], "false turns it off: --lr-decay constant, which reads no "
     "--min-lr or --lr-decay-steps: drop those"),
    # a switch whose default the run chooses (None) given false: its --no- spelling (it was
    # told "leave the flag out", which keeps fused attention on a GPU; a re-test)
    ("plan", ["--model", "gpt2-tiny", "--gpus", "2", "--fused_attention=False"],
     "--fused_attention=False: did you mean --no-fused-attention?"),
]


@pytest.mark.parametrize(
    "tool, argv, message", OTHER_TOOLS, ids=[" ".join([t, *a]) for t, a, _ in OTHER_TOOLS]
)
def test_another_tools_flag_is_answered_with_what_to_do(tool, argv, message, capsys):
    """Megatron-LM's, torchtitan's, DeepSpeed's and Hugging Face Trainer's flags, and
    megapar-train's that megapar-eval lacks, get one line saying what to do instead."""
    import importlib

    main = importlib.import_module(f"megapar.cli.{tool}").main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    line = _one_line(capsys, f"megapar-{tool}")
    assert exc.value.code == 2 and message in line, line
    assert "did you mean --no-offload" not in line and "--world-size" not in line, line
    assert "did you mean --top" not in line and "did you mean --today" not in line, line


def test_a_megatron_command_is_told_the_defaults_megapar_does_not_share(capsys):
    """A Megatron-LM command line translated flag by flag trained with megapar's weight decay,
    beta2, decay, warmup and floor (0.1, 0.95, cosine, 20, lr / 10 against Megatron-LM's 0.01,
    0.999, linear, 0, 0) unsaid; the line names those the command does not set in either name,
    fp16's loss scaler under --fp16, and nothing for a line that is not Megatron-LM's."""
    from megapar.cli.train import main as train

    def line(argv):
        with pytest.raises(SystemExit) as exc:
            train(argv)
        assert exc.value.code == 2
        return _one_line(capsys, "megapar-train")

    said = line(["--tensor-model-parallel-size", "2", "--train-iters", "5"])
    assert "--train-iters: did you mean --max-steps?" in said, said
    assert ("megapar-train's defaults that are not Megatron-LM's: --weight-decay 0.1 "
            "(Megatron-LM's 0.01), --global-batch-size 16, a multiple of --micro-batch-size x dp "
            "(--micro-batch-size x dp: no accumulation), --adam-beta2 0.95 (0.999), "
            "--lr-decay cosine (linear), "
            "--warmup-steps 20, at most 10 % of the steps (0), --min-lr 1e-4, at most --lr x 0.1 "
            "(0); give Megatron-LM's where the run should be its") in said, said
    said = line(["--train-iters", "5", "--weight-decay", "0.01", "--lr-warmup-iters=3", "--fp16"])
    assert "--weight-decay 0.1" not in said and "--warmup-steps 20" not in said, said
    assert "--adam-beta2 0.95 (0.999)" in said and "--hysteresis 1 (2)" in said, said
    assert "--initial-loss-scale 65536 (2^32)" in said, said
    said = line(["--train-iters", "5", "--start-weight-decay", "0.01"])
    assert "--weight-decay 0.1" not in said and "--adam-beta2 0.95" in said, said
    every = ["--train-iters", "5", "--weight-decay", "0.01", "--adam-beta2", "0.999",
             "--global-batch-size", "8",
             "--lr-decay-style", "linear", "--warmup-steps", "0", "--min-lr", "0"]
    assert "defaults" not in line(every)
    assert "defaults" not in line(["--training.steps", "5"])  # torchtitan's
    assert "defaults" not in line(["--max-step", "5"])
    # a line of Megatron-LM's recompute or eval flags was not marked as its (a re-test);
    # --bf16 alone is the Trainer's and DeepSpeed's too
    assert "--lr-decay cosine (linear)" in line(["--recompute-granularity", "full"])
    assert "--hysteresis 1 (2)" in line(["--eval-iters", "2", "--fp16"])
    assert "defaults" not in line(["--bf16"])


@functools.cache
def _every_commands_flags() -> frozenset[str]:
    """The flags of every megapar command (what a hint may name), built once (the tests look
    them up for each flag a hint names)."""
    import importlib

    flags: set[str] = set()
    for tool in ("train", "eval", "convert", "plan", "data", "bubble", "generate"):
        module = importlib.import_module(f"megapar.cli.{tool}")
        parser = (module.build_parser if hasattr(module, "build_parser")
                  else importlib.import_module("megapar.training.config").build_parser)()
        flags |= set(parser._option_string_actions)
    return frozenset(flags)


@pytest.mark.parametrize("tool", ["eval", "convert", "plan", "data", "bubble"])
def test_each_commands_other_flags_are_not_its_own_and_name_its_flags(tool):
    """A flag in a command's `OTHER_FLAGS` is not one of its own (it would never be looked up),
    one answered as "did you mean" names flags the command has, and a sentence names flags
    some megapar command has."""
    import importlib

    module = importlib.import_module(f"megapar.cli.{tool}")
    known = module.build_parser()._option_string_actions
    for other, ours in module.OTHER_FLAGS.items():
        assert other not in known, other
        if ours.startswith("--"):
            assert all(w in known for w in ours.split() if w.startswith("--")), ours
        else:
            assert all(w.rstrip(",;)") in _every_commands_flags()
                       for w in ours.split() if w.startswith("--")), ours


@pytest.mark.parametrize("tool", ["train", "eval", "convert", "generate", "bubble", "plan", "data"])
def test_each_command_answers_every_other_name_of_its_parallel_sizes(tool):
    """Megatron-LM's, torchtitan's, vLLM's and SGLang's names for a parallel size a command
    takes (--tp, --pp, --cp, --ep, --dp, --virtual-stages) are each answered by that command
    with megapar's flag (in words of the command's own where it says more: `--schedule
    interleaved --virtual-stages`), from the one table `LAYOUT_NAMES`; those for a size it
    answers by megapar's flag (`--ep` to megapar-eval, every size to megapar-data) with that
    answer (the torchtitan names had none, then eval and generate none for virtual stages and
    torchtitan's dp, megapar-data none at all: re-tests' findings)."""
    import importlib

    from megapar.one_line_parser import LAYOUT_NAMES

    if tool == "train":
        from megapar.training.config import build_parser
        from megapar.training.other_tools import OTHER_TOOLS_FLAGS as table
    else:
        module = importlib.import_module(f"megapar.cli.{tool}")
        build_parser, table = module.build_parser, module.OTHER_FLAGS
    parser = build_parser()
    known = parser._option_string_actions
    taken = {theirs: ours for theirs, ours in LAYOUT_NAMES.items() if ours in known}
    assert taken or tool == "data", f"megapar-{tool} takes none of {set(LAYOUT_NAMES.values())}"
    unnamed = {theirs: table.get(theirs) for theirs, ours in taken.items()
               if ours not in (table.get(theirs) or "").split()}
    assert not unnamed, unnamed
    answered = {theirs: table[ours] for theirs, ours in LAYOUT_NAMES.items() if ours in table}
    assert {theirs: parser.known_as[theirs] for theirs in answered} == answered


MISSING_VALUE = [
    ("train", ["--recompute"], "expected one argument; give it one of its values: "
     "--recompute none|selective|full"),
    ("train", ["--seq-len", "--max-steps", "2"], "expected one argument; give its value: "
     "--seq-len SEQ_LEN"),
    ("eval", ["--load", "ck", "--max-batches"], "give its value: --max-batches MAX_BATCHES"),
    ("convert", ["ck", "--to-hf"], "give its value: --to-hf HF_DIR"),
    ("bubble", ["-m"], "argument --microbatches/-m: expected one argument; give its value: "
     "--microbatches MICROBATCHES"),
]


@pytest.mark.parametrize(
    "tool, argv, message", MISSING_VALUE, ids=[" ".join([t, *a]) for t, a, _ in MISSING_VALUE]
)
def test_a_flag_without_its_value_names_the_value(tool, argv, message, capsys):
    """A flag given without its value (argparse: "expected one argument") names the value it
    takes: its choices, or its placeholder, in the same one line (exit 2)."""
    import importlib

    main = importlib.import_module(f"megapar.cli.{tool}").main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    line = _one_line(capsys, f"megapar-{tool}")
    assert exc.value.code == 2 and message in line, line


STRAY = [
    # the checkpoint as a positional: was "the following arguments are required: --load"
    ("eval", ["ck"], "unexpected argument 'ck': pass the checkpoint as --load ck"),
    ("eval", ["--load", "ck", "extra"], "unexpected argument 'extra': --load takes one value"),
    ("data", ["a.txt"], "unexpected argument 'a.txt': pass the input as --input a.txt"),
    ("data", ["a.txt", "b.txt", "out"], "unexpected arguments 'a.txt', 'b.txt', 'out': pass the "
     "input and the output prefix as --input a.txt b.txt --output-prefix out"),
    ("data", ["--output-prefix", "out", "a.txt", "b.txt"],
     "unexpected arguments 'a.txt', 'b.txt': pass the input as --input a.txt b.txt"),
    # a misspelt required flag: was "the following arguments are required: --load"
    ("eval", ["--lod", "ck"], "unrecognized arguments: --lod ck; --lod: did you mean --load?"),
    # another tool's name for it, as megapar-generate knew it (megapar-eval said nothing)
    ("eval", ["--checkpoint", "ck"], "--checkpoint ck; --checkpoint: did you mean --load?"),
    ("eval", ["--checkp", "ck"], "--checkp ck; --checkp: did you mean --load?"),  # was --cp
    ("plan", ["llama3-8b"], "unexpected argument 'llama3-8b': pass the model as --model llama3-8b"),
    ("train", ["ck"], "'ck': megapar-train takes no positional arguments; give each value after"),
    ("train", ["--dry-run", "yes"], "unexpected argument 'yes': --dry-run takes no value"),
    ("bubble", ["--pp", "2", "-m", "4", "-1"], "unexpected argument '-1': -m takes one value"),
    ("bubble", ["ck"], "'ck': megapar-bubble takes no positional arguments"),
    # an unknown flag before the paths: its 2 was read as a PATH and left out of the line
    ("convert", ["--tensor-parallel-size", "2", "a", "b"],
     "unrecognized arguments: --tensor-parallel-size 2; --tensor-parallel-size: did you mean --tp?"),
    ("convert", ["a", "b", "--tensor-parallel-size", "2"],
     "unrecognized arguments: --tensor-parallel-size 2; --tensor-parallel-size: did you mean --tp?"),
    # a reviewer's: the path after an unknown flag's value was listed as unrecognized, a
    # negative value dropped, a flag given twice answered twice
    ("convert", ["a", "--ifno", "2", "b"], "unrecognized arguments: --ifno 2; --ifno: did you "
     "mean --info? (see"),
    ("convert", ["--ifno", "-1", "a", "b"], "unrecognized arguments: --ifno -1; --ifno: did you "
     "mean --info? (see"),
    ("convert", ["--ifno", "2", "--ifno", "3", "a", "b"], "unrecognized arguments: --ifno 2 "
     "--ifno 3; --ifno: did you mean --info? (see"),
    # a short flag was close to any other by the "--" they share (--foo: --info, --wd: --dp)
    ("convert", ["a", "--foo", "2", "b"], "unrecognized arguments: --foo 2 (see"),
    ("train", ["--wd", "0.1"], "unrecognized arguments: --wd 0.1; --wd: did you mean "
     "--weight-decay? (see"),
    ("train", ["--amp"], "--amp: did you mean --precision bf16 (or fp16)? (see"),
    # a second re-test's: a learning-rate scheduler was --schedule (the pipeline's), --gpus
    # the dry run's --gpus-per-node, megapar-plan's --zero3 a ZeRO-3 threshold; the other
    # tools answered no short name
    ("train", ["--sched", "cosine"], "--sched: did you mean --lr-decay (the learning rate's "
     "schedule; --schedule is the pipeline's)?"),
    ("train", ["--gpus", "2"], "--gpus: megapar-train's processes are tp x cp x pp x dp, one "
     "GPU each (give --dp)"),
    ("plan", ["--model", "gpt2-tiny", "--zero3"], "--zero3: did you mean --zero-stages 3?"),
    # another tool's switch given false, by megapar-plan's defaults (--bf16 0 was told
    # --precision bf16, its true; --gradient_checkpointing=False and --no-bf16 had no answer)
    ("plan", ["--model", "gpt2-tiny", "--bf16", "0"], "--bf16: false counts fp32 activations: "
     "--precision fp32 (megapar-plan counts bf16 by default)"),
    ("plan", ["--model", "gpt2-tiny", "--no-bf16"], "--no-bf16: false counts fp32"),
    ("plan", ["--model", "gpt2-tiny", "--gradient_checkpointing=False"],
     "--gradient_checkpointing=False: false plans no recomputation: --recompute none"),
    ("plan", ["--model", "gpt2-tiny", "--gradient_checkpointing"],
     "--gradient_checkpointing: did you mean --recompute full?"),
    ("plan", ["--model", "gpt2-tiny", "--zero3=f"], "false plans no ZeRO-3: --zero-stages 0 1 2"),
    ("plan", ["--model", "gpt2-tiny", "--bf16", "1"], "--bf16: did you mean --precision bf16?"),
    ("eval", ["--load", "ck", "--bs", "4"], "--bs: did you mean --micro-batch-size?"),
    ("convert", ["a", "b", "--hf", "x"], "--hf: did you mean --from-hf DIR (a transformers "
     "model in) or --to-hf DIR (out)?"),
    ("data", ["--nproc", "2"], "--nproc: did you mean --workers?"),
]


@pytest.mark.parametrize("tool, argv, message", STRAY, ids=[" ".join([t, *a]) for t, a, _ in STRAY])
def test_a_stray_word_is_named_with_where_it_belongs(tool, argv, message, capsys):
    """A word no flag takes is named, with the flag it belongs to, in one line (exit 2); it was
    argparse's "arguments are required: --load" (the word unnamed) or "unrecognized arguments"."""
    import importlib

    main = importlib.import_module(f"megapar.cli.{tool}").main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    line = _one_line(capsys, f"megapar-{tool}")
    assert exc.value.code == 2 and message in line, line


def test_convert_takes_its_paths_on_either_side_of_the_flags(tmp_path, capsys):
    """`megapar-convert SRC --tp 2 DST` is SRC DST --tp 2 (DST was "unrecognized")."""
    from megapar.cli.convert import main as convert

    assert convert([str(tmp_path / "no_src"), "--tp", "2", str(tmp_path / "dst")]) == 2
    assert "no_src: no such checkpoint directory" in _one_line(capsys, "megapar-convert")


@pytest.mark.parametrize("argv, message", [
    (["--from-hf", "hf", "out", "--model", "llama-tiny"], "--model names the model of a "
     "torchtitan or Megatron checkpoint (--from-dcp, --from-megatron) only; here the model is "
     "the transformers directory's config.json: drop it"),
    (["ck", "--to-hf", "out", "--job-config", "a.toml"], "--job-config names the model of a "
     "torchtitan checkpoint (--from-dcp) only; here the model is the checkpoint's: drop it"),
])
def test_convert_names_the_dcp_only_flag_that_was_given(argv, message, tmp_path, monkeypatch,
                                                         capsys):
    """`megapar-convert --from-hf HF OUT --model M` said "--job-config and --model are used only
    with --from-dcp", naming a flag the user had not given and not where the model comes from."""
    from megapar.cli.convert import main as convert_main

    monkeypatch.chdir(tmp_path)
    assert convert_main(argv) == 2
    line = _one_line(capsys, "megapar-convert")
    assert message in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_model_directory_given_as_text_is_named_as_a_model(tmp_path, capsys):
    """`megapar-data --input CKPT` read the checkpoint's manifest.json as a document ("the
    object has no string field 'text'; fix it or pass --jsonl-key", after a note on its
    .safetensors files), and so did --input / --data HF_DIR with a transformers model's
    config.json. Each is one line naming what the directory is; nothing is written."""
    from megapar.cli.data import main as data_main
    from megapar.training.data import _refuse_what_is_not_text

    ckpt, hf, text = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "text"
    (ckpt / "step_00000002").mkdir(parents=True)
    (ckpt / "step_00000002" / "manifest.json").write_text("{}")
    (ckpt / "step_00000002" / "model_tp0_pp0.safetensors").write_bytes(b"")
    (ckpt / "latest").write_text("step_00000002")
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"")
    text.mkdir()
    (text / "config.json").write_text('{"text": "a json document named config.json"}')
    out = tmp_path / "out" / "x"
    for given, what in ((ckpt, "a megapar checkpoint"), (ckpt / "step_00000002",
                        "a megapar checkpoint"), (hf, "a Hugging Face model")):
        assert data_main(["--input", str(given), "--output-prefix", str(out)]) == 2
        line = _one_line(capsys, "megapar-data")
        assert f"input {given} is {what}, not text; pass the text" in line, line
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=f"--data {hf} is a Hugging Face model, not data; "
                                         f"train from it with megapar-train --from-hf {hf}"):
        _refuse_what_is_not_text(str(hf))
    # a directory of text that holds a config.json (no weights beside it) is still text
    assert data_main(["--input", str(text), "--output-prefix", str(out), "--no-progress"]) == 0


def test_a_dry_run_refuses_raw_text_the_run_could_not_read(no_workers, tmp_path, capsys):
    """megapar-train --dry-run --data DIR of no text (here SentencePiece models), or --data a
    binary file, rehearsed the job ('data skipped (... raw text, which a rehearsal does not
    tokenize ...)') that the run then refused: the rehearsal checks the inputs as the run lists
    them (nothing is tokenized). A --data that is not on this machine is still skipped."""
    models = tmp_path / "sp"
    models.mkdir()
    shutil.copy(asset_path("botchan_en_unigram_1000.model"), models / "a.model")
    (tmp_path / "data.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(64))
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--max-steps", "1", "--dry-run"]
    for data, says in [(models, f"input directory {models} holds only SentencePiece models"),
                       (tmp_path / "data.gz", "gzip")]:
        assert train(["--data", str(data), *common]) == 2
        line = _one_line(capsys, "megapar-train")
        assert says in line, line


def test_a_trainer_checkpoint_given_to_from_hf_says_what_is_not_read(tmp_path):
    """A Hugging Face Trainer's checkpoint-500 given to --from-hf started at step 1 with a new
    optimizer, its optimizer.pt, scheduler.pt and step dropped without a word (a Trainer
    user's tryout): a note says so; a plain model directory gets none."""
    from megapar.training.model_config import trainer_checkpoint_note

    ckpt = tmp_path / "checkpoint-500"
    ckpt.mkdir()
    assert trainer_checkpoint_note(str(ckpt)) == []
    (ckpt / "trainer_state.json").write_text('{"global_step": 500}')
    (ckpt / "optimizer.pt").write_bytes(b"")
    assert trainer_checkpoint_note(str(ckpt)) == [
        f"--from-hf {ckpt}: a Hugging Face Trainer checkpoint at step 500; megapar-train starts "
        f"from its weights alone, at step 1 with a new optimizer and schedule (its optimizer.pt, "
        f"trainer_state.json are not read)"]


def test_a_trainer_arguments_or_accelerate_config_is_answered_with_megapar_trains_flags(tmp_path):
    """A Hugging Face TrainingArguments JSON was read as a DeepSpeed config (its fp16 / bf16
    keys) and ~20 settings megapar has were called "no equivalent"; an accelerate config got
    "unknown setting 'distributed_type'; did you mean 'muon_distributed'?" (a Trainer user's
    tryout). Each is named, with its settings as flags, the Trainer's defaults where megapar's
    differ; a megapar config sharing a Trainer name (eval_steps) is still read as megapar's."""
    from megapar.models.config import ConfigError
    from megapar.training.config import TrainConfig, parse_args

    args = tmp_path / "args.json"
    args.write_text(json.dumps({
        "output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "learning_rate": 3e-4, "max_steps": 100, "warmup_ratio": 0.1, "bf16": True,
        "fp16": False, "lr_scheduler_type": "cosine", "save_steps": 50, "logging_steps": 5,
        "seed": 7, "adam_beta2": 0.98, "gradient_checkpointing": True}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(args)])
    said = str(info.value)
    assert said.startswith(f"{args} is a Hugging Face Trainer's arguments (TrainingArguments)")
    for flag in ("--micro-batch-size 4", "--lr 0.0003", "--weight-decay 0", "--adam-beta2 0.98",
                 "--max-steps 100", "--warmup-steps 10", "--lr-decay cosine --min-lr 0",
                 "--precision bf16", "--recompute full", "--save out --save-interval 50",
                 "--log-interval 5", "--seed 7", "--global-batch-size (8 x dp)"):
        assert flag in said, (flag, said)
    # a DeepSpeed config given inline as the Trainer's deepspeed argument (a dict, which the
    # Trainer takes as it takes a file's path) was dropped without a word (a re-test): its
    # settings join the flags, the Trainer's own first; a value megapar refuses is named
    inline = tmp_path / "inline.json"
    inline.write_text(json.dumps({
        "output_dir": "out", "per_device_train_batch_size": 2, "max_grad_norm": 0.5,
        "deepspeed": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                      "gradient_clipping": 2.0, "train_micro_batch_size_per_gpu": "auto",
                      "wall_clock_breakdown": False, "flops_profiler": {"enabled": False}}}))
    with pytest.raises(ConfigError) as info:  # its value unlike the Trainer's: refused, as
        parse_args(["--config", str(inline)])  # the Trainer refuses it ("mismatch")
    assert str(info.value) == (
        f"{inline}: deepspeed's gradient_clipping 2.0 (--clip-grad 2.0) differs from the "
        f"Trainer's own --clip-grad 0.5, which the Trainer refuses: set them alike, or the "
        f'deepspeed one to "auto"'), str(info.value)
    for given, said in (({"gradient_accumulation_steps": 4}, "deepspeed's "
                         "gradient_accumulation_steps 4 differs from the Trainer's own "
                         "gradient_accumulation_steps 1"),
                        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}},
                         "deepspeed's optimizer.params.betas.1 0.95 (--adam-beta2 0.95) differs "
                         "from the Trainer's own --adam-beta2 0.999"),  # and these (a re-test)
                        # and what the Trainer fills from arguments of other names (a re-test)
                        ({"bf16": {"enabled": True}}, "deepspeed's bf16.enabled True differs "
                         "from the Trainer's own bf16 False"),
                        ({"scheduler": {"type": "WarmupDecayLR", "params": {
                            "warmup_max_lr": 1e-3, "warmup_num_steps": 10}}},
                         "deepspeed's scheduler.params.warmup_max_lr 0.001 differs from the "
                         "Trainer's own --lr 5e-05"),
                        ({"train_batch_size": 12}, "deepspeed's train_batch_size 12 differs from "
                         "the Trainer's own per_device_train_batch_size x "
                         "gradient_accumulation_steps = 8 times the number of processes")):
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"output_dir": "out", "deepspeed": given}))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(other)])
        assert said in str(info.value), str(info.value)
    other.write_text(json.dumps({"output_dir": "out", "deepspeed": {"train_batch_size": 64}}))
    with pytest.raises(ConfigError) as info:  # one that fits: its world said, not the flag
        parse_args(["--config", str(other)])  # beside '(8 x dp)' (it said both)
    assert ("deepspeed's train_batch_size 64: the Trainer's 8 per process on 8 processes, "
            "--global-batch-size 64 at --dp 8") in str(info.value), str(info.value)
    assert "--global-batch-size" not in str(info.value).split(";")[0], str(info.value)
    # its scheduler replaces the Trainer's (the Trainer builds none): WarmupLR holds the lr
    # after warmup, where '--lr-decay linear' was given (a re-test)
    other.write_text(json.dumps({"output_dir": "out", "deepspeed": {"scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(other)])
    flags = str(info.value).split(";")[0]
    assert "--lr-decay constant" in flags and "--lr-decay linear" not in flags, str(info.value)
    assert "--min-lr" not in flags and "deepspeed's scheduler WarmupLR replaces the Trainer's " \
        "lr_scheduler_type" in str(info.value), str(info.value)
    text = json.loads(inline.read_text())
    text["deepspeed"]["gradient_clipping"] = "auto"
    inline.write_text(json.dumps(text))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(inline)])
    said = str(info.value)
    assert "--clip-grad 0.5 " in said and "--clip-grad 2" not in said, said
    assert "--zero 3 --offload-optimizer" in said, said
    inline.write_text(json.dumps({"output_dir": "out",
                                  "deepspeed": {"zero_optimization": {"stage": 4}}}))
    with pytest.raises(ConfigError, match=r"a value in it is one megapar-train refuses: --zero 4 "
                                          r"is invalid: choose one of 0, 1, 2, 3"):
        parse_args(["--config", str(inline)])
    # ddp_timeout is --timeout-s, checked as megapar-train checks it, and a warmup_ratio past
    # 1 (which the Trainer refuses) is said, not turned into steps (both were dropped or
    # passed on without a word; a re-test)
    for given, line in (({"ddp_timeout": 600}, "--timeout-s 600"),
                        ({"ddp_timeout": 0}, "--timeout-s 0.0 is invalid: it must be a finite "
                                             "number >= 0.001"),
                        ({"warmup_ratio": 1.5, "max_steps": 10}, "warmup_ratio 1.5: a share of "
                                                                 "the training steps, from 0 "
                                                                 "to 1")):
        inline.write_text(json.dumps({"output_dir": "out", **given}))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(inline)])
        assert line in str(info.value), str(info.value)
        assert "--warmup-steps 15" not in str(info.value)
    yaml_args = tmp_path / "args.yaml"  # YAML reads 3e-4 as a string: a traceback said so
    yaml_args.write_text("output_dir: out\nlearning_rate: 3e-4\nmax_steps: '100'\n")
    with pytest.raises(ConfigError, match=r"--lr 0.0003 .*--max-steps 100 "):
        parse_args(["--config", str(yaml_args)])
    accelerate = tmp_path / "fsdp.yaml"
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
                          "mixed_precision: bf16\nnum_machines: 1\nnum_processes: 4\n")
    with pytest.raises(ConfigError, match=r"fsdp.yaml is an accelerate config, which "
                       r"megapar-train does not read: .* give --dp 4 --zero 3 --precision bf16"):
        parse_args(["--config", str(accelerate)])
    with pytest.raises(ConfigError, match=r"give --dp 4 --zero 2 --precision bf16 .*; the "
                       r"command line's --zero 2 over the file's --zero 3"):
        parse_args(["--config", str(accelerate), "--zero", "2"])
    # its FSDP's strategy is read as the Trainer's fsdp is (every FSDP was --zero 3): by name
    # (FSDP1), number (older files) or FSDP2's reshard_after_forward, with its offload
    for fsdp_config, flags in (
        ("fsdp_sharding_strategy: SHARD_GRAD_OP", "--dp 4 --zero 2 --precision"),
        ("fsdp_sharding_strategy: 3", "--dp 4 --precision"),
        ("fsdp_reshard_after_forward: false\n  fsdp_version: 2", "--dp 4 --zero 2 --precision"),
        ("fsdp_reshard_after_forward: FULL_SHARD\n  fsdp_offload_params: true",
         "--dp 4 --zero 3 --offload-optimizer --offload-params --precision"),
        # a re-test's: a number as a string, torch's enum's name, a null beside a strategy
        ("fsdp_sharding_strategy: '2'", "--dp 4 --zero 2 --precision"),
        # its activation checkpointing was dropped unsaid (a re-test)
        ("fsdp_sharding_strategy: 1\n  fsdp_activation_checkpointing: true",
         "--dp 4 --zero 3 --recompute full --precision"),
        ("fsdp_sharding_strategy: _HYBRID_SHARD_ZERO2", "--dp 4 --zero 2 --precision"),
        ("fsdp_reshard_after_forward: null\n  fsdp_sharding_strategy: SHARD_GRAD_OP",
         "--dp 4 --zero 2 --precision"),
    ):
        accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
                              f"fsdp_config:\n  {fsdp_config}\nmixed_precision: bf16\n"
                              "num_machines: 1\nnum_processes: 4\n")
        with pytest.raises(ConfigError, match=f"give {flags} bf16 "):
            parse_args(["--config", str(accelerate)])
    # a strategy it cannot read was plain data parallelism without a word (or, a list, a
    # traceback): said; DeepSpeed's offload devices are its offload flags
    for strategy in ("FULL_SHARDED", "9", "[1]"):
        accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
                              f"fsdp_config:\n  fsdp_sharding_strategy: {strategy}\n"
                              "num_machines: 1\nnum_processes: 4\n")
        with pytest.raises(ConfigError, match=r"give --dp 4 \(the processes are tp x cp x pp x "
                           r"dp\); FSDP's sharding .*: not one megapar reads \(reshard_after_"
                           r"forward true / false, or full_shard, .*; megapar's FSDP is --zero 3"):
            parse_args(["--config", str(accelerate)])
    # one written by hand without compute_environment was "unknown setting 'distributed_type';
    # did you mean 'muon_distributed'?" (a re-test)
    accelerate.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\n")
    with pytest.raises(ConfigError, match=r"is an accelerate config.* give --dp 4"):
        parse_args(["--config", str(accelerate)])
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                          "deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n"
                          "  offload_param_device: cpu\nnum_machines: 1\nnum_processes: 4\n")
    with pytest.raises(ConfigError, match=r"give --dp 4 --zero 3 --offload-optimizer "
                       r"--offload-params \("):
        parse_args(["--config", str(accelerate)])
    # its DeepSpeed plugin's clipping and accumulation, a dynamo backend and the Megatron-LM
    # plugin's layout were dropped unsaid
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                          "deepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 1.0\n"
                          "  gradient_accumulation_steps: 4\ndynamo_config:\n"
                          "  dynamo_backend: INDUCTOR\nnum_processes: 8\n")
    with pytest.raises(ConfigError, match=r"give --dp 8 --zero 2 --clip-grad 1 "
                       r"--global-batch-size \(--micro-batch-size x 4 x dp\) --compile \("):
        parse_args(["--config", str(accelerate)])
    # at the line's --micro-batch-size a number, and the line's --global-batch-size over it (it
    # was the sentence beside both; a re-test)
    for line, flag in ((["--micro-batch-size", "2"], "--global-batch-size 64 "),
                       (["--micro-batch-size", "2", "--dp", "2"], "--global-batch-size 16 "),
                       (["--global-batch-size", "48"], "--global-batch-size 48 ")):
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(accelerate), *line])
        assert flag in str(info.value) and "--dp size" not in str(info.value), str(info.value)
    # a DeepSpeed plugin's own file, its fp16 (DeepSpeed's scaler) and a parameter offload
    # without the optimizer's were unsaid or dropped (a re-test)
    accelerate.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n"
                          "  offload_param_device: cpu\nmixed_precision: fp16\n"
                          "num_processes: 2\n")
    with pytest.raises(ConfigError, match=r"give --dp 2 --zero 3 --hysteresis 2 --precision "
                       r"fp16 \(.*\); offload_param_device without offload_optimizer_device: "
                       r"megapar offloads the parameters with the optimizer state"):
        parse_args(["--config", str(accelerate)])
    # with the plugin's file, accelerate reads the precision from it, not from mixed_precision
    # (--precision fp16 --hysteresis 2 contradicted the file's bf16; a second re-test)
    accelerate.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                          "  deepspeed_config_file: ds1.json\nmixed_precision: fp16\n"
                          "num_processes: 2\n")
    with pytest.raises(ConfigError, match=r"give --dp 2 \(.*\); deepspeed_config_file ds1.json: "
                       r"give that file to --config .*\(accelerate takes the precision, stage, "
                       r"offload, clipping and accumulation from it"):
        parse_args(["--config", str(accelerate)])
    accelerate.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
                          "  offload_optimizer_device: cpu\n  offload_param_device: cpu\n"
                          "num_processes: 2\n")
    with pytest.raises(ConfigError, match=r"give --dp 2 --zero 2 --offload-optimizer \(.*\); "
                       r"offload_param_device: DeepSpeed offloads parameters at stage 3 only"):
        parse_args(["--config", str(accelerate)])
    accelerate.write_text("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n"
                          "  megatron_lm_tp_degree: 2\n  megatron_lm_pp_degree: 2\n"
                          "  megatron_lm_sequence_parallelism: true\n"
                          "  megatron_lm_use_distributed_optimizer: true\n"
                          "dynamo_backend: 'NO'\nnum_processes: 8\n")
    with pytest.raises(ConfigError, match=r"give --dp 2 --tp 2 --pp 2 --sequence-parallel "
                       r"--zero 1 \(the processes"):
        parse_args(["--config", str(accelerate)])
    accelerate.write_text(accelerate.read_text().replace("num_processes: 8", "num_processes: 6"))
    with pytest.raises(ConfigError, match=r"give --tp 2 --pp 2 --sequence-parallel --zero 1 \(.*"
                       r"; num_processes 6 is no multiple of tp x pp = 4, which Megatron-LM "
                       r"refuses"):
        parse_args(["--config", str(accelerate)])
    # steps below 1 are the Trainer's ratios of the training steps, and its fsdp is --zero:
    # were --eval-interval 0.5 (refused as no int) and nothing (a Trainer user's tryout)
    args.write_text(json.dumps({
        "output_dir": "out", "learning_rate": 3e-4, "max_steps": 100, "eval_steps": 0.5,
        "eval_strategy": "steps", "logging_steps": 0.01, "save_steps": 0.25, "fsdp": "full_shard offload auto_wrap"}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(args)])
    for flag in ("--zero 3 --offload-optimizer --offload-params", "--save-interval 25",
                 "--log-interval 1 --eval-interval 50"):
        assert flag in str(info.value), (flag, info.value)
    args.write_text(json.dumps({"output_dir": "out", "learning_rate": 3e-4, "eval_steps": 0.5,
                                "eval_strategy": "steps", "fsdp": ["shard_grad_op"]}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(args)])
    assert "--zero 2 " in str(info.value) and ("eval_steps 0.5: --eval-interval (the ratio x "
                                               "the training steps)") in str(info.value), info.value
    # as transformers 5 reads them (a re-test's findings): no_shard shards nothing,
    # hybrid_shard_zero2 and reshard_after_forward false are ZeRO-2; a float max_steps counts;
    # warmup rounds up; eval_steps without eval_strategy steps, a fractional logging_steps
    # above 1 and a negative save_steps are no flags
    cases = [
        ({"fsdp": "no_shard", "max_steps": 10}, "--max-steps 10", "--zero"),
        ({"fsdp": "hybrid_shard_zero2 offload"}, "--zero 2 --offload-optimizer --save",
         "--offload-params"),
        ({"fsdp": True, "fsdp_config": {"fsdp_reshard_after_forward": False}}, "--zero 2 ", ""),
        ({"fsdp": True, "fsdp_config": {"cpu_offload": True}},
         "--zero 3 --offload-optimizer --offload-params", ""),
        ({"fsdp": "bogus"}, "fsdp bogus: not one of the Trainer's options", "--min-lr 0 --zero"),
        ({"max_steps": 100.0, "warmup_ratio": 0.033}, "--max-steps 100 --warmup-steps 4", ""),
        ({"max_steps": 100, "eval_steps": 0.2}, "eval_steps: the Trainer evaluates on steps "
         "only with eval_strategy steps (here no)", "--eval-interval 20"),
        ({"logging_steps": 2.5, "save_steps": -1}, "logging_steps 2.5: not a setting the "
         "Trainer takes", "--log-interval 2"),
        ({"logging_strategy": "epoch", "max_steps": 10}, "--max-steps 10", "--log-interval"),
        # the schedulers the command line's hint maps, the Trainer's warmup_steps over its
        # ratio (transformers 4) and an optimizer megapar has not were left unsaid (a re-test)
        ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
          "max_steps": 10}, "--lr-decay cosine --min-lr 3e-05", ""),
        ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-5}},
         "--lr-decay cosine --min-lr 1e-05", ""),
        ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {
            "num_decay_steps": 3, "decay_type": "1-sqrt", "min_lr_ratio": 0.5}},
         "--lr-decay wsd --min-lr 0.00015 --lr-wsd-decay-steps 3 --lr-wsd-decay-style sqrt", ""),
        ({"max_steps": 10, "warmup_steps": 2, "warmup_ratio": 0.5}, "--warmup-steps 2 ",
         "--warmup-steps 5"),
        # transformers' decay is cosine unless told (a second re-test: megapar's linear was
        # kept), and a warmup_type megapar has not is said
        ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {
            "num_decay_steps": 3, "num_stable_steps": 4, "warmup_type": "cosine"}},
         "--lr-wsd-decay-steps 3 --lr-wsd-decay-style cosine", ""),
        ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {
            "num_stable_steps": 4, "warmup_type": "cosine"}},
         "lr_scheduler_kwargs warmup_type cosine: megapar-train's warmup is linear", ""),
        ({"optim": "adafactor"}, "optim adafactor: megapar-train's --optimizer is adamw, lamb, "
         "lars, sgd or muon (not given, it trains with AdamW)", ""),
        ({"optim": "adamw_torch_fused"}, "--lr 0.0003", "optim adamw"),
        # a schedule megapar has is not also said to be one it has not (a read of the change)
        ({"lr_scheduler_type": "cosine"}, "--lr-decay cosine --min-lr 0", "lr_scheduler_type"),
        ({"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2.0}},
         "lr_scheduler_type polynomial power 2.0: megapar-train's --lr-decay is", ""),
        # a third re-test's: polynomial at its default power 1 is a linear decay to lr_end;
        # SGD got the Adam flags megapar-train refuses with it, and its momentum unsaid;
        # num_cycles, a cosine_with_min_lr without its floor and the deepspeed file unsaid;
        # the WSD's end of decay named but not computed
        ({"lr_scheduler_type": "polynomial"}, "--lr-decay linear --min-lr 1e-07", "power"),
        ({"optim": "sgd"}, "--optimizer sgd --save out", "--adam-"),
        ({"optim": "sgd"}, "optim sgd: the Trainer's is torch's SGD with momentum 0; megapar's "
         "sgd uses momentum 0.9", ""),
        # a second re-test's: the momentum of optim_args (transformers 5 reads it), lamb (no
        # optimizer of transformers'), a WSD without num_decay_steps and an lr_end above the
        # lr (both refused by transformers), a warmup_ratio's steps in the WSD's end
        ({"optim": "sgd", "optim_args": "momentum=0.9"}, "--optimizer sgd", "optim sgd:"),
        ({"optim": "sgd", "optim_args": "momentum=0.5, nesterov=True"}, "optim sgd: the "
         "Trainer's is torch's SGD with momentum 0.5 (its optim_args); megapar's", ""),
        ({"optim": "sgd", "optim_args": "weight_decay=0.1,nesterov=true,dampening=0.1"},
         "--weight-decay 0.1", "--weight-decay 0 "),
        ({"optim": "sgd", "optim_args": "weight_decay=0.1,nesterov=true,dampening=0.1"},
         "optim_args nesterov=true,dampening=0.1: megapar's sgd has no dampening and no "
         "Nesterov momentum", ""),
        ({"optim": "lamb"}, "optim lamb: not one of transformers' optimizers",
         "--optimizer lamb --save"),
        ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {
            "num_stable_steps": 50}}, "transformers refuses it without num_decay_steps", ""),
        ({"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"lr_end": 1e-3}},
         "lr_end 0.001: transformers refuses an lr_end not below learning_rate 0.0003",
         "--min-lr 0.001"),
        ({"lr_scheduler_type": "warmup_stable_decay", "max_steps": 100, "warmup_ratio": 0.1,
          "lr_scheduler_kwargs": {"num_stable_steps": 50, "num_decay_steps": 30}},
         "--warmup-steps 10 --lr-decay wsd", "num_stable_steps:"),
        ({"lr_scheduler_type": "warmup_stable_decay", "max_steps": 100, "warmup_ratio": 0.1,
          "lr_scheduler_kwargs": {"num_stable_steps": 50, "num_decay_steps": 30}},
         "--lr-decay-steps 90", ""),
        ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 1.0}},
         "lr_scheduler_kwargs num_cycles 1.0: megapar-train's cosine is half a wave", ""),
        ({"lr_scheduler_type": "cosine_with_min_lr"}, "lr_scheduler_type cosine_with_min_lr: "
         "transformers refuses it without min_lr or min_lr_rate", "--lr-decay cosine --min-lr 0"),
        ({"deepspeed": "ds.json"}, "deepspeed ds.json: no such config file, which the Trainer refuses too", ""),
        ({"lr_scheduler_type": "warmup_stable_decay", "max_steps": 200, "warmup_steps": 10,
          "lr_scheduler_kwargs": {"num_stable_steps": 70, "num_decay_steps": 20}},
         "--lr-wsd-decay-style cosine --lr-decay-steps 100 --save", "num_stable_steps"),
        ({"lr_scheduler_type": "warmup_stable_decay", "max_steps": 100, "warmup_steps": 10,
          "lr_scheduler_kwargs": {"num_stable_steps": 70, "num_decay_steps": 20}},
         "--lr-wsd-decay-style cosine --save", "--lr-decay-steps"),
    ]
    for extra, said, absent in cases:
        args.write_text(json.dumps({"output_dir": "out", "learning_rate": 3e-4, **extra}))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(args)])
        assert said in str(info.value), (extra, info.value)
        assert not absent or absent not in str(info.value), (extra, info.value)
    # a deepspeed file that is there is read as the Trainer reads it: its scheduler replaces
    # the Trainer's (the file's translation said --lr-decay constant, the Trainer's cosine; a
    # re-test)
    schedule = tmp_path / "ds_sched.json"
    schedule.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_num_steps": "auto"}}}))
    args.write_text(json.dumps({"output_dir": "out", "lr_scheduler_type": "cosine",
                                "deepspeed": str(schedule)}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(args)])
    flags = str(info.value).split(";")[0]
    assert "--lr-decay constant" in flags and "cosine" not in flags, str(info.value)
    # a file the Trainer cannot read is said so (it was told to give it to --config, which
    # then refused it: no such config file; a re-test)
    for text, why in [("", "an empty file"), ('{"a":\n', "not valid JSON at line 2 column 1")]:
        schedule.write_text(text)
        with pytest.raises(ConfigError, match=rf"deepspeed \S*ds_sched.json: {why}.*, which the "
                                              r"Trainer refuses too; fix the path or the file"):
            parse_args(["--config", str(args)])
    schedule.unlink()
    with pytest.raises(ConfigError, match=r"ds_sched.json: no such config file, which the "
                                          r"Trainer refuses too"):
        parse_args(["--config", str(args)])
    # a cosine's floor as a ratio: the number at the Trainer's lr (it was '--min-lr (--lr x
    # cos_min_ratio 0.1)', which no shell takes; a re-test)
    args.write_text(json.dumps({"output_dir": "out", "learning_rate": 3e-4, "deepspeed": {
        "scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1}}}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(args)])
    flags = str(info.value).split(";")[0]
    # its warmup is DeepSpeed's 1000 (the Trainer fills warmup_num_steps only where the file
    # gives it; it said --warmup-steps 0, the Trainer's, beside DeepSpeed's log warmup)
    assert "--lr-decay cosine --warmup-steps 1000 --min-lr 3e-05" in flags, flags
    assert flags.count("--warmup-steps") == 1, flags
    # ... within the Trainer's max_steps (1000 over max_steps 100 was refused next; a re-test)
    args.write_text(json.dumps({"output_dir": "out", "warmup_steps": 10, "max_steps": 100,
                                "deepspeed": {"scheduler": {"type": "WarmupDecayLR", "params": {
                                    "total_num_steps": "auto"}}}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(args)])
    flags = str(info.value).split(";")[0]
    assert "--max-steps 100" in flags and "--warmup-steps 100 " in flags, flags
    assert "warms up over 1000 steps, more than the Trainer's max_steps 100" in str(info.value)
    # a DeepSpeed config alone: at megapar-train's --lr, said (it was the unpasteable
    # '--min-lr (--lr x cos_min_ratio 0.1)'; a re-test)
    alone = tmp_path / "ds_alone.json"
    alone.write_text(json.dumps({"scheduler": {"type": "WarmupCosineLR", "params": {
        "cos_min_ratio": 0.1, "total_num_steps": 50}}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(alone)])
    said = str(info.value)
    assert "--lr-decay cosine --warmup-steps 50 --max-steps 50 --min-lr 0.0001 " in said, said
    assert "scheduler.params.cos_min_ratio 0.1 (of the optimizer's lr, which the file does not " \
        "give: --min-lr 0.0001 is at megapar-train's --lr 0.001)" in said, said
    assert "(--lr x" not in said, said
    with pytest.raises(ConfigError) as info:  # at the command line's --lr (a re-test)
        parse_args(["--config", str(alone), "--lr", "3e-4"])
    assert "--min-lr 3e-05 " in str(info.value) and "cos_min_ratio" not in str(info.value)
    # a Trainer counting epochs, whose inline scheduler warms up over DeepSpeed's 1000 steps:
    # the --max-steps to choose is said to exceed it (--warmup-steps 1000 was refused next at
    # the default --max-steps; a re-test of 71568e4a)
    epochs = tmp_path / "epochs.json"
    epochs.write_text(json.dumps({"output_dir": "out", "num_train_epochs": 1, "deepspeed": {
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(epochs)])
    assert "--warmup-steps 1000 " in str(info.value) and (
        "deepspeed's scheduler warms up over 1000 steps: the --max-steps you choose must be "
        f"more (megapar-train's default is {TrainConfig.max_steps})") in str(info.value), \
        str(info.value)
    # a Trainer's learning_rate beside the command line's --lr: the line's, and the inline
    # cosine's floor its ratio (the file's --lr 0.0003 and --min-lr 3e-05 were said; a re-test)
    trainer = tmp_path / "trainer.json"
    trainer.write_text(json.dumps({"output_dir": "out", "max_steps": 4, "learning_rate": 3e-4,
                                   "deepspeed": {"scheduler": {"type": "WarmupCosineLR", "params": {
                                       "total_num_steps": "auto", "cos_min_ratio": 0.1}}}}))
    for line, lr, floor in (([], "0.0003", "3e-05"), (["--lr", "1e-3"], "0.001", "0.0001")):
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(trainer), *line])
        assert f"--lr {lr} " in str(info.value) and f"--min-lr {floor}" in str(info.value), \
            str(info.value)
    # a switch written as a string is read by its word ("false" was read as true: --precision
    # fp16 --recompute full --compile offered; a re-test), and the constant schedule does not
    # warm up (transformers' get_constant_schedule; it was --warmup-steps 100 and "never
    # reaching its learning_rate")
    trainer.write_text(json.dumps({"output_dir": "out", "fp16": "false", "torch_compile": "no",
                                   "gradient_checkpointing": "False", "bf16": "n",
                                   "max_steps": 10}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(trainer)])
    said = str(info.value)
    assert all(f not in said for f in ("--precision", "--recompute", "--compile")), said
    trainer.write_text(json.dumps({"output_dir": "out", "fp16": "true", "max_steps": 100,
                                   "warmup_steps": 500, "lr_scheduler_type": "constant"}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(trainer)])
    said = str(info.value)
    assert "--warmup-steps 0 --lr-decay constant --precision fp16 " in said and "warmup_steps " \
        "500: the Trainer's constant schedule does not warm up (constant_with_warmup does)" in \
        said and "never reaching" not in said, said
    # every inline value unlike the Trainer's in one line (weight decay, beta2 and warmup were
    # refused a run each), and an optimizer lr unlike its learning_rate refused too (it was
    # translated at the Trainer's and never compared; a re-test)
    trainer.write_text(json.dumps({
        "output_dir": "o", "per_device_train_batch_size": 4, "learning_rate": 1e-4,
        "max_steps": 100, "deepspeed": {
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                      "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(trainer)])
    said = str(info.value)
    for part in ("optimizer.params.lr 0.0003 (--lr 0.0003) differs from the Trainer's own --lr "
                 "0.0001", "optimizer.params.weight_decay 0.1", "optimizer.params.betas.1 0.95",
                 "scheduler.params.warmup_num_steps 10"):
        assert part in said, said
    assert said.count("; and deepspeed's ") == 3 and "\n" not in said, said
    # and with an inline DeepSpeed optimizer, its lr a number or "auto" (the floor was the
    # file's ratio, --min-lr 3e-05 beside --lr 0.001)
    for optimizer_lr in (3e-4, "auto"):
        trainer.write_text(json.dumps({"output_dir": "out", "max_steps": 4, "learning_rate": 3e-4,
                                       "deepspeed": {"optimizer": {"type": "AdamW", "params": {
                                           "lr": optimizer_lr}}, "scheduler": {
                                           "type": "WarmupCosineLR", "params": {
                                               "total_num_steps": "auto", "cos_min_ratio": 0.1}}}}))
        for line, lr, floor in (([], "0.0003", "3e-05"), (["--lr", "1e-3"], "0.001", "0.0001")):
            with pytest.raises(ConfigError) as info:
                parse_args(["--config", str(trainer), *line])
            said = str(info.value)
            assert f"--lr {lr} " in said and f"--min-lr {floor}" in said, said
            assert "mismatch" not in said, said
    # the Trainer's own warmup_steps past its max_steps, or past megapar-train's default steps
    # where it counts epochs (--warmup-steps 500 was refused next; a re-test)
    for given, flag, said in (({"max_steps": 100, "warmup_steps": 500}, "--warmup-steps 100 ",
                               "warmup_steps 500: more than the Trainer's max_steps 100, never "
                               "reaching its "
                               "learning_rate"),
                              ({"num_train_epochs": 1, "warmup_steps": 500}, "--warmup-steps 500 ",
                               "warmup_steps 500: the --max-steps you choose must be more "
                               f"(megapar-train's default is {TrainConfig.max_steps})")):
        epochs.write_text(json.dumps({"output_dir": "out", **given}))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(epochs)])
        assert flag in str(info.value) and said in str(info.value), str(info.value)
    from megapar.training.hf_trainer_config import DEFAULT_MAX_STEPS  # (it cannot import it)
    assert DEFAULT_MAX_STEPS == TrainConfig.max_steps
    # and over an lr the file gives (the file's was said, and its floor: a re-test)
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
                                 "scheduler": {"type": "WarmupCosineLR", "params": {
                                     "total_num_steps": 6, "cos_min_ratio": 0.1}}}))
    for line, lr, floor in (([], "0.0002", "2e-05"), (["--lr", "1e-3"], "0.001", "0.0001")):
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(given), *line])
        assert f"--lr {lr} " in str(info.value) and f"--min-lr {floor} " in str(info.value), \
            str(info.value)
    # a log warmup is not said beside the line's --warmup-steps, which stands in it whole; a
    # Trainer's parenthesis follows its flags, not the last note (both: a re-test)
    logged = tmp_path / "logged.json"
    logged.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_num_steps": 100, "warmup_type": "log"}}}))
    for line, said in (([], True), (["--warmup-steps", "1"], False)):
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(logged), *line])
        assert ("warmup_type log (megapar's warmup is linear)" in str(info.value)) == said, \
            str(info.value)
    logged.write_text(json.dumps({"output_dir": "o", "warmup_steps": 10, "max_steps": 100}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(logged), "--warmup-steps", "5"])
    assert ("--log-interval 500 (the Trainer's other arguments have no megapar-train flag, or "
            "are its defaults); the command line's --warmup-steps 5 over the file's warmup_steps "
            "10") in str(info.value), str(info.value)
    # the values the file derives from the line's flags: a warmup ratio of the line's
    # --max-steps, a warmup cut to it, DeepSpeed's global batch of the line's micro-batch (the
    # file's were said: --warmup-steps 100 at --max-steps 50 was refused next; a re-test)
    for file, line, said in (
            ({"output_dir": "o", "max_steps": 200, "warmup_ratio": 0.1}, ["--max-steps=50"],
             "--max-steps 50 --warmup-steps 5 "),
            ({"output_dir": "o", "max_steps": 200, "warmup_steps": 100}, ["--max-steps", "50"],
             "--max-steps 50 --warmup-steps 50 "),
            ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
              "scheduler": {"type": "WarmupCosineLR", "params": {
                  "total_num_steps": 100, "warmup_num_steps": 10}}},
             ["--dp", "2", "--micro-batch-size", "2", "--max-steps", "5"],
             "--micro-batch-size 2 --global-batch-size 32 ")):
        derived = tmp_path / "derived.json"
        derived.write_text(json.dumps(file))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), *line])
        flags = str(info.value).split(";")[0]
        assert said in flags, flags
        if line[-2:] == ["--max-steps", "5"]:  # DeepSpeed's 10 warmup steps cut to 5
            assert "--warmup-steps 5 --max-steps 5 " in flags, flags
    # the Trainer's / torchtitan's per-rank batch at the line's --dp is a number, and the line's
    # --global-batch-size over it (both were "--global-batch-size 8 x the --dp size"; a re-test)
    trainer_batch = {"output_dir": "o", "max_steps": 5, "per_device_train_batch_size": 4,
                     "gradient_accumulation_steps": 2}
    for line, flag, note in (
            (["--dp", "2"], "--global-batch-size 16 ", None),
            (["--global-batch-size", "32"], "--global-batch-size 32 ",
             "the command line's --global-batch-size 32 over the file's "
             "per_device_train_batch_size 4 x gradient_accumulation_steps 2 x dp")):
        derived.write_text(json.dumps(trainer_batch))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), *line])
        flags = str(info.value).split(";")[0]
        assert flag in flags and "(8 x dp)" not in flags and "--dp size" not in str(info.value), \
            str(info.value)
        assert note is None or note in str(info.value), str(info.value)
        titan = _toml_refusal(tmp_path / "titan.toml", "[training]\nsteps = 5\n"
                              "local_batch_size = 8\n", *line)
        assert flag.strip() in titan and "x dp" not in titan.split(";")[1], titan
        assert "--dp size" not in titan, titan
        titan_note = note and note.replace(  # the file's keys
            "per_device_train_batch_size 4 x gradient_accumulation_steps 2 x dp",
            "training.local_batch_size 8 x dp")
        assert titan_note is None or titan_note in titan, titan
    # a local batch the line's --dp and --global-batch-size cannot take is said with both
    # fixes, and the file's own keys are named (it suggested flags megapar-train refused, and
    # 'the file's --seq-len 64'; a re-test)
    titan = _toml_refusal(tmp_path / "titan.toml", "[training]\nsteps = 5\nlocal_batch_size = 8\n"
                          "seq_len = 64\n", "--dp", "2", "--global-batch-size", "8", "--seq-len", "32")
    assert ("the command line's --seq-len 32 over the file's training.seq_len 64; the command "
            "line's --global-batch-size 8 over the file's training.local_batch_size 8 x --dp 2; "
            "but --global-batch-size 8 is no multiple of --micro-batch-size 8 x --dp 2 = 16, "
            "which megapar-train refuses: give --global-batch-size 16 (or a multiple), or "
            "--micro-batch-size 4") in titan, titan
    # an inline DeepSpeed value is compared with the Trainer's own (its warmup before a cut to
    # the line's --max-steps: 10 and 10 "differ" at --max-steps 4), and not where the line sets
    # both (--weight-decay 0.1 was refused beside the file's 0 and 0.1); the cut said once
    for file, line, flag in (
            ({"output_dir": "o", "max_steps": 100, "warmup_steps": 10, "deepspeed": {
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}},
             ["--max-steps", "4"], "--max-steps 4 --warmup-steps 4 "),
            ({"output_dir": "o", "max_steps": 100, "weight_decay": 0, "deepspeed": {
                "optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}}},
             ["--weight-decay", "0.1"], "--weight-decay 0.1 ")):
        derived.write_text(json.dumps(file))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), *line])
        said = str(info.value)
        assert "differs" not in said and flag in said.split(";")[0], said
        assert said.count("never reaching") <= 1, said
    # the line's --warmup-steps over the file's own warmup, not over what was derived from it
    # ("over the file's --warmup-steps 5" of DeepSpeed's 100 cut to the line's --max-steps 5,
    # "--warmup-steps 1" of a ratio 0.1 of the line's 4; a note where the two were alike)
    for file, line, note in (
            ({"scheduler": {"type": "WarmupDecayLR", "params": {
                "warmup_num_steps": 100, "total_num_steps": 200}}},
             ["--max-steps", "5", "--warmup-steps", "3"], "the command line's --warmup-steps 3 "
             "over the file's scheduler.params.warmup_num_steps 100"),
            ({"output_dir": "o", "max_steps": 200, "warmup_ratio": 0.1},
             ["--max-steps", "4", "--warmup-steps", "2"],
             "the command line's --warmup-steps 2 over the file's warmup_ratio 0.1"),
            ({"output_dir": "o", "max_steps": 200, "warmup_steps": 100},
             ["--max-steps", "50", "--warmup-steps", "100"], None),
            # DeepSpeed's warmup not cut or said beside the line's ("above the command line's
            # --max-steps 50" of the line's 200, and "over the file's --warmup-steps 50", its
            # cut; a re-test), nor an inline one beside a Trainer's
            ({"scheduler": {"type": "WarmupDecayLR", "params": {
                "warmup_num_steps": 100, "total_num_steps": 1000}}},
             ["--max-steps", "50", "--warmup-steps", "200"], "the command line's --warmup-steps "
             "200 over the file's scheduler.params.warmup_num_steps 100"),
            ({"output_dir": "o", "max_steps": 20, "warmup_steps": 10, "deepspeed": {
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}}}},
             ["--max-steps", "3", "--warmup-steps", "5"],
             "the command line's --warmup-steps 5 over the file's warmup_steps 10")):
        derived.write_text(json.dumps(file))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), *line])
        said = str(info.value)
        assert f"--warmup-steps {line[-1]} " in said.split(";")[0], said
        assert said.count("--warmup-steps") == 1 + (note is not None), said
        assert note is None or note in said, said
        assert "never reaching" not in said and "above" not in said, said
    # the line's --max-steps and --warmup-steps stand in a torchtitan job's steps and warmup:
    # its schedule is the line's (a warmup of 30 was cut to the file's 10 steps, its cosine
    # dropped, beside --max-steps 50; a re-test)
    titan = _toml_refusal(tmp_path / "titan.toml", "[training]\nsteps = 10\n[optimizer]\n"
                          "lr = 8e-4\n[lr_scheduler]\nwarmup_steps = 30\ndecay_type = "
                          "\"cosine\"\nmin_lr_factor = 0.1\n", "--max-steps", "50",
                          "--warmup-steps", "3")
    assert "--warmup-steps 3 --lr-decay cosine --min-lr 8e-05 --max-steps 50 " in titan, titan
    assert titan.endswith("the command line's --max-steps 50 over the file's training.steps 10; "
                          "the command line's --warmup-steps 3 over the file's lr_scheduler."
                          "warmup_steps 30"), titan
    # the line's --lr stands in a torchtitan job's [optimizer] lr: its cosine's floor is its
    # min_lr_factor of the line's (it stayed 8e-05 of the file's 8e-4 beside --lr 1e-3)
    titan = _toml_refusal(tmp_path / "titan.toml", "[training]\nsteps = 100\n[optimizer]\n"
                          "lr = 8e-4\n[lr_scheduler]\nwarmup_steps = 10\ndecay_type = "
                          "\"cosine\"\nmin_lr_factor = 0.1\n", "--lr", "1e-3")
    assert "--min-lr 0.0001 " in titan and "--lr 0.001;" in titan, titan
    assert titan.endswith("the command line's --lr 0.001 over the file's optimizer.lr 0.0008"), \
        titan
    # DeepSpeed's three batch keys fix its GPUs by the file's values, and are checked as the
    # file's: the line's --micro-batch-size does not move them (--micro-batch-size 2 made a
    # file's 8 GPUs --dp 16), beside its --dp too (which refused the file's 4 x 2 x --dp 2)
    derived.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                   "gradient_accumulation_steps": 2}))
    for line, flags in ((["--micro-batch-size", "2"], "--dp 8 --global-batch-size 64 "
                         "--micro-batch-size 2 "),
                        (["--micro-batch-size", "2", "--dp", "2"], "flags (or a --config file "
                         "of them): --global-batch-size 64 --micro-batch-size 2 ")):
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), *line])
        assert flags in str(info.value) and "the command line's --micro-batch-size 2 over the " \
            "file's train_micro_batch_size_per_gpu 4" in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match="train_batch_size 64 is not train_micro_batch_size_"
                       "per_gpu 4 x gradient_accumulation_steps 2 x --dp 2 = 16, which DeepSpeed"):
        parse_args(["--config", str(derived), "--dp", "2"])  # the file's, at the line's --dp
    # a warmup past the line's --max-steps says the line's, not the file's key ("more than
    # max_steps 30" / "above total_num_steps 50" of the line's; a re-test)
    for file, said in (
            ({"output_dir": "o", "max_steps": 50, "warmup_steps": 100},
             "warmup_steps 100: more than the command line's --max-steps 30, never reaching"),
            ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "scheduler": {"type": "WarmupDecayLR", "params": {
                  "warmup_num_steps": 100, "total_num_steps": 200}}},
             "warmup_num_steps 100 above the command line's --max-steps 30 (DeepSpeed warms")):
        derived.write_text(json.dumps(file))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), "--max-steps", "30"])
        assert said in str(info.value) and "max_steps 30" not in str(info.value) \
            and "total_num_steps 30" not in str(info.value), str(info.value)
    # the line's --lr noted as its other flags are, and its own --warmup-steps not called the
    # file's ("the file's warmup of 10 steps cut to ..." of the line's 10; a re-test)
    for file, line, note in (
            ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}},
             ["--lr", "1e-3"], "the command line's --lr 0.001 over the file's "
             "optimizer.params.lr 0.0003"),
            ({"output_dir": "o", "max_steps": 100, "learning_rate": 3e-4}, ["--lr", "5e-4"],
             "the command line's --lr 0.0005 over the file's learning_rate 0.0003")):
        derived = tmp_path / "derived.json"
        derived.write_text(json.dumps(file))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), *line])
        assert note in str(info.value), str(info.value)
    # the Trainer's report_to: megapar-train's reporting flags (wandb was "the Trainer's other
    # arguments have no megapar-train flag"; a re-test)
    for report, flag, said in (("wandb", None, "report_to wandb: --wandb-project NAME"),
                               ("all", "--tensorboard tb", "report_to wandb: --wandb-project"),
                               (["tensorboard", "mlflow"], "--tensorboard tb",
                                "report_to mlflow: megapar-train reports to Weights & Biases "
                                "(--wandb-project) and TensorBoard (--tensorboard) alone"),
                               ("none", None, None)):
        derived.write_text(json.dumps({"output_dir": "o", "max_steps": 5, "report_to": report,
                                       "logging_dir": "tb"}))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived)])
        text = str(info.value)
        assert (flag in text.split(";")[0]) if flag else "--tensorboard" not in text, text
        assert (said in text) if said else "report_to" not in text, text
    derived.write_text(json.dumps({"output_dir": "o", "max_steps": 5, "report_to": ["wandb",
                                                                              "tensorboard"]}))
    with pytest.raises(ConfigError) as info:  # the line's own: not told again (a re-test)
        parse_args(["--config", str(derived), "--wandb-project", "p", "--tensorboard", "tb"])
    assert "report_to" not in str(info.value), str(info.value)
    # a note names the file's own value, not one derived from the line's (the line's
    # --micro-batch-size 2 made "the file's --global-batch-size (4 x dp)"; a re-test)
    derived.write_text(json.dumps({"output_dir": "o", "max_steps": 20,
                                   "per_device_train_batch_size": 4,
                                   "gradient_accumulation_steps": 2}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(derived), "--micro-batch-size", "2", "--global-batch-size",
                    "16"])
    assert "the command line's --global-batch-size 16 over the file's " \
        "per_device_train_batch_size 4 x gradient_accumulation_steps 2 x dp" in str(info.value), \
        str(info.value)
    # ... at the line's --dp (8 at dp 1: "8 over (8 x dp)" was noted, 4 over 8 was not)
    for batch, note in (("4", "the command line's --global-batch-size 4 over the file's "
                         "per_device_train_batch_size 4 x gradient_accumulation_steps 2 x "
                         "--dp 1"), ("8", None)):
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(derived), "--micro-batch-size", "2", "--dp", "1",
                        "--global-batch-size", batch])
        said = str(info.value)
        assert (note in said) if note else "--global-batch-size 8 over" not in said, said
    # DeepSpeed's monitors are megapar-train's reporting (its tensorboard section was a
    # --tensorboard of the dict), and a torchtitan job's are not told beside the line's own
    monitors = tmp_path / "monitors.json"
    monitors.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "tensorboard": {
        "enabled": True, "output_path": "tbout", "job_name": "j"}, "wandb": {
        "enabled": True, "project": "dsproj"}}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(monitors), "--wandb-project", "p"])
    assert "--tensorboard tbout/j --wandb-project p " in str(info.value) and "the command " \
        "line's --wandb-project p over the file's --wandb-project dsproj" in str(info.value), \
        str(info.value)
    titan = _toml_refusal(tmp_path / "titan.toml", "[training]\nsteps = 10\n[metrics]\n"
                          "enable_tensorboard = true\nsave_tb_folder = \"tb\"\n"
                          "enable_wandb = true\n", "--tensorboard", "tbx", "--wandb-project", "p")
    assert "metrics" not in titan, titan
    yaml_lr = tmp_path / "lr.yaml"  # YAML reads 1e-4 as a string (it was not noted)
    yaml_lr.write_text("output_dir: o\nmax_steps: 10\nlearning_rate: 1e-4\n")
    with pytest.raises(ConfigError, match="the command line's --lr 0.0002 over the file's "
                       "learning_rate 0.0001"):
        parse_args(["--config", str(yaml_lr), "--lr", "2e-4"])
    derived.write_text(json.dumps({"output_dir": "o", "num_train_epochs": 3,
                                   "warmup_steps": 100}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(derived), "--max-steps", "2", "--warmup-steps", "10"])
    assert "the file's warmup of" not in str(info.value), str(info.value)
    from megapar.training.hf_trainer_config import command_line_wins

    assert command_line_wins(
        ["--adam-beta1 0.9 --adam-beta2 0.95", "--compile", "--global-batch-size (8 x dp)"],
        {"--adam-beta2": "--adam-beta2 0.99", "--compile": "--no-compile",
         "--no-compile": "--no-compile", "--global-batch-size": "--global-batch-size 32",
         "--adam-beta1": "--adam-beta1 0.9"}) == (
        ["--adam-beta1 0.9 --adam-beta2 0.99", "--no-compile", "--global-batch-size 32"],
        ["the command line's --adam-beta2 0.99 over the file's --adam-beta2 0.95",
         "the command line's --no-compile over the file's --compile",
         "the command line's --global-batch-size 32 over the file's --global-batch-size (8 x dp)"])
    # the command line's own flags over the file's, as over a --config of megapar-train's own
    # (--min-lr 5e-05 and --max-steps 50 beside a DeepSpeed cosine were said as the file's)
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(given), "--min-lr", "5e-5", "--max-steps", "50"])
    said = str(info.value)
    assert "--max-steps 50 --min-lr 5e-05 " in said and "--min-lr 2e-05" not in said.split(
        ";")[0], said
    assert "the command line's --max-steps 50 over the file's scheduler.params.total_num_steps " \
        "6; the command line's --min-lr 5e-05 over the file's --min-lr 2e-05" in said, said
    for line, kept, over in ((["--precision", "fp32"], "--precision fp32 ", "--precision bf16"),
                             (["--recompute", "selective"], "--recompute selective ",
                              "--recompute full")):
        trainer.write_text(json.dumps({"output_dir": "out", "max_steps": 4, "bf16": True,
                                       "gradient_checkpointing": True}))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(trainer), *line])
        said = str(info.value)
        assert kept in said and f"the command line's {kept}over the file's {over}" in said, said
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"eval_steps": 2, "seed": 7, "max_steps": 3}))
    assert parse_args(["--config", str(ours)]).eval_steps == 2
    # a megapar config with one Trainer spelling, and a DeepSpeed config with the Trainer's
    # gradient_accumulation_steps, are not the Trainer's (a second re-test's findings)
    ours.write_text(json.dumps({"seed": 1, "max_steps": 10, "learning_rate": 3e-4}))
    with pytest.raises(ConfigError, match="unknown setting 'learning_rate'; did you mean --lr"):
        parse_args(["--config", str(ours)])
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
                                     "gradient_accumulation_steps": "auto",
                                     "train_micro_batch_size_per_gpu": "auto"}))
    with pytest.raises(ConfigError, match=r"ds.json is a DeepSpeed config.*--zero 2"):
        parse_args(["--config", str(deepspeed)])


@pytest.mark.parametrize("name,text,said", [
    # a translation gave flags megapar-train then refused (a re-test of the config translations)
    ("ds.json", {"zero_optimization": {"stage": 4}, "train_batch_size": 8},
     "is a DeepSpeed config, which megapar-train does not read, and a value in it is one "
     "megapar-train refuses: --zero 4 is invalid: choose one of 0, 1, 2, 3 (the file's "
     "zero_optimization.stage 4); correct it in the file"),  # its key named (a re-test)
    ("ds.json", {"train_batch_size": 8.5},
     "megapar-train refuses: --global-batch-size '8.5' is invalid: expected a whole number"),
    ("ds.json", {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"eps": 0}}},
     "megapar-train refuses: --adam-eps 0.0 is invalid: it must be a finite number > 0.0"),
    ("ds.json", {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
                                                      "params": {"total_num_steps": 0}}},
     "megapar-train refuses: --max-steps 0 is invalid: it must be a whole number >= 1"),
    ("args.json", {"output_dir": "out", "per_device_train_batch_size": "auto"},
     "is a Hugging Face Trainer's arguments (TrainingArguments), which megapar-train does not "
     "read, and a value in it is one megapar-train refuses: --micro-batch-size 'auto' is "
     "invalid: expected a whole number (the file's per_device_train_batch_size 'auto'); "
     "correct it in the file"),
    ("args.json", {"output_dir": "out", "weight_decay": -0.1},
     "megapar-train refuses: --weight-decay -0.1 is invalid: it must be a finite number >= 0.0"),
    ("args.json", {"output_dir": "out", "label_smoothing_factor": 1.0},  # [0, 1): a re-test
     "megapar-train refuses: --label-smoothing 1.0 is invalid: it must be in [0, 1)"),
    ("args.json", {"output_dir": "out", "adam_beta2": 1.0},
     "megapar-train refuses: --adam-beta2 1.0 is invalid: it must be in [0, 1)"),
    ("args.json", {"output_dir": "out", "bf16": True, "fp16": True},
     ": bf16 and fp16 are both true, which the Trainer refuses: set one"),
    ("args.json", {"output_dir": "out", "bf16": 1.0, "fp16": "yes"},  # read as its switches
     ": bf16 and fp16 are both true, which the Trainer refuses: set one"),  # are (1.0 was not)
    ("acc.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: MEGATRON_LM\n"
                 "megatron_lm_config:\n  megatron_lm_gradient_clipping: -1\n",
     "is an accelerate config, which megapar-train does not read, and a value in it is one "
     "megapar-train refuses: --clip-grad -1.0 is invalid: it must be a finite number >= 0.0"),
    ("acc.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                 "deepspeed_config:\n  zero_stage: 4\n",  # it said "--zero 1, 2 or 3"
     "megapar-train refuses: --zero 4 is invalid: choose one of 0, 1, 2, 3"),
    ("job.toml", "[optimizer]\nname = 'AdamW'\neps = 0\n[training]\nsteps = 10\n",
     "not a TOML job config (torchtitan's), and a value in it is one megapar-train refuses: "
     "--adam-eps 0.0 is invalid: it must be a finite number > 0.0 (the file's optimizer.eps "
     "0)"),
    # two keys hold the refused value: the one nearest the flag's name is named (a re-test)...
    ("ds.json", {"zero_optimization": {"stage": 4}, "train_micro_batch_size_per_gpu": 4},
     "choose one of 0, 1, 2, 3 (the file's zero_optimization.stage 4); correct it in the file"),
    ("args.json", {"output_dir": "out", "weight_decay": -1, "max_grad_norm": -1},
     "--weight-decay -1.0 is invalid: it must be a finite number >= 0.0 (the file's "
     "weight_decay -1)"),
    ("job.toml", "[optimizer]\nlr = -1\n[lr_scheduler]\nmin_lr_factor = -1\n",
     "--lr -1.0 is invalid: it must be a finite number > 0.0 (the file's optimizer.lr -1)"),
    # a list's item, and the key another tool names the flag by, where no word is shared with
    # it (neither was named; a re-test); a negative bucket said as the file's (-0.0 MB)
    ("ds.json", {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}},
     "--adam-beta2 1.5 is invalid: it must be in [0, 1) (the file's optimizer.params.betas.1 "
     "1.5)"),
    ("job.toml", "[parallelism]\ntensor_parallel_degree = 0\n[lr_scheduler]\n"
                 "min_lr_factor = 0.0\n",
     "--tp 0 is invalid: it must be a whole number >= 1 (the file's "
     "parallelism.tensor_parallel_degree 0)"),
    ("ds.json", {"zero_optimization": {"stage": 3, "reduce_bucket_size": -1}},
     "ds.json: zero_optimization.reduce_bucket_size -1 is invalid: DeepSpeed's bucket is a "
     "whole number of elements > 0 (megapar's --grad-bucket-mb, 4 bytes each)"),
    ("ds.json", {"zero_optimization": {"stage": 2, "reduce_bucket_size": True}},
     "ds.json: zero_optimization.reduce_bucket_size true is invalid"),  # (a bool is an int)
    # ... and where none is nearest, neither, rather than the wrong one
    ("args.json", {"output_dir": "out", "per_device_train_batch_size": -2,
                   "per_device_eval_batch_size": -2},
     "--micro-batch-size -2 is invalid: it must be a whole number >= 1; correct it in the file"),
])
def test_a_translated_config_with_a_value_megapar_train_refuses_names_it(tmp_path, name, text,
                                                                          said):
    """Another tool's config whose value megapar-train refuses (DeepSpeed's stage 4, a batch of
    8.5 or "auto", an eps of 0, a negative clipping) was answered with flags that megapar-train
    then refused one at a time; the value is named at once, as megapar-train names it."""
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    path = tmp_path / name
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)])
    assert said in str(info.value), str(info.value)


def test_a_translated_config_says_what_it_has_no_flag_for(tmp_path):
    """A re-test's findings: accelerate's DeepSpeed stage 0 read "--zero 1, 2 or 3", its nvme
    offload became host offload without a word (a DeepSpeed config's is said), a partial
    optimizer offload's ratio and the Trainer's label smoothing were dropped, and a ratio given
    as warmup_steps was said as warmup_ratio."""
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    def said(name: str, text) -> str:
        path = tmp_path / name
        path.write_text(text if isinstance(text, str) else json.dumps(text))
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(path)])
        return str(info.value)

    plugin = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\n"
              "deepspeed_config:\n  zero_stage: {stage}\n  offload_optimizer_device: {device}\n")
    line = said("a.yaml", plugin.format(stage=0, device="cpu"))  # megapar offloads at --zero 0
    assert "give --dp 2 --zero 0 --offload-optimizer (" in line, line
    line = said("a.yaml", plugin.format(stage='"3"', device="cpu") + "  offload_param_device: cpu\n")
    assert "give --dp 2 --zero 3 --offload-optimizer --offload-params (" in line, line  # "3" is 3
    line = said("a.yaml", plugin.format(stage=2, device="nvme"))
    assert "give --dp 2 --zero 2 (" in line and ("offload_optimizer_device nvme: no equivalent "
                                                 "(megapar offloads to the host)") in line, line
    line = said("ds.json", {"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert "--offload-optimizer" in line and ("no equivalent: zero_optimization.offload_optimizer"
                                              ".ratio 0.3 (megapar offloads all of the optimizer "
                                              "state)") in line, line
    line = said("args.json", {"output_dir": "out", "label_smoothing_factor": 0.1,
                              "warmup_steps": 0.05})
    assert "--label-smoothing 0.1" in line and ("warmup_steps 0.05: --warmup-steps (the ratio x "
                                                "the training steps)") in line, line


def test_worker_exit_lead(monkeypatch, capsys):
    """Under torchrun a node's process that does not print a start-up refusal exits after the
    one that prints it: torchrun ended the printing process (SIGTERM) once another exited, and
    the line was lost (1 run in 4 of --tp 3 on 4 processes, a cluster user's rehearsal)."""
    import time

    import megapar.cli.worker_exit as worker_exit

    monkeypatch.setattr(worker_exit, "REFUSAL_LEAD_S", 0.3)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    took = {}
    for local in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local)
        start = time.perf_counter()
        assert worker_exit.refused("megapar-train", "bad") == 2
        took[local] = time.perf_counter() - start
    assert took["0"] < 0.3 <= took["1"], took
    assert capsys.readouterr().err == "megapar-train: error: bad\n"


def test_an_empty_data_list_in_a_config_file_is_one_line(tmp_path):
    """{"data": []} in a --config file failed in the blend's parser with an IndexError
    traceback (a re-test); it is one line naming the file and its key (it said "leave the flag
    out" of the key), and a TrainConfig made in Python with data=[] is named as such."""
    import re

    from megapar.models.config import ConfigError
    from megapar.training.config import TrainConfig, parse_args
    from megapar.training.validate import UsageError, check_settings

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"data": [], "max_steps": 3}))
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert str(err.value) == (f"{path}: data: [] names no data: give a text file, a directory "
                              f'of them or a prepared prefix (e.g. data: ["corpus.txt"]), or '
                              f"remove the key (the shipped sample)")
    with pytest.raises(UsageError, match=r"^TrainConfig\(data=\[\]\) names no data: give"):
        check_settings(TrainConfig(data=[]))
    for value, said in (("", "data: '' is an empty path"), ([""], "data: [''] holds an empty "
                                                                 "path")):  # the file named too
        path.write_text(json.dumps({"data": value}))
        with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {re.escape(said)}"):
            parse_args(["--config", str(path)])


def test_empty_paths_of_the_other_commands_are_said_as_empty(tmp_path, capsys):
    """An unset $CKPT / $CONFIG / $DST (a re-test): megapar-eval and megapar-generate said
    "--load : no such checkpoint directory", megapar-train's --config '' trained the defaults
    without a word and --config ' ' was answered with torchtitan's registry, megapar-convert's
    empty DST "holds the source", prepare('') "config.json: no such config file"."""
    import megapar
    from megapar.cli.convert import main as convert
    from megapar.cli.data import main as data
    from megapar.cli.generate import main as generate
    from megapar.models.config import ConfigError

    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    for command, argv, line in [
        (evaluate, ["--load", "", "--data", str(text)], "megapar-eval: error: --load '' is an "
         "empty path: give a directory written by --save (or one of its step_* directories)"),
        (generate, ["--load", " ", "--prompt", "hi"], "megapar-generate: error: --load ' ' is an "
         "empty path: give a directory written by --save (or one of its step_* directories)"),
        (train, ["--config", ""], "megapar-train: error: --config '' is an empty path: give a "
         "YAML or JSON file of megapar-train's settings, or leave the flag out"),
        (train, ["--config", " ", "--dry-run"], "megapar-train: error: --config ' ' is an empty "
         "path"),
        (convert, [str(text), "", "--tp", "1"], "megapar-convert: error: DST '' is an empty "
         "path: give a directory"),
        (convert, ["", str(tmp_path / "out"), "--tp", "1"], "megapar-convert: error: SRC '' is "
         "an empty path: give a directory"),
        (convert, ["--from-hf", str(tmp_path), " "], "megapar-convert: error: DST ' ' is an "
         "empty path: give a directory"),
        (convert, ["--to-hf", " ", str(tmp_path)], "megapar-convert: error: --to-hf ' ' is an "
         "empty path: give a directory"),
        # an unset $TOKENIZER ran the checkpoint's, an unset $OUT wrote ' .bin' (a re-test)
        (evaluate, ["--load", str(tmp_path), "--data", str(text), "--tokenizer", ""],
         "megapar-eval: error: --tokenizer '' is empty: give one, or leave the flag out (the "
         "checkpoint's)"),
        (evaluate, ["--load", str(tmp_path), "--data", " "], "megapar-eval: error: --data ' ' is "
         "empty: give a prepared prefix or a text file"),
        (generate, ["--load", str(tmp_path), "--prompt", "hi", "--tokenizer", " "],
         "megapar-generate: error: --tokenizer ' ' is empty"),
        (generate, ["--load", str(tmp_path), "--prompt-file", ""], "megapar-generate: error: "
         "--prompt-file '' is empty: give a file of the prompt's text"),
        (data, ["--input", str(text), "--output-prefix", " "], "megapar-data: error: "
         "--output-prefix ' ' is empty: give a prefix such as data/corpus"),
        (data, ["--input", "", "--output-prefix", str(tmp_path / "out")], "megapar-data: error: "
         "--input '' is empty: give a text file"),
        (train, ["--profile-dir", "", "--profile-steps", "1:1", "--dry-run"], "megapar-train: "
         "error: --profile-dir '' is an empty path: give a path (e.g. --profile-dir profile)"),
        (data, ["--input", str(text), "--output-prefix", str(tmp_path / "j"), "--jsonl-key", ""],
         "megapar-data: error: --jsonl-key '' is empty: give the field holding each record's "
         "text"),  # it wrote a dataset; megapar-train asked to add '' to the line (a re-test)
        (train, ["--jsonl-key", " ", "--dry-run"], "megapar-train: error: --jsonl-key ' ' is an "
         "empty name: give the field holding each record's text (e.g. --jsonl-key body)"),
    ]:
        assert command(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(line) and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(" *"))
    for text, said in [("save: ''", "--save '' is an empty path: give a path (e.g. --save "
                                     "ckpt), or remove the key"),
                       ("model: ' '", "--model ' ' is an empty name: give a recipe (e.g. "
                                      "--model gpt2-tiny) or a model config file, or remove "
                                      "the key"),
                       ("", "holds no settings: write megapar-train's settings in it (e.g. "
                            "max_steps: 100), or leave --config out")]:
        # the file named, as its other values' refusals (an empty file trained the defaults)
        config = tmp_path / "c.yaml"
        config.write_text(text)
        assert train(["--config", str(config), "--dry-run"]) == 2
        assert capsys.readouterr().err.strip() == f"megapar-train: error: {config}" + (
            f": {said}" if text else f" {said}")
    for text in ["", " \n"]:  # an empty JSON file is the empty YAML's line ("not valid JSON")
        config = tmp_path / "c.json"
        config.write_text(text)
        assert train(["--config", str(config), "--dry-run"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"megapar-train: error: {config} holds no settings: write megapar-train's settings "
            "in it (e.g. max_steps: 100), or leave --config out")
        assert train(["--model", str(config), "--dry-run"]) == 2
        assert capsys.readouterr().err.strip().startswith(
            f"megapar-train: error: {config}: the config has no model_type; add")
    with pytest.raises(ConfigError, match=r"^megapar.prepare: model '' is empty: give a "
                                          r"transformers model or its directory, a recipe"):
        megapar.prepare("")


def test_yamls_unquoted_off_is_a_choice_of_nothing_or_refused_naming_yaml(tmp_path):
    """YAML reads an unquoted off / no / on / yes as a boolean: `fp8: off` was refused as
    "--fp8 'False' is invalid: choose one of off, ..." (the word written, offered back);
    `save: no` saved into a directory named False. A false is the choice of nothing where a
    flag has one (off, none); anything else names YAML's reading, before any worker."""
    from megapar.models.config import ConfigError
    from megapar.training.config import parse_args

    config = tmp_path / "c.yaml"
    for text, name, value in [("fp8: off", "fp8", "off"), ("recompute: no", "recompute", "none"),
                              ("grad_compression: off", "grad_compression", "none"),
                              # the off of a choice the --no- spelling is told (lr_decay: off
                              # was refused; a re-test)
                              ("lr_decay: off", "lr_decay", "constant"),
                              ("precision: no", "precision", "fp32")]:
        config.write_text(text + "\n")
        assert getattr(parse_args(["--config", str(config)]), name) == value, text
    for text, said in [("fp8: on", "--fp8 true is invalid (YAML reads an unquoted yes / no / on "
                        "/ off as true / false): choose one of off, tensorwise, rowwise, or "
                        "remove the key"),
                       ("schedule: off", "--schedule false is invalid (YAML reads"),
                       # a false where the flag's default is none is that default (save:
                       # false was told to quote it: a run saving to ./false; a re-test)
                       ("save: no", "--save false: megapar-train's default is no --save; remove "
                        "the key (YAML reads an unquoted no / off as false: quote a value so "
                        "named)"),
                       ("save: yes", "--save true is invalid (YAML reads an unquoted yes / no "
                        "/ on / off as true / false): give its value in quotes, or remove the "
                        "key")]:
        config.write_text(text + "\n")
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(config)])
        assert str(info.value).startswith(f"{config}: {said}"), info.value
    # a JSON file's true / false is written so: no word of YAML, nor of quotes (a re-test)
    config = tmp_path / "c.json"
    config.write_text('{"save": false}')
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(config)])
    assert str(info.value) == f"{config}: --save false: megapar-train's default is no --save; " \
                              f"remove the key", info.value
    # a file named .YAML is YAML (it was read as JSON: "not valid JSON at line 1"; a re-test)
    config = tmp_path / "c.YAML"
    config.write_text("fp8: off\n")
    assert parse_args(["--config", str(config)]).fp8 == "off"
