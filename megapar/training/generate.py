"""Text generation from a stage model at any tp x pp: one token at a time, with a KV cache.

The prompt's forward (the prefill) fills each attention layer's cache of keys and values
(`megapar.models.kv_cache`: this tp rank's heads, this pipeline stage's layers), and each new
token then runs a forward of its one position, which appends to the cache and reads it (as
transformers' and torchtitan's generate with a cache); under pp only that position's hidden
state crosses the stages. A model or layout the cache does not serve (context or sequence
parallelism, an MoE with a capacity factor, a stand-in without a config) runs the model's
forward over the whole sequence so far for each token instead. Either way the logits are the
last position's, in the model's dtype (float32 as megapar-eval loads it;
`megapar.training.inference.forward_logits`), and the chosen token is broadcast from the last
stage's tp rank 0 to every rank, so all ranks grow the same sequence and stop together.

The choice is made on the host: `next_token` takes the logits row as float32 on the CPU,
greedy (temperature 0: the argmax, as transformers' greedy search) or sampled with
`torch.multinomial` from softmax(top-p(top-k(logits / temperature))) with a CPU generator, so
a seed gives the same tokens on any device and at any layout.
"""

from __future__ import annotations

import contextlib
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
    to -inf (transformers' TopKLogitsWarper and TopPLogitsWarper, at least one token kept)."""
    out = logits / sampling.temperature
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
    """The float32 logits ([vocab], on the CPU) of the last position of `ids` ([1, seq] on the
    mesh's device, or a batch dict of them) on the last stage's ranks; None on the others
    (`forward_logits`)."""
    logits = forward_logits(model, mesh, ids, hidden_size, vocab_size, last_only=True)
    return None if logits is None else logits[0, -1].float().cpu()


@dataclass
class Generated:
    """One sample: the prompt's ids, the new ids (the end-of-sequence token included where it
    stopped there) and why it stopped: "eos", "max_new_tokens" or "positions"."""

    prompt_ids: list[int]
    new_ids: list[int]
    stop: str


@torch.no_grad()
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
    """Grow `prompt_ids` by up to `max_new_tokens` tokens, stopping after `eos_id` or once the
    sequence holds `max_length` tokens (the model's positions). Every rank of the mesh calls it
    with the same arguments and returns the same result; `generator` (CPU) is drawn from on the
    last stage's tp rank 0 only. `cache`: use the KV cache where the model takes it
    (`takes_kv_cache`); False: the whole sequence's forward per token."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=mesh.device)
    source = mesh.layout.rank(0, mesh.pp - 1, mesh.dp_rank, mesh.cp_rank)  # it chooses
    many = dist.is_initialized() and dist.get_world_size() > 1
    cached = cache and takes_kv_cache(model)
    new: list[int] = []
    stop = "max_new_tokens"
    with kv_cache(model, max_length) if cached else contextlib.nullcontext():
        while len(new) < max_new_tokens:
            if ids.shape[1] >= max_length:
                stop = "positions"
                break
            inputs: torch.Tensor | dict = ids  # the prefill, or every token without the cache
            if cached and new:  # the cache holds all but the last token's keys and values
                inputs = {"input_ids": ids[:, -1:], "positions_from": ids.shape[1] - 1}
            logits = last_logits(model, mesh, inputs, hidden_size, vocab_size)
            token = torch.zeros(1, dtype=torch.long, device=mesh.device)
            if logits is not None and mesh.rank == source:
                token.fill_(next_token(logits, sampling, generator))
            if many:
                dist.broadcast(token, src=source)
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
            new.append(int(token))
            if eos_id is not None and new[-1] == eos_id:
                stop = "eos"
                break
    return Generated(list(prompt_ids), new, stop)
