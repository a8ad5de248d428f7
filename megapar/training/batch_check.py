"""Checks of the global batch a user hands to `engine.train_step` / `eval_step`.

A vocab-parallel embedding cannot see an id outside every shard (it becomes a zero vector at
tp > 1, an IndexError at tp = 1), GPT-2 and Llama take right padding only, and a pipeline trains on
nonsense if stage 0's inputs and the last stage's labels come from different batches. So every
batch is checked in the user's process, with one clear error naming the fix:

- `check_batch`: tensors of integer ids of one [G, seq] shape, keys the model reads, ids and
  labels inside the vocabulary (labels may be -100), seq within the model's positions;
- `same_call_on_every_rank`: at every step, a fingerprint of the batch (its keys, shapes and
  values) all-reduced over the world with the call and the step (one collective of six int64s,
  read once: one host wait per step, none per micro-batch), since train_step takes the *same*
  global batch on every rank (draw it from a seeded `torch.Generator`: unseeded processes,
  torchrun's, draw different batches). Checked before the step runs, so a batch of another
  shape on one rank is refused instead of hanging the pipeline, and nothing of a refused batch
  is trained; the engine's other collective calls begin with it too (without a batch), so
  ranks that make different calls all stop with one line.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterable, Sequence

import torch
import torch.distributed as dist

from megapar.faults.status import set_action
from megapar.wording import first_few

BERT_KEYS = ("input_ids", "labels", "token_type_ids", "attention_mask")
DECODER_KEYS = ("input_ids", "labels")


def check_batch(
    batch, config, what: str = "train_step", extra: bool = False
) -> dict[str, torch.Tensor]:
    """The batch, checked (ValueError / TypeError naming the fix otherwise), its integer
    tensors as int64 (any integer width is accepted). A decoder's `attention_mask` must pad on
    the right (ones, then zeros); it is kept for a mixture of experts (which routes no padding)
    and dropped for a dense decoder (causal attention keeps right padding out already).
    `extra` (a `loss_fn` reads the batch): keys the model does not read are kept as they are,
    tensors of one row per sequence.
    Everything here is local: a bad batch fails on every rank that holds it before any
    communication."""
    if not isinstance(batch, dict):
        raise TypeError(
            f"{what} takes a dict of tensors with at least 'input_ids' (and 'labels' "
            f"to train), got {type(batch).__name__}"
        )
    if "input_ids" not in batch:
        keys = ", ".join(map(repr, batch)) or "none"
        raise TypeError(
            f"{what}: the batch has no 'input_ids' (its keys: {keys}); it takes a dict of "
            f"tensors with at least 'input_ids' (and 'labels' to train)"
        )
    if what in ("train_step", "eval_step") and "labels" not in batch:
        raise ValueError(  # eval_step's loss needs them too (else only the last stage fails)
            f"{what} needs 'labels' (the next-token ids aligned with input_ids, "
            f"-100 where there is none; BERT: the masked tokens' ids)"
        )
    bert = config.model_type == "bert"
    allowed = BERT_KEYS if bert else DECODER_KEYS
    out = {}
    shape: tuple[int, ...] | None = None
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{what}: batch[{key!r}] is a {type(value).__name__}; pass torch "
                f"tensors (torch.as_tensor(...))"
            )
        if key == "attention_mask" and value.shape != batch["input_ids"].shape:
            raise ValueError(
                f"{what}: attention_mask has shape {tuple(value.shape)}, input_ids "
                f"{tuple(batch['input_ids'].shape)}; they must match"
            )
        if key == "attention_mask" and not bert:
            ones = value == 1
            binary = bool((ones | (value == 0)).all())  # else refused below
            if binary and value.dim() == 2 and not bool((ones[:, 1:] <= ones[:, :-1]).all()):
                raise ValueError(
                    f"{what}: {config.model_type} in megapar takes right padding only; "
                    f"pack sequences without padding, or pad on the right (a tokenizer's "
                    f"padding_side='right': causal attention keeps the padding out of the "
                    f"tokens before it) and set the labels of padded positions to -100"
                )
            if binary and not getattr(config, "num_moe_layers", 0):
                continue  # a dense decoder: causal attention is the whole of its masking
            # a mixture of experts routes no padding (`megapar.models.moe`)
        if key not in allowed and key != "attention_mask" and extra:
            rows = batch["input_ids"].shape[0] if batch["input_ids"].dim() else None
            if value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(
                    f"{what}: batch[{key!r}] has shape {tuple(value.shape)}; an entry for "
                    f"loss_fn must have one row per sequence ([global batch, ...], {rows} rows)"
                )
            out[key] = value
            continue
        if key not in allowed and key != "attention_mask":
            raise ValueError(
                f"{what}: batch key {key!r} is not used by {config.model_type} "
                f"(it reads {', '.join(allowed)}); drop it"
            )
        if (
            value.is_floating_point()
            or value.is_complex()
            or (value.dtype == torch.bool and key != "attention_mask")
        ):
            raise TypeError(
                f"{what}: batch[{key!r}] holds {value.dtype}; token ids, labels and "
                f"masks must be integer tensors (e.g. .long())"
            )
        if key == "attention_mask" and not bool(((value == 0) | (value == 1)).all()):
            raise ValueError(f"{what}: attention_mask holds values other than 0 and 1")
        value = value.long()  # int32 / uint8 ids work at every layout, and compare correctly
        if value.dim() != 2 or (shape is not None and tuple(value.shape) != shape):
            raise ValueError(
                f"{what}: batch[{key!r}] has shape {tuple(value.shape)}; every "
                f"entry must be [global batch, seq]"
                + (f" like the others, {shape}" if shape else "")
            )
        shape = tuple(value.shape)
        out[key] = value
    if value_range := _out_of_range(out, config):
        raise ValueError(f"{what}: {value_range}")
    limit = config.max_positions
    assert shape is not None  # input_ids is in the batch (checked above)
    if shape[1] > limit:
        raise ValueError(
            f"{what}: sequences of {shape[1]} tokens are longer than the model's "
            f"{limit} positions; cut them to at most {limit}"
        )
    return out


UNSHIFTED_WARNING = (
    "{what}: the labels equal input_ids at every labelled position, as transformers' models "
    "take them (they shift the labels themselves); megapar does not shift them, so this "
    "trains each position to predict its own token: pass next-token labels, e.g. "
    "input_ids[:, :-1] with labels input_ids[:, 1:] (labels[:, t] is the token after "
    "input_ids[:, t])"
)


def unshifted_labels(batch: dict[str, torch.Tensor], config) -> bool:
    """Whether a checked decoder batch's labels are transformers' unshifted ones: equal to
    input_ids wherever they are not -100, with two neighbouring labelled positions whose ids
    differ somewhere (next-token labels there would be the second id, not the first: so no
    batch of next-token labels is taken for one). One host read."""
    labels = batch.get("labels")
    if config.model_type == "bert" or labels is None or labels.shape[1] < 2:
        return False
    ids, labelled = batch["input_ids"], labels != -100
    same = ((labels == ids) | ~labelled).all()
    pair = (labelled[:, :-1] & labelled[:, 1:] & (ids[:, :-1] != ids[:, 1:])).any()
    return bool(torch.stack([same, pair]).all())


def _min_max(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty tensor, read together (one host read, not two)."""
    low, high = torch.stack([t.min(), t.max()]).tolist()
    return low, high


