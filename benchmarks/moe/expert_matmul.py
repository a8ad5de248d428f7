"""The MoE layer's experts on the CPU: megapar's loop over sorted slices against
`torch._grouped_mm` and against transformers' per-expert loop with masks, forward + backward.

One Mixtral MoE layer (default: hidden 256, 8 experts of 512, top 2; fp32, one process) on T
tokens, at a few T. Five implementations run on the same weights, the same tokens and the same
output gradient, forward + backward each:

- megapar loop: `megapar.models.moe.MoE` as it runs on the CPU (router, a stable argsort of the
  T x k assignments, a gather of the sorted rows, `GroupedExperts`' loop over each expert's
  contiguous slice, the weighted un-sort with `index_copy`, the sum over k);
- megapar grouped_mm: the same layer with its experts run by `GroupedExperts._grouped` (one
  `torch._grouped_mm` per projection: megapar's CUDA bf16 path, which torch 2.13 also runs on
  the CPU in fp32);
- transformers eager: transformers' `MixtralSparseMoeBlock` with `experts_implementation
  "eager"`, the plain PyTorch MoE: a one-hot mask, then per expert hit a `torch.where` of its
  tokens (a host sync each), a gather, the SwiGLU, and an `index_add_` back;
- transformers grouped_mm: the same block with `"grouped_mm"` (transformers 5's default):
  sort, gather, `torch._grouped_mm`, un-sort;
- the experts alone, on rows already sorted: the slice loop (`GroupedExperts.forward`)
  against the grouped kernel (`GroupedExperts._grouped`);
- and, for scale, a dense SwiGLU of intermediate k x I on the same T tokens: the same MLP
  weights per token and the same FLOPs, with no routing (what the MoE layer costs beyond its
  matmuls).

The outputs, the input's gradient and every weight's gradient of all of them are checked equal
(fp32, 1e-5 relative) before any timing. Then the implementations run `--rounds` rounds in
turns (`common.interleave`, the order reversed every other round), `--steps` forward + backward
calls each, and the ratios of their times are taken round by round: median [min, max], of
the wall-clock time and of the CPU time the process got (`time.process_time`: with one
thread, where the machine is shared with other jobs, the time a call computed rather than the
time it waited for a core). torch runs `--threads` threads (default 1: the cores are shared).

    python benchmarks/moe/expert_matmul.py                     # about 2 minutes on 2 cores
    python benchmarks/moe/expert_matmul.py --tokens 64 --rounds 2 --steps 1   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from megapar.mesh import Layout, Mesh
from megapar.models import MixtralConfig
from megapar.models.moe import MoE, host_counts, route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (  # noqa: E402
    interleave, output_file, pair_ratios, positive, ratio_summary, write_json,
)

RATIOS = [  # (a, b): a's seconds over b's, round by round
    ("megapar loop", "transformers eager"),
    ("megapar grouped_mm", "megapar loop"),
    ("transformers grouped_mm", "transformers eager"),
    ("megapar loop", "transformers grouped_mm"),
    ("megapar grouped_mm", "transformers grouped_mm"),
    ("experts grouped_mm", "experts slice loop"),
    ("megapar loop", "dense MLP"),
    ("megapar grouped_mm", "dense MLP"),
    ("transformers eager", "dense MLP"),
]


CLOCKS = ("wall", "cpu")  # perf_counter, and process_time: the CPU time this process got


def megapar_layer(args, grouped: bool) -> MoE:
    """A megapar MoE layer (no balancing penalty: the block's output alone is compared), seeded;
    with `grouped` its experts run `torch._grouped_mm` whatever the device."""
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.expert_size,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                           num_attention_heads=4, vocab_size=64, router_aux_loss_coef=0.0)
    layer = MoE(config, Mesh(Layout(1, 1, 1), 0)).train()
    torch.manual_seed(0)
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.5)  # a spread routing, not all tokens on one expert
        layer.experts.gate_up.normal_(0, args.hidden ** -0.5)
        layer.experts.down.normal_(0, args.expert_size ** -0.5)
    if grouped:
        experts = layer.experts
        experts.forward = types.MethodType(
            lambda self, x, tokens_per_expert, counts=None: self._grouped(x, tokens_per_expert),
            experts)
    return layer


def hf_block(args, source: MoE, implementation: str) -> MixtralSparseMoeBlock:
    """transformers' Mixtral MoE block with `source`'s weights."""
    config = transformers.MixtralConfig(hidden_size=args.hidden,
                                        intermediate_size=args.expert_size,
                                        num_local_experts=args.experts,
                                        num_experts_per_tok=args.top_k, num_attention_heads=4)
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config).train()
    with torch.no_grad():
        block.gate.weight.copy_(source.router.weight)
        block.experts.gate_up_proj.copy_(source.experts.gate_up)
        block.experts.down_proj.copy_(source.experts.down)
    return block


def block_call(module, x, grad):
    """forward + backward of a whole block: (module, its input [1, T, H] needing grad, grad)."""
    def call():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(grad)
        return module
    return call


def experts_call(layer: MoE, x, grad, grouped: bool):
    """forward + backward of the experts alone on rows sorted by expert (the router's choice on
    x): the slice loop (`layer` must be unpatched) or the grouped kernel."""
    with torch.no_grad():
        experts = layer.router(x.reshape(-1, x.shape[-1]))[3]
        order, tokens_per_expert, _ = route(experts, layer.num_experts, None)
    rows = x.detach().reshape(-1, x.shape[-1])[order // layer.top_k].requires_grad_()
    sorted_grad = grad.reshape(-1, grad.shape[-1])[order // layer.top_k]
    experts = layer.experts

    def call():
        experts.gate_up.grad = experts.down.grad = rows.grad = None
        y = (experts._grouped if grouped else experts)(rows, tokens_per_expert)
        y.backward(sorted_grad)
        return y, rows.grad, experts.gate_up.grad, experts.down.grad
    return call, host_counts(tokens_per_expert, rows.shape[0])


def dense_call(args, x, grad):
    """forward + backward of a dense SwiGLU of intermediate top-k x I on the same tokens."""
    size, h = args.top_k * args.expert_size, args.hidden
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(2 * size, h, generator=gen) * h ** -0.5).requires_grad_()
    down = (torch.randn(h, size, generator=gen) * size ** -0.5).requires_grad_()
    rows = x.detach().reshape(-1, h).requires_grad_()
    flat_grad = grad.reshape(-1, h)

    def call():
        gate_up.grad = down.grad = rows.grad = None
        gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
        F.linear(F.silu(gate) * up, down).backward(flat_grad)
    return call


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    """max |a - b| / max |b|, raising when it is above 1e-5."""
    a, b = a.detach(), b.detach()
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    if not err <= 1e-5:
        raise AssertionError(f"{what}: relative error {err:.2e} > 1e-5")
    return err


def check_equal(calls, names, x) -> float:
    """Run each block once and compare its output, input gradient and weight gradients with
    the first's; the largest relative error."""
    worst = 0.0
    ref = None
    for name in names:
        out = calls[name]()
        got = (x.grad.clone(), *grads_of(out))
        with torch.no_grad():
            value = out(x)
        if ref is None:
            ref = (value, *got)
            continue
        worst = max(worst, close(value, ref[0], f"{name} output"))
        for g, r, what in zip(got, ref[1:], ("input grad", "router grad", "gate_up grad",
                                             "down grad")):
            worst = max(worst, close(g, r, f"{name} {what}"))
    return worst


def grads_of(module) -> tuple[torch.Tensor, ...]:
    """(router, gate_up, down) gradients of a megapar layer or a transformers block."""
    if isinstance(module, MoE):
        return module.router.weight.grad, module.experts.gate_up.grad, module.experts.down.grad
    return (module.gate.weight.grad, module.experts.gate_up_proj.grad,
            module.experts.down_proj.grad)


def timed(call, steps: int):
    """A run for `interleave`: `steps` calls; (wall seconds, CPU seconds of this process) of
    one, the mean."""
    def run() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            call()
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
    return run


def measure(args, tokens: int) -> dict:
    """Check the implementations equal at `tokens` tokens, then time them in turns."""
    loop, grouped = megapar_layer(args, False), megapar_layer(args, True)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, args.hidden, generator=gen).requires_grad_()
    grad = torch.randn(1, tokens, args.hidden, generator=gen)
    blocks = {"megapar loop": loop, "megapar grouped_mm": grouped,
              "transformers eager": hf_block(args, loop, "eager"),
              "transformers grouped_mm": hf_block(args, loop, "grouped_mm")}
    calls = {name: block_call(m, x, grad) for name, m in blocks.items()}
    worst = check_equal(calls, list(blocks), x)
    slices, counts = experts_call(loop, x, grad, grouped=False)
    kernel, _ = experts_call(loop, x, grad, grouped=True)
    for a, b, what in zip(slices(), kernel(), ("output", "input grad", "gate_up grad",
                                               "down grad")):
        worst = max(worst, close(b, a, f"experts grouped_mm {what}"))
    calls["experts slice loop"], calls["experts grouped_mm"] = slices, kernel
    calls["dense MLP"] = dense_call(args, x, grad)

    runs = interleave({n: timed(c, args.steps) for n, c in calls.items()}, args.rounds,
                      alternate=True)
    record = {"tokens": tokens, "tokens_per_expert": counts, "max_rel_err": worst}
    for i, clock in enumerate(CLOCKS):
        times = {n: [r[i] for r in rs] for n, rs in runs.items()}
        record[f"{clock}_seconds"] = times
        record[f"{clock}_ratios"] = {f"{a} / {b}": pair_ratios(times[a], times[b])
                                     for a, b in RATIOS}
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=positive, default=256)
    p.add_argument("--expert-size", type=positive, default=512, help="each expert's intermediate")
    p.add_argument("--experts", type=positive, default=8)
    p.add_argument("--top-k", type=positive, default=2)
    p.add_argument("--tokens", type=positive, nargs="+", default=[128, 512, 2048],
                   help="tokens per layer call (before top-k)")
    p.add_argument("--rounds", type=positive, default=8, help="rounds of all implementations")
    p.add_argument("--steps", type=positive, default=2, help="forward + backward calls per run")
    p.add_argument("--threads", type=positive, default=1, help="torch threads")
    p.add_argument("--json", type=output_file, help="write every figure to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"MoE layer: hidden {args.hidden}, {args.experts} experts of {args.expert_size}, "
          f"top {args.top_k}; fp32, {args.threads} thread(s), torch {torch.__version__}, "
          f"transformers {transformers.__version__}; {args.rounds} rounds x {args.steps} "
          f"forward + backward calls", flush=True)
    results = []
    for tokens in args.tokens:
        r = measure(args, tokens)
        results.append(r)
        print(f"\nT = {tokens} tokens (per expert: {r['tokens_per_expert']}); all equal to "
              f"{r['max_rel_err']:.1e} relative")
        print("  medians of rounds, ms: wall / CPU")
        for name, t in r["wall_seconds"].items():
            cpu = r["cpu_seconds"][name]
            print(f"    {name:24} {1e3 * statistics.median(t):9.2f} / "
                  f"{1e3 * statistics.median(cpu):9.2f}")
        print("  ratios of time, round by round, median [min, max] (< 1: the first is "
              "faster): CPU time | wall")
        for key, ratios in r["cpu_ratios"].items():
            print(f"    {key:45} {ratio_summary(ratios)} | "
                  f"{ratio_summary(r['wall_ratios'][key])}", flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results,
                               "torch": torch.__version__,
                               "transformers": transformers.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
