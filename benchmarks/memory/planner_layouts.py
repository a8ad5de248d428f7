"""The planner's CPU figure against the OS, layout by layout (issue 47).

Each layout trains a step in spawned ranks built with `megapar.prepare` (no sampler thread, so
nothing but the job adds to the peak); each rank reports how far its peak resident set rose
over building its engine and the step (VmHWM after `/proc/self/clear_refs`, as
benchmarks/memory/process_terms.py and tests/test_process_peak.py measure it: `megapar` imported
before the baseline is read, its training modules by `prepare` after it; tests/test_peak_memory.py
imports them before, and its rises are 50-80 MiB lower). Beside it the planner's
CPU figure (`megapar.plan.process`, target cpu, fp32) for the same layout: the most risen rank
against the largest figure over the pipeline stages, and per pipeline stage where pp > 1.

    python benchmarks/memory/planner_layouts.py                 # every layout, ~15 min on 2 cores
    python benchmarks/memory/planner_layouts.py recompute-full tp2-sp   # some of them
    python benchmarks/memory/planner_layouts.py --repeats 2     # each run twice, the lower counts

Layouts whose activations dominate (recompute, tp, SP, cp, pipeline) use 8 blocks of hidden 256
at 1,024 tokens and a 1,024-token vocabulary; those whose state dominates (ZeRO, offload) the
8 blocks of hidden 512 of tests/test_peak_memory.py at 32 tokens; mixtures of experts
mixtral-tiny (4 experts in each of 4 MoE layers) at 64 tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megapar.launcher import run_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import output_file, write_json, positive  # noqa: E402

WIDE = dict(n_embd=256, n_layer=8, n_head=8, n_positions=1024, vocab_size=1024)
"""Activations dominate: 8 blocks of hidden 256, 1,024 positions."""
STATE = dict(n_embd=512, n_layer=8, n_head=8, n_positions=64, vocab_size=1024)
"""State dominates: tests/test_peak_memory.py's workers' model (25M parameters), with its 4 MB
gradient buckets (`B4`): gloo's collectives hold copies of a bucket in flight, which the
planner does not count (NCCL makes none)."""
B4 = dict(grad_bucket_mb=4)

GPT2_WIDE = dict(n_embd=768, n_layer=6, n_head=12, n_positions=64, vocab_size=50257)
"""tests/test_process_peak.py's model: GPT-2's width and vocabulary, 6 blocks."""

LAYOUTS = {  # name: (model, world, options, global batch, seq, environment)
    "gpt2-wide-one-process": (GPT2_WIDE, 1, dict(micro_batch_size=1), 1, 64, {}),
    "one-process": (WIDE, 1, dict(micro_batch_size=4), 4, 1024, {}),
    "recompute-selective": (WIDE, 1, dict(micro_batch_size=4, recompute="selective"), 4, 1024,
                            {}),
    "recompute-full": (WIDE, 1, dict(micro_batch_size=4, recompute="full"), 4, 1024, {}),
    "tp2": (WIDE, 2, dict(micro_batch_size=4, tp=2), 4, 1024, {}),
    "tp2-sp": (WIDE, 2, dict(micro_batch_size=4, tp=2, sequence_parallel=True), 4, 1024, {}),
    "cp2": (WIDE, 2, dict(micro_batch_size=4, cp=2), 4, 1024, {}),
    "pp2-1f1b": (WIDE, 2, dict(micro_batch_size=1, pp=2, schedule="1f1b"), 8, 1024, {}),
    "pp2-gpipe": (WIDE, 2, dict(micro_batch_size=1, pp=2, schedule="gpipe"), 8, 1024, {}),
    "zero0": (STATE, 2, dict(micro_batch_size=1, **B4), 2, 32, {}),
    "zero1": (STATE, 2, dict(micro_batch_size=1, zero=1, **B4), 2, 32, {}),
    "zero2": (STATE, 2, dict(micro_batch_size=1, zero=2, **B4), 2, 32, {}),
    "zero3": (STATE, 2, dict(micro_batch_size=1, zero=3, **B4), 2, 32, {}),
    "offload-optimizer": (STATE, 2, dict(micro_batch_size=1, zero=1, offload_optimizer=True, **B4),
                          2, 32, {}),
    "offload-optimizer-copies": (STATE, 2, dict(micro_batch_size=1, zero=1, **B4,
                                                offload_optimizer=True), 2, 32,
                                 {"MEGAPAR_HOST_COPIES": "1"}),
    "offload-params": (STATE, 2, dict(micro_batch_size=1, zero=3, offload_optimizer=True,
                                      offload_params=True, **B4), 2, 32, {}),
    "offload-params-copies": (STATE, 2, dict(micro_batch_size=1, zero=3, offload_optimizer=True,
                                             offload_params=True, **B4), 2, 32,
                              {"MEGAPAR_HOST_COPIES": "1"}),
    "gpt2-124m-zero2": ("gpt2-124m", 2, dict(micro_batch_size=1, zero=2), 2, 64, {}),
    "gpt2-124m-zero3": ("gpt2-124m", 2, dict(micro_batch_size=1, zero=3, **B4), 2, 64, {}),
    "mixtral-zero3-ep2": ("mixtral-tiny", 2, dict(micro_batch_size=1, zero=3, ep=2), 2, 64, {}),
    "mixtral-zero3-dp4-ep2": ("mixtral-tiny", 4, dict(micro_batch_size=1, zero=3, ep=2), 4, 64,
                              {}),
}


def _model(model):
    if isinstance(model, str):
        return model
    from transformers import GPT2Config

    # GPT-2's special ids (50256) lie outside a 1,024-token vocabulary: None, or transformers
    # warns twice per layout that they "must be None or an integer within the vocabulary"
    inside = {} if model["vocab_size"] > 50256 else {"bos_token_id": None, "eos_token_id": None}
    return GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **inside, **model)


def _rise(model, options: dict, batch: int, seq: int, env: dict, steps: int = 1,
          imports_first: bool = True) -> int:
    """How far this rank's peak resident set rose over building its engine and `steps` steps;
    `imports_first`: megapar's training modules and transformers' config imported before the
    baseline is read (the planner's baseline: `megapar.plan.process.CPU_BASELINE`)."""
    os.environ.update(env)
    import torch

    import megapar

    if imports_first:
        import megapar.training.prepare  # noqa: F401
        import torch._dynamo  # noqa: F401  building torch's optimizers imports it (70 MiB)
        from transformers import GPT2Config  # noqa: F401

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    start = status("VmRSS")
    engine = megapar.prepare(_model(model), seq_len=seq, **options)
    ids = torch.randint(0, 1000, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return status("VmHWM") - start


def predicted(model, world: int, options: dict, batch: int, seq: int, env: dict) -> list[float]:
    """The planner's CPU figure of each pipeline stage's rank for the layout (in `env`: offload
    makes host copies on the CPU only with MEGAPAR_HOST_COPIES=1)."""
    os.environ.pop("MEGAPAR_HOST_COPIES", None)
    os.environ.update(env)
    from megapar.models.config import config_from_dict
    from megapar.models.recipes import resolve_model
    from megapar.plan import Candidate, Problem, stage_memory
    from megapar.plan.estimate import activation_sizes, stage_roles
    from megapar.plan.problem import runs_fused_attention
    from megapar.plan.process import process_peak

    config = (
        resolve_model(model) if isinstance(model, str)
        else config_from_dict(_model(model).to_dict())
    )
    o = options
    tp, pp, cp = o.get("tp", 1), o.get("pp", 1), o.get("cp", 1)
    c = Candidate(tp, pp, world // (tp * pp * cp), o["micro_batch_size"], o.get("schedule", "1f1b"),
                  1, o.get("recompute", "none"), o.get("sequence_parallel", False),
                  o.get("zero", 0), cp, offload_optimizer=o.get("offload_optimizer", False),
                  offload_params=o.get("offload_params", False), ep=o.get("ep", 1))
    p = Problem(config, world, global_batch=batch, seq_len=seq, precision="fp32", target="cpu",
                grad_bucket_mb=o.get("grad_bucket_mb", 25.0),
                fused_attention=runs_fused_attention(config, "cpu"))
    block = activation_sizes(p, c).full
    return [process_peak(p, c, s, *stage_roles(p, c, s.stage), block).total
            for s in stage_memory(p, c)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layouts", nargs="*", help=f"some of: {', '.join(LAYOUTS)}")
    parser.add_argument("--repeats", type=positive, default=1)
    parser.add_argument("--json", type=output_file, help="write every figure to this file")
    parser.add_argument("--imports-in-rise", action="store_true",
                        help="import megapar's training modules and transformers after the "
                             "baseline is read (the rise then holds their ~110 MiB)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layouts {', '.join(unknown)}; choose among {', '.join(LAYOUTS)}")
    rows = {}
    mib = 2**20
    print(f"{'layout':26} {'predicted':>10} {'OS rise':>10} {'ratio':>7}   per stage (MiB)")
    for name in args.layouts or list(LAYOUTS):
        model, world, options, batch, seq, env = LAYOUTS[name]
        runs = [run_local(_rise, world, model, options, batch, seq, env, 1,
                          not args.imports_in_rise, start_method="spawn", timeout_s=1800)
                for _ in range(args.repeats)]
        rises = [min(r[i] for r in runs) for i in range(world)]
        figures = predicted(model, world, options, batch, seq, env)
        pp = options.get("pp", 1)
        # ranks of pipeline stage s: megapar's rank order tp-pp-dp (tp fastest)
        tp = options.get("tp", 1)
        stage_rise = [max(r for i, r in enumerate(rises) if i // tp % pp == s) for s in range(pp)]
        ratio = max(figures) / max(rises)
        stages = ", ".join(f"{f / mib:.0f}/{r / mib:.0f}" for f, r in zip(figures, stage_rise))
        print(f"{name:26} {max(figures) / mib:10.1f} {max(rises) / mib:10.1f} {ratio:7.3f}   "
              f"{stages if pp > 1 else ''}", flush=True)
        rows[name] = {"predicted": figures, "rises": rises, "ratio": ratio}
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