def _out_of_range(batch: dict[str, torch.Tensor], config) -> str:
    vocab = config.vocab_size
    ids = batch["input_ids"]
    low, high = _min_max(ids) if ids.numel() else (0, 0)
    if low < 0 or high >= vocab:
        bad = high if high >= vocab else low
        return (
            f"input id {bad} is outside the model's vocabulary of {vocab} tokens (0 to "
            f"{vocab - 1}); is the data tokenized for another vocabulary?"
        )
    labels = batch.get("labels")
    if labels is not None and labels.numel():
        bad_labels = labels[(labels != -100) & ((labels < 0) | (labels >= vocab))]
        if bad_labels.numel():
            return (
                f"label {int(bad_labels[0])} is outside the vocabulary of {vocab} tokens (0 to "
                f"{vocab - 1}; -100 marks a position without a label)"
            )
    types = batch.get("token_type_ids")
    n_types = getattr(config, "type_vocab_size", None)
    low, high = _min_max(types) if types is not None and types.numel() else (0, 0)
    if n_types and (low < 0 or high >= n_types):
        return f"token_type_ids must be 0 to {n_types - 1}"
    return ""


_PRIME = 2**31 - 1
_weights: dict = {}  # the position weights of the last batch size and device (one entry)


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    """n pseudo-random int64 weights in [1, 1024], the same on every rank; kept for the next
    batch of the same size (a step's batches usually are)."""
    key = (n, str(device))
    if key not in _weights:
        pos = torch.arange(n, dtype=torch.int64, device=device)
        _weights.clear()
        _weights[key] = (pos * 2_654_435_761 % 2**32 >> 22) + 1  # Knuth's multiplicative hash
    return _weights[key]


