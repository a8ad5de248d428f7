"""Print a megapar checkpoint's manifest summary and per-tensor table.

Usage::

    python tools/inspect_checkpoint.py CKPT [--no-tensors]

CKPT is a checkpoint root (its ``latest`` is followed) or a step directory. A thin wrapper over
``megapar-convert --info CKPT --tensors`` (file sizes are checked, checksums are not).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint root or step directory")
    p.add_argument("--no-tensors", action="store_true", help="summary only, no tensor table")
    args = p.parse_args(argv)
    from megapar.cli.convert import main as convert  # its errors, a reader gone (| head)

    return convert(["--info", args.checkpoint, "--fast", *([] if args.no_tensors else ["--tensors"])])

if __name__ == "__main__":
    sys.exit(main())
