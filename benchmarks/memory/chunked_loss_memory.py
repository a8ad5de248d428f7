"""The chunked LM head + loss at the peak the OS sees: a large vocabulary at two sequence lengths.

A Llama body (hidden 64, 2 layers) with Llama 3's 128,256-token vocabulary, micro-batch 2,
trained for 2 steps (`--steps`) by `megapar-train` in a fresh process per configuration;
the figure is the process's peak resident set (`ru_maxrss` from `wait4`). At sequence 512 and 1024, with the chunked loss (`--loss-chunk-tokens`, default 1024) and with
the whole logits (`--loss-chunk-tokens 0`). The claim (issue 46): with the chunked loss the
peak grows from 512 to 1024 by at most half of one fp32 logits tensor of the extra 1,024
tokens (1,024 x 128,256 x 4 bytes / 2 = 250.5 MiB); with the whole logits it grows by several
such tensors (the logits, their softmax and their gradient).

    python benchmarks/memory/chunked_loss_memory.py               # both, about a minute on 2 cores
    python benchmarks/memory/chunked_loss_memory.py --only chunked --json   # one JSON line at the end
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import run_peak, scratch_dir, positive  # noqa: E402

VOCAB = 128256
MODEL = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024,
         "rope_theta": 500000.0, "bos_token_id": None, "eos_token_id": None}
"""Llama 3's vocabulary on a tiny body: the head and its logits are most of the memory."""
MICRO_BATCH = 2
SEQS = (512, 1024)
MODES = {"chunked": [], "whole": ["--loss-chunk-tokens", "0"]}
MIB = 2**20
BOUND = (SEQS[1] - SEQS[0]) * MICRO_BATCH * VOCAB * 4 / 2
"""Half of one fp32 logits tensor of the extra tokens (bytes)."""


def os_peak(argv: list[str], env: dict) -> int:
    """The peak resident bytes of one fresh megapar-train run."""
    return run_peak([sys.executable, "-m", "megapar.cli.train", *argv], env=env,
                    capture="stderr").peak_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(MODES), help="measure one mode")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--steps", type=positive, default=2,
                        help="optimizer steps per run (the peak is reached in the first)")
    args = parser.parse_args(argv)
    work = scratch_dir("megapar-chunked-loss-")
    model = os.path.join(work, "model.json")
    with open(model, "w") as f:
        json.dump(MODEL, f)
    env = {**os.environ, "MEGAPAR_CPU": "1"}
    results = {}
    for mode in [args.only] if args.only else list(MODES):
        peaks = {}
        for seq in SEQS:
            peaks[seq] = os_peak(
                ["--model", model, "--seq-len", str(seq), "--micro-batch-size", str(MICRO_BATCH),
                 "--global-batch-size", str(MICRO_BATCH), "--max-steps", str(args.steps),
                 "--warmup-steps", "0", "--eval-interval", "0", "--no-progress",
                 "--data-cache", os.path.join(work, "cache"), *MODES[mode]], env)
        growth = peaks[SEQS[1]] - peaks[SEQS[0]]
        results[mode] = {"peak_mib": {str(s): round(p / MIB, 1) for s, p in peaks.items()},
                         "growth_mib": round(growth / MIB, 1), "bound_mib": round(BOUND / MIB, 1)}
        print(f"{mode:8} peak seq {SEQS[0]}: {peaks[SEQS[0]] / MIB:8.1f} MiB, seq {SEQS[1]}: "
              f"{peaks[SEQS[1]] / MIB:8.1f} MiB, growth {growth / MIB:+8.1f} MiB "
              f"({growth / (2 * BOUND):.2f} fp32 logits tensors of the extra tokens; "
              f"bound {BOUND / MIB:.1f} MiB)", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
