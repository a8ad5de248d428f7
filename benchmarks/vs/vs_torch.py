"""megapar vs torch's own parallelism on the same work: s/step, ratio, speedup, losses.

The same GPT-2 (default: 8 layers, hidden 256, 4 heads, vocab 1024, seq 128, global batch 16,
fp32, AdamW lr 1e-3, no clipping, no dropout, the same initial weights: one transformers
GPT2LMHeadModel built from a seed) is trained by megapar (`megapar.prepare`) and by a plain
PyTorch GPT-2 parallelised with torch's own tools:

- pipeline: `torch.distributed.pipelining` (`PipelineStage`, `Schedule1F1B` / `ScheduleGPipe`),
  the model cut in two halves by hand, the tied embedding's gradient summed over the first and
  last stage after the step (what Megatron and megapar do); for ZB-V (`pp2-zbv`) in four
  quarters, two `PipelineStage`s per rank in the V (rank r: stages r and 2 pp - 1 - r) under
  `ScheduleZBVZeroBubble`, the tied embedding's two copies both on rank 0, summed there;
- tensor parallel: DTensor (`parallelize_module` with `ColwiseParallel` on q / k / v / MLP-up,
  `RowwiseParallel` on the output projections, as torchtitan does); embeddings and LM head
  replicated (megapar splits them over the vocabulary);
- data parallel: one flat all-reduce of the gradients per step over the dp dimension of the
  DeviceMesh (DDP's bucketing without overlap).

Every configuration runs both systems in alternation (megapar, torch, torch, megapar, ...,
`--repeats` times each: neither always first) so that machine noise hits both; each run forks its gloo ranks, takes
one warm-up step and times `--steps` steps (barrier-synchronised). Printed per configuration:
median s/step of each, megapar / torch, speedup over the serial run of the same system, and the
losses of both (they must agree to 1e-5 relative: the same model and the same steps). Every
rank of both systems uses one torch thread: a rank stands for one device, so "speedup over
serial" is what a second core (GPU) buys, the measure the issue and Megatron's scaling tables use.
On 2 cores, configs with more than 2 ranks oversubscribe the machine.

    python benchmarks/vs/vs_torch.py                       # all configs, ~10 minutes on 2 cores
    python benchmarks/vs/vs_torch.py --configs serial pp2-1f1b --repeats 3 --steps 3
    python benchmarks/vs/vs_torch.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megapar.launcher import run_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_ab_arguments, interleave, pair_ratios, ratio_summary  # noqa: E402

CONFIGS = {  # name: (tp, pp, dp, schedule, micro-batches, model size)
    "serial": (1, 1, 1, "1f1b", 1, "small"),
    "pp2-1f1b": (1, 2, 1, "1f1b", 8, "small"),
    "pp2-gpipe": (1, 2, 1, "gpipe", 8, "small"),
    "pp2-zbv": (1, 2, 1, "zb-v", 8, "small"),
    "tp2": (2, 1, 1, "1f1b", 1, "small"),
    "tp2-pp2": (2, 2, 1, "1f1b", 4, "small"),
    "dp2-tp2": (2, 1, 2, "1f1b", 1, "small"),
    "large-serial": (1, 1, 1, "1f1b", 1, "large"),
    "large-pp2-1f1b": (1, 2, 1, "1f1b", 8, "large"),
}
SIZES = {"small": dict(n_layer=8, n_embd=256, n_head=4, seq=128),
         "large": dict(n_layer=8, n_embd=512, n_head=8, seq=256)}
VOCAB, BATCH, LR = 1024, 16, 1e-3


def hf_model(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    s = SIZES[size]
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=s["seq"], n_embd=s["n_embd"], n_layer=s["n_layer"],
        n_head=s["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None))


def batches(size: str, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        seq = torch.randint(0, VOCAB, (BATCH, SIZES[size]["seq"] + 1), generator=gen)
        out.append({"input_ids": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()})
    return out


# the torch reference model ------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.fc, self.fc_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.ln_1(x)
        q, k, v = (f(y).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))  # -1: the heads of this tp rank
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class Part(nn.Module):
    """Blocks [lo, hi) of the GPT-2, with the embedding if first and the head if last."""

    def __init__(self, hf, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        cfg, sd = hf.config, hf.state_dict()
        h = cfg.n_embd
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = nn.Embedding(VOCAB, h), nn.Embedding(cfg.n_positions, h)
        self.blocks = nn.ModuleList(Block(h, cfg.n_head) for _ in range(lo, hi))
        if last:
            self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, VOCAB, bias=False)
        with torch.no_grad():
            if first:
                self.wte.weight.copy_(sd["transformer.wte.weight"])
                self.wpe.weight.copy_(sd["transformer.wpe.weight"])
            for block, i in zip(self.blocks, range(lo, hi)):
                p = f"transformer.h.{i}."
                w, bias = sd[p + "attn.c_attn.weight"].t(), sd[p + "attn.c_attn.bias"]
                for j, lin in enumerate((block.q, block.k, block.v)):  # HF Conv1D: [in, out]
                    lin.weight.copy_(w[j * h:(j + 1) * h]), lin.bias.copy_(bias[j * h:(j + 1) * h])
                for lin, name in ((block.proj, "attn.c_proj"), (block.fc, "mlp.c_fc"),
                                  (block.fc_proj, "mlp.c_proj")):
                    lin.weight.copy_(sd[p + name + ".weight"].t()), lin.bias.copy_(sd[p + name + ".bias"])
                for ln, name in ((block.ln_1, "ln_1"), (block.ln_2, "ln_2")):
                    ln.weight.copy_(sd[p + name + ".weight"]), ln.bias.copy_(sd[p + name + ".bias"])
            if last:
                self.ln_f.weight.copy_(sd["transformer.ln_f.weight"])
                self.ln_f.bias.copy_(sd["transformer.ln_f.bias"])
                self.head.weight.copy_(sd["transformer.wte.weight"])  # tied (summed in step)
        if first and last:
            self.head.weight = self.wte.weight  # one stage: really tied

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def parallelize_tp(model: nn.Module, tp_mesh) -> None:
    """DTensor tensor parallelism over `tp_mesh` as torchtitan applies it to a `Part`'s blocks:
    the Q, K, V and MLP-up linears split by columns, the two output projections by rows."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    plan = {f"blocks.{i}.{k}": ColwiseParallel() for i in range(len(model.blocks))
            for k in ("q", "k", "v", "fc")}
    plan.update({f"blocks.{i}.{k}": RowwiseParallel() for i in range(len(model.blocks))
                 for k in ("proj", "fc_proj")})
    parallelize_module(model, tp_mesh, plan)


