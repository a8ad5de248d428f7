"""megapar-train's step with --fp8 against bf16 on one GPU: tokens/s and the losses, as ratios.

The Llama of 1.2B (megapar's `llama-1b` recipe, seq 2048, micro-batch 4: gpu_bench.py's
sizes) is trained by `megapar.prepare(config, precision="bf16")` with and without `fp8=`
(tensorwise, rowwise), in turns (`--rounds` rounds, each variant once per round), each for
`--warmup` + `--steps` steps from the same weights and batches. Printed per variant: tokens/s
(the median round), its ratio to bf16 taken round by round, and the last step's loss beside
bf16's. By default the step runs eagerly, so the float8 casts are separate kernels; torchao's
published speed-ups (+25 % tensorwise on Llama 3 8B) are with torch.compile fusing them:
`--compile` compiles every variant's blocks (megapar-train's --compile; bf16 compiled is then
the yardstick), each run's compilation inside its warm-up steps.

    python benchmarks/vs/fp8_bench.py                        # on a GPU with FP8 (sm 8.9+)
    python benchmarks/vs/fp8_bench.py --compile              # compiled bf16 against compiled fp8
    python benchmarks/vs/fp8_bench.py --device cpu --tiny    # a rehearsal (float8 emulated)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

import megapar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_bench.py
from common import interleave, output_file, positive, write_json  # noqa: E402
from gpu_bench import LR, data, hf_config, reset_memory, timed  # noqa: E402

VARIANTS = ("bf16", "tensorwise", "rowwise")


def run(variant: str, config, mbs: int, seq: int, batches, warmup: int, device, tiny,
        compile_blocks: bool = False) -> dict:
    """One run of `variant`; --tiny converts every linear (the size rule would keep them all);
    `compile_blocks`: megapar-train's --compile."""
    base = reset_memory(device)
    os.environ["MEGAPAR_CPU"] = "0" if device.type == "cuda" else "1"
    fp8 = {} if variant == "bf16" else {"fp8": variant, "fp8_emulate": device.type != "cuda",
                                        "fp8_layers": "all" if tiny else "auto"}
    engine = megapar.prepare(config, micro_batch_size=mbs, precision="bf16", seq_len=seq, lr=LR,
                             weight_decay=0.1, clip_grad=1.0, adam_beta2=0.95, seed=1,
                             compile=compile_blocks, **fp8)

    def step(ids):
        return engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})

    seconds, peak, losses = timed(step, batches, warmup, device)
    return {"tokens_per_s": mbs * seq / seconds, "peak_reserved": peak - base,
            "losses": losses, "layers": engine.fp8_summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=positive, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=positive, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model (a rehearsal)")
    parser.add_argument("--compile", action="store_true",
                        help="compile every variant's blocks (compiled inside the warm-up)")
    parser.add_argument("--json", type=output_file, help="write every figure to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device visible (--device cpu --tiny "
                     f"rehearses this script on the CPU)")
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    config, mbs, seq = hf_config("llama-1b", args.tiny)
    batches = data(config, mbs, seq, device, args.warmup + args.steps)
    results = interleave(
        {v: (lambda v=v: run(v, config, mbs, seq, batches, args.warmup, device, args.tiny,
                             args.compile))
         for v in ["bf16", *[v for v in args.variants if v != "bf16"]]},
        args.rounds, alternate=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (emulated)"
    print(f"fp8_bench on {name}: llama-1b{' (tiny)' if args.tiny else ''}, micro-batch {mbs} x "
          f"{seq}, bf16 autocast{', compiled blocks' if args.compile else ''}, "
          f"{args.steps} timed steps after {args.warmup}, "
          f"{args.rounds} rounds in turns")
    bf16 = results["bf16"]
    record = {"device": name, "torch": torch.__version__, "compile": args.compile, "variants": {}}
    for variant, runs in results.items():
        speed = statistics.median(r["tokens_per_s"] for r in runs)
        ratio = statistics.median(r["tokens_per_s"] / b["tokens_per_s"]
                                  for r, b in zip(runs, bf16))
        loss, loss_bf16 = runs[-1]["losses"][-1], bf16[-1]["losses"][-1]
        print(f"{variant:>10}: {speed:,.0f} tokens/s ({ratio:.3f} x bf16), last loss "
              f"{loss:.4f} (bf16 {loss_bf16:.4f}), peak reserved "
              f"{runs[-1]['peak_reserved'] / 2**30:.2f} GiB")
        if runs[-1]["layers"]:
            print(f"{'':>12}{runs[-1]['layers']}")
        record["variants"][variant] = {"tokens_per_s": speed, "ratio_to_bf16": ratio,
                                       "losses": runs[-1]["losses"],
                                       "layers": runs[-1]["layers"]}
    if args.json:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
