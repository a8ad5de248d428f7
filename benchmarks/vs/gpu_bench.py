"""megapar-train's step against plain PyTorch on one GPU: tokens/s, MFU and peak memory, as ratios.

For GPT-2 124M (seq 1024) and a Llama of 1.2B (megapar's `llama-1b` recipe, Llama 3.2 1B's
shape; seq 2048), in bf16 autocast with fp32 weights, the same model is trained in one process,
in turns, by:

- megapar: the engine `megapar-train` runs (`megapar.prepare(config, precision="bf16")`, one
  optimizer step per `train_step`, micro-batch = the whole batch, clipping at 1.0);
- torch eager: transformers' model (SDPA attention), `torch.autocast(bfloat16)`, fused AdamW,
  `clip_grad_norm_(1.0)`, the loss read every step (as `train_step` returns it);
- torch compile: the same model wrapped in `torch.compile`;
- megapar compile: megapar with `compile=True` (`--compile`: each block torch.compile'd).

Dropout is off in both (the same model). Each system takes `--warmup` steps, then `--steps`
timed steps between two device synchronisations. Peak memory is what the OS side sees: the
device memory torch's allocator reserved at its peak, from building the model to the last step
(not only what was allocated to tensors), with the CUDA context, printed once, on top; for
megapar's runs that sum is set against `megapar-plan --target gpu`'s figure for the same layout
(its process peak: tensors, the allocator's reserve, the context), as a ratio. MFU counts
6 N + 12 L h s FLOPs per token (PaLM's appendix B, nanoGPT's `estimate_mfu`, megapar-train's
log; N the parameters without position embeddings) against the GPU's dense bf16 peak
(`megapar.device.PEAK_TFLOPS`); a measured 8192^3 bf16 matrix product gives the rate this GPU
reaches. Printed: a table, the ratios megapar / eager and compile / eager, and published MFU
figures beside them. `--json FILE` writes every figure.

    python benchmarks/vs/gpu_bench.py                          # both models, eager and compiled
    python benchmarks/vs/gpu_bench.py --models gpt2-124m --no-compile
    python benchmarks/vs/gpu_bench.py --device cpu --tiny      # a rehearsal of the script itself
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

import megapar
from megapar.device import PEAK_TFLOPS, cuda_context_bytes, peak_tflops
from megapar.models.config import config_from_hf
from megapar.plan import Candidate, Problem, estimate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import output_file, write_json, positive  # noqa: E402

MODELS = {  # recipe: (transformers config kwargs, micro-batch size, sequence length)
    "gpt2-124m": (dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768,
                       n_layer=12, n_head=12, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0), 16, 1024),
    "llama-1b": (dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                      intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0), 4, 2048),
}
TINY = {  # --tiny: the same two families at a size a CPU runs in seconds
    "gpt2-124m": dict(n_positions=64, n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                      bos_token_id=0, eos_token_id=0),
    "llama-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=64, vocab_size=512),
}
PUBLISHED = [
    ("nanoGPT, GPT-2 124M, 8 x A100 40GB", "about 29 %", "derived from its README: 4 days for "
     "600,000 iterations of 491,520 tokens (config/train_gpt2.py), 855 MFLOP per token, "
     "312 TFLOP/s peak"),
    ("torchtitan, Llama 3.1 8B, FSDP on 8 / 128 H100", "33-39 %", "docs/performance.md: "
     "with or without torch.compile, bf16, selective activation checkpointing"),
]
LR, CLIP = 3e-4, 1.0


def hf_config(name: str, tiny: bool):
    from transformers import AutoConfig

    kwargs, mbs, seq = MODELS[name]
    kwargs = dict(kwargs)
    if tiny:
        kwargs.update(TINY[name])
        mbs, seq = 2, 64
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs), mbs, seq


def model_flops_per_token(config, n_params: int, seq: int) -> float:
    """6 N + 12 L h s, N without the position embeddings (they are a lookup, not a product)."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    positions = config.n_positions * config.n_embd if config.model_type == "gpt2" else 0
    return 6.0 * (n_params - positions) + 12.0 * layers * hidden * seq


