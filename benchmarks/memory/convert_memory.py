"""Peak memory of offline checkpoint conversion vs the largest layer and the whole checkpoint.

Builds a GPT-2 with many layers (default 24 layers, hidden 256, vocab 8192) at 1x1 with two
synthetic optimizer moments per parameter, saves it, then runs each conversion in a *fresh*
Python process that measures, above its own baseline after imports:

- peak anonymous memory (RssAnon in /proc/self/status, sampled every millisecond): the heap,
  i.e. the tensors the converter holds;
- peak resident set (VmHWM, exact, reset through /proc/self/clear_refs at the baseline): also
  counts pages of the memory-mapped source shards while they are mapped.

Usage::

    python benchmarks/memory/convert_memory.py [--layers 24] [--hidden 256] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import positive  # noqa: E402

MB = 1 << 20


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM|RssAnon|RssFile):\s+(\d+) kB",
                                                    text, re.M)}


def measure(src: str, dst: str, tp: int, pp: int) -> dict:
    """Run one conversion in this process and return its peak memory above baseline."""
    from megapar.checkpoint.convert import convert_checkpoint, plan
    from megapar.mesh import Layout
    from megapar.models import GPT2Config

    # Warm-up: the first model built on the meta device makes torch import sympy and its meta
    # kernels (a fixed ~70 MB whatever the model); measured and reported separately.
    cold = _status()
    plan(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2), Layout())
    base, done = _status(), threading.Event()
    peak = dict(base)
    Path("/proc/self/clear_refs").write_text("5")    # VmHWM := VmRSS

    def sample():
        while not done.is_set():
            for k, v in _status().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    convert_checkpoint(src, dst, tp, pp, progress=False)
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return {"seconds": seconds, "fixed": base["RssAnon"] - cold["RssAnon"],
            "anon_peak": peak["RssAnon"] - base["RssAnon"],
            "rss_peak": _status()["VmHWM"] - base["VmRSS"]}


def build_source(root: Path, layers: int, hidden: int, vocab: int) -> dict:
    """Save the 1x1 source checkpoint; returns its size figures."""
    import torch

    from megapar.checkpoint.distributed import save_checkpoint
    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config
    from megapar.pipeline.partition import build_stage

    config = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=hidden, n_layer=layers,
                        n_head=8)
    mesh = Mesh(Layout())
    model = build_stage(config, mesh, seed=0)
    optim = {n: {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
             for n, p in model.named_parameters()}
    save_checkpoint(root, 100, model, mesh, optim, {}, {})
    groups: dict[str, int] = {}
    largest_tensor = 0
    for name, p in model.named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
        size = 3 * p.numel() * p.element_size()     # weights + two moments
        groups[group] = groups.get(group, 0) + size
        largest_tensor = max(largest_tensor, p.numel() * p.element_size())
    block = max(v for k, v in groups.items() if k.startswith("layers."))
    return {"params": sum(p.numel() for p in model.parameters()),
            "total": sum(groups.values()), "largest_layer": max(groups.values()),
            "largest_layer_name": max(groups, key=groups.get), "block": block,
            "largest_tensor": largest_tensor}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive, default=24)
    p.add_argument("--hidden", type=positive, default=256)
    p.add_argument("--vocab", type=positive, default=8192)
    p.add_argument("--measure", nargs=4, metavar=("SRC", "DST", "TP", "PP"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.measure and (args.layers < 4 or args.hidden < 8 or args.hidden % 8
                             or args.vocab < 1):
        p.error(f"--layers {args.layers} / --hidden {args.hidden} / --vocab {args.vocab}: the "
                f"conversions go to pp 4 and the model has 8 heads, so --layers must be >= 4, "
                f"--hidden a multiple of 8, --vocab >= 1")
    if args.measure:
        src, dst, tp, pp = args.measure
        print(json.dumps(measure(src, dst, int(tp), int(pp))))
        return
    with tempfile.TemporaryDirectory(prefix="convert_memory-") as tmp:
        sizes = build_source(Path(tmp) / "src", args.layers, args.hidden, args.vocab)
        print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
              f"{sizes['params']:,} parameters; sizes include 2 fp32 optimizer moments")
        print(f"  whole checkpoint          {sizes['total'] / MB:8.1f} MB")
        print(f"  largest layer ({sizes['largest_layer_name']})  "
              f"{sizes['largest_layer'] / MB:8.1f} MB   (one block: {sizes['block'] / MB:.1f} MB)")
        print(f"  largest single tensor     {sizes['largest_tensor'] / MB:8.1f} MB")
        previous = Path(tmp) / "src"
        for i, (tp, pp) in enumerate([(2, 2), (4, 1), (1, 4)]):
            dst = Path(tmp) / f"c{i}"
            out = subprocess.run([sys.executable, __file__, "--measure", str(previous), str(dst),
                                  str(tp), str(pp)], capture_output=True, text=True)
            if out.returncode != 0:  # its own words, not CalledProcessError's
                said = (out.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
                sys.exit(f"convert_memory.py: error: the conversion to tp={tp} pp={pp} failed "
                         f"(exit {out.returncode}): {said}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"convert -> tp={tp} pp={pp}: {r['seconds']:5.1f} s, peak heap "
                  f"+{r['anon_peak'] / MB:6.1f} MB, peak RSS +{r['rss_peak'] / MB:6.1f} MB "
                  f"({r['anon_peak'] / sizes['total']:.1%} / {r['rss_peak'] / sizes['total']:.1%}"
                  f" of the checkpoint); torch's one-time meta init +{r['fixed'] / MB:.0f} MB")
            previous = dst


if __name__ == "__main__":
    main()