def torch_run(name: str, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleZBVZeroBubble,
    )

    tp, pp, dp, schedule, m, size = CONFIGS[name]
    hf = hf_model(size)
    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    stage, n = mesh["pp"].get_local_rank(), hf.config.n_layer
    if schedule == "zb-v":  # two quarters per rank, in a V: stages r and 2 pp - 1 - r
        v = 2 * pp
        parts = [Part(hf, s * n // v, (s + 1) * n // v, s == 0, s == v - 1)
                 for s in (stage, v - 1 - stage)]
        return _timed(_zbv_step(parts, stage, pp, m, mesh, ScheduleZBVZeroBubble, PipelineStage),
                      size, steps)
    model = Part(hf, stage * n // pp, (stage + 1) * n // pp, stage == 0, stage == pp - 1)
    if tp > 1:
        parallelize_tp(model, mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0,
                                  eps=1e-8)  # megapar's (and Megatron's) betas
    if pp > 1:
        pstage = PipelineStage(model, stage, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        runner = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](pstage, m, loss_fn)
    dp_rank = mesh["dp"].get_local_rank()
    local_batch = BATCH // dp

    def step(batch) -> float:
        ids = batch["input_ids"][dp_rank * local_batch:(dp_rank + 1) * local_batch]
        labels = batch["labels"][dp_rank * local_batch:(dp_rank + 1) * local_batch]
        optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros(())
        if pp > 1:
            losses = []
            if stage == 0:
                runner.step(ids)
            else:
                runner.step(target=labels, losses=losses)
                loss = torch.stack(losses).mean().detach()
            tied = model.wte.weight if model.first else model.head.weight
            dist.all_reduce(tied.grad, group=mesh["pp"].get_group())  # first + last (pp = 2)
        else:
            loss = loss_fn(model(ids), labels)
            loss.backward()
            loss = loss.detach()
        if dp > 1:
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                     for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(dp)
            dist.all_reduce(flat, group=mesh["dp"].get_group())
            for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(new)
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= dp
        optimizer.step()
        if pp > 1:
            dist.broadcast(loss, src=dist.get_global_rank(mesh["pp"].get_group(), pp - 1),
                           group=mesh["pp"].get_group())
        return float(loss)

    return _timed(step, size, steps)


def _zbv_step(parts, stage, pp, m, mesh, schedule_cls, stage_cls):
    """torch's ZB-V step on this rank's two parts (`parts[0]` virtual stage `stage`, `parts[1]`
    2 pp - 1 - stage); rank 0 holds the input, the loss and both tied copies."""
    group = mesh["pp"].get_group()
    stages = [stage_cls(part, index, 2 * pp, torch.device("cpu"), group=group)
              for part, index in zip(parts, (stage, 2 * pp - 1 - stage))]
    runner = schedule_cls(stages, m, loss_fn)
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)

    def step(batch) -> float:
        optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros(())
        if stage == 0:
            losses = []
            runner.step(batch["input_ids"], target=batch["labels"], losses=losses)
            loss = torch.stack(losses).mean().detach()
            embedding, head = parts[0].wte.weight, parts[1].head.weight
            total = embedding.grad + head.grad  # the tied copies, both here: summed in place
            embedding.grad.copy_(total), head.grad.copy_(total)
        else:
            runner.step()
        optimizer.step()
        dist.broadcast(loss, src=dist.get_global_rank(group, 0), group=group)
        return float(loss)

    return step


def megapar_run(name: str, steps: int) -> dict:
    import megapar

    tp, pp, dp, schedule, m, size = CONFIGS[name]
    engine = megapar.prepare(hf_model(size), tp=tp, pp=pp, micro_batch_size=BATCH // (m * dp),
                             schedule=schedule, lr=LR, weight_decay=0.0, clip_grad=0.0,
                             global_batch_size=BATCH, seq_len=SIZES[size]["seq"])
    return _timed(engine.train_step, size, steps)


def _timed(step, size: str, steps: int) -> dict:
    data = batches(size, steps + 1)
    losses = [step(data[0])]  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for batch in data[1:]:
        losses.append(step(batch))
    dist.barrier()
    return {"s_per_step": (time.perf_counter() - start) / steps, "losses": losses}


def _worker(system: str, name: str, steps: int) -> dict:
    if not dist.is_initialized():  # one rank: run_local starts no process group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)  # one core per rank, as one GPU per rank
    return (megapar_run if system == "megapar" else torch_run)(name, steps)


def ab_runs(worker, name: str, world: int, systems, repeats: int, steps: int) -> dict:
    """{system: [rank 0's result of each round]}: `worker(system, name, steps)` on `world` forked
    ranks, the systems taking turns round by round, each first every other round."""
    return interleave({s: (lambda s=s: run_local(worker, world, s, name, steps,
                                                 timeout_s=1200)[0]) for s in systems}, repeats,
                      alternate=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_arguments(parser, CONFIGS)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 2
    results = {name: ab_runs(_worker, name, math.prod(CONFIGS[name][:3]), ("megapar", "torch"),
                             args.repeats, args.steps)
               for name in args.configs}
    print("s: median seconds a step; ratio: megapar s / torch s (below 1: megapar faster); mp x "
          "ser / tc x ser: each side's speed-up over the one-process run of the same size; "
          "pair by pair: megapar / torch per repeat, median [min, max]")
    print(f"{'config':>15} {'megapar s':>10} {'torch s':>9} {'ratio':>6} {'mp x ser':>8} "
          f"{'tc x ser':>8} {'max loss diff':>13}  {'pair by pair':>18}  losses (megapar)")
    for name, runs in results.items():
        med = {k: statistics.median(r["s_per_step"] for r in v) for k, v in runs.items()}
        size = CONFIGS[name][5]
        serial = "serial" if size == "small" else "large-serial"
        speed = {k: (statistics.median(r["s_per_step"] for r in results[serial][k]) / med[k]
                     if serial in results else math.nan) for k in med}
        a, b = runs["megapar"][0]["losses"], runs["torch"][0]["losses"]
        diff = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        pairs = ratio_summary(pair_ratios(*([r["s_per_step"] for r in runs[k]]
                                            for k in ("megapar", "torch"))))
        print(f"{name:>15} {med['megapar']:>10.3f} {med['torch']:>9.3f} "
              f"{med['megapar'] / med['torch']:>6.2f} {speed['megapar']:>8.2f} "
              f"{speed['torch']:>8.2f} {diff:>13.1e}  {pairs:>18}  "
              f"{', '.join(f'{x:.5f}' for x in a)}")
    missing = {"serial" if CONFIGS[n][5] == "small" else "large-serial" for n in results}
    missing -= set(results)
    if missing:  # the speed-up columns divide by the serial run of the same size
        print(f"mp x ser / tc x ser: nan without {' and '.join(sorted(missing))} in --configs")


if __name__ == "__main__":
    main()
