"""Fine-tune a transformers causal LM on prompt / response pairs, the prompt masked out of the
loss, with your own loop on megapar's engine (tp 2 by default).

    python examples/sft_prompt_mask.py --model DIR --data pairs.jsonl --out DIR-sft
    python examples/sft_prompt_mask.py --model DIR --data pairs.jsonl --tp 1   # one process

DIR is a transformers directory written by save_pretrained, with its tokenizer (a
GPT2LMHeadModel, LlamaForCausalLM, ...); pairs.jsonl holds one {"prompt": ..., "response": ...}
object per line (other field names: --keys PROMPT,RESPONSE, e.g. TRL's prompt,completion).
megapar-train --sft-keys prompt,response trains on the same rows from the command line; this
is the same with your own loop: each row here is the prompt, the response and the end-of-text
token, cut at --seq-len + 1 and padded on the right; the labels are the next tokens where the next
token is the response's (or the end of text) and -100 on the prompt and the padding.
loss_mean="token" makes the loss the mean over the global batch's labelled tokens, as one
forward of the whole batch with F.cross_entropy(ignore_index=-100) gives (megapar's default
would average each micro-batch's own mean). --out exports the result for transformers.
"""

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import megapar


def read_pairs(path: str, keys: tuple[str, str] = ("prompt", "response")) -> list[tuple[str, str]]:
    """The (prompt, response) pairs of a JSON Lines file (fields `keys`: TRL's are prompt,
    completion), one clear error for a bad line."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"sft_prompt_mask.py: error: {path}:{lineno}: not valid JSON "
                         f"({e.msg} at column {e.colno}); repair or delete the line")
            if not isinstance(record, dict) or not all(
                isinstance(record.get(k), str) for k in keys
            ):
                fields = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
                sys.exit(f"sft_prompt_mask.py: error: {path}:{lineno}: needs string fields "
                         f"{keys[0]!r} and {keys[1]!r} (its fields: {fields}); pass --keys "
                         f"naming them")
            pairs.append((record[keys[0]], record[keys[1]]))
    return pairs


def sft_batch(tokenizer, pairs, seq_len: int) -> dict[str, torch.Tensor]:
    """input_ids and next-token labels [len(pairs), seq_len]: labels on the response and the
    end-of-text token, -100 on the prompt and the right padding."""
    eos = tokenizer.eos_token_id
    ids = torch.full((len(pairs), seq_len + 1), eos)
    labels = torch.full((len(pairs), seq_len + 1), -100)
    for row, (prompt, response) in enumerate(pairs):
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"]  # no second BOS
        if r and r[-1] == eos:  # a response ending in the EOS written out ends with that one,
            r = r[:-1]  # as megapar-train --sft-keys does (a chat template's <|im_end|>)
        tokens = (p + r + [eos])[: seq_len + 1]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, len(p) : len(tokens)] = torch.tensor(tokens[len(p) :])
    return {"input_ids": ids[:, :-1], "labels": labels[:, 1:]}


def global_batches(tokenizer, pairs, seq_len: int, batch_size: int, seed: int):
    """Global batches of the pairs in a seeded order, the same on every rank, epoch after
    epoch (a last incomplete batch of an epoch dropped)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(pairs), generator=gen).tolist()
        for k in range(len(pairs) // batch_size):
            rows = order[k * batch_size : (k + 1) * batch_size]
            yield sft_batch(tokenizer, [pairs[i] for i in rows], seq_len)


def train(args) -> list[float]:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    engine = megapar.prepare(model, tp=args.tp, pp=args.pp, micro_batch_size=2, lr=args.lr,
                             loss_mean="token", precision="fp32")
    losses = []
    for batch in global_batches(tokenizer, args.pairs, args.seq_len, args.batch_size, args.seed):
        if engine.step == args.steps:
            break
        losses.append(engine.train_step(batch))
        if engine.mesh.rank == 0:
            print(f"step {engine.step}: loss {losses[-1]:.4f}", flush=True)
    if args.out:
        engine.export_hf(args.out)  # with DIR's tokenizer, which the model trained with
    return losses


def _keys(value: str) -> tuple[str, str]:
    """--keys PROMPT,RESPONSE as two different field names."""
    keys = [k.strip() for k in value.split(",")]
    if len(keys) != 2 or not all(keys) or keys[0] == keys[1]:
        raise argparse.ArgumentTypeError(f"{value!r} is not two field names PROMPT,RESPONSE")
    return keys[0], keys[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", required=True, help="a transformers directory")
    parser.add_argument("--data", required=True, help="JSON Lines of prompt / response pairs")
    parser.add_argument("--keys", type=_keys, default=("prompt", "response"),
                        help="PROMPT,RESPONSE field names (default prompt,response; TRL's: "
                             "prompt,completion), as megapar-train --sft-keys")
    parser.add_argument("--out", help="export the fine-tuned model here (transformers)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", help="write the losses to this file")
    args = parser.parse_args(argv)
    for flag in ("tp", "pp", "steps", "seq_len", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: it must be >= 1")
    if not os.path.isdir(args.model):  # else transformers would look for it on the Hub
        parser.error(f"--model {args.model}: no such directory (a save_pretrained directory)")
    try:
        args.pairs = read_pairs(args.data, args.keys)  # checked here, before any rank starts
    except OSError as e:
        parser.error(f"--data {args.data}: {e.strerror}")
    if len(args.pairs) < args.batch_size:  # no global batch: the loop would wait forever
        parser.error(f"--batch-size {args.batch_size} is more than the {len(args.pairs)} pairs "
                     f"of {args.data}; lower it")
    losses = megapar.launch(train, args.tp * args.pp, args)
    if args.json and losses is not None:
        with open(args.json, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
