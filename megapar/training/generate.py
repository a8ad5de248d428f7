"""Text generation from a stage model at any tp x pp: a batch of prompts grown one token at a
time, with a KV cache.

The prompts are left-padded to the longest and their forward (the prefill) fills each attention
layer's cache of keys and values (`megapar.models.kv_cache`: this tp rank's heads, this
pipeline stage's layers, a sliding window's layer only the window's last positions; the pad
slots attended by no other slot, each row's positions counted from its first real token, as
transformers' generate with an attention_mask). Each step then
runs a forward of one position per row, which appends to the cache and reads it (as
transformers' and torchtitan's generate with a cache); under pp only those positions' hidden
states cross the stages, the whole batch as one micro-batch. A row that stops (its
end-of-sequence token, max_new_tokens, the model's positions) leaves the batch and every cache,
and the loop ends when no row is left. A model or layout the cache does not serve (context or
sequence parallelism, an MoE with a capacity factor, a stand-in without a config) grows each
prompt alone with the model's forward over the whole sequence so far for each token instead.
Either way the logits are the last position's, in the model's dtype
(`megapar.training.inference.forward_logits`), and the chosen tokens are broadcast from the last
stage's tp rank 0 to every rank, so all ranks grow the same sequences and stop together.

The choice is made on the host, row by row: `next_token` takes a row's logits as float32 on
the CPU, greedy (temperature 0: the argmax, as transformers' greedy search) or sampled with
`torch.multinomial` from softmax(top-p(top-k(logits / temperature))) with that row's own CPU
generator, so a seed gives the same draws on any device, at any layout and batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapar.mesh import Mesh
from megapar.models.kv_cache import kv_cache, takes_kv_cache
from megapar.training.inference import forward_logits


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: `temperature` 0 is greedy; otherwise the logits are divided
    by it, cut to the `top_k` largest (0: all) and to the smallest set whose probability reaches
    `top_p` (1.0: all), and one token is drawn."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """`logits` ([vocab], float32) / temperature with the tokens top-k and top-p leave out set
    to -inf (transformers' TopKLogitsWarper and TopPLogitsWarper, at least one token kept). A
    temperature so small that the division overflows (1e-45) divides the logits less their
    largest instead: the same softmax, the largest 0 where it was inf (it drew from NaNs)."""
    out = logits / sampling.temperature
    if torch.isinf(out).any() and torch.isfinite(logits).any():
        out = (logits - logits[torch.isfinite(logits)].max()) / sampling.temperature
    if 0 < sampling.top_k < out.numel():
        kth = torch.topk(out, sampling.top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(out, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[-1] = False  # the most likely token always stays
        out = out.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return out


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the last position's logits ([vocab] float32 on the CPU)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = filtered_logits(logits, sampling).softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def last_logits(model, mesh: Mesh, ids, hidden_size: int, vocab_size: int):
    """The float32 logits ([rows, vocab], on the CPU) of the last position of each row of `ids`
    ([rows, seq] on the mesh's device, or a batch dict of them) on the last stage's ranks; None
    on the others (`forward_logits`)."""
    logits = forward_logits(model, mesh, ids, hidden_size, vocab_size, last_only=True)
    return None if logits is None else logits[:, -1].float().cpu()


@dataclass
class Generated:
    """One sample: the prompt's ids, the new ids (the end-of-sequence token included where it
    stopped there) and why it stopped: "eos", "max_new_tokens" or "positions"."""

    prompt_ids: list[int]
    new_ids: list[int]
    stop: str


def _stop(generated: Generated, max_new_tokens: int, max_length: int, eos_id: int | None):
    """Why `generated` stops after its last new token, or None where it goes on."""
    if eos_id is not None and generated.new_ids and generated.new_ids[-1] == eos_id:
        return "eos"
    if len(generated.new_ids) >= max_new_tokens:
        return "max_new_tokens"
    if len(generated.prompt_ids) + len(generated.new_ids) >= max_length:
        return "positions"
    return None


def _chosen(logits, mesh: Mesh, rows: list[int], sampling: Sampling, generators) -> list[int]:
    """The next token of each of `rows` (indices into `generators`), chosen on the last stage's
    tp rank 0 from `logits` ([len(rows), vocab]) and broadcast to every rank."""
    source = mesh.layout.rank(0, mesh.pp - 1, mesh.dp_rank, mesh.cp_rank)  # it chooses
    tokens = torch.zeros(len(rows), dtype=torch.long, device=mesh.device)
    if logits is not None and mesh.rank == source:
        chosen = [next_token(logits[i], sampling, generators[r]) for i, r in enumerate(rows)]
        tokens.copy_(torch.tensor(chosen, dtype=torch.long))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tokens, src=source)
    return tokens.tolist()


@torch.no_grad()
def generate_batch(
    model,
    mesh: Mesh,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling,
    generators: list[torch.Generator],
    hidden_size: int,
    vocab_size: int,
    max_length: int,
    eos_id: int | None,
    cache: bool = True,
    pad_id: int = 0,
) -> list[Generated]:
    """Grow each of `prompts` by up to `max_new_tokens` tokens, each row stopping after
    `eos_id` or once it holds `max_length` tokens (the model's positions), together in one
    batch left-padded with `pad_id` (never attended). Every rank of the mesh calls it with the
    same arguments and returns the same result; row i draws from `generators[i]` (CPU), on the
    last stage's tp rank 0 only. `cache`: use the KV cache where the model takes it
    (`takes_kv_cache`); False, or a model it does not serve: each prompt alone, the whole
    sequence's forward per token. The mesh is tp x pp alone: each token is broadcast over
    the world from its one chooser, which dp or cp replicas would each name as their own."""
    if mesh.dp > 1 or mesh.cp > 1:
        raise ValueError(
            f"generate_batch runs on a mesh of tp x pp alone, and this one has dp={mesh.dp} "
            f"cp={mesh.cp}; build the mesh with dp = cp = 1, as megapar-generate does"
        )
    out = [Generated(list(p), [], "max_new_tokens") for p in prompts]
    if not (cache and takes_kv_cache(model)):
        for row, generated in enumerate(out):
            _grow_alone(
                model,
                mesh,
                generated,
                max_new_tokens,
                sampling,
                generators[row],
                hidden_size,
                vocab_size,
                max_length,
                eos_id,
            )
        return out
    rows = [r for r, g in enumerate(out) if _starts(g, max_length)]
    if not rows:
        return out
    width = max(len(prompts[r]) for r in rows)
    pads = torch.tensor([width - len(prompts[r]) for r in rows], dtype=torch.long)
    padded = [[pad_id] * (width - len(prompts[r])) + prompts[r] for r in rows]
    ids = torch.tensor(padded, dtype=torch.long, device=mesh.device)
    room = max_length - min(len(prompts[r]) for r in rows)  # the most tokens a row can add
    capacity = width + min(max_new_tokens, room)
    padding = pads.to(mesh.device) if bool(pads.any()) else None
    inputs: torch.Tensor | dict = ids
    if padding is not None:  # each row's positions from its first real token
        inputs = {"input_ids": ids, "positions_from": -padding[:, None]}
    slot = width  # the cache slot of the tokens chosen next
    with kv_cache(model, capacity, padding) as caches:
        while True:
            logits = last_logits(model, mesh, inputs, hidden_size, vocab_size)
            tokens = _chosen(logits, mesh, rows, sampling, generators)
            going = []  # positions in `rows` of the rows that go on
            for i, (r, token) in enumerate(zip(rows, tokens, strict=True)):
                out[r].new_ids.append(token)
                stop = _stop(out[r], max_new_tokens, max_length, eos_id)
                if stop is None:
                    going.append(i)
                else:
                    out[r].stop = stop
            if not going:
                return out
            if len(going) < len(rows):  # the finished rows leave the batch and the caches
                keep = torch.tensor(going, dtype=torch.long, device=mesh.device)
                for c in caches:
                    c.keep_rows(keep)
                rows = [rows[i] for i in going]
                if padding is not None:
                    padding = padding.index_select(0, keep)
            new = torch.tensor([[out[r].new_ids[-1]] for r in rows], device=mesh.device)
            positions: int | torch.Tensor = slot if padding is None else slot - padding[:, None]
            inputs = {"input_ids": new, "positions_from": positions}
            slot += 1


def _starts(generated: Generated, max_length: int) -> bool:
    """Whether a prompt leaves room for a token; where not, its stop is set to "positions"."""
    if len(generated.prompt_ids) < max_length:
        return True
    generated.stop = "positions"
    return False


def _grow_alone(
    model,
    mesh: Mesh,
    generated: Generated,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    hidden_size: int,
    vocab_size: int,
    max_length: int,
    eos_id: int | None,
) -> None:
    """Grow one sample in place without a cache: the whole sequence's forward per token."""
    if not _starts(generated, max_length):
        return
    ids = generated.prompt_ids
    while True:
        inputs = torch.tensor([ids + generated.new_ids], dtype=torch.long, device=mesh.device)
        logits = last_logits(model, mesh, inputs, hidden_size, vocab_size)
        generated.new_ids += _chosen(logits, mesh, [0], sampling, [generator])
        stop = _stop(generated, max_new_tokens, max_length, eos_id)
        if stop is not None:
            generated.stop = stop
            return


def generate(
    model,
    mesh: Mesh,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    hidden_size: int,
    vocab_size: int,
    max_length: int,
    eos_id: int | None,
    cache: bool = True,
) -> Generated:
    """`generate_batch` of the one prompt `prompt_ids`, drawing from `generator`."""
    return generate_batch(
        model,
        mesh,
        [prompt_ids],
        max_new_tokens,
        sampling,
        [generator],
        hidden_size,
        vocab_size,
        max_length,
        eos_id,
        cache,
    )[0]
