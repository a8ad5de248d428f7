"""Files shipped inside the package (``megapar/assets``): the GPT-2 BPE, a small SentencePiece
model, the Shakespeare sample the default job trains on."""

from __future__ import annotations

from pathlib import Path


def asset_path(name: str) -> str:
    """Absolute path of a file shipped in ``megapar/assets`` (e.g. ``"gpt2_vocab.json"``)."""
    path = Path(__file__).resolve().parent.parent / "assets" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"megapar asset {name!r} not found at {path}; the package install is incomplete "
            "-- reinstall megapar (pip install -e .) so that megapar/assets/* is included"
        )
    return str(path)