def fingerprint(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """An int64 hash (a 0-dim tensor on the batch's device) of a checked batch's keys, shapes
    and values: per key, the dot product of the values with pseudo-random position weights,
    folded modulo a prime with the key's name and shape. Computed where the batch is, without
    reading anything back to the host (its cost: docs/guides/python-api.md). Exact (no int64
    overflow) for values of magnitude below 2**21 (checked ids, labels, masks) and batches
    below 2**32 tokens; a float entry (for a `loss_fn`) counts by its bits."""
    total = None
    for key in sorted(batch):
        value = batch[key]
        if value.is_floating_point():  # a loss_fn's entry: its float64 bits folded to 21
            bits = value.detach().reshape(-1).to(torch.float64).view(torch.int64)
            flat = (bits ^ (bits >> 21) ^ (bits >> 42)) & ((1 << 21) - 1)
        else:
            flat = value.reshape(-1).to(torch.int64)
        weights = _position_weights(flat.numel(), flat.device)
        dot = torch.dot(flat, weights) if flat.device.type == "cpu" else (flat * weights).sum()
        part = dot % _PRIME  # (torch.dot has no integer kernel on CUDA)
        salt = (
            zlib.crc32(key.encode()) * 1_000_003 + value.shape[0] * 7919 + value.shape[-1]
        ) % _PRIME
        part = (part * 65_599 + salt) % _PRIME
        total = part if total is None else (total * 1_000_003 + part) % _PRIME
    assert total is not None  # a checked batch holds input_ids
    return total


API_CALLS = (
    "train_step",
    "eval_step",
    "engine.save",
    "engine.load",
    "engine.export_hf",
    "engine.params_whole",
    "engine.poll_save",
    "engine.wait_save",
)
"""The engine's calls that communicate: each begins with `same_call_on_every_rank`, so ranks
that make different ones meet in that one collective and all raise, instead of pairing one
call's collectives with another's and waiting out the timeout."""


def same_call_on_every_rank(
    what: str,
    step: int,
    device: torch.device,
    batch: dict[str, torch.Tensor] | None = None,
    read: int | None = None,
) -> None:
    """Raise on every rank (no hang) unless all ranks make the same call (`what`, one of
    `API_CALLS`) at the same step, with the same batch where it takes one: one all-reduce
    (MAX) of [c, -c, s, -s, h, -h] over the world (call, step, the batch's `fingerprint`), read
    once (each max == -its min). Where calls or steps differ, every rank sees it and gathers
    each rank's (`_calls_of_ranks`), so that the line names them all. `read`: in place of a
    batch, a fingerprint of the checkpoint a load read (its manifest's files), the same on
    every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if batch is None:  # a batch's call said "checking the batch", which this is part of
        set_action(f"{what}: agreeing on the call with the other ranks")
    h = (
        fingerprint(batch).to(device)
        if batch is not None
        else torch.tensor(read or 0, dtype=torch.int64)
    )
    c = API_CALLS.index(what)
    signs = torch.tensor([c, -c, step, -step], dtype=torch.int64)
    both = torch.cat([signs.to(device), torch.stack([h, -h]).to(device)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    c_high, c_low, s_high, s_low, high, neg_low = (int(x) for x in both.tolist())
    rank = dist.get_rank()
    if c_high != -c_low:
        others = ranks_doing_otherwise(
            _calls_of_ranks(c, step, 0, device), lambda call, _: f"in {API_CALLS[call]}", rank
        )
        taken = step - 1 if what == "train_step" else step  # engine.step: the steps taken
        raise RuntimeError(
            f"{what}: rank {rank} is in {what} at engine.step {taken} while {others}; every "
            f"rank must make the same megapar calls in the same order (train_step, eval_step, "
            f"save, load, export_hf, params_whole, poll_save, wait_save: each is collective)"
        )
    if s_high != -s_low:
        others = ranks_doing_otherwise(
            _calls_of_ranks(c, step, 0, device), lambda _, at: f"at step {at}", rank
        )
        raise RuntimeError(
            f"{what}: rank {rank} is at step {step} while {others}; every rank must make the "
            f"same megapar calls in the same order (one skipped a train_step, or loaded another "
            f"checkpoint)"
        )
    if high != -neg_low and batch is None:
        groups = _ranks_by(t[2] for t in _calls_of_ranks(c, step, read or 0, device))
        who = [_ranks_named(ranks) for ranks in groups.values()]
        raise RuntimeError(
            f"{what}: the ranks read {len(groups)} different checkpoints of step {step} (their "
            f"manifests list other files): {who[0]} read one, "
            f"{first_few([f'{w} another' for w in who[1:]], 4)}; every rank must load the same "
            f"checkpoint"
        )
    if high != -neg_low:
        raise ValueError(
            f"{what}: rank {rank} got another global batch than other ranks; every "
            f"rank must pass the same global batch (each takes its own share). Draw it from a "
            f"torch.Generator with a fixed seed (or seed torch's global RNG the same on every "
            f"rank: unseeded processes, torchrun's, differ)"
        )


def _calls_of_ranks(c: int, step: int, read: int, device: torch.device) -> list[tuple[int, ...]]:
    """Every rank's (call index, step, `read`), gathered: on the path where they differ, which
    every rank takes (they all read the same reduced values)."""
    mine = torch.tensor([c, step, read], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [tuple(int(v) for v in x.tolist()) for x in every]


def ranks_doing_otherwise(calls: Sequence[tuple[int, ...]], said, rank: int) -> str:
    """The ranks whose (call, step) in `calls` (each rank's) `said` ("in eval_step", "at step
    3") otherwise than `rank`'s, grouped: "rank 1 is in eval_step and ranks 2 and 3 are in
    engine.export_hf" (the first four groups, and how many more)."""
    said_of = [said(call, at) for call, at, *_ in calls]
    return first_few(
        [
            f"{_ranks_named(ranks)} {'is' if len(ranks) == 1 else 'are'} {text}"
            for text, ranks in _ranks_by(said_of).items()
            if text != said_of[rank]
        ],
        4,
    )


def _ranks_by(values: Iterable[Hashable]) -> dict[Hashable, list[int]]:
    """Each distinct value of `values` (one per rank, in rank order) with its ranks."""
    groups: dict[Hashable, list[int]] = {}
    for r, value in enumerate(values):
        groups.setdefault(value, []).append(r)
    return groups


def _ranks_named(ranks: list[int]) -> str:
    """ "rank 1", or "ranks 1, 2, 3" (the first eight, and how many more)."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {first_few(list(map(str, ranks)), 8)}"
