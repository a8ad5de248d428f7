"""How much activation memory a pipeline stage keeps for backward under each recompute mode.

Runs the forward of a few micro-batches (what a stage holds at the peak of a GPipe step, or of
1F1B's warmup) on a small GPT-2 and counts the bytes of every distinct tensor storage kept for
backward:

- tensors autograd saves, seen through `torch.autograd.graph.saved_tensors_hooks`;
- the inputs of checkpointed regions. Non-reentrant `torch.utils.checkpoint` replaces the saved
  tensors *inside* a region by placeholders (its own, innermost hooks) and keeps the region's
  inputs alive in a closure instead, which the outer hook never sees, so they are counted by
  wrapping `torch.utils.checkpoint.checkpoint`.

Parameters are excluded (they are not activations). Also reports the forward+backward time, the
price of recomputation.

    python benchmarks/memory/recompute_memory.py [--layers 4 --hidden 256 --seq 256 --mb 4 --m 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint

from megapar.mesh import Layout, Mesh
from megapar.models import GPT2Config, build_model, set_recompute
from megapar.tensor_parallel import RNGTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

MODES = ("none", "selective", "full")


class SavedBytes:
    """Distinct storages kept for backward (by autograd or by checkpoint), minus parameters."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def add(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def pack(self, tensor):
        self.add(tensor)
        return tensor


def build(config: GPT2Config, whole: bool, mode: str, seed: int = 0):
    """The whole model (first = last stage), or a middle stage that holds only blocks."""
    mesh = Mesh(Layout())
    model = build_model(config, mesh, range(config.n_layer), pre_process=whole,
                        post_process=whole, tracker=RNGTracker(seed, mesh))
    model.init_weights(seed)
    set_recompute(model, mode)
    return model


def micro_batches(config: GPT2Config, args, whole: bool):
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.m):
        ids = torch.randint(0, config.vocab_size, (args.mb, args.seq + 1), generator=gen)
        hidden = None if whole else torch.randn(args.mb, args.seq, config.n_embd, generator=gen,
                                                requires_grad=True)
        batches.append((hidden, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}))
    return batches


def measure(config: GPT2Config, args, whole: bool, mode: str) -> tuple[int, float]:
    """(bytes kept for backward after m forwards, best seconds for the m forwards + backwards),
    after one untimed run (the mode's first run pays one-off costs: with --repeats 1 selective
    timed 229 x none)."""
    measure_once(config, args, whole, mode)
    runs = [measure_once(config, args, whole, mode) for _ in range(args.repeats)]
    return runs[0][0], min(t for _, t in runs)


def measure_once(config: GPT2Config, args, whole: bool, mode: str) -> tuple[int, float]:
    model = build(config, whole, mode)
    batches = micro_batches(config, args, whole)
    counter = SavedBytes(model)
    original = torch_checkpoint.checkpoint

    def counting_checkpoint(fn, *inputs, **kwargs):
        for x in inputs:
            counter.add(x)
        return original(fn, *inputs, **kwargs)

    torch_checkpoint.checkpoint = counting_checkpoint
    try:
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            outputs = [model(hidden, batch) for hidden, batch in batches]
        for hidden in (h for h, _ in batches if h is not None):
            counter.add(hidden)  # the received activation the stage keeps in every mode
        saved = counter.total
        for out in outputs:
            (out.sum() if out.dim() else out).backward()
        elapsed = time.perf_counter() - start
    finally:
        torch_checkpoint.checkpoint = original
    return saved, elapsed


def add_stage_arguments(parser: argparse.ArgumentParser, m: int) -> None:
    """The flags of the GPT-2 stage whose saved activations these scripts count (also
    sequence_parallel_memory.py's): its size, the micro-batches in flight (`m` by default) and
    the dropout."""
    parser.add_argument("--layers", type=positive, default=4, help="blocks (default %(default)s)")
    parser.add_argument("--hidden", type=positive, default=256,
        help="hidden size (default %(default)s)")
    parser.add_argument("--heads", type=positive, default=8,
        help="attention heads (default %(default)s)")
    parser.add_argument("--seq", type=positive, default=256,
        help="sequence length (default %(default)s)")
    parser.add_argument("--mb", type=positive, default=4, help="micro-batch size")
    parser.add_argument("--m", type=positive, default=m, help="micro-batches in flight")
    parser.add_argument("--vocab", type=positive, default=1000,
        help="vocabulary size (default %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.1,
        help="dropout probability (default %(default)s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stage_arguments(parser, m=4)
    parser.add_argument("--repeats", type=positive, default=3,
                        help="timing: best of this many runs, after an untimed one")
    args = parser.parse_args()
    torch.set_num_threads(1)
    p = args.dropout
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=p, embd_pdrop=p,
                        attn_pdrop=p)
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"vocab {args.vocab}, dropout {p}; {args.m} micro-batches of {args.mb} in flight, fp32")
    for whole, title in ((False, "middle stage (blocks only)"),
                         (True, "whole model (embedding + blocks + LM head)")):
        print(f"\n{title}")
        print(f"{'recompute':>10} {'saved MiB':>10} {'vs none':>8} {'fwd+bwd ms':>11} {'vs none':>8}")
        base = None
        for mode in MODES:
            saved, elapsed = measure(config, args, whole, mode)
            base = base or (saved, elapsed)
            print(f"{mode:>10} {saved / 2**20:>10.2f} {saved / base[0]:>8.3f} "
                  f"{1e3 * elapsed:>11.1f} {elapsed / base[1]:>8.2f}")


if __name__ == "__main__":
    main()