def data(config, mbs: int, seq: int, device, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (mbs, seq + 1), generator=gen).to(device)
            for _ in range(steps)]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device) -> int:
    """Free what the last system left and return what the allocator still reserves."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_reserved(device)


def timed(step, batches, warmup: int, device) -> tuple[float, float, list[float]]:
    """(seconds per step, the allocator's peak reserved bytes, losses): reserved, not only
    allocated, is what the device holds for the process (the OS-side peak, with the CUDA
    context on top)."""
    losses = [step(b) for b in batches[:warmup]]
    sync(device)
    start = time.perf_counter()
    losses += [step(b) for b in batches[warmup:]]
    sync(device)
    seconds = (time.perf_counter() - start) / (len(batches) - warmup)
    peak = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    return seconds, peak, losses


def run_megapar(config, mbs, seq, batches, warmup, device, compile_: bool = False):
    base = reset_memory(device)
    os.environ["MEGAPAR_CPU"] = "0" if device.type == "cuda" else "1"
    engine = megapar.prepare(config, micro_batch_size=mbs, precision="bf16", seq_len=seq, lr=LR,
                             weight_decay=0.1, clip_grad=CLIP, adam_beta2=0.95,
                             compile=compile_)
    n_params = sum(p.numel() for p in engine.model.parameters())

    def step(ids):
        return engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})

    seconds, peak, losses = timed(step, batches, warmup, device)
    return seconds, peak - base, losses, n_params  # the engine goes with this frame


def run_torch(config, mbs, seq, batches, warmup, device, compile_: bool):
    from transformers import AutoModelForCausalLM

    base = reset_memory(device)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95),
                            fused=True if device.type == "cuda" else None)
    forward = torch.compile(model) if compile_ else model

    def step(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    seconds, peak, losses = timed(step, batches, warmup, device)
    return seconds, peak - base, losses


def planner_bytes(config, mbs: int, seq: int) -> float:
    """`megapar-plan --target gpu`'s figure for a megapar run here: the process peak of one GPU
    (the tensors' peak, the allocator's reserve, the CUDA context) at micro-batch mbs x seq,
    one micro-batch a step, bf16 autocast with fp32 weights, the chunked loss and fused
    attention, as `megapar.prepare` runs them by default (the planner does not model
    compilation)."""
    p = Problem(config_from_hf(config), gpus=1, global_batch=mbs, seq_len=seq,
                precision="bf16", target="gpu")
    process = estimate(p, Candidate(mbs=mbs)).process
    assert process is not None  # estimate always fills it
    return process.total


def memory_table(results: dict) -> list[str]:
    """megapar's device memory against the planner, a line per run (the held figure is 0 on
    the CPU: not measured)."""
    lines = [f"  {'model':10} {'system':16} {'held GiB':>9} {'planner GiB':>12} {'ratio':>7}"]
    for model, entry in results["models"].items():
        for system, run in entry["systems"].items():
            if "planner_gib" in run:
                held = run["held_gib"]
                ratio = f"{held / run['planner_gib']:7.3f}" if held else f"{'-':>7}"
                lines.append(f"  {model:10} {system:16} {held:9.2f} {run['planner_gib']:12.2f} "
                             f"{ratio}")
    return lines


def matmul_tflops(device) -> float | None:
    """The bf16 rate this GPU reaches on an 8192^3 product (the median of 10 after 3)."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * 8192**3 / times[len(times) // 2] / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=positive, default=10, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", nargs="*", default=None, metavar="MODEL",
                        help="models to also run compiled (default: all of --models)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a rehearsal)")
    parser.add_argument("--json", type=output_file, help="write every figure to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device visible (--device cpu --tiny "
                     f"rehearses this script on the CPU)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    compiled = [] if args.no_compile else (args.models if args.compile is None else args.compile)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(device, "bf16")
    reached = matmul_tflops(device)
    context = cuda_context_bytes(device) if device.type == "cuda" else 0
    print(f"gpu_bench on {name}: torch {torch.__version__}, bf16 peak "
          f"{peak or 'unknown'} TFLOP/s (datasheet), {reached or 0:.0f} TFLOP/s measured on "
          f"an 8192^3 product; CUDA context and libraries {context / 2**30:.2f} GiB (add it "
          f"to each peak for the process's device memory)")
    results = {"device": name, "torch": torch.__version__, "peak_tflops": peak,
               "matmul_tflops": reached, "context_bytes": context, "models": {}}
    # megapar and eager torch for every model first, the compiled runs (minutes of
    # compilation) last: a session cut short still has the comparison
    runs = [(m, s) for m in args.models for s in ("megapar", "torch eager")] + \
        [(m, s) for m in args.models if m in compiled for s in ("torch compile",
                                                                "megapar compile")]
    print(f"  {'model':10} {'system':14} {'ms/step':>9} {'tokens/s':>10} {'MFU':>7} "
          f"{'held GiB':>9} {'vs eager':>9}  first / last loss")
    for model, system in runs:
        config, mbs, seq = hf_config(model, args.tiny)
        batches = data(config, mbs, seq, device, args.warmup + args.steps)
        entry = results["models"].setdefault(model, {"micro_batch": mbs, "seq": seq,
                                                     "systems": {}})
        if system in ("megapar", "megapar compile"):
            sec, mem, losses, n_params = run_megapar(config, mbs, seq, batches, args.warmup,
                                                     device, system == "megapar compile")
            entry.update(parameters=n_params,
                         flops_per_token=model_flops_per_token(config, n_params, seq))
        else:
            sec, mem, losses = run_torch(config, mbs, seq, batches, args.warmup, device,
                                         system == "torch compile")
        rate = mbs * seq / sec
        mfu = rate * entry["flops_per_token"] / (peak * 1e12) if peak else None
        entry["systems"][system] = {"s_per_step": sec, "tokens_per_s": rate, "mfu": mfu,
                                    "peak_gib": mem / 2**30, "losses": losses}
        if system.startswith("megapar"):  # the device's figure against the planner's
            held = (mem + context) / 2**30 if device.type == "cuda" else 0.0
            entry["systems"][system].update(
                held_gib=held, planner_gib=planner_bytes(config, mbs, seq) / 2**30,
                micro_batch=mbs, seq=seq)
        eager = entry["systems"].get("torch eager", {}).get("s_per_step")
        shown = f"{100 * mfu:6.1f}%" if mfu is not None else "      -"
        ratio = f"{eager / sec:9.3f}" if eager else f"{'-':>9}"
        print(f"  {model:10} {system:14} {1e3 * sec:9.1f} {rate:10,.0f} {shown} "
              f"{mem / 2**30:9.2f} {ratio}  {losses[0]:.4f} / {losses[-1]:.4f}", flush=True)
        if system == "torch eager":  # megapar ran first: its ratio, now that eager's is known
            mine = entry["systems"]["megapar"]["s_per_step"]
            print(f"  {model:10} megapar / torch eager: {sec / mine:.3f} of eager's tokens/s "
                  f"({entry['parameters'] / 1e6:,.0f} M parameters, micro-batch {mbs} x {seq}, "
                  f"{entry['flops_per_token'] / 1e6:,.0f} MFLOP per token)", flush=True)
        if args.json:
            write_json(args.json, results)
    print("\nmemory against the planner (held: the allocator's reserved peak plus the CUDA "
          "context; planner: megapar-plan --target gpu for the layout; compiled runs beside "
          "the eager figure it predicts):")
    print("\n".join(memory_table(results)))
    print("\npublished MFU, for scale (other GPUs, models and batch sizes):")
    for who, mfu, source in PUBLISHED:
        print(f"  {who}: {mfu} ({source})")
    if peak:
        print(f"  datasheet peaks used here: {PEAK_TFLOPS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
